#!/usr/bin/env python3
"""GPU training throughput: nemo-dag's GPU trainer against the same model in PyTorch on the
same GPU, in the same run.

    cargo build --profile dist -p nemo-dag        # on any x86-64 machine; carry the binary
    python3 bench/gpu_bench.py --bin target/dist/nemo-dag [--steps 20]

Needs a CUDA GPU, PyTorch with CUDA, NVRTC (libnvrtc.so.13 on LD_LIBRARY_PATH) and the CUDA
headers (NEMO_DAG_CUDA_HOME or /usr/local/cuda), as `nemo-dag gpu-check` does.

The model is the one `nemo-dag gpu-check` times: four MLP blocks (`----`, SwiGLU), hidden 1024,
FFN 4096, vocabulary 32,768, untied head; 8 rows of 512 random tokens a step (one micro-batch),
AdamW, clipping at 0.5. nemo-dag's figure is gpu-check's own `speed` line (tokens/s over the
timed steps after one warm-up step; the same line also gives the CPU trainer's rate on this
machine). PyTorch's is the twin of bench/torch_models.py on CUDA, eager, timed the same way with
a synchronize at both ends, in three precisions:

- `torch f32`:  float32 with TF32 off: the arithmetic nemo-dag's kernels do (f32 FMAs).
- `torch tf32`: float32 weights, matmuls on the tensor cores in TF32.
- `torch bf16`: autocast to bfloat16 (the usual way to train on this GPU).

Printed: tokens/s for each and nemo-dag's ratio to it.
"""

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

CONFIG = dict(pattern="----", hidden=1024, ffn=4096, vocab=32768, activation="swiglu")
ROWS, LEN = 8, 512


def nemo_dag_rate(binary, steps):
    out = subprocess.run(
        [binary, "gpu-check", "--speed-steps", str(steps)],
        capture_output=True,
        text=True,
    )
    sys.stderr.write(out.stdout + out.stderr)
    if out.returncode != 0:
        sys.exit(f"nemo-dag gpu-check failed with exit {out.returncode}")
    m = re.search(r"device (\d+) tokens/s, CPU trainer (\d+) tokens/s", out.stdout)
    if not m:
        sys.exit("gpu-check printed no speed line")
    return float(m.group(1)), float(m.group(2))


def torch_rate(steps, precision):
    import torch
    import torch_models

    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = torch_models.Net(CONFIG)
    opt = torch.optim.AdamW(net.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)

    def step():
        ids = torch.randint(0, CONFIG["vocab"], (ROWS, LEN + 1), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _, _ = net.loss(ids[:, :-1], ids[:, 1:], torch.ones(ROWS, LEN, device="cuda"), ROWS * LEN)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    clock = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return ROWS * LEN * steps / (time.perf_counter() - clock)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default=str(ROOT / "target" / "dist" / "nemo-dag"))
    p.add_argument("--steps", type=int, default=20)
    a = p.parse_args()
    ours, cpu = nemo_dag_rate(a.bin, a.steps)
    rows = [("nemo-dag CPU trainer", cpu)]
    for precision in ("f32", "tf32", "bf16"):
        rows.append((f"torch {precision}", torch_rate(a.steps, precision)))
    import torch

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.steps} timed steps of {ROWS * LEN} tokens")
    print(f"{'':24}{'tokens/s':>12}  nemo-dag GPU / this")
    print(f"{'nemo-dag GPU (f32)':24}{ours:12.0f}")
    for name, rate in rows:
        print(f"{name:24}{rate:12.0f}  {ours / rate:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
