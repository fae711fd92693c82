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
//! `transformers.AutoModelForCausalLM.from_pretrained` loads, and `tokenizer_config.json` with
//! the chat template the model was fine-tuned with plus `generation_config.json` with its stop
//! tokens ([`crate::hf::chat`]), so `AutoTokenizer.apply_chat_template` renders what `pack`
//! trained on and `generate` stops where our `eval` does. `format: llama` writes a dense
//! model as `LlamaForCausalLM` ([`crate::hf::llama`]); `format: nemotron_h` writes any hybrid of
//! Mamba-2, attention, MLP and MoE blocks as `NemotronHForCausalLM` ([`crate::hf::nemotron_h`]).
//! A model the format cannot express fails with the reason, before anything is written.

use crate::hf::{self, llama, nemotron_h};
use crate::training::{carried_template, input, model_tokenizer};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::Value;
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
    // 2: also writes tokenizer_config.json (with the model's chat template) and
    // generation_config.json, and the stop and pad token ids in config.json.
    version: 2,
    summary: "write a model as a Hugging Face checkpoint: Llama, or NemotronH for hybrids",
    inputs: &[Port {
        name: "model",
        required: true,
        what: "a pretrain, sft, dpo, grpo or import_model artifact's model",
    }],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("hf", "hf")]),
    resumable: false,
    launched: false,
    gpu: false,
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
        let (architecture, config, written) = match params.format {
            Format::Llama => {
                llama::check(&model).map_err(RunError::new)?;
                let written = hf::to_theirs(&model, &llama::mapping(&model), |_| false);
                ("Llama", llama::config(&model), written)
            }
            Format::NemotronH => {
                nemotron_h::check(&model)
                    .map_err(|why| RunError::new(format!("no NemotronH equivalent: {why}")))?;
                let mapping = nemotron_h::mapping(&model).map_err(RunError::new)?;
                let written = hf::to_theirs(&model, &mapping, nemotron_h::left_out);
                ("NemotronH", nemotron_h::config(&model), written)
            }
        };
        let (tensors, left_out) = written.map_err(|e| RunError::new(format!("export: {e}")))?;
        let (tokenizer, tokenizer_path) = model_tokenizer(&dir)?;
        let chat_template = carried_template(&[&dir])?;
        let talk = hf::chat::files(&tokenizer, chat_template.as_deref(), model.cfg.max_seq);
        let mut config = config;
        if let Value::Object(c) = &mut config {
            c.extend(talk.config_ids);
        }
        let out = ctx.out_dir.join("hf");
        hf::write_dir(&out, &config, tensors).map_err(RunError::new)?;
        std::fs::copy(tokenizer_path, out.join("tokenizer.json"))?;
        for (name, value) in [
            ("tokenizer_config.json", &talk.tokenizer_config),
            ("generation_config.json", &talk.generation_config),
        ] {
            let text = serde_json::to_string_pretty(value)
                .map_err(|e| RunError::new(format!("{name}: {e}")))?;
            std::fs::write(out.join(name), text + "\n")?;
        }
        if chat_template.is_none() {
            writeln!(
                ctx.log,
                "the model carries no chat template (it was not fine-tuned on chat data), so \
                 tokenizer_config.json has none"
            )?;
        }
        let layers = config["num_hidden_layers"].as_u64().unwrap_or(0);
        if left_out > 0 {
            writeln!(
                ctx.log,
                "left out the model's {left_out} MTP tensors: {architecture}ForCausalLM has no \
                 MTP depths (transformers ignores mtp.* on load)"
            )?;
        }
        writeln!(
            ctx.log,
            "exported {layers} {architecture} layers to hf/ (config.json, model.safetensors, \
             tokenizer.json, tokenizer_config.json, generation_config.json)"
        )?;
        let mut m = Metrics::new();
        m.insert("layers".into(), Value::from(layers));
        m.insert("parameters".into(), Value::from(model.params.count()));
        if params.format == Format::NemotronH {
            m.insert("mtp_tensors_left_out".into(), Value::from(left_out));
        }
        Ok(m)
    }
}
