#!/usr/bin/env python3
"""tokenize benchmark: nemo-dag's `tokenize` op against Python `tokenizers` + numpy, same
corpus, same tokenizer.json, same machine, at 1 and 2 threads.

    cargo build --release
    python3 -m venv target/bench-venv && target/bench-venv/bin/pip install tokenizers numpy
    target/bench-venv/bin/python bench/tokenize_bench.py [--mb 100] [--threads 1,2]

The corpus is JSONL generated here (deterministic pseudo-English with punctuation, numbers
and some unicode; `--mb` megabytes of text), so the benchmark needs nothing from outside.
The tokenizer is a byte-level BPE with an 8,192-token vocabulary trained by nemo-dag's own
`train_tokenizer` op on the first 5 MB (timed separately, not part of the comparison).

- nemo-dag: `run --force data` of a one-stage `tokenize` manifest (4 shards, EOS appended,
  int32), with RAYON_NUM_THREADS=N. The time includes process start, reading JSONL, hashing
  the input and publishing the artifact — everything a user waits for.
- Python: read the same JSONL, `Tokenizer.encode_batch_fast` (no offsets, like nemo-dag) in
  batches of 1,000 (threads capped with RAYON_NUM_THREADS=N), append EOS, and write one MMIDIDX
  .bin/.idx with numpy as Megatron's `preprocess_data.py` would.

Both produce the same token count (checked). Printed: seconds, tokens/s, tokens per CPU-second
and the ratio nemo-dag / Python.
"""

import argparse
import json
import os
import random
import resource
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no what "
    "model data training token learning rate batch gradient loss layer attention expert mixture "
    "naïve café über résumé 北京 東京 🙂 ½ 3.14 42 1,000 2026 — (see above) [note] e.g. i.e."
).split()


def make_corpus(path: Path, mb: int) -> int:
    rng = random.Random(0)
    target = mb * 1_000_000
    written = 0
    rows = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            n = rng.randint(20, 400)
            words = [rng.choice(WORDS) for _ in range(n)]
            for i in range(0, n, rng.randint(8, 20)):
                words[i] = words[i].capitalize()
                if i:
                    words[i - 1] += rng.choice([".", ",", ";", ":", "!", "?"])
            text = " ".join(words) + "."
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
            written += len(text.encode())
            rows += 1
    return rows


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_nemo(binary: Path, work: Path, threads: int) -> tuple[float, float, int]:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), RAYON_RS_NUM_THREADS=str(threads))
    cpu0 = cpu_of_children()
    t0 = time.perf_counter()
    subprocess.run([str(binary), "run", "m.yaml", "--force", "data"], cwd=work, env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    cpu = cpu_of_children() - cpu0
    show = subprocess.run([str(binary), "show", "data", "--manifest", "m.yaml", "--json"], cwd=work,
                          check=True, capture_output=True, text=True).stdout
    return wall, cpu, json.loads(show)["metrics"]["total_tokens"]


PY_SIDE = r'''
import json, struct, sys, time, numpy as np
from tokenizers import Tokenizer
tok_path, corpus, prefix = sys.argv[1:4]
tok = Tokenizer.from_file(tok_path)
eos = tok.token_to_id("<|endoftext|>")
lengths, chunks = [], []
batch = []
def flush():
    for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
        ids = enc.ids + [eos]
        lengths.append(len(ids))
        chunks.append(np.asarray(ids, dtype=np.int32))
    batch.clear()
with open(corpus, encoding="utf-8") as f:
    for line in f:
        batch.append(json.loads(line)["text"])
        if len(batch) == 1000:
            flush()
flush()
with open(prefix + ".bin", "wb") as b:
    for c in chunks:
        b.write(c.tobytes(order="C"))
lengths = np.asarray(lengths, dtype=np.int32)
pointers = np.zeros(len(lengths), dtype=np.int64)
np.cumsum(lengths[:-1].astype(np.int64) * 4, out=pointers[1:])
doc_idx = np.arange(len(lengths) + 1, dtype=np.int64)
with open(prefix + ".idx", "wb") as x:
    x.write(b"MMIDIDX\x00\x00"); x.write(struct.pack("<Q", 1)); x.write(struct.pack("<B", 4))
    x.write(struct.pack("<Q", len(lengths))); x.write(struct.pack("<Q", len(doc_idx)))
    x.write(lengths.tobytes(order="C")); x.write(pointers.tobytes(order="C")); x.write(doc_idx.tobytes(order="C"))
print(int(lengths.sum()))
'''


def run_python(tok: Path, corpus: Path, work: Path, threads: int) -> tuple[float, float, int]:
    env = dict(os.environ, RAYON_RS_NUM_THREADS=str(threads), RAYON_NUM_THREADS=str(threads),
               TOKENIZERS_PARALLELISM="true")
    cpu0 = cpu_of_children()
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", PY_SIDE, str(tok), str(corpus), str(work / "py_shard")],
                         env=env, check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - t0
    return wall, cpu_of_children() - cpu0, int(out.strip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "nemo-dag")
    args = ap.parse_args()
    try:
        import tokenizers  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        raise SystemExit("needs Python tokenizers and numpy: see the usage at the top of this file")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        rows = make_corpus(work / "corpus.jsonl", args.mb)
        with open(work / "corpus.jsonl", encoding="utf-8") as src, open(work / "sample.jsonl", "w", encoding="utf-8") as dst:
            size = 0
            for line in src:
                dst.write(line)
                size += len(line)
                if size > 5_000_000:
                    break
        print(f"corpus: {args.mb} MB of text, {rows} documents (generated in {time.perf_counter() - t0:.1f} s)")
        (work / "m.yaml").write_text(
            "stages:\n"
            "  tok:\n    op: train_tokenizer\n    inputs: {corpus: sample.jsonl}\n    params: {vocab_size: 8192}\n"
            "  data:\n    op: tokenize\n    inputs: {tokenizer: \"tok:tokenizer\", corpus: corpus.jsonl}\n"
            "    params: {num_shards: 4}\n"
        )
        t0 = time.perf_counter()
        subprocess.run([str(args.bin), "run", "m.yaml", "--target", "tok"], cwd=work, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"tokenizer: 8192-token byte-level BPE trained on 5 MB in {time.perf_counter() - t0:.1f} s")
        tok = Path(json.loads(subprocess.run([str(args.bin), "show", "tok", "--manifest", "m.yaml", "--json"], cwd=work,
                                             check=True, capture_output=True, text=True).stdout)["outputs"]["tokenizer"]["path"])
        print()
        print(f"{'threads':>7} {'side':>8} {'seconds':>8} {'tokens/s':>12} {'tok/CPU-s':>12} {'nemo/python':>12}")
        for n in [int(x) for x in args.threads.split(",")]:
            nw, nc, ntok = run_nemo(args.bin, work, n)
            pw, pc, ptok = run_python(tok, work / "corpus.jsonl", work, n)
            if ntok != ptok:
                raise SystemExit(f"token counts differ: nemo-dag {ntok}, python {ptok}")
            print(f"{n:>7} {'nemo-dag':>8} {nw:8.2f} {ntok / nw:12,.0f} {ntok / nc:12,.0f} {pw / nw:11.2f}x")
            print(f"{n:>7} {'python':>8} {pw:8.2f} {ptok / pw:12,.0f} {ptok / pc:12,.0f}")
        print(f"\n{ntok:,} tokens. Goal: nemo-dag >= 2x Python's per-core throughput, near-linear in threads.")


if __name__ == "__main__":
    main()
