"""Check an exported Hugging Face Llama checkpoint against nemo-dag's own logits.

Usage: python check_export.py HF_DIR CASE_JSON [--transformers]

CASE_JSON holds {"ids": [...], "logits": [[...], ...]}: token ids and the logits nemo-dag
computed for them. This script recomputes the logits from HF_DIR alone and prints the largest
absolute difference, exiting 1 if it exceeds 1e-4:

- always with a numpy transcription of transformers' LlamaForCausalLM forward (RMSNorm in
  float32, rotate_half rotary embedding with inv_freq = theta^(-2i/d), grouped-query causal
  attention, SiLU-gated MLP), reading model.safetensors with a 20-line parser;
- with `--transformers`, also with `AutoModelForCausalLM.from_pretrained(HF_DIR)` itself.
"""

import json
import struct
import sys

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        assert info["dtype"] == "F32", (name, info["dtype"])
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(data[a:b], dtype="<f4").reshape(info["shape"]).astype(np.float64)
    return out


def rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def numpy_llama(cfg, w, ids):
    t = len(ids)
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    inv_freq = 1.0 / cfg["rope_theta"] ** (np.arange(0, d, 2) / d)
    angles = np.outer(np.arange(t), inv_freq)
    cos = np.cos(np.concatenate([angles, angles], -1))
    sin = np.sin(np.concatenate([angles, angles], -1))

    def rope(x):  # (heads, t, d)
        half = d // 2
        rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rotated * sin

    x = w["model.embed_tokens.weight"][ids]
    causal = np.triu(np.full((t, t), -np.inf), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, d).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, d).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, d).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k = np.repeat(k, nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        s = q @ k.transpose(0, 2, 1) / np.sqrt(d) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        y = (s @ v).transpose(1, 0, 2).reshape(t, nh * d)
        x = x + y @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return x @ head.T


def load(hf_dir, case_path):
    """The exported directory's config and tensors, and the case's ids and our logits."""
    with open(case_path) as f:
        case = json.load(f)
    with open(f"{hf_dir}/config.json") as f:
        cfg = json.load(f)
    w = read_safetensors(f"{hf_dir}/model.safetensors")
    return cfg, w, case["ids"], np.array(case["logits"], dtype=np.float64)


def main():
    hf_dir, case_path = sys.argv[1], sys.argv[2]
    cfg, w, ids, ours = load(hf_dir, case_path)
    results = {}
    results["numpy"] = float(np.abs(numpy_llama(cfg, w, ids) - ours).max())
    if "--transformers" in sys.argv:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].double().numpy()
        results["transformers"] = float(np.abs(logits - ours).max())
    print(json.dumps(results))
    sys.exit(0 if all(v <= 1e-4 for v in results.values()) else 1)


if __name__ == "__main__":
    main()
