#!/usr/bin/env python3
"""GPU training throughput: nemo-dag's GPU trainer against the same models in PyTorch on the
same GPU, in the same run.

    cargo build --profile dist -p nemo-dag        # on any x86-64 machine; carry the binary
    python3 bench/gpu_bench.py --bin target/dist/nemo-dag [--steps 20] [--no-compile]
    python3 bench/gpu_bench.py --report check.json     # nemo-dag's figures from an earlier
                                                       # `gpu-check --json` on this machine
    python3 bench/gpu_bench.py --report check.json --compiled-only   # torch.compile's alone

Needs a CUDA GPU, PyTorch with CUDA, NVRTC and cuBLASLt (libnvrtc.so.13 and libcublasLt.so.13
on LD_LIBRARY_PATH) and the CUDA headers (NEMO_DAG_CUDA_HOME or /usr/local/cuda), as
`nemo-dag gpu-check` does.

The models are the three `nemo-dag gpu-check` times (ops/train/src/gpu/check.rs, SPEED_MODELS):

- four MLP blocks (`----`, SwiGLU), hidden 1024, FFN 4096, vocabulary 32,768, untied head,
  8 rows of 512 random tokens a step;
- GPT-2 small's size: 12 layers of attention and MLP (`*-` × 12), hidden 768, 12 heads of 64,
  FFN 3072 (squared ReLU), RoPE, tied vocabulary of 50,304, 8 rows of 1024 tokens a step
  (124 M parameters);
- the tiny hybrid `ME*-/*E` of bench/train_bench.py (Mamba-2, MoE with 8 experts of which 2
  and a shared expert run per token, attention, squared-ReLU MLP, one MTP depth; hidden 128,
  vocabulary 1,024), 16 rows of 128 tokens a step. Its FLOPs count the experts a token runs
  through, not all eight, and not the Mamba-2 scan.

Each step is one micro-batch, AdamW, clipping at 0.5. nemo-dag's GPU trainer multiplies as
the training ops do on a GPU (bf16 operands on cuBLASLt, f32 sums; everything else f32), so
`torch bf16` is its like-for-like twin. nemo-dag's figures come from
`gpu-check --json` (tokens/s over the timed steps after one warm-up step, and the CPU trainer's
rate on this machine). PyTorch's are the twins of bench/torch_models.py on CUDA, timed the same
way with a synchronize at both ends:

- `torch f32`:  eager, float32 with TF32 off: the arithmetic nemo-dag's kernels do (f32 FMAs).
- `torch tf32`: eager, float32 weights, matmuls on the tensor cores in TF32.
- `torch bf16`: eager, autocast to bfloat16 (the usual way to train on this GPU).
- `torch bf16 compiled`: the same under `torch.compile` (left out with --no-compile).

Attention in the twins is `F.scaled_dot_product_attention(is_causal=True)` (flash or
memory-efficient kernels), the fastest eager PyTorch has. Printed per model: tokens/s, model
TFLOP/s and MFU (model FLOPs as nanoGPT's estimate_mfu counts them, over the GPU's dense bf16
peak), and nemo-dag's ratio to each.

Then that attention alone at GPT-2 small's shapes (8 rows of 1024 tokens, 12 heads of 64,
causal, bf16): milliseconds a layer for the forward and for the forward and backward, to set
beside the `attention_*` rows of `NEMO_DAG_KERNEL_TIMES`' profile (which are per step, twelve
layers; their backward also has `attention_bwd_delta_f32` and `attention_pack_bf16`).
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_bench import HYBRID  # noqa: E402  (the same model as the CPU benchmark's)

MODELS = {
    "----": (dict(pattern="----", hidden=1024, ffn=4096, vocab=32768, activation="swiglu"), 8, 512),
    "*-" * 12: (
        dict(
            pattern="*-" * 12,
            hidden=768,
            heads=12,
            kv_heads=12,
            head_dim=64,
            ffn=3072,
            vocab=50304,
            activation="relu2",
            tie_embeddings=True,
        ),
        8,
        1024,
    ),
    # bench/train_bench.py's HYBRID (Mamba-2, MoE, attention, MLP, one MTP depth).
    "ME*-/*E": (dict(HYBRID, vocab=1024), 16, 128),
}

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from NVIDIA's data sheets, by the name
# torch reports; MFU is left out for a GPU not listed.
PEAK_BF16 = {"H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.4}


def nemo_dag_rates(binary, steps, report=None):
    if report:
        if not Path(report).is_file():
            sys.exit(f"{report}: no such report (did gpu-check finish?)")
        speed = json.loads(Path(report).read_text()).get("speed") or []
        if not speed:
            sys.exit(f"{report} has no speed figures: write it with gpu-check --speed-steps N --json")
        return {s["pattern"]: s for s in speed}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "gpu-check.json"
        out = subprocess.run(
            [binary, "gpu-check", "--speed-steps", str(steps), "--json", str(report)],
            capture_output=True,
            text=True,
        )
        sys.stderr.write(out.stdout + out.stderr)
        if out.returncode != 0:
            sys.exit(f"nemo-dag gpu-check failed with exit {out.returncode}")
        return {s["pattern"]: s for s in json.loads(report.read_text())["speed"]}


def torch_rate(config, rows, length, steps, precision, compiled=False):
    import torch
    import torch_models

    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = torch_models.Net(config)
    net.sdpa = True
    opt = torch.optim.AdamW(net.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    loss_fn = torch.compile(net.loss) if compiled else net.loss

    def step():
        with torch.device("cuda"):
            ids = torch.randint(0, config["vocab"], (rows, length + 1))
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss, _, _ = loss_fn(ids[:, :-1], ids[:, 1:], torch.ones(rows, length), rows * length)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
            opt.step()
            net.update_moe_biases()
            opt.zero_grad(set_to_none=True)

    return rows * length / seconds_per_call(step, 3 if compiled else 2, steps)


def seconds_per_call(run, warmup, steps):
    """Seconds a call of `run` takes on the GPU, over `steps` calls after `warmup` untimed ones."""
    import torch

    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    clock = time.perf_counter()
    for _ in range(steps):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - clock) / steps


def sdpa_ms(rows, heads, length, dim, steps):
    """Milliseconds a call of PyTorch's causal attention in bf16, (forward, forward and
    backward), q, k and v (rows, heads, length, dim) as a layer's."""
    import torch
    import torch.nn.functional as F

    q, k, v = (
        torch.randn(rows, heads, length, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    dy = torch.randn(rows, heads, length, dim, device="cuda", dtype=torch.bfloat16)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return (
        1e3 * seconds_per_call(forward, 3, steps),
        1e3 * seconds_per_call(lambda: forward().backward(dy), 3, steps),
    )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default=str(ROOT / "target" / "dist" / "nemo-dag"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile")
    p.add_argument("--compiled-only", action="store_true", help="time torch.compile's twins alone")
    p.add_argument("--report", help="nemo-dag's figures from this `gpu-check --json` report (--bin unused)")
    a = p.parse_args()
    ours = nemo_dag_rates(a.bin, a.steps, a.report)
    import torch

    gpu = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in gpu), None)
    print(f"\n{gpu}, torch {torch.__version__}, PyTorch timed over {a.steps} steps")
    for pattern, (config, rows, length) in MODELS.items():
        mine = ours.get(pattern)
        if mine is None:
            print(f"\n{pattern}: not in nemo-dag's report; skipped")
            continue
        flops = mine["flops_per_token"]
        rate = mine["device_tokens_per_s"]
        ours_name = f"nemo-dag GPU ({mine.get('precision', 'f32')})"
        mfu = lambda r: f"{100 * r * flops / 1e12 / peak:5.1f}%" if peak else "    -"

        # Each row as soon as it is measured, so that a time limit or a failing twin loses
        # only what comes after it.
        def row(name, r):
            ratio = f"  {rate / r:.2f}x" if name != ours_name else ""
            print(f"{name:24}{r:12.0f}{r * flops / 1e12:9.1f}{mfu(r):>7}{ratio}")

        print(
            f"\n{mine['model']}: {mine['parameters']:,} parameters, {rows * length} tokens a step, "
            f"nemo-dag timed over {mine['steps']} steps"
        )
        print(f"{'':24}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}  nemo-dag GPU / this")
        row(ours_name, rate)
        if mine.get("precision") != "f32" and mine.get("device_f32_tokens_per_s"):
            row("nemo-dag GPU (f32)", mine["device_f32_tokens_per_s"])
        if mine.get("cpu_tokens_per_s"):
            row("nemo-dag CPU trainer", mine["cpu_tokens_per_s"])
        twins = [(f"torch {precision}", precision, False) for precision in ("f32", "tf32", "bf16")]
        if a.compiled_only:
            twins = []
        if a.compiled_only or not a.no_compile:
            twins.append(("torch bf16 compiled", "bf16", True))
        for name, precision, compiled in twins:
            try:
                row(name, torch_rate(config, rows, length, a.steps, precision, compiled))
            except Exception as e:  # one twin failing leaves the others' figures
                print(f"{name:24}  failed: {type(e).__name__}: {e}")
    if not a.compiled_only:
        forward, both = sdpa_ms(8, 12, 1024, 64, a.steps)
        print(
            f"\nPyTorch's causal attention (SDPA, bf16), GPT-2 small's layer (8 x 1024 tokens, 12 heads "
            f"of 64): forward {forward:.3f} ms, forward and backward {both:.3f} ms; "
            f"x 12 layers {12 * forward:.2f} and {12 * both:.2f} ms"
        )


if __name__ == "__main__":
    # A line at a time, so that what was measured is in the log even if a time limit kills it.
    sys.stdout.reconfigure(line_buffering=True)
    main()
