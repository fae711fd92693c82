//! `y = x · wᵀ` for `x` of any rank ≥ 2 and a weight stored `(out, in)` as in PyTorch
//! (`torch.nn.functional.linear` without bias).
//!
//! Backward: `dx = g · w`, `dw = gᵀ · x`. Must match: [`linear_plain`] within 1e-5.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};

use crate::launch::{Arg, Geometry};

// 1. Reference ----------------------------------------------------------------------------

/// `x @ wᵀ` from candle ops: the spec the fused op is tested against.
pub fn linear_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let last = dims[dims.len() - 1];
    let rows = x.elem_count() / last;
    let y = x.reshape((rows, last))?.matmul(&w.t()?)?;
    let mut out = dims.to_vec();
    let n = out.len();
    out[n - 1] = w.dim(0)?;
    y.reshape(out)
}

/// `v` rounded to bf16 (to nearest, ties to even) for a finite `v`, back as an f32: what
/// `cast_bf16` and `gemm_bf16_f32` do to an operand.
pub fn round_bf16(v: f32) -> f32 {
    let bits = v.to_bits();
    f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

/// `gemm` on the host in f64, its operands as its precision holds them (rounded to bf16 for
/// [`Precision::Bf16`]): each output's value, and the size its sum's rounding scales with
/// (`Σ|alpha·a·b| + |beta·c|`). What linear.cu's GEMMs, and cuBLASLt's bf16 products, are
/// held to.
pub fn gemm_reference(g: &Gemm, a: &[f32], b: &[f32], c: &[f32]) -> Vec<(f64, f64)> {
    let (m, n, k) = (g.m, g.n, g.k);
    let operand = |v: f32| f64::from(if g.is_bf16() { round_bf16(v) } else { v });
    let at = |row: usize, kk: usize| {
        operand(if g.trans_a {
            a[kk * m + row]
        } else {
            a[row * k + kk]
        })
    };
    let bt = |kk: usize, col: usize| {
        operand(if g.trans_b {
            b[col * k + kk]
        } else {
            b[kk * n + col]
        })
    };
    let (alpha, beta) = (f64::from(g.alpha), f64::from(g.beta));
    let mut out = Vec::with_capacity(m * n);
    for row in 0..m {
        for col in 0..n {
            let terms = (0..k).map(|kk| alpha * at(row, kk) * bt(kk, col));
            let (sum, size) = terms.fold((0f64, 0f64), |(s, z), t| (s + t, z + t.abs()));
            let before = beta * f64::from(c[row * n + col]);
            out.push((sum + before, size + before.abs()));
        }
    }
    out
}

// 2. CPU, one graph node with its backward -------------------------------------------------

struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let mut dims = l1.shape().dims().to_vec();
        match dims.last_mut() {
            Some(last) if *last == k && k > 0 => *last = n,
            _ => bail!(
                "linear: input {:?} for a weight {:?}",
                l1.shape(),
                l2.shape()
            ),
        }
        if !l1.is_contiguous() {
            bail!("linear: input is not contiguous")
        }
        let m = l1.shape().elem_count() / k;
        // candle's own GEMM on the storages: x (m×k) · wᵀ (the weight's layout transposed).
        let lhs = Layout::contiguous_with_offset((m, k), l1.start_offset());
        let out = s1.matmul(s2, (1, m, n, k), &lhs, &l2.transpose(0, 1)?)?;
        Ok((out, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, k) = w.dims2()?;
        let m = x.elem_count() / k;
        let g = grad.reshape((m, n))?;
        let dx = g.matmul(w)?.reshape(x.shape())?;
        let dw = g.t()?.matmul(&x.reshape((m, k))?)?;
        Ok((Some(dx), Some(dw)))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// `x · wᵀ` for `x` `(…, K)` and `w` `(N, K)`. On the CPU one graph node: forward
/// `x.reshape(rows, K).matmul(wᵀ)` straight on the storages, backward `dx = g · w`,
/// `dw = gᵀ · x` over the rows. Written out of candle ops ([`linear_plain`]: reshape,
/// transpose, matmul, reshape) each view is a node whose backward allocates a zero gradient
/// and adds into it; here there is one node. [`linear_plain`] elsewhere.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !(x.device().is_cpu() && w.device().is_cpu()) {
        return linear_plain(x, w);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear)
}

/// The arithmetic of a matrix product's operands. Every product accumulates in f32 and writes
/// f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 operands: linear.cu's `gemm_f32`, each output one fmaf chain over k in order, so
    /// the GPU and the SIMT shim write the same bytes.
    #[default]
    F32,
    /// Operands rounded to bf16, products summed in f32, as Megatron-LM's bf16 training
    /// multiplies: cuBLASLt on a GPU that has it, `gemm_bf16_f32` elsewhere (the same
    /// arithmetic, summed in another order).
    Bf16,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The linear.cu kernel that multiplies at this precision.
    pub fn kernel(self) -> &'static str {
        match self {
            Precision::F32 => "gemm_f32",
            Precision::Bf16 => "gemm_bf16_f32",
        }
    }
}

/// One product `c = alpha · op(a) · op(b) + beta · c` of row-major f32 matrices: op(a) is
/// m × k (`a` stored k × m when `trans_a`), op(b) is k × n (`b` stored n × k when `trans_b`),
/// c is m × n. [`crate::launch::Launcher::gemm`] runs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub trans_a: bool,
    pub trans_b: bool,
    pub alpha: f32,
    pub beta: f32,
    pub precision: Precision,
    /// Whether `a` and `b` are stored as bf16 (what linear.cu's `cast_bf16` would write from
    /// their f32 values, so the product's bytes are the same), to be read as they are: written
    /// so by the kernel that made them, they save the product a cast. An operand stored as
    /// bf16 makes the product a bf16 one, whatever `precision` says.
    pub bf16_inputs: (bool, bool),
}

impl Gemm {
    /// Whether its operands are bf16: rounded so, or stored so.
    pub fn is_bf16(&self) -> bool {
        self.precision == Precision::Bf16 || self.bf16_inputs != (false, false)
    }

    /// The linear.cu kernel that computes it.
    pub fn kernel(&self) -> &'static str {
        match (self.precision, self.bf16_inputs) {
            (precision, (false, false)) => precision.kernel(),
            (_, (true, false)) => "gemm_bf16_f32_a16",
            (_, (false, true)) => "gemm_bf16_f32_b16",
            (_, (true, true)) => "gemm_bf16_f32_ab16",
        }
    }

    /// The kernel's arguments, in its parameters' order.
    pub fn args<'a, B>(&self, a: Arg<'a, B>, b: Arg<'a, B>, c: Arg<'a, B>) -> [Arg<'a, B>; 13] {
        [
            a,
            b,
            c,
            Arg::I32(self.m as i32),
            Arg::I32(self.n as i32),
            Arg::I32(self.k as i32),
            Arg::I32(i32::from(self.trans_a)),
            Arg::I32(i32::from(self.trans_b)),
            Arg::F32(self.alpha),
            Arg::F32(self.beta),
            Arg::I64(0),
            Arg::I64(0),
            Arg::I64(0),
        ]
    }
}

/// The launch of linear.cu's `gemm_f32` for `batches` products of `m × n` outputs: a block of
/// 256 threads for each 128 × 128 tile of C.
pub fn gemm_geometry(m: usize, n: usize, batches: usize) -> Geometry {
    Geometry {
        grid: [
            n.div_ceil(128).max(1) as u32,
            m.div_ceil(128).max(1) as u32,
            batches.max(1) as u32,
        ],
        block: [256, 1, 1],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn linear_matches_the_plain_ops_forward_and_backward() {
        for dims in [vec![1, 1], vec![5, 7], vec![2, 9, 33], vec![2, 3, 4, 16]] {
            let mut rng = Rng::new(dims.iter().product::<usize>() as u64);
            let k = *dims.last().unwrap();
            let x = Var::from_tensor(&randn(&mut rng, &dims, 1.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[6, k], 1.0)).unwrap();
            let fused = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let plain = linear_plain(x.as_tensor(), w.as_tensor()).unwrap();
            assert_eq!(fused.dims(), plain.dims());
            assert!(
                max_diff(&fused, &plain) < 1e-5,
                "{}",
                max_diff(&fused, &plain)
            );
            let g = randn(&mut rng, plain.dims(), 1.0);
            for diff in grad_diffs(&fused, &plain, &g, &[&x, &w]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
        // A view with an offset (a narrowed input) goes through `contiguous` first.
        let mut rng = Rng::new(1);
        let x = randn(&mut rng, &[4, 10], 1.0).narrow(1, 2, 5).unwrap();
        let w = randn(&mut rng, &[3, 5], 1.0);
        let plain = linear_plain(&x, &w).unwrap();
        assert!(max_diff(&linear(&x, &w).unwrap(), &plain) < 1e-5);
        let bad = randn(&mut rng, &[3, 4], 1.0);
        assert!(linear(&x, &bad).is_err(), "a weight of the wrong width");
    }

    /// linear.cu's GEMM `kernel` through the SIMT shim: `alpha · op(a) · op(b) + beta · c`
    /// over `batches`, op(a) m×k and op(b) k×n.
    fn cuda_gemm<A, B>(
        kernel: &str,
        (a, b, c): (&[A], &[B], &[f32]),
        (m, n, k, batches): (usize, usize, usize, usize),
        (trans_a, trans_b): (bool, bool),
        (alpha, beta): (f32, f32),
        schedule: Schedule,
    ) -> Vec<f32> {
        use crate::simt::{arg, launch};
        let mut c = c.to_vec();
        let (ap, bp, cp) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
        let (mi, ni, ki) = (m as i32, n as i32, k as i32);
        let (ta, tb) = (i32::from(trans_a), i32::from(trans_b));
        let strides = ((m * k) as i64, (k * n) as i64, (m * n) as i64);
        let params = [
            arg(&ap),
            arg(&bp),
            arg(&cp),
            arg(&mi),
            arg(&ni),
            arg(&ki),
            arg(&ta),
            arg(&tb),
            arg(&alpha),
            arg(&beta),
            arg(&strides.0),
            arg(&strides.1),
            arg(&strides.2),
        ];
        let g = gemm_geometry(m, n, batches);
        // SAFETY: a, b and c hold `batches` matrices of m×k, k×n and m×n values.
        unsafe { launch(kernel, g.grid, g.block, schedule, &params) }.unwrap();
        c
    }

    /// The GEMM of linear.cu, executed by the SIMT shim, against candle's matmul within 1e-5
    /// of the result's scale: every transpose, batches, alpha and beta, sizes that are not
    /// multiples of the tile and span several tiles, in both schedules. Then linear's three products through it.
    #[test]
    fn the_cuda_gemm_matches_candles_matmul() {
        let t =
            |v: &[f32], dims: &[usize]| Tensor::from_vec(v.to_vec(), dims, &Device::Cpu).unwrap();
        for (m, n, k, batches) in [
            (1, 1, 1, 1),
            (5, 3, 7, 2),
            (17, 33, 29, 1),
            (40, 24, 50, 3),
            (131, 260, 21, 2), // several tiles each way, k not a multiple of the slice
        ] {
            let mut rng = Rng::new((m * n * k) as u64);
            for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = values(&randn(&mut rng, &[batches, m * k], 1.0));
                let b = values(&randn(&mut rng, &[batches, k * n], 1.0));
                let c = values(&randn(&mut rng, &[batches, m * n], 1.0));
                let (alpha, beta) = (0.5f32, 2.0f32);
                let op = |v: &[f32], rows, cols, trans: bool| {
                    let stored = if trans {
                        [batches, cols, rows]
                    } else {
                        [batches, rows, cols]
                    };
                    let x = t(v, &stored);
                    if trans { x.transpose(1, 2).unwrap() } else { x }
                };
                let want = (op(&a, m, k, trans_a)
                    .matmul(&op(&b, k, n, trans_b))
                    .unwrap()
                    * f64::from(alpha))
                .unwrap()
                .add(&(t(&c, &[batches, m, n]) * f64::from(beta)).unwrap())
                .unwrap();
                let want = values(&want);
                let at =
                    format!("m {m}, n {n}, k {k}, batches {batches}, trans {trans_a}/{trans_b}");
                let got = in_both_schedules(&at, |s| {
                    vec![cuda_gemm(
                        "gemm_f32",
                        (&a, &b, &c),
                        (m, n, k, batches),
                        (trans_a, trans_b),
                        (alpha, beta),
                        s,
                    )]
                });
                let gap = largest_gap(&got[0], &want);
                assert!(gap < 1e-5 * (k as f32).sqrt().max(1.0) * 4.0, "{at}: {gap}");
            }
        }
        // linear's forward and backward, as its three GEMMs.
        let (m, n, k) = (9, 6, 33);
        let mut rng = Rng::new(3);
        let x = Var::from_tensor(&randn(&mut rng, &[m, k], 1.0)).unwrap();
        let w = Var::from_tensor(&randn(&mut rng, &[n, k], 1.0)).unwrap();
        let g = randn(&mut rng, &[m, n], 1.0);
        let y = linear_plain(x.as_tensor(), w.as_tensor()).unwrap();
        let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (xv, wv, gv) = (values(x.as_tensor()), values(w.as_tensor()), values(&g));
        let gemm = |a: &[f32], b: &[f32], dims: (usize, usize, usize), trans| {
            cuda_gemm(
                "gemm_f32",
                (a, b, &vec![0.0; dims.0 * dims.1]),
                (dims.0, dims.1, dims.2, 1),
                trans,
                (1.0, 0.0),
                Schedule::Forward,
            )
        };
        let y_cuda = gemm(&xv, &wv, (m, n, k), (false, true));
        let dx = gemm(&gv, &wv, (m, k, n), (false, false));
        let dw = gemm(&gv, &xv, (n, k, m), (true, false));
        assert!(largest_gap(&y_cuda, &values(&y)) < 1e-5);
        assert!(largest_gap(&dx, &values(grads.get(x.as_tensor()).unwrap())) < 1e-5);
        assert!(largest_gap(&dw, &values(grads.get(w.as_tensor()).unwrap())) < 1e-5);
    }

    /// The bf16 GEMM with A, B or both stored as bf16 (the bits `cast_bf16` writes) gives the
    /// bytes it gives from the f32 operands, in every transpose, in both schedules; and
    /// [`Gemm::kernel`] names each variant.
    #[test]
    fn operands_stored_as_bf16_give_the_bytes_of_the_ones_rounded_as_loaded() {
        let bits = |v: &[f32]| -> Vec<u16> {
            v.iter()
                .map(|x| (round_bf16(*x).to_bits() >> 16) as u16)
                .collect()
        };
        for (m, n, k) in [(5, 3, 7), (131, 260, 21)] {
            let mut rng = Rng::new((m * n * k) as u64 + 11);
            for trans in [(false, false), (true, false), (false, true), (true, true)] {
                let a = values(&randn(&mut rng, &[m * k], 1.0));
                let b = values(&randn(&mut rng, &[k * n], 1.0));
                let c = values(&randn(&mut rng, &[m * n], 1.0));
                let (a16, b16) = (bits(&a), bits(&b));
                let at = format!("m {m}, n {n}, k {k}, trans {trans:?}");
                let run = |kernel, s| match kernel {
                    "gemm_bf16_f32_a16" => {
                        cuda_gemm(kernel, (&a16, &b, &c), (m, n, k, 1), trans, (0.5, 2.0), s)
                    }
                    "gemm_bf16_f32_b16" => {
                        cuda_gemm(kernel, (&a, &b16, &c), (m, n, k, 1), trans, (0.5, 2.0), s)
                    }
                    "gemm_bf16_f32_ab16" => {
                        cuda_gemm(kernel, (&a16, &b16, &c), (m, n, k, 1), trans, (0.5, 2.0), s)
                    }
                    _ => cuda_gemm(kernel, (&a, &b, &c), (m, n, k, 1), trans, (0.5, 2.0), s),
                };
                let want = run("gemm_bf16_f32", Schedule::Forward);
                for (inputs, kernel) in [
                    ((true, false), "gemm_bf16_f32_a16"),
                    ((false, true), "gemm_bf16_f32_b16"),
                    ((true, true), "gemm_bf16_f32_ab16"),
                ] {
                    let g = Gemm {
                        m,
                        n,
                        k,
                        trans_a: trans.0,
                        trans_b: trans.1,
                        alpha: 0.5,
                        beta: 2.0,
                        precision: Precision::F32,
                        bf16_inputs: inputs,
                    };
                    assert_eq!(g.kernel(), kernel);
                    let got = in_both_schedules(&at, |s| vec![run(kernel, s)]);
                    let same = got[0]
                        .iter()
                        .zip(&want)
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{at}: {kernel} differs from gemm_bf16_f32");
                }
            }
        }
    }

    /// [`gemm_reference`]'s values at `precision`, as f32.
    fn host_gemm(
        (a, b, c): (&[f32], &[f32], &[f32]),
        (m, n, k): (usize, usize, usize),
        (trans_a, trans_b): (bool, bool),
        (alpha, beta): (f32, f32),
        precision: Precision,
    ) -> Vec<f32> {
        let g = Gemm {
            m,
            n,
            k,
            trans_a,
            trans_b,
            alpha,
            beta,
            precision,
            bf16_inputs: (false, false),
        };
        let reference = gemm_reference(&g, a, b, c);
        reference.iter().map(|(v, _)| *v as f32).collect()
    }

    /// `gemm_bf16_f32`, through the SIMT shim: the product of the operands rounded to bf16
    /// (as `half` rounds: to nearest, ties to even), summed in f32 — within f32's error of the
    /// same product summed in f64 on the host, in every transpose, at sizes that are not
    /// multiples of the tile, in both schedules. And not the f32 product: the operands were
    /// rounded (the f32 GEMM's result is further from it than bf16's rounding allows).
    #[test]
    fn the_bf16_gemm_multiplies_the_operands_rounded_to_bf16() {
        for (m, n, k) in [(1, 1, 1), (5, 3, 7), (17, 33, 29), (131, 260, 21)] {
            let mut rng = Rng::new((m * n * k) as u64 + 7);
            for trans in [(false, false), (true, false), (false, true), (true, true)] {
                let a = values(&randn(&mut rng, &[m * k], 1.0));
                let b = values(&randn(&mut rng, &[k * n], 1.0));
                let c = values(&randn(&mut rng, &[m * n], 1.0));
                let scalars = (0.5f32, 2.0f32);
                let at = format!("m {m}, n {n}, k {k}, trans {trans:?}");
                let got = in_both_schedules(&at, |s| {
                    vec![cuda_gemm(
                        "gemm_bf16_f32",
                        (&a, &b, &c),
                        (m, n, k, 1),
                        trans,
                        scalars,
                        s,
                    )]
                });
                let want = host_gemm((&a, &b, &c), (m, n, k), trans, scalars, Precision::Bf16);
                let f32_sum_error = 1e-5 * (k as f32).sqrt().max(1.0) * 4.0;
                let gap = largest_gap(&got[0], &want);
                assert!(gap < f32_sum_error, "{at}: {gap}");
                if k >= 7 {
                    let unrounded =
                        host_gemm((&a, &b, &c), (m, n, k), trans, scalars, Precision::F32);
                    let apart = largest_gap(&unrounded, &want);
                    assert!(
                        apart > 20.0 * f32_sum_error,
                        "{at}: rounding moved it only {apart}"
                    );
                }
            }
        }
    }

    /// `cast_bf16`, and the host's [`round_bf16`], round as `half` does: to nearest, ties to
    /// even, signs, zeros, values past bf16's largest finite and subnormals included, over a
    /// length no grid divides evenly.
    #[test]
    fn cast_bf16_rounds_to_nearest_even() {
        use crate::simt::{arg, launch};
        let mut rng = Rng::new(11);
        let mut x = values(&randn(&mut rng, &[1000], 3.0));
        // 1 + 2⁻⁸ is halfway between two bf16 values: ties go to the even one (1.0); 1 + 3·2⁻⁸
        // goes up. Then -0, the largest f32 (rounds to infinity) and a subnormal.
        x.extend([1.0 + 1.0 / 256.0, 1.0 + 3.0 / 256.0, -0.0, f32::MAX, 1e-40]);
        let want: Vec<u16> = x
            .iter()
            .map(|v| half::bf16::from_f32(*v).to_bits())
            .collect();
        // The same from a 16-byte aligned buffer (four values a thread, into an 8-byte aligned
        // one) and from one float into it (one at a time), over lengths no four divide.
        let mut held = vec![0u128; x.len() / 4 + 2];
        let base = held.as_mut_ptr().cast::<f32>();
        for (offset, len) in [(0, x.len()), (0, x.len() - 3), (1, x.len())] {
            // SAFETY: `held` has room for x.len() + 4 floats.
            let from = unsafe { std::slice::from_raw_parts_mut(base.add(offset), len) };
            from.copy_from_slice(&x[..len]);
            for grid in [1u32, 3] {
                let mut out = vec![0u64; len.div_ceil(4)];
                let (xp, yp) = (from.as_ptr(), out.as_mut_ptr().cast::<u16>());
                let params = [arg(&xp), arg(&yp), arg(&len)];
                // SAFETY: `from` holds len floats and `out` room for len bf16 values.
                unsafe {
                    launch(
                        "cast_bf16",
                        [grid, 1, 1],
                        [256, 1, 1],
                        Schedule::Reverse,
                        &params,
                    )
                }
                .unwrap();
                // SAFETY: `out` holds at least len bf16 values.
                let y = unsafe { std::slice::from_raw_parts(yp, len) };
                assert_eq!(
                    y,
                    &want[..len],
                    "offset {offset}, {len} values, grid {grid}"
                );
            }
        }
        // The host's reference rounds the same way (the f32 it gives is the bf16's top half).
        let host: Vec<u16> = x
            .iter()
            .map(|v| (round_bf16(*v).to_bits() >> 16) as u16)
            .collect();
        assert_eq!(host, want);
    }
}
