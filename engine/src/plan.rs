//! Plans: whether each stage's key is already in the store, and why not (the key itself is
//! [`crate::key`]).

use crate::diag::{InputError, Result};
use crate::digest::Digester;
use crate::key::stage_key;
use crate::manifest::{Input, Manifest, Stage};
use crate::store::{Artifact, InputRecord, Published, RunRecord, Store};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// A stage whose inputs are all known: its key and the records of what it consumes.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub key: String,
    pub inputs: BTreeMap<String, InputRecord>,
    pub upstream_keys: Vec<String>,
}

/// Resolve a stage whose upstream artifacts are all known; `None` if one is not.
pub fn resolve(
    manifest: &Manifest,
    stage: &Stage,
    upstream: &HashMap<String, Published>,
    digester: &mut Digester,
) -> Result<Option<Resolved>, InputError> {
    let mut inputs = BTreeMap::new();
    let mut upstream_keys = Vec::new();
    for (name, input) in &stage.inputs {
        let record = match input {
            Input::File { written, path } => {
                file_input(manifest, stage, name, written, path, digester)?
            }
            Input::Stage { stage: up, output } => {
                let Some(published) = upstream.get(up) else {
                    return Ok(None);
                };
                let Some(digest) = published.outputs.get(output) else {
                    return Ok(None);
                };
                upstream_keys.push(published.key.clone());
                InputRecord::Upstream {
                    stage: up.clone(),
                    output: output.clone(),
                    key: published.key.clone(),
                    digest: digest.clone(),
                }
            }
        };
        inputs.insert(name.clone(), record);
    }
    upstream_keys.sort();
    upstream_keys.dedup();
    Ok(Some(Resolved {
        key: stage_key(stage, &inputs),
        inputs,
        upstream_keys,
    }))
}

/// The record of one input file or directory, its digest computed (or remembered).
fn file_input(
    manifest: &Manifest,
    stage: &Stage,
    name: &str,
    written: &str,
    path: &std::path::Path,
    digester: &mut Digester,
) -> Result<InputRecord, InputError> {
    let digest = digester.digest(path).map_err(|e| {
        manifest.error_at(
            &["stages", &stage.name, "inputs", name],
            format!("input `{name}` ({written}): {e}"),
        )
    })?;
    Ok(InputRecord::File {
        path: path.display().to_string(),
        digest,
    })
}

/// Digest every file input of the `selected` stages: a run reads all of its inputs before it
/// writes anything, so an unreadable one stops it with nothing written.
pub fn check_file_inputs(
    manifest: &Manifest,
    selected: &std::collections::BTreeSet<String>,
    digester: &mut Digester,
) -> Result<(), InputError> {
    for name in manifest.order.iter().filter(|n| selected.contains(*n)) {
        let stage = &manifest.stages[name];
        for (input, source) in &stage.inputs {
            if let Input::File { written, path } = source {
                file_input(manifest, stage, input, written, path, digester)?;
            }
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freshness {
    UpToDate,
    Stale,
    PendingUpstream,
}

impl Freshness {
    pub fn as_str(self) -> &'static str {
        match self {
            Freshness::UpToDate => "up-to-date",
            Freshness::Stale => "stale",
            Freshness::PendingUpstream => "pending-upstream",
        }
    }
}

#[derive(Debug, Clone)]
pub struct StagePlan {
    pub name: String,
    pub freshness: Freshness,
    pub key: Option<String>,
    pub reasons: Vec<String>,
    /// For a stage that would run: what its artifact in the last recorded run took, the
    /// likeliest cost of running it again.
    pub last_run: Option<LastRun>,
}

/// What one run of a stage took, from its artifact.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LastRun {
    pub key: String,
    pub seconds: f64,
    /// User and system CPU seconds together.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_seconds: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_rss_bytes: Option<u64>,
}

impl LastRun {
    pub fn of(a: &Artifact) -> LastRun {
        let r = a.resources.as_ref();
        LastRun {
            key: a.key.clone(),
            seconds: a.seconds,
            cpu_seconds: r.and_then(|r| Some(r.cpu_user_seconds? + r.cpu_system_seconds?)),
            peak_rss_bytes: r.map(|r| r.peak_rss_bytes),
        }
    }
}

impl std::fmt::Display for LastRun {
    /// `2m 41s, 5m 02s CPU, 1.4 GiB peak`
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", duration(self.seconds))?;
        if let Some(cpu) = self.cpu_seconds {
            write!(f, ", {} CPU", duration(cpu))?;
        }
        if let Some(peak) = self.peak_rss_bytes {
            write!(f, ", {} peak", nemo_dag_op::plan::bytes(peak))?;
        }
        Ok(())
    }
}

/// `rerun: 3 stage(s); 2 of them took 7m 31s together in their last runs (12m 02s CPU); 1
/// without a last run to go by`, from the last run of each stage that would run; `None` when
/// none would.
pub fn rerun_cost<'a>(would_run: impl IntoIterator<Item = Option<&'a LastRun>>) -> Option<String> {
    let rerun: Vec<Option<&LastRun>> = would_run.into_iter().collect();
    if rerun.is_empty() {
        return None;
    }
    let known: Vec<&LastRun> = rerun.iter().flatten().copied().collect();
    let mut text = format!("rerun: {} stage(s)", rerun.len());
    if !known.is_empty() {
        let seconds: f64 = known.iter().map(|l| l.seconds).sum();
        let cpu: Option<f64> = known.iter().map(|l| l.cpu_seconds).sum();
        text.push_str(&format!(
            "; {} of them took {} together in their last runs",
            known.len(),
            duration(seconds)
        ));
        if let Some(cpu) = cpu {
            text.push_str(&format!(" ({} CPU)", duration(cpu)));
        }
    }
    let never = rerun.len() - known.len();
    if never > 0 {
        text.push_str(&format!("; {never} without a last run to go by"));
    }
    Some(text)
}

/// Seconds as people read them: `0.17s`, `4.2s`, `2m 41s`, `3h 07m`.
pub fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0);
    if s < 1.0 {
        return format!("{s:.2}s");
    }
    if s < 60.0 {
        return format!("{s:.1}s");
    }
    let whole = s.round() as u64;
    if whole < 3600 {
        format!("{}m {:02}s", whole / 60, whole % 60)
    } else {
        format!("{}h {:02}m", whole / 3600, (whole % 3600) / 60)
    }
}

/// What `status` shows: each stage's freshness against the store, and why it is not fresh,
/// compared with the last recorded run of this manifest. Reads only; writes nothing.
pub fn plan(manifest: &Manifest, store: &Store, digester: &mut Digester) -> Result<Vec<StagePlan>> {
    let record = last_run_record(manifest, store);
    let previous = &record.stages;
    let mut known: HashMap<String, Published> = HashMap::new();
    let mut out = Vec::new();
    let mut fresh: HashMap<&str, Freshness> = HashMap::new();
    for name in &manifest.order {
        let stage = &manifest.stages[name];
        let resolved = resolve(manifest, stage, &known, digester)?;
        // The previous artifact is only read to explain a stage that is not up to date.
        let prev = || previous.get(name).and_then(|k| store.load(k));
        let (freshness, key, reasons, last_run) = match &resolved {
            Some(r) => match store.lookup(&r.key, digester) {
                Ok(Some(published)) => {
                    known.insert(name.clone(), published);
                    (Freshness::UpToDate, Some(r.key.clone()), Vec::new(), None)
                }
                Err(damage) => (Freshness::Stale, Some(r.key.clone()), vec![damage], None),
                Ok(None) => {
                    let prev = prev();
                    let mut reasons = why_stale(stage, Some(r), prev.as_ref(), &fresh);
                    if reasons.is_empty() {
                        reasons.push(if previous.get(name) == Some(&r.key) {
                            "artifact missing from the store".to_string()
                        } else {
                            "no artifact with this key".to_string()
                        });
                    }
                    let last = prev.as_ref().map(LastRun::of);
                    (Freshness::Stale, Some(r.key.clone()), reasons, last)
                }
            },
            None => {
                let prev = prev();
                let reasons = why_stale(stage, None, prev.as_ref(), &fresh);
                let last = prev.as_ref().map(LastRun::of);
                (Freshness::PendingUpstream, None, reasons, last)
            }
        };
        fresh.insert(name.as_str(), freshness);
        out.push(StagePlan {
            name: name.clone(),
            freshness,
            key,
            reasons,
            last_run,
        });
    }
    Ok(out)
}

/// The last recorded run of this manifest (and variant); empty if there is none.
pub fn last_run_record(manifest: &Manifest, store: &Store) -> RunRecord {
    std::fs::read(store.run_record_path(&run_id(manifest)))
        .ok()
        .and_then(|b| serde_json::from_slice::<RunRecord>(&b).ok())
        .unwrap_or_default()
}

/// One run record per manifest file and variant.
pub fn run_id(manifest: &Manifest) -> String {
    let stem = manifest.name();
    let variant = manifest
        .variant
        .as_ref()
        .map(|v| v.display().to_string())
        .unwrap_or_default();
    let id = blake3::hash(format!("{}\n{variant}", manifest.path.display()).as_bytes());
    format!("{stem}-{}", &id.to_hex()[..12])
}

/// The key components that differ from the previous artifact of this stage.
fn why_stale(
    stage: &Stage,
    now: Option<&Resolved>,
    prev: Option<&Artifact>,
    fresh: &HashMap<&str, Freshness>,
) -> Vec<String> {
    let mut reasons = Vec::new();
    let Some(prev) = prev else {
        reasons.push("never run".to_string());
        return reasons;
    };
    let declared = Declared {
        op: stage.op.name(),
        op_version: stage.op.version(),
        params: &stage.params,
        cmd: stage.cmd.as_deref(),
    };
    declared.changes_since(prev, &mut reasons);
    let prev_outputs: BTreeMap<&String, &String> =
        prev.outputs.iter().map(|(k, v)| (k, &v.path)).collect();
    let declared_changed = prev_outputs.len() != stage.outputs.len()
        || stage
            .outputs
            .iter()
            .any(|(k, v)| prev_outputs.get(k).map(|p| p.strip_prefix("out/")) != Some(Some(v)));
    if declared_changed {
        reasons.push("outputs changed".to_string());
    }
    for (name, input) in &stage.inputs {
        let before = prev.inputs.get(name);
        match input {
            Input::File { written, .. } => {
                let after = now.and_then(|r| r.inputs.get(name));
                match (before, after) {
                    (None, _) => reasons.push(format!("input {name} added")),
                    (Some(b), Some(a)) if b.digest() != a.digest() => {
                        reasons.push(format!("input {name} changed ({written})"))
                    }
                    _ => {}
                }
            }
            Input::Stage { stage: up, .. } => {
                let after = now.and_then(|r| r.inputs.get(name));
                match (before, after) {
                    (None, _) => reasons.push(format!("input {name} added")),
                    (Some(b), Some(a)) if b.digest() != a.digest() => {
                        reasons.push(format!("upstream {up} changed"))
                    }
                    (Some(_), None) => {
                        let state = fresh.get(up.as_str()).copied();
                        if state != Some(Freshness::UpToDate) {
                            reasons.push(format!("upstream {up} is not up to date"));
                        }
                    }
                    _ => {}
                }
            }
        }
    }
    for name in prev.inputs.keys() {
        if !stage.inputs.contains_key(name) {
            reasons.push(format!("input {name} removed"));
        }
    }
    reasons.dedup();
    reasons
}

/// Why a stage was built again: what its key covers that differs between the artifact of its
/// previous run and the one this run published.
pub fn why_built(prev: Option<&Artifact>, now: &Artifact) -> Vec<String> {
    let Some(prev) = prev else {
        return vec!["never run".to_string()];
    };
    if prev.key == now.key {
        return vec!["the same key as before: forced, or its artifact was gone".to_string()];
    }
    let mut reasons = Vec::new();
    let declared = Declared {
        op: &now.op,
        op_version: now.op_version,
        params: &now.params,
        cmd: now.cmd.as_deref(),
    };
    declared.changes_since(prev, &mut reasons);
    let paths = |a: &Artifact| -> Vec<(String, String)> {
        a.outputs
            .iter()
            .map(|(k, o)| (k.clone(), o.path.clone()))
            .collect()
    };
    if paths(prev) != paths(now) {
        reasons.push("outputs changed".to_string());
    }
    for (name, input) in &now.inputs {
        match (prev.inputs.get(name), input) {
            (None, _) => reasons.push(format!("input {name} added")),
            (Some(b), a) if b.digest() == a.digest() => {}
            (Some(_), InputRecord::Upstream { stage, .. }) => {
                reasons.push(format!("upstream {stage} changed"))
            }
            (Some(_), InputRecord::File { path, .. }) => {
                reasons.push(format!("input {name} changed ({path})"))
            }
        }
    }
    for name in prev.inputs.keys() {
        if !now.inputs.contains_key(name) {
            reasons.push(format!("input {name} removed"));
        }
    }
    reasons
}

/// What a stage declares that its key covers, besides its inputs and outputs.
struct Declared<'a> {
    op: &'a str,
    op_version: u32,
    params: &'a Value,
    cmd: Option<&'a str>,
}

impl Declared<'_> {
    /// The op, its version, each param by path, and the command, where they differ from
    /// `prev`'s.
    fn changes_since(&self, prev: &Artifact, out: &mut Vec<String>) {
        if prev.op != self.op {
            out.push(format!("op {} → {}", prev.op, self.op));
        } else if prev.op_version != self.op_version {
            out.push(format!(
                "op version {} → {}",
                prev.op_version, self.op_version
            ));
        }
        diff_values("params", &prev.params, self.params, out);
        if prev.cmd.as_deref() != self.cmd {
            out.push("cmd changed".to_string());
        }
    }
}

fn diff_values(path: &str, before: &Value, after: &Value, out: &mut Vec<String>) {
    match (before, after) {
        (Value::Object(b), Value::Object(a)) => {
            let mut keys: Vec<&String> = b.keys().chain(a.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let sub = format!("{path}.{k}");
                match (b.get(k), a.get(k)) {
                    (Some(x), Some(y)) => diff_values(&sub, x, y, out),
                    (Some(x), None) => out.push(format!("{sub}: {x} → (unset)")),
                    (None, Some(y)) => out.push(format!("{sub}: (unset) → {y}")),
                    (None, None) => {}
                }
            }
        }
        (b, a) if b != a => out.push(format!("{path}: {b} → {a}")),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn param_diffs_name_the_leaf() {
        let mut out = Vec::new();
        diff_values(
            "params",
            &json!({"lr": 0.001, "n": 3}),
            &json!({"lr": 0.0001, "n": 3}),
            &mut out,
        );
        assert_eq!(out, vec!["params.lr: 0.001 → 0.0001"]);
    }
}
