//! `nemo-dag lineage`: every ancestor of an artifact, with its op, key, params and inputs.

use super::TargetArgs;
use nemo_dag_engine::diag::Result;
use nemo_dag_engine::store::{Artifact, InputRecord, Store, lineage, short};
use serde_json::{Value, json};
use std::collections::BTreeMap;

pub type Args = TargetArgs;

pub fn exec(a: Args) -> Result<()> {
    let store = Store::find(a.store.as_deref(), a.manifest.as_deref())?;
    let key = store.resolve_target(&a.target, a.manifest.as_deref())?;
    let target = store.load_existing(&key)?;
    let ancestors = lineage(&store, &target)?;
    if a.json {
        let list: Vec<Value> = ancestors.iter().map(entry).collect();
        println!("{}", json!({"artifact": entry(&target), "ancestors": list}));
        return Ok(());
    }
    for (depth, art) in std::iter::once(&target).chain(ancestors.iter()).enumerate() {
        let marker = if depth == 0 { "●" } else { "↑" };
        println!(
            "{marker} {} [{} v{}] {}",
            art.stage, art.op, art.op_version, art.key
        );
        println!("    params {}", art.params);
        for (name, i) in &art.inputs {
            match i {
                InputRecord::File { path, digest } => {
                    println!("    input  {name}: file {path} blake3:{}", short(digest))
                }
                InputRecord::Upstream {
                    stage,
                    output,
                    digest,
                    ..
                } => {
                    println!(
                        "    input  {name}: {stage}:{output} blake3:{}",
                        short(digest)
                    )
                }
            }
        }
    }
    Ok(())
}

fn entry(a: &Artifact) -> Value {
    let inputs: BTreeMap<&String, Value> = a
        .inputs
        .iter()
        .map(|(n, i)| (n, serde_json::to_value(i).unwrap_or(Value::Null)))
        .collect();
    json!({"stage": a.stage, "op": a.op, "op_version": a.op_version, "key": a.key, "params": a.params, "inputs": inputs})
}
