//! A model's size from its config alone, without building it: its parameters, the weights a
//! token passes through, and the work and memory of training it on a micro-batch.
//!
//! The counts follow [`crate::net::Model::new`] block by block (a test holds them to the built
//! model's). The memory of the forward pass counts what candle's autograd keeps alive until the
//! backward: every intermediate tensor of the forward, per block kind, as the code in
//! [`crate::layers`], [`crate::mamba2`] and [`crate::moe`] computes it.

use crate::config::{Activation, BlockKind, ModelConfig, Pattern};

/// The parameters of a model, and those one token's forward multiplies by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parameters {
    /// Every trained value.
    pub total: u64,
    /// Weights of the matrix products one token's forward goes through: the output head, the
    /// top-k routed and the shared experts of an MoE block (not the others), and each MTP
    /// depth's blocks once per depth even when the depths share them.
    pub matmul_per_token: u64,
    /// Attention blocks a token goes through (main stack and MTP depths).
    pub attention_layers: u64,
    /// Mamba blocks a token goes through.
    pub mamba_layers: u64,
}

impl ModelConfig {
    /// The model's parameters for a vocabulary of `vocab` tokens. The config must validate.
    pub fn parameters(&self, pattern: &Pattern, vocab: usize) -> Parameters {
        let (v, d) = (vocab as u64, self.hidden as u64);
        let mut p = Parameters {
            total: v * d + d, // embedding, final norm
            matmul_per_token: v * d,
            attention_layers: 0,
            mamba_layers: 0,
        };
        if !self.tie_embeddings {
            p.total += v * d;
        }
        for kind in &pattern.main {
            self.add_block(*kind, &mut p, true);
        }
        let weighted_depths = if self.mtp_shared {
            pattern.mtp.len().min(1)
        } else {
            pattern.mtp.len()
        };
        for (depth, blocks) in pattern.mtp.iter().enumerate() {
            let owns_weights = depth < weighted_depths;
            if owns_weights {
                p.total += 3 * d + 2 * d * d; // enorm, hnorm, final norm, eh_proj
            }
            p.matmul_per_token += 2 * d * d + v * d; // eh_proj and the depth's head
            for kind in blocks {
                self.add_block(*kind, &mut p, owns_weights);
            }
        }
        p
    }

    /// Adds one block's weights (`owns_weights`: not a repeat of a shared MTP depth) and the
    /// weights a token multiplies by in it.
    fn add_block(&self, kind: BlockKind, p: &mut Parameters, owns_weights: bool) {
        let d = self.hidden as u64;
        let (total, per_token) = match kind {
            BlockKind::Attention => {
                p.attention_layers += 1;
                let (h, k, hd) = (
                    self.heads as u64,
                    self.kv_heads() as u64,
                    self.head_dim as u64,
                );
                let w = (h + 2 * k) * hd * d + d * h * hd;
                (w, w)
            }
            BlockKind::Mlp => {
                let w = self.mlp_weights(self.ffn as u64);
                (w, w)
            }
            BlockKind::Mamba => {
                p.mamba_layers += 1;
                let Some(m) = &self.mamba else { return };
                let (h, di, gn) = (
                    m.heads as u64,
                    (m.heads * m.head_dim) as u64,
                    (m.groups * m.state) as u64,
                );
                let channels = di + 2 * gn;
                let projections = (2 * di + 2 * gn + h) * d + d * di;
                let small = channels * m.conv as u64 + channels + 3 * h + di;
                (projections + small, projections)
            }
            BlockKind::Moe => {
                let Some(m) = &self.moe else { return };
                let router = m.experts as u64 * d;
                let expert = self.mlp_weights(m.expert_ffn as u64);
                let shared = if m.shared_ffn > 0 {
                    self.mlp_weights(m.shared_ffn as u64)
                } else {
                    0
                };
                (
                    router + m.experts as u64 * expert + shared,
                    router + m.top_k as u64 * expert + shared,
                )
            }
        };
        if owns_weights {
            p.total += d + total; // the block's norm
        }
        p.matmul_per_token += per_token;
    }

    /// fc1 and fc2 of an MLP `ffn` wide.
    fn mlp_weights(&self, ffn: u64) -> u64 {
        let rows = match self.activation {
            Activation::Swiglu => 2 * ffn,
            Activation::Relu2 => ffn,
        };
        (rows + ffn) * self.hidden as u64
    }
}

/// Values the training forward keeps per token until the backward, and the vocabulary-wide
/// ones (the logits and the cross-entropy's softmax of every head), counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ActivationsPerToken {
    /// Hidden-state-sized and block-internal tensors, summed over every block.
    pub blocks: u64,
    /// `vocab`-wide tensors of the main head and each MTP depth's head.
    pub logits: u64,
}

impl ModelConfig {
    /// What candle's autograd holds per token of a training forward, block by block: each
    /// block's norm and residual sum, and the intermediate tensors its mixer computes.
    pub fn activations_per_token(&self, pattern: &Pattern, vocab: usize) -> ActivationsPerToken {
        let d = self.hidden as u64;
        let heads = 1 + pattern.mtp.len() as u64;
        let mut blocks = d; // the embedding's rows
        for kind in pattern.main.iter().chain(pattern.mtp.iter().flatten()) {
            blocks += 2 * d + self.mixer_activations(*kind);
        }
        // Each MTP depth: two norms, their concatenation, eh_proj, the final norm.
        blocks += pattern.mtp.len() as u64 * 6 * d;
        ActivationsPerToken {
            blocks,
            // The logits, their softmax in the cross-entropy, and its gradient.
            logits: heads * 3 * vocab as u64,
        }
    }

    fn mixer_activations(&self, kind: BlockKind) -> u64 {
        let d = self.hidden as u64;
        match kind {
            BlockKind::Attention => {
                let (h, k, hd) = (
                    self.heads as u64,
                    self.kv_heads() as u64,
                    self.head_dim as u64,
                );
                // qkv, the rotated q and k, the attention output, the projection.
                (h + 2 * k) * hd + (h + k) * hd + h * hd + d
            }
            BlockKind::Mlp => self.mlp_activations(self.ffn as u64),
            BlockKind::Mamba => {
                let Some(m) = &self.mamba else { return 0 };
                let (h, di, gn) = (
                    m.heads as u64,
                    (m.heads * m.head_dim) as u64,
                    (m.groups * m.state) as u64,
                );
                let (p, n, chunk) = (m.head_dim as u64, m.state as u64, m.chunk.max(1) as u64);
                // in_proj, the conv + SiLU, dt and its decay, the scan's output and its
                // per-chunk states, the gated norm, out_proj.
                (2 * di + 2 * gn + h) + (di + 2 * gn) + 2 * h + di + h * p * n / chunk + 2 * di + d
            }
            BlockKind::Moe => {
                let Some(m) = &self.moe else { return 0 };
                let (e, k) = (m.experts as u64, m.top_k as u64);
                let shared = if m.shared_ffn > 0 {
                    self.mlp_activations(m.shared_ffn as u64)
                } else {
                    0
                };
                // Router logits, scores and selection; each chosen expert's gathered input,
                // MLP and gated output; the output summed expert by expert, which autograd
                // keeps once per expert.
                3 * e + shared + k * (2 * d + self.mlp_activations(m.expert_ffn as u64)) + e * d
            }
        }
    }

    /// fc1's output, the activation and fc2's output.
    fn mlp_activations(&self, ffn: u64) -> u64 {
        let rows = match self.activation {
            Activation::Swiglu => 2 * ffn,
            Activation::Relu2 => ffn,
        };
        rows + ffn + self.hidden as u64
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ModelConfig;
    use crate::net::Model;

    fn config(json: serde_json::Value) -> ModelConfig {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn the_count_from_the_config_is_the_built_models() {
        let mamba = serde_json::json!({"heads": 4, "head_dim": 8, "groups": 2, "state": 8, "conv": 4, "chunk": 8});
        let moe = serde_json::json!({"experts": 6, "top_k": 2, "expert_ffn": 12, "shared_ffn": 20});
        for cfg in [
            config(
                serde_json::json!({"pattern": "*-*-", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 48}),
            ),
            config(
                serde_json::json!({"pattern": "*-", "hidden": 32, "heads": 2, "head_dim": 16, "ffn": 40, "activation": "relu2", "tie_embeddings": true}),
            ),
            config(
                serde_json::json!({"pattern": "MEM*E/*E/*E", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "activation": "relu2", "position": "none", "mamba": mamba, "moe": moe, "mtp_shared": true}),
            ),
            config(
                serde_json::json!({"pattern": "M*E/ME/ME", "hidden": 16, "heads": 2, "head_dim": 8, "mamba": mamba, "moe": moe}),
            ),
        ] {
            let pattern = cfg.validate().unwrap();
            let built = Model::new(&cfg, 50, 1).unwrap();
            assert_eq!(
                cfg.parameters(&pattern, 50).total,
                built.params.count() as u64,
                "{}",
                cfg.pattern
            );
        }
    }

    #[test]
    fn a_token_goes_through_top_k_experts_and_every_mtp_depth() {
        let moe = serde_json::json!({"experts": 8, "top_k": 2, "expert_ffn": 10});
        let cfg = config(
            serde_json::json!({"pattern": "E/E/E", "hidden": 4, "activation": "relu2", "moe": moe, "mtp_shared": true, "tie_embeddings": true}),
        );
        let p = cfg.parameters(&cfg.validate().unwrap(), 100);
        let (router, expert) = (8 * 4, (10 + 10) * 4);
        // One main MoE block and two MTP depths sharing one set of weights.
        assert_eq!(
            p.total,
            100 * 4 + 4 + (4 + router + 8 * expert) + (3 * 4 + 2 * 16 + 4 + router + 8 * expert)
        );
        let block = router + 2 * expert;
        assert_eq!(p.matmul_per_token, 400 + block + 2 * (32 + 400 + block));
    }
}
