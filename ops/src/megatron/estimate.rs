//! What a `megatron_pretrain` or `megatron_sft` stage will need per GPU, and the work of a step,
//! before it is submitted: Megatron-LM's own rules applied to the model a Megatron-Bridge
//! recipe builds.
//!
//! **The model.** A recipe names a function in Megatron-Bridge, not a model; nemo-dag knows the
//! models of the recipes its manifests use ([`recipe`]: Nemotron 3 Nano and Super, as
//! Megatron-Bridge v0.6's `recipes/nemotronh/h100/nemotron_3_{nano,super}.py` build them and
//! Megatron-LM's Nemotron 3 Super configs describe it). A stage of any other recipe, or one
//! whose `overrides` change a `model.` key, is not estimated.
//!
//! **Weights and optimizer per GPU** (Megatron-LM's `megatron/training/theoretical_memory_usage.py`,
//! `compute_weight_and_optimizer_memory`, counted per layer of the hybrid pattern, which that
//! function does not do), on the busier of the first and the last pipeline stage: each holds
//! `1/PP` of the layers; the first also the embedding, the last the output layer, the final
//! norm and the MTP depths (where Megatron-Core builds them).
//! Attention, Mamba, dense MLP and shared-expert weights are split over TP; norms, routers and
//! LatentMoE's projections are replicated; routed experts are split over `EP·ETP`. Each
//! parameter costs `2` bytes (bf16 weights) plus its gradient buffer (`4` bytes when gradients
//! are reduced in fp32, else `2`) plus the optimizer's main copy and two moments, divided over
//! the data-parallel ranks with the distributed optimizer: `DP·CP` (Megatron-Core's
//! data-and-context-parallel group; Megatron-LM's formula divides by `DP` only) with
//! `DP = world/(TP·PP·CP)` for dense weights, `EDP = world/(ETP·EP·PP)` for routed experts.
//! With fp32 gradients and optimizer this is Megatron-LM's `6 + 12/DP`; the recipes' own dtypes
//! are used ([`Precision`]).
//!
//! **Activations per GPU** (our own model: Megatron-LM has no activation formula for Mamba or
//! MoE layers, and refuses to estimate hybrid models): the bf16 tensors each layer keeps for
//! its backward, per micro-batch of `micro_batch × seq_length / CP` tokens, divided over TP
//! (the layer input only with sequence parallelism), less what the recipe recomputes; a rank's
//! routed experts see `top_k` copies of each of its tokens (bounded by the capacity factor).
//! The first pipeline stage keeps `min(PP, micro-batches)` micro-batches in flight (1F1B), the
//! last one, with every head's fp32 logits. These figures are the uncertain part: a stage is refused only when its
//! weights and optimizer alone exceed the GPU ([`nemo_dag_op::Estimate::least_bytes`]).
//!
//! **FLOPs per step**: Megatron-LM's `num_floating_point_operations` for hybrid models
//! (`megatron/training/training.py`), over the global batch, forward and backward, with one
//! difference: the Mamba terms use the model's own inner width (`heads·head_dim`) where
//! Megatron-LM assumes `2·hidden` (equal for Super; Nano's is 4096, not 5376).

use nemo_dag_op::Estimate;

/// A hybrid model as Megatron builds it (`hybrid_layer_pattern`: `M` Mamba-2, `*` attention,
/// `-` MLP, `E` MoE, one layer each, every layer with its own pre-norm).
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub pattern: &'static str,
    /// One MTP depth's layers (empty: none), repeated `mtp_depths` times; with `mtp_shared`
    /// every depth runs the same weights (`mtp_use_repeated_layer`).
    pub mtp: &'static str,
    pub mtp_depths: u64,
    pub mtp_shared: bool,
    pub hidden: u64,
    pub heads: u64,
    pub kv_groups: u64,
    pub kv_channels: u64,
    /// Dense MLP layers' FFN width.
    pub ffn: u64,
    /// SwiGLU (two input projections) rather than a plain activation.
    pub gated: bool,
    pub moe: Option<MoeShape>,
    pub mamba: Option<MambaShape>,
    /// The padded vocabulary.
    pub vocab: u64,
    pub untied: bool,
}

#[derive(Debug, Clone, Copy)]
pub struct MoeShape {
    pub experts: u64,
    pub top_k: u64,
    pub ffn: u64,
    pub shared_ffn: u64,
    /// LatentMoE: the experts run in this width, between a down and an up projection.
    pub latent: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
pub struct MambaShape {
    pub heads: u64,
    pub head_dim: u64,
    pub groups: u64,
    pub state: u64,
    pub conv: u64,
}

/// Bytes per parameter beside its bf16 weight: the gradient buffer's, and the optimizer's main
/// copy and moments (each sharded over the data-parallel ranks with the distributed optimizer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Precision {
    pub grad: u64,
    pub main: u64,
    pub moments: u64,
    pub distributed: bool,
}

impl Precision {
    /// Megatron-LM's rule: bf16 weights, fp32 gradients, fp32 main weights and moments.
    pub const MEGATRON: Precision = Precision {
        grad: 4,
        main: 4,
        moments: 8,
        distributed: true,
    };

    /// Bytes per parameter with `dp` data-parallel ranks sharing the optimizer.
    fn per_parameter(&self, dp: u64) -> f64 {
        let shared = (self.main + self.moments) as f64;
        let dp = if self.distributed { dp.max(1) } else { 1 };
        2.0 + self.grad as f64 + shared / dp as f64
    }
}

/// How a recipe trains unless the stage says otherwise.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub tp: u64,
    pub pp: u64,
    pub ep: u64,
    pub etp: u64,
    pub cp: u64,
    pub sp: bool,
    pub precision: Precision,
    /// `recompute_modules` under selective recompute (`layernorm`, `moe`, `moe_act`,
    /// `core_attn`), or [`FULL_RECOMPUTE`].
    pub recompute: &'static [&'static str],
    /// `moe_expert_capacity_factor`: routed tokens per expert at most this times the mean.
    pub capacity: Option<f64>,
}

/// `recompute_granularity: full`, one layer at a time (`recompute_method: uniform`,
/// `recompute_num_layers: 1`, as NeMo-RL's `activation_checkpointing` sets it): each layer
/// keeps only its input for the backward, and recomputes the rest of one layer at a time.
pub const FULL_RECOMPUTE: &[&str] = &["full"];

/// A recipe nemo-dag can estimate: its model and its defaults.
#[derive(Debug, Clone, Copy)]
pub struct Recipe {
    pub shape: Shape,
    pub defaults: Defaults,
}

/// Nemotron 3 Nano (30B-A3B) as Megatron-Bridge v0.6's
/// `nemotron_3_nano_pretrain_8gpu_h100_bf16_config` builds it.
const NANO: Shape = Shape {
    pattern: "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    mtp: "",
    mtp_depths: 0,
    mtp_shared: false,
    hidden: 2688,
    heads: 32,
    kv_groups: 2,
    kv_channels: 128,
    ffn: 1856,
    gated: false,
    moe: Some(MoeShape {
        experts: 128,
        top_k: 6,
        ffn: 1856,
        shared_ffn: 3712,
        latent: None,
    }),
    mamba: Some(MambaShape {
        heads: 64,
        head_dim: 64,
        groups: 8,
        state: 128,
        conv: 4,
    }),
    vocab: 131072,
    untied: true,
};

/// Nemotron 3 Super (120B-A12B, LatentMoE, two MTP depths sharing one `*E`), as Megatron-LM's
/// `tests/functional_tests/test_cases/nemotron/nemotron3_super_release_gb200/model_config.yaml`
/// and `examples/post_training/modelopt/conf/nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16.sh`
/// describe it (Megatron-Bridge reads it from the Hugging Face config).
const SUPER: Shape = Shape {
    pattern: "MEMEMEM*EMEMEMEM*EMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEMEM*EMEMEMEM*EMEMEMEME",
    mtp: "*E",
    mtp_depths: 2,
    mtp_shared: true,
    hidden: 4096,
    heads: 32,
    kv_groups: 2,
    kv_channels: 128,
    ffn: 2688,
    gated: false,
    moe: Some(MoeShape {
        experts: 512,
        top_k: 22,
        ffn: 2688,
        shared_ffn: 5376,
        latent: Some(1024),
    }),
    mamba: Some(MambaShape {
        heads: 128,
        head_dim: 64,
        groups: 8,
        state: 128,
        conv: 4,
    }),
    vocab: 131072,
    untied: true,
};

/// The recipes of Megatron-Bridge v0.6 (`recipes/nemotronh/`) nemo-dag can estimate, with the
/// parallelism and dtypes each sets.
pub fn recipe(name: &str) -> Option<Recipe> {
    let fp32 = |grad| Precision {
        grad,
        ..Precision::MEGATRON
    };
    // The precision-aware optimizer: fp16 main weights, bf16 moments, bf16 gradients.
    let compact = Precision {
        grad: 2,
        main: 2,
        moments: 4,
        distributed: true,
    };
    let defaults = |tp, pp, ep, sp, precision, recompute, capacity| Defaults {
        tp,
        pp,
        ep,
        etp: 1,
        cp: 1,
        sp,
        precision,
        recompute,
        capacity,
    };
    let (shape, defaults) = match name {
        "nemotron_3_nano_pretrain_config" | "nemotron_3_nano_pretrain_8gpu_h100_bf16_config" => (
            NANO,
            defaults(1, 1, 8, false, fp32(2), &["moe", "layernorm"][..], None),
        ),
        "nemotron_3_nano_sft_config" | "nemotron_3_nano_sft_8gpu_h100_bf16_config" => {
            (NANO, defaults(1, 1, 8, false, fp32(4), &[][..], None))
        }
        "nemotron_3_super_pretrain_config" => (
            SUPER,
            defaults(
                1,
                2,
                32,
                false,
                compact,
                &["layernorm", "moe_act", "moe", "core_attn"][..],
                Some(1.10),
            ),
        ),
        "nemotron_3_super_sft_config" | "nemotron_3_super_sft_16gpu_h100_bf16_config" => {
            (SUPER, defaults(8, 1, 16, true, compact, &[][..], None))
        }
        _ => return None,
    };
    Some(Recipe { shape, defaults })
}

/// Parameters of one layer (or a model), as the ranks split them.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Split {
    /// Divided over tensor-parallel ranks.
    pub tp: u64,
    /// On every rank.
    pub replicated: u64,
    /// Routed experts, divided over `EP·ETP`.
    pub experts: u64,
    /// Of `experts`, what one token runs through (its top-k).
    pub active_experts: u64,
}

impl std::ops::Add for Split {
    type Output = Split;
    fn add(self, o: Split) -> Split {
        Split {
            tp: self.tp + o.tp,
            replicated: self.replicated + o.replicated,
            experts: self.experts + o.experts,
            active_experts: self.active_experts + o.active_experts,
        }
    }
}

impl std::ops::Mul<u64> for Split {
    type Output = Split;
    fn mul(self, n: u64) -> Split {
        Split {
            tp: self.tp * n,
            replicated: self.replicated * n,
            experts: self.experts * n,
            active_experts: self.active_experts * n,
        }
    }
}

impl Split {
    pub fn total(&self) -> u64 {
        self.tp + self.replicated + self.experts
    }

    /// What one token runs through: everything but the routed experts it is not sent to.
    pub fn active(&self) -> u64 {
        self.tp + self.replicated + self.active_experts
    }
}

impl Shape {
    fn mamba_inner(&self) -> u64 {
        self.mamba.map_or(0, |m| m.heads * m.head_dim)
    }

    /// The parameters of one layer of kind `symbol`, with its pre-norm.
    pub fn layer(&self, symbol: char) -> Split {
        let h = self.hidden;
        let norm = Split {
            replicated: h,
            ..Split::default()
        };
        let mlp = |ffn: u64| (if self.gated { 3 } else { 2 }) * h * ffn;
        norm + match symbol {
            '*' => Split {
                tp: h * (self.heads + 2 * self.kv_groups) * self.kv_channels
                    + self.heads * self.kv_channels * h,
                ..Split::default()
            },
            '-' => Split {
                tp: mlp(self.ffn),
                ..Split::default()
            },
            'M' => {
                let Some(m) = self.mamba else {
                    return norm;
                };
                let inner = m.heads * m.head_dim;
                let bc = 2 * m.groups * m.state;
                Split {
                    // in_proj (z, x, B, C, dt), the causal conv and its bias, dt_bias, A_log,
                    // D, the gated norm, out_proj.
                    tp: h * (2 * inner + bc + m.heads)
                        + (inner + bc) * (m.conv + 1)
                        + 3 * m.heads
                        + inner
                        + inner * h,
                    ..Split::default()
                }
            }
            'E' => {
                let Some(e) = self.moe else {
                    return norm;
                };
                let width = e.latent.unwrap_or(h);
                let expert = (if self.gated { 3 } else { 2 }) * width * e.ffn;
                Split {
                    tp: mlp(e.shared_ffn),
                    replicated: h * e.experts + e.latent.map_or(0, |l| 2 * h * l),
                    experts: e.experts * expert,
                    active_experts: e.top_k * expert,
                }
            }
            _ => Split::default(),
        }
    }

    fn layers(&self, pattern: &str) -> Split {
        pattern
            .chars()
            .map(|c| self.layer(c))
            .fold(Split::default(), |a, b| a + b)
    }

    /// The main stack's layers.
    pub fn decoder(&self) -> Split {
        self.layers(self.pattern)
    }

    /// The embedding, the output layer when untied, and the final norm.
    pub fn ends(&self) -> Split {
        Split {
            tp: self.vocab * self.hidden * if self.untied { 2 } else { 1 },
            replicated: self.hidden,
            ..Split::default()
        }
    }

    /// The MTP depths' weights: each depth's `eh_proj`, its two input norms and final norm,
    /// and its layers; once when the depths share them.
    pub fn mtp(&self) -> Split {
        if self.mtp_depths == 0 {
            return Split::default();
        }
        let h = self.hidden;
        let depth = Split {
            tp: 2 * h * h,
            replicated: 3 * h,
            ..Split::default()
        } + self.layers(self.mtp);
        depth * if self.mtp_shared { 1 } else { self.mtp_depths }
    }

    /// Every parameter: the decoder, its ends and the MTP depths.
    pub fn parameters(&self) -> Split {
        self.decoder() + self.ends() + self.mtp()
    }

    fn count(&self, symbol: char) -> u64 {
        let main = self.pattern.chars().filter(|c| *c == symbol).count() as u64;
        let mtp = self.mtp.chars().filter(|c| *c == symbol).count() as u64;
        main + mtp * self.mtp_depths
    }

    /// Megatron-LM's `num_floating_point_operations` for a hybrid model, for `tokens` tokens
    /// in rows of `seq` (its `seqlen_squared_sum` is `tokens · seq`), forward and backward;
    /// the Mamba terms with the model's own inner width.
    pub fn flops(&self, tokens: f64, seq: f64) -> f64 {
        let h = self.hidden as f64;
        let (n, g) = (self.heads as f64, self.kv_groups as f64);
        let p = self.kv_channels as f64 * n / h;
        let attention = 4.0 * tokens * h * p * (h + h * g / n) + 2.0 * tokens * seq * h * p;
        let mamba = self.mamba.map_or(0.0, |m| {
            let inner = self.mamba_inner() as f64;
            let (groups, state, heads) = (m.groups as f64, m.state as f64, m.heads as f64);
            2.0 * tokens * h * (2.0 * inner + 2.0 * groups * state + heads)
                + 7.0 * tokens * inner * state
                + 2.0 * tokens * inner * h
        });
        let gate = if self.gated { 1.5 } else { 1.0 };
        let mlp = 4.0 * self.ffn as f64 * gate * tokens * h;
        let moe = self.moe.map_or(0.0, |e| {
            let (k, ffn) = (e.top_k as f64, e.ffn as f64);
            let routed = match e.latent {
                None => 4.0 * tokens * h * ffn * k * gate,
                Some(l) => {
                    let l = l as f64;
                    4.0 * tokens * l * ffn * k * gate + 4.0 * tokens * h * l
                }
            };
            routed + 4.0 * tokens * h * e.shared_ffn as f64 * gate
        });
        let logits = 2.0 * tokens * h * self.vocab as f64 * (1 + self.mtp_depths) as f64;
        let count = |c| self.count(c) as f64;
        3.0 * (count('*') * attention
            + count('M') * mamba
            + count('-') * mlp
            + count('E') * moe
            + logits)
    }
}

/// A stage's shape of run: its parallelism (the recipe's where the stage gives none), its ranks
/// and its batch.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub world: u64,
    pub tp: u64,
    pub pp: u64,
    pub ep: u64,
    pub etp: u64,
    pub cp: u64,
    pub sp: bool,
    pub seq: u64,
    pub micro_batch: u64,
    pub global_batch: u64,
    pub steps: u64,
}

impl Run {
    /// A run of `world` ranks with `defaults`' parallelism, micro-batches of `micro_batch` ×
    /// `seq` tokens and `global_batch` sequences a step.
    pub fn of(
        defaults: &Defaults,
        world: u64,
        seq: u64,
        (micro_batch, global_batch): (u64, u64),
        steps: u64,
    ) -> Run {
        let d = defaults;
        Run {
            world,
            tp: d.tp,
            pp: d.pp,
            ep: d.ep,
            etp: d.etp,
            cp: d.cp,
            sp: d.sp,
            seq,
            micro_batch,
            global_batch,
            steps,
        }
    }

    /// Data-parallel ranks of the dense weights and of the routed experts.
    fn data_parallel(&self) -> (u64, u64) {
        let dense = self.world / (self.tp * self.pp * self.cp).max(1);
        let experts = self.world / (self.etp * self.ep * self.pp).max(1);
        (dense.max(1), experts.max(1))
    }

    /// Micro-batches each data-parallel rank runs per step.
    fn micro_batches(&self) -> u64 {
        let (dp, _) = self.data_parallel();
        (self.global_batch / (self.micro_batch * dp).max(1)).max(1)
    }
}

/// A pipeline stage's GPU: its weights and optimizer (dense, and routed experts) and what it
/// keeps for the backward (its layers' activations, and the logits on the last stage).
struct StageMemory {
    dense: u64,
    experts: u64,
    activations: u64,
    logits: u64,
}

impl StageMemory {
    fn certain(&self) -> u64 {
        self.dense + self.experts
    }

    fn peak(&self) -> u64 {
        self.certain() + self.activations + self.logits
    }
}

/// The GPU of pipeline stage `first` or last (or both, with one stage): `1/PP` of the decoder;
/// the first stage also holds the embedding, and keeps `min(PP, micro-batches)` micro-batches
/// in flight (1F1B); the last holds the output layer (a copy of the embedding when tied), the
/// final norm, the MTP depths (Megatron-Core builds them on the last stage) and the fp32
/// logits of every head, and keeps one micro-batch in flight.
fn stage(recipe: &Recipe, run: &Run, first: bool, last: bool) -> StageMemory {
    let (shape, d) = (&recipe.shape, &recipe.defaults);
    let (dp, edp) = run.data_parallel();
    let (decoder, mtp) = (shape.decoder(), shape.mtp());
    let table = shape.vocab * shape.hidden;
    let mut tp = decoder.tp / run.pp;
    let mut replicated = decoder.replicated / run.pp;
    let mut experts = decoder.experts / run.pp;
    if first {
        tp += table;
    }
    if last {
        if !first || shape.untied {
            tp += table;
        }
        tp += mtp.tp;
        replicated += shape.hidden + mtp.replicated;
        experts += mtp.experts;
    }
    let dense = (tp / run.tp.max(1) + replicated) as f64 * d.precision.per_parameter(dp * run.cp);
    let experts = (experts / (run.ep * run.etp).max(1)) as f64 * d.precision.per_parameter(edp);
    let in_flight = if first {
        run.pp.min(run.micro_batches())
    } else {
        1
    };
    let activations = if d.recompute == FULL_RECOMPUTE {
        // Every layer's input, for each micro-batch in flight (the MTP depths' too, on the
        // last stage), and one layer's activations while it is recomputed.
        let mtp = if last {
            shape.mtp.len() * shape.mtp_depths as usize
        } else {
            0
        };
        let inputs = layer_inputs(run, shape, shape.pattern.len()) / run.pp as f64
            + layer_inputs(run, shape, mtp);
        let widest = [shape.pattern, if last { shape.mtp } else { "" }]
            .iter()
            .flat_map(|p| p.chars())
            .map(|c| layer_activations(recipe, run, &c.to_string()))
            .fold(0.0, f64::max);
        inputs * in_flight as f64 + widest
    } else {
        let layers = layer_activations(recipe, run, shape.pattern) / run.pp as f64
            + if last {
                layer_activations(recipe, run, shape.mtp) * shape.mtp_depths as f64
            } else {
                0.0
            };
        layers * in_flight as f64
    };
    let logits = if last {
        4 * run.micro_batch * run.seq / run.cp.max(1) * shape.vocab / run.tp.max(1)
            * (1 + shape.mtp_depths)
    } else {
        0
    };
    StageMemory {
        dense: dense as u64,
        experts: experts as u64,
        activations: activations as u64,
        logits,
    }
}

/// The busiest GPU's memory and the step's work for `run` of `recipe` (see the module docs):
/// the pipeline stage with the larger peak, first or last; what is needed for certain is the
/// larger weights and optimizer of the two.
pub fn estimate(recipe: &Recipe, run: &Run) -> Estimate {
    let (shape, d) = (&recipe.shape, &recipe.defaults);
    let (dp, edp) = run.data_parallel();
    let stages = if run.pp == 1 {
        vec![("", stage(recipe, run, true, true))]
    } else {
        vec![
            ("first", stage(recipe, run, true, false)),
            ("last", stage(recipe, run, false, true)),
        ]
    };
    let certain = stages.iter().map(|(_, s)| s.certain()).max().unwrap_or(0);
    let (which, busiest) = stages
        .into_iter()
        .max_by_key(|(_, s)| s.peak())
        .unwrap_or(("", stage(recipe, run, true, true)));
    let mut memory = vec![
        ("weights and optimizer".to_string(), busiest.dense),
        (
            "routed experts' weights and optimizer".to_string(),
            busiest.experts,
        ),
        ("activations".to_string(), busiest.activations),
        ("logits".to_string(), busiest.logits),
    ];
    memory.retain(|(_, b)| *b > 0);
    let tokens = (run.global_batch * run.seq) as f64;
    let stage_name = if which.is_empty() {
        String::new()
    } else {
        format!(", the {which} pipeline stage's")
    };
    Estimate {
        device: nemo_dag_op::plan::EACH_GPU.to_string(),
        memory,
        flops_per_step: shape.flops(tokens, run.seq as f64),
        steps: run.steps,
        basis: format!(
            "{} GPUs{stage_name}: TP {} PP {} EP {} CP {}{}, data-parallel {dp} (experts {edp}); micro-batch {} × {} tokens, {} per step; {:.1} B parameters ({:.1} B active); weights and optimizer by Megatron-LM's rule ({:.1} bytes a dense parameter), activations our own model ({})",
            run.world,
            run.tp,
            run.pp,
            run.ep,
            run.cp,
            if run.sp { ", sequence parallel" } else { "" },
            run.micro_batch,
            run.seq,
            run.micro_batches(),
            shape.parameters().total() as f64 / 1e9,
            shape.parameters().active() as f64 / 1e9,
            d.precision.per_parameter(dp * run.cp),
            if d.recompute.is_empty() {
                "no recompute".to_string()
            } else if d.recompute == FULL_RECOMPUTE {
                "full recompute, a layer at a time".to_string()
            } else {
                format!("recomputing {}", d.recompute.join(", "))
            },
        ),
        least_bytes: Some(certain),
    }
}

/// The bf16 inputs of `layers` layers on one rank, for one micro-batch: what full recompute
/// keeps of each.
fn layer_inputs(run: &Run, shape: &Shape, layers: usize) -> f64 {
    let tokens = (run.micro_batch * run.seq / run.cp.max(1)) as f64;
    let split = if run.sp { run.tp.max(1) as f64 } else { 1.0 };
    layers as f64 * 2.0 * tokens * shape.hidden as f64 / split
}

/// The bf16 tensors the layers of `pattern` keep for the backward on one rank, for one
/// micro-batch (see the module docs), in bytes; under [`FULL_RECOMPUTE`], what one layer holds
/// while it is recomputed.
fn layer_activations(recipe: &Recipe, run: &Run, pattern: &str) -> f64 {
    let (shape, d) = (&recipe.shape, &recipe.defaults);
    let recomputes = |module: &str| d.recompute.contains(&module);
    let tokens = (run.micro_batch * run.seq / run.cp.max(1)) as f64;
    let tp = run.tp.max(1) as f64;
    let h = shape.hidden as f64;
    // A layer's input, split over TP only with sequence parallelism; its normed input, kept
    // unless the norm is recomputed.
    let input = 2.0 * tokens * h / if run.sp { tp } else { 1.0 };
    let normed = if recomputes("layernorm") { 0.0 } else { input };
    let per_layer = |symbol: char| -> f64 {
        let kept = match symbol {
            '*' => {
                let (n, g, kv) = (
                    shape.heads as f64,
                    shape.kv_groups as f64,
                    shape.kv_channels as f64,
                );
                // q, k, v; the attention's output and its log-sum-exp (fp32).
                normed
                    + (2.0 * tokens * (n + 2.0 * g) * kv + 2.0 * tokens * n * kv) / tp
                    + 4.0 * tokens * n / tp
            }
            '-' => {
                let up = if shape.gated { 2.0 } else { 1.0 };
                normed + 2.0 * tokens * shape.ffn as f64 * (up + 1.0) / tp
            }
            'M' => shape.mamba.map_or(0.0, |m| {
                let inner = shape.mamba_inner() as f64;
                let bc = 2.0 * (m.groups * m.state) as f64;
                let projected = inner * 2.0 + bc + m.heads as f64;
                // in_proj's output, the conv's, the scan's output and the gated norm's (the
                // fused scan keeps its inputs and output and recomputes its chunk states).
                normed + 2.0 * tokens * (projected + inner + bc + 2.0 * inner) / tp
            }),
            'E' => shape.moe.map_or(0.0, |e| {
                if recomputes("moe") {
                    return normed;
                }
                let router = 4.0 * tokens * e.experts as f64;
                let width = e.latent.unwrap_or(shape.hidden) as f64;
                // Each rank's tokens (its share of the sequence under sequence parallelism)
                // go out top-k times and as many come back to its experts.
                let own = tokens / if run.sp { tp } else { 1.0 };
                let routed = own * e.top_k as f64 * d.capacity.unwrap_or(1.0);
                let act = if recomputes("moe_act") { 1.0 } else { 2.0 };
                let up = if shape.gated { 2.0 } else { 1.0 };
                // The dispatched tokens, each expert's up-projection (and activation), the
                // shared expert's.
                normed
                    + router
                    + 2.0 * routed * (width + e.ffn as f64 * (up + act - 1.0))
                    + 2.0 * tokens * e.shared_ffn as f64 * (up + act - 1.0) / tp
            }),
            _ => 0.0,
        };
        input + kept
    };
    pattern.chars().map(per_layer).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(got: f64, want: f64, tolerance: f64) -> bool {
        (got - want).abs() <= tolerance * want.abs()
    }

    /// The shapes reproduce the published sizes (NVIDIA's model cards: Nemotron 3 Nano 31.6 B
    /// parameters, 3.6 B active; Super 120.6 B, 12.7 B active, the MTP depths not counted),
    /// so the table and the per-layer counts are the models Megatron-Bridge builds.
    #[test]
    fn the_shapes_have_the_published_parameter_counts() {
        let nano = NANO.decoder() + NANO.ends();
        assert!(close(nano.total() as f64, 31.6e9, 0.005), "{nano:?}");
        assert!(close(nano.active() as f64, 3.6e9, 0.02), "{nano:?}");
        assert_eq!(NANO.pattern.len(), 52);
        let sup = SUPER.decoder() + SUPER.ends();
        assert!(close(sup.total() as f64, 120.6e9, 0.005), "{sup:?}");
        assert!(close(sup.active() as f64, 12.7e9, 0.02), "{sup:?}");
        assert_eq!(SUPER.pattern.len(), 88);
        assert_eq!(
            ['M', 'E', '*'].map(|c| SUPER.pattern.matches(c).count()),
            [40, 40, 8]
        );
    }

    /// Per-layer counts by hand, Nano: a Mamba-2 layer of 64 heads of 64, 8 groups of state
    /// 128, width 2688.
    #[test]
    fn a_mamba_layer_counts_in_proj_conv_heads_norm_and_out_proj() {
        let m = NANO.layer('M');
        let in_proj = 2688 * (2 * 4096 + 2 * 8 * 128 + 64);
        let conv = (4096 + 2048) * 5;
        let out_proj = 4096 * 2688;
        assert_eq!(m.tp, in_proj + conv + 3 * 64 + 4096 + out_proj);
        assert_eq!(m.replicated, 2688);
        let a = NANO.layer('*');
        assert_eq!(a.tp, 2688 * (32 + 4) * 128 + 32 * 128 * 2688);
        let e = SUPER.layer('E');
        assert_eq!(e.experts, 512 * 2 * 1024 * 2688);
        assert_eq!(e.active_experts, 22 * 2 * 1024 * 2688);
        assert_eq!(e.replicated, 4096 + 4096 * 512 + 2 * 4096 * 1024);
    }

    fn run(recipe: &Recipe, world: u64, seq: u64, global_batch: u64) -> Run {
        Run::of(&recipe.defaults, world, seq, (1, global_batch), 10)
    }

    /// Weights and optimizer per GPU, worked by hand with Megatron-LM's splitting rule: Nano's
    /// SFT on 8 GPUs with EP 8 keeps every dense weight (DP 8) and 16 experts of each layer
    /// (expert DP 1) with fp32 gradients and optimizer: 2.20 B × (6 + 12/8) + 3.67 B × 18 bytes.
    #[test]
    fn weights_and_optimizer_follow_megatrons_rule() {
        let sft = recipe("nemotron_3_nano_sft_config").unwrap();
        let e = estimate(&sft, &run(&sft, 8, 2048, 128));
        let dense = NANO.decoder().tp + NANO.decoder().replicated + NANO.ends().total();
        let experts = NANO.decoder().experts / 8;
        let want = dense as f64 * 7.5 + experts as f64 * 18.0;
        let got = e.least_bytes.unwrap() as f64;
        assert!(close(got, want, 1e-6), "{got} vs {want}");
        let gib = (1u64 << 30) as f64;
        assert!(close(got, 76.9 * gib, 0.01), "{}", got / gib);

        // Super's pretraining: PP 2 halves the decoder, and the last stage, which also holds
        // the output layer, the final norm and the MTP depth, has the larger weights; its
        // precision-aware optimizer is 2 + 2 + 6/DP bytes a parameter.
        let pre = recipe("nemotron_3_super_pretrain_config").unwrap();
        let r = run(&pre, 64, 4096, 1280);
        assert_eq!(r.data_parallel(), (32, 1));
        assert_eq!(r.micro_batches(), 40);
        let e = estimate(&pre, &r);
        let (d, m) = (SUPER.decoder(), SUPER.mtp());
        let dense = d.tp / 2 + SUPER.vocab * 4096 + m.tp + d.replicated / 2 + 4096 + m.replicated;
        let experts = (d.experts / 2 + m.experts) / 32;
        let want = dense as f64 * (4.0 + 6.0 / 32.0) + experts as f64 * (4.0 + 6.0);
        assert!(close(e.least_bytes.unwrap() as f64, want, 1e-6));
        assert!(e.peak_bytes() > e.least_bytes.unwrap(), "{e}");
        // The first stage, with two micro-batches in flight, has the larger peak.
        assert!(e.basis.contains("the first pipeline stage's"), "{e}");
    }

    /// FLOPs per step by Megatron-LM's hybrid formula: Nano at GBS 1024 × 8192 is 174.3 PFLOP
    /// with its own Mamba width (Megatron-LM's 2·hidden would give 186.9), within 2 % of
    /// 6 × the active parameters a matmul reads (not the input embedding, a lookup) × tokens,
    /// plus attention's quadratic part.
    #[test]
    fn flops_follow_megatrons_hybrid_formula() {
        let tokens = 1024.0 * 8192.0;
        let nano = NANO.flops(tokens, 8192.0);
        assert!(close(nano, 174.3e15, 0.002), "{nano:e}");
        let active = (NANO.decoder() + NANO.ends()).active() - NANO.vocab * NANO.hidden;
        let attention = 3.0 * 6.0 * 2.0 * tokens * 8192.0 * 2688.0 * (32.0 * 128.0 / 2688.0);
        let rule = 6.0 * active as f64 * tokens + attention;
        assert!(close(nano, rule, 0.02), "{nano:e} vs {rule:e}");
        // Super with the manifest's shape, MTP depths counted with their own logits.
        let sup = SUPER.flops(tokens, 8192.0);
        assert!(close(sup, 710.7e15, 0.002), "{sup:e}");
    }

    /// More GPUs for the same batch need less memory each; recomputing MoE layers keeps less.
    #[test]
    fn the_estimate_moves_the_way_the_run_does() {
        let pre = recipe("nemotron_3_nano_pretrain_config").unwrap();
        let small = estimate(&pre, &run(&pre, 8, 8192, 1024));
        let large = estimate(&pre, &run(&pre, 32, 8192, 1024));
        assert!(large.least_bytes < small.least_bytes, "{small}\n{large}");
        let sft = recipe("nemotron_3_nano_sft_config").unwrap();
        let kept = layer_activations(&sft, &run(&sft, 8, 8192, 64), NANO.pattern);
        let recomputed = layer_activations(&pre, &run(&pre, 8, 8192, 64), NANO.pattern);
        assert!(recomputed < kept, "{recomputed} vs {kept}");
        assert!(recipe("llama3_8b_pretrain_config").is_none());
    }
}
