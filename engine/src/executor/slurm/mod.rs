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

use crate::cache::{Cache, Transfer};
use crate::diag::{Failure, InputError, Result, io_err};
use crate::digest::Digester;
use crate::estimate;
use crate::executor::local::{self, Outcome};
use crate::executor::profile::Profile;
use crate::manifest::Manifest;
use crate::plan::{self, Freshness};
use crate::store::Store;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

mod queue;
mod script;

use queue::follow;
pub use queue::{JobState, cancel, is_terminal, job_report, job_states};
use script::{after_placeholder, dependency_line, job_script};

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
    /// The shared cache (`[cache]` in env.toml): what it has is pulled here instead of
    /// submitted, and the jobs pull their inputs from it and push what they build.
    pub cache: Option<&'a Cache>,
    /// `run --offline`: no cache here or in the jobs.
    pub offline: bool,
    /// The MLflow tracker: with `--run`, each stage the jobs built is logged when they end.
    pub tracker: Option<&'a crate::mlflow::Tracker>,
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
    check_node_store(opts)?;
    // What the cache has is not built again: pulled here, it is up to date below.
    let pulled = match opts.cache {
        Some(cache) if !opts.dry_run => pull_here(manifest, store, cache, opts.targets),
        _ => BTreeSet::new(),
    };
    // Jobs that keep their own store cannot run without the cache.
    if let (Some(node), Some(why)) = (
        &opts.profile.node_store,
        opts.cache.and_then(Cache::down_reason),
    ) {
        return Err(InputError::new(format!(
            "profile `{}` keeps its jobs' artifacts on the node ({node}), and the shared cache cannot be used: {why}",
            opts.profile.name
        ))
        .help("nothing was submitted: every job would fail for want of its inputs; check [cache] and that the server is up")
        .into());
    }
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
    let partition = partition(opts);
    for name in manifest.order.iter().filter(|n| stale.contains(n.as_str())) {
        script::check_image_named(manifest, opts, name).map_err(|(message, help)| {
            manifest
                .error_at(&["stages", name, "params"], message)
                .help(help)
        })?;
        script::check_mounts(manifest, store, opts, name).map_err(|(message, help)| {
            manifest
                .error_at(&["stages", name, "resources", "launch"], message)
                .help(help)
        })?;
        if let (Some(capacity), Some(estimate)) = (opts.profile.gpu_memory, manifest.estimate(name))
            && let Some((message, help)) =
                estimate::does_not_fit_gpu(name, estimate, capacity, &opts.profile.name)
        {
            return Err(manifest
                .error_at(&["stages", name, "resources"], message)
                .help(help)
                .into());
        }
    }
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
            if let Some(preview) = script::preview(manifest, opts, &p.stage) {
                println!(
                    "# ---- {}: what nemo-dag exec runs in it (inputs and the attempt directory named; resolved when it runs) ----",
                    p.stage
                );
                println!("{}", preview.trim_end());
            }
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
            state: if pulled.contains(&p.name) {
                "pulled"
            } else {
                "cached"
            },
            seconds: 0.0,
            error: None,
            log: None,
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
                });
            }
            Ok(order(manifest, out))
        }
        Mode::Run => {
            let mut out = up_to_date;
            out.extend(follow(manifest, store, &record)?);
            // Built in the nodes' own stores: what they pushed comes here.
            if let (Some(cache), Some(_)) = (opts.cache, &opts.profile.node_store) {
                pull_here(manifest, store, cache, opts.targets);
            }
            // The jobs recorded their stages as they ended; this records the run itself (its
            // argv, overrides and end, and what was pulled or cached here), then its history.
            let argv: Vec<String> = std::env::args().collect();
            let record = local::record_run(manifest, store, &argv, &out)?;
            local::record_history(manifest, store, &record, &out);
            if let Some(tracker) = opts.tracker {
                let built: Vec<String> = out
                    .iter()
                    .filter(|o| o.state == "executed")
                    .filter_map(|o| o.key.clone())
                    .collect();
                let tags = crate::mlflow::RunTags::new(manifest, &argv);
                tracker.stages(store, &built, &tags, &|| interrupt::Interrupt.fired());
            }
            Ok(order(manifest, out))
        }
    }
}

/// A profile whose jobs keep their own store on the node needs a cache that carries artifacts
/// both ways: one it writes, and reads back.
fn check_node_store(opts: &SubmitOptions) -> Result<()> {
    let Some(node) = &opts.profile.node_store else {
        return Ok(());
    };
    let profile = &opts.profile.name;
    let refuse = |message: String, help: &str| Err(InputError::new(message).help(help).into());
    let Some(cache) = opts.cache.filter(|_| !opts.offline) else {
        return refuse(
            format!(
                "profile `{profile}` keeps its jobs' artifacts in a store on the node ({node}), and {}: the jobs could neither get their inputs nor give back what they build",
                if opts.offline {
                    "--offline turns the shared cache off"
                } else {
                    "no [cache] is configured in env.toml"
                }
            ),
            "give env.toml a [cache] that writes a scope it reads (docs/cache.md), or remove `node_store` where the nodes see this store",
        );
    };
    let settings = &cache.remote.settings;
    match &settings.write {
        Some(scope) if settings.read.contains(scope) => Ok(()),
        Some(scope) => refuse(
            format!(
                "profile `{profile}` keeps its jobs' artifacts on the node, and [cache] in {} writes scope `{scope}` without reading it: a job would never find what the job before it pushed",
                cache.file.display()
            ),
            "add the write scope to `read`",
        ),
        None => refuse(
            format!(
                "profile `{profile}` keeps its jobs' artifacts on the node, and [cache] in {} writes no scope: what a job builds could not leave its node",
                cache.file.display()
            ),
            "set `write = \"SCOPE\"` in [cache], a scope `read` lists too",
        ),
    }
}

/// Pull what the cache has of the selected stages into this store; the names pulled. A cache
/// that cannot be used is a warning: the jobs build what it would have given.
fn pull_here(
    manifest: &Manifest,
    store: &Store,
    cache: &Cache,
    targets: &[String],
) -> BTreeSet<String> {
    match crate::cache::transfer(manifest, store, cache, targets, Transfer::Pull) {
        Ok(rows) => rows
            .into_iter()
            .filter_map(|row| {
                if let Some(problem) = &row.problem {
                    eprintln!("{} │ not pulled: {problem}", row.name);
                }
                row.done.is_some().then(|| {
                    eprintln!("{} │ pulled from the shared cache", row.name);
                    row.name
                })
            })
            .collect(),
        Err(e) => {
            // A cache that is down was said when it went down.
            if cache.down_reason().is_none() {
                eprintln!("nemo-dag: warning: {e}");
            }
            BTreeSet::new()
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

/// The partition a job goes to: the profile's for this mode (`run_partition`,
/// `batch_partition`), else its `partition`.
fn partition<'a>(opts: &SubmitOptions<'a>) -> Option<&'a String> {
    match opts.mode {
        Mode::Run => opts.profile.run_partition.as_ref(),
        Mode::Batch => opts.profile.batch_partition.as_ref(),
    }
    .or(opts.profile.partition.as_ref())
}
