//! The launches of one micro-batch, each with the geometry its `.cu` file documents.

use super::{Activations, BlockActs, DeviceStep, Heads, Slot, device};
use kernels::attention::{TENSOR_CORE_ROWS_PER_WARP as TENSOR_CORE_ROWS, tensor_core_kernel};
use kernels::launch::{Arg, Geometry, Launcher};
use kernels::linear::{Gemm, Precision};
use model::config::Activation;
use nemo_dag_op::RunError;

/// Threads per block of the row kernels (RMSNorm, cross-entropy, embedding): a multiple of 32.
const ROW_BLOCK: u32 = 128;
/// Blocks the row kernels and the element-wise kernels are launched with, at most.
const MAX_GRID: u32 = 1024;

/// Operand transposes of [`Kernels::gemm`]: `NT` is `a · bᵀ` (a linear layer's forward),
/// `NN` is `a · b` (its input gradient), `TN` is `aᵀ · b` (its weight gradient).
pub(super) const NT: (bool, bool) = (false, true);
const NN: (bool, bool) = (false, false);
const TN: (bool, bool) = (true, false);

/// Threads per block of attention.cu's kernels (its `ATTN_MAX_THREADS`): four warps, each
/// owning 2 query rows (forward, dq) or 4 keys (dk/dv) in the f32 kernels, 16 of either
/// ([`TENSOR_CORE_ROWS`]) in the tensor cores'.
const ATTN_BLOCK: u32 = 128;
const ATTN_WARPS: usize = ATTN_BLOCK as usize / 32;

/// What attention reads besides `qkv`: the micro-batch's shape (`batch` rows of `len` packed
/// tokens), its segment ids and its rotary tables.
pub(super) struct Packed<'a, B> {
    pub batch: usize,
    pub len: usize,
    pub acts: &'a Activations<B>,
}

impl<B> Packed<'_, B> {
    /// `[qkv, cos, sin, segments]`, the arguments every attention kernel opens with.
    fn inputs<'a>(&'a self, qkv: Arg<'a, B>) -> Result<[Arg<'a, B>; 4], RunError> {
        let table = |t: &'a Option<B>| t.as_ref().map_or(Arg::Null, |b| Arg::Ptr(b, 0));
        let segments = self.acts.segments.as_ref().ok_or_else(|| {
            RunError::new("GPU trainer: attention without segment ids".to_string())
        })?;
        Ok([
            qkv,
            table(&self.acts.cos),
            table(&self.acts.sin),
            Arg::Ptr(segments, 0),
        ])
    }

    /// `[batch, len, heads, kv_heads, head_dim, causal]`, the sizes they close with.
    fn sizes<'a>(&self, h: Heads) -> [Arg<'a, B>; 6] {
        [
            Arg::I32(self.batch as i32),
            Arg::I32(self.len as i32),
            Arg::I32(h.heads as i32),
            Arg::I32(h.kv_heads as i32),
            Arg::I32(h.dim as i32),
            Arg::I32(1),
        ]
    }
}

fn lse_of<B>(a: &BlockActs<B>) -> Result<&B, RunError> {
    a.lse
        .as_ref()
        .ok_or_else(|| RunError::new("GPU trainer: an attention block without lse".to_string()))
}

pub(super) fn row_grid(rows: usize) -> u32 {
    (rows as u32).clamp(1, MAX_GRID)
}

/// Attention's kernels loop over their work items (grid-stride), so any grid is correct.
fn attention_grid(items: usize) -> Geometry {
    Geometry::linear((items as u32).clamp(1, MAX_GRID), ATTN_BLOCK)
}

/// One block an item, for the tensor-core kernels: the GPU hands blocks to multiprocessors as
/// they free up, so the causal mask's uneven tiles (which the kernels take heaviest first)
/// balance themselves, where a grid of at most [`MAX_GRID`] leaves some blocks a second item.
fn item_grid(items: usize) -> Geometry {
    Geometry::linear(items.clamp(1, i32::MAX as usize) as u32, ATTN_BLOCK)
}

/// The kernel `stem` that writes its output in f32 (`stem_f32`) or, for products that alone
/// read it, rounded to bf16 (`stem_to_bf16`).
fn writing(stem: &str, to_bf16: bool) -> String {
    format!("{stem}_{}", if to_bf16 { "to_bf16" } else { "f32" })
}

pub(super) fn elementwise_grid(n: usize) -> u32 {
    (n.div_ceil(256) as u32).clamp(1, MAX_GRID)
}

/// The launches of one micro-batch of `rows` tokens, each with the geometry its `.cu` file
/// documents.
pub(super) struct Kernels<'l, L: Launcher> {
    pub launcher: &'l L,
    pub rows: usize,
    /// The matmuls' operands: f32, or bf16 with f32 sums ([`DeviceStep::precision`]).
    pub precision: Precision,
}

// By hand: a derive would ask `L: Copy`, and the launches only borrow their launcher.
impl<L: Launcher> Clone for Kernels<'_, L> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<L: Launcher> Copy for Kernels<'_, L> {}

impl<L: Launcher> Kernels<'_, L> {
    /// # Safety (for every launch below)
    /// The buffers were sized by [`DeviceStep::allocate`] for at least `rows` tokens and by
    /// [`Layout`] for the parameters; every argument has the type its kernel declares.
    pub(super) fn run(
        &self,
        name: &str,
        geometry: Geometry,
        args: &[Arg<'_, L::Buffer>],
    ) -> Result<(), RunError> {
        // SAFETY: see above; the shapes passed are the ones the buffers were sized with.
        unsafe { self.launcher.launch(name, geometry, args) }.map_err(device)
    }

    /// A grid-stride kernel over `n` elements, with the grid that covers them.
    pub(super) fn elementwise(
        &self,
        name: &str,
        n: usize,
        args: &[Arg<'_, L::Buffer>],
    ) -> Result<(), RunError> {
        self.run(name, Geometry::linear(elementwise_grid(n), 256), args)
    }

    fn rows(&self) -> i32 {
        self.rows as i32
    }

    pub(super) fn embedding(
        &self,
        table: Arg<'_, L::Buffer>,
        ids: &L::Buffer,
        out: Arg<'_, L::Buffer>,
        vocab: usize,
        dim: usize,
    ) -> Result<(), RunError> {
        let args = [
            table,
            Arg::Ptr(ids, 0),
            out,
            Arg::I32(self.rows()),
            Arg::I32(vocab as i32),
            Arg::I32(dim as i32),
        ];
        let geometry = Geometry::linear(row_grid(self.rows), ROW_BLOCK);
        self.run("embedding_fwd_f32", geometry, &args)
    }

    /// The gradient of the whole table, from `dout` of the rows `ids` looked up, into
    /// `acts.dtable`.
    pub(super) fn embedding_backward(
        &self,
        dout: Arg<'_, L::Buffer>,
        ids: &L::Buffer,
        acts: &Activations<L::Buffer>,
        vocab: usize,
        dim: usize,
    ) -> Result<(), RunError> {
        let args = [
            dout,
            Arg::Ptr(ids, 0),
            Arg::Ptr(&acts.dtable, 0),
            Arg::I32(self.rows()),
            Arg::I32(vocab as i32),
            Arg::I32(dim as i32),
        ];
        let geometry = Geometry::linear(row_grid(vocab), ROW_BLOCK);
        self.run("embedding_bwd_f32", geometry, &args)
    }

    /// `y = rms_norm(x) · w` and each row's `rstd`: `y` f32, or in bf16 where `to_bf16` (for
    /// the products that alone read it; the bytes a cast would make).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm(
        &self,
        x: Arg<'_, L::Buffer>,
        w: Arg<'_, L::Buffer>,
        y: Arg<'_, L::Buffer>,
        rstd: Arg<'_, L::Buffer>,
        d: usize,
        eps: f32,
        to_bf16: bool,
    ) -> Result<(), RunError> {
        let args = [
            x,
            w,
            y,
            rstd,
            Arg::I32(self.rows()),
            Arg::I32(d as i32),
            Arg::F32(eps),
        ];
        let geometry = Geometry::linear(row_grid(self.rows), ROW_BLOCK);
        self.run(&writing("rms_norm_fwd", to_bf16), geometry, &args)
    }

    /// dx of an RMSNorm, and its weight's gradient added into `grads` at `w`'s slot.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rms_norm_backward(
        &self,
        x: Arg<'_, L::Buffer>,
        w: Slot,
        rstd: Arg<'_, L::Buffer>,
        dy: Arg<'_, L::Buffer>,
        dx: Arg<'_, L::Buffer>,
        acts: &Activations<L::Buffer>,
        step: &DeviceStep<'_, L>,
    ) -> Result<(), RunError> {
        let grid = row_grid(self.rows);
        let d = w.len;
        let partial = Arg::Ptr(&acts.dw_partial, 0);
        let args = [
            x,
            w.at(&step.weights),
            rstd,
            dy,
            dx,
            partial,
            Arg::I32(self.rows()),
            Arg::I32(d as i32),
        ];
        self.run("rms_norm_bwd_f32", Geometry::linear(grid, ROW_BLOCK), &args)?;
        let dw = Arg::Ptr(&acts.dw, 0);
        let reduce = [partial, dw, Arg::I32(grid as i32), Arg::I32(d as i32)];
        let geometry = Geometry::linear(d.div_ceil(128) as u32, 128);
        self.run("rms_norm_dw_reduce", geometry, &reduce)?;
        self.add(w.at(&step.grads), dw, d)
    }

    /// `y` of the MLP's activation of `h`: f32, or in bf16 where `to_bf16` (for products to
    /// read uncast; the bytes a cast would make).
    pub(super) fn activation(
        &self,
        activation: Activation,
        h: Arg<'_, L::Buffer>,
        y: Arg<'_, L::Buffer>,
        f: usize,
        to_bf16: bool,
    ) -> Result<(), RunError> {
        let n = self.rows * f;
        let geometry = Geometry::linear(elementwise_grid(n), 256);
        match activation {
            Activation::Swiglu => self.run(
                &writing("swiglu_fwd", to_bf16),
                geometry,
                &[h, y, Arg::I32(self.rows()), Arg::I32(f as i32)],
            ),
            Activation::Relu2 => self.run(
                &writing("relu2_fwd", to_bf16),
                geometry,
                &[h, y, Arg::Usize(n)],
            ),
        }
    }

    /// `dh` of the MLP's activation from `dy`: f32, or in bf16 where `to_bf16`.
    pub(super) fn activation_backward(
        &self,
        activation: Activation,
        h: Arg<'_, L::Buffer>,
        dy: Arg<'_, L::Buffer>,
        dh: Arg<'_, L::Buffer>,
        f: usize,
        to_bf16: bool,
    ) -> Result<(), RunError> {
        let n = self.rows * f;
        let geometry = Geometry::linear(elementwise_grid(n), 256);
        match activation {
            Activation::Swiglu => self.run(
                &writing("swiglu_bwd", to_bf16),
                geometry,
                &[h, dy, dh, Arg::I32(self.rows()), Arg::I32(f as i32)],
            ),
            Activation::Relu2 => self.run(
                &writing("relu2_bwd", to_bf16),
                geometry,
                &[h, dy, dh, Arg::Usize(n)],
            ),
        }
    }

    /// Per-token cross-entropy of the logits against `labels`, with each row's log-sum-exp.
    pub(super) fn cross_entropy(
        &self,
        logits: Arg<'_, L::Buffer>,
        labels: &L::Buffer,
        acts: &Activations<L::Buffer>,
        vocab: usize,
    ) -> Result<(), RunError> {
        let geometry = Geometry::linear(row_grid(self.rows), ROW_BLOCK);
        let (labels, lse) = (Arg::Ptr(labels, 0), Arg::Ptr(&acts.lse, 0));
        let (rows, vocab) = (Arg::I32(self.rows()), Arg::I32(vocab as i32));
        let ce = Arg::Ptr(&acts.ce, 0);
        self.run(
            "cross_entropy_fwd_f32",
            geometry,
            &[logits, labels, ce, lse, rows, vocab],
        )
    }

    /// The logits' gradient from [`Kernels::cross_entropy`]'s, each token's scaled by its
    /// weight `dloss` (∂loss/∂CE), into `acts.dlogits`: in bf16 when the step multiplies in
    /// bf16 (the bytes a cast would make of the f32 ones, for [`Kernels::head_backward`]'s
    /// products to read uncast), else f32.
    pub(super) fn cross_entropy_backward(
        &self,
        logits: Arg<'_, L::Buffer>,
        labels: &L::Buffer,
        dloss: Arg<'_, L::Buffer>,
        acts: &Activations<L::Buffer>,
        vocab: usize,
    ) -> Result<(), RunError> {
        let geometry = Geometry::linear(row_grid(self.rows), ROW_BLOCK);
        let (labels, lse) = (Arg::Ptr(labels, 0), Arg::Ptr(&acts.lse, 0));
        let (rows, vocab) = (Arg::I32(self.rows()), Arg::I32(vocab as i32));
        let dlogits = Arg::Ptr(&acts.dlogits, 0);
        self.run(
            &writing("cross_entropy_bwd", self.bf16()),
            geometry,
            &[logits, labels, lse, dloss, dlogits, rows, vocab],
        )
    }

    /// Causal attention of every head over the packed segments: `y` (`rows × heads·dim`) from
    /// `qkv` (`rows × (heads + 2·kv_heads)·dim`), and each row's log-sum-exp for the backward.
    /// At bf16 precision, where the head width has them, on the tensor cores (from `qkv` as
    /// bf16 heads); else attention.cu's f32 kernel.
    pub(super) fn attention(
        &self,
        qkv: Arg<'_, L::Buffer>,
        y: Arg<'_, L::Buffer>,
        a: &BlockActs<L::Buffer>,
        h: Heads,
        p: &Packed<'_, L::Buffer>,
    ) -> Result<(), RunError> {
        let outputs = [y, Arg::Ptr(lse_of(a)?, 0)];
        let Some(kernel) = self.tensor_cores("attention_fwd", h) else {
            let args = [&p.inputs(qkv)?[..], &outputs, &p.sizes(h)].concat();
            let query_tiles = p.batch * h.heads * p.len.div_ceil(2 * ATTN_WARPS);
            return self.run("attention_fwd_f32", attention_grid(query_tiles), &args);
        };
        let packed = self.pack_heads(qkv, None, h, p)?;
        let segments = p.inputs(qkv)?[3];
        let args = [&[Arg::Ptr(packed, 0), segments][..], &outputs, &p.sizes(h)].concat();
        let query_tiles = p.batch * h.heads * p.len.div_ceil(TENSOR_CORE_ROWS * ATTN_WARPS);
        self.run(&kernel, item_grid(query_tiles), &args)
    }

    /// Whether [`Kernels::attention_backward`] writes `dqkv` in bf16: on the tensor cores,
    /// which do (for the qkv projection's products to read uncast).
    pub(super) fn attention_grad_is_bf16(&self, h: Heads) -> bool {
        self.tensor_cores("attention_bwd_dq", h).is_some()
    }

    /// The tensor-core kernel of attention.cu for `stage`, where the step multiplies in bf16
    /// and the head width has one.
    fn tensor_cores(&self, stage: &str, h: Heads) -> Option<String> {
        match self.precision {
            Precision::Bf16 => tensor_core_kernel(stage, h.dim),
            Precision::F32 => None,
        }
    }

    /// `qkv` (RoPE applied to q and k) and, for the backward, `dy` as bf16 heads of contiguous
    /// rows in the step's packed-heads buffer (attention_pack_bf16): dy after qkv.
    fn pack_heads<'p>(
        &self,
        qkv: Arg<'_, L::Buffer>,
        dy: Option<Arg<'_, L::Buffer>>,
        h: Heads,
        p: &'p Packed<'_, L::Buffer>,
    ) -> Result<&'p L::Buffer, RunError> {
        let packed = p.acts.packed_heads.as_ref().ok_or_else(|| {
            RunError::new("GPU trainer: attention without its packed-heads buffer".to_string())
        })?;
        let [_, cos, sin, _] = p.inputs(qkv)?;
        let (batch, len) = (Arg::I32(p.batch as i32), Arg::I32(p.len as i32));
        let all = h.heads + 2 * h.kv_heads;
        let pack = |x, (cos, sin), at, heads: usize, rotated: usize| {
            let args = [
                x,
                cos,
                sin,
                Arg::Ptr(packed, at),
                batch,
                len,
                Arg::I32(heads as i32),
                Arg::I32(rotated as i32),
                Arg::I32(h.dim as i32),
            ];
            let pairs = self.rows * heads * h.dim / 2;
            self.run(
                "attention_pack_bf16",
                Geometry::linear(elementwise_grid(pairs), 256),
                &args,
            )
        };
        pack(qkv, (cos, sin), 0, all, h.heads + h.kv_heads)?;
        if let Some(dy) = dy {
            pack(dy, (Arg::Null, Arg::Null), self.packed_dy_at(h), h.heads, 0)?;
        }
        Ok(packed)
    }

    /// Where dy starts in the packed-heads buffer, in bytes: after qkv's `(h + 2k)·d` bf16s a
    /// row (16-byte aligned, as the kernels' copies need: `d` is a multiple of 16).
    fn packed_dy_at(&self, h: Heads) -> usize {
        self.rows * (h.heads + 2 * h.kv_heads) * h.dim * 2
    }

    /// The gradient of `qkv` (`dqkv`, RoPE undone) from the gradient `dy` of the block's
    /// attention output: Σ dy·y per row, then dq per query tile and dk, dv per key tile, with
    /// no atomics; on the tensor cores where the forward was, which write it in bf16
    /// ([`Kernels::attention_grad_is_bf16`]).
    pub(super) fn attention_backward(
        &self,
        a: &BlockActs<L::Buffer>,
        dy: Arg<'_, L::Buffer>,
        dqkv: Arg<'_, L::Buffer>,
        h: Heads,
        p: &Packed<'_, L::Buffer>,
    ) -> Result<(), RunError> {
        let delta = p.acts.delta.as_ref().ok_or_else(|| {
            RunError::new("GPU trainer: attention without its delta buffer".to_string())
        })?;
        let (batch, len) = (Arg::I32(p.batch as i32), Arg::I32(p.len as i32));
        let delta_args = [
            Arg::Ptr(&a.mixed, 0),
            dy,
            Arg::Ptr(delta, 0),
            batch,
            len,
            Arg::I32(h.heads as i32),
            Arg::I32(h.dim as i32),
        ];
        let rows = (p.batch * h.heads * p.len).div_ceil(ATTN_WARPS);
        self.run("attention_bwd_delta_f32", attention_grid(rows), &delta_args)?;
        let (lse, delta) = (Arg::Ptr(lse_of(a)?, 0), Arg::Ptr(delta, 0));
        let qkv = Arg::Ptr(&a.projected, 0);
        let kernels = (
            self.tensor_cores("attention_bwd_dq", h),
            self.tensor_cores("attention_bwd_dkv", h),
        );
        let (Some(dq), Some(dkv)) = kernels else {
            let args = [&p.inputs(qkv)?[..], &[dy, lse, delta, dqkv], &p.sizes(h)].concat();
            let query_tiles = p.batch * h.heads * p.len.div_ceil(2 * ATTN_WARPS);
            self.run("attention_bwd_dq_f32", attention_grid(query_tiles), &args)?;
            let key_tiles = p.batch * h.kv_heads * p.len.div_ceil(4 * ATTN_WARPS);
            return self.run("attention_bwd_dkv_f32", attention_grid(key_tiles), &args);
        };
        let packed = self.pack_heads(qkv, Some(dy), h, p)?;
        let packed_dy = Arg::Ptr(packed, self.packed_dy_at(h));
        let [_, cos, sin, segments] = p.inputs(qkv)?;
        let inputs = [Arg::Ptr(packed, 0), cos, sin, segments];
        let args = [&inputs[..], &[packed_dy, lse, delta, dqkv], &p.sizes(h)].concat();
        let tiles = p.len.div_ceil(TENSOR_CORE_ROWS * ATTN_WARPS);
        self.run(&dq, item_grid(p.batch * h.heads * tiles), &args)?;
        self.run(&dkv, item_grid(p.batch * h.kv_heads * tiles), &args)
    }

    /// `c = op(a) · op(b) + beta · c` for `(m, n, k)`, at the step's precision.
    pub(super) fn gemm(
        &self,
        a: Arg<'_, L::Buffer>,
        b: Arg<'_, L::Buffer>,
        c: Arg<'_, L::Buffer>,
        dims: (usize, usize, usize),
        trans: (bool, bool),
        beta: f32,
    ) -> Result<(), RunError> {
        self.gemm_of(a, b, c, dims, trans, beta, (false, false))
    }

    /// [`Kernels::gemm`] with `a` and `b` stored as bf16 where `bf16_inputs` says (written so
    /// by the kernels that made them, read uncast).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm_of(
        &self,
        a: Arg<'_, L::Buffer>,
        b: Arg<'_, L::Buffer>,
        c: Arg<'_, L::Buffer>,
        (m, n, k): (usize, usize, usize),
        (trans_a, trans_b): (bool, bool),
        beta: f32,
        bf16_inputs: (bool, bool),
    ) -> Result<(), RunError> {
        let gemm = Gemm {
            m,
            n,
            k,
            trans_a,
            trans_b,
            alpha: 1.0,
            beta,
            precision: self.precision,
            bf16_inputs,
        };
        // SAFETY: as `run`: the shapes passed are the ones the buffers were sized with.
        unsafe { self.launcher.gemm(&gemm, a, b, c) }.map_err(device)
    }

    /// The backward of a linear layer `y = x · wᵀ` over `dims = (rows, outputs, inputs)`: the
    /// weight's gradient added into `dw` (`dyᵀ · x`), and `dx = dy · w + beta · dx`.
    pub(super) fn linear_backward(
        &self,
        dy: Arg<'_, L::Buffer>,
        x: Arg<'_, L::Buffer>,
        (w, dw): (Arg<'_, L::Buffer>, Arg<'_, L::Buffer>),
        dx: Arg<'_, L::Buffer>,
        dims: (usize, usize, usize),
        beta: f32,
    ) -> Result<(), RunError> {
        self.linear_backward_of(dy, x, (w, dw), dx, dims, beta, (false, false))
    }

    /// [`Kernels::linear_backward`] with `dy` and `x` stored as bf16 where `(dy_bf16,
    /// x_bf16)` says (written so by the kernels that made them, read uncast).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn linear_backward_of(
        &self,
        dy: Arg<'_, L::Buffer>,
        x: Arg<'_, L::Buffer>,
        (w, dw): (Arg<'_, L::Buffer>, Arg<'_, L::Buffer>),
        dx: Arg<'_, L::Buffer>,
        (rows, outputs, inputs): (usize, usize, usize),
        beta: f32,
        (dy_bf16, x_bf16): (bool, bool),
    ) -> Result<(), RunError> {
        let dims = (outputs, inputs, rows);
        self.gemm_of(dy, x, dw, dims, TN, 1.0, (dy_bf16, x_bf16))?;
        self.gemm_of(
            dy,
            w,
            dx,
            (rows, inputs, outputs),
            NN,
            beta,
            (dy_bf16, false),
        )
    }

    /// [`Kernels::linear_backward`] of the output head `logits = x · wᵀ` (`rows × vocab`),
    /// from `acts.dlogits` as [`Kernels::cross_entropy_backward`] wrote them, into `dx`: when
    /// the step multiplies in bf16, the gradients and `x` (the final norm's rows) are bf16,
    /// read uncast.
    pub(super) fn head_backward(
        &self,
        acts: &Activations<L::Buffer>,
        x: Arg<'_, L::Buffer>,
        (w, dw): (Arg<'_, L::Buffer>, Arg<'_, L::Buffer>),
        dx: Arg<'_, L::Buffer>,
        (rows, vocab, hidden): (usize, usize, usize),
    ) -> Result<(), RunError> {
        let dlogits = Arg::Ptr(&acts.dlogits, 0);
        let dims = (rows, vocab, hidden);
        let inputs = (self.bf16(), self.bf16());
        self.linear_backward_of(dlogits, x, (w, dw), dx, dims, 0.0, inputs)
    }

    /// Whether the step multiplies in bf16, so that a kernel whose output only products read
    /// writes it in bf16.
    pub(super) fn bf16(&self) -> bool {
        self.precision == Precision::Bf16
    }

    /// `dst[:, dst_at + j] = src[:, src_at + j]` for `j < width`, over the micro-batch's rows.
    pub(super) fn columns(
        &self,
        (dst, dst_cols, dst_at): (Arg<'_, L::Buffer>, usize, usize),
        (src, src_cols, src_at): (Arg<'_, L::Buffer>, usize, usize),
        width: usize,
    ) -> Result<(), RunError> {
        let args = [
            dst,
            Arg::I32(dst_cols as i32),
            Arg::I32(dst_at as i32),
            src,
            Arg::I32(src_cols as i32),
            Arg::I32(src_at as i32),
            Arg::I32(self.rows as i32),
            Arg::I32(width as i32),
        ];
        self.elementwise("copy_columns_f32", self.rows * width, &args)
    }

    /// `acc += x` over `n` floats.
    pub(super) fn add(
        &self,
        acc: Arg<'_, L::Buffer>,
        x: Arg<'_, L::Buffer>,
        n: usize,
    ) -> Result<(), RunError> {
        let geometry = Geometry::linear(elementwise_grid(n), 256);
        self.run("add_f32", geometry, &[acc, x, Arg::Usize(n)])
    }

    /// Copies `n` floats from `src` to `dst` (regions that do not overlap).
    pub(super) fn copy(
        &self,
        src: Arg<'_, L::Buffer>,
        dst: Arg<'_, L::Buffer>,
        n: usize,
    ) -> Result<(), RunError> {
        let geometry = Geometry::linear(elementwise_grid(n), 256);
        self.run("copy_f32", geometry, &[dst, src, Arg::Usize(n)])
    }
}
