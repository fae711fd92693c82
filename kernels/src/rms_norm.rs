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
    use crate::simt::{SCHEDULES, Schedule, arg, launch_1d};
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

    /// What rms_norm.cu computes through the SIMT shim: y, dx and dw for `grid` blocks of
    /// `block` threads, in one schedule.
    fn cuda_f32(
        (x, w, g): (&[f32], &[f32], &[f32]),
        (rows, d): (usize, usize),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> [Vec<f32>; 3] {
        let (mut y, mut rstd) = (vec![0f32; rows * d], vec![0f32; rows]);
        let mut dx = vec![0f32; rows * d];
        let mut partial = vec![0f32; grid as usize * d];
        let mut dw = vec![0f32; d];
        let (r, n, eps, blocks) = (rows as i32, d as i32, 1e-5f32, grid as i32);
        let (x, w, g) = (x.as_ptr(), w.as_ptr(), g.as_ptr());
        let (yp, rp) = (y.as_mut_ptr(), rstd.as_mut_ptr());
        let (dxp, pp, dwp) = (dx.as_mut_ptr(), partial.as_mut_ptr(), dw.as_mut_ptr());
        // SAFETY: every buffer holds what the kernels index: rows × d values, a rstd a row,
        // a partial row of d a block.
        unsafe {
            let fwd = [
                arg(&x),
                arg(&w),
                arg(&yp),
                arg(&rp),
                arg(&r),
                arg(&n),
                arg(&eps),
            ];
            launch_1d("rms_norm_fwd_f32", grid, block, schedule, &fwd).unwrap();
            let bwd = [
                arg(&x),
                arg(&w),
                arg(&rp),
                arg(&g),
                arg(&dxp),
                arg(&pp),
                arg(&r),
                arg(&n),
            ];
            launch_1d("rms_norm_bwd_f32", grid, block, schedule, &bwd).unwrap();
            let reduce = [arg(&pp), arg(&dwp), arg(&blocks), arg(&n)];
            launch_1d(
                "rms_norm_dw_reduce",
                d.div_ceil(128) as u32,
                128,
                schedule,
                &reduce,
            )
            .unwrap();
        }
        [y, dx, dw]
    }

    /// rms_norm.cu, executed by the SIMT shim, against the plain ops: forward and both
    /// gradients at shapes that leave threads idle, loop over columns and over rows, in either
    /// schedule, which must give the same bytes (the dw sum has no atomics).
    #[test]
    fn the_cuda_kernels_match_the_plain_ops() {
        for (rows, d) in [(1, 1), (3, 7), (7, 1000), (33, 96), (4, 3000)] {
            let mut rng = Rng::new(7 * d as u64 + rows as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[rows, d], 2.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[d], 1.0)).unwrap();
            let g = randn(&mut rng, &[rows, d], 1.0);
            let plain = rms_norm_plain(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            let grads = (&plain * &g)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let want = [
                values(&plain),
                values(grads.get(x.as_tensor()).unwrap()),
                values(grads.get(w.as_tensor()).unwrap()),
            ];
            let inputs = (values(x.as_tensor()), values(w.as_tensor()), values(&g));
            let inputs = (&inputs.0[..], &inputs.1[..], &inputs.2[..]);
            for launch in [(1, 32), (3, 64), (rows as u32, 256), (2, 1024)] {
                let [got, reversed] = SCHEDULES.map(|s| cuda_f32(inputs, (rows, d), launch, s));
                let at = format!("rows {rows}, d {d}, grid × block {launch:?}");
                assert_eq!(got, reversed, "{at}: the schedules disagree");
                for (what, got, want, tolerance) in [
                    ("y", &got[0], &want[0], 1e-5),
                    ("dx", &got[1], &want[1], 1e-4),
                    ("dw", &got[2], &want[2], 1e-4),
                ] {
                    let gap = largest_gap(got, want);
                    assert!(gap < tolerance, "{at}: {what} is {gap} from the plain ops");
                }
            }
        }
    }

    /// `rms_norm_fwd_to_bf16`: f32 in, bf16 out, the f32 kernel's y rounded bit for bit and
    /// its rstd, in both schedules.
    #[test]
    fn the_cuda_forward_to_bf16_is_the_f32_one_rounded() {
        let (rows, d) = (6, 333);
        let mut rng = Rng::new(29);
        let x = values(&randn(&mut rng, &[rows, d], 2.0));
        let w = values(&randn(&mut rng, &[d], 1.0));
        let run = |kernel: &str, schedule| {
            let (mut y, mut y16, mut rstd) =
                (vec![0f32; rows * d], vec![0u16; rows * d], vec![0f32; rows]);
            let (xp, wp, rp) = (x.as_ptr(), w.as_ptr(), rstd.as_mut_ptr());
            let yp: *mut std::ffi::c_void = if kernel.ends_with("f32") {
                y.as_mut_ptr().cast()
            } else {
                y16.as_mut_ptr().cast()
            };
            let (r, n, eps) = (rows as i32, d as i32, 1e-5f32);
            let params = [
                arg(&xp),
                arg(&wp),
                arg(&yp),
                arg(&rp),
                arg(&r),
                arg(&n),
                arg(&eps),
            ];
            // SAFETY: rows × d values in and out, one rstd a row.
            unsafe { launch_1d(kernel, 3, 64, schedule, &params) }.unwrap();
            let y = if kernel.ends_with("f32") {
                y
            } else {
                widened(&y16)
            };
            vec![y, rstd]
        };
        let want = run("rms_norm_fwd_f32", Schedule::Forward);
        let got = in_both_schedules("to_bf16", |s| run("rms_norm_fwd_to_bf16", s));
        assert!(rounded_to_bf16(&want[0], &got[0]), "not the f32 y rounded");
        assert_eq!(want[1], got[1], "rstd");
    }

    /// The bf16 forward: bf16 in and out, f32 inside. Within half a bf16 ulp (2⁻⁸ of the value) of the plain
    /// ops on the same (rounded) input, plus the f32 sums' own difference.
    #[test]
    fn the_cuda_bf16_forward_rounds_once() {
        use half::bf16;
        let (rows, d) = (5, 700);
        let mut rng = Rng::new(11);
        let x: Vec<bf16> = values(&randn(&mut rng, &[rows, d], 2.0))
            .into_iter()
            .map(bf16::from_f32)
            .collect();
        let w = values(&randn(&mut rng, &[d], 1.0));
        let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
        let want = values(
            &rms_norm_plain(
                &Tensor::from_vec(xf, &[rows, d], &Device::Cpu).unwrap(),
                &Tensor::from_vec(w.clone(), &[d], &Device::Cpu).unwrap(),
                1e-5,
            )
            .unwrap(),
        );
        let bits: Vec<u16> = x.iter().map(|v| v.to_bits()).collect();
        let (mut y, mut rstd) = (vec![0u16; rows * d], vec![0f32; rows]);
        let (xp, wp, yp, rp) = (bits.as_ptr(), w.as_ptr(), y.as_mut_ptr(), rstd.as_mut_ptr());
        let (r, n, eps) = (rows as i32, d as i32, 1e-5f32);
        let params = [
            arg(&xp),
            arg(&wp),
            arg(&yp),
            arg(&rp),
            arg(&r),
            arg(&n),
            arg(&eps),
        ];
        // SAFETY: rows × d values in and out, one rstd a row.
        unsafe { launch_1d("rms_norm_fwd_bf16", 2, 128, Schedule::Forward, &params) }.unwrap();
        for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
            let got = bf16::from_bits(got).to_f32();
            let bound = want.abs() * 2f32.powi(-8) + 1e-5;
            assert!(
                (got - want).abs() <= bound,
                "element {i}: {got} against {want}"
            );
            assert_eq!(bf16::from_bits(y[i]), bf16::from_f32(got), "stored as bf16");
        }
    }
}
