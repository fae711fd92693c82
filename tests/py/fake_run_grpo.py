"""A stand-in for NeMo-RL's `examples/nemo_gym/run_grpo_nemo_gym.py` in the nemo_rl_grpo tests.

The real program is https://github.com/NVIDIA-NeMo/RL examples/nemo_gym/run_grpo_nemo_gym.py at
v0.7.0: it loads `--config`, applies `key=value` overrides in OmegaConf struct mode, starts
NeMo-Gym and vLLM on Ray, and trains with GRPO, resuming from the newest `step_N` of
`checkpointing.checkpoint_dir`. This fake needs no GPU, no Ray and no NeMo-RL: the tests link it at
RL_ROOT/examples/nemo_gym/run_grpo_nemo_gym.py, and the op runs it from RL_ROOT as

    <python> examples/nemo_gym/run_grpo_nemo_gym.py --config CONFIG KEY=VALUE ...

Python 3.11, stdlib only. It checks, and on the first failure prints `fake_run_grpo: <what is
wrong>` and exits 2:

1. argv: `--config C` (a file under the working directory), then only `key=value` words, none
   with a `+`, `++` or `~` prefix, no key twice, every key in
   tests/fixtures/nemo-rl-0.7-grpo-nanov3-keys.txt (struct mode: an unknown key is an error).
2. the model: `policy.model_name` == `policy.tokenizer.name`, a directory with config.json and
   tokenizer.json.
3. the data: train and validation JSONL exist, every row a NeMo-Gym row
   (`responses_create_params.input`, `agent_ref` {type responses_api_agents, name *_simple_agent}).
4. the attempt: `checkpointing.enabled=true`; checkpoint_dir and logger.log_dir under one OUT,
   NRL_MEGATRON_CHECKPOINT_DIR == OUT/run/megatron_cache, HF_HUB_OFFLINE=1; no `tmp_step_*` or
   `old_step_*` left in checkpoint_dir (the op clears them before a launch).

Then it resumes as NeMo-RL does, from the highest `step_N` (its training_info.json's
total_steps), and for each step up to grpo.max_num_steps prints NeMo-RL's step banner, a loss and
an average reward; at every checkpointing.save_period and at the last step it saves as NeMo-RL
does: tmp_step_N (training_info.json, config.yaml, policy/weights/), renamed to step_N.

Knobs (environment):
    FAKE_RL_ARGV_LOG=path  append {"argv", "resumed_from", "ckpt_at_start"} as a JSON line,
                           after the checks
    FAKE_RL_DIE_AT=s       at step s: tmp_step_s half-written, print `killed`, exit 137
    FAKE_RL_TIMEOUT_AT=s   after saving step s: print NeMo-RL's timeout line, exit 0
"""

import json
import os
import re
import sys
from pathlib import Path

HERE = Path(os.path.realpath(__file__)).parent
KEYS = {
    line.strip()
    for line in (HERE.parent / "fixtures" / "nemo-rl-0.7-grpo-nanov3-keys.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
}


def fail(message):
    print(f"fake_run_grpo: {message}", file=sys.stderr)
    sys.exit(2)


def unquote(value):
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] == "'" else value


def main():
    argv = sys.argv[1:]
    if len(argv) < 2 or argv[0] != "--config":
        fail(f"argv starts {argv[:2]}, not --config C")
    if not Path(argv[1]).is_file():
        fail(f"--config {argv[1]}: no such file under {os.getcwd()}")
    cfg = {}
    for word in argv[2:]:
        key, eq, value = word.partition("=")
        if not eq or key[:1] in "+~":
            fail(f"`{word}` is not a plain key=value override")
        if key in cfg:
            fail(f"`{key}` given twice")
        if key not in KEYS:
            fail(f"`{key}` is not a key of grpo_nanov3.yaml (struct mode)")
        cfg[key] = unquote(value)

    model = Path(cfg.get("policy.model_name", ""))
    if cfg.get("policy.tokenizer.name") != str(model):
        fail("policy.tokenizer.name is not policy.model_name")
    for name in ("config.json", "tokenizer.json"):
        if not (model / name).is_file():
            fail(f"policy.model_name {model}: no {name}")
    for key in ("data.train.data_path", "data.validation.data_path"):
        path = Path(cfg.get(key, ""))
        if not path.is_file():
            fail(f"{key} {path}: no such file")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            row = json.loads(line)
            ref = row.get("agent_ref", {})
            if not row.get("responses_create_params", {}).get("input"):
                fail(f"{path}:{n}: no responses_create_params.input")
            if ref.get("type") != "responses_api_agents" or not str(ref.get("name", "")).endswith("_simple_agent"):
                fail(f"{path}:{n}: agent_ref {ref} does not name a Gym agent server")

    if cfg.get("checkpointing.enabled") != "true":
        fail("checkpointing is not enabled")
    ckpt = Path(cfg.get("checkpointing.checkpoint_dir", ""))
    out = ckpt.parent
    if ckpt.name != "checkpoint" or Path(cfg.get("logger.log_dir", "")) != out / "run" / "logs":
        fail(f"checkpoint_dir {ckpt} and log_dir {cfg.get('logger.log_dir')} are not OUT/checkpoint and OUT/run/logs")
    if os.environ.get("NRL_MEGATRON_CHECKPOINT_DIR") != str(out / "run" / "megatron_cache"):
        fail(f"NRL_MEGATRON_CHECKPOINT_DIR is {os.environ.get('NRL_MEGATRON_CHECKPOINT_DIR')}")
    if os.environ.get("HF_HUB_OFFLINE") != "1":
        fail("HF_HUB_OFFLINE is not 1")
    if not cfg.get("cluster.num_nodes", "").isdigit():
        fail(f"cluster.num_nodes is {cfg.get('cluster.num_nodes')!r}")
    ckpt.mkdir(parents=True, exist_ok=True)
    start = sorted(p.name for p in ckpt.iterdir())
    leftovers = [n for n in start if n.startswith(("tmp_step_", "old_step_"))]
    if leftovers:
        fail(f"checkpoint_dir holds {leftovers} at the start")

    steps = [int(m.group(1)) for n in start if (m := re.fullmatch(r"step_(\d+)", n))]
    resumed = max(steps) if steps else 0
    if resumed:
        info = json.loads((ckpt / f"step_{resumed}" / "training_info.json").read_text())
        resumed = info["total_steps"]
    log = os.environ.get("FAKE_RL_ARGV_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"argv": argv, "resumed_from": resumed or None, "ckpt_at_start": start}) + "\n")

    total = int(cfg["grpo.max_num_steps"])
    period = int(cfg["checkpointing.save_period"])
    die = int(os.environ.get("FAKE_RL_DIE_AT", "0"))
    timeout = int(os.environ.get("FAKE_RL_TIMEOUT_AT", "0"))
    (out / "run" / "logs").mkdir(parents=True, exist_ok=True)
    for step in range(resumed + 1, total + 1):
        print(f"========================= Step {step}/{total} =========================", flush=True)
        print("📊 Training Results:")
        print(f"  • Loss: {1.0 / step:.4f}")
        print(f"  • Avg Reward: {step / total:.4f}", flush=True)
        if step % period and step != total:
            continue
        print(f"Saving checkpoint for step {step}...", flush=True)
        tmp = ckpt / f"tmp_step_{step}"
        tmp.mkdir()
        prompts = int(cfg["grpo.num_prompts_per_step"])
        (tmp / "training_info.json").write_text(json.dumps({"total_steps": step, "consumed_samples": step * prompts}))
        (tmp / "config.yaml").write_text("grpo: {}\n")
        if step == die:
            print("killed", flush=True)
            sys.exit(137)
        (tmp / "policy" / "weights").mkdir(parents=True)
        (tmp / "policy" / "weights" / "__0_0.distcp").write_bytes(b"\0" * 32)
        tmp.rename(ckpt / f"step_{step}")
        if step == timeout:
            print("Timeout has been reached, stopping training early", flush=True)
            return
    print("Max number of steps has been reached, stopping training early")


if __name__ == "__main__":
    main()
