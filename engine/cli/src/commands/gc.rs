//! `nemo-dag gc`: remove the artifacts no recorded run or pin references, and leftover attempts.

use nemo_dag_engine::diag::Result;
use nemo_dag_engine::store::{Store, gc};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// The store beside this manifest
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// List what would be removed
    #[arg(long)]
    dry_run: bool,
}

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    if !store.artifacts().is_dir() {
        eprintln!("nothing to collect in {}", store.root.display());
        return Ok(());
    }
    let report = gc::collect(&store, a.dry_run)?;
    for (key, bytes) in &report.removed {
        if a.dry_run {
            println!("would remove {key} ({bytes} bytes)");
        } else {
            println!("removed {key}");
        }
    }
    eprintln!(
        "{} {} artifact(s), {} bytes, and {} interrupted or failed attempt(s), {} bytes; kept {}",
        if a.dry_run { "would remove" } else { "removed" },
        report.removed.len(),
        report.bytes(),
        report.attempts,
        report.attempt_bytes,
        report.kept
    );
    Ok(())
}
