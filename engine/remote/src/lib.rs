//! The shared cache: a team's artifacts in object storage (S3 or an S3-compatible server, or a
//! shared directory), content-addressed, written once, and verified on the way back.
//!
//! ```text
//! <url>/
//!   cas/<blake3>            one file's bytes, named by their digest (written once)
//!   ac/<scope>/<key>.json   a stage's record: each file of its artifact by digest, its outputs'
//!                           digests, and who made it (written once, after every blob)
//!   probe/<nonce>           the conditional-create probe, deleted after
//! ```
//!
//! The shape is Bazel's remote cache (a CAS of blobs plus an action cache from key to result),
//! with the lessons of Nx's CVE-2025-36852 ("CREEP") applied:
//! - a blob is trusted only after its bytes hash to its name, as they stream in;
//! - a record is created with `If-None-Match: *` and never overwritten, and only after the
//!   server has shown that it refuses a second create ([`Remote::probe`]);
//! - records live in scopes: a reader names the scopes it trusts, in order, and writes one.
//!
//! This crate moves bytes and records; what an artifact directory is, and publishing a pulled
//! one, is the engine's (`nemo_dag_engine::cache`).

use bytes::Bytes;
use futures::StreamExt;
use object_store::aws::{AmazonS3Builder, S3ConditionalPut};
use object_store::azure::MicrosoftAzureBuilder;
use object_store::gcp::GoogleCloudStorageBuilder;
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path as Location;
use object_store::{
    ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig,
    WriteMultipart,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Component, Path};
use std::sync::Arc;
use std::time::Duration;

/// The record format; a record of another schema is not used.
pub const RECORD_SCHEMA: u32 = 1;

/// Files up to this size go up in one request; larger ones in parts of this size.
const PART_BYTES: usize = 16 << 20;
/// A downloaded blob's bytes, in order: hashed, counted and written.
struct Sink<'a> {
    file: &'a mut std::fs::File,
    hasher: blake3::Hasher,
    received: u64,
    moved: &'a std::sync::atomic::AtomicU64,
}

impl Sink<'_> {
    fn take(&mut self, chunk: &[u8], dest: &Path) -> Result<(), Error> {
        self.received += chunk.len() as u64;
        self.moved
            .fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
        self.hasher.update(chunk);
        self.file
            .write_all(chunk)
            .map_err(|e| Error::Local(format!("cannot write {}: {e}", dest.display())))
    }
}

/// The memory all transfers of one process may buffer at once, in MiB.
const BUFFER_MIB: u32 = 512;

/// The size of a ranged part of a download (a blob up to this size is one GET).
const DOWNLOAD_PART_BYTES: u64 = 8 << 20;
/// Parts of one file in flight at once.
const PARTS_IN_FLIGHT: usize = 8;

/// The `[cache]` section of `env.toml`, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `s3://bucket/prefix` or `file:///shared/path`.
    pub url: String,
    /// An S3-compatible server's address (`http://127.0.0.1:9000`).
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// Plain HTTP, for a loopback or test endpoint.
    pub allow_http: bool,
    /// The scopes whose records are used, in order.
    pub read: Vec<String>,
    /// The one scope written; `None`: read-only.
    pub write: Option<String>,
}

/// Why the cache could not do something. None of these is ever a reason to fail a run: the
/// stage builds locally instead.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// The server did not answer, or answered with a failure of its own.
    Unreachable(String),
    /// The server refused: credentials, permissions, or conditional creates it does not honour.
    Refused(String),
    /// What came back is not what its name or record says.
    Corrupt(String),
    /// A file here could not be read or written.
    Local(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Unreachable(m) | Error::Refused(m) | Error::Corrupt(m) | Error::Local(m) => {
                f.write_str(m)
            }
        }
    }
}

impl std::error::Error for Error {}

/// Who wrote a record: for an audit, and for the report when two writers disagree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Producer {
    pub host: String,
    pub engine_version: String,
    pub created_at: String,
}

/// One entry of an artifact's directory, by its path relative to that directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Entry {
    File {
        path: String,
        digest: String,
        bytes: u64,
        executable: bool,
    },
    Dir {
        path: String,
    },
    /// A relative link within the artifact's outputs (the only kind a published artifact has).
    Link {
        path: String,
        target: String,
    },
}

impl Entry {
    pub fn path(&self) -> &str {
        match self {
            Entry::File { path, .. } | Entry::Dir { path } | Entry::Link { path, .. } => path,
        }
    }
}

/// What a scope knows of one stage key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub schema: u32,
    pub key: String,
    pub scope: String,
    pub producer: Producer,
    /// Each declared output's digest, as the artifact's `artifact.json` has it: enough to key
    /// the stages downstream without downloading anything.
    pub outputs: BTreeMap<String, String>,
    /// Every file, directory and link of the artifact, parents before children.
    pub entries: Vec<Entry>,
}

impl Record {
    /// The bytes of every file, counted once per digest.
    pub fn bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.entries
            .iter()
            .filter_map(|e| match e {
                Entry::File { digest, bytes, .. } if seen.insert(digest) => Some(*bytes),
                _ => None,
            })
            .sum()
    }

    /// Whether this record can be laid out under a directory without leaving it: every path
    /// relative and plain, every digest a blake3 one, each path once. A record comes from a
    /// server, and a server is not trusted to name paths.
    pub fn check(&self, key: &str, scope: &str) -> Result<(), String> {
        if self.schema != RECORD_SCHEMA {
            return Err(format!(
                "schema {} (this nemo-dag reads {RECORD_SCHEMA})",
                self.schema
            ));
        }
        if self.key != key || self.scope != scope {
            return Err(format!(
                "it names key {} in scope `{}`",
                short(&self.key),
                self.scope
            ));
        }
        let mut seen = std::collections::HashSet::new();
        let links: std::collections::HashSet<&str> = self
            .entries
            .iter()
            .filter(|e| matches!(e, Entry::Link { .. }))
            .map(Entry::path)
            .collect();
        for entry in &self.entries {
            let path = entry.path();
            if !plain_relative(path) {
                return Err(format!("it names the path `{path}`"));
            }
            if !seen.insert(path) {
                return Err(format!("it names `{path}` twice"));
            }
            // Nothing is laid out through a link: the link could point anywhere.
            let mut parent = Path::new(path).parent();
            while let Some(p) = parent.and_then(Path::to_str).filter(|p| !p.is_empty()) {
                if links.contains(p) {
                    return Err(format!("`{path}` lies under the link `{p}`"));
                }
                parent = Path::new(p).parent();
            }
            match entry {
                Entry::File { digest, .. } if !is_digest(digest) => {
                    return Err(format!("`{path}` has the digest `{digest}`"));
                }
                Entry::Link { target, .. } if !link_stays_in_outputs(path, target) => {
                    return Err(format!(
                        "`{path}` links to `{target}`, outside the artifact's outputs"
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// `a/b/c`: no root, no `.` or `..`, nothing empty.
fn plain_relative(path: &str) -> bool {
    !path.is_empty()
        && !path.contains('\\')
        && Path::new(path)
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
}

/// A link under `out/` whose relative target, read from the link's directory, stays under
/// `out/` (as a published artifact's links do: the engine refuses any other at publish).
fn link_stays_in_outputs(path: &str, target: &str) -> bool {
    if !path.starts_with("out/") || target.is_empty() || target.starts_with('/') {
        return false;
    }
    let mut at: Vec<&str> = path.split('/').collect();
    at.pop();
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                if at.pop().is_none() {
                    return false;
                }
            }
            name => at.push(name),
        }
    }
    at.len() >= 2 && at[0] == "out"
}

fn is_digest(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn short(key: &str) -> &str {
    &key[..key.len().min(12)]
}

/// A record written, or the one a writer before us left under that key.
#[derive(Debug, Clone, PartialEq)]
pub enum Written {
    Created,
    Existing(Box<Record>),
}

/// A connection to the cache at `settings.url`.
#[derive(Debug)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    prefix: Location,
    pub settings: Settings,
    /// Why the cache cannot be reached at all, found without asking it: a `file://` directory
    /// that is not there (a share that is not mounted). Like a server that is down, a run
    /// then builds here.
    pub unreachable: Option<String>,
    /// Bytes of blobs sent and received so far, as they move: what a progress line shows.
    pub moved: Arc<std::sync::atomic::AtomicU64>,
    /// The memory transfers may hold at once, in MiB: what a blob's transfer buffers (a small
    /// file read whole, a large one's parts in flight) is taken from it first.
    buffers: Arc<tokio::sync::Semaphore>,
}

impl Remote {
    /// A client for the cache the settings name. Nothing is sent yet. The error is about the
    /// `url` setting.
    pub fn open(settings: Settings) -> Result<Remote, String> {
        let (scheme, rest) = settings.url.split_once("://").ok_or_else(|| {
            "write `s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix` or `file:///a/shared/directory`".to_string()
        })?;
        let mut unreachable = None;
        let client = ClientOptions::new()
            .with_allow_http(settings.allow_http)
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(300));
        let retry = RetryConfig {
            max_retries: 2,
            retry_timeout: Duration::from_secs(30),
            ..RetryConfig::default()
        };
        // `s3://bucket/prefix`, `gs://bucket/prefix`, `az://container/prefix`.
        let bucket_and_prefix = || {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            match bucket.is_empty() {
                true => Err(format!(
                    "a {scheme}:// URL names its {}: `{scheme}://{}/prefix`",
                    if scheme == "az" {
                        "container"
                    } else {
                        "bucket"
                    },
                    if scheme == "az" {
                        "container"
                    } else {
                        "bucket"
                    }
                )),
                false => Ok((bucket, prefix)),
            }
        };
        if settings.region.is_some() && scheme != "s3" {
            return Err(format!(
                "`region` is for s3:// caches; a {scheme}:// cache takes its place from the URL and `endpoint`"
            ));
        }
        let (store, prefix): (Arc<dyn ObjectStore>, String) = match scheme {
            "s3" => {
                let (bucket, prefix) = bucket_and_prefix()?;
                // Credentials from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
                // AWS_SESSION_TOKEN, web identity) or the instance's metadata: never from here.
                let mut builder = AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_client_options(client)
                    .with_retry(retry)
                    .with_allow_http(settings.allow_http)
                    // Set, not left to the crate's default: a create-only put must send
                    // `If-None-Match: *` whatever version of object_store this is.
                    .with_conditional_put(S3ConditionalPut::ETagMatch);
                if let Some(endpoint) = &settings.endpoint {
                    builder = builder.with_endpoint(endpoint);
                }
                if let Some(region) = &settings.region {
                    builder = builder.with_region(region);
                }
                let store = builder.build().map_err(|e| e.to_string())?;
                (Arc::new(store), prefix.to_string())
            }
            // Credentials from the environment: AZURE_STORAGE_ACCOUNT_NAME with
            // AZURE_STORAGE_ACCOUNT_KEY, a SAS, a client secret, or a managed identity.
            // Create-only writes are `If-None-Match: *`, which Azure honours.
            "az" => {
                let (container, prefix) = bucket_and_prefix()?;
                let mut builder = MicrosoftAzureBuilder::from_env()
                    .with_container_name(container)
                    .with_client_options(client)
                    .with_retry(retry)
                    .with_allow_http(settings.allow_http);
                if let Some(endpoint) = &settings.endpoint {
                    builder = builder.with_endpoint(endpoint.clone());
                }
                match builder.build() {
                    Ok(store) => (Arc::new(store), prefix.to_string()),
                    // Like missing S3 credentials: the run builds here, and says why once.
                    Err(e) if std::env::var_os("AZURE_STORAGE_ACCOUNT_NAME").is_none() => {
                        unreachable = Some(format!(
                            "{e} (no AZURE_STORAGE_ACCOUNT_NAME in the environment)"
                        ));
                        (Arc::new(InMemory::new()), prefix.to_string())
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            // Credentials from the environment: GOOGLE_APPLICATION_CREDENTIALS or
            // GOOGLE_SERVICE_ACCOUNT, else the instance's metadata. Create-only writes are
            // `x-goog-if-generation-match: 0`.
            "gs" => {
                let (bucket, prefix) = bucket_and_prefix()?;
                let mut builder = GoogleCloudStorageBuilder::from_env()
                    .with_bucket_name(bucket)
                    .with_client_options(client)
                    .with_retry(retry);
                if let Some(endpoint) = &settings.endpoint {
                    builder = builder.with_base_url(endpoint);
                }
                match builder.build() {
                    Ok(store) => (Arc::new(store), prefix.to_string()),
                    // Credentials that cannot be read here (a key file missing on this node):
                    // the cache is down, as for a server that does not answer.
                    Err(e) => {
                        unreachable = Some(format!("cannot use the Google credentials: {e}"));
                        (Arc::new(InMemory::new()), prefix.to_string())
                    }
                }
            }
            "file" => {
                if !rest.starts_with('/') {
                    return Err(
                        "a file:// URL names an absolute directory: `file:///a/shared/directory`"
                            .into(),
                    );
                }
                if Path::new(rest).is_dir() {
                    let store =
                        LocalFileSystem::new_with_prefix(rest).map_err(|e| e.to_string())?;
                    (Arc::new(store), String::new())
                } else {
                    unreachable = Some(format!("{rest} is not a directory (is it mounted here?)"));
                    (Arc::new(InMemory::new()), rest.to_string())
                }
            }
            other => {
                return Err(format!(
                    "`{other}://` is not a cache this nemo-dag can reach: write `s3://bucket/prefix` (also for S3-compatible servers, with `endpoint`), `gs://bucket/prefix`, `az://container/prefix` or `file:///a/shared/directory`"
                ));
            }
        };
        let prefix = Location::parse(prefix.trim_matches('/'))
            .map_err(|e| format!("the prefix is not a plain path: {e}"))?;
        Ok(Remote {
            store,
            prefix,
            settings,
            unreachable,
            moved: Default::default(),
            buffers: Arc::new(tokio::sync::Semaphore::new(BUFFER_MIB as usize)),
        })
    }

    /// Room for `bytes` of buffers among all transfers, waited for.
    async fn budget(&self, bytes: u64) -> Result<tokio::sync::SemaphorePermit<'_>, Error> {
        let mib = bytes.div_ceil(1 << 20).clamp(1, u64::from(BUFFER_MIB)) as u32;
        self.buffers
            .acquire_many(mib)
            .await
            .map_err(|e| Error::Local(format!("internal: {e}")))
    }

    fn count(&self, bytes: u64) {
        self.moved
            .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    fn at(&self, rel: &str) -> Location {
        let mut loc = self.prefix.clone();
        for part in rel.split('/') {
            loc = loc.clone().join(part);
        }
        loc
    }

    fn blob(&self, digest: &str) -> Location {
        self.at(&format!("cas/{digest}"))
    }

    fn record_at(&self, scope: &str, key: &str) -> Location {
        self.at(&format!("ac/{scope}/{key}.json"))
    }

    /// The record of `key` in the first read scope that has one.
    pub async fn find(&self, key: &str) -> Result<Option<Record>, Error> {
        for scope in &self.settings.read {
            if let Some(record) = self.record(scope, key).await? {
                return Ok(Some(record));
            }
        }
        Ok(None)
    }

    /// The record of `key` in `scope`, checked to be one.
    pub async fn record(&self, scope: &str, key: &str) -> Result<Option<Record>, Error> {
        let at = self.record_at(scope, key);
        let bytes = match self.store.get(&at).await {
            Ok(got) => got.bytes().await.map_err(|e| classify(&at, e))?,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(classify(&at, e)),
        };
        let record: Record = serde_json::from_slice(&bytes)
            .map_err(|e| Error::Corrupt(format!("{at} is not a record: {e}")))?;
        record
            .check(key, scope)
            .map_err(|why| Error::Corrupt(format!("{at} is not a record of this key: {why}")))?;
        Ok(Some(record))
    }

    /// Write `record` into its scope, unless a record of its key is there already: a record is
    /// never overwritten. Its blobs must be up first.
    pub async fn put_record(&self, record: &Record) -> Result<Written, Error> {
        let at = self.record_at(&record.scope, &record.key);
        let json = serde_json::to_vec_pretty(record).map_err(|e| Error::Local(e.to_string()))?;
        let create = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store.put_opts(&at, json.into(), create).await {
            Ok(_) => Ok(Written::Created),
            Err(object_store::Error::AlreadyExists { .. }) => {
                match self.record(&record.scope, &record.key).await? {
                    Some(existing) => Ok(Written::Existing(Box::new(existing))),
                    None => Err(Error::Corrupt(format!(
                        "{at} exists, but could not be read back"
                    ))),
                }
            }
            Err(e) => Err(classify(&at, e)),
        }
    }

    /// Check that the server refuses a second create of one object, as every record write
    /// relies on: servers and gateways have taken `If-None-Match: *` and ignored it.
    pub async fn probe(&self) -> Result<(), Error> {
        let nonce = format!(
            "{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        );
        let at = self.at(&format!("probe/{nonce}"));
        let create = || PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        let first = self.store.put_opts(&at, "1".into(), create()).await;
        let second = match first {
            Ok(_) => self.store.put_opts(&at, "2".into(), create()).await,
            Err(e) => Err(e),
        };
        let _ = self.store.delete(&at).await;
        match second {
            Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
            Ok(_) => Err(Error::Refused(format!(
                "{} accepted a second create of {at}: it ignores `If-None-Match: *`, so a record could be overwritten; nothing is written to it",
                self.settings.url
            ))),
            Err(
                object_store::Error::NotImplemented { .. }
                | object_store::Error::NotSupported { .. },
            ) => Err(Error::Refused(format!(
                "{} does not support create-only writes; nothing is written to it",
                self.settings.url
            ))),
            Err(e) => Err(classify(&at, e)),
        }
    }

    /// Whether the blob `digest` is on the server.
    pub async fn has_blob(&self, digest: &str) -> Result<bool, Error> {
        exists(&*self.store, &self.blob(digest)).await
    }

    /// Upload the file at `path` as blob `digest` (which the caller computed) unless the server
    /// has it. Returns whether anything was sent.
    pub async fn upload(&self, digest: &str, path: &Path, bytes: u64) -> Result<bool, Error> {
        if self.has_blob(digest).await? {
            return Ok(false);
        }
        let at = self.blob(digest);
        let local =
            |e: std::io::Error| Error::Local(format!("cannot read {}: {e}", path.display()));
        // A small file is read whole; a large one holds its parts in flight and one being read.
        let buffered = if bytes as usize <= PART_BYTES {
            bytes
        } else {
            ((PARTS_IN_FLIGHT + 1) * PART_BYTES) as u64
        };
        let _budget = self.budget(buffered).await?;
        let mut file = std::fs::File::open(path).map_err(local)?;
        if bytes as usize <= PART_BYTES {
            let mut buf = Vec::with_capacity(bytes as usize);
            file.read_to_end(&mut buf).map_err(local)?;
            let create = PutOptions {
                mode: PutMode::Create,
                ..Default::default()
            };
            return match self
                .store
                .put_opts(&at, PutPayload::from(buf), create)
                .await
            {
                Ok(_) | Err(object_store::Error::AlreadyExists { .. }) => Ok(true),
                Err(e) => Err(classify(&at, e)),
            }
            .inspect(|_| self.count(bytes));
        }
        // In parts: S3 completes a multipart upload atomically, so a killed upload leaves no
        // object, only parts the bucket's lifecycle rules clean up.
        let upload = self
            .store
            .put_multipart(&at)
            .await
            .map_err(|e| classify(&at, e))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        loop {
            let mut chunk = vec![0u8; PART_BYTES];
            let n = read_full(&mut file, &mut chunk).map_err(local)?;
            if n == 0 {
                break;
            }
            chunk.truncate(n);
            writer
                .wait_for_capacity(PARTS_IN_FLIGHT)
                .await
                .map_err(|e| classify(&at, e))?;
            // Counted as it is handed over; parts still in flight are within eight parts.
            self.count(n as u64);
            writer.put(Bytes::from(chunk));
        }
        writer.finish().await.map_err(|e| classify(&at, e))?;
        Ok(true)
    }

    /// Download blob `digest` into a new file at `dest`, hashing it as it streams: a blob whose
    /// bytes are not its digest is refused (and `dest` removed). A blob over one part comes in
    /// ranged parts, several at once, hashed and written in order.
    pub async fn download(&self, digest: &str, bytes: u64, dest: &Path) -> Result<(), Error> {
        let at = self.blob(digest);
        let missing = |e: object_store::Error| match e {
            // Gone (a lifecycle rule, a hand clean-up): this record cannot be used; the
            // cache as a whole still can.
            object_store::Error::NotFound { .. } => Error::Corrupt(format!("blob {at} is missing")),
            e => classify(&at, e),
        };
        let _budget = if bytes > DOWNLOAD_PART_BYTES {
            // Its size first: a blob cut short on the server is its record's fault, not the
            // server's, and its last parts would ask for bytes past its end.
            let meta = self.store.head(&at).await.map_err(missing)?;
            if meta.size != bytes {
                return Err(Error::Corrupt(format!(
                    "blob {at} is {} bytes, not {bytes}",
                    meta.size
                )));
            }
            Some(
                self.budget(PARTS_IN_FLIGHT as u64 * DOWNLOAD_PART_BYTES)
                    .await?,
            )
        } else {
            None
        };
        let mut file = std::fs::File::create_new(dest)
            .map_err(|e| Error::Local(format!("cannot write {}: {e}", dest.display())))?;
        let mut sink = Sink {
            file: &mut file,
            hasher: blake3::Hasher::new(),
            received: 0,
            moved: &self.moved,
        };
        let streamed = if bytes <= DOWNLOAD_PART_BYTES {
            match self.store.get(&at).await {
                Ok(got) => {
                    let mut stream = got.into_stream();
                    let mut result = Ok(());
                    while let Some(chunk) = stream.next().await {
                        result = chunk
                            .map_err(|e| classify(&at, e))
                            .and_then(|c| sink.take(&c, dest));
                        if result.is_err() {
                            break;
                        }
                    }
                    result
                }
                Err(e) => Err(missing(e)),
            }
        } else {
            let store = &self.store;
            let at = &at;
            let parts = (0..bytes)
                .step_by(DOWNLOAD_PART_BYTES as usize)
                .map(|start| start..(start + DOWNLOAD_PART_BYTES).min(bytes))
                .map(|range| async move { store.get_range(at, range).await });
            let mut parts = futures::stream::iter(parts).buffered(PARTS_IN_FLIGHT);
            let mut result = Ok(());
            while let Some(part) = parts.next().await {
                result = part.map_err(missing).and_then(|p| sink.take(&p, dest));
                if result.is_err() {
                    break;
                }
            }
            result
        };
        let (hash, received) = (sink.hasher.finalize().to_hex(), sink.received);
        let verdict = streamed.and_then(|()| {
            if hash.as_str() == digest && received == bytes {
                Ok(())
            } else {
                Err(Error::Corrupt(format!(
                    "blob {at} is not what its name says: {received} bytes hashing to {}, not {bytes} bytes hashing to {}",
                    short(hash.as_str()),
                    short(digest)
                )))
            }
        });
        if verdict.is_err() {
            drop(file);
            let _ = std::fs::remove_file(dest);
        }
        verdict
    }
}

/// Read until `buf` is full or the file ends.
fn read_full(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

async fn exists(store: &dyn ObjectStore, at: &Location) -> Result<bool, Error> {
    match store.head(at).await {
        Ok(_) => Ok(true),
        Err(object_store::Error::NotFound { .. }) => Ok(false),
        Err(e) => Err(classify(at, e)),
    }
}

/// An object-store failure, as the cache reports it.
fn classify(at: &Location, e: object_store::Error) -> Error {
    use object_store::Error as E;
    match e {
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => Error::Refused(format!(
            "refused {at}: {e} (credentials come from the environment: docs/cache.md lists what each kind of URL reads)"
        )),
        E::NotImplemented { .. } | E::NotSupported { .. } | E::Precondition { .. } => {
            Error::Refused(format!("{at}: {e}"))
        }
        other => Error::Unreachable(format!("{at}: {other}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(entries: Vec<Entry>) -> Record {
        Record {
            schema: RECORD_SCHEMA,
            key: "k".repeat(64),
            scope: "main".into(),
            producer: Producer {
                host: "h".into(),
                engine_version: "0".into(),
                created_at: "t".into(),
            },
            outputs: BTreeMap::new(),
            entries,
        }
    }

    #[test]
    fn a_record_that_would_write_outside_its_directory_is_refused() {
        let key = "k".repeat(64);
        let file = |path: &str| Entry::File {
            path: path.into(),
            digest: "0".repeat(64),
            bytes: 1,
            executable: false,
        };
        assert_eq!(record(vec![file("out/a.txt")]).check(&key, "main"), Ok(()));
        for bad in ["../x", "/etc/passwd", "out/../../x", "./x", "", "a\\..\\b"] {
            let r = record(vec![file(bad)]);
            assert!(r.check(&key, "main").is_err(), "{bad:?} was accepted");
        }
        // A link out, and a file laid out through a link, are refused.
        let link = |path: &str, target: &str| Entry::Link {
            path: path.into(),
            target: target.into(),
        };
        assert_eq!(
            record(vec![link("out/a/l", "../b")]).check(&key, "main"),
            Ok(())
        );
        for (path, target) in [
            ("out/l", "/home/u/.git/hooks"),
            ("out/l", "../artifact.json"),
            ("out/a/l", "../../../x"),
            ("out", "out/x"),
            ("log", "out/x"),
        ] {
            let r = record(vec![link(path, target)]);
            assert!(
                r.check(&key, "main").is_err(),
                "{path} → {target} was accepted"
            );
        }
        let through = record(vec![link("out/x", "y"), file("out/x/hook")]);
        assert!(
            through
                .check(&key, "main")
                .unwrap_err()
                .contains("under the link")
        );
        let twice = record(vec![file("a"), Entry::Dir { path: "a".into() }]);
        assert!(twice.check(&key, "main").unwrap_err().contains("twice"));
        let not_a_digest = record(vec![Entry::File {
            path: "a".into(),
            digest: "../../x".into(),
            bytes: 1,
            executable: false,
        }]);
        assert!(not_a_digest.check(&key, "main").is_err());
        // Another key's or another scope's record is not this one.
        assert!(record(vec![]).check(&"j".repeat(64), "main").is_err());
        assert!(record(vec![]).check(&key, "alice").is_err());
    }

    fn settings(url: &str, region: Option<&str>) -> Settings {
        Settings {
            url: url.into(),
            endpoint: None,
            region: region.map(str::to_string),
            allow_http: false,
            read: vec!["main".into()],
            write: None,
        }
    }

    #[test]
    fn each_kind_of_url_opens_a_client_and_a_malformed_one_says_what_it_lacks() {
        for url in ["s3://team/nemo-dag", "gs://team/nemo-dag", "gs://team"] {
            let remote = Remote::open(settings(url, None)).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(remote.unreachable, None, "{url}");
        }
        // An Azure client needs its account from the environment; without it the cache is
        // down (said once, the run builds), not a bad setting.
        let azure = Remote::open(settings("az://team/nemo-dag", None)).unwrap();
        if std::env::var_os("AZURE_STORAGE_ACCOUNT_NAME").is_none() {
            let why = azure.unreachable.unwrap_or_default();
            assert!(why.contains("AZURE_STORAGE_ACCOUNT_NAME"), "{why}");
        }
        let refusal = |url: &str, region: Option<&str>| match Remote::open(settings(url, region)) {
            Ok(_) => panic!("{url} opened"),
            Err(e) => e,
        };
        assert!(refusal("gs:///prefix", None).contains("names its bucket"));
        assert!(refusal("az:///prefix", None).contains("names its container"));
        assert!(refusal("gs://team/x", Some("eu")).contains("`region` is for s3://"));
        assert!(refusal("ftp://team/x", None).contains("`az://container/prefix`"));
        assert!(refusal("team/x", None).contains("`gs://bucket/prefix`"));
        // A share that is not mounted is reachable later, not a bad setting.
        let unmounted = Remote::open(settings("file:///nonexistent/nemo-dag", None)).unwrap();
        assert!(unmounted.unreachable.is_some());
    }
}
