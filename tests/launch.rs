//! `resources.launch`: a stage whose command starts once per rank (docs/slurm.md, "Multi-node
//! stages"). What needs no cluster: the manifest checks, local runs, and the job scripts
//! `--dry-run` prints. The ranks on a real cluster are in `slurm.rs`.

use crate::common::{Project, snapshot};

fn manifest(resources: &str) -> String {
    format!(
        "stages:\n  a:\n    op: cmd\n    outputs: {{o: o.txt}}\n    cmd: \"echo > {{outputs.o}}\"\n    resources: {{{resources}}}\n"
    )
}

/// Exit 2, nothing on stdout, every needle on stderr, and nothing written.
fn assert_bad_input(p: &Project, args: &[&str], needles: &[&str]) {
    let before = snapshot(&p.dir);
    let out = p.run(args);
    assert_eq!(out.code, 2, "nemo-dag {args:?}: bad input exits 2\n{out}");
    assert!(out.stdout.trim().is_empty(), "{out}");
    let squash = |s: &str| -> String {
        s.chars()
            .filter(|c| !c.is_whitespace() && *c != '│')
            .collect()
    };
    let err = squash(&out.stderr);
    for n in needles {
        assert!(
            err.contains(&squash(n)),
            "stderr should mention {n:?}\n{out}"
        );
    }
    assert_eq!(
        before,
        snapshot(&p.dir),
        "bad input must write nothing\n{out}"
    );
}

#[test]
fn launch_is_checked_when_the_manifest_loads() {
    for (resources, needles) in [
        (
            "launch: torchrn",
            &[
                "resources.launch",
                "`torchrn`",
                "did you mean `torchrun`?",
                "none, torchrun, srun",
            ][..],
        ),
        ("launch: 3", &["resources.launch", "`3`"][..]),
        (
            "ntasks_per_node: 2",
            &[
                "resources.ntasks_per_node",
                "launch: srun",
                "launch: torchrun",
            ][..],
        ),
        (
            "launch: none, ntasks_per_node: 2",
            &["resources.ntasks_per_node", "launch: srun"][..],
        ),
        (
            "launch: srun, ntasks_per_node: 0",
            &["resources.ntasks_per_node", "at least 1"][..],
        ),
        (
            "launch: srun, ntasks_per_node: 5000",
            &["resources.ntasks_per_node", "at most"][..],
        ),
    ] {
        let p = Project::new("launch-check");
        p.write("m.yaml", &manifest(resources));
        let mut needles = needles.to_vec();
        needles.push("m.yaml:6");
        assert_bad_input(&p, &["run", "m.yaml"], &needles);
        assert_bad_input(&p, &["validate", "m.yaml"], &needles);
    }

    // An op that does not start its work under a launcher refuses one, naming the op.
    let p = Project::new("launch-op");
    p.write(
        "m.yaml",
        "stages:\n  gen:\n    op: generate\n    params: {}\n    resources: {launch: torchrun}\n",
    );
    assert_bad_input(
        &p,
        &["validate", "m.yaml"],
        &["resources.launch", "op `generate`", "`cmd`", "m.yaml:5"],
    );

    // Sensible shapes load.
    for resources in [
        "launch: srun, nodes: 2, ntasks_per_node: 4",
        "launch: torchrun, gpus: 8",
        "launch: torchrun, nodes: 4, gpus: 8, ntasks_per_node: 8",
        "launch: none",
        "launch: none, nodes: 2",
    ] {
        let p = Project::new("launch-ok");
        p.write("m.yaml", &manifest(resources));
        p.ok(&["validate", "m.yaml"]);
    }
}

#[test]
fn a_local_run_refuses_what_needs_a_slurm_allocation() {
    for (resources, needles) in [
        (
            "launch: srun, ntasks_per_node: 2",
            &[
                "stage `a`",
                "launch: srun",
                "Slurm profile",
                "--run PROFILE",
            ][..],
        ),
        (
            "launch: torchrun, nodes: 2",
            &["stage `a`", "2 nodes", "Slurm profile"][..],
        ),
    ] {
        let p = Project::new("launch-local");
        p.write("m.yaml", &manifest(resources));
        let mut needles = needles.to_vec();
        needles.push("m.yaml:6");
        assert_bad_input(&p, &["run", "m.yaml"], &needles);
        assert_bad_input(&p, &["run", "m.yaml", "--dry-run"], &needles);
        assert!(!p.store().exists(), "nothing ran, nothing was written");
    }

    // An up-to-date stage is only read, so the run goes on: resources are not in the key, and
    // a stage built before it had `launch: srun` is cached. Forcing it would run it: refused.
    let p = Project::new("launch-local-cached");
    p.write("m.yaml", &manifest("cpus: 1"));
    p.ok(&["run", "m.yaml"]);
    p.write("m.yaml", &manifest("launch: srun, ntasks_per_node: 2"));
    let v = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(crate::common::states(&v)["a"], "cached", "{v}");
    let out = p.run(&["run", "m.yaml", "--force", "a"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("needs a Slurm profile"), "{out}");
}

/// A stand-in `torchrun`: records its arguments, then starts what follows `--no-python` once per
/// rank with the variables torchrun sets, and fails if any rank fails.
const FAKE_TORCHRUN: &str = r#"#!/bin/sh
echo "$@" > "$TORCHRUN_ARGS"
n=1
while [ $# -gt 0 ]; do
  case "$1" in
    --nproc-per-node=*) n=${1#--nproc-per-node=} ;;
    --no-python) shift; break ;;
  esac
  shift
done
pids=""
r=0
while [ $r -lt $n ]; do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$n "$@" & pids="$pids $!"
  r=$((r + 1))
done
status=0
for p in $pids; do wait $p || status=$?; done
exit $status
"#;

#[test]
fn torchrun_on_one_node_runs_here_standalone() {
    use std::os::unix::fs::PermissionsExt;
    let p = Project::new("launch-torchrun");
    let bin = p.write("bin/torchrun", FAKE_TORCHRUN);
    std::fs::set_permissions(&bin, std::fs::Permissions::from_mode(0o755)).unwrap();
    p.write(
        "m.yaml",
        r#"
stages:
  ranks:
    op: cmd
    outputs: {d: d}
    cmd: "mkdir -p {outputs.d} && echo $RANK of $WORLD_SIZE > {outputs.d}/rank-$RANK.txt"
    resources: {launch: torchrun, ntasks_per_node: 2}
"#,
    );
    let args = p.path("torchrun-args.txt");
    let path = format!(
        "{}:{}",
        p.path("bin").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut c = p.command(&["run", "m.yaml", "--json"]);
    c.env("PATH", &path).env("TORCHRUN_ARGS", &args);
    let out = crate::common::output(c);
    assert_eq!(out.code, 0, "{out}");
    let args = std::fs::read_to_string(&args).unwrap();
    assert!(
        args.starts_with("--standalone --nnodes=1 --nproc-per-node=2 --no-python sh -c mkdir -p '")
            && args.trim_end().ends_with("/out/d'/rank-$RANK.txt"),
        "torchrun's arguments: {args}"
    );
    let v = out.json();
    let key = crate::common::key_of(&v, "ranks");
    assert_eq!(p.published(&key, "d/rank-0.txt"), "0 of 2\n");
    assert_eq!(p.published(&key, "d/rank-1.txt"), "1 of 2\n");

    // Without torchrun on PATH the stage fails before it starts, saying what is missing.
    p.write("m.yaml", &manifest("launch: torchrun"));
    let mut c = p.command(&["run", "m.yaml", "--json"]);
    c.env("PATH", "/usr/bin:/bin");
    let out = crate::common::output(c);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr.contains("`torchrun` is not on PATH"),
        "the failure names the launcher: {out}"
    );
}

#[test]
fn the_job_script_of_a_launched_stage_wires_the_rendezvous() {
    let p = Project::new("launch-script");
    p.write(".git", "");
    // The containers see the project (and its store) at the same path.
    let shared = p.dir.display().to_string();
    p.write(
        "env.toml",
        &format!(
            "[lab]\nexecutor = \"slurm\"\nnodes = 8\nntasks_per_node = 3\ncpus_per_task = 16\ncontainer_image = \"img.sqsh\"\nmounts = [\"/data:/data\", \"{shared}:{shared}\"]\n"
        ),
    );
    p.write(
        "m.yaml",
        r#"
stages:
  ranks:
    op: cmd
    outputs: {o: o.txt}
    cmd: "echo $RANK > {outputs.o}"
    resources: {launch: srun, nodes: 2, ntasks_per_node: 4}
  torch:
    op: cmd
    inputs: {r: "ranks:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.r} > {outputs.o}"
    resources: {launch: torchrun, nodes: 2, gpus: 8}
  once:
    op: cmd
    inputs: {r: "torch:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.r} > {outputs.o}"
"#,
    );
    let out = p.ok(&["run", "m.yaml", "--batch", "lab", "--dry-run"]);
    let scripts = out.stdout.as_str();
    let script = |stage: &str| -> Vec<&str> {
        let start = scripts
            .find(&format!("# ---- {stage} ----"))
            .unwrap_or_else(|| panic!("no script for {stage}: {scripts}"));
        let rest = &scripts[start..];
        let end = rest[1..].find("# ---- ").map_or(rest.len(), |e| e + 1);
        rest[..end].lines().collect()
    };
    let has = |lines: &[&str], line: &str| {
        assert!(
            lines.contains(&line),
            "want the line\n  {line}\nin\n{}",
            lines.join("\n")
        );
    };
    let rendezvous = [
        "MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | sed -n 1p)",
        "MASTER_PORT=$((10000 + SLURM_JOB_ID % 20000))",
        "export MASTER_ADDR MASTER_PORT",
    ];

    // srun: a task per rank; the stage's shape wins over the profile's.
    let srun = script("ranks");
    has(&srun, "#SBATCH --nodes=2");
    has(&srun, "#SBATCH --ntasks-per-node=4");
    for line in rendezvous {
        has(&srun, line);
    }
    let exec = srun
        .iter()
        .find(|l| l.contains(" exec --stage ranks "))
        .unwrap();
    assert!(
        !exec.starts_with("srun"),
        "nemo-dag exec runs once, on the first node, outside the container: {exec}"
    );
    assert!(
        exec.ends_with(
            &format!(" -- srun --nodes=2 --ntasks=8 --ntasks-per-node=4 --cpus-per-task=16 --kill-on-bad-exit=1 --container-image=img.sqsh --container-mounts=/data:/data,{shared}:{shared} sh -c 'export RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID WORLD_SIZE=$SLURM_NTASKS LOCAL_WORLD_SIZE=4; exec \"$@\"' nemo-dag-rank")
        ),
        "{exec}"
    );

    // torchrun: one per node, ranks per node from `gpus`.
    let torch = script("torch");
    has(&torch, "#SBATCH --nodes=2");
    has(&torch, "#SBATCH --ntasks-per-node=1");
    has(&torch, "#SBATCH --gpus-per-node=8");
    for line in rendezvous {
        has(&torch, line);
    }
    let exec = torch
        .iter()
        .find(|l| l.contains(" exec --stage torch "))
        .unwrap();
    assert!(
        exec.ends_with(
            &format!(" -- srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --cpus-per-task=16 --kill-on-bad-exit=1 --container-image=img.sqsh --container-mounts=/data:/data,{shared}:{shared} sh -c 'exec torchrun --nnodes=2 --nproc-per-node=8 --node-rank=$SLURM_NODEID --master-addr=$MASTER_ADDR --master-port=$MASTER_PORT --no-python \"$@\"' torchrun")
        ),
        "{exec}"
    );

    // A stage without a launch is as before: the profile's shape, exec in the container.
    let once = script("once");
    has(&once, "#SBATCH --nodes=8");
    has(&once, "#SBATCH --ntasks-per-node=3");
    assert!(!once.iter().any(|l| l.contains("MASTER_")), "{once:?}");
    assert!(
        once.iter()
            .any(|l| l.starts_with("srun --container-image=img.sqsh ") && !l.contains(" -- ")),
        "{once:?}"
    );
}
