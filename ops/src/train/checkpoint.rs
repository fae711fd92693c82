//! Model and checkpoint directories.
//!
//! A **model** directory (what `pretrain` and `sft` publish as `model`, what `sft` and `export`
//! read) holds `config.json` (the [`ModelConfig`] plus the vocabulary size), `model.safetensors`
//! (every parameter under its dotted name, and each MoE router's `expert_bias`) and the
//! `tokenizer.json` the model was trained with.
//!
//! A **checkpoint** directory adds `optimizer.safetensors` (AdamW's `m.NAME` and `v.NAME`) and
//! `state.json` (step, AdamW's step count, the curve so far). It is written beside the old one
//! and swapped in by renames, so a kill at any moment leaves a complete checkpoint: either
//! `checkpoint/` or, between the two renames, `checkpoint.old/`.

use super::Trainer;
use crate::model::config::ModelConfig;
use crate::model::net::Model;
use crate::model::params::to_f32_vec;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelFile {
    /// Format marker, bumped on incompatible changes.
    pub nemo_dag_model: u32,
    pub vocab: usize,
    pub config: ModelConfig,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct State {
    step: u64,
    adam_t: u64,
    curve: Vec<super::Point>,
}

fn bad(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

/// Every tensor of the model: parameters, then MoE expert biases.
fn model_tensors(model: &Model) -> io::Result<HashMap<String, Tensor>> {
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
pub fn save_model(model: &Model, dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let file = ModelFile {
        nemo_dag_model: 1,
        vocab: model.vocab,
        config: model.cfg.clone(),
    };
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&file).map_err(bad)? + "\n",
    )?;
    candle_core::safetensors::save(&model_tensors(model)?, dir.join("model.safetensors"))
        .map_err(bad)
}

/// Read a model directory's `config.json`.
pub fn read_model_file(dir: &Path) -> io::Result<ModelFile> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
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
pub fn load_model(dir: &Path) -> io::Result<Model> {
    let file = read_model_file(dir)?;
    let model = Model::new(&file.config, file.vocab, 0).map_err(bad)?;
    load_weights(&model, &dir.join("model.safetensors"))?;
    Ok(model)
}

fn load_weights(model: &Model, path: &Path) -> io::Result<()> {
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| bad(format!("{}: {e}", path.display())))?;
    for (name, var) in model.params.iter() {
        let t = tensors
            .get(name)
            .ok_or_else(|| bad(format!("{} has no tensor `{name}`", path.display())))?;
        if t.dims() != var.dims() {
            return Err(bad(format!(
                "{}: `{name}` has shape {:?}, the model needs {:?}",
                path.display(),
                t.dims(),
                var.dims()
            )));
        }
        var.set(t).map_err(bad)?;
    }
    for (name, moe) in model.moe_layers() {
        let t = tensors
            .get(&name)
            .ok_or_else(|| bad(format!("{} has no tensor `{name}`", path.display())))?;
        moe.set_bias(&to_f32_vec(t).map_err(bad)?).map_err(bad)?;
    }
    Ok(())
}

/// Save a full checkpoint into `dir` (replacing what is there, atomically as a directory).
pub fn save(trainer: &Trainer, dir: &Path) -> io::Result<()> {
    let tmp = sibling(dir, "tmp");
    let old = sibling(dir, "old");
    let _ = std::fs::remove_dir_all(&tmp);
    save_model(&trainer.model, &tmp)?;
    let mut moments = HashMap::new();
    for (i, (name, var)) in trainer.model.params.iter().enumerate() {
        for (prefix, data) in [("m", &trainer.opt.m[i]), ("v", &trainer.opt.v[i])] {
            let t = Tensor::from_vec(data.clone(), var.shape(), &Device::Cpu).map_err(bad)?;
            moments.insert(format!("{prefix}.{name}"), t);
        }
    }
    candle_core::safetensors::save(&moments, tmp.join("optimizer.safetensors")).map_err(bad)?;
    let state = State {
        step: trainer.step,
        adam_t: trainer.opt.t,
        curve: trainer.curve.clone(),
    };
    std::fs::write(
        tmp.join("state.json"),
        serde_json::to_string_pretty(&state).map_err(bad)? + "\n",
    )?;
    let _ = std::fs::remove_dir_all(&old);
    if dir.exists() {
        std::fs::rename(dir, &old)?;
    }
    std::fs::rename(&tmp, dir)?;
    let _ = std::fs::remove_dir_all(&old);
    Ok(())
}

/// The checkpoint a resumed run should load, if any (`dir`, or `dir.old` after a kill
/// between the two renames of [`save`]).
pub fn latest(dir: &Path) -> Option<PathBuf> {
    [dir.to_path_buf(), sibling(dir, "old")]
        .into_iter()
        .find(|d| d.join("state.json").is_file())
}

/// Restore weights, optimizer and progress from a checkpoint directory.
pub fn restore(trainer: &mut Trainer, dir: &Path) -> io::Result<()> {
    let file = read_model_file(dir)?;
    if file.config != trainer.model.cfg || file.vocab != trainer.model.vocab {
        return Err(bad(format!(
            "{} was written for another model config; delete it to start over",
            dir.display()
        )));
    }
    load_weights(&trainer.model, &dir.join("model.safetensors"))?;
    let path = dir.join("optimizer.safetensors");
    let moments = candle_core::safetensors::load(&path, &Device::Cpu)
        .map_err(|e| bad(format!("{}: {e}", path.display())))?;
    for (i, (name, _)) in trainer.model.params.iter().enumerate() {
        for (prefix, slot) in [("m", &mut trainer.opt.m[i]), ("v", &mut trainer.opt.v[i])] {
            let t = moments
                .get(&format!("{prefix}.{name}"))
                .ok_or_else(|| bad(format!("{} has no `{prefix}.{name}`", path.display())))?;
            let data = to_f32_vec(t).map_err(bad)?;
            if data.len() != slot.len() {
                return Err(bad(format!(
                    "{}: `{prefix}.{name}` has the wrong size",
                    path.display()
                )));
            }
            *slot = data;
        }
    }
    let text = std::fs::read_to_string(dir.join("state.json"))?;
    let state: State = serde_json::from_str(&text).map_err(bad)?;
    trainer.step = state.step;
    trainer.opt.t = state.adam_t;
    trainer.curve = state.curve;
    Ok(())
}

fn sibling(dir: &Path, suffix: &str) -> PathBuf {
    let mut name = dir
        .file_name()
        .map(|n| n.to_os_string())
        .unwrap_or_default();
    name.push(format!(".{suffix}"));
    dir.with_file_name(name)
}
