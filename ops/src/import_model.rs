//! `import_model`: a Hugging Face checkpoint directory as a model artifact, which `sft`, `dpo`,
//! `grpo`, `eval` and `export` take like one of ours.
//!
//! ```yaml
//! base:
//!   op: import_model
//!   inputs: {hf: ../models/my-llama}          # a directory, or another stage's `hf` output
//!   params: {source: "my-org/my-llama@3f2c1a"} # optional: where it came from, for lineage
//! ```
//!
//! The directory holds `config.json`, `model.safetensors` (or the shards that
//! `model.safetensors.index.json` lists; f32, bf16 or f16) and `tokenizer.json`. The input is
//! content-hashed like any other, so a changed checkpoint is imported again. Read:
//! `LlamaForCausalLM` and `MistralForCausalLM` without a sliding window ([`crate::hf::llama`]),
//! and `NemotronHForCausalLM` ([`crate::hf::nemotron_h`]). Every option we do not implement
//! (biases, rope scaling, sliding windows, LatentMoE, a Mamba step-size floor, …) is an error
//! that names it, and so is a tensor that would have no place in the model: the artifact is
//! never a silently different model. Weights are stored as f32. The checkpoint's chat template
//! (`chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`) stays with the model,
//! so `sft` on it and `export` of it keep it.

use crate::hf::{self, llama, nemotron_h};
use crate::training::input;
use candle_core::Tensor;
use model::checkpoint::{save_model, set_tensors};
use model::net::Model;
use nemo_dag_data::chat::{CHAT_TEMPLATE_FILE, TemplateSource, load_template};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;

pub struct ImportModel;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// Where the checkpoint came from (a hub repository and revision, a URL): recorded in the
    /// artifact's metrics, part of the key.
    #[serde(default)]
    pub source: Option<String>,
}

static SPEC: Spec = Spec {
    name: "import_model",
    // 2: the model keeps the checkpoint's chat template (`chat_template.jinja`).
    version: 2,
    summary: "read a Hugging Face checkpoint (Llama, Mistral, NemotronH) as a model artifact",
    inputs: &[Port {
        name: "hf",
        required: true,
        what: "a Hugging Face model directory: config.json, safetensors, tokenizer.json",
    }],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("model", "model")]),
    resumable: false,
    launched: false,
    gpu: false,
};

const ARCHITECTURES: &str = "LlamaForCausalLM, MistralForCausalLM, NemotronHForCausalLM";

impl Op for ImportModel {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, _p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        Ok(())
    }

    fn run(&self, params: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let dir = input(ctx, "hf")?;
        let at = |why: String| RunError::new(format!("{}: {why}", dir.display()));
        let tokenizer = dir.join("tokenizer.json");
        if !tokenizer.is_file() {
            return Err(at(
                "no tokenizer.json: the ops that take a model read its tokenizer from it".into(),
            ));
        }
        let (config, tensors) = hf::read_dir(&dir).map_err(RunError::new)?;
        let architecture = config["architectures"][0]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let (model, ignored) = match architecture.as_str() {
            "LlamaForCausalLM" | "MistralForCausalLM" => {
                let (cfg, vocab) = llama::model_config(&config).map_err(at)?;
                embedding_fits(&tensors, "model.embed_tokens.weight", vocab, cfg.hidden)
                    .map_err(at)?;
                let model = Model::new(&cfg, vocab, 0).map_err(|e| at(e.to_string()))?;
                let (ours, ignored) = hf::to_ours(&tensors, &llama::mapping(&model), |n| {
                    n.ends_with("rotary_emb.inv_freq")
                })
                .map_err(at)?;
                set_tensors(&model, &ours, "the checkpoint").map_err(|e| at(e.to_string()))?;
                (model, ignored)
            }
            "NemotronHForCausalLM" => {
                let (cfg, vocab) = nemotron_h::model_config(&config).map_err(at)?;
                let theirs = nemotron_h::hub_layout(tensors).map_err(at)?;
                embedding_fits(&theirs, "backbone.embeddings.weight", vocab, cfg.hidden)
                    .map_err(at)?;
                let model = Model::new(&cfg, vocab, 0).map_err(|e| at(e.to_string()))?;
                let mapping = nemotron_h::mapping(&model).map_err(at)?;
                let (ours, ignored) =
                    hf::to_ours(&theirs, &mapping, nemotron_h::ignored).map_err(at)?;
                set_tensors(&model, &ours, "the checkpoint").map_err(|e| at(e.to_string()))?;
                (model, ignored)
            }
            "" => return Err(at("config.json names no `architectures`".into())),
            other => {
                return Err(at(format!(
                    "`{other}` cannot be imported; these can: {ARCHITECTURES}"
                )));
            }
        };
        let out = ctx.out_dir.join("model");
        save_model(&model, &out).map_err(|e| RunError::new(e.to_string()))?;
        std::fs::copy(&tokenizer, out.join("tokenizer.json"))?;
        let template = chat_template(&dir).map_err(at)?;
        if let Some(text) = &template {
            std::fs::write(out.join(CHAT_TEMPLATE_FILE), text)?;
        }
        let pattern = model.cfg.pattern.clone();
        writeln!(
            ctx.log,
            "imported {architecture} from {} as pattern `{pattern}`: {} parameters, vocabulary {}",
            params
                .source
                .as_deref()
                .unwrap_or(&dir.display().to_string()),
            model.params.count(),
            model.vocab
        )?;
        if ignored > 0 {
            writeln!(
                ctx.log,
                "left out {ignored} tensors with no place in the model (MTP depths, rotary tables)"
            )?;
        }
        let mut m = Metrics::new();
        m.insert("architecture".into(), Value::from(architecture));
        m.insert("pattern".into(), Value::from(pattern));
        m.insert("parameters".into(), Value::from(model.params.count()));
        m.insert("tensors_left_out".into(), Value::from(ignored));
        if let Some(source) = &params.source {
            m.insert("source".into(), Value::from(source.clone()));
        }
        Ok(m)
    }
}

/// Before a model of the config's size is allocated: the checkpoint's embedding has the shape
/// the config says (a wrong `vocab_size` or `hidden_size` is an error, not an allocation).
fn embedding_fits(
    tensors: &HashMap<String, Tensor>,
    name: &str,
    vocab: usize,
    hidden: usize,
) -> Result<(), String> {
    match tensors.get(name) {
        Some(t) if t.dims() == [vocab, hidden] => Ok(()),
        Some(t) => Err(format!(
            "`{name}` has shape {:?}, but config.json says vocab_size {vocab} × hidden_size {hidden}",
            t.dims()
        )),
        None => Err(format!("the checkpoint has no tensor `{name}`")),
    }
}

/// The checkpoint's chat template, as transformers finds it: `chat_template.jinja`, else
/// `tokenizer_config.json`'s `chat_template` (a string, or the `default` of a list); none when
/// neither is there.
fn chat_template(dir: &Path) -> Result<Option<String>, String> {
    let file = dir.join(CHAT_TEMPLATE_FILE);
    let config = dir.join("tokenizer_config.json");
    let source = if file.is_file() {
        TemplateSource::File(file)
    } else if config.is_file() {
        let text =
            std::fs::read_to_string(&config).map_err(|e| format!("{}: {e}", config.display()))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| format!("{} is not JSON: {e}", config.display()))?;
        if json.get("chat_template").is_none_or(Value::is_null) {
            return Ok(None);
        }
        TemplateSource::TokenizerConfig(config)
    } else {
        return Ok(None);
    };
    load_template(&source).map(Some).map_err(|e| e.to_string())
}
