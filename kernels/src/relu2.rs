//! Squared ReLU (So et al. 2021, "Primer"; Nemotron-H's MLP activation): `y = max(h, 0)²`.
//!
//! Backward: `dh = dy · 2·max(h, 0)`. Must match: [`relu2_plain`] to the byte, forward and
//! backward (the same arithmetic as relu then sqr), the fused CPU op and the CUDA kernels
//! (`relu2.cu`) alike.

use crate::rows::{slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp1, Layout, Result, Shape, Tensor};

// 1. Reference ----------------------------------------------------------------------------

/// `relu(h)²` from candle primitives: the spec the fused op is tested against.
pub fn relu2_plain(h: &Tensor) -> Result<Tensor> {
    h.relu()?.sqr()
}

// 2. CPU, one graph node with its backward -------------------------------------------------

struct Relu2;

impl CustomOp1 for Relu2 {
    fn name(&self) -> &'static str {
        "relu2"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = slice(s, l)?;
        let mut out = vec![0f32; h.len()];
        simd::relu2(h, &mut out);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut out = vec![0f32; h.elem_count()];
        with_values(h, |hv| {
            with_values(grad, |gv| simd::relu2_grad(hv, gv, &mut out))
        })??;
        Ok(Some(Tensor::from_vec(out, h.shape(), h.device())?))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// `max(h, 0)²`: one fused pass for f32 on the CPU, [`relu2_plain`] elsewhere.
pub fn relu2(h: &Tensor) -> Result<Tensor> {
    if !crate::fused_here(h) {
        return relu2_plain(h);
    }
    h.contiguous()?.apply_op1(Relu2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn relu2_matches_the_plain_ops_forward_and_backward() {
        for (rows, f) in [(3, 5), (300, 192)] {
            let mut rng = Rng::new(f as u64 + 1);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let fused = relu2(h.as_tensor()).unwrap();
            let plain = relu2_plain(h.as_tensor()).unwrap();
            // Same arithmetic as relu then sqr: the same bytes, forward and backward.
            assert_eq!(max_diff(&fused, &plain), 0.0);
            for diff in grad_diffs(&fused, &plain, &g, &[&h]) {
                assert_eq!(diff, 0.0);
            }
        }
    }

    /// relu2.cu's y and dh through the SIMT shim, for `grid` blocks of `block` threads: the
    /// f32 kernels', or the `_to_bf16` kernels' widened to f32.
    fn cuda(
        h: &[f32],
        dy: &[f32],
        launch: (u32, u32),
        schedule: Schedule,
        to_bf16: bool,
    ) -> Vec<Vec<f32>> {
        if to_bf16 {
            let (y, dh) = launches::<u16>("to_bf16", h, dy, launch, schedule);
            vec![widened(&y), widened(&dh)]
        } else {
            let (y, dh) = launches::<f32>("f32", h, dy, launch, schedule);
            vec![y, dh]
        }
    }

    fn launches<T: Copy + Default>(
        suffix: &str,
        h: &[f32],
        dy: &[f32],
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> (Vec<T>, Vec<T>) {
        use crate::simt::{arg, launch_1d};
        let n = h.len();
        let (mut y, mut dh) = (vec![T::default(); n], vec![T::default(); n]);
        // SAFETY: h, dy, y and dh all hold n values.
        unsafe {
            launch_1d(
                &format!("relu2_fwd_{suffix}"),
                grid,
                block,
                schedule,
                &[arg(&h.as_ptr()), arg(&y.as_mut_ptr()), arg(&n)],
            )
            .unwrap();
            launch_1d(
                &format!("relu2_bwd_{suffix}"),
                grid,
                block,
                schedule,
                &[
                    arg(&h.as_ptr()),
                    arg(&dy.as_ptr()),
                    arg(&dh.as_mut_ptr()),
                    arg(&n),
                ],
            )
            .unwrap();
        }
        (y, dh)
    }

    /// relu2.cu, executed by the SIMT shim: the plain ops' bytes, forward and backward, at
    /// sizes that are not multiples of the block and grids that loop or leave threads idle,
    /// in both schedules; and the `_to_bf16` kernels, those bytes rounded to bf16.
    #[test]
    fn the_cuda_kernels_give_the_plain_ops_bytes() {
        for (rows, f) in [(1, 1), (3, 5), (7, 333), (64, 96)] {
            let mut rng = Rng::new(17 * f as u64 + rows as u64);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let plain = relu2_plain(h.as_tensor()).unwrap();
            let want = vec![values(&plain), plain_grads(&plain, &g, &[&h]).remove(0)];
            let (hv, gv) = (values(h.as_tensor()), values(&g));
            for launch in [(1, 32), (3, 64), (rows as u32, 256), (40, 1024)] {
                let at = format!("rows {rows}, F {f}, grid × block {launch:?}");
                let got = in_both_schedules(&at, |rev| cuda(&hv, &gv, launch, rev, false));
                assert_eq!(got, want, "{at}");
                let bf16 = in_both_schedules(&at, |rev| cuda(&hv, &gv, launch, rev, true));
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
