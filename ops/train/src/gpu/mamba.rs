//! A Mamba-2 block's mixer on a device: the launches between its input projection (`in_proj`)
//! and its output projection (`out_proj`), forward and backward, in the order of
//! ops/model/src/mamba2.rs (Megatron-LM's `MambaMixer`):
//!
//! ```text
//! [z, xBC, dt] = columns of in_proj's output
//! xBC = SiLU(causal_conv(xBC))        [x, B, C] = columns of xBC       causal_conv_silu.cu
//! Δ = softplus(dt + dt_bias)          A = −exp(A_log)                  mamba2.cu
//! y = SSD scan(x, Δ, A, B, C) + D·x                                    ssd.cu, mamba2.cu
//! out = gated_rms_norm(y, z) · norm                                    gated_rms_norm.cu
//! ```
//!
//! The backward runs the same list in reverse and joins the gradients of z, xBC and dt into the
//! gradient of in_proj's output. Every parameter's gradient is summed in a fixed order (partial
//! rows per block, then one pass over them), so a step's bytes never depend on timing.

use super::launches::{Kernels, row_grid};
use super::{BlockActs, Slot};
use kernels::launch::{Arg, Geometry, Launcher};
use nemo_dag_op::RunError;

/// Threads per block of the scan's and the convolution's block-per-item kernels.
const BLOCK: u32 = 128;
/// Blocks of the convolution's weight-gradient partials, at most.
const CONV_PARTIALS: usize = 256;

/// A Mamba-2 mixer's sizes and the slots of its parameters besides in_proj and out_proj.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ssm {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state: usize,
    pub conv: usize,
    pub chunk: usize,
    pub eps: f32,
    pub conv_weight: Slot,
    pub conv_bias: Slot,
    pub dt_bias: Slot,
    pub a_log: Slot,
    pub d: Slot,
    pub norm: Slot,
}

impl Ssm {
    /// `d_inner = H·P`: the width of z, x, y and the mixer's output.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// `G·N`: the width of B and of C.
    fn group_state(&self) -> usize {
        self.groups * self.state
    }

    /// The convolution's channels, `[x, B, C]`.
    pub fn channels(&self) -> usize {
        self.inner() + 2 * self.group_state()
    }

    /// in_proj's rows: `[z, xBC, dt]`.
    pub fn projected(&self) -> usize {
        self.inner() + self.channels() + self.heads
    }

    /// The floats of a state for every (row, head, chunk) of `chunk_rows` (row, chunk) pairs.
    fn states(&self, chunk_rows: usize) -> usize {
        chunk_rows * self.heads * self.head_dim * self.state
    }

    fn conv_partials(rows: usize) -> usize {
        rows.div_ceil(64).clamp(1, CONV_PARTIALS)
    }
}

/// What one Mamba-2 block keeps from its forward for its backward, for `rows` tokens in
/// `chunk_rows` (row, chunk) pairs.
pub(super) struct MambaActs<B> {
    /// The convolution's input, `rows × channels`.
    xbc_in: B,
    /// The gate z, `rows × inner`; x, `rows × inner`; B and C, `rows × G·N`; Δ, `rows × H`.
    z: B,
    x: B,
    b: B,
    c: B,
    dt: B,
    /// `A`, `H` floats.
    a: B,
    /// The state entering every chunk, `chunk_rows × H × P × N`: the backward's checkpoints.
    entering: B,
    /// The scan's output plus the skip, `rows × inner`.
    y: B,
    /// The gated norm's 1/rms per (token, group).
    rstd: B,
}

/// The Mamba-2 blocks' scratch, shared by every block (sized for the widest).
pub(super) struct MambaScratch<B> {
    conv_out: B,
    cs: B,
    own: B,
    scan: B,
    dy: B,
    dz: B,
    dx: B,
    ddt: B,
    db_h: B,
    dc_h: B,
    da_row: B,
    db: B,
    dc: B,
    da: B,
    dxbc: B,
    dpre: B,
    dxbc_in: B,
    conv_partial: B,
    dconv_w: B,
    dconv_b: B,
    norm_partial: B,
    dnorm: B,
    draw: B,
    dparam: B,
}

impl<B> MambaActs<B> {
    pub fn allocate(
        alloc: &impl Fn(usize) -> Result<B, RunError>,
        s: &Ssm,
        rows: usize,
        chunk_rows: usize,
    ) -> Result<Self, RunError> {
        Ok(MambaActs {
            xbc_in: alloc(rows * s.channels())?,
            z: alloc(rows * s.inner())?,
            x: alloc(rows * s.inner())?,
            b: alloc(rows * s.group_state())?,
            c: alloc(rows * s.group_state())?,
            dt: alloc(rows * s.heads)?,
            a: alloc(s.heads)?,
            entering: alloc(s.states(chunk_rows))?,
            y: alloc(rows * s.inner())?,
            rstd: alloc(rows * s.groups)?,
        })
    }
}

impl<B> MambaScratch<B> {
    /// Scratch for every Mamba-2 block of `ssms`; `None` when there is none.
    pub fn allocate(
        alloc: &impl Fn(usize) -> Result<B, RunError>,
        ssms: &[Ssm],
        (rows, batch, chunk_rows): (usize, usize, usize),
    ) -> Result<Option<Self>, RunError> {
        if ssms.is_empty() {
            return Ok(None);
        }
        let widest = |f: &dyn Fn(&Ssm) -> usize| ssms.iter().map(f).max().unwrap_or(0);
        let channels = widest(&|s| s.channels());
        let inner = widest(&|s| s.inner());
        let heads = widest(&|s| s.heads);
        let per_head = widest(&|s| s.heads * s.state);
        let gn = widest(&|s| s.group_state());
        let states = widest(&|s| s.states(chunk_rows));
        let scan = widest(&|s| batch * s.heads * (s.chunk + 5) * s.head_dim * s.state);
        let cs = widest(&|s| chunk_rows * s.heads * s.chunk);
        let conv = widest(&|s| (s.conv + 1) * s.channels());
        Ok(Some(MambaScratch {
            conv_out: alloc(rows * channels)?,
            cs: alloc(cs)?,
            own: alloc(states)?,
            scan: alloc(scan)?,
            dy: alloc(rows * inner)?,
            dz: alloc(rows * inner)?,
            dx: alloc(rows * inner)?,
            ddt: alloc(rows * heads)?,
            db_h: alloc(rows * per_head)?,
            dc_h: alloc(rows * per_head)?,
            da_row: alloc(batch * heads)?,
            db: alloc(rows * gn)?,
            dc: alloc(rows * gn)?,
            da: alloc(heads)?,
            dxbc: alloc(rows * channels)?,
            dpre: alloc(rows * channels)?,
            dxbc_in: alloc(rows * channels)?,
            conv_partial: alloc(Ssm::conv_partials(rows) * conv)?,
            dconv_w: alloc(conv)?,
            dconv_b: alloc(channels)?,
            norm_partial: alloc(row_grid(rows * widest(&|s| s.groups)) as usize * inner)?,
            dnorm: alloc(inner)?,
            draw: alloc(rows * heads)?,
            dparam: alloc(heads)?,
        }))
    }
}

/// The shape of one micro-batch the scan runs over: `batch` rows of `len` tokens, and each
/// token's run start inside its row (int32, `rows` of them).
pub(super) struct Scan<'a, B> {
    pub batch: usize,
    pub len: usize,
    pub starts: &'a B,
}

/// A whole buffer as a kernel argument.
fn at<B>(buffer: &B) -> Arg<'_, B> {
    Arg::Ptr(buffer, 0)
}

fn missing(what: &str) -> RunError {
    RunError::new(format!("GPU trainer: a Mamba-2 block without its {what}"))
}

impl<L: Launcher> Kernels<'_, L> {
    /// `out[h] = Σ u·v` over every (row, head h, p < `p`) of `[rows, H, p]`; `v` null: `Σ u`.
    fn head_sums(
        &self,
        u: Arg<'_, L::Buffer>,
        v: Arg<'_, L::Buffer>,
        out: Arg<'_, L::Buffer>,
        heads: usize,
        p: usize,
    ) -> Result<(), RunError> {
        let geometry = Geometry::linear((heads as u32).clamp(1, 1024), 256);
        let sizes = [self.rows, heads, p].map(|v| Arg::I32(v as i32));
        self.run(
            "mamba_head_sums_f32",
            geometry,
            &[&[u, v, out], &sizes[..]].concat(),
        )
    }

    /// The mixer of a Mamba-2 block: `out` (`rows × inner`, the block's `mixed`) from in_proj's
    /// output (`rows × projected`).
    pub(super) fn mamba(
        &self,
        w: &L::Buffer,
        s: &Ssm,
        block: &BlockActs<L::Buffer>,
        scratch: &MambaScratch<L::Buffer>,
        scan: &Scan<'_, L::Buffer>,
    ) -> Result<(), RunError> {
        let m = block.mamba.as_ref().ok_or_else(|| missing("activations"))?;
        let (inner, ch, gn, h) = (s.inner(), s.channels(), s.group_state(), s.heads);
        let projected = (Arg::Ptr(&block.projected, 0), s.projected());
        let rows = self.rows;
        self.columns((at(&m.z), inner, 0), (projected.0, projected.1, 0), inner)?;
        self.columns(
            (at(&m.xbc_in), ch, 0),
            (projected.0, projected.1, inner),
            ch,
        )?;
        let conv = [
            at(&m.xbc_in),
            s.conv_weight.at(w),
            s.conv_bias.at(w),
            at(scan.starts),
            at(&scratch.conv_out),
            Arg::I32(rows as i32),
            Arg::I32(scan.len as i32),
            Arg::I32(ch as i32),
            Arg::I32(s.conv as i32),
        ];
        self.elementwise("causal_conv_silu_fwd_f32", rows * ch, &conv)?;
        let conv_out = at(&scratch.conv_out);
        self.columns((at(&m.x), inner, 0), (conv_out, ch, 0), inner)?;
        self.columns((at(&m.b), gn, 0), (conv_out, ch, inner), gn)?;
        self.columns((at(&m.c), gn, 0), (conv_out, ch, inner + gn), gn)?;
        self.step_size(w, s, m, projected)?;
        self.ssd(s, m, scratch, scan)?;
        let skip = [at(&m.y), at(&m.x), s.d.at(w)];
        let sizes = [rows, h, s.head_dim].map(|v| Arg::I32(v as i32));
        self.elementwise(
            "mamba_skip_fwd_f32",
            rows * inner,
            &[&skip[..], &sizes].concat(),
        )?;
        self.gated_norm(w, s, m, block)
    }

    /// One token a row of a Mamba-2 block's mixer, against the row's convolution `window`
    /// `(B, K, channels)` and SSM `state` `(B, H, P, N)`, which move on only for the rows
    /// whose `active` flag (int32) is set: `block.mixed` from in_proj's output, as
    /// ops/model's `Mamba2::step` (decode.cu's kernels in place of the convolution and the
    /// scan; the same step size and gated norm as [`Kernels::mamba`]).
    pub(super) fn mamba_step(
        &self,
        w: &L::Buffer,
        s: &Ssm,
        block: &BlockActs<L::Buffer>,
        scratch: &MambaScratch<L::Buffer>,
        (window, state): (&L::Buffer, &L::Buffer),
        active: &L::Buffer,
    ) -> Result<(), RunError> {
        let m = block.mamba.as_ref().ok_or_else(|| missing("activations"))?;
        let (inner, ch, rows) = (s.inner(), s.channels(), self.rows);
        let projected = (Arg::Ptr(&block.projected, 0), s.projected());
        self.columns((at(&m.z), inner, 0), (projected.0, projected.1, 0), inner)?;
        let conv = [
            projected.0,
            Arg::I32(projected.1 as i32),
            Arg::I32(inner as i32),
            s.conv_weight.at(w),
            s.conv_bias.at(w),
            at(window),
            at(active),
            at(&scratch.conv_out),
            Arg::I32(rows as i32),
            Arg::I32(ch as i32),
            Arg::I32(s.conv as i32),
        ];
        self.elementwise("decode_conv_step_f32", rows * ch, &conv)?;
        self.step_size(w, s, m, projected)?;
        let scan = [
            at(&scratch.conv_out),
            at(&m.dt),
            at(&m.a),
            s.d.at(w),
            at(state),
            at(active),
            at(&m.y),
        ];
        let sizes = [rows, s.heads, s.head_dim, s.groups, s.state].map(|v| Arg::I32(v as i32));
        self.elementwise(
            "decode_ssm_step_f32",
            rows * inner,
            &[&scan[..], &sizes].concat(),
        )?;
        self.gated_norm(w, s, m, block)
    }

    /// `Δ = softplus(dt + dt_bias)` from the dt columns of in_proj's output, and `A`.
    fn step_size(
        &self,
        w: &L::Buffer,
        s: &Ssm,
        m: &MambaActs<L::Buffer>,
        (projected, cols): (Arg<'_, L::Buffer>, usize),
    ) -> Result<(), RunError> {
        let h = s.heads;
        let dt = [
            projected,
            Arg::I32(cols as i32),
            Arg::I32((s.inner() + s.channels()) as i32),
            s.dt_bias.at(w),
            at(&m.dt),
            Arg::I32(self.rows as i32),
            Arg::I32(h as i32),
        ];
        self.elementwise("mamba_dt_fwd_f32", self.rows * h, &dt)?;
        let a = [s.a_log.at(w), at(&m.a), Arg::I32(h as i32)];
        self.elementwise("mamba_a_fwd_f32", h, &a)
    }

    /// The block's output, `block.mixed = gated_rms_norm(y, z) · norm`.
    fn gated_norm(
        &self,
        w: &L::Buffer,
        s: &Ssm,
        m: &MambaActs<L::Buffer>,
        block: &BlockActs<L::Buffer>,
    ) -> Result<(), RunError> {
        let rows = self.rows;
        let norm = [
            at(&m.y),
            at(&m.z),
            s.norm.at(w),
            Arg::Ptr(&block.mixed, 0),
            at(&m.rstd),
            Arg::I32(rows as i32),
            Arg::I32(s.inner() as i32),
            Arg::I32(s.groups as i32),
            Arg::F32(s.eps),
        ];
        let items = row_grid(rows * s.groups);
        self.run(
            "gated_rms_norm_fwd_f32",
            Geometry::linear(items, 128),
            &norm,
        )
    }

    /// The chunked scan's four launches: `m.y` and the states entering each chunk.
    fn ssd(
        &self,
        s: &Ssm,
        m: &MambaActs<L::Buffer>,
        scratch: &MambaScratch<L::Buffer>,
        scan: &Scan<'_, L::Buffer>,
    ) -> Result<(), RunError> {
        let chunks = scan.len.div_ceil(s.chunk);
        let items = scan.batch * s.heads * chunks;
        let [batch, len, heads, p, groups, n, chunk] = [
            scan.batch, scan.len, s.heads, s.head_dim, s.groups, s.state, s.chunk,
        ]
        .map(|v| Arg::I32(v as i32));
        let per_item = Geometry::linear((items as u32).clamp(1, 1024), BLOCK);
        let cumsum = [
            at(&m.dt),
            at(&m.a),
            at(&scratch.cs),
            batch,
            len,
            heads,
            chunk,
        ];
        self.elementwise("ssd_chunk_cumsum_f32", items, &cumsum)?;
        let state = [
            at(&m.x),
            at(&m.dt),
            at(&m.b),
            at(&scratch.cs),
            at(scan.starts),
            at(&scratch.own),
            batch,
            len,
            heads,
            p,
            groups,
            n,
            chunk,
        ];
        self.run("ssd_chunk_state_f32", per_item, &state)?;
        let passing = [
            at(&scratch.cs),
            at(scan.starts),
            at(&scratch.own),
            at(&m.entering),
            batch,
            len,
            heads,
            p,
            n,
            chunk,
        ];
        let per_row_head = (scan.batch * s.heads) as u32;
        let geometry = Geometry::linear(per_row_head.clamp(1, 1024), BLOCK);
        self.run("ssd_state_passing_f32", geometry, &passing)?;
        let scan_args = [
            at(&m.x),
            at(&m.dt),
            at(&m.b),
            at(&m.c),
            at(&scratch.cs),
            at(scan.starts),
            at(&m.entering),
            at(&m.y),
            batch,
            len,
            heads,
            p,
            groups,
            n,
            chunk,
        ];
        self.run("ssd_chunk_scan_f32", per_item, &scan_args)
    }

    /// The backward of [`Kernels::mamba`]: from `dout` (the gradient of the mixer's output),
    /// `dprojected` (the gradient of in_proj's output), and the gradients of conv_weight,
    /// conv_bias, dt_bias, A_log, D and norm added into `grads`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn mamba_backward(
        &self,
        (w, grads): (&L::Buffer, &L::Buffer),
        s: &Ssm,
        block: &BlockActs<L::Buffer>,
        scratch: &MambaScratch<L::Buffer>,
        scan: &Scan<'_, L::Buffer>,
        dout: Arg<'_, L::Buffer>,
        dprojected: Arg<'_, L::Buffer>,
    ) -> Result<(), RunError> {
        let m = block.mamba.as_ref().ok_or_else(|| missing("activations"))?;
        let (inner, ch, gn, h, p) = (
            s.inner(),
            s.channels(),
            s.group_state(),
            s.heads,
            s.head_dim,
        );
        let rows = self.rows;

        // Gated norm: dy, dz, and the norm's weight.
        let items = row_grid(rows * s.groups);
        let norm = [
            at(&m.y),
            at(&m.z),
            s.norm.at(w),
            at(&m.rstd),
            dout,
            at(&scratch.dy),
            at(&scratch.dz),
            at(&scratch.norm_partial),
            Arg::I32(rows as i32),
            Arg::I32(inner as i32),
            Arg::I32(s.groups as i32),
        ];
        self.run(
            "gated_rms_norm_bwd_f32",
            Geometry::linear(items, 128),
            &norm,
        )?;
        let reduce = [
            at(&scratch.norm_partial),
            at(&scratch.dnorm),
            Arg::I32(items as i32),
            Arg::I32(inner as i32),
        ];
        let columns = Geometry::linear(inner.div_ceil(128) as u32, 128);
        self.run("gated_rms_norm_dw_reduce", columns, &reduce)?;
        self.add(s.norm.at(grads), at(&scratch.dnorm), inner)?;

        // The scan: dx, dΔ, dB, dC, dA; then the skip's share of dx and D's gradient.
        let [batch, len, heads, pp, groups, n, chunk] =
            [scan.batch, scan.len, h, p, s.groups, s.state, s.chunk].map(|v| Arg::I32(v as i32));
        let ssd = [
            at(&m.x),
            at(&m.dt),
            at(&m.a),
            at(&m.b),
            at(&m.c),
            at(scan.starts),
            at(&m.entering),
            at(&scratch.dy),
            at(&scratch.scan),
            at(&scratch.dx),
            at(&scratch.ddt),
            at(&scratch.db_h),
            at(&scratch.dc_h),
            at(&scratch.da_row),
            batch,
            len,
            heads,
            pp,
            groups,
            n,
            chunk,
        ];
        let per_row_head = (scan.batch * h) as u32;
        let geometry = Geometry::linear(per_row_head.clamp(1, 1024), BLOCK);
        self.run("ssd_bwd_f32", geometry, &ssd)?;
        let reduce = [
            at(&scratch.db_h),
            at(&scratch.dc_h),
            at(&scratch.da_row),
            at(&scratch.db),
            at(&scratch.dc),
            at(&scratch.da),
            batch,
            len,
            heads,
            groups,
            n,
        ];
        self.elementwise("ssd_bwd_reduce_f32", rows * gn, &reduce)?;
        let sizes = [rows, h, p].map(|v| Arg::I32(v as i32));
        let skip = [at(&scratch.dy), s.d.at(w), at(&scratch.dx)];
        self.elementwise(
            "mamba_skip_bwd_f32",
            rows * inner,
            &[&skip[..], &sizes].concat(),
        )?;
        self.head_sums(at(&scratch.dy), at(&m.x), at(&scratch.dparam), h, p)?;
        self.add(s.d.at(grads), at(&scratch.dparam), h)?;
        let a = [
            at(&m.a),
            at(&scratch.da),
            at(&scratch.dparam),
            Arg::I32(h as i32),
        ];
        self.elementwise("mamba_a_bwd_f32", h, &a)?;
        self.add(s.a_log.at(grads), at(&scratch.dparam), h)?;

        // Δ: the gradient of in_proj's dt columns, and dt_bias's.
        let projected = Arg::Ptr(&block.projected, 0);
        let dt = [
            projected,
            Arg::I32(s.projected() as i32),
            Arg::I32((inner + ch) as i32),
            s.dt_bias.at(w),
            at(&scratch.ddt),
            at(&scratch.draw),
            Arg::I32(rows as i32),
            Arg::I32(h as i32),
        ];
        self.elementwise("mamba_dt_bwd_f32", rows * h, &dt)?;
        self.head_sums(at(&scratch.draw), Arg::Null, at(&scratch.dparam), h, 1)?;
        self.add(s.dt_bias.at(grads), at(&scratch.dparam), h)?;

        // The convolution: d[x, B, C] joined, back through SiLU and the taps.
        self.columns(
            (at(&scratch.dxbc), ch, 0),
            (at(&scratch.dx), inner, 0),
            inner,
        )?;
        self.columns((at(&scratch.dxbc), ch, inner), (at(&scratch.db), gn, 0), gn)?;
        self.columns(
            (at(&scratch.dxbc), ch, inner + gn),
            (at(&scratch.dc), gn, 0),
            gn,
        )?;
        let conv_sizes = [rows, scan.len, ch, s.conv].map(|v| Arg::I32(v as i32));
        let dpre = [
            at(&m.xbc_in),
            s.conv_weight.at(w),
            s.conv_bias.at(w),
            at(scan.starts),
            at(&scratch.dxbc),
            at(&scratch.dpre),
        ];
        self.elementwise(
            "causal_conv_silu_dpre_f32",
            rows * ch,
            &[&dpre[..], &conv_sizes].concat(),
        )?;
        let dx = [
            s.conv_weight.at(w),
            at(scan.starts),
            at(&scratch.dpre),
            at(&scratch.dxbc_in),
        ];
        self.elementwise(
            "causal_conv_silu_dx_f32",
            rows * ch,
            &[&dx[..], &conv_sizes].concat(),
        )?;
        let partials = Ssm::conv_partials(rows);
        let dw = [
            at(&m.xbc_in),
            at(scan.starts),
            at(&scratch.dpre),
            at(&scratch.conv_partial),
        ];
        let geometry = Geometry::linear(partials as u32, BLOCK);
        self.run(
            "causal_conv_silu_dw_partials_f32",
            geometry,
            &[&dw[..], &conv_sizes].concat(),
        )?;
        let reduce = [
            at(&scratch.conv_partial),
            at(&scratch.dconv_w),
            at(&scratch.dconv_b),
            Arg::I32(partials as i32),
            Arg::I32(ch as i32),
            Arg::I32(s.conv as i32),
        ];
        let pairs = (s.conv + 1) * ch;
        let geometry = Geometry::linear(pairs.div_ceil(128) as u32, 128);
        self.run("causal_conv_silu_dw_reduce", geometry, &reduce)?;
        self.add(s.conv_weight.at(grads), at(&scratch.dconv_w), ch * s.conv)?;
        self.add(s.conv_bias.at(grads), at(&scratch.dconv_b), ch)?;

        // in_proj's output: [dz, dxBC, d(dt)].
        let cols = s.projected();
        self.columns((dprojected, cols, 0), (at(&scratch.dz), inner, 0), inner)?;
        self.columns((dprojected, cols, inner), (at(&scratch.dxbc_in), ch, 0), ch)?;
        self.columns((dprojected, cols, inner + ch), (at(&scratch.draw), h, 0), h)
    }
}
