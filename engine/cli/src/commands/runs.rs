//! `nemo-dag runs`: the recorded runs as a table, like `dvc exp show`.

use nemo_dag_engine::diag::Result;
use nemo_dag_engine::runs::{Columns, table};
use nemo_dag_engine::store::Store;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only this manifest's runs (every variant of it); every manifest's when not given
    pub manifest: Option<PathBuf>,
    /// Only the last N runs
    #[arg(short = 'n', long, value_name = "N")]
    pub last: Option<usize>,
    /// Every param and metric as a column, not only those that differ between the runs shown
    #[arg(long)]
    pub all: bool,
    /// Only the params whose `stage.path` contains TEXT (repeatable)
    #[arg(long = "param", value_name = "TEXT")]
    pub params: Vec<String>,
    /// Only the metrics whose `stage.path` contains TEXT (repeatable)
    #[arg(long = "metric", value_name = "TEXT")]
    pub metrics: Vec<String>,
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
    /// The runs as JSON: each with its stages' keys, outcomes, params and final metrics
    #[arg(long)]
    pub json: bool,
}

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    let mut entries = store.history_of(a.manifest.as_deref());
    if let Some(n) = a.last {
        entries.drain(..entries.len().saturating_sub(n));
    }
    if a.json {
        println!("{}", serde_json::json!({ "runs": entries }));
    } else {
        let columns = Columns {
            all: a.all,
            params: a.params,
            metrics: a.metrics,
        };
        print!("{}", table(&entries, &columns));
    }
    Ok(())
}
