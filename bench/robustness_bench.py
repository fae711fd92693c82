#!/usr/bin/env python3
"""Robustness: does the store ever serve a wrong or lost result when runs are killed, `gc` runs
beside them, or published entries are damaged? Each trial is checked by content, not by exit
codes; the figures are printed beside the goals, and beside another build when one is given.

    cargo build --release
    python3 bench/robustness_bench.py [--trials 100] [--gc-trials 20]
    python3 bench/robustness_bench.py --baseline-bin OLD/nemo-dag   # this build against another

The scenarios:

- kill -9 of `run` alone, at a random instant while a `cmd` stage's three background writers
  sleep: then a plain rerun. Wrong = the published output does not hold exactly one attempt's
  three lines (a dead attempt's writers reached it), or a stage process outlived the run.
- kill -9 of the whole process tree at a random instant, then a rerun: wrong = a published entry
  without its outputs, or a rerun that does not reach a clean run's bytes.
- `gc` at a random instant during a run whose second stage reads the first's output: lost = the
  run fails, or its result is wrong, or the first stage's artifact is gone afterwards.
- Seven ways to damage a published entry (edit, append, delete, same-size rewrite with the old
  mtime, an empty or missing artifact.json, a run record naming another stage's key). Detected =
  `run` neither serves the damaged bytes nor builds on them (it refuses, or rebuilds an entry that
  is not an artifact), and `verify --all` reports every scenario but the rebuilt ones.
- The manifest fuzzer (tests/fuzz): --fuzz-cases cases (0: skip) through
  `cargo test --release -p nemo-dag --test fuzz`, its line quoted. The fuzzer runs in-process
  against the working tree's library, so it has no baseline column.
"""

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "nemo-dag"

FORKS = """stages:
  forks:
    op: cmd
    outputs: {o: o.txt}
    cmd: "touch {outputs.o}; for i in 1 2 3; do (sleep 1; echo $i >> {outputs.o}) & done; wait"
"""

CHAIN = """stages:
  a:
    op: cmd
    outputs: {o: a.txt}
    cmd: "seq 1000 > {outputs.o}"
  b:
    op: cmd
    inputs: {i: "a:o"}
    outputs: {o: b.txt}
    cmd: "sleep 0.5; wc -l < {inputs.i} > {outputs.o}"
  c:
    op: cmd
    inputs: {i: "b:o"}
    outputs: {o: c.txt}
    cmd: "sleep 0.3; cat {inputs.i} {inputs.i} > {outputs.o}"
"""

PAIR = """stages:
  gen:
    op: cmd
    outputs: {nums: nums.txt}
    cmd: "seq 3 > {outputs.nums}"
  total:
    op: cmd
    inputs: {nums: "gen:nums"}
    outputs: {sum: sum.txt}
    cmd: "awk '{s+=$1} END {print s}' {inputs.nums} > {outputs.sum}"
"""


def run(binary, cwd, *args, timeout=120):
    env = dict(os.environ, NO_COLOR="1")
    env.pop("NEMO_DAG_STORE", None)
    return subprocess.run(
        [str(binary), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def spawn(binary, cwd, *args):
    env = dict(os.environ, NO_COLOR="1")
    env.pop("NEMO_DAG_STORE", None)
    return subprocess.Popen(
        [str(binary), *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def stage_processes(store):
    """Processes running a stage of this store (cmd stages get NEMO_DAG_OUT inside it)."""
    needle = f"NEMO_DAG_OUT={store}".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if any(var.startswith(needle) for var in env.split(b"\0")):
            found.append(int(pid))
    return found


def descendants(pid):
    parents = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        parents[int(p)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = [], [pid]
    while todo:
        cur = todo.pop()
        kids = [c for c, pp in parents.items() if pp == cur]
        out += kids
        todo += kids
    return out


def wait_for(cond, timeout):
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return True
        time.sleep(0.02)
    return False


def published(store, key, rel):
    return (store / "artifacts" / key / "out" / rel).read_text()


def keys_of(stdout):
    return {s["name"]: s["key"] for s in json.loads(stdout)["stages"]}


def kill_run_alone(binary, work):
    """One trial; returns True when something was wrong."""
    (work / "m.yaml").write_text(FORKS)
    store = work / ".nemo-dag"
    child = spawn(binary, work, "run", "m.yaml")
    if not wait_for(lambda: len(stage_processes(store)) >= 3, 20):
        child.kill()
        child.wait()
        return True
    time.sleep(random.uniform(0, 0.9))
    child.kill()
    child.wait()
    time.sleep(0.3)
    strays = stage_processes(store)
    rerun = run(binary, work, "run", "m.yaml", "--json")
    if rerun.returncode != 0:
        return True
    key = keys_of(rerun.stdout)["forks"]
    time.sleep(1.2)  # let any stray writer do its worst
    lines = sorted(published(store, key, "o.txt").split())
    for pid in strays:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return lines != ["1", "2", "3"] or bool(strays)


def clean_chain(binary, tmp):
    work = Path(tempfile.mkdtemp(dir=tmp))
    (work / "m.yaml").write_text(CHAIN)
    out = run(binary, work, "run", "m.yaml", "--json")
    return keys_of(out.stdout)


def entries_whole(store):
    for d in (store / "artifacts").glob("*"):
        meta = d / "artifact.json"
        if not meta.is_file():
            return False
        for out in json.loads(meta.read_text())["outputs"].values():
            if not (d / out["path"]).exists():
                return False
    return True


def kill_whole_tree(binary, work, clean):
    (work / "m.yaml").write_text(CHAIN)
    store = work / ".nemo-dag"
    child = spawn(binary, work, "run", "m.yaml", "--json")
    time.sleep(random.uniform(0.05, 1.2))
    try:
        os.kill(child.pid, signal.SIGSTOP)
    except OSError:
        pass
    for pid in [child.pid, *descendants(child.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    child.wait()
    if store.exists() and not entries_whole(store):
        return True
    rerun = run(binary, work, "run", "m.yaml", "--json")
    if rerun.returncode != 0:
        return True
    keys = keys_of(rerun.stdout)
    return keys != clean or published(store, keys["c"], "c.txt") != "1000\n1000\n"


def gc_during_run(binary, work):
    (work / "m.yaml").write_text(CHAIN)
    store = work / ".nemo-dag"
    child = spawn(binary, work, "run", "m.yaml", "--json")
    time.sleep(random.uniform(0.05, 1.0))
    run(binary, work, "gc")
    out, _ = child.communicate(timeout=60)
    if child.returncode != 0:
        return True
    keys = keys_of(out)
    if not (store / "artifacts" / keys["a"]).is_dir():
        return True
    return published(store, keys["c"], "c.txt") != "1000\n1000\n"


def make_writable(path):
    os.chmod(path, 0o644)


def tamper_scenarios():
    """(name, damage(store, keys, record), rebuilt): `rebuilt` scenarios damage what is not an
    artifact any more, which `run` rebuilds rather than refuses."""

    def out_file(store, keys):
        f = store / "artifacts" / keys["gen"] / "out" / "nums.txt"
        make_writable(f)
        return f

    def edit(store, keys, _):
        out_file(store, keys).write_text("1\n2\n4\n")

    def append(store, keys, _):
        with open(out_file(store, keys), "a") as f:
            f.write("4\n")

    def delete(store, keys, _):
        out_file(store, keys).unlink()

    def same_size_old_mtime(store, keys, _):
        f = out_file(store, keys)
        st = f.stat()
        f.write_text("3\n2\n1\n")
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))

    def empty_meta(store, keys, _):
        meta = store / "artifacts" / keys["gen"] / "artifact.json"
        make_writable(meta)
        meta.write_text("")

    def no_meta(store, keys, _):
        meta = store / "artifacts" / keys["gen"] / "artifact.json"
        make_writable(meta)
        meta.unlink()

    def record_points_elsewhere(store, keys, record):
        v = json.loads(record.read_text())
        v["stages"]["gen"] = keys["total"]
        record.write_text(json.dumps(v))

    return [
        ("edit an output", edit, False),
        ("append to an output", append, False),
        ("delete an output", delete, False),
        ("same-size rewrite, old mtime", same_size_old_mtime, False),
        ("empty artifact.json", empty_meta, True),
        ("missing artifact.json", no_meta, True),
        ("run record names another stage's key", record_points_elsewhere, False),
    ]


def tamper(binary, tmp):
    detected = 0
    names = []
    for name, damage, rebuilt in tamper_scenarios():
        work = Path(tempfile.mkdtemp(dir=tmp))
        (work / "m.yaml").write_text(PAIR)
        store = work / ".nemo-dag"
        first = run(binary, work, "run", "m.yaml", "--json")
        keys = keys_of(first.stdout)
        record = next((store / "runs").glob("*.json"))
        time.sleep(0.05)
        damage(store, keys, record)
        verify = run(binary, work, "verify", "--all")
        after = run(binary, work, "run", "m.yaml", "--json")
        if name.startswith("run record"):
            # The record is not what builds consume: the run must be unaffected, verify must see it.
            ok = after.returncode == 0 and keys_of(after.stdout) == keys and verify.returncode == 1
        elif rebuilt:
            ok = (
                after.returncode == 0
                and json.loads(after.stdout)["stages"][0]["state"] == "executed"
                and published(store, keys["total"], "sum.txt") == "6\n"
            )
        else:
            served = after.returncode == 0
            ok = not served and verify.returncode == 1 and keys["gen"][:12] in verify.stdout
        detected += ok
        if not ok:
            names.append(name)
        shutil.rmtree(work, ignore_errors=True)
    return detected, len(tamper_scenarios()), names


def measure(binary, trials, gc_trials, tmp):
    figures = {}
    wrong = 0
    for _ in range(trials):
        work = Path(tempfile.mkdtemp(dir=tmp))
        wrong += kill_run_alone(binary, work)
        shutil.rmtree(work, ignore_errors=True)
    figures["kill -9 of run alone: wrong"] = (wrong, trials)
    clean = clean_chain(binary, tmp)
    wrong = 0
    for _ in range(trials):
        work = Path(tempfile.mkdtemp(dir=tmp))
        wrong += kill_whole_tree(binary, work, clean)
        shutil.rmtree(work, ignore_errors=True)
    figures["kill -9 of the whole tree: wrong"] = (wrong, trials)
    lost = 0
    for _ in range(gc_trials):
        work = Path(tempfile.mkdtemp(dir=tmp))
        lost += gc_during_run(binary, work)
        shutil.rmtree(work, ignore_errors=True)
    figures["gc during a run: lost or wrong"] = (lost, gc_trials)
    detected, total, missed = tamper(binary, tmp)
    figures["tamper scenarios: detected"] = (detected, total)
    return figures, missed


def fuzz(cases, seed):
    """Run the manifest fuzzer for `cases` cases; (cases, panics, hangs, its line)."""
    env = dict(os.environ, NEMO_DAG_FUZZ_CASES=str(cases), NEMO_DAG_FUZZ_SECONDS="100000",
               NEMO_DAG_FUZZ_SEED=str(seed))
    out = subprocess.run(["cargo", "test", "--release", "-q", "-p", "nemo-dag", "--test", "fuzz"],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    line = next((l for l in out.stdout.splitlines() if " cases, " in l), None)
    if line is None:
        sys.exit(f"the fuzzer printed no figures:\n{out.stdout}\n{out.stderr}")
    n, panics, hangs = (int(x) for x in re.search(r"(\d+) cases, (\d+) panics, (\d+) hangs", line).groups())
    return n, panics, hangs, line.split(": ", 1)[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(BIN))
    ap.add_argument("--baseline-bin", help="another nemo-dag build to measure beside this one")
    ap.add_argument("--trials", type=int, default=100, help="kill trials of each kind")
    ap.add_argument("--gc-trials", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fuzz-cases", type=int, default=10_000, help="manifest fuzzer cases (0: skip)")
    a = ap.parse_args()
    builds = [("this build", a.bin)] + ([("baseline", a.baseline_bin)] if a.baseline_bin else [])
    results = []
    for label, binary in builds:
        if not Path(binary).is_file():
            sys.exit(f"no nemo-dag at {binary}: cargo build --release")
        random.seed(a.seed)
        tmp = tempfile.mkdtemp(prefix="nemo-dag-robustness-")
        clock = time.time()
        figures, missed = measure(binary, a.trials, a.gc_trials, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        results.append((label, figures, missed, time.time() - clock))
    goals = {
        "kill -9 of run alone: wrong": "0",
        "kill -9 of the whole tree: wrong": "0",
        "gc during a run: lost or wrong": "0",
        "tamper scenarios: detected": "all",
    }
    header = f"{'scenario':<36} {'goal':>5}" + "".join(f" {label:>14}" for label, *_ in results)
    print(header)
    print("-" * len(header))
    for name, goal in goals.items():
        row = f"{name:<36} {goal:>5}"
        for _, figures, _, _ in results:
            n, of = figures[name]
            row += f" {f'{n} / {of}':>14}"
        print(row)
    if a.fuzz_cases:
        n, panics, hangs, line = fuzz(a.fuzz_cases, a.seed)
        row = f"{'fuzz: panics + hangs':<36} {'0':>5}" + f" {f'{panics + hangs} / {n}':>14}"
        print(row + "".join(f" {'-':>14}" for _ in results[1:]))
    for label, _, missed, seconds in results:
        extra = f"; missed: {', '.join(missed)}" if missed else ""
        print(f"{label}: {seconds:.0f} s{extra}")
    if a.fuzz_cases:
        print(f"fuzzer: {line}")


if __name__ == "__main__":
    main()
