#!/usr/bin/env python3
"""Slurm executor benchmark: submission time and per-stage overhead, next to plain sbatch.

Needs a running cluster (`eval "$(scripts/slurm-up)"`) and a release build
(`cargo build --release`). Usage:

    python3 bench/slurm_bench.py [--stages 100] [--bin target/release/nemo-dag]

For a chain of N trivial `cmd` stages it measures, in one run:
  1. `nemo-dag run --batch`: wall time to submit all N jobs (goal: under 2 s for N = 100);
  2. the time until every stage is published (polling `nemo-dag status`), and so the overhead
     per stage from submission to published artifact;
and the same chain submitted by hand as N `sbatch --parsable --dependency=afterok` calls
running `true`, polled with squeue: the floor that Slurm itself sets on this machine.
"""

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def chain_manifest(n: int) -> str:
    lines = ["stages:"]
    for i in range(n):
        lines.append(f"  s{i:04d}:")
        lines.append("    op: cmd")
        lines.append("    outputs: {o: o.txt}")
        if i == 0:
            lines.append('    cmd: "echo 0 > {outputs.o}"')
        else:
            lines.append(f'    inputs: {{i: "s{i - 1:04d}:o"}}')
            lines.append('    cmd: "cat {inputs.i} > {outputs.o}; echo ' + str(i) + ' >> {outputs.o}"')
    return "\n".join(lines) + "\n"


def wait_all(check, limit: float) -> float:
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > limit:
            raise SystemExit(f"timed out after {limit} s")
        time.sleep(0.2)
    return time.perf_counter() - start


def bench_nemo(binary: Path, n: int, work: Path) -> tuple[float, float]:
    (work / "env.toml").write_text('[lab]\nexecutor = "slurm"\n')
    (work / ".git").write_text("")
    (work / "chain.yaml").write_text(chain_manifest(n))
    t0 = time.perf_counter()
    subprocess.run([str(binary), "run", "chain.yaml", "--batch", "lab"], cwd=work, check=True,
                   stderr=subprocess.DEVNULL)
    submit = time.perf_counter() - t0

    def done() -> bool:
        out = subprocess.run([str(binary), "status", "chain.yaml", "--json"], cwd=work, check=True,
                             capture_output=True, text=True).stdout
        return all(s["state"] == "up-to-date" for s in json.loads(out)["stages"])

    wait_all(done, 30 + 5 * n)
    return submit, time.perf_counter() - t0


def bench_sbatch(n: int, work: Path) -> tuple[float, float]:
    ids = []
    t0 = time.perf_counter()
    for i in range(n):
        args = ["sbatch", "--parsable", "-o", str(work / f"j{i}.out"), "--wrap", "true"]
        if ids:
            args[1:1] = [f"--dependency=afterok:{ids[-1]}", "--kill-on-invalid-dep=yes"]
        ids.append(subprocess.run(args, check=True, capture_output=True, text=True).stdout.strip().split(";")[0])
    submit = time.perf_counter() - t0

    def done() -> bool:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%T", "-j", ",".join(ids)],
                             capture_output=True, text=True).stdout.split()
        return len(out) == n and all(s == "COMPLETED" for s in out)

    wait_all(done, 30 + 5 * n)
    return submit, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, default=100)
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "nemo-dag")
    args = ap.parse_args()
    if not shutil.which("sbatch"):
        raise SystemExit("no sbatch on PATH: start a cluster with scripts/slurm-up first")
    if not args.bin.exists():
        raise SystemExit(f"{args.bin} not found: cargo build --release")
    n = args.stages
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "nemo").mkdir()
        (work / "plain").mkdir()
        nemo_submit, nemo_total = bench_nemo(args.bin.resolve(), n, work / "nemo")
        plain_submit, plain_total = bench_sbatch(n, work / "plain")
    print(f"Slurm chain of {n} stages, one job per stage (single-node cluster, {os.cpu_count()} cores)")
    print(f"{'':34} {'nemo-dag':>10} {'plain sbatch':>13} {'ratio':>7}")
    rows = [
        ("submit all jobs (s)", nemo_submit, plain_submit),
        ("submit → all complete (s)", nemo_total, plain_total),
        ("per stage, submit → done (ms)", 1000 * nemo_total / n, 1000 * plain_total / n),
    ]
    for name, a, b in rows:
        print(f"{name:34} {a:10.3f} {b:13.3f} {a / b:7.2f}")
    print(f"goal: submit {n} stages in under 2 s — {'met' if nemo_submit < 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
