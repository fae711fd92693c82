//! Mamba-2's gated RMSNorm (step 5 of the mixer; `RMSNormGated` in
//! `mamba_ssm/ops/triton/layernorm_gated.py`, with `norm_before_gate=False`): `v = y ⊙ silu(z)`,
//! RMS-normalised within each of `G` contiguous groups, times the weight. Backward as
//! [`crate::simd::gated_norm_grad`] says. It runs on the calling thread and never depends on
//! the thread count.
//!
//! Must match: [`gated_rms_norm_plain`] within 1e-5 forward, 1e-4 in gradients.

use crate::rows::{slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp3, D, Layout, Result, Shape, Tensor, bail};

// 1. Reference ----------------------------------------------------------------------------

/// The gated norm from candle primitives, `y` and `z` `(…, D)`, `weight (D)`:
/// `v = y ⊙ silu(z)`, RMS-normalised within each group, times `weight`. The spec the fused op
/// is tested against.
pub fn gated_rms_norm_plain(
    y: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    let lead = &y.dims()[..y.rank() - 1];
    let width = y.dim(D::Minus1)?;
    let grouped: Vec<usize> = lead
        .iter()
        .copied()
        .chain([groups, width / groups])
        .collect();
    let v = y
        .reshape(grouped.as_slice())?
        .mul(&z.silu()?.reshape(grouped.as_slice())?)?;
    let inv = (v.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    v.broadcast_mul(&inv)?
        .reshape(y.shape())?
        .broadcast_mul(weight)
}

// 2. CPU, one graph node with its backward -------------------------------------------------

struct GatedRmsNorm {
    groups: usize,
    eps: f32,
}

impl GatedRmsNorm {
    /// `(rows, channels)` from `y`, `z` (same shape) and the weight `(channels)`.
    fn dims(&self, y: &Shape, z: &Shape, w: &Shape) -> Result<(usize, usize)> {
        let d = w.elem_count();
        if y != z
            || y.dims().last() != Some(&d)
            || d == 0
            || self.groups == 0
            || !d.is_multiple_of(self.groups)
        {
            bail!(
                "gated-rms-norm: y {y:?}, z {z:?}, weight {w:?}, {} groups",
                self.groups
            )
        }
        Ok((y.elem_count() / d, d))
    }
}

impl CustomOp3 for GatedRmsNorm {
    fn name(&self) -> &'static str {
        "gated-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, d) = self.dims(l1.shape(), l2.shape(), l3.shape())?;
        let (y, z, w) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let mut out = vec![0f32; rows * d];
        let mut v = vec![0f32; d];
        for (r, o) in out.chunks_mut(d).enumerate() {
            let at = r * d..(r + 1) * d;
            simd::gated_norm(
                &y[at.clone()],
                &z[at],
                w,
                (self.groups, self.eps),
                &mut v,
                o,
            );
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        y: &Tensor,
        z: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (rows, d) = self.dims(y.shape(), z.shape(), w.shape())?;
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let (mut dy, mut dz, mut dw) = (vec![0f32; rows * d], vec![0f32; rows * d], vec![0f32; d]);
        let (mut v, mut gw) = (vec![0f32; d], vec![0f32; d]);
        with_values(y, |yv| {
            with_values(z, |zv| {
                with_values(grad, |gv| {
                    for r in 0..rows {
                        let at = r * d..(r + 1) * d;
                        simd::gated_norm_grad(
                            (&yv[at.clone()], &zv[at.clone()], &wv, &gv[at.clone()]),
                            (self.groups, self.eps),
                            &mut v,
                            &mut gw,
                            &mut dy[at.clone()],
                            &mut dz[at],
                            &mut dw,
                        );
                    }
                })
            })
        })???;
        Ok((
            Some(Tensor::from_vec(dy, y.shape(), y.device())?),
            Some(Tensor::from_vec(dz, z.shape(), z.device())?),
            Some(Tensor::from_vec(dw, w.shape(), w.device())?),
        ))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// Mamba-2's gated RMSNorm as one node: `y`, `z` `(…, D)`, `weight (D)`; per row
/// `v = y ⊙ silu(z)` normalised by `1/sqrt(mean(v²) + eps)` within each of `groups` contiguous
/// groups of `D/groups` channels, times `weight`. One fused node for f32 on the CPU,
/// [`gated_rms_norm_plain`] elsewhere.
pub fn gated_rms_norm(
    y: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    if !crate::fused_here(y) {
        return gated_rms_norm_plain(y, z, weight, groups, eps);
    }
    y.contiguous()?.apply_op3(
        &z.contiguous()?,
        &weight.contiguous()?,
        GatedRmsNorm {
            groups,
            eps: eps as f32,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// The fused gated RMSNorm against the plain ops, values and gradients (y, z, weight), with
    /// one group and with several.
    #[test]
    fn gated_rms_norm_matches_the_plain_ops_forward_and_backward() {
        let di = 12;
        for groups in [1, 2, 4] {
            let mut rng = Rng::new(21 + groups as u64);
            let y = Var::from_tensor(&randn(&mut rng, &[2, 7, di], 1.0)).unwrap();
            let z = Var::from_tensor(&randn(&mut rng, &[2, 7, di], 1.0)).unwrap();
            // A weight that is not all ones, so its gradient and its product both count.
            let w = Var::from_tensor(&randn(&mut rng, &[di], 1.0)).unwrap();
            let eps = 1e-5;
            let fused = gated_rms_norm(&y, &z, &w, groups, eps).unwrap();
            let plain = gated_rms_norm_plain(&y, &z, &w, groups, eps).unwrap();
            let diff = max_diff(&fused, &plain);
            assert!(diff < 1e-5, "{groups} groups: {diff}");
            let g = randn(&mut rng, &[2, 7, di], 1.0);
            for diff in grad_diffs(&fused, &plain, &g, &[&y, &z, &w]) {
                assert!(diff < 1e-4, "{groups} groups: gradient off by {diff}");
            }
        }
    }
}
