//! The crate layout's two rules, checked on the real dependency graph (`cargo metadata`):
//! arrows only point down (each of our crates depends only on the crates below it), and the
//! engine and the data crate build without any ML code (no candle anywhere under them).
//! docs/architecture.md draws the same graph.

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};

/// Each of our crates and the only crates of ours it may depend on (normal dependencies).
const ALLOWED: &[(&str, &[&str])] = &[
    ("nemo-dag-op", &[]),
    ("nemo-dag-kernels", &[]),
    ("nemo-dag-data", &[]),
    ("nemo-dag-model", &["nemo-dag-kernels"]),
    (
        "nemo-dag-train",
        &[
            "nemo-dag-model",
            "nemo-dag-kernels",
            "nemo-dag-data",
            "nemo-dag-op",
        ],
    ),
    (
        "nemo-dag-ops",
        &[
            "nemo-dag-op",
            "nemo-dag-data",
            "nemo-dag-model",
            "nemo-dag-train",
            "nemo-dag-kernels",
        ],
    ),
    ("nemo-dag-remote", &[]),
    ("nemo-dag-mlflow", &[]),
    (
        "nemo-dag-engine",
        &["nemo-dag-op", "nemo-dag-remote", "nemo-dag-mlflow"],
    ),
    (
        "nemo-dag",
        &["nemo-dag-engine", "nemo-dag-op", "nemo-dag-ops"],
    ),
];

fn cargo(args: &[&str]) -> Vec<u8> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args(args)
        .current_dir(crate::common::repo())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Each workspace crate's declared normal dependencies, by package name.
fn declared() -> BTreeMap<String, Vec<String>> {
    let meta: Value =
        serde_json::from_slice(&cargo(&["metadata", "--format-version", "1", "--no-deps"]))
            .expect("cargo metadata prints JSON");
    meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap().to_string())
                .collect();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

#[test]
fn our_crates_depend_only_on_the_crates_below_them() {
    let declared = declared();
    let ours: BTreeSet<&str> = ALLOWED.iter().map(|(n, _)| *n).collect();
    let workspace: BTreeSet<&str> = declared.keys().map(String::as_str).collect();
    assert_eq!(
        ours, workspace,
        "ALLOWED names every crate of the workspace"
    );
    let mut wrong = Vec::new();
    for (name, allowed) in ALLOWED {
        for dep in &declared[*name] {
            if ours.contains(dep.as_str()) && !allowed.contains(&dep.as_str()) {
                wrong.push(format!("{name} → {dep}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "arrows that point up or sideways: {wrong:?}"
    );
}

#[test]
fn the_engine_and_the_data_crate_build_without_candle() {
    for root in ["nemo-dag-engine", "nemo-dag-data", "nemo-dag-op"] {
        let tree = cargo(&[
            "tree",
            "-p",
            root,
            "-e",
            "normal",
            "--offline",
            "--prefix",
            "none",
        ]);
        let tree = String::from_utf8_lossy(&tree);
        assert!(
            tree.lines().count() > 1,
            "cargo tree lists {root}'s dependencies: {tree}"
        );
        let ml: Vec<&str> = tree.lines().filter(|l| l.starts_with("candle")).collect();
        assert!(ml.is_empty(), "{root} depends on {ml:?}");
    }
}

/// The binary starts on a machine with no CUDA: cudarc opens the driver and NVRTC at run time
/// (`dynamic-loading`), and nothing asks for link-time CUDA. candle-core's `cuda` feature would:
/// it turns on cudarc's `dynamic-linking`, which puts libcuda in the binary's `DT_NEEDED`
/// (the loader then refuses to start it without a driver) and cannot share a build with
/// `dynamic-loading`.
#[test]
fn cuda_is_loaded_at_run_time_and_candle_never_gets_its_cuda_feature() {
    let tree = cargo(&[
        "tree",
        "-p",
        "nemo-dag",
        "-e",
        "normal",
        "-f",
        "{p} [{f}]",
        "--offline",
        "--prefix",
        "none",
    ]);
    let tree = String::from_utf8_lossy(&tree);
    let features = |name: &str| -> BTreeSet<String> {
        tree.lines()
            .filter(|l| l.starts_with(&format!("{name} ")))
            .filter_map(|l| l.split_once('[').and_then(|(_, f)| f.split_once(']')))
            .flat_map(|(f, _)| f.split(',').map(str::to_string))
            .collect()
    };
    let candle = features("candle-core");
    assert!(
        !candle.is_empty(),
        "cargo tree lists candle-core with its features: {tree}"
    );
    assert!(
        !candle.contains("cuda"),
        "candle-core gets cuda: {candle:?}"
    );
    let cudarc = features("cudarc");
    assert!(cudarc.contains("dynamic-loading"), "cudarc: {cudarc:?}");
    assert!(!cudarc.contains("dynamic-linking"), "cudarc: {cudarc:?}");
}
