//! The Slurm executor against a real Slurm cluster.
//!
//! `scripts/test` brings up a single-node cluster (`scripts/slurm-up`) and sets
//! `NEMO_DAG_REQUIRE_SLURM=1`, so on CI these tests run for real. Run alone without a cluster,
//! each test prints why it skips.

use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::{Project, output};

/// Whether a cluster with a usable node answers; panics if one is required and does not.
fn cluster_up(test: &str) -> bool {
    let ok = Command::new("sinfo")
        .args(["-h", "-o", "%T"])
        .output()
        .map(|o| {
            let states = String::from_utf8_lossy(&o.stdout);
            o.status.success()
                && ["idle", "mixed", "allocated", "completing"]
                    .iter()
                    .any(|s| states.contains(s))
        })
        .unwrap_or(false);
    if !ok {
        if std::env::var("NEMO_DAG_REQUIRE_SLURM").as_deref() == Ok("1") {
            panic!("{test}: NEMO_DAG_REQUIRE_SLURM=1 but no usable Slurm node answers `sinfo`");
        }
        eprintln!("skipping {test}: no Slurm cluster here (start one with scripts/slurm-up)");
    }
    ok
}

/// A project for one test: the shared temp project, plus an `env.toml` with a `lab` profile and
/// a project-root marker (the env.toml search stops there).
fn project(name: &str) -> Project {
    let p = Project::new(&format!("slurm-{name}"));
    p.write(
        "env.toml",
        "[lab]\nexecutor = \"slurm\"\ntime = \"00:05:00\"\nenv_vars = {NEMO_DAG_TEST = \"1\"}\n",
    );
    p.write(".git", "");
    p
}

fn stages(v: &Value) -> Vec<(String, String, Option<String>)> {
    v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["name"].as_str().unwrap().to_string(),
                s["state"].as_str().unwrap().to_string(),
                s["key"].as_str().map(str::to_string),
            )
        })
        .collect()
}

const DIAMOND: &str = r#"
stages:
  gen:
    op: cmd
    params: {n: 5}
    outputs: {nums: nums.txt}
    cmd: "seq {params.n} > {outputs.nums}"
  double:
    op: cmd
    inputs: {nums: "gen:nums"}
    outputs: {out: out.txt}
    cmd: "awk '{print 2*$1}' {inputs.nums} > {outputs.out}"
  square:
    op: cmd
    inputs: {nums: "gen:nums"}
    outputs: {out: out.txt}
    cmd: "awk '{print $1*$1}' {inputs.nums} > {outputs.out}"
  total:
    op: cmd
    inputs: {a: "double:out", b: "square:out"}
    outputs: {sum: sum.txt}
    cmd: "cat {inputs.a} {inputs.b} | awk '{s+=$1} END {print s}' > {outputs.sum}"
"#;

/// Wait until `status --json` says every stage is up to date.
fn wait_up_to_date(p: &Project, manifest: &str, limit: Duration) -> Value {
    let start = Instant::now();
    loop {
        let v = p.json(&["status", manifest, "--json"]);
        if stages(&v).iter().all(|(_, s, _)| s == "up-to-date") {
            return v;
        }
        if start.elapsed() >= limit {
            // Show what the jobs said: a failure here is otherwise undiagnosable after the fact.
            let logs: Vec<String> = v["stages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| s["job"]["log"].as_str())
                .map(|l| {
                    format!(
                        "--- {l}\n{}",
                        std::fs::read_to_string(l).unwrap_or_default()
                    )
                })
                .collect();
            panic!("not up to date after {limit:?}: {v}\n{}", logs.join("\n"));
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

#[test]
fn a_pipeline_through_slurm_reaches_the_same_keys_as_a_local_run() {
    if !cluster_up("slurm_same_keys") {
        return;
    }
    let p = project("keys");
    p.write("d.yaml", DIAMOND);
    let local = p.json(&["run", "d.yaml", "--json", "--store", "local-store"]);
    // The cluster run is tracked in MLflow, from here, once its jobs have ended.
    let mlflow = crate::track::Mlflow::start("slurm_same_keys");
    if let Some(server) = &mlflow {
        let env = std::fs::read_to_string(p.path("env.toml")).unwrap();
        p.write(
            "env.toml",
            &format!("{env}[mlflow]\ntracking_uri = \"{}\"\n", server.uri),
        );
    }
    let out = p.run(&["run", "d.yaml", "--run", "lab", "--json"]);
    assert!(out.code == 0, "{}", out);
    let cluster: Value = out.json();
    let mut a = stages(&local);
    let mut b = stages(&cluster);
    a.sort();
    b.sort();
    assert_eq!(a.len(), 4);
    for ((na, _, ka), (nb, sb, kb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert_eq!(sb, "executed", "{nb} on the cluster");
        assert_eq!(ka, kb, "stage {na}: local and Slurm keys differ");
    }
    // The published result is the same bytes.
    let show = p.json(&["show", "total", "--manifest", "d.yaml", "--json"]);
    let sum = std::fs::read_to_string(show["outputs"]["sum"]["path"].as_str().unwrap()).unwrap();
    assert_eq!(sum.trim(), (2 * 15 + 55).to_string());
    // The run is in the history as the user ran it, not as its last job did, each stage built.
    let runs = p.json(&["runs", "d.yaml", "--json"]);
    let run = &runs["runs"][0];
    assert_eq!(runs["runs"].as_array().map(Vec::len), Some(1), "{runs}");
    assert!(
        run["argv"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == "--run")),
        "{run}"
    );
    for (name, stage) in run["stages"].as_object().unwrap() {
        assert_eq!(stage["outcome"], "executed", "{name}: {run}");
    }
    if let Some(server) = &mlflow {
        assert!(out.stderr.contains("mlflow: 4 stage(s) logged"), "{out}");
        let mut tracked: Vec<(String, String)> = server
            .runs("d")
            .iter()
            .map(|r| {
                let key = r["tags"]["nemo_dag.key"].as_str().unwrap_or("");
                (
                    r["name"].as_str().unwrap_or("").to_string(),
                    key.to_string(),
                )
            })
            .collect();
        tracked.sort();
        let built: Vec<(String, String)> = b
            .iter()
            .map(|(name, _, key)| (name.clone(), key.clone().unwrap_or_default()))
            .collect();
        assert_eq!(tracked, built, "an MLflow run per stage the jobs built");
    }
    // A second --batch of the up-to-date pipeline submits nothing.
    let again = p.run(&["run", "d.yaml", "--batch", "lab"]);
    assert!(again.code == 0, "{}", again);
    let err = again.stderr.as_str();
    assert!(err.contains("submitted 0 job(s)"), "{}", again);
}

#[test]
fn batch_returns_before_the_jobs_finish_and_status_follows_them() {
    if !cluster_up("slurm_batch") {
        return;
    }
    let p = project("batch");
    p.write(
        "s.yaml",
        r#"
stages:
  slow:
    op: cmd
    outputs: {o: o.txt}
    cmd: "sleep 4; echo slow > {outputs.o}"
  after:
    op: cmd
    inputs: {i: "slow:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
"#,
    );
    let start = Instant::now();
    let out = p.run(&["run", "s.yaml", "--batch", "lab", "--json"]);
    let took = start.elapsed();
    assert!(out.code == 0, "{}", out);
    assert!(
        took < Duration::from_secs(3),
        "--batch took {took:?}: it must not wait for the jobs"
    );
    let v: Value = out.json();
    assert!(stages(&v).iter().all(|(_, s, _)| s == "submitted"), "{v}");

    let status = p.json(&["status", "s.yaml", "--json"]);
    let slow = &status["stages"][0];
    assert_eq!(slow["name"], "slow");
    assert!(
        matches!(
            slow["job"]["state"].as_str(),
            Some("PENDING" | "RUNNING" | "CONFIGURING")
        ),
        "status should show the queued job: {status}"
    );
    let after = &status["stages"][1];
    assert_eq!(after["state"], "pending-upstream");
    assert_eq!(after["job"]["state"], "PENDING", "{status}");

    wait_up_to_date(&p, "s.yaml", Duration::from_secs(60));
}

#[test]
fn a_failing_stage_cancels_its_dependents_and_points_at_its_log() {
    if !cluster_up("slurm_failure") {
        return;
    }
    let p = project("fail");
    p.write(
        "f.yaml",
        r#"
stages:
  ok:
    op: cmd
    outputs: {o: o.txt}
    cmd: "echo ok > {outputs.o}"
  broken:
    op: cmd
    inputs: {i: "ok:o"}
    outputs: {o: o.txt}
    cmd: "echo about to fail; exit 3"
  downstream:
    op: cmd
    inputs: {i: "broken:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
"#,
    );
    let out = p.run(&["run", "f.yaml", "--run", "lab", "--json"]);
    assert_eq!(out.code, 1, "{}", out);
    let v: Value = out.json();
    let s = stages(&v);
    let state = |n: &str| s.iter().find(|(name, _, _)| name == n).unwrap().1.clone();
    assert_eq!(state("ok"), "executed");
    assert_eq!(state("broken"), "failed");
    assert_eq!(state("downstream"), "skipped");
    let broken = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "broken")
        .unwrap();
    let log = broken["log"].as_str().unwrap();
    assert!(
        std::fs::read_to_string(log)
            .unwrap()
            .contains("about to fail")
    );

    let status = p.json(&["status", "f.yaml", "--json"]);
    let down = status["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "downstream")
        .unwrap();
    assert_eq!(down["job"]["state"], "CANCELLED", "{status}");
    let because = down["job"]["because"].as_str().unwrap_or("");
    assert!(
        because.contains("broken") && because.contains(log),
        "{status}"
    );
}

#[test]
fn cancel_stops_the_queued_and_running_jobs() {
    if !cluster_up("slurm_cancel") {
        return;
    }
    let p = project("cancel");
    p.write(
        "c.yaml",
        r#"
stages:
  long:
    op: cmd
    outputs: {o: o.txt}
    cmd: "sleep 60; echo > {outputs.o}"
  next:
    op: cmd
    inputs: {i: "long:o"}
    outputs: {o: o.txt}
    cmd: "cat {inputs.i} > {outputs.o}"
"#,
    );
    let out = p.run(&["run", "c.yaml", "--batch", "lab"]);
    assert!(out.code == 0, "{}", out);
    let out = p.run(&["cancel", "c.yaml"]);
    assert!(out.code == 0, "{}", out);
    let said = out.stdout.as_str();
    assert!(
        said.contains("cancelled long") && said.contains("cancelled next"),
        "{}",
        out
    );
    let start = Instant::now();
    loop {
        let status = p.json(&["status", "c.yaml", "--json"]);
        let states: Vec<&str> = status["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["job"]["state"].as_str().unwrap_or(""))
            .collect();
        if states.iter().all(|s| *s == "CANCELLED") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "jobs not cancelled: {status}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// A cluster whose nodes do not see the submitting store: each job gets an empty store of its
/// own (`node_store` with `$SLURM_JOB_ID`), pulls its inputs from the shared cache and pushes
/// what it builds; `--run` brings the results back, and another machine pulls them all.
#[test]
fn jobs_with_stores_of_their_own_pull_their_inputs_and_push_what_they_build() {
    use crate::cache::{Server, cache_section, endpoint, nd};
    if !cluster_up("slurm_node_store") {
        return;
    }
    let Some(server) = Server::start("slurm-node-store") else {
        return;
    };
    let machine = |name: &str| {
        let p = Project::new(&format!("slurm-node-store-{name}"));
        let nodes = p.dir.join("nodes").display().to_string();
        p.write(
            "env.toml",
            &format!(
                "[lab]\nexecutor = \"slurm\"\ntime = \"00:05:00\"\nnode_store = \"{nodes}/job-$SLURM_JOB_ID\"\n\n{}",
                cache_section(&endpoint(&server), &["main"], Some("main"))
            ),
        );
        p.write(".git", "");
        p.write("d.yaml", DIAMOND);
        p
    };
    let a = machine("a");
    let out = nd(&a, &["run", "d.yaml", "--run", "lab", "--json"]);
    assert_eq!(out.code, 0, "{out}");
    let cluster: Value = out.json();
    assert!(
        stages(&cluster).iter().all(|(_, s, _)| s == "executed"),
        "{cluster}"
    );
    // One store per job, each built from nothing: `total` pulled both of its inputs.
    let job_stores = std::fs::read_dir(a.dir.join("nodes")).unwrap().count();
    assert_eq!(job_stores, 4, "a store of its own for each of the 4 jobs");
    let slurm = a.store().join("slurm");
    let logs = crate::common::find_named(&slurm, "total.log");
    assert_eq!(logs.len(), 1, "{logs:?}");
    let total_log = std::fs::read_to_string(slurm.join(&logs[0])).unwrap();
    for input in ["double", "square"] {
        assert!(
            total_log.contains(&format!("pulled `{input}`")),
            "total's job pulled {input}: {total_log}"
        );
    }
    assert!(total_log.contains("pushed `total`"), "{total_log}");
    // Further up is only keyed, from the cache's records: `gen` stays where it is.
    assert!(!total_log.contains("pulled `gen`"), "{total_log}");
    // The results came back here: up to date, with the keys a local run gives.
    let record = a.json(&["status", "d.yaml", "--json"]);
    assert!(
        stages(&record).iter().all(|(_, s, _)| s == "up-to-date"),
        "{record}"
    );
    let local = a.json(&[
        "run",
        "d.yaml",
        "--json",
        "--store",
        "local-store",
        "--offline",
    ]);
    let mut here = stages(&record);
    let mut there = stages(&local);
    here.sort();
    there.sort();
    for ((name, _, k1), (_, _, k2)) in here.iter().zip(&there) {
        assert_eq!(k1, k2, "stage {name}: the cluster's key is a local run's");
    }
    // Another machine submits nothing: the cache has it all.
    let b = machine("b");
    let out = nd(&b, &["run", "d.yaml", "--run", "lab", "--json"]);
    assert_eq!(out.code, 0, "{out}");
    assert!(out.stderr.contains("submitted 0 job(s)"), "{out}");
    let pulled: Value = out.json();
    assert!(
        stages(&pulled).iter().all(|(_, s, _)| s == "pulled"),
        "{pulled}"
    );
    assert!(!b.dir.join("nodes").exists(), "no job ran for b");
    // Without a cache to carry them, node stores are refused before anything is submitted.
    let offline = nd(
        &b,
        &[
            "run",
            "d.yaml",
            "--run",
            "lab",
            "--offline",
            "--force",
            "gen",
        ],
    );
    assert_eq!(offline.code, 2, "{offline}");
    assert!(
        offline.stderr.contains("node_store") || offline.stderr.contains("on the node"),
        "{offline}"
    );
}

#[test]
fn dry_run_prints_every_script_and_the_chain_and_submits_nothing() {
    if !cluster_up("slurm_dry_run") {
        return;
    }
    let p = project("dry");
    p.write("d.yaml", DIAMOND);
    // The container sees the project and its store at the same path (checked before submit).
    let shared = p.dir.display().to_string();
    p.write(
        "env.toml",
        &format!(
            "[lab]\nexecutor = \"slurm\"\npartition = \"debug\"\naccount = \"llm\"\ncontainer_image = \"img.sqsh\"\nmounts = [\"/data:/data\", \"{shared}:{shared}\"]\nenv_vars = {{NEMO_DAG_TEST = \"1\"}}\n"
        ),
    );
    let out = p.run(&["run", "d.yaml", "--batch", "lab", "--dry-run"]);
    assert!(out.code == 0, "{}", out);
    let script = out.stdout.as_str();
    for stage in ["gen", "double", "square", "total"] {
        assert!(
            script.contains(&format!("--job-name=d.{stage}")),
            "{script}"
        );
    }
    assert!(script.contains("#SBATCH --partition=debug"), "{script}");
    assert!(script.contains("#SBATCH --account=llm"), "{script}");
    assert!(
        script.contains(&format!(
            "--container-image=img.sqsh --container-mounts=/data:/data,{shared}:{shared}"
        )),
        "{script}"
    );
    assert!(
        script.contains("# waits for: double, square (afterok)"),
        "{script}"
    );
    assert!(script.contains("--kill-on-invalid-dep=yes"), "{script}");
    assert!(
        script.contains("export NEMO_DAG_TEST=1"),
        "profile env_vars are exported: {script}"
    );
    assert!(
        !Path::new(&p.dir.join(".nemo-dag")).exists(),
        "a dry run must write nothing"
    );
}

#[test]
fn a_requeued_job_runs_again_and_publishes() {
    if !cluster_up("slurm_requeue") {
        return;
    }
    let p = project("requeue");
    p.write(
        "q.yaml",
        r#"
stages:
  train:
    op: cmd
    outputs: {o: o.txt}
    cmd: "echo attempt $SLURM_RESTART_COUNT >> {outputs.o}; sleep 3; echo done >> {outputs.o}"
    resources: {requeue: true}
"#,
    );
    let out = p.run(&["run", "q.yaml", "--batch", "lab"]);
    assert!(out.code == 0, "{}", out);
    let status = p.json(&["status", "q.yaml", "--json"]);
    let id = status["stages"][0]["job"]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let key = status["stages"][0]["key"].as_str().unwrap().to_string();
    // Requeue it while it runs.
    let start = Instant::now();
    while p.json(&["status", "q.yaml", "--json"])["stages"][0]["job"]["state"] != "RUNNING" {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "job {id} never started"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Requeue only once the command itself is running (its first line is written), not while
    // `nemo-dag exec` is still starting up.
    // (Each attempt builds in a directory of its own, `tmp/<key>.<attempt>/`.)
    let tmp = p.dir.join(".nemo-dag/tmp");
    let written = || {
        crate::common::find_named(&tmp, "o.txt").iter().any(|rel| {
            rel.starts_with(&key)
                && std::fs::read_to_string(tmp.join(rel)).is_ok_and(|t| t.starts_with("attempt"))
        })
    };
    while !written() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "job {id} never wrote out/o.txt under {}",
            tmp.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut requeue = Command::new("scontrol");
    requeue.args(["requeue", &id]);
    let rq = output(requeue);
    assert!(rq.code == 0, "{rq}");
    // The rerun waits out Slurm's hold (cred_expire + 1 s, 11 s on the test cluster). Forcing it
    // earlier with `scontrol update StartTime=now` races the node's credential revocation and
    // can fail the job ("Job credential revoked"); see docs/slurm-setup-notes.md.
    wait_up_to_date(&p, "q.yaml", Duration::from_secs(60));
    let show = p.json(&["show", "train", "--manifest", "q.yaml", "--json"]);
    let o = std::fs::read_to_string(show["outputs"]["o"]["path"].as_str().unwrap()).unwrap();
    // The first attempt was killed before publishing; only the second attempt's output exists.
    assert_eq!(o, "attempt 1\ndone\n", "published output: {o:?}");
}

/// Two ranks of one stage find each other over TCP at `MASTER_ADDR:MASTER_PORT` (plain sockets:
/// rank 0 listens, rank 1 connects, each sends its rank), then each writes what it heard. With
/// a `fail` rank, that rank exits 3 at once instead.
const RENDEZVOUS: &str = r#"
import os, socket, sys, time

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
local = int(os.environ["LOCAL_RANK"])
addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
out, fail = sys.argv[1], int(sys.argv[2])
if rank == fail:
    sys.exit(3)
if rank == 0:
    server = socket.create_server((addr, port))
    server.settimeout(60)
    conn, _ = server.accept()
else:
    deadline = time.time() + 60
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
conn.settimeout(60)
conn.sendall(b"%d\n" % rank)
peer = conn.makefile().readline().strip()
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "rank-%d.txt" % rank), "w") as f:
    f.write("rank %d of %d (local %d) heard rank %s\n" % (rank, world, local, peer))
"#;

fn two_ranks(fail: i32) -> String {
    format!(
        r#"
stages:
  ranks:
    op: cmd
    params: {{fail: {fail}}}
    inputs: {{prog: rendezvous.py}}
    outputs: {{d: ranks}}
    cmd: "python3 {{inputs.prog}} {{outputs.d}} {{params.fail}}"
    resources: {{launch: srun, nodes: 1, ntasks_per_node: 2}}
  after:
    op: cmd
    inputs: {{d: "ranks:d"}}
    outputs: {{o: o.txt}}
    cmd: "cat {{inputs.d}}/rank-0.txt {{inputs.d}}/rank-1.txt > {{outputs.o}}"
"#
    )
}

#[test]
fn two_ranks_rendezvous_over_tcp_and_their_stage_publishes_once() {
    if !cluster_up("slurm_two_ranks") {
        return;
    }
    let p = project("ranks");
    p.write("rendezvous.py", RENDEZVOUS);
    p.write("r.yaml", &two_ranks(-1));
    let out = p.run(&["run", "r.yaml", "--run", "lab", "--json"]);
    assert!(out.code == 0, "{}", out);
    let v: Value = out.json();
    let s = stages(&v);
    assert!(s.iter().all(|(_, state, _)| state == "executed"), "{v}");
    // The dependent read both ranks' files from the one published output.
    let show = p.json(&["show", "after", "--manifest", "r.yaml", "--json"]);
    let o = std::fs::read_to_string(show["outputs"]["o"]["path"].as_str().unwrap()).unwrap();
    assert_eq!(
        o,
        "rank 0 of 2 (local 0) heard rank 1\nrank 1 of 2 (local 1) heard rank 0\n"
    );
    // One artifact for the stage, written by one `nemo-dag exec`, holding both ranks.
    let show = p.json(&["show", "ranks", "--manifest", "r.yaml", "--json"]);
    let dir = Path::new(show["outputs"]["d"]["path"].as_str().unwrap());
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(files, ["rank-0.txt", "rank-1.txt"]);
}

#[test]
fn a_failing_rank_fails_its_stage_and_cancels_the_dependents() {
    if !cluster_up("slurm_failing_rank") {
        return;
    }
    let p = project("rank-fails");
    p.write("rendezvous.py", RENDEZVOUS);
    p.write("r.yaml", &two_ranks(1));
    let start = Instant::now();
    let out = p.run(&["run", "r.yaml", "--run", "lab", "--json"]);
    assert_eq!(out.code, 1, "{}", out);
    // Rank 0 waits for rank 1 in accept(); the stage must not wait out its 60 s timeout.
    assert!(
        start.elapsed() < Duration::from_secs(45),
        "rank 0 outlived the failed rank 1 by {:?}",
        start.elapsed()
    );
    let v: Value = out.json();
    let s = stages(&v);
    let state = |n: &str| s.iter().find(|(name, _, _)| name == n).unwrap().1.clone();
    assert_eq!(state("ranks"), "failed", "{v}");
    assert_eq!(state("after"), "skipped", "{v}");
    let status = p.json(&["status", "r.yaml", "--json"]);
    let of = |n: &str| {
        status["stages"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == n)
            .unwrap()
            .clone()
    };
    assert_eq!(of("ranks")["state"], "stale", "nothing published: {status}");
    assert_eq!(of("ranks")["job"]["state"], "FAILED", "{status}");
    assert_eq!(of("after")["job"]["state"], "CANCELLED", "{status}");
    let ranks = v["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["name"] == "ranks")
        .unwrap();
    let error = ranks["error"].as_str().unwrap_or("");
    assert!(
        error.contains("under `srun`") && error.contains("which rank"),
        "the error says a rank failed and where to look: {v}"
    );
    let log = std::fs::read_to_string(ranks["log"].as_str().unwrap()).unwrap();
    assert!(
        log.contains("task 1: Exited with exit code 3"),
        "srun names the failed rank: {log}"
    );
}

/// The Megatron stand-in project (`megatron::project`) with a `lab` profile and its pretrain
/// stage launched as 2 ranks under srun.
fn megatron_on_two_ranks(name: &str) -> Project {
    let p = crate::megatron::project(name);
    p.write(
        "env.toml",
        "[lab]\nexecutor = \"slurm\"\ntime = \"00:05:00\"\n",
    );
    p.write(".git", "");
    let text = std::fs::read_to_string(p.path("m.yaml")).unwrap().replacen(
        "    op: megatron_pretrain\n",
        "    op: megatron_pretrain\n    resources: {launch: srun, ntasks_per_node: 2}\n",
        1,
    );
    p.write("m.yaml", &text);
    p
}

#[test]
fn a_megatron_stage_runs_once_per_rank_under_srun_and_publishes_once() {
    if !cluster_up("slurm_megatron_ranks") {
        return;
    }
    use crate::megatron;
    let p = megatron_on_two_ranks("slurm-mb");
    let out = megatron::run(
        &p,
        &["run", "m.yaml", "--target", "pretrain", "--run", "lab"],
        &[],
    );
    assert_eq!(out.code, 0, "{out}");
    // run_recipe.py started once per rank, each told its rank; rank 0 saved.
    let mut ranks: Vec<u64> = megatron::launches(&p)
        .iter()
        .map(|l| l["rank"].as_u64().unwrap())
        .collect();
    ranks.sort();
    assert_eq!(ranks, [0, 1]);
    let script =
        std::fs::read_to_string(megatron::output(&p, "pretrain", "run").join("launch.sh")).unwrap();
    assert!(
        script.contains("exec srun --nodes=1 --ntasks=2"),
        "{script}"
    );
    megatron::assert_final_iteration_alone(&p, "iter_0000010");
}

#[test]
fn a_sigterm_to_the_ranks_saves_the_iteration_in_progress_and_the_next_run_resumes_from_it() {
    if !cluster_up("slurm_megatron_sigterm") {
        return;
    }
    use crate::megatron;
    let p = megatron_on_two_ranks("slurm-mb-term");
    // The data here, so that only the training stage waits for the (shared) test cluster.
    let data = megatron::run(&p, &["run", "m.yaml", "--target", "pretrain_data"], &[]);
    assert_eq!(data.code, 0, "{data}");
    let args = ["run", "m.yaml", "vars.steps=40", "--target", "pretrain"];
    let pace = [("FAKE_MB_SECONDS_PER_ITER", "0.3")];
    let out = megatron::run(&p, &[&args[..], &["--batch", "lab"]].concat(), &pace);
    assert_eq!(out.code, 0, "{out}");
    // Once iteration 4 is saved, Slurm signals the job's steps (the ranks, not the batch
    // shell), as `--signal=TERM@…` does before a time limit (here 75 s before the profile's
    // 5 minutes, long after the 12 s this stage takes).
    let saved = p.store().join("tmp");
    let at_4 = || !crate::common::find_named(&saved, "iter_0000004").is_empty();
    if !crate::common::wait_for(Duration::from_secs(600), at_4) {
        let status = p.run(&["status", "m.yaml", "vars.steps=40"]);
        let logs: Vec<String> = crate::common::find_named(&p.store().join("slurm"), "pretrain.log")
            .iter()
            .map(|l| std::fs::read_to_string(p.store().join("slurm").join(l)).unwrap_or_default())
            .collect();
        panic!("iteration 4 was never saved\n{status}\n{logs:#?}");
    }
    let jobs = Command::new("squeue")
        .args(["-h", "-o", "%i", "--name=m.pretrain"])
        .output()
        .unwrap();
    let job = String::from_utf8_lossy(&jobs.stdout).trim().to_string();
    assert!(!job.is_empty(), "no job for pretrain");
    let cancel = Command::new("scancel")
        .args(["--signal=TERM", &job])
        .status()
        .unwrap();
    assert!(cancel.success());
    assert!(
        crate::common::wait_for(Duration::from_secs(60), || {
            let q = Command::new("squeue")
                .args(["-h", "-j", &job])
                .output()
                .unwrap();
            String::from_utf8_lossy(&q.stdout).trim().is_empty()
        }),
        "job {job} did not end"
    );
    let status = p.json(&["status", "m.yaml", "vars.steps=40", "--json"]);
    assert_eq!(
        crate::common::stage(&status, "pretrain")["state"],
        "stale",
        "{status}"
    );

    let out = megatron::run(&p, &[&args[..], &["--run", "lab"]].concat(), &[]);
    assert_eq!(out.code, 0, "{out}");
    let all = megatron::launches(&p);
    let summary: Vec<String> = all
        .iter()
        .map(|l| {
            format!(
                "rank {} at start {} {}",
                l["rank"], l["trackers_at_start"], l["ckpt_at_start"]
            )
        })
        .collect();
    let resumed = all.iter().rev().find(|l| l["rank"] == 0).unwrap();
    let step: u64 = resumed["argv"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find_map(|w| w.strip_prefix("checkpoint.ckpt_step="))
        .unwrap_or_else(|| panic!("no resume: {summary:#?}\n{out}"))
        .parse()
        .unwrap();
    assert!(
        (5..8).contains(&step),
        "resumed from {step}, not the save on SIGTERM: {summary:#?}"
    );
}
