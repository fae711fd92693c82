//! `nemo-dag exec`: build one stage and publish it. Every executor runs stages through this
//! one code path (the local executor as a child process; Slurm as the job's command).
//!
//! 1. Take the key's lock (a concurrent run of the same stage waits here).
//! 2. If the key is already published, stop: someone else built it (`cached`).
//! 3. Run the op in a fresh attempt directory, `tmp/<key>.<attempt>/out`, its log in
//!    `…/log.txt` (and on stderr). A resumable op (checkpoints) continues its last attempt's
//!    directory once that attempt's processes are gone ([`crate::store::attempt`]).
//! 4. Check that no output links out of the stage, make the files read-only, digest them,
//!    write `artifact.json`, fsync everything, rename into `artifacts/<key>`.
//!
//! A failure moves the attempt to `failed/<key>/` (for its log, until `gc`) and publishes
//! nothing; a resumable op's attempt stays in `tmp/` (its checkpoints) with a copy of the log in
//! `failed/<key>/`.

use crate::cache::{Cache, Pushed};
use crate::diag::InputError;
use crate::diag::{Failure, Result, io_err};
use crate::digest::Digester;
use crate::executor::local::{self, Outcome};
use crate::launch::Launch;
use crate::manifest::{LoadArgs, Manifest};
use crate::stage_log::StageLog;
use crate::store::{ARTIFACT_SCHEMA, Artifact, InputRecord, OutputRecord, ResourceRecord, Store};
use crate::usage::Counters;
use nemo_dag_op::{AnyOp, Device, Estimate, Progress, Registry, RunContext, StageDecl};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything `exec` needs, resolved by the caller: no manifest is read here.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobSpec {
    pub store: PathBuf,
    pub key: String,
    pub stage: String,
    pub op: String,
    pub op_version: u32,
    pub params: Value,
    pub cmd: Option<String>,
    pub outputs: BTreeMap<String, String>,
    pub inputs: BTreeMap<String, InputRecord>,
    /// Input name → the file or directory the op reads.
    pub input_paths: BTreeMap<String, PathBuf>,
    pub upstream_keys: Vec<String>,
    pub manifest: String,
    /// Build even if the key is already published (`run --force`).
    pub force: bool,
    /// The stage's `resources.device`, as written (checked when the manifest loaded).
    #[serde(default)]
    pub device: Option<String>,
    /// The plan's estimate of what the stage needs ([`crate::estimate`]), when its op made one.
    #[serde(default)]
    pub estimate: Option<Estimate>,
    /// The ranks the stage's `resources.launch` asks for, if any.
    #[serde(default)]
    pub launch: Option<Launch>,
    /// What starts them, as the executor found it for where the stage runs: the argv the op's
    /// command follows (`srun …` in a Slurm job, `torchrun --standalone …` here).
    #[serde(default)]
    pub launcher: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct JobResult {
    /// `executed`, `cached` or `failed`.
    pub state: String,
    /// The stage's key, when it was resolved.
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub log: Option<String>,
}

/// Checks `resources.device` on this machine and resolves it for the op
/// ([`RunContext::device`]). `cuda`/`cuda:N` with no usable GPU is an error carrying the
/// probe's reason; so is `cuda` for an op that does not run on it (a `cmd` stage runs, its
/// command may use the GPU). `auto` says on stderr what it found, and hands a found GPU to an
/// op that trains on one.
fn check_device(spec: &JobSpec, op: &dyn AnyOp, ops: Registry) -> Result<Device> {
    let device = match spec.device.as_deref().map(Device::parse).transpose() {
        Ok(device) => device.unwrap_or(Device::Cpu),
        Err(why) => return Err(stage_error(spec, &format!("resources.device: {why}"), None)),
    };
    let probe = |ordinal| match ops.gpu_probe() {
        Some(probe) => probe(ordinal),
        None => Err("this nemo-dag was built without GPU support".to_string()),
    };
    let trains_on_gpu = op.spec().gpu;
    match device {
        Device::Cpu => Ok(Device::Cpu),
        Device::Auto => {
            let (found, resolved) = match probe(0) {
                Ok(gpu) if trains_on_gpu => (
                    format!(
                        "found {gpu}; op `{}` runs on it where it can (the stage's log says \
                         which)",
                        spec.op
                    ),
                    Device::Auto,
                ),
                Ok(gpu) => (
                    format!(
                        "found {gpu}, but op `{}` does not run on a GPU through \
                         `resources.device`; running on the CPU",
                        spec.op
                    ),
                    Device::Cpu,
                ),
                Err(why) => (
                    format!("no usable GPU ({why}); running on the CPU"),
                    Device::Cpu,
                ),
            };
            eprintln!("nemo-dag: stage `{}`: device auto: {found}", spec.stage);
            Ok(resolved)
        }
        Device::Cuda(ordinal) => match probe(ordinal) {
            Err(why) => Err(stage_error(
                spec,
                &format!("asks for device cuda:{ordinal}, which is not usable here: {why}"),
                Some("write `device: auto` to run on the CPU where there is no GPU"),
            )),
            Ok(gpu) if spec.cmd.is_none() && !trains_on_gpu => Err(stage_error(
                spec,
                &format!(
                    "asks for device cuda:{ordinal} ({gpu}), but op `{}` does not run on a \
                     GPU through `resources.device`",
                    spec.op
                ),
                Some(
                    "write `device: auto` or `cpu`; `nemo-dag ops` lists the ops that do (an op \
                     launched by `resources.launch` gets its GPUs from the launch)",
                ),
            )),
            Ok(gpu) => {
                eprintln!("nemo-dag: stage `{}`: device {gpu}", spec.stage);
                Ok(if trains_on_gpu {
                    Device::Cuda(ordinal)
                } else {
                    Device::Cpu
                })
            }
        },
    }
}

/// A launched stage has a launcher that this machine can start, and an unlaunched one has
/// none: the job script and the manifest agree (a job submitted before the manifest changed
/// may not), and a missing `torchrun` fails the stage before its attempt exists.
fn check_launcher(spec: &JobSpec) -> Result<()> {
    match (&spec.launch, spec.launcher.first()) {
        (None, None) => Ok(()),
        (Some(launch), None) => Err(stage_error(
            spec,
            &format!(
                "asks for {}, but nothing here starts its ranks",
                launch.describe()
            ),
            Some(
                "launch: srun and torchrun on several nodes run under a Slurm profile (`nemo-dag run MANIFEST --run PROFILE`); a job submitted before the stage had `launch` must be submitted again",
            ),
        )),
        (None, Some(program)) => Err(stage_error(
            spec,
            &format!(
                "has no resources.launch, but this job starts it under `{program}`: the manifest changed after the job was submitted"
            ),
            Some("submit the stage again"),
        )),
        (Some(_), Some(program)) if !on_path(program) => Err(stage_error(
            spec,
            &format!("is started by `{program}`, but `{program}` is not on PATH"),
            Some(if program == "torchrun" {
                "launch: torchrun needs PyTorch's `torchrun` where the stage runs (`pip install torch`, in the environment nemo-dag runs in)"
            } else {
                "launch: srun runs inside a Slurm job, on a node with Slurm's client commands"
            }),
        )),
        (Some(_), Some(_)) => Ok(()),
    }
}

/// Whether `program` names an executable file, directly (with a `/`) or in a `PATH` directory.
fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    let executable = |path: &Path| {
        path.metadata()
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.contains('/') {
        return executable(Path::new(program));
    }
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| executable(&dir.join(program))))
}

fn stage_error(spec: &JobSpec, message: &str, help: Option<&str>) -> Failure {
    let help = help.map(|h| format!("\n  help: {h}")).unwrap_or_default();
    Failure::Other(miette::miette!("stage `{}` {message}{help}", spec.stage))
}

pub fn exec(spec: &JobSpec, ops: Registry) -> Result<JobResult> {
    let store = Store::new(spec.store.clone());
    store.ensure()?;
    let _shared = store.hold_shared()?;
    let _lock = store.lock(&spec.key)?;
    store.set_aside_invalid(&spec.key)?;
    if !spec.force && store.is_published(&spec.key) {
        return Ok(JobResult {
            state: "cached".into(),
            key: Some(spec.key.clone()),
            error: None,
            log: None,
        });
    }
    let op = ops
        .get(&spec.op)
        .filter(|op| op.version() == spec.op_version)
        .ok_or_else(|| {
            Failure::Other(miette::miette!(
                "this nemo-dag has no op `{}` version {}; the job was planned by another version",
                spec.op,
                spec.op_version
            ))
        })?;

    let stage = StageDecl {
        name: &spec.stage,
        params: &spec.params,
        inputs: spec.inputs.keys().map(String::as_str).collect(),
        outputs: &spec.outputs,
        cmd: spec.cmd.as_deref(),
        world_size: spec.launch.as_ref().map(|l| l.world_size()),
        nodes: spec.launch.as_ref().map(|l| u64::from(l.nodes)),
    };
    // The op parses and checks its params here too (a job spec may come from another process
    // or machine); `run` gets exactly what this check approved.
    let checked = op.check(&stage).map_err(|e| {
        Failure::Other(miette::miette!(
            "stage `{}`: {}{}",
            spec.stage,
            e.message,
            e.help.map(|h| format!("\n  help: {h}")).unwrap_or_default()
        ))
    })?;

    // Before the attempt exists: a stage that cannot have its device or launcher writes nothing.
    let device = check_device(spec, op, ops)?;
    check_launcher(spec)?;
    let attempt = store.start_attempt(&spec.key, op.resumable())?;
    let tmp = attempt.dir;
    let out_dir = tmp.join("out");
    std::fs::create_dir_all(&out_dir).map_err(|e| io_err("cannot create", &out_dir, e))?;
    let log_path = tmp.join("log.txt");
    let mut log = StageLog::open(&log_path).map_err(|e| io_err("cannot create", &log_path, e))?;
    if attempt.resumed {
        let _ = writeln!(
            log,
            "nemo-dag: resuming an interrupted attempt at this stage"
        );
    }

    let started_at = crate::store::timestamp();
    let clock = Instant::now();
    let counters = Counters::now();
    // Progress goes to stderr only, as lines the executor turns into a bar (never the log).
    let mut progress = |p: Progress| eprintln!("{}", p.to_line());
    let mut ctx = RunContext {
        stage,
        inputs: &spec.input_paths,
        out_dir: &out_dir,
        log: &mut log,
        progress: &mut progress,
        stop_after_step: stop_after_step(),
        launcher: &spec.launcher,
        device,
    };
    allow_a_save(op, &spec.launcher);
    let ran = op.run(&checked, &mut ctx);
    end_grace();
    let outcome = ran
        .map_err(|e| e.to_string())
        .and_then(|metrics| check_output_links(&out_dir).map(|()| metrics));
    let seconds = clock.elapsed().as_secs_f64();
    let used = Counters::now().since(&counters);
    let unlaunched = spec.launch.is_none();
    let metrics = match outcome {
        Ok(m) => m,
        Err(e) => {
            let _ = writeln!(log, "nemo-dag: stage `{}` failed: {e}", spec.stage);
            let _ = log.finish();
            let log = keep_failed_attempt(&store, &spec.key, &tmp, op.resumable());
            return Ok(JobResult {
                state: "failed".into(),
                key: Some(spec.key.clone()),
                error: Some(e),
                log: Some(log.display().to_string()),
            });
        }
    };
    log.finish()
        .map_err(|e| io_err("cannot write", &log_path, e))?;

    let _ = std::fs::remove_file(tmp.join(crate::store::attempt::MARKER));
    crate::store::seal(&tmp).map_err(|e| io_err("cannot make read-only", &tmp, e))?;
    let mut digester = Digester::fresh();
    let mut outputs = BTreeMap::new();
    for (name, rel) in &spec.outputs {
        let path = out_dir.join(rel);
        let digest = digester
            .digest(&path)
            .map_err(|e| io_err("cannot digest output", &path, e))?;
        let bytes = tree_bytes(&path);
        outputs.insert(
            name.clone(),
            OutputRecord {
                path: format!("out/{rel}"),
                digest,
                bytes,
            },
        );
    }
    let artifact = Artifact {
        schema: ARTIFACT_SCHEMA,
        key: spec.key.clone(),
        stage: spec.stage.clone(),
        op: spec.op.clone(),
        op_version: spec.op_version,
        params: spec.params.clone(),
        cmd: spec.cmd.clone(),
        inputs: spec.inputs.clone(),
        outputs,
        metrics,
        upstream_keys: spec.upstream_keys.clone(),
        manifest: spec.manifest.clone(),
        started_at,
        seconds,
        host: crate::store::hostname(),
        engine_version: env!("CARGO_PKG_VERSION").to_string(),
        resources: Some(ResourceRecord {
            peak_rss_bytes: crate::usage::peak_rss_bytes(),
            // A launched stage's ranks run under `srun` or torchrun on other nodes too, not as
            // children of this process: what it measures would be the launcher's alone.
            cpu_user_seconds: unlaunched.then_some(used.user.as_secs_f64()),
            cpu_system_seconds: unlaunched.then_some(used.system.as_secs_f64()),
            read_bytes: used.read.filter(|_| unlaunched),
            written_bytes: used.written.filter(|_| unlaunched),
            estimate: spec.estimate.as_ref().map(Estimate::to_json),
        }),
    };
    // Beside the outputs, not one of them: a warning when it cannot be written.
    if let Err(e) = crate::tensorboard::write(&tmp, &artifact) {
        eprintln!(
            "nemo-dag: warning: no TensorBoard event file for `{}`: {e}",
            spec.stage
        );
    }
    let json = serde_json::to_vec_pretty(&artifact).map_err(|e| miette::miette!("{e}"))?;
    crate::store::sync_tree(&tmp).map_err(|e| io_err("cannot sync", &tmp, e))?;
    let meta = tmp.join("artifact.json");
    crate::store::write_atomic(&meta, &json, true)
        .map_err(|e| io_err("cannot write artifact.json in", &tmp, e))?;
    crate::store::seal(&meta).map_err(|e| io_err("cannot make read-only", &meta, e))?;
    store.publish(&tmp, &spec.key, spec.force)?;
    Ok(JobResult {
        state: "executed".into(),
        key: Some(spec.key.clone()),
        error: None,
        log: Some(
            store
                .artifact_dir(&spec.key)
                .join("log.txt")
                .display()
                .to_string(),
        ),
    })
}

/// Keep a failed attempt in `failed/<key>/` for its log (until `gc`), and return the log's
/// path. A resumable op (training) leaves its attempt where the next run looks for it, so a
/// crash on day five resumes from the last checkpoint; only the log is copied.
fn keep_failed_attempt(store: &Store, key: &str, attempt: &Path, resumable: bool) -> PathBuf {
    let failed = store.failed_dir(key);
    let _ = std::fs::remove_dir_all(&failed);
    let log = attempt.join("log.txt");
    let kept = if resumable {
        std::fs::create_dir_all(&failed).is_ok()
            && std::fs::copy(&log, failed.join("log.txt")).is_ok()
    } else {
        std::fs::rename(attempt, &failed).is_ok()
    };
    if kept { failed.join("log.txt") } else { log }
}

/// A symbolic link among the outputs may only point inside them, by a relative path: a link
/// out of the stage would let published content change after publication, and an absolute
/// link breaks when the attempt is renamed into place.
pub(crate) fn check_output_links(out_dir: &Path) -> std::result::Result<(), String> {
    let root = std::fs::canonicalize(out_dir).map_err(|e| e.to_string())?;
    let mut todo = vec![out_dir.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let entry = entry.map_err(|e| e.to_string())?;
            let path = entry.path();
            let ty = entry.file_type().map_err(|e| e.to_string())?;
            if ty.is_dir() {
                todo.push(path);
                continue;
            }
            if !ty.is_symlink() {
                continue;
            }
            let target = std::fs::read_link(&path).map_err(|e| e.to_string())?;
            let inside = !target.is_absolute()
                && std::fs::canonicalize(&path).is_ok_and(|t| t.starts_with(&root));
            if !inside {
                let rel = path.strip_prefix(out_dir).unwrap_or(&path);
                return Err(format!(
                    "output {} is a symbolic link to {}, outside the stage's outputs: write the file itself (`cp -L`), or link within the outputs by a relative path",
                    rel.display(),
                    target.display()
                ));
            }
        }
    }
    Ok(())
}

/// Total size in bytes of a file, or of the files under a directory.
fn tree_bytes(path: &std::path::Path) -> u64 {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::read_dir(path)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| tree_bytes(&e.path()))
            .sum(),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// `NEMO_DAG_STOP_AFTER_STEP=N`: end a resumable stage after step N's checkpoint, as a
/// preemption would (the stage fails; running again resumes). For drills and tests.
fn stop_after_step() -> Option<u64> {
    std::env::var("NEMO_DAG_STOP_AFTER_STEP")
        .ok()
        .and_then(|v| v.parse().ok())
}

/// When `exec` leads its own process group (the local executor starts it so, and so does a
/// Slurm batch step), a SIGTERM, SIGHUP or SIGINT — which is also what it gets when the run that
/// started it dies ([`nemo_dag_op::process::term_with_parent`]) — kills the whole group: the
/// stage's commands and anything they forked die with it, instead of writing on into an
/// abandoned attempt.
///
/// A stage that can save on the way out gets a grace period instead ([`allow_a_save`]).
fn take_the_group_down_on_termination() {
    // SAFETY: getpgrp and getpid have no preconditions.
    let leader = unsafe { libc::getpgrp() == libc::getpid() };
    if !leader {
        return;
    }
    let handler: extern "C" fn(libc::c_int) = on_termination;
    for signal in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        // SAFETY: installing a handler that only calls async-signal-safe functions.
        unsafe { libc::signal(signal, handler as libc::sighandler_t) };
    }
}

/// Seconds a terminated stage's processes get to save before they are killed; 0: none.
static TERM_GRACE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Whether the grace period starts by passing SIGTERM on to the stage's processes. Not to
/// `srun`: it answers a SIGTERM of its own by killing its tasks ("forcing job termination"),
/// and under Slurm the ranks hear from Slurm itself (`--signal`, a preemption, `scancel`).
static PASS_TERM_ON: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The default of `NEMO_DAG_TERM_GRACE`: time for a distributed checkpoint of a large model.
const DEFAULT_TERM_GRACE: u32 = 300;

extern "C" fn kill_group(_: libc::c_int) {
    // SAFETY: kill is async-signal-safe; 0 is our own process group, ourselves included.
    unsafe { libc::kill(0, libc::SIGKILL) };
}

extern "C" fn on_termination(_: libc::c_int) {
    let grace = TERM_GRACE.load(std::sync::atomic::Ordering::Relaxed);
    if grace == 0 {
        kill_group(0);
        return;
    }
    // SAFETY: signal (sigaction), kill and alarm are async-signal-safe. Ignore further
    // termination signals (and the one we may pass on), hand SIGTERM to the stage's processes
    // where that is how they hear of it, and kill the group when the grace period is over.
    unsafe {
        for signal in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
            libc::signal(signal, libc::SIG_IGN);
        }
        if PASS_TERM_ON.load(std::sync::atomic::Ordering::Relaxed) {
            libc::kill(0, libc::SIGTERM);
        }
        let alarm: extern "C" fn(libc::c_int) = kill_group;
        libc::signal(libc::SIGALRM, alarm as libc::sighandler_t);
        libc::alarm(grace);
    }
}

/// A resumable op whose work runs in child processes (a launched one: Megatron-Bridge saves a
/// checkpoint on SIGTERM, then exits) gets `NEMO_DAG_TERM_GRACE` seconds (default 300) between
/// a SIGTERM to this process and SIGKILL, so a preemption or a time limit costs nothing since
/// the last save. An op that trains inside this process has nothing to hand the signal to, and
/// keeps the immediate kill.
fn allow_a_save(op: &dyn nemo_dag_op::AnyOp, launcher: &[String]) {
    if !(op.spec().resumable && op.spec().launched) {
        return;
    }
    PASS_TERM_ON.store(
        launcher.first().is_none_or(|l| l != "srun"),
        std::sync::atomic::Ordering::Relaxed,
    );
    let grace = std::env::var("NEMO_DAG_TERM_GRACE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_TERM_GRACE);
    TERM_GRACE.store(grace, std::sync::atomic::Ordering::Relaxed);
}

/// After the op returns: no grace period is running any more, and a late termination signal
/// kills at once again.
fn end_grace() {
    TERM_GRACE.store(0, std::sync::atomic::Ordering::Relaxed);
    // SAFETY: alarm(0) cancels a pending alarm; it has no preconditions.
    unsafe { libc::alarm(0) };
}

/// Where `nemo-dag exec` finds its job.
pub enum JobSource {
    /// A job spec (JSON) an executor wrote, or `-` for stdin.
    Spec(PathBuf),
    /// A stage of a manifest, its key resolved against the store (a cluster job).
    Stage {
        stage: String,
        manifest: LoadArgs,
        store: Store,
        /// What starts a launched stage's ranks in this job (the job script's words after
        /// `--`, from [`Launch::slurm_command`]); empty for a stage without `launch`.
        launcher: Vec<String>,
        /// Use no shared cache (`run --offline`): pull nothing, push nothing.
        offline: bool,
        /// The store is the node's own (a profile's `node_store`): a stage not pushed fails.
        must_push: bool,
    },
}

/// `nemo-dag exec`: build one job, print its [`JobResult`] as one JSON line on stdout, and
/// return the exit code (1 when it failed). In [`JobSource::Stage`] mode the stage is also
/// recorded in the manifest's run record once built, as a local run would.
pub fn exec_command(source: Option<JobSource>, ops: Registry) -> i32 {
    take_the_group_down_on_termination();
    let mut recorded: Option<(Manifest, Store, String)> = None;
    let mut cache: Option<Cache> = None;
    let mut must_push = false;
    let spec = match source {
        Some(JobSource::Spec(path)) => read_spec(&path),
        Some(JobSource::Stage {
            stage,
            manifest,
            store,
            launcher,
            offline,
            must_push: must,
        }) => Manifest::load(&manifest)
            .map_err(Failure::from)
            .and_then(|manifest| {
                must_push = must;
                if !offline {
                    cache = Cache::load(&manifest.dir)?;
                }
                let known = match &cache {
                    Some(cache) => pull_for_job(&manifest, &store, cache, &stage),
                    None => Default::default(),
                };
                let mut spec = local::spec_for_stage(&manifest, &store, &stage, &known)?;
                spec.launcher = launcher;
                recorded = Some((manifest, store, stage));
                Ok(spec)
            }),
        None => Err(InputError::new("exec needs --spec FILE, or --stage STAGE MANIFEST").into()),
    };
    let result = match spec.and_then(|spec| exec(&spec, ops)) {
        Ok(r) => r,
        Err(e) => JobResult {
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
    let pushed = match (&cache, &recorded, &result.key) {
        (Some(cache), Some((_, store, stage)), Some(key)) if result.state == "executed" => {
            push_for_job(store, cache, stage, key, must_push)
        }
        (None, Some((_, _, stage)), _) if must_push && result.state == "executed" => Err(format!(
            "`{stage}` was built in this node's own store (the profile's node_store), and there is no shared cache to take it to the other jobs"
        )),
        _ => Ok(()),
    };
    if let Err(why) = pushed {
        eprintln!("nemo-dag exec: {why}");
        println!(
            "{}",
            serde_json::to_string(&JobResult {
                state: "failed".into(),
                key: result.key.clone(),
                error: Some(why),
                log: result.log.clone(),
            })
            .unwrap_or_default()
        );
        return 1;
    }
    if let Some((manifest, store, stage)) = &recorded
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
        };
        let argv: Vec<String> = std::env::args().collect();
        if let Err(e) = local::record_run(manifest, store, &argv, &[outcome]) {
            eprintln!("nemo-dag exec: {e:?}");
            println!("{}", serde_json::to_string(&result).unwrap_or_default());
            return 1;
        }
    }
    if let Some(error) = &result.error
        && result.log.is_none()
    {
        eprintln!("nemo-dag exec: {error}");
    }
    println!("{}", serde_json::to_string(&result).unwrap_or_default());
    if result.state == "failed" { 1 } else { 0 }
}

/// A cluster job with a shared cache: bring in what the stage needs that this node's store
/// lacks (its direct inputs, and the stage itself when someone built it already); the stages
/// further up are keyed from the cache's records. A cache that cannot help is said in the
/// job's log; the stage then needs its upstream here. Every upstream stage's key and outputs,
/// as the cache knows them.
fn pull_for_job(
    manifest: &Manifest,
    store: &Store,
    cache: &Cache,
    stage: &str,
) -> std::collections::HashMap<String, crate::store::Published> {
    match crate::cache::pull_inputs(manifest, store, cache, stage) {
        Ok((rows, known)) => {
            for row in rows {
                if let Some(scope) = row.remote.as_ref().filter(|_| row.done.is_some()) {
                    eprintln!(
                        "nemo-dag exec: pulled `{}` ({} bytes) from the shared cache (scope {scope})",
                        row.name, row.bytes
                    );
                }
                if let Some(problem) = row.problem {
                    eprintln!("nemo-dag exec: `{}` not pulled: {problem}", row.name);
                }
            }
            known
        }
        Err(e) => {
            // A cache that is down was said when it went down.
            if cache.down_reason().is_none() {
                eprintln!("nemo-dag exec: warning: {e}");
            }
            Default::default()
        }
    }
}

/// A cluster job with a shared cache: what it built goes to the write scope before the job
/// ends, so that the next job, on any node, finds it. `Err` (with `must`: the job keeps its
/// store on its node, and what is not pushed is lost) says why it is not in the cache.
fn push_for_job(
    store: &Store,
    cache: &Cache,
    stage: &str,
    key: &str,
    must: bool,
) -> Result<(), String> {
    let pushed = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .and_then(|rt| {
            rt.block_on(cache.push(store, key))
                .map_err(|e| e.to_string())
        });
    let missing = match pushed {
        Ok(Pushed::Pushed { bytes }) => {
            eprintln!(
                "nemo-dag exec: pushed `{stage}` ({bytes} bytes) to the shared cache {}",
                cache.remote.settings.url
            );
            return Ok(());
        }
        // Theirs is kept, and the next job uses theirs: as good as ours.
        Ok(Pushed::There) => return Ok(()),
        Ok(Pushed::Conflict(why)) => {
            eprintln!("nemo-dag exec: warning: `{stage}`: {why}");
            return Ok(());
        }
        Ok(Pushed::Off) => cache
            .write_refusal()
            .or_else(|| cache.down_reason())
            .unwrap_or_else(|| "the cache writes no scope".into()),
        Err(why) => why,
    };
    let why = format!("`{stage}` was not pushed to the shared cache: {missing}");
    if must {
        return Err(format!(
            "{why}; it was built in this node's own store (the profile's node_store), so no other job can use it"
        ));
    }
    // A cache that is down was said when it went down.
    if cache.down_reason().is_none() {
        eprintln!("nemo-dag exec: warning: {why}");
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(op: &str, device: &str, cmd: Option<&str>) -> JobSpec {
        serde_json::from_value(serde_json::json!({
            "store": "/nowhere", "key": "k", "stage": "s", "op": op, "op_version": 1,
            "params": {}, "cmd": cmd, "outputs": {}, "inputs": {}, "input_paths": {},
            "upstream_keys": [], "manifest": "m.yaml", "force": false, "device": device
        }))
        .unwrap()
    }

    /// What each `resources.device` resolves to for an op that trains on a GPU (`trains`) and
    /// one that does not (`resumable`), on a machine whose probe finds a GPU and one whose
    /// probe finds none.
    #[test]
    fn a_device_resolves_for_the_op_and_the_machine() {
        let with_gpu = crate::testing::ops().with_gpu_probe(|n| Ok(format!("GPU {n}")));
        let without = crate::testing::ops().with_gpu_probe(|_| Err("no driver".to_string()));
        let resolve = |ops: Registry, op: &str, device: &str, cmd: Option<&str>| {
            let spec = spec(op, device, cmd);
            let op = ops.get(&spec.op).unwrap();
            check_device(&spec, op, ops).map_err(|e| e.to_string())
        };
        assert_eq!(
            resolve(with_gpu, "trains", "cuda:1", None),
            Ok(Device::Cuda(1))
        );
        assert_eq!(resolve(with_gpu, "trains", "auto", None), Ok(Device::Auto));
        assert_eq!(resolve(with_gpu, "trains", "cpu", None), Ok(Device::Cpu));
        assert_eq!(
            resolve(with_gpu, "resumable", "auto", None),
            Ok(Device::Cpu)
        );
        // A command may use the GPU itself; the op does not train on it.
        assert_eq!(
            resolve(with_gpu, "cmd", "cuda", Some("nvidia-smi")),
            Ok(Device::Cpu)
        );
        let cpu_only = resolve(with_gpu, "resumable", "cuda", None).unwrap_err();
        assert!(cpu_only.contains("does not run on a GPU"), "{cpu_only}");
        assert_eq!(resolve(without, "trains", "auto", None), Ok(Device::Cpu));
        let missing = resolve(without, "trains", "cuda", None).unwrap_err();
        assert!(missing.contains("not usable here: no driver"), "{missing}");
    }
}
