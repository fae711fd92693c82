//! One module per subcommand: its arguments, and the engine call it makes. What they share:
//! the arguments that name a manifest, and loading it with its store.

pub mod cache;
pub mod cancel;
pub mod diff;
pub mod exec;
pub mod gc;
pub mod gpu_check;
pub mod graph;
pub mod lineage;
pub mod ops;
pub mod pin;
pub mod plot;
pub mod report;
pub mod run;
pub mod runs;
pub mod show;
pub mod status;
pub mod validate;
pub mod verify;

use nemo_dag_engine::diag::Result;
use nemo_dag_engine::manifest::{LoadArgs, Manifest};
use nemo_dag_engine::store::Store;
use nemo_dag_op::Registry;
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone)]
pub struct ManifestArgs {
    /// The manifest (.yaml, .yml or .toml)
    pub manifest: PathBuf,
    /// Overrides KEY.PATH=VALUE (e.g. vars.n=5 stages.train.params.lr=1e-4)
    pub overrides: Vec<String>,
    /// Variant: NAME for <manifest dir>/<manifest stem>/NAME.yaml, or a path
    #[arg(short = 'c', long = "config", value_name = "VARIANT")]
    pub variant: Option<String>,
    /// Artifact store [default: .nemo-dag beside the manifest; env NEMO_DAG_STORE]
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
}

impl ManifestArgs {
    /// The manifest's store, and how to load the manifest: its compiled tree is remembered
    /// in the store when `remember` (commands that write).
    pub fn load_args(&self, ops: Registry, remember: bool) -> (LoadArgs, Store) {
        let store = Store::for_manifest(self.store.as_deref(), &self.manifest);
        let args = LoadArgs {
            variant: self.variant.clone(),
            overrides: self.overrides.clone(),
            cache_dir: Some(store.root.join("cache").join("manifests")),
            // Only into a store that exists: loading a manifest never creates one.
            write_cache: remember && store.root.is_dir(),
            ..LoadArgs::new(self.manifest.clone(), ops)
        };
        (args, store)
    }

    /// Load the manifest, and find its store.
    pub fn load(&self, ops: Registry) -> Result<(Manifest, Store)> {
        self.load_remembering(ops, false)
    }

    pub fn load_remembering(&self, ops: Registry, remember: bool) -> Result<(Manifest, Store)> {
        let (args, store) = self.load_args(ops, remember);
        Ok((Manifest::load(&args)?, store))
    }
}

/// The arguments of commands that find a published artifact without loading a manifest.
#[derive(clap::Args, Debug)]
pub struct TargetArgs {
    /// A stage name (its artifact from the last run) or a key (a prefix of 6+ hex digits)
    pub target: String,
    /// The manifest the stage belongs to (needed when several manifests share a store)
    #[arg(long)]
    pub manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    pub store: Option<PathBuf>,
    #[arg(long)]
    pub json: bool,
}
