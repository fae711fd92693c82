//! The GPU trainer: [`Trainer::step`] as a list of kernel launches on a [`Launcher`], read top
//! to bottom like llm.c's `train_gpt2.cu` — one forward, one backward, one optimizer step.
//!
//! The weights, gradients and AdamW moments live on the device as flat f32 buffers, one slice
//! per parameter in the [`Trainer`]'s order, so the host state a checkpoint is written from is
//! one download away ([`DeviceStep::download`]) and a checkpoint of either device resumes on
//! the other. The same code runs on a GPU ([`kernels::launch::Cuda`]) and, in the tests, on the
//! SIMT shim ([`kernels::launch::Shim`]), where it is held to the CPU trainer step for step.
//!
//! What runs here so far: models of MLP blocks (`-`, SwiGLU or squared ReLU), attention
//! blocks (`*`: grouped-query causal attention over packed segments, RoPE or none), Mamba-2
//! blocks (`M`: [`mamba`]) and MoE blocks (`E`: [`moe`]), MTP depths after `/` ([`mtp`]), tied
//! or untied output head, f32 throughout, GEMMs through linear.cu. [`DeviceStep::upload`]
//! names anything else. Three block kinds are the same three steps around a different middle
//! — an input projection, the mixer, an output projection added onto the residual — and an
//! MoE block runs such an MLP per expert on its own tokens, so one loop runs them all:
//!
//! ```text
//! block:   h = rms_norm(x);  a = h · w_inᵀ;  m = mix(a);  x = x + m · w_outᵀ
//!          MLP:        w_in = fc1,     mix = SwiGLU or squared ReLU,             w_out = fc2
//!          attention:  w_in = qkv,     mix = causal GQA attention,               w_out = proj
//!          Mamba-2:    w_in = in_proj, mix = conv, SSD scan, gated RMSNorm,      w_out = out_proj
//! MoE:     h = rms_norm(x);  x = x + shared_mlp(h) + Σ_top-k gate · expert_mlp(h)
//! ```
//!
//! Per step, as [`Trainer::step`], for any objective of the main head's per-token
//! log-probabilities ([`PerToken`]: next-token cross-entropy, DPO, GRPO):
//!
//! ```text
//! for each micro-batch:      (the reference model's forward and logp, when the objective has one)
//!                            forward → logp of each label → the objective's ∂loss/∂logp
//!                            (on the host) → backward, with the MTP heads' CE when it trains them,
//!                            gradients summed into one buffer, micro-batch by micro-batch
//! global gradient norm → clip → lr from the schedule → AdamW on every parameter
//! ```

pub mod check;
mod decode;
mod launches;
mod mamba;
mod moe;
mod mtp;

use crate::{BatchSource, Objective, PerToken, Stepper, Tally, TokenGrad, Trainer};
use kernels::attention::tensor_core_kernel;
use kernels::launch::{Arg, Geometry, Launcher};
use kernels::linear::Precision;
use launches::{Kernels, NT, Packed, elementwise_grid, row_grid};
use mamba::{MambaActs, MambaScratch, Scan, Ssm};
use model::config::{Activation, BlockKind, ModelConfig};
use model::layers::Rope;
use model::net::{Batch, Model};
use moe::{Experts, MoeActs, MoeScratch};
use mtp::{Join, JoinActs, JoinScratch};

pub use decode::Decoding;
use nemo_dag_op::RunError;
use std::collections::BTreeMap;
use std::ops::Range;

/// The matmuls' operands when a training op runs on a GPU: bf16 with f32 sums, as
/// Megatron-LM trains (weights, gradients, AdamW's moments, the loss and the norms stay f32).
/// The CPU trainer multiplies in f32, so the two devices' losses agree to about 1e-2, not
/// 1e-4 (docs/gpu.md, "Precision").
pub const TRAINING_PRECISION: Precision = Precision::Bf16;

/// Blocks of the gradient-norm's partial sums (summed in block order by one block), for `n`
/// gradients: one for every 4,096, at most 1,024. A GPU needs about a thousand blocks to read
/// at its memory's speed (64 took 3 ms for 117 M gradients on an H100); the shim, which runs
/// a block per OS thread, needs few for the small models it trains.
fn norm_blocks(n: usize) -> u32 {
    n.div_ceil(4096).clamp(1, 1024) as u32
}

fn device(e: kernels::launch::LaunchError) -> RunError {
    RunError::new(format!("GPU trainer: {e}"))
}

/// One parameter's slice of the flat buffers, in f32 elements.
#[derive(Debug, Clone, Copy)]
struct Slot {
    offset: usize,
    len: usize,
    decay: bool,
}

impl Slot {
    fn at<'b, B>(&self, buffer: &'b B) -> Arg<'b, B> {
        Arg::Ptr(buffer, self.offset * 4)
    }

    /// The parameter in the weights and in the gradients.
    fn with_grad<'b, B>(&self, (w, g): (&'b B, &'b B)) -> (Arg<'b, B>, Arg<'b, B>) {
        (self.at(w), self.at(g))
    }
}

/// What a block does between its input and output projections.
#[derive(Debug, Clone, Copy)]
enum Mixer {
    /// `-`: fc1 → SwiGLU or squared ReLU → fc2.
    Mlp(Activation),
    /// `*`: qkv → causal grouped-query attention (attention.cu) → proj.
    Attention(Heads),
    /// `M`: in_proj → causal conv + SiLU, the chunked SSD scan, gated RMSNorm ([`mamba`]) →
    /// out_proj.
    Mamba(Ssm),
}

/// An attention block's heads: `heads` query heads of `dim` share `kv_heads` key/value heads.
#[derive(Debug, Clone, Copy)]
struct Heads {
    heads: usize,
    kv_heads: usize,
    dim: usize,
}

impl Heads {
    fn of(cfg: &ModelConfig) -> Heads {
        Heads {
            heads: cfg.heads,
            kv_heads: cfg.kv_heads(),
            dim: cfg.head_dim,
        }
    }
}

/// The parameters of one block.
struct Block {
    norm: Slot,
    body: Body,
}

/// What a block computes from its normed input.
enum Body {
    /// An input projection, a mixer and an output projection: `-`, `*` and `M`.
    Projected(Projected),
    /// `E`: a router, routed experts and perhaps a shared expert ([`moe`]).
    Moe(Experts),
}

impl Block {
    /// The projections around a mixer this block runs on every token: its own, or an MoE
    /// block's shared expert.
    fn projected(&self) -> Option<Projected> {
        match &self.body {
            Body::Projected(p) => Some(*p),
            Body::Moe(e) => e.shared.map(|m| Projected {
                mixer: Mixer::Mlp(e.activation),
                w_in: m.fc1,
                w_out: m.fc2,
                in_width: m.in_width,
                mid_width: m.ffn,
            }),
        }
    }

    fn mixer(&self) -> Option<Mixer> {
        self.projected().map(|p| p.mixer)
    }
}

/// A block's projections and its mixer, with the widths they are launched with.
#[derive(Debug, Clone, Copy)]
struct Projected {
    mixer: Mixer,
    /// `(in_width, hidden)`: fc1 or qkv.
    w_in: Slot,
    /// `(hidden, mid_width)`: fc2 or proj.
    w_out: Slot,
    /// The input projection's rows: `2·ffn` for SwiGLU (gate, then up), `ffn` for squared
    /// ReLU, `(heads + 2·kv_heads)·head_dim` for attention, `[z, xBC, dt]` for Mamba-2.
    in_width: usize,
    /// The mixer's output width: `ffn`, `heads·head_dim`, or Mamba-2's `d_inner`.
    mid_width: usize,
}

/// A run of blocks from an input to the output head: the main stack, or an MTP depth.
struct Stack {
    /// Its blocks in [`Layout::blocks`].
    blocks: Range<usize>,
    /// Its input's slot in the residual streams (`xs`): each stack has one slot more than it
    /// has blocks, so block `i` of stack `s` reads slot `i + s` and writes slot `i + s + 1`.
    first_slot: usize,
    final_norm: Slot,
    /// An MTP depth's join of the shifted embedding and the previous stack's output; `None`
    /// for the main stack, which starts from the embedding.
    join: Option<Join>,
}

impl Stack {
    /// The residual-stream slot block `i` reads.
    fn slot(&self, i: usize) -> usize {
        self.first_slot + i - self.blocks.start
    }

    /// The slot of the stack's output, which its final norm reads.
    fn output(&self) -> usize {
        self.first_slot + self.blocks.len()
    }
}

/// Where each parameter the step touches lives, and the sizes it is launched with.
struct Layout {
    vocab: usize,
    hidden: usize,
    eps: f32,
    embedding: Slot,
    /// Every block: the main stack's, then each MTP depth's in turn (a shared depth's once per
    /// depth, each with activations of its own).
    blocks: Vec<Block>,
    /// The main stack, then MTP depths 1, 2, …
    stacks: Vec<Stack>,
    /// The output head: the embedding's slot when tied.
    head: Slot,
    /// Whether attention blocks rotate queries and keys (RoPE).
    rope: bool,
    slots: Vec<Slot>,
    total: usize,
}

impl Layout {
    /// `model`'s parameters in order, each decayed by AdamW where `decay` says.
    fn of(model: &Model, decay: &[bool]) -> Result<Layout, RunError> {
        let cfg = &model.cfg;
        let heads = Heads::of(cfg);
        if model.pattern.count(BlockKind::Attention) > 0 && heads.dim > MAX_HEAD_DIM {
            return Err(unsupported(format!(
                "attention heads of {} dimensions (attention.cu holds at most {MAX_HEAD_DIM})",
                heads.dim
            )));
        }
        let mut slots = Vec::new();
        let mut by_name = BTreeMap::new();
        let mut total = 0;
        for ((name, var), decay) in model.params.iter().zip(decay) {
            let slot = Slot {
                offset: total,
                len: var.elem_count(),
                decay: *decay,
            };
            total += slot.len;
            slots.push(slot);
            by_name.insert(name.to_string(), slot);
        }
        let find = |name: &str| {
            by_name
                .get(name)
                .copied()
                .ok_or_else(|| RunError::new(format!("GPU trainer: the model has no `{name}`")))
        };

        // The main stack, then each MTP depth k = 1..=D with its own weights, or depth 0's
        // for every k when they are shared, as `Model::loss` runs them.
        let mut blocks = Vec::new();
        let mut stacks = Vec::new();
        let depths = model.pattern.mtp.len();
        for k in 0..=depths {
            let weights = if cfg.mtp_shared {
                0
            } else {
                k.saturating_sub(1)
            };
            let (prefix, kinds) = match k {
                0 => (String::new(), &model.pattern.main),
                _ => (format!("mtp.{weights}."), &model.pattern.mtp[weights]),
            };
            let start = blocks.len();
            for (i, kind) in kinds.iter().enumerate() {
                blocks.push(block(&format!("{prefix}blocks.{i}"), *kind, cfg, &find)?);
            }
            let join = (k > 0)
                .then(|| {
                    Ok::<_, RunError>(Join {
                        shift: k,
                        weights,
                        enorm: find(&format!("{prefix}enorm"))?,
                        hnorm: find(&format!("{prefix}hnorm"))?,
                        eh_proj: find(&format!("{prefix}eh_proj"))?,
                        loss_scale: cfg.mtp_loss_scale / depths as f64,
                    })
                })
                .transpose()?;
            stacks.push(Stack {
                blocks: start..blocks.len(),
                first_slot: start + k,
                final_norm: find(&format!("{prefix}final_norm"))?,
                join,
            });
        }
        let embedding = find("embedding")?;
        let head = if cfg.tie_embeddings {
            embedding
        } else {
            find("output")?
        };
        Ok(Layout {
            vocab: model.vocab,
            hidden: cfg.hidden,
            eps: cfg.norm_eps as f32,
            embedding,
            blocks,
            stacks,
            head,
            rope: model.rope().is_some(),
            slots,
            total,
        })
    }

    /// Slots of the residual streams: one more per stack than it has blocks.
    fn streams(&self) -> usize {
        self.blocks.len() + self.stacks.len()
    }

    /// The MTP depths' joins.
    fn joins(&self) -> impl Iterator<Item = &Join> {
        self.stacks.iter().filter_map(|s| s.join.as_ref())
    }

    fn attention_heads(&self) -> Option<Heads> {
        self.blocks.iter().find_map(|b| match b.mixer() {
            Some(Mixer::Attention(heads)) => Some(heads),
            _ => None,
        })
    }

    fn ssms(&self) -> Vec<Ssm> {
        self.blocks
            .iter()
            .filter_map(|b| match b.mixer() {
                Some(Mixer::Mamba(ssm)) => Some(ssm),
                _ => None,
            })
            .collect()
    }

    /// The (row, chunk) pairs of the Mamba-2 scan for `batch` rows of `len` tokens.
    fn chunk_rows(&self, batch: usize, len: usize) -> usize {
        self.ssms()
            .iter()
            .map(|s| batch * len.div_ceil(s.chunk))
            .max()
            .unwrap_or(0)
    }
}

/// The parameters of the block `kind` whose names start with `prefix` (`blocks.3`,
/// `mtp.0.blocks.1`).
fn block(
    prefix: &str,
    kind: BlockKind,
    cfg: &ModelConfig,
    find: &impl Fn(&str) -> Result<Slot, RunError>,
) -> Result<Block, RunError> {
    let param = |name: &str| find(&format!("{prefix}.{name}"));
    let heads = Heads::of(cfg);
    let body = match kind {
        BlockKind::Attention => Projected {
            mixer: Mixer::Attention(heads),
            w_in: param("attn.qkv")?,
            w_out: param("attn.proj")?,
            in_width: (heads.heads + 2 * heads.kv_heads) * heads.dim,
            mid_width: heads.heads * heads.dim,
        },
        BlockKind::Mamba => {
            let m = cfg.mamba.as_ref().ok_or_else(|| {
                RunError::new("GPU trainer: Mamba blocks need `mamba:`".to_string())
            })?;
            let param = |name: &str| param(&format!("mamba.{name}"));
            let ssm = Ssm {
                heads: m.heads,
                head_dim: m.head_dim,
                groups: m.groups,
                state: m.state,
                conv: m.conv,
                chunk: m.chunk,
                eps: cfg.norm_eps as f32,
                conv_weight: param("conv_weight")?,
                conv_bias: param("conv_bias")?,
                dt_bias: param("dt_bias")?,
                a_log: param("a_log")?,
                d: param("d")?,
                norm: param("norm")?,
            };
            Projected {
                mixer: Mixer::Mamba(ssm),
                w_in: param("in_proj")?,
                w_out: param("out_proj")?,
                in_width: ssm.projected(),
                mid_width: ssm.inner(),
            }
        }
        BlockKind::Moe => {
            let m = cfg
                .moe
                .as_ref()
                .ok_or_else(|| RunError::new("GPU trainer: MoE blocks need `moe:`".to_string()))?;
            let mlp = |name: &str, ffn: usize| {
                Ok::<_, RunError>(moe::Mlp {
                    fc1: param(&format!("moe.{name}.fc1"))?,
                    fc2: param(&format!("moe.{name}.fc2"))?,
                    in_width: in_width(cfg.activation, ffn),
                    ffn,
                })
            };
            let experts = Experts {
                router: param("moe.router")?,
                routed: (0..m.experts)
                    .map(|e| mlp(&format!("experts.{e}"), m.expert_ffn))
                    .collect::<Result<_, _>>()?,
                shared: (m.shared_ffn > 0)
                    .then(|| mlp("shared", m.shared_ffn))
                    .transpose()?,
                top_k: m.top_k,
                scaling: m.scaling as f32,
                activation: cfg.activation,
            };
            return Ok(Block {
                norm: param("norm")?,
                body: Body::Moe(experts),
            });
        }
        BlockKind::Mlp => Projected {
            mixer: Mixer::Mlp(cfg.activation),
            w_in: param("mlp.fc1")?,
            w_out: param("mlp.fc2")?,
            in_width: in_width(cfg.activation, cfg.ffn),
            mid_width: cfg.ffn,
        },
    };
    Ok(Block {
        norm: param("norm")?,
        body: Body::Projected(body),
    })
}

/// fc1's rows for an MLP of `ffn`: SwiGLU's gate and up, or squared ReLU's one.
fn in_width(activation: Activation, ffn: usize) -> usize {
    match activation {
        Activation::Swiglu => 2 * ffn,
        Activation::Relu2 => ffn,
    }
}

/// The widest head attention.cu holds (its `MAX_D`).
const MAX_HEAD_DIM: usize = 128;

fn unsupported(what: String) -> RunError {
    RunError::new(format!(
        "the GPU trainer does not train {what} yet: it trains models of MLP, attention, \
         Mamba-2 and MoE blocks (patterns of `-`, `*`, `M` and `E`, with MTP depths after `/`) \
         whose attention heads have at most {MAX_HEAD_DIM} dimensions"
    ))
    .with_help("run this stage with `device: cpu`, or `auto` to use a GPU where it can")
}

/// One block's activations kept from the forward for the backward.
struct BlockActs<B> {
    /// The input projection's output, `rows × in_width`.
    projected: B,
    /// The mixer's output, `rows × mid_width`.
    mixed: B,
    /// Attention: each (row, head, token)'s log-sum-exp, `rows × heads` floats.
    lse: Option<B>,
    /// Mamba-2: what its backward reads.
    mamba: Option<MambaActs<B>>,
    /// MoE: what its backward reads (the shared expert's are `projected` and `mixed`).
    moe: Option<MoeActs<B>>,
}

/// One micro-batch's activations, kept from the forward for the backward, and the backward's
/// scratch. Sized for `rows` tokens; reallocated when a larger micro-batch comes.
struct Activations<B> {
    rows: usize,
    /// The micro-batch rows, and Mamba-2's (row, chunk) pairs, the buffers are sized for.
    batch: usize,
    chunk_rows: usize,
    /// Per stack: the ids it embeds, its labels and loss weights.
    inputs: Vec<Inputs<B>>,
    /// The main head's loss weights (∂loss/∂CE per token), from the objective.
    main_dloss: Option<B>,
    /// Per token: its packed segment's id, and RoPE's cos and sin at its position
    /// (`rows × head_dim`); allocated when the model has attention blocks (and RoPE).
    segments: Option<B>,
    cos: Option<B>,
    sin: Option<B>,
    /// The residual stream entering each block, and after each stack's last one:
    /// `(L + S) × rows × D` for `L` blocks in `S` stacks ([`Stack::slot`]).
    xs: B,
    /// Each block's normed input, `L × rows × D`, and the 1/rms of each norm of a slot of
    /// `xs` (a block's, or a stack's final norm), `(L + S) × rows`.
    normed: B,
    rstd: B,
    blocks: Vec<BlockActs<B>>,
    /// Per MTP depth: what its join keeps; and the joins' scratch.
    joins: Vec<JoinActs<B>>,
    join: Option<JoinScratch<B>>,
    final_normed: B,
    logits: B,
    ce: B,
    lse: B,
    /// The logits' gradient (rows × vocab): f32, or bf16 in its first half when the step
    /// multiplies in bf16 ([`Kernels::cross_entropy_backward`]).
    dlogits: B,
    dx: B,
    dh: B,
    dnorm_in: B,
    /// The gradients of a block's mixer output and projected input (the widest block's).
    dmixed: B,
    dprojected: B,
    /// Attention's Σ dy·y per (row, head, token).
    delta: Option<B>,
    /// Attention's q, k, v and dy as bf16 heads of contiguous rows, for the tensor-core
    /// kernels (attention_pack_bf16): `rows · (2·heads + 2·kv_heads) · dim` bf16s (allocated
    /// as half as many floats), where the head width has them. Allocated at f32 precision too:
    /// a step's precision is set after its buffers ([`DeviceStep::with_precision`]).
    packed_heads: Option<B>,
    /// Mamba-2: each token's run start inside its row (int32), and the blocks' scratch.
    starts: Option<B>,
    mamba: Option<MambaScratch<B>>,
    /// MoE blocks' output and backward scratch.
    moe: Option<MoeScratch<B>>,
    dw_partial: B,
    dw: B,
    dtable: B,
}

/// What [`DeviceStep::launching`] gives: a micro-batch's launches, its activations as the
/// attention and Mamba kernels read them, and its per-slot activations.
struct Launching<'s, 'l, L: Launcher> {
    k: Kernels<'l, L>,
    packed: Packed<'s, L::Buffer>,
    at: Slots<'s, L::Buffer>,
}

/// A micro-batch's per-slot activations as kernel arguments, for `rows` tokens of width
/// `hidden`: the residual stream of slot `i` ([`Stack::slot`]), block `i`'s normed input, and
/// the 1/rms of the norm of slot `i`.
struct Slots<'a, B> {
    acts: &'a Activations<B>,
    rows: usize,
    hidden: usize,
}

impl<L: Launcher> Kernels<'_, L> {
    /// Block `i`'s entry from residual slot `x`: its normed input (`normed(i)`, and the norm's
    /// 1/rms) and the residual carried into slot `x + 1`, onto which the block adds its output.
    fn enter_block(
        &self,
        at: &Slots<'_, L::Buffer>,
        norm: Arg<'_, L::Buffer>,
        (i, x): (usize, usize),
        eps: f32,
        normed_bf16: bool,
    ) -> Result<(), RunError> {
        let d = at.hidden;
        let normed = at.normed(i);
        self.rms_norm(at.x(x), norm, normed, at.rstd(x), d, eps, normed_bf16)?;
        self.copy(at.x(x), at.x(x + 1), self.rows * d)
    }
}

impl<'a, B> Slots<'a, B> {
    fn x(&self, i: usize) -> Arg<'a, B> {
        Arg::Ptr(&self.acts.xs, i * self.rows * self.hidden * 4)
    }

    fn normed(&self, i: usize) -> Arg<'a, B> {
        Arg::Ptr(&self.acts.normed, i * self.rows * self.hidden * 4)
    }

    fn rstd(&self, i: usize) -> Arg<'a, B> {
        Arg::Ptr(&self.acts.rstd, i * self.rows * 4)
    }
}

/// What a stack's head and loss read for one micro-batch: the ids the stack embeds, its labels
/// and, for an MTP depth, each token's loss weight (its loss mask times the depth's loss scale,
/// divided by the global batch's loss tokens; the main head's weights are the objective's,
/// uploaded once its log-probabilities are known). The main stack's ids and labels are the
/// batch's; MTP depth k's are shifted left by k ([`model::net::shift_left`]).
struct Inputs<B> {
    ids: B,
    labels: B,
    dloss: Option<B>,
}

/// A [`Trainer`]'s weights and AdamW state on a device, and the step that updates them.
pub struct DeviceStep<'l, L: Launcher> {
    launcher: &'l L,
    layout: Layout,
    weights: L::Buffer,
    grads: L::Buffer,
    m: L::Buffer,
    v: L::Buffer,
    norm_partial: L::Buffer,
    norm: L::Buffer,
    acts: Option<Activations<L::Buffer>>,
    /// The frozen reference model's weights, when the objective reads one (uploaded on first
    /// use).
    reference: Option<L::Buffer>,
    /// The matmuls' operands: f32 (the CPU trainer's arithmetic) unless set otherwise.
    precision: Precision,
}

impl<'l, L: Launcher> DeviceStep<'l, L> {
    /// Copies `trainer`'s weights and AdamW moments to the device; an error names what the
    /// GPU trainer cannot train yet.
    pub fn upload(launcher: &'l L, trainer: &Trainer) -> Result<Self, RunError> {
        let layout = Layout::of(&trainer.model, &trainer.decay)?;
        let moments = |m: &[Vec<f32>]| launcher.upload_f32(&m.concat()).map_err(device);
        let optimizer = (moments(&trainer.opt.m)?, moments(&trainer.opt.v)?);
        Self::holding(launcher, layout, &trainer.model, Some(optimizer))
    }

    /// `model`'s weights on the device for forwards only ([`DeviceStep::logp`]: eval's
    /// scoring; [`Decoding`]): no gradients or AdamW moments.
    pub fn upload_for_scoring(launcher: &'l L, model: &Model) -> Result<Self, RunError> {
        // (`decay` only matters to AdamW, which scoring never runs.)
        let layout = Layout::of(model, &vec![false; model.params.iter().count()])?;
        Self::holding(launcher, layout, model, None)
    }

    /// `model`'s weights uploaded in `layout`'s order, with the gradients and the norm's
    /// buffers when `optimizer` brings AdamW's moments (m, v); empty buffers otherwise.
    fn holding(
        launcher: &'l L,
        layout: Layout,
        model: &Model,
        optimizer: Option<(L::Buffer, L::Buffer)>,
    ) -> Result<Self, RunError> {
        let weights = model.params.values().map_err(crate::err)?;
        let weights = launcher.upload_f32(&weights.concat()).map_err(device)?;
        let trains = optimizer.is_some();
        // Training's buffers, or empty ones for a step that never trains.
        let bytes = |n: usize| launcher.alloc(if trains { n } else { 0 }).map_err(device);
        let (m, v) = match optimizer {
            Some(moments) => moments,
            None => (bytes(0)?, bytes(0)?),
        };
        Ok(DeviceStep {
            launcher,
            grads: bytes(layout.total * 4)?,
            // f64 partials, one a block, and the f64 norm.
            norm_partial: bytes(norm_blocks(layout.total) as usize * 8)?,
            norm: bytes(8)?,
            layout,
            weights,
            m,
            v,
            acts: None,
            reference: None,
            precision: Precision::F32,
        })
    }

    /// Each label's log-probability of `batch` under the device's weights of `model`'s
    /// architecture, row-major: the main stack's forward and head, no backward. MoE blocks
    /// count no tokens, as the CPU's inference forward does not.
    pub fn logp(&mut self, model: &Model, batch: &Batch) -> Result<Vec<f32>, RunError> {
        self.prepare(batch, model.rope(), None)?;
        self.main_logp((&self.weights, model), batch)
    }

    /// The same step with its matmuls' operands at `precision` ([`Precision::Bf16`]: as
    /// Megatron-LM trains; the weights, their gradients, AdamW's moments, the loss and the
    /// norms stay f32).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// Copies the weights and AdamW moments back into `trainer` (for a checkpoint, or to go on
    /// on the CPU).
    pub fn download(&self, trainer: &mut Trainer) -> Result<(), RunError> {
        self.download_weights(trainer)?;
        let read = |buffer: &L::Buffer, slot: &Slot| {
            self.launcher
                .read_f32(buffer, slot.offset, slot.len)
                .map_err(device)
        };
        for (i, slot) in self.layout.slots.iter().enumerate() {
            trainer.opt.m[i] = read(&self.m, slot)?;
            trainer.opt.v[i] = read(&self.v, slot)?;
        }
        Ok(())
    }

    /// Copies a frozen reference model's weights (an objective's [`PerToken::reference`]) to
    /// the device, once: done when the GPU is set up, so that a device without room for them
    /// fails there, not at the first step. The reference must be the policy's architecture.
    pub fn upload_reference(
        &mut self,
        policy: &Model,
        reference: Option<&Model>,
    ) -> Result<(), RunError> {
        let Some(reference) = reference else {
            return Ok(());
        };
        let names = |m: &Model| -> Vec<(String, usize)> {
            m.params
                .iter()
                .map(|(n, v)| (n.to_string(), v.elem_count()))
                .collect()
        };
        if names(reference) != names(policy) {
            return Err(RunError::new(
                "GPU trainer: the reference model's parameters are not the policy's",
            ));
        }
        let weights = reference.params.values().map_err(crate::err)?;
        let uploaded = self
            .launcher
            .upload_f32(&weights.concat())
            .map_err(device)?;
        self.reference = Some(uploaded);
        Ok(())
    }

    /// Copies the weights (not the optimizer state) back into `trainer`'s model.
    fn download_weights(&self, trainer: &mut Trainer) -> Result<(), RunError> {
        for ((_, var), slot) in trainer.model.params.iter().zip(&self.layout.slots) {
            let values = self
                .launcher
                .read_f32(&self.weights, slot.offset, slot.len)
                .map_err(device)?;
            let t = candle_core::Tensor::from_vec(values, var.shape(), var.device())
                .map_err(crate::err)?;
            var.set(&t).map_err(crate::err)?;
        }
        Ok(())
    }

    /// The gradients of the last step, per parameter (clipped when the step clipped them).
    pub fn gradients(&self) -> Result<Vec<Vec<f32>>, RunError> {
        self.layout
            .slots
            .iter()
            .map(|s| {
                self.launcher
                    .read_f32(&self.grads, s.offset, s.len)
                    .map_err(device)
            })
            .collect()
    }

    /// One optimizer step of `trainer` on global batch `trainer.step` of `source`:
    /// [`DeviceStep::step_on`] with [`crate::NextToken`]. Returns (mean loss, grad norm before
    /// clipping).
    pub fn step(
        &mut self,
        trainer: &mut Trainer,
        source: &mut dyn BatchSource,
    ) -> Result<(f64, f64), RunError> {
        self.step_on(trainer, &mut crate::NextToken::new(source))
    }

    /// One optimizer step of `trainer` on `objective`, which must be [`PerToken`]: the device
    /// twin of [`Trainer::step`]. Returns (mean loss, grad norm before clipping).
    pub fn step_on(
        &mut self,
        trainer: &mut Trainer,
        objective: &mut dyn Objective,
    ) -> Result<(f64, f64), RunError> {
        let cpu_only = || RunError::new("GPU trainer: the objective trains on the CPU only");
        let micro = objective.prepare_on(&trainer.model, trainer.step, &*self)?;
        let per_token = objective.per_token().ok_or_else(cpu_only)?;
        self.zero_grads()?;
        let (mut loss_sum, mut count, mut tally) = (0.0, 0.0, Tally::new());
        for i in 0..micro {
            let m = self.forward_backward(per_token, i, &trainer.model)?;
            loss_sum += m.sum;
            count += m.count;
            for (k, v) in m.tally {
                *tally.entry(k).or_insert(0.0) += v;
            }
        }
        let norm = self.clip(trainer.schedule.clip_grad)?;
        trainer.check_norm(norm)?;
        let lr = trainer.lr();
        self.adamw(trainer, lr)?;
        trainer.opt.t += 1;
        trainer.model.update_moe_biases();
        let loss = loss_sum / count.max(1.0);
        let metrics = objective.metrics(&tally);
        trainer.finish_step(loss, norm, lr, metrics);
        Ok((loss, norm))
    }

    /// Forward and backward of micro-batch `i` of `objective`'s prepared step, its gradients
    /// added into `grads`: the network, the main head's log-probabilities handed to
    /// [`PerToken::grad`], and its gradient back through the head and the network (with the
    /// MTP heads' losses when the objective trains them). Returns the objective's figures.
    fn forward_backward(
        &mut self,
        objective: &dyn PerToken,
        i: usize,
        model: &Model,
    ) -> Result<TokenGrad, RunError> {
        let batch = objective.batch(i)?;
        let mtp = objective.mtp_normaliser();
        let stacks = if mtp.is_some() {
            self.layout.stacks.len()
        } else {
            1
        };
        self.prepare(&batch, model.rope(), mtp)?;
        let reference = match objective.reference() {
            Some(r) => Some(self.reference_logp(model, r, &batch)?),
            None => None,
        };
        let count = objective.counts_experts();
        let routed = self.forward((&self.weights, model), &batch, stacks, count)?;
        // The main head's loss weights, written once the objective has given them (held out
        // of the activations meanwhile, which the launches borrow).
        let mut main_dloss = match self.acts.as_mut().and_then(|a| a.main_dloss.take()) {
            Some(buffer) => buffer,
            None => self.launcher.alloc(batch.ids.len() * 4).map_err(device)?,
        };

        let Launching { k, packed, at } = self.launching(&batch)?;
        let (l, acts, rows) = (&self.layout, packed.acts, k.rows);
        let (w, g) = (&self.weights, &self.grads);
        let (d, v) = (l.hidden, l.vocab);

        // Backward, stack by stack from the last MTP depth: its head and loss, its blocks in
        // reverse, its input (the embedding, or the join, which sends a gradient back to the
        // previous stack's output). The main head's loss is the objective's: its gradient in
        // each token's log-probability comes from the host, as the CE's weight (∂loss/∂CE =
        // −∂loss/∂logp); an MTP head's weights were uploaded with the batch.
        let (final_normed, logits) = (Arg::Ptr(&acts.final_normed, 0), Arg::Ptr(&acts.logits, 0));
        let dx = Arg::Ptr(&acts.dx, 0);
        let (dh, dnorm_in) = (Arg::Ptr(&acts.dh, 0), Arg::Ptr(&acts.dnorm_in, 0));
        let mut figures = None;
        for (s, stack) in l.stacks.iter().enumerate().take(stacks).rev() {
            let (out, inputs) = (stack.output(), &acts.inputs[s]);
            let final_norm = stack.final_norm;
            self.head(&k, w, stack, &inputs.labels)?;
            let dloss = if s == 0 {
                let logp = self.head_logp(rows)?;
                let grad = objective.grad(i, &logp, reference.as_deref())?;
                if grad.dlogp.len() != rows {
                    return Err(RunError::new(format!(
                        "GPU trainer: the objective gave {} gradients for {rows} tokens",
                        grad.dlogp.len()
                    )));
                }
                let dce: Vec<f32> = grad.dlogp.iter().map(|g| -g).collect();
                figures = Some(grad);
                let bytes = kernels::launch::f32_bytes(&dce);
                self.launcher
                    .write(&mut main_dloss, 0, &bytes)
                    .map_err(device)?;
                Arg::Ptr(&main_dloss, 0)
            } else {
                Arg::Ptr(inputs.dloss.as_ref().ok_or_else(no_acts)?, 0)
            };
            k.cross_entropy_backward(logits, &inputs.labels, dloss, acts, v)?;
            let head = l.head.with_grad((w, g));
            k.head_backward(acts, final_normed, head, dh, (rows, v, d))?;
            k.rms_norm_backward(at.x(out), final_norm, at.rstd(out), dh, dx, acts, self)?;
            if s + 1 < stacks {
                // The next depth joined this stack's output too.
                k.add(dx, Arg::Ptr(&join_scratch(acts)?.carry, 0), rows * d)?;
            }
            for i in stack.blocks.clone().rev() {
                let (block, a, x) = (&l.blocks[i], &acts.blocks[i], stack.slot(i));
                let (projected, mixed) = (Arg::Ptr(&a.projected, 0), Arg::Ptr(&a.mixed, 0));
                let (dmixed, dprojected) =
                    (Arg::Ptr(&acts.dmixed, 0), Arg::Ptr(&acts.dprojected, 0));
                match (&block.body, &routed[i]) {
                    (Body::Projected(p), _) => {
                        let (n_in, n_mid) = (p.in_width, p.mid_width);
                        let w_out = p.w_out.with_grad((w, g));
                        // An MLP's activations, and their gradients, only products read: in
                        // bf16 when the step multiplies in bf16; so is the tensor-core
                        // attention's gradient.
                        let mlp16 = matches!(p.mixer, Mixer::Mlp(_)) && k.bf16();
                        let in16 = match p.mixer {
                            Mixer::Mlp(_) => mlp16,
                            Mixer::Attention(heads) => k.attention_grad_is_bf16(heads),
                            Mixer::Mamba(_) => false,
                        };
                        let dims = (rows, d, n_mid);
                        let inputs = (false, mlp16);
                        k.linear_backward_of(dx, mixed, w_out, dmixed, dims, 0.0, inputs)?;
                        match p.mixer {
                            Mixer::Mlp(activation) => k.activation_backward(
                                activation, projected, dmixed, dprojected, n_mid, mlp16,
                            )?,
                            Mixer::Attention(heads) => {
                                k.attention_backward(a, dmixed, dprojected, heads, &packed)?
                            }
                            Mixer::Mamba(ssm) => {
                                let (scratch, scan) = mamba_inputs(&packed)?;
                                let (w, a, scan) = ((w, g), a, &scan);
                                k.mamba_backward(w, &ssm, a, scratch, scan, dmixed, dprojected)?
                            }
                        }
                        let (w_in, normed) = (p.w_in.with_grad((w, g)), at.normed(i));
                        let (dims, inputs) = ((rows, n_in, d), (in16, k.bf16()));
                        k.linear_backward_of(dprojected, normed, w_in, dh, dims, 0.0, inputs)?;
                    }
                    (Body::Moe(experts), Some(r)) => {
                        let scratch = moe_scratch(acts)?;
                        let io = (at.normed(i), dx, dh);
                        let shared = (dmixed, dprojected);
                        k.moe_backward((w, g), experts, r, io, a, scratch, shared, d)?;
                    }
                    (Body::Moe(_), None) => {
                        return Err(RunError::new(
                            "GPU trainer: an MoE block's backward without its forward's routing"
                                .to_string(),
                        ));
                    }
                }
                k.rms_norm_backward(at.x(x), block.norm, at.rstd(x), dh, dnorm_in, acts, self)?;
                k.add(dx, dnorm_in, rows * d)?;
            }
            match (&stack.join, s.checked_sub(1)) {
                (Some(join), Some(before)) => {
                    let h = at.x(l.stacks[before].output());
                    let (a, scratch) = (&acts.joins[before], join_scratch(acts)?);
                    k.join_backward(self, join, a, scratch, acts, &inputs.ids, (h, dx))?;
                }
                _ => {
                    k.embedding_backward(dx, &inputs.ids, acts, v, d)?;
                    k.add(l.embedding.at(g), Arg::Ptr(&acts.dtable, 0), v * d)?;
                }
            }
        }
        if let Some(acts) = self.acts.as_mut() {
            acts.main_dloss = Some(main_dloss);
        }
        figures.ok_or_else(|| RunError::new("GPU trainer: the main head was not run"))
    }

    /// The forward of the uploaded micro-batch through the first `stacks` stacks (the main
    /// stack, then MTP depths) on the weights `w` of `model`, which chooses the MoE blocks'
    /// experts and, with `count`, counts their tokens for the bias update; returns each
    /// block's routing (`None` for a block that is not MoE).
    fn forward(
        &self,
        (w, model): (&L::Buffer, &Model),
        batch: &Batch,
        stacks: usize,
        count: bool,
    ) -> Result<Vec<Option<moe::Routed<L::Buffer>>>, RunError> {
        let Launching { k, packed, at } = self.launching(batch)?;
        let (l, acts, rows) = (&self.layout, packed.acts, k.rows);
        let (d, v) = (l.hidden, l.vocab);

        // Stack by stack: x = embed(ids), or an MTP depth's join; then per block
        // x = x + w_out(mix(w_in(rms_norm(x)))), or x = x + moe(rms_norm(x)).
        let mut routed = Vec::with_capacity(l.blocks.len());
        for (s, stack) in l.stacks.iter().enumerate().take(stacks) {
            let (input, ids) = (at.x(stack.first_slot), &acts.inputs[s].ids);
            match (&stack.join, s.checked_sub(1)) {
                (Some(join), Some(before)) => {
                    let h = at.x(l.stacks[before].output());
                    let (a, scratch) = (&acts.joins[before], join_scratch(acts)?);
                    k.join(l, w, join, a, scratch, ids, (h, input))?
                }
                _ => k.embedding(l.embedding.at(w), ids, input, v, d)?,
            }
            for i in stack.blocks.clone() {
                let (block, a, x) = (&l.blocks[i], &acts.blocks[i], stack.slot(i));
                let (projected, mixed) = (Arg::Ptr(&a.projected, 0), Arg::Ptr(&a.mixed, 0));
                // A projected block's normed input only its in-projection's products read: in
                // bf16 when they are (an MoE block's router reads its own in f32).
                let normed16 = k.bf16() && matches!(block.body, Body::Projected(_));
                k.enter_block(&at, block.norm.at(w), (i, x), l.eps, normed16)?;
                let p = match &block.body {
                    Body::Projected(p) => p,
                    Body::Moe(experts) => {
                        let (scratch, layer) = (moe_scratch(acts)?, moe_layer(model, stack, i)?);
                        let counted = (count, batch.valid.as_deref());
                        let r = k.moe(w, experts, layer, counted, at.normed(i), a, scratch, d)?;
                        k.add(at.x(x + 1), scratch.output(), rows * d)?;
                        routed.push(Some(r));
                        continue;
                    }
                };
                routed.push(None);
                let (n_in, n_mid) = (p.in_width, p.mid_width);
                let (w_in, dims) = (p.w_in.at(w), (rows, n_in, d));
                k.gemm_of(
                    at.normed(i),
                    w_in,
                    projected,
                    dims,
                    NT,
                    0.0,
                    (normed16, false),
                )?;
                // An MLP's activation only products read: in bf16 when they are bf16.
                let mlp16 = matches!(p.mixer, Mixer::Mlp(_)) && k.bf16();
                match p.mixer {
                    Mixer::Mlp(activation) => {
                        k.activation(activation, projected, mixed, n_mid, mlp16)?
                    }
                    Mixer::Attention(heads) => k.attention(projected, mixed, a, heads, &packed)?,
                    Mixer::Mamba(ssm) => {
                        let (scratch, scan) = mamba_inputs(&packed)?;
                        k.mamba(w, &ssm, a, scratch, &scan)?
                    }
                }
                let (out, dims) = (at.x(x + 1), (rows, d, n_mid));
                k.gemm_of(mixed, p.w_out.at(w), out, dims, NT, 1.0, (mlp16, false))?;
            }
        }
        Ok(routed)
    }

    /// The launches of a micro-batch the size of `batch` (uploaded by [`DeviceStep::prepare`]),
    /// its activations as the attention and Mamba kernels read them, and its slots.
    fn launching(&self, batch: &Batch) -> Result<Launching<'_, 'l, L>, RunError> {
        let acts = self.acts.as_ref().ok_or_else(no_acts)?;
        let rows = batch.ids.len();
        let k = Kernels {
            launcher: self.launcher,
            rows,
            precision: self.precision,
        };
        let packed = Packed {
            batch: batch.layout.batch,
            len: batch.layout.len,
            acts,
        };
        let slots = Slots {
            acts,
            rows,
            hidden: self.layout.hidden,
        };
        Ok(Launching {
            k,
            packed,
            at: slots,
        })
    }

    /// `stack`'s output head on the weights `w`: its final norm, the logits and each token's
    /// cross-entropy against `labels` (with the log-sum-exp the backward reads).
    fn head(
        &self,
        k: &Kernels<'_, L>,
        w: &L::Buffer,
        stack: &Stack,
        labels: &L::Buffer,
    ) -> Result<(), RunError> {
        let (l, acts) = (&self.layout, self.acts.as_ref().ok_or_else(no_acts)?);
        let (d, v, out) = (l.hidden, l.vocab, stack.output());
        let (final_normed, logits) = (Arg::Ptr(&acts.final_normed, 0), Arg::Ptr(&acts.logits, 0));
        let at = Slots {
            acts,
            rows: k.rows,
            hidden: d,
        };
        // The normed rows only the head's products read: in bf16 when they are.
        let (norm, rstd) = (stack.final_norm.at(w), at.rstd(out));
        k.rms_norm(at.x(out), norm, final_normed, rstd, d, l.eps, k.bf16())?;
        let (head, dims) = (l.head.at(w), (k.rows, v, d));
        k.gemm_of(final_normed, head, logits, dims, NT, 0.0, (k.bf16(), false))?;
        k.cross_entropy(logits, labels, acts, v)
    }

    /// The log-probability of each of the `rows` labels under the head just run: minus its
    /// cross-entropy.
    fn head_logp(&self, rows: usize) -> Result<Vec<f32>, RunError> {
        let acts = self.acts.as_ref().ok_or_else(no_acts)?;
        let ce = self.launcher.read_f32(&acts.ce, 0, rows).map_err(device)?;
        Ok(ce.into_iter().map(|c| -c).collect())
    }

    /// The frozen `reference`'s log-probabilities of the uploaded micro-batch's labels, from
    /// its weights on the device (uploaded on first use; they never change).
    fn reference_logp(
        &mut self,
        policy: &Model,
        reference: &Model,
        batch: &Batch,
    ) -> Result<Vec<f32>, RunError> {
        if self.reference.is_none() {
            self.upload_reference(policy, Some(reference))?;
        }
        let w = self.reference.as_ref().ok_or_else(no_acts)?;
        self.main_logp((w, reference), batch)
    }

    /// The uploaded micro-batch's labels' log-probabilities under the weights `w` of `model`:
    /// the main stack's forward (no MoE tokens counted) and its head.
    fn main_logp(
        &self,
        (w, model): (&L::Buffer, &Model),
        batch: &Batch,
    ) -> Result<Vec<f32>, RunError> {
        self.forward((w, model), batch, 1, false)?;
        let Launching { k, packed, .. } = self.launching(batch)?;
        let main = self.layout.stacks.first().ok_or_else(no_acts)?;
        self.head(&k, w, main, &packed.acts.inputs[0].labels)?;
        self.head_logp(batch.ids.len())
    }

    /// Uploads a micro-batch's ids and labels (and, for attention, its segment ids and rotary
    /// tables), allocating the activations for its size on first use. With `mtp`, the MTP
    /// heads' normaliser, the MTP depths' shifted ids, labels and loss weights too.
    fn prepare(
        &mut self,
        batch: &Batch,
        rope: Option<&Rope>,
        mtp: Option<f64>,
    ) -> Result<(), RunError> {
        let rows = batch.ids.len();
        let layout = &batch.layout;
        if batch.labels.len() != rows
            || batch.loss_mask.len() != rows
            || layout.batch * layout.len != rows
            || layout.segments.len() != rows
            || layout.positions.len() != rows
        {
            return Err(RunError::new(format!(
                "GPU trainer: a micro-batch of {rows} ids has {} labels, {} loss weights and a \
                 layout of {} × {} ({} segment ids, {} positions)",
                batch.labels.len(),
                batch.loss_mask.len(),
                layout.batch,
                layout.len,
                layout.segments.len(),
                layout.positions.len()
            )));
        }
        let chunk_rows = self.layout.chunk_rows(layout.batch, layout.len);
        if self
            .acts
            .as_ref()
            .is_none_or(|a| a.rows < rows || a.batch < layout.batch || a.chunk_rows < chunk_rows)
        {
            self.acts = Some(self.allocate(rows, layout.batch, chunk_rows, true)?);
        }
        let attention = self.layout.attention_heads().is_some();
        let tables = match (attention && self.layout.rope, rope) {
            (false, _) => None,
            (true, Some(rope)) => Some(rope.fused_tables(layout).map_err(crate::err)?),
            (true, None) => {
                return Err(RunError::new(
                    "GPU trainer: the model uses RoPE but has no rotary tables".to_string(),
                ));
            }
        };
        let acts = self.acts.as_mut().ok_or_else(no_acts)?;
        let u32_bytes = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let f32_bytes = kernels::launch::f32_bytes;
        let l = self.launcher;
        let [main, depths @ ..] = acts.inputs.as_mut_slice() else {
            return Err(no_acts());
        };
        l.write(&mut main.ids, 0, &u32_bytes(&batch.ids))
            .and_then(|_| l.write(&mut main.labels, 0, &u32_bytes(&batch.labels)))
            .map_err(device)?;
        if let Some(normaliser) = mtp {
            for (join, inputs) in self.layout.joins().zip(depths) {
                let (ids, labels, mask) = model::net::shift_left(batch, join.shift);
                let dloss: Vec<f32> = mask
                    .iter()
                    .map(|m| (*m as f64 * join.loss_scale / normaliser) as f32)
                    .collect();
                l.write(&mut inputs.ids, 0, &u32_bytes(&ids))
                    .and_then(|_| l.write(&mut inputs.labels, 0, &u32_bytes(&labels)))
                    .map_err(device)?;
                let weights = inputs.dloss.as_mut().ok_or_else(no_acts)?;
                l.write(weights, 0, &f32_bytes(&dloss)).map_err(device)?;
            }
        }
        if let Some(segments) = acts.segments.as_mut() {
            l.write(segments, 0, &u32_bytes(&layout.segments))
                .map_err(device)?;
        }
        if let Some(starts) = acts.starts.as_mut() {
            let runs = model::mamba2::run_starts(&layout.segments, layout.batch, layout.len)
                .map_err(crate::err)?;
            let bytes: Vec<u8> = runs
                .iter()
                .flat_map(|s| (*s as i32).to_le_bytes())
                .collect();
            l.write(starts, 0, &bytes).map_err(device)?;
        }
        if let (Some(t), Some(cos), Some(sin)) = (tables, acts.cos.as_mut(), acts.sin.as_mut()) {
            l.write(cos, 0, &f32_bytes(&t.cos))
                .and_then(|_| l.write(sin, 0, &f32_bytes(&t.sin)))
                .map_err(device)?;
        }
        Ok(())
    }

    /// The activations of a micro-batch of `rows` tokens in `batch` rows and `chunk_rows`
    /// (row, chunk) pairs of the Mamba-2 scan, and, with `backward`, the backward's scratch
    /// (without it, as the decoder asks, those buffers are empty).
    fn allocate(
        &self,
        rows: usize,
        batch: usize,
        chunk_rows: usize,
        backward: bool,
    ) -> Result<Activations<L::Buffer>, RunError> {
        let l = &self.layout;
        let (d, v, blocks) = (l.hidden, l.vocab, l.blocks.len());
        let depths = l.joins().count();
        let floats = |n: usize| self.launcher.alloc(n * 4).map_err(device);
        let grads = |n: usize| floats(if backward { n } else { 0 });
        let widest = |width: fn(&Projected) -> usize| {
            let widths = l
                .blocks
                .iter()
                .filter_map(|b| b.projected().map(|p| width(&p)));
            widths.max().unwrap_or(0)
        };
        let experts: Vec<&Experts> = l
            .blocks
            .iter()
            .filter_map(|b| match &b.body {
                Body::Moe(e) => Some(e),
                Body::Projected(_) => None,
            })
            .collect();
        let heads = l.attention_heads();
        let attention = |n: usize| heads.map(|_| floats(n)).transpose();
        let per_head = |h: Heads| rows * h.heads;
        let ssms = l.ssms();
        Ok(Activations {
            rows,
            batch,
            chunk_rows,
            inputs: l
                .stacks
                .iter()
                .map(|stack| {
                    Ok(Inputs {
                        ids: floats(rows)?,
                        labels: floats(rows)?,
                        dloss: stack.join.as_ref().map(|_| floats(rows)).transpose()?,
                    })
                })
                .collect::<Result<_, RunError>>()?,
            main_dloss: Some(floats(rows)?),
            segments: attention(rows)?,
            cos: heads
                .filter(|_| l.rope)
                .map(|h| floats(rows * h.dim))
                .transpose()?,
            sin: heads
                .filter(|_| l.rope)
                .map(|h| floats(rows * h.dim))
                .transpose()?,
            xs: floats(l.streams() * rows * d)?,
            normed: floats(blocks * rows * d)?,
            rstd: floats(l.streams() * rows)?,
            blocks: l
                .blocks
                .iter()
                .map(|b| {
                    let p = b.projected();
                    Ok(BlockActs {
                        projected: floats(rows * p.map_or(0, |p| p.in_width))?,
                        mixed: floats(rows * p.map_or(0, |p| p.mid_width))?,
                        lse: match b.mixer() {
                            Some(Mixer::Attention(h)) => Some(floats(per_head(h))?),
                            _ => None,
                        },
                        mamba: match b.mixer() {
                            Some(Mixer::Mamba(s)) => {
                                Some(MambaActs::allocate(&floats, &s, rows, chunk_rows)?)
                            }
                            _ => None,
                        },
                        moe: match &b.body {
                            Body::Moe(e) => Some(MoeActs::allocate(&floats, e, rows, d)?),
                            Body::Projected(_) => None,
                        },
                    })
                })
                .collect::<Result<_, RunError>>()?,
            joins: (0..depths)
                .map(|_| JoinActs::allocate(&floats, rows, d))
                .collect::<Result<_, RunError>>()?,
            join: JoinScratch::allocate(&floats, depths, rows, d)?,
            final_normed: floats(rows * d)?,
            logits: floats(rows * v)?,
            ce: floats(rows)?,
            lse: floats(rows)?,
            dlogits: grads(rows * v)?,
            dx: grads(rows * d)?,
            dh: grads(rows * d)?,
            dnorm_in: grads(rows * d)?,
            dmixed: grads(rows * widest(|b| b.mid_width))?,
            dprojected: grads(rows * widest(|b| b.in_width))?,
            delta: heads.map(|h| grads(per_head(h))).transpose()?,
            packed_heads: heads
                .filter(|h| tensor_core_kernel("attention_fwd", h.dim).is_some())
                .map(|h| floats(rows * (h.heads + h.kv_heads) * h.dim))
                .transpose()?,
            starts: (!ssms.is_empty()).then(|| floats(rows)).transpose()?,
            mamba: MambaScratch::allocate(&floats, &ssms, (rows, batch, chunk_rows))?,
            moe: MoeScratch::allocate(&floats, &experts, rows, d)?,
            dw_partial: grads(row_grid(rows) as usize * d)?,
            dw: grads(d)?,
            dtable: grads(v * d)?,
        })
    }

    /// Sets every gradient to zero, before a step's first micro-batch.
    fn zero_grads(&mut self) -> Result<(), RunError> {
        self.launcher.zero(&mut self.grads).map_err(device)
    }

    /// The global L2 norm of the gradients (f64 partials summed in block order), and the
    /// gradients scaled to `max_norm` when above it (0: no clipping); returns the norm before.
    fn clip(&mut self, max_norm: f64) -> Result<f64, RunError> {
        let n = self.layout.total;
        let (g, partial, norm) = (&self.grads, &self.norm_partial, &self.norm);
        let l = self.launcher;
        let blocks = norm_blocks(n);
        // SAFETY: grads holds n floats, the partials one double a block, norm one double.
        unsafe {
            l.launch(
                "grad_norm_partials",
                Geometry::linear(blocks, 256),
                &[Arg::Ptr(g, 0), Arg::Usize(n), Arg::Ptr(partial, 0)],
            )
            .and_then(|_| {
                l.launch(
                    "grad_norm_finish",
                    Geometry::linear(1, 256),
                    &[
                        Arg::Ptr(partial, 0),
                        Arg::I32(blocks as i32),
                        Arg::Ptr(norm, 0),
                    ],
                )
            })
            .and_then(|_| {
                l.launch(
                    "grad_clip_f32",
                    Geometry::linear(elementwise_grid(n), 256),
                    &[
                        Arg::Ptr(g, 0),
                        Arg::Usize(n),
                        Arg::Ptr(norm, 0),
                        Arg::F64(max_norm),
                    ],
                )
            })
            .map_err(device)?;
        }
        let norm = l.read_f64(norm, 0, 1).map_err(device)?;
        Ok(norm.first().copied().unwrap_or(f64::NAN))
    }

    /// AdamW on every parameter, with the bias corrections of step `opt.t + 1` computed as
    /// [`crate::optim::AdamW::step`] computes them (f64, rounded to f32).
    fn adamw(&mut self, trainer: &Trainer, lr: f64) -> Result<(), RunError> {
        let c = trainer.schedule.adamw();
        let t = trainer.opt.t + 1;
        let bc1 = 1.0 - c.beta1.powi(t as i32);
        let bc2 = 1.0 - c.beta2.powi(t as i32);
        for slot in &self.layout.slots {
            let wd = if slot.decay {
                c.weight_decay as f32
            } else {
                0.0
            };
            let args = [
                slot.at(&self.weights),
                slot.at(&self.grads),
                slot.at(&self.m),
                slot.at(&self.v),
                Arg::Null,
                Arg::Usize(slot.len),
                Arg::F32(lr as f32),
                Arg::F32(c.beta1 as f32),
                Arg::F32(c.beta2 as f32),
                Arg::F32(bc1 as f32),
                Arg::F32(bc2 as f32),
                Arg::F32(c.eps as f32),
                Arg::F32(wd),
            ];
            // SAFETY: each slot holds `len` floats of the weights, grads and moments.
            unsafe {
                self.launcher.launch(
                    "adamw_f32",
                    Geometry::linear(elementwise_grid(slot.len), 256),
                    &args,
                )
            }
            .map_err(device)?;
        }
        Ok(())
    }
}

/// Scoring on a device: eval's perplexity and multiple choice from [`DeviceStep::logp`].
pub struct Scoring<'l, 'm, L: Launcher> {
    pub step: DeviceStep<'l, L>,
    pub model: &'m Model,
}

impl<L: Launcher> crate::eval::Scorer for Scoring<'_, '_, L> {
    fn model(&self) -> &Model {
        self.model
    }

    fn logp(
        &mut self,
        ids: &[u32],
        labels: &[u32],
        layout: &model::layers::Layout,
    ) -> Result<Vec<f32>, RunError> {
        // The kernels read an id past the vocabulary as NaN, where the CPU's forward refuses it.
        let vocab = self.model.vocab;
        if let Some(id) = ids.iter().chain(labels).find(|id| **id as usize >= vocab) {
            return Err(RunError::new(format!(
                "token id {id} is outside the model's vocabulary ({vocab})"
            )));
        }
        let batch = Batch {
            ids: ids.to_vec(),
            labels: labels.to_vec(),
            loss_mask: vec![1.0; ids.len()],
            layout: layout.clone(),
            valid: None,
        };
        self.step.logp(self.model, &batch)
    }

    fn decoders(&self) -> Option<&dyn crate::Decoders> {
        Some(&self.step)
    }
}

/// A [`DeviceStep`] as the training loop's [`Stepper`]: steps of `objective` (which must be
/// [`PerToken`]), the host's weights and moments brought back before each checkpoint.
pub struct OnDevice<'l, 'o, 'a, L: Launcher> {
    pub step: DeviceStep<'l, L>,
    pub objective: &'o mut (dyn Objective + 'a),
}

impl<L: Launcher> Stepper for OnDevice<'_, '_, '_, L> {
    fn step(&mut self, trainer: &mut Trainer) -> Result<(f64, f64), RunError> {
        self.step.step_on(trainer, self.objective)
    }

    fn sync(&mut self, trainer: &mut Trainer) -> Result<(), RunError> {
        self.step.download(trainer)
    }
}

/// Whether the GPU trainer's forward can score `model` (eval): `Err` names what it cannot,
/// before anything touches a device.
pub fn can_score(model: &Model) -> Result<(), RunError> {
    Layout::of(model, &vec![false; model.params.iter().count()]).map(|_| ())
}

/// Whether the GPU trainer can train `trainer`'s model: `Err` names what it cannot, before
/// anything touches a device.
pub fn supports(trainer: &Trainer) -> Result<(), RunError> {
    Layout::of(&trainer.model, &trainer.decay).map(|_| ())
}

/// The Mamba-2 blocks' scratch and the micro-batch's scan shape.
fn mamba_inputs<'a, B>(p: &Packed<'a, B>) -> Result<(&'a MambaScratch<B>, Scan<'a, B>), RunError> {
    let scratch = mamba_scratch(p.acts)?;
    let starts = p.acts.starts.as_ref().ok_or_else(no_mamba_scratch)?;
    let scan = Scan {
        batch: p.batch,
        len: p.len,
        starts,
    };
    Ok((scratch, scan))
}

/// The Mamba-2 blocks' scratch.
fn mamba_scratch<B>(acts: &Activations<B>) -> Result<&MambaScratch<B>, RunError> {
    acts.mamba.as_ref().ok_or_else(no_mamba_scratch)
}

fn no_mamba_scratch() -> RunError {
    RunError::new("GPU trainer: a Mamba-2 block without its scratch".to_string())
}

/// The MoE blocks' scratch.
fn moe_scratch<B>(acts: &Activations<B>) -> Result<&MoeScratch<B>, RunError> {
    acts.moe
        .as_ref()
        .ok_or_else(|| RunError::new("GPU trainer: an MoE block without its scratch".to_string()))
}

/// The CPU model's MoE layer of block `i` of `stack`, which chooses its tokens' experts and
/// counts them.
fn moe_layer<'m>(
    model: &'m Model,
    stack: &Stack,
    i: usize,
) -> Result<&'m model::moe::Moe, RunError> {
    let at = i - stack.blocks.start;
    let blocks = match &stack.join {
        None => Some(&model.blocks),
        Some(join) => model.mtp.get(join.weights).map(|m| &m.blocks),
    };
    match blocks.and_then(|b| b.get(at)).map(|b| &b.mixer) {
        Some(model::net::Mixer::Moe(m)) => Ok(m),
        _ => Err(RunError::new(format!(
            "GPU trainer: block {at} of the model's stack is not an MoE block"
        ))),
    }
}

/// The MTP depths' scratch.
fn join_scratch<B>(acts: &Activations<B>) -> Result<&JoinScratch<B>, RunError> {
    acts.join
        .as_ref()
        .ok_or_else(|| RunError::new("GPU trainer: an MTP depth without its scratch".to_string()))
}

fn no_acts() -> RunError {
    RunError::new("GPU trainer: the activations were not allocated".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{tempdir, weights};
    use crate::{NextToken, Schedule, checkpoint};
    use check::PackedCounting as Counting;
    use kernels::launch::Shim;
    use kernels::simt::Schedule as Warps;
    use model::config::ModelConfig;
    use model::net::Model;
    use serde_json::json;

    /// An attention block and an MLP block on the counting task, untied head unless `tied`.
    fn trainer(activation: &str, tied: bool, clip: f64) -> Trainer {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "*-", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 48,
            "activation": activation, "tie_embeddings": tied
        }))
        .unwrap();
        let schedule: Schedule = serde_json::from_value(json!({
            "steps": 6, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, "min_lr": 1e-3,
            "warmup": 2, "log_interval": 1, "clip_grad": clip
        }))
        .unwrap();
        Trainer::new(Model::new(&cfg, 32, 11).unwrap(), schedule)
    }

    fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The step's kernels, run by the SIMT shim, give the CPU trainer's gradients: every
    /// launch of the forward and backward (embedding, RMSNorm, GEMMs, activations, attention
    /// over packed rows with RoPE and grouped heads, cross-entropy, and the sums over paths
    /// and micro-batches) is in this comparison.
    #[test]
    fn one_step_on_the_shim_gives_the_cpu_gradients() {
        let cases = check::MODELS.into_iter().chain([
            ("-*", "relu2", true),
            ("*", "swiglu", false),
            ("M", "swiglu", true),
        ]);
        for (pattern, activation, tied) in cases {
            let gap = check::gradients(&Shim::default(), pattern, activation, tied).unwrap();
            assert!(
                gap.passes(),
                "`{pattern}` {activation}, tied {tied}: {gap:?}"
            );
        }
    }

    /// Rows of 48 tokens packed as three sequences of 20, 17 and 11: several key tiles per
    /// query (the online softmax's rescaling), key tiles a later segment's queries skip, and
    /// micro-batches whose batch × len differ (2 × 48, then 4 × 24, then 1 × 96).
    struct LongPacked;

    impl BatchSource for LongPacked {
        fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError> {
            Ok([(2, 48), (4, 24), (1, 96)]
                .into_iter()
                .map(|(rows, len)| {
                    let n = rows * len;
                    let ids: Vec<u32> = (0..n as u64)
                        .map(|i| ((i * 7 + step) % 32) as u32)
                        .collect();
                    let labels: Vec<u32> = ids.iter().map(|t| (t + 7) % 32).collect();
                    let mut layout = model::layers::Layout::plain(rows, len);
                    let mut loss_mask = vec![1.0; n];
                    for (i, mask) in loss_mask.iter_mut().enumerate() {
                        let at = i % 48;
                        let (segment, start) = match at {
                            0..20 => (0, 0),
                            20..37 => (1, 20),
                            _ => (2, 37),
                        };
                        layout.segments[i] = (i / 48 * 3 + segment) as u32;
                        layout.positions[i] = (at - start) as u32;
                        if [19, 36, 47].contains(&at) {
                            *mask = 0.0;
                        }
                    }
                    Batch {
                        ids,
                        labels,
                        loss_mask,
                        layout,
                        valid: None,
                    }
                })
                .collect())
        }
    }

    /// Attention over long packed rows, with RoPE and without (`position: none`, null tables),
    /// and Mamba-2 (its state carried over many chunks, some of which a segment starts inside;
    /// one group) give the CPU trainer's gradients.
    #[test]
    fn long_packed_rows_with_and_without_rope_give_the_cpu_gradients() {
        for (pattern, position) in [("*-*", "rope"), ("*-*", "none"), ("M-M", "none")] {
            let cfg: ModelConfig = serde_json::from_value(json!({
                "pattern": pattern, "hidden": 32, "heads": 4, "kv_heads": 1, "head_dim": 8,
                "ffn": 48, "position": position, "max_seq": 128,
                "mamba": {"heads": 4, "head_dim": 16, "state": 16, "chunk": 8}
            }))
            .unwrap();
            let mut t = Trainer::new(
                Model::new(&cfg, 32, 5).unwrap(),
                trainer("relu2", false, 0.0).schedule,
            );
            let gap = check::step_gap(&Shim::default(), &mut t, || LongPacked).unwrap();
            assert!(gap.passes(), "`{pattern}`, position {position}: {gap:?}");
        }
    }

    /// Six steps with clipping and the lr schedule on the shim follow the CPU trainer's curve;
    /// both warp schedules give the same bytes (no races, no order-dependent sums); the
    /// weights and moments come back into a checkpoint the CPU trainer resumes from.
    #[test]
    fn steps_on_the_shim_follow_the_cpu_trainer_and_resume_on_the_cpu() {
        let mut cpu = trainer("swiglu", false, 0.5);
        let mut objective_source = Counting(2);
        let mut objective = NextToken::new(&mut objective_source);
        for _ in 0..4 {
            cpu.step(&mut objective).unwrap();
        }
        let run_on = |warps| {
            let mut t = trainer("swiglu", false, 0.5);
            let shim = Shim { schedule: warps };
            let mut step = DeviceStep::upload(&shim, &t).unwrap();
            for _ in 0..4 {
                step.step(&mut t, &mut Counting(2)).unwrap();
            }
            step.download(&mut t).unwrap();
            t
        };
        let on_shim = run_on(Warps::Forward);
        let reversed = run_on(Warps::Reverse);
        assert_eq!(
            weights(&on_shim),
            weights(&reversed),
            "the warp order shows"
        );
        assert_eq!(on_shim.opt, reversed.opt);
        assert_eq!(on_shim.step, 4);
        assert_eq!(on_shim.opt.t, 4);
        for (a, b) in on_shim.curve.iter().zip(&cpu.curve) {
            assert_eq!((a.step, a.lr), (b.step, b.lr));
            assert!((a.loss - b.loss).abs() < 1e-4 * b.loss, "{a:?} vs {b:?}");
            assert!(
                (a.grad_norm - b.grad_norm).abs() < 1e-4 * b.grad_norm,
                "{a:?} vs {b:?}"
            );
        }
        assert_eq!(on_shim.curve.len(), cpu.curve.len());
        let diff = max_diff(&weights(&on_shim), &weights(&cpu));
        assert!(diff < 1e-3, "weights after 4 steps are {diff} apart");

        // The device's state, checkpointed, resumes on the CPU for the last two steps.
        let dir = tempdir("gpu-resume");
        checkpoint::save(&on_shim, &dir).unwrap();
        let mut resumed = trainer("swiglu", false, 0.5);
        checkpoint::restore(&mut resumed, &dir).unwrap();
        assert_eq!(weights(&resumed), weights(&on_shim));
        let mut source = Counting(2);
        let mut objective = NextToken::new(&mut source);
        for _ in 0..2 {
            resumed.step(&mut objective).unwrap();
            cpu.step(&mut objective).unwrap();
        }
        let last = |t: &Trainer| t.curve.last().map(|p| p.loss).unwrap();
        assert!((last(&resumed) - last(&cpu)).abs() < 1e-3 * last(&cpu));
    }

    /// The training loop on the device (`Trainer::run_on` with `OnDevice`), as `pretrain` and
    /// `sft` drive it under `device: cuda`: checkpoints are written from the device's state,
    /// a run stopped after step 2 and resumed from its checkpoint on the device ends with the
    /// same bytes as one that never stopped, and the log has the CPU loop's lines.
    #[test]
    fn the_loop_on_the_device_checkpoints_and_resumes_to_the_same_bytes() {
        let shim = Shim::default();
        let run = |dir: &std::path::Path, stop_after: Option<u64>| {
            let mut t = trainer("swiglu", false, 0.5);
            t.schedule.steps = 4;
            t.schedule.save_interval = 2;
            if let Some(latest) = checkpoint::latest(dir) {
                checkpoint::restore(&mut t, &latest).unwrap();
            }
            let mut source = Counting(2);
            let mut objective = NextToken::new(&mut source);
            let mut stepper = OnDevice {
                step: DeviceStep::upload(&shim, &t).unwrap(),
                objective: &mut objective,
            };
            let mut log = Vec::new();
            let r = t.run_on(
                &mut stepper,
                dir,
                |_| 48,
                &mut log,
                &mut |_, _, _| {},
                stop_after,
            );
            (
                t,
                r.map_err(|e| e.to_string()),
                String::from_utf8(log).unwrap(),
            )
        };
        let whole = tempdir("gpu-loop-whole");
        let (uninterrupted, r, log) = run(&whole, None);
        assert!(r.is_ok(), "{r:?}");
        assert!(log.contains("step      4/4 | loss") && log.contains("checkpoint: step 4 saved"));

        let cut = tempdir("gpu-loop-cut");
        let (_, r, _) = run(&cut, Some(2));
        assert!(r.unwrap_err().contains("stopped after step 2"));
        let (resumed, r, _) = run(&cut, None);
        assert_eq!(r.unwrap()["resumed_from_step"], 2);
        assert_eq!(weights(&resumed), weights(&uninterrupted));
        assert_eq!(resumed.opt, uninterrupted.opt);
        // What was written is the device's state, not the host's initial weights.
        let mut saved = trainer("swiglu", false, 0.5);
        checkpoint::restore(&mut saved, &checkpoint::latest(&whole).unwrap()).unwrap();
        assert_eq!(weights(&saved), weights(&uninterrupted));
        let initial = weights(&trainer("swiglu", false, 0.5));
        assert!(
            weights(&saved) != initial,
            "the checkpoint holds the initial weights"
        );
    }

    /// eval's scoring on the device: the perplexity of a token stream and the log-likelihoods
    /// of multiple-choice continuations under a hybrid (Mamba-2, RoPE attention, MoE with a
    /// shared expert, MLP), from [`DeviceStep::logp`] on the shim, against the CPU's: within
    /// f32's error with f32 matmuls, within bf16's with bf16 ones.
    #[test]
    fn scoring_on_the_shim_gives_the_cpus_perplexity_and_loglikelihoods() {
        use crate::eval::{Cpu, Scorer, perplexity};
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "M*E-", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8,
            "ffn": 48, "activation": "relu2", "max_seq": 24,
            "mamba": {"heads": 8, "head_dim": 8, "state": 8, "groups": 2, "conv": 4, "chunk": 4},
            "moe": {"experts": 4, "top_k": 2, "expert_ffn": 16, "shared_ffn": 24,
                    "scaling": 2.5}
        }))
        .unwrap();
        let model = Model::new(&cfg, 32, 5).unwrap();
        let stream: Vec<u32> = (0..200u32).map(|i| (i * 7 + i / 5) % 32).collect();
        let pairs: Vec<(Vec<u32>, Vec<u32>)> = (0..5u32)
            .map(|i| {
                (
                    (0..3 + 2 * i).map(|j| (i + j) % 32).collect(),
                    vec![i, i + 1, 9],
                )
            })
            .collect();
        let (want_ppl, want_tokens) = perplexity(&mut Cpu(&model), &stream, 16, 10).unwrap();
        let want_ll = crate::choice::loglikelihoods(&mut Cpu(&model), &pairs, 3).unwrap();
        let shim = Shim::default();
        for (precision, tolerance) in [(Precision::F32, 1e-5), (Precision::Bf16, 1e-2)] {
            let step = DeviceStep::upload_for_scoring(&shim, &model)
                .unwrap()
                .with_precision(precision);
            let mut scoring = Scoring {
                step,
                model: &model,
            };
            assert_eq!(scoring.model().vocab, 32);
            let (ppl, tokens) = perplexity(&mut scoring, &stream, 16, 10).unwrap();
            assert_eq!(tokens, want_tokens);
            let gap = (ppl - want_ppl).abs() / want_ppl;
            eprintln!("{precision:?}: loss {ppl} vs {want_ppl} ({gap:.1e})");
            assert!(gap < tolerance, "{precision:?}: {ppl} vs {want_ppl}");
            let ll = crate::choice::loglikelihoods(&mut scoring, &pairs, 3).unwrap();
            for (got, want) in ll.iter().zip(&want_ll) {
                assert!(
                    (got - want).abs() < tolerance * want.abs(),
                    "{precision:?}: {got} vs {want}"
                );
            }
            // An id past the vocabulary is refused, as the CPU's forward refuses it.
            let outside = [(vec![3, 4], vec![32])];
            let err = crate::choice::loglikelihoods(&mut scoring, &outside, 1).unwrap_err();
            assert!(
                err.message.contains("outside the model's vocabulary"),
                "{}",
                err.message
            );
        }
    }

    /// MoE blocks, each in a way of its own: one expert a token (k = 1: the gates are the
    /// raw scores) and no shared expert beside MLP blocks; three of six with a shared expert
    /// beside attention, SwiGLU experts. One step gives the CPU's gradients; then steps
    /// with clipping follow the CPU trainer's curve and move every expert bias as the CPU
    /// trainer moves it (the same tokens counted for the same experts), to the byte.
    #[test]
    fn moe_blocks_give_the_cpu_gradients_and_move_the_biases_as_the_cpu_does() {
        let cases = [
            (
                "E-E",
                "relu2",
                json!({"experts": 4, "top_k": 1, "expert_ffn": 16, "scaling": 1.0}),
            ),
            (
                "*E",
                "swiglu",
                json!({"experts": 6, "top_k": 3, "expert_ffn": 8, "shared_ffn": 12,
                       "scaling": 2.5, "bias_update_rate": 1e-2}),
            ),
        ];
        for (pattern, activation, moe) in cases {
            let cfg: ModelConfig = serde_json::from_value(json!({
                "pattern": pattern, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8,
                "ffn": 48, "activation": activation, "moe": moe
            }))
            .unwrap();
            let fresh = || {
                Trainer::new(
                    Model::new(&cfg, 32, 7).unwrap(),
                    trainer(activation, false, 0.5).schedule,
                )
            };
            let biases = |t: &Trainer| -> Vec<Vec<f32>> {
                t.model.moe_layers().map(|(_, m)| m.bias()).collect()
            };

            let shim = Shim::default();
            let gap = check::step_gap(&shim, &mut fresh(), || LongPacked).unwrap();
            assert!(gap.passes(), "`{pattern}`: {gap:?}");

            let (mut cpu, mut on_shim) = (fresh(), fresh());
            let mut source = Counting(2);
            let mut objective = NextToken::new(&mut source);
            let mut step = DeviceStep::upload(&shim, &on_shim).unwrap();
            for _ in 0..4 {
                let (cpu_loss, _) = cpu.step(&mut objective).unwrap();
                let (loss, _) = step.step(&mut on_shim, &mut Counting(2)).unwrap();
                assert!(
                    (loss - cpu_loss).abs() < 1e-4 * cpu_loss,
                    "{loss} vs {cpu_loss}"
                );
                assert_eq!(biases(&on_shim), biases(&cpu), "`{pattern}`");
            }
            assert!(
                biases(&cpu).iter().flatten().any(|b| *b != 0.0),
                "`{pattern}`: no bias moved"
            );
        }
    }

    /// MTP depths, each in a way of its own: one depth of its own blocks after a hybrid main
    /// stack; two depths sharing one set of weights (`mtp_shared`) with a tied head, so the
    /// embedding's gradient comes from the input, both joins and three heads; two depths of
    /// MoE blocks with weights of their own. All on rows packed as two sequences, whose
    /// shifted labels must not cross from one into the other. One step gives the CPU's
    /// gradients; 4 steps with clipping follow the CPU trainer's curve and end with its expert
    /// biases, to the byte.
    #[test]
    fn mtp_depths_give_the_cpu_gradients_and_follow_its_curve() {
        let cases = [
            ("M*-/*-", false, json!({})),
            (
                "*-/M-/M-",
                true,
                json!({"mtp_shared": true, "mtp_loss_scale": 0.3}),
            ),
            (
                "-E/E/E",
                false,
                json!({"moe": {"experts": 4, "top_k": 2, "expert_ffn": 8, "shared_ffn": 8,
                               "bias_update_rate": 1e-2}}),
            ),
        ];
        for (pattern, tied, extra) in cases {
            let mut cfg = json!({
                "pattern": pattern, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8,
                "ffn": 48, "max_seq": 128, "tie_embeddings": tied,
                "mamba": {"heads": 4, "head_dim": 16, "state": 8, "chunk": 8}
            });
            for (key, value) in extra.as_object().unwrap() {
                cfg[key] = value.clone();
            }
            let cfg: ModelConfig = serde_json::from_value(cfg).unwrap();
            let fresh = || {
                Trainer::new(
                    Model::new(&cfg, 32, 3).unwrap(),
                    trainer("swiglu", false, 0.5).schedule,
                )
            };
            let shim = Shim::default();
            let gap = check::step_gap(&shim, &mut fresh(), || Counting(2)).unwrap();
            assert!(gap.passes(), "`{pattern}`: {gap:?}");

            let (mut cpu, mut on_shim) = (fresh(), fresh());
            let (mut cpu_source, mut shim_source) = (Counting(2), Counting(2));
            let worst = check::curve_gap(
                &shim,
                (&mut cpu, &mut NextToken::new(&mut cpu_source)),
                (&mut on_shim, &mut NextToken::new(&mut shim_source)),
                4,
                Precision::F32,
            )
            .unwrap();
            assert!(worst <= check::CURVE_TOLERANCE, "`{pattern}`: {worst}");
            let biases = |t: &Trainer| -> Vec<Vec<f32>> {
                t.model.moe_layers().map(|(_, m)| m.bias()).collect()
            };
            assert_eq!(biases(&on_shim), biases(&cpu), "`{pattern}`");
        }
    }

    /// DPO and GRPO on the device: the policy's and the reference's log-probabilities from
    /// the device, the objective's derivative from the host, back through a hybrid with an
    /// MTP depth neither objective trains; step-1 gradients and four steps' losses, norms and
    /// figures (accuracy, margins, rewards, KL) held to the CPU trainer's.
    #[test]
    fn dpo_and_grpo_give_the_cpu_gradients_and_follow_its_curve() {
        for name in check::OBJECTIVES {
            let (gap, worst) = check::objective(&Shim::default(), name).unwrap();
            eprintln!(
                "{name}: {gap:?} ({:.2e}), curve {worst:.2e}",
                gap.relative()
            );
            assert!(gap.passes(), "{name}: {gap:?}");
            assert!(worst <= check::CURVE_TOLERANCE, "{name}: {worst}");
        }
    }

    #[test]
    fn a_model_the_gpu_trainer_cannot_train_yet_is_named() {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "*-", "hidden": 32, "heads": 2, "kv_heads": 1, "head_dim": 256,
            "ffn": 48
        }))
        .unwrap();
        let t = Trainer::new(
            Model::new(&cfg, 32, 1).unwrap(),
            trainer("relu2", false, 1.0).schedule,
        );
        let err = DeviceStep::upload(&Shim::default(), &t)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("attention heads of 256 dimensions") && err.contains("device: cpu"),
            "{err}"
        );
    }
}
