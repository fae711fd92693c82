#!/usr/bin/env python3
"""Check that bench/torch_models.py is nemo-dag's model, not just a similar one.

    target/torch-venv/bin/python bench/check_torch_twin.py [--keep DIR]

Runs one small `nemo-dag run` (needs target/release/nemo-dag) of the benchmark's HYBRID model
(`ME*-/*E`: Mamba-2, MoE, attention, relu2 MLP, one MTP depth), then loads nemo-dag's own
weights into the PyTorch twin and compares:

1. Names and shapes: `model.safetensors` loads into `Net` with `load_state_dict(strict=True)`
   (every tensor by name, same shape), and the parameter counts agree.
2. Eval loss: the `eval` op's perplexity loss (mean main-head cross-entropy over windows of the
   valid split) against the twin's on the same windows, read from the same `.bin/.idx`, on the
   weights after a few real training steps (MoE expert biases no longer zero).
3. First training step: a 1-step `pretrain` with lr = 1e-12 publishes (up to ~1e-12) its
   initial weights; the twin rebuilds step 0's global batch the way nemo-dag reads it
   (Megatron GPTDataset indices: numpy RandomState shuffles) and compares the logged loss
   (main head) and the gradient norm before clipping (which also covers the MTP term and the
   whole backward pass), and the expert biases nemo-dag moved after that step (which experts
   the routers picked for every token of the batch).

Exits non-zero when a difference is above its tolerance.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torch_models import Net  # noqa: E402
from train_bench import BIN, HYBRID  # noqa: E402

SEQ, GLOBAL, MICRO, SEED = 128, 16, 8, 1234
TRAINED_STEPS = 4
EVAL_WINDOWS = 16


def manifest():
    def pretrain(steps, lr):
        return {
            "op": "pretrain",
            "inputs": {"data": "data:data", "tokenizer": "tokenizer:tokenizer"},
            "params": {"model": HYBRID, "seq_length": SEQ, "steps": steps, "global_batch": GLOBAL,
                       "micro_batch": MICRO, "lr": lr, "log_interval": 1, "seed": SEED},
        }

    return {
        "stages": {
            "problems": {"op": "generate", "params": {"kind": "arithmetic", "count": 2000, "seed": 7}},
            "tokenizer": {
                "op": "train_tokenizer",
                "inputs": {"corpus": "problems:pretrain"},
                "params": {"vocab_size": 1024, "special_tokens": ["<|endoftext|>"]},
            },
            # Two shards: one train (no blending), one valid (for eval).
            "data": {
                "op": "tokenize",
                "inputs": {"tokenizer": "tokenizer:tokenizer", "a": "problems:pretrain"},
                "params": {"num_shards": 2, "valid_shards": 1, "add_eos": True},
            },
            "init": pretrain(1, 1e-12),
            "trained": pretrain(TRAINED_STEPS, 3e-3),
            "eval": {
                "op": "eval",
                "inputs": {"model": "trained:model", "data": "data:data"},
                "params": {"perplexity": {"split": "valid", "seq_length": SEQ, "max_windows": EVAL_WINDOWS}},
            },
        }
    }


def show(path, stage):
    out = subprocess.run([str(BIN), "show", stage, "--manifest", str(path), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


# --- nemo-dag's files, read with numpy ---------------------------------------------------------

def read_safetensors(path):
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        assert meta["dtype"] == "F32", (name, meta["dtype"])
        a, b = meta["data_offsets"]
        out[name] = torch.from_numpy(np.frombuffer(raw[8 + n + a : 8 + n + b], np.float32).copy()).reshape(meta["shape"])
    return out


MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


class Indexed:
    """Megatron `.bin`/`.idx` (MMIDIDX v1): `sizes[i]` tokens of sequence `i`."""

    def __init__(self, prefix):
        idx = Path(str(prefix) + ".idx").read_bytes()
        assert idx[:9] == b"MMIDIDX\x00\x00"
        self.dtype = MEGATRON_DTYPES[idx[17]]
        n = int.from_bytes(idx[18:26], "little")
        self.sizes = np.frombuffer(idx, np.int32, n, 34).astype(np.int64)
        self.pointers = np.frombuffer(idx, np.int64, n, 34 + 4 * n)
        self.bin = np.fromfile(str(prefix) + ".bin", np.uint8)

    def tokens(self, i, offset=0, length=None):
        length = self.sizes[i] - offset if length is None else length
        item = np.dtype(self.dtype).itemsize
        start = self.pointers[i] + offset * item
        return self.bin[start : start + length * item].view(self.dtype).astype(np.int64)


def blend(data_dir, split):
    entries = json.loads((Path(data_dir) / "blend.json").read_text())[split]
    return [Path(data_dir) / entries[i + 1] for i in range(0, len(entries), 2)]


def gpt_samples(ds, num_samples, seq, seed):
    """Megatron GPTDataset (add_extra_token): the `seq + 1` tokens of samples 0..num_samples-1
    (ops/data/src/megatron/gpt_dataset.rs `build_gpt_indices` + `sample_tokens`)."""
    sizes = ds.sizes
    docs = np.arange(len(sizes))
    tokens_per_epoch = int(sizes.sum())
    epochs = max(1, -(-(num_samples * seq + 1) // tokens_per_epoch))
    separate = False
    if epochs > 1:
        sans_final = ((epochs - 1) * tokens_per_epoch - 1) // seq
        per_epoch = (tokens_per_epoch - 1) // seq
        separate = num_samples - sans_final < int(0.80 * per_epoch)
    rng = np.random.RandomState(seed)

    def repeat(n):
        index = np.concatenate([docs] * n)
        rng.shuffle(index)
        return index

    doc_index = np.concatenate([repeat(epochs - 1), repeat(1)]) if separate else repeat(epochs)
    total_samples = (epochs * tokens_per_epoch - 1) // seq
    rows, position, offset = [(0, 0)], 0, 0
    while len(rows) <= total_samples:
        remaining = seq + 1
        while remaining != 0:
            length = sizes[doc_index[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            elif position + 1 == len(doc_index):
                offset = sizes[doc_index[position]] - 1
                break
            else:
                position, offset = position + 1, 0
        rows.append((position, max(offset, 0)))
    first = ((epochs - 1) * tokens_per_epoch - 1) // seq if separate else total_samples
    shuffle = np.arange(first)
    rng.shuffle(shuffle)
    if first < total_samples:
        last = np.arange(first, total_samples)
        rng.shuffle(last)
        shuffle = np.concatenate([shuffle, last])
    out = []
    for i in range(num_samples):
        j = shuffle[i]
        (d0, o0), (d1, o1) = rows[j], rows[j + 1]
        if d0 == d1:
            t = ds.tokens(doc_index[d0], o0, o1 + 1 - o0)
        else:
            parts = [ds.tokens(doc_index[d0], o0)]
            parts += [ds.tokens(doc_index[p]) for p in range(d0 + 1, d1)]
            parts.append(ds.tokens(doc_index[d1], 0, o1 + 1))
            t = np.concatenate(parts)
        assert len(t) == seq + 1, len(t)
        out.append(t)
    return torch.from_numpy(np.stack(out))


def load_twin(model_dir, dtype):
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    net = Net(dict(cfg["config"], vocab=cfg["vocab"]))
    tensors = read_safetensors(Path(model_dir) / "model.safetensors")
    twin = net.state_dict()
    names_ok = sorted(tensors) == sorted(twin) and all(tensors[k].shape == twin[k].shape for k in twin)
    net.load_state_dict(tensors, strict=True)
    return net.to(dtype), tensors, names_ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--keep", help="work directory to use and keep (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if not BIN.exists():
        sys.exit(f"{BIN} is missing: run `cargo build --release` first")
    torch.set_num_threads(args.threads)
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
        failures = check_all(Path(args.keep), args.threads)
        print(f"work dir kept: {args.keep}")
    else:
        with tempfile.TemporaryDirectory(prefix="twin-check-") as work:
            failures = check_all(Path(work), args.threads)
    if failures:
        sys.exit(f"FAILED: {', '.join(failures)}")
    print("the PyTorch twin matches nemo-dag")


def check_all(work, threads):
    """Run the manifest in `work`, print every comparison; returns the failed ones' labels."""
    path = work / "twin.yaml"
    path.write_text(json.dumps(manifest()))
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    subprocess.run([str(BIN), "run", str(path)], check=True, env=env, capture_output=True)
    failures = []

    def check(label, ours, theirs, tol):
        diff = abs(ours - theirs)
        ok = diff <= tol
        print(f"  {label:<34} nemo-dag {theirs:.8f}   torch {ours:.8f}   |diff| {diff:.2e}  {'ok' if ok else 'FAIL'} (tol {tol:g})")
        if not ok:
            failures.append(label)

    # 1. Names, shapes, counts.
    trained = show(path, "trained")
    net, tensors, names_ok = load_twin(trained["outputs"]["model"]["path"], torch.float32)
    n_torch = sum(p.numel() for p in net.parameters())
    n_ours = trained["metrics"]["parameters"]
    print(f"1. tensors: {len(tensors)} in model.safetensors, {len(net.state_dict())} in the twin's state_dict; "
          f"same names and shapes: {names_ok}")
    print(f"   parameters: nemo-dag {n_ours:,}, torch {n_torch:,}")
    if not names_ok or n_torch != n_ours:
        failures.append("names/shapes/count")

    # 2. Eval loss on the valid split's windows, weights after a few training steps.
    data_dir = show(path, "data")["outputs"]["data"]["path"]
    ev = show(path, "eval")
    results = json.loads((Path(ev["outputs"]["results"]["path"]) / "results.json").read_text())
    ppl = results["perplexity"]
    stream = []
    for prefix in blend(data_dir, "valid"):
        ds = Indexed(prefix)
        for i in range(len(ds.sizes)):
            if len(stream) >= EVAL_WINDOWS * SEQ + 1:
                break
            stream.extend(ds.tokens(i).tolist())
    stream = torch.tensor(stream)
    windows = min((len(stream) - 1) // SEQ, EVAL_WINDOWS)
    ids = torch.stack([stream[w * SEQ : w * SEQ + SEQ] for w in range(windows)])
    labels = torch.stack([stream[w * SEQ + 1 : w * SEQ + SEQ + 1] for w in range(windows)])
    print(f"2. eval loss, {windows} windows of {SEQ} tokens (valid split), weights after {TRAINED_STEPS} steps:")
    for dtype, tol in [(torch.float32, 1e-5), (torch.float64, 1e-5)]:
        net = net.to(dtype).eval()
        with torch.no_grad():
            sums = [net.loss(ids[i : i + 8], labels[i : i + 8])[1] for i in range(0, windows, 8)]
        check(f"mean main CE ({str(dtype)[6:]})", float(sum(sums)) / (windows * SEQ), ppl["loss"], tol)

    # 3. The first training step on the initial weights.
    init = show(path, "init")
    curve = init["metrics"]["curve"][0]
    net, tensors, _ = load_twin(init["outputs"]["model"]["path"], torch.float32)
    moved = {k: v.clone() for k, v in tensors.items() if k.endswith("expert_bias")}
    train_prefixes = blend(data_dir, "train")
    assert len(train_prefixes) == 1, "one train shard expected (no blending)"
    samples = gpt_samples(Indexed(train_prefixes[0]), GLOBAL, SEQ, SEED)
    print(f"3. step 1 of a 1-step run (lr 1e-12: the published weights are the initial ones), "
          f"{GLOBAL} samples rebuilt from the train shard:")
    for dtype, tol_loss, tol_norm in [(torch.float32, 1e-5, 1e-5), (torch.float64, 1e-5, 1e-5)]:
        net = net.to(dtype).train()
        for m in net.moe_layers():
            m.expert_bias.zero_()  # step 1 routed with the bias at 0; nemo-dag moved it after
            m.counts.zero_()
        net.zero_grad()
        main = 0.0
        for i in range(0, GLOBAL, MICRO):
            x = samples[i : i + MICRO]
            total, main_sum, _ = net.loss(x[:, :-1], x[:, 1:], normaliser=GLOBAL * SEQ)
            total.backward()
            main += float(main_sum.detach())
        norm = sum(float(p.grad.double().pow(2).sum()) for p in net.parameters() if p.grad is not None) ** 0.5
        name = str(dtype)[6:]
        check(f"step-1 loss ({name})", main / (GLOBAL * SEQ), curve["loss"], tol_loss)
        check(f"step-1 grad norm ({name})", norm, curve["grad_norm"], tol_norm)
        net.update_moe_biases()
        twin = net.state_dict()
        same = all(torch.equal(twin[n].float(), moved[n]) for n in moved)
        print(f"  expert biases after step 1 ({name}): {'same' if same else 'DIFFERENT'} "
              f"({len(moved)} routers, {sum(int((v != 0).sum()) for v in moved.values())} of "
              f"{sum(v.numel() for v in moved.values())} moved)")
        if not same:
            failures.append(f"expert biases ({name})")
    return failures


if __name__ == "__main__":
    main()
