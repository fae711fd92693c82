//! nemo-dag's engine: manifests → a content-hashed DAG → a crash-safe artifact store →
//! executors, and the `nemo-dag` command line.
//!
//! The modules, in the order data flows through them:
//! - [`doc`]: YAML/TOML text → one value tree with spans for error reporting.
//! - [`manifest`]: vars, Jinja templating, variants, overrides, typed and validated stages.
//! - [`digest`]: content digests of inputs and outputs, memoised by file stamp.
//! - [`plan`]: stage keys, and each stage's freshness against the store (with reasons).
//! - [`store`]: the on-disk artifact store: atomic publish, per-key locks, run records, gc.
//! - [`profile`]: execution profiles from `env.toml` (local or Slurm).
//! - [`exec`]: builds one stage and publishes it (the one code path every executor runs).
//! - [`local`]: the local executor, a tokio scheduler of `exec` child processes.
//! - [`slurm`]: the Slurm executor: one `sbatch` job per stale stage, chained with `afterok`.
//! - [`cli`]: commands and what they print.
//!
//! Ops (what a stage does) live in the `nemo-dag-ops` crate; the engine never depends on
//! what an op computes, only on its name, version, declared outputs and `run`.

// Input errors carry their source text and span for the diagnostic; they are built once, on
// the way out, so their size never matters on a hot path.
#![allow(clippy::result_large_err)]

pub mod cli;
pub mod diag;
pub mod digest;
pub mod doc;
pub mod exec;
pub mod local;
pub mod manifest;
pub mod plan;
pub mod profile;
pub mod slurm;
pub mod store;
