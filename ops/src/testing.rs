//! Running an op in-process in unit tests, as `nemo-dag exec` would: check the declaration,
//! then run it with its outputs, into `out`.

use nemo_dag_op::{AnyOp, Metrics, RunContext, RunError, StageDecl};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Check and run `op` with `params` and `inputs` into `out`; its result and its log.
pub fn run_op(
    op: &dyn AnyOp,
    params: Value,
    inputs: BTreeMap<String, PathBuf>,
    out: &Path,
) -> (Result<Metrics, RunError>, String) {
    std::fs::create_dir_all(out).unwrap();
    let names: Vec<&str> = inputs.keys().map(String::as_str).collect();
    let decl = StageDecl {
        name: op.name(),
        params: &params,
        inputs: names.clone(),
        outputs: &BTreeMap::new(),
        cmd: None,
        world_size: None,
        nodes: None,
    };
    let checked = op.check(&decl).unwrap();
    let outputs = op.outputs(&decl);
    let mut log = Vec::new();
    let mut ctx = RunContext {
        stage: StageDecl {
            outputs: &outputs,
            ..decl
        },
        inputs: &inputs,
        out_dir: out,
        log: &mut log,
        progress: &mut |_| {},
        stop_after_step: None,
        launcher: &[],
        device: nemo_dag_op::Device::Cpu,
    };
    let r = op.run(&checked, &mut ctx);
    (r, String::from_utf8(log).unwrap())
}

/// A fresh, empty scratch directory for one test (`name` keeps tests apart).
pub fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("nemo-dag-ops-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The names in a directory, sorted.
pub fn names(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("a directory")
        .map(|e| {
            e.expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    names.sort();
    names
}
