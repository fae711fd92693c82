"""A stand-in for Megatron-Bridge's `scripts/conversion/run_conversion.py` in the megatron_export tests.

The real program is https://github.com/NVIDIA-NeMo/Megatron-Bridge scripts/conversion/run_conversion.py
at v0.6.0, the in-job worker `convert.sh` starts once per rank: `export` builds the Hugging Face
model from a reference (`--hf-model`) adapted to the checkpoint's own config (the
`run_config.yaml` of the iteration), maps the weights and saves them with the reference's
tokenizer files. This fake needs no torch: the tests link it at
MB_ROOT/scripts/conversion/run_conversion.py, and the op runs it as

    <python> MB_ROOT/scripts/conversion/run_conversion.py export --device cpu|gpu --hf-model M
        --megatron-path ITER --hf-path OUT [--torch-dtype D] [--tp N --pp N --ep N --etp N]
        [--hf-revision R] [--not-strict] [--distributed-save|--no-distributed-save]
        [--save-every-n-ranks N] [--no-progress] [--overwrite] [--trust-remote-code]

Python 3.11, stdlib only. It parses its arguments with the flags of v0.6.0's worker parser
(`scripts/conversion/arguments.py`, `build_parser(include_execution=False)`: argparse with
`allow_abbrev=False`, so an unknown or misspelt flag exits 2), applies the worker's own argument
checks (`_validate_args`), then those of the CPU and GPU backends: the checkpoint exists and has a
`run_config.yaml`; the destination is empty or missing; the GPU backend needs a process group's
variables (WORLD_SIZE, or Slurm's SLURM_NTASKS). It also requires HF_HUB_OFFLINE=1 (a job never
downloads). On the first failure it prints `fake_run_conversion: <what is wrong>` and exits 2.

Then rank 0 writes OUT as the converter's save does: `config.json` (NemotronHForCausalLM, the
reference's token ids: bos 1, eos 2, pad 0; `vocab_size` 384, the tests' 300-token tokenizer
padded to a multiple of 128 as Megatron pads it), two safetensors shards with
`model.safetensors.index.json`, `generation_config.json`, and the reference's tokenizer files
(`tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`).

Knobs (environment):
    FAKE_MB_ARGV_LOG=path    append {"rank", "argv", "script": "run_conversion.py"} as a JSON line
    FAKE_CONVERT_VOCAB=n     write vocab_size n instead
    FAKE_CONVERT_TRUNCATE=1  cut the second shard short, and exit 0 (a save that lost data)
    FAKE_CONVERT_FAIL=1      fail after the checks: print a traceback-like line, exit 1
    FAKE_CONVERT_PARSE_ONLY=1  check the arguments (not the paths), print that they are
                             accepted, exit 0: for launch lines with placeholder paths
"""

import argparse
import json
import os
import re
import struct
import sys
from pathlib import Path


def fail(message):
    print(f"fake_run_conversion: {message}", file=sys.stderr)
    sys.exit(2)


def parser():
    p = argparse.ArgumentParser(allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", allow_abbrev=False)
    export.add_argument("--device", choices=("cpu", "gpu"), required=True)
    export.add_argument("--hf-model", required=True)
    export.add_argument("--hf-revision")
    export.add_argument("--megatron-path", required=True)
    export.add_argument("--torch-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    export.add_argument("--trust-remote-code", action="store_true")
    export.add_argument("--overwrite", action="store_true")
    for flag in ("tp", "pp", "ep", "etp"):
        export.add_argument(f"-{flag}", f"--{flag}", type=int, default=1, dest=flag)
    export.add_argument("--distributed-timeout-minutes", type=int)
    export.add_argument("--hf-path", required=True)
    export.add_argument("--no-progress", action="store_true")
    export.add_argument("--not-strict", action="store_true")
    export.add_argument("--distributed-save", action=argparse.BooleanOptionalAction, default=None)
    export.add_argument("--save-every-n-ranks", type=int, default=1)
    export.add_argument("--export-weight-dtype", choices=("bfloat16", "float16", "float32"))
    return p


def check_args(args):
    # run_conversion.py _validate_args
    for name in ("tp", "pp", "ep", "etp"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be at least 1.")
    if args.device == "cpu" and any(getattr(args, n) != 1 for n in ("tp", "pp", "ep", "etp")):
        fail("CPU conversion requires TP=PP=EP=ETP=1.")
    distributed = args.distributed_save if args.distributed_save is not None else args.device == "gpu"
    if args.device == "cpu" and distributed:
        fail("--distributed-save is only supported by the GPU backend.")
    if not distributed and args.save_every_n_ranks != 1:
        fail("--save-every-n-ranks requires --distributed-save.")
    if args.device == "gpu":
        if os.environ.get("WORLD_SIZE") is None and os.environ.get("SLURM_NTASKS") is None:
            fail("GPU conversion must be launched through NeMo Run's local or Slurm executor.")
        world = int(os.environ.get("WORLD_SIZE") or os.environ["SLURM_NTASKS"])
        if world % (args.tp * args.pp) or world % (args.etp * args.ep * args.pp):
            fail(f"{world} ranks do not divide into TP={args.tp} PP={args.pp} EP={args.ep} ETP={args.etp}")
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        fail("HF_HUB_OFFLINE is not 1: a job would try the Hub")


def check_paths(args):
    if args.hf_model.startswith("/") and not Path(args.hf_model).is_dir():
        fail(f"--hf-model {args.hf_model}: no such directory")
    ckpt = Path(args.megatron_path)
    if not ckpt.exists():
        fail(f"Megatron checkpoint does not exist: {ckpt}")
    if not re.fullmatch(r"iter_\d{7}", ckpt.name):
        fail(f"--megatron-path {ckpt} is not an iteration directory")
    configs = sorted(ckpt.glob("**/run_config.yaml"))
    if not configs:
        fail(f"Could not find run_config.yaml in {ckpt}. Ensure this is a valid Megatron checkpoint.")
    out = Path(args.hf_path)
    if out.exists() and any(out.iterdir()):
        fail(f"Destination is not empty: {out}. Pass --overwrite to replace it.")
    if out.resolve().is_relative_to(ckpt.resolve()):
        fail(f"the destination {out} lies inside the source {ckpt}")


def safetensors(tensors):
    """A safetensors file of float32 tensors {name: [values]}."""
    header, data = {}, b""
    for name, values in tensors.items():
        blob = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [len(data), len(data) + len(blob)]}
        data += blob
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def main():
    argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    log = os.environ.get("FAKE_MB_ARGV_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"rank": rank, "argv": argv, "script": "run_conversion.py"}) + "\n")
    args = parser().parse_args(argv)
    check_args(args)
    if os.environ.get("FAKE_CONVERT_PARSE_ONLY") == "1":
        print("fake_run_conversion: arguments accepted")
        return
    check_paths(args)
    if os.environ.get("FAKE_CONVERT_FAIL") == "1":
        print("RuntimeError: Strict Megatron-to-HF export failed: missing keys", file=sys.stderr)
        sys.exit(1)
    if rank != 0:
        return
    out = Path(args.hf_path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = int(os.environ.get("FAKE_CONVERT_VOCAB") or 384)
    config = {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "vocab_size": vocab,
        "max_position_embeddings": 8192,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": args.torch_dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    shards = {
        "model-00001-of-00002.safetensors": {"backbone.embeddings.weight": [0.5] * 8},
        "model-00002-of-00002.safetensors": {"backbone.norm_f.weight": [1.0] * 4, "lm_head.weight": [0.25] * 8},
    }
    weight_map = {}
    for name, tensors in shards.items():
        blob = safetensors(tensors)
        if os.environ.get("FAKE_CONVERT_TRUNCATE") == "1" and name.startswith("model-00002"):
            blob = blob[:-6]
        (out / name).write_bytes(blob)
        weight_map.update({t: name for t in tensors})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # The reference's tokenizer, as save_pretrained of the reference writes it.
    (out / "tokenizer.json").write_text(json.dumps({"reference": args.hf_model}))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|reference_end|>"}))
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|reference_end|>"}))
    print(f"CPU export complete: {out}" if args.device == "cpu" else f"GPU export complete: {out}")


if __name__ == "__main__":
    main()
