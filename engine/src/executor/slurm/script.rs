//! The `sbatch` script of one stage: its `#SBATCH` lines (the stage's resources over the
//! profile's), its `afterok` dependencies, the profile's environment, and the one command it
//! runs, `nemo-dag exec --stage`, under `srun` (in a container when the profile names one).
//!
//! A launched stage (`resources.launch`, [`crate::launch`]) is shaped by its launch, wires the
//! rendezvous, and runs `nemo-dag exec` once on the first node, outside any container; the
//! words after `--` start its command once per rank, in the image its op names (an `image`
//! param, part of its key) or else the profile's.

use super::SubmitOptions;
use crate::launch::Step;
use crate::manifest::Manifest;
use crate::store::Store;
use std::path::Path;

pub(super) fn after_placeholder(stages: &[String]) -> Vec<String> {
    stages.iter().map(|s| format!("<job of {s}>")).collect()
}

pub(super) fn dependency_line(after: &[String]) -> String {
    if after.is_empty() {
        String::new()
    } else {
        format!(
            "#SBATCH --dependency=afterok:{}\n#SBATCH --kill-on-invalid-dep=yes\n",
            after.join(":")
        )
    }
}

/// Seconds before the time limit that the ranks of a stage which saves on SIGTERM are told to
/// stop: ten minutes, or a quarter of a shorter limit. Slurm sends a signal whose time has come
/// at once, and looks only about once a minute (so up to 60 s early): `TERM@600` on a 5-minute
/// job would stop it as soon as it starts.
fn term_warning(limit: Option<std::time::Duration>) -> u64 {
    const TEN_MINUTES: u64 = 600;
    limit.map_or(TEN_MINUTES, |l| TEN_MINUTES.min(l.as_secs() / 4).max(1))
}

/// Where the store's path is in the job's `nemo-dag exec` command line.
const STORE_WORD: usize = 5;

/// The batch script of one stage. `@AFTER@` is replaced by the dependency lines at submit time.
pub(super) fn job_script(
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
    let launch = r.launch();
    let stem = manifest.name();
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
    // A launched stage's shape is its launch's, whole.
    let (nodes, tasks_per_node) = match &launch {
        Some(launch) => (Some(launch.nodes), Some(launch.tasks_per_node())),
        None => (r.nodes.or(profile.nodes), profile.ntasks_per_node),
    };
    sb("nodes", nodes.map(|n| n.to_string()));
    sb("ntasks-per-node", tasks_per_node.map(|n| n.to_string()));
    sb(
        "gpus-per-node",
        r.gpus
            .or(profile.gpus_per_node)
            .filter(|g| *g > 0)
            .map(|n| n.to_string()),
    );
    let cpus_per_task = r.cpus.or(profile.cpus_per_task);
    sb("cpus-per-task", cpus_per_task.map(|n| n.to_string()));
    sb("time", r.time.as_ref().map(scalar).or(profile.time.clone()));
    sb("mem", r.mem.as_ref().map(scalar).or(profile.mem.clone()));
    if profile.exclusive == Some(true) {
        s.push_str("#SBATCH --exclusive\n");
    }
    if r.requeue == Some(true) {
        s.push_str("#SBATCH --requeue\n");
    }
    // The ranks of a stage that saves on SIGTERM hear of the time limit ahead of it, time to
    // save and stop rather than be killed after Slurm's KillWait. Not `B:`: the batch shell is
    // `nemo-dag exec`, whose `srun` would kill the ranks on a SIGTERM of its own.
    if stage.op.spec().resumable && stage.op.spec().launched {
        let limit = r.time_limit().or_else(|| profile.time_limit());
        s.push_str(&format!("#SBATCH --signal=TERM@{}\n", term_warning(limit)));
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
    if opts.offline {
        argv.push("--offline".into());
    }
    if profile.node_store.is_some() {
        argv.push("--must-push".into());
    }
    debug_assert_eq!(argv[STORE_WORD - 1], "--store");
    if let Some(v) = &manifest.variant {
        argv.push("-c".into());
        argv.push(v.display().to_string());
    }
    argv.push(manifest.path.display().to_string());
    argv.extend(manifest.overrides.iter().cloned());
    if let Some(launch) = &launch {
        s.push_str(&launch.rendezvous_lines());
        argv.push("--".into());
        argv.extend(launcher(manifest, opts, name));
    }
    let mut command: Vec<String> = argv.iter().map(|a| quote(a)).collect();
    // A node's own store: in double quotes, so that the job's shell expands its variables
    // (the profile refuses anything else the shell would read).
    if let Some(node_store) = &profile.node_store {
        command[STORE_WORD] = format!("\"{node_store}\"");
    }
    match &profile.container_image {
        Some(image) if launch.is_none() => {
            let mut srun = format!("srun --container-image={}", quote(image));
            if !profile.mounts.is_empty() {
                srun.push_str(&format!(
                    " --container-mounts={}",
                    quote(&profile.mounts.join(","))
                ));
            }
            s.push_str(&format!("{srun} {}\n", command.join(" ")));
        }
        _ => s.push_str(&format!("exec {}\n", command.join(" "))),
    }
    s
}

/// The argv that starts a launched stage's ranks inside its job (empty without a launch): one
/// `srun` step over the stage's shape, in the image its op names, else the profile's.
pub(super) fn launcher(manifest: &Manifest, opts: &SubmitOptions, name: &str) -> Vec<String> {
    let profile = opts.profile;
    let stage = &manifest.stages[name];
    let Some(launch) = stage.resources.launch() else {
        return Vec::new();
    };
    let image = named_image(manifest, name);
    let step = Step {
        cpus_per_task: stage.resources.cpus.or(profile.cpus_per_task),
        mpi: profile.mpi.as_deref(),
        container_image: image.as_deref().or(profile.container_image.as_deref()),
        mounts: &profile.mounts,
    };
    launch.slurm_command(&step)
}

/// The image stage `name`'s params name, when its op takes one ([`nemo_dag_op::Op::image`]).
fn named_image(manifest: &Manifest, name: &str) -> Option<String> {
    let stage = &manifest.stages[name];
    let checked = stage.op.check(&stage.decl()).ok()?;
    stage.op.image(&checked)
}

/// A stage whose op's software is an image ([`nemo_dag_op::Op::names_image`]: Megatron-Bridge,
/// NeMo-RL) must name it in its params, where the key sees it. Left to the profile's
/// `container_image`, a later run in another image would be served this one's result.
/// `Err((message, help))`, before anything is submitted.
pub(super) fn check_image_named(
    manifest: &Manifest,
    opts: &SubmitOptions,
    name: &str,
) -> Result<(), (String, String)> {
    let stage = &manifest.stages[name];
    let Some(fallback) = opts.profile.container_image.as_deref() else {
        return Ok(());
    };
    if !stage.op.names_image() || named_image(manifest, name).is_some() {
        return Ok(());
    }
    Err((
        format!(
            "stage `{name}` names no image, so `{}` would run in profile `{}`'s `{fallback}`, \
             which is not part of the stage's key: a run in another image would be served \
             this one's result",
            stage.op.name(),
            opts.profile.name
        ),
        format!(
            "name it in the stage's params, `image: \"{fallback}\"`, so that a new image \
             reruns the stage"
        ),
    ))
}

/// A stage that runs in a container (its ranks, or `nemo-dag exec` itself) must see, at the
/// same path, everything nemo-dag hands it: host paths under the store (its attempt directory,
/// upstream artifacts) and the files the manifest names. `Err((message, help))` names what is missing,
/// before anything is submitted rather than after the queue wait.
pub(super) fn check_mounts(
    manifest: &Manifest,
    store: &Store,
    opts: &SubmitOptions,
    name: &str,
) -> Result<(), (String, String)> {
    // The ranks' image, or, for a stage without a launch, the profile's that `exec` runs in.
    let image = launcher(manifest, opts, name)
        .iter()
        .find_map(|w| w.strip_prefix("--container-image=").map(str::to_string))
        .or_else(|| {
            let unlaunched = manifest.stages[name].resources.launch().is_none();
            unlaunched
                .then(|| opts.profile.container_image.clone())
                .flatten()
        });
    let Some(image) = image else {
        return Ok(());
    };
    // pyxis' SRC[:DST[:FLAGS]]; a path is seen at the same place only where SRC is DST.
    let same_place: Vec<&Path> = opts
        .profile
        .mounts
        .iter()
        .filter_map(|m| {
            let mut parts = m.split(':');
            let host = parts.next()?;
            let inside = parts.next().unwrap_or(host);
            (host == inside).then_some(Path::new(host))
        })
        .collect();
    // With a node store, the artifacts travel through the shared cache, and a store inside the
    // image is as good as any; where the path is fixed, it is the one to mount.
    let launched = manifest.stages[name].resources.launch().is_some();
    let mut needed = match &opts.profile.node_store {
        None => vec![std::path::absolute(&store.root).unwrap_or_else(|_| store.root.clone())],
        Some(node) if !node.contains('$') => vec![std::path::PathBuf::from(node)],
        // The ranks of a launched stage read and write the node store from inside the image,
        // at a path only the job's shell knows.
        Some(node) if launched => {
            return Err((
                format!(
                    "stage `{name}` starts its ranks in image `{image}`, which must see the node store at the same path, and node_store `{node}` is known only when the job runs"
                ),
                format!(
                    "give profile `{}` a node_store without variables, and mount it: mounts = [\"/scratch/nemo-dag:/scratch/nemo-dag\"]",
                    opts.profile.name
                ),
            ));
        }
        Some(_) => Vec::new(),
    };
    needed.extend(
        manifest.stages[name]
            .inputs
            .values()
            .filter_map(|input| match input {
                crate::manifest::Input::File { path, .. } => Some(path.clone()),
                crate::manifest::Input::Stage { .. } => None,
            }),
    );
    match needed
        .iter()
        .find(|path| !same_place.iter().any(|m| path.starts_with(m)))
    {
        None => Ok(()),
        Some(path) => {
            let dir = path.parent().unwrap_or(path).display().to_string();
            Err((
                format!(
                    "stage `{name}` runs in image `{image}`, where {} is not mounted at the same path",
                    path.display()
                ),
                format!(
                    "add it, or a directory above it, to the `mounts` of profile `{}` in env.toml, e.g. mounts = [\"{dir}:{dir}\"] (a shared filesystem every node sees)",
                    opts.profile.name
                ),
            ))
        }
    }
}

/// What a stage's op will run in its job ([`nemo_dag_op::Op::preview`]), for `--dry-run`.
pub(super) fn preview(manifest: &Manifest, opts: &SubmitOptions, name: &str) -> Option<String> {
    let stage = &manifest.stages[name];
    let checked = stage.op.check(&stage.decl()).ok()?;
    stage
        .op
        .preview(&checked, &stage.decl(), &launcher(manifest, opts, name))
}

fn scalar(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn quote(s: &str) -> String {
    nemo_dag_op::process::shell_word(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::executor::profile::Profile;
    use crate::executor::slurm::Mode;
    use crate::manifest::LoadArgs;
    use std::path::PathBuf;

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

    /// The options of a dry run under `profile`, with no shared cache.
    fn dry_run(profile: &Profile, mode: Mode, offline: bool) -> SubmitOptions<'_> {
        SubmitOptions {
            profile,
            mode,
            dry_run: true,
            targets: &[],
            force: &[],
            cache: None,
            offline,
            tracker: None,
        }
    }

    /// The job script of `stage`, as a dry run under `profile` writes it.
    fn script(m: &Manifest, dir: &Path, profile: &Profile, mode: Mode, stage: &str) -> String {
        let opts = dry_run(profile, mode, false);
        job_script(
            m,
            &Store::new(dir.join(".nemo-dag")),
            &opts,
            super::super::partition(&opts),
            Path::new("/opt/nemo-dag"),
            stage,
            Path::new("/logs/train.log"),
        )
    }

    #[test]
    fn the_stage_owns_its_shape_and_the_profile_fills_the_rest() {
        let (m, dir) = manifest(
            "stages:\n  train:\n    op: cmd\n    params: {lr: 0.1}\n    outputs: {o: o}\n    cmd: \"echo {params.lr} > {outputs.o}\"\n    resources: {gpus: 2, time: '01:00:00', requeue: true}\n",
        );
        let profile = Profile {
            name: "c".into(),
            executor: crate::executor::profile::Executor::Slurm,
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
        let s = script(&m, &dir, &profile, Mode::Run, "train");
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

    #[test]
    fn a_node_store_is_left_for_the_jobs_shell_to_expand_and_offline_reaches_the_job() {
        let (m, dir) = manifest(
            "stages:\n  train:\n    op: cmd\n    params: {lr: 0.1}\n    outputs: {o: o}\n    cmd: \"echo {params.lr} > {outputs.o}\"\n",
        );
        let profile = Profile {
            name: "c".into(),
            executor: crate::executor::profile::Executor::Slurm,
            node_store: Some("$TMPDIR/nd-$SLURM_JOB_ID".into()),
            ..Default::default()
        };
        let s = script(&m, &dir, &profile, Mode::Batch, "train");
        assert!(
            s.contains("exec --stage train --store \"$TMPDIR/nd-$SLURM_JOB_ID\" "),
            "{s}"
        );
        let opts = dry_run(&profile, Mode::Batch, true);
        let s = job_script(
            &m,
            &Store::new(dir.join(".nemo-dag")),
            &opts,
            None,
            Path::new("/opt/nemo-dag"),
            "train",
            Path::new("/logs/train.log"),
        );
        assert!(s.contains("\" --offline "), "{s}");
        // With a node store, a stage the cache does not take fails its job.
        assert!(s.contains(" --must-push "), "{s}");
    }

    #[test]
    fn a_launched_stage_in_an_image_needs_a_node_store_it_can_mount() {
        let (m, dir) = manifest(
            "stages:\n  train:\n    op: cmd\n    params: {lr: 0.1}\n    outputs: {o: o}\n    cmd: \"echo {params.lr} > {outputs.o}\"\n    resources: {launch: srun, nodes: 2, gpus: 4}\n",
        );
        let check = |node_store: &str, mounts: &[&str]| {
            let profile = Profile {
                name: "c".into(),
                executor: crate::executor::profile::Executor::Slurm,
                container_image: Some("img.sqsh".into()),
                node_store: Some(node_store.into()),
                mounts: mounts.iter().map(|m| m.to_string()).collect(),
                ..Default::default()
            };
            let opts = dry_run(&profile, Mode::Batch, false);
            check_mounts(&m, &Store::new(dir.join(".nemo-dag")), &opts, "train")
        };
        let (message, _) = check("$TMPDIR/nd", &[]).unwrap_err();
        assert!(
            message.contains("known only when the job runs"),
            "{message}"
        );
        let (message, _) = check("/scratch/nd", &[]).unwrap_err();
        assert!(message.contains("/scratch/nd is not mounted"), "{message}");
        let dir_text = dir.display().to_string();
        let project = format!("{dir_text}:{dir_text}");
        assert!(check("/scratch/nd", &["/scratch:/scratch", &project]).is_ok());
    }

    /// An op whose software is its image must name it: the profile's image is not in the key.
    #[test]
    fn a_stage_whose_software_is_an_image_must_name_it_not_take_the_profiles() {
        let stage = |params: &str| {
            format!(
                "stages:\n  train:\n    op: in_image\n    params: {{lr: 0.1{params}}}\n    outputs: {{o: o}}\n    resources: {{launch: srun}}\n"
            )
        };
        let check = |text: &str, image: Option<&str>| {
            let (m, _dir) = manifest(text);
            let profile = Profile {
                name: "c".into(),
                executor: crate::executor::profile::Executor::Slurm,
                container_image: image.map(str::to_string),
                ..Default::default()
            };
            check_image_named(&m, &dry_run(&profile, Mode::Batch, false), "train")
        };
        let (message, help) = check(&stage(""), Some("nemo.sqsh")).unwrap_err();
        assert!(
            message.contains("stage `train` names no image")
                && message.contains("profile `c`'s `nemo.sqsh`")
                && message.contains("not part of the stage's key"),
            "{message}"
        );
        assert!(help.contains("image: \"nemo.sqsh\""), "{help}");
        // Named in the stage: keyed. No profile image: the stage's own check decides.
        assert!(check(&stage(", image: nemo.sqsh"), Some("other.sqsh")).is_ok());
        assert!(check(&stage(""), None).is_ok());
        // An op whose software is not an image (cmd) may run in the profile's.
        let cmd = "stages:\n  train:\n    op: cmd\n    params: {lr: 0.1}\n    outputs: {o: o}\n    cmd: \"true\"\n    resources: {launch: srun}\n";
        assert!(check(cmd, Some("nemo.sqsh")).is_ok());
    }

    #[test]
    fn a_launched_stage_runs_exec_once_and_its_command_once_per_rank() {
        let (m, dir) = manifest(
            "stages:\n  train:\n    op: cmd\n    params: {lr: 0.1}\n    outputs: {o: o}\n    cmd: \"echo {params.lr} > {outputs.o}\"\n    resources: {launch: srun, nodes: 2, gpus: 4, cpus: 8}\n",
        );
        let profile = Profile {
            name: "c".into(),
            executor: crate::executor::profile::Executor::Slurm,
            nodes: Some(16),
            ntasks_per_node: Some(1),
            env_vars: [("HF_HOME".to_string(), "/hf".to_string())].into(),
            startup_commands: vec!["module load cuda".into()],
            container_image: Some("img.sqsh".into()),
            ..Default::default()
        };
        let s = script(&m, &dir, &profile, Mode::Batch, "train");
        let lines: Vec<&str> = s.lines().collect();
        let at = |line: &str| {
            lines
                .iter()
                .position(|l| *l == line)
                .unwrap_or_else(|| panic!("no line {line:?} in\n{s}"))
        };
        // The launch's shape, not the profile's: a task per rank (one per GPU), 8 CPUs each.
        at("#SBATCH --nodes=2");
        at("#SBATCH --ntasks-per-node=4");
        at("#SBATCH --gpus-per-node=4");
        at("#SBATCH --cpus-per-task=8");
        // The rendezvous after the profile's environment and startup, before exec.
        let startup = at("module load cuda");
        let addr = at("MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)");
        let port = at("MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))");
        let export = at("export MASTER_ADDR MASTER_PORT");
        assert!(startup < addr && addr < port && port < export, "{s}");
        assert_eq!(
            lines[addr - 1],
            "# 8 ranks (2 nodes × 4) started by srun; nemo-dag exec publishes once, after every rank exits 0"
        );
        // exec, once, on the first node and outside the container; the ranks in it.
        let exec = lines[export + 1];
        assert_eq!(export + 2, lines.len(), "exec is the last line: {s}");
        let (exec_part, launcher) = exec.split_once(" -- ").unwrap();
        assert!(
            exec_part.starts_with("exec /opt/nemo-dag exec --stage train --store "),
            "{exec}"
        );
        assert!(
            exec_part.ends_with("r.yaml stages.train.params.lr=0.5"),
            "{exec}"
        );
        assert_eq!(
            launcher,
            "srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=8 --kill-on-bad-exit=1 --container-image=img.sqsh sh -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=4; exec \"$@\"' nemo-dag-rank"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_stage_that_saves_on_sigterm_hears_of_its_time_limit_before_it_and_after_it_starts() {
        let (m, dir) = manifest(
            "stages:\n  train:\n    op: resumable\n    params: {lr: 0.1}\n    outputs: {o: o}\n  short:\n    op: resumable\n    outputs: {o: o}\n    resources: {time: '00:05:00'}\n  plain:\n    op: cmd\n    outputs: {o: o}\n    cmd: \"true\"\n",
        );
        let signal = |profile_time: Option<&str>, stage: &str| {
            let profile = Profile {
                name: "c".into(),
                executor: crate::executor::profile::Executor::Slurm,
                time: profile_time.map(String::from),
                ..Default::default()
            };
            let s = script(&m, &dir, &profile, Mode::Batch, stage);
            s.lines()
                .find_map(|l| l.strip_prefix("#SBATCH --signal="))
                .map(String::from)
        };
        // Ten minutes ahead of a long limit, or of the partition's when none is given.
        assert_eq!(
            signal(Some("04:00:00"), "train").as_deref(),
            Some("TERM@600")
        );
        assert_eq!(signal(None, "train").as_deref(), Some("TERM@600"));
        // A quarter of a short one, the stage's over the profile's: `TERM@600` would reach a
        // 5-minute job as soon as it starts.
        assert_eq!(
            signal(Some("00:20:00"), "train").as_deref(),
            Some("TERM@300")
        );
        assert_eq!(
            signal(Some("04:00:00"), "short").as_deref(),
            Some("TERM@75")
        );
        // A stage that cannot save is not signalled early.
        assert_eq!(signal(Some("00:05:00"), "plain"), None);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
