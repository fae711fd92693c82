#!/usr/bin/env python3
"""Training throughput: nemo-dag's `pretrain` (candle, CPU) against the same model in PyTorch.

    cargo build --release
    python3 -m venv target/torch-venv && target/torch-venv/bin/pip install torch numpy
    target/torch-venv/bin/python bench/train_bench.py [--steps 20] [--threads 1,2]
    python3 bench/train_bench.py --baseline-bin OTHER/nemo-dag   # this build against another

The model is the same in both: a Llama-style dense stack `*-*-*-*-` (4 attention + 4 SwiGLU MLP
blocks), hidden 128, 4 query heads sharing 2 KV heads of 32, FFN 384, RMSNorm, rotary positions,
untied output head; vocabulary of the tokenizer nemo-dag trains for the run (about 640 tokens).
Batch: global 16 sequences of 128 tokens as 2 micro-batches of 8 (gradient accumulation), AdamW,
gradient clipping at 1.0: every step processes 2,048 tokens.

- nemo-dag: `nemo-dag run` of a manifest generate → train_tokenizer → tokenize → pretrain with
  RAYON_NUM_THREADS=N; the figure is the op's own `tokens_per_second` metric (training loop
  only, including the final checkpoint write), read from `show --json`.
- PyTorch: the same architecture written out in a few lines (manual softmax attention, the
  graph candle runs; `--sdpa` uses F.scaled_dot_product_attention instead), random token ids,
  torch.set_num_threads(N); tokens/s over the timed steps after 2 warm-up steps.

The hybrid `ME*-/*E` model (Mamba-2, MoE, attention, squared-ReLU MLP, one MTP depth; no
positional encoding; Mamba 4 heads of 32, state 32, chunk 64; MoE 8 experts of 192, top-2,
shared expert 192, scaling 2.5) is timed the same way against its PyTorch twin,
bench/torch_models.py: nemo-dag's parameters under the same names and shapes and the same
forward ops — Mamba-2 as the chunked SSD scan in plain PyTorch with the config's chunk length,
the MoE router's top-k dispatch (each expert runs only on the tokens routed to it) plus the
shared expert, the MTP depth with its own norms and `eh_proj`, the loss main + 0.3·MTP per
token — with AdamW decaying matrices only and the expert biases moved after each step, as
nemo-dag does. bench/check_torch_twin.py loads nemo-dag's own weights into the twin and checks
the eval loss, the first step's loss and gradient norm, and the expert-bias updates against
nemo-dag's. The hybrid's `torch sdpa` column uses F.scaled_dot_product_attention in its two
attention blocks (main stack and MTP depth); everything else is the same as the `torch` column.
Printed: tokens/s for each and the ratio nemo-dag / PyTorch; then tokens per CPU-second (user +
system time: for nemo-dag the whole `nemo-dag run` process, for PyTorch the timed steps), which
holds up better than wall-clock when other work shares the machine.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "nemo-dag"

DENSE = dict(pattern="*-*-*-*-", hidden=128, heads=4, kv_heads=2, head_dim=32, ffn=384)
HYBRID = dict(
    pattern="ME*-/*E",
    hidden=128,
    heads=4,
    kv_heads=2,
    head_dim=32,
    ffn=384,
    activation="relu2",
    position="none",
    mamba=dict(heads=4, head_dim=32, state=32, groups=1, chunk=64),
    moe=dict(experts=8, top_k=2, expert_ffn=192, shared_ffn=192, scaling=2.5),
)
SEQ, GLOBAL, MICRO = 128, 16, 8


def manifest(model, steps):
    return json.dumps(
        {
            "stages": {
                "problems": {
                    "op": "generate",
                    "params": {"kind": "arithmetic", "count": 2000, "seed": 7},
                },
                "tokenizer": {
                    "op": "train_tokenizer",
                    "inputs": {"corpus": "problems:pretrain"},
                    "params": {"vocab_size": 1024, "special_tokens": ["<|endoftext|>"]},
                },
                "data": {
                    "op": "tokenize",
                    "inputs": {"tokenizer": "tokenizer:tokenizer", "a": "problems:pretrain"},
                    "params": {"num_shards": 2, "add_eos": True},
                },
                "train": {
                    "op": "pretrain",
                    "inputs": {"data": "data:data", "tokenizer": "tokenizer:tokenizer"},
                    "params": {
                        "model": model,
                        "seq_length": SEQ,
                        "steps": steps,
                        "global_batch": GLOBAL,
                        "micro_batch": MICRO,
                        "lr": 1e-3,
                        "log_interval": 1000,
                    },
                },
            }
        }
    )


def nemo_dag(model, steps, threads, work, binary=None):
    binary = binary or BIN
    path = Path(work) / "bench.yaml"
    path.write_text(manifest(model, steps))  # JSON is YAML
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(
        [str(binary), "run", str(path), "--force", "train"],
        check=True,
        env=env,
        capture_output=True,
    )
    show = subprocess.run(
        [str(binary), "show", "train", "--manifest", str(path), "--json"],
        check=True,
        capture_output=True,
        text=True,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    art = json.loads(show.stdout)
    vocab = json.loads((Path(art["outputs"]["model"]["path"]) / "config.json").read_text())["vocab"]
    tokens = art["metrics"]["tokens_trained"]
    return art["metrics"]["tokens_per_second"], tokens / cpu, vocab


def timed(step, steps):
    """Tokens per second and per CPU-second of `steps` calls of `step`, after 2 warm-up calls."""
    for _ in range(2):
        step()
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    tokens = steps * GLOBAL * SEQ
    return tokens / (time.perf_counter() - start), tokens / (time.process_time() - cpu)


def torch_tokens_per_s(vocab, steps, threads, sdpa):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    c = DENSE
    h, nh, nkv, d, ffn = c["hidden"], c["heads"], c["kv_heads"], c["head_dim"], c["ffn"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.n1 = torch.nn.Parameter(torch.ones(h))
            self.qkv = torch.nn.Linear(h, (nh + 2 * nkv) * d, bias=False)
            self.proj = torch.nn.Linear(nh * d, h, bias=False)
            self.n2 = torch.nn.Parameter(torch.ones(h))
            self.fc1 = torch.nn.Linear(h, 2 * ffn, bias=False)
            self.fc2 = torch.nn.Linear(ffn, h, bias=False)

        def forward(self, x, cos, sin, mask):
            b, t, _ = x.shape
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.n1
            q, k, v = self.qkv(y).split([nh * d, nkv * d, nkv * d], -1)
            q = q.view(b, t, nh, d).transpose(1, 2)
            k = k.view(b, t, nkv, d).transpose(1, 2)
            v = v.view(b, t, nkv, d).transpose(1, 2)

            def rope(z):
                z1, z2 = z[..., : d // 2], z[..., d // 2 :]
                return z * cos + torch.cat([-z2, z1], -1) * sin

            q, k = rope(q), rope(k)
            k = k.repeat_interleave(nh // nkv, 1)
            v = v.repeat_interleave(nh // nkv, 1)
            if sdpa:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-1, -2)) / d**0.5 + mask
                a = torch.softmax(s, -1) @ v
            x = x + self.proj(a.transpose(1, 2).reshape(b, t, nh * d))
            y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.n2
            g, u = self.fc1(y).chunk(2, -1)
            return x + self.fc2(F.silu(g) * u)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, h)
            self.blocks = torch.nn.ModuleList([Block() for _ in range(4)])
            self.norm = torch.nn.Parameter(torch.ones(h))
            self.out = torch.nn.Linear(h, vocab, bias=False)

        def forward(self, ids, cos, sin, mask):
            x = self.emb(ids)
            for blk in self.blocks:
                x = blk(x, cos, sin, mask)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.norm
            return self.out(x)

    net = Net()
    # AdamW as nemo-dag's trainer runs it: matrices decay, norm weights do not.
    params = list(net.parameters())
    groups = [
        dict(params=[p for p in params if p.dim() >= 2], weight_decay=0.1),
        dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0),
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2) / d)
    ang = torch.outer(torch.arange(SEQ).float(), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)
    gen = torch.Generator().manual_seed(0)

    def step():
        opt.zero_grad()
        for _ in range(GLOBAL // MICRO):
            ids = torch.randint(0, vocab, (MICRO, SEQ + 1), generator=gen)
            logits = net(ids[:, :-1], cos, sin, mask)
            loss = F.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum")
            (loss / (GLOBAL * SEQ)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()

    return timed(step, steps)


def torch_hybrid_tokens_per_s(vocab, steps, threads, sdpa):
    """The HYBRID model's PyTorch twin (bench/torch_models.py), timed like the dense one."""
    import torch
    from torch_models import Net

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = Net(dict(HYBRID, vocab=vocab)).train()
    net.sdpa = sdpa
    opt = torch.optim.AdamW(net.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    gen = torch.Generator().manual_seed(0)

    def step():
        opt.zero_grad()
        for _ in range(GLOBAL // MICRO):
            ids = torch.randint(0, vocab, (MICRO, SEQ + 1), generator=gen)
            total, _, _ = net.loss(ids[:, :-1], ids[:, 1:], normaliser=GLOBAL * SEQ)
            total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        net.update_moe_biases()

    return timed(step, steps)


def against_baseline(baseline, steps, threads, repeat):
    """This build against another nemo-dag build (no PyTorch): the two alternate, `repeat`
    times per model and thread count, so that a refactor can show it did not get slower."""
    with tempfile.TemporaryDirectory() as work:
        print(f"{'model':<8} {'threads':>7} {'this build tok/s':>17} {'baseline tok/s':>15} {'ratio':>6}")
        for name, model in [("dense", DENSE), ("hybrid", HYBRID)]:
            for n in threads:
                ours, base = [], []
                for _ in range(repeat):
                    ours.append(nemo_dag(model, steps, n, work, BIN)[0])
                    base.append(nemo_dag(model, steps, n, work, baseline)[0])
                for o, b in zip(ours, base):
                    print(f"{name:<8} {n:>7} {o:>17.0f} {b:>15.0f} {o / b:>6.2f}", flush=True)


def main():
    global BIN
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--bin", type=Path, default=BIN, help="the nemo-dag build to time")
    ap.add_argument("--baseline-bin", type=Path,
                    help="compare with this other nemo-dag build instead of PyTorch")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each build (--baseline-bin)")
    args = ap.parse_args()
    BIN = args.bin
    if not BIN.exists():
        sys.exit(f"{BIN} is missing: run `cargo build --release` first")
    threads = [int(t) for t in args.threads.split(",")]
    if args.baseline_bin:
        return against_baseline(args.baseline_bin, args.steps, threads, args.repeat)
    with tempfile.TemporaryDirectory() as work:
        print(
            f"{'model':<8} {'threads':>7} {'nemo-dag tok/s':>15} {'torch tok/s':>12} {'ratio':>6} {'torch sdpa':>11} {'ratio':>6}"
            f" | per CPU-second: {'nemo-dag':>9} {'torch':>7} {'ratio':>6}"
        )
        models = [("dense", DENSE, torch_tokens_per_s), ("hybrid", HYBRID, torch_hybrid_tokens_per_s)]
        for name, model, torch_run in models:
            for n in threads:
                ours, ours_cpu, vocab = nemo_dag(model, args.steps, n, work)
                same, same_cpu = torch_run(vocab, args.steps, n, sdpa=False)
                sdpa, _ = torch_run(vocab, args.steps, n, sdpa=True)
                print(
                    f"{name:<8} {n:>7} {ours:>15.0f} {same:>12.0f} {ours / same:>6.2f} {sdpa:>11.0f} {ours / sdpa:>6.2f}"
                    f" | {'':>16}{ours_cpu:>9.0f} {same_cpu:>7.0f} {ours_cpu / same_cpu:>6.2f}",
                    flush=True,
                )

if __name__ == "__main__":
    main()
