//! `nemo-dag diff`: what differs between two published artifacts (params, inputs, metrics), or
//! between two runs of the history (`@3 @5`), stage by stage.

use nemo_dag_engine::diag::{InputError, Result};
use nemo_dag_engine::diff::{diff, diff_runs};
use nemo_dag_engine::store::Store;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The first artifact: a stage name (its artifact from the last run), STAGE@N (its
    /// artifact in run N of `nemo-dag runs`) or a key (6+ hex digits); or a whole run, @N
    pub a: String,
    /// The second artifact, or run, named the same ways
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
    let run = |target: &str| target.strip_prefix('@').map(str::parse::<u64>);
    match (run(&a.a), run(&a.b)) {
        (None, None) => {}
        (Some(Ok(x)), Some(Ok(y))) => {
            let d = diff_runs(&store.history_entry(x)?, &store.history_entry(y)?);
            print(d.text(), d.markdown(), d.json(), &a);
            return Ok(());
        }
        _ => {
            return Err(InputError::new(format!(
                "`{}` and `{}`: compare two runs (@3 @5) or two artifacts (sft@3 sft@5, stage names, keys), not one of each",
                a.a, a.b
            ))
            .help("a run is @ and its number in `nemo-dag runs`")
            .into());
        }
    }
    let load = |target: &str| -> Result<_> {
        let key = store.resolve_target(target, a.manifest.as_deref())?;
        store.load_existing(&key)
    };
    let d = diff(&load(&a.a)?, &load(&a.b)?);
    print(d.text(), d.markdown(), d.json(), &a);
    Ok(())
}

fn print(text: String, markdown: String, json: serde_json::Value, a: &Args) {
    if a.json {
        println!("{json}");
    } else if a.md {
        print!("{markdown}");
    } else {
        print!("{text}");
    }
}
