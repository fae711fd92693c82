//! What a training or scoring run of the native CPU trainer needs, from the model config and
//! the batch alone: the memory at its peak and the FLOPs of a step.
//!
//! The peak is the backward of a wave of micro-batches ([`crate::Trainer::step`]): the
//! weights, AdamW's two moments and the running gradient sums stay for the whole run; each
//! micro-batch computed at once (one per worker thread, as many as a step has) holds its
//! forward's activations and its own gradients. Activations are counted per token by
//! [`model::size`]; the backward's temporaries about double them (measured: see
//! docs/scale.md, "How the plan is computed").

use model::config::{ModelConfig, Pattern};
use nemo_dag_op::Estimate;

/// f32 everywhere on the CPU.
const F32: u64 = 4;
/// The backward's temporaries, as a multiple of what the forward keeps.
const BACKWARD: u64 = 2;
/// The process besides the model: code, the tokenizer, the data readers, thread pools and the
/// allocator's slack. Fitted to the tiny recipes' measured peaks (a data stage alone peaks at
/// 18–33 MiB; a training stage holds its data and its threads' arenas besides).
const RUNTIME: u64 = 96 << 20;

/// The shape of the work: micro-batches of `rows` rows of up to `len` tokens.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub rows: usize,
    pub len: usize,
    /// Micro-batches in one optimizer step.
    pub micro_batches: usize,
    /// Optimizer steps (0 for a run that only scores or generates).
    pub steps: u64,
}

/// A model known only by its config.
pub struct Sized<'a> {
    pub cfg: &'a ModelConfig,
    pub pattern: Pattern,
    pub vocab: usize,
}

impl<'a> Sized<'a> {
    /// `None` when the config does not validate (the stage's check says why).
    pub fn new(cfg: &'a ModelConfig, vocab: usize) -> Option<Sized<'a>> {
        let pattern = cfg.validate().ok()?;
        Some(Sized {
            cfg,
            pattern,
            vocab,
        })
    }

    fn parameters(&self) -> model::size::Parameters {
        self.cfg.parameters(&self.pattern, self.vocab)
    }

    /// Forward FLOPs per token at context `len`: two per weight a token multiplies by, and
    /// attention's scores and weighted sum over the causal half of the context, and the SSD
    /// scan's state updates and chunk products.
    fn forward_flops_per_token(&self, len: usize) -> f64 {
        let p = self.parameters();
        let mut flops = 2.0 * p.matmul_per_token as f64;
        let cfg = self.cfg;
        flops += p.attention_layers as f64 * 2.0 * (cfg.heads * cfg.head_dim) as f64 * len as f64;
        if let Some(m) = &cfg.mamba {
            let (h, hp, n, c) = (m.heads, m.head_dim, m.state, m.chunk);
            flops += p.mamba_layers as f64
                * (4.0 * (h * hp * n) as f64 + 2.0 * (h * c * (n + hp)) as f64);
        }
        flops
    }

    /// Activation bytes of one micro-batch of `tokens` tokens, forward and backward.
    fn activation_bytes(&self, tokens: u64) -> (u64, u64) {
        let a = self.cfg.activations_per_token(&self.pattern, self.vocab);
        (
            BACKWARD * F32 * a.blocks * tokens,
            BACKWARD * F32 * a.logits * tokens,
        )
    }

    /// Training on rows whose length is known only as a range, `shortest` to `shape.len`:
    /// the estimate at the longest, with the peak at the shortest as its least.
    pub fn training_between(
        &self,
        shortest: usize,
        shape: Shape,
        extra: Vec<(String, u64)>,
        what: &str,
    ) -> Estimate {
        let at_shortest = Shape {
            len: shortest,
            ..shape
        };
        let least = self.training(at_shortest, extra.clone(), what).peak_bytes();
        Estimate {
            least_bytes: Some(least),
            ..self.training(shape, extra, what)
        }
    }

    /// Training with AdamW: `extra` adds parts of the stage's own (a frozen reference model,
    /// rollout caches).
    pub fn training(&self, shape: Shape, extra: Vec<(String, u64)>, what: &str) -> Estimate {
        let params = self.parameters().total;
        let at_once = kernels::workers::threads().min(shape.micro_batches.max(1)) as u64;
        let tokens = (shape.rows * shape.len) as u64;
        let (blocks, logits) = self.activation_bytes(tokens);
        let mut memory = vec![
            ("parameters".to_string(), F32 * params),
            ("optimizer".to_string(), 2 * F32 * params),
            // The step's running sums, and each micro-batch's own.
            ("gradients".to_string(), (1 + at_once) * F32 * params),
            ("activations".to_string(), at_once * blocks),
            ("logits".to_string(), at_once * logits),
        ];
        memory.extend(extra);
        memory.push(("runtime".to_string(), RUNTIME));
        let step_tokens = tokens * shape.micro_batches as u64;
        Estimate {
            device: "cpu".into(),
            memory,
            flops_per_step: 3.0 * self.forward_flops_per_token(shape.len) * step_tokens as f64,
            steps: shape.steps,
            basis: format!(
                "{what}: {} parameters, micro-batch {} × {} tokens, {at_once} at once, {} per step",
                count(params),
                shape.rows,
                shape.len,
                shape.micro_batches
            ),
            least_bytes: None,
        }
    }

    /// Bytes of the decoding caches of `rows` rows of up to `len` tokens: every attention
    /// block's keys and values, every Mamba block's SSM and conv states.
    pub fn cache_bytes(&self, rows: usize, len: usize) -> u64 {
        let p = self.parameters();
        let cfg = self.cfg;
        let kv = p.attention_layers * 2 * (cfg.kv_heads() * cfg.head_dim * len) as u64;
        let ssm = cfg.mamba.as_ref().map_or(0, |m| {
            let channels = m.heads * m.head_dim + 2 * m.groups * m.state;
            p.mamba_layers * (m.heads * m.head_dim * m.state + channels * m.conv) as u64
        });
        F32 * rows as u64 * (kv + ssm)
    }

    /// The weights alone, as a frozen copy (a reference model) holds them.
    pub fn weight_bytes(&self) -> u64 {
        F32 * self.parameters().total
    }
}

/// `7.1M`, `1.2B`.
fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}
