//! The manifest front-end under random and hostile input, in-process: the loader (YAML/TOML
//! parse, vars, Jinja, variants, overrides, validation, every op's check), the `cmd` op's
//! placeholder check, the graph renderer, and miette's rendering of every error. A case
//! fails if it panics, takes more than [`HANG`], allocates more than [`MEMORY`] at its peak,
//! or renders an error over [`ERROR_BYTES`]. It prints
//! `N cases, P panics, H hangs (> 2 s)` and fails on any of those. See tests/fuzz/README.md.
//!
//! `NEMO_DAG_FUZZ_CASES` (default 10,000) and `NEMO_DAG_FUZZ_SECONDS` (default 90: the run
//! stops at whichever comes first), `NEMO_DAG_FUZZ_SEED` (a number, or `random`).

mod mutate;

use mutate::{Case, Rng};
use nemo_dag_engine::graph;
use nemo_dag_engine::manifest::{LoadArgs, Manifest};
use nemo_dag_engine::plan::{Freshness, StagePlan};
use nemo_dag_op::{Registry, StageDecl};
use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A case slower than this is a hang.
const HANG: Duration = Duration::from_secs(2);
/// A case still running after this is stopped: the run ends there, with the case saved.
const STUCK: Duration = Duration::from_secs(60);
/// The most a case may allocate beyond what was live when it started.
const MEMORY: usize = 1 << 30;
/// The longest rendered error.
const ERROR_BYTES: usize = 64 << 10;
const NAME: &str = "fuzz_manifest_front_end";

/// The system allocator, counting live bytes and their peak.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is passed to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's layout contract is passed on.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live = LIVE.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(live, Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, size: usize) -> *mut u8 {
        // SAFETY: as above.
        let q = unsafe { System.realloc(p, layout, size) };
        if !q.is_null() {
            if size >= layout.size() {
                let live =
                    LIVE.fetch_add(size - layout.size(), Ordering::Relaxed) + size - layout.size();
                PEAK.fetch_max(live, Ordering::Relaxed);
            } else {
                LIVE.fetch_sub(layout.size() - size, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// What went wrong with one case.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Panic,
    Hang,
    Memory,
    HugeError,
}

#[derive(Default)]
struct Tally {
    cases: usize,
    loaded: usize,
    refused: usize,
    panics: usize,
    hangs: usize,
    memory: usize,
    huge_errors: usize,
    slowest: Duration,
    peak: usize,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--list") {
        println!("{NAME}: test");
        return;
    }
    let filters: Vec<&String> = args.iter().filter(|a| !a.starts_with('-')).collect();
    let ignored_only = args.iter().any(|a| a == "--ignored");
    if ignored_only || (!filters.is_empty() && !filters.iter().any(|f| NAME.contains(f.as_str()))) {
        println!("{NAME}: filtered out");
        return;
    }
    let cases: usize = env_number("NEMO_DAG_FUZZ_CASES").unwrap_or(10_000);
    let seconds = env_number("NEMO_DAG_FUZZ_SECONDS").unwrap_or(90);
    let seed = match std::env::var("NEMO_DAG_FUZZ_SEED").as_deref() {
        Ok("random") => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
        Ok(n) => n.parse().unwrap_or(1),
        Err(_) => 0x6e656d6f,
    };
    let code = run(cases, Duration::from_secs(seconds as u64), seed);
    std::process::exit(code);
}

fn env_number(name: &str) -> Option<usize> {
    std::env::var(name).ok()?.replace('_', "").parse().ok()
}

/// What a failing case leaves behind: its files and what went wrong.
fn failures_dir() -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-failures")
}

fn run(max_cases: usize, budget: Duration, seed: u64) -> i32 {
    let scratch =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("fuzz-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).expect("a scratch directory");
    // Inputs of the shipped manifests are found as they are beside them.
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let _ = std::os::unix::fs::symlink(repo.join("manifests/data"), scratch.join("data"));
    let _ = std::fs::remove_dir_all(failures_dir());

    let seeds = seeds(&repo);
    let donors: Vec<Vec<u8>> = seeds.iter().map(|(_, text, _)| text.clone()).collect();
    let ops = nemo_dag_ops::registry();
    let op_names = ops.names();

    // Panics are counted, not printed: the case is saved with the message instead.
    let panic_message: Arc<Mutex<Option<String>>> = Arc::default();
    {
        let slot = panic_message.clone();
        std::panic::set_hook(Box::new(move |info| {
            let place = info.location().map(|l| l.to_string()).unwrap_or_default();
            if let Ok(mut s) = slot.lock() {
                *s = Some(format!("{info} at {place}"));
            }
        }));
    }

    // The watchdog: a case still running after STUCK ends the run, its case saved.
    let started_at = Arc::new(AtomicU64::new(0));
    let current: Arc<Mutex<Option<Case>>> = Arc::default();
    let epoch = Instant::now();
    {
        let started_at = started_at.clone();
        let current = current.clone();
        std::thread::spawn(move || {
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let since = started_at.load(Ordering::Relaxed);
                if since == 0 {
                    continue;
                }
                let running = epoch.elapsed().saturating_sub(Duration::from_millis(since));
                if running > STUCK {
                    if let Ok(case) = current.lock()
                        && let Some(case) = case.as_ref()
                    {
                        save(case, "stuck", &format!("still running after {running:?}"));
                    }
                    println!(
                        "{NAME}: a case ran past {STUCK:?}; saved under {}",
                        failures_dir().display()
                    );
                    std::process::exit(1);
                }
            }
        });
    }

    let mut rng = Rng::new(seed);
    let mut tally = Tally::default();
    let start = Instant::now();
    // Every seed as it is first (the corpus holds the regressions), then mutations.
    let mut queue: Vec<Case> = seeds
        .iter()
        .map(|(file, text, args)| mutate::plain(file, text, args.clone()))
        .collect();
    queue.reverse();
    while tally.cases < max_cases && start.elapsed() < budget {
        let case = queue.pop().unwrap_or_else(|| {
            let (file, text, _) = rng.pick(&seeds);
            mutate::case(&mut rng, file, text, &donors, &op_names)
        });
        if let Ok(mut c) = current.lock() {
            *c = Some(case.clone());
        }
        started_at.store(epoch.elapsed().as_millis().max(1) as u64, Ordering::Relaxed);
        let live_before = LIVE.load(Ordering::Relaxed);
        PEAK.store(live_before, Ordering::Relaxed);
        let t = Instant::now();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            one_case(&case, &scratch, ops)
        }));
        let took = t.elapsed();
        started_at.store(0, Ordering::Relaxed);
        let peak = PEAK.load(Ordering::Relaxed).saturating_sub(live_before);
        tally.cases += 1;
        tally.slowest = tally.slowest.max(took);
        tally.peak = tally.peak.max(peak);
        let mut failures = Vec::new();
        match outcome {
            Ok(Ok(loaded)) => {
                if loaded {
                    tally.loaded += 1;
                } else {
                    tally.refused += 1;
                }
            }
            Ok(Err(why)) => failures.push((Failure::HugeError, why)),
            Err(_) => {
                let message = panic_message.lock().ok().and_then(|mut m| m.take());
                failures.push((Failure::Panic, message.unwrap_or_default()));
            }
        }
        if took > HANG {
            failures.push((Failure::Hang, format!("took {took:?}")));
        }
        if peak > MEMORY {
            failures.push((Failure::Memory, format!("allocated {} MiB", peak >> 20)));
        }
        for (failure, why) in failures {
            match failure {
                Failure::Panic => tally.panics += 1,
                Failure::Hang => tally.hangs += 1,
                Failure::Memory => tally.memory += 1,
                Failure::HugeError => tally.huge_errors += 1,
            }
            let kind = format!("{failure:?}").to_lowercase();
            save(&case, &format!("{kind}-{}", tally.cases), &why);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);

    println!(
        "{NAME}: {} cases, {} panics, {} hangs (> {} s); {} over {} MiB, {} errors over {} KiB; \
         {} loaded, {} refused; slowest {:.2} s, peak {} MiB; seed {seed}, {:.0} s",
        tally.cases,
        tally.panics,
        tally.hangs,
        HANG.as_secs(),
        tally.memory,
        MEMORY >> 20,
        tally.huge_errors,
        ERROR_BYTES >> 10,
        tally.loaded,
        tally.refused,
        tally.slowest.as_secs_f64(),
        tally.peak >> 20,
        start.elapsed().as_secs_f64()
    );
    let failed = tally.panics + tally.hangs + tally.memory + tally.huge_errors;
    if failed > 0 {
        println!(
            "{NAME}: FAILED: the cases are under {}; fix each, then keep it in tests/fuzz/corpus/",
            failures_dir().display()
        );
        return 1;
    }
    0
}

/// The seeds: every shipped manifest and every corpus file, with the overrides of its
/// `.args` file if it has one (one argument a line).
fn seeds(repo: &Path) -> Vec<(String, Vec<u8>, Vec<String>)> {
    let mut files = Vec::new();
    for dir in ["manifests", "tests/fuzz/corpus"] {
        let Ok(entries) = std::fs::read_dir(repo.join(dir)) else {
            continue;
        };
        let mut paths: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
        paths.sort();
        for path in paths {
            let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
            if !matches!(ext, "yaml" | "yml" | "toml") {
                continue;
            }
            let Ok(text) = std::fs::read(&path) else {
                continue;
            };
            let args = std::fs::read_to_string(path.with_extension("args"))
                .map(|a| a.lines().map(str::to_string).collect())
                .unwrap_or_default();
            files.push((format!("m.{ext}"), text, args));
        }
    }
    assert!(
        !files.is_empty(),
        "no seeds under manifests/ or tests/fuzz/corpus/"
    );
    files
}

/// Load the case; render its error, or its graph; check a `cmd` line with its params.
/// Ok(true) if it loaded, Ok(false) if it was refused, Err if the error shown is too big.
fn one_case(case: &Case, scratch: &Path, ops: Registry) -> Result<bool, String> {
    let dir = scratch.join("case");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let _ = std::os::unix::fs::symlink(scratch.join("data"), dir.join("data"));
    let path = dir.join(&case.file);
    std::fs::write(&path, &case.text).map_err(|e| e.to_string())?;
    let mut args = LoadArgs::new(&path, ops);
    if let Some((name, text)) = &case.variant {
        let variant = dir.join("m").join(format!("{name}.yaml"));
        if let Some(parent) = variant.parent() {
            let _ = std::fs::create_dir_all(parent);
        }
        let _ = std::fs::write(&variant, text);
        args.variant = Some(name.clone());
    }
    args.overrides = case.overrides.clone();

    let loaded = match Manifest::load(&args) {
        Ok(manifest) => {
            let plans: Vec<StagePlan> = manifest
                .order
                .iter()
                .map(|name| StagePlan {
                    name: name.clone(),
                    freshness: Freshness::Stale,
                    key: None,
                    reasons: Vec::new(),
                    last_run: None,
                })
                .collect();
            for format in [
                graph::Format::Ascii,
                graph::Format::Dot,
                graph::Format::Mermaid,
                graph::Format::Json,
            ] {
                graph::render(&manifest, &plans, format);
            }
            true
        }
        Err(e) => {
            let mut shown = String::new();
            // As the binary shows errors (engine/cli/src/main.rs): unwrapped lines.
            miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
                .with_wrap_lines(false)
                .render_report(&mut shown, &e)
                .map_err(|e| format!("rendering the error failed: {e}"))?;
            if shown.len() > ERROR_BYTES {
                return Err(format!("the error shown is {} bytes", shown.len()));
            }
            false
        }
    };

    // The placeholder check, on its own.
    if let Some(cmd_op) = ops.get("cmd") {
        let params = serde_json::json!({"x": "$(touch pwned)", "n": 3, "a": {"b": 1}});
        let outputs = std::collections::BTreeMap::from([("o".to_string(), "o.txt".to_string())]);
        let decl = StageDecl {
            name: "s",
            params: &params,
            inputs: vec!["i"],
            outputs: &outputs,
            cmd: Some(&case.cmd),
            world_size: None,
            nodes: None,
        };
        let _ = cmd_op.check(&decl);
    }
    Ok(loaded)
}

/// Keep a failing case under `failures_dir()/name/`.
fn save(case: &Case, name: &str, why: &str) {
    let dir = failures_dir().join(name);
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join(&case.file), &case.text);
    if let Some((variant, text)) = &case.variant {
        let _ = std::fs::write(
            dir.join(format!("variant-{}.yaml", variant.replace('/', "_"))),
            text,
        );
    }
    let _ = std::fs::write(dir.join("m.args"), case.overrides.join("\n"));
    let _ = std::fs::write(dir.join("cmd.txt"), &case.cmd);
    let _ = std::fs::write(dir.join("why.txt"), why);
}
