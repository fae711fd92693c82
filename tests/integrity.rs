//! What the store serves is what was published: a killed run leaves no process writing into an
//! attempt a later run reuses; `gc` during a run deletes nothing the run needs; an entry edited,
//! emptied or half-removed after publication is refused or rebuilt, never served; inputs are
//! hashed as the ops read them; and what `run` promises at its end (the run record) is written
//! or the run fails.

use crate::common::*;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Three background writers, each appending one line a second after the stage starts. A run
/// killed during that second leaves them running unless the engine kills the stage's group.
const FORKS: &str = r#"stages:
  forks:
    op: cmd
    outputs: {o: o.txt}
    cmd: "touch {outputs.o}; for i in 1 2 3; do (sleep 1; echo $i >> {outputs.o}) & done; wait"
"#;

/// Processes that belong to a stage of this store: `cmd` stages run with `NEMO_DAG_OUT` set to
/// their attempt's output directory, which lies inside the store.
fn stage_processes(store: &Path) -> Vec<u32> {
    let needle = format!("NEMO_DAG_OUT={}", store.display());
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(env) = std::fs::read(e.path().join("environ")) else {
            continue;
        };
        if env
            .split(|b| *b == 0)
            .any(|var| String::from_utf8_lossy(var).starts_with(&needle))
        {
            found.push(pid);
        }
    }
    found
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(child) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid …: comm may hold spaces and parens, so split after the last ')'.
        let ppid = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if ppid == Some(pid) {
            found.push(child);
        }
    }
    found
}

fn sorted_lines(text: &str) -> Vec<String> {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    lines.sort();
    lines
}

/// Kill the run (not its children) with `signal` while the stage's writers sleep, rerun, and
/// check that the published output holds exactly one attempt's lines and no writer outlives
/// the run.
fn kill_run_alone(signal: &str) {
    let p = Project::new(&format!("stray-{signal}"));
    p.write("forks.yaml", FORKS);
    let store = p.store();
    let child = p.spawn(&["run", "forks.yaml"]);
    let started = wait_for(Duration::from_secs(20), || {
        stage_processes(&store).len() >= 3
    });
    assert!(started, "the stage's writers never started");
    let status = std::process::Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let killed = child_output(child);
    assert_ne!(killed.code, 0, "a killed run does not succeed\n{killed}");
    // The stage's processes die with the run (the writers sleep 1 s: give them none of it).
    let gone = wait_for(Duration::from_millis(500), || {
        stage_processes(&store).is_empty()
    });
    assert!(
        gone,
        "after kill {signal} of the run, stage processes are still running: {:?}",
        stage_processes(&store)
    );
    let v = p.json(&["run", "forks.yaml", "--json"]);
    let out = p.published(&key_of(&v, "forks"), "o.txt");
    assert_eq!(
        sorted_lines(&out),
        ["1", "2", "3"],
        "the rerun published another attempt's writes too"
    );
}

#[test]
fn sigterm_of_the_run_stops_its_stages_processes() {
    kill_run_alone("-TERM");
}

#[test]
fn sighup_of_the_run_stops_its_stages_processes() {
    kill_run_alone("-HUP");
}

#[test]
fn kill_9_of_the_run_alone_stops_its_stages_processes() {
    kill_run_alone("-KILL");
}

/// A stage's process killed from outside (the OOM killer, say) leaves writers behind; they
/// must not write into what the next attempt publishes.
#[test]
fn a_dead_attempts_writers_never_reach_the_next_attempt() {
    let p = Project::new("dead-attempt");
    p.write("forks.yaml", FORKS);
    let store = p.store();
    let child = p.spawn(&["run", "forks.yaml"]);
    let started = wait_for(Duration::from_secs(20), || {
        stage_processes(&store).len() >= 3
    });
    assert!(started, "the stage's writers never started");
    // kill -9 the stage's `nemo-dag exec` only (the run's one child), as the OOM killer would.
    let exec = children_of(child.id());
    assert_eq!(exec.len(), 1, "the run has one stage running: {exec:?}");
    let exec = exec[0];
    std::process::Command::new("kill")
        .args(["-KILL", &exec.to_string()])
        .status()
        .unwrap();
    let first = child_output(child);
    assert_ne!(first.code, 0, "{first}");
    let v = p.json(&["run", "forks.yaml", "--json"]);
    std::thread::sleep(Duration::from_millis(1500));
    let out = p.published(&key_of(&v, "forks"), "o.txt");
    assert_eq!(sorted_lines(&out), ["1", "2", "3"], "{out}");
}

const SLOW_CONSUMER: &str = r#"stages:
  a:
    op: cmd
    outputs: {o: a.txt}
    cmd: "seq 100 > {outputs.o}"
  b:
    op: cmd
    inputs: {i: "a:o"}
    outputs: {o: b.txt}
    cmd: "sleep 2; cat {inputs.i} | wc -l > {outputs.o}"
"#;

/// `gc` while a run is between two stages must not delete what the run just published.
#[test]
fn gc_during_a_run_deletes_nothing_the_run_uses() {
    let p = Project::new("gc-during-run");
    p.write("m.yaml", SLOW_CONSUMER);
    let store = p.store();
    let child = p.spawn(&["run", "m.yaml", "--json"]);
    let b_started = wait_for(Duration::from_secs(20), || {
        !stage_processes(&store).is_empty()
    });
    assert!(b_started, "stage b never started");
    let gc = p.run(&["gc"]);
    let run = child_output(child);
    assert_eq!(run.code, 0, "the run completes despite gc\n{run}\ngc: {gc}");
    let v = run.json();
    assert_eq!(p.published(&key_of(&v, "b"), "b.txt").trim(), "100");
    assert!(
        store.join("artifacts").join(key_of(&v, "a")).is_dir(),
        "a's artifact survives: gc said\n{gc}"
    );
    if gc.code != 0 {
        assert!(
            gc.stderr.contains("in use"),
            "a gc that cannot run says why\n{gc}"
        );
    }
}

/// A run killed before it writes its record keeps what it published: `gc` afterwards must not
/// delete the stages it finished (the run journals each one as it publishes).
#[test]
fn gc_after_a_killed_run_keeps_what_it_published() {
    let p = Project::new("gc-after-kill");
    p.write("m.yaml", SLOW_CONSUMER);
    let store = p.store();
    let child = p.spawn(&["run", "m.yaml"]);
    let b_started = wait_for(Duration::from_secs(20), || {
        !stage_processes(&store).is_empty() && !p.artifact_dirs().is_empty()
    });
    assert!(b_started, "stage a was never published");
    let published = p.artifact_dirs();
    std::process::Command::new("kill")
        .args(["-KILL", &child.id().to_string()])
        .status()
        .unwrap();
    let killed = child_output(child);
    assert_ne!(killed.code, 0, "{killed}");
    let gone = wait_for(Duration::from_secs(5), || {
        stage_processes(&store).is_empty()
    });
    assert!(gone, "the killed run's stage is still running");
    let gc = p.run(&["gc"]);
    assert_eq!(gc.code, 0, "{gc}");
    for dir in &published {
        assert!(
            dir.is_dir(),
            "gc deleted {}, which the killed run had published\n{gc}",
            dir.display()
        );
    }
    // The next run finds it cached and, once its record is written, drops the journal.
    let v = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(stage(&v, "a")["state"], "cached", "{v}");
    let journals = find_named(&store.join("runs"), ".journal");
    assert!(journals.is_empty(), "journals left: {journals:?}");
}

fn run_record(store: &Path) -> PathBuf {
    let records: Vec<PathBuf> = std::fs::read_dir(store.join("runs"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    assert_eq!(records.len(), 1, "{records:?}");
    records[0].clone()
}

/// A run whose record cannot be written fails: otherwise the next `gc` deletes its results.
#[test]
fn a_run_record_that_cannot_be_written_fails_the_run() {
    let p = Project::new("record-fails");
    p.write("m.yaml", TWO_STAGE_YAML);
    p.ok(&["run", "m.yaml"]);
    let record = run_record(&p.store());
    // A directory where the record goes: the rename onto it fails, as a full disk would.
    std::fs::remove_file(&record).unwrap();
    std::fs::create_dir(&record).unwrap();
    std::fs::write(record.join("x"), "").unwrap();
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr.contains("run record") && out.stderr.contains(&*record.to_string_lossy()),
        "the error names the record\n{out}"
    );
    let leftovers: Vec<String> = find_named(&p.store().join("runs"), ".");
    assert!(
        leftovers.iter().all(|f| !f.ends_with(".tmp")),
        "no temp file is left: {leftovers:?}"
    );
}

/// Publish TWO_STAGE_YAML and return (gen key, total key).
fn published_pair(p: &Project) -> (String, String) {
    p.write("m.yaml", TWO_STAGE_YAML);
    let v = p.json(&["run", "m.yaml", "--json"]);
    (key_of(&v, "gen"), key_of(&v, "total"))
}

#[test]
fn published_files_are_read_only() {
    let p = Project::new("read-only");
    let (gen_key, _) = published_pair(&p);
    let entry = p.store().join("artifacts").join(gen_key);
    for rel in ["out/nums.txt", "artifact.json", "log.txt"] {
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(entry.join(rel)).unwrap().permissions(),
        );
        assert_eq!(mode & 0o222, 0, "{rel} is writable: {mode:o}");
    }
}

/// Ways to damage a published entry after the fact; each must be noticed by `run`, which then
/// refuses to serve it, and by `verify`.
fn tamper(entry: &Path, how: &str) {
    let file = entry.join("out/nums.txt");
    let mut perms = std::fs::metadata(&file).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
    std::fs::set_permissions(&file, perms).unwrap();
    match how {
        "edit" => std::fs::write(&file, "1\n2\n4\n").unwrap(),
        "append" => {
            use std::io::Write;
            let mut f = std::fs::File::options().append(true).open(&file).unwrap();
            f.write_all(b"4\n").unwrap();
        }
        "delete" => std::fs::remove_file(&file).unwrap(),
        "replace" => {
            std::fs::remove_file(&file).unwrap();
            std::fs::write(&file, "9\n9\n9\n").unwrap();
        }
        other => panic!("no tamper scenario {other}"),
    }
}

#[test]
fn a_tampered_entry_is_refused_not_served() {
    for how in ["edit", "append", "delete", "replace"] {
        let p = Project::new(&format!("tamper-{how}"));
        let (gen_key, total_key) = published_pair(&p);
        tamper(&p.store().join("artifacts").join(&gen_key), how);
        let out = p.run(&["run", "m.yaml", "--json"]);
        assert_ne!(out.code, 0, "{how}: a tampered entry is not served\n{out}");
        assert!(
            out.stderr.contains("gen") && out.stderr.contains("nums.txt"),
            "{how}: the error names the stage and the file\n{out}"
        );
        let verify = p.run(&["verify", "--all"]);
        assert_eq!(verify.code, 1, "{how}: verify reports it\n{verify}");
        assert!(
            verify.stdout.contains(&gen_key[..12]) && !verify.stdout.contains(&total_key[..12]),
            "{how}: verify names the damaged entry only\n{verify}"
        );
        // The way out the error suggests: rebuild it.
        p.ok(&["run", "m.yaml", "--force", "gen"]);
        p.ok(&["verify", "--all"]);
        assert_eq!(p.published(&total_key, "sum.txt"), "6\n");
    }
}

#[test]
fn verify_passes_a_clean_store_and_checks_one_stage() {
    let p = Project::new("verify-clean");
    let (gen_key, _) = published_pair(&p);
    let all = p.ok(&["verify", "--all"]);
    assert!(all.stdout.contains("2 entries"), "{all}");
    let one = p.ok(&["verify", "gen"]);
    assert!(one.stdout.contains(&gen_key[..12]), "{one}");
    let by_key = p.ok(&["verify", &gen_key[..10]]);
    assert!(by_key.stdout.contains("1 entr"), "{by_key}");
}

/// A run record is a cache of what `artifact.json` says; when they disagree the artifact wins,
/// and `verify` says so.
#[test]
fn a_wrong_digest_in_a_run_record_is_not_trusted() {
    let p = Project::new("record-digest");
    let (_, total_key) = published_pair(&p);
    let record = run_record(&p.store());
    let mut v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record).unwrap()).unwrap();
    // (Earlier versions kept output digests in the record and trusted them over the artifact.)
    v["outputs"] = serde_json::json!({"gen": {"nums": "0".repeat(64)}});
    v["stages"]["gen"] = serde_json::Value::String(total_key.clone());
    std::fs::write(&record, serde_json::to_vec(&v).unwrap()).unwrap();
    let verify = p.run(&["verify", "--all"]);
    assert_eq!(verify.code, 1, "{verify}");
    assert!(
        verify.stdout.contains("run record") && verify.stdout.contains("another stage"),
        "{verify}"
    );
    let again = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(
        key_of(&again, "total"),
        total_key,
        "the downstream key comes from the artifact, not the record: {again}"
    );
    assert_eq!(states(&again)["total"], "cached", "{again}");
}

/// An entry without a (valid) `artifact.json` is not published: `run` rebuilds it, and every
/// command agrees on that.
#[test]
fn an_entry_without_a_valid_artifact_json_is_rebuilt() {
    for damage in ["missing", "empty", "garbage"] {
        let p = Project::new(&format!("no-artifact-json-{damage}"));
        let (gen_key, _) = published_pair(&p);
        let meta = p
            .store()
            .join("artifacts")
            .join(&gen_key)
            .join("artifact.json");
        let _ = std::fs::remove_file(&meta);
        match damage {
            "empty" => std::fs::write(&meta, "").unwrap(),
            "garbage" => std::fs::write(&meta, "{\"schema\": 1").unwrap(),
            _ => {}
        }
        let status = p.json(&["status", "m.yaml", "--json"]);
        assert_ne!(states(&status)["gen"], "up-to-date", "{damage}: {status}");
        let v = p.json(&["run", "m.yaml", "--json"]);
        assert_eq!(states(&v)["gen"], "executed", "{damage}: {v}");
        assert_eq!(key_of(&v, "gen"), gen_key);
        p.ok(&["show", "gen"]);
        p.ok(&["verify", "--all"]);
    }
}

/// A symlink in an input directory is hashed by what it points at, as the op reads it.
#[test]
fn a_symlinked_input_file_is_hashed_by_its_content() {
    let p = Project::new("symlink-input");
    p.write("real/doc.txt", "one\n");
    std::fs::create_dir_all(p.path("data")).unwrap();
    std::os::unix::fs::symlink(p.path("real/doc.txt"), p.path("data/doc.txt")).unwrap();
    p.write(
        "m.yaml",
        "stages:\n  count:\n    op: cmd\n    inputs: {d: data}\n    outputs: {o: o.txt}\n    cmd: \"cat {inputs.d}/doc.txt | wc -l > {outputs.o}\"\n",
    );
    let first = p.json(&["run", "m.yaml", "--json"]);
    p.write("real/doc.txt", "one\ntwo\n");
    let second = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(states(&second)["count"], "executed", "{second}");
    assert_ne!(key_of(&first, "count"), key_of(&second, "count"));
    assert_eq!(p.published(&key_of(&second, "count"), "o.txt").trim(), "2");
}

#[test]
fn an_output_symlink_out_of_the_stage_is_refused() {
    let p = Project::new("symlink-output");
    p.write("outside.txt", "drifts\n");
    let target = p.path("outside.txt");
    p.write(
        "m.yaml",
        &format!(
            "stages:\n  link:\n    op: cmd\n    outputs: {{o: o.txt}}\n    cmd: \"ln -s {} {{outputs.o}}\"\n",
            target.display()
        ),
    );
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(out.stderr.contains("symbolic link"), "{out}");
    assert!(p.artifact_dirs().is_empty(), "nothing is published");
}

/// Inputs are regular files and directories: a FIFO would block forever, /dev/zero never ends.
#[test]
fn an_input_that_is_not_a_file_or_directory_is_an_input_error() {
    let p = Project::new("fifo-input");
    let fifo = p.path("pipe");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    for input in [fifo.display().to_string(), "/dev/zero".to_string()] {
        p.write(
            "m.yaml",
            &format!(
                "stages:\n  s:\n    op: cmd\n    inputs: {{i: {input}}}\n    outputs: {{o: o.txt}}\n    cmd: \"head -c 1 {{inputs.i}} > {{outputs.o}}\"\n"
            ),
        );
        for cmd in ["status", "run"] {
            let mut child = p.spawn(&[cmd, "m.yaml"]);
            let ended = wait_for(Duration::from_secs(10), || {
                child.try_wait().ok().flatten().is_some()
            });
            if !ended {
                let _ = child.kill();
            }
            assert!(ended, "`{cmd}` with input {input} hangs");
            let out = child_output(child);
            assert_eq!(out.code, 2, "{cmd} {input}\n{out}");
            assert!(
                out.stderr.contains("not a regular file or directory"),
                "{cmd} {input}\n{out}"
            );
        }
        assert!(
            !p.store().exists(),
            "an input error writes nothing (input {input})"
        );
    }
}

/// A run that stops at an input error has written nothing: no store, no cache.
#[test]
fn an_unreadable_input_stops_the_run_before_anything_is_written() {
    let p = Project::new("unreadable-input");
    // The input directory exists (the manifest loads); a file in it cannot be read.
    std::fs::create_dir_all(p.path("data")).unwrap();
    std::os::unix::fs::symlink(p.path("nowhere"), p.path("data/dangling")).unwrap();
    p.write(
        "m.yaml",
        "stages:\n  first:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo > {outputs.o}\"\n  s:\n    op: cmd\n    inputs: {i: data}\n    outputs: {o: o.txt}\n    cmd: \"ls {inputs.i} > {outputs.o}\"\n",
    );
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("dangling"), "{out}");
    assert!(!p.store().exists(), "the store was created: {out}");
    p.write("ok.yaml", TWO_STAGE_YAML);
    let typo = p.run(&["run", "ok.yaml", "--target", "totl"]);
    assert_eq!(typo.code, 2, "{typo}");
    assert!(!p.store().exists(), "the store was created: {typo}");
}

/// A stage whose `nemo-dag exec` dies by a signal is reported with the signal and the last
/// lines it wrote.
#[test]
fn a_stage_killed_by_a_signal_is_reported_with_its_last_words() {
    let p = Project::new("signal-report");
    p.write(
        "m.yaml",
        "stages:\n  s:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo reading the big line >&2; kill -ABRT $PPID; sleep 5\"\n",
    );
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(out.stderr.contains("SIGABRT"), "the signal is named\n{out}");
    // (The stage's lines are also echoed live, before the failure: look after it.)
    let failed = out.stderr.find("FAILED").map_or("", |at| &out.stderr[at..]);
    assert!(
        failed.contains("reading the big line"),
        "the report quotes the stage's last lines: {failed}\n{out}"
    );
}

#[test]
fn gc_removes_failed_attempts() {
    let p = Project::new("gc-failed");
    p.write(
        "m.yaml",
        "stages:\n  s:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"echo big > {outputs.o}; exit 3\"\n",
    );
    assert_eq!(p.run(&["run", "m.yaml"]).code, 1);
    let failed = p.store().join("failed");
    assert_eq!(std::fs::read_dir(&failed).unwrap().count(), 1);
    p.ok(&["gc"]);
    assert_eq!(
        std::fs::read_dir(&failed).unwrap().count(),
        0,
        "gc keeps failed attempts"
    );
}

#[test]
fn a_stage_log_is_capped() {
    let p = Project::new("log-cap");
    p.write(
        "m.yaml",
        "stages:\n  s:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"head -c 3000000 /dev/zero | tr '\\\\0' x | fold -w 100; echo last line; echo > {outputs.o}\"\n",
    );
    let out = p
        .command(&["run", "m.yaml", "--json"])
        .env("NEMO_DAG_LOG_LIMIT", "1000000")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let log = p
        .store()
        .join("artifacts")
        .join(key_of(&v, "s"))
        .join("log.txt");
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(text.len() < 1_100_000, "the log holds {} bytes", text.len());
    assert!(text.contains("not kept"), "the cut is marked");
    assert!(text.contains("last line"), "the end of the log is kept");
}

/// `resources.time` holds on this machine as it does on a cluster: the stage is killed.
#[test]
fn a_stage_past_its_time_limit_is_killed() {
    let p = Project::new("time-limit");
    p.write(
        "m.yaml",
        "stages:\n  slow:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"sleep 30; echo > {outputs.o}\"\n    resources: {time: '0:02'}\n",
    );
    let clock = std::time::Instant::now();
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        clock.elapsed() < Duration::from_secs(15),
        "the stage ran past its limit: {:?}",
        clock.elapsed()
    );
    assert!(
        out.stderr.contains("exceeded its time limit of 2s"),
        "{out}"
    );
    assert!(
        stage_processes(&p.store()).is_empty(),
        "the stage's processes are gone"
    );
    assert!(p.artifact_dirs().is_empty());
}

/// A tmpfs of a few hundred KiB, unmounted on drop; `None` where this machine cannot mount one
/// (not root, or a container without the capability).
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(dir: PathBuf, size: &str) -> Option<SmallDisk> {
        std::fs::create_dir_all(&dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(SmallDisk(dir))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

/// A full disk fails the stage with the file it could not write, publishes nothing and leaves
/// no temp files.
#[test]
fn a_full_disk_fails_the_stage_and_names_the_file() {
    let p = Project::new("full-disk");
    let Some(disk) = SmallDisk::mount(p.path("disk"), "600k") else {
        eprintln!("skipped: cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN)");
        return;
    };
    std::fs::write(
        disk.0.join("m.yaml"),
        "stages:\n  big:\n    op: cmd\n    outputs: {o: o.txt}\n    cmd: \"head -c 400000 /dev/zero > {outputs.o}; seq 1 100000\"\n",
    )
    .unwrap();
    let out = output({
        let mut c = p.command(&["run", "m.yaml"]);
        c.current_dir(&disk.0);
        c
    });
    assert_eq!(out.code, 1, "{out}");
    let store = disk.0.join(".nemo-dag");
    assert!(
        out.stderr.contains("No space left on device")
            && out
                .stderr
                .contains(&format!("cannot write the stage log {}", store.display())),
        "the error names the file\n{out}"
    );
    assert!(artifact_dirs(&store).is_empty(), "nothing is published");
    let temp: Vec<String> = find_named(&store.join("runs"), ".");
    assert!(temp.is_empty(), "no temp files are left: {temp:?}");
}
