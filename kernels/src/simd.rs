//! Element-wise f32 math over slices for the fused CPU ops and the optimizer, written so the
//! compiler vectorises it, and compiled for AVX-512, for AVX2 and for the baseline x86-64 with
//! the best one the CPU has picked at run time (the `multiversion` crate).
//!
//! Why: a release build targets baseline x86-64, which has only 4-lane SSE2, and `f32::exp` is a
//! libm call per element. Training a `-c tiny` model spent ~7 % of its time in `expf` alone and
//! ~15 % in element-wise loops (perf, docs/performance.md). Here `exp` is a short polynomial the
//! compiler inlines into 16-lane AVX-512 code.
//!
//! Results are the same bytes whichever version runs:
//! - no fused multiply-add: Rust never contracts `a * b + c` on its own, so AVX2/AVX-512 code
//!   rounds every product and sum exactly as the SSE2 code does;
//! - sums are written with a fixed number of lanes ([`LANES`] partial sums, element `i` into lane
//!   `i mod LANES`, combined pairwise in a fixed order), so every version adds the same numbers in
//!   the same order; `max` is exact in any order.
//!
//! Each function says which plain formula it computes; the tests hold them to it.

use multiversion::multiversion;

/// Partial sums in every reduction: one AVX-512 register of f32, two AVX2 registers.
pub const LANES: usize = 16;

/// `e^x` within 2 ulp (Cephes' `expf`): `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, a degree-7
/// polynomial for `e^r`, and `2^n` built in the exponent bits (as `2^(n−1)·2`, so that n = 128
/// near the top of the range still fits). `e^x` is 0 below −86.9 (`e^x` < 1.8e−38, near the
/// end of normal f32; `e^−∞` = 0) and +∞ above ln(f32::MAX); NaN stays NaN. Branch-free, so
/// it vectorises.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes' coefficients as published
pub fn exp(x: f32) -> f32 {
    const LO: f32 = -86.9;
    const HI: f32 = 88.722_83;
    // 1.5·2^23: adding and subtracting it rounds to the nearest integer (ties to even).
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(LO, HI);
    let shifted = xc * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    // n as an integer, read from the low mantissa bits of `shifted` (`n as i32` would be a
    // saturating conversion, which the compiler does lane by lane).
    let n_int = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    // ln 2 split in two so that n·C1 is exact.
    let r = (xc - n * 0.693_359_375) - n * -2.121_944_4e-4;
    let p = 1.987_569_15e-4;
    let p = p * r + 1.398_199_950_7e-3;
    let p = p * r + 8.333_451_907_3e-3;
    let p = p * r + 4.166_579_589_4e-2;
    let p = p * r + 1.666_666_545_9e-1;
    let p = p * r + 5.000_000_120_1e-1;
    let e_r = p * r * r + r + 1.0;
    let two_n_1 = f32::from_bits(((n_int + 126) as u32) << 23);
    let y = e_r * two_n_1 * 2.0;
    if x.is_nan() {
        x
    } else if x < LO {
        0.0
    } else if x > HI {
        f32::INFINITY
    } else {
        y
    }
}

/// `σ(x) = 1 / (1 + e^−x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// Combine lane sums pairwise in a fixed order: `(l0+l8) + (l4+l12) + …`.
#[inline(always)]
fn fold(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0]
}

/// `Σ_i f(x_i, y_i)` in [`LANES`] lanes (`x` and `y` of the same length).
#[inline(always)]
fn lane_sum(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let (xs, ys) = (x.chunks_exact(LANES), y.chunks_exact(LANES));
    let (xr, yr) = (xs.remainder(), ys.remainder());
    for (a, b) in xs.zip(ys) {
        for l in 0..LANES {
            acc[l] += f(a[l], b[l]);
        }
    }
    for (l, (a, b)) in xr.iter().zip(yr).enumerate() {
        acc[l] += f(*a, *b);
    }
    fold(acc)
}

/// `Σ a_i · b_i` (lanes as in the module doc).
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    lane_sum(&a[..n], &b[..n], |x, y| x * y)
}

/// `max_i x_i` (−∞ for an empty slice; NaNs are skipped, as `f32::max` does).
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for l in 0..LANES {
            acc[l] = acc[l].max(c[l]);
        }
    }
    for (a, v) in acc.iter_mut().zip(chunks.remainder()) {
        *a = a.max(*v);
    }
    acc.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `x_i ← e^(x_i − shift)` in place; returns `Σ_i` of the new values.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp(*v - shift);
    }
    lane_sum(x, x, |v, _| v)
}

/// `Σ_i e^(x_i − shift)`, nothing written.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn sum_exp_shifted(x: &[f32], shift: f32) -> f32 {
    lane_sum(x, x, |v, _| exp(v - shift))
}

/// Log-sum-exp `max + ln Σ_i e^(x_i − max)` of a row.
pub fn log_sum_exp(x: &[f32]) -> f32 {
    let m = max(x);
    m + sum_exp_shifted(x, m).ln()
}

/// `y_i = a · e^(x_i − shift)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn scaled_exp_shifted(x: &[f32], shift: f32, a: f32, y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y = a * exp(*x - shift);
    }
}

/// `x_i ← a · x_i`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn scale(x: &mut [f32], a: f32) {
    for v in x.iter_mut() {
        *v *= a;
    }
}

/// `x_i ← a · x_i + m_i`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn scale_add(x: &mut [f32], a: f32, m: &[f32]) {
    for (v, m) in x.iter_mut().zip(m) {
        *v = a * *v + *m;
    }
}

/// Softmax backward on one row in place: `g_j ← scale · p_j · (g_j − Σ_k g_k p_k)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn softmax_grad(p: &[f32], g: &mut [f32], scale: f32) {
    let n = p.len().min(g.len());
    let (p, g) = (&p[..n], &mut g[..n]);
    let d = lane_sum(p, g, |a, b| a * b);
    for (g, p) in g.iter_mut().zip(p) {
        *g = scale * p * (*g - d);
    }
}

/// `acc_i ← acc_i + x_i`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a += *b;
    }
}

/// SwiGLU forward on one row: `y_j = g_j · σ(g_j) · u_j`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn swiglu(g: &[f32], u: &[f32], y: &mut [f32]) {
    for ((y, g), u) in y.iter_mut().zip(g).zip(u) {
        *y = *g * sigmoid(*g) * *u;
    }
}

/// SwiGLU backward on one row: `du_j = dy_j · g_j · σ(g_j)`,
/// `dg_j = dy_j · u_j · σ(g_j) · (1 + g_j · (1 − σ(g_j)))`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn swiglu_grad(g: &[f32], u: &[f32], dy: &[f32], dg: &mut [f32], du: &mut [f32]) {
    let n = g
        .len()
        .min(u.len())
        .min(dy.len())
        .min(dg.len())
        .min(du.len());
    let (g, u, dy, dg, du) = (&g[..n], &u[..n], &dy[..n], &mut dg[..n], &mut du[..n]);
    for j in 0..n {
        let s = sigmoid(g[j]);
        du[j] = dy[j] * g[j] * s;
        dg[j] = dy[j] * u[j] * s * (1.0 + g[j] * (1.0 - s));
    }
}

/// RMSNorm on one row: `y_j = x_j · r · w_j` with `r = 1/sqrt(mean(x²) + eps)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let d = x.len().min(w.len()).min(y.len());
    let r = 1.0 / (lane_sum(&x[..d], &x[..d], |a, b| a * b) / d as f32 + eps).sqrt();
    for j in 0..d {
        y[j] = x[j] * r * w[j];
    }
}

/// [`rms_norm`]'s backward on one row, from the input `x` and the incoming gradient `g`:
/// `dx = r·(g ⊙ w) − x · r³/D · Σ_j g_j w_j x_j`, and `dw += g ⊙ x · r` (added into the caller's
/// running sum over rows). `gw` is scratch of `D`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn rms_norm_grad(
    (x, w, g): (&[f32], &[f32], &[f32]),
    eps: f32,
    gw: &mut [f32],
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let d = x.len().min(w.len()).min(g.len());
    let d = d.min(gw.len()).min(dx.len()).min(dw.len());
    let (x, gw) = (&x[..d], &mut gw[..d]);
    for j in 0..d {
        gw[j] = g[j] * w[j];
    }
    let r = 1.0 / (lane_sum(x, x, |a, b| a * b) / d as f32 + eps).sqrt();
    let k = r * r * r * lane_sum(gw, x, |a, b| a * b) / d as f32;
    for j in 0..d {
        dw[j] += g[j] * x[j] * r;
        dx[j] = r * gw[j] - k * x[j];
    }
}

/// Squared ReLU: `y_j = max(h_j, 0)²`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn relu2(h: &[f32], y: &mut [f32]) {
    for (y, h) in y.iter_mut().zip(h) {
        let r = h.max(0.0);
        *y = r * r;
    }
}

/// Squared ReLU backward: `dh_j = dy_j · 2·max(h_j, 0)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn relu2_grad(h: &[f32], dy: &[f32], dh: &mut [f32]) {
    for ((dh, h), dy) in dh.iter_mut().zip(h).zip(dy) {
        *dh = *dy * (2.0 * h.max(0.0));
    }
}

/// `acc_j ← acc_j + a_j · b_j` (a product, then a sum: rounded twice, never fused).
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn mul_add_assign(acc: &mut [f32], a: &[f32], b: &[f32]) {
    for ((acc, a), b) in acc.iter_mut().zip(a).zip(b) {
        *acc += *a * *b;
    }
}

/// SiLU in place: `x_j ← x_j · σ(x_j)`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn silu_in_place(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v *= sigmoid(*v);
    }
}

/// SiLU backward: `dx_j = dy_j · σ(x_j)·(1 + x_j·(1 − σ(x_j)))`.
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn silu_grad(x: &[f32], dy: &[f32], dx: &mut [f32]) {
    for ((dx, x), dy) in dx.iter_mut().zip(x).zip(dy) {
        let s = sigmoid(*x);
        *dx = *dy * (s * (1.0 + *x * (1.0 - s)));
    }
}

/// Gated RMSNorm on one row of `D` channels in `groups` contiguous groups (Mamba-2's step 5):
/// `v = y ⊙ silu(z)`, per group `r = 1/sqrt(mean(v²) + eps)`, `out = v · r ⊙ w`.
/// `v` is written too (scratch of `D`).
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn gated_norm(
    y: &[f32],
    z: &[f32],
    w: &[f32],
    (groups, eps): (usize, f32),
    v: &mut [f32],
    out: &mut [f32],
) {
    let d = y
        .len()
        .min(z.len())
        .min(w.len())
        .min(v.len())
        .min(out.len());
    for j in 0..d {
        v[j] = y[j] * (z[j] * sigmoid(z[j]));
    }
    let gs = d / groups.max(1);
    for g in 0..groups {
        let at = g * gs..(g + 1) * gs;
        let vg = &v[at.clone()];
        let r = 1.0 / (lane_sum(vg, vg, |a, b| a * b) / gs as f32 + eps).sqrt();
        for j in at {
            out[j] = v[j] * r * w[j];
        }
    }
}

/// [`gated_norm`]'s backward on one row, from its inputs and the incoming gradient `g`:
/// with `s = silu(z)`, `v = y ⊙ s` and per group `r`, `dv = r·(g ⊙ w) − v · r³/gs · Σ(g ⊙ w ⊙ v)`;
/// then `dy = dv ⊙ s`, `dz = dv ⊙ y ⊙ σ(z)·(1 + z·(1 − σ(z)))`, and `dw += g ⊙ v · r` (added
/// into the caller's running sum over rows).
#[allow(clippy::too_many_arguments)]
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn gated_norm_grad(
    (y, z, w, g): (&[f32], &[f32], &[f32], &[f32]),
    (groups, eps): (usize, f32),
    v: &mut [f32],
    gw: &mut [f32],
    dy: &mut [f32],
    dz: &mut [f32],
    dw: &mut [f32],
) {
    let d = y.len().min(z.len()).min(w.len()).min(g.len());
    let d = d
        .min(v.len())
        .min(gw.len())
        .min(dy.len())
        .min(dz.len())
        .min(dw.len());
    // σ(z) is kept in `dz` until the second pass overwrites it with the gradient.
    for j in 0..d {
        dz[j] = sigmoid(z[j]);
        v[j] = y[j] * (z[j] * dz[j]);
        gw[j] = g[j] * w[j];
    }
    let gs = d / groups.max(1);
    for grp in 0..groups {
        let at = grp * gs..(grp + 1) * gs;
        let (vg, gwg) = (&v[at.clone()], &gw[at.clone()]);
        let r = 1.0 / (lane_sum(vg, vg, |a, b| a * b) / gs as f32 + eps).sqrt();
        let k = r * r * r * lane_sum(gwg, vg, |a, b| a * b) / gs as f32;
        for j in at {
            let dv = r * gw[j] - k * v[j];
            let s = dz[j];
            dy[j] = dv * (z[j] * s);
            dz[j] = dv * y[j] * (s * (1.0 + z[j] * (1.0 - s)));
            dw[j] += g[j] * v[j] * r;
        }
    }
}

/// One AdamW update of a parameter tensor, element by element:
/// `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
/// `w ← w − lr·((m/bc1) / (sqrt(v/bc2) + eps) + wd·w)`.
#[allow(clippy::too_many_arguments)]
#[multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2"))]
pub fn adamw(
    w: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    (b1, b2): (f32, f32),
    (bc1, bc2): (f32, f32),
    lr: f32,
    eps: f32,
    wd: f32,
) {
    let n = w.len().min(g.len()).min(m.len()).min(v.len());
    let (w, g, m, v) = (&mut w[..n], &g[..n], &mut m[..n], &mut v[..n]);
    for j in 0..n {
        m[j] = b1 * m[j] + (1.0 - b1) * g[j];
        v[j] = b2 * v[j] + (1.0 - b2) * g[j] * g[j];
        let update = (m[j] / bc1) / ((v[j] / bc2).sqrt() + eps);
        w[j] -= lr * (update + wd * w[j]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm_over_the_whole_range() {
        let mut worst = (0u32, 0f32);
        let mut x = -86.9f32;
        while x < 88.72 {
            let (ours, libm) = (exp(x), x.exp());
            let d = ulps(ours, libm);
            if d > worst.0 {
                worst = (d, x);
            }
            x += 0.000_37;
        }
        assert!(worst.0 <= 2, "{} ulp at x = {}", worst.0, worst.1);
    }

    #[test]
    fn exp_edges() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert!(
            ulps(exp(88.72), 88.72f32.exp()) <= 2,
            "n = 128 at the top of the range"
        );
        assert_eq!(exp(88.73), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(100.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        assert!((exp(1.0) - std::f32::consts::E).abs() <= f32::EPSILON * 3.0);
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32 ^ seed).wrapping_mul(2_654_435_761) >> 8;
                (h as f32 / (1u32 << 24) as f32) * 8.0 - 4.0
            })
            .collect()
    }

    #[test]
    fn reductions_match_their_formulas_for_every_length() {
        for n in [0, 1, 5, 15, 16, 17, 31, 100, 635] {
            let (a, b) = (data(n, 1), data(n, 2));
            let plain: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!(
                (dot(&a, &b) as f64 - plain).abs() < 1e-4 * (1.0 + n as f64),
                "dot n={n}"
            );
            let m = a.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            assert_eq!(max(&a), m, "max n={n}");
            let lse: f64 = a.iter().map(|x| (*x as f64).exp()).sum::<f64>().ln();
            if n > 0 {
                assert!((log_sum_exp(&a) as f64 - lse).abs() < 1e-5, "lse n={n}");
            }
            let mut e = a.clone();
            let s = exp_shifted(&mut e, 1.5);
            for (e, x) in e.iter().zip(&a) {
                assert!((e - (x - 1.5).exp()).abs() <= 2e-7 * e.abs().max(1.0));
            }
            let plain: f32 = e.iter().sum();
            assert!((s - plain).abs() <= 1e-5 * plain.abs().max(1.0));
        }
    }

    #[test]
    fn lane_sums_add_in_the_documented_order() {
        // Element i goes to lane i mod 16 and the lanes fold pairwise, (l0+l8) first. In order,
        // 1e8 − 1e8 + 1 = 1; in lanes, lane 0 holds 1e8 + 1 = 1e8 (f32) and lane 8 cancels it.
        let mut x = vec![0f32; 32];
        x[0] = 1e8;
        x[8] = -1e8;
        x[16] = 1.0;
        let ones = vec![1f32; 32];
        assert_eq!(x.iter().sum::<f32>(), 1.0);
        assert_eq!(dot(&x, &ones), 0.0);
    }

    /// The dispatched kernels (AVX-512 or AVX2 where the CPU has them) against the same
    /// formulas in plain loops, which the test binary compiles for baseline x86-64: the bytes
    /// must not depend on the instruction set.
    #[test]
    fn the_vectorised_versions_give_the_baseline_bytes() {
        let (g, u, dy) = (data(1000, 11), data(1000, 12), data(1000, 13));
        let mut y = vec![0f32; 1000];
        swiglu(&g, &u, &mut y);
        let plain: Vec<f32> = (0..1000).map(|j| g[j] * sigmoid(g[j]) * u[j]).collect();
        assert_eq!(y, plain);
        let (mut dg, mut du) = (vec![0f32; 1000], vec![0f32; 1000]);
        swiglu_grad(&g, &u, &dy, &mut dg, &mut du);
        for j in 0..1000 {
            let s = sigmoid(g[j]);
            assert_eq!(du[j], dy[j] * g[j] * s);
            assert_eq!(dg[j], dy[j] * u[j] * s * (1.0 + g[j] * (1.0 - s)));
        }
        let mut e = g.clone();
        let sum = exp_shifted(&mut e, 0.5);
        let plain: Vec<f32> = g.iter().map(|x| exp(x - 0.5)).collect();
        assert_eq!(e, plain);
        let mut lanes = [0f32; LANES];
        for (i, v) in plain.iter().enumerate() {
            lanes[i % LANES] += v;
        }
        assert_eq!(sum, fold(lanes));
        assert_eq!(dot(&g, &u), {
            let mut lanes = [0f32; LANES];
            for i in 0..1000 {
                lanes[i % LANES] += g[i] * u[i];
            }
            fold(lanes)
        });
    }

    /// `Σ f(j)` over `range` in the lanes of [`lane_sum`]: element `i` of the range into lane
    /// `i mod LANES`, folded in [`fold`]'s order.
    fn lanes_of(f: impl Fn(usize) -> f32, range: std::ops::Range<usize>) -> f32 {
        let mut lanes = [0f32; LANES];
        for (i, j) in range.enumerate() {
            lanes[i % LANES] += f(j);
        }
        fold(lanes)
    }

    /// The kernels of the fused relu², conv, RMSNorm and gated-norm ops against their formulas
    /// in plain loops compiled for baseline x86-64; widths that are not multiples of 16 take the
    /// remainder path.
    #[test]
    fn the_norm_and_activation_kernels_give_the_baseline_bytes() {
        let n = 1000;
        let (h, dy, w, z) = (data(n, 21), data(n, 22), data(n, 23), data(n, 24));
        let (mut y, mut dh) = (vec![0f32; n], vec![0f32; n]);
        relu2(&h, &mut y);
        relu2_grad(&h, &dy, &mut dh);
        let mut s = h.clone();
        silu_in_place(&mut s);
        let mut ds = vec![0f32; n];
        silu_grad(&h, &dy, &mut ds);
        let mut acc = w.clone();
        mul_add_assign(&mut acc, &h, &dy);
        for j in 0..n {
            let r = h[j].max(0.0);
            assert_eq!((y[j], dh[j]), (r * r, dy[j] * (2.0 * r)));
            let sg = sigmoid(h[j]);
            assert_eq!(s[j], h[j] * sg);
            assert_eq!(ds[j], dy[j] * (sg * (1.0 + h[j] * (1.0 - sg))));
            assert_eq!(acc[j], w[j] + h[j] * dy[j]);
        }

        let eps = 1e-5;
        rms_norm(&h, &w, eps, &mut y);
        let (mut gw, mut dx, mut dw) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        rms_norm_grad((&h, &w, &dy), eps, &mut gw, &mut dx, &mut dw);
        let r = 1.0 / (lanes_of(|j| h[j] * h[j], 0..n) / n as f32 + eps).sqrt();
        let k = r * r * r * lanes_of(|j| (dy[j] * w[j]) * h[j], 0..n) / n as f32;
        for j in 0..n {
            assert_eq!(y[j], h[j] * r * w[j]);
            assert_eq!(dx[j], r * (dy[j] * w[j]) - k * h[j]);
            assert_eq!(dw[j], dy[j] * h[j] * r);
        }

        let (groups, gs) = (5, 200);
        let v: Vec<f32> = (0..n).map(|j| h[j] * (z[j] * sigmoid(z[j]))).collect();
        let mut scratch = vec![0f32; n];
        gated_norm(&h, &z, &w, (groups, eps), &mut scratch, &mut y);
        let (mut dyy, mut dz, mut dw) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
        let inputs = (h.as_slice(), z.as_slice(), w.as_slice(), dy.as_slice());
        gated_norm_grad(
            inputs,
            (groups, eps),
            &mut scratch,
            &mut gw,
            &mut dyy,
            &mut dz,
            &mut dw,
        );
        for g in 0..groups {
            let at = g * gs..(g + 1) * gs;
            let r = 1.0 / (lanes_of(|j| v[j] * v[j], at.clone()) / gs as f32 + eps).sqrt();
            let k = r * r * r * lanes_of(|j| (dy[j] * w[j]) * v[j], at.clone()) / gs as f32;
            for j in at {
                assert_eq!(y[j], v[j] * r * w[j]);
                let dv = r * (dy[j] * w[j]) - k * v[j];
                let sg = sigmoid(z[j]);
                assert_eq!(dyy[j], dv * (z[j] * sg));
                assert_eq!(dz[j], dv * h[j] * (sg * (1.0 + z[j] * (1.0 - sg))));
                assert_eq!(dw[j], dy[j] * v[j] * r);
            }
        }
    }

    #[test]
    fn swiglu_and_adamw_match_their_formulas() {
        let (g, u, dy) = (data(37, 3), data(37, 4), data(37, 5));
        let mut y = vec![0f32; 37];
        swiglu(&g, &u, &mut y);
        let (mut dg, mut du) = (vec![0f32; 37], vec![0f32; 37]);
        swiglu_grad(&g, &u, &dy, &mut dg, &mut du);
        for j in 0..37 {
            let s = 1.0 / (1.0 + (-g[j] as f64).exp());
            let (g, u, dy) = (g[j] as f64, u[j] as f64, dy[j] as f64);
            assert!((y[j] as f64 - g * s * u).abs() < 1e-5);
            assert!((du[j] as f64 - dy * g * s).abs() < 1e-5);
            assert!((dg[j] as f64 - dy * u * s * (1.0 + g * (1.0 - s))).abs() < 1e-5);
        }
        let (mut w, gr, mut m, mut v) = (data(20, 6), data(20, 7), data(20, 8), data(20, 9));
        for x in v.iter_mut() {
            *x = x.abs();
        }
        let (w0, m0, v0) = (w.clone(), m.clone(), v.clone());
        adamw(
            &mut w,
            &gr,
            &mut m,
            &mut v,
            (0.9, 0.95),
            (0.5, 0.3),
            1e-2,
            1e-8,
            0.1,
        );
        for j in 0..20 {
            let mj = 0.9 * m0[j] + (1.0 - 0.9f32) * gr[j];
            let vj = 0.95 * v0[j] + (1.0 - 0.95f32) * gr[j] * gr[j];
            let wj = w0[j] - 1e-2 * ((mj / 0.5) / ((vj / 0.3).sqrt() + 1e-8) + 0.1 * w0[j]);
            assert_eq!((m[j], v[j], w[j]), (mj, vj, wj));
        }
    }
}
