//! The model as a manifest declares it: sizes, and the layer pattern in the Nemotron-H language.
//!
//! ```yaml
//! model:
//!   pattern: "*-*-*-*-"      # 8 blocks: attention, MLP, attention, MLP, ... (a Llama-style model)
//!   hidden: 128
//!   heads: 4
//!   kv_heads: 2              # grouped-query attention: 2 KV heads shared by 4 query heads
//!   head_dim: 32
//!   ffn: 384
//! ```
//!
//! One symbol per block (Megatron `hybrid_layer_allocation.py`): `M` Mamba-2, `*` self-attention,
//! `-` dense MLP, `E` mixture of experts. Every symbol is its own pre-norm residual block.
//! `|` (a pipeline-stage boundary in Megatron) is accepted and ignored; `/` starts a
//! multi-token-prediction pattern, repeated once per MTP depth (`"M*M*/*E/*E"` is the main
//! stack `M*M*` and two MTP depths of `*E`).

use serde::{Deserialize, Serialize};
use std::fmt;

/// One block of the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BlockKind {
    /// `M`: RMSNorm → Mamba-2 mixer → + residual.
    Mamba,
    /// `*`: RMSNorm → causal self-attention → + residual.
    Attention,
    /// `-`: RMSNorm → MLP → + residual.
    Mlp,
    /// `E`: RMSNorm → mixture of experts → + residual.
    Moe,
}

impl BlockKind {
    pub fn symbol(self) -> char {
        match self {
            BlockKind::Mamba => 'M',
            BlockKind::Attention => '*',
            BlockKind::Mlp => '-',
            BlockKind::Moe => 'E',
        }
    }
}

/// A parsed layer pattern: the main stack and the MTP depths.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pattern {
    pub main: Vec<BlockKind>,
    /// One entry per MTP depth; Megatron requires every depth to repeat the same pattern.
    pub mtp: Vec<Vec<BlockKind>>,
}

/// Why a pattern string is not valid; `position` is the 0-based character index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError {
    pub position: usize,
    pub message: String,
}

impl fmt::Display for PatternError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (at character {})", self.message, self.position + 1)
    }
}

impl Pattern {
    pub fn parse(text: &str) -> Result<Pattern, PatternError> {
        let mut parts: Vec<Vec<BlockKind>> = vec![Vec::new()];
        for (position, c) in text.chars().enumerate() {
            let kind = match c {
                'M' => BlockKind::Mamba,
                '*' => BlockKind::Attention,
                '-' => BlockKind::Mlp,
                'E' => BlockKind::Moe,
                '|' => continue,
                '/' => {
                    parts.push(Vec::new());
                    continue;
                }
                'G' | 'D' | '+' => {
                    return Err(PatternError {
                        position,
                        message: format!(
                            "layer symbol `{c}` ({}) is Megatron's, but nemo-dag does not implement it",
                            match c {
                                'G' => "gated delta net",
                                'D' => "DeepSeek sparse attention",
                                _ => "multi-head latent attention",
                            }
                        ),
                    });
                }
                other => {
                    return Err(PatternError {
                        position,
                        message: format!(
                            "unknown layer symbol `{other}`; use M (Mamba-2), * (attention), - (MLP), E (MoE), / (MTP depth)"
                        ),
                    });
                }
            };
            if let Some(last) = parts.last_mut() {
                last.push(kind);
            }
        }
        let main = parts.remove(0);
        if main.is_empty() {
            return Err(PatternError {
                position: 0,
                message: "the main pattern has no layers".into(),
            });
        }
        if let Some(i) = parts.iter().position(|p| p.is_empty()) {
            let position = text
                .char_indices()
                .filter(|(_, c)| *c == '/')
                .nth(i)
                .map(|(p, _)| p)
                .unwrap_or(0);
            return Err(PatternError {
                position,
                message: "an MTP depth after `/` has no layers".into(),
            });
        }
        if parts.windows(2).any(|w| w[0] != w[1]) {
            return Err(PatternError {
                position: text.find('/').unwrap_or(0),
                message: "every MTP depth must repeat the same pattern".into(),
            });
        }
        Ok(Pattern { main, mtp: parts })
    }

    pub fn count(&self, kind: BlockKind) -> usize {
        self.main
            .iter()
            .chain(self.mtp.iter().flatten())
            .filter(|k| **k == kind)
            .count()
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for k in &self.main {
            write!(f, "{}", k.symbol())?;
        }
        for depth in &self.mtp {
            f.write_str("/")?;
            for k in depth {
                write!(f, "{}", k.symbol())?;
            }
        }
        Ok(())
    }
}

/// The MLP's activation. `swiglu` (gate ⊙ SiLU, Llama) or `relu2` (squared ReLU, not gated,
/// Nemotron-H's MLP and experts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Activation {
    #[default]
    Swiglu,
    Relu2,
}

/// Position encoding of attention blocks: rotary (Llama) or none (Nemotron-H hybrids, whose
/// Mamba layers carry position).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Position {
    #[default]
    Rope,
    None,
}

fn d_norm_eps() -> f64 {
    1e-5
}
fn d_init_std() -> f64 {
    0.02
}
fn d_rope_theta() -> f64 {
    10000.0
}
fn d_max_seq() -> usize {
    4096
}

/// Mamba-2 mixer sizes (`MambaMixer`): `heads × head_dim` = d_inner, `groups` share B and C.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MambaConfig {
    pub heads: usize,
    pub head_dim: usize,
    pub state: usize,
    #[serde(default = "d_groups")]
    pub groups: usize,
    #[serde(default = "d_conv")]
    pub conv: usize,
    /// Chunk length of the chunked (SSD) scan used for training.
    #[serde(default = "d_chunk")]
    pub chunk: usize,
}
fn d_groups() -> usize {
    1
}
fn d_conv() -> usize {
    4
}
fn d_chunk() -> usize {
    64
}

/// Mixture-of-experts sizes and router settings (Megatron `TopKRouter`, `moe_utils.py`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    /// FFN width of each routed expert.
    pub expert_ffn: usize,
    /// FFN width of the shared expert (0: none).
    #[serde(default)]
    pub shared_ffn: usize,
    /// Gate weights are multiplied by this (`moe_router_topk_scaling_factor`).
    #[serde(default = "d_one")]
    pub scaling: f64,
    /// Aux-loss-free balancing: the expert bias moves by this per global batch.
    #[serde(default = "d_bias_rate")]
    pub bias_update_rate: f64,
}
fn d_one() -> f64 {
    1.0
}
fn d_bias_rate() -> f64 {
    MoeConfig::DEFAULT_BIAS_UPDATE_RATE
}

impl MoeConfig {
    /// The expert bias's step per global batch when a manifest names none.
    pub const DEFAULT_BIAS_UPDATE_RATE: f64 = 1e-3;
}

fn d_mtp_scale() -> f64 {
    ModelConfig::DEFAULT_MTP_LOSS_SCALE
}

/// Everything that fixes a model's shape and initialisation, as written in a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The layer pattern (`*-*-`, `MEM*EME/*E/*E`).
    pub pattern: String,
    /// Vocabulary size; 0 (or absent) takes the tokenizer's.
    #[serde(default)]
    pub vocab: usize,
    pub hidden: usize,
    #[serde(default)]
    pub heads: usize,
    #[serde(default)]
    pub kv_heads: usize,
    #[serde(default)]
    pub head_dim: usize,
    /// Dense MLP width.
    #[serde(default)]
    pub ffn: usize,
    #[serde(default)]
    pub activation: Activation,
    #[serde(default)]
    pub position: Position,
    #[serde(default = "d_rope_theta")]
    pub rope_theta: f64,
    /// Longest sequence the rotary tables cover.
    #[serde(default = "d_max_seq")]
    pub max_seq: usize,
    #[serde(default = "d_norm_eps")]
    pub norm_eps: f64,
    /// Standard deviation of the normal init (output projections get it / sqrt(2·layers)).
    #[serde(default = "d_init_std")]
    pub init_std: f64,
    #[serde(default)]
    pub tie_embeddings: bool,
    #[serde(default)]
    pub mamba: Option<MambaConfig>,
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// MTP loss weight (`mtp_loss_scaling_factor`), divided among the depths.
    #[serde(default = "d_mtp_scale")]
    pub mtp_loss_scale: f64,
    /// One set of MTP block weights serves every depth (`mtp_use_repeated_layer`).
    #[serde(default)]
    pub mtp_shared: bool,
}

/// A problem with a model config: the field it is about (under `model`) and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: &'static str,
    pub message: String,
}

impl ModelConfig {
    /// The MTP loss weight when a manifest names none.
    pub const DEFAULT_MTP_LOSS_SCALE: f64 = 0.3;

    pub fn pattern(&self) -> Result<Pattern, ConfigError> {
        Pattern::parse(&self.pattern).map_err(|e| ConfigError {
            field: "pattern",
            message: format!("layer pattern `{}`: {e}", self.pattern),
        })
    }

    /// Check the sizes the pattern needs; returns the parsed pattern.
    pub fn validate(&self) -> Result<Pattern, ConfigError> {
        let pattern = self.pattern()?;
        let need = |ok: bool, field: &'static str, message: String| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError { field, message })
            }
        };
        need(self.hidden > 0, "hidden", "hidden must be > 0".into())?;
        if pattern.count(BlockKind::Attention) > 0 {
            need(
                self.heads > 0 && self.head_dim > 0,
                "heads",
                "attention blocks (`*`) need heads and head_dim".into(),
            )?;
            let kv = self.kv_heads();
            need(
                kv > 0 && self.heads.is_multiple_of(kv),
                "kv_heads",
                format!(
                    "heads ({}) must be a multiple of kv_heads ({kv})",
                    self.heads
                ),
            )?;
            need(
                self.position == Position::None || self.head_dim.is_multiple_of(2),
                "head_dim",
                "rotary position encoding needs an even head_dim".into(),
            )?;
        }
        if pattern.count(BlockKind::Mlp) > 0 {
            need(self.ffn > 0, "ffn", "MLP blocks (`-`) need ffn".into())?;
        }
        if pattern.count(BlockKind::Mamba) > 0 {
            let Some(m) = &self.mamba else {
                return Err(ConfigError {
                    field: "mamba",
                    message: "Mamba blocks (`M`) need a `mamba:` section (heads, head_dim, state)"
                        .into(),
                });
            };
            need(
                m.heads > 0 && m.head_dim > 0 && m.state > 0 && m.conv > 0 && m.chunk > 0,
                "mamba",
                "mamba heads, head_dim, state, conv and chunk must be > 0".into(),
            )?;
            need(
                m.groups > 0 && m.heads % m.groups == 0,
                "mamba",
                format!(
                    "mamba heads ({}) must be a multiple of groups ({})",
                    m.heads, m.groups
                ),
            )?;
        }
        if pattern.count(BlockKind::Moe) > 0 {
            let Some(m) = &self.moe else {
                return Err(ConfigError {
                    field: "moe",
                    message: "MoE blocks (`E`) need a `moe:` section (experts, top_k, expert_ffn)"
                        .into(),
                });
            };
            need(
                m.experts > 0 && m.top_k > 0 && m.top_k <= m.experts && m.expert_ffn > 0,
                "moe",
                format!(
                    "moe needs experts > 0, 0 < top_k <= experts and expert_ffn > 0 (got {} experts, top_k {})",
                    m.experts, m.top_k
                ),
            )?;
        }
        Ok(pattern)
    }

    pub fn kv_heads(&self) -> usize {
        if self.kv_heads == 0 {
            self.heads
        } else {
            self.kv_heads
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use BlockKind::*;

    #[test]
    fn patterns_parse_into_blocks_and_mtp_depths() {
        let p = Pattern::parse("M*M*/MM/MM").unwrap();
        assert_eq!(p.main, vec![Mamba, Attention, Mamba, Attention]);
        assert_eq!(p.mtp, vec![vec![Mamba, Mamba], vec![Mamba, Mamba]]);
        let p = Pattern::parse("ME|M*-").unwrap();
        assert_eq!(
            p.main,
            vec![Mamba, Moe, Mamba, Attention, Mlp],
            "`|` is ignored"
        );
        assert!(p.mtp.is_empty());
        assert_eq!(p.to_string(), "MEM*-");
        assert_eq!(Pattern::parse("MEM*EME/*E/*E").unwrap().count(Moe), 5);
    }

    #[test]
    fn bad_patterns_name_the_character() {
        let e = Pattern::parse("M*X-").unwrap_err();
        assert_eq!(e.position, 2);
        assert!(e.message.contains("unknown layer symbol `X`"), "{e}");
        assert!(e.to_string().contains("at character 3"), "{e}");
        assert!(
            Pattern::parse("MG")
                .unwrap_err()
                .message
                .contains("gated delta net")
        );
        assert!(Pattern::parse("").is_err());
        assert_eq!(Pattern::parse("M*//E").unwrap_err().position, 2);
        assert!(
            Pattern::parse("M*/*E/E")
                .unwrap_err()
                .message
                .contains("same pattern")
        );
    }

    #[test]
    fn validation_names_the_missing_section() {
        let c: ModelConfig = serde_json::from_value(
            serde_json::json!({"pattern": "M*", "hidden": 8, "heads": 2, "head_dim": 4}),
        )
        .unwrap();
        assert_eq!(c.validate().unwrap_err().field, "mamba");
        let c: ModelConfig = serde_json::from_value(
            serde_json::json!({"pattern": "*", "hidden": 8, "heads": 3, "kv_heads": 2, "head_dim": 4}),
        )
        .unwrap();
        assert_eq!(c.validate().unwrap_err().field, "kv_heads");
    }
}
