//! `nemo-dag pin`: keep an artifact through `gc` under a name, or remove the name.

use nemo_dag_engine::diag::Result;
use nemo_dag_engine::store::Store;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The pin's name
    name: String,
    /// A stage name or key to pin
    target: Option<String>,
    #[arg(long)]
    remove: bool,
    #[arg(long)]
    manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
}

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    if a.remove {
        store.unpin(&a.name)?;
        eprintln!("unpinned {}", a.name);
        return Ok(());
    }
    let key = store.pin(&a.name, a.target.as_deref(), a.manifest.as_deref())?;
    eprintln!(
        "pinned {} → {}",
        a.name,
        nemo_dag_engine::store::short(&key)
    );
    Ok(())
}
