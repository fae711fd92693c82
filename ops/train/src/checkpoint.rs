//! Checkpoint directories: a model directory ([`model::checkpoint`]) plus the optimizer.
//!
//! A **checkpoint** directory adds `optimizer.safetensors` (AdamW's `m.NAME` and `v.NAME`) and
//! `state.json` (step, AdamW's step count, the curve so far). It is written beside the old one
//! and swapped in by renames, so a kill at any moment leaves a complete checkpoint: either
//! `checkpoint/` or, between the two renames, `checkpoint.old/`.

use crate::Trainer;
use candle_core::{Device, Tensor};
use model::checkpoint::load_weights;
pub use model::checkpoint::{ModelFile, load_model, read_model_file, save_model};
use model::params::to_f32_vec;
use nemo_dag_op::RunError;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

fn bad(e: impl std::fmt::Display) -> RunError {
    RunError::new(e.to_string())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct State {
    step: u64,
    adam_t: u64,
    curve: Vec<crate::Point>,
}

/// Save a full checkpoint into `dir` (replacing what is there, atomically as a directory).
pub fn save(trainer: &Trainer, dir: &Path) -> Result<(), RunError> {
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
pub fn restore(trainer: &mut Trainer, dir: &Path) -> Result<(), RunError> {
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
