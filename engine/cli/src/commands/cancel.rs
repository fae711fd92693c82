//! `nemo-dag cancel`: cancel the manifest's queued and running cluster jobs.

use super::ManifestArgs;
use nemo_dag_engine::diag::Result;
use nemo_dag_engine::executor::slurm;
use nemo_dag_op::Registry;

pub fn exec(m: ManifestArgs, ops: Registry) -> Result<()> {
    let (manifest, store) = m.load(ops)?;
    let cancelled = slurm::cancel(&manifest, &store)?;
    if cancelled.is_empty() {
        eprintln!("no queued or running jobs for {}", manifest.path.display());
    }
    for (stage, id) in &cancelled {
        println!("cancelled {stage} (job {id})");
    }
    Ok(())
}
