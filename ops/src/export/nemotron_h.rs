//! `export` with `format: nemotron_h`: a hybrid model as transformers' `NemotronHForCausalLM`
//! (`transformers/models/nemotron_h/`, native since transformers 5), in the layout of the
//! hub's Nemotron-H checkpoints: `backbone.*` tensor names, one tensor per expert, an untied
//! `lm_head`.
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

use candle_core::Tensor;
use model::checkpoint::model_tensors;
use model::config::{Activation, BlockKind, Position};
use model::net::Model;
use nemo_dag_op::RunError;
use serde_json::{Value, json};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;

/// What [`write`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    pub layers: usize,
    /// MTP tensors left out (no place for them in `NemotronHForCausalLM`).
    pub mtp_tensors: usize,
}

/// transformers' name of a block kind in `layers_block_type`.
fn layer_type(kind: BlockKind) -> &'static str {
    match kind {
        BlockKind::Mamba => "linear_attention",
        BlockKind::Attention => "full_attention",
        BlockKind::Mlp => "mlp",
        BlockKind::Moe => "moe",
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

/// Write `config.json` and `model.safetensors` of `model` as a `NemotronHForCausalLM` into `out`.
pub fn write(model: &Model, out: &Path) -> Result<Written, RunError> {
    check(model).map_err(|why| RunError::new(format!("no NemotronH equivalent: {why}")))?;
    let e = |e: candle_core::Error| RunError::new(format!("export: {e}"));
    let ours = model_tensors(model).map_err(e)?;
    let (tensors, mtp_tensors) = rename(model, &ours).map_err(RunError::new)?;
    let tensors: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(name, t)| Ok((name, t.contiguous().map_err(e)?)))
        .collect::<Result<_, RunError>>()?;
    std::fs::create_dir_all(out)?;
    candle_core::safetensors::save(&tensors, out.join("model.safetensors")).map_err(e)?;
    let text =
        serde_json::to_string_pretty(&config(model)).map_err(|e| RunError::new(e.to_string()))?;
    std::fs::write(out.join("config.json"), text + "\n")?;
    Ok(Written {
        layers: model.pattern.main.len(),
        mtp_tensors,
    })
}

/// Our tensors under transformers' names, and how many MTP tensors were left out.
fn rename(
    model: &Model,
    ours: &HashMap<String, Tensor>,
) -> Result<(BTreeMap<String, Tensor>, usize), String> {
    let cfg = &model.cfg;
    let mut out = BTreeMap::new();
    let mut mtp = 0;
    for (name, t) in ours {
        if name.starts_with("mtp.") {
            mtp += 1;
            continue;
        }
        let bad = |e: candle_core::Error| format!("{name}: {e}");
        match name.as_str() {
            "embedding" => {
                if cfg.tie_embeddings {
                    out.insert("lm_head.weight".to_string(), t.clone());
                }
                out.insert("backbone.embeddings.weight".to_string(), t.clone());
            }
            "final_norm" => {
                out.insert("backbone.norm_f.weight".to_string(), t.clone());
            }
            "output" => {
                out.insert("lm_head.weight".to_string(), t.clone());
            }
            _ => {
                let (layer, what) = name
                    .strip_prefix("blocks.")
                    .and_then(|rest| rest.split_once('.'))
                    .ok_or_else(|| format!("no NemotronH name for the tensor `{name}`"))?;
                let p = format!("backbone.layers.{layer}");
                let m = format!("{p}.mixer");
                let renamed = match what {
                    "norm" => format!("{p}.norm.weight"),
                    "mamba.in_proj" => format!("{m}.in_proj.weight"),
                    "mamba.conv_weight" => {
                        let (c, k) = t.dims2().map_err(bad)?;
                        let t = t.reshape((c, 1, k)).map_err(bad)?;
                        out.insert(format!("{m}.conv1d.weight"), t);
                        continue;
                    }
                    "mamba.conv_bias" => format!("{m}.conv1d.bias"),
                    "mamba.dt_bias" => format!("{m}.dt_bias"),
                    "mamba.a_log" => format!("{m}.A_log"),
                    "mamba.d" => format!("{m}.D"),
                    "mamba.norm" => format!("{m}.norm.weight"),
                    "mamba.out_proj" => format!("{m}.out_proj.weight"),
                    "attn.qkv" => {
                        let (h, k, d) = (cfg.heads, cfg.kv_heads(), cfg.head_dim);
                        for (proj, first, rows) in [
                            ("q", 0, h * d),
                            ("k", h * d, k * d),
                            ("v", (h + k) * d, k * d),
                        ] {
                            let part = t.narrow(0, first, rows).map_err(bad)?;
                            out.insert(format!("{m}.{proj}_proj.weight"), part);
                        }
                        continue;
                    }
                    "attn.proj" => format!("{m}.o_proj.weight"),
                    "mlp.fc1" => format!("{m}.up_proj.weight"),
                    "mlp.fc2" => format!("{m}.down_proj.weight"),
                    "moe.router" => format!("{m}.gate.weight"),
                    "moe.expert_bias" => format!("{m}.gate.e_score_correction_bias"),
                    "moe.shared.fc1" => format!("{m}.shared_experts.up_proj.weight"),
                    "moe.shared.fc2" => format!("{m}.shared_experts.down_proj.weight"),
                    other => match other
                        .strip_prefix("moe.experts.")
                        .and_then(|rest| rest.split_once('.'))
                    {
                        Some((e, "fc1")) => format!("{m}.experts.{e}.up_proj.weight"),
                        Some((e, "fc2")) => format!("{m}.experts.{e}.down_proj.weight"),
                        _ => return Err(format!("no NemotronH name for the tensor `{name}`")),
                    },
                };
                out.insert(renamed, t.clone());
            }
        }
    }
    Ok((out, mtp))
}

/// `config.json`: every key whose transformers default is not what we compute is written.
fn config(model: &Model) -> Value {
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
        let ours = model_tensors(&m).unwrap();
        let (theirs, mtp) = rename(&m, &ours).unwrap();
        assert!(mtp > 0);
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
        let (theirs, _) = rename(&tied, &model_tensors(&tied).unwrap()).unwrap();
        assert!(theirs.contains_key("lm_head.weight"));
    }
}
