//! `nemo-dag gpu-check`: does this machine's GPU train as the CPU does, and how fast?

use nemo_dag_engine::diag::{Failure, InputError, Result, io_err};
use nemo_dag_op::Device;
use nemo_dag_ops::gpu_check::{self, Target};
use std::path::{Path, PathBuf};

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
    let report = gpu_check::run(target, a.speed_steps, &mut out)
        .map_err(|why| Failure::Stage(format!("gpu-check cannot run: {why}")))?;
    if let Some(path) = &a.json {
        write_whole(path, &report.json)?;
    }
    if report.ok {
        Ok(())
    } else {
        Err(Failure::Stage("gpu-check: a part FAILED (above)".into()))
    }
}

/// Writes `json` to `path` through a temporary file beside it, so a reader never sees half.
fn write_whole(path: &Path, json: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(json).unwrap_or_default() + "\n";
    let tmp = path.with_extension("json.partial");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_err("cannot write", path, e)
        })
}
