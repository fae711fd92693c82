//! Trackers: each executed stage becomes a run of a real `mlflow server` (from PyPI, started
//! here on a loopback port), read back with MLflow's own client; a tracker that is down, or
//! that accepts and never answers, costs a run a warning and a few seconds, never a stage.

use crate::common::{Project, key_of, states, wait_for};
use serde_json::Value;
use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A tiny pretrain and an eval of it: a curve, and final figures under paths.
const RECIPE: &str = r#"
stages:
  problems:
    op: generate
    params: {kind: arithmetic, count: 200, seed: 7, max_operand: 20}
  tokenizer:
    op: train_tokenizer
    inputs: {corpus: "problems:pretrain"}
    params: {vocab_size: 300, special_tokens: ["<|endoftext|>"]}
  data:
    op: tokenize
    inputs: {tokenizer: "tokenizer:tokenizer", arithmetic: "problems:pretrain"}
    params: {num_shards: 1, add_eos: true}
  pretrain:
    op: pretrain
    inputs: {data: "data:data", tokenizer: "tokenizer:tokenizer"}
    params:
      model: {pattern: "*-", hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, ffn: 64, max_seq: 64}
      seq_length: 32
      steps: 4
      global_batch: 4
      micro_batch: 2
      lr: 1e-2
      warmup: 1
      log_interval: 1
  eval:
    op: eval
    inputs: {model: "pretrain:model", data: "data:data"}
    params:
      perplexity: {split: train, seq_length: 32, max_windows: 2}
  notes:
    op: cmd
    params: {blend: {"s3://bucket/x/": 1}, "a[b]": 2, long: LONG}
    outputs: {o: notes.txt}
    cmd: "echo noted > {outputs.o}"
"#;

/// `mlflow server` on a loopback port with a SQLite store of its own; its process group is
/// stopped when dropped.
pub(crate) struct Mlflow {
    child: Child,
    pub(crate) uri: String,
    python: String,
    root: std::path::PathBuf,
}

impl Mlflow {
    pub(crate) fn start(test: &str) -> Option<Mlflow> {
        let Ok(bin) = std::env::var("NEMO_DAG_MLFLOW") else {
            assert!(
                std::env::var("NEMO_DAG_REQUIRE_MLFLOW").as_deref() != Ok("1"),
                "{test}: NEMO_DAG_REQUIRE_MLFLOW=1 but NEMO_DAG_MLFLOW names no mlflow"
            );
            eprintln!(
                "skipping {test}: no MLflow (scripts/test installs it and sets NEMO_DAG_MLFLOW)"
            );
            return None;
        };
        let root =
            std::env::temp_dir().join(format!("nemo-dag-mlflow-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let port = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let child = Command::new(&bin)
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .arg("--backend-store-uri")
            .arg(format!("sqlite:///{}", root.join("mlflow.db").display()))
            .arg("--default-artifact-root")
            .arg(root.join("artifacts"))
            .args(["--workers", "1"])
            .env("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(root.join("server.log")).unwrap(),
            ))
            .process_group(0)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"));
        // The venv's Python, beside its `mlflow`.
        let python = std::path::Path::new(&bin)
            .with_file_name("python")
            .display()
            .to_string();
        let server = Mlflow {
            child,
            uri: format!("http://127.0.0.1:{port}"),
            python,
            root,
        };
        let up = wait_for(Duration::from_secs(90), || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        assert!(
            up,
            "mlflow server did not start: {}",
            std::fs::read_to_string(server.root.join("server.log")).unwrap_or_default()
        );
        Some(server)
    }

    /// Every run of `experiment`, as MLflow's own client reads it (tests/py/mlflow_runs.py).
    pub(crate) fn runs(&self, experiment: &str) -> Vec<Value> {
        let out = Command::new(&self.python)
            .arg(crate::common::repo().join("tests/py/mlflow_runs.py"))
            .args([&self.uri, experiment])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        v["runs"].as_array().cloned().unwrap_or_default()
    }
}

impl Drop for Mlflow {
    fn drop(&mut self) {
        // SAFETY: signalling the process group we created for the server and its workers.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGTERM) };
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// The runs by name.
fn by_name(runs: &[Value]) -> BTreeMap<String, Value> {
    runs.iter()
        .map(|r| (r["name"].as_str().unwrap_or("").to_string(), r.clone()))
        .collect()
}

#[test]
fn executed_stages_become_runs_of_a_real_mlflow_server() {
    let Some(server) = Mlflow::start("stages") else {
        return;
    };
    let p = Project::new("mlflow");
    p.write("recipe.yaml", &RECIPE.replace("LONG", &"x".repeat(7000)));
    p.write(
        "env.toml",
        &format!(
            "[mlflow]\ntracking_uri = \"{}\"\nexperiment = \"tiny\"\n",
            server.uri
        ),
    );
    let run = p.ok(&["run", "recipe.yaml"]);
    assert!(
        run.stderr
            .contains("mlflow: 6 stage(s) logged to experiment `tiny`: http://127.0.0.1:"),
        "{run}"
    );
    let status = p.json(&["status", "recipe.yaml", "--json"]);
    let runs = by_name(&server.runs("tiny"));
    assert_eq!(
        runs.keys().collect::<Vec<_>>(),
        ["data", "eval", "notes", "pretrain", "problems", "tokenizer"],
        "a run per executed stage"
    );
    for (name, r) in &runs {
        assert_eq!(r["status"], "FINISHED", "{name}: {r}");
        assert_eq!(r["tags"]["nemo_dag.key"], key_of(&status, name), "{name}");
        assert!(
            r["tags"]["nemo_dag.manifest"]
                .as_str()
                .is_some_and(|m| m.ends_with("recipe.yaml")),
            "{r}"
        );
    }

    // The stage's params, flattened; its tags tie it to its inputs' keys.
    let pre = &runs["pretrain"];
    assert_eq!(pre["params"]["model.hidden"], "32", "{pre}");
    assert_eq!(pre["params"]["lr"], "0.01", "{pre}");
    assert_eq!(
        pre["tags"]["nemo_dag.op"]
            .as_str()
            .map(|s| s.starts_with("pretrain@")),
        Some(true)
    );
    let data_key = key_of(&status, "data");
    assert_eq!(
        pre["tags"]["nemo_dag.input.data"],
        format!("data:data {data_key}"),
        "{pre}"
    );
    assert!(
        pre["tags"]["nemo_dag.upstream_keys"]
            .as_str()
            .is_some_and(|u| u.contains(&data_key)),
        "{pre}"
    );

    // Every figure of the curve at its step, as the artifact has it.
    let shown = p.json(&["show", "pretrain", "--json"]);
    let curve = shown["metrics"]["curve"].as_array().unwrap();
    assert_eq!(curve.len(), 4, "{shown}");
    for figure in ["loss", "lr", "grad_norm"] {
        let want: Vec<(i64, f64)> = curve
            .iter()
            .map(|pt| (pt["step"].as_i64().unwrap(), pt[figure].as_f64().unwrap()))
            .collect();
        let got: Vec<(i64, f64)> = pre["metrics"][format!("train/{figure}")]
            .as_array()
            .unwrap_or_else(|| panic!("no train/{figure}: {pre}"))
            .iter()
            .map(|m| (m[0].as_i64().unwrap(), m[1].as_f64().unwrap()))
            .collect();
        assert_eq!(got, want, "train/{figure}");
    }
    // The final figures at the last step, an eval's under their paths.
    assert_eq!(
        pre["metrics"]["final_loss"][0][1], shown["metrics"]["final_loss"],
        "{pre}"
    );
    let ppl = &runs["eval"]["metrics"]["perplexity.perplexity"];
    let shown_eval = p.json(&["show", "eval", "--json"]);
    assert_eq!(
        ppl[0][1], shown_eval["metrics"]["perplexity"]["perplexity"],
        "{ppl}"
    );

    // Names the server would refuse as they are (a path with `//`, brackets) and a value longer
    // than it keeps are made ones it takes.
    let notes = &runs["notes"]["params"];
    assert_eq!(notes["blend.s3:/bucket/x"], "1", "{notes}");
    assert_eq!(notes["a_b_"], "2", "{notes}");
    assert_eq!(notes["long"].as_str().map(str::len), Some(6000), "{notes}");

    // A run that builds nothing logs nothing; one that rebuilds the eval logs the eval.
    let again = p.ok(&["run", "recipe.yaml", "--json"]);
    assert!(!again.stderr.contains("mlflow:"), "{again}");
    assert_eq!(server.runs("tiny").len(), 6);
    p.ok(&[
        "run",
        "recipe.yaml",
        "stages.eval.params.perplexity.max_windows=1",
    ]);
    let runs = server.runs("tiny");
    let evals: Vec<&Value> = runs.iter().filter(|r| r["name"] == "eval").collect();
    assert_eq!((runs.len(), evals.len()), (7, 2));
    assert!(
        evals
            .iter()
            .any(|r| r["params"]["perplexity.max_windows"] == "1"),
        "{evals:?}"
    );

    // A stage that fails is a FAILED run, with its params, its key and why.
    let failed = p.run(&["run", "recipe.yaml", "stages.notes.cmd=exit 3"]);
    assert_eq!(failed.code, 1, "{failed}");
    let runs = server.runs("tiny");
    let broken: Vec<&Value> = runs
        .iter()
        .filter(|r| r["name"] == "notes" && r["status"] == "FAILED")
        .collect();
    assert_eq!(broken.len(), 1, "{runs:?}");
    let tags = &broken[0]["tags"];
    assert!(
        tags["nemo_dag.error"]
            .as_str()
            .is_some_and(|e| e.contains("exit")),
        "{tags}"
    );
    assert!(
        tags["nemo_dag.log"]
            .as_str()
            .is_some_and(|l| l.ends_with("log.txt")),
        "{tags}"
    );
    assert!(
        crate::common::is_key(tags["nemo_dag.key"].as_str().unwrap_or("")),
        "{tags}"
    );
    assert_eq!(broken[0]["params"]["cmd"], "exit 3");
    assert_eq!(broken[0]["params"]["a_b_"], "2");

    // MLFLOW_TRACKING_URI wins over env.toml, and with no experiment named the manifest names
    // it.
    let q = Project::new("mlflow-env-wins");
    q.write(
        "other.yaml",
        "stages:\n  a:\n    op: cmd\n    outputs: {o: a.txt}\n    cmd: \"echo a > {outputs.o}\"\n",
    );
    q.write(
        "env.toml",
        "[mlflow]\ntracking_uri = \"http://127.0.0.1:9\"\n",
    );
    let out = crate::common::output({
        let mut c = q.command(&["run", "other.yaml"]);
        c.env("MLFLOW_TRACKING_URI", &server.uri);
        c
    });
    assert_eq!(out.code, 0, "{out}");
    assert!(!out.stderr.contains("warning"), "{out}");
    let other = server.runs("other");
    assert_eq!(other.len(), 1, "{other:?}");
    assert_eq!(other[0]["name"], "a");
}

/// Two quick stages under a tracker at `uri`: the run succeeds, both stages are published, and
/// the tracker is warned about once, saying `why`, within `limit`.
fn run_under_a_broken_tracker(uri: &str, why: &str, limit: Duration) {
    let p = Project::new("mlflow-down");
    p.write(
        "pipeline.yaml",
        "stages:\n  a:\n    op: cmd\n    outputs: {o: a.txt}\n    cmd: \"echo a > {outputs.o}\"\n  b:\n    op: cmd\n    inputs: {i: \"a:o\"}\n    outputs: {o: b.txt}\n    cmd: \"cat {inputs.i} > {outputs.o}\"\n",
    );
    p.write("env.toml", &format!("[mlflow]\ntracking_uri = \"{uri}\"\n"));
    let mut child = p.spawn(&["run", "pipeline.yaml"]);
    let ended = wait_for(limit, || child.try_wait().is_ok_and(|s| s.is_some()));
    if !ended {
        let _ = child.kill();
    }
    let out = crate::common::child_output(child);
    assert!(
        ended,
        "the run did not end within {limit:?} under {uri}\n{out}"
    );
    assert_eq!(out.code, 0, "{out}");
    let warnings: Vec<&str> = out
        .stderr
        .lines()
        .filter(|l| l.contains("warning: MLflow at"))
        .collect();
    assert_eq!(warnings.len(), 1, "said once\n{out}");
    assert!(warnings[0].contains(why), "{why}\n{out}");
    let s = states(&p.json(&["status", "pipeline.yaml", "--json"]));
    assert!(s.values().all(|v| v == "up-to-date"), "{s:?}");
}

/// A loopback server that answers every request with `status` and an empty body.
fn answering(status: &'static str) -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for mut conn in listener.incoming().flatten() {
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf);
            let _ = write!(
                conn,
                "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            );
        }
    });
    port
}

#[test]
fn a_tracker_that_is_down_refuses_or_never_answers_never_fails_a_run() {
    // Nothing listens: refused at once.
    let closed = std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let limit = Duration::from_secs(20);
    run_under_a_broken_tracker(&format!("http://127.0.0.1:{closed}"), "no answer", limit);
    // A server that fails, and one that wants credentials.
    let failing = answering("500 Internal Server Error");
    run_under_a_broken_tracker(
        &format!("http://127.0.0.1:{failing}"),
        "refused (500)",
        limit,
    );
    let locked = answering("401 Unauthorized");
    run_under_a_broken_tracker(
        &format!("http://127.0.0.1:{locked}"),
        "MLFLOW_TRACKING_TOKEN",
        limit,
    );
    // Accepts every connection and never answers: without a timeout, the run would wait
    // forever; with it, it ends a request's timeout (5 s) later.
    let silent = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
    let port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        while let Ok((conn, _)) = silent.accept() {
            held.push(conn);
        }
    });
    run_under_a_broken_tracker(&format!("http://127.0.0.1:{port}"), "timed out", limit);
}

#[test]
fn mlflow_settings_that_cannot_work_are_errors_at_their_line_and_nothing_runs() {
    let pipeline =
        "stages:\n  a:\n    op: cmd\n    outputs: {o: a.txt}\n    cmd: \"echo a > {outputs.o}\"\n";
    for (setting, wanted) in [
        (
            "tracking_uri = \"file:///tmp/mlruns\"",
            "mlflow.tracking_uri: `file:///tmp/mlruns` is not an http:// or https:// server",
        ),
        (
            "trackinguri = \"http://127.0.0.1:9\"",
            "did you mean `tracking_uri`",
        ),
        (
            "tracking_uri = 5000",
            "mlflow.tracking_uri must be a non-empty string",
        ),
    ] {
        let p = Project::new("mlflow-bad");
        p.write("pipeline.yaml", pipeline);
        p.write("env.toml", &format!("[mlflow]\n{setting}\n"));
        let out = p.run(&["run", "pipeline.yaml"]);
        assert_eq!(out.code, 2, "{setting}\n{out}");
        assert!(out.stderr.contains(wanted), "{setting}: {wanted}\n{out}");
        assert!(
            out.stderr.contains("env.toml:2:"),
            "the line is named\n{out}"
        );
        assert!(
            !p.store().join("artifacts").exists(),
            "{setting}: nothing ran"
        );
    }
    // A bad tracking_uri in the file is an error even where the environment's would win.
    let p = Project::new("mlflow-bad-masked");
    p.write("pipeline.yaml", pipeline);
    p.write(
        "env.toml",
        "[mlflow]\ntracking_uri = \"file:///tmp/mlruns\"\n",
    );
    let out = crate::common::output({
        let mut c = p.command(&["run", "pipeline.yaml"]);
        c.env("MLFLOW_TRACKING_URI", "http://127.0.0.1:9");
        c
    });
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("env.toml:2:"), "{out}");
    assert!(!p.store().join("artifacts").exists());

    // The environment's MLFLOW_TRACKING_URI may be set for other tools: one nemo-dag cannot
    // use is said, and the run goes on untracked.
    let p = Project::new("mlflow-env");
    p.write("pipeline.yaml", pipeline);
    let out = crate::common::output({
        let mut c = p.command(&["run", "pipeline.yaml"]);
        c.env("MLFLOW_TRACKING_URI", "databricks");
        c
    });
    assert_eq!(out.code, 0, "{out}");
    assert!(
        out.stderr.contains(
            "warning: MLFLOW_TRACKING_URI `databricks` is not an http:// or https:// server"
        ),
        "{out}"
    );
}
