//! Model directories: what `pretrain` and `sft` publish as `model`, and what `sft`, `export`
//! and `eval` read.
//!
//! A **model** directory holds `config.json` (the [`ModelConfig`] plus the vocabulary size),
//! `model.safetensors` (every parameter under its dotted name, and each MoE router's
//! `expert_bias`) and the `tokenizer.json` the model was trained with.

use crate::config::ModelConfig;
use crate::net::Model;
use crate::params::to_f32_vec;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelFile {
    /// Format marker, bumped on incompatible changes.
    pub nemo_dag_model: u32,
    pub vocab: usize,
    pub config: ModelConfig,
}

impl ModelFile {
    /// The `config.json` of a model of `config` over `vocab` tokens.
    pub fn new(config: &ModelConfig, vocab: usize) -> ModelFile {
        ModelFile {
            nemo_dag_model: 1,
            vocab,
            config: config.clone(),
        }
    }
}

fn bad(e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::Msg(e.to_string())
}

/// Every tensor of the model: parameters, then MoE expert biases.
pub fn model_tensors(model: &Model) -> candle_core::Result<HashMap<String, Tensor>> {
    let mut map = HashMap::new();
    for (name, var) in model.params.iter() {
        map.insert(name.to_string(), var.as_tensor().clone());
    }
    for (name, moe) in model.moe_layers() {
        let bias = moe.bias();
        let n = bias.len();
        map.insert(name, Tensor::from_vec(bias, n, &Device::Cpu).map_err(bad)?);
    }
    Ok(map)
}

/// Write `config.json` and `model.safetensors` into `dir` (created if needed).
pub fn save_model(model: &Model, dir: &Path) -> candle_core::Result<()> {
    std::fs::create_dir_all(dir)?;
    let file = ModelFile::new(&model.cfg, model.vocab);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&file).map_err(bad)? + "\n",
    )?;
    candle_core::safetensors::save(&model_tensors(model)?, dir.join("model.safetensors"))
        .map_err(bad)
}

/// Read a model directory's `config.json`.
pub fn read_model_file(dir: &Path) -> candle_core::Result<ModelFile> {
    let path = dir.join("config.json");
    let text =
        std::fs::read_to_string(&path).map_err(|e| bad(format!("{}: {e}", path.display())))?;
    let file: ModelFile = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "{} is not a nemo-dag model config: {e}",
            path.display()
        ))
    })?;
    if file.nemo_dag_model != 1 {
        return Err(bad(format!(
            "{}: model format {} is not supported by this nemo-dag",
            path.display(),
            file.nemo_dag_model
        )));
    }
    Ok(file)
}

/// Load a model directory: build the model from its config and overwrite every parameter.
pub fn load_model(dir: &Path) -> candle_core::Result<Model> {
    let file = read_model_file(dir)?;
    let model = Model::new(&file.config, file.vocab, 0).map_err(bad)?;
    load_weights(&model, &dir.join("model.safetensors"))?;
    Ok(model)
}

/// Overwrite every parameter (and MoE expert bias) of `model` with the tensors of `path`.
pub fn load_weights(model: &Model, path: &Path) -> candle_core::Result<()> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| bad(format!("{}: {e}", path.display())))?;
    set_tensors(model, &tensors, &path.display().to_string())
}

/// Overwrite every parameter (and MoE expert bias) of `model` with the tensor of its name in
/// `tensors` (read from `from`, for messages). A missing tensor or one of another shape is an
/// error naming it; nothing is left at its initial value.
pub fn set_tensors(
    model: &Model,
    tensors: &HashMap<String, Tensor>,
    from: &str,
) -> candle_core::Result<()> {
    for (name, var) in model.params.iter() {
        let t = tensors
            .get(name)
            .ok_or_else(|| bad(format!("{from} has no tensor `{name}`")))?;
        if t.dims() != var.dims() {
            return Err(bad(format!(
                "{from}: `{name}` has shape {:?}, the model needs {:?}",
                t.dims(),
                var.dims()
            )));
        }
        var.set(t).map_err(bad)?;
    }
    for (name, moe) in model.moe_layers() {
        let t = tensors
            .get(&name)
            .ok_or_else(|| bad(format!("{from} has no tensor `{name}`")))?;
        moe.set_bias(&to_f32_vec(t).map_err(bad)?).map_err(bad)?;
    }
    Ok(())
}
