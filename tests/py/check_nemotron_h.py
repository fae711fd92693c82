"""Check an exported NemotronH checkpoint against nemo-dag's own logits.

Usage: python check_nemotron_h.py HF_DIR CASE_JSON [--transformers [--save DIR]]

CASE_JSON holds {"ids": [...], "logits": [[...], ...]}: token ids and the logits nemo-dag
computed for them. This script recomputes the logits from HF_DIR alone and prints the largest
absolute difference for each way, exiting 1 if one exceeds 1e-4:

- always with a numpy transcription of transformers' NemotronHForCausalLM forward
  (transformers/models/nemotron_h/modeling_nemotron_h.py, its PyTorch paths): per layer an
  RMSNorm and one mixer — Mamba-2 (in_proj split [z | xBC | dt], depthwise causal conv1d with
  bias, SiLU, Δ = softplus(dt + dt_bias) clamped from below at time_step_min, A = −exp(A_log),
  the state recurrence token by token, + D·x, RMSNorm gated by SiLU(z) in n_groups groups,
  out_proj), attention with no position encoding, a squared-ReLU MLP, or MoE (sigmoid router in
  float, top-k on score + e_score_correction_bias, the raw scores of the chosen experts
  normalised when norm_topk_prob, times routed_scaling_factor, squared-ReLU experts, plus the
  shared expert) — then norm_f and lm_head; the tensors read by name from model.safetensors
  with the parser of check_export.py;
- with `--transformers`, also with `AutoModelForCausalLM.from_pretrained(HF_DIR)` itself, which
  must load with no missing, unexpected or mismatched tensor (transformers only warns about a
  missing one and initialises it at random), on a batch of two rows: the ids, and their first
  half right-padded with an attention mask, whose unpadded positions must give our logits too;
  with `--save DIR` it then writes the model with its own `save_pretrained` (transformers'
  layout, not the hub's) and the tokenizer into DIR, for nemo-dag to import.
"""

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_export import load, rms_norm  # noqa: E402

TOLERANCE = 1e-4


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    return np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))


def relu2_mlp(w, m, h):
    u = np.maximum(h @ w[m + "up_proj.weight"].T, 0)
    return (u * u) @ w[m + "down_proj.weight"].T


def mamba(cfg, w, m, h):
    t = h.shape[0]
    heads, p, groups = cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"]
    n, k = cfg["ssm_state_size"], cfg["conv_kernel"]
    inner = heads * p
    conv_dim = inner + 2 * groups * n
    proj = h @ w[m + "in_proj.weight"].T
    z, xbc, dt = proj[:, :inner], proj[:, inner : inner + conv_dim], proj[:, inner + conv_dim :]
    taps = w[m + "conv1d.weight"][:, 0, :]  # (channels, K): tap K-1 is the current token
    padded = np.concatenate([np.zeros((k - 1, conv_dim)), xbc])
    conv = np.stack([(padded[s : s + k] * taps.T).sum(0) for s in range(t)]) + w[m + "conv1d.bias"]
    xbc = silu(conv)
    x = xbc[:, :inner].reshape(t, heads, p)
    b = xbc[:, inner : inner + groups * n].reshape(t, groups, n)
    c = xbc[:, inner + groups * n :].reshape(t, groups, n)
    delta = np.maximum(softplus(dt + w[m + "dt_bias"]), cfg.get("time_step_min", 0.001))
    a = -np.exp(w[m + "A_log"])
    d = w[m + "D"]
    per_group = heads // groups
    state = np.zeros((heads, p, n))
    y = np.zeros((t, heads, p))
    for s in range(t):
        for hh in range(heads):
            g = hh // per_group
            state[hh] = np.exp(delta[s, hh] * a[hh]) * state[hh] + delta[s, hh] * np.outer(x[s, hh], b[s, g])
            y[s, hh] = state[hh] @ c[s, g] + d[hh] * x[s, hh]
    v = y.reshape(t, inner) * silu(z)
    v = v.reshape(t, groups, inner // groups)
    v = v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg["layer_norm_epsilon"])
    v = v.reshape(t, inner) * w[m + "norm.weight"]
    return v @ w[m + "out_proj.weight"].T


def attention(cfg, w, m, h):
    t = h.shape[0]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    q = (h @ w[m + "q_proj.weight"].T).reshape(t, nh, d).transpose(1, 0, 2)
    k = (h @ w[m + "k_proj.weight"].T).reshape(t, nkv, d).transpose(1, 0, 2)
    v = (h @ w[m + "v_proj.weight"].T).reshape(t, nkv, d).transpose(1, 0, 2)
    k = np.repeat(k, nh // nkv, axis=0)
    v = np.repeat(v, nh // nkv, axis=0)
    s = q @ k.transpose(0, 2, 1) / np.sqrt(d) + np.triu(np.full((t, t), -np.inf), 1)
    s = np.exp(s - s.max(-1, keepdims=True))
    s /= s.sum(-1, keepdims=True)
    return (s @ v).transpose(1, 0, 2).reshape(t, nh * d) @ w[m + "o_proj.weight"].T


def moe(cfg, w, m, h):
    scores = sigmoid(h @ w[m + "gate.weight"].T)
    choice = scores + w[m + "gate.e_score_correction_bias"]
    out = np.zeros_like(h)
    for s in range(h.shape[0]):
        chosen = np.argsort(-choice[s])[: cfg["num_experts_per_tok"]]
        gates = scores[s, chosen]
        if cfg["norm_topk_prob"]:
            gates = gates / (gates.sum() + 1e-20)
        gates = gates * cfg["routed_scaling_factor"]
        for e, g in zip(chosen, gates):
            out[s] += g * relu2_mlp(w, f"{m}experts.{e}.", h[s : s + 1])[0]
    return out + relu2_mlp(w, m + "shared_experts.", h)


MIXERS = {"linear_attention": mamba, "full_attention": attention, "moe": moe}


def numpy_nemotron_h(cfg, w, ids):
    eps = cfg["layer_norm_epsilon"]
    x = w["backbone.embeddings.weight"][ids]
    for i, kind in enumerate(cfg["layers_block_type"]):
        p = f"backbone.layers.{i}."
        h = rms_norm(x, w[p + "norm.weight"], eps)
        m = p + "mixer."
        x = x + (relu2_mlp(w, m, h) if kind == "mlp" else MIXERS[kind](cfg, w, m, h))
    return rms_norm(x, w["backbone.norm_f.weight"], eps) @ w["lm_head.weight"].T


def transformers_gap(hf_dir, ids, ours, save=None):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, output_loading_info=True
    )
    wrong = {k: v for k, v in info.items() if k != "error_msgs" and v}
    if wrong or info.get("error_msgs"):
        sys.exit(f"transformers {transformers.__version__} loaded {hf_dir} with {info}")
    model.eval()
    half = len(ids) // 2
    pad = 0
    rows = torch.tensor([ids, ids[:half] + [pad] * (len(ids) - half)])
    mask = torch.tensor([[1] * len(ids), [1] * half + [0] * (len(ids) - half)])
    with torch.no_grad():
        logits = model(rows, attention_mask=mask).logits.double().numpy()
    gap_full = np.abs(logits[0] - ours).max()
    gap_padded = np.abs(logits[1, :half] - ours[:half]).max()
    if save:
        import shutil

        model.save_pretrained(save)
        shutil.copy(f"{hf_dir}/tokenizer.json", f"{save}/tokenizer.json")
    return transformers.__version__, float(max(gap_full, gap_padded))


def main():
    hf_dir, case_path = sys.argv[1], sys.argv[2]
    cfg, w, ids, ours = load(hf_dir, case_path)
    results = {}
    results["numpy"] = float(np.abs(numpy_nemotron_h(cfg, w, ids) - ours).max())
    if "--transformers" in sys.argv:
        save = sys.argv[sys.argv.index("--save") + 1] if "--save" in sys.argv else None
        version, gap = transformers_gap(hf_dir, ids, ours, save)
        results["transformers"] = gap
        results["transformers_version"] = version
    print(json.dumps(results))
    gaps = [v for v in results.values() if isinstance(v, float)]
    sys.exit(0 if all(g <= TOLERANCE for g in gaps) else 1)


if __name__ == "__main__":
    main()
