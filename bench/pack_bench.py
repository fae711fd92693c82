#!/usr/bin/env python3
"""pack throughput: conversations → chat template → role chunks → tokens → packed Parquet.

    cargo build --release
    python3 bench/pack_bench.py [--rows 50000] [--threads 1,2]

Generates `--rows` arithmetic conversations with nemo-dag's own `generate` op (a third of them
with reasoning), trains a 4,096-token tokenizer on the pretraining text, then times
`run --force sft` of a `pack` stage (pack_size 1024, 4 shards, first_fit_shuffle) with
RAYON_NUM_THREADS=N, and reports sequences/s and tokens/s from the stage's own metrics.
"""

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=50000)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--bin", type=Path, default=ROOT / "target" / "release" / "nemo-dag")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "m.yaml").write_text(
            "stages:\n"
            f"  gen:\n    op: generate\n    params: {{kind: arithmetic, count: {args.rows}, seed: 1}}\n"
            "  tok:\n    op: train_tokenizer\n    inputs: {corpus: \"gen:pretrain\"}\n    params: {vocab_size: 4096}\n"
            "  sft:\n    op: pack\n    inputs: {tokenizer: \"tok:tokenizer\", chat: \"gen:chat\"}\n"
            "    params: {pack_size: 1024, num_shards: 4}\n"
        )
        subprocess.run([str(args.bin), "run", "m.yaml", "--target", "tok"], cwd=work, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(f"pack: {args.rows} conversations, pack_size 1024, 4 shards, first_fit_shuffle")
        print(f"{'threads':>7} {'seconds':>8} {'sequences/s':>12} {'tokens/s':>12} {'packed rows':>12}")
        for n in [int(x) for x in args.threads.split(",")]:
            env = dict(os.environ, RAYON_NUM_THREADS=str(n))
            t0 = time.perf_counter()
            subprocess.run([str(args.bin), "run", "m.yaml", "--force", "sft"], cwd=work, env=env, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            wall = time.perf_counter() - t0
            m = json.loads(subprocess.run([str(args.bin), "show", "sft", "--manifest", "m.yaml", "--json"], cwd=work,
                                          check=True, capture_output=True, text=True).stdout)["metrics"]
            print(f"{n:>7} {wall:8.2f} {m['num_sequences'] / wall:12,.0f} {m['total_tokens'] / wall:12,.0f} "
                  f"{m['num_packed_sequences']:>12,}")
        print(f"packing factor {m['packing_factor']}, efficiency {m['packing_efficiency']}%")


if __name__ == "__main__":
    main()
