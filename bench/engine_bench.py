#!/usr/bin/env python3
"""Engine benchmark: nemo-dag against GNU make (and DVC / Snakemake when installed).

For each shape (chain, wide, diamond) and size N it writes a nemo-dag manifest of N cheap `cmd`
stages and the equivalent Makefile, then measures, side by side in one run:

  1. the first run (cold), at --jobs and at -j1;
  2. a no-op run (everything up to date), median of --repeat;
  3. a no-op status: `nemo-dag status` against `make -q`, median of --repeat;
  4. a rerun after one parameter change in the middle of the graph:
     nemo-dag `stages.sNNNN.params.v=2`; make: the stage's param file params/sNNNN.txt is rewritten
     (every Make rule depends on its own param file, so the change reruns that stage and its
     descendants, as in nemo-dag).

Each command is trivially cheap (`echo`, `cat ... | cksum`), so what is measured is the engine's
own overhead. Both tools produce byte-identical outputs; the script checks that on the sink stage.

--big-input adds a hashing benchmark: a file of random bytes (--big-size-mib, default 1 GiB) as
the input of a one-stage manifest; the cold `nemo-dag status` (which hashes the file) against
`b3sum`, then a no-op status after one run.

Usage:
    python3 bench/engine_bench.py                         # sizes 10,100,1000, all shapes
    python3 bench/engine_bench.py --sizes 10,100 --shapes chain
    python3 bench/engine_bench.py --sizes 10000           # opt-in, slow
    python3 bench/engine_bench.py --big-input --big-size-mib 1024
    python3 bench/engine_bench.py --tools make            # the Make half alone (no binary needed)

Standard library only (Python 3.11). Everything goes to stdout as plain tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPES = ("chain", "wide", "diamond")

# Goals from the issue (at N = 1000).
GOAL_N = 1000
GOAL_STATUS_S = 0.100  # no-op status under 100 ms ...
GOAL_STATUS_VS_MAKE = 3.0  # ... and within 3x of `make -q`
GOAL_OVERHEAD_S = 0.010  # engine overhead per executed stage under 10 ms
GOAL_HASH_VS_B3SUM = 0.8  # hashing throughput at least 0.8x b3sum
GOAL_BIG_NOOP_S = 0.050  # no-op status with a 1 GiB input under 50 ms


# --------------------------------------------------------------------------------------------
# The graphs
# --------------------------------------------------------------------------------------------


@dataclass
class Graph:
    shape: str
    n: int
    deps: dict[str, list[str]]  # stage -> the stages it reads, in insertion (topological) order
    changed: str = ""  # the stage whose param the rerun measure changes

    @property
    def names(self) -> list[str]:
        return list(self.deps)

    def descendants(self, stage: str) -> set[str]:
        children: dict[str, list[str]] = {s: [] for s in self.deps}
        for s, ds in self.deps.items():
            for d in ds:
                children[d].append(s)
        seen, todo = set(), [stage]
        while todo:
            for c in children[todo.pop()]:
                if c not in seen:
                    seen.add(c)
                    todo.append(c)
        return seen

    def sinks(self) -> list[str]:
        used = {d for ds in self.deps.values() for d in ds}
        return [s for s in self.deps if s not in used]


def stage_name(i: int) -> str:
    return f"s{i:04d}"


def make_graph(shape: str, n: int) -> Graph:
    """N stages in all. chain: s_i reads s_{i-1}. wide: N-1 independent stages and one join
    stage reading all of them. diamond: layers of width ~sqrt(N), each stage reading two stages
    of the previous layer (the last layer may be partial)."""
    if n < 2:
        raise SystemExit("sizes must be at least 2")
    names = [stage_name(i) for i in range(n)]
    deps: dict[str, list[str]] = {}
    if shape == "chain":
        for i, s in enumerate(names):
            deps[s] = [names[i - 1]] if i else []
    elif shape == "wide":
        for s in names[:-1]:
            deps[s] = []
        deps[names[-1]] = names[:-1]
    elif shape == "diamond":
        width = max(2, round(math.sqrt(n)))
        prev: list[str] = []
        for start in range(0, n, width):
            layer = names[start : start + width]
            for j, s in enumerate(layer):
                if prev:
                    a, b = prev[j % len(prev)], prev[(j + 1) % len(prev)]
                    deps[s] = [a] if a == b else [a, b]
                else:
                    deps[s] = []
            prev = layer
    else:
        raise SystemExit(f"unknown shape {shape!r} (one of {', '.join(SHAPES)})")
    return Graph(shape, n, deps, changed=names[n // 2])


# Every stage writes "<name> <v>\n", after the cksum of its inputs' concatenation when it has
# inputs. The wide join stage only declares its inputs (a `cat` of thousands of store paths would
# overflow the kernel's 128 KiB limit on one argument of `sh -c`); make's join does the same.
JOIN_INPUTS_LIMIT = 2


def uses_inputs(deps: list[str]) -> bool:
    return 0 < len(deps) <= JOIN_INPUTS_LIMIT


# --------------------------------------------------------------------------------------------
# Running and timing
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    seconds: float | None = None  # None: not measured (error, timeout, not applicable)
    note: str = ""  # e.g. "executed 500" or the error
    ok: bool = True


def timed(argv: list[str], cwd: Path, timeout: float, env: dict | None = None):
    """Run argv, return (seconds, CompletedProcess | None on timeout)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            timeout=timeout, env=env,
        )
    except subprocess.TimeoutExpired:
        return time.perf_counter() - t0, None
    return time.perf_counter() - t0, p


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


class Tool:
    """One engine under test. Each method prepares or measures one thing in `d` (its own dir)."""

    name = "?"

    def __init__(self, args: argparse.Namespace):
        self.args = args

    def available(self) -> str | None:  # None when usable, else why not
        return None

    def version(self) -> str:
        return ""

    def setup(self, g: Graph, d: Path) -> None:
        raise NotImplementedError

    def cold(self, g: Graph, d: Path, jobs: int) -> Result:
        raise NotImplementedError

    def noop_run(self, g: Graph, d: Path, jobs: int) -> Result:
        raise NotImplementedError

    def noop_status(self, g: Graph, d: Path) -> Result:
        raise NotImplementedError

    def change_param(self, g: Graph, d: Path, jobs: int) -> Result:
        raise NotImplementedError

    def sink_output(self, g: Graph, d: Path, sink: str) -> bytes | None:
        return None


# ---- nemo-dag -------------------------------------------------------------------------------


class NemoDag(Tool):
    name = "nemo-dag"

    def __init__(self, args):
        super().__init__(args)
        self.bin = str(Path(args.bin).resolve())
        self.env = {k: v for k, v in os.environ.items() if k != "NEMO_DAG_STORE"}
        self.contract_notes: list[str] = []
        self.keys: dict[Path, dict[str, str]] = {}

    def note(self, msg: str) -> None:
        if msg not in self.contract_notes:
            self.contract_notes.append(msg)

    def available(self):
        if not os.access(self.bin, os.X_OK):
            return f"no binary at {self.bin} (build it: cargo build --release)"
        return None

    def version(self):
        p = subprocess.run([self.bin, "--version"], capture_output=True, text=True)
        return ((p.stdout.strip() or p.stderr.strip()).splitlines() or ["?"])[0]

    def setup(self, g, d):
        d.mkdir(parents=True, exist_ok=True)
        lines = [f"# nemo-dag engine benchmark: {g.shape}, {g.n} cmd stages", "stages:"]
        for s, deps in g.deps.items():
            lines += [f"  {s}:", "    op: cmd", f"    params: {{v: 1, name: {s}}}"]
            if deps:
                ins = ", ".join(f'i{k}: "{dep}:o"' for k, dep in enumerate(deps))
                lines.append(f"    inputs: {{{ins}}}")
            lines.append("    outputs: {o: o.txt}")
            if uses_inputs(deps):
                cat = " ".join(f"{{inputs.i{k}}}" for k in range(len(deps)))
                cmd = (f"cat {cat} | cksum > {{outputs.o}} && "
                       "echo {params.name} {params.v} >> {outputs.o}")
            else:
                cmd = "echo {params.name} {params.v} > {outputs.o}"
            lines.append(f'    cmd: "{cmd}"')
        (d / "pipeline.yaml").write_text("\n".join(lines) + "\n")

    def _argv(self, d: Path, store: str, *rest: str) -> list[str]:
        cmd, *more = rest
        return [self.bin, cmd, str(d / "pipeline.yaml"), *more, "--store", str(d / store)]

    def _run(self, g, d, argv, expect: dict[str, int], what: str) -> Result:
        secs, p = timed(argv, d, self.args.timeout, self.env)
        if p is None:
            return Result(None, f"timeout after {self.args.timeout:.0f} s", False)
        if p.returncode != 0:
            return Result(None, f"exit {p.returncode}: {tail(p.stderr)}", False)
        try:
            stages = json.loads(p.stdout)["stages"]
            states: dict[str, int] = {}
            for st in stages:
                states[st["state"]] = states.get(st["state"], 0) + 1
                if st.get("key"):
                    self.keys.setdefault(d, {})[st["name"]] = st["key"]  # the latest run wins
        except (ValueError, KeyError, TypeError) as e:
            self.note(f"`{' '.join(argv[1:2])} --json`: stdout is not "
                      f'{{"stages":[{{"name","key","state",..}}]}} ({e}): {p.stdout[:200]!r}')
            return Result(secs, "unparsed --json")
        got = ", ".join(f"{k} {v}" for k, v in sorted(states.items()))
        if {k: v for k, v in states.items() if v} != {k: v for k, v in expect.items() if v}:
            want = ", ".join(f"{k} {v}" for k, v in sorted(expect.items()) if v)
            self.note(f"{what} ({g.shape}, N={g.n}): expected states [{want}], got [{got}]")
            return Result(secs, got, False)
        return Result(secs, got)

    def cold(self, g, d, jobs):
        store = f"store-j{jobs}"
        return self._run(g, d, self._argv(d, store, "run", "-j", str(jobs), "--json"),
                         {"executed": g.n}, f"first run -j{jobs}")

    def noop_run(self, g, d, jobs):
        return self._run(g, d, self._argv(d, "store", "run", "-j", str(jobs), "--json"),
                         {"cached": g.n}, "no-op run")

    def noop_status(self, g, d):
        return self._run(g, d, self._argv(d, "store", "status", "--json"),
                         {"up-to-date": g.n}, "no-op status")

    def change_param(self, g, d, jobs):
        k = 1 + len(g.descendants(g.changed))
        argv = self._argv(d, "store", "run", f"stages.{g.changed}.params.v=2",
                          "-j", str(jobs), "--json")
        return self._run(g, d, argv, {"executed": k, "cached": g.n - k},
                         f"run stages.{g.changed}.params.v=2")

    def sink_output(self, g, d, sink):
        key = self.keys.get(d, {}).get(sink)
        if not key:
            return None
        path = d / "store" / "artifacts" / key / "out" / "o.txt"
        return path.read_bytes() if path.exists() else None


# ---- GNU make -------------------------------------------------------------------------------


class Make(Tool):
    name = "make"

    def available(self):
        if not shutil.which("make"):
            return "not installed (apt-get install -y make)"
        p = subprocess.run(["make", "--version"], capture_output=True, text=True)
        if "GNU Make" not in p.stdout:
            return "`make --version` does not say GNU Make"
        return None

    def version(self):
        p = subprocess.run(["make", "--version"], capture_output=True, text=True)
        return p.stdout.splitlines()[0]

    def setup(self, g, d):
        for sub in ("params", "out"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        outs = " ".join(f"out/{s}.txt" for s in g.names)
        # Built-in implicit rules off (as `make -r`; a tuned Makefile does this): with them make
        # tries dozens of pattern rules per file and its no-op check is ~50x slower at N = 1000,
        # which would flatter nemo-dag.
        rules = [f"# GNU make twin of the nemo-dag benchmark: {g.shape}, {g.n} stages",
                 "MAKEFLAGS += --no-builtin-rules", ".SUFFIXES:",
                 ".DEFAULT_GOAL := all", f"all: {outs}", ".PHONY: all", ""]
        for s, deps in g.deps.items():
            (d / "params" / f"{s}.txt").write_text(f"{s} 1\n")
            ins = " ".join(f"out/{x}.txt" for x in deps)
            rules.append(f"out/{s}.txt: params/{s}.txt {ins}".rstrip())
            if uses_inputs(deps):
                rules.append(f"\tcat {ins} | cksum > $@ && cat params/{s}.txt >> $@")
            else:
                rules.append(f"\tcat params/{s}.txt > $@")
        (d / "Makefile").write_text("\n".join(rules) + "\n")

    def _make(self, d, jobs, expect: int | None, *extra) -> Result:
        secs, p = timed(["make", "-j", str(jobs), *extra], d, self.args.timeout)
        if p is None:
            return Result(None, f"timeout after {self.args.timeout:.0f} s", False)
        if p.returncode != 0:
            return Result(None, f"exit {p.returncode}: {tail(p.stderr)}", False)
        ran = sum(1 for line in p.stdout.splitlines() if line.startswith("cat "))
        ok = expect is None or ran == expect
        return Result(secs, f"executed {ran}" + ("" if ok else f" (expected {expect})"), ok)

    def cold(self, g, d, jobs):
        if jobs != self.args.jobs:  # the -j1 measure builds in a twin directory
            twin = d.parent / f"{d.name}-j{jobs}"
            self.setup(g, twin)
            return self._make(twin, jobs, g.n)
        return self._make(d, jobs, g.n)

    def noop_run(self, g, d, jobs):
        return self._make(d, jobs, 0)

    def noop_status(self, g, d):
        secs, p = timed(["make", "-q"], d, self.args.timeout)
        if p is None:
            return Result(None, "timeout", False)
        if p.returncode != 0:
            return Result(secs, f"make -q exit {p.returncode} (expected 0: up to date)", False)
        return Result(secs, "up to date")

    def change_param(self, g, d, jobs):
        (d / "params" / f"{g.changed}.txt").write_text(f"{g.changed} 2\n")
        return self._make(d, jobs, 1 + len(g.descendants(g.changed)))

    def sink_output(self, g, d, sink):
        path = d / "out" / f"{sink}.txt"
        return path.read_bytes() if path.exists() else None


# ---- Snakemake and DVC (only when installed) ------------------------------------------------


class Snakemake(Make):
    """The Makefile's rules as a Snakefile (per-stage param files as inputs, like make)."""

    name = "snakemake"

    def available(self):
        return None if shutil.which("snakemake") else "not installed"

    def version(self):
        p = subprocess.run(["snakemake", "--version"], capture_output=True, text=True)
        return "snakemake " + p.stdout.strip()

    def setup(self, g, d):
        for sub in ("params", "out"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        outs = ", ".join(f'"out/{s}.txt"' for s in g.names)
        rules = [f"rule all:\n    input: [{outs}]\n"]
        for s, deps in g.deps.items():
            (d / "params" / f"{s}.txt").write_text(f"{s} 1\n")
            ins = [f"out/{x}.txt" for x in deps]
            inputs = ", ".join(f'"{x}"' for x in [f"params/{s}.txt", *ins])
            if uses_inputs(deps):
                shell = f"cat {' '.join(ins)} | cksum > {{output}} && cat params/{s}.txt >> {{output}}"
            else:
                shell = f"cat params/{s}.txt > {{output}}"
            rules.append(f'rule {s}:\n    input: {inputs}\n    output: "out/{s}.txt"\n'
                         f'    shell: "{shell}"\n')
        (d / "Snakefile").write_text("\n".join(rules))

    def _sm(self, d, *extra) -> Result:
        secs, p = timed(["snakemake", *extra], d, self.args.timeout)
        if p is None:
            return Result(None, f"timeout after {self.args.timeout:.0f} s", False)
        if p.returncode != 0:
            return Result(None, f"exit {p.returncode}: {tail(p.stderr)}", False)
        return Result(secs)

    def cold(self, g, d, jobs):
        if jobs != self.args.jobs:
            twin = d.parent / f"{d.name}-j{jobs}"
            self.setup(g, twin)
            d = twin
        return self._sm(d, "--cores", str(jobs), "--quiet")

    def noop_run(self, g, d, jobs):
        return self._sm(d, "--cores", str(jobs), "--quiet")

    def noop_status(self, g, d):
        return self._sm(d, "--cores", "1", "--dry-run", "--quiet")

    def change_param(self, g, d, jobs):
        (d / "params" / f"{g.changed}.txt").write_text(f"{g.changed} 2\n")
        return self._sm(d, "--cores", str(jobs), "--quiet")


class Dvc(Make):
    """The graph as a dvc.yaml (per-stage param files as deps); `dvc repro` runs serially."""

    name = "dvc"

    def available(self):
        return None if shutil.which("dvc") else "not installed"

    def version(self):
        p = subprocess.run(["dvc", "--version"], capture_output=True, text=True)
        return "dvc " + p.stdout.strip()

    def setup(self, g, d):
        for sub in ("params", "out"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        subprocess.run(["dvc", "init", "--no-scm", "-q", "-f"], cwd=d, check=True)
        lines = ["stages:"]
        for s, deps in g.deps.items():
            (d / "params" / f"{s}.txt").write_text(f"{s} 1\n")
            ins = [f"out/{x}.txt" for x in deps]
            if uses_inputs(deps):
                cmd = f"cat {' '.join(ins)} | cksum > out/{s}.txt && cat params/{s}.txt >> out/{s}.txt"
            else:
                cmd = f"cat params/{s}.txt > out/{s}.txt"
            lines += [f"  {s}:", f"    cmd: {json.dumps(cmd)}",
                      f"    deps: {json.dumps([f'params/{s}.txt', *ins])}",
                      f'    outs: ["out/{s}.txt"]']
        (d / "dvc.yaml").write_text("\n".join(lines) + "\n")

    def _dvc(self, d, *argv) -> Result:
        secs, p = timed(["dvc", *argv], d, self.args.timeout)
        if p is None:
            return Result(None, f"timeout after {self.args.timeout:.0f} s", False)
        if p.returncode != 0:
            return Result(None, f"exit {p.returncode}: {tail(p.stderr)}", False)
        return Result(secs)

    def cold(self, g, d, jobs):
        if jobs != self.args.jobs:
            twin = d.parent / f"{d.name}-j{jobs}"
            self.setup(g, twin)
            d = twin
        return self._dvc(d, "repro", "-q")

    def noop_run(self, g, d, jobs):
        return self._dvc(d, "repro", "-q")

    def noop_status(self, g, d):
        return self._dvc(d, "status", "-q")

    def change_param(self, g, d, jobs):
        (d / "params" / f"{g.changed}.txt").write_text(f"{g.changed} 2\n")
        return self._dvc(d, "repro", "-q")


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(r):
        cells = [str(c).ljust(w) if i == 0 else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def median(results: list[Result]) -> Result:
    bad = [r for r in results if not r.ok or r.seconds is None]
    if bad:
        return bad[0]
    return Result(statistics.median(r.seconds for r in results), results[-1].note)


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# --------------------------------------------------------------------------------------------
# The engine benchmark
# --------------------------------------------------------------------------------------------

MEASURES = ["cold", "cold_j1", "noop_run", "noop_status", "rerun", "per_stage"]


def measure_tool(t: Tool, g: Graph, d: Path, r: dict[str, Result], args) -> None:
    """The measures of one tool on one graph, in order, into r."""
    j = args.jobs
    t.setup(g, d)
    r["cold_j1"] = t.cold(g, d, 1)
    r["cold"] = t.cold(g, d, j) if j != 1 else r["cold_j1"]
    if isinstance(t, NemoDag):  # the store that the later measures use
        if j == 1:
            shutil.copytree(d / "store-j1", d / "store")
        else:
            os.rename(d / f"store-j{j}", d / "store")
    r["noop_run"] = median([t.noop_run(g, d, j) for _ in range(args.repeat)])
    r["noop_status"] = median([t.noop_status(g, d) for _ in range(args.repeat)])
    r["rerun"] = t.change_param(g, d, j)
    c1 = r["cold_j1"].seconds
    r["per_stage"] = Result(None if c1 is None else c1 / g.n)


def bench_case(shape: str, n: int, tools: list[Tool], args, workdir: Path) -> dict:
    g = make_graph(shape, n)
    case = Path(tempfile.mkdtemp(prefix=f"{shape}-{n}-", dir=workdir))
    j = args.jobs
    res: dict[str, dict[str, Result]] = {t.name: {} for t in tools}
    for t in tools:
        try:
            measure_tool(t, g, case / t.name, res[t.name], args)
        except (OSError, subprocess.SubprocessError) as e:  # one tool failing spoils no other
            for m in MEASURES:
                res[t.name].setdefault(m, Result(None, f"{type(e).__name__}: {e}", False))
    # The two tools must have computed the same thing: compare the sink's output.
    mismatch = ""
    nemo = next((t for t in tools if isinstance(t, NemoDag)), None)
    make = next((t for t in tools if type(t) is Make), None)
    if nemo and make:
        sink = g.sinks()[-1]
        a = nemo.sink_output(g, case / nemo.name, sink)
        b = make.sink_output(g, case / make.name, sink)
        if a is None or a != b:
            mismatch = f"sink {sink} output differs: nemo-dag {a!r} vs make {b!r}"
    if not args.keep:
        shutil.rmtree(case, ignore_errors=True)

    k = 1 + len(g.descendants(g.changed))
    labels = {
        "cold": f"first run (cold, -j{j})",
        "cold_j1": "first run (cold, -j1)",
        "noop_run": f"no-op run (median of {args.repeat})",
        "noop_status": f"no-op status (median of {args.repeat})",
        "rerun": f"rerun after 1 param change ({g.changed}, {k} stages)",
        "per_stage": "wall per executed stage (cold -j1 / N)",
    }
    names = [t.name for t in tools]
    header = ["measure", *(f"{x} s" for x in names)]
    has_ratio = "nemo-dag" in names and "make" in names
    if has_ratio:
        header.append("nemo/make")
    rows = []
    for m in MEASURES:
        row = [labels[m]] + [fmt_s(res[x][m].seconds) if res[x][m].ok or res[x][m].seconds
                             else "error" for x in names]
        if has_ratio:
            row.append(ratio(res["nemo-dag"][m].seconds, res["make"][m].seconds))
        rows.append(row)
    if has_ratio:
        a, b = res["nemo-dag"]["cold_j1"].seconds, res["make"]["cold_j1"].seconds
        diff = None if a is None or b is None else (a - b) / n
        rows.append(["nemo-dag minus make per stage (-j1)", fmt_s(diff)]
                    + [""] * (len(header) - 2))
    print(f"\n== {shape}, N = {n} (--jobs {j}) ==")
    print(table(header, rows))
    for x in names:
        for m in MEASURES:
            if not res[x][m].ok:
                print(f"  ! {x} {labels[m]}: {res[x][m].note}")
    if mismatch:
        print(f"  ! {mismatch}")
    return {"shape": shape, "n": n, "res": res}


def goals_report(cases: list[dict]) -> None:
    at = [c for c in cases if c["n"] == GOAL_N and "nemo-dag" in c["res"]]
    print(f"\n== Goals (issue), at N = {GOAL_N} ==")
    if not at:
        print(f"(no case at N = {GOAL_N} with nemo-dag: run with --sizes including {GOAL_N})")
        return
    rows = []
    for c in at:
        r = c["res"]["nemo-dag"]
        st = r["noop_status"].seconds
        mq = c["res"].get("make", {}).get("noop_status", Result()).seconds
        ps = r["per_stage"].seconds
        rows.append([c["shape"], "no-op status < 0.100 s", fmt_s(st),
                     "-" if st is None else verdict(st < GOAL_STATUS_S)])
        rows.append([c["shape"], "no-op status <= 3x make -q", ratio(st, mq),
                     "-" if st is None or mq is None else verdict(st <= GOAL_STATUS_VS_MAKE * mq)])
        rows.append([c["shape"], "overhead per executed stage < 0.010 s", fmt_s(ps),
                     "-" if ps is None else verdict(ps < GOAL_OVERHEAD_S)])
        mk = c["res"].get("make", {}).get("per_stage", Result()).seconds
        if ps is not None and mk is not None:
            rows.append([c["shape"], "  same, less make's per stage (cmd cost)", fmt_s(ps - mk),
                         verdict(ps - mk < GOAL_OVERHEAD_S)])
    print(table(["shape", "goal", "measured", "verdict"], rows))


def summary(cases: list[dict], names: list[str]) -> None:
    print("\n== Summary (seconds; nemo-dag / make) ==")
    cols = [("cold", "cold"), ("noop_run", "no-op run"), ("noop_status", "no-op status"),
            ("rerun", "1-param rerun"), ("per_stage", "per stage -j1")]
    header = ["shape", "N"]
    for _, label in cols:
        header += [label] if "make" not in names or "nemo-dag" not in names else [label, "ratio"]
    rows = []
    for c in cases:
        row = [c["shape"], str(c["n"])]
        for m, _ in cols:
            vals = [c["res"][x][m].seconds for x in names if x in ("nemo-dag", "make")]
            row.append(" / ".join(fmt_s(v) for v in vals))
            if "make" in names and "nemo-dag" in names:
                row.append(ratio(c["res"]["nemo-dag"][m].seconds, c["res"]["make"][m].seconds))
        rows.append(row)
    print(table(header, rows))


# --------------------------------------------------------------------------------------------
# The big-input hashing benchmark
# --------------------------------------------------------------------------------------------


def bench_big(args, nemo: NemoDag | None, workdir: Path) -> None:
    mib = args.big_size_mib
    print(f"\n== Big input: hashing a {mib} MiB file of random bytes ==")
    d = Path(tempfile.mkdtemp(prefix="big-", dir=workdir))
    big = d / "big.bin"
    chunk = 16 << 20
    left = mib << 20
    t0 = time.perf_counter()
    with open(big, "wb") as f:
        while left:
            k = min(chunk, left)
            f.write(os.urandom(k))
            left -= k
    print(f"wrote {big} ({mib} MiB) in {time.perf_counter() - t0:.1f} s")
    (d / "pipeline.yaml").write_text(
        "stages:\n  consume:\n    op: cmd\n    params: {v: 1}\n"
        "    inputs: {data: big.bin}\n    outputs: {o: o.txt}\n"
        '    cmd: "echo {params.v} > {outputs.o}"\n')
    rows = []
    b3 = shutil.which("b3sum")
    b3_s = None
    if not b3:
        print("b3sum: not installed (Debian: apt-get install -y b3sum); b3sum columns skipped")
    else:
        subprocess.run([b3, str(big)], capture_output=True)  # warms the page cache
        print("page cache: warmed by one untimed `b3sum big.bin` first; every figure below is "
              "hot-cache (hashing speed, not disk speed)")
        b3_s = median([Result(timed([b3, "big.bin"], d, args.timeout)[0])
                       for _ in range(3)]).seconds
        b3_1 = median([Result(timed([b3, "--num-threads", "1", "big.bin"], d, args.timeout)[0])
                       for _ in range(3)]).seconds
        rows.append(["b3sum big.bin (median of 3)", fmt_s(b3_s), f"{mib / b3_s:.0f}", "", ""])
        rows.append(["b3sum --num-threads 1 big.bin (median of 3)", fmt_s(b3_1),
                     f"{mib / b3_1:.0f}", "", ""])
    if nemo is None:
        print(table(["measure", "seconds", "MiB/s", "vs b3sum", "goal"], rows))
        shutil.rmtree(d, ignore_errors=True)
        return
    # The digest memo ignores files modified in the last 2 s ("racy" timestamps): let it settle
    # so that the run below memoises the digest, as it would for a real corpus.
    age = time.time() - big.stat().st_mtime
    if age < 3:
        time.sleep(3 - age)
    colds, notes = [], []
    for i in range(3):  # a fresh store each time: nothing memoised, the file is hashed
        argv = [nemo.bin, "status", "pipeline.yaml", "--json", "--store", f"cold-store-{i}"]
        secs, p = timed(argv, d, args.timeout, nemo.env)
        if p is None or p.returncode != 0:
            notes.append(f"`{' '.join(argv[1:])}` failed: "
                         f"{'timeout' if p is None else tail(p.stderr)}")
            break
        colds.append(secs)
    if colds:
        s = statistics.median(colds)
        thr = mib / s
        vs = None if b3_s is None else thr / (mib / b3_s)
        rows.append([f"nemo-dag status, cold (median of {len(colds)}, fresh store each)",
                     fmt_s(s), f"{thr:.0f}", "-" if vs is None else f"{vs:.2f}x",
                     f">= {GOAL_HASH_VS_B3SUM}x b3sum: "
                     + ("-" if vs is None else verdict(vs >= GOAL_HASH_VS_B3SUM))])
    secs, p = timed([nemo.bin, "run", "pipeline.yaml", "--json", "--store", "store"], d,
                    args.timeout, nemo.env)
    if p is None or p.returncode != 0:
        notes.append(f"nemo-dag run failed: {'timeout' if p is None else tail(p.stderr)}")
    else:
        rows.append(["nemo-dag run, first (hashes the input again)", fmt_s(secs), "", "", ""])
        noops = []
        for _ in range(args.repeat):
            secs, p = timed([nemo.bin, "status", "pipeline.yaml", "--json", "--store", "store"],
                            d, args.timeout, nemo.env)
            if p is None or p.returncode != 0:
                notes.append("no-op status failed")
                break
            states = [s["state"] for s in json.loads(p.stdout)["stages"]]
            if states != ["up-to-date"]:
                notes.append(f"no-op status after a run: states {states}, expected up-to-date")
            noops.append(secs)
        if noops:
            s = statistics.median(noops)
            rows.append([f"nemo-dag status, no-op after one run (median of {len(noops)})",
                         fmt_s(s), "", "", f"< {GOAL_BIG_NOOP_S} s: {verdict(s < GOAL_BIG_NOOP_S)}"])
            if colds and s > 0.5 * statistics.median(colds):
                notes.append(f"the no-op status ({s:.3f} s) costs about as much as hashing the file "
                             f"cold ({statistics.median(colds):.3f} s): the digest memo "
                             "(<store>/cache/digests.json) was not used")
    print(table(["measure", "seconds", "MiB/s", "vs b3sum", "goal"], rows))
    for m in notes:
        print(f"  ! {m}")
        nemo.note(f"big input: {m}")
    if not args.keep:
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(
        description="nemo-dag engine benchmark against GNU make (and DVC / Snakemake if installed)")
    ap.add_argument("--bin", default=str(REPO / "target" / "release" / "nemo-dag"),
                    help="the nemo-dag binary (default: target/release/nemo-dag in the repo)")
    ap.add_argument("--sizes", default="10,100,1000",
                    help="stage counts, comma-separated (default 10,100,1000; 10000 is opt-in)")
    ap.add_argument("--shapes", default="chain,wide,diamond", help="chain,wide,diamond")
    ap.add_argument("--jobs", "-j", type=int, default=2, help="parallel jobs for both (default 2)")
    ap.add_argument("--repeat", type=int, default=5, help="repeats of no-op measures (median)")
    ap.add_argument("--tools", default="nemo-dag,make,snakemake,dvc",
                    help="which to measure (default all; snakemake/dvc only when installed)")
    ap.add_argument("--workdir", help="where the per-case temp dirs go (default: a fresh mkdtemp)")
    ap.add_argument("--keep", action="store_true", help="keep the case directories")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per command")
    ap.add_argument("--big-input", action="store_true", help="also run the input-hashing bench")
    ap.add_argument("--big-size-mib", type=int, default=1024, help="its file size (MiB)")
    ap.add_argument("--big-only", action="store_true", help="only the input-hashing bench")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r} (one of {', '.join(SHAPES)})")

    wanted = [x.strip() for x in args.tools.split(",")]
    classes = {"nemo-dag": NemoDag, "make": Make, "snakemake": Snakemake, "dvc": Dvc}
    tools: list[Tool] = []
    print("nemo-dag engine benchmark")
    print(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
          f"host: {platform.node()}, {os.cpu_count()} CPUs, {platform.platform()}; "
          f"python {platform.python_version()}")
    for name in ("nemo-dag", "make", "snakemake", "dvc"):
        if name not in wanted:
            print(f"{name:10} skipped (--tools)")
            continue
        t = classes[name](args)
        why = t.available()
        if why:
            print(f"{name:10} {why}")
            if name == "nemo-dag":
                print("           nemo-dag is required: build it, or pass --tools make to run "
                      "the Make half alone")
                return 2
            continue
        print(f"{name:10} {t.version()}")
        tools.append(t)

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="nemo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"workdir: {workdir}; --jobs {args.jobs}; sizes {sizes}; shapes {shapes}")
    print("stages: cheap `cmd`s (echo / cat | cksum), so the figures are engine overhead")

    cases = []
    if not args.big_only:
        for n in sizes:
            for shape in shapes:
                cases.append(bench_case(shape, n, tools, args, workdir))
        summary(cases, [t.name for t in tools])
        goals_report(cases)
    nemo = next((t for t in tools if isinstance(t, NemoDag)), None)
    if args.big_input or args.big_only:
        bench_big(args, nemo, workdir)
    if nemo:
        print("\n== nemo-dag behaviour to look at (contract mismatches, unexpected results) ==")
        print("\n".join(f"- {m}" for m in nemo.contract_notes) or "(none)")
    if not args.workdir and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
