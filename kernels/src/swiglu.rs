//! SwiGLU (Shazeer 2020) on the stacked `fc1` output `h = [g, u]` (last dimension `2F`, gate
//! half first): `y = silu(g) ⊙ u` with `silu(g) = g·σ(g)`, as Megatron-LM's fused `swiglu`.
//!
//! Backward: `dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`, `du = dy ⊙ silu(g)`. Must match:
//! [`swiglu_plain`] within 1e-5, the fused CPU op and the CUDA kernels (`swiglu.cu`) alike.

use crate::rows::{for_rows, slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp1, D, Layout, Result, Shape, Tensor, bail};

// 1. Reference ----------------------------------------------------------------------------

/// `silu(h[..F]) ⊙ h[F..]` from candle primitives: the spec the fused op is tested against.
pub fn swiglu_plain(h: &Tensor) -> Result<Tensor> {
    let n = h.dim(D::Minus1)? / 2;
    h.narrow(D::Minus1, 0, n)?
        .silu()?
        .mul(&h.narrow(D::Minus1, n, n)?)
}

// 2. CPU, one graph node with its backward -------------------------------------------------

struct Swiglu;

impl CustomOp1 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let mut dims = l.shape().dims().to_vec();
        let Some(last) = dims.last_mut() else {
            bail!("swiglu: a scalar input")
        };
        if *last % 2 != 0 {
            bail!("swiglu: an odd last dimension {}", *last)
        }
        let f = *last / 2;
        *last = f;
        let h = slice(s, l)?;
        let mut out = vec![0f32; h.len() / 2];
        if f > 0 {
            let row = |(r, y): (usize, &mut [f32])| {
                let (g, u) = h[r * 2 * f..(r + 1) * 2 * f].split_at(f);
                simd::swiglu(g, u, y);
            };
            for_rows(&mut out, f, row);
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let w = h.dim(D::Minus1)?;
        let f = w / 2;
        let mut out = vec![0f32; h.elem_count()];
        if f > 0 {
            with_values(h, |hv| {
                with_values(grad, |gv| {
                    let row = |(r, d): (usize, &mut [f32])| {
                        let (g, u) = hv[r * w..(r + 1) * w].split_at(f);
                        let (dg, du) = d.split_at_mut(f);
                        simd::swiglu_grad(g, u, &gv[r * f..(r + 1) * f], dg, du);
                    };
                    for_rows(&mut out, w, row);
                })
            })??;
        }
        Ok(Some(Tensor::from_vec(out, h.shape(), h.device())?))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// SwiGLU on `h = [g, u]`: one fused pass for f32 on the CPU, [`swiglu_plain`] elsewhere.
pub fn swiglu(h: &Tensor) -> Result<Tensor> {
    if !crate::fused_here(h) {
        return swiglu_plain(h);
    }
    h.contiguous()?.apply_op1(Swiglu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn swiglu_matches_the_plain_ops_forward_and_backward() {
        // Big enough to take the parallel path too.
        for (rows, f) in [(3, 5), (300, 192)] {
            let mut rng = Rng::new(f as u64);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, 2 * f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let fused = swiglu(h.as_tensor()).unwrap();
            let plain = swiglu_plain(h.as_tensor()).unwrap();
            assert!(
                max_diff(&fused, &plain) < 1e-5,
                "{}",
                max_diff(&fused, &plain)
            );
            for diff in grad_diffs(&fused, &plain, &g, &[&h]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
        let odd = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(swiglu(&odd).is_err(), "an odd width has no halves");
    }

    /// swiglu.cu's y and dh through the SIMT shim, for `grid` blocks of `block` threads: the
    /// f32 kernels', or the `_to_bf16` kernels' widened to f32.
    fn cuda(
        h: &[f32],
        dy: &[f32],
        shape: (usize, usize),
        launch: (u32, u32),
        schedule: Schedule,
        to_bf16: bool,
    ) -> Vec<Vec<f32>> {
        if to_bf16 {
            let (y, dh) = launches::<u16>("to_bf16", h, dy, shape, launch, schedule);
            vec![widened(&y), widened(&dh)]
        } else {
            let (y, dh) = launches::<f32>("f32", h, dy, shape, launch, schedule);
            vec![y, dh]
        }
    }

    fn launches<T: Copy + Default>(
        suffix: &str,
        h: &[f32],
        dy: &[f32],
        (rows, f): (usize, usize),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> (Vec<T>, Vec<T>) {
        use crate::simt::{arg, launch_1d};
        let (mut y, mut dh) = (
            vec![T::default(); rows * f],
            vec![T::default(); rows * 2 * f],
        );
        let (r, n) = (rows as i32, f as i32);
        // SAFETY: h and dh hold rows × 2F values, y and dy rows × F.
        unsafe {
            launch_1d(
                &format!("swiglu_fwd_{suffix}"),
                grid,
                block,
                schedule,
                &[arg(&h.as_ptr()), arg(&y.as_mut_ptr()), arg(&r), arg(&n)],
            )
            .unwrap();
            launch_1d(
                &format!("swiglu_bwd_{suffix}"),
                grid,
                block,
                schedule,
                &[
                    arg(&h.as_ptr()),
                    arg(&dy.as_ptr()),
                    arg(&dh.as_mut_ptr()),
                    arg(&r),
                    arg(&n),
                ],
            )
            .unwrap();
        }
        (y, dh)
    }

    /// swiglu.cu, executed by the SIMT shim, against the plain ops within 1e-5, forward and
    /// backward, at sizes that are not multiples of the block, with grids too small (threads
    /// loop) and too large (threads idle), in both schedules; and the `_to_bf16` kernels, the
    /// f32 kernels' bytes rounded to bf16.
    #[test]
    fn the_cuda_kernels_match_the_plain_ops() {
        for (rows, f) in [(1, 1), (3, 5), (7, 333), (64, 96)] {
            let mut rng = Rng::new(31 * f as u64 + rows as u64);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, 2 * f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let plain = swiglu_plain(h.as_tensor()).unwrap();
            let want = [values(&plain), plain_grads(&plain, &g, &[&h]).remove(0)];
            let (hv, gv) = (values(h.as_tensor()), values(&g));
            for launch in [(1, 32), (3, 64), (rows as u32, 256), (40, 1024)] {
                let at = format!("rows {rows}, F {f}, grid × block {launch:?}");
                let run = |rev, to_bf16| cuda(&hv, &gv, (rows, f), launch, rev, to_bf16);
                let got = in_both_schedules(&at, |rev| run(rev, false));
                for (what, got, want) in [("y", &got[0], &want[0]), ("dh", &got[1], &want[1])] {
                    let gap = largest_gap(got, want);
                    assert!(gap < 1e-5, "{at}: {what} is {gap} from the plain ops");
                }
                let bf16 = in_both_schedules(&at, |rev| run(rev, true));
                for (f32s, bf16) in got.iter().zip(&bf16) {
                    assert!(
                        rounded_to_bf16(f32s, bf16),
                        "{at}: not the f32 bytes rounded"
                    );
                }
            }
        }
    }
}
