//! The built-in ops of nemo-dag: what a stage *does*.
//!
//! An op is a plain Rust value implementing the protocol of the `nemo-dag-op` crate
//! ([`nemo_dag_op::Op`]); [`registry`] lists them for the `nemo-dag` binary, which hands the
//! list to the engine. The engine never depends on this crate.
//!
//! Ops in this crate:
//! - [`cmd`]: run any external program through `sh -c`, with shell-quoted placeholders.
//! - [`generate`]: synthetic, exactly checkable data (arithmetic) for the tiny recipes.
//! - [`train_tokenizer`]: train a byte-level BPE `tokenizer.json` on a corpus.
//! - [`tokenize`]: text datasets → Megatron `.bin`/`.idx` shards and `blend.json`.
//! - [`pack`]: chat JSONL → chat-templated, loss-masked, packed Parquet SFT shards.
//! - [`rl_data`]: prompts with verifiable answers → NeMo-Gym-shaped RL JSONL.
//! - [`pretrain`]: train a model from scratch on tokenized data.
//! - [`sft`]: fine-tune an upstream model on packed chat data.
//! - [`dpo`]: direct preference optimization of an upstream model on chosen/rejected pairs.
//! - [`grpo`]: reinforcement learning (GRPO) on prompts with verifiable answers.
//! - [`export`]: a model as a Hugging Face checkpoint (Llama, or NemotronH for hybrids).
//! - [`import_model`]: a Hugging Face checkpoint (Llama, Mistral, NemotronH) as a model.
//! - [`import`]: a file or directory from outside the store as an artifact, with its origin.
//! - [`eval`]: perplexity, multiple-choice log-likelihood and verifiable generation accuracy.
//! - [`megatron`]: `megatron_pretrain` and `megatron_sft`, the same stages at real scale, run by
//!   NVIDIA Megatron-Bridge on a Slurm cluster, and `megatron_export`, its checkpoint as a
//!   Hugging Face model.
//! - [`nemo_rl`]: `nemo_rl_grpo`, GRPO at real scale by NVIDIA NeMo-RL and NeMo-Gym.
//!
//! Each file is an op's params, its spec, its checks and the wiring of its `run` (`training.rs`
//! holds what the training ops share, `hf/` the Hugging Face layouts export and import share); the formats live in
//! `nemo-dag-data`, the networks in `nemo-dag-model`, the training loop and the DPO/GRPO
//! algorithms in `nemo-dag-train` (docs/architecture.md).

pub mod cmd;
pub mod dpo;
pub mod eval;
pub mod export;
pub mod generate;
pub mod gpu_check;
pub mod grpo;
pub mod hf;
pub mod import;
pub mod import_model;
pub mod megatron;
pub mod nemo_rl;
pub mod pack;
pub mod pretrain;
pub mod rl_data;
pub mod saves;
pub mod sft;
#[cfg(test)]
mod testing;
pub mod tokenize;
pub mod train_tokenizer;
mod training;

use nemo_dag_op::{AnyOp, Registry, RunError};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Every built-in op, in the order `nemo-dag` lists them.
pub fn registry() -> Registry {
    static OPS: &[&dyn AnyOp] = &[
        &cmd::Cmd,
        &generate::Generate,
        &train_tokenizer::TrainTokenizer,
        &tokenize::Tokenize,
        &pack::Pack,
        &rl_data::RlData,
        &pretrain::Pretrain,
        &sft::Sft,
        &dpo::Dpo,
        &grpo::Grpo,
        &export::Export,
        &import_model::ImportModel,
        &import::Import,
        &eval::Eval,
        &megatron::Megatron(megatron::Mode::Pretrain),
        &megatron::Megatron(megatron::Mode::Sft),
        &megatron::export::MegatronExport,
        &nemo_rl::NemoRlGrpo,
    ];
    Registry::new(OPS).with_gpu_probe(probe_gpu)
}

/// CUDA device `ordinal` as the kernels crate finds it: its description, or what is missing.
/// Where the SIMT shim stands in for a GPU ([`training::SHIM_VAR`]), any ordinal is it.
fn probe_gpu(ordinal: usize) -> Result<String, String> {
    if training::shim_stands_in() {
        return Ok(format!(
            "the SIMT shim as cuda:{ordinal} ({}=1: the GPU path's kernels on the CPU)",
            training::SHIM_VAR
        ));
    }
    kernels::cuda::Gpu::probe(ordinal)
        .map(|gpu| gpu.to_string())
        .map_err(|why| why.to_string())
}

/// The stage's `tokenizer` input, loaded (`tokenize` and `pack` take one); returns its path too.
pub(crate) fn load_tokenizer(
    inputs: &BTreeMap<String, PathBuf>,
) -> Result<(tokenizers::Tokenizer, PathBuf), RunError> {
    let given = inputs
        .get("tokenizer")
        .ok_or_else(|| RunError::new("no `tokenizer` input"))?;
    // A directory (a Hugging Face one, or an `import` of a tokenizer file) holds tokenizer.json.
    let within = given.join("tokenizer.json");
    let path = if given.is_dir() && within.is_file() {
        &within
    } else {
        given
    };
    let tokenizer = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| RunError::new(format!("cannot load tokenizer {}: {e}", path.display())))?;
    Ok((tokenizer, path.to_path_buf()))
}

/// A number as Python's `str(float)` prints it (`1.0`, `0.5`): a blend weight as `blend.json`
/// holds it, a float Hydra reads as one.
pub(crate) fn format_weight(w: f64) -> String {
    if w.fract() == 0.0 {
        format!("{w:.1}")
    } else {
        format!("{w}")
    }
}
