//! Finding things without a manifest: which store a command works on, which published key a
//! stage name or key prefix means, and an artifact's ancestors.

use super::{Artifact, RunRecord, Store, short};
use crate::diag::{Failure, InputError, Result};
use serde_json::Value;
use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};

impl Store {
    /// The store of a manifest: `explicit` (`--store`), else `$NEMO_DAG_STORE`, else
    /// `.nemo-dag` beside the manifest.
    pub fn for_manifest(explicit: Option<&Path>, manifest: &Path) -> Store {
        Store::new(named(explicit).unwrap_or_else(|| beside(manifest)))
    }

    /// The store a command without a manifest argument works on: `explicit`, else
    /// `$NEMO_DAG_STORE`, else the one beside `manifest`, else the nearest `.nemo-dag` in the
    /// working directory or a parent.
    pub fn find(explicit: Option<&Path>, manifest: Option<&Path>) -> Result<Store> {
        if let Some(root) = named(explicit) {
            return Ok(Store::new(root));
        }
        if let Some(m) = manifest {
            return Ok(Store::new(beside(m)));
        }
        let mut dir = std::env::current_dir().ok();
        while let Some(d) = dir {
            if d.join(".nemo-dag").is_dir() {
                return Ok(Store::new(d.join(".nemo-dag")));
            }
            dir = d.parent().map(Path::to_path_buf);
        }
        Err(
            InputError::new("no artifact store found (no .nemo-dag here or in a parent directory)")
                .help("pass --store DIR, --manifest FILE, or set NEMO_DAG_STORE")
                .into(),
        )
    }

    /// A stage name (its key in the last run of the manifest) or a key prefix → a published
    /// key. `manifest` narrows the runs searched when several manifests share the store.
    pub fn resolve_target(&self, target: &str, manifest: Option<&Path>) -> Result<String> {
        if let Some(key) = self.resolve_key(target)? {
            return Ok(key);
        }
        if let Some((stage, run)) = target.rsplit_once('@')
            && let Ok(run) = run.parse::<u64>()
        {
            return self.resolve_in_run(stage, run, manifest);
        }
        let wanted = absolute(manifest);
        let mut found: Vec<(String, String)> = self
            .run_records()
            .into_iter()
            .filter(|(_, r)| wanted.as_ref().is_none_or(|w| &r.manifest == w))
            .filter_map(|(_, r)| {
                r.stages
                    .get(target)
                    .map(|k| (r.manifest.clone(), k.clone()))
            })
            .collect();
        in_one_manifest(target, found.iter().map(|(m, _)| m.as_str()))?;
        if found.is_empty() {
            let copies = self.sweep_copies(target, wanted.as_deref());
            if !copies.is_empty() {
                let names: Vec<&str> = copies.iter().map(String::as_str).collect();
                return Err(InputError::new(format!(
                    "`{target}` is a sweep of {} stages: {}",
                    names.len(),
                    names.join(", ")
                ))
                .help(format!(
                    "name one copy, e.g. '{}' (quoted for the shell)",
                    names[0]
                ))
                .into());
            }
        }
        match found.pop() {
            Some((_, key)) if self.is_published(&key) => Ok(key),
            Some((_, key)) => Err(InputError::new(format!(
                "the last run's artifact for `{target}` ({}) is no longer in the store",
                short(&key)
            ))
            .help("run the manifest again to rebuild it")
            .into()),
            None => Err(InputError::new(format!(
                "no artifact for `{target}` in {}",
                self.root.display()
            ))
            .help("give a stage name from a manifest that has been run, or a key (6+ hex digits)")
            .into()),
        }
    }

    /// `stage@run`: the stage's artifact in run `run` of the history.
    fn resolve_in_run(&self, stage: &str, run: u64, manifest: Option<&Path>) -> Result<String> {
        let entry = self.history_entry(run)?;
        // Runs are numbered across the store: run N may be another manifest's.
        if let Some(wanted) = absolute(manifest)
            && entry.manifest != wanted
        {
            return Err(InputError::new(format!(
                "run {run} is of {}, not of {wanted}",
                entry.manifest
            ))
            .help("`nemo-dag runs MANIFEST` lists a manifest's runs with their numbers")
            .into());
        }
        let Some(key) = entry.stages.get(stage).and_then(|s| s.key.clone()) else {
            let names = entry
                .stages
                .iter()
                .filter(|(_, s)| s.key.is_some())
                .map(|(n, _)| n.as_str());
            return Err(
                InputError::new(format!("run {run} has no artifact for `{stage}`"))
                    .help(crate::diag::did_you_mean(stage, "its stages", names))
                    .into(),
            );
        };
        if !self.is_published(&key) {
            return Err(InputError::new(format!(
                "`{stage}` of run {run} ({}) is no longer in the store: `gc` removed it",
                short(&key)
            ))
            .help(format!(
                "the history keeps each run's params and final metrics, not its artifacts: `nemo-dag diff @{run} @N` compares two runs from it"
            ))
            .into());
        }
        Ok(key)
    }

    /// Like [`Store::resolve_target`], but a swept stage's declared name means every copy of
    /// it (in name order) in the newest run that has the stage or its copies.
    pub fn resolve_targets(&self, target: &str, manifest: Option<&Path>) -> Result<Vec<String>> {
        if self.resolve_key(target)?.is_none() {
            let wanted = absolute(manifest);
            let having: Vec<(PathBuf, RunRecord)> = self
                .run_records()
                .into_iter()
                .rev()
                .filter(|(_, r)| wanted.as_ref().is_none_or(|w| &r.manifest == w))
                .filter(|(_, r)| {
                    r.stages.contains_key(target) || !copies_of(&r.stages, target).is_empty()
                })
                .collect();
            in_one_manifest(target, having.iter().map(|(_, r)| r.manifest.as_str()))?;
            let newest = having.into_iter().next();
            if let Some((_, r)) = newest
                && !r.stages.contains_key(target)
            {
                return copies_of(&r.stages, target)
                    .into_iter()
                    .map(|name| self.resolve_target(&name, Some(Path::new(&r.manifest))))
                    .collect();
            }
        }
        Ok(vec![self.resolve_target(target, manifest)?])
    }

    /// The copies of swept stage `base` (`sft[lr=1e-4]`, …) in the last runs: (name, key).
    fn sweep_copies(&self, base: &str, manifest: Option<&str>) -> Vec<String> {
        let copies: BTreeSet<String> = self
            .run_records()
            .into_iter()
            .filter(|(_, r)| manifest.is_none_or(|w| r.manifest == w))
            .flat_map(|(_, r)| copies_of(&r.stages, base))
            .collect();
        copies.into_iter().collect()
    }

    /// A published artifact that must be there (a key from a record or a resolved target).
    pub fn load_existing(&self, key: &str) -> Result<Artifact> {
        self.load(key).ok_or_else(|| {
            Failure::Other(miette::miette!(
                "artifact {key} is missing or unreadable in {}",
                self.root.display()
            ))
        })
    }
}

/// The store named by `--store`, else by `$NEMO_DAG_STORE`.
fn named(explicit: Option<&Path>) -> Option<PathBuf> {
    explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("NEMO_DAG_STORE").map(PathBuf::from))
}

/// `.nemo-dag` in the directory of `manifest`.
fn beside(manifest: &Path) -> PathBuf {
    let abs = std::path::absolute(manifest).unwrap_or_else(|_| manifest.to_path_buf());
    abs.parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
        .join(".nemo-dag")
}

/// Every ancestor of `artifact`, nearest first (breadth-first over `upstream_keys`), each once.
pub fn lineage(store: &Store, artifact: &Artifact) -> Result<Vec<Artifact>> {
    let mut ancestors = Vec::new();
    let mut seen = BTreeSet::new();
    let mut todo: VecDeque<String> = artifact.upstream_keys.iter().cloned().collect();
    while let Some(k) = todo.pop_front() {
        if !seen.insert(k.clone()) {
            continue;
        }
        let a = store.load_existing(&k)?;
        todo.extend(a.upstream_keys.iter().cloned());
        ancestors.push(a);
    }
    Ok(ancestors)
}

/// The artifact as JSON, with output paths made absolute so they can be used directly, and
/// its directory as `dir`.
pub fn artifact_json(store: &Store, artifact: &Artifact) -> Value {
    let dir = store.artifact_dir(&artifact.key);
    let mut v = serde_json::to_value(artifact).unwrap_or(Value::Null);
    if let Some(outputs) = v.get_mut("outputs").and_then(Value::as_object_mut) {
        for out in outputs.values_mut() {
            if let Some(p) = out.get("path").and_then(Value::as_str) {
                let abs = dir.join(p).display().to_string();
                out["path"] = Value::String(abs);
            }
        }
    }
    let events = dir
        .join(crate::tensorboard::DIR)
        .join(crate::tensorboard::safe(&artifact.stage));
    if events.is_dir() {
        v["tensorboard"] = Value::String(events.display().to_string());
    }
    v["dir"] = Value::String(dir.display().to_string());
    v
}

/// The names of a swept stage's copies (`sft[lr=1e-4]`, …) among a run's stages.
fn copies_of(stages: &std::collections::BTreeMap<String, String>, base: &str) -> Vec<String> {
    let prefix = format!("{base}[");
    stages
        .keys()
        .filter(|name| name.starts_with(&prefix) && name.ends_with(']'))
        .cloned()
        .collect()
}

/// A manifest path as run records name it.
pub(super) fn absolute(manifest: Option<&Path>) -> Option<String> {
    manifest.map(|m| {
        std::path::absolute(m)
            .unwrap_or_else(|_| m.to_path_buf())
            .display()
            .to_string()
    })
}

/// An error when the runs that name `target` are of several manifests.
fn in_one_manifest<'a>(target: &str, manifests: impl Iterator<Item = &'a str>) -> Result<()> {
    let manifests: BTreeSet<&str> = manifests.collect();
    if manifests.len() > 1 {
        let list: Vec<&str> = manifests.into_iter().collect();
        return Err(InputError::new(format!(
            "stage `{target}` is in several manifests: {}",
            list.join(", ")
        ))
        .help("add --manifest FILE to say which")
        .into());
    }
    Ok(())
}
