//! transformers' `LlamaForCausalLM` (and `MistralForCausalLM` without a sliding window): a dense
//! model of attention/MLP pairs (`*-*-…`) with SwiGLU and rotary positions, no MTP.
//!
//! | nemo-dag | Hugging Face Llama |
//! | --- | --- |
//! | `embedding` | `model.embed_tokens.weight` |
//! | `blocks.{2i}.norm` | `model.layers.{i}.input_layernorm.weight` |
//! | `blocks.{2i}.attn.qkv` | `model.layers.{i}.self_attn.{q,k,v}_proj.weight` |
//! | `blocks.{2i}.attn.proj` | `model.layers.{i}.self_attn.o_proj.weight` |
//! | `blocks.{2i+1}.norm` | `model.layers.{i}.post_attention_layernorm.weight` |
//! | `blocks.{2i+1}.mlp.fc1` | `model.layers.{i}.mlp.{gate,up}_proj.weight` |
//! | `blocks.{2i+1}.mlp.fc2` | `model.layers.{i}.mlp.down_proj.weight` |
//! | `final_norm` | `model.norm.weight` |
//! | `output` | `lm_head.weight` (absent with tied embeddings) |

use super::{Theirs, f64_or, head_sizes, require_bool, usize_of};
use model::config::{Activation, BlockKind, ModelConfig, Position};
use model::net::Model;
use serde_json::{Value, json};

/// Why a model is not Llama-shaped, or `Ok(number of Llama layers)`.
pub fn check(model: &Model) -> Result<usize, String> {
    let cfg = &model.cfg;
    let dense = model
        .pattern
        .main
        .chunks(2)
        .all(|p| p == [BlockKind::Attention, BlockKind::Mlp]);
    if !dense {
        return Err(format!(
            "only a pattern of attention/MLP pairs (`*-*-…`) maps to Llama; this model is `{}`",
            model.pattern
        ));
    }
    if !model.pattern.mtp.is_empty() {
        return Err("a model with MTP depths has no Llama equivalent".into());
    }
    if cfg.activation != Activation::Swiglu || cfg.position != Position::Rope {
        return Err("Llama needs activation swiglu and position rope".into());
    }
    Ok(model.pattern.main.len() / 2)
}

/// Our tensors and their names in a Llama checkpoint, for a model that passes [`check`].
pub fn mapping(model: &Model) -> Vec<(String, Theirs)> {
    let cfg = &model.cfg;
    let (h, k, d) = (cfg.heads, cfg.kv_heads(), cfg.head_dim);
    let same = |ours: String, theirs: String| (ours, Theirs::Same(theirs));
    let mut m = vec![same("embedding".into(), "model.embed_tokens.weight".into())];
    for i in 0..model.pattern.main.len() / 2 {
        let (a, f, p) = (2 * i, 2 * i + 1, format!("model.layers.{i}"));
        m.push(same(
            format!("blocks.{a}.norm"),
            format!("{p}.input_layernorm.weight"),
        ));
        let proj = |x: &str| format!("{p}.self_attn.{x}_proj.weight");
        m.push((
            format!("blocks.{a}.attn.qkv"),
            Theirs::Rows(vec![
                (proj("q"), h * d),
                (proj("k"), k * d),
                (proj("v"), k * d),
            ]),
        ));
        m.push(same(format!("blocks.{a}.attn.proj"), proj("o")));
        m.push(same(
            format!("blocks.{f}.norm"),
            format!("{p}.post_attention_layernorm.weight"),
        ));
        let mlp = |x: &str| format!("{p}.mlp.{x}_proj.weight");
        m.push((
            format!("blocks.{f}.mlp.fc1"),
            Theirs::Rows(vec![(mlp("gate"), cfg.ffn), (mlp("up"), cfg.ffn)]),
        ));
        m.push(same(format!("blocks.{f}.mlp.fc2"), mlp("down")));
    }
    m.push(same("final_norm".into(), "model.norm.weight".into()));
    if !cfg.tie_embeddings {
        m.push(same("output".into(), "lm_head.weight".into()));
    }
    m
}

/// The `config.json` of a model that passes [`check`].
pub fn config(model: &Model) -> Value {
    let cfg = &model.cfg;
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": model.pattern.main.len() / 2,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "vocab_size": model.vocab,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": false,
        "mlp_bias": false,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    })
}

/// Our model config and vocabulary for their `config.json`, or the first option we do not
/// implement, named.
pub fn model_config(c: &Value) -> Result<(ModelConfig, usize), String> {
    // MistralConfig's default window is 4096: a Mistral config without the key has one.
    let mistral_default = json!(4096);
    let window = match c.get("sliding_window") {
        None if c["model_type"] == "mistral" => Some(&mistral_default),
        w => w.filter(|w| !w.is_null()),
    };
    if let Some(window) = window {
        return Err(format!(
            "config.json: `sliding_window: {window}` is not implemented (attention is full)"
        ));
    }
    if c["hidden_act"].as_str().unwrap_or("silu") != "silu" {
        return Err(format!(
            "config.json: `hidden_act: {}` is not implemented (only silu: SwiGLU)",
            c["hidden_act"]
        ));
    }
    require_bool(c, "attention_bias", false, false)?;
    require_bool(c, "mlp_bias", false, false)?;
    // transformers 5 writes the rotary settings as `rope_parameters`; older configs as keys.
    let rope = c
        .get("rope_parameters")
        .filter(|r| !r.is_null())
        .unwrap_or(c);
    let kind = rope["rope_type"].as_str().unwrap_or("default");
    if kind != "default" || !c["rope_scaling"].is_null() {
        return Err(format!(
            "config.json: rope scaling `{}` is not implemented (plain RoPE only)",
            if kind != "default" {
                kind.to_string()
            } else {
                c["rope_scaling"].to_string()
            }
        ));
    }
    let layers = usize_of(c, "num_hidden_layers")?;
    let hidden = usize_of(c, "hidden_size")?;
    let heads = usize_of(c, "num_attention_heads")?;
    let (kv_heads, head_dim) = head_sizes(c, hidden, heads);
    let vocab = usize_of(c, "vocab_size")?;
    let cfg = ModelConfig {
        pattern: "*-".repeat(layers),
        vocab,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn: usize_of(c, "intermediate_size")?,
        activation: Activation::Swiglu,
        position: Position::Rope,
        rope_theta: f64_or(rope, "rope_theta", f64_or(c, "rope_theta", 10000.0)?)?,
        max_seq: c["max_position_embeddings"]
            .as_u64()
            .map_or(4096, |v| v as usize),
        norm_eps: f64_or(c, "rms_norm_eps", 1e-6)?,
        init_std: f64_or(c, "initializer_range", 0.02)?,
        tie_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(false),
        mamba: None,
        moe: None,
        mtp_loss_scale: ModelConfig::DEFAULT_MTP_LOSS_SCALE,
        mtp_shared: false,
    };
    Ok((cfg, vocab))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Value {
        json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 500000.0
        })
    }

    #[test]
    fn a_llama_config_becomes_ours() {
        let (cfg, vocab) = model_config(&base()).unwrap();
        assert_eq!(
            (cfg.pattern.as_str(), vocab, cfg.head_dim),
            ("*-*-", 100, 8)
        );
        assert_eq!(
            (cfg.kv_heads, cfg.rope_theta, cfg.norm_eps),
            (2, 500000.0, 1e-5)
        );
        // transformers 5's `rope_parameters` form.
        let mut c = base();
        c["rope_theta"] = Value::Null;
        c["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 1e6});
        assert_eq!(model_config(&c).unwrap().0.rope_theta, 1e6);
        // A `rope_parameters` without the theta: the top-level key still counts.
        let mut c = base();
        c["rope_parameters"] = json!({"rope_type": "default"});
        assert_eq!(model_config(&c).unwrap().0.rope_theta, 500000.0);
    }

    #[test]
    fn options_we_do_not_implement_are_named() {
        for (key, value, named) in [
            ("sliding_window", json!(4096), "sliding_window"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            ("attention_bias", json!(true), "attention_bias"),
            ("mlp_bias", json!(true), "mlp_bias"),
            (
                "rope_scaling",
                json!({"rope_type": "yarn", "factor": 4.0}),
                "rope scaling",
            ),
        ] {
            let mut c = base();
            c[key] = value;
            let why = model_config(&c).unwrap_err();
            assert!(why.contains(named), "{key}: {why}");
        }
        // A Mistral config without the key has MistralConfig's window of 4096.
        let mut c = base();
        c["model_type"] = json!("mistral");
        assert!(
            model_config(&c)
                .unwrap_err()
                .contains("sliding_window: 4096")
        );
        let mut c = base();
        c["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 1e6});
        assert!(model_config(&c).unwrap_err().contains("llama3"));
    }
}
