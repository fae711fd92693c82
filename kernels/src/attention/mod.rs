//! Grouped-query causal self-attention from the `qkv` projection's output to the output
//! projection's input, `softmax(R(q)·R(k)ᵀ/sqrt(d) + mask)·v` per head, with packed segments
//! through the additive mask (Megatron-LM's `DotProductAttention`, and FlashAttention's online
//! tiling in spirit: only the key blocks the mask leaves open are computed).
//!
//! On the CPU it is one graph node (written out of candle ops it is about 25, with head copies
//! and the reduction of the repeated kv heads). Tasks of one (batch row, kv head) each, in
//! parallel; GEMMs on blocks of 32 query rows and only the key columns the mask leaves open;
//! the probabilities are kept for the backward `dv = Σ pᵀ·dy`,
//! `ds = p ⊙ (dy·vᵀ − rowsum)/sqrt(d)`, `dq = Rᵀ(ds·k)`, `dk = Rᵀ(Σ dsᵀ·q)`.
//!
//! Must match: [`attention_plain`] within 1e-5, forward and backward; the same bytes at any
//! thread count.

use crate::rope::{RopeTables, rope, rope_row};
use crate::rows::{PAR_MIN, slice};
use crate::softmax::{masked_softmax, softmax, softmax_row, softmax_row_grad};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, D, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;
use std::sync::OnceLock;

// 1. Reference ----------------------------------------------------------------------------

/// The `qkv` projection's output `(B, T, (h + 2k)·d)` as query, key and value heads
/// `(B, heads, T, d)`, RoPE applied to the queries and keys.
pub fn split_heads(
    qkv: &Tensor,
    h: usize,
    k: usize,
    d: usize,
    rope_tables: Option<&RopeTables>,
) -> Result<(Tensor, Tensor, Tensor)> {
    let (b, t, _) = qkv.dims3()?;
    // (B, T, heads, D) → (B, heads, T, D)
    let split = |start: usize, n: usize| -> Result<Tensor> {
        qkv.narrow(D::Minus1, start * d, n * d)?
            .reshape((b, t, n, d))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (mut q, mut kk, v) = (split(0, h)?, split(h, k)?, split(h + k, k)?);
    if let Some(tables) = rope_tables {
        q = rope(&q, tables)?;
        kk = rope(&kk, tables)?;
    }
    Ok((q, kk, v))
}

/// Attention from the `qkv` projection's output `(B, T, (h + 2k)·d)` to the output
/// projection's input `(B, T, h·d)` as a composition of candle ops (heads split and copied,
/// RoPE, kv heads repeated, `q·kᵀ`, masked softmax, `p·v`): the spec the fused op is tested
/// against.
pub fn attention_plain(
    qkv: &Tensor,
    mask: Option<&Tensor>,
    rope_tables: Option<&RopeTables>,
    h: usize,
    k: usize,
    d: usize,
) -> Result<Tensor> {
    let (b, t, _) = qkv.dims3()?;
    let (q, kk, v) = split_heads(qkv, h, k, d, rope_tables)?;
    // Each key/value head serves heads/kv_heads query heads.
    let repeat = |x: Tensor| -> Result<Tensor> {
        if h == k {
            return Ok(x);
        }
        x.unsqueeze(2)?
            .broadcast_as((b, k, h / k, t, d))?
            .reshape((b, h, t, d))
    };
    let (kk, v) = (repeat(kk)?, repeat(v)?);
    let scale = 1.0 / (d as f64).sqrt();
    let scores = q.matmul(&kk.t()?)?;
    let probs = match mask {
        // One fused pass for scale + mask + softmax (and one backward).
        Some(mask) => masked_softmax(&scores, mask, scale)?,
        None => softmax(&(scores * scale)?)?,
    };
    let y = probs.matmul(&v)?; // (B, heads, T, D)
    y.transpose(1, 2)?.reshape((b, t, h * d))
}

// 2. CPU, one graph node with its backward -------------------------------------------------

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
/// the forward pass. Must match [`attention_plain`].
fn attention_cpu(
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

// 3. The kernel ---------------------------------------------------------------------------

/// Attention from `qkv` `(B, T, (heads + 2·kv_heads)·head_dim)` to `(B, T, heads·head_dim)`:
/// one fused node for f32 on the CPU, [`attention_plain`] elsewhere.
pub fn attention(
    qkv: &Tensor,
    mask: Option<&Tensor>,
    rope: Option<&RopeTables>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Tensor> {
    if !crate::fused_here(qkv) {
        return attention_plain(qkv, mask, rope, heads, kv_heads, head_dim);
    }
    attention_cpu(qkv, mask, rope, heads, kv_heads, head_dim)
}

/// The tensor-core kernel of attention.cu for `stage` (`attention_fwd`, `attention_bwd_dq` or
/// `attention_bwd_dkv`) and heads `head_dim` wide: `attention_fwd_bf16_d64`, …; `None` for a
/// width it has no kernel for (the f32 kernels take those).
pub fn tensor_core_kernel(stage: &str, head_dim: usize) -> Option<String> {
    matches!(head_dim, 16 | 32 | 64 | 128).then(|| format!("{stage}_bf16_d{head_dim}"))
}

/// Query rows (forward, dq) or keys (dkv) a warp of the tensor-core kernels owns: a block of
/// `w` warps takes `16·w` of them.
pub const TENSOR_CORE_ROWS_PER_WARP: usize = 16;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// `(qkv, mask, tables)` for an attention test: rows of two packed segments (positions
    /// restarting) when `packed`, else plain causal rows.
    fn attention_case(
        rng: &mut Rng,
        (b, t, w): (usize, usize, usize),
        d: usize,
        packed: bool,
    ) -> (Var, Tensor, RopeTables) {
        let cut = if packed { t / 2 - 1 } else { t };
        let positions: Vec<u32> = (0..b)
            .flat_map(|_| (0..t).map(move |i| if i < cut { i } else { i - cut } as u32))
            .collect();
        let qkv = Var::from_tensor(&randn(rng, &[b, t, w], 1.0)).unwrap();
        (
            qkv,
            segment_mask(b, t, cut),
            rope_tables(d, &positions, b, t),
        )
    }

    #[test]
    fn attention_matches_the_plain_ops_forward_and_backward() {
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
    /// The sizes of one CUDA attention case.
    #[derive(Clone, Copy, Debug)]
    struct Sizes {
        b: usize,
        t: usize,
        h: usize,
        k: usize,
        d: usize,
    }

    /// How many blocks a launch gets: one (every block loops), one per work item, or a few
    /// more than the items (the extra blocks find nothing to do).
    #[derive(Clone, Copy, Debug)]
    enum Grid {
        One,
        PerItem,
        Spare,
    }

    impl Grid {
        fn blocks(self, items: usize) -> u32 {
            match self {
                Grid::One => 1,
                Grid::PerItem => items.max(1) as u32,
                Grid::Spare => items as u32 + 3,
            }
        }
    }

    /// What the kernels read besides `qkv`: RoPE tables, segment ids, the causal flag.
    struct Masking<'a> {
        rope: Option<&'a RopeTables>,
        segments: Option<&'a [i32]>,
        causal: bool,
    }

    /// Which of attention.cu's kernels: the f32 ones, or the tensor cores' for heads this wide.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Family {
        F32,
        Bf16(usize),
    }

    impl Family {
        /// `(query tiles, key tiles)` of a launch of `warps` warps a block.
        fn tiles(self, n: Sizes, warps: usize) -> (usize, usize) {
            let (query_rows, keys) = match self {
                Family::F32 => (2 * warps, 4 * warps),
                Family::Bf16(_) => (16 * warps, 16 * warps),
            };
            (
                n.b * n.h * n.t.div_ceil(query_rows),
                n.b * n.k * n.t.div_ceil(keys),
            )
        }

        fn kernel(self, name: &str) -> String {
            match self {
                Family::F32 => format!("{name}_f32"),
                Family::Bf16(d) => tensor_core_kernel(name, d).unwrap(),
            }
        }
    }

    /// attention.cu through the SIMT shim: `[y, lse, dqkv]` for `qkv` and the upstream
    /// gradient `dy`, every kernel on blocks of `block` threads.
    fn cuda(
        (qkv, dy): (&[f32], &[f32]),
        n: Sizes,
        masking: &Masking,
        (grid, block): (Grid, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        cuda_of(Family::F32, (qkv, dy), n, masking, (grid, block), schedule)
    }

    /// [`cuda`] with the kernels of `family` for the forward, dq and dkv.
    fn cuda_of(
        family: Family,
        (qkv, dy): (&[f32], &[f32]),
        n: Sizes,
        masking: &Masking,
        (grid, block): (Grid, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let Sizes { b, t, h, k, d } = n;
        let (mut y, mut lse) = (vec![0f32; b * t * h * d], vec![0f32; b * h * t]);
        let (mut delta, mut dqkv) = (vec![0f32; b * h * t], vec![0f32; qkv.len()]);
        // The tensor-core kernels write dqkv in bf16.
        let mut dqkv16 = vec![0u16; qkv.len()];
        let null = std::ptr::null::<f32>();
        let (cos, sin) = masking
            .rope
            .map_or((null, null), |r| (r.cos.as_ptr(), r.sin.as_ptr()));
        let segments = masking.segments.map_or(std::ptr::null(), <[i32]>::as_ptr);
        let (bi, ti, hi, ki, di) = (b as i32, t as i32, h as i32, k as i32, d as i32);
        let causal = i32::from(masking.causal);
        let qkv_len = qkv.len();
        let (qkv, dy) = (qkv.as_ptr(), dy.as_ptr());
        let (yp, lp, dp, gp) = (
            y.as_mut_ptr(),
            lse.as_mut_ptr(),
            delta.as_mut_ptr(),
            dqkv.as_mut_ptr(),
        );
        let gp16 = dqkv16.as_mut_ptr();
        let warps = block as usize / 32;
        let (query_tiles, key_tiles) = family.tiles(n, warps);
        let launch = |name: &str, items: usize, params: &[*mut std::ffi::c_void]| {
            // SAFETY: every buffer holds what the kernel indexes for these sizes: qkv, its
            // packed copy and dqkv B·T·(h + 2k)·d, y, dy and its packed copy B·T·h·d, lse and
            // delta B·h·T, the tables B·T·d and the segments B·T.
            unsafe { launch_1d(name, grid.blocks(items), block, schedule, params) }.unwrap()
        };
        let sizes = [
            arg(&bi),
            arg(&ti),
            arg(&hi),
            arg(&ki),
            arg(&di),
            arg(&causal),
        ];
        // The tensor-core kernels read qkv and dy as attention_pack_bf16 writes them.
        let (mut packed_qkv, mut packed_dy) = (vec![0u16; qkv_len], vec![0u16; b * t * h * d]);
        let (pq, pd) = (packed_qkv.as_mut_ptr(), packed_dy.as_mut_ptr());
        if let Family::Bf16(_) = family {
            let (all, rotated, none) = ((h + 2 * k) as i32, (h + k) as i32, 0i32);
            let qkv_pack = [
                arg(&qkv),
                arg(&cos),
                arg(&sin),
                arg(&pq),
                arg(&bi),
                arg(&ti),
                arg(&all),
                arg(&rotated),
                arg(&di),
            ];
            launch("attention_pack_bf16", qkv_len.div_ceil(64), &qkv_pack);
            let dy_pack = [
                arg(&dy),
                arg(&null),
                arg(&null),
                arg(&pd),
                arg(&bi),
                arg(&ti),
                arg(&hi),
                arg(&none),
                arg(&di),
            ];
            launch(
                "attention_pack_bf16",
                (b * t * h * d).div_ceil(64),
                &dy_pack,
            );
        }
        let (pq, pd) = (pq.cast_const(), pd.cast_const());
        let (qkv_in, dy_in, dqkv_out) = match family {
            Family::F32 => (arg(&qkv), arg(&dy), arg(&gp)),
            Family::Bf16(_) => (arg(&pq), arg(&pd), arg(&gp16)),
        };
        let fwd = match family {
            Family::F32 => [
                &[qkv_in, arg(&cos), arg(&sin), arg(&segments)][..],
                &[arg(&yp), arg(&lp)],
                &sizes,
            ]
            .concat(),
            Family::Bf16(_) => [&[qkv_in, arg(&segments), arg(&yp), arg(&lp)][..], &sizes].concat(),
        };
        launch(&family.kernel("attention_fwd"), query_tiles, &fwd);
        let (yc, lc) = (yp.cast_const(), lp.cast_const());
        let delta_params = [
            arg(&yc),
            arg(&dy),
            arg(&dp),
            arg(&bi),
            arg(&ti),
            arg(&hi),
            arg(&di),
        ];
        launch(
            "attention_bwd_delta_f32",
            (b * h * t).div_ceil(warps),
            &delta_params,
        );
        let dc = dp.cast_const();
        let bwd = [
            &[qkv_in, arg(&cos), arg(&sin), arg(&segments)][..],
            &[dy_in, arg(&lc), arg(&dc), dqkv_out],
            &sizes,
        ]
        .concat();
        launch(&family.kernel("attention_bwd_dq"), query_tiles, &bwd);
        launch(&family.kernel("attention_bwd_dkv"), key_tiles, &bwd);
        drop((packed_qkv, packed_dy)); // alive until the last launch read them
        match family {
            Family::F32 => vec![y, lse, dqkv],
            Family::Bf16(_) => vec![y, lse, widened(&dqkv16)],
        }
    }

    /// Segment ids of `b` packed rows of `t`: row `r` cut into `r + 1` runs of about equal
    /// length (so rows differ), as ops/model's `Layout::segments`.
    fn packed_segments(b: usize, t: usize) -> Vec<i32> {
        (0..b)
            .flat_map(|r| (0..t).map(move |i| (i * (r + 1) / t) as i32))
            .collect()
    }

    /// The additive mask `(b, 1, t, t)` of `segments`, as ops/model's `Layout::attention_mask`
    /// builds it (causal: `j ≤ i`; else every key of the segment).
    fn mask_of(segments: &[i32], b: usize, t: usize, causal: bool) -> Tensor {
        let mut m = vec![f32::NEG_INFINITY; b * t * t];
        for r in 0..b {
            let seg = &segments[r * t..(r + 1) * t];
            for i in 0..t {
                for j in 0..t {
                    if (!causal || j <= i) && seg[i] == seg[j] {
                        m[(r * t + i) * t + j] = 0.0;
                    }
                }
            }
        }
        Tensor::from_vec(m, (b, 1, t, t), &Device::Cpu).unwrap()
    }

    /// Positions restarting at 0 at each segment, for the rotary tables.
    fn positions_of(segments: &[i32], b: usize, t: usize) -> Vec<u32> {
        let mut positions = vec![0u32; b * t];
        for r in 0..b {
            for i in 1..t {
                let at = r * t + i;
                if segments[at] == segments[at - 1] {
                    positions[at] = positions[at - 1] + 1;
                }
            }
        }
        positions
    }

    /// One case of the CUDA kernels' tests: the sizes (b = 2), which shape of the list and
    /// which mask (in the order packed, causal, segments, none), RoPE or not, the inputs (qkv
    /// and an upstream gradient of y) and what `attention_plain` gives for them (y, dqkv).
    struct Case<'a> {
        n: Sizes,
        shape: usize,
        mask: usize,
        rope: bool,
        masking: Masking<'a>,
        inputs: (&'a [f32], &'a [f32]),
        want: [Vec<f32>; 2],
    }

    impl Case<'_> {
        fn name(&self) -> &'static str {
            ["packed", "causal", "segments", "none"][self.mask]
        }
    }

    /// `check` on every case of `shapes` (`(h, k, d, t)`): packed rows (a different number of
    /// segments per batch row), segments without the causal cut, plain causal rows and no mask,
    /// each with and without RoPE.
    fn each_case(shapes: &[(usize, usize, usize, usize)], mut check: impl FnMut(&Case)) {
        let b = 2;
        for (shape, &(h, k, d, t)) in shapes.iter().enumerate() {
            let n = Sizes { b, t, h, k, d };
            let segments = packed_segments(b, t);
            let one_segment = vec![0i32; b * t];
            let tables = rope_tables(d, &positions_of(&segments, b, t), b, t);
            let plain_tables = rope_tables(d, &positions_of(&one_segment, b, t), b, t);
            let mut rng = Rng::new((h * 1000 + k * 100 + d + t) as u64);
            let qkv = Var::from_tensor(&randn(&mut rng, &[b, t, (h + 2 * k) * d], 1.0)).unwrap();
            let g = randn(&mut rng, &[b, t, h * d], 1.0);
            let (xv, gv) = (values(qkv.as_tensor()), values(&g));
            for mask in 0..4 {
                for rope in [false, true] {
                    let (seg, causal, table) = match mask {
                        0 => (Some(&segments[..]), true, &tables),
                        1 => (None, true, &plain_tables),
                        2 => (Some(&segments[..]), false, &tables),
                        _ => (None, false, &plain_tables),
                    };
                    let additive =
                        (mask < 3).then(|| mask_of(seg.unwrap_or(&one_segment), b, t, causal));
                    let r = rope.then_some(table);
                    let plain = attention_plain(qkv.as_tensor(), additive.as_ref(), r, h, k, d);
                    let plain = plain.unwrap();
                    check(&Case {
                        n,
                        shape,
                        mask,
                        rope,
                        masking: Masking {
                            rope: r,
                            segments: seg,
                            causal,
                        },
                        inputs: (&xv, &gv),
                        want: [values(&plain), plain_grads(&plain, &g, &[&qkv]).remove(0)],
                    });
                }
            }
        }
    }

    /// attention.cu, executed by the SIMT shim, against `attention_plain`: y within 1e-5 and
    /// the gradient of qkv (dq, dk, dv, RoPE undone) within 1e-5, in every case of
    /// [`each_case`], with GQA groups of 1 to 4, lengths and head widths that fill no tile,
    /// and grids that loop or leave blocks idle, in both schedules.
    #[test]
    fn the_cuda_kernels_match_the_plain_ops() {
        let shapes = [
            (1, 1, 8, 1),
            (4, 2, 8, 13),
            (3, 3, 16, 13),
            (4, 1, 16, 45),
            (6, 2, 24, 33),
            (2, 1, 32, 64),
        ];
        let geometries = [
            (Grid::One, 32),
            (Grid::PerItem, 64),
            (Grid::Spare, 128),
            (Grid::PerItem, 96),
        ];
        let mut worst = [0f32; 2];
        each_case(&shapes, |c| {
            // Every geometry for one shape's packed rows, then one in turn.
            let launches = if c.shape == 1 && c.mask == 0 {
                &geometries[..]
            } else {
                &geometries[(c.mask * 2 + usize::from(c.rope)) % 4..][..1]
            };
            for &launch in launches {
                let at = format!(
                    "{:?} mask={} rope={} launch={launch:?}",
                    c.n,
                    c.name(),
                    c.rope
                );
                let got = in_both_schedules(&at, |schedule| {
                    cuda(c.inputs, c.n, &c.masking, launch, schedule)
                });
                for (i, (what, got, want)) in
                    [("y", &got[0], &c.want[0]), ("dqkv", &got[2], &c.want[1])]
                        .into_iter()
                        .enumerate()
                {
                    let gap = largest_gap(got, want);
                    worst[i] = worst[i].max(gap);
                    assert!(gap <= 1e-5, "{at}: {what} is {gap} from the plain ops");
                }
            }
        });
        eprintln!("largest gaps: y {}, dqkv {}", worst[0], worst[1]);
    }

    /// attention.cu's tensor-core kernels, executed by the SIMT shim (which multiplies the
    /// lanes' mma fragments as PTX lays them out), against `attention_plain` in f32: y and dqkv
    /// within 2 % of the largest value of the same head, the cost of rounding q, k, v, p, dy
    /// and ds to bf16 and of storing dqkv in bf16 (measured: 0.69 % and 1.17 %), and each
    /// row's log-sum-exp within 0.02 of
    /// the f32 kernels' (measured: 0.0065; -inf on the same rows). Every case of
    /// [`each_case`], every head width these kernels take, GQA groups, partial tiles, tiles
    /// seen whole (no masks), grids that loop or leave blocks idle, blocks of one to four
    /// warps, and both schedules giving the same bytes.
    #[test]
    fn the_tensor_core_kernels_match_the_plain_ops_to_bf16() {
        // The longest rows (100, 50) hold tiles every row of a warp sees whole, causal or not,
        // which the kernels leave the masks out of.
        let shapes = [
            (2, 1, 16, 13),
            (4, 2, 32, 45),
            (3, 3, 64, 70),
            (2, 1, 128, 50),
            (2, 1, 16, 100),
        ];
        let geometries = [
            (Grid::One, 32),
            (Grid::PerItem, 128),
            (Grid::Spare, 64),
            (Grid::PerItem, 96),
        ];
        let mut worst = [0f32; 3];
        each_case(&shapes, |c| {
            let (n, d) = (c.n, c.n.d);
            let launch = geometries[(c.shape + c.mask * 2 + usize::from(c.rope)) % 4];
            let at = format!("{n:?} mask={} rope={} launch={launch:?}", c.name(), c.rope);
            let got = in_both_schedules(&at, |schedule| {
                cuda_of(Family::Bf16(d), c.inputs, n, &c.masking, launch, schedule)
            });
            for (i, (what, got, want)) in
                [("y", &got[0], &c.want[0]), ("dqkv", &got[2], &c.want[1])]
                    .into_iter()
                    .enumerate()
            {
                let gap = largest_gap_by_head(got, want, want.len() / (n.b * n.t), d);
                worst[i] = worst[i].max(gap);
                assert!(gap <= 2e-2, "{at}: {what} is {gap} of a head's largest off");
            }
            // Each row's log-sum-exp, which the backward reads, against the f32 kernels':
            // -inf on the same rows (those that see no key), else close.
            let launch = (Grid::PerItem, 128);
            let f32_lse = &cuda(c.inputs, n, &c.masking, launch, Schedule::Forward)[1];
            for (r, (a, b)) in got[1].iter().zip(f32_lse).enumerate() {
                let gap = if a == b { 0.0 } else { (a - b).abs() };
                worst[2] = worst[2].max(gap);
                assert!(gap <= 2e-2, "{at}: lse {r} is {a}, the f32 kernel's {b}");
            }
        });
        eprintln!(
            "largest gaps: y {} and dqkv {} of a head's largest value; lse {}",
            worst[0], worst[1], worst[2]
        );
    }

    /// The largest gap of `got` from `want`, rows `width` wide of heads `d` wide, relative to
    /// the largest value of the same head over every row: a head the kernels get wrong stands
    /// out even where other heads' values are larger.
    fn largest_gap_by_head(got: &[f32], want: &[f32], width: usize, d: usize) -> f32 {
        assert_eq!(got.len(), want.len());
        let heads = width / d;
        let (mut gap, mut largest) = (vec![0f32; heads], vec![0f32; heads]);
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let head = i % width / d;
            gap[head] = gap[head].max((g - w).abs());
            largest[head] = largest[head].max(w.abs());
        }
        gap.iter()
            .zip(&largest)
            .map(|(g, l)| if *g == 0.0 { 0.0 } else { g / l })
            .fold(0f32, f32::max)
    }

    /// The CUDA forward keeps each row's log-sum-exp of its scaled, masked scores: what the
    /// backward recomputes the probabilities from.
    #[test]
    fn the_cuda_forward_keeps_each_rows_log_sum_exp() {
        let n = Sizes {
            b: 2,
            t: 7,
            h: 2,
            k: 1,
            d: 8,
        };
        let mut rng = Rng::new(5);
        let qkv = values(&randn(&mut rng, &[n.b, n.t, 4 * n.d], 1.0));
        let dy = vec![0f32; n.b * n.t * n.h * n.d];
        let segments = packed_segments(n.b, n.t);
        let masking = Masking {
            rope: None,
            segments: Some(&segments),
            causal: true,
        };
        let got = cuda(
            (&qkv, &dy),
            n,
            &masking,
            (Grid::PerItem, 64),
            Schedule::Forward,
        );
        let w = 4 * n.d;
        let scale = 1.0 / (n.d as f64).sqrt();
        for (b, h, r) in
            (0..n.b).flat_map(|b| (0..n.h).flat_map(move |h| (0..n.t).map(move |r| (b, h, r))))
        {
            let q = &qkv[(b * n.t + r) * w + h * n.d..][..n.d];
            let mut sum = 0f64;
            for c in 0..=r {
                if segments[b * n.t + c] == segments[b * n.t + r] {
                    let key = &qkv[(b * n.t + c) * w + 2 * n.d..][..n.d];
                    let s: f64 = q
                        .iter()
                        .zip(key)
                        .map(|(a, b)| f64::from(*a) * f64::from(*b))
                        .sum();
                    sum += (s * scale).exp();
                }
            }
            let lse = got[1][(b * n.h + h) * n.t + r];
            assert!(
                (f64::from(lse) - sum.ln()).abs() < 1e-5,
                "({b}, {h}, {r}): {lse} vs {}",
                sum.ln()
            );
        }
    }

    /// A head the kernels do not hold gives NaN everywhere, never a partial result: wider than
    /// 128 for the f32 kernels, another width than its own for a tensor-core kernel.
    #[test]
    fn the_cuda_kernels_answer_a_head_they_do_not_hold_with_nan() {
        for (family, d) in [
            (Family::F32, 130),
            (Family::Bf16(16), 24),
            (Family::Bf16(64), 32),
        ] {
            let n = Sizes {
                b: 1,
                t: 3,
                h: 1,
                k: 1,
                d,
            };
            let qkv = vec![0.5f32; n.t * 3 * n.d];
            let dy = vec![1f32; n.t * n.d];
            let masking = Masking {
                rope: None,
                segments: None,
                causal: true,
            };
            let launch = (Grid::PerItem, 32);
            let got = cuda_of(family, (&qkv, &dy), n, &masking, launch, Schedule::Forward);
            for (what, v) in ["y", "lse", "dqkv"].iter().zip(&got) {
                assert!(
                    v.iter().all(|x| x.is_nan()),
                    "{family:?} d={d} {what}: {v:?}"
                );
            }
        }
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
