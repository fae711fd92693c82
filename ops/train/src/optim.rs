//! AdamW and the learning-rate schedule, written out on plain `f32` slices.
//!
//! AdamW (decoupled weight decay), per parameter `w` with gradient `g` at step `t` (from 1):
//!
//! ```text
//! m = β1·m + (1−β1)·g            v = β2·v + (1−β2)·g²
//! w = w − lr·( m/(1−β1ᵗ) / (sqrt(v/(1−β2ᵗ)) + ε)  +  wd·w )
//! ```
//!
//! Weight decay applies to matrices only (embeddings, projections), never to norm weights or
//! Mamba's per-head vectors, as Megatron does. Gradients are clipped to a global L2 norm first.
//! The schedule is Megatron's: linear warmup from 0 to `lr` over `warmup` steps, then cosine
//! (or linear, or constant) decay to `min_lr` at the last step.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    #[default]
    Cosine,
    Linear,
    Constant,
}

/// Learning rate at `step` (0-based) of `steps`.
pub fn lr_at(step: u64, steps: u64, lr: f64, min_lr: f64, warmup: u64, decay: Decay) -> f64 {
    if warmup > 0 && step < warmup {
        return lr * (step + 1) as f64 / warmup as f64;
    }
    let span = steps.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup.min(step)) as f64 / span).clamp(0.0, 1.0);
    let coeff = match decay {
        Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
        Decay::Linear => 1.0 - progress,
        Decay::Constant => 1.0,
    };
    min_lr + (lr - min_lr) * coeff
}

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// The optimizer state: first and second moments per parameter, and the step count.
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    pub m: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub t: u64,
}

impl AdamW {
    pub fn new(sizes: &[usize]) -> AdamW {
        AdamW {
            m: sizes.iter().map(|n| vec![0.0; *n]).collect(),
            v: sizes.iter().map(|n| vec![0.0; *n]).collect(),
            t: 0,
        }
    }

    /// One update of every parameter. `decay[i]` says whether parameter `i` is weight-decayed.
    pub fn step(
        &mut self,
        weights: &mut [Vec<f32>],
        grads: &[Vec<f32>],
        decay: &[bool],
        lr: f64,
        c: &AdamWConfig,
    ) {
        self.t += 1;
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        let (b1, b2) = (c.beta1 as f32, c.beta2 as f32);
        for i in 0..weights.len() {
            let wd = if decay[i] { c.weight_decay as f32 } else { 0.0 };
            let (w, g, m, v) = (&mut weights[i], &grads[i], &mut self.m[i], &mut self.v[i]);
            let (lr, eps) = (lr as f32, c.eps as f32);
            let bc = (bc1 as f32, bc2 as f32);
            kernels::simd::adamw(w, g, m, v, (b1, b2), bc, lr, eps, wd);
        }
    }
}

/// The global L2 norm of all gradients (summed in f64, in parameter order: deterministic).
pub fn grad_norm(grads: &[Vec<f32>]) -> f64 {
    grads
        .iter()
        .map(|g| g.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>())
        .sum::<f64>()
        .sqrt()
}

/// Scale gradients so their global norm is at most `max_norm`; returns the norm before.
pub fn clip(grads: &mut [Vec<f32>], max_norm: f64) -> f64 {
    let norm = grad_norm(grads);
    if max_norm > 0.0 && norm > max_norm {
        let s = (max_norm / (norm + 1e-6)) as f32;
        for g in grads.iter_mut() {
            for x in g.iter_mut() {
                *x *= s;
            }
        }
    }
    norm
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_linearly_then_decays_to_min_lr() {
        let at = |s| lr_at(s, 110, 1e-3, 1e-4, 10, Decay::Cosine);
        assert!((at(0) - 1e-4).abs() < 1e-12 && (at(9) - 1e-3).abs() < 1e-12);
        assert!((at(10) - 1e-3).abs() < 1e-12);
        assert!(
            (at(60) - 5.5e-4).abs() < 1e-9,
            "half-way is the mean: {}",
            at(60)
        );
        assert!((at(110) - 1e-4).abs() < 1e-12);
        assert_eq!(lr_at(50, 100, 1.0, 0.0, 0, Decay::Linear), 0.5);
        assert_eq!(lr_at(99, 100, 1.0, 0.0, 0, Decay::Constant), 1.0);
    }

    #[test]
    fn adamw_first_step_moves_each_weight_by_lr_times_sign() {
        // With bias correction, step 1 is w -= lr·(g/(|g|+eps) + wd·w).
        let mut w = vec![vec![1.0f32, -2.0], vec![0.5]];
        let g = vec![vec![0.3f32, -4.0], vec![1e-3]];
        let mut opt = AdamW::new(&[2, 1]);
        let c = AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        opt.step(&mut w, &g, &[true, false], 0.01, &c);
        assert!((w[0][0] - (1.0 - 0.01 * (1.0 + 0.1))).abs() < 1e-6, "{w:?}");
        assert!(
            (w[0][1] - (-2.0 + 0.01 * (1.0 + 0.2))).abs() < 1e-6,
            "{w:?}"
        );
        assert!(
            (w[1][0] - (0.5 - 0.01)).abs() < 1e-5,
            "no decay on vectors: {w:?}"
        );
        assert_eq!(opt.t, 1);
    }

    #[test]
    fn clipping_caps_the_global_norm() {
        let mut g = vec![vec![3.0f32], vec![4.0]];
        assert_eq!(clip(&mut g, 1.0), 5.0);
        assert!((grad_norm(&g) - 1.0).abs() < 1e-5);
        let mut small = vec![vec![0.3f32]];
        clip(&mut small, 1.0);
        assert_eq!(small[0][0], 0.3);
    }
}
