//! `nemo-dag graph`: the stage graph with each stage's state.

use super::ManifestArgs;
use nemo_dag_engine::diag::Result;
use nemo_dag_engine::digest::Digester;
use nemo_dag_engine::graph;
use nemo_dag_engine::plan;
use nemo_dag_op::Registry;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Format {
    Ascii,
    Dot,
    Mermaid,
    Json,
    Svg,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    m: ManifestArgs,
    #[arg(long, value_enum, default_value = "ascii")]
    format: Format,
}

pub fn exec(a: Args, ops: Registry) -> Result<()> {
    let (manifest, store) = a.m.load(ops)?;
    let plans = plan::plan(&manifest, &store, &mut Digester::load(&store.memo_file()))?;
    let format = match a.format {
        Format::Ascii => graph::Format::Ascii,
        Format::Dot => graph::Format::Dot,
        Format::Mermaid => graph::Format::Mermaid,
        Format::Json => graph::Format::Json,
        Format::Svg => graph::Format::Svg,
    };
    println!("{}", graph::render(&manifest, &plans, format));
    Ok(())
}
