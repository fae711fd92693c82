//! The fused AdamW step's CUDA kernel (`adamw.cu`), held to the CPU optimizer. The CPU
//! optimizer lives in ops/train (`optim.rs`: `AdamW::step`, which calls
//! [`crate::simd::adamw`]); this file restates its formula in plain Rust and tests the
//! kernel against it:
//!
//! ```text
//! m = β1·m + (1−β1)·g            v = β2·v + (1−β2)·g·g
//! w = w − lr·( (m/bc1) / (sqrt(v/bc2) + ε)  +  wd·w )      bc1 = 1−β1ᵗ, bc2 = 1−β2ᵗ (f64, then f32)
//! ```
//!
//! Must match: the CPU optimizer's bytes through the SIMT shim (the same operations in the
//! same order, none fused). On a GPU, NVRTC contracts `a·b + c` into FMAs unless told
//! `--fmad=false`, which moves results by up to an ulp or so per step.

#[cfg(test)]
mod tests {
    use crate::testing::*;

    /// The hyper-parameters of one step, as `AdamW::step` rounds them to f32.
    struct Step {
        lr: f32,
        betas: (f32, f32),
        corrections: (f32, f32),
        eps: f32,
        wd: f32,
    }

    impl Step {
        /// Step `t` (from 1) of AdamW with `lr` and `wd`, β = (0.9, 0.95), ε = 1e-8.
        fn at(t: i32, lr: f64, wd: f64) -> Step {
            let (beta1, beta2) = (0.9f64, 0.95f64);
            Step {
                lr: lr as f32,
                betas: (beta1 as f32, beta2 as f32),
                corrections: ((1.0 - beta1.powi(t)) as f32, (1.0 - beta2.powi(t)) as f32),
                eps: 1e-8,
                wd: wd as f32,
            }
        }
    }

    /// ops/train's `AdamW::step` for one parameter, written out: the reference.
    fn plain_step(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &Step) {
        let ((b1, b2), (bc1, bc2)) = (s.betas, s.corrections);
        for j in 0..w.len() {
            m[j] = b1 * m[j] + (1.0 - b1) * g[j];
            v[j] = b2 * v[j] + (1.0 - b2) * g[j] * g[j];
            let update = (m[j] / bc1) / ((v[j] / bc2).sqrt() + s.eps);
            w[j] -= s.lr * (update + s.wd * w[j]);
        }
    }

    /// [w, m, v] after adamw.cu's step through the SIMT shim, and the bf16 copy of w.
    fn cuda_step(
        state: &[Vec<f32>],
        g: &[f32],
        s: &Step,
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> (Vec<Vec<f32>>, Vec<u16>) {
        use crate::simt::{arg, launch_1d};
        let mut state = state.to_vec();
        let n = g.len();
        let mut copy = vec![0u16; n];
        let [w, m, v] = &mut state[..] else {
            unreachable!("the state is [w, m, v]")
        };
        // SAFETY: w, g, m, v and the copy all hold n values.
        let (wp, gp, mp, vp, cp) = (
            w.as_mut_ptr(),
            g.as_ptr(),
            m.as_mut_ptr(),
            v.as_mut_ptr(),
            copy.as_mut_ptr(),
        );
        let params = [
            arg(&wp),
            arg(&gp),
            arg(&mp),
            arg(&vp),
            arg(&cp),
            arg(&n),
            arg(&s.lr),
            arg(&s.betas.0),
            arg(&s.betas.1),
            arg(&s.corrections.0),
            arg(&s.corrections.1),
            arg(&s.eps),
            arg(&s.wd),
        ];
        unsafe { launch_1d("adamw_f32", grid, block, schedule, &params) }.unwrap();
        (state, copy)
    }

    /// Three AdamW steps of adamw.cu, executed by the SIMT shim, give the CPU optimizer's
    /// bytes (the plain reference and `simd::adamw`, which `AdamW::step` calls), with and
    /// without weight decay, at sizes that are not multiples of the block and grids that loop
    /// or leave threads idle, in both schedules; the bf16 copy is the new weight rounded to
    /// nearest even.
    #[test]
    fn the_cuda_step_gives_the_cpu_optimizers_bytes() {
        for (n, wd) in [(1, 0.1), (37, 0.0), (1000, 0.1), (4099, 0.01)] {
            let mut rng = Rng::new(n as u64);
            let w = values(&randn(&mut rng, &[n], 0.5));
            let mut want = vec![w, vec![0f32; n], vec![0f32; n]];
            for launch in [(1, 32), (3, 64), (n.div_ceil(256) as u32, 256), (9, 1024)] {
                let mut state = want.clone();
                let mut cpu = want.clone();
                for t in 1..=3 {
                    let g = values(&randn(&mut rng, &[n], 1e-2 * t as f64));
                    let s = Step::at(t, 3e-3 / t as f64, wd);
                    let at = format!("n {n}, step {t}, grid × block {launch:?}");
                    let copies = std::cell::RefCell::new(Vec::new());
                    state = in_both_schedules(&at, |rev| {
                        let (state, copy) = cuda_step(&state, &g, &s, launch, rev);
                        copies.borrow_mut().push(copy);
                        state
                    });
                    let [w, m, v] = &mut want[..] else {
                        unreachable!("the state is [w, m, v]")
                    };
                    plain_step(w, &g, m, v, &s);
                    let [cw, cm, cv] = &mut cpu[..] else {
                        unreachable!("the state is [w, m, v]")
                    };
                    let (lr, betas, corrections) = (s.lr, s.betas, s.corrections);
                    crate::simd::adamw(cw, &g, cm, cv, betas, corrections, lr, s.eps, s.wd);
                    assert_eq!(state, want, "{at}: against the plain reference");
                    assert_eq!(cpu, want, "{at}: simd::adamw against the plain reference");
                    let rounded: Vec<u16> = want[0]
                        .iter()
                        .map(|w| half::bf16::from_f32(*w).to_bits())
                        .collect();
                    for copy in copies.into_inner() {
                        assert_eq!(copy, rounded, "{at}: the bf16 copy");
                    }
                }
                want = state;
            }
        }
    }
}
