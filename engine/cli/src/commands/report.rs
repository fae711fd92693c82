//! `nemo-dag report`: the manifest's state as one self-contained HTML file.

use super::ManifestArgs;
use nemo_dag_engine::diag::{Result, io_err};
use nemo_dag_engine::digest::Digester;
use nemo_dag_engine::{plan, report};
use nemo_dag_op::Registry;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    m: ManifestArgs,
    /// Where to write the report
    #[arg(short, long, value_name = "FILE", default_value = "report.html")]
    output: PathBuf,
}

pub fn exec(a: Args, ops: Registry) -> Result<()> {
    let (manifest, store) = a.m.load(ops)?;
    let plans = plan::plan(&manifest, &store, &mut Digester::load(&store.memo_file()))?;
    let record = plan::last_run_record(&manifest, &store);
    let html = report::html(&manifest, &store, &plans, &record);
    nemo_dag_engine::store::write_atomic(&a.output, html.as_bytes(), false)
        .map_err(|e| io_err("cannot write the report", &a.output, e))?;
    eprintln!("wrote {}", a.output.display());
    Ok(())
}
