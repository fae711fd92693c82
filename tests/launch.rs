//! `resources.launch`: a stage whose command starts once per rank (docs/slurm.md, "Multi-node
//! stages"). What needs no cluster: the manifest checks and local runs.

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
