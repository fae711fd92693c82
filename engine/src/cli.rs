//! The `nemo-dag` command line: argument parsing, and what each command prints.
//! stdout carries data (tables, JSON with `--json`); stderr carries progress and diagnostics.

use crate::diag::{Failure, InputError, Result};
use crate::digest::Digester;
use crate::exec::{self, JobSpec};
use crate::local::{self, Outcome, RunOptions, short};
use crate::manifest::{Input, LoadArgs, Manifest};
use crate::plan::{self, Freshness, StagePlan};
use crate::slurm;
use crate::store::{Artifact, Store};
use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    name = "nemo-dag",
    version,
    about = "Declarative, content-hashed DAG pipelines for LLM training recipes",
    after_help = "Examples:\n  nemo-dag run manifests/super3.yaml -c tiny\n  nemo-dag status manifests/super3.yaml\n  nemo-dag graph manifests/super3.yaml --format mermaid\n  nemo-dag lineage sft --manifest manifests/super3.yaml"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run every stale stage of a manifest (cached stages are not rerun)
    Run(RunArgs),
    /// Show which stages are up to date, stale or waiting on upstream, and why
    Status(StatusArgs),
    /// Print the stage graph with each stage's state
    Graph(GraphArgs),
    /// Show a published artifact's metadata (by stage name or key)
    Show(TargetArgs),
    /// Show every ancestor of an artifact: op, key, params and input digests
    Lineage(TargetArgs),
    /// Check a manifest without running anything
    Validate(ManifestArgs),
    /// Cancel the manifest's queued and running cluster jobs
    Cancel(ManifestArgs),
    /// Remove artifacts that no recorded run or pin references
    Gc(GcArgs),
    /// Keep an artifact through `gc` under a name (or `--remove` the name)
    Pin(PinArgs),
    /// List the built-in ops
    Ops,
    /// Build one stage from a job spec (used by executors; not for people)
    #[command(hide = true)]
    Exec(ExecArgs),
}

#[derive(Args, Debug, Clone)]
struct ManifestArgs {
    /// The manifest (.yaml, .yml or .toml)
    manifest: PathBuf,
    /// Overrides KEY.PATH=VALUE (e.g. vars.n=5 stages.train.params.lr=1e-4)
    overrides: Vec<String>,
    /// Variant: NAME for <manifest dir>/<manifest stem>/NAME.yaml, or a path
    #[arg(short = 'c', long = "config", value_name = "VARIANT")]
    variant: Option<String>,
    /// Artifact store [default: .nemo-dag beside the manifest; env NEMO_DAG_STORE]
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    m: ManifestArgs,
    /// Run only these stages and what they need (repeatable)
    #[arg(long = "target", value_name = "STAGE")]
    targets: Vec<String>,
    /// Rebuild these stages even if cached (repeatable)
    #[arg(long, value_name = "STAGE")]
    force: Vec<String>,
    /// How many CPUs' worth of stages run at once [default: all cores]
    #[arg(short = 'j', long)]
    jobs: Option<usize>,
    /// Keep running independent stages after one fails
    #[arg(long)]
    keep_going: bool,
    /// Print what would run; run and write nothing
    #[arg(long)]
    dry_run: bool,
    /// Print a JSON summary on stdout
    #[arg(long)]
    json: bool,
    /// Submit to the cluster of this env.toml profile and follow the jobs to the end
    #[arg(
        short = 'r',
        long = "run",
        value_name = "PROFILE",
        conflicts_with = "batch"
    )]
    run_profile: Option<String>,
    /// Submit to the cluster of this env.toml profile and return at once
    #[arg(short = 'b', long = "batch", value_name = "PROFILE")]
    batch: Option<String>,
}

#[derive(Args, Debug)]
struct StatusArgs {
    #[command(flatten)]
    m: ManifestArgs,
    #[arg(long)]
    json: bool,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum GraphFormat {
    Ascii,
    Dot,
    Mermaid,
    Json,
}

#[derive(Args, Debug)]
struct GraphArgs {
    #[command(flatten)]
    m: ManifestArgs,
    #[arg(long, value_enum, default_value = "ascii")]
    format: GraphFormat,
}

#[derive(Args, Debug)]
struct TargetArgs {
    /// A stage name (its artifact from the last run) or a key (a prefix of 6+ hex digits)
    target: String,
    /// The manifest the stage belongs to (needed when several manifests share a store)
    #[arg(long)]
    manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct GcArgs {
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
    /// The store beside this manifest
    #[arg(long)]
    manifest: Option<PathBuf>,
    /// List what would be removed
    #[arg(long)]
    dry_run: bool,
}

#[derive(Args, Debug)]
struct PinArgs {
    /// The pin's name
    name: String,
    /// A stage name or key to pin
    target: Option<String>,
    #[arg(long)]
    remove: bool,
    #[arg(long)]
    manifest: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ExecArgs {
    /// A job spec (JSON) written by an executor, or - for stdin
    #[arg(long, conflicts_with_all = ["stage", "manifest"])]
    spec: Option<PathBuf>,
    /// Build this stage of MANIFEST, resolving its key against the store (cluster jobs)
    #[arg(long, requires = "manifest")]
    stage: Option<String>,
    /// The manifest (with --stage)
    manifest: Option<PathBuf>,
    /// Overrides KEY.PATH=VALUE, as given to `run`
    overrides: Vec<String>,
    #[arg(short = 'c', long = "config", value_name = "VARIANT")]
    variant: Option<String>,
    #[arg(long, value_name = "DIR")]
    store: Option<PathBuf>,
}

/// Parse the command line, run the command, and return the process exit code.
pub fn main() -> i32 {
    let argv: Vec<String> = std::env::args().collect();
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Status(_)
            | Command::Graph(_)
            | Command::Show(_)
            | Command::Lineage(_)
            | Command::Validate(_)
            | Command::Ops
    ) {
        // Commands that only print end quietly when the reader goes away
        // (`nemo-dag status --json | head`), as Unix tools do. Commands that drive child
        // processes keep Rust's default (a write to a dead child is an error, not a kill).
        // SAFETY: restores the default action of one signal before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Run(a) => cmd_run(a, argv),
        Command::Status(a) => cmd_status(a),
        Command::Graph(a) => cmd_graph(a),
        Command::Show(a) => cmd_show(a),
        Command::Lineage(a) => cmd_lineage(a),
        Command::Validate(a) => cmd_validate(a),
        Command::Cancel(a) => cmd_cancel(a),
        Command::Gc(a) => cmd_gc(a),
        Command::Pin(a) => cmd_pin(a),
        Command::Ops => cmd_ops(),
        Command::Exec(a) => return cmd_exec(a),
    };
    match result {
        Ok(()) => 0,
        Err(Failure::Input(e)) => {
            eprintln!("{:?}", miette::Report::new(*e));
            2
        }
        Err(Failure::Stage(msg)) => {
            eprintln!("error: {msg}");
            1
        }
        Err(Failure::Interrupted) => 130,
        Err(Failure::Other(report)) => {
            eprintln!("{report:?}");
            1
        }
    }
}

fn load(m: &ManifestArgs) -> Result<(Manifest, Store)> {
    load_with(m, false)
}

/// Load a manifest; `remember` keeps its compiled tree in the store for the next command.
fn load_with(m: &ManifestArgs, remember: bool) -> Result<(Manifest, Store)> {
    let root = m
        .store
        .clone()
        .or_else(|| std::env::var_os("NEMO_DAG_STORE").map(PathBuf::from))
        .unwrap_or_else(|| {
            let abs = std::path::absolute(&m.manifest).unwrap_or_else(|_| m.manifest.clone());
            abs.parent()
                .map(Path::to_path_buf)
                .unwrap_or_default()
                .join(".nemo-dag")
        });
    let store = Store::new(root);
    let manifest = Manifest::load(&LoadArgs {
        path: m.manifest.clone(),
        variant: m.variant.clone(),
        overrides: m.overrides.clone(),
        cache_dir: Some(store.root.join("cache").join("manifests")),
        write_cache: remember,
    })?;
    Ok((manifest, store))
}

fn cmd_run(a: RunArgs, argv: Vec<String>) -> Result<()> {
    let (manifest, store) = load_with(&a.m, !a.dry_run)?;
    let cluster = match (&a.run_profile, &a.batch) {
        (Some(p), _) => Some((p, slurm::Mode::Run)),
        (_, Some(p)) => Some((p, slurm::Mode::Batch)),
        _ => None,
    };
    if let Some((name, mode)) = cluster {
        let profile = crate::profile::load(&manifest.dir, name)?;
        if profile.executor == crate::profile::Executor::Slurm {
            let opts = slurm::SubmitOptions {
                profile: &profile,
                mode,
                dry_run: a.dry_run,
                targets: &a.targets,
                force: &a.force,
            };
            let outcomes = slurm::submit(&manifest, &store, &opts)?;
            if a.dry_run {
                return Ok(());
            }
            if mode == slurm::Mode::Run {
                summarize(&outcomes);
            }
            if a.json {
                println!("{}", json!({ "stages": outcomes }));
            }
            return fail_if_any(&outcomes);
        }
        // A local profile runs here, with its environment.
        for (k, v) in &profile.env_vars {
            // SAFETY: single-threaded at this point; no other thread reads the environment.
            unsafe { std::env::set_var(k, v) };
        }
    }
    if a.dry_run {
        let selected = local::select(&manifest, &a.targets)?;
        local::check_names(&manifest, &a.force, "--force")?;
        let plans = plan::plan(&manifest, &store, &mut Digester::load(&store.memo_file()))?;
        let stages: Vec<Value> = plans
            .iter()
            .filter(|p| selected.contains(&p.name))
            .map(|p| {
                let forced = a.force.contains(&p.name);
                let state = match p.freshness {
                    Freshness::UpToDate if !forced => "cached",
                    _ => "would-run",
                };
                eprintln!("{:>10}  {}{}", state, p.name, reasons_suffix(p));
                json!({"name": p.name, "key": p.key, "state": state, "seconds": 0.0, "reasons": p.reasons})
            })
            .collect();
        if a.json {
            println!("{}", json!({ "stages": stages }));
        }
        return Ok(());
    }
    let jobs = a.jobs.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    let opts = RunOptions {
        jobs,
        keep_going: a.keep_going,
        targets: a.targets.clone(),
        force: a.force.clone(),
        argv,
    };
    let outcomes = local::run(&manifest, &store, &opts)?;
    summarize(&outcomes);
    if a.json {
        println!("{}", json!({ "stages": outcomes }));
    }
    fail_if_any(&outcomes)
}

fn fail_if_any(outcomes: &[Outcome]) -> Result<()> {
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.state == "failed").collect();
    if let Some(first) = failed.first() {
        let log = first
            .log
            .as_deref()
            .unwrap_or("the store's failed/ directory");
        return Err(Failure::Stage(format!(
            "{} stage(s) failed; first: `{}` — see its log: {log}",
            failed.len(),
            first.name
        )));
    }
    Ok(())
}

fn summarize(outcomes: &[Outcome]) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for o in outcomes {
        *counts.entry(o.state).or_default() += 1;
    }
    let parts: Vec<String> = [
        "executed",
        "cutoff",
        "cached",
        "submitted",
        "failed",
        "skipped",
    ]
    .iter()
    .filter_map(|s| counts.get(s).map(|n| format!("{n} {s}")))
    .collect();
    eprintln!("{} stage(s): {}", outcomes.len(), parts.join(", "));
}

fn reasons_suffix(p: &StagePlan) -> String {
    if p.reasons.is_empty() {
        String::new()
    } else {
        format!("  ({})", p.reasons.join("; "))
    }
}

fn cmd_status(a: StatusArgs) -> Result<()> {
    let (manifest, store) = load(&a.m)?;
    let plans = plan::plan(&manifest, &store, &mut Digester::load(&store.memo_file()))?;
    // Jobs of the last cluster submission, if any, reconciled with Slurm now.
    let jobs = slurm::job_report(&manifest, &store);
    if a.json {
        let stages: Vec<Value> = plans
            .iter()
            .map(|p| {
                let mut v = json!({"name": p.name, "state": p.freshness.as_str(), "key": p.key, "reasons": p.reasons});
                if let Some(job) = jobs.get(&p.name).filter(|_| p.freshness != Freshness::UpToDate) {
                    v["job"] = job.clone();
                }
                v
            })
            .collect();
        println!("{}", json!({ "stages": stages }));
        return Ok(());
    }
    let width = plans.iter().map(|p| p.name.len()).max().unwrap_or(0);
    for p in &plans {
        let key = p.key.as_deref().map(short).unwrap_or("-");
        let job = jobs
            .get(&p.name)
            .filter(|_| p.freshness != Freshness::UpToDate)
            .map(|j| {
                format!(
                    "  job {} {}",
                    j["id"].as_str().unwrap_or(""),
                    j["state"].as_str().unwrap_or("")
                )
            })
            .unwrap_or_default();
        println!(
            "{:<width$}  {:<16}  {key}{job}",
            p.name,
            p.freshness.as_str()
        );
        for r in &p.reasons {
            println!("{:<width$}    · {r}", "");
        }
        if let Some(because) = jobs
            .get(&p.name)
            .and_then(|j| j.get("because"))
            .and_then(Value::as_str)
        {
            println!("{:<width$}    · cancelled: {because}", "");
        }
    }
    Ok(())
}

fn cmd_graph(a: GraphArgs) -> Result<()> {
    let (manifest, store) = load(&a.m)?;
    let plans = plan::plan(&manifest, &store, &mut Digester::load(&store.memo_file()))?;
    let state: BTreeMap<&str, &StagePlan> = plans.iter().map(|p| (p.name.as_str(), p)).collect();
    let edges = edges(&manifest);
    let text = match a.format {
        GraphFormat::Json => {
            let nodes: Vec<Value> = manifest
                .order
                .iter()
                .map(|n| {
                    let p = state[n.as_str()];
                    json!({"name": n, "op": manifest.stages[n].op.name(), "state": p.freshness.as_str(), "key": p.key})
                })
                .collect();
            let edges: Vec<Value> = edges
                .iter()
                .map(|(from, output, to, input)| json!({"from": from, "output": output, "to": to, "input": input}))
                .collect();
            json!({"nodes": nodes, "edges": edges}).to_string()
        }
        GraphFormat::Dot => {
            let mut s = String::from(
                "digraph pipeline {\n  rankdir=LR;\n  node [shape=box, style=\"rounded,filled\"];\n",
            );
            for n in &manifest.order {
                let p = state[n.as_str()];
                s.push_str(&format!(
                    "  \"{n}\" [label=\"{n}\\n{}\\n{}\", fillcolor=\"{}\"];\n",
                    manifest.stages[n].op.name(),
                    p.freshness.as_str(),
                    color(p.freshness)
                ));
            }
            for (from, output, to, input) in &edges {
                s.push_str(&format!(
                    "  \"{from}\" -> \"{to}\" [label=\"{output} → {input}\"];\n"
                ));
            }
            s.push('}');
            s
        }
        GraphFormat::Mermaid => {
            let id: BTreeMap<&str, String> = manifest
                .order
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), format!("s{i}")))
                .collect();
            let mut s = String::from("flowchart LR\n");
            for n in &manifest.order {
                let p = state[n.as_str()];
                s.push_str(&format!(
                    "  {}[\"{n}<br/>{} · {}\"]:::{}\n",
                    id[n.as_str()],
                    manifest.stages[n].op.name(),
                    p.freshness.as_str(),
                    p.freshness.as_str().replace('-', "_")
                ));
            }
            for (from, output, to, _) in &edges {
                s.push_str(&format!(
                    "  {} -->|{output}| {}\n",
                    id[from.as_str()],
                    id[to.as_str()]
                ));
            }
            for f in [
                Freshness::UpToDate,
                Freshness::Stale,
                Freshness::PendingUpstream,
            ] {
                s.push_str(&format!(
                    "  classDef {} fill:{}\n",
                    f.as_str().replace('-', "_"),
                    color(f)
                ));
            }
            s.trim_end().to_string()
        }
        GraphFormat::Ascii => ascii_graph(&manifest, &state),
    };
    println!("{text}");
    Ok(())
}

fn color(f: Freshness) -> &'static str {
    match f {
        Freshness::UpToDate => "#c8e6c9",
        Freshness::Stale => "#ffe0b2",
        Freshness::PendingUpstream => "#e0e0e0",
    }
}

/// (from stage, output, to stage, input) for every `STAGE:OUTPUT` input.
fn edges(manifest: &Manifest) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    for name in &manifest.order {
        for (input, source) in &manifest.stages[name].inputs {
            if let Input::Stage { stage, output } = source {
                out.push((stage.clone(), output.clone(), name.clone(), input.clone()));
            }
        }
    }
    out
}

/// Stages by depth (longest path from a source), each with its state and what it consumes.
fn ascii_graph(manifest: &Manifest, state: &BTreeMap<&str, &StagePlan>) -> String {
    let mut depth: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &manifest.order {
        let d = manifest.stages[n]
            .deps
            .iter()
            .map(|d| depth[d.as_str()] + 1)
            .max()
            .unwrap_or(0);
        depth.insert(n, d);
    }
    let width = manifest.order.iter().map(|n| n.len()).max().unwrap_or(0);
    let mut s = String::new();
    let max_depth = depth.values().copied().max().unwrap_or(0);
    for level in 0..=max_depth {
        for n in manifest.order.iter().filter(|n| depth[n.as_str()] == level) {
            let p = state[n.as_str()];
            let stage = &manifest.stages[n];
            let from: Vec<String> = stage
                .inputs
                .values()
                .map(|i| match i {
                    Input::Stage { stage, output } => format!("{stage}:{output}"),
                    Input::File { written, .. } => written.clone(),
                })
                .collect();
            let arrow = if from.is_empty() {
                String::new()
            } else {
                format!("  ◀ {}", from.join(", "))
            };
            s.push_str(&format!(
                "{}{} {:<width$}  [{}] {}{}\n",
                "  ".repeat(level),
                if level == 0 { "●" } else { "└▶" },
                n,
                stage.op.name(),
                p.freshness.as_str(),
                arrow
            ));
        }
    }
    s.trim_end().to_string()
}

/// Which store a command without a manifest argument works on.
fn find_store(store: &Option<PathBuf>, manifest: &Option<PathBuf>) -> Result<Store> {
    if let Some(s) = store {
        return Ok(Store::new(s.clone()));
    }
    if let Some(s) = std::env::var_os("NEMO_DAG_STORE") {
        return Ok(Store::new(PathBuf::from(s)));
    }
    if let Some(m) = manifest {
        let abs = std::path::absolute(m).unwrap_or_else(|_| m.clone());
        let dir = abs.parent().map(Path::to_path_buf).unwrap_or_default();
        return Ok(Store::new(dir.join(".nemo-dag")));
    }
    let mut dir = std::env::current_dir().ok();
    while let Some(d) = dir {
        if d.join(".nemo-dag").is_dir() {
            return Ok(Store::new(d.join(".nemo-dag")));
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    Err(
        InputError::new("no artifact store found (no .nemo-dag here or in a parent directory)")
            .help("pass --store DIR, --manifest FILE, or set NEMO_DAG_STORE")
            .into(),
    )
}

/// A stage name (its key in the last run of the manifest) or a key prefix → a published key.
fn resolve_target(store: &Store, target: &str, manifest: &Option<PathBuf>) -> Result<String> {
    if let Some(key) = store.resolve_key(target)? {
        return Ok(key);
    }
    let wanted = manifest.as_ref().map(|m| {
        std::path::absolute(m)
            .unwrap_or_else(|_| m.clone())
            .display()
            .to_string()
    });
    let mut found: Vec<(String, String)> = store
        .run_records()
        .into_iter()
        .filter(|(_, r)| wanted.as_ref().is_none_or(|w| &r.manifest == w))
        .filter_map(|(_, r)| {
            r.stages
                .get(target)
                .map(|k| (r.manifest.clone(), k.clone()))
        })
        .collect();
    let manifests: std::collections::BTreeSet<&String> = found.iter().map(|(m, _)| m).collect();
    if manifests.len() > 1 {
        let list: Vec<&str> = manifests.iter().map(|s| s.as_str()).collect();
        return Err(InputError::new(format!(
            "stage `{target}` is in several manifests: {}",
            list.join(", ")
        ))
        .help("add --manifest FILE to say which")
        .into());
    }
    match found.pop() {
        Some((_, key)) if store.is_published(&key) => Ok(key),
        Some((_, key)) => Err(InputError::new(format!(
            "the last run's artifact for `{target}` ({}) is no longer in the store",
            short(&key)
        ))
        .help("run the manifest again to rebuild it")
        .into()),
        None => Err(InputError::new(format!(
            "no artifact for `{target}` in {}",
            store.root.display()
        ))
        .help("give a stage name from a manifest that has been run, or a key (6+ hex digits)")
        .into()),
    }
}

fn load_artifact(store: &Store, key: &str) -> Result<Artifact> {
    store.load(key).ok_or_else(|| {
        Failure::Other(miette::miette!(
            "artifact {key} is missing or unreadable in {}",
            store.root.display()
        ))
    })
}

/// The artifact as JSON, with output paths made absolute so they can be used directly.
fn artifact_json(store: &Store, artifact: &Artifact) -> Value {
    let dir = store.artifact_dir(&artifact.key);
    let mut v = serde_json::to_value(artifact).unwrap_or(Value::Null);
    if let Some(outputs) = v.get_mut("outputs").and_then(Value::as_object_mut) {
        for out in outputs.values_mut() {
            if let Some(p) = out.get("path").and_then(Value::as_str) {
                let abs = dir.join(p).display().to_string();
                out["path"] = Value::String(abs);
            }
        }
    }
    v["dir"] = Value::String(dir.display().to_string());
    v
}

fn cmd_show(a: TargetArgs) -> Result<()> {
    let store = find_store(&a.store, &a.manifest)?;
    let key = resolve_target(&store, &a.target, &a.manifest)?;
    let artifact = load_artifact(&store, &key)?;
    let v = artifact_json(&store, &artifact);
    if a.json {
        println!("{v}");
        return Ok(());
    }
    println!("stage    {}", artifact.stage);
    println!("op       {} v{}", artifact.op, artifact.op_version);
    println!("key      {}", artifact.key);
    println!(
        "built    {} on {} in {:.2}s (nemo-dag {})",
        artifact.started_at, artifact.host, artifact.seconds, artifact.engine_version
    );
    println!("params   {}", artifact.params);
    for (name, i) in &artifact.inputs {
        match i {
            crate::store::InputRecord::File { path, digest } => {
                println!("input    {name} = {path} ({})", short(digest))
            }
            crate::store::InputRecord::Upstream {
                stage,
                output,
                key,
                digest,
            } => {
                println!(
                    "input    {name} = {stage}:{output} [{}] ({})",
                    short(key),
                    short(digest)
                )
            }
        }
    }
    for (name, o) in v["outputs"].as_object().into_iter().flatten() {
        println!(
            "output   {name} = {} ({} bytes)",
            o["path"].as_str().unwrap_or(""),
            o["bytes"]
        );
    }
    Ok(())
}

fn cmd_lineage(a: TargetArgs) -> Result<()> {
    let store = find_store(&a.store, &a.manifest)?;
    let key = resolve_target(&store, &a.target, &a.manifest)?;
    let target = load_artifact(&store, &key)?;
    let mut ancestors = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    let mut todo: std::collections::VecDeque<String> =
        target.upstream_keys.iter().cloned().collect();
    while let Some(k) = todo.pop_front() {
        if !seen.insert(k.clone()) {
            continue;
        }
        let a = load_artifact(&store, &k)?;
        todo.extend(a.upstream_keys.iter().cloned());
        ancestors.push(a);
    }
    let entry = |a: &Artifact| {
        let inputs: BTreeMap<&String, Value> = a
            .inputs
            .iter()
            .map(|(n, i)| (n, serde_json::to_value(i).unwrap_or(Value::Null)))
            .collect();
        json!({"stage": a.stage, "op": a.op, "op_version": a.op_version, "key": a.key, "params": a.params, "inputs": inputs})
    };
    if a.json {
        let list: Vec<Value> = ancestors.iter().map(entry).collect();
        println!("{}", json!({"artifact": entry(&target), "ancestors": list}));
        return Ok(());
    }
    for (depth, art) in std::iter::once(&target).chain(ancestors.iter()).enumerate() {
        let marker = if depth == 0 { "●" } else { "↑" };
        println!(
            "{marker} {} [{} v{}] {}",
            art.stage, art.op, art.op_version, art.key
        );
        println!("    params {}", art.params);
        for (name, i) in &art.inputs {
            match i {
                crate::store::InputRecord::File { path, digest } => {
                    println!("    input  {name}: file {path} blake3:{}", short(digest))
                }
                crate::store::InputRecord::Upstream {
                    stage,
                    output,
                    digest,
                    ..
                } => {
                    println!(
                        "    input  {name}: {stage}:{output} blake3:{}",
                        short(digest)
                    )
                }
            }
        }
    }
    Ok(())
}

fn cmd_cancel(m: ManifestArgs) -> Result<()> {
    let (manifest, store) = load(&m)?;
    let cancelled = slurm::cancel(&manifest, &store)?;
    if cancelled.is_empty() {
        eprintln!("no queued or running jobs for {}", manifest.path.display());
    }
    for (stage, id) in &cancelled {
        println!("cancelled {stage} (job {id})");
    }
    Ok(())
}

fn cmd_validate(m: ManifestArgs) -> Result<()> {
    let (manifest, _) = load(&m)?;
    eprintln!(
        "ok: {} stage(s), in order: {}",
        manifest.order.len(),
        manifest.order.join(" → ")
    );
    Ok(())
}

fn cmd_gc(a: GcArgs) -> Result<()> {
    let store = find_store(&a.store, &a.manifest)?;
    if !store.artifacts().is_dir() {
        eprintln!("nothing to collect in {}", store.root.display());
        return Ok(());
    }
    let live = store.live_keys();
    let mut freed = 0u64;
    let mut removed = 0usize;
    for key in store.published_keys() {
        if live.contains(&key) {
            continue;
        }
        let dir = store.artifact_dir(&key);
        let bytes = dir_bytes(&dir);
        if a.dry_run {
            println!("would remove {key} ({bytes} bytes)");
        } else {
            // Hold the key's lock so a concurrent exec of this key is never half-deleted.
            let _lock = store.lock(&key)?;
            let trash = store.root.join("trash").join(&key);
            let _ = std::fs::remove_dir_all(&trash);
            if std::fs::rename(&dir, &trash).is_ok() {
                let _ = std::fs::remove_dir_all(&trash);
            }
            println!("removed {key}");
        }
        freed += bytes;
        removed += 1;
    }
    if !a.dry_run {
        // Leftovers of interrupted builds: a tmp entry whose key nobody is building.
        for entry in std::fs::read_dir(store.root.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let key = entry.file_name().to_string_lossy().to_string();
            let lock_path = store.root.join("locks").join(format!("{key}.lock"));
            let free = std::fs::File::options()
                .write(true)
                .open(&lock_path)
                .map(|f| f.try_lock().is_ok())
                .unwrap_or(true);
            if free {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    eprintln!(
        "{} {removed} artifact(s), {freed} bytes; kept {}",
        if a.dry_run { "would remove" } else { "removed" },
        live.len()
    );
    Ok(())
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            _ => e.metadata().map(|m| m.len()).unwrap_or(0),
        })
        .sum()
}

fn cmd_pin(a: PinArgs) -> Result<()> {
    let store = find_store(&a.store, &a.manifest)?;
    if a.name.is_empty() || a.name.contains(['/', '\0']) || a.name.starts_with('.') {
        return Err(InputError::new(format!("`{}` is not a valid pin name", a.name)).into());
    }
    let path = store.root.join("pins").join(&a.name);
    if a.remove {
        std::fs::remove_file(&path)
            .map_err(|e| crate::diag::io_err("cannot remove pin", &path, e))?;
        eprintln!("unpinned {}", a.name);
        return Ok(());
    }
    let Some(target) = &a.target else {
        return Err(InputError::new("pin needs a target: nemo-dag pin NAME STAGE|KEY").into());
    };
    let key = resolve_target(&store, target, &a.manifest)?;
    crate::store::write_atomic(&path, format!("{key}\n").as_bytes(), true)
        .map_err(|e| crate::diag::io_err("cannot write pin", &path, e))?;
    eprintln!("pinned {} → {}", a.name, short(&key));
    Ok(())
}

fn cmd_ops() -> Result<()> {
    let ops = nemo_dag_ops::registry();
    let width = ops.iter().map(|op| op.name().len()).max().unwrap_or(0);
    for op in ops {
        println!("{:<width$}  v{}  {}", op.name(), op.version(), op.summary());
    }
    Ok(())
}

fn cmd_exec(a: ExecArgs) -> i32 {
    // In --stage mode (a cluster job) the stage's key is resolved here, and recorded in the
    // manifest's run record once built, as a local run would.
    let mut recorded: Option<(Manifest, Store)> = None;
    let spec = match (&a.spec, &a.stage, &a.manifest) {
        (Some(path), _, _) => read_spec(path),
        (None, Some(stage), Some(manifest)) => {
            let m = ManifestArgs {
                manifest: manifest.clone(),
                overrides: a.overrides.clone(),
                variant: a.variant.clone(),
                store: a.store.clone(),
            };
            load(&m).and_then(|(manifest, store)| {
                let spec = local::spec_for_stage(&manifest, &store, stage)?;
                recorded = Some((manifest, store));
                Ok(spec)
            })
        }
        _ => Err(InputError::new("exec needs --spec FILE, or --stage STAGE MANIFEST").into()),
    };
    let result = match spec.and_then(|spec| exec::exec(&spec)) {
        Ok(r) => r,
        Err(e) => exec::JobResult {
            state: "failed".into(),
            key: None,
            error: Some(match e {
                Failure::Other(r) => format!("{r}"),
                Failure::Input(i) => format!("{:?}", miette::Report::new(*i)),
                Failure::Stage(s) => s,
                Failure::Interrupted => "interrupted".into(),
            }),
            log: None,
        },
    };
    if let (Some((manifest, store)), Some(stage)) = (&recorded, &a.stage)
        && result.state != "failed"
    {
        let outcome = Outcome {
            name: stage.clone(),
            key: result.key.clone(),
            state: if result.state == "executed" {
                "executed"
            } else {
                "cached"
            },
            seconds: 0.0,
            error: None,
            log: None,
            outputs: None,
        };
        let argv: Vec<String> = std::env::args().collect();
        local::record_run(manifest, store, &argv, &[outcome]);
    }
    if let Some(error) = &result.error
        && result.log.is_none()
    {
        eprintln!("nemo-dag exec: {error}");
    }
    println!("{}", serde_json::to_string(&result).unwrap_or_default());
    if result.state == "failed" { 1 } else { 0 }
}

fn read_spec(path: &Path) -> Result<JobSpec> {
    let text = if path == Path::new("-") {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
    } else {
        std::fs::read_to_string(path)
    };
    text.map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| {
            InputError::new(format!("cannot read the job spec {}: {e}", path.display())).into()
        })
}
