//! `nemo-dag verify`: re-read published entries and report every one that is not what was
//! published (and every run record that points at the wrong thing).

use nemo_dag_engine::diag::{Failure, InputError, Result};
use nemo_dag_engine::store::{Store, short, verify};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A stage name (its artifact from the last run) or a key (a prefix of 6+ hex digits)
    target: Option<String>,
    /// Every entry in the store, and every run record
    #[arg(long, conflicts_with = "target")]
    all: bool,
    /// The manifest the stage belongs to (needed when several manifests share a store)
    #[arg(long)]
    manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    let target = match &a.target {
        Some(t) => Some(store.resolve_target(t, a.manifest.as_deref())?),
        None => None,
    };
    let keys = match (&target, a.all) {
        (Some(key), _) => Some(vec![key.clone()]),
        (None, true) => None,
        (None, false) => {
            return Err(InputError::new("verify needs a stage or key, or --all")
                .help("`nemo-dag verify --all` checks every entry in the store")
                .into());
        }
    };
    let report = verify::verify(&store, keys, a.all);
    if a.json {
        println!("{}", serde_json::to_string(&report).unwrap_or_default());
    } else {
        for f in &report.findings {
            let stage = f.stage.as_deref().unwrap_or("?");
            println!("DAMAGED {} {stage}: {}", short(&f.key), f.problem);
        }
        if let (Some(key), true) = (&target, report.findings.is_empty()) {
            println!("ok {}", short(key));
        }
        println!(
            "verified {} {}{}: {} problem(s)",
            report.entries,
            if report.entries == 1 {
                "entry"
            } else {
                "entries"
            },
            if a.all {
                format!(" and {} run record(s)", report.records)
            } else {
                String::new()
            },
            report.findings.len()
        );
    }
    if report.findings.is_empty() {
        Ok(())
    } else {
        Err(Failure::Stage(format!(
            "{} problem(s) in {}: `nemo-dag run MANIFEST --force STAGE` rebuilds a damaged stage",
            report.findings.len(),
            store.root.display()
        )))
    }
}
