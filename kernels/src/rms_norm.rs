//! RMSNorm over the last dimension: `y = x · r · w` with `r = 1/sqrt(mean(x²) + eps)`
//! (Zhang & Sennrich 2019; Megatron-LM's and transformers' `RMSNorm`).
//!
//! Backward: `dw = Σ_rows g ⊙ x · r` and `dx = r · (g ⊙ w) − x · r³/D · Σ_j g_j w_j x_j`.
//! Must match: [`rms_norm_plain`] within 1e-5 forward, 1e-4 in gradients (the fused rows sum
//! in a different order).

use crate::rows::{for_rows, slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp2, D, Layout, Result, Shape, Tensor, bail};

// 1. Reference ----------------------------------------------------------------------------

/// RMSNorm from candle primitives: the spec the fused op is tested against.
pub fn rms_norm_plain(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv = (ms + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)?.broadcast_mul(weight)
}

// 2. CPU, one graph node with its backward -------------------------------------------------

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = l1.shape().dims().last().copied().unwrap_or(0);
        let (x, w) = (slice(s1, l1)?, slice(s2, l2)?);
        if w.len() != d || d == 0 {
            bail!("rms-norm: weight of {} for rows of {d}", w.len())
        }
        let mut out = vec![0f32; x.len()];
        let row =
            |(r, y): (usize, &mut [f32])| simd::rms_norm(&x[r * d..(r + 1) * d], w, self.eps, y);
        for_rows(&mut out, d, row);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let mut dx = vec![0f32; x.elem_count()];
        // dw sums over rows in row order: the same bytes whatever the thread count.
        let mut dw = vec![0f32; d];
        let mut gw = vec![0f32; d];
        with_values(x, |xv| {
            with_values(grad, |gv| {
                for (r, dx) in dx.chunks_mut(d).enumerate() {
                    let at = r * d..(r + 1) * d;
                    let row = (&xv[at.clone()], wv.as_slice(), &gv[at]);
                    simd::rms_norm_grad(row, self.eps, &mut gw, dx, &mut dw);
                }
            })
        })??;
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), x.device())?),
            Some(Tensor::from_vec(dw, w.shape(), w.device())?),
        ))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) * weight`: one fused pass for
/// f32 on the CPU, [`rms_norm_plain`] elsewhere.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if !crate::fused_here(x) {
        return rms_norm_plain(x, weight, eps);
    }
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn rms_norm_matches_the_plain_ops_forward_and_backward() {
        for (rows, d) in [(3, 5), (300, 128)] {
            let mut rng = Rng::new(d as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[rows, d], 2.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[d], 1.0)).unwrap();
            let g = randn(&mut rng, &[rows, d], 1.0);
            let fused = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            let plain = rms_norm_plain(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-5);
            for diff in grad_diffs(&fused, &plain, &g, &[&x, &w]) {
                assert!(diff < 1e-4, "{diff}");
            }
        }
    }
}
