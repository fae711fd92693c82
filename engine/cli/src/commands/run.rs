//! `nemo-dag run`: build every stale stage, here or on the cluster of an `env.toml` profile.

use super::ManifestArgs;
use nemo_dag_engine::cache::Cache;
use nemo_dag_engine::diag::{Failure, Result};
use nemo_dag_engine::executor::local::{self, Outcome, RunOptions};
use nemo_dag_engine::executor::profile::{self, Executor};
use nemo_dag_engine::executor::slurm;
use nemo_dag_engine::mlflow::Tracker;
use nemo_dag_engine::plan;
use nemo_dag_op::Registry;
use serde_json::json;
use std::collections::BTreeMap;

#[derive(clap::Args, Debug)]
pub struct Args {
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
    /// Run stages whose estimated memory exceeds this machine's (the plan may overestimate)
    #[arg(long)]
    no_memory_check: bool,
    /// Use no shared cache: pull nothing and push nothing, even with [cache] in env.toml
    #[arg(long)]
    offline: bool,
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

pub fn exec(mut a: Args, argv: Vec<String>, ops: Registry) -> Result<()> {
    let (manifest, store) = a.m.load_remembering(ops, !a.dry_run)?;
    // A swept stage's declared name means all its copies.
    a.targets = manifest.expand_names(&a.targets, "--target")?;
    a.force = manifest.expand_names(&a.force, "--force")?;
    let cluster = match (&a.run_profile, &a.batch) {
        (Some(p), _) => Some((p, slurm::Mode::Run)),
        (_, Some(p)) => Some((p, slurm::Mode::Batch)),
        _ => None,
    };
    let cache = if a.offline {
        None
    } else {
        Cache::load(&manifest.dir)?.map(std::sync::Arc::new)
    };
    // Not for a dry run, which builds nothing; checked before anything runs all the same.
    let tracker = Tracker::load(&manifest.dir, manifest.name())?
        .filter(|_| !a.dry_run)
        .map(std::sync::Arc::new);
    if let Some((name, mode)) = cluster {
        let profile = profile::load(&manifest.dir, name)?;
        if profile.executor == Executor::Slurm {
            let opts = slurm::SubmitOptions {
                profile: &profile,
                mode,
                dry_run: a.dry_run,
                targets: &a.targets,
                force: &a.force,
                cache: cache.as_deref(),
                offline: a.offline,
                tracker: tracker.as_deref(),
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
        let stages = local::dry_run(&manifest, &store, &a.targets, &a.force)?;
        for s in &stages {
            let reasons = if s.reasons.is_empty() {
                String::new()
            } else {
                format!("  ({})", s.reasons.join("; "))
            };
            eprintln!("{:>10}  {}{reasons}", s.state, s.name);
            if s.state == "would-run"
                && let Some(e) = manifest.estimate(&s.name)
            {
                eprintln!("{:>10}  · plan: {e}", "");
            }
            if let Some(last) = &s.last_run {
                eprintln!("{:>10}  · last run: {last}", "");
            }
        }
        let would_run = stages.iter().filter(|s| s.state == "would-run");
        if let Some(total) = plan::rerun_cost(would_run.map(|s| s.last_run.as_ref())) {
            eprintln!("{total}");
        }
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
        check_memory: !a.no_memory_check,
        cache,
        tracker,
    };
    let outcomes = local::run(&manifest, &store, &opts)?;
    summarize(&outcomes);
    if a.json {
        println!("{}", json!({ "stages": outcomes }));
    }
    fail_if_any(&outcomes)
}

/// `N stage(s): 3 executed, 1 cached` on stderr.
fn summarize(outcomes: &[Outcome]) {
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for o in outcomes {
        *counts.entry(o.state).or_default() += 1;
    }
    let parts: Vec<String> = [
        "executed",
        "pulled",
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

fn fail_if_any(outcomes: &[Outcome]) -> Result<()> {
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.state == "failed").collect();
    if let Some(first) = failed.first() {
        // A stage refused before its attempt started (a missing device, say) has no log: its
        // reason is the line printed above.
        let see = match first.log.as_deref() {
            Some(log) => format!("see its log: {log}"),
            None => "its error is above".to_string(),
        };
        return Err(Failure::Stage(format!(
            "{} stage(s) failed; first: `{}` — {see}",
            failed.len(),
            first.name
        )));
    }
    Ok(())
}
