//! Softmax over the last dimension, and the attention scores' `softmax(scale·s + mask)` as one
//! pass per row (the masked softmax of Megatron-LM's `FusedScaleMaskSoftmax`).
//!
//! Backward: `ds = scale · p ⊙ (g − Σ_j g_j p_j)`. Must match: [`softmax`] of the scaled,
//! masked scores within 1e-6 forward and 1e-5 in gradients. Masked entries (−∞) are exactly 0.

use crate::rows::{for_rows, slice};
use crate::simd;
use candle_core::{CpuStorage, CustomOp2, D, Layout, Result, Shape, Tensor, bail};

// 1. Reference ----------------------------------------------------------------------------

/// Softmax over the last dimension, from primitives (differentiable). The max is subtracted
/// for stability and detached: it cancels out of the result, so it needs no gradient.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&max)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

// 2. CPU, one graph node with its backward -------------------------------------------------

/// One row of `softmax(scale·s + mask)` in place over the raw scores `row`; `mask` is the
/// row's additive mask (`None`: every entry counts). Masked entries (−∞, half of a causal row)
/// become exactly 0 (`e^−∞` = 0); a row with nothing left to attend to stays all 0.
pub(crate) fn softmax_row(row: &mut [f32], scale: f32, mask: Option<&[f32]>) {
    match mask {
        Some(m) => simd::scale_add(row, scale, m),
        None => simd::scale(row, scale),
    }
    let max = simd::max(row);
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let sum = simd::exp_shifted(row, max);
    simd::scale(row, 1.0 / sum);
}

/// [`softmax_row`]'s backward in place: `g ← scale · p ⊙ (g − Σ_j g_j p_j)`.
pub(crate) fn softmax_row_grad(p: &[f32], g: &mut [f32], scale: f32) {
    simd::softmax_grad(p, g, scale);
}

struct MaskedSoftmax {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, t2) = l1.shape().dims4()?;
        if l2.shape().dims4()? != (b, 1, t, t2) {
            bail!(
                "masked-softmax: mask shape {:?} for scores {:?}",
                l2.shape(),
                l1.shape()
            )
        }
        let (s, m) = (slice(s1, l1)?, slice(s2, l2)?);
        let mut out = vec![0f32; s.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let (bi, i) = (r / (h * t), r % t);
            y.copy_from_slice(&s[r * t2..(r + 1) * t2]);
            let mask = &m[(bi * t + i) * t2..(bi * t + i + 1) * t2];
            softmax_row(y, self.scale, Some(mask));
        };
        for_rows(&mut out, t2, row);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        p: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let t2 = p.dim(D::Minus1)?;
        let pv = p.flatten_all()?.to_vec1::<f32>()?;
        let gv = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; pv.len()];
        let scale = self.scale;
        let row = |(r, d): (usize, &mut [f32])| {
            d.copy_from_slice(&gv[r * t2..(r + 1) * t2]);
            softmax_row_grad(&pv[r * t2..(r + 1) * t2], d, scale);
        };
        for_rows(&mut out, t2, row);
        Ok((Some(Tensor::from_vec(out, p.shape(), p.device())?), None))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// `softmax(scale·scores + mask)` over the last dimension; `scores` is `(B, H, T, T)`, `mask`
/// `(B, 1, T, T)` (additive, 0 or −∞, not differentiated). One fused pass for f32 on the CPU,
/// the plain composition elsewhere.
pub fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    if !crate::fused_here(scores) {
        return softmax(&(scores * scale)?.broadcast_add(mask)?);
    }
    scores.contiguous()?.apply_op2(
        &mask.contiguous()?,
        MaskedSoftmax {
            scale: scale as f32,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn masked_softmax_matches_the_plain_ops_forward_and_backward() {
        // Big enough to take the parallel path too.
        for (b, h, t) in [(2, 3, 7), (2, 4, 96)] {
            let mut rng = Rng::new(t as u64);
            let s = Var::from_tensor(&randn(&mut rng, &[b, h, t, t], 2.0)).unwrap();
            let m = segment_mask(b, t, t / 2);
            let w = randn(&mut rng, &[b, h, t, t], 1.0);
            let scale = 0.35;
            let fused = masked_softmax(s.as_tensor(), &m, scale).unwrap();
            let plain =
                softmax(&(s.as_tensor() * scale).unwrap().broadcast_add(&m).unwrap()).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-6);
            for diff in grad_diffs(&fused, &plain, &w, &[&s]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
    }
}
