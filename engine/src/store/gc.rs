//! `gc`: remove every published artifact that no run record or pin references (directly or as
//! an ancestor), and the leftovers of interrupted builds.
//!
//! An artifact is removed under its key's lock, so a concurrent `exec` of the same key is never
//! half-deleted: the directory is first renamed into `trash/` (one atomic step, after which no
//! reader sees it), then deleted. A `tmp/` entry is removed only when nobody holds its lock.

use super::Store;
use crate::diag::Result;
use std::path::Path;

/// What `gc` removed (or, in a dry run, would remove).
#[derive(Debug, Default)]
pub struct Report {
    /// (key, bytes) of each artifact removed, in key order.
    pub removed: Vec<(String, u64)>,
    /// How many artifacts are still referenced and kept.
    pub kept: usize,
}

impl Report {
    pub fn bytes(&self) -> u64 {
        self.removed.iter().map(|(_, b)| b).sum()
    }
}

/// Collect the store's garbage; with `dry_run`, only say what would go.
pub fn collect(store: &Store, dry_run: bool) -> Result<Report> {
    let mut report = Report::default();
    if !store.artifacts().is_dir() {
        return Ok(report);
    }
    let live = store.live_keys();
    report.kept = live.len();
    for key in store.published_keys() {
        if live.contains(&key) {
            continue;
        }
        let dir = store.artifact_dir(&key);
        let bytes = dir_bytes(&dir);
        if !dry_run {
            let _lock = store.lock(&key)?;
            let trash = store.root.join("trash").join(&key);
            let _ = std::fs::remove_dir_all(&trash);
            if std::fs::rename(&dir, &trash).is_ok() {
                let _ = std::fs::remove_dir_all(&trash);
            }
        }
        report.removed.push((key, bytes));
    }
    if !dry_run {
        remove_abandoned_builds(store);
    }
    Ok(report)
}

/// Leftovers of interrupted builds: a `tmp/` entry whose key nobody is building.
fn remove_abandoned_builds(store: &Store) {
    for entry in std::fs::read_dir(store.root.join("tmp"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let key = entry.file_name().to_string_lossy().to_string();
        let lock_path = store.root.join("locks").join(format!("{key}.lock"));
        let free = std::fs::File::options()
            .write(true)
            .open(&lock_path)
            .map(|f| f.try_lock().is_ok())
            .unwrap_or(true);
        if free {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}
