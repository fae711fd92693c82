//! `verify`: is what the store holds what was published?
//!
//! Each entry's outputs are re-hashed and compared with the digests its `artifact.json`
//! recorded when it was built; an entry without a readable `artifact.json` is reported as not
//! an artifact; and each run record's stage → key is checked against the artifact it names.
//! `run` makes the same output check before it serves a published key, through the digest
//! memo ([`check_outputs`]); `verify` re-reads every byte.

use super::{Artifact, Store, short};
use crate::digest::Digester;

/// One problem with one entry (or with a run record).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Finding {
    pub key: String,
    pub stage: Option<String>,
    pub problem: String,
}

/// What `verify` looked at and what it found.
#[derive(Debug, Default, serde::Serialize)]
pub struct Report {
    pub entries: usize,
    pub records: usize,
    pub findings: Vec<Finding>,
}

/// The outputs of `artifact` whose files differ from what `artifact.json` records, one line
/// each (empty when all match).
pub fn check_outputs(store: &Store, artifact: &Artifact, digester: &mut Digester) -> Vec<String> {
    let dir = store.artifact_dir(&artifact.key);
    let mut damage = Vec::new();
    for (name, out) in &artifact.outputs {
        let path = dir.join(&out.path);
        match digester.digest(&path) {
            Ok(d) if d == out.digest => {}
            Ok(d) => damage.push(format!(
                "output `{name}` ({}): its content has digest {}, artifact.json records {}",
                out.path,
                short(&d),
                short(&out.digest)
            )),
            Err(e) => damage.push(format!(
                "output `{name}` ({}) cannot be read: {e}",
                out.path
            )),
        }
    }
    damage
}

/// Re-hash the entries `keys` (every published key with `None`), and with `records` check
/// every run record too.
pub fn verify(store: &Store, keys: Option<Vec<String>>, records: bool) -> Report {
    let mut report = Report::default();
    let keys = keys.unwrap_or_else(|| store.published_keys());
    for key in keys {
        report.entries += 1;
        let Some(artifact) = store.load(&key) else {
            report.findings.push(Finding {
                key,
                stage: None,
                problem: "not an artifact: artifact.json is missing, unreadable or names another key (the next build of this key sets it aside)".into(),
            });
            continue;
        };
        // A fresh digester: every byte is read again, whatever the memo says.
        for problem in check_outputs(store, &artifact, &mut Digester::fresh()) {
            report.findings.push(Finding {
                key: key.clone(),
                stage: Some(artifact.stage.clone()),
                problem,
            });
        }
    }
    if records {
        for (path, record) in store.run_records() {
            report.records += 1;
            for (stage, key) in &record.stages {
                let problem = match store.load(key) {
                    None if store.artifact_dir(key).exists() => {
                        "names an entry that is not an artifact"
                    }
                    None => continue, // collected by gc: the record is just out of date
                    // Keys leave names out: a sweep's copy (`sft[lr=1e-3]`) may be served
                    // the artifact its declared stage (`sft`) built with the same params.
                    Some(a) if base_name(&a.stage) != base_name(stage) => {
                        "names an artifact of another stage"
                    }
                    Some(_) => continue,
                };
                report.findings.push(Finding {
                    key: key.clone(),
                    stage: Some(stage.clone()),
                    problem: format!("run record {}: {problem}", path.display()),
                });
            }
        }
    }
    report
}

/// A stage's declared name: a sweep's copy `sft[lr=1e-3]` is `sft`.
fn base_name(stage: &str) -> &str {
    stage.split_once('[').map_or(stage, |(base, _)| base)
}
