//! The shared cache against a real S3 server: s3s-fs on a loopback port (scripts/test builds
//! it into target/tools), one server per test, stopped by its pid. Two projects stand for two
//! machines; the bucket is a directory, so a test can tamper with what the server holds.

use crate::common::{Out, Project, expect, stage_list, states};
use serde_json::Value;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub(crate) const ACCESS_KEY: &str = "nemo-dag-test";
pub(crate) const SECRET_KEY: &str = "nemo-dag-test-secret";
pub(crate) const BUCKET: &str = "team";
pub(crate) const PREFIX: &str = "nemo-dag";

/// An s3s-fs server on 127.0.0.1, killed when dropped.
pub(crate) struct Server {
    child: Child,
    port: u16,
    root: PathBuf,
}

impl Server {
    /// A server with an empty bucket, or `None` (said) where there is no s3s-fs.
    pub(crate) fn start(test: &str) -> Option<Server> {
        let Ok(bin) = std::env::var("NEMO_DAG_S3S_FS") else {
            if std::env::var("NEMO_DAG_REQUIRE_S3").as_deref() == Ok("1") {
                panic!("{test}: NEMO_DAG_REQUIRE_S3=1 but NEMO_DAG_S3S_FS names no s3s-fs");
            }
            eprintln!(
                "skipping {test}: no S3 server (scripts/test builds s3s-fs and sets NEMO_DAG_S3S_FS)"
            );
            return None;
        };
        let root = std::env::temp_dir().join(format!("nemo-dag-s3-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let port = free_port();
        let child = Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
            .arg(&root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
        let up = crate::common::wait_for(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "s3s-fs did not listen on port {port}");
        Some(Server { child, port, root })
    }

    /// Where the server keeps an object of the cache.
    fn object(&self, rel: &str) -> PathBuf {
        self.root.join(BUCKET).join(PREFIX).join(rel)
    }

    fn record(&self, scope: &str, key: &str) -> PathBuf {
        self.object(&format!("ac/{scope}/{key}.json"))
    }

    /// Where the server keeps the blob of the file at `path` (`out/model.txt`) in the record
    /// of `key` in `scope`.
    fn blob_of(&self, scope: &str, key: &str, path: &str) -> PathBuf {
        let record: Value =
            serde_json::from_slice(&std::fs::read(self.record(scope, key)).unwrap()).unwrap();
        let digest = record["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["path"] == path)
            .and_then(|e| e["digest"].as_str())
            .unwrap_or_else(|| panic!("no {path} in the record of {key}"))
            .to_string();
        self.object(&format!("cas/{digest}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    listener.local_addr().unwrap().port()
}

/// A "machine": a project holding the shipped `manifest` (with its variants and data), and an
/// env.toml whose [cache] reads `read` and writes `write` at `endpoint`.
fn machine(
    name: &str,
    manifest: &str,
    endpoint: &str,
    read: &[&str],
    write: Option<&str>,
) -> Project {
    let p = Project::new(&format!("cache-{name}"));
    let manifests = crate::common::repo().join("manifests");
    let stem = manifest.trim_end_matches(".yaml");
    p.write(
        manifest,
        &std::fs::read_to_string(manifests.join(manifest)).unwrap(),
    );
    for variant in std::fs::read_dir(manifests.join(stem))
        .into_iter()
        .flatten()
        .flatten()
    {
        let rel = format!("{stem}/{}", variant.file_name().to_string_lossy());
        p.write(&rel, &std::fs::read_to_string(variant.path()).unwrap());
    }
    p.write("env.toml", &cache_section(endpoint, read, write));
    p.write(".git", "");
    p
}

/// An env.toml `[cache]` for the test server at `endpoint`.
pub(crate) fn cache_section(endpoint: &str, read: &[&str], write: Option<&str>) -> String {
    let read: Vec<String> = read.iter().map(|s| format!("{s:?}")).collect();
    let write = write
        .map(|w| format!("write = {w:?}\n"))
        .unwrap_or_default();
    format!(
        "[cache]\nurl = \"s3://{BUCKET}/{PREFIX}\"\nendpoint = \"{endpoint}\"\nregion = \"us-east-1\"\nallow_http = true\nread = [{}]\n{write}",
        read.join(", ")
    )
}

pub(crate) fn endpoint(server: &Server) -> String {
    format!("http://127.0.0.1:{}", server.port)
}

/// The binary, with the test server's credentials in the environment, as a user has them.
pub(crate) fn nd(p: &Project, args: &[&str]) -> Out {
    let mut c = p.command(args);
    c.env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY);
    crate::common::output(c)
}

fn run_json(p: &Project, args: &[&str]) -> (Value, Out) {
    let out = nd(p, args);
    assert_eq!(out.code, 0, "nemo-dag {args:?}\n{out}");
    (out.json(), out)
}

/// Every file of every published artifact, by path under `artifacts/`, with its digest.
fn artifacts(p: &Project) -> Vec<(String, Option<String>)> {
    crate::common::snapshot(&p.store().join("artifacts"))
        .into_iter()
        .map(|(path, bytes)| (path, bytes.map(|b| blake3::hash(&b).to_hex().to_string())))
        .collect()
}

/// The stages' outputs alone: what a stage built anywhere has in common with its pull.
fn outputs(p: &Project) -> Vec<(String, Option<String>)> {
    artifacts(p)
        .into_iter()
        .filter(|(path, _)| path.contains("/out/"))
        .collect()
}

/// Every object the server holds under the cache, with its bytes.
fn objects(server: &Server) -> Vec<(String, Option<Vec<u8>>)> {
    crate::common::snapshot(&server.object(""))
}

fn all(v: &Value, state: &str) -> bool {
    states(v).values().all(|s| s == state)
}

#[test]
fn a_second_machine_pulls_every_stage_of_the_demo_and_data_recipes_and_runs_nothing() {
    let Some(server) = Server::start("two-machines") else {
        return;
    };
    for (manifest, variant) in [("demo.yaml", None), ("data-prep.yaml", Some("tiny"))] {
        let e = endpoint(&server);
        let a = machine("a", manifest, &e, &["main"], Some("main"));
        let b = machine("b", manifest, &e, &["main"], Some("main"));
        let mut args = vec!["run", manifest, "--json"];
        if let Some(v) = variant {
            args.extend(["-c", v]);
        }
        let (first, out) = run_json(&a, &args);
        assert!(all(&first, "executed"), "{first}");
        assert!(out.stderr.contains("pushed "), "{out}");
        let (second, out) = run_json(&b, &args);
        assert!(
            all(&second, "pulled"),
            "{manifest}: every stage pulled\n{out}"
        );
        assert!(!out.stderr.contains("started"), "nothing ran on b:\n{out}");
        assert!(
            out.stderr
                .contains(&format!("stage(s): {} pulled", states(&second).len())),
            "{out}"
        );
        assert_eq!(
            artifacts(&a),
            artifacts(&b),
            "{manifest}: the same bytes on both machines"
        );
        assert_eq!(crate::common::keys(&first), crate::common::keys(&second));
        // b's store serves them as its own: its run record names them (so `gc` keeps them),
        // a rerun is all cached, and verify finds nothing.
        let gc = nd(&b, &["gc", "--store", ".nemo-dag"]);
        assert_eq!(gc.code, 0, "{gc}");
        assert!(gc.stdout.is_empty(), "gc removed pulled artifacts:\n{gc}");
        let (third, _) = run_json(&b, &args);
        assert!(all(&third, "cached"), "{third}");
        let verify = nd(&b, &["verify", "--all", "--store", ".nemo-dag"]);
        assert_eq!(verify.code, 0, "{verify}");
    }
}

#[test]
fn a_blob_altered_on_the_server_is_refused_and_the_stage_builds_here() {
    let Some(server) = Server::start("tampered") else {
        return;
    };
    let e = endpoint(&server);
    let a = machine("a", "demo.yaml", &e, &["main"], Some("main"));
    let (first, _) = run_json(&a, &["run", "demo.yaml", "--json"]);
    // Alter the blob of `fit`'s model on the server (same length: only the digest tells).
    let fit = crate::common::key_of(&first, "fit");
    let blob = server.blob_of("main", &fit, "out/model.txt");
    let mut bytes = std::fs::read(&blob).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&blob, &bytes).unwrap();

    let b = machine("b", "demo.yaml", &e, &["main"], Some("main"));
    let (second, out) = run_json(&b, &["run", "demo.yaml", "--json"]);
    assert_eq!(
        states(&second),
        expect(&[
            ("generate", "pulled"),
            ("fit", "executed"),
            ("count", "pulled"),
            // fit built here gives a's bytes, so report's key is a's, and the cache has it.
            ("report", "pulled")
        ]),
        "{out}"
    );
    assert!(
        out.stderr.contains("not pulled") && out.stderr.contains("is not what its name says"),
        "the refusal names the blob:\n{out}"
    );
    // What b built is what a built; nothing of the altered blob reached b's store.
    assert_eq!(outputs(&a), outputs(&b));
    let b_files = artifacts(&b);
    assert!(
        !b_files
            .iter()
            .any(|(_, d)| d.as_deref() == Some(blake3::hash(&bytes).to_hex().as_str())),
        "the altered bytes are nowhere in b's store"
    );

    // A blob gone from the server (a lifecycle rule, a hand clean-up) refuses its stage only:
    // the cache stays in use for the others.
    std::fs::remove_file(&blob).unwrap();
    let c = machine("c", "demo.yaml", &e, &["main"], None);
    let (third, out) = run_json(&c, &["run", "demo.yaml", "--json"]);
    assert_eq!(
        states(&third),
        expect(&[
            ("generate", "pulled"),
            ("fit", "executed"),
            ("count", "pulled"),
            ("report", "pulled")
        ]),
        "{out}"
    );
    assert!(out.stderr.contains("is missing"), "{out}");
    assert!(!out.stderr.contains("warning"), "{out}");
    assert_eq!(outputs(&a), outputs(&c));
}

#[test]
fn a_scope_not_read_is_ignored_and_a_record_is_never_overwritten() {
    let Some(server) = Server::start("scopes") else {
        return;
    };
    let e = endpoint(&server);
    // alice pushes to her scope; bob, reading only main, builds everything himself.
    let alice = machine("alice", "demo.yaml", &e, &["alice"], Some("alice"));
    let (first, _) = run_json(&alice, &["run", "demo.yaml", "--json"]);
    let bob = machine("bob", "demo.yaml", &e, &["main"], Some("main"));
    let (second, out) = run_json(&bob, &["run", "demo.yaml", "--json"]);
    assert!(all(&second, "executed"), "{out}");
    assert_eq!(crate::common::keys(&first), crate::common::keys(&second));

    // A stage that gives other bytes each time: carol's record is kept, dave's is not written.
    let text = "stages:\n  stamp:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"od -An -N8 -tx8 /dev/urandom > {outputs.o}\"\n";
    let carol = machine("carol", "demo.yaml", &e, &["other"], Some("main"));
    carol.write("n.yaml", text);
    let (c, _) = run_json(&carol, &["run", "n.yaml", "--json"]);
    let key = crate::common::key_of(&c, "stamp");
    let kept = std::fs::read(server.record("main", &key)).unwrap();
    let dave = machine("dave", "demo.yaml", &e, &["other"], Some("main"));
    dave.write("n.yaml", text);
    let (d, out) = run_json(&dave, &["run", "n.yaml", "--json"]);
    assert_eq!(states(&d), expect(&[("stamp", "executed")]));
    assert!(
        out.stderr.contains("not pushed") && out.stderr.contains("theirs is kept"),
        "the conflict is reported:\n{out}"
    );
    assert_eq!(std::fs::read(server.record("main", &key)).unwrap(), kept);
}

#[test]
fn a_cache_that_is_down_warns_once_and_the_run_builds_here() {
    // Nothing listens on this port.
    let e = format!("http://127.0.0.1:{}", free_port());
    let p = machine("down", "demo.yaml", &e, &["main"], Some("main"));
    let (v, out) = run_json(&p, &["run", "demo.yaml", "--json"]);
    assert!(all(&v, "executed"), "{out}");
    assert_eq!(
        out.stderr.matches("warning: the shared cache").count(),
        1,
        "one warning:\n{out}"
    );
    assert!(
        out.stderr.contains("env.toml"),
        "it names the setting's file:\n{out}"
    );
    // The commands whose whole job is the cache fail instead.
    let push = nd(&p, &["push", "demo.yaml"]);
    assert_eq!(push.code, 1, "{push}");
    assert!(push.stderr.contains("cannot be used"), "{push}");

    // A file:// share that is not mounted here is a cache that is down, not a bad setting.
    let p = Project::new("cache-unmounted");
    p.write(
        "demo.yaml",
        &std::fs::read_to_string(crate::common::repo().join("manifests/demo.yaml")).unwrap(),
    );
    p.write(
        "env.toml",
        "[cache]\nurl = \"file:///nonexistent/nemo-dag-share\"\nread = [\"main\"]\nwrite = \"main\"\n",
    );
    p.write(".git", "");
    let (v, out) = run_json(&p, &["run", "demo.yaml", "--json"]);
    assert!(all(&v, "executed"), "{out}");
    assert_eq!(
        out.stderr
            .matches("/nonexistent/nemo-dag-share is not a directory")
            .count(),
        1,
        "one warning:\n{out}"
    );
    let push = nd(&p, &["push", "demo.yaml"]);
    assert_eq!(push.code, 1, "{push}");
    assert!(!std::path::Path::new("/nonexistent").exists());
}

/// A server that accepts a second create of the same name (it ignores `If-None-Match: *`)
/// could let a record be overwritten: nemo-dag probes before its first record, finds out,
/// and writes no record to it. The stand-in is a small S3 server of the tests' own
/// (tests/py/lax_s3.py): s3s-fs honours the header, and a proxy that dropped it would break
/// the request's signature.
#[test]
fn a_server_that_ignores_create_only_writes_gets_no_record() {
    let lax = StandIn::start("lax_s3.py", "lax");
    let p = machine("lax", "demo.yaml", &lax.endpoint(), &["main"], Some("main"));
    let (v, out) = run_json(&p, &["run", "demo.yaml", "--json"]);
    assert!(all(&v, "executed"), "the run builds here:\n{out}");
    let why = "ignores `If-None-Match: *`";
    assert_eq!(out.stderr.matches(why).count(), 1, "said once:\n{out}");
    let push = nd(&p, &["push", "demo.yaml"]);
    assert_eq!(push.code, 1, "{push}");
    assert!(push.stderr.contains(why), "{push}");
    let records: Vec<String> = crate::common::snapshot(&lax.root)
        .into_iter()
        .map(|(path, _)| path)
        .filter(|path| path.contains("/ac/"))
        .collect();
    assert!(records.is_empty(), "records written: {records:?}");
}

/// A stand-in server of the tests' own (a Python script in tests/py, standard library only) on
/// a loopback port, keeping its objects under `root`; killed, and its files removed, when
/// dropped.
struct StandIn {
    child: Child,
    port: u16,
    root: PathBuf,
}

impl StandIn {
    fn start(script: &str, name: &str) -> StandIn {
        let python = std::env::var("NEMO_DAG_PYTHON").unwrap_or_else(|_| "python3".into());
        let root = std::env::temp_dir().join(format!("nemo-dag-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join(BUCKET)).unwrap();
        let port = free_port();
        let child = Command::new(&python)
            .arg(crate::common::repo().join("tests/py").join(script))
            .arg(port.to_string())
            .arg(&root)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {python}: {e}"));
        let server = StandIn { child, port, root };
        let up = crate::common::wait_for(Duration::from_secs(20), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "{script} did not listen on port {port}");
        server
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Azurite (the Azure Storage emulator, from npm; scripts/test installs it into target/tools)
/// on a loopback port with one container, killed when dropped.
struct Azurite {
    child: Child,
    port: u16,
    root: PathBuf,
}

/// The emulator's published development account.
const AZURE_ACCOUNT: &str = "devstoreaccount1";
const AZURE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

impl Azurite {
    fn start(test: &str) -> Option<Azurite> {
        let Ok(bin) = std::env::var("NEMO_DAG_AZURITE") else {
            if std::env::var("NEMO_DAG_REQUIRE_AZURITE").as_deref() == Ok("1") {
                panic!(
                    "{test}: NEMO_DAG_REQUIRE_AZURITE=1 but NEMO_DAG_AZURITE names no azurite-blob"
                );
            }
            eprintln!(
                "skipping {test}: no Azurite (scripts/test installs it and sets NEMO_DAG_AZURITE)"
            );
            return None;
        };
        let root =
            std::env::temp_dir().join(format!("nemo-dag-azurite-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let port = free_port();
        let child = Command::new(&bin)
            .args([
                "--blobHost",
                "127.0.0.1",
                "--blobPort",
                &port.to_string(),
                "--silent",
            ])
            .arg("--location")
            .arg(&root)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
        let azurite = Azurite { child, port, root };
        let up = crate::common::wait_for(Duration::from_secs(30), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(up, "Azurite did not listen on port {port}");
        let python = std::env::var("NEMO_DAG_PYTHON").unwrap_or_else(|_| "python3".into());
        let made = Command::new(&python)
            .arg(crate::common::repo().join("tests/py/azurite_container.py"))
            .args([&port.to_string(), BUCKET])
            .status()
            .unwrap_or_else(|e| panic!("cannot run {python}: {e}"));
        assert!(made.success(), "could not create the container");
        Some(azurite)
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// `az://` works as `s3://` does: against Azurite, the demo recipe and a 40 MB output go from
/// one machine to another, identical, and the probe finds that Azure refuses a second create.
#[test]
fn an_azure_container_carries_artifacts_between_machines() {
    let Some(azurite) = Azurite::start("azure") else {
        return;
    };
    between_machines(
        "azure",
        &format!(
            "url = \"az://{BUCKET}/{PREFIX}\"\nendpoint = \"http://127.0.0.1:{}/{AZURE_ACCOUNT}\"",
            azurite.port
        ),
        &[
            ("AZURE_STORAGE_ACCOUNT_NAME", AZURE_ACCOUNT),
            ("AZURE_STORAGE_ACCOUNT_KEY", AZURE_KEY),
        ],
    );
}

/// `gs://` the same way, against a stand-in for Google Cloud Storage's XML API
/// (tests/py/gcs_xml.py: no emulator that can be installed here keeps create-only writes).
/// It checks the wiring: the bucket and prefix, the endpoint, create-only writes (412),
/// multipart uploads and ranged reads as object_store sends them.
#[test]
fn a_gcs_bucket_carries_artifacts_between_machines() {
    let gcs = StandIn::start("gcs_xml.py", "gcs");
    between_machines(
        "gcs",
        &format!(
            "url = \"gs://{BUCKET}/{PREFIX}\"\nendpoint = \"{}\"",
            gcs.endpoint()
        ),
        // object_store's way to a server with no OAuth: a service account key that says so.
        &[(
            "GOOGLE_SERVICE_ACCOUNT_KEY",
            r#"{"private_key":"unused","private_key_id":"unused","client_email":"test@example.com","disable_oauth":true}"#,
        )],
    );
}

/// Machine A runs the demo recipe with a 40 MB stage added and pushes to the cache that
/// `settings` (the `url` and `endpoint` lines) names; machine B pulls every stage, identical.
fn between_machines(name: &str, settings: &str, env: &[(&str, &str)]) {
    let manifest = format!(
        "{}  big:\n    op: cmd\n    outputs: {{o: big.txt}}\n    cmd: \"yes nemo-dag | head -c 40000000 > {{outputs.o}}\"\n",
        std::fs::read_to_string(crate::common::repo().join("manifests/demo.yaml")).unwrap()
    );
    let machine = |m: &str| {
        let p = Project::new(&format!("cache-{name}-{m}"));
        p.write("demo.yaml", &manifest);
        p.write(
            "env.toml",
            &format!(
                "[cache]\n{settings}\nallow_http = true\nread = [\"main\"]\nwrite = \"main\"\n"
            ),
        );
        p.write(".git", "");
        p
    };
    let run = |p: &Project| {
        let mut c = p.command(&["run", "demo.yaml", "--json"]);
        c.envs(env.iter().copied());
        crate::common::output(c)
    };
    let (a, b) = (machine("a"), machine("b"));
    let first = run(&a);
    assert_eq!(first.code, 0, "{first}");
    assert!(all(&first.json(), "executed"), "{first}");
    assert_eq!(first.stderr.matches("pushed ").count(), 5, "{first}");
    assert!(!first.stderr.contains("warning"), "{first}");
    let second = run(&b);
    assert_eq!(second.code, 0, "{second}");
    assert!(all(&second.json(), "pulled"), "{second}");
    assert_eq!(
        artifacts(&a),
        artifacts(&b),
        "the same bytes on both machines"
    );
}

/// A large blob cut short on the server (its parts would ask for bytes past its end) is that
/// record's fault: its stage builds here, and the cache stays in use.
#[test]
fn a_large_blob_cut_short_on_the_server_refuses_its_stage_only() {
    let Some(server) = Server::start("cut-short") else {
        return;
    };
    let e = endpoint(&server);
    let a = machine("a", "demo.yaml", &e, &["main"], Some("main"));
    let both = format!(
        "{BIG}{}",
        &BIG["stages:\n".len()..]
            .replace("big", "other")
            .replace("20971520", "1024")
    );
    a.write("big.yaml", &both);
    let (first, _) = run_json(&a, &["run", "big.yaml", "--json"]);
    let key = crate::common::key_of(&first, "big");
    let blob = server.blob_of("main", &key, "out/o.bin");
    let bytes = std::fs::read(&blob).unwrap();
    std::fs::write(&blob, &bytes[..bytes.len() - (1 << 20)]).unwrap();

    let b = machine("b", "demo.yaml", &e, &["main"], None);
    b.write("big.yaml", &both);
    let (second, out) = run_json(&b, &["run", "big.yaml", "--json"]);
    assert_eq!(
        states(&second),
        expect(&[("big", "executed"), ("other", "pulled")]),
        "{out}"
    );
    assert!(out.stderr.contains("bytes, not 20971520"), "{out}");
    assert!(!out.stderr.contains("warning"), "{out}");
}

/// A profile whose jobs keep their own store submits nothing when the cache that would carry
/// their inputs cannot be used: every job would fail after its wait in the queue. (Refused
/// before `sbatch`, so no cluster is needed.)
#[test]
fn jobs_with_their_own_store_are_not_submitted_when_the_cache_is_down() {
    let e = format!("http://127.0.0.1:{}", free_port());
    let p = machine("node-store-down", "demo.yaml", &e, &["main"], Some("main"));
    let env = std::fs::read_to_string(p.path("env.toml")).unwrap();
    p.write(
        "env.toml",
        &format!("[lab]\nexecutor = \"slurm\"\nnode_store = \"/tmp/nd-$SLURM_JOB_ID\"\n\n{env}"),
    );
    let out = nd(&p, &["run", "demo.yaml", "--batch", "lab"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(
        out.stderr.contains("the shared cache cannot be used")
            && out.stderr.contains("nothing was submitted"),
        "{out}"
    );
    assert_eq!(
        out.stderr.matches("warning").count(),
        1,
        "said once, then refused:\n{out}"
    );
    assert!(!p.store().join("slurm").exists(), "a job was submitted");
}

/// A run that finds hundreds of stages in the cache pulls a few at a time. Each pull holds the
/// key's lock, its connections and the files it writes: 200 at once ran out of file
/// descriptors under a limit of 128, and stages the cache had were built again.
#[test]
fn many_stages_are_pulled_a_few_at_a_time() {
    let Some(server) = Server::start("many") else {
        return;
    };
    let mut manifest = String::from("stages:\n");
    for i in 0..200 {
        manifest.push_str(&format!(
            "  s{i:03}:\n    op: cmd\n    outputs: {{o: o.txt}}\n    cmd: \"echo {i} > {{outputs.o}}\"\n"
        ));
    }
    let machine = |name: &str| {
        let p = Project::new(&format!("cache-many-{name}"));
        p.write("many.yaml", &manifest);
        p.write(
            "env.toml",
            &cache_section(&endpoint(&server), &["main"], Some("main")),
        );
        p.write(".git", "");
        p
    };
    let (a, b) = (machine("a"), machine("b"));
    let (built, out) = run_json(&a, &["run", "many.yaml", "--json"]);
    assert!(all(&built, "executed"), "{out}");
    // B runs under a limit of 128 open files: 8 pulls at a time need about 60.
    let mut c = Command::new("sh");
    c.current_dir(&b.dir)
        .arg("-c")
        .arg(format!(
            "ulimit -n 128 && exec {} run many.yaml --json",
            crate::common::BIN
        ))
        .env_remove("NEMO_DAG_STORE")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY);
    let out = crate::common::output(c);
    assert_eq!(out.code, 0, "{out}");
    assert!(all(&out.json(), "pulled"), "every stage pulled:\n{out}");
}

#[test]
fn push_pull_and_cache_status_move_artifacts_without_running_anything() {
    let Some(server) = Server::start("commands") else {
        return;
    };
    let e = endpoint(&server);
    let a = machine("a", "demo.yaml", &e, &["main"], Some("main"));
    a.ok(&["run", "demo.yaml", "--offline"]);
    assert!(objects(&server).is_empty(), "--offline pushes nothing");
    let status = |p: &Project| -> Vec<(String, bool, Option<String>)> {
        let (v, _) = run_json(p, &["cache", "status", "demo.yaml", "--json"]);
        stage_list(&v)
            .iter()
            .map(|s| {
                (
                    s["name"].as_str().unwrap().to_string(),
                    s["local"].as_bool().unwrap(),
                    s["remote"].as_str().map(String::from),
                )
            })
            .collect()
    };
    assert!(
        status(&a)
            .iter()
            .all(|(_, local, remote)| *local && remote.is_none())
    );
    let (pushed, _) = run_json(&a, &["push", "demo.yaml", "--target", "fit", "--json"]);
    let done: Vec<&str> = stage_list(&pushed)
        .iter()
        .filter_map(|s| s["done"].as_str())
        .collect();
    assert_eq!(
        done,
        ["pushed", "pushed"],
        "fit and what it needs: {pushed}"
    );
    // A second push sends nothing.
    let (again, _) = run_json(&a, &["push", "demo.yaml", "--json"]);
    let sent: u64 = stage_list(&again)
        .iter()
        .filter(|s| ["generate", "fit"].contains(&s["name"].as_str().unwrap()))
        .map(|s| s["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(sent, 0, "{again}");

    let b = machine("b", "demo.yaml", &e, &["main"], None);
    let before = status(&b);
    assert!(
        before
            .iter()
            .all(|(_, local, remote)| !*local && remote.as_deref() == Some("main")),
        "every stage is in the cache, none here: {before:?}"
    );
    let (pulled, _) = run_json(&b, &["pull", "demo.yaml", "--json"]);
    assert!(stage_list(&pulled).iter().all(|s| s["done"] == "pulled"));
    assert_eq!(artifacts(&a), artifacts(&b));
    // The pull is recorded as the manifest's state: `gc` keeps it, `show` finds it by name.
    let gc = nd(&b, &["gc", "--store", ".nemo-dag"]);
    assert!(
        gc.code == 0 && gc.stdout.is_empty(),
        "gc removed pulled artifacts:\n{gc}"
    );
    let show = nd(&b, &["show", "fit", "--manifest", "demo.yaml"]);
    assert_eq!(show.code, 0, "{show}");
    let (run, _) = run_json(&b, &["run", "demo.yaml", "--json"]);
    assert!(all(&run, "cached"), "{run}");
    // b writes no scope: a push is refused before anything is sent.
    let push = nd(&b, &["push", "demo.yaml"]);
    assert_eq!(push.code, 2, "{push}");
    assert!(push.stderr.contains("writes no scope"), "{push}");
}

#[test]
fn cache_settings_that_cannot_work_are_errors_at_their_line_and_nothing_runs() {
    for (setting, wanted) in [
        (
            "secret_access_key = \"x\"",
            "credentials never go in env.toml",
        ),
        ("regoin = \"us-east-1\"", "did you mean `region`"),
        ("read = \"main\"", "cache.read is a list"),
        ("write = \"a/b\"", "not a scope name"),
    ] {
        let p = machine("bad", "demo.yaml", "http://127.0.0.1:9", &["main"], None);
        let text = std::fs::read_to_string(p.path("env.toml")).unwrap();
        let text = text.replace("read = [\"main\"]\n", "");
        p.write("env.toml", &format!("{text}{setting}\n"));
        let out = nd(&p, &["run", "demo.yaml"]);
        assert_eq!(out.code, 2, "{setting}\n{out}");
        assert!(out.stderr.contains(wanted), "{setting}: {wanted}\n{out}");
        assert!(out.stderr.contains("env.toml"), "{out}");
        assert!(
            !p.store().join("artifacts").exists(),
            "{setting}: nothing ran"
        );
    }
    let p = machine(
        "bad-url",
        "demo.yaml",
        "http://127.0.0.1:9",
        &["main"],
        None,
    );
    let text = std::fs::read_to_string(p.path("env.toml")).unwrap();
    p.write(
        "env.toml",
        &text.replace("s3://team/nemo-dag", "ftp://host/x"),
    );
    let out = nd(&p, &["run", "demo.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("cache.url"), "{out}");
}

/// A TCP proxy to the server that lets `rate` bytes a second through each connection, each
/// way: a slow network, so that a test can kill a transfer in the middle. Counts the bytes
/// that go each way.
struct SlowLink {
    port: u16,
    upstream: std::sync::Arc<std::sync::atomic::AtomicU64>,
    downstream: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl SlowLink {
    fn to(server: &Server, rate: u64) -> SlowLink {
        use std::io::{Read, Write};
        use std::sync::atomic::{AtomicU64, Ordering};
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = server.port;
        let upstream = std::sync::Arc::new(AtomicU64::new(0));
        let downstream = std::sync::Arc::new(AtomicU64::new(0));
        let (up, down) = (upstream.clone(), downstream.clone());
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(("127.0.0.1", target)) else {
                    continue;
                };
                let pipe = move |mut from: std::net::TcpStream,
                                 mut to: std::net::TcpStream,
                                 count: std::sync::Arc<AtomicU64>| {
                    let mut buf = vec![0u8; 16 << 10];
                    while let Ok(n) = from.read(&mut buf) {
                        if n == 0 || to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                        count.fetch_add(n as u64, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_secs_f64(n as f64 / rate as f64));
                    }
                    let _ = to.shutdown(std::net::Shutdown::Both);
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (up, down) = (up.clone(), down.clone());
                std::thread::spawn(move || pipe(c2, s2, up));
                std::thread::spawn(move || pipe(server, client, down));
            }
        });
        SlowLink {
            port,
            upstream,
            downstream,
        }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn sent(&self) -> u64 {
        self.upstream.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn received(&self) -> u64 {
        self.downstream.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// A stage with one 20 MiB output: over the 16 MiB above which a file goes up in parts.
const BIG: &str = "stages:\n  big:\n    op: cmd\n    outputs: {o: o.bin}\n    cmd: \"head -c 20971520 /dev/urandom > {outputs.o}\"\n";

fn with_endpoint(p: &Project, endpoint: &str) {
    let text = std::fs::read_to_string(p.path("env.toml")).unwrap();
    let start = text.find("endpoint = ").unwrap();
    let end = start + text[start..].find('\n').unwrap();
    p.write(
        "env.toml",
        &format!(
            "{}endpoint = \"{endpoint}\"{}",
            &text[..start],
            &text[end..]
        ),
    );
}

#[test]
fn a_push_or_a_pull_killed_midway_leaves_no_partial_entry_anywhere() {
    let Some(server) = Server::start("killed") else {
        return;
    };
    let slow = SlowLink::to(&server, 4 << 20);
    let a = machine("a", "demo.yaml", &slow.endpoint(), &["main"], Some("main"));
    a.write("big.yaml", BIG);
    a.ok(&["run", "big.yaml", "--offline"]);
    let credentials = |mut c: Command| {
        c.env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c
    };

    // kill -9 a push once 4 MiB of the 20 have gone up: no record, so no reader sees anything.
    let mut push = credentials(a.command(&["push", "big.yaml"]))
        .spawn()
        .unwrap();
    assert!(crate::common::wait_for(Duration::from_secs(30), || slow
        .sent()
        > 4 << 20));
    push.kill().unwrap();
    push.wait().unwrap();
    let records = crate::common::listing(&server.object("ac"));
    assert!(
        records.iter().all(|r| !r.ends_with(".json")),
        "a killed push wrote a record: {records:?}"
    );
    for (path, bytes) in objects(&server) {
        if let (Some(digest), Some(bytes)) = (path.strip_prefix("cas/"), bytes) {
            assert_eq!(
                blake3::hash(&bytes).to_hex().as_str(),
                digest,
                "a partial blob is visible"
            );
        }
    }
    // Pushed again, in full, over the fast link.
    with_endpoint(&a, &endpoint(&server));
    let again = nd(&a, &["push", "big.yaml"]);
    assert_eq!(again.code, 0, "{again}");

    // kill -9 a pull in the middle of the big file (4 MiB of 20 down, over a link of 1 MiB/s
    // a connection: the file comes in ranged parts, several at once): nothing published; the
    // next pull completes.
    let slower = SlowLink::to(&server, 1 << 20);
    let midway = |since: u64| {
        let slower = &slower;
        move || slower.received() > since + (4 << 20)
    };
    let b = machine("b", "demo.yaml", &slower.endpoint(), &["main"], None);
    b.write("big.yaml", BIG);
    let mut pull = credentials(b.command(&["pull", "big.yaml"]))
        .spawn()
        .unwrap();
    assert!(
        crate::common::wait_for(Duration::from_secs(30), midway(0)),
        "the pull never got going"
    );
    pull.kill().unwrap();
    pull.wait().unwrap();
    assert!(
        b.artifact_dirs().is_empty(),
        "a killed pull published {:?}",
        b.artifact_dirs()
    );
    with_endpoint(&b, &endpoint(&server));
    let (v, _) = run_json(&b, &["run", "big.yaml", "--json"]);
    assert_eq!(states(&v), expect(&[("big", "pulled")]));
    assert_eq!(outputs(&a), outputs(&b));

    // Ctrl-C during a run's pull: the run ends at once as interrupted, publishes nothing and
    // builds nothing; the next run pulls.
    let c = machine("c", "demo.yaml", &slower.endpoint(), &["main"], None);
    c.write("big.yaml", BIG);
    let since = slower.received();
    let mut cmd = c.command(&["run", "big.yaml"]);
    cmd.env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let run = cmd.spawn().unwrap();
    assert!(
        crate::common::wait_for(Duration::from_secs(30), midway(since)),
        "the pull never got going"
    );
    // SAFETY: signalling the child this test started.
    unsafe { libc::kill(run.id() as i32, libc::SIGINT) };
    let clock = std::time::Instant::now();
    let out = crate::common::child_output(run);
    assert!(
        clock.elapsed() < Duration::from_secs(3),
        "the run took {:?} to stop:\n{out}",
        clock.elapsed()
    );
    assert_eq!(out.code, 130, "{out}");
    assert!(!out.stderr.contains("started"), "nothing was built:\n{out}");
    assert!(
        c.artifact_dirs().is_empty(),
        "an interrupted pull published"
    );
    with_endpoint(&c, &endpoint(&server));
    let (v, _) = run_json(&c, &["run", "big.yaml", "--json"]);
    assert_eq!(states(&v), expect(&[("big", "pulled")]));
}
