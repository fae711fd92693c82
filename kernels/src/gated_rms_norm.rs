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

    /// What gated_rms_norm.cu computes through the SIMT shim: out, dy, dz and dw for `grid`
    /// blocks of `block` threads, in one schedule.
    fn cuda(
        (y, z, w, g): (&[f32], &[f32], &[f32], &[f32]),
        (rows, d, groups): (usize, usize, usize),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let (mut out, mut rstd) = (vec![0f32; rows * d], vec![0f32; rows * groups]);
        let (mut dy, mut dz) = (vec![0f32; rows * d], vec![0f32; rows * d]);
        let (mut partial, mut dw) = (vec![0f32; grid as usize * d], vec![0f32; d]);
        let (r, n, gr, eps, blocks) = (rows as i32, d as i32, groups as i32, 1e-5f32, grid as i32);
        let (y, z, w, g) = (y.as_ptr(), z.as_ptr(), w.as_ptr(), g.as_ptr());
        let (op, rp) = (out.as_mut_ptr(), rstd.as_mut_ptr());
        let (dyp, dzp) = (dy.as_mut_ptr(), dz.as_mut_ptr());
        let (pp, dwp) = (partial.as_mut_ptr(), dw.as_mut_ptr());
        // SAFETY: y, z, out, g, dy and dz hold rows × d values, w and dw d, rstd one a
        // (row, group), the partials a row of d a block.
        unsafe {
            let fwd = [
                arg(&y),
                arg(&z),
                arg(&w),
                arg(&op),
                arg(&rp),
                arg(&r),
                arg(&n),
                arg(&gr),
                arg(&eps),
            ];
            launch_1d("gated_rms_norm_fwd_f32", grid, block, schedule, &fwd).unwrap();
            let bwd = [
                arg(&y),
                arg(&z),
                arg(&w),
                arg(&rp),
                arg(&g),
                arg(&dyp),
                arg(&dzp),
                arg(&pp),
                arg(&r),
                arg(&n),
                arg(&gr),
            ];
            launch_1d("gated_rms_norm_bwd_f32", grid, block, schedule, &bwd).unwrap();
            let reduce = [arg(&pp), arg(&dwp), arg(&blocks), arg(&n)];
            let columns = d.div_ceil(128) as u32;
            launch_1d("gated_rms_norm_dw_reduce", columns, 128, schedule, &reduce).unwrap();
        }
        vec![out, dy, dz, dw]
    }

    /// gated_rms_norm.cu, executed by the SIMT shim, against the plain ops: values within
    /// 1e-5, the gradients of y, z and the weight within 1e-4, with one group and several,
    /// groups smaller than a warp and larger than a block, grids that loop over (row, group)
    /// items and grids that leave blocks idle, in both schedules (which must give the same
    /// bytes: dw has no atomics).
    #[test]
    fn the_cuda_kernels_match_the_plain_ops() {
        for (rows, d, groups) in [
            (1, 1, 1),
            (3, 7, 1),
            (5, 12, 4),
            (7, 1000, 2),
            (33, 96, 3),
            (4, 3000, 1),
        ] {
            let mut rng = Rng::new(13 * d as u64 + rows as u64 + groups as u64);
            let y = Var::from_tensor(&randn(&mut rng, &[rows, d], 1.5)).unwrap();
            let z = Var::from_tensor(&randn(&mut rng, &[rows, d], 1.5)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[d], 1.0)).unwrap();
            let g = randn(&mut rng, &[rows, d], 1.0);
            let plain = gated_rms_norm_plain(&y, &z, &w, groups, 1e-5).unwrap();
            let mut want = vec![values(&plain)];
            want.extend(plain_grads(&plain, &g, &[&y, &z, &w]));
            let inputs = [&y, &z, &w].map(|v| values(v.as_tensor()));
            let gv = values(&g);
            let inputs = (&inputs[0][..], &inputs[1][..], &inputs[2][..], &gv[..]);
            let items = (rows * groups) as u32;
            for launch in [(1, 32), (3, 64), (items, 256), (items + 3, 128), (2, 1024)] {
                let at = format!("rows {rows}, D {d}, {groups} groups, grid × block {launch:?}");
                let got = in_both_schedules(&at, |s| cuda(inputs, (rows, d, groups), launch, s));
                for (what, got, want, tolerance) in [
                    ("out", &got[0], &want[0], 1e-5),
                    ("dy", &got[1], &want[1], 1e-4),
                    ("dz", &got[2], &want[2], 1e-4),
                    ("dw", &got[3], &want[3], 1e-4),
                ] {
                    let gap = largest_gap(got, want);
                    assert!(gap < tolerance, "{at}: {what} is {gap} from the plain ops");
                }
            }
        }
    }
}
