//! nemo-dag's integration tests: one binary (as ripgrep and uv do), one module per area.
//! Most drive the built `nemo-dag` binary on a scratch project (`common::Project`); helpers
//! they share live in `common/`, and the Python checks they call in `py/`.

mod common;

/// Incremental runs, early cutoff, YAML/TOML equivalence, the store, gc and pins.
mod spine;

/// Bad input: exit code 2, the place named, nothing written.
mod errors;

/// Crashes, kills, concurrent runs and interrupted builds leave the store consistent.
mod robustness;

/// What the store serves is what was published: kills, gc, tampering, symlinks, odd inputs.
mod integrity;

/// The data ops against their Python references: tokenizers, Megatron's reader, packing.
mod data;

/// Training, checkpoints, resume, export, eval.
mod train;

/// The shipped recipes load, and the tiny ones run.
mod recipes;

/// Megatron-Bridge as a backend, against a stand-in that checks its arguments.
pub(crate) mod megatron;

/// NeMo-RL's GRPO as a backend, against a stand-in that checks its arguments and resumes.
mod nemo_rl;

/// Plan before running: memory and FLOP estimates, printed, recorded, and refused when too big.
pub(crate) mod scale;

/// Stage keys of every shipped manifest are what they were.
mod keys;

/// `resources.device` on a machine with no GPU: `cuda` fails, `auto` runs on the CPU.
mod device;

/// The crates' arrows point down, and the engine builds without ML code.
mod layout;

/// `resources.launch`: a stage's command once per rank; the checks, local runs, job scripts.
mod launch;

/// The shared cache against a real S3 server: two machines, tampering, scopes, a server down.
pub(crate) mod cache;

/// Trackers: executed stages as runs of a real MLflow server, and a tracker that is down.
pub(crate) mod track;

/// The Slurm executor against a real single-node cluster (scripts/slurm-up).
mod slurm;
