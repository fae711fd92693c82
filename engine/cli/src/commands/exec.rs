//! `nemo-dag exec` (hidden): build one stage, as every executor does, and print its result
//! as one JSON line.

use super::ManifestArgs;
use nemo_dag_engine::exec::{JobSource, exec_command};
use nemo_dag_op::Registry;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// A job spec (JSON) written by an executor, or - for stdin
    #[arg(long, conflicts_with_all = ["stage", "manifest"])]
    spec: Option<PathBuf>,
    /// Build this stage of MANIFEST, resolving its key against the store (cluster jobs)
    #[arg(long, requires = "manifest")]
    stage: Option<String>,
    /// The manifest (with --stage)
    manifest: Option<PathBuf>,
    /// Overrides KEY.PATH=VALUE, as given to `run`
    overrides: Vec<String>,
    #[arg(short = 'c', long = "config", value_name = "VARIANT")]
    variant: Option<String>,
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// With --stage: use no shared cache, even with [cache] in env.toml
    #[arg(long, requires = "stage")]
    offline: bool,
    /// With --stage: the store is the node's own, so a stage the cache does not take fails
    #[arg(long, requires = "stage", conflicts_with = "offline")]
    must_push: bool,
    /// With --stage: what starts a launched stage's ranks (`srun …`), the stage's command
    /// following it; the job script writes it
    #[arg(last = true, value_name = "LAUNCHER")]
    launcher: Vec<String>,
}

pub fn exec(a: Args, ops: Registry) -> i32 {
    let source = match (a.spec, a.stage, a.manifest) {
        (Some(path), _, _) => Some(JobSource::Spec(path)),
        (None, Some(stage), Some(manifest)) => {
            // A node_store whose variable is not set on the node renders as `--store ""`.
            if a.store.as_ref().is_some_and(|s| s.as_os_str().is_empty()) {
                eprintln!(
                    "nemo-dag exec: --store is empty (is a variable in the profile's node_store unset on this node?)"
                );
                return 2;
            }
            let m = ManifestArgs {
                manifest,
                overrides: a.overrides,
                variant: a.variant,
                store: a.store,
            };
            let (manifest, store) = m.load_args(ops, false);
            Some(JobSource::Stage {
                stage,
                manifest,
                store,
                launcher: a.launcher,
                offline: a.offline,
                must_push: a.must_push,
            })
        }
        _ => None,
    };
    exec_command(source, ops)
}
