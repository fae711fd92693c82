//! `nemo-dag gpu-check`: the GPU trainer on a CUDA device (or on the SIMT shim) held to the CPU
//! trainer, and timed beside it. The parts and their tolerances are `train::gpu::check`'s.

use kernels::launch::{Cuda, Shim};
use std::io::Write;
pub use train::gpu::check::{Report, Speed};

/// Where the check runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// CUDA device `cuda:N`.
    Cuda(usize),
    /// The SIMT shim: the same kernels on the CPU (no speed figures: the shim is not fast).
    Shim,
}

/// Runs the check, writing its report to `out`: every part's figures and whether all passed,
/// or `Err` when it could not run (no GPU, NVRTC missing, a kernel that does not compile: the
/// reason).
pub fn run(target: Target, speed: Speed, out: &mut dyn Write) -> Result<Report, String> {
    let ok = match target {
        Target::Cuda(ordinal) => {
            let cuda = Cuda::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e}"))?;
            train::gpu::check::run(&cuda, speed, out)
        }
        Target::Shim => train::gpu::check::run(&Shim::default(), Speed::NONE, out),
    };
    ok.map_err(|e| e.to_string())
}
