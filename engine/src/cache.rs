//! The shared cache as the store sees it ([`nemo_dag_remote`] moves the bytes): the `[cache]`
//! section of `env.toml`, pulling a stage's artifact into the store, and pushing one out.
//!
//! A pull publishes under the store's own rules: the key's lock, a directory in `tmp/` that
//! nothing else reads, every blob checked against its digest as it streams and every output
//! against `artifact.json` before the one rename into `artifacts/<key>`. A push sends the blobs
//! first and the stage's record last, create-only, so a record never names a blob that is not
//! there, and a record is never replaced.
//!
//! A cache that fails never fails a run: the first failure is said once, and the run goes on
//! building here, as if no cache were configured.

use crate::diag::InputError;
use crate::digest::Digester;
use crate::executor::profile::Section;
use crate::store::{Artifact, Published, Store, short};
use futures::StreamExt;
use nemo_dag_remote::{Entry, Error, Producer, RECORD_SCHEMA, Record, Remote, Settings, Written};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The keys `[cache]` takes.
const KEYS: [&str; 6] = ["url", "endpoint", "region", "allow_http", "read", "write"];
/// Blobs of one artifact moving at once.
const BLOBS_IN_FLIGHT: usize = 8;
/// Stages of one wave of `push`, `pull` or `cache status` moving at once.
const STAGES_IN_FLIGHT: usize = 8;

/// One blob moving, boxed so that a run's tasks can hold several (and stay `Send`).
type Moving<'a, T> = std::pin::Pin<Box<dyn Future<Output = Result<T, Error>> + Send + 'a>>;

/// The shared cache of a run: the remote, where it was configured, and whether it still works.
#[derive(Debug)]
pub struct Cache {
    pub remote: Remote,
    /// The `env.toml` that configured it (its errors and warnings name it).
    pub file: PathBuf,
    /// Why it stopped being used, once something failed: said once, then nothing is tried.
    down: Mutex<Option<String>>,
    /// Whether records may be written: the probe's verdict, taken at the first write.
    writable: tokio::sync::OnceCell<Result<(), String>>,
}

/// What a pull did.
#[derive(Debug)]
pub enum Pulled {
    /// Published from the cache, from this scope's record.
    Pulled { scope: String, bytes: u64 },
    /// Published here already (another run got there first).
    Here,
    /// No read scope has the key.
    Absent,
    /// The cache could not give it: the stage builds here. The reason, for the stage's line.
    Refused(String),
    /// The cache is not in use (down, or failed earlier in this run).
    Off,
}

/// What a push did.
#[derive(Debug, PartialEq)]
pub enum Pushed {
    /// The record was written, with this many bytes of blobs sent.
    Pushed { bytes: u64 },
    /// The write scope has the key already.
    There,
    /// The write scope had a record of the key from another writer with other outputs: theirs
    /// is kept. (A stage that does not give the same bytes twice, or tampering.)
    Conflict(String),
    /// Not pushed: no write scope, the cache is down, or the server cannot be trusted to keep
    /// a record once written (said once).
    Off,
}

impl Cache {
    /// The `[cache]` of the `env.toml` found from `start`, if there is one, checked: an unknown
    /// key, a bad URL or a bad scope is an error at its place in the file.
    pub fn load(start: &Path) -> Result<Option<Cache>, InputError> {
        let Some(section) = Section::load(start, "cache")? else {
            return Ok(None);
        };
        let table = &section.table;
        let at = |key: &str, message: String| section.at(key, message);
        if let Some(key) = table.keys().find(|k| {
            ["secret", "access_key", "token"]
                .iter()
                .any(|c| k.contains(c))
        }) {
            return Err(at(key, format!("[cache] has no key `{key}`")).help(
                "credentials never go in env.toml: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment (or use web identity or the instance's metadata)",
            ));
        }
        section.check_keys(&KEYS)?;
        let text = |key: &str| section.text(key);
        let url = text("url")?.ok_or_else(|| {
            at("", "[cache] needs a `url`".into())
                .help("`url = \"s3://bucket/prefix\"` or `url = \"file:///a/shared/directory\"`")
        })?;
        let endpoint = text("endpoint")?;
        let region = text("region")?;
        let allow_http = match table.get("allow_http") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(at(
                    "allow_http",
                    "cache.allow_http must be true or false".into(),
                ));
            }
        };
        if let Some(e) = &endpoint {
            if !(e.starts_with("https://") || e.starts_with("http://")) {
                return Err(at(
                    "endpoint",
                    format!("cache.endpoint `{e}` is not an http(s):// address"),
                ));
            }
            if e.starts_with("http://") && !allow_http {
                return Err(at("endpoint", format!("cache.endpoint `{e}` is plain HTTP"))
                    .help("set `allow_http = true` for a loopback test server; anything else should be https://"));
            }
            if allow_http && e.starts_with("http://") && !is_loopback(e) {
                return Err(at("allow_http", format!("allow_http is only for a server on this machine, and `{e}` is not one"))
                    .help("use https:// for a server across a network: requests carry signed credentials and the artifacts themselves"));
            }
        }
        if allow_http && endpoint.is_none() {
            return Err(at(
                "allow_http",
                "allow_http is for the loopback server `endpoint` names, and there is no endpoint"
                    .into(),
            )
            .help("add `endpoint = \"http://127.0.0.1:PORT\"`, or remove allow_http"));
        }
        let write = text("write")?;
        if let Some(w) = &write {
            check_scope(w).map_err(|why| at("write", format!("cache.write: {why}")))?;
        }
        let read = match table.get("read") {
            None => write.iter().cloned().collect(),
            Some(Value::Array(items)) => {
                let mut read = Vec::new();
                for item in items {
                    let Some(scope) = item.as_str() else {
                        return Err(at("read", "cache.read is a list of scope names".into()));
                    };
                    check_scope(scope).map_err(|why| at("read", format!("cache.read: {why}")))?;
                    read.push(scope.to_string());
                }
                read
            }
            Some(_) => {
                return Err(at(
                    "read",
                    "cache.read is a list of scope names: `read = [\"main\", \"alice\"]`".into(),
                ));
            }
        };
        if read.is_empty() && write.is_none() {
            return Err(at("", "[cache] reads no scope and writes none".into())
                .help("name the scopes to read (`read = [\"main\"]`) and the one to write (`write = \"alice\"`)"));
        }
        let settings = Settings {
            url,
            endpoint,
            region,
            allow_http,
            read,
            write,
        };
        let remote =
            Remote::open(settings).map_err(|why| at("url", format!("cache.url: {why}")))?;
        let cache = Cache {
            remote,
            file: section.file.clone(),
            down: Mutex::new(None),
            writable: tokio::sync::OnceCell::new(),
        };
        if let Some(why) = cache.remote.unreachable.clone() {
            cache.went_down(&Error::Unreachable(why));
        }
        Ok(Some(cache))
    }

    /// Whether the cache is still in use this run.
    fn up(&self) -> bool {
        self.down.lock().map(|d| d.is_none()).unwrap_or(false)
    }

    /// Stop using the cache for the rest of the run, and say why (once).
    fn went_down(&self, why: &Error) {
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        if down.is_none() {
            // Without credentials in the environment, object_store asks the instance's metadata
            // service, and the failure names only that.
            let hint = if self.remote.settings.url.starts_with("s3://")
                && why.to_string().contains("169.254.169.254")
                && std::env::var_os("AWS_ACCESS_KEY_ID").is_none()
            {
                " (no AWS_ACCESS_KEY_ID in the environment, and no instance credentials here)"
            } else {
                ""
            };
            eprintln!(
                "nemo-dag: warning: the shared cache {} ([cache] in {}) cannot be used: {why}{hint}; this run builds here and pushes nothing",
                self.remote.settings.url,
                self.file.display()
            );
            *down = Some(format!("{why}{hint}"));
        }
    }

    /// Why the cache is not in use, if it is not.
    pub fn down_reason(&self) -> Option<String> {
        self.down.lock().ok().and_then(|d| d.clone())
    }

    /// Why records may not be written here, once a write was tried and the server refused.
    pub fn write_refusal(&self) -> Option<String> {
        self.writable.get().and_then(|v| v.clone().err())
    }

    /// The record of `key` in the first read scope that has one.
    pub async fn find(&self, key: &str) -> Result<Option<Record>, Error> {
        if !self.up() {
            return Ok(None);
        }
        self.remote.find(key).await.inspect_err(|e| {
            if !matches!(e, Error::Corrupt(_)) {
                self.went_down(e);
            }
        })
    }

    /// Pull `key` into `store` from the first read scope that has it.
    pub async fn pull(&self, store: &Store, key: &str) -> Pulled {
        if !self.up() {
            return Pulled::Off;
        }
        let record = match self.find(key).await {
            Ok(Some(record)) => record,
            Ok(None) if self.up() => return Pulled::Absent,
            Ok(None) => return Pulled::Off,
            Err(_) if !self.up() => return Pulled::Off,
            Err(e) => return Pulled::Refused(e.to_string()),
        };
        // The key's lock, as `exec` takes it: a build of the same key elsewhere finishes
        // first. Polled, not waited on in a thread, so that an interrupted run ends at once.
        let lock = loop {
            match store.try_lock(key) {
                Ok(Some(file)) => break file,
                Ok(None) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
                Err(e) => return Pulled::Refused(e.to_string()),
            }
        };
        if store.is_published(key) {
            return Pulled::Here;
        }
        if let Err(e) = store.set_aside_invalid(key) {
            return Pulled::Refused(e.to_string());
        }
        let dir = store.root.join("tmp").join(format!(
            "pull-{key}.{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        ));
        let laid_out = match self.assemble(&record, &dir).await {
            Err(e) => {
                if matches!(e, Error::Unreachable(_)) {
                    self.went_down(&e);
                }
                Err(e.to_string())
            }
            // Hashing, syncing and the rename are blocking work: off the run's own thread,
            // which meanwhile starts stages and shows their output. The key's lock goes with
            // it: a pull cancelled meanwhile still holds the key until its rename is done.
            Ok(()) => {
                let (record, dir, store, key) =
                    (record.clone(), dir.clone(), store.clone(), key.to_string());
                tokio::task::spawn_blocking(move || {
                    let _lock = lock;
                    verify_pulled(&record, &dir).and_then(|()| {
                        crate::store::seal(&dir).map_err(|e| e.to_string())?;
                        crate::store::sync_tree(&dir).map_err(|e| e.to_string())?;
                        store.publish(&dir, &key, false).map_err(|e| e.to_string())
                    })
                })
                .await
                .unwrap_or_else(|e| Err(format!("internal: the check of the pull failed: {e}")))
            }
        };
        match laid_out {
            Ok(()) => Pulled::Pulled {
                scope: record.scope.clone(),
                bytes: record.bytes(),
            },
            Err(why) => {
                let _ = std::fs::remove_dir_all(&dir);
                Pulled::Refused(format!(
                    "the cache's copy (scope `{}`, made on {} at {}) was refused: {why}",
                    record.scope, record.producer.host, record.producer.created_at
                ))
            }
        }
    }

    /// Lay `record` out under `dir`: directories and links, and every file downloaded and
    /// checked against its digest, several at once.
    async fn assemble(&self, record: &Record, dir: &Path) -> Result<(), Error> {
        let local = |path: &Path, e: std::io::Error| {
            Error::Local(format!("cannot write {}: {e}", path.display()))
        };
        std::fs::create_dir_all(dir).map_err(|e| local(dir, e))?;
        let mut files = Vec::new();
        // Links last, once everything else is in place ([`Record::check`] refused any entry
        // under a link, and any link out of the outputs).
        let (links, rest): (Vec<&Entry>, Vec<&Entry>) = record
            .entries
            .iter()
            .partition(|e| matches!(e, Entry::Link { .. }));
        for entry in rest.into_iter().chain(links) {
            let path = dir.join(entry.path());
            match entry {
                Entry::Dir { .. } => std::fs::create_dir_all(&path).map_err(|e| local(&path, e))?,
                Entry::Link { target, .. } => {
                    if let Some(parent) = path.parent() {
                        std::fs::create_dir_all(parent).map_err(|e| local(parent, e))?;
                    }
                    std::os::unix::fs::symlink(target, &path).map_err(|e| local(&path, e))?;
                }
                Entry::File {
                    digest,
                    bytes,
                    executable,
                    ..
                } => {
                    if let Some(parent) = path.parent() {
                        std::fs::create_dir_all(parent).map_err(|e| local(parent, e))?;
                    }
                    files.push((digest, *bytes, *executable, path));
                }
            }
        }
        let remote = &self.remote;
        let downloads: Vec<Moving<'_, ()>> = files
            .into_iter()
            .map(|(digest, bytes, executable, path)| {
                Box::pin(async move {
                    remote.download(digest, bytes, &path).await?;
                    if executable {
                        use std::os::unix::fs::PermissionsExt;
                        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                            .map_err(|e| local(&path, e))?;
                    }
                    Ok(())
                }) as Moving<'_, ()>
            })
            .collect();
        let mut downloads = futures::stream::iter(downloads).buffer_unordered(BLOBS_IN_FLIGHT);
        while let Some(done) = downloads.next().await {
            done?;
        }
        Ok(())
    }

    /// Whether records may be written here: a write scope, and a server that refuses a second
    /// create (probed once).
    async fn can_write(&self) -> bool {
        if self.remote.settings.write.is_none() || !self.up() {
            return false;
        }
        let verdict = self
            .writable
            .get_or_init(|| async {
                self.remote.probe().await.map_err(|e| {
                    if matches!(e, Error::Unreachable(_)) {
                        self.went_down(&e);
                    } else {
                        eprintln!(
                            "nemo-dag: warning: nothing is pushed to the shared cache {} ([cache] in {}): {e}",
                            self.remote.settings.url,
                            self.file.display()
                        );
                    }
                    e.to_string()
                })
            })
            .await;
        verdict.is_ok()
    }

    /// Push the published `key` to the write scope: its blobs, then its record.
    pub async fn push(&self, store: &Store, key: &str) -> Result<Pushed, Error> {
        let Some(scope) = self.remote.settings.write.clone() else {
            return Ok(Pushed::Off);
        };
        if !self.up() {
            return Ok(Pushed::Off);
        }
        let artifact = store
            .load(key)
            .ok_or_else(|| Error::Local(format!("{} is not published here", short(key))))?;
        // A record there already is never replaced; if its outputs are not ours, say so.
        match self.remote.record(&scope, key).await {
            Ok(Some(theirs)) => return Ok(compare(&theirs, &output_digests(&artifact))),
            Ok(None) => {}
            Err(e @ Error::Corrupt(_)) => return Err(e),
            Err(e) => {
                self.went_down(&e);
                return Ok(Pushed::Off);
            }
        }
        if !self.can_write().await {
            return Ok(Pushed::Off);
        }
        let dir = store.artifact_dir(key);
        let entries = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || entries_of(&dir))
                .await
                .map_err(|e| Error::Local(format!("internal: hashing the artifact failed: {e}")))?
                .map_err(Error::Local)?
        };
        let mut seen = std::collections::HashSet::new();
        let blobs: Vec<(String, u64, PathBuf)> = entries
            .iter()
            .filter_map(|e| match e {
                Entry::File {
                    path,
                    digest,
                    bytes,
                    ..
                } if seen.insert(digest.clone()) => Some((digest.clone(), *bytes, dir.join(path))),
                _ => None,
            })
            .collect();
        let mut sent = 0u64;
        let remote = &self.remote;
        let uploads: Vec<Moving<'_, u64>> = blobs
            .into_iter()
            .map(|(digest, bytes, path)| {
                Box::pin(async move {
                    let uploaded = remote.upload(&digest, &path, bytes).await?;
                    Ok(if uploaded { bytes } else { 0 })
                }) as Moving<'_, u64>
            })
            .collect();
        let mut uploads = futures::stream::iter(uploads).buffer_unordered(BLOBS_IN_FLIGHT);
        while let Some(done) = uploads.next().await {
            match done {
                Ok(bytes) => sent += bytes,
                Err(e) => {
                    if matches!(e, Error::Unreachable(_)) {
                        self.went_down(&e);
                    }
                    return Err(e);
                }
            }
        }
        drop(uploads);
        let record = Record {
            schema: RECORD_SCHEMA,
            key: key.to_string(),
            scope,
            producer: Producer {
                host: crate::store::hostname(),
                engine_version: env!("CARGO_PKG_VERSION").to_string(),
                created_at: crate::store::timestamp(),
            },
            outputs: output_digests(&artifact),
            entries,
        };
        match self.remote.put_record(&record).await? {
            Written::Created => Ok(Pushed::Pushed { bytes: sent }),
            // Another writer got there between our look and our write.
            Written::Existing(theirs) => Ok(compare(&theirs, &record.outputs)),
        }
    }
}

/// A record already in the write scope, against the outputs we would have written.
fn compare(theirs: &Record, ours: &BTreeMap<String, String>) -> Pushed {
    if &theirs.outputs == ours {
        return Pushed::There;
    }
    Pushed::Conflict(format!(
        "scope `{}` already has key {} from {} at {} (nemo-dag {}) with other outputs ({}); theirs is kept: the stage does not give the same bytes twice, or one of the two was tampered with",
        theirs.scope,
        short(&theirs.key),
        theirs.producer.host,
        theirs.producer.created_at,
        theirs.producer.engine_version,
        differing(&theirs.outputs, ours)
    ))
}

/// What `push`, `pull` and `cache status` do with each stage.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transfer {
    Push,
    Pull,
    Status,
}

/// One stage of `push`, `pull` or `cache status`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub name: String,
    /// `None`: an upstream stage is neither here nor in the cache, so its key is unknown.
    pub key: Option<String>,
    /// Published in this store (after a pull: because it was pulled).
    pub local: bool,
    /// The read scope that has it, if one does (for `push`: the write scope, once pushed).
    pub remote: Option<String>,
    /// What was done: `pushed`, `pulled`, or nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub done: Option<&'static str>,
    /// Bytes sent or received.
    pub bytes: u64,
    /// Why a stage was not moved, when it could have been.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub problem: Option<String>,
}

/// Walk the selected stages in order, keying each from what is published here or recorded in
/// the cache, and push, pull or only report each. An unreachable cache is an error here: moving
/// artifacts is all these commands do.
pub fn transfer(
    manifest: &crate::manifest::Manifest,
    store: &Store,
    cache: &Cache,
    targets: &[String],
    what: Transfer,
) -> crate::diag::Result<Vec<Row>> {
    walk(manifest, store, cache, targets, what, None).map(|(rows, _)| rows)
}

/// What a cluster job needs to build `stage` in a store of its own: the stage's direct inputs
/// and the stage itself are pulled where this store lacks them; the stages further up are
/// keyed from the cache's records and stay where they are. The rows, and every upstream
/// stage's key and outputs, for [`crate::executor::local::spec_for_stage`].
pub fn pull_inputs(
    manifest: &crate::manifest::Manifest,
    store: &Store,
    cache: &Cache,
    stage: &str,
) -> crate::diag::Result<(Vec<Row>, HashMap<String, Published>)> {
    let mut needed: std::collections::BTreeSet<String> =
        manifest.stages[stage].deps.iter().cloned().collect();
    needed.insert(stage.to_string());
    walk(
        manifest,
        store,
        cache,
        &[stage.to_string()],
        Transfer::Pull,
        Some(&needed),
    )
}

/// [`transfer`], where `pulled_only` (for a pull) limits what is pulled: the other stages are
/// only keyed, from this store or the cache's records.
fn walk(
    manifest: &crate::manifest::Manifest,
    store: &Store,
    cache: &Cache,
    targets: &[String],
    what: Transfer,
    pulled_only: Option<&std::collections::BTreeSet<String>>,
) -> crate::diag::Result<(Vec<Row>, HashMap<String, Published>)> {
    let selected = crate::executor::local::select(manifest, targets)?;
    if what == Transfer::Push && cache.remote.settings.write.is_none() {
        return Err(InputError::new(format!(
            "[cache] in {} writes no scope, so nothing can be pushed",
            cache.file.display()
        ))
        .help("add `write = \"SCOPE\"` to [cache]: the one scope your credentials may write")
        .into());
    }
    let mut digester = Digester::load(&store.memo_file());
    if what == Transfer::Pull {
        store.ensure()?;
    }
    let _shared = if store.root.join("locks").is_dir() {
        Some(store.hold_shared()?)
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| miette::miette!("cannot start the transfer: {e}"))?;
    let mut published: HashMap<String, Published> = Default::default();
    let mut rows = Vec::new();
    // In waves: the stages whose upstream stages are all settled are keyed here, one after
    // another (from the store, or the records found in the wave before), then moved several
    // at once. A pipeline of independent stages is one wave.
    let mut pending: Vec<&String> = manifest
        .order
        .iter()
        .filter(|n| selected.contains(*n))
        .collect();
    let mut settled: std::collections::HashSet<&str> = Default::default();
    while !pending.is_empty() {
        let (wave, rest): (Vec<&String>, Vec<&String>) = pending.into_iter().partition(|n| {
            manifest.stages[n.as_str()]
                .deps
                .iter()
                .all(|d| !selected.contains(d) || settled.contains(d.as_str()))
        });
        pending = rest;
        if wave.is_empty() {
            return Err(
                miette::miette!("internal: the stages {pending:?} wait on each other").into(),
            );
        }
        let mut keyed = Vec::new();
        for name in &wave {
            let stage = &manifest.stages[name.as_str()];
            let mut row = Row {
                name: name.to_string(),
                key: None,
                local: false,
                remote: None,
                done: None,
                bytes: 0,
                problem: None,
            };
            let Some(resolved) = crate::plan::resolve(manifest, stage, &published, &mut digester)?
            else {
                rows.push(row);
                continue;
            };
            row.key = Some(resolved.key.clone());
            match store.lookup(&resolved.key, &mut digester) {
                Ok(Some(found)) => {
                    row.local = true;
                    published.insert(name.to_string(), found);
                }
                Ok(None) => {}
                Err(damage) => row.problem = Some(damage),
            }
            // Outside what is to be pulled, a stage only needs its key and outputs.
            let what = match pulled_only {
                Some(needed) if !needed.contains(name.as_str()) => {
                    if row.local {
                        rows.push(row);
                        continue;
                    }
                    Transfer::Status
                }
                _ => what,
            };
            keyed.push((row, resolved.key, what));
        }
        let moved: Vec<(Row, Option<crate::store::Published>)> = runtime.block_on(
            futures::stream::iter(
                keyed
                    .into_iter()
                    .map(|(row, key, what)| move_one(cache, store, what, row, key)),
            )
            .buffer_unordered(STAGES_IN_FLIGHT)
            .collect(),
        );
        for (row, found) in moved {
            if let Some(found) = found {
                published.entry(row.name.clone()).or_insert(found);
            }
            rows.push(row);
        }
        settled.extend(wave.iter().map(|n| n.as_str()));
        if cache.down_reason().is_some() {
            break;
        }
    }
    let position: std::collections::HashMap<&str, usize> = manifest
        .order
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    rows.sort_by_key(|r| position.get(r.name.as_str()).copied());
    let _ = digester.save(&store.memo_file());
    if what == Transfer::Pull {
        // What is here now is this manifest's state: its run record names it, so that `gc`
        // keeps what was pulled, and `show` finds it by stage name.
        let outcomes: Vec<crate::executor::local::Outcome> = rows
            .iter()
            .filter(|r| r.local)
            .map(|r| crate::executor::local::Outcome {
                name: r.name.clone(),
                key: r.key.clone(),
                state: if r.done.is_some() { "pulled" } else { "cached" },
                seconds: 0.0,
                error: None,
                log: None,
            })
            .collect();
        let argv: Vec<String> = std::env::args().collect();
        crate::executor::local::record_run(manifest, store, &argv, &outcomes)?;
    }
    if let Some(why) = cache.down_reason() {
        return Err(miette::miette!(
            help = format!(
                "check [cache] in {}, and that the server is up",
                cache.file.display()
            ),
            "the shared cache {} cannot be used: {why}",
            cache.remote.settings.url
        )
        .into());
    }
    if let Some(why) = cache.write_refusal() {
        return Err(miette::miette!(
            help = format!("[cache] in {}", cache.file.display()),
            "nothing was pushed to {}: {why}",
            cache.remote.settings.url
        )
        .into());
    }
    Ok((rows, published))
}

/// Push, pull or look up one keyed stage of [`transfer`]; what it leaves published (or, for
/// `cache status`, what its record says), so that the stages after it can be keyed.
async fn move_one(
    cache: &Cache,
    store: &Store,
    what: Transfer,
    mut row: Row,
    key: String,
) -> (Row, Option<crate::store::Published>) {
    let mut found = None;
    match what {
        Transfer::Push if row.local => match cache.push(store, &key).await {
            Ok(Pushed::Pushed { bytes }) => {
                row.done = Some("pushed");
                row.bytes = bytes;
                row.remote = cache.remote.settings.write.clone();
            }
            Ok(Pushed::There) => row.remote = cache.remote.settings.write.clone(),
            Ok(Pushed::Conflict(why)) => row.problem = Some(why),
            Ok(Pushed::Off) => {}
            Err(e) => row.problem = Some(e.to_string()),
        },
        Transfer::Pull if !row.local && row.problem.is_none() => {
            match cache.pull(store, &key).await {
                Pulled::Pulled { scope, bytes } => {
                    row.done = Some("pulled");
                    row.bytes = bytes;
                    row.remote = Some(scope);
                }
                Pulled::Refused(why) => row.problem = Some(why),
                Pulled::Here | Pulled::Absent | Pulled::Off => {}
            }
            if let Some(artifact) = store.load(&key) {
                row.local = true;
                found = Some(crate::store::Published::from(&artifact));
            }
        }
        _ => match cache.find(&key).await {
            Ok(Some(record)) => {
                row.remote = Some(record.scope.clone());
                // Keyed from the record, the stages downstream can be looked up too.
                found = Some(crate::store::Published {
                    key: key.clone(),
                    outputs: record.outputs.clone(),
                });
            }
            Ok(None) => {}
            Err(e) => row.problem = Some(e.to_string()),
        },
    }
    (row, found)
}

/// `127.0.0.1`, `localhost` or `[::1]`, with any port.
fn is_loopback(endpoint: &str) -> bool {
    let rest = endpoint
        .split_once("://")
        .map(|(_, r)| r)
        .unwrap_or(endpoint);
    let host = rest.split('/').next().unwrap_or("");
    let host = if host.starts_with('[') {
        host.split(']').next().map(|h| &h[1..]).unwrap_or("")
    } else {
        host.split(':').next().unwrap_or("")
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// A scope is a path segment of the cache: letters, digits, `.`, `_`, `-`.
fn check_scope(scope: &str) -> Result<(), String> {
    let ok = !scope.is_empty()
        && scope.len() <= 64
        && !scope.starts_with('.')
        && scope
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "`{scope}` is not a scope name: letters, digits, `.`, `_` and `-`, at most 64"
        ))
    }
}

fn output_digests(artifact: &Artifact) -> BTreeMap<String, String> {
    artifact
        .outputs
        .iter()
        .map(|(name, o)| (name.clone(), o.digest.clone()))
        .collect()
}

/// `out: abc… ≠ def…` for each output whose digest differs.
fn differing(a: &BTreeMap<String, String>, b: &BTreeMap<String, String>) -> String {
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    names
        .into_iter()
        .filter(|n| a.get(*n) != b.get(*n))
        .map(|n| {
            let d = |m: &BTreeMap<String, String>| {
                m.get(n)
                    .map(|d| short(d).to_string())
                    .unwrap_or("none".into())
            };
            format!("{n}: {} ≠ {}", d(a), d(b))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Every directory, file and link under a published artifact's directory, parents first.
fn entries_of(dir: &Path) -> Result<Vec<Entry>, String> {
    use std::os::unix::fs::PermissionsExt;
    let mut entries = Vec::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let here = dir.join(&rel);
        let listing = std::fs::read_dir(&here).map_err(|e| format!("{}: {e}", here.display()))?;
        for item in listing {
            let item = item.map_err(|e| format!("{}: {e}", here.display()))?;
            let path = rel.join(item.file_name());
            let name = path
                .to_str()
                .ok_or_else(|| format!("{} is not UTF-8", path.display()))?
                .to_string();
            let full = dir.join(&path);
            let meta =
                std::fs::symlink_metadata(&full).map_err(|e| format!("{}: {e}", full.display()))?;
            if meta.is_dir() {
                entries.push(Entry::Dir { path: name });
                todo.push(path);
            } else if meta.file_type().is_symlink() {
                let target =
                    std::fs::read_link(&full).map_err(|e| format!("{}: {e}", full.display()))?;
                entries.push(Entry::Link {
                    path: name,
                    target: target.to_string_lossy().into_owned(),
                });
            } else {
                let digest = crate::digest::hash_file(&full, meta.len())
                    .map_err(|e| format!("{}: {e}", full.display()))?;
                entries.push(Entry::File {
                    path: name,
                    digest: digest.to_hex().to_string(),
                    bytes: meta.len(),
                    executable: meta.permissions().mode() & 0o111 != 0,
                });
            }
        }
    }
    entries.sort_by(|a, b| a.path().cmp(b.path()));
    Ok(entries)
}

/// A pulled directory is the artifact its record says: an `artifact.json` of this key whose
/// outputs are the record's, each output's content hashing to its digest, and no link that
/// leaves the outputs.
fn verify_pulled(record: &Record, dir: &Path) -> Result<(), String> {
    let json = std::fs::read(dir.join("artifact.json"))
        .map_err(|e| format!("it has no artifact.json: {e}"))?;
    let artifact: Artifact = serde_json::from_slice(&json)
        .map_err(|e| format!("its artifact.json does not parse: {e}"))?;
    if artifact.key != record.key || artifact.schema != crate::store::ARTIFACT_SCHEMA {
        return Err(format!(
            "its artifact.json is of key {}",
            short(&artifact.key)
        ));
    }
    if output_digests(&artifact) != record.outputs {
        return Err(format!(
            "its artifact.json's outputs are not its record's ({})",
            differing(&output_digests(&artifact), &record.outputs)
        ));
    }
    if let Some((name, o)) = artifact.outputs.iter().find(|(_, o)| {
        !o.path.starts_with("out/")
            || !std::path::Path::new(&o.path)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
    }) {
        return Err(format!("its output `{name}` is at `{}`", o.path));
    }
    crate::exec::check_output_links(&dir.join("out"))?;
    let mut digester = Digester::fresh();
    for (name, output) in &artifact.outputs {
        let path = dir.join(&output.path);
        let got = digester
            .digest(&path)
            .map_err(|e| format!("output `{name}`: {e}"))?;
        if got != output.digest {
            return Err(format!(
                "output `{name}` hashes to {}, not {}",
                short(&got),
                short(&output.digest)
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_endpoints_are_told_apart_from_the_rest() {
        for yes in [
            "http://127.0.0.1:9000",
            "http://localhost:8014/",
            "http://[::1]:9000",
            "http://127.0.0.2",
        ] {
            assert!(is_loopback(yes), "{yes}");
        }
        for no in [
            "http://10.0.0.5:9000",
            "http://s3.example.com",
            "http://localhost.example.com",
            "http://127.0.0.1.nip.io",
        ] {
            assert!(!is_loopback(no), "{no}");
        }
    }

    #[test]
    fn scope_names_are_one_path_segment() {
        for ok in ["main", "alice", "ci-main", "pr_12.b"] {
            assert_eq!(check_scope(ok), Ok(()), "{ok}");
        }
        for bad in ["", "a/b", "..", ".hidden", "a b", &"x".repeat(65)] {
            assert!(check_scope(bad).is_err(), "{bad:?}");
        }
    }
}
