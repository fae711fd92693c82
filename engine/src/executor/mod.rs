//! Executors: what runs the stale stages of a plan. Both end in the same place, a
//! `nemo-dag exec` process per stage that builds and publishes it ([`crate::exec`]), so a
//! stage's artifact is the same bytes whichever executor ran it.
//!
//! - [`local`]: a tokio scheduler of `exec` child processes on this machine, with the progress
//!   display.
//! - [`slurm`]: one `sbatch` job per stale stage, chained with `afterok`; [`slurm`]'s `script`
//!   writes the job script, its `queue` asks Slurm about the jobs.
//! - [`profile`]: the `env.toml` profiles that say which executor, and with what resources.

pub mod local;
pub mod profile;
pub mod slurm;
