//! `export`: a model as a Hugging Face transformers checkpoint.
//!
//! ```yaml
//! export:
//!   op: export
//!   inputs: {model: "sft:model"}
//!   params: {format: nemotron_h}   # or llama, the default
//! ```
//!
//! Writes `hf/` with `config.json`, `model.safetensors` and the model's `tokenizer.json`, which
//! `transformers.AutoModelForCausalLM.from_pretrained` loads. `format: nemotron_h` writes any
//! hybrid of Mamba-2, attention, MLP and MoE blocks as `NemotronHForCausalLM` ([`nemotron_h`]).
//! `format: llama` writes a dense model as `LlamaForCausalLM`. Only a Llama-shaped model can be
//! exported that way: the pattern alternates attention and MLP (`*-*-…`), with
//! SwiGLU, rotary positions and no MTP. The mapping is a renaming plus two splits — the fused
//! `qkv` into `q_proj`/`k_proj`/`v_proj`, and SwiGLU's stacked `fc1` into `gate_proj`/`up_proj`:
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

mod nemotron_h;

use crate::training::input;
use candle_core::Tensor;
use model::config::{Activation, BlockKind, Position};
use model::net::{Mixer, Model};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::HashMap;
use std::path::Path;
use train::checkpoint;

pub struct Export;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    #[serde(default)]
    pub format: Format,
}

/// The transformers architecture written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// `LlamaForCausalLM`: dense attention/MLP pairs with SwiGLU and RoPE.
    #[default]
    Llama,
    /// `NemotronHForCausalLM`: any pattern of `M`, `*`, `-` and `E`.
    NemotronH,
}

static SPEC: Spec = Spec {
    name: "export",
    version: 1,
    summary: "write a model as a Hugging Face checkpoint: Llama, or NemotronH for hybrids",
    inputs: &[Port {
        name: "model",
        required: true,
        what: "a pretrain, sft, dpo or grpo artifact's model",
    }],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("hf", "hf")]),
    resumable: false,
    launched: false,
};

impl Op for Export {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, _p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        Ok(())
    }

    fn run(&self, params: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let dir = input(ctx, "model")?;
        let model = checkpoint::load_model(&dir)
            .map_err(|e| RunError::new(format!("cannot load the model: {e}")))?;
        let out = ctx.out_dir.join("hf");
        let mut m = Metrics::new();
        let (layers, architecture) = match params.format {
            Format::Llama => (write_llama(&model, &out)?, "Llama"),
            Format::NemotronH => {
                let written = nemotron_h::write(&model, &out)?;
                if written.mtp_tensors > 0 {
                    writeln!(
                        ctx.log,
                        "left out the model's {} MTP tensors: NemotronHForCausalLM has no MTP \
                         depths (transformers ignores mtp.* on load)",
                        written.mtp_tensors
                    )?;
                }
                m.insert(
                    "mtp_tensors_left_out".into(),
                    Value::from(written.mtp_tensors),
                );
                (written.layers, "NemotronH")
            }
        };
        std::fs::copy(dir.join("tokenizer.json"), out.join("tokenizer.json"))?;
        writeln!(
            ctx.log,
            "exported {layers} {architecture} layers to hf/ (config.json, model.safetensors, tokenizer.json)"
        )?;
        m.insert("layers".into(), Value::from(layers));
        m.insert("parameters".into(), Value::from(model.params.count()));
        Ok(m)
    }
}

/// Why a model is not Llama-shaped, or `Ok(number of Llama layers)`.
pub fn llama_layers(model: &Model) -> Result<usize, String> {
    let cfg = &model.cfg;
    let pairs = model.pattern.main.chunks(2);
    let dense = pairs
        .clone()
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

/// Write `config.json` and `model.safetensors` of the Llama equivalent into `out`.
pub fn write_llama(model: &Model, out: &Path) -> Result<usize, RunError> {
    let layers = llama_layers(model).map_err(RunError::new)?;
    let cfg = &model.cfg;
    let (h, k, d) = (cfg.heads, cfg.kv_heads(), cfg.head_dim);
    let e = |e: candle_core::Error| RunError::new(format!("export: {e}"));
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut put = |name: String, t: Tensor| -> Result<(), RunError> {
        tensors.insert(name, t.contiguous().map_err(e)?);
        Ok(())
    };
    put("model.embed_tokens.weight".into(), model.embedding.clone())?;
    for i in 0..layers {
        let (attn_block, mlp_block) = (&model.blocks[2 * i], &model.blocks[2 * i + 1]);
        let (Mixer::Attention(attn), Mixer::Mlp(mlp)) = (&attn_block.mixer, &mlp_block.mixer)
        else {
            return Err(RunError::new("internal: pattern and blocks disagree"));
        };
        let p = format!("model.layers.{i}");
        put(
            format!("{p}.input_layernorm.weight"),
            attn_block.norm.clone(),
        )?;
        put(
            format!("{p}.self_attn.q_proj.weight"),
            attn.qkv.narrow(0, 0, h * d).map_err(e)?,
        )?;
        put(
            format!("{p}.self_attn.k_proj.weight"),
            attn.qkv.narrow(0, h * d, k * d).map_err(e)?,
        )?;
        put(
            format!("{p}.self_attn.v_proj.weight"),
            attn.qkv.narrow(0, (h + k) * d, k * d).map_err(e)?,
        )?;
        put(format!("{p}.self_attn.o_proj.weight"), attn.proj.clone())?;
        put(
            format!("{p}.post_attention_layernorm.weight"),
            mlp_block.norm.clone(),
        )?;
        put(
            format!("{p}.mlp.gate_proj.weight"),
            mlp.fc1.narrow(0, 0, cfg.ffn).map_err(e)?,
        )?;
        put(
            format!("{p}.mlp.up_proj.weight"),
            mlp.fc1.narrow(0, cfg.ffn, cfg.ffn).map_err(e)?,
        )?;
        put(format!("{p}.mlp.down_proj.weight"), mlp.fc2.clone())?;
    }
    put("model.norm.weight".into(), model.final_norm.clone())?;
    if let Some(output) = &model.output {
        put("lm_head.weight".into(), output.clone())?;
    }
    std::fs::create_dir_all(out)?;
    candle_core::safetensors::save(&tensors, out.join("model.safetensors")).map_err(e)?;
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": h,
        "num_key_value_heads": k,
        "head_dim": d,
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
    });
    let text = serde_json::to_string_pretty(&config).map_err(|e| RunError::new(e.to_string()))?;
    std::fs::write(out.join("config.json"), text + "\n")?;
    Ok(layers)
}
