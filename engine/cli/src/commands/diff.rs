//! `nemo-dag diff`: what differs between two published artifacts (params, inputs, metrics).

use nemo_dag_engine::diag::Result;
use nemo_dag_engine::diff::diff;
use nemo_dag_engine::store::Store;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The first artifact: a stage name (its artifact from the last run) or a key (6+ hex digits)
    pub a: String,
    /// The second artifact, named the same ways
    pub b: String,
    /// The manifest the stages belong to (needed when several manifests share a store)
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
    /// A Markdown table, for a pull-request comment
    #[arg(long, conflicts_with = "json")]
    pub md: bool,
    #[arg(long)]
    pub json: bool,
}

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    let load = |target: &str| -> Result<_> {
        let key = store.resolve_target(target, a.manifest.as_deref())?;
        store.load_existing(&key)
    };
    let d = diff(&load(&a.a)?, &load(&a.b)?);
    if a.json {
        println!("{}", d.json());
    } else if a.md {
        print!("{}", d.markdown());
    } else {
        print!("{}", d.text());
    }
    Ok(())
}
