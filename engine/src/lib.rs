//! nemo-dag's engine: manifests → a content-hashed DAG → a crash-safe artifact store →
//! executors. The `nemo-dag` command line (the `cli/` crate beside this one) parses arguments,
//! calls into these modules and prints.
//!
//! The modules, in the order data flows through them:
//! - [`doc`]: YAML/TOML text → one value tree with spans for error reporting.
//! - [`manifest`]: vars, Jinja templating, variants, overrides, typed and validated stages.
//! - [`digest`]: content digests of inputs and outputs, memoised by file stamp.
//! - [`key`]: the stage key, blake3 of the canonical JSON of everything that determines the
//!   stage's output.
//! - [`plan`]: each stage's freshness against the store (with reasons).
//! - [`store`]: the on-disk artifact store: atomic publish, per-key locks, attempts, run
//!   records, verified reads, gc.
//! - [`launch`]: `resources.launch`, a stage's command once per rank, and the rendezvous.
//! - [`exec`]: builds one stage and publishes it (the one code path every executor runs), with
//!   its capped [`stage_log`].
//! - [`executor`]: what runs the stale stages: [`executor::local`] (a tokio scheduler of
//!   `exec` child processes) and [`executor::slurm`] (one `sbatch` job per stale stage, chained
//!   with `afterok`), with the `env.toml` [`executor::profile`]s.
//! - [`graph`]: the stage graph as text (ascii, dot, mermaid, json).
//! - [`diff`]: what differs between two published artifacts (params, inputs, metrics).
//! - [`plot`]: one metric of several artifacts' curves, overlaid as SVG.
//!
//! Ops (what a stage does) reach the engine only through the `nemo-dag-op` protocol crate, as
//! the registry the binary passes in: the engine never depends on what an op computes, only on
//! its name, version, declared outputs and `run`, and it builds without any ML code.

// Input errors carry their source text and span for the diagnostic; they are built once, on
// the way out, so their size never matters on a hot path.
#![allow(clippy::result_large_err)]

pub mod cache;
pub mod curve;
pub mod diag;
pub mod diff;
pub mod digest;
pub mod doc;
pub mod duration;
pub mod estimate;
pub mod exec;
pub mod executor;
pub mod graph;
pub mod key;
pub mod launch;
pub mod manifest;
pub mod mlflow;
pub mod plan;
pub mod plot;
pub mod report;
pub mod runs;
pub mod stage_log;
pub mod store;
pub mod sweep;
pub mod tensorboard;
#[cfg(test)]
mod testing;
pub mod usage;
