//! `nemo-dag push`, `nemo-dag pull` and `nemo-dag cache status`: move a manifest's artifacts to
//! and from the shared cache (`[cache]` in env.toml), or say where each stage's artifact is,
//! without running anything.

use super::ManifestArgs;
use nemo_dag_engine::cache::{self, Cache, Row, Transfer};
use nemo_dag_engine::diag::{InputError, Result};
use nemo_dag_op::Registry;
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    m: ManifestArgs,
    /// Only these stages and what they need (repeatable)
    #[arg(long = "target", value_name = "STAGE")]
    targets: Vec<String>,
    /// Print a JSON summary on stdout
    #[arg(long)]
    json: bool,
}

#[derive(clap::Subcommand, Debug)]
pub enum CacheCommand {
    /// Say, per stage, whether its artifact is here, in the shared cache, or missing
    Status(Args),
}

pub fn exec(a: Args, what: Transfer, ops: Registry) -> Result<()> {
    let (manifest, store) = a.m.load(ops)?;
    let cache = Cache::load(&manifest.dir)?.ok_or_else(|| {
        InputError::new("no shared cache is configured: env.toml has no [cache]").help(
            "add [cache] with `url`, `read` and `write` to the env.toml beside the manifest (docs/cache.md)",
        )
    })?;
    let progress = (what != Transfer::Status).then(|| Progress::start(&cache, what));
    let rows = cache::transfer(&manifest, &store, &cache, &a.targets, what);
    drop(progress);
    let rows = rows?;
    let width = rows.iter().map(|r| r.name.len()).max().unwrap_or(4);
    for r in &rows {
        eprintln!("{:<width$}  {}", r.name, describe(r));
    }
    let moved: u64 = rows.iter().map(|r| r.bytes).sum();
    let count = |done| rows.iter().filter(|r| r.done == Some(done)).count();
    match what {
        Transfer::Push => eprintln!(
            "{} stage(s) pushed ({}) to {}",
            count("pushed"),
            nemo_dag_op::plan::bytes(moved),
            cache.remote.settings.url
        ),
        Transfer::Pull => eprintln!(
            "{} stage(s) pulled ({}) from {}",
            count("pulled"),
            nemo_dag_op::plan::bytes(moved),
            cache.remote.settings.url
        ),
        Transfer::Status => {}
    }
    if a.json {
        println!("{}", json!({ "stages": rows }));
    }
    match rows.iter().find(|r| r.problem.is_some()) {
        Some(r) => Err(miette::miette!(
            "stage `{}`: {}",
            r.name,
            r.problem.as_deref().unwrap_or_default()
        )
        .into()),
        None => Ok(()),
    }
}

/// `local, remote (main) · pushed 1.2 MiB`.
fn describe(r: &Row) -> String {
    let Some(key) = &r.key else {
        return "missing (an upstream stage is neither here nor in the cache)".into();
    };
    let short = &key[..key.len().min(12)];
    let place = match (r.local, &r.remote) {
        (true, Some(scope)) => format!("local, remote ({scope})"),
        (true, None) => "local".into(),
        (false, Some(scope)) => format!("remote ({scope})"),
        (false, None) => "missing".into(),
    };
    let done = r
        .done
        .map(|d| format!(" · {d} {}", nemo_dag_op::plan::bytes(r.bytes)))
        .unwrap_or_default();
    let problem = r
        .problem
        .as_deref()
        .map(|p| format!(" · {p}"))
        .unwrap_or_default();
    format!("{short}  {place}{done}{problem}")
}

/// A line on a terminal's stderr, redrawn as blobs move: how much, and how fast.
struct Progress {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    fn start(cache: &Cache, what: Transfer) -> Option<Progress> {
        use std::io::IsTerminal;
        use std::sync::atomic::Ordering;
        if !std::io::stderr().is_terminal() {
            return None;
        }
        let moved = cache.remote.moved.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let verb = if what == Transfer::Push {
            "pushed"
        } else {
            "pulled"
        };
        let thread = std::thread::spawn({
            let stop = stop.clone();
            move || {
                let clock = std::time::Instant::now();
                let mut shown = false;
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    let bytes = moved.load(Ordering::Relaxed);
                    if bytes == 0 {
                        continue;
                    }
                    let rate = bytes as f64 / clock.elapsed().as_secs_f64().max(1e-3);
                    eprint!(
                        "\r\x1b[2K{verb} {} · {}/s",
                        nemo_dag_op::plan::bytes(bytes),
                        nemo_dag_op::plan::bytes(rate as u64)
                    );
                    shown = true;
                }
                if shown {
                    eprint!("\r\x1b[2K");
                }
            }
        });
        Some(Progress {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
