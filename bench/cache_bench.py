#!/usr/bin/env python3
"""Shared-cache benchmark: `nemo-dag push` / `nemo-dag pull` against `dvc push` / `dvc pull`.

Both tools talk to the SAME local S3-compatible server (s3s-fs on a loopback port, built by
scripts/test into target/tools/bin), each under its own bucket prefix, in one run. Usage:

    python3 bench/cache_bench.py [--bin target/release/nemo-dag] [--big-mib 1024] [--stages 1000]
    python3 bench/cache_bench.py --bin target/debug/nemo-dag --big-mib 64 --stages 100   # a check
    python3 bench/cache_bench.py --count-requests     # also count the S3 requests of each command
    python3 bench/cache_bench.py --tools nemo-dag     # the nemo-dag half alone (no DVC needed)

DVC comes from PyPI: the script uses the venv target/bench-venv-dvc (--dvc-venv), and creates
it (`python3 -m venv`, `pip install 'dvc[s3]'`) when `dvc` and its S3 plugin are not importable
there (--no-install refuses instead). DVC runs through a ten-line shim that works around one
s3s-fs quirk (a HEAD of a key that is a "directory" there gets a 500 where S3 answers 404, and
`dvc pull` HEADs its remote's root first; see DVC_SHIM below); nothing else of DVC is changed.
The driver itself is standard library only (Python 3.11).

s3s-fs does not set TCP_NODELAY, and sends a GET's headers and streamed body in two writes:
Nagle and the client's delayed ACK then cost about 40 ms per GET with a body, whoever the
client is (a sequential GET of a 1.5 KB object: 44 ms, against 0.8 ms with TCP_NODELAY). That
is the test server's, not a property of S3, and it hurts most the tool that issues requests one
after another. So the script sets TCP_NODELAY on s3s-fs's listening socket once it listens
(borrowed with pidfd_getfd; accepted sockets inherit it); --server-nagle leaves it off.

Two cases, each measured for both tools. A "machine" is a project directory of its own: a
nemo-dag project (manifest, env.toml with [cache], `.git` marker) or a DVC repo (`dvc init
--no-scm`, an S3 remote with `endpointurl`). Machine A builds and pushes; machine B starts
empty and pulls.

  1. The big artifact: a file of --big-mib MiB of random bytes (default 1 GiB).
     nemo-dag: one `cmd` stage `cp SRC {outputs.o}`. SRC is an absolute path outside the
     project and is not a declared input, so the stage key depends on the command text alone
     and B's `pull` hashes no local input (as `dvc pull` hashes none). A runs it
     (`run --offline`, untimed), then the timed `push` (cold: empty prefix), a no-op `push`,
     and B's `pull`.
     DVC: A copies SRC in and runs `dvc add big.bin` (untimed: md5 + copy into .dvc/cache),
     then the timed `dvc push`, a no-op `dvc push`; B gets A's .dvc/config, config.local and
     big.bin.dvc, and an empty cache, and runs the timed `dvc pull`.
  2. A pipeline of --stages small artifacts (default 1,000): nemo-dag, N independent `cmd`
     stages `echo i > {outputs.o}`; DVC, one directory of N files `f<i>.txt` holding the same
     bytes, tracked by one `dvc add data`. Timed: cold push, no-op push (median of --repeat),
     pull on B.

What each timed region includes (printed again with the table):
  - nemo-dag push: keying the manifest's stages (the digests of the published artifacts),
    then per stage a GET of the record, the write probe (once), a blake3 hash of every file of
    the artifact (artifact.json, log.txt and the outputs: the push hashes the files again),
    a HEAD per blob, the uploads (8 blobs at a time; over 16 MiB in 16 MiB parts, 8 in
    flight), then the record. Stages whose upstream stages are settled move 8 at a time.
  - nemo-dag pull: per stage the record, the downloads (hashed as they stream, one GET per
    blob), a second hash of each output from disk, an fsync of the tree, the publish rename.
  - dvc push: Python start-up, loading the repo and the hashes `dvc add` stored (no
    re-hashing of an unchanged file), the remote existence checks, the uploads.
  - dvc pull: Python start-up, the fetch into B's .dvc/cache, then the checkout into the
    workspace (a copy from the cache where the file system has no reflinks: one more write of
    every byte); downloads are not hashed (the S3 remote's `verify` defaults to false).
The start-up of each CLI alone (`--version`) is printed as a floor.

Before anything is reported, the bytes each tool's B pulled are compared with the originals.
MiB/s is the outputs' payload (the same bytes for both tools) over the command's wall time;
"ratio" is DVC seconds / nemo-dag seconds, so above 1 means nemo-dag is faster. The goals (issue):
at least 1.0x DVC's throughput for the big artifact, and a no-op push of 1,000 already pushed
stages in under 1 s. The page cache is warm (every file was just written); `sync` runs before
each timed command. The server is stopped by its pid and the work directory removed at the
end, also on failure (--keep keeps the directory).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import filecmp
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / "target" / "bench-venv-dvc"
DVC_SHIM_NOTE = "a shim for one s3s-fs quirk (see DVC_SHIM in the script)"
S3S_FS = REPO / "target" / "tools" / "bin" / "s3s-fs"

ACCESS_KEY = "nemo-dag-bench"
SECRET_KEY = "nemo-dag-bench-secret"
BUCKET = "bench"
REGION = "us-east-1"
MIB = 1 << 20

GOAL_BIG_VS_DVC = 1.0  # at least DVC's throughput for the big artifact
GOAL_NOOP_PUSH_S = 1.0  # a no-op push of 1,000 pushed stages under 1 s
GOAL_N = 1000


# --------------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------------


class Failed(Exception):
    pass


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run(argv: list, cwd: Path, env: dict, timeout: float = 3600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout)
    if p.returncode != 0:
        raise Failed(f"`{' '.join(map(str, argv))}` in {cwd} exited {p.returncode}\n"
                     f"stdout:\n{tail(p.stdout)}\nstderr:\n{tail(p.stderr)}")
    return p


def timed(argv: list, cwd: Path, env: dict) -> tuple[float, subprocess.CompletedProcess]:
    os.sync()  # earlier writes are flushed outside the timed region
    t0 = time.perf_counter()
    p = run(argv, cwd, env)
    return time.perf_counter() - t0, p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_nodelay_on_listener(pid: int) -> int:
    """Set TCP_NODELAY on the listening sockets of process `pid`; accepted sockets inherit it
    (Linux). s3s-fs does not set it, and writes a GET's headers and body in two writes when the
    body streams from a file: Nagle then holds the body until the client's delayed ACK, about
    40 ms per GET on loopback, for every client. The socket is borrowed with pidfd_getfd (Linux
    5.6+; a parent may do it to its child). Returns how many listeners were set."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pidfd_open, pidfd_getfd = 434, 438  # the syscall numbers, the same on x86-64 and aarch64
    pidfd = libc.syscall(pidfd_open, pid, 0)
    if pidfd < 0:
        raise OSError(ctypes.get_errno(), "pidfd_open")
    done = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    continue
            except OSError:
                continue
            mine = libc.syscall(pidfd_getfd, pidfd, int(fd), 0)
            if mine < 0:
                raise OSError(ctypes.get_errno(), "pidfd_getfd")
            with socket.socket(fileno=mine) as s:  # closes this copy only
                if s.type == socket.SOCK_STREAM and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    done += 1
    finally:
        os.close(pidfd)
    return done


class Server:
    """s3s-fs on 127.0.0.1 with one bucket (a directory under its root), stopped by its pid."""

    def __init__(self, binary: Path, root: Path, log: Path, count_requests: bool, nodelay: bool):
        self.binary, self.root, self.log, self.count = binary, root, log, count_requests
        self.nodelay = nodelay
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.nodelay_note = "s3s-fs as it is (Nagle on: about 40 ms per GET with a body)"

    def start(self) -> None:
        (self.root / BUCKET).mkdir(parents=True)
        self.port = free_port()
        env = dict(os.environ)
        # With --count-requests, s3s logs one "resolved route, op: X" line per request.
        env["RUST_LOG"] = "s3s::ops=debug,s3s::ops::signature=info" if self.count else "warn"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [self.binary, "--host", "127.0.0.1", "--port", str(self.port),
                 "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY, self.root],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise Failed(f"s3s-fs exited {self.proc.returncode}:\n{tail(self.log.read_text())}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
            except OSError:
                time.sleep(0.05)
                continue
            if self.nodelay:
                try:
                    if set_nodelay_on_listener(self.proc.pid):
                        self.nodelay_note = "TCP_NODELAY set on s3s-fs's listener (--server-nagle: not)"
                except OSError as e:
                    self.nodelay_note = (f"could not set TCP_NODELAY on s3s-fs ({e}): about 40 ms "
                                         "per GET with a body, for both tools")
            return
        raise Failed(f"s3s-fs did not listen on port {self.port}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def mark(self) -> int:
        return self.log.stat().st_size if self.count else 0

    def requests_since(self, mark: int) -> collections.Counter | None:
        if not self.count:
            return None
        time.sleep(0.05)  # the server's last log lines
        with open(self.log, "rb") as f:
            f.seek(mark)
            text = re.sub(r"\x1b\[[0-9;]*m", "", f.read().decode(errors="replace"))
        return collections.Counter(re.findall(r"resolved route, op: (\w+)", text))

    def usage(self, prefix: str) -> tuple[int, int]:
        """Objects and bytes the server holds under `prefix` of the bucket."""
        n = size = 0
        for dirpath, _, files in os.walk(self.root / BUCKET / prefix):
            for f in files:
                n += 1
                size += os.path.getsize(os.path.join(dirpath, f))
        return n, size


# --------------------------------------------------------------------------------------------
# Measures
# --------------------------------------------------------------------------------------------


@dataclass
class M:
    seconds: float
    payload: int  # the outputs' bytes the command moved (0 for a no-op)
    requests: collections.Counter | None = None
    samples: list[float] = field(default_factory=list)


@dataclass
class Case:
    name: str
    payload: int
    push: M | None = None
    noop: M | None = None
    pull: M | None = None
    setup_s: float = 0.0  # the untimed local build / `dvc add`
    server_objects: int = 0
    server_bytes: int = 0
    note: str = ""


def median_of(fn, repeat: int) -> M:
    ms = [fn() for _ in range(repeat)]
    samples = [m.seconds for m in ms]
    best = sorted(ms, key=lambda m: m.seconds)[len(ms) // 2]
    best.samples = samples
    return best


# --------------------------------------------------------------------------------------------
# nemo-dag
# --------------------------------------------------------------------------------------------


def big_manifest(src: Path) -> str:
    cmd = f"cp '{src}' {{outputs.o}}"
    return f"stages:\n  big:\n    op: cmd\n    outputs: {{o: big.bin}}\n    cmd: {json.dumps(cmd)}\n"


def stages_manifest(n: int) -> str:
    lines = ["stages:"]
    for i in range(n):
        lines += [f"  s{i:04d}:", "    op: cmd", "    outputs: {o: o.txt}",
                  f'    cmd: "echo {i} > {{outputs.o}}"']
    return "\n".join(lines) + "\n"


def stage_bytes(i: int) -> bytes:
    return f"{i}\n".encode()


class NemoDag:
    def __init__(self, binary: Path, server: Server, env: dict, keep: bool):
        self.bin, self.server, self.env, self.keep = binary, server, env, keep

    def project(self, d: Path, manifest: str, prefix: str, write: bool) -> None:
        d.mkdir(parents=True)
        (d / "m.yaml").write_text(manifest)
        (d / ".git").write_text("")  # the project root: the env.toml search stops here
        (d / "env.toml").write_text(
            f'[cache]\nurl = "s3://{BUCKET}/{prefix}"\nendpoint = "{self.server.endpoint}"\n'
            f'region = "{REGION}"\nallow_http = true\nread = ["bench"]\n'
            + ('write = "bench"\n' if write else ""))

    def cmd(self, d: Path, *args: str) -> tuple[float, dict, collections.Counter | None]:
        mark = self.server.mark()
        s, p = timed([self.bin, *args, "m.yaml", "--json"], d, self.env)
        try:
            out = json.loads(p.stdout)
        except json.JSONDecodeError:
            raise Failed(f"nemo-dag {' '.join(args)}: no JSON on stdout:\n{tail(p.stdout)}\n{tail(p.stderr)}")
        return s, out, self.server.requests_since(mark)

    def stages(self, out: dict) -> list[dict]:
        return out["stages"]

    def case(self, name: str, manifest: str, prefix: str, payload: int, n: int, work: Path,
             repeat: int, check) -> Case:
        a, b = work / f"nemo-{prefix}-a", work / f"nemo-{prefix}-b"
        full_prefix = f"nemo-dag/{prefix}"
        self.project(a, manifest, full_prefix, write=True)
        self.project(b, manifest, full_prefix, write=False)
        c = Case(name, payload)
        c.setup_s, built, _ = self.cmd(a, "run", "--offline")
        bad = [s for s in self.stages(built) if s.get("state") != "executed"]
        if len(self.stages(built)) != n or bad:
            raise Failed(f"nemo-dag run: expected {n} executed stages, got {bad[:3]}")

        s, out, req = self.cmd(a, "push")
        rows = self.stages(out)
        if len(rows) != n or any(r.get("done") != "pushed" for r in rows):
            raise Failed(f"nemo-dag push: not every stage pushed: "
                         f"{[r for r in rows if r.get('done') != 'pushed'][:3]}")
        c.push = M(s, payload, req)
        sent = sum(r.get("bytes", 0) for r in rows)

        def noop() -> M:
            s, out, req = self.cmd(a, "push")
            again = sum(r.get("bytes", 0) for r in self.stages(out))
            if again or any(r.get("done") for r in self.stages(out)):
                raise Failed(f"nemo-dag no-op push sent {again} bytes")
            return M(s, 0, req)

        c.noop = median_of(noop, repeat)

        s, out, req = self.cmd(b, "pull")
        rows = self.stages(out)
        if len(rows) != n or any(r.get("done") != "pulled" for r in rows):
            raise Failed(f"nemo-dag pull: not every stage pulled: "
                         f"{[r for r in rows if r.get('done') != 'pulled'][:3]}")
        c.pull = M(s, payload, req)
        # The bytes B pulled are the originals.
        for r in rows:  # in the manifest's order, which need not be the stages' numbering
            art = b / ".nemo-dag" / "artifacts" / r["key"]
            outputs = json.loads((art / "artifact.json").read_text())["outputs"]
            check(int(r["name"][1:]) if r["name"].startswith("s") else 0, art / outputs["o"]["path"])
        c.server_objects, c.server_bytes = self.server.usage(full_prefix)
        size = f"{sent / MIB:.1f} MiB" if sent >= MIB else f"{sent / 1024:.1f} KiB"
        c.note = f"push sent {size} (outputs, artifact.json, log.txt per stage)"
        if not self.keep:
            shutil.rmtree(a)
            shutil.rmtree(b)
        return c


# --------------------------------------------------------------------------------------------
# DVC
# --------------------------------------------------------------------------------------------


def ensure_dvc(args) -> Path:
    """The Python of a venv where dvc[s3] imports; the venv is made and filled when it does not."""
    py = args.dvc_venv / "bin" / "python"
    have = py.exists() and subprocess.run([py, "-c", "import dvc, dvc_s3, s3fs"],
                                          capture_output=True).returncode == 0
    if not have:
        if args.no_install:
            raise SystemExit(f"no dvc[s3] in {args.dvc_venv} (and --no-install)")
        print(f"installing dvc[s3] from PyPI into {args.dvc_venv} ...", flush=True)
        if not py.exists():
            subprocess.run([sys.executable, "-m", "venv", args.dvc_venv], check=True)
        subprocess.run([py, "-m", "pip", "install", "-q", "dvc[s3]"], check=True)
    return py


# DVC's `pull` first checks that the remote's root (`<prefix>/files/md5`) exists, with s3fs's
# `exists`: a HEAD of that key, then a listing when S3 answers 404. s3s-fs keeps objects as files,
# so that key is a directory there, and it answers the HEAD with 500 (it reads the "object" to
# compute its ETag); botocore retries the 500 four times with back-off, then DVC gives up
# ("failed to connect to s3"). Real S3 answers 404. This shim, the only change to DVC, answers
# `exists` of such a root with the listing alone (one request where S3 would take two).
DVC_SHIM = """\
import sys

import s3fs.core
from fsspec.asyn import sync_wrapper

_exists = s3fs.core.S3FileSystem._exists


async def _root_exists(self, path):
    p = self._strip_protocol(path).rstrip("/")
    if p.endswith("/files/md5"):
        bucket, key, _ = self.split_path(p)
        out = await self._call_s3("list_objects_v2", Bucket=bucket, Prefix=key + "/", MaxKeys=1)
        return bool(out.get("KeyCount") or out.get("Contents"))
    return await _exists(self, path)


s3fs.core.S3FileSystem._exists = _root_exists
s3fs.core.S3FileSystem.exists = sync_wrapper(_root_exists)

from dvc.cli import main

sys.exit(main())
"""


class Dvc:
    def __init__(self, python: Path, shim: Path, server: Server, env: dict, keep: bool):
        self.python, self.server, self.env, self.keep = python, server, env, keep
        self.bin = [python, shim]  # `dvc` is `python shim.py`

    def version(self) -> str:
        return run([*self.bin, "--version"], REPO, self.env).stdout.strip()

    def repo(self, d: Path, prefix: str) -> None:
        d.mkdir(parents=True)
        run([*self.bin, "init", "--no-scm", "-q"], d, self.env)
        for argv in (["remote", "add", "-d", "bench", f"s3://{BUCKET}/{prefix}"],
                     ["remote", "modify", "bench", "endpointurl", self.server.endpoint],
                     ["remote", "modify", "bench", "region", REGION],
                     ["remote", "modify", "--local", "bench", "access_key_id", ACCESS_KEY],
                     ["remote", "modify", "--local", "bench", "secret_access_key", SECRET_KEY]):
            run([*self.bin, *argv], d, self.env)

    def cmd(self, d: Path, *args: str) -> tuple[float, str, collections.Counter | None]:
        mark = self.server.mark()
        s, p = timed([*self.bin, *args], d, self.env)
        return s, p.stdout + p.stderr, self.server.requests_since(mark)

    def case(self, name: str, prefix: str, payload: int, files: list[str], work: Path, repeat: int,
             lay_out, target: str, check) -> Case:
        a, b = work / f"dvc-{prefix}-a", work / f"dvc-{prefix}-b"
        full_prefix = f"dvc/{prefix}"
        self.repo(a, full_prefix)
        lay_out(a)
        c = Case(name, payload)
        c.setup_s, _, _ = self.cmd(a, "add", "-q", target)

        s, out, req = self.cmd(a, "push")
        c.push = M(s, payload, req)
        pushed = re.search(r"(\d+) files? pushed", out)

        def noop() -> M:
            s, out, req = self.cmd(a, "push")
            if "up to date" not in out.lower():
                raise Failed(f"dvc no-op push did not say it was up to date:\n{tail(out)}")
            return M(s, 0, req)

        c.noop = median_of(noop, repeat)

        b.mkdir(parents=True)
        run([*self.bin, "init", "--no-scm", "-q"], b, self.env)
        for rel in (".dvc/config", ".dvc/config.local", f"{target}.dvc"):
            shutil.copy(a / rel, b / rel)
        s, out, req = self.cmd(b, "pull")
        c.pull = M(s, payload, req)
        for i, rel in enumerate(files):
            check(i, b / rel)
        c.server_objects, c.server_bytes = self.server.usage(full_prefix)
        c.note = f"dvc said: {pushed.group(0) if pushed else tail(out, 1)}"
        if not self.keep:
            shutil.rmtree(a)
            shutil.rmtree(b)
        return c


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def table(header: list[str], rows: list[list[str]], left: tuple[int, ...] = (0,)) -> str:
    """Columns in `left` are text, aligned left; the others are figures, aligned right."""
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    left = tuple(i % len(header) for i in left)

    def line(r):
        cells = [c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def fmt_s(m: M | None) -> str:
    return "-" if m is None else f"{m.seconds:.3f}"


def fmt_rate(m: M | None) -> str:
    if m is None or not m.payload:
        return "-"
    rate = m.payload / MIB / m.seconds
    return f"{rate:.1f}" if rate >= 10 else f"{rate:.3g}"


def fmt_ratio(nemo: M | None, dvc: M | None) -> str:
    if nemo is None or dvc is None:
        return "-"
    return f"{dvc.seconds / nemo.seconds:.2f}x"


def fmt_requests(c: collections.Counter | None) -> str:
    if c is None:
        return "-"
    return f"{sum(c.values())}: " + ", ".join(f"{k} {v}" for k, v in c.most_common())


def report(args, cases: dict[str, dict[str, Case]], startup: dict[str, float]) -> None:
    rows, reqs = [], []
    for key, label in (("big", f"{args.big_mib} MiB artifact"), ("stages", f"{args.stages} stages")):
        nemo, dvc = cases.get("nemo-dag", {}).get(key), cases.get("dvc", {}).get(key)
        if nemo is None and dvc is None:
            continue
        for what, title in (("push", "push (cold)"), ("noop", "push (no-op)"), ("pull", "pull")):
            a = getattr(nemo, what) if nemo else None
            b = getattr(dvc, what) if dvc else None
            med = f", median of {args.repeat}" if what == "noop" else ""
            rows.append([f"{label}: {title}{med}", fmt_s(a), fmt_s(b), fmt_rate(a), fmt_rate(b),
                         fmt_ratio(a, b)])
            if args.count_requests:
                reqs.append([f"{label}: {title}", "nemo-dag", fmt_requests(a.requests if a else None)])
                reqs.append(["", "dvc", fmt_requests(b.requests if b else None)])
    print("\n== Shared cache: nemo-dag against DVC, one s3s-fs server on 127.0.0.1 ==")
    print(table(["case", "nemo-dag s", "DVC s", "nemo-dag MiB/s", "DVC MiB/s", "ratio (DVC/nemo)"],
                rows))
    print("MiB/s: the outputs' bytes over wall time; ratio above 1: nemo-dag is faster.")
    for tool, per in cases.items():
        for key, c in per.items():
            if c.noop and len(c.noop.samples) > 1:
                print(f"no-op push samples, {tool} {key}: "
                      + ", ".join(f"{x:.3f}" for x in c.noop.samples) + " s")
    print("CLI start-up alone (--version): "
          + ", ".join(f"{k} {v:.3f} s" for k, v in startup.items()))

    print("\n== Untimed set-up and what the server holds afterwards ==")
    srows = []
    for tool, what in (("nemo-dag", "run --offline"), ("dvc", "dvc add")):
        for key, c in cases.get(tool, {}).items():
            srows.append([f"{tool} {key}", f"{what}: {c.setup_s:.3f} s", str(c.server_objects),
                          f"{c.server_bytes / MIB:.2f}", c.note])
    print(table(["tool / case", "set-up", "objects", "MiB", "note"], srows, left=(0, 1, -1)))

    if reqs:
        print("\n== S3 requests per command (s3s-fs log; the no-op row is one of the repeats) ==")
        print(table(["command", "tool", "requests"], reqs, left=(0, 1, 2)))

    print("\nWhat each timed command includes:")
    print("  nemo-dag push: key the stages; per stage one record GET, a blake3 re-hash of every file"
          " of the artifact, a HEAD per blob, the uploads (8 blobs at once; 16 MiB parts, 8 in"
          " flight), the record PUT; stages whose upstream is settled, 8 at a time.")
    print("  nemo-dag pull: records, one GET per blob hashed as it streams, each output hashed again"
          " from disk, fsync, publish.")
    print("  dvc push: Python start-up, the md5s `dvc add` stored (no re-hash), existence checks,"
          " uploads (s3fs: 50 MiB parts, up to 10 at once per file; 4 x cores files at once).")
    print("  dvc pull: Python start-up, fetch into .dvc/cache (s3fs: ranged GETs in parallel for big"
          " files), checkout into the workspace (a copy without reflinks); no hash of downloads.")

    print("\n== Goals (issue) ==")
    grows = []
    nemo, dvc = cases.get("nemo-dag", {}), cases.get("dvc", {})
    if "big" in nemo and "big" in dvc:
        for what in ("push", "pull"):
            r = getattr(dvc["big"], what).seconds / getattr(nemo["big"], what).seconds
            grows.append([f"{args.big_mib} MiB {what}: >= {GOAL_BIG_VS_DVC:.1f}x DVC's throughput",
                          f"{r:.2f}x", "met" if r >= GOAL_BIG_VS_DVC else "NOT met"])
    if "stages" in nemo:
        s = nemo["stages"].noop.seconds
        at = "" if args.stages == GOAL_N else f" (measured at N = {args.stages}; the goal is at {GOAL_N})"
        grows.append([f"no-op push of {args.stages} stages < {GOAL_NOOP_PUSH_S:.0f} s{at}", f"{s:.3f} s",
                      "met" if s < GOAL_NOOP_PUSH_S else "NOT met"])
    print(table(["goal", "measured", "verdict"], grows, left=(0, 2)) if grows else "(needs both tools)")


# --------------------------------------------------------------------------------------------


def write_random(path: Path, mib: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MIB))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, default=REPO / "target" / "release" / "nemo-dag")
    ap.add_argument("--s3s-fs", type=Path, default=S3S_FS)
    ap.add_argument("--dvc-venv", type=Path, default=VENV, help="the venv holding dvc[s3] (made if need be)")
    ap.add_argument("--no-install", action="store_true", help="never pip install DVC")
    ap.add_argument("--big-mib", type=int, default=1024)
    ap.add_argument("--stages", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=3, help="no-op pushes per tool (median)")
    ap.add_argument("--tools", default="nemo-dag,dvc")
    ap.add_argument("--cases", default="big,stages")
    ap.add_argument("--count-requests", action="store_true",
                    help="log the server's requests and count them per command (a little slower)")
    ap.add_argument("--server-nagle", action="store_true",
                    help="leave s3s-fs's sockets as they are (Nagle on: ~40 ms per GET with a body)")
    ap.add_argument("--work", type=Path, help="where the temporary directory goes (default: $TMPDIR)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the work directory: projects, repos and the server's files")
    args = ap.parse_args()
    args.repeat = max(1, args.repeat)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    if set(tools) - {"nemo-dag", "dvc"} or set(wanted) - {"big", "stages"}:
        raise SystemExit("--tools takes nemo-dag,dvc and --cases big,stages")
    if "nemo-dag" in tools and not args.bin.exists():
        raise SystemExit(f"{args.bin} not found: cargo build --release")
    if not args.s3s_fs.exists():
        raise SystemExit(f"{args.s3s_fs} not found: scripts/test builds it into target/tools")
    dvc_python = ensure_dvc(args) if "dvc" in tools else None

    # SIGTERM runs the clean-up below as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nemo-dag-cache-bench-", dir=args.work))
    server = Server(args.s3s_fs.resolve(), work / "s3", work / "s3s-fs.log", args.count_requests,
                    not args.server_nagle)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "NEMO_DAG_", "DVC_"))}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=str(work / "aws-config"),
               AWS_SHARED_CREDENTIALS_FILE=str(work / "aws-credentials"),
               DVC_NO_ANALYTICS="1", DVC_SITE_CACHE_DIR=str(work / "dvc-site"),
               DVC_GLOBAL_CONFIG_DIR=str(work / "dvc-global"),
               DVC_SYSTEM_CONFIG_DIR=str(work / "dvc-system"))
    cases: dict[str, dict[str, Case]] = {t: {} for t in tools}
    startup: dict[str, float] = {}
    try:
        server.start()
        nemo = NemoDag(args.bin.resolve(), server, env, args.keep) if "nemo-dag" in tools else None
        dvc = None
        if dvc_python:
            shim = work / "dvc_shim.py"
            shim.write_text(DVC_SHIM)
            dvc = Dvc(dvc_python, shim, server, env, args.keep)
        print(f"cache benchmark, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.node()}, "
              f"{os.cpu_count()} cores, work dir {work}")
        if nemo:
            print(f"nemo-dag: {args.bin} ({run([nemo.bin, '--version'], REPO, env).stdout.strip()})")
            startup["nemo-dag"] = min(timed([nemo.bin, "--version"], REPO, env)[0] for _ in range(3))
        if dvc:
            print(f"dvc: {dvc.version()} in {args.dvc_venv}, run through {DVC_SHIM_NOTE}")
            plain = args.dvc_venv / "bin" / "dvc"
            startup["dvc"] = min(timed([plain, "--version"], REPO, env)[0] for _ in range(3))
        print(f"s3s-fs: {server.endpoint}, bucket `{BUCKET}`, {server.nodelay_note}"
              + (", counting requests" if args.count_requests else ""), flush=True)

        if "big" in wanted:
            src = work / "src" / "big.bin"
            t0 = time.perf_counter()
            write_random(src, args.big_mib)
            print(f"wrote {src} ({args.big_mib} MiB of random bytes) in {time.perf_counter() - t0:.1f} s",
                  flush=True)
            payload = args.big_mib * MIB

            def check_big(_i: int, got: Path) -> None:
                if not filecmp.cmp(src, got, shallow=False):
                    raise Failed(f"{got} is not the bytes of {src}")

            if nemo:
                print("nemo-dag: big artifact ...", flush=True)
                cases["nemo-dag"]["big"] = nemo.case("big", big_manifest(src), "big", payload, 1, work,
                                                     args.repeat, check_big)

            if dvc:
                print("dvc: big artifact ...", flush=True)

                def lay_out_big(d: Path) -> None:
                    shutil.copyfile(src, d / "big.bin")

                cases["dvc"]["big"] = dvc.case("big", "big", payload, ["big.bin"], work, args.repeat,
                                               lay_out_big, "big.bin", check_big)
            if not args.keep:
                src.unlink()

        if "stages" in wanted:
            n = args.stages
            payload = sum(len(stage_bytes(i)) for i in range(n))

            def check_small(i: int, got: Path) -> None:
                if got.read_bytes() != stage_bytes(i):
                    raise Failed(f"{got} holds {got.read_bytes()!r}, not {stage_bytes(i)!r}")

            if nemo:
                print(f"nemo-dag: {n} stages ...", flush=True)
                cases["nemo-dag"]["stages"] = nemo.case("stages", stages_manifest(n), "stages", payload,
                                                        n, work, args.repeat, check_small)
            if dvc:
                print(f"dvc: {n} files ...", flush=True)

                def lay_out_small(d: Path) -> None:
                    (d / "data").mkdir()
                    for i in range(n):
                        (d / "data" / f"f{i:04d}.txt").write_bytes(stage_bytes(i))

                cases["dvc"]["stages"] = dvc.case("stages", "stages", payload,
                                                  [f"data/f{i:04d}.txt" for i in range(n)], work, args.repeat,
                                                  lay_out_small, "data", check_small)
        print("every pulled byte checked against the originals", flush=True)
        report(args, cases, startup)
    except Failed as e:
        print(f"\nFAILED: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        server.stop()
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
