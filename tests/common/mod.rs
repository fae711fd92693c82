//! Helpers shared by the end-to-end tests: a throwaway project directory that holds manifests
//! (and, by default, the `.nemo-dag` store beside them), and a way to run the built binary in it
//! as a user would.
#![allow(dead_code)]

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_nemo-dag");

/// The repository's root (this test binary belongs to `engine/cli`).
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The two-stage example of the CLI contract. `total` sums with awk (not `paste | bc`), so the
/// tests need nothing beyond coreutils and awk.
pub const TWO_STAGE_YAML: &str = r#"vars:
  n: 3
stages:
  gen:
    op: cmd
    params: {n: {{ n }}}
    outputs: {nums: nums.txt}
    cmd: "seq {params.n} > {outputs.nums}"
  total:
    op: cmd
    inputs: {nums: "gen:nums"}
    outputs: {sum: sum.txt}
    cmd: "awk '{s+=$1} END {print s}' {inputs.nums} > {outputs.sum}"
    resources: {cpus: 1}
"#;

/// The same recipe in TOML.
pub const TWO_STAGE_TOML: &str = r#"[vars]
n = 3

[stages.gen]
op = "cmd"
params = { n = {{ n }} }
outputs = { nums = "nums.txt" }
cmd = "seq {params.n} > {outputs.nums}"

[stages.total]
op = "cmd"
inputs = { nums = "gen:nums" }
outputs = { sum = "sum.txt" }
cmd = "awk '{s+=$1} END {print s}' {inputs.nums} > {outputs.sum}"
resources = { cpus = 1 }
"#;

/// What one invocation of the binary did.
#[derive(Debug)]
pub struct Out {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Out {
    /// stdout parsed as JSON (panics with both streams if it is not).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!("stdout is not JSON ({e})\n{self}");
        })
    }
}

impl std::fmt::Display for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit code {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
            self.code, self.stdout, self.stderr
        )
    }
}

/// A temporary project directory, removed when dropped.
pub struct Project {
    pub dir: PathBuf,
}

static COUNTER: AtomicUsize = AtomicUsize::new(0);

impl Project {
    pub fn new(name: &str) -> Project {
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let dir =
            std::env::temp_dir().join(format!("nemo-dag-e2e-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        // Canonical, so that paths the engine prints compare equal to ours.
        let dir = dir.canonicalize().unwrap();
        Project { dir }
    }

    pub fn path(&self, rel: &str) -> PathBuf {
        self.dir.join(rel)
    }

    /// Write a file (creating its directories); returns its path.
    pub fn write(&self, rel: &str, text: &str) -> PathBuf {
        let p = self.dir.join(rel);
        if let Some(parent) = p.parent() {
            std::fs::create_dir_all(parent).unwrap();
        }
        std::fs::write(&p, text).unwrap();
        p
    }

    /// The default store: `.nemo-dag/` beside the manifests.
    pub fn store(&self) -> PathBuf {
        self.dir.join(".nemo-dag")
    }

    /// A command for the binary, run in the project directory, with no store from the
    /// environment of whoever runs the tests, and no colour.
    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .current_dir(&self.dir)
            .env_remove("NEMO_DAG_STORE")
            .env_remove("MLFLOW_TRACKING_URI")
            .env_remove("MLFLOW_EXPERIMENT_NAME")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null());
        c
    }

    /// Run the binary to completion.
    pub fn run(&self, args: &[&str]) -> Out {
        output(self.command(args))
    }

    /// Run the binary and require exit 0.
    pub fn ok(&self, args: &[&str]) -> Out {
        let out = self.run(args);
        assert_eq!(out.code, 0, "nemo-dag {args:?} should succeed\n{out}");
        out
    }

    /// Run the binary, require exit 0, and parse stdout as JSON.
    pub fn json(&self, args: &[&str]) -> Value {
        let out = self.run(args);
        assert_eq!(out.code, 0, "nemo-dag {args:?} should succeed\n{out}");
        out.json()
    }

    /// Start the binary without waiting for it (stdout/stderr captured).
    pub fn spawn(&self, args: &[&str]) -> Child {
        self.command(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// Published entries: directories under `<store>/artifacts/`.
    pub fn artifact_dirs(&self) -> Vec<PathBuf> {
        artifact_dirs(&self.store())
    }

    /// The published file `out/<rel>` of the entry `key`, per the store layout.
    pub fn published(&self, key: &str, rel: &str) -> String {
        let p = self
            .store()
            .join("artifacts")
            .join(key)
            .join("out")
            .join(rel);
        std::fs::read_to_string(&p)
            .unwrap_or_else(|e| panic!("cannot read published output {}: {e}", p.display()))
    }

    /// Every file and directory under the project (relative paths), sorted.
    pub fn listing(&self) -> Vec<String> {
        listing(&self.dir)
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn output(mut c: Command) -> Out {
    let o = c.output().unwrap();
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

pub fn child_output(child: Child) -> Out {
    let o = child.wait_with_output().unwrap();
    Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    }
}

pub fn artifact_dirs(store: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(store.join("artifacts"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    v.sort();
    v
}

/// Recursive listing of `dir`: relative paths, sorted (empty if `dir` does not exist).
pub fn listing(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let p = e.path();
            out.push(p.strip_prefix(root).unwrap().display().to_string());
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Listing plus the bytes of every file: what "nothing was written" compares.
pub fn snapshot(dir: &Path) -> Vec<(String, Option<Vec<u8>>)> {
    listing(dir)
        .into_iter()
        .map(|rel| {
            let p = dir.join(&rel);
            let bytes = if p.is_file() {
                std::fs::read(&p).ok()
            } else {
                None
            };
            (rel, bytes)
        })
        .collect()
}

/// `{"stages":[{name, state, ..}]}` → name → state.
pub fn states(v: &Value) -> BTreeMap<String, String> {
    stage_list(v)
        .iter()
        .map(|s| {
            (
                s["name"]
                    .as_str()
                    .expect("stage without a name")
                    .to_string(),
                s["state"]
                    .as_str()
                    .expect("stage without a state")
                    .to_string(),
            )
        })
        .collect()
}

/// The stages of a `--json` summary that were not found cached, as `name:state`, by name.
pub fn not_cached(v: &Value) -> Vec<String> {
    states(v)
        .into_iter()
        .filter(|(_, s)| s != "cached")
        .map(|(n, s)| format!("{n}:{s}"))
        .collect()
}

/// `{"stages":[{name, key, ..}]}` → name → key (None for a null key).
pub fn keys(v: &Value) -> BTreeMap<String, Option<String>> {
    stage_list(v)
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_string(),
                s["key"].as_str().map(str::to_string),
            )
        })
        .collect()
}

/// The key of one stage, which must be there and not null.
pub fn key_of(v: &Value, stage: &str) -> String {
    keys(v)
        .get(stage)
        .cloned()
        .flatten()
        .unwrap_or_else(|| panic!("no key for stage `{stage}` in {v}"))
}

/// The stage entry `name` of a `{"stages":[..]}` document.
pub fn stage<'a>(v: &'a Value, name: &str) -> &'a Value {
    stage_list(v)
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no stage `{name}` in {v}"))
}

pub fn stage_list(v: &Value) -> &Vec<Value> {
    v["stages"]
        .as_array()
        .unwrap_or_else(|| panic!("no `stages` list in {v}"))
}

/// Builds a name → state map from literals, for assertions.
pub fn expect(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

pub fn is_key(k: &str) -> bool {
    k.len() == 64 && k.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Poll `cond` every 10 ms until it holds or `timeout` passes; returns whether it held.
pub fn wait_for(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    cond()
}

/// Every file under `dir` whose name starts with `prefix` (recursively).
pub fn find_named(dir: &Path, prefix: &str) -> Vec<String> {
    listing(dir)
        .into_iter()
        .filter(|rel| {
            Path::new(rel)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(prefix))
        })
        .collect()
}

/// The Python that reference checks run with (`NEMO_DAG_PYTHON`, else `python3`), if it has
/// `tokenizers`, `numpy` and `jinja2`. `NEMO_DAG_REQUIRE_PYTHON=1` (set by scripts/test) turns a missing
/// one into a failure instead of a printed skip.
pub fn python() -> Option<String> {
    let candidate = std::env::var("NEMO_DAG_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&candidate)
        .args(["-c", "import tokenizers, numpy, jinja2"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(candidate);
    }
    if std::env::var("NEMO_DAG_REQUIRE_PYTHON").as_deref() == Ok("1") {
        panic!(
            "NEMO_DAG_REQUIRE_PYTHON=1 but {candidate} cannot import tokenizers, numpy and jinja2"
        );
    }
    eprintln!(
        "skipping the Python comparison: {candidate} lacks tokenizers/numpy/jinja2 (scripts/test installs them)"
    );
    None
}

/// One column of a text table as `runs` prints it (a header line, a line per row, then
/// perhaps a note in parentheses): on each row, the text under the header `name` up to the next
/// header. Headers are single words; cells may hold spaces.
pub fn table_column(table: &str, name: &str) -> Vec<String> {
    let mut lines = table.lines();
    let header: Vec<char> = lines.next().unwrap_or_default().chars().collect();
    // Where each header starts, in characters (cells may hold `–`, several bytes).
    let starts: Vec<usize> = (0..header.len())
        .filter(|&i| header[i] != ' ' && (i == 0 || header[i - 1] == ' '))
        .collect();
    let word = |s: usize| -> String { header[s..].iter().take_while(|c| **c != ' ').collect() };
    let at = starts
        .iter()
        .position(|&s| word(s) == name)
        .unwrap_or_else(|| panic!("no column `{name}` in\n{table}"));
    let (start, end) = (
        starts[at],
        starts.get(at + 1).copied().unwrap_or(usize::MAX),
    );
    lines
        .take_while(|l| !l.starts_with('('))
        .map(|l| {
            let cell: String = l
                .chars()
                .skip(start)
                .take(end.saturating_sub(start))
                .collect();
            cell.trim().to_string()
        })
        .collect()
}
