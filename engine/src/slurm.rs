//! The Slurm executor: one `sbatch` job per stale stage, chained with `afterok`.
//!
//! What is submitted is the stale frontier and everything downstream of it; up-to-date stages
//! are never resubmitted, and a stage that already has a pending or running job from an earlier
//! `--batch` is reused as a dependency instead of being submitted twice. Each job runs
//!
//! ```text
//! nemo-dag exec --stage NAME MANIFEST [overrides] --store STORE
//! ```
//!
//! which resolves the stage's key when the job *starts* (its upstream outputs exist by then),
//! exits at once if that key is already published (early cutoff on the cluster), and otherwise
//! builds and publishes it atomically, exactly as a local run does. The store, the manifest and
//! the `nemo-dag` binary must therefore be on a filesystem every node sees, at the same path.
//!
//! `--kill-on-invalid-dep=yes` makes Slurm cancel the dependents of a failed job at once
//! (without it they pend forever). Job ids are recorded in `<store>/slurm/<run-id>.json`, which
//! `status` reconciles with `squeue` (and `sacct` where accounting exists) and `cancel` reads.

use crate::diag::{Failure, InputError, Result, io_err};
use crate::digest::Digester;
use crate::local::{self, Outcome};
use crate::manifest::Manifest;
use crate::plan::{self, Freshness};
use crate::profile::Profile;
use crate::store::Store;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Submit, follow the logs, exit with the pipeline's status.
    Run,
    /// Submit and return.
    Batch,
}

/// What was submitted for one manifest (+ variant), kept in `<store>/slurm/<run-id>.json`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SlurmRecord {
    pub manifest: String,
    pub profile: String,
    pub submitted_at: String,
    pub jobs: BTreeMap<String, JobRecord>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct JobRecord {
    pub job_id: String,
    pub log: String,
    /// Job ids this job waits for.
    pub after: Vec<String>,
}

pub struct SubmitOptions<'a> {
    pub profile: &'a Profile,
    pub mode: Mode,
    pub dry_run: bool,
    pub targets: &'a [String],
    pub force: &'a [String],
}

/// One job to submit: its script and the stages it waits for.
#[derive(Debug)]
struct Planned {
    stage: String,
    script: String,
    after_stages: Vec<String>,
    log: PathBuf,
}

pub fn record_path(store: &Store, manifest: &Manifest) -> PathBuf {
    store
        .root
        .join("slurm")
        .join(format!("{}.json", plan::run_id(manifest)))
}

pub fn load_record(store: &Store, manifest: &Manifest) -> Option<SlurmRecord> {
    let bytes = std::fs::read(record_path(store, manifest)).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Submit the stale part of the graph. Returns the stage → job id map of this submission.
pub fn submit(manifest: &Manifest, store: &Store, opts: &SubmitOptions) -> Result<Vec<Outcome>> {
    let selected = local::select(manifest, opts.targets)?;
    local::check_names(manifest, opts.force, "--force")?;
    let plans = plan::plan(manifest, store, &mut Digester::load(&store.memo_file()))?;
    let previous = load_record(store, manifest).unwrap_or_default();
    let previous_states = if opts.dry_run {
        HashMap::new()
    } else {
        job_states(previous.jobs.values().map(|j| j.job_id.as_str()))
    };

    let stale: BTreeSet<&str> = plans
        .iter()
        .filter(|p| selected.contains(&p.name))
        .filter(|p| p.freshness != Freshness::UpToDate || opts.force.contains(&p.name))
        .map(|p| p.name.as_str())
        .collect();
    let partition = match opts.mode {
        Mode::Run => opts.profile.run_partition.as_ref(),
        Mode::Batch => opts.profile.batch_partition.as_ref(),
    }
    .or(opts.profile.partition.as_ref());
    let run_dir = store.root.join("slurm").join(plan::run_id(manifest));
    let exe =
        std::env::current_exe().map_err(|e| miette::miette!("cannot find nemo-dag itself: {e}"))?;

    // Reuse jobs of an earlier submission that are still pending or running.
    let mut reused: BTreeMap<String, String> = BTreeMap::new();
    let mut planned = Vec::new();
    for name in manifest.order.iter().filter(|n| stale.contains(n.as_str())) {
        if let Some(job) = previous.jobs.get(name)
            && matches!(
                previous_states.get(&job.job_id).map(|s| s.state.as_str()),
                Some("PENDING" | "RUNNING" | "CONFIGURING" | "REQUEUED")
            )
            && !opts.force.contains(name)
        {
            reused.insert(name.clone(), job.job_id.clone());
            continue;
        }
        let stage = &manifest.stages[name];
        let after_stages: Vec<String> = stage
            .deps
            .iter()
            .filter(|d| stale.contains(d.as_str()))
            .cloned()
            .collect();
        let log = run_dir.join(format!("{name}.log"));
        let script = job_script(manifest, store, opts, partition, &exe, name, &log);
        planned.push(Planned {
            stage: name.clone(),
            script,
            after_stages,
            log,
        });
    }

    if opts.dry_run {
        for p in &planned {
            let after: Vec<String> = p
                .after_stages
                .iter()
                .map(|s| {
                    reused
                        .get(s)
                        .map(|id| format!("{s} (job {id})"))
                        .unwrap_or_else(|| s.clone())
                })
                .collect();
            println!("# ---- {} ----", p.stage);
            if !after.is_empty() {
                println!("# waits for: {} (afterok)", after.join(", "));
            }
            println!(
                "{}",
                p.script.replace(
                    "@AFTER@",
                    &dependency_line(&after_placeholder(&p.after_stages))
                )
            );
        }
        for (stage, id) in &reused {
            println!("# ---- {stage}: already queued as job {id}; not resubmitted ----");
        }
        eprintln!(
            "dry run: {} job(s) would be submitted{}; nothing was submitted or written",
            planned.len(),
            if reused.is_empty() {
                String::new()
            } else {
                format!(", {} reused", reused.len())
            }
        );
        return Ok(Vec::new());
    }

    store.ensure()?;
    std::fs::create_dir_all(&run_dir).map_err(|e| io_err("cannot create", &run_dir, e))?;
    let mut record = SlurmRecord {
        manifest: manifest.path.display().to_string(),
        profile: opts.profile.name.clone(),
        submitted_at: crate::store::timestamp(),
        jobs: previous
            .jobs
            .iter()
            .filter(|(name, _)| reused.contains_key(*name))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    };
    let mut ids: BTreeMap<String, String> = reused.clone();
    let clock = Instant::now();
    for p in &planned {
        let after: Vec<String> = p
            .after_stages
            .iter()
            .filter_map(|s| ids.get(s).cloned())
            .collect();
        let script = p.script.replace("@AFTER@", &dependency_line(&after));
        let path = run_dir.join(format!("{}.sbatch", p.stage));
        std::fs::write(&path, &script).map_err(|e| io_err("cannot write", &path, e))?;
        let _ = std::fs::remove_file(&p.log);
        let out = Command::new("sbatch")
            .arg("--parsable")
            .arg(&path)
            .output()
            .map_err(|e| {
                Failure::Other(miette::miette!(
                    help =
                        "is Slurm installed and configured here? (`sinfo` should list a partition)",
                    "cannot run sbatch: {e}"
                ))
            })?;
        if !out.status.success() {
            // Do not leave the jobs submitted so far waiting on a job that will never exist.
            let submitted: Vec<&String> = ids
                .iter()
                .filter(|(s, _)| !reused.contains_key(*s))
                .map(|(_, id)| id)
                .collect();
            if !submitted.is_empty() {
                let _ = Command::new("scancel").args(submitted).status();
            }
            return Err(Failure::Stage(format!(
                "sbatch refused the job for stage `{}`: {}",
                p.stage,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let id = String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap_or("")
            .to_string();
        eprintln!(
            "{} │ submitted as job {id}{}",
            p.stage,
            if after.is_empty() {
                String::new()
            } else {
                format!(" (after {})", after.join(", "))
            }
        );
        ids.insert(p.stage.clone(), id.clone());
        record.jobs.insert(
            p.stage.clone(),
            JobRecord {
                job_id: id,
                log: p.log.display().to_string(),
                after,
            },
        );
    }
    let bytes = serde_json::to_vec_pretty(&record).map_err(|e| miette::miette!("{e}"))?;
    crate::store::write_atomic(&record_path(store, manifest), &bytes, true)
        .map_err(|e| io_err("cannot record jobs in", &store.root, e))?;
    eprintln!(
        "submitted {} job(s) in {:.2}s{}",
        planned.len(),
        clock.elapsed().as_secs_f64(),
        if reused.is_empty() {
            String::new()
        } else {
            format!("; {} already queued", reused.len())
        }
    );

    let up_to_date: Vec<Outcome> = plans
        .iter()
        .filter(|p| selected.contains(&p.name) && !stale.contains(p.name.as_str()))
        .map(|p| Outcome {
            name: p.name.clone(),
            key: p.key.clone(),
            state: "cached",
            seconds: 0.0,
            error: None,
            log: None,
            outputs: None,
        })
        .collect();
    match opts.mode {
        Mode::Batch => {
            let mut out = up_to_date;
            for (stage, job) in &record.jobs {
                out.push(Outcome {
                    name: stage.clone(),
                    key: None,
                    state: "submitted",
                    seconds: 0.0,
                    error: None,
                    log: Some(job.log.clone()),
                    outputs: None,
                });
            }
            Ok(order(manifest, out))
        }
        Mode::Run => {
            let mut out = up_to_date;
            out.extend(follow(manifest, store, &record)?);
            Ok(order(manifest, out))
        }
    }
}

fn order(manifest: &Manifest, mut outcomes: Vec<Outcome>) -> Vec<Outcome> {
    let pos: HashMap<&str, usize> = manifest
        .order
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    outcomes.sort_by_key(|o| pos.get(o.name.as_str()).copied().unwrap_or(usize::MAX));
    outcomes
}

fn after_placeholder(stages: &[String]) -> Vec<String> {
    stages.iter().map(|s| format!("<job of {s}>")).collect()
}

fn dependency_line(after: &[String]) -> String {
    if after.is_empty() {
        String::new()
    } else {
        format!(
            "#SBATCH --dependency=afterok:{}\n#SBATCH --kill-on-invalid-dep=yes\n",
            after.join(":")
        )
    }
}

/// The batch script of one stage. `@AFTER@` is replaced by the dependency lines at submit time.
fn job_script(
    manifest: &Manifest,
    store: &Store,
    opts: &SubmitOptions,
    partition: Option<&String>,
    exe: &Path,
    name: &str,
    log: &Path,
) -> String {
    let profile = opts.profile;
    let stage = &manifest.stages[name];
    let r = &stage.resources;
    let stem = manifest
        .path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("nemo-dag");
    let mut s = String::from("#!/bin/bash\n");
    let mut sb = |flag: &str, value: Option<String>| {
        if let Some(v) = value {
            s.push_str(&format!("#SBATCH --{flag}={v}\n"));
        }
    };
    sb("job-name", Some(format!("{stem}.{name}")));
    sb("output", Some(log.display().to_string()));
    sb("chdir", Some(manifest.dir.display().to_string()));
    sb("partition", partition.cloned());
    sb("account", profile.account.clone());
    // The manifest owns the shape of a stage; the profile fills in what the stage leaves open.
    sb("nodes", r.nodes.or(profile.nodes).map(|n| n.to_string()));
    sb(
        "ntasks-per-node",
        profile.ntasks_per_node.map(|n| n.to_string()),
    );
    sb(
        "gpus-per-node",
        r.gpus
            .or(profile.gpus_per_node)
            .filter(|g| *g > 0)
            .map(|n| n.to_string()),
    );
    sb(
        "cpus-per-task",
        r.cpus.or(profile.cpus_per_task).map(|n| n.to_string()),
    );
    sb("time", r.time.as_ref().map(scalar).or(profile.time.clone()));
    sb("mem", r.mem.as_ref().map(scalar).or(profile.mem.clone()));
    if profile.exclusive == Some(true) {
        s.push_str("#SBATCH --exclusive\n");
    }
    if r.requeue == Some(true) {
        s.push_str("#SBATCH --requeue\n");
    }
    s.push_str("@AFTER@");
    s.push_str("set -eo pipefail\n");
    for (k, v) in &profile.env_vars {
        s.push_str(&format!("export {k}={}\n", quote(v)));
    }
    for c in &profile.startup_commands {
        s.push_str(c);
        s.push('\n');
    }
    let mut argv: Vec<String> = vec![
        exe.display().to_string(),
        "exec".into(),
        "--stage".into(),
        name.into(),
        "--store".into(),
        std::path::absolute(&store.root)
            .unwrap_or_else(|_| store.root.clone())
            .display()
            .to_string(),
    ];
    if let Some(v) = &manifest.variant {
        argv.push("-c".into());
        argv.push(v.display().to_string());
    }
    argv.push(manifest.path.display().to_string());
    argv.extend(manifest.overrides.iter().cloned());
    let command: Vec<String> = argv.iter().map(|a| quote(a)).collect();
    match &profile.container_image {
        Some(image) => {
            let mut srun = format!("srun --container-image={}", quote(image));
            if !profile.mounts.is_empty() {
                srun.push_str(&format!(
                    " --container-mounts={}",
                    quote(&profile.mounts.join(","))
                ));
            }
            s.push_str(&format!("{srun} {}\n", command.join(" ")));
        }
        None => s.push_str(&format!("exec {}\n", command.join(" "))),
    }
    s
}

fn scalar(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:,@+".contains(c))
    {
        s.to_string()
    } else {
        nemo_dag_op::process::shell_quote(s)
    }
}

/// A job as Slurm reports it now.
#[derive(Debug, Clone, PartialEq)]
pub struct JobState {
    pub state: String,
    pub reason: String,
    pub exit_code: Option<String>,
}

const TERMINAL: [&str; 9] = [
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
];

pub fn is_terminal(state: &str) -> bool {
    TERMINAL.contains(&state)
}

/// Ask Slurm about jobs: `squeue` for those it still holds, then `sacct` (when accounting
/// exists) for the rest. Jobs neither knows are absent from the map.
pub fn job_states<'a>(ids: impl Iterator<Item = &'a str>) -> HashMap<String, JobState> {
    let ids: Vec<&str> = ids.collect();
    let mut states = HashMap::new();
    if ids.is_empty() {
        return states;
    }
    if let Ok(out) = Command::new("squeue")
        .args(["-h", "-t", "all", "-o", "%i|%T|%r", "-j"])
        .arg(ids.join(","))
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut f = line.split('|');
            if let (Some(id), Some(state), Some(reason)) = (f.next(), f.next(), f.next()) {
                states.insert(
                    id.trim().to_string(),
                    JobState {
                        state: state.trim().to_string(),
                        reason: reason.trim().to_string(),
                        exit_code: None,
                    },
                );
            }
        }
    }
    let missing: Vec<&str> = ids
        .iter()
        .copied()
        .filter(|id| !states.contains_key(*id))
        .collect();
    // sacct reads the accounting database, or (`-c`) the job-completion log when a cluster has
    // no database; either may be absent.
    let sacct = |extra: &[&str]| {
        Command::new("sacct")
            .args(extra)
            .args(["-n", "-P", "-X", "-o", "JobID,State,ExitCode", "-j"])
            .arg(missing.join(","))
            .output()
            .ok()
            .filter(|o| o.status.success())
    };
    if !missing.is_empty()
        && let Some(out) = sacct(&[]).or_else(|| sacct(&["-c"]))
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let f: Vec<&str> = line.split('|').collect();
            if f.len() >= 3 {
                let state = f[1].split_whitespace().next().unwrap_or("").to_string();
                states.insert(
                    f[0].to_string(),
                    JobState {
                        state,
                        reason: String::new(),
                        exit_code: Some(f[2].to_string()),
                    },
                );
            }
        }
    }
    states
}

/// Follow submitted jobs to the end: stream their logs, then report each stage's outcome.
fn follow(manifest: &Manifest, store: &Store, record: &SlurmRecord) -> Result<Vec<Outcome>> {
    let width = record.jobs.keys().map(|n| n.len()).max().unwrap_or(4);
    let mut offsets: HashMap<String, u64> = HashMap::new();
    let clock = Instant::now();
    let mut last: HashMap<String, JobState> = HashMap::new();
    let ctrl_c = interrupt::Interrupt::install();
    loop {
        let states = job_states(record.jobs.values().map(|j| j.job_id.as_str()));
        for (stage, job) in &record.jobs {
            stream_log(stage, &job.log, width, &mut offsets);
            if let Some(s) = states.get(&job.job_id)
                && last.get(stage) != Some(s)
            {
                eprintln!(
                    "{stage:>width$} │ job {} {}{}",
                    job.job_id,
                    s.state,
                    if s.reason.is_empty() || s.reason == "None" {
                        String::new()
                    } else {
                        format!(" ({})", s.reason)
                    }
                );
                last.insert(stage.clone(), s.clone());
            }
        }
        let done = record
            .jobs
            .values()
            .all(|j| states.get(&j.job_id).is_none_or(|s| is_terminal(&s.state)));
        if done {
            break;
        }
        if ctrl_c.fired() {
            let ids: Vec<&str> = record.jobs.values().map(|j| j.job_id.as_str()).collect();
            let _ = Command::new("scancel").args(&ids).status();
            eprintln!("interrupted: cancelled jobs {}", ids.join(", "));
            return Err(Failure::Interrupted);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    for (stage, job) in &record.jobs {
        stream_log(stage, &job.log, width, &mut offsets);
    }
    let seconds = clock.elapsed().as_secs_f64();
    let _ = store;
    Ok(record
        .jobs
        .iter()
        .map(|(stage, job)| outcome_of(manifest, stage, job, last.get(stage), seconds))
        .collect())
}

/// What a finished job did: the result line `nemo-dag exec` printed last in its log.
fn outcome_of(
    _manifest: &Manifest,
    stage: &str,
    job: &JobRecord,
    state: Option<&JobState>,
    seconds: f64,
) -> Outcome {
    let text = std::fs::read_to_string(&job.log).unwrap_or_default();
    let result: Option<crate::exec::JobResult> = text
        .lines()
        .rev()
        .find(|l| l.starts_with("{\"state\""))
        .and_then(|l| serde_json::from_str(l).ok());
    let slurm_state = state.map(|s| s.state.as_str()).unwrap_or("UNKNOWN");
    let (state, error): (&'static str, Option<String>) =
        match (result.as_ref().map(|r| r.state.as_str()), slurm_state) {
            (Some("executed"), _) => ("executed", None),
            (Some("cached"), _) => ("cached", None),
            (_, "CANCELLED") if text.is_empty() => (
                "skipped",
                Some(format!(
                    "job {} was cancelled before it ran ({})",
                    job.job_id,
                    state.map(|s| s.reason.as_str()).unwrap_or("")
                )),
            ),
            (Some(_), s) => (
                "failed",
                result
                    .as_ref()
                    .and_then(|r| r.error.clone())
                    .or(Some(format!("job ended {s}"))),
            ),
            (None, s) => (
                "failed",
                Some(format!(
                    "job {} ended {s} without a result; see {}",
                    job.job_id, job.log
                )),
            ),
        };
    let key = result.as_ref().and_then(|r| r.key.clone());
    Outcome {
        name: stage.to_string(),
        key,
        state,
        seconds,
        error,
        log: Some(job.log.clone()),
        outputs: None,
    }
}

fn stream_log(stage: &str, log: &str, width: usize, offsets: &mut HashMap<String, u64>) {
    let Ok(mut f) = std::fs::File::open(log) else {
        return;
    };
    let at = offsets.entry(stage.to_string()).or_insert(0);
    if f.seek(SeekFrom::Start(*at)).is_err() {
        return;
    }
    let mut buf = String::new();
    if f.read_to_string(&mut buf).is_err() {
        return;
    }
    // Only whole lines; the rest is read next time.
    let complete = buf.rfind('\n').map(|i| i + 1).unwrap_or(0);
    for line in buf[..complete].lines() {
        if !line.starts_with("{\"state\"") {
            eprintln!("{stage:>width$} │ {line}");
        }
    }
    *at += complete as u64;
}

/// `nemo-dag cancel`: cancel this manifest's queued and running jobs.
pub fn cancel(manifest: &Manifest, store: &Store) -> Result<Vec<(String, String)>> {
    let record = load_record(store, manifest).ok_or_else(|| {
        InputError::new(format!(
            "no Slurm jobs recorded for {}",
            manifest.path.display()
        ))
        .help("jobs are recorded by `nemo-dag run --batch PROFILE` or `--run PROFILE`")
    })?;
    let states = job_states(record.jobs.values().map(|j| j.job_id.as_str()));
    let active: Vec<(String, String)> = record
        .jobs
        .iter()
        .filter(|(_, j)| {
            states
                .get(&j.job_id)
                .is_some_and(|s| !is_terminal(&s.state))
        })
        .map(|(s, j)| (s.clone(), j.job_id.clone()))
        .collect();
    if !active.is_empty() {
        let status = Command::new("scancel")
            .args(active.iter().map(|(_, id)| id))
            .status()
            .map_err(|e| miette::miette!("cannot run scancel: {e}"))?;
        if !status.success() {
            return Err(Failure::Stage(format!("scancel failed ({status})")));
        }
    }
    Ok(active)
}

/// For `status`: each recorded stage's job and its state now, with the failing stage's log for
/// jobs Slurm cancelled because an upstream job failed.
pub fn job_report(manifest: &Manifest, store: &Store) -> BTreeMap<String, serde_json::Value> {
    let Some(record) = load_record(store, manifest) else {
        return BTreeMap::new();
    };
    let states = job_states(record.jobs.values().map(|j| j.job_id.as_str()));
    let failed: Vec<(&String, &JobRecord)> = record
        .jobs
        .iter()
        .filter(|(_, j)| {
            states.get(&j.job_id).is_some_and(|s| {
                matches!(
                    s.state.as_str(),
                    "FAILED" | "TIMEOUT" | "OUT_OF_MEMORY" | "NODE_FAIL"
                )
            })
        })
        .collect();
    record
        .jobs
        .iter()
        .map(|(stage, job)| {
            let s = states.get(&job.job_id);
            let mut v = serde_json::json!({
                "id": job.job_id,
                "state": s.map(|s| s.state.clone()).unwrap_or_else(|| "UNKNOWN".into()),
                "reason": s.map(|s| s.reason.clone()).unwrap_or_default(),
                "log": job.log,
            });
            if s.is_some_and(|s| s.state == "CANCELLED")
                && let Some((up, upjob)) = failed
                    .iter()
                    .find(|(up, _)| upstream_of(manifest, stage, up))
            {
                v["because"] =
                    serde_json::json!(format!("upstream `{up}` failed; see {}", upjob.log));
            }
            (stage.clone(), v)
        })
        .collect()
}

fn upstream_of(manifest: &Manifest, stage: &str, candidate: &str) -> bool {
    local::select(manifest, &[stage.to_string()])
        .map(|s| s.contains(candidate) && candidate != stage)
        .unwrap_or(false)
}

/// Ctrl-C while following jobs: a flag set by a SIGINT handler, polled by the follow loop.
mod interrupt {
    use std::sync::atomic::{AtomicBool, Ordering};

    static FIRED: AtomicBool = AtomicBool::new(false);

    extern "C" fn on_sigint(_: libc::c_int) {
        FIRED.store(true, Ordering::SeqCst);
    }

    pub struct Interrupt;

    impl Interrupt {
        pub fn install() -> Interrupt {
            // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
            unsafe {
                libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
            }
            Interrupt
        }

        pub fn fired(&self) -> bool {
            FIRED.load(Ordering::SeqCst)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::LoadArgs;

    fn manifest(text: &str) -> (Manifest, PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "nemo-dag-slurm-unit-{}-{}",
            std::process::id(),
            &blake3::hash(text.as_bytes()).to_hex()[..8]
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("r.yaml");
        std::fs::write(&path, text).unwrap();
        let m = Manifest::load(&LoadArgs {
            overrides: vec!["stages.train.params.lr=0.5".into()],
            ..LoadArgs::new(path.clone(), crate::testing::ops())
        })
        .unwrap();
        (m, dir)
    }

    #[test]
    fn the_stage_owns_its_shape_and_the_profile_fills_the_rest() {
        let (m, dir) = manifest(
            "stages:\n  train:\n    op: cmd\n    params: {lr: 0.1}\n    outputs: {o: o}\n    cmd: \"echo {params.lr} > {outputs.o}\"\n    resources: {gpus: 2, time: '01:00:00', requeue: true}\n",
        );
        let profile = Profile {
            name: "c".into(),
            executor: crate::profile::Executor::Slurm,
            partition: Some("batch".into()),
            run_partition: Some("interactive".into()),
            gpus_per_node: Some(8),
            cpus_per_task: Some(4),
            time: Some("04:00:00".into()),
            exclusive: Some(true),
            env_vars: [("HF_HOME".to_string(), "/data/hf home".to_string())].into(),
            container_image: Some("img.sqsh".into()),
            mounts: vec!["/a:/a".into(), "/b:/b".into()],
            ..Default::default()
        };
        let opts = SubmitOptions {
            profile: &profile,
            mode: Mode::Run,
            dry_run: true,
            targets: &[],
            force: &[],
        };
        let store = Store::new(dir.join(".nemo-dag"));
        let partition = profile.run_partition.as_ref();
        let s = job_script(
            &m,
            &store,
            &opts,
            partition,
            Path::new("/opt/nemo-dag"),
            "train",
            Path::new("/logs/train.log"),
        );
        assert!(s.contains("#SBATCH --partition=interactive\n"), "{s}");
        assert!(
            s.contains("#SBATCH --gpus-per-node=2\n"),
            "the stage's gpus win: {s}"
        );
        assert!(
            s.contains("#SBATCH --cpus-per-task=4\n"),
            "the profile fills cpus: {s}"
        );
        assert!(s.contains("#SBATCH --time=01:00:00\n"), "{s}");
        assert!(
            s.contains("#SBATCH --exclusive\n#SBATCH --requeue\n"),
            "{s}"
        );
        assert!(s.contains("export HF_HOME='/data/hf home'\n"), "{s}");
        assert!(
            s.contains("srun --container-image=img.sqsh --container-mounts=/a:/a,/b:/b /opt/nemo-dag exec --stage train --store "),
            "{s}"
        );
        assert!(
            s.trim_end().ends_with("r.yaml stages.train.params.lr=0.5"),
            "overrides travel to the job: {s}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
