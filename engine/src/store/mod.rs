//! The artifact store: one directory per published key, made visible by a single rename.
//!
//! ```text
//! <store>/
//!   artifacts/<key>/      published: artifact.json, log.txt, out/<declared outputs> (read-only)
//!   tmp/<key>.<attempt>/  a stage being built, one directory per attempt (never read as a result)
//!   failed/<key>/         the last failed attempt at a key, kept for its log until `gc`
//!   locks/<key>.lock      one writer per key, across processes (flock)
//!   locks/store.lock      held shared by every run and exec, exclusively by `gc`
//!   runs/<id>.json        the last run of each manifest (+variant): stage → key
//!   runs/<id>.journal     keys a run in progress (or killed) has published so far
//!   runs/history/<n>.json every run that ended: its record, with params and final metrics
//!   pins/<name>           a key that `gc` must keep
//!   cache/digests.json    the file-digest memo
//! ```
//!
//! The modules: [`fs`] writes files atomically; [`find`] finds a store and resolves a stage
//! name or key prefix in it; [`history`] keeps every run; [`attempt`] gives each build a
//! directory of its own; [`pins`]
//! keeps artifacts by name; [`gc`] removes what nothing references; [`verify`] re-digests
//! what is published.
//!
//! The invariants:
//! - `artifacts/<key>/` exists only complete. Everything is written and synced inside an
//!   attempt directory, then renamed into place, so a crash or `kill -9` at any instant leaves
//!   at worst a stray `tmp/` entry, which nothing reads and `gc` removes.
//! - An entry is published when its `artifact.json` parses and names its key ([`Store::load`]);
//!   anything else under `artifacts/` is set aside by the next build of that key.
//! - What is served is what was published: before a published output is used, its files are
//!   checked against the digests in `artifact.json` (by their stamp, re-hashed when it moved).

pub mod attempt;
mod find;
mod fs;
pub mod gc;
pub mod history;
mod pins;
pub mod verify;

pub use find::{artifact_json, lineage};
pub use fs::{seal, sync_dir, sync_tree, write_atomic};

use crate::diag::{Failure, Result, io_err};
use crate::digest::Digester;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::{Path, PathBuf};

pub const ARTIFACT_SCHEMA: u32 = 1;

#[derive(Debug, Clone)]
pub struct Store {
    pub root: PathBuf,
}

/// `artifact.json`: everything needed to trust, explain and trace a published result.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    pub schema: u32,
    pub key: String,
    pub stage: String,
    pub op: String,
    pub op_version: u32,
    pub params: Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    pub inputs: BTreeMap<String, InputRecord>,
    pub outputs: BTreeMap<String, OutputRecord>,
    pub metrics: serde_json::Map<String, Value>,
    pub upstream_keys: Vec<String>,
    pub manifest: String,
    pub started_at: String,
    pub seconds: f64,
    pub host: String,
    pub engine_version: String,
    /// What the stage used, beside what its plan estimated (absent in artifacts published
    /// before nemo-dag recorded it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRecord>,
}

/// The machine resources a stage used, and the plan's estimate of them. Fields unknown to this
/// version are ignored, so a later nemo-dag can record more without this one rebuilding.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResourceRecord {
    /// Peak resident memory, in bytes: of the `exec` process that ran the op (in-process
    /// training) or of its largest child (a `cmd`), whichever is larger.
    pub peak_rss_bytes: u64,
    /// CPU time of the op, user and system, in seconds: of the `exec` process and the children
    /// it waited for, from the op's start to its end (the attempt that published; a resumed
    /// training stage's earlier attempts are not counted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_user_seconds: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_system_seconds: Option<f64>,
    /// Bytes the op's processes read and wrote through system calls, over the same span
    /// ([`crate::usage::Counters`]: files, pipes and sockets; not memory-mapped pages).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub written_bytes: Option<u64>,
    /// The plan's estimate ([`nemo_dag_op::Estimate::to_json`]), when the op made one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimate: Option<Value>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum InputRecord {
    File {
        path: String,
        digest: String,
    },
    Upstream {
        stage: String,
        output: String,
        key: String,
        digest: String,
    },
}

impl InputRecord {
    pub fn digest(&self) -> &str {
        match self {
            InputRecord::File { digest, .. } | InputRecord::Upstream { digest, .. } => digest,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OutputRecord {
    /// Relative to the artifact's directory (`out/nums.txt`).
    pub path: String,
    pub digest: String,
    pub bytes: u64,
}

/// The last run of one manifest: which key each stage had. What each key published is read
/// from its `artifact.json`, never from here.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct RunRecord {
    pub manifest: String,
    pub variant: Option<String>,
    pub overrides: Vec<String>,
    pub argv: Vec<String>,
    pub finished_at: String,
    pub stages: BTreeMap<String, String>,
    /// How each stage ended in the last run that reached it: `executed`, `pulled` (from the
    /// shared cache), `cached` or `cutoff` (absent in records written before nemo-dag kept it).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outcomes: BTreeMap<String, String>,
    /// For each stage a run built: why, as what its key covers that changed since the run
    /// before ([`crate::plan::why_built`]). Kept while the stage keeps that key.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub why: BTreeMap<String, Vec<String>>,
}

/// What a consumer needs of a published stage: its key and the digest of each output.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    pub key: String,
    pub outputs: BTreeMap<String, String>,
}

impl From<&Artifact> for Published {
    fn from(a: &Artifact) -> Published {
        Published {
            key: a.key.clone(),
            outputs: a
                .outputs
                .iter()
                .map(|(k, o)| (k.clone(), o.digest.clone()))
                .collect(),
        }
    }
}

impl Store {
    /// A store at `root`, made absolute: stage commands run in their own directory, so every
    /// path handed to them must be absolute.
    pub fn new(root: PathBuf) -> Store {
        let root = std::path::absolute(&root).unwrap_or(root);
        Store { root }
    }

    pub fn artifacts(&self) -> PathBuf {
        self.root.join("artifacts")
    }

    pub fn artifact_dir(&self, key: &str) -> PathBuf {
        self.artifacts().join(key)
    }

    pub fn failed_dir(&self, key: &str) -> PathBuf {
        self.root.join("failed").join(key)
    }

    pub fn memo_file(&self) -> PathBuf {
        self.root.join("cache").join("digests.json")
    }

    /// Create the layout (only commands that write call this).
    pub fn ensure(&self) -> Result<()> {
        for sub in [
            "artifacts",
            "tmp",
            "failed",
            "locks",
            "runs",
            "pins",
            "cache",
            "trash",
        ] {
            let dir = self.root.join(sub);
            std::fs::create_dir_all(&dir).map_err(|e| io_err("cannot create", &dir, e))?;
        }
        let tag = self.root.join("CACHEDIR.TAG");
        if !tag.exists() {
            let _ = std::fs::write(
                &tag,
                "Signature: 8a477f597d28d172789f06886806bc55\n# nemo-dag artifact store\n",
            );
        }
        Ok(())
    }

    /// The published artifact for `key`, if there is one: the one definition of "published"
    /// is an `artifact.json` that parses and names this key.
    pub fn load(&self, key: &str) -> Option<Artifact> {
        let bytes = std::fs::read(self.artifact_dir(key).join("artifact.json")).ok()?;
        let artifact: Artifact = serde_json::from_slice(&bytes).ok()?;
        (artifact.key == key && artifact.schema == ARTIFACT_SCHEMA).then_some(artifact)
    }

    pub fn is_published(&self, key: &str) -> bool {
        self.load(key).is_some()
    }

    /// The published `key`, checked to be what was published: each output's files against the
    /// digests in its `artifact.json` (through `digester`'s memo, so an untouched output costs
    /// a `stat` per file). `Ok(None)` when the key is not published; when it was altered after
    /// publication, an error naming the stage, the key and each changed output, with the way
    /// out.
    pub fn lookup(
        &self,
        key: &str,
        digester: &mut Digester,
    ) -> std::result::Result<Option<Published>, String> {
        let Some(artifact) = self.load(key) else {
            return Ok(None);
        };
        let damage = verify::check_outputs(self, &artifact, digester);
        if damage.is_empty() {
            return Ok(Some(Published::from(&artifact)));
        }
        Err(format!(
            "the artifact of stage `{stage}` ({key}) was changed after it was published, and is not used: {damage}\n  help: `nemo-dag verify --all` lists every damaged entry; `nemo-dag run MANIFEST --force '{stage}'` rebuilds this one",
            stage = artifact.stage,
            key = short(key),
            damage = damage.join("; "),
        ))
    }

    /// An entry under `artifacts/<key>` that is not published (no readable `artifact.json`:
    /// an older crash, a hand edit) is moved aside so the key can be built. The caller holds
    /// the key's lock.
    pub fn set_aside_invalid(&self, key: &str) -> Result<bool> {
        let dir = self.artifact_dir(key);
        if !dir.exists() || self.load(key).is_some() {
            return Ok(false);
        }
        let trash = self
            .root
            .join("trash")
            .join(format!("{key}.invalid.{}", std::process::id()));
        std::fs::rename(&dir, &trash).map_err(|e| io_err("cannot move aside", &dir, e))?;
        let _ = std::fs::remove_dir_all(&trash);
        Ok(true)
    }

    /// Every run and exec holds this shared for as long as it works on the store; `gc` takes
    /// it exclusively, so it never deletes what a running build is about to use.
    pub fn hold_shared(&self) -> Result<File> {
        let file = self.store_lock_file()?;
        file.lock_shared()
            .map_err(|e| io_err("cannot lock", &self.store_lock_path(), e))?;
        Ok(file)
    }

    /// The store to oneself (for `gc`), or `None` while a run or exec works on it.
    pub fn try_hold_exclusive(&self) -> Result<Option<File>> {
        let file = self.store_lock_file()?;
        match file.try_lock() {
            Ok(()) => Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => {
                Err(io_err("cannot lock", &self.store_lock_path(), e))
            }
        }
    }

    fn store_lock_path(&self) -> PathBuf {
        self.root.join("locks").join("store.lock")
    }

    fn store_lock_file(&self) -> Result<File> {
        let path = self.store_lock_path();
        File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| io_err("cannot open lock", &path, e))
    }

    /// Block until this process is the only one working on `key`. Dropping the file unlocks.
    pub fn lock(&self, key: &str) -> Result<File> {
        let (file, path) = self.lock_file(key)?;
        file.lock().map_err(|e| io_err("cannot lock", &path, e))?;
        Ok(file)
    }

    /// The key's lock if no other process holds it now (for a caller that must not block).
    pub fn try_lock(&self, key: &str) -> Result<Option<File>> {
        let (file, path) = self.lock_file(key)?;
        match file.try_lock() {
            Ok(()) => Ok(Some(file)),
            Err(std::fs::TryLockError::WouldBlock) => Ok(None),
            Err(std::fs::TryLockError::Error(e)) => Err(io_err("cannot lock", &path, e)),
        }
    }

    fn lock_file(&self, key: &str) -> Result<(File, PathBuf)> {
        let path = self.root.join("locks").join(format!("{key}.lock"));
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| io_err("cannot open lock", &path, e))?;
        Ok((file, path))
    }

    /// Move a finished `tmp` directory into place as `artifacts/<key>`. With `replace`, an
    /// existing entry is swapped out first (a forced rerun).
    pub fn publish(&self, tmp: &Path, key: &str, replace: bool) -> Result<()> {
        let dest = self.artifact_dir(key);
        if replace && dest.exists() {
            let trash = self
                .root
                .join("trash")
                .join(format!("{key}.{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&trash);
            std::fs::rename(&dest, &trash).map_err(|e| io_err("cannot move aside", &dest, e))?;
            let _ = std::fs::remove_dir_all(&trash);
        }
        std::fs::rename(tmp, &dest).map_err(|e| io_err("cannot publish", &dest, e))?;
        sync_dir(&self.artifacts());
        Ok(())
    }

    pub fn run_record_path(&self, id: &str) -> PathBuf {
        self.root.join("runs").join(format!("{id}.json"))
    }

    /// A run's journal: the keys it has published so far, one line each, appended as each
    /// stage is published (O(1) a stage) and removed once the run's record is written. A run
    /// killed before its record keeps its results live for `gc` through its journal.
    pub fn journal_path(&self, id: &str) -> PathBuf {
        self.root.join("runs").join(format!("{id}.journal"))
    }

    pub fn journal(&self, id: &str, key: &str) -> Result<()> {
        use std::io::Write;
        let path = self.journal_path(id);
        File::options()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(format!("{key}\n").as_bytes()))
            .map_err(|e| io_err("cannot write the run journal", &path, e))
    }

    /// Every key in every run journal.
    fn journaled_keys(&self) -> Vec<String> {
        std::fs::read_dir(self.root.join("runs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "journal"))
            .filter_map(|e| std::fs::read_to_string(e.path()).ok())
            .flat_map(|text| {
                text.lines()
                    .map(str::trim)
                    .filter(|k| !k.is_empty())
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    pub fn run_records(&self) -> Vec<(PathBuf, RunRecord)> {
        let mut out: Vec<(PathBuf, RunRecord)> = std::fs::read_dir(self.root.join("runs"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let p = e.path();
                let rec = serde_json::from_slice(&std::fs::read(&p).ok()?).ok()?;
                Some((p, rec))
            })
            .collect();
        out.sort_by(|a, b| a.1.finished_at.cmp(&b.1.finished_at));
        out
    }

    pub fn pins(&self) -> BTreeMap<String, String> {
        std::fs::read_dir(self.root.join("pins"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let key = std::fs::read_to_string(e.path()).ok()?;
                Some((
                    e.file_name().to_string_lossy().to_string(),
                    key.trim().to_string(),
                ))
            })
            .collect()
    }

    pub fn published_keys(&self) -> Vec<String> {
        let mut keys: Vec<String> = std::fs::read_dir(self.artifacts())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .collect();
        keys.sort();
        keys
    }

    /// Resolve a full key or a unique prefix of at least 6 hex digits.
    pub fn resolve_key(&self, prefix: &str) -> Result<Option<String>> {
        if prefix.len() < 6 || !prefix.chars().all(|c| c.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let matches: Vec<String> = self
            .published_keys()
            .into_iter()
            .filter(|k| k.starts_with(prefix))
            .collect();
        match matches.len() {
            0 => Ok(None),
            1 => Ok(matches.into_iter().next()),
            n => Err(Failure::Input(Box::new(crate::diag::InputError::new(
                format!("key prefix `{prefix}` matches {n} artifacts; give more digits"),
            )))),
        }
    }

    /// Every key that a run record, run journal or pin references, with all of their
    /// ancestors.
    pub fn live_keys(&self) -> BTreeSet<String> {
        let mut todo: Vec<String> = self
            .run_records()
            .into_iter()
            .flat_map(|(_, r)| r.stages.into_values())
            .chain(self.journaled_keys())
            .chain(self.pins().into_values())
            .collect();
        let mut live = BTreeSet::new();
        while let Some(key) = todo.pop() {
            if !live.insert(key.clone()) {
                continue;
            }
            if let Some(a) = self.load(&key) {
                todo.extend(a.upstream_keys);
            }
        }
        live
    }
}

/// A key as people see it: its first 12 hex digits.
pub fn short(key: &str) -> &str {
    &key[..key.len().min(12)]
}

/// RFC 3339 UTC timestamp with milliseconds, from the system clock.
pub fn timestamp() -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        now.subsec_millis()
    )
}

pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates on success.
    let ok = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } == 0;
    if !ok {
        return "unknown".into();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn timestamps_are_rfc3339() {
        let t = super::timestamp();
        assert_eq!(t.len(), 24, "{t}");
        assert!(t.ends_with('Z') && t.as_bytes()[10] == b'T', "{t}");
    }
}
