//! What Slurm says about submitted jobs: their states (`squeue`, then `sacct`), following them
//! to the end with their logs, cancelling them, and the report `status` shows.

use super::{JobRecord, SlurmRecord, interrupt, load_record, upstream_of};
use crate::diag::{Failure, InputError, Result};
use crate::executor::local::Outcome;
use crate::manifest::Manifest;
use crate::store::Store;
use nemo_dag_op::Progress;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::process::Command;
use std::time::{Duration, Instant};

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
pub(super) fn follow(
    manifest: &Manifest,
    store: &Store,
    record: &SlurmRecord,
) -> Result<Vec<Outcome>> {
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
        // Not the exec's result line, nor its progress lines (the log has the same figures).
        if !line.starts_with("{\"state\"") && Progress::from_line(line).is_none() {
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
