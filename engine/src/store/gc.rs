//! `gc`: remove every published artifact that no run record or pin references (directly or as
//! an ancestor), the attempts of builds that are not running, and failed attempts.
//!
//! `gc` holds the store's lock exclusively (every run and exec holds it shared), so it never
//! runs beside a build: it cannot delete what a run has just published and not yet recorded.
//! An artifact is first renamed into `trash/` (one atomic step, after which no reader sees it),
//! then deleted.

use super::Store;
use crate::diag::{Failure, Result};
use std::path::Path;

/// What `gc` removed (or, in a dry run, would remove).
#[derive(Debug, Default)]
pub struct Report {
    /// (key, bytes) of each artifact removed, in key order.
    pub removed: Vec<(String, u64)>,
    /// How many artifacts are still referenced and kept.
    pub kept: usize,
    /// Attempts (interrupted or failed builds) removed, and their bytes.
    pub attempts: usize,
    pub attempt_bytes: u64,
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
    store.ensure()?;
    let Some(_exclusive) = store.try_hold_exclusive()? else {
        return Err(Failure::Other(miette::miette!(
            help = "run gc again when it has ended",
            "the store {} is in use by a running `nemo-dag run` or `exec`: gc would delete what it is publishing",
            store.root.display()
        )));
    };
    let live = store.live_keys();
    report.kept = live.len();
    for key in store.published_keys() {
        if live.contains(&key) {
            continue;
        }
        let dir = store.artifact_dir(&key);
        let bytes = dir_bytes(&dir);
        if !dry_run {
            let trash = store.root.join("trash").join(&key);
            let _ = std::fs::remove_dir_all(&trash);
            if std::fs::rename(&dir, &trash).is_ok() {
                let _ = std::fs::remove_dir_all(&trash);
            }
        }
        report.removed.push((key, bytes));
    }
    // No build runs while we hold the store: every attempt and failed attempt is a leftover.
    for sub in ["tmp", "failed", "trash"] {
        for entry in std::fs::read_dir(store.root.join(sub))
            .into_iter()
            .flatten()
            .flatten()
        {
            report.attempts += usize::from(sub != "trash");
            report.attempt_bytes += dir_bytes(&entry.path());
            if !dry_run {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    Ok(report)
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
