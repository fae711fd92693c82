//! The local executor: walks the DAG and runs every ready stage, `-j` at a time.
//!
//! A stage becomes ready when everything it consumes is published. Its key is then computed
//! from the actual digests of those outputs; if that key is already in the store the stage is
//! `cached` (or `cutoff`, when an upstream stage just re-ran and produced identical bytes) and
//! nothing is started. Otherwise a child process `nemo-dag exec` builds and publishes it — the
//! same code path a Slurm job runs. Each child leads its own process group: Ctrl-C, SIGTERM or
//! SIGHUP of the run kill every group, a child whose run dies (even by `kill -9`) kills its own
//! group (PR_SET_PDEATHSIG → [`crate::exec`]), and when a child ends, whatever is left of its
//! group is killed too. A stage with `resources.time` is killed when its time is up.
//!
//! The run holds the store's shared lock (so `gc` refuses to run beside it), journals each key
//! it publishes at once, and writes the run record at the end.

use crate::diag::{Failure, InputError, Result};
use crate::digest::Digester;
use crate::exec::{JobResult, JobSpec};
use crate::manifest::{Input, Manifest};
use crate::plan::{self, Resolved};
use crate::store::short;
use crate::store::{Published, RunRecord, Store};
use nemo_dag_op::Progress;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::task::JoinSet;

/// How long the stages still being sent to MLflow may take once every stage has ended.
const TRACKING_GRACE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    pub jobs: usize,
    pub keep_going: bool,
    pub targets: Vec<String>,
    pub force: Vec<String>,
    pub argv: Vec<String>,
    /// Refuse, before anything runs, a stage whose plan needs more memory than this machine
    /// has (`run --no-memory-check` turns it off).
    pub check_memory: bool,
    /// The shared cache (`[cache]` in env.toml): a stale stage is pulled from it when one of
    /// its read scopes has the key, and what runs here is pushed to its write scope.
    pub cache: Option<std::sync::Arc<crate::cache::Cache>>,
    /// The MLflow tracker (`[mlflow]` in env.toml, or `MLFLOW_TRACKING_URI`): each stage that
    /// runs here becomes an MLflow run once it is published.
    pub tracker: Option<std::sync::Arc<crate::mlflow::Tracker>>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    pub name: String,
    pub key: Option<String>,
    /// `executed`, `pulled` (from the shared cache), `cached`, `cutoff`, `failed` or
    /// `skipped`.
    pub state: &'static str,
    pub seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log: Option<String>,
}

impl Outcome {
    /// Whether the stage's artifact is in the store after this run (its run record names it).
    pub fn published(&self) -> bool {
        matches!(self.state, "executed" | "pulled" | "cached" | "cutoff")
    }
}

/// Stages pulled from the shared cache at once.
const PULLS_IN_FLIGHT: usize = 8;

/// The stages `--target` selects: the targets and everything upstream of them.
pub fn select(manifest: &Manifest, targets: &[String]) -> Result<BTreeSet<String>, InputError> {
    let targets = manifest.expand_names(targets, "--target")?;
    if targets.is_empty() {
        return Ok(manifest.stages.keys().cloned().collect());
    }
    let mut selected = BTreeSet::new();
    let mut todo: Vec<&str> = targets.iter().map(String::as_str).collect();
    while let Some(name) = todo.pop() {
        if selected.insert(name.to_string()) {
            todo.extend(manifest.stages[name].deps.iter().map(String::as_str));
        }
    }
    Ok(selected)
}

/// One stage of a dry run: what `run` would do with it, and why.
#[derive(Debug, serde::Serialize)]
pub struct WouldRun {
    pub name: String,
    pub key: Option<String>,
    /// `cached` or `would-run`.
    pub state: &'static str,
    pub seconds: f64,
    pub reasons: Vec<String>,
    /// What the stage took the last time it ran (a forced one: its current artifact).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_run: Option<plan::LastRun>,
}

/// What `run --dry-run` reports: each selected stage, cached or would-run, with the plan's
/// reasons. Reads only; runs and writes nothing.
pub fn dry_run(
    manifest: &Manifest,
    store: &Store,
    targets: &[String],
    force: &[String],
) -> Result<Vec<WouldRun>> {
    let selected = select(manifest, targets)?;
    check_names(manifest, force, "--force")?;
    let mut digester = Digester::load(&store.memo_file());
    check_launches(manifest, store, &selected, force, &mut digester)?;
    let plans = plan::plan(manifest, store, &mut digester)?;
    Ok(plans
        .into_iter()
        .filter(|p| selected.contains(&p.name))
        .map(|p| {
            let forced = force.contains(&p.name);
            let state = match p.freshness {
                plan::Freshness::UpToDate if !forced => "cached",
                _ => "would-run",
            };
            let last_run = match p.freshness {
                plan::Freshness::UpToDate if forced => p
                    .key
                    .as_deref()
                    .and_then(|k| store.load(k))
                    .map(|a| plan::LastRun::of(&a)),
                _ => p.last_run,
            };
            WouldRun {
                name: p.name,
                key: p.key,
                state,
                seconds: 0.0,
                reasons: p.reasons,
                last_run: last_run.filter(|_| state == "would-run"),
            }
        })
        .collect())
}

/// `; or a variant of the manifest sized for one machine: -c tiny`, when it has variants and
/// none is chosen.
fn smaller_variant(manifest: &Manifest) -> String {
    let variants = crate::manifest::variants(&manifest.path);
    if manifest.variant.is_some() || variants.is_empty() {
        return String::new();
    }
    let shown: Vec<String> = variants.iter().map(|v| format!("`-c {v}`")).collect();
    format!("; or a variant of the manifest: {}", shown.join(", "))
}

/// A stage this machine cannot launch (`launch: srun`, or `torchrun` on several nodes) stops
/// a local run before anything runs, unless it is up to date and only its artifact is used.
/// The plan is computed only when such a stage is selected.
fn check_launches(
    manifest: &Manifest,
    store: &Store,
    selected: &BTreeSet<String>,
    force: &[String],
    digester: &mut Digester,
) -> Result<()> {
    let needs_slurm: HashMap<&str, String> = selected
        .iter()
        .filter_map(|name| {
            let launch = manifest.stages[name].resources.launch()?;
            let why = launch.local_command().err()?;
            Some((name.as_str(), why))
        })
        .collect();
    if needs_slurm.is_empty() {
        return Ok(());
    }
    let plans = plan::plan(manifest, store, digester)?;
    let first = plans.iter().find(|p| {
        needs_slurm.contains_key(p.name.as_str())
            && (p.freshness != plan::Freshness::UpToDate || force.contains(&p.name))
    });
    match first {
        None => Ok(()),
        Some(p) => Err(manifest
            .error_at(
                &["stages", &p.name, "resources", "launch"],
                format!(
                    "stage `{}`: {}, so it needs a Slurm profile",
                    p.name, needs_slurm[p.name.as_str()]
                ),
            )
            .help(format!(
                "run it on a cluster: `nemo-dag run {} --batch PROFILE` (or `--run PROFILE`), with a profile whose executor is \"slurm\" in env.toml (docs/slurm.md){}",
                manifest.path.display(),
                smaller_variant(manifest)
            ))
            .into()),
    }
}

pub fn check_names(manifest: &Manifest, names: &[String], flag: &str) -> Result<(), InputError> {
    manifest.expand_names(names, flag).map(drop)
}

/// Prints progress for people on stderr: on a terminal a live bar for the run and one for each
/// training stage (from its `step N/M` log lines); plain lines otherwise.
struct Reporter {
    multi: Option<indicatif::MultiProgress>,
    bar: Option<indicatif::ProgressBar>,
    width: usize,
}

impl Reporter {
    fn new(total: usize, width: usize) -> Reporter {
        if !std::io::stderr().is_terminal() || total <= 1 {
            return Reporter {
                multi: None,
                bar: None,
                width,
            };
        }
        let multi = indicatif::MultiProgress::new();
        let bar = multi.add(indicatif::ProgressBar::new(total as u64));
        bar.set_style(
            indicatif::ProgressStyle::with_template("{spinner} [{pos}/{len}] {elapsed} {wide_msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        Reporter {
            multi: Some(multi),
            bar: Some(bar),
            width,
        }
    }

    fn line(&self, text: String) {
        print_line(self.multi.as_ref(), text);
    }

    fn stage_line(&self, name: &str, text: &str) {
        self.line(format!("{name:>w$} │ {text}", w = self.width));
    }

    fn done(&self, running: &[&str]) {
        if let Some(bar) = &self.bar {
            bar.inc(1);
            bar.set_message(format!("running: {}", running.join(", ")));
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }

    /// A live line for the shared cache's transfers, on a terminal: the bytes pulled and
    /// pushed so far and the rate, once any have moved. Cleared when the task is aborted.
    fn transfers(&self, cache: &crate::cache::Cache) -> Option<tokio::task::JoinHandle<()>> {
        let multi = self.multi.clone()?;
        let moved = cache.remote.moved.clone();
        Some(tokio::spawn(async move {
            let clock = Instant::now();
            let mut shown = 0;
            let mut line: Option<ClearOnDrop> = None;
            loop {
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
                let bytes = moved.load(std::sync::atomic::Ordering::Relaxed);
                if bytes == shown {
                    continue;
                }
                shown = bytes;
                let bar = &line
                    .get_or_insert_with(|| {
                        let bar = multi.add(indicatif::ProgressBar::new_spinner());
                        bar.set_style(
                            indicatif::ProgressStyle::with_template(
                                "{spinner} shared cache: {wide_msg}",
                            )
                            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
                        );
                        ClearOnDrop(bar)
                    })
                    .0;
                let rate = bytes as f64 / clock.elapsed().as_secs_f64().max(1e-3);
                bar.set_message(format!(
                    "{} moved · {}/s",
                    nemo_dag_op::plan::bytes(bytes),
                    nemo_dag_op::plan::bytes(rate as u64)
                ));
                bar.tick();
            }
        }))
    }
}

/// Clears its line when the task that shows it ends.
struct ClearOnDrop(indicatif::ProgressBar);

impl Drop for ClearOnDrop {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// A line on stderr that does not tear the live bars.
fn print_line(multi: Option<&indicatif::MultiProgress>, text: String) {
    match multi {
        Some(m) => {
            if m.println(&text).is_err() {
                eprintln!("{text}");
            }
        }
        None => eprintln!("{text}"),
    }
}

/// Shows one stage's stderr, prefixed with its name; its progress lines ([`Progress`]) drive a
/// bar of its own on a terminal, and are not shown as text.
struct StageEcho {
    multi: Option<indicatif::MultiProgress>,
    bar: Option<indicatif::ProgressBar>,
    name: String,
    width: usize,
    /// The last few lines (not progress), for a stage that dies without a report.
    last: VecDeque<String>,
}

impl StageEcho {
    fn line(&mut self, line: &str) {
        if let Some(Progress {
            done,
            total,
            message,
        }) = Progress::from_line(line)
        {
            let Some(multi) = &self.multi else { return };
            let bar = self.bar.get_or_insert_with(|| {
                let bar = multi.add(indicatif::ProgressBar::new(total));
                bar.set_style(
                    indicatif::ProgressStyle::with_template(
                        "{prefix} {bar:30} {pos}/{len} steps · eta {eta} · {wide_msg}",
                    )
                    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
                );
                bar.set_prefix(self.name.clone());
                bar
            });
            bar.set_length(total);
            bar.set_position(done);
            bar.set_message(message);
            return;
        }
        print_line(
            self.multi.as_ref(),
            format!("{:>w$} │ {line}", self.name, w = self.width),
        );
        if self.last.len() == LAST_LINES {
            self.last.pop_front();
        }
        self.last.push_back(line.chars().take(500).collect());
    }
}

impl Drop for StageEcho {
    fn drop(&mut self) {
        if let (Some(multi), Some(bar)) = (&self.multi, self.bar.take()) {
            bar.finish_and_clear();
            multi.remove(&bar);
        }
    }
}

type JobOutput = (String, std::io::Result<JobResult>, f64);

/// How many of a stage's last lines a failure report quotes.
const LAST_LINES: usize = 8;

pub fn run(manifest: &Manifest, store: &Store, opts: &RunOptions) -> Result<Vec<Outcome>> {
    let selected = select(manifest, &opts.targets)?;
    check_names(manifest, &opts.force, "--force")?;
    // Every input is read before anything is written: bad input leaves no trace.
    let mut digester = Digester::load(&store.memo_file());
    plan::check_file_inputs(manifest, &selected, &mut digester)?;
    check_launches(manifest, store, &selected, &opts.force, &mut digester)?;
    if opts.check_memory {
        check_memory(manifest, store, &selected, &opts.force, &mut digester)?;
    }
    store.ensure()?;
    let _shared = store.hold_shared()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| miette::miette!("cannot start the scheduler: {e}"))?;
    runtime.block_on(schedule(manifest, store, opts, selected, digester))
}

/// Refuse the run, before any stage starts, when a stage that would run here has a plan that
/// needs more memory than this machine has: better a clear error now than an out-of-memory
/// kill an hour in, after its upstream stages ran.
fn check_memory(
    manifest: &Manifest,
    store: &Store,
    selected: &BTreeSet<String>,
    force: &[String],
    digester: &mut Digester,
) -> Result<()> {
    // The estimates first (no I/O): only a stage that may not fit needs its freshness.
    let mut over = Vec::new();
    for name in manifest.order.iter().filter(|n| selected.contains(*n)) {
        let device = manifest.stages[name].resources.device.as_deref();
        // A per-GPU plan is not this machine's memory (a Slurm profile's gpu_memory checks it).
        if let (Some(estimate), Some((capacity, what))) =
            (manifest.estimate(name), crate::estimate::capacity(device))
            && !estimate.per_gpu()
            && estimate.peak_bytes() > capacity
        {
            over.push((name, estimate, capacity, what));
        }
    }
    if over.is_empty() {
        return Ok(());
    }
    let would_run: BTreeSet<String> = plan::plan(manifest, store, digester)?
        .into_iter()
        .filter(|p| p.freshness != plan::Freshness::UpToDate || force.contains(&p.name))
        .map(|p| p.name)
        .collect();
    for (name, estimate, capacity, what) in over {
        if !would_run.contains(name) {
            continue;
        }
        if let Some((message, help)) =
            crate::estimate::does_not_fit(name, estimate, capacity, &what)
        {
            let help = format!("{help}; `run --no-memory-check` runs it anyway");
            return Err(manifest
                .error_at(&["stages", name], message)
                .help(help)
                .into());
        }
        eprintln!(
            "nemo-dag: stage `{name}` may need up to {} with its rows at their longest, more than this machine has ({what}); it runs, as it needs at least {}",
            nemo_dag_op::plan::bytes(estimate.peak_bytes()),
            nemo_dag_op::plan::bytes(estimate.certain_bytes())
        );
    }
    Ok(())
}

/// The first termination signal the run gets, by name.
async fn termination() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        let _ = tokio::signal::ctrl_c().await;
        return "SIGINT";
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = term.recv() => "SIGTERM",
        _ = hup.recv() => "SIGHUP",
    }
}

async fn schedule(
    manifest: &Manifest,
    store: &Store,
    opts: &RunOptions,
    selected: BTreeSet<String>,
    mut digester: Digester,
) -> Result<Vec<Outcome>> {
    let jobs = opts.jobs.max(1);
    let exe =
        std::env::current_exe().map_err(|e| miette::miette!("cannot find nemo-dag itself: {e}"))?;
    let order: Vec<&String> = manifest
        .order
        .iter()
        .filter(|n| selected.contains(*n))
        .collect();
    let position: HashMap<&str, usize> = order
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let width = order.iter().map(|n| n.len()).max().unwrap_or(4).min(24);
    let reporter = Reporter::new(order.len(), width);
    let transfers = opts.cache.as_ref().and_then(|c| reporter.transfers(c));

    let mut waiting: HashMap<&str, usize> = order
        .iter()
        .map(|n| (n.as_str(), manifest.stages[*n].deps.len()))
        .collect();
    let mut dependents: HashMap<&str, Vec<&str>> = HashMap::new();
    for name in &order {
        for dep in &manifest.stages[*name].deps {
            dependents
                .entry(dep.as_str())
                .or_default()
                .push(name.as_str());
        }
    }
    let mut ready: BTreeSet<(usize, &str)> = order
        .iter()
        .filter(|n| waiting[n.as_str()] == 0)
        .map(|n| (position[n.as_str()], n.as_str()))
        .collect();

    let mut published: HashMap<String, Published> = HashMap::new();
    let mut executed: HashSet<String> = HashSet::new();
    let mut outcomes: HashMap<String, Outcome> = HashMap::new();
    let mut running: HashMap<String, (u32, usize, String)> = HashMap::new(); // name → (pid, cpus, key)
    let mut cpus_in_use = 0usize;
    let mut failed = false;
    let mut tasks: JoinSet<JobOutput> = JoinSet::new();
    // The shared cache: stages being pulled, stages it could not give (they build here), and
    // pushes of what ran here (they finish before the run ends).
    let mut pulls: JoinSet<(String, String, crate::cache::Pulled, f64)> = JoinSet::new();
    let mut not_pulled: HashSet<&str> = HashSet::new();
    let mut pushes: JoinSet<(
        String,
        String,
        std::result::Result<crate::cache::Pushed, nemo_dag_remote::Error>,
    )> = JoinSet::new();
    // What ran here, logged to MLflow as it is published (one stage at a time, never failing).
    let mut tracking: JoinSet<()> = JoinSet::new();
    let run_tags = crate::mlflow::RunTags::new(manifest, &opts.argv);
    let mut interrupted = false;
    // Each key this run publishes is journaled at once; the record is written at the end.
    let run_id = plan::run_id(manifest);
    let mut record_error: Option<Failure> = None;
    let stop = termination();
    tokio::pin!(stop);

    loop {
        // Start (or settle from the cache) every ready stage that fits.
        while let Some(&(pos, name)) = ready.first() {
            if interrupted || (failed && !opts.keep_going) {
                break;
            }
            let stage = &manifest.stages[name];
            let resolved =
                plan::resolve(manifest, stage, &published, &mut digester)?.ok_or_else(|| {
                    miette::miette!("internal: stage {name} became ready before its inputs")
                })?;
            let forced = opts.force.iter().any(|f| f == name);
            let found = if forced {
                Ok(None)
            } else {
                store.lookup(&resolved.key, &mut digester)
            };
            match found {
                Ok(None) => {
                    if let Some(cache) = opts
                        .cache
                        .as_ref()
                        .filter(|_| !forced && !not_pulled.contains(name))
                    {
                        // Each pull holds the key's lock, a connection and a file: a few at
                        // a time, the rest wait in the ready set.
                        if pulls.len() >= PULLS_IN_FLIGHT {
                            break;
                        }
                        ready.remove(&(pos, name));
                        let (cache, store, key, name) = (
                            cache.clone(),
                            store.clone(),
                            resolved.key.clone(),
                            name.to_string(),
                        );
                        pulls.spawn(async move {
                            let clock = Instant::now();
                            let pulled = cache.pull(&store, &key).await;
                            (name, key, pulled, clock.elapsed().as_secs_f64())
                        });
                        continue;
                    }
                }
                Ok(Some(found)) => {
                    ready.remove(&(pos, name));
                    let cutoff = stage.deps.iter().any(|d| executed.contains(d));
                    let state = if cutoff { "cutoff" } else { "cached" };
                    reporter.stage_line(name, &format!("{state} {}", short(&resolved.key)));
                    let o = outcome(name, Some(&resolved.key), state, 0.0);
                    outcomes.insert(name.to_string(), o);
                    published.insert(name.to_string(), found);
                    release(name, &dependents, &mut waiting, &mut ready, &position);
                    reporter.done(&running.keys().map(String::as_str).collect::<Vec<_>>());
                    continue;
                }
                Err(damage) => {
                    // Never served, never rebuilt over silently: the user decides.
                    ready.remove(&(pos, name));
                    failed = true;
                    reporter.stage_line(name, &format!("FAILED: {damage}"));
                    let mut o = outcome(name, Some(&resolved.key), "failed", 0.0);
                    o.error = Some(damage);
                    outcomes.insert(name.to_string(), o);
                    reporter.done(&running.keys().map(String::as_str).collect::<Vec<_>>());
                    continue;
                }
            }
            let cpus = (stage.resources.cpus.unwrap_or(1) as usize).clamp(1, jobs);
            if cpus_in_use + cpus > jobs {
                break;
            }
            ready.remove(&(pos, name));
            let mut spec = job_spec(manifest, store, name, &resolved, forced);
            // (A launch this machine cannot start was refused before the run began; should one
            // get here, `exec` fails the stage for want of a launcher.)
            if let Some(launch) = &spec.launch {
                spec.launcher = launch.local_command().unwrap_or_default();
            }
            reporter.stage_line(name, &format!("started {}", short(&resolved.key)));
            let echo = StageEcho {
                multi: reporter.multi.clone(),
                bar: None,
                name: name.to_string(),
                width,
                last: VecDeque::new(),
            };
            let limit = stage.resources.time_limit();
            let pid = start_job(&exe, &spec, &mut tasks, echo, limit)?;
            cpus_in_use += cpus;
            running.insert(name.to_string(), (pid, cpus, resolved.key.clone()));
        }
        if tasks.is_empty() && pulls.is_empty() {
            break;
        }
        tokio::select! {
            pulled = pulls.join_next(), if !pulls.is_empty() => {
                // (A pull cancelled by an interrupt gave nothing.)
                let Some(Ok((name, key, pulled, seconds))) = pulled else { continue };
                let Some((&name_ref, &pos)) = position.get_key_value(name.as_str()) else { continue };
                use crate::cache::Pulled;
                let state = match pulled {
                    Pulled::Pulled { scope, bytes } => {
                        reporter.stage_line(&name, &format!("pulled {} from `{scope}` ({}) in {seconds:.2}s", short(&key), nemo_dag_op::plan::bytes(bytes)));
                        Some("pulled")
                    }
                    Pulled::Here => Some("cached"),
                    Pulled::Refused(why) => {
                        reporter.stage_line(&name, &format!("not pulled: {why}; building here"));
                        None
                    }
                    Pulled::Absent | Pulled::Off => None,
                };
                match (state, store.load(&key)) {
                    (Some(state), Some(artifact)) if !interrupted => {
                        if state == "pulled"
                            && let Err(e) = store.journal(&run_id, &key)
                        {
                            record_error.get_or_insert(e);
                        }
                        outcomes.insert(name.clone(), outcome(&name, Some(&key), state, seconds));
                        published.insert(name.clone(), Published::from(&artifact));
                        release(name_ref, &dependents, &mut waiting, &mut ready, &position);
                        reporter.done(&running.keys().map(String::as_str).collect::<Vec<_>>());
                    }
                    _ => {
                        not_pulled.insert(name_ref);
                        if !interrupted {
                            ready.insert((pos, name_ref));
                        }
                    }
                }
            }
            joined = tasks.join_next(), if !tasks.is_empty() => {
                let Some(joined) = joined else { continue };
                let (name, result, seconds) = joined.map_err(|e| miette::miette!("internal: {e}"))?;
                let Some((_, cpus, key)) = running.remove(&name) else { continue };
                cpus_in_use -= cpus;
                // The map's own key: a &str that lives as long as the manifest (no O(N) search).
                let name_ref: &str = position.get_key_value(name.as_str()).map(|(k, _)| *k).unwrap_or("");
                let result = result.unwrap_or_else(|e| JobResult {
                    state: "failed".into(),
                    key: None,
                    error: Some(format!("nemo-dag exec did not report: {e}")),
                    log: None,
                });
                match (result.state.as_str(), store.load(&key).map(|a| Published::from(&a))) {
                    ("executed" | "cached", Some(found)) => {
                        let state = if result.state == "executed" {
                            executed.insert(name.clone());
                            if let Err(e) = store.journal(&run_id, &key) {
                                record_error.get_or_insert(e);
                            }
                            if let Some(cache) = &opts.cache {
                                let (cache, store, key, name) = (cache.clone(), store.clone(), key.clone(), name.clone());
                                pushes.spawn(async move {
                                    let pushed = cache.push(&store, &key).await;
                                    (name, key, pushed)
                                });
                            }
                            if let Some(tracker) = &opts.tracker {
                                let (tracker, store, key, tags) = (tracker.clone(), store.clone(), key.clone(), run_tags.clone());
                                tracking.spawn(async move {
                                    if let Some(artifact) = store.load(&key) {
                                        tracker.stage(&artifact, &store.artifact_dir(&key), &tags).await;
                                    }
                                });
                            }
                            "executed"
                        } else {
                            "cached"
                        };
                        reporter.stage_line(&name, &format!("{state} {} in {seconds:.2}s", short(&key)));
                        let o = outcome(&name, Some(&key), state, seconds);
                        outcomes.insert(name.clone(), o);
                        published.insert(name.clone(), found);
                        release(name_ref, &dependents, &mut waiting, &mut ready, &position);
                    }
                    _ if interrupted => {
                        reporter.stage_line(&name, "stopped (interrupted)");
                        let mut o = outcome(&name, Some(&key), "failed", seconds);
                        o.error = Some("interrupted".into());
                        outcomes.insert(name.clone(), o);
                    }
                    _ => {
                        failed = true;
                        let error = result.error.clone().unwrap_or_else(|| "the stage did not publish an artifact".into());
                        let log_hint = result.log.as_deref().map(|l| format!(" (log: {l})")).unwrap_or_default();
                        reporter.stage_line(&name, &format!("FAILED: {error}{log_hint}"));
                        if let Some(tracker) = &opts.tracker {
                            let stage = &manifest.stages[&name];
                            let failure = crate::mlflow::Failed {
                                stage,
                                key: &key,
                                upstream_keys: stage.deps.iter().filter_map(|d| published.get(d)).map(|p| p.key.clone()).collect(),
                                manifest: &manifest.path,
                                error: &error,
                                log: result.log.as_deref(),
                                seconds,
                            };
                            let (tracker, record) = (tracker.clone(), crate::mlflow::Record::failed(&failure, &run_tags));
                            tracking.spawn(async move { tracker.record(record).await });
                        }
                        let mut o = outcome(&name, Some(&key), "failed", seconds);
                        o.error = Some(error);
                        o.log = result.log.clone();
                        outcomes.insert(name.clone(), o);
                    }
                }
                reporter.done(&running.keys().map(String::as_str).collect::<Vec<_>>());
            }
            signal = &mut stop, if !interrupted => {
                interrupted = true;
                reporter.line(format!("{signal}: stopping running stages; nothing partial is published"));
                for (pid, _, _) in running.values() {
                    // SAFETY: signalling a process group we created. What they leave in tmp/ is
                    // never published; the next attempt wipes or resumes it, and gc removes it.
                    unsafe { libc::kill(-(*pid as i32), libc::SIGKILL) };
                }
                ready.clear();
                pulls.abort_all();
                pushes.abort_all();
                tracking.abort_all();
                failed = true;
            }
        }
    }
    // What ran here goes to the shared cache before the run ends: a push that fails is said,
    // and never fails the run.
    loop {
        let pushed = tokio::select! {
            pushed = pushes.join_next() => pushed,
            signal = &mut stop, if !interrupted => {
                interrupted = true;
                reporter.line(format!("{signal}: the pushes still running are abandoned (a record goes up only after its blobs: nothing partial is visible)"));
                pushes.abort_all();
                tracking.abort_all();
                continue;
            }
        };
        let Some(pushed) = pushed else { break };
        let Ok((name, key, pushed)) = pushed else {
            continue;
        };
        use crate::cache::Pushed;
        match pushed {
            Ok(Pushed::Pushed { bytes }) => reporter.stage_line(
                &name,
                &format!(
                    "pushed {} ({} sent)",
                    short(&key),
                    nemo_dag_op::plan::bytes(bytes)
                ),
            ),
            Ok(Pushed::Conflict(why)) => {
                reporter.stage_line(&name, &format!("warning: not pushed: {why}"))
            }
            Ok(Pushed::There | Pushed::Off) => {}
            Err(e) => reporter.stage_line(&name, &format!("warning: not pushed: {e}")),
        }
    }
    // The tracker's requests are bounded by their timeouts, and stop at its first failure; a
    // slow one that still answers gets TRACKING_GRACE after the stages, then is left.
    let grace = tokio::time::sleep(TRACKING_GRACE);
    tokio::pin!(grace);
    loop {
        let tracked = tokio::select! {
            tracked = tracking.join_next() => tracked,
            signal = &mut stop, if !interrupted => {
                interrupted = true;
                reporter.line(format!("{signal}: what is still going to MLflow is abandoned"));
                tracking.abort_all();
                continue;
            }
            () = &mut grace, if !tracking.is_empty() => {
                reporter.line(format!(
                    "warning: MLflow is slow: {} stage(s) still being sent after {}s are not tracked",
                    tracking.len(),
                    TRACKING_GRACE.as_secs()
                ));
                tracking.abort_all();
                continue;
            }
        };
        if tracked.is_none() {
            break;
        }
    }
    if let Some(line) = match &opts.tracker {
        Some(t) => t.summary().await,
        None => None,
    } {
        reporter.line(line);
    }
    if let Some(t) = transfers {
        t.abort();
        let _ = t.await;
    }
    reporter.finish();
    let _ = digester.save(&store.memo_file());

    let outcomes: Vec<Outcome> = order
        .iter()
        .map(|n| {
            outcomes
                .remove(n.as_str())
                .unwrap_or_else(|| outcome(n, None, "skipped", 0.0))
        })
        .collect();
    let recorded = record_run(manifest, store, &opts.argv, &outcomes).map(|record| {
        let _ = std::fs::remove_file(store.journal_path(&run_id));
        record_history(manifest, store, &record, &outcomes);
    });
    if interrupted {
        return Err(Failure::Interrupted);
    }
    match record_error.or(recorded.err()) {
        Some(e) => Err(e),
        None => Ok(outcomes),
    }
}

/// Add the run that just ended to the store's run history: `record` is the run record it
/// wrote (not read back: another run of the manifest may write it meanwhile). What `runs`
/// lists. A history that cannot be written is a warning; the run and its record stand.
pub fn record_history(
    manifest: &Manifest,
    store: &Store,
    record: &RunRecord,
    outcomes: &[Outcome],
) {
    let reached: BTreeMap<String, String> = outcomes
        .iter()
        .filter(|o| o.published() || o.state == "failed")
        .map(|o| (o.name.clone(), o.state.to_string()))
        .collect();
    let sweep = |name: &str| {
        let point = manifest.stages.get(name)?.sweep.as_ref()?;
        Some(crate::store::history::Swept {
            stage: point.base.clone(),
            point: point.text(),
            ordinal: point.ordinal,
        })
    };
    if let Err(e) = store.append_history(record, &reached, sweep) {
        eprintln!("nemo-dag: warning: this run is not in the run history (`runs`): {e:?}");
    }
}

fn outcome(name: &str, key: Option<&str>, state: &'static str, seconds: f64) -> Outcome {
    Outcome {
        name: name.to_string(),
        key: key.map(str::to_string),
        state,
        seconds,
        error: None,
        log: None,
    }
}

fn release<'a>(
    name: &str,
    dependents: &HashMap<&'a str, Vec<&'a str>>,
    waiting: &mut HashMap<&'a str, usize>,
    ready: &mut BTreeSet<(usize, &'a str)>,
    position: &HashMap<&'a str, usize>,
) {
    for d in dependents.get(name).into_iter().flatten() {
        if let Some(count) = waiting.get_mut(d) {
            *count -= 1;
            if *count == 0 {
                ready.insert((position[d], d));
            }
        }
    }
}

/// The job spec of one stage, resolved against what is already published: every stage it
/// depends on must be in the store, or in `known` (the shared cache's records of the stages
/// further up, which a cluster job keys from without pulling them). This is how a cluster job
/// finds its key when it starts.
pub fn spec_for_stage(
    manifest: &Manifest,
    store: &Store,
    name: &str,
    known: &HashMap<String, Published>,
) -> Result<JobSpec> {
    if !manifest.stages.contains_key(name) {
        return Err(InputError::new(format!(
            "the manifest has no stage `{name}` (a job runs one stage, by its full name)"
        ))
        .into());
    }
    let wanted = select(manifest, &[name.to_string()])?;
    let mut digester = Digester::load(&store.memo_file());
    let mut published: HashMap<String, Published> = HashMap::new();
    for stage_name in manifest.order.iter().filter(|n| wanted.contains(*n)) {
        let stage = &manifest.stages[stage_name];
        let resolved = plan::resolve(manifest, stage, &published, &mut digester)?
            .ok_or_else(|| miette::miette!("internal: {stage_name} resolved before its inputs"))?;
        if stage_name == name {
            return Ok(job_spec(manifest, store, name, &resolved, false));
        }
        let artifact = store
            .lookup(&resolved.key, &mut digester)
            .map_err(Failure::Stage)?
            .or_else(|| {
                // Not a direct input (those are pulled), so only its key and outputs matter.
                known
                    .get(stage_name)
                    .filter(|k| k.key == resolved.key)
                    .filter(|_| !manifest.stages[name].deps.contains(stage_name))
                    .cloned()
            })
            .ok_or_else(|| {
                Failure::Stage(format!(
                    "stage `{name}` needs `{stage_name}`, which is not in the store (key {}); run it first",
                    short(&resolved.key)
                ))
            })?;
        published.insert(stage_name.clone(), artifact);
    }
    Err(miette::miette!("internal: stage {name} not found").into())
}

/// Everything `exec` needs to build one stage.
pub fn job_spec(
    manifest: &Manifest,
    store: &Store,
    name: &str,
    resolved: &Resolved,
    force: bool,
) -> JobSpec {
    let stage = &manifest.stages[name];
    let input_paths = stage
        .inputs
        .iter()
        .map(|(input, source)| {
            let path = match source {
                Input::File { path, .. } => path.clone(),
                Input::Stage { stage: up, output } => {
                    let key = match resolved.inputs.get(input) {
                        Some(crate::store::InputRecord::Upstream { key, .. }) => key.clone(),
                        _ => String::new(),
                    };
                    let rel = manifest.stages[up]
                        .outputs
                        .get(output)
                        .cloned()
                        .unwrap_or_default();
                    store.artifact_dir(&key).join("out").join(rel)
                }
            };
            (input.clone(), path)
        })
        .collect();
    JobSpec {
        store: std::path::absolute(&store.root).unwrap_or_else(|_| store.root.clone()),
        key: resolved.key.clone(),
        stage: name.to_string(),
        op: stage.op.name().to_string(),
        op_version: stage.op.version(),
        params: stage.params.clone(),
        cmd: stage.cmd.clone(),
        outputs: stage.outputs.clone(),
        inputs: resolved.inputs.clone(),
        input_paths,
        upstream_keys: resolved.upstream_keys.clone(),
        manifest: manifest.path.display().to_string(),
        force,
        device: stage.resources.device.clone(),
        estimate: manifest.estimate(name).cloned(),
        launch: stage.resources.launch(),
        launcher: Vec::new(),
    }
}

/// Start `nemo-dag exec` for one stage; its stderr is shown live, prefixed with the stage name.
/// With a `limit`, the stage's whole process group is killed when the time is up.
fn start_job(
    exe: &PathBuf,
    spec: &JobSpec,
    tasks: &mut JoinSet<JobOutput>,
    mut stage_echo: StageEcho,
    limit: Option<Duration>,
) -> Result<u32> {
    let mut command = tokio::process::Command::new(exe);
    command
        .arg("exec")
        .arg("--spec")
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    // SAFETY: term_with_parent only calls prctl, which is async-signal-safe.
    unsafe {
        command.pre_exec(nemo_dag_op::process::term_with_parent);
    }
    let mut child = command
        .spawn()
        .map_err(|e| miette::miette!("cannot start `{} exec`: {e}", exe.display()))?;
    let pid = child.id().unwrap_or(0);
    let spec_json = serde_json::to_vec(spec).map_err(|e| miette::miette!("{e}"))?;
    let mut stdin = child.stdin.take();
    let mut stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let name = stage_echo.name.clone();
    let clock = Instant::now();
    let oom_kills_before = crate::estimate::oom_kills();
    let estimate = spec.estimate.clone();
    tasks.spawn(async move {
        let result = async {
            if let Some(mut stdin) = stdin.take() {
                stdin.write_all(&spec_json).await?;
                stdin.shutdown().await?;
            }
            let echo = async {
                if let Some(stderr) = stderr {
                    let mut lines = BufReader::new(stderr).lines();
                    while let Ok(Some(line)) = lines.next_line().await {
                        stage_echo.line(&line);
                    }
                }
                std::mem::take(&mut stage_echo.last)
            };
            let read_result = async {
                let mut out = Vec::new();
                if let Some(stdout) = stdout.as_mut() {
                    stdout.read_to_end(&mut out).await?;
                }
                Ok::<_, std::io::Error>(out)
            };
            let io = async { tokio::join!(echo, read_result) };
            tokio::pin!(io);
            let timer = async {
                match limit {
                    Some(limit) => tokio::time::sleep(limit).await,
                    None => std::future::pending().await,
                }
            };
            let (timed_out, (last, out)) = tokio::select! {
                done = &mut io => (false, done),
                () = timer => {
                    kill_group(pid);
                    (true, io.await)
                }
            };
            let out = out?;
            let status = child.wait().await?;
            // Whatever the stage left running in its group goes with it.
            kill_group(pid);
            if let (true, Some(limit)) = (timed_out, limit) {
                return Ok(JobResult {
                    state: "failed".into(),
                    key: None,
                    error: Some(format!(
                        "the stage exceeded its time limit of {} (resources.time) and was killed",
                        crate::duration::show(limit)
                    )),
                    log: None,
                });
            }
            let text = String::from_utf8_lossy(&out);
            let report = text
                .lines()
                .rev()
                .find(|l| l.starts_with('{'))
                .unwrap_or("");
            Ok(
                serde_json::from_str::<JobResult>(report).unwrap_or_else(|_| JobResult {
                    state: "failed".into(),
                    key: None,
                    error: Some(no_report(
                        status,
                        &last,
                        oom_kills_before,
                        estimate.as_ref(),
                    )),
                    log: None,
                }),
            )
        }
        .await;
        (name, result, clock.elapsed().as_secs_f64())
    });
    Ok(pid)
}

/// SIGKILL to every process left in the group `pid` led.
fn kill_group(pid: u32) {
    if let Ok(pid) = i32::try_from(pid)
        && pid > 1
    {
        // SAFETY: signalling a process group this scheduler created.
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}

/// Why an `exec` ended without its one-line report, with the last lines it wrote.
fn no_report(
    status: std::process::ExitStatus,
    last: &VecDeque<String>,
    oom_kills_before: Option<u64>,
    estimate: Option<&nemo_dag_op::Estimate>,
) -> String {
    use std::os::unix::process::ExitStatusExt;
    let planned = match (estimate, crate::estimate::machine_memory()) {
        (Some(e), Some(ram)) => format!(
            "; its plan estimated {} and this machine has {}",
            nemo_dag_op::plan::bytes(e.peak_bytes()),
            nemo_dag_op::plan::bytes(ram)
        ),
        _ => String::new(),
    };
    let oom =
        matches!((oom_kills_before, crate::estimate::oom_kills()), (Some(a), Some(b)) if b > a);
    let how = match status.signal() {
        Some(libc::SIGKILL) if oom => format!(
            "was killed by the kernel's out-of-memory killer (the oom_kill count of this cgroup rose while it ran){planned}"
        ),
        Some(libc::SIGKILL) => format!(
            "was killed by SIGKILL (if nobody killed it, likely the kernel's out-of-memory killer: see `dmesg`){planned}"
        ),
        Some(_) => format!("was killed by {status}"),
        None => format!("ended with {status} and no report"),
    };
    if last.is_empty() {
        return format!("nemo-dag exec {how}");
    }
    let lines: Vec<&str> = last.iter().map(String::as_str).collect();
    format!(
        "nemo-dag exec {how}; its last lines:\n    {}",
        lines.join("\n    ")
    )
}

/// Remember which key each stage has now, for `status` reasons, `show` and `gc`. Several
/// processes may record into one run (the jobs of a cluster submission), so the record is
/// updated under a lock: read, merge, replace. A record that cannot be written is an error:
/// without it, `gc` would delete what the run published.
pub fn record_run(
    manifest: &Manifest,
    store: &Store,
    argv: &[String],
    outcomes: &[Outcome],
) -> Result<RunRecord> {
    let path = store.run_record_path(&plan::run_id(manifest));
    let lock = std::fs::File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path.with_extension("lock"));
    let _guard = lock.as_ref().ok().filter(|f| f.lock().is_ok());
    let mut record = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<RunRecord>(&b).ok())
        .unwrap_or_default();
    for o in outcomes {
        if let (Some(key), true) = (&o.key, o.published()) {
            let before = record.stages.insert(o.name.clone(), key.clone());
            record.outcomes.insert(o.name.clone(), o.state.to_string());
            let now = store.load(key).filter(|_| o.state == "executed");
            match (now, before) {
                // Recorded already, by the job that built it (a cluster run records its
                // stages from the nodes, then the run itself).
                (Some(_), Some(before)) if &before == key => {}
                (Some(now), Some(before)) => {
                    let why = match store.load(&before) {
                        Some(prev) => plan::why_built(Some(&prev), &now),
                        None => vec![format!(
                            "its previous artifact {} is not in this store",
                            short(&before)
                        )],
                    };
                    record.why.insert(o.name.clone(), why);
                }
                (Some(now), None) => {
                    record
                        .why
                        .insert(o.name.clone(), plan::why_built(None, &now));
                }
                // Found (here or in the shared cache) under another key: the reason the
                // record kept belongs to the key it had.
                (None, before) if before.as_ref() != Some(key) => {
                    record.why.remove(&o.name);
                }
                (None, _) => {}
            }
        }
    }
    record
        .stages
        .retain(|name, _| manifest.stages.contains_key(name));
    record
        .outcomes
        .retain(|name, _| record.stages.contains_key(name));
    record
        .why
        .retain(|name, _| record.stages.contains_key(name));
    record.manifest = manifest.path.display().to_string();
    record.variant = manifest.variant.as_ref().map(|v| v.display().to_string());
    record.overrides = manifest.overrides.clone();
    record.argv = argv.to_vec();
    record.finished_at = crate::store::timestamp();
    let bytes = serde_json::to_vec_pretty(&record).map_err(|e| miette::miette!("{e}"))?;
    crate::store::write_atomic(&path, &bytes, false).map(|()| record).map_err(|e| {
        let published = outcomes.iter().any(Outcome::published);
        let consequence = if published {
            ". Until a run record names this run's artifacts, `gc` may delete them; run again once it can be written (they will be found cached)"
        } else {
            ""
        };
        Failure::Other(miette::miette!(
            "cannot write the run record {}: {e}{consequence}",
            path.display()
        ))
    })
}
