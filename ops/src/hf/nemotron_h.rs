//! transformers' `NemotronHForCausalLM` (`transformers/models/nemotron_h/`, native since
//! transformers 5): any hybrid of Mamba-2, attention, MLP and MoE blocks, written in the layout
//! of the hub's Nemotron-H checkpoints (`backbone.*` tensor names, one tensor per expert, an
//! untied `lm_head`). Read back from that layout or from transformers' own (`model.*` names,
//! each layer's experts fused into `(E, …)` tensors).
//!
//! Every pattern of `M`, `*`, `-` and `E` maps one block to one layer, in order, and the
//! config's `layers_block_type` lists them (`linear_attention`, `full_attention`, `mlp`, `moe`).
//! Each tensor is renamed, and two are reshaped or split:
//!
//! | nemo-dag (`blocks.{i}.…`) | transformers (`backbone.layers.{i}.…`) |
//! | --- | --- |
//! | `embedding` | `backbone.embeddings.weight` |
//! | `norm` | `norm.weight` |
//! | `mamba.in_proj` (`[z, x, B, C, dt]`) | `mixer.in_proj.weight` (`[z, xBC, dt]`: the same rows) |
//! | `mamba.conv_weight` `(C, K)` | `mixer.conv1d.weight` `(C, 1, K)` |
//! | `mamba.conv_bias`, `dt_bias`, `a_log`, `d`, `norm`, `out_proj` | `mixer.conv1d.bias`, `dt_bias`, `A_log`, `D`, `norm.weight`, `out_proj.weight` |
//! | `attn.qkv` | `mixer.{q,k,v}_proj.weight` |
//! | `attn.proj` | `mixer.o_proj.weight` |
//! | `mlp.fc1`, `mlp.fc2` | `mixer.up_proj.weight`, `mixer.down_proj.weight` |
//! | `moe.router`, `moe.expert_bias` | `mixer.gate.weight`, `mixer.gate.e_score_correction_bias` |
//! | `moe.experts.{e}.fc1`, `.fc2` | `mixer.experts.{e}.up_proj.weight`, `.down_proj.weight` |
//! | `moe.shared.fc1`, `.fc2` | `mixer.shared_experts.up_proj.weight`, `.down_proj.weight` |
//! | `final_norm` | `backbone.norm_f.weight` |
//! | `output` (or `embedding` when tied) | `lm_head.weight` |
//!
//! What transformers computes must be what we compute, so a model it would compute differently
//! is refused, naming why: attention with rotary positions (NemotronH's has none), SwiGLU MLPs or
//! experts (NemotronH's are squared-ReLU), a MoE layer without a shared expert (NemotronH always
//! has one), fewer than two experts. The config sets what transformers would otherwise default
//! differently: `routed_scaling_factor` (its default is 1.0), `norm_topk_prob` (we normalise the
//! gates only when top-k > 1), and `time_step_min` 0 (transformers clamps Δ from below at it; we
//! never clamp). MTP depths have no place in `NemotronHForCausalLM` (transformers ignores
//! `mtp.*` on load): they are left out, and the export says how many tensors that was.

use super::{Theirs, f64_or, head_sizes, require_bool, usize_of};
use candle_core::Tensor;
use model::checkpoint::model_tensors;
use model::config::{Activation, BlockKind, MambaConfig, ModelConfig, MoeConfig, Position};
use model::net::Model;
use serde_json::{Value, json};
use std::collections::HashMap;

/// transformers' name of a block kind in `layers_block_type`.
fn layer_type(kind: BlockKind) -> &'static str {
    match kind {
        BlockKind::Mamba => "linear_attention",
        BlockKind::Attention => "full_attention",
        BlockKind::Mlp => "mlp",
        BlockKind::Moe => "moe",
    }
}

/// The pattern symbol of one of transformers' layer types (or of a pattern character).
fn symbol(layer: &str) -> Option<char> {
    match layer {
        "linear_attention" | "mamba" | "M" => Some('M'),
        "full_attention" | "attention" | "*" => Some('*'),
        "mlp" | "-" => Some('-'),
        "moe" | "E" => Some('E'),
        _ => None,
    }
}

/// Why transformers' NemotronH would compute something else than `model`, if it would.
pub fn check(model: &Model) -> Result<(), String> {
    let cfg = &model.cfg;
    let has = |kind| model.pattern.main.contains(&kind);
    if has(BlockKind::Attention) && cfg.position == Position::Rope {
        return Err(
            "attention with rotary positions: NemotronH's attention has no position \
                    encoding (train the model with `position: none`)"
                .into(),
        );
    }
    if (has(BlockKind::Mlp) || has(BlockKind::Moe)) && cfg.activation != Activation::Relu2 {
        return Err(
            "SwiGLU MLPs: NemotronH's MLPs and experts are squared-ReLU, not gated \
                    (train the model with `activation: relu2`)"
                .into(),
        );
    }
    if has(BlockKind::Moe) {
        let moe = cfg
            .moe
            .as_ref()
            .ok_or("the pattern has MoE blocks but the config no `moe`")?;
        if moe.shared_ffn == 0 {
            return Err(
                "a MoE layer without a shared expert: NemotronH's always has one \
                        (set `moe.shared_ffn`)"
                    .into(),
            );
        }
        if moe.experts < 2 {
            return Err(format!(
                "{} routed expert: NemotronH's router needs at least 2",
                moe.experts
            ));
        }
    }
    if has(BlockKind::Mamba) && cfg.mamba.is_none() {
        return Err("the pattern has Mamba blocks but the config no `mamba`".into());
    }
    Ok(())
}

/// Whether one of our tensors stays out of a NemotronH checkpoint (the MTP depths').
pub fn left_out(name: &str) -> bool {
    name.starts_with("mtp.")
}

/// Our tensors (but the MTP depths') and their names in a NemotronH checkpoint.
pub fn mapping(model: &Model) -> Result<Vec<(String, Theirs)>, String> {
    let cfg = &model.cfg;
    let mut names: Vec<String> = model_tensors(model)
        .map_err(|e| e.to_string())?
        .into_keys()
        .filter(|n| !left_out(n))
        .collect();
    names.sort();
    let mut m = Vec::with_capacity(names.len() + 1);
    for name in names {
        let same = |to: String| Theirs::Same(to);
        let theirs = match name.as_str() {
            "embedding" => same("backbone.embeddings.weight".into()),
            "final_norm" => same("backbone.norm_f.weight".into()),
            "output" => same("lm_head.weight".into()),
            _ => {
                let (layer, what) = name
                    .strip_prefix("blocks.")
                    .and_then(|rest| rest.split_once('.'))
                    .ok_or_else(|| format!("no NemotronH name for the tensor `{name}`"))?;
                let p = format!("backbone.layers.{layer}");
                let x = |rest: &str| format!("{p}.mixer.{rest}");
                match what {
                    "norm" => same(format!("{p}.norm.weight")),
                    "mamba.in_proj" => same(x("in_proj.weight")),
                    "mamba.conv_weight" => Theirs::Conv(x("conv1d.weight")),
                    "mamba.conv_bias" => same(x("conv1d.bias")),
                    "mamba.dt_bias" => same(x("dt_bias")),
                    "mamba.a_log" => same(x("A_log")),
                    "mamba.d" => same(x("D")),
                    "mamba.norm" => same(x("norm.weight")),
                    "mamba.out_proj" => same(x("out_proj.weight")),
                    "attn.qkv" => {
                        let (h, k, d) = (cfg.heads, cfg.kv_heads(), cfg.head_dim);
                        Theirs::Rows(vec![
                            (x("q_proj.weight"), h * d),
                            (x("k_proj.weight"), k * d),
                            (x("v_proj.weight"), k * d),
                        ])
                    }
                    "attn.proj" => same(x("o_proj.weight")),
                    "mlp.fc1" => same(x("up_proj.weight")),
                    "mlp.fc2" => same(x("down_proj.weight")),
                    "moe.router" => same(x("gate.weight")),
                    "moe.expert_bias" => same(x("gate.e_score_correction_bias")),
                    "moe.shared.fc1" => same(x("shared_experts.up_proj.weight")),
                    "moe.shared.fc2" => same(x("shared_experts.down_proj.weight")),
                    other => match other
                        .strip_prefix("moe.experts.")
                        .and_then(|rest| rest.split_once('.'))
                    {
                        Some((e, "fc1")) => same(x(&format!("experts.{e}.up_proj.weight"))),
                        Some((e, "fc2")) => same(x(&format!("experts.{e}.down_proj.weight"))),
                        _ => return Err(format!("no NemotronH name for the tensor `{name}`")),
                    },
                }
            }
        };
        m.push((name, theirs));
    }
    // NemotronH's head is its own tensor: a tied model writes its embedding there too.
    if cfg.tie_embeddings {
        m.push(("embedding".into(), Theirs::Same("lm_head.weight".into())));
    }
    Ok(m)
}

/// `config.json`: every key whose transformers default is not what we compute is written.
pub fn config(model: &Model) -> Value {
    let cfg = &model.cfg;
    let types: Vec<&str> = model.pattern.main.iter().map(|k| layer_type(*k)).collect();
    let mut c = json!({
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": model.vocab,
        "hidden_size": cfg.hidden,
        "layers_block_type": types,
        "num_hidden_layers": types.len(),
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads(),
        "head_dim": cfg.head_dim,
        "attention_bias": false,
        "intermediate_size": cfg.ffn,
        "mlp_hidden_act": "relu2",
        "mlp_bias": false,
        "layer_norm_epsilon": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq,
        "tie_word_embeddings": false,
        "residual_in_fp32": false,
        "use_bias": false,
        "num_nextn_predict_layers": 0,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    });
    if let Some(m) = &cfg.mamba {
        c["mamba_num_heads"] = json!(m.heads);
        c["mamba_head_dim"] = json!(m.head_dim);
        c["ssm_state_size"] = json!(m.state);
        c["n_groups"] = json!(m.groups);
        c["conv_kernel"] = json!(m.conv);
        c["chunk_size"] = json!(m.chunk);
        c["use_conv_bias"] = json!(true);
        c["mamba_proj_bias"] = json!(false);
        c["mamba_hidden_act"] = json!("silu");
        // transformers clamps Δ = softplus(dt + dt_bias) from below at time_step_min; ours
        // never clamps, and Δ > 0 always, so a floor of 0 changes nothing.
        c["time_step_min"] = json!(0.0);
    }
    if let Some(moe) = &cfg.moe {
        c["n_routed_experts"] = json!(moe.experts);
        c["num_experts_per_tok"] = json!(moe.top_k);
        c["moe_intermediate_size"] = json!(moe.expert_ffn);
        c["n_shared_experts"] = json!(1);
        c["moe_shared_expert_intermediate_size"] = json!(moe.shared_ffn);
        c["routed_scaling_factor"] = json!(moe.scaling);
        c["norm_topk_prob"] = json!(moe.top_k > 1);
        c["n_group"] = json!(1);
        c["topk_group"] = json!(1);
    }
    c
}

/// Our model config and vocabulary for their `config.json`, or the first option we would
/// compute differently from transformers, named.
pub fn model_config(c: &Value) -> Result<(ModelConfig, usize), String> {
    let pattern: String = match (&c["layers_block_type"], &c["hybrid_override_pattern"]) {
        (Value::Array(list), _) => list
            .iter()
            .map(|l| {
                l.as_str().and_then(symbol).ok_or_else(|| {
                    format!("config.json: `layers_block_type` has an unknown layer {l}")
                })
            })
            .collect::<Result<_, _>>()?,
        (_, Value::String(p)) => p
            .chars()
            .map(|ch| {
                symbol(&ch.to_string()).ok_or_else(|| {
                    format!("config.json: `hybrid_override_pattern` has an unknown symbol `{ch}`")
                })
            })
            .collect::<Result<_, _>>()?,
        _ => return Err("config.json: no `layers_block_type` list".into()),
    };
    if c["mlp_hidden_act"].as_str().unwrap_or("relu2") != "relu2" {
        return Err(format!(
            "config.json: `mlp_hidden_act: {}` is not implemented (relu2 only)",
            c["mlp_hidden_act"]
        ));
    }
    for key in ["attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"] {
        require_bool(c, key, false, false)?;
    }
    if !c["moe_latent_size"].is_null() {
        return Err("config.json: `moe_latent_size` (LatentMoE) is not implemented".into());
    }
    let hidden = usize_of(c, "hidden_size")?;
    let heads = c["num_attention_heads"].as_u64().unwrap_or(0) as usize;
    let mamba = if pattern.contains('M') {
        require_bool(c, "use_conv_bias", true, true)?;
        if c["mamba_hidden_act"].as_str().unwrap_or("silu") != "silu" {
            return Err("config.json: only `mamba_hidden_act: silu` is implemented".into());
        }
        for key in ["time_step_limit", "mamba_dt_limit"] {
            let limit = &c[key];
            // transformers writes infinity as `{"__float__": "Infinity"}` (JSON has none).
            let infinite = |v: &Value| {
                v.is_null()
                    || v.as_f64().is_some_and(f64::is_infinite)
                    || v["__float__"].as_str() == Some("Infinity")
            };
            let default =
                limit.is_null() || (limit[0].as_f64() == Some(0.0) && infinite(&limit[1]));
            if !default {
                return Err(format!(
                    "config.json: `{key}: {limit}`: transformers' fused kernels clamp Mamba's step \
                     size Δ there, and nemo-dag's Mamba-2 never clamps"
                ));
            }
        }
        let floor = f64_or(c, "time_step_min", 0.001)?;
        if floor > 0.0 {
            return Err(format!(
                "config.json: `time_step_min: {floor}`: transformers clamps Mamba's step size \
                 Δ from below there, and nemo-dag's Mamba-2 never clamps, so the model would \
                 compute differently"
            ));
        }
        Some(MambaConfig {
            heads: usize_of(c, "mamba_num_heads")?,
            head_dim: usize_of(c, "mamba_head_dim")?,
            state: usize_of(c, "ssm_state_size")?,
            groups: usize_of(c, "n_groups")?,
            conv: usize_of(c, "conv_kernel")?,
            chunk: usize_of(c, "chunk_size")?,
        })
    } else {
        None
    };
    let moe = if pattern.contains('E') {
        let top_k = usize_of(c, "num_experts_per_tok")?;
        // We normalise the chosen experts' gates exactly when top-k > 1.
        require_bool(c, "norm_topk_prob", true, top_k > 1)?;
        for key in ["n_group", "topk_group"] {
            if c[key].as_u64().unwrap_or(1) != 1 {
                return Err(format!(
                    "config.json: grouped routing (`{key}` > 1) is not implemented"
                ));
            }
        }
        Some(MoeConfig {
            experts: usize_of(c, "n_routed_experts")?,
            top_k,
            expert_ffn: usize_of(c, "moe_intermediate_size")?,
            shared_ffn: usize_of(c, "moe_shared_expert_intermediate_size")?,
            scaling: f64_or(c, "routed_scaling_factor", 1.0)?,
            bias_update_rate: MoeConfig::DEFAULT_BIAS_UPDATE_RATE,
        })
    } else {
        None
    };
    let vocab = usize_of(c, "vocab_size")?;
    let (kv_heads, head_dim) = head_sizes(c, hidden, heads);
    let cfg = ModelConfig {
        pattern,
        vocab,
        hidden,
        heads,
        kv_heads,
        head_dim,
        ffn: c["intermediate_size"].as_u64().unwrap_or(0) as usize,
        activation: Activation::Relu2,
        position: Position::None,
        rope_theta: 10000.0,
        max_seq: c["max_position_embeddings"]
            .as_u64()
            .map_or(4096, |v| v as usize),
        norm_eps: f64_or(c, "layer_norm_epsilon", 1e-5)?,
        init_std: f64_or(c, "initializer_range", 0.02)?,
        // transformers' NemotronH never ties its head to the embedding (it has no tied
        // weights): both tensors are read, whatever `tie_word_embeddings` says.
        tie_embeddings: false,
        mamba,
        moe,
        mtp_loss_scale: ModelConfig::DEFAULT_MTP_LOSS_SCALE,
        mtp_shared: false,
    };
    Ok((cfg, vocab))
}

/// Their tensors in the hub's layout: transformers' own (`model.*`, each layer's experts fused
/// into `experts.{up,down}_proj` of shape `(E, …)`) renamed to `backbone.*` with one tensor
/// per expert; the hub's layout unchanged.
pub fn hub_layout(theirs: HashMap<String, Tensor>) -> Result<HashMap<String, Tensor>, String> {
    let mut out = HashMap::with_capacity(theirs.len());
    for (name, t) in theirs {
        let name = match name.strip_prefix("model.") {
            Some(rest) => format!("backbone.{rest}"),
            None => name,
        };
        let fused = ["experts.up_proj", "experts.down_proj"]
            .iter()
            .find_map(|f| name.strip_suffix(f).map(|p| (p.to_string(), &f[8..])));
        match fused {
            Some((prefix, proj)) => {
                let experts = t.dim(0).map_err(|e| format!("{name}: {e}"))?;
                for e in 0..experts {
                    let one = t.get(e).map_err(|err| format!("{name}: {err}"))?;
                    out.insert(format!("{prefix}experts.{e}.{proj}.weight"), one);
                }
            }
            None => {
                if out.contains_key(&name) {
                    return Err(format!(
                        "`{name}` is in the checkpoint twice (as model.* and backbone.*)"
                    ));
                }
                out.insert(name, t);
            }
        }
    }
    Ok(out)
}

/// Whether a tensor of a NemotronH checkpoint has no place in our model and may be dropped: the
/// MTP depths', which transformers ignores too.
pub fn ignored(name: &str) -> bool {
    name.starts_with("mtp.") || name.starts_with("backbone.mtp") || name.contains(".mtp.")
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::config::ModelConfig;

    fn model(changes: Value) -> Model {
        let mut c = json!({
            "pattern": "ME*-/*E", "hidden": 16, "heads": 2, "kv_heads": 1, "head_dim": 8,
            "ffn": 32, "activation": "relu2", "position": "none",
            "mamba": {"heads": 2, "head_dim": 8, "state": 4, "groups": 1, "chunk": 8},
            "moe": {"experts": 3, "top_k": 2, "expert_ffn": 8, "shared_ffn": 8, "scaling": 2.5}
        });
        for (k, v) in changes.as_object().unwrap() {
            c[k] = v.clone();
        }
        let cfg: ModelConfig = serde_json::from_value(c).unwrap();
        Model::new(&cfg, 40, 1).unwrap()
    }

    #[test]
    fn what_transformers_would_compute_differently_is_refused_by_name() {
        assert_eq!(check(&model(json!({}))), Ok(()));
        let why = |changes| check(&model(changes)).unwrap_err();
        assert!(why(json!({"position": "rope"})).contains("rotary"));
        assert!(why(json!({"activation": "swiglu"})).contains("squared-ReLU"));
        let no_shared = json!({"moe": {"experts": 3, "top_k": 2, "expert_ffn": 8}});
        assert!(why(no_shared).contains("shared expert"));
        let one = json!({"moe": {"experts": 1, "top_k": 1, "expert_ffn": 8, "shared_ffn": 8}});
        assert!(why(one).contains("at least 2"));
        // Without attention, rotary positions change nothing; without MLPs, neither does SwiGLU.
        assert_eq!(
            check(&model(json!({"pattern": "M-", "position": "rope"}))),
            Ok(())
        );
        assert_eq!(
            check(&model(json!({"pattern": "M*", "activation": "swiglu"}))),
            Ok(())
        );
    }

    #[test]
    fn every_tensor_gets_its_transformers_name_and_mtp_is_left_out() {
        let m = model(json!({}));
        assert!(model_tensors(&m).unwrap().keys().any(|n| left_out(n)));
        let (theirs, kept_out) =
            super::super::to_theirs(&m, &mapping(&m).unwrap(), left_out).unwrap();
        assert!(kept_out > 0);
        let names: Vec<&str> = theirs.keys().map(String::as_str).collect();
        for want in [
            "backbone.embeddings.weight",
            "backbone.layers.0.mixer.conv1d.weight",
            "backbone.layers.0.mixer.A_log",
            "backbone.layers.1.mixer.gate.e_score_correction_bias",
            "backbone.layers.1.mixer.experts.2.down_proj.weight",
            "backbone.layers.1.mixer.shared_experts.up_proj.weight",
            "backbone.layers.2.mixer.v_proj.weight",
            "backbone.layers.3.mixer.up_proj.weight",
            "backbone.norm_f.weight",
            "lm_head.weight",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert!(
            names
                .iter()
                .all(|n| n.starts_with("backbone.") || *n == "lm_head.weight")
        );
        assert_eq!(
            theirs["backbone.layers.0.mixer.conv1d.weight"].dims(),
            [2 * 8 + 2 * 4, 1, 4]
        );
        // A tied head becomes an lm_head of its own.
        let tied = model(json!({"tie_embeddings": true}));
        let (theirs, _) =
            super::super::to_theirs(&tied, &mapping(&tied).unwrap(), left_out).unwrap();
        assert!(theirs.contains_key("lm_head.weight"));
    }

    #[test]
    fn transformers_in_memory_layout_becomes_the_hubs() {
        use candle_core::Device;
        let fused = Tensor::arange(0f32, 24.0, &Device::Cpu)
            .unwrap()
            .reshape((2, 3, 4))
            .unwrap();
        let norm = Tensor::ones(4, candle_core::DType::F32, &Device::Cpu).unwrap();
        let theirs = HashMap::from([
            (
                "model.layers.1.mixer.experts.up_proj".to_string(),
                fused.clone(),
            ),
            ("model.norm_f.weight".to_string(), norm),
        ]);
        let hub = hub_layout(theirs).unwrap();
        let mut names: Vec<&String> = hub.keys().collect();
        names.sort();
        assert_eq!(
            names,
            [
                "backbone.layers.1.mixer.experts.0.up_proj.weight",
                "backbone.layers.1.mixer.experts.1.up_proj.weight",
                "backbone.norm_f.weight"
            ]
        );
        let second = &hub["backbone.layers.1.mixer.experts.1.up_proj.weight"];
        assert_eq!(second.dims(), [3, 4]);
        let want: Vec<f32> = (12..24).map(|v| v as f32).collect();
        assert_eq!(
            second.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            want
        );
    }

    fn hf_config() -> Value {
        let m = model(json!({}));
        config(&m)
    }

    #[test]
    fn our_config_reads_back_as_the_same_model() {
        let m = model(json!({}));
        let (cfg, vocab) = model_config(&config(&m)).unwrap();
        assert_eq!(vocab, 40);
        assert_eq!(cfg.pattern, "ME*-");
        assert_eq!(cfg.mamba, m.cfg.mamba);
        assert_eq!(cfg.moe, m.cfg.moe);
        assert_eq!(
            (cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ffn),
            (2, 1, 8, 32)
        );
    }

    #[test]
    fn what_we_would_compute_differently_on_import_is_named() {
        for (key, value, named) in [
            ("time_step_min", Value::Null, "time_step_min: 0.001"),
            ("norm_topk_prob", json!(false), "norm_topk_prob"),
            ("moe_latent_size", json!(64), "LatentMoE"),
            ("mlp_hidden_act", json!("silu"), "mlp_hidden_act"),
            ("n_group", json!(2), "grouped routing"),
            ("use_conv_bias", json!(false), "use_conv_bias"),
        ] {
            let mut c = hf_config();
            c[key] = value;
            let why = model_config(&c).unwrap_err();
            assert!(why.contains(named), "{key}: {why}");
        }
        let mut c = hf_config();
        c["time_step_limit"] = json!([0.0, 1.0]);
        assert!(model_config(&c).unwrap_err().contains("time_step_limit"));
        c["time_step_limit"] = json!([0.0, {"__float__": "Infinity"}]);
        assert!(model_config(&c).is_ok());
        // Never tied: transformers reads both the embedding and lm_head.
        let mut c = hf_config();
        c["tie_word_embeddings"] = json!(true);
        assert!(!model_config(&c).unwrap().0.tie_embeddings);
        let mut c = hf_config();
        c["layers_block_type"] = json!(["linear_attention", "sliding_attention"]);
        assert!(model_config(&c).unwrap_err().contains("unknown layer"));
    }
}
