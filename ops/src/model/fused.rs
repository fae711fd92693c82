//! Fused CPU kernels for the hot paths of training, each one graph node with its own backward
//! and each tested against the plain composition of candle ops it replaces
//! ([`super::layers::softmax`], [`super::layers::token_losses`], `rms_norm_plain`,
//! `activate_plain`, `linear_plain`, `attention_plain`).
//!
//! Written out of candle primitives, `softmax(scale·s + mask)` over the `(B, H, T, T)` attention
//! scores costs seven passes forward and more backward, each allocating a tensor; the
//! cross-entropy over the vocabulary likewise. Here each is one pass per row forward and one
//! backward (rows in parallel with rayon; every row is computed the same way whatever the
//! thread count, so results are deterministic).
//!
//! - [`masked_softmax`]: `p = softmax(scale·s + mask)` row-wise; backward
//!   `ds = scale · p ⊙ (g − Σ_j g_j p_j)`.
//! - [`cross_entropy`]: per row `lse(x) − x[label]`; backward `dx = g · (softmax(x) − onehot)`.
//! - [`rope`]: `y = x·cos + R(x)·sin` with `R([a, b]) = [−b, a]`; backward
//!   `dx = g·cos + Rᵀ(g·sin)` with `Rᵀ([a, b]) = [b, −a]`.
//! - [`rms_norm`]: per row `y = x · r · w` with `r = 1/sqrt(mean(x²) + eps)`; backward
//!   `dw = Σ_rows g ⊙ x · r` and `dx = r · (g ⊙ w) − x · r³/D · Σ_j g_j w_j x_j`.
//! - [`swiglu`]: `y = silu(g) ⊙ u` on the stacked `[g, u]`; backward
//!   `dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`, `du = dy ⊙ silu(g)`.
//! - [`relu2`]: `y = max(h, 0)²`; backward `dh = dy · 2·max(h, 0)`.
//! - [`linear`]: `y = x · wᵀ` over all leading dimensions as one graph node (candle's GEMM);
//!   backward `dx = g · w`, `dw = gᵀ · x`.
//! - [`attention`]: grouped-query causal self-attention from the `qkv` projection's output to
//!   the output projection's input, `softmax(R(q)·R(k)ᵀ/sqrt(d) + mask)·v` per head, as one
//!   graph node (written out of candle ops it is about 25, with head copies and the reduction
//!   of the repeated kv heads). Tasks of one (batch row, kv head) each, in parallel; GEMMs on
//!   blocks of 32 query rows and only the key columns the mask leaves open; the probabilities
//!   are kept for the backward `dv = Σ pᵀ·dy`, `ds = p ⊙ (dy·vᵀ − rowsum)/sqrt(d)`,
//!   `dq = Rᵀ(ds·k)`, `dk = Rᵀ(Σ dsᵀ·q)`.

use crate::simd;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, D, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;
use std::sync::{Arc, OnceLock};

/// A contiguous f32 storage's values under `l`.
pub(crate) fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("fused op: input is not contiguous")
    };
    Ok(&s.as_slice::<f32>()?[start..end])
}

/// Rows are processed in parallel only when there is enough work to pay for it.
const PAR_MIN: usize = 1 << 15;

/// `f(index, row)` over `out` cut in rows of `width`, in parallel when `out` is large.
fn for_rows(out: &mut [f32], width: usize, f: impl Fn((usize, &mut [f32])) + Send + Sync) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(width).enumerate().for_each(f);
    } else {
        out.chunks_mut(width).enumerate().for_each(f);
    }
}

/// One row of `softmax(scale·s + mask)` in place over the raw scores `row`; `mask` is the
/// row's additive mask (`None`: every entry counts). Masked entries (−∞, half of a causal row)
/// become exactly 0 (`e^−∞` = 0); a row with nothing left to attend to stays all 0.
fn softmax_row(row: &mut [f32], scale: f32, mask: Option<&[f32]>) {
    match mask {
        Some(m) => simd::scale_add(row, scale, m),
        None => simd::scale(row, scale),
    }
    let max = simd::max(row);
    if max == f32::NEG_INFINITY {
        row.fill(0.0);
        return;
    }
    let sum = simd::exp_shifted(row, max);
    simd::scale(row, 1.0 / sum);
}

/// [`softmax_row`]'s backward in place: `g ← scale · p ⊙ (g − Σ_j g_j p_j)`.
fn softmax_row_grad(p: &[f32], g: &mut [f32], scale: f32) {
    simd::softmax_grad(p, g, scale);
}

/// `f` over a tensor's values, read in place when it is a contiguous f32 CPU tensor (what a
/// forward or backward pass hands a fused op), else from a copy. The backward passes read their
/// saved inputs and incoming gradients this way instead of copying megabytes out with `to_vec1`.
pub(crate) fn with_values<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
            && let Ok(values) = cpu.as_slice::<f32>()
        {
            return Ok(f(&values[start..end]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
}

struct MaskedSoftmax {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, t2) = l1.shape().dims4()?;
        if l2.shape().dims4()? != (b, 1, t, t2) {
            bail!(
                "masked-softmax: mask shape {:?} for scores {:?}",
                l2.shape(),
                l1.shape()
            )
        }
        let (s, m) = (slice(s1, l1)?, slice(s2, l2)?);
        let mut out = vec![0f32; s.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let (bi, i) = (r / (h * t), r % t);
            y.copy_from_slice(&s[r * t2..(r + 1) * t2]);
            let mask = &m[(bi * t + i) * t2..(bi * t + i + 1) * t2];
            softmax_row(y, self.scale, Some(mask));
        };
        for_rows(&mut out, t2, row);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        p: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let t2 = p.dim(D::Minus1)?;
        let pv = p.flatten_all()?.to_vec1::<f32>()?;
        let gv = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; pv.len()];
        let scale = self.scale;
        let row = |(r, d): (usize, &mut [f32])| {
            d.copy_from_slice(&gv[r * t2..(r + 1) * t2]);
            softmax_row_grad(&pv[r * t2..(r + 1) * t2], d, scale);
        };
        for_rows(&mut out, t2, row);
        Ok((Some(Tensor::from_vec(out, p.shape(), p.device())?), None))
    }
}

/// `softmax(scale·scores + mask)` over the last dimension; `scores` is `(B, H, T, T)`, `mask`
/// `(B, 1, T, T)` (additive, 0 or −∞, not differentiated).
pub fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    scores.contiguous()?.apply_op2(
        &mask.contiguous()?,
        MaskedSoftmax {
            scale: scale as f32,
        },
    )
}

struct CrossEntropy;

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let x = slice(s1, l1)?;
        let Some((start, end)) = l2.contiguous_offsets() else {
            bail!("cross-entropy: labels are not contiguous")
        };
        let labels = &s2.as_slice::<u32>()?[start..end];
        if labels.len() != n {
            bail!("cross-entropy: {} labels for {n} rows", labels.len())
        }
        if let Some(l) = labels.iter().find(|l| **l as usize >= v) {
            bail!("cross-entropy: label {l} outside the vocabulary of {v}")
        }
        let loss = |r: usize| {
            let row = &x[r * v..(r + 1) * v];
            simd::log_sum_exp(row) - row[labels[r] as usize]
        };
        let out: Vec<f32> = if x.len() >= PAR_MIN {
            (0..n).into_par_iter().map(loss).collect()
        } else {
            (0..n).map(loss).collect()
        };
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, v) = logits.dims2()?;
        let labels = labels.to_vec1::<u32>()?;
        let g = grad.to_vec1::<f32>()?;
        let mut out = vec![0f32; n * v];
        with_values(logits, |x| {
            let row = |(r, d): (usize, &mut [f32])| {
                let xs = &x[r * v..(r + 1) * v];
                simd::scaled_exp_shifted(xs, simd::log_sum_exp(xs), g[r], d);
                d[labels[r] as usize] -= g[r];
            };
            for_rows(&mut out, v, row);
        })?;
        Ok((Some(Tensor::from_vec(out, (n, v), logits.device())?), None))
    }
}

/// Per-row cross-entropy `−log softmax(logits)[label]`: `logits` `(N, V)`, `labels` `(N,)` u32.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&labels.contiguous()?, CrossEntropy)
}

/// Rotary tables for one forward pass: `cos` and `sin` per (row, position, dim), row-major
/// `(batch, len, head_dim)`, shared by every attention block.
#[derive(Clone)]
pub struct RopeTables {
    pub cos: Arc<Vec<f32>>,
    pub sin: Arc<Vec<f32>>,
    pub batch: usize,
    pub len: usize,
    pub dim: usize,
}

struct RopeOp {
    t: RopeTables,
    /// The backward map `g·cos + Rᵀ(g·sin)` instead of the forward one.
    transpose: bool,
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, d) = l.shape().dims4()?;
        let tb = &self.t;
        if (b, t, d) != (tb.batch, tb.len, tb.dim) || d % 2 != 0 {
            bail!(
                "rope: input {:?} for tables of {}x{}x{}",
                l.shape(),
                tb.batch,
                tb.len,
                tb.dim
            )
        }
        let x = slice(s, l)?;
        let mut out = vec![0f32; x.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let (bi, ti) = (r / (h * t), r % t);
            let at = (bi * t + ti) * d;
            let (cos, sin) = (&tb.cos[at..at + d], &tb.sin[at..at + d]);
            rope_row(&x[r * d..(r + 1) * d], cos, sin, y, self.transpose);
        };
        for_rows(&mut out, d, row);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = RopeOp {
            t: self.t.clone(),
            transpose: !self.transpose,
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

/// Rotary embedding of `x` `(B, H, T, D)` in the `rotate_half` convention, in one pass.
pub fn rope(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    x.contiguous()?.apply_op1(RopeOp {
        t: tables.clone(),
        transpose: false,
    })
}

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

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) * weight`, in one pass.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

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

/// SwiGLU on the stacked `fc1` output `h = [g, u]` (last dimension `2F`, gate half first):
/// `silu(g) ⊙ u` with `silu(g) = g·σ(g)`, in one pass; backward
/// `dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`, `du = dy ⊙ silu(g)`. Must match the plain
/// composition `h.narrow(g).silu() * h.narrow(u)` of [`super::layers::activate_plain`].
pub fn swiglu(h: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op1(Swiglu)
}

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

/// Squared ReLU `max(h, 0)²` in one pass; backward `dh = dy · 2·max(h, 0)`. Must match the
/// plain composition `h.relu().sqr()` of [`super::layers::activate_plain`].
pub fn relu2(h: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op1(Relu2)
}

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

/// `x · wᵀ` for `x` `(…, K)` and `w` `(N, K)` as one graph node: forward
/// `x.reshape(rows, K).matmul(wᵀ)` straight on the storages, backward `dx = g · w`,
/// `dw = gᵀ · x` over the rows. Written out of candle ops ([`super::layers::linear_plain`]:
/// reshape, transpose, matmul, reshape) each view is a node whose backward allocates a zero
/// gradient and adds into it; here there is one node. Must match `linear_plain`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear)
}

/// A read-only strided matrix inside a slice: element `(r, c)` is `data[off + r·rs + c·cs]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    off: usize,
    rs: usize,
    cs: usize,
}

impl<'a> View<'a> {
    fn new(data: &'a [f32], off: usize, rs: usize, cs: usize) -> View<'a> {
        View { data, off, rs, cs }
    }

    /// Whether every element of an `m × n` matrix lies inside the slice.
    fn holds(&self, m: usize, n: usize) -> bool {
        m == 0 || n == 0 || self.off + (m - 1) * self.rs + (n - 1) * self.cs < self.data.len()
    }
}

/// `out[o + r·o_rs + c] (+)= Σ_k a(r, k)·b(k, c)` for an `m × n` result over `k` terms:
/// the `gemm` crate single-threaded (it runs inside a per-head task), accumulating into `out`
/// when `acc`, overwriting it otherwise.
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    out: &mut [f32],
    o: usize,
    o_rs: usize,
    (m, n, k): (usize, usize, usize),
    a: View,
    b: View,
    acc: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        o + (m - 1) * o_rs + n <= out.len() && a.holds(m, k) && b.holds(k, n),
        "attention: a GEMM operand out of bounds"
    );
    if k == 0 {
        if !acc {
            for r in 0..m {
                out[o + r * o_rs..o + r * o_rs + n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: every element the call reads or writes is inside its slice (asserted above);
    // `out` is borrowed mutably, so it overlaps neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr().add(o),
            1,
            o_rs as isize,
            acc,
            a.data.as_ptr().add(a.off),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.off),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// Query rows are taken in blocks of this many; each block computes only the key columns some
/// of its rows may attend to (for a causal mask, about half of the square).
const ROW_BLOCK: usize = 32;

/// One block of query rows `rows` and the key columns `cols` any of them attends to.
#[derive(Clone)]
struct Block {
    rows: (usize, usize),
    cols: (usize, usize),
}

/// The row blocks of one batch row's `t × t` additive mask (`None`: every column).
fn blocks(mask: Option<&[f32]>, t: usize) -> Vec<Block> {
    (0..t)
        .step_by(ROW_BLOCK)
        .map(|r0| {
            let r1 = (r0 + ROW_BLOCK).min(t);
            let cols = match mask {
                None => (0, t),
                Some(m) => {
                    let (mut lo, mut hi) = (t, 0);
                    for i in r0..r1 {
                        let row = &m[i * t..(i + 1) * t];
                        if let Some(first) = row.iter().position(|v| *v != f32::NEG_INFINITY) {
                            lo = lo.min(first);
                            let last = row.iter().rposition(|v| *v != f32::NEG_INFINITY);
                            hi = hi.max(last.map_or(first, |l| l) + 1);
                        }
                    }
                    if lo >= hi { (0, 0) } else { (lo, hi) }
                }
            };
            Block {
                rows: (r0, r1),
                cols,
            }
        })
        .collect()
}

/// The rotary map of one row of `d = 2·half` values, forward `x·cos + R(x)·sin` or, with
/// `transpose`, its transpose `x·cos + Rᵀ(x·sin)` (the backward).
fn rope_row(x: &[f32], cos: &[f32], sin: &[f32], y: &mut [f32], transpose: bool) {
    let half = x.len() / 2;
    for j in 0..half {
        if transpose {
            y[j] = x[j] * cos[j] + x[j + half] * sin[j + half];
            y[j + half] = x[j + half] * cos[j + half] - x[j] * sin[j];
        } else {
            y[j] = x[j] * cos[j] - x[j + half] * sin[j];
            y[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
        }
    }
}

/// What the forward pass of one `(batch row, kv head)` task keeps for the backward.
struct Saved {
    /// The task's `g` query heads after RoPE, each `T × d`.
    q: Vec<f32>,
    /// The key head after RoPE and the value head, `T × d` each.
    k: Vec<f32>,
    v: Vec<f32>,
    /// The attention probabilities of each query head, `T × T` (0 outside the row blocks).
    p: Vec<f32>,
    blocks: Vec<Block>,
}

struct FusedAttention {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    scale: f32,
    rope: Option<RopeTables>,
    /// Filled by the forward pass (one op instance per graph node), read by the backward.
    saved: OnceLock<Vec<Saved>>,
}

impl FusedAttention {
    /// Batch and length of `qkv` `(B, T, (h + 2k)·d)`, checking it and the mask and tables.
    fn dims(&self, qkv: &Shape, mask: Option<&Shape>) -> Result<(usize, usize)> {
        let (b, t, w) = qkv.dims3()?;
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        if k == 0 || h % k != 0 || w != (h + 2 * k) * d {
            bail!("attention: qkv {qkv:?} for {h} heads, {k} kv heads of {d}")
        }
        if let Some(m) = mask
            && m.dims4()? != (b, 1, t, t)
        {
            bail!("attention: mask {m:?} for qkv {qkv:?}")
        }
        if let Some(r) = &self.rope
            && ((r.batch, r.len, r.dim) != (b, t, d) || d % 2 != 0)
        {
            bail!(
                "attention: rope tables of {}x{}x{} for qkv {qkv:?}",
                r.batch,
                r.len,
                r.dim
            )
        }
        Ok((b, t))
    }

    /// The `T × d` head starting at column `col` of batch row `bi`, rotated when the op has
    /// tables.
    fn gather(&self, x: &[f32], (bi, t): (usize, usize), col: usize, rotate: bool) -> Vec<f32> {
        let d = self.head_dim;
        let w = (self.heads + 2 * self.kv_heads) * d;
        let mut out = vec![0f32; t * d];
        for (i, y) in out.chunks_mut(d).enumerate() {
            let at = (bi * t + i) * w + col;
            let xs = &x[at..at + d];
            match &self.rope {
                Some(r) if rotate => {
                    let p = (bi * t + i) * d;
                    rope_row(xs, &r.cos[p..p + d], &r.sin[p..p + d], y, false)
                }
                _ => y.copy_from_slice(xs),
            }
        }
        out
    }

    /// The forward pass of batch row `bi`, kv head `j` and its query heads: their outputs
    /// `T × (g·d)` and what the backward needs.
    fn task(
        &self,
        x: &[f32],
        mask: Option<&[f32]>,
        bi: usize,
        j: usize,
        t: usize,
    ) -> (Vec<f32>, Saved) {
        let (h, kh, d) = (self.heads, self.kv_heads, self.head_dim);
        let g = h / kh;
        let mask = mask.map(|m| &m[bi * t * t..(bi + 1) * t * t]);
        let blocks = blocks(mask, t);
        let k = self.gather(x, (bi, t), (h + j) * d, true);
        let v = self.gather(x, (bi, t), (h + kh + j) * d, false);
        let mut q = Vec::with_capacity(g * t * d);
        for i in 0..g {
            q.extend(self.gather(x, (bi, t), (j * g + i) * d, true));
        }
        let mut p = vec![0f32; g * t * t];
        let mut y = vec![0f32; t * g * d];
        for i in 0..g {
            let (qi, pi) = (
                &q[i * t * d..(i + 1) * t * d],
                &mut p[i * t * t..(i + 1) * t * t],
            );
            for blk in &blocks {
                let ((r0, r1), (c0, c1)) = (blk.rows, blk.cols);
                // scores = q · kᵀ on the block's columns
                gemm_into(
                    pi,
                    r0 * t + c0,
                    t,
                    (r1 - r0, c1 - c0, d),
                    View::new(qi, r0 * d, d, 1),
                    View::new(&k, c0 * d, 1, d),
                    false,
                );
                for r in r0..r1 {
                    let cols = r * t + c0..r * t + c1;
                    // (A row with no key to attend to stays 0; the composition gives NaN.)
                    softmax_row(&mut pi[cols.clone()], self.scale, mask.map(|m| &m[cols]));
                }
                // y = p · v
                gemm_into(
                    &mut y,
                    r0 * g * d + i * d,
                    g * d,
                    (r1 - r0, d, c1 - c0),
                    View::new(pi, r0 * t + c0, t, 1),
                    View::new(&v, c0 * d, d, 1),
                    false,
                );
            }
        }
        (y, Saved { q, k, v, p, blocks })
    }

    /// Every `(batch row, kv head)` task, in parallel when there is enough work; each is
    /// computed the same way whatever the thread count.
    fn tasks<R: Send>(
        &self,
        b: usize,
        t: usize,
        f: impl Fn(usize, usize) -> R + Send + Sync,
    ) -> Vec<R> {
        let kh = self.kv_heads;
        let work = b * self.heads * t * t * self.head_dim;
        if work >= PAR_MIN * 8 && b * kh > 1 {
            (0..b * kh)
                .into_par_iter()
                .map(|n| f(n / kh, n % kh))
                .collect()
        } else {
            (0..b * kh).map(|n| f(n / kh, n % kh)).collect()
        }
    }

    fn forward(
        &self,
        s: &CpuStorage,
        l: &Layout,
        mask: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, t) = self.dims(l.shape(), mask.map(|(_, ml)| ml.shape()))?;
        let x = slice(s, l)?;
        let mask = match mask {
            Some((ms, ml)) => Some(slice(ms, ml)?),
            None => None,
        };
        let (h, g, d) = (self.heads, self.heads / self.kv_heads, self.head_dim);
        let done = self.tasks(b, t, |bi, j| self.task(x, mask, bi, j, t));
        let mut out = vec![0f32; b * t * h * d];
        let mut saved = Vec::with_capacity(done.len());
        for (n, (y, keep)) in done.into_iter().enumerate() {
            let (bi, j) = (n / self.kv_heads, n % self.kv_heads);
            for (i, row) in y.chunks(g * d).enumerate() {
                let at = (bi * t + i) * h * d + j * g * d;
                out[at..at + g * d].copy_from_slice(row);
            }
            saved.push(keep);
        }
        // A second forward of the same op instance keeps the first one's (equal) values.
        let _ = self.saved.set(saved);
        Ok((CpuStorage::F32(out), Shape::from((b, t, h * d))))
    }

    /// The gradient of one task: `(dq T × g·d, dk T × d, dv T × d)`, RoPE undone.
    fn task_grad(
        &self,
        sv: &Saved,
        dy: &[f32],
        bi: usize,
        j: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let (h, kh, d) = (self.heads, self.kv_heads, self.head_dim);
        let g = h / kh;
        let mut dq = vec![0f32; t * d];
        let mut dq_all = vec![0f32; t * g * d];
        let mut dk = vec![0f32; t * d];
        let mut dv = vec![0f32; t * d];
        let mut ds = vec![0f32; t * t];
        let dy_at = bi * t * h * d;
        for i in 0..g {
            let qi = &sv.q[i * t * d..(i + 1) * t * d];
            let pi = &sv.p[i * t * t..(i + 1) * t * t];
            let dyi = View::new(dy, dy_at + (j * g + i) * d, h * d, 1);
            for blk in &sv.blocks {
                let ((r0, r1), (c0, c1)) = (blk.rows, blk.cols);
                let (rb, nc) = (r1 - r0, c1 - c0);
                let dyb = View {
                    off: dyi.off + r0 * h * d,
                    ..dyi
                };
                // dv += pᵀ · dy
                gemm_into(
                    &mut dv,
                    c0 * d,
                    d,
                    (nc, d, rb),
                    View::new(pi, r0 * t + c0, 1, t),
                    dyb,
                    true,
                );
                // dp = dy · vᵀ
                gemm_into(
                    &mut ds,
                    r0 * t + c0,
                    t,
                    (rb, nc, d),
                    dyb,
                    View::new(&sv.v, c0 * d, 1, d),
                    false,
                );
                // ds = scale · p ⊙ (dp − Σ_j dp_j p_j)
                for r in r0..r1 {
                    let cols = r * t + c0..r * t + c1;
                    softmax_row_grad(&pi[cols.clone()], &mut ds[cols], self.scale);
                }
                // dq = ds · k; dk += dsᵀ · q
                gemm_into(
                    &mut dq,
                    r0 * d,
                    d,
                    (rb, d, nc),
                    View::new(&ds, r0 * t + c0, t, 1),
                    View::new(&sv.k, c0 * d, d, 1),
                    false,
                );
                gemm_into(
                    &mut dk,
                    c0 * d,
                    d,
                    (nc, d, rb),
                    View::new(&ds, r0 * t + c0, 1, t),
                    View::new(qi, r0 * d, d, 1),
                    true,
                );
            }
            for (r, row) in dq.chunks(d).enumerate() {
                let y = &mut dq_all[r * g * d + i * d..r * g * d + (i + 1) * d];
                self.unrotate(row, (bi, t, r), y);
            }
        }
        let mut dk_out = vec![0f32; t * d];
        for (r, (row, y)) in dk.chunks(d).zip(dk_out.chunks_mut(d)).enumerate() {
            self.unrotate(row, (bi, t, r), y);
        }
        (dq_all, dk_out, dv)
    }

    /// `Rᵀ` of RoPE at (batch row, position) on one row of `d`; a copy without tables.
    fn unrotate(&self, x: &[f32], (bi, t, i): (usize, usize, usize), y: &mut [f32]) {
        match &self.rope {
            Some(r) => {
                let d = self.head_dim;
                let p = (bi * t + i) * d;
                rope_row(x, &r.cos[p..p + d], &r.sin[p..p + d], y, true)
            }
            None => y.copy_from_slice(x),
        }
    }

    fn backward(&self, qkv: &Tensor, mask: Option<&Tensor>, grad: &Tensor) -> Result<Tensor> {
        let (b, t, w) = qkv.dims3()?;
        let recomputed;
        let saved = match self.saved.get() {
            Some(s) => s,
            None => {
                let x = qkv.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
                let m = match mask {
                    Some(m) => Some(m.contiguous()?.flatten_all()?.to_vec1::<f32>()?),
                    None => None,
                };
                recomputed = self.tasks(b, t, |bi, j| self.task(&x, m.as_deref(), bi, j, t).1);
                &recomputed
            }
        };
        let dy = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let (h, kh, d) = (self.heads, self.kv_heads, self.head_dim);
        let g = h / kh;
        let grads = self.tasks(b, t, |bi, j| {
            self.task_grad(&saved[bi * kh + j], &dy, bi, j, t)
        });
        let mut out = vec![0f32; b * t * w];
        for (n, (dq, dk, dv)) in grads.iter().enumerate() {
            let (bi, j) = (n / kh, n % kh);
            for r in 0..t {
                let at = (bi * t + r) * w;
                out[at + j * g * d..at + (j + 1) * g * d]
                    .copy_from_slice(&dq[r * g * d..(r + 1) * g * d]);
                out[at + (h + j) * d..at + (h + j + 1) * d]
                    .copy_from_slice(&dk[r * d..(r + 1) * d]);
                out[at + (h + kh + j) * d..at + (h + kh + j + 1) * d]
                    .copy_from_slice(&dv[r * d..(r + 1) * d]);
            }
        }
        Tensor::from_vec(out, (b, t, w), qkv.device())
    }
}

impl CustomOp1 for FusedAttention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(s, l, None)
    }

    fn bwd(&self, qkv: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.backward(qkv, None, grad)?))
    }
}

impl CustomOp2 for FusedAttention {
    fn name(&self) -> &'static str {
        "attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward(s1, l1, Some((s2, l2)))
    }

    fn bwd(
        &self,
        qkv: &Tensor,
        mask: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        Ok((Some(self.backward(qkv, Some(mask), grad)?), None))
    }
}

/// Causal self-attention with grouped-query heads as one graph node, from the `qkv`
/// projection's output `(B, T, (h + 2k)·d)` (h query heads, then k key heads, then k value
/// heads, each `d` wide) to the output projection's input `(B, T, h·d)`: RoPE on queries and
/// keys (`rope`), query head `i` attending with kv head `i / (h/k)`,
/// `softmax(q·kᵀ/sqrt(d) + mask)·v` with the additive `mask` `(B, 1, T, T)` (`None`: every
/// key). Backward `dv = Σ pᵀ·dy`, `dp = dy·vᵀ`, `ds = p ⊙ (dp − Σ_j dp_j p_j)/sqrt(d)`,
/// `dq = ds·k`, `dk = Σ dsᵀ·q`, then `Rᵀ` on `dq` and `dk`. The probabilities are kept from
/// the forward pass. Must match [`super::layers::attention_plain`].
pub fn attention(
    qkv: &Tensor,
    mask: Option<&Tensor>,
    rope: Option<&RopeTables>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    let op = FusedAttention {
        heads,
        kv_heads,
        head_dim,
        scale: 1.0 / (head_dim as f32).sqrt(),
        rope: rope.cloned(),
        saved: OnceLock::new(),
    };
    let qkv = qkv.contiguous()?;
    match mask {
        Some(m) => qkv.apply_op2(&m.contiguous()?, op),
        None => qkv.apply_op1(op),
    }
}

#[cfg(test)]
mod tests {
    use super::super::layers::{softmax, token_losses};
    use super::super::params::Rng;
    use super::*;
    use candle_core::{Device, Var};

    fn randn(rng: &mut Rng, shape: &[usize], std: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
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
    fn grad_diffs(fused: &Tensor, plain: &Tensor, w: &Tensor, vars: &[&Var]) -> Vec<f32> {
        let grads = |y: &Tensor| (y * w).unwrap().sum_all().unwrap().backward().unwrap();
        let (gf, gp) = (grads(fused), grads(plain));
        vars.iter()
            .map(|v| {
                let t = v.as_tensor();
                max_diff(gf.get(t).unwrap(), gp.get(t).unwrap())
            })
            .collect()
    }

    /// A causal mask with a packed boundary, (b, 1, t, t).
    fn mask(b: usize, t: usize) -> Tensor {
        let mut m = vec![f32::NEG_INFINITY; b * t * t];
        for r in 0..b {
            for i in 0..t {
                for j in 0..=i {
                    if (i < t / 2) == (j < t / 2) {
                        m[(r * t + i) * t + j] = 0.0;
                    }
                }
            }
        }
        Tensor::from_vec(m, (b, 1, t, t), &Device::Cpu).unwrap()
    }

    #[test]
    fn masked_softmax_matches_the_plain_ops_forward_and_backward() {
        // Big enough to take the parallel path too.
        for (b, h, t) in [(2, 3, 7), (2, 4, 96)] {
            let mut rng = Rng::new(t as u64);
            let s = Var::from_tensor(&randn(&mut rng, &[b, h, t, t], 2.0)).unwrap();
            let m = mask(b, t);
            let w = randn(&mut rng, &[b, h, t, t], 1.0);
            let scale = 0.35;
            let fused = masked_softmax(s.as_tensor(), &m, scale).unwrap();
            let plain =
                softmax(&(s.as_tensor() * scale).unwrap().broadcast_add(&m).unwrap()).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-6);
            for diff in grad_diffs(&fused, &plain, &w, &[&s]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
    }

    #[test]
    fn cross_entropy_matches_the_plain_ops_forward_and_backward() {
        for (n, v) in [(5, 11), (300, 257)] {
            let mut rng = Rng::new(n as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[n, v], 3.0)).unwrap();
            let labels: Vec<u32> = (0..n).map(|i| ((i * 7919) % v) as u32).collect();
            let labels = Tensor::from_vec(labels, n, &Device::Cpu).unwrap();
            let w = randn(&mut rng, &[n], 1.0);
            let fused = cross_entropy(x.as_tensor(), &labels).unwrap();
            let plain = token_losses(x.as_tensor(), &labels).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-5);
            for diff in grad_diffs(&fused, &plain, &w, &[&x]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
        let x = Tensor::zeros((1, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let bad = Tensor::new(&[3u32], &Device::Cpu).unwrap();
        assert!(
            cross_entropy(&x, &bad).is_err(),
            "a label outside the vocabulary"
        );
    }

    #[test]
    fn rms_norm_matches_the_plain_ops_forward_and_backward() {
        for (rows, d) in [(3, 5), (300, 128)] {
            let mut rng = Rng::new(d as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[rows, d], 2.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[d], 1.0)).unwrap();
            let g = randn(&mut rng, &[rows, d], 1.0);
            let fused = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            let plain =
                super::super::layers::rms_norm_plain(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-5);
            for diff in grad_diffs(&fused, &plain, &g, &[&x, &w]) {
                assert!(diff < 1e-4, "{diff}");
            }
        }
    }

    #[test]
    fn rope_matches_the_plain_ops_forward_and_backward() {
        let (b, h, t, d) = (2, 3, 5, 8);
        let rope = super::super::layers::Rope::new(d, 16, 10000.0).unwrap();
        let layout = super::super::layers::Layout {
            batch: b,
            len: t,
            positions: vec![0, 1, 2, 0, 1, 3, 4, 5, 6, 7],
            segments: vec![0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
        };
        let (cos, sin) = rope.tables(&layout).unwrap();
        let tables = rope.fused_tables(&layout).unwrap();
        let mut rng = Rng::new(4);
        let x = Var::from_tensor(&randn(&mut rng, &[b, h, t, d], 1.0)).unwrap();
        let g = randn(&mut rng, &[b, h, t, d], 1.0);
        let fused = super::rope(x.as_tensor(), &tables).unwrap();
        let plain = super::super::layers::apply_rope(x.as_tensor(), &cos, &sin).unwrap();
        assert!(max_diff(&fused, &plain) < 1e-6);
        for diff in grad_diffs(&fused, &plain, &g, &[&x]) {
            assert!(diff < 1e-6, "{diff}");
        }
    }

    #[test]
    fn swiglu_matches_the_plain_ops_forward_and_backward() {
        use super::super::config::Activation;
        // Big enough to take the parallel path too.
        for (rows, f) in [(3, 5), (300, 192)] {
            let mut rng = Rng::new(f as u64);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, 2 * f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let fused = swiglu(h.as_tensor()).unwrap();
            let plain =
                super::super::layers::activate_plain(h.as_tensor(), Activation::Swiglu).unwrap();
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

    #[test]
    fn relu2_matches_the_plain_ops_forward_and_backward() {
        use super::super::config::Activation;
        for (rows, f) in [(3, 5), (300, 192)] {
            let mut rng = Rng::new(f as u64 + 1);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let fused = relu2(h.as_tensor()).unwrap();
            let plain =
                super::super::layers::activate_plain(h.as_tensor(), Activation::Relu2).unwrap();
            // Same arithmetic as relu then sqr: the same bytes, forward and backward.
            assert_eq!(max_diff(&fused, &plain), 0.0);
            for diff in grad_diffs(&fused, &plain, &g, &[&h]) {
                assert_eq!(diff, 0.0);
            }
        }
    }

    #[test]
    fn linear_matches_the_plain_ops_forward_and_backward() {
        for dims in [vec![1, 1], vec![5, 7], vec![2, 9, 33], vec![2, 3, 4, 16]] {
            let mut rng = Rng::new(dims.iter().product::<usize>() as u64);
            let k = *dims.last().unwrap();
            let x = Var::from_tensor(&randn(&mut rng, &dims, 1.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[6, k], 1.0)).unwrap();
            let fused = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let plain = super::super::layers::linear_plain(x.as_tensor(), w.as_tensor()).unwrap();
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
        let plain = super::super::layers::linear_plain(&x, &w).unwrap();
        assert!(max_diff(&linear(&x, &w).unwrap(), &plain) < 1e-5);
        let bad = randn(&mut rng, &[3, 4], 1.0);
        assert!(linear(&x, &bad).is_err(), "a weight of the wrong width");
    }

    /// `(qkv, mask, tables)` for an attention test: rows of two packed segments (positions
    /// restarting) when `packed`, else plain causal rows; `mask: false` drops the mask.
    fn attention_case(
        rng: &mut Rng,
        (b, t, w): (usize, usize, usize),
        d: usize,
        packed: bool,
    ) -> (Var, Tensor, RopeTables) {
        use super::super::layers::{Layout as Rows, Rope};
        let cut = t / 2 - 1;
        let rows = if packed {
            Rows {
                batch: b,
                len: t,
                positions: (0..b)
                    .flat_map(|_| (0..t).map(|i| if i < cut { i } else { i - cut } as u32))
                    .collect(),
                segments: (0..b)
                    .flat_map(|_| (0..t).map(|i| (i >= cut) as u32))
                    .collect(),
            }
        } else {
            Rows::plain(b, t)
        };
        let rope = Rope::new(d, 256, 10000.0).unwrap();
        let qkv = Var::from_tensor(&randn(rng, &[b, t, w], 1.0)).unwrap();
        (
            qkv,
            rows.attention_mask().unwrap(),
            rope.fused_tables(&rows).unwrap(),
        )
    }

    #[test]
    fn attention_matches_the_plain_ops_forward_and_backward() {
        use super::super::layers::attention_plain;
        let b = 2;
        // T = 13: one partial row block; T = 45: blocks of different column ranges; the last
        // is big enough to take the parallel path.
        let shapes = [(4, 2, 8, 13), (4, 2, 16, 13), (3, 3, 8, 13), (3, 3, 16, 13)];
        let more = [(4, 2, 8, 45), (2, 2, 16, 45), (4, 1, 16, 100)];
        for (h, k, d, t) in shapes.into_iter().chain(more) {
            for rope in [false, true] {
                for mask in ["packed", "causal", "none"] {
                    let mut rng = Rng::new((h * 1000 + k * 100 + d + t) as u64);
                    let w = (h + 2 * k) * d;
                    let (qkv, m, tables) = attention_case(&mut rng, (b, t, w), d, mask == "packed");
                    let m = (mask != "none").then_some(&m);
                    let r = rope.then_some(&tables);
                    let x = qkv.as_tensor();
                    let fused = attention(x, m, r, h, k, d).unwrap();
                    let plain = attention_plain(x, m, r, h, k, d).unwrap();
                    let case = format!("h={h} k={k} d={d} t={t} rope={rope} mask={mask}");
                    assert_eq!(fused.dims(), &[b, t, h * d], "{case}");
                    let diff = max_diff(&fused, &plain);
                    assert!(diff <= 1e-5, "{case}: forward {diff}");
                    let g = randn(&mut rng, &[b, t, h * d], 1.0);
                    let gf = (&fused * &g)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let gp = (&plain * &g)
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .backward()
                        .unwrap();
                    let (a, c) = (gf.get(x).unwrap(), gp.get(x).unwrap());
                    let diff = max_diff(a, c);
                    assert!(diff <= 1e-5, "{case}: backward {diff}");
                    // Without the forward pass's probabilities the backward recomputes them.
                    let op = FusedAttention {
                        heads: h,
                        kv_heads: k,
                        head_dim: d,
                        scale: 1.0 / (d as f32).sqrt(),
                        rope: r.cloned(),
                        saved: OnceLock::new(),
                    };
                    let again = op.backward(x, m, &g).unwrap();
                    assert_eq!(max_diff(&again, a), 0.0, "{case}: recomputed backward");
                }
            }
        }
    }

    #[test]
    fn attention_is_the_same_whatever_the_thread_count() {
        let (b, t, h, k, d) = (3, 70, 4, 2, 16);
        let mut rng = Rng::new(11);
        let (qkv, m, tables) = attention_case(&mut rng, (b, t, (h + 2 * k) * d), d, true);
        let g = randn(&mut rng, &[b, t, h * d], 1.0);
        let run = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let y = attention(qkv.as_tensor(), Some(&m), Some(&tables), h, k, d).unwrap();
                let grads = (&y * &g).unwrap().sum_all().unwrap().backward().unwrap();
                let dx = grads.get(qkv.as_tensor()).unwrap();
                (
                    y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    dx.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                )
            })
        };
        assert_eq!(run(1), run(3));
    }

    #[test]
    fn attention_rejects_inconsistent_shapes() {
        let mut rng = Rng::new(2);
        let (qkv, m, tables) = attention_case(&mut rng, (2, 13, 64), 8, false);
        let x = qkv.as_tensor();
        assert!(attention(x, Some(&m), Some(&tables), 4, 2, 8).is_ok());
        assert!(
            attention(x, None, None, 4, 3, 8).is_err(),
            "heads % kv_heads"
        );
        assert!(attention(x, None, None, 4, 1, 8).is_err(), "width");
        let short = m.narrow(2, 0, 12).unwrap();
        assert!(attention(x, Some(&short), None, 4, 2, 8).is_err(), "mask");
        let (_, _, other) = attention_case(&mut rng, (1, 13, 64), 8, false);
        assert!(attention(x, None, Some(&other), 4, 2, 8).is_err(), "tables");
    }
}
