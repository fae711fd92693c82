//! A mixture-of-experts block (`E`) on the device, as ops/model's `moe.rs` computes it on the
//! CPU: a sigmoid router, each token's top-k experts by score + bias, gates from the raw
//! scores, the routed experts' MLPs, and the shared expert when there is one.
//!
//! ```text
//! forward:   s = sigmoid(h · routerᵀ)                                moe_scores_f32
//!            chosen = top-k of s + bias, counted for the bias update  on the host (Moe::select)
//!            g = gates(s, chosen)                                     moe_gates_fwd_f32
//!            xp = h in expert order                                   moe_gather_f32
//!            per expert e: yp[e] = fc2_e(act(fc1_e(xp[e])))           GEMMs; one activation
//!            out = shared(h) + Σ_chosen g · yp                        moe_combine_f32
//! backward:  dyp = g · dout in expert order; dg = dout · yp          moe_gather_f32, moe_gate_grads_f32
//!            per expert e: the MLP's backward, dxp[e]                 GEMMs; one activation
//!            dh = shared's dh + Σ_chosen dxp                          moe_combine_f32
//!            d(router logits) from dg; dh += … · router               moe_gates_bwd_f32, GEMMs
//! ```
//!
//! The choice of experts is discrete and the bias takes part only there, so it is made where
//! the CPU makes it: the scores come to the host, `Moe::select` picks (the same function, so
//! the same ties), `Moe::count` counts for the aux-loss-free bias update after the step, and
//! the layout the kernels read ([`Permutation`]) goes back up. Each expert runs on its own
//! rows of the permuted buffers, one GEMM each, and an expert no token chose is not run (its
//! gradient stays 0, as on the CPU).

use super::launches::{Kernels, NT, row_grid};
use super::{BlockActs, Slot, device};
use kernels::launch::{Arg, Geometry, Launcher};
use kernels::moe::Permutation;
use model::config::Activation;
use model::moe::Moe;
use nemo_dag_op::RunError;

/// An MLP's weights and widths: a routed expert or the shared one.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mlp {
    pub fc1: Slot,
    pub fc2: Slot,
    /// fc1's rows: `2·ffn` for SwiGLU (gate, then up), `ffn` for squared ReLU.
    pub in_width: usize,
    pub ffn: usize,
}

/// An MoE block's parameters and sizes.
#[derive(Debug, Clone)]
pub(super) struct Experts {
    /// `(experts, hidden)`.
    pub router: Slot,
    pub routed: Vec<Mlp>,
    pub shared: Option<Mlp>,
    pub top_k: usize,
    pub scaling: f32,
    pub activation: Activation,
}

impl Experts {
    fn count(&self) -> usize {
        self.routed.len()
    }

    /// The routed experts' widths (all alike).
    fn widths(&self) -> (usize, usize) {
        self.routed.first().map_or((0, 0), |m| (m.in_width, m.ffn))
    }
}

/// What an MoE block's backward reads from its forward, for `rows` tokens: the scores, the
/// gates, and the experts' inputs, pre-activations, activations and outputs in expert order
/// (`rows · k` permuted rows). The shared expert's are the block's `projected` and `mixed`.
pub(super) struct MoeActs<B> {
    scores: B,
    gates: B,
    xp: B,
    hp: B,
    ap: B,
    yp: B,
}

impl<B> MoeActs<B> {
    pub fn allocate(
        floats: &impl Fn(usize) -> Result<B, RunError>,
        e: &Experts,
        rows: usize,
        hidden: usize,
    ) -> Result<MoeActs<B>, RunError> {
        let n = rows * e.top_k;
        let (in_width, ffn) = e.widths();
        Ok(MoeActs {
            scores: floats(rows * e.count())?,
            gates: floats(n)?,
            xp: floats(n * hidden)?,
            hp: floats(n * in_width)?,
            ap: floats(n * ffn)?,
            yp: floats(n * hidden)?,
        })
    }
}

/// The MoE blocks' forward output and backward scratch, sized for the largest of them.
pub(super) struct MoeScratch<B> {
    out: B,
    dyp: B,
    dap: B,
    dhp: B,
    dxp: B,
    dgates: B,
    dlogits: B,
}

impl<B> MoeScratch<B> {
    /// Where an MoE block's forward leaves its output.
    pub fn output(&self) -> Arg<'_, B> {
        Arg::Ptr(&self.out, 0)
    }

    /// `None` when the model has no MoE block.
    pub fn allocate(
        floats: &impl Fn(usize) -> Result<B, RunError>,
        blocks: &[&Experts],
        rows: usize,
        hidden: usize,
    ) -> Result<Option<MoeScratch<B>>, RunError> {
        if blocks.is_empty() {
            return Ok(None);
        }
        let widest = |f: &dyn Fn(&Experts) -> usize| blocks.iter().map(|e| f(e)).max();
        let widest = |f: &dyn Fn(&Experts) -> usize| widest(f).unwrap_or(0);
        let n = rows * widest(&|e| e.top_k);
        Ok(Some(MoeScratch {
            out: floats(rows * hidden)?,
            dyp: floats(n * hidden)?,
            dap: floats(n * widest(&|e| e.widths().1))?,
            dhp: floats(n * widest(&|e| e.widths().0))?,
            dxp: floats(n * hidden)?,
            dgates: floats(n)?,
            dlogits: floats(rows * widest(&|e| e.count()))?,
        }))
    }
}

/// A micro-batch's way through one MoE block, made by its forward for its backward: the
/// chosen experts `(rows, k)` and their [`Permutation`], on the device and on the host.
pub(super) struct Routed<B> {
    chosen: B,
    routes: B,
    slots: B,
    pos: B,
    layout: Permutation,
    k: usize,
}

impl<B> Routed<B> {
    /// Runs `f` on every expert that has tokens, with its permuted rows, in expert order.
    fn each_expert(
        &self,
        e: &Experts,
        mut f: impl FnMut(&Mlp, Rows) -> Result<(), RunError>,
    ) -> Result<(), RunError> {
        for (x, expert) in e.routed.iter().enumerate() {
            let range = self.layout.rows_of(x);
            if !range.is_empty() {
                f(
                    expert,
                    Rows {
                        start: range.start,
                        len: range.len(),
                    },
                )?;
            }
        }
        Ok(())
    }
}

/// One expert's rows of the permuted buffers.
#[derive(Clone, Copy)]
struct Rows {
    start: usize,
    len: usize,
}

impl Rows {
    /// Its first row of `buffer`, whose rows are `width` floats.
    fn of<B>(self, buffer: &B, width: usize) -> Arg<'_, B> {
        Arg::Ptr(buffer, self.start * width * 4)
    }
}

/// A block's input, the gradient of its output, and where the gradient of its input goes.
pub(super) type Flow<'a, B> = (Arg<'a, B>, Arg<'a, B>, Arg<'a, B>);

/// Threads per block of the one-thread-a-token kernels (gates).
const TOKEN_BLOCK: u32 = 128;
/// moe_gate_grads_f32: a warp a permuted row, eight warps a block.
const GATE_GRAD_BLOCK: u32 = 256;

impl<L: Launcher> Kernels<'_, L> {
    /// The forward of an MoE block on `h` (its normed input, `rows × hidden`): its output,
    /// without the residual, into [`MoeScratch::output`], and the routing its backward needs
    /// (returned). `layer` is the CPU model's layer, which chooses, and with `count` counts
    /// the tokens each expert got (those `valid` marks, or all) for the bias update.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe(
        &self,
        w: &L::Buffer,
        e: &Experts,
        layer: &Moe,
        (count, valid): (bool, Option<&[bool]>),
        h: Arg<'_, L::Buffer>,
        a: &BlockActs<L::Buffer>,
        s: &MoeScratch<L::Buffer>,
        hidden: usize,
    ) -> Result<Routed<L::Buffer>, RunError> {
        let (rows, experts, k) = (self.rows, e.count(), e.top_k);
        let m = moe_acts(a)?;
        let scores = Arg::Ptr(&m.scores, 0);
        self.gemm(h, e.router.at(w), scores, (rows, experts, hidden), NT, 0.0)?;
        let n = Arg::Usize(rows * experts);
        self.elementwise("moe_scores_f32", rows * experts, &[scores, n])?;

        let s_host = self.read(&m.scores, rows * experts)?;
        let chosen = layer.select(&s_host);
        if count {
            layer.count(&chosen, valid);
        }
        let layout = Permutation::of(&chosen, experts, k)
            .map_err(|why| RunError::new(format!("GPU trainer: routing: {why}")))?;
        let up = |v: &[u32]| self.launcher.upload_u32(v).map_err(device);
        let r = Routed {
            chosen: up(&chosen)?,
            routes: up(&layout.routes)?,
            slots: up(&layout.slots)?,
            pos: up(&layout.pos)?,
            layout,
            k,
        };
        let gates = Arg::Ptr(&m.gates, 0);
        let sizes = [rows, experts, k].map(|v| Arg::I32(v as i32));
        let args = [scores, Arg::Ptr(&r.chosen, 0), gates];
        let args = [&args[..], &sizes, &[Arg::F32(e.scaling)]].concat();
        self.run("moe_gates_fwd_f32", self.per_token(), &args)?;

        let out = Arg::Ptr(&s.out, 0);
        let base = match &e.shared {
            Some(shared) => {
                let (projected, mixed) = (Arg::Ptr(&a.projected, 0), Arg::Ptr(&a.mixed, 0));
                self.gemm(
                    h,
                    shared.fc1.at(w),
                    projected,
                    (rows, shared.in_width, hidden),
                    NT,
                    0.0,
                )?;
                self.activation(e.activation, projected, mixed, shared.ffn, false)?;
                self.gemm(
                    mixed,
                    shared.fc2.at(w),
                    out,
                    (rows, hidden, shared.ffn),
                    NT,
                    0.0,
                )?;
                out
            }
            None => Arg::Null,
        };

        let n = rows * k;
        let xp = Arg::Ptr(&m.xp, 0);
        self.gather(&r, h, Arg::Null, xp, n, hidden)?;
        let (in_width, ffn) = e.widths();
        r.each_expert(e, |x, rows| {
            let (xp, hp) = (rows.of(&m.xp, hidden), rows.of(&m.hp, in_width));
            self.gemm(xp, x.fc1.at(w), hp, (rows.len, in_width, hidden), NT, 0.0)
        })?;
        let permuted = Kernels { rows: n, ..*self };
        let (hp, ap) = (Arg::Ptr(&m.hp, 0), Arg::Ptr(&m.ap, 0));
        permuted.activation(e.activation, hp, ap, ffn, false)?;
        r.each_expert(e, |x, rows| {
            let (ap, yp) = (rows.of(&m.ap, ffn), rows.of(&m.yp, hidden));
            self.gemm(ap, x.fc2.at(w), yp, (rows.len, hidden, ffn), NT, 0.0)
        })?;
        let yp = Arg::Ptr(&m.yp, 0);
        self.combine(&r, yp, gates, base, out, hidden)?;
        Ok(r)
    }

    /// The backward of an MoE block: from `dout` (the gradient of its output), its parameters'
    /// gradients added into `g` and the gradient of its input `h` written to `dh` (`(h, dout,
    /// dh)` is the [`Flow`]). `dmixed`
    /// and `dprojected` are the shared expert's scratch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_backward(
        &self,
        (w, g): (&L::Buffer, &L::Buffer),
        e: &Experts,
        r: &Routed<L::Buffer>,
        (h, dout, dh): Flow<'_, L::Buffer>,
        a: &BlockActs<L::Buffer>,
        s: &MoeScratch<L::Buffer>,
        (dmixed, dprojected): (Arg<'_, L::Buffer>, Arg<'_, L::Buffer>),
        hidden: usize,
    ) -> Result<(), RunError> {
        let (rows, experts, k) = (self.rows, e.count(), e.top_k);
        let n = rows * k;
        let m = moe_acts(a)?;
        let (in_width, ffn) = e.widths();
        let (gates, dgates) = (Arg::Ptr(&m.gates, 0), Arg::Ptr(&s.dgates, 0));

        // The routed experts, from the gradient of each permuted row back to its input.
        self.gather(r, dout, gates, Arg::Ptr(&s.dyp, 0), n, hidden)?;
        let grads = [
            dout,
            Arg::Ptr(&m.yp, 0),
            Arg::Ptr(&r.routes, 0),
            Arg::Ptr(&r.slots, 0),
            dgates,
            Arg::I32(n as i32),
            Arg::I32(hidden as i32),
        ];
        let warps = GATE_GRAD_BLOCK as usize / 32;
        let grid = (n.div_ceil(warps) as u32).clamp(1, 1024);
        self.run(
            "moe_gate_grads_f32",
            Geometry::linear(grid, GATE_GRAD_BLOCK),
            &grads,
        )?;
        r.each_expert(e, |x, rows| {
            let (dyp, ap, dap) = (
                rows.of(&s.dyp, hidden),
                rows.of(&m.ap, ffn),
                rows.of(&s.dap, ffn),
            );
            let fc2 = x.fc2.with_grad((w, g));
            self.linear_backward(dyp, ap, fc2, dap, (rows.len, hidden, ffn), 0.0)
        })?;
        let permuted = Kernels { rows: n, ..*self };
        let (hp, dap, dhp) = (Arg::Ptr(&m.hp, 0), Arg::Ptr(&s.dap, 0), Arg::Ptr(&s.dhp, 0));
        permuted.activation_backward(e.activation, hp, dap, dhp, ffn, false)?;
        r.each_expert(e, |x, rows| {
            let (dhp, xp) = (rows.of(&s.dhp, in_width), rows.of(&m.xp, hidden));
            let (fc1, dxp) = (x.fc1.with_grad((w, g)), rows.of(&s.dxp, hidden));
            self.linear_backward(dhp, xp, fc1, dxp, (rows.len, in_width, hidden), 0.0)
        })?;

        // The shared expert's dh, then the routed experts' rows added onto it in expert order.
        let base = match &e.shared {
            Some(shared) => {
                let (projected, mixed) = (Arg::Ptr(&a.projected, 0), Arg::Ptr(&a.mixed, 0));
                let (sf, si) = (shared.ffn, shared.in_width);
                let (fc1, fc2) = (shared.fc1.with_grad((w, g)), shared.fc2.with_grad((w, g)));
                self.linear_backward(dout, mixed, fc2, dmixed, (rows, hidden, sf), 0.0)?;
                self.activation_backward(e.activation, projected, dmixed, dprojected, sf, false)?;
                self.linear_backward(dprojected, h, fc1, dh, (rows, si, hidden), 0.0)?;
                dh
            }
            None => Arg::Null,
        };
        self.combine(r, Arg::Ptr(&s.dxp, 0), Arg::Null, base, dh, hidden)?;

        // The router, through the gates.
        let (scores, dlogits) = (Arg::Ptr(&m.scores, 0), Arg::Ptr(&s.dlogits, 0));
        let sizes = [rows, experts, k].map(|v| Arg::I32(v as i32));
        let args = [scores, Arg::Ptr(&r.chosen, 0), dgates, dlogits];
        let args = [&args[..], &sizes, &[Arg::F32(e.scaling)]].concat();
        self.run("moe_gates_bwd_f32", self.per_token(), &args)?;
        let router = e.router.with_grad((w, g));
        self.linear_backward(dlogits, h, router, dh, (rows, experts, hidden), 1.0)
    }

    /// `to[i] = w_i · from[route_i]` for the `n` permuted rows, `w_i` the row's gate (or 1
    /// when `gates` is null).
    fn gather(
        &self,
        r: &Routed<L::Buffer>,
        from: Arg<'_, L::Buffer>,
        gates: Arg<'_, L::Buffer>,
        to: Arg<'_, L::Buffer>,
        n: usize,
        hidden: usize,
    ) -> Result<(), RunError> {
        let (routes, slots) = (Arg::Ptr(&r.routes, 0), Arg::Ptr(&r.slots, 0));
        let args = [from, routes, slots, gates, to];
        let args = [&args[..], &[Arg::I32(n as i32), Arg::I32(hidden as i32)]].concat();
        self.elementwise("moe_gather_f32", n * hidden, &args)
    }

    /// `to[t] = base[t] + Σ w · rows[p]` over token `t`'s permuted rows (base 0 when null).
    fn combine(
        &self,
        r: &Routed<L::Buffer>,
        permuted: Arg<'_, L::Buffer>,
        gates: Arg<'_, L::Buffer>,
        base: Arg<'_, L::Buffer>,
        to: Arg<'_, L::Buffer>,
        hidden: usize,
    ) -> Result<(), RunError> {
        let (pos, slots) = (Arg::Ptr(&r.pos, 0), Arg::Ptr(&r.slots, 0));
        let sizes = [self.rows, r.k, hidden].map(|v| Arg::I32(v as i32));
        let args = [&[permuted, pos, slots, gates, base, to][..], &sizes].concat();
        self.elementwise("moe_combine_f32", self.rows * hidden, &args)
    }

    fn per_token(&self) -> Geometry {
        Geometry::linear(
            row_grid(self.rows.div_ceil(TOKEN_BLOCK as usize)),
            TOKEN_BLOCK,
        )
    }

    fn read(&self, buffer: &L::Buffer, n: usize) -> Result<Vec<f32>, RunError> {
        self.launcher.read_f32(buffer, 0, n).map_err(device)
    }
}

fn moe_acts<B>(a: &BlockActs<B>) -> Result<&MoeActs<B>, RunError> {
    a.moe
        .as_ref()
        .ok_or_else(|| RunError::new("GPU trainer: an MoE block without its buffers".to_string()))
}
