//! What the kernels' tests share: seeded random tensors, the largest difference between two
//! results or their gradients, and the masks and rotary tables of packed rows.

use crate::rope::{RopeTables, rope_angles};

pub use crate::rng::Rng;
pub use candle_core::{Device, Tensor, Var};

/// `shape` of normal values with standard deviation `std`, from `rng`.
pub fn randn(rng: &mut Rng, shape: &[usize], std: f64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// For each of `vars`, the largest difference between its gradients of `Σ w ⊙ fused` and
/// of `Σ w ⊙ plain`.
pub fn grad_diffs(fused: &Tensor, plain: &Tensor, w: &Tensor, vars: &[&Var]) -> Vec<f32> {
    let grads = |y: &Tensor| (y * w).unwrap().sum_all().unwrap().backward().unwrap();
    let (gf, gp) = (grads(fused), grads(plain));
    vars.iter()
        .map(|v| {
            let t = v.as_tensor();
            max_diff(gf.get(t).unwrap(), gp.get(t).unwrap())
        })
        .collect()
}

/// The additive causal mask `(b, 1, t, t)` of rows packed with two segments, the second
/// starting at `cut` (`cut = t`: one segment, plain causal rows).
pub fn segment_mask(b: usize, t: usize, cut: usize) -> Tensor {
    let mut m = vec![f32::NEG_INFINITY; b * t * t];
    for r in 0..b {
        for i in 0..t {
            for j in 0..=i {
                if (i < cut) == (j < cut) {
                    m[(r * t + i) * t + j] = 0.0;
                }
            }
        }
    }
    Tensor::from_vec(m, (b, 1, t, t), &Device::Cpu).unwrap()
}

/// Llama's rotary tables (theta 10000) for `positions`, `b` rows of `t`.
pub fn rope_tables(d: usize, positions: &[u32], b: usize, t: usize) -> RopeTables {
    let (cos, sin) = rope_angles(d, 10000.0, positions);
    let cos = Tensor::from_vec(cos, (b, 1, t, d), &Device::Cpu).unwrap();
    let sin = Tensor::from_vec(sin, (b, 1, t, d), &Device::Cpu).unwrap();
    RopeTables::new(&cos, &sin).unwrap()
}
