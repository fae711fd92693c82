//! The store under abuse: `kill -9` in the middle of a run never leaves an entry a later run
//! accepts (the rerun completes and reaches the same keys as a clean run), and concurrent runs
//! of one manifest against one store execute each stage exactly once.

use crate::common::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

const CHAIN: &str = r#"stages:
  a:
    op: cmd
    outputs: {o: a.txt}
    cmd: "echo a > {outputs.o}"
  b:
    op: cmd
    inputs: {i: "a:o"}
    outputs: {o: b.txt, part: sub/part.txt}
    cmd: "echo partial > {outputs.part}; sleep 1; cat {inputs.i} > {outputs.o}; echo b >> {outputs.o}"
  c:
    op: cmd
    inputs: {i: "b:o"}
    outputs: {o: c.txt}
    cmd: "cat {inputs.i} > {outputs.o}; echo c >> {outputs.o}"
"#;

fn published_count(store: &Path) -> usize {
    artifact_dirs(store)
        .iter()
        .filter(|d| d.join("artifact.json").is_file())
        .count()
}

/// Every published entry is whole: `artifact.json` present and every output it lists there.
fn assert_no_partial_entries(store: &Path, when: &str) {
    for d in artifact_dirs(store) {
        let meta = d.join("artifact.json");
        assert!(
            meta.is_file(),
            "{when}: {} has no artifact.json (a partial entry)",
            d.display()
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&meta).unwrap())
            .unwrap_or_else(|e| panic!("{when}: {} is not JSON: {e}", meta.display()));
        for (name, out) in v["outputs"].as_object().into_iter().flatten() {
            let rel = out["path"].as_str().unwrap_or_default();
            assert!(
                d.join(rel).exists(),
                "{when}: output {name} ({rel}) of {} is missing",
                d.display()
            );
        }
    }
}

/// Every live descendant of `pid` (by the parent pids in /proc).
fn descendants(pid: u32) -> Vec<u32> {
    let mut parent: BTreeMap<u32, u32> = BTreeMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces and parens, so split after the last ')'.
        if let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..])
            && let Some(ppid) = rest.split_whitespace().nth(1).and_then(|s| s.parse().ok())
        {
            parent.insert(p, ppid);
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for (&child, &pp) in &parent {
            if pp == p {
                out.push(child);
                todo.push(child);
            }
        }
    }
    out
}

/// `kill -9` a process and everything it started. It is stopped first, so that it cannot
/// start another process between the listing and the kill.
fn kill_tree(pid: u32) {
    let _ = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status();
    let mut pids: Vec<String> = vec![pid.to_string()];
    pids.extend(descendants(pid).iter().map(u32::to_string));
    let _ = Command::new("kill").arg("-9").args(&pids).status();
}

/// Start a run, wait until stage `a` is published (so `b` is mid-command), wait `delay`, then
/// `kill -9` the run process — and, with `whole_tree`, every process it started, as a crash of
/// the machine would. Then a plain rerun must complete with the keys of a clean run.
fn kill_then_rerun(delay_ms: u64, whole_tree: bool, clean_keys: &BTreeMap<String, Option<String>>) {
    let p = Project::new(&format!("kill9-{delay_ms}-{whole_tree}"));
    p.write("chain.yaml", CHAIN);
    let store = p.store();
    let mut child = p.spawn(&["run", "chain.yaml", "--json"]);
    let published = wait_for(Duration::from_secs(20), || published_count(&store) >= 1);
    assert!(published, "stage a was never published");
    std::thread::sleep(Duration::from_millis(delay_ms));
    if whole_tree {
        kill_tree(child.id());
    } else {
        child.kill().unwrap(); // SIGKILL
    }
    let killed = child.wait().unwrap();
    assert!(!killed.success(), "the run was meant to be killed mid-way");
    assert_no_partial_entries(&store, "right after kill -9");
    if whole_tree {
        // b was mid-command (it sleeps 1 s): it must not count as built.
        assert_eq!(
            published_count(&store),
            1,
            "only a was published before the kill"
        );
        let status = p.json(&["status", "chain.yaml", "--json"]);
        let st = states(&status);
        assert_eq!(st["a"], "up-to-date", "{status}");
        assert_ne!(
            st["b"], "up-to-date",
            "a killed build is not a result: {status}"
        );
        assert_ne!(st["c"], "up-to-date", "{status}");
    }

    let rerun = p.run(&["run", "chain.yaml", "--json"]);
    assert_eq!(rerun.code, 0, "the rerun after kill -9 completes\n{rerun}");
    let v = rerun.json();
    assert_eq!(
        &keys(&v),
        clean_keys,
        "the rerun reaches a clean run's keys"
    );
    assert_eq!(
        states(&v)["a"],
        "cached",
        "a was published before the kill: {v}"
    );
    if whole_tree {
        assert_eq!(
            states(&v)["b"],
            "executed",
            "b is built again from scratch: {v}"
        );
    }
    assert_no_partial_entries(&store, "after the rerun");
    assert_eq!(p.published(&key_of(&v, "c"), "c.txt"), "a\nb\nc\n");
    assert_eq!(p.published(&key_of(&v, "b"), "sub/part.txt"), "partial\n");
    // And everything is settled now.
    let status = p.json(&["status", "chain.yaml", "--json"]);
    assert!(
        states(&status).values().all(|s| s == "up-to-date"),
        "{status}"
    );
}

#[test]
fn kill_9_mid_run_then_rerun_completes_with_the_same_keys() {
    let clean = Project::new("kill9-clean");
    clean.write("chain.yaml", CHAIN);
    let v = clean.json(&["run", "chain.yaml", "--json"]);
    assert!(states(&v).values().all(|s| s == "executed"), "{v}");
    let clean_keys = keys(&v);

    // Only the run process (its stage processes live on, as after `kill -9` of one pid).
    kill_then_rerun(0, false, &clean_keys);
    kill_then_rerun(300, false, &clean_keys);
    // The run and every process it started (b is mid-command, its tmp entry half-written).
    kill_then_rerun(0, true, &clean_keys);
    kill_then_rerun(300, true, &clean_keys);
}

#[test]
fn kill_9_at_arbitrary_instants_never_leaves_an_accepted_partial_entry() {
    let clean = Project::new("kill9-any-clean");
    clean.write("chain.yaml", CHAIN);
    let clean_keys = keys(&clean.json(&["run", "chain.yaml", "--json"]));
    // Kill the whole tree at a few instants from the very start (loading, publishing a, ...).
    for delay_ms in [0u64, 20, 60, 150] {
        let p = Project::new(&format!("kill9-any-{delay_ms}"));
        p.write("chain.yaml", CHAIN);
        let mut child = p.spawn(&["run", "chain.yaml", "--json"]);
        std::thread::sleep(Duration::from_millis(delay_ms));
        kill_tree(child.id());
        let _ = child.wait();
        assert_no_partial_entries(&p.store(), &format!("kill -9 after {delay_ms} ms"));
        let rerun = p.run(&["run", "chain.yaml", "--json"]);
        assert_eq!(rerun.code, 0, "rerun after kill at {delay_ms} ms\n{rerun}");
        assert_eq!(keys(&rerun.json()), clean_keys);
        assert_eq!(
            p.published(&clean_keys["c"].clone().unwrap(), "c.txt"),
            "a\nb\nc\n"
        );
        assert_no_partial_entries(&p.store(), "after the rerun");
    }
}

#[test]
fn concurrent_runs_execute_each_stage_once() {
    let p = Project::new("concurrent");
    let counter = p.path("counter.log");
    let mut yaml = format!("vars:\n  counter: \"{}\"\nstages:\n", counter.display());
    // root → (left, right) → join; every command appends its name to a file outside the store.
    let stages = [
        ("root", ""),
        ("left", "root"),
        ("right", "root"),
        ("join", "left"),
    ];
    for (name, dep) in stages {
        yaml.push_str(&format!("  {name}:\n    op: cmd\n"));
        yaml.push_str(&format!(
            "    params: {{counter: \"{{{{ counter }}}}\", tag: {name}}}\n"
        ));
        if !dep.is_empty() {
            let extra = if name == "join" {
                ", r: \"right:o\""
            } else {
                ""
            };
            yaml.push_str(&format!("    inputs: {{i: \"{dep}:o\"{extra}}}\n"));
        }
        yaml.push_str(
            "    outputs: {o: o.txt}\n    cmd: \"echo {params.tag} >> {params.counter}; sleep 0.3; echo done > {outputs.o}\"\n",
        );
    }
    p.write("c.yaml", &yaml);

    let runs: Vec<_> = (0..2)
        .map(|_| p.spawn(&["run", "c.yaml", "--json"]))
        .collect();
    let outs: Vec<Out> = runs.into_iter().map(child_output).collect();
    for o in &outs {
        assert_eq!(o.code, 0, "both concurrent runs succeed\n{o}");
    }
    let lines = std::fs::read_to_string(&counter).unwrap();
    for (name, _) in stages {
        let n = lines.lines().filter(|l| *l == name).count();
        assert_eq!(n, 1, "stage {name} ran {n} times in total:\n{lines}");
    }
    let v: Vec<_> = outs.iter().map(Out::json).collect();
    assert_eq!(keys(&v[0]), keys(&v[1]), "both runs reach the same keys");
    // A run reports `executed` only for what it ran itself; the other run found it published.
    for (name, _) in stages {
        let executed = v.iter().filter(|r| states(r)[name] == "executed").count();
        assert_eq!(executed, 1, "stage {name}: runs {:?} / {:?}", v[0], v[1]);
    }
    assert_no_partial_entries(&p.store(), "after concurrent runs");
    assert_eq!(p.artifact_dirs().len(), 4);
}

/// Ctrl-C stops the running stages' whole command trees, publishes nothing partial, exits 130,
/// and a rerun completes.
#[test]
fn ctrl_c_stops_children_and_publishes_nothing_partial() {
    let p = Project::new("ctrl-c");
    p.write("m.yaml", CHAIN);
    let child = p.spawn(&["run", "m.yaml"]);
    let store = p.store();
    assert!(
        wait_for(Duration::from_secs(10), || published_count(&store) == 1),
        "stage a was never published"
    );
    // b is now sleeping; interrupt the run as a terminal's Ctrl-C would.
    let pid = child.id();
    std::thread::sleep(Duration::from_millis(200));
    let sent = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = child_output(child);
    assert_eq!(out.code, 130, "{}", out.stderr);
    assert!(out.stderr.contains("interrupted"), "{}", out.stderr);
    assert_eq!(published_count(&store), 1, "only a is published");
    assert_no_partial_entries(&store, "after Ctrl-C");
    // b's command tree is gone: nothing writes b's outputs after we return.
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(published_count(&store), 1);
    let rerun = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(
        states(&rerun),
        expect(&[("a", "cached"), ("b", "executed"), ("c", "executed")])
    );
}
