//! What the kernels' tests share: seeded random tensors, the largest difference between two
//! results or their gradients, the masks and rotary tables of packed rows, and a launch on the
//! SIMT shim.

use crate::rope::{RopeTables, rope_angles};

pub use crate::rng::Rng;
pub use crate::simt::Schedule;
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

/// The values of `t`, flattened.
pub fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// The largest absolute difference between two results of the same length.
pub fn largest_gap(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The gradients of `Σ g ⊙ y` with respect to each of `vars`, flattened: what a kernel's
/// backward must produce for the upstream gradient `g`.
pub fn plain_grads(y: &Tensor, g: &Tensor, vars: &[&Var]) -> Vec<Vec<f32>> {
    let grads = (y * g).unwrap().sum_all().unwrap().backward().unwrap();
    vars.iter()
        .map(|v| values(grads.get(v.as_tensor()).unwrap()))
        .collect()
}

/// `run(schedule)` in the SIMT shim's two schedules (lowest warp first, then highest first),
/// which must give the same bytes: a difference is a race between warps. Returns the result.
pub fn in_both_schedules(
    at: &str,
    run: impl Fn(crate::simt::Schedule) -> Vec<Vec<f32>>,
) -> Vec<Vec<f32>> {
    let bits = |r: &[Vec<f32>]| -> Vec<Vec<u32>> {
        r.iter()
            .map(|v| v.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    let [forward, reversed] = crate::simt::SCHEDULES.map(run);
    assert!(
        bits(&forward) == bits(&reversed),
        "{at}: the two schedules disagree"
    );
    forward
}

/// Launches `name` on `shim` with `grid` blocks of `block` threads, panicking with the
/// kernel's name when the launch fails.
pub fn launch_on(
    shim: &crate::launch::Shim,
    name: &str,
    (grid, block): (u32, u32),
    args: &[crate::launch::Arg<'_, <crate::launch::Shim as crate::launch::Launcher>::Buffer>],
) {
    use crate::launch::{Geometry, Launcher};
    // SAFETY: each test sizes its buffers for the shapes it passes.
    let launched = unsafe { shim.launch(name, Geometry::linear(grid, block), args) };
    launched.unwrap_or_else(|e| panic!("{name}: {e}"));
}

/// Asserts |got − want| ≤ `tolerance` · the largest |want| (or 1e-30), naming the case.
pub fn assert_close(got: &[f32], want: &[f32], tolerance: f32, at: &str) {
    let largest = want.iter().fold(1e-30f32, |m, w| m.max(w.abs()));
    let gap = largest_gap(got, want);
    assert!(
        gap <= tolerance * largest,
        "{at}: {gap:e} apart, largest {largest:e}"
    );
}

/// bf16 values as the kernels store them (an f32's high half), widened back to f32.
pub fn widened(bits: &[u16]) -> Vec<f32> {
    bits.iter()
        .map(|b| f32::from_bits(u32::from(*b) << 16))
        .collect()
}

/// Whether `bf16` (widened) is `f32` rounded to bf16, to nearest with ties to even, bit for
/// bit: what a `_to_bf16` kernel must write, the bytes `cast_bf16` makes of the f32 kernel's.
pub fn rounded_to_bf16(f32s: &[f32], bf16: &[f32]) -> bool {
    let rounded = f32s.iter().map(|v| crate::linear::round_bf16(*v).to_bits());
    f32s.len() == bf16.len() && rounded.eq(bf16.iter().map(|v| v.to_bits()))
}
