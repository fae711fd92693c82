//! The global gradient norm and clip's CUDA kernels (`grad_norm.cu`), held to the CPU
//! trainer's: ops/train's `optim.rs` (`grad_norm`: the squares summed in f64; `clip`: scale
//! by `max_norm / (norm + 1e-6)`, rounded to f32, when the norm is above `max_norm`). This
//! file restates both in plain Rust and tests the kernels against them.
//!
//! Must match: the norm within 1e-12 relative (f64 sums in a tree instead of in order), the
//! clipped gradients' bytes (one f32 product each, with the scale rounded from that norm).

#[cfg(test)]
mod tests {
    use crate::testing::*;

    /// ops/train's `grad_norm` over one flat buffer: f64 squares summed in order.
    fn plain_norm(g: &[f32]) -> f64 {
        g.iter()
            .map(|x| (*x as f64) * (*x as f64))
            .sum::<f64>()
            .sqrt()
    }

    /// ops/train's `clip` after [`plain_norm`].
    fn plain_clip(g: &mut [f32], norm: f64, max_norm: f64) {
        if max_norm > 0.0 && norm > max_norm {
            let s = (max_norm / (norm + 1e-6)) as f32;
            g.iter_mut().for_each(|x| *x *= s);
        }
    }

    /// The norm and the clipped gradients from grad_norm.cu's three launches through the
    /// SIMT shim, the first and last for `grid` blocks of `block` threads.
    fn cuda(
        g: &[f32],
        max_norm: f64,
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> (f64, Vec<f32>) {
        use crate::simt::{arg, launch_1d};
        let (mut partial, mut norm, mut clipped) =
            (vec![f64::NAN; grid as usize], vec![0f64; 1], g.to_vec());
        // SAFETY: g and clipped hold n values, partial one a block, norm one.
        unsafe {
            launch_1d(
                "grad_norm_partials",
                grid,
                block,
                schedule,
                &[arg(&g.as_ptr()), arg(&g.len()), arg(&partial.as_mut_ptr())],
            )
            .unwrap();
            launch_1d(
                "grad_norm_finish",
                1,
                block,
                schedule,
                &[
                    arg(&partial.as_ptr()),
                    arg(&(grid as i32)),
                    arg(&norm.as_mut_ptr()),
                ],
            )
            .unwrap();
            launch_1d(
                "grad_clip_f32",
                grid,
                block,
                schedule,
                &[
                    arg(&clipped.as_mut_ptr()),
                    arg(&g.len()),
                    arg(&norm.as_ptr()),
                    arg(&max_norm),
                ],
            )
            .unwrap();
        }
        (norm[0], clipped)
    }

    /// grad_norm.cu, executed by the SIMT shim, against the CPU trainer's norm and clip:
    /// sizes smaller than the block and not multiples of it, more partials than the finishing
    /// block has threads, no clip and norms below and above the clip, both schedules.
    #[test]
    fn the_cuda_norm_and_clip_match_the_cpu_trainers() {
        for (n, clip) in [(1, 1.0 / 3.0), (31, 0.0), (1000, 2.0), (20_011, 1.0 / 3.0)] {
            let mut rng = Rng::new(n as u64 + 2);
            let g = values(&randn(&mut rng, &[n], 0.3));
            let norm = plain_norm(&g);
            let max_norm = norm * clip;
            let mut want = g.clone();
            plain_clip(&mut want, norm, max_norm);
            for launch in [(1, 32), (3, 64), (70, 32), (5, 1024)] {
                let at = format!("n {n}, max_norm {max_norm}, grid × block {launch:?}");
                // The f64 norm travels as the two f32 of its bits, so the schedules compare its bytes.
                let got = in_both_schedules(&at, |rev| {
                    let (norm, clipped) = cuda(&g, max_norm, launch, rev);
                    let bits = norm.to_bits();
                    let halves = [bits >> 32, bits & 0xffff_ffff];
                    vec![halves.map(|h| f32::from_bits(h as u32)).to_vec(), clipped]
                });
                let bits = |h: f32| h.to_bits() as u64;
                let got_norm = f64::from_bits(bits(got[0][0]) << 32 | bits(got[0][1]));
                let gap = (got_norm - norm).abs() / norm;
                assert!(
                    gap < 1e-12,
                    "{at}: the norm is {gap} (relative) from the CPU's"
                );
                assert_eq!(got[1], want, "{at}: the clipped gradients");
            }
        }
    }
}
