//! The run history: one entry for each run that reached its end, numbered across the store
//! (`runs/history/000007.json` is run 7), written once and never changed.
//!
//! An entry is what the manifest's run record said after the run, with what `runs` and `diff`
//! need of each stage's artifact copied in: its params and final metrics. So the history can
//! still be read after `gc` has removed an old run's artifacts: entries are not roots for
//! `gc`, only the last run record of each manifest is.

use super::{Artifact, RunRecord, Store, write_atomic};
use crate::diag::{InputError, Result};
use crate::diff::{final_metrics, flatten};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// One run, as `runs` lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Entry {
    /// Its number in this store: 1 for the first run recorded, counting every manifest.
    pub run: u64,
    pub manifest: String,
    pub variant: Option<String>,
    pub overrides: Vec<String>,
    pub argv: Vec<String>,
    pub finished_at: String,
    /// Every stage of the manifest's run record after this run, by name.
    pub stages: BTreeMap<String, StageEntry>,
}

/// One stage of a run: its artifact, and what this run did with it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct StageEntry {
    /// Its key; `None` for a stage that failed in this run and has no artifact.
    pub key: Option<String>,
    /// What this run did: `executed`, `pulled`, `cached`, `cutoff` or `failed`; `None` for a
    /// stage this run did not reach, whose artifact an earlier run left.
    pub outcome: Option<String>,
    /// For a sweep's copy: where it sits in the sweep.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sweep: Option<Swept>,
    /// Its params by dotted path (`model.hidden`), and its `cmd` when it has one.
    pub params: BTreeMap<String, Value>,
    /// Its final metrics by dotted path: numbers and flags, not curves, tables or text.
    pub metrics: BTreeMap<String, Value>,
}

/// A copy's place in its sweep.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Swept {
    /// The stage as the manifest declares it (`sft`).
    pub stage: String,
    /// The point, as the copy's name gives it (`lr=1e-4`).
    pub point: String,
    /// Its place among the copies: the matrix's order.
    pub ordinal: usize,
}

impl StageEntry {
    pub fn of(artifact: &Artifact) -> StageEntry {
        let mut params = BTreeMap::new();
        flatten("", &artifact.params, &mut params);
        if let Some(cmd) = &artifact.cmd {
            params.insert("cmd".into(), Value::from(cmd.clone()));
        }
        StageEntry {
            key: Some(artifact.key.clone()),
            outcome: None,
            sweep: None,
            params,
            metrics: final_metrics(&artifact.metrics),
        }
    }
}

impl Store {
    fn history_dir(&self) -> PathBuf {
        self.root.join("runs").join("history")
    }

    /// Append this run to the history: `record` is the manifest's run record after it, and
    /// `reached` what the run did to each stage it reached (`failed` ones included); `sweep`
    /// names a copy's declared stage and point. Returns the run's number.
    pub fn append_history(
        &self,
        record: &RunRecord,
        reached: &BTreeMap<String, String>,
        sweep: impl Fn(&str) -> Option<Swept>,
    ) -> Result<u64> {
        let blank = || StageEntry {
            key: None,
            outcome: None,
            sweep: None,
            params: BTreeMap::new(),
            metrics: BTreeMap::new(),
        };
        let mut stages = BTreeMap::new();
        let failed = reached
            .iter()
            .filter(|(_, o)| *o == "failed")
            .map(|(n, _)| n);
        for name in record.stages.keys().chain(failed) {
            // A stage that failed here has no artifact from this run: the one its record
            // keeps is an earlier run's.
            let mut entry = match (
                reached.get(name).map(String::as_str),
                record.stages.get(name),
            ) {
                (Some("failed"), _) | (_, None) => blank(),
                (_, Some(key)) => self.load(key).map_or_else(
                    || StageEntry {
                        key: Some(key.clone()),
                        ..blank()
                    },
                    |a| StageEntry::of(&a),
                ),
            };
            entry.outcome = reached.get(name).cloned();
            entry.sweep = sweep(name);
            stages.insert(name.clone(), entry);
        }
        let dir = self.history_dir();
        std::fs::create_dir_all(&dir).map_err(|e| crate::diag::io_err("cannot create", &dir, e))?;
        let mut entry = Entry {
            run: 0,
            manifest: record.manifest.clone(),
            variant: record.variant.clone(),
            overrides: record.overrides.clone(),
            argv: record.argv.clone(),
            finished_at: record.finished_at.clone(),
            stages,
        };
        // Numbers are taken by hard-linking a complete file into place, which fails when the
        // name exists: two runs finishing together in one store take two numbers.
        // A name no other process has, on this host or another sharing the store.
        let tmp = dir.join(format!(
            ".entry.{}.{}.{}",
            super::hostname(),
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ));
        let mut tried = 0;
        loop {
            // Past the number that clashed, even if a cached listing does not show it yet.
            entry.run = self
                .history_numbers()
                .last()
                .copied()
                .unwrap_or(0)
                .max(tried)
                + 1;
            tried = entry.run;
            let bytes = serde_json::to_vec_pretty(&entry).map_err(|e| miette::miette!("{e}"))?;
            write_atomic(&tmp, &bytes, true)
                .map_err(|e| crate::diag::io_err("cannot write", &tmp, e))?;
            let path = self.history_path(entry.run);
            let linked = std::fs::hard_link(&tmp, &path);
            let _ = std::fs::remove_file(&tmp);
            match linked {
                Ok(()) => return Ok(entry.run),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(crate::diag::io_err("cannot write", &path, e)),
            }
        }
    }

    fn history_path(&self, n: u64) -> PathBuf {
        self.history_dir().join(format!("{n:06}.json"))
    }

    fn history_numbers(&self) -> Vec<u64> {
        let mut numbers: Vec<u64> = std::fs::read_dir(self.history_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let name = e.file_name();
                name.to_str()?.strip_suffix(".json")?.parse().ok()
            })
            .collect();
        numbers.sort_unstable();
        numbers
    }

    /// Every run in the history, oldest first. An entry that cannot be read is skipped with a
    /// warning naming its file.
    pub fn history(&self) -> Vec<Entry> {
        self.history_numbers()
            .into_iter()
            .filter_map(|n| {
                let path = self.history_path(n);
                let read = std::fs::read(&path)
                    .map_err(|e| e.to_string())
                    .and_then(|b| serde_json::from_slice::<Entry>(&b).map_err(|e| e.to_string()));
                match read {
                    Ok(entry) => Some(entry),
                    Err(e) => {
                        eprintln!(
                            "nemo-dag: warning: skipping {} in the run history: {e}",
                            path.display()
                        );
                        None
                    }
                }
            })
            .collect()
    }

    /// The runs of `manifest` (every manifest's when `None`), oldest first.
    pub fn history_of(&self, manifest: Option<&std::path::Path>) -> Vec<Entry> {
        let wanted = super::find::absolute(manifest);
        let mut entries = self.history();
        entries.retain(|e| wanted.as_ref().is_none_or(|w| &e.manifest == w));
        entries
    }

    /// Run `n` of the history.
    pub fn history_entry(&self, n: u64) -> Result<Entry> {
        let path = self.history_path(n);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                InputError::new(format!("{}: not a run history entry: {e}", path.display())).into()
            }),
            Err(_) => {
                let last = self.history_numbers().last().copied();
                Err(
                    InputError::new(format!("there is no run {n} in {}", self.root.display()))
                        .help(match last {
                            Some(last) => {
                                format!("runs are numbered 1 to {last}; `nemo-dag runs` lists them")
                            }
                            None => "no run has been recorded in this store yet".into(),
                        })
                        .into(),
                )
            }
        }
    }
}
