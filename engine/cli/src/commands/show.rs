//! `nemo-dag show`: a published artifact's metadata, by stage name or key.

use super::TargetArgs;
use nemo_dag_engine::diag::Result;
use nemo_dag_engine::store::{InputRecord, Store, artifact_json, short};
use nemo_dag_op::plan::bytes;

pub type Args = TargetArgs;

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    let key = store.resolve_target(&a.target, a.manifest.as_deref())?;
    let artifact = store.load_existing(&key)?;
    let v = artifact_json(&store, &artifact);
    if a.json {
        println!("{v}");
        return Ok(());
    }
    println!("stage    {}", artifact.stage);
    println!("op       {} v{}", artifact.op, artifact.op_version);
    println!("key      {}", artifact.key);
    println!(
        "built    {} on {} in {:.2}s (nemo-dag {})",
        artifact.started_at, artifact.host, artifact.seconds, artifact.engine_version
    );
    println!("params   {}", artifact.params);
    if let Some(r) = &artifact.resources {
        let planned = r
            .estimate
            .as_ref()
            .and_then(|e| e["peak_bytes"].as_u64())
            .map(|b| format!(" · planned ≈ {}", bytes(b)))
            .unwrap_or_default();
        println!(
            "memory   peak {} measured{planned}",
            bytes(r.peak_rss_bytes)
        );
        if let (Some(user), Some(system)) = (r.cpu_user_seconds, r.cpu_system_seconds) {
            println!("cpu      {user:.2}s user, {system:.2}s system");
        }
        if let (Some(read), Some(written)) = (r.read_bytes, r.written_bytes) {
            println!("io       read {}, wrote {}", bytes(read), bytes(written));
        }
    }
    if let Some(rate) = artifact
        .metrics
        .get("tokens_per_second")
        .and_then(serde_json::Value::as_f64)
    {
        println!("speed    {rate:.0} tokens/s");
    }
    for (name, i) in &artifact.inputs {
        match i {
            InputRecord::File { path, digest } => {
                println!("input    {name} = {path} ({})", short(digest))
            }
            InputRecord::Upstream {
                stage,
                output,
                key,
                digest,
            } => {
                println!(
                    "input    {name} = {stage}:{output} [{}] ({})",
                    short(key),
                    short(digest)
                )
            }
        }
    }
    for (name, o) in v["outputs"].as_object().into_iter().flatten() {
        println!(
            "output   {name} = {} ({} bytes)",
            o["path"].as_str().unwrap_or(""),
            o["bytes"]
        );
    }
    if let Some(events) = v["tensorboard"].as_str() {
        println!("curves   {events} (TensorBoard event files)");
    }
    Ok(())
}
