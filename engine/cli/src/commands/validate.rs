//! `nemo-dag validate`: load and check a manifest; run nothing.

use super::ManifestArgs;
use nemo_dag_engine::diag::Result;
use nemo_dag_op::Registry;

pub fn exec(m: ManifestArgs, ops: Registry) -> Result<()> {
    let (manifest, _) = m.load(ops)?;
    eprintln!(
        "ok: {} stage(s), in order: {}",
        manifest.order.len(),
        manifest.order.join(" → ")
    );
    for name in &manifest.order {
        if let Some(e) = manifest.estimate(name) {
            eprintln!("  {name}: {e}");
        }
    }
    Ok(())
}
