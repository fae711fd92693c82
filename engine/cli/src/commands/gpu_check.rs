//! `nemo-dag gpu-check`: does this machine's GPU train as the CPU does, and how fast?

use nemo_dag_engine::diag::{Failure, InputError, Result, io_err};
use nemo_dag_engine::store::write_atomic;
use nemo_dag_op::Device;
use nemo_dag_ops::gpu_check::{self, Speed, Target};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The device to check: `cuda` or `cuda:N`
    #[arg(long, default_value = "cuda:0")]
    device: String,
    /// Run the check on the SIMT shim instead (the same kernels executed on the CPU)
    #[arg(long, conflicts_with = "device")]
    shim: bool,
    /// Optimizer steps of the speed comparison (0: none)
    #[arg(long, default_value_t = 3)]
    speed_steps: u64,
    /// The CPU trainer's steps timed beside the device's, after a warm-up step; above 0 the
    /// CPU's decoding is timed too (0: the CPU is not timed)
    #[arg(long, default_value_t = 2)]
    speed_cpu_steps: u64,
    /// Also write every part's figures to this JSON file (written whole, or not at all)
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
}

pub fn exec(a: Args) -> Result<()> {
    let target = if a.shim {
        Target::Shim
    } else {
        match Device::parse(&a.device) {
            Ok(Device::Cuda(n)) => Target::Cuda(n),
            Ok(other) => {
                return Err(InputError::new(format!("--device {other} is not a GPU"))
                    .help("write --device cuda or cuda:N, or --shim to check on the CPU")
                    .into());
            }
            Err(why) => return Err(InputError::new(format!("--device: {why}")).into()),
        }
    };
    let mut out = std::io::stdout();
    let speed = Speed {
        steps: a.speed_steps,
        cpu_steps: a.speed_cpu_steps,
    };
    let report = gpu_check::run(target, speed, &mut out)
        .map_err(|why| Failure::Stage(format!("gpu-check cannot run: {why}")))?;
    if let Some(path) = &a.json {
        // Through a temporary file and a rename: a reader sees the whole report or none.
        let text = serde_json::to_string_pretty(&report.json).unwrap_or_default() + "\n";
        write_atomic(path, text.as_bytes(), false).map_err(|e| io_err("cannot write", path, e))?;
    }
    if report.ok {
        Ok(())
    } else {
        Err(Failure::Stage("gpu-check: a part FAILED (above)".into()))
    }
}
