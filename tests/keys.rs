//! Every shipped manifest and variant keeps its stage keys: a store made by an earlier
//! nemo-dag stays valid. `keys.txt` beside this file holds each stage's key, computed with
//! fixed input digests (see `shipped_keys`); it changes only when an op's version, a
//! manifest, or the key formula does, and then on purpose (regenerate it with
//! `NEMO_DAG_BLESS_KEYS=1 cargo test keys`, and say why in the commit).

use nemo_dag_engine::key::stage_key;
use nemo_dag_engine::manifest::{Input, LoadArgs, Manifest};
use nemo_dag_engine::store::InputRecord;

fn load_manifest(path: &std::path::Path, variant: Option<String>) -> Manifest {
    Manifest::load(&LoadArgs {
        variant,
        ..LoadArgs::new(path, nemo_dag_ops::registry())
    })
    .unwrap_or_else(|e| panic!("{}: {e:?}", path.display()))
}

#[test]
fn shipped_manifests_keep_their_keys() {
    let golden = crate::common::repo().join("tests/keys.txt");
    let now = shipped_keys();
    if std::env::var_os("NEMO_DAG_BLESS_KEYS").is_some() {
        std::fs::write(&golden, &now).unwrap();
        return;
    }
    let recorded = std::fs::read_to_string(&golden).unwrap();
    let changed: Vec<String> = recorded
        .lines()
        .zip(now.lines())
        .filter(|(a, b)| a != b)
        .map(|(a, b)| format!("  was {a}\n  now {b}"))
        .collect();
    assert!(
        changed.is_empty() && recorded.lines().count() == now.lines().count(),
        "stage keys changed (a store made before would rebuild these):\n{}\n({} recorded, {} now)",
        changed.join("\n"),
        recorded.lines().count(),
        now.lines().count()
    );
}

/// Every shipped manifest and variant, each stage's key with each input's digest fixed: a
/// source file's is the blake3 of its bytes (a directory or a missing file: its written path),
/// an upstream output's is derived from the upstream stage's key, so a change anywhere up the
/// graph shows downstream too.
fn shipped_keys() -> String {
    let dir = crate::common::repo().join("manifests");
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    let mut out = String::new();
    for file in files {
        let stem = file.file_stem().unwrap().to_string_lossy().to_string();
        let mut variants: Vec<Option<String>> = vec![None];
        if let Ok(rd) = std::fs::read_dir(dir.join(&stem)) {
            let mut v: Vec<String> = rd
                .map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "toml"))
                .map(|p| p.file_stem().unwrap().to_string_lossy().to_string())
                .collect();
            v.sort();
            variants.extend(v.into_iter().map(Some));
        }
        for variant in variants {
            let m = load_manifest(&file, variant.clone());
            let mut keys: std::collections::BTreeMap<String, String> = Default::default();
            for name in &m.order {
                let stage = &m.stages[name];
                let mut inputs = std::collections::BTreeMap::new();
                for (input, source) in &stage.inputs {
                    let record = match source {
                        Input::File { written, path } => InputRecord::File {
                            path: written.clone(),
                            digest: match std::fs::read(path) {
                                Ok(bytes) => blake3::hash(&bytes).to_hex().to_string(),
                                Err(_) => format!("unreadable {written}"),
                            },
                        },
                        Input::Stage { stage, output } => InputRecord::Upstream {
                            stage: stage.clone(),
                            output: output.clone(),
                            key: keys[stage].clone(),
                            digest: format!("{} {output}", keys[stage]),
                        },
                    };
                    inputs.insert(input.clone(), record);
                }
                let key = stage_key(stage, &inputs);
                out.push_str(&format!(
                    "{} {} {name} {key}\n",
                    file.file_name().unwrap().to_string_lossy(),
                    variant.as_deref().unwrap_or("-")
                ));
                keys.insert(name.clone(), key);
            }
        }
    }
    out
}
