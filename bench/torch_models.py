"""PyTorch twin of nemo-dag's model (ops/model/src/): the same parameters under the same names
and shapes, the same forward ops, the same loss. Plain eager PyTorch, no custom kernels.

    net = Net(dict(pattern="ME*-/*E", hidden=128, ..., vocab=640))
    total, main_sum, mtp_sums = net.loss(ids, labels, normaliser=ids.numel())

One class per block kind, as in nemo-dag:

- `Attention`  (`*`, layers.rs): fused `qkv` projection, grouped-query heads, rotary or no
  position encoding, causal softmax attention (or `F.scaled_dot_product_attention` with
  `sdpa=True`), output projection `proj`.
- `Mlp`        (`-`, layers.rs; also every MoE expert): `fc2(act(fc1(x)))`, SwiGLU (`fc1` is
  `[gate; up]`) or squared ReLU.
- `Mamba2`     (`M`, mamba2.rs): `in_proj` → `[z, xBC, dt]`, depthwise causal conv over `xBC`
  (`conv_weight` is `(channels, K)` as in nemo-dag, used through `F.conv1d`), SiLU, Δ =
  softplus(dt + dt_bias), A = −exp(a_log), the chunked SSD scan (`ssd_chunked`: the
  intra-chunk masked "attention", each chunk's own state, a sequential pass carrying the state
  across chunks, the entering state's contribution), + D·x, gated RMSNorm per group, `out_proj`.
- `Moe`        (`E`, moe.rs): sigmoid router; top-k on `score + expert_bias` (the bias only
  selects); gates = chosen raw scores normalised (k > 1) × scaling; tokens dispatched: each
  expert runs only on the rows routed to it (gathered, then `index_add`ed back with their
  gates); plus the shared expert on every token. `expert_bias` is a buffer moved by
  `update_bias()` after each optimizer step (aux-loss-free balancing), as nemo-dag does.
- `Block`: `x + mixer(rms_norm(x))` with its own `norm`; `MtpDepth`: `enorm`, `hnorm`,
  `eh_proj`, blocks, `final_norm` (net.rs).

`Net.state_dict()` keys are nemo-dag's tensor names (`blocks.0.mamba.in_proj`,
`mtp.0.eh_proj`, `blocks.1.moe.expert_bias`, ...) with nemo-dag's shapes, so a nemo-dag
`model.safetensors` loads with `load_state_dict(strict=True)` and no renaming
(bench/check_torch_twin.py does that and compares losses). The initialisation draws the same
distributions as nemo-dag's (params.rs, mamba2.rs) from torch's generator, not its values.

Packed sequences (several documents in a row, SFT) are not modelled: every row here is one
sequence, which is what `pretrain` feeds (its Mamba masks and attention masks are then exactly
the causal ones used here).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def parse_pattern(text):
    """`"ME*-/*E"` → (["M", "E", "*", "-"], [["*", "E"]]): the main stack and the MTP depths."""
    parts = text.replace("|", "").split("/")
    return list(parts[0]), [list(p) for p in parts[1:]]


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def normal(shape, std):
    return nn.Parameter(torch.randn(shape) * std)


def ones(n):
    return nn.Parameter(torch.ones(n))


class Attention(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        self.h, self.k, self.d = c["heads"], c.get("kv_heads") or c["heads"], c["head_dim"]
        self.qkv = normal(((self.h + 2 * self.k) * self.d, c["hidden"]), c["init_std"])
        self.proj = normal((c["hidden"], self.h * self.d), out_std)

    def forward(self, x, ctx):
        b, t, _ = x.shape
        h, k, d = self.h, self.k, self.d
        q, kk, v = F.linear(x, self.qkv).split([h * d, k * d, k * d], -1)
        q = q.view(b, t, h, d).transpose(1, 2)
        kk = kk.view(b, t, k, d).transpose(1, 2)
        v = v.view(b, t, k, d).transpose(1, 2)
        if ctx["rope"] is not None:
            cos, sin = ctx["rope"]
            q, kk = apply_rope(q, cos, sin), apply_rope(kk, cos, sin)
        kk = kk.repeat_interleave(h // k, 1)  # query head i reads kv head i // (h/k)
        v = v.repeat_interleave(h // k, 1)
        if ctx["sdpa"]:
            y = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
        else:
            s = (q @ kk.transpose(-1, -2)) / math.sqrt(d) + ctx["mask"]
            y = torch.softmax(s, -1) @ v
        return F.linear(y.transpose(1, 2).reshape(b, t, h * d), self.proj)


def apply_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def rope_tables(head_dim, length, theta):
    half = head_dim // 2
    i = torch.arange(head_dim, dtype=torch.float64) % half
    angle = torch.arange(length, dtype=torch.float64)[:, None] / theta ** (2 * i / head_dim)
    return angle.cos().float(), angle.sin().float()


class Mlp(nn.Module):
    def __init__(self, hidden, ffn, activation, std, out_std):
        super().__init__()
        self.activation = activation
        self.fc1 = normal((2 * ffn if activation == "swiglu" else ffn, hidden), std)
        self.fc2 = normal((hidden, ffn), out_std)

    def forward(self, x):
        h = F.linear(x, self.fc1)
        if self.activation == "swiglu":
            g, u = h.chunk(2, -1)
            h = F.silu(g) * u
        else:
            h = F.relu(h).square()
        return F.linear(h, self.fc2)


class Mamba2(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        m = c["mamba"]
        self.H, self.P, self.N = m["heads"], m["head_dim"], m["state"]
        self.G, self.K, self.chunk = m.get("groups", 1), m.get("conv", 4), m.get("chunk", 64)
        self.eps = c["norm_eps"]
        di, gn = self.H * self.P, self.G * self.N
        channels = di + 2 * gn
        bound = 1 / math.sqrt(self.K)  # Kaiming-uniform of a depthwise conv (fan_in = K)
        self.in_proj = normal((2 * di + 2 * gn + self.H, c["hidden"]), c["init_std"])
        self.conv_weight = nn.Parameter(torch.empty(channels, self.K).uniform_(-bound, bound))
        self.conv_bias = nn.Parameter(torch.empty(channels).uniform_(-bound, bound))
        dt = torch.empty(self.H).uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
        self.a_log = nn.Parameter(torch.empty(self.H).uniform_(1, 16).log())
        self.d = ones(self.H)
        self.norm = ones(di)
        self.out_proj = normal((c["hidden"], di), out_std)

    def forward(self, u, ctx):
        b, t, _ = u.shape
        H, P, N, G = self.H, self.P, self.N, self.G
        di, gn = H * P, G * N
        z, xbc, dt = F.linear(u, self.in_proj).split([di, di + 2 * gn, H], -1)
        # Depthwise causal conv: K − 1 zeros on the left, tap K − 1 on the current token.
        xbc = F.conv1d(xbc.transpose(1, 2), self.conv_weight.unsqueeze(1), self.conv_bias,
                       padding=self.K - 1, groups=xbc.shape[-1])
        xbc = F.silu(xbc[..., :t].transpose(1, 2))
        x, B, C = xbc.split([di, gn, gn], -1)
        x = x.reshape(b, t, H, P)
        dt = F.softplus(dt + self.dt_bias)
        y = ssd_chunked(x, dt, -self.a_log.exp(), B.reshape(b, t, G, N), C.reshape(b, t, G, N), self.chunk)
        y = y + x * self.d[:, None]
        v = (y.reshape(b, t, di) * F.silu(z)).reshape(b, t, G, di // G)  # gated RMSNorm per group
        v = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(b, t, di) * self.norm
        return F.linear(v, self.out_proj)


def ssd_chunked(x, dt, A, B, C, chunk):
    """The Mamba-2 scan `S_t = exp(Δ_t·A)·S_{t−1} + Δ_t·x_t⊗B_t, y_t = S_t·C_t` in chunked (SSD)
    form, as mamba2.rs computes it. x (b,T,H,P), dt (b,T,H), A (H), B, C (b,T,G,N) → y (b,T,H,P)."""
    b, T, H, P = x.shape
    L = max(1, min(chunk, T))
    c = -(-T // L)
    pad = c * L - T
    B = B.repeat_interleave(H // B.shape[2], 2)  # head h reads group h // (H/G)
    C = C.repeat_interleave(H // C.shape[2], 2)

    def chunked(z):  # (b, T, H, w) → (b, H, chunks, L, w)
        return F.pad(z, (0, 0, 0, 0, 0, pad)).reshape(b, c, L, H, -1).permute(0, 3, 1, 2, 4)

    xc, bc, cc = chunked(x), chunked(B), chunked(C)
    dtc = chunked(dt.unsqueeze(-1)).squeeze(-1)  # (b, H, chunks, L)
    cs = (dtc * A[:, None, None]).cumsum(-1)  # cs_t = a_1 + … + a_t inside the chunk
    dtx = xc * dtc.unsqueeze(-1)  # Δ_s x_s

    # 1. Inside each chunk: y_t = Σ_{s≤t} (C_t·B_s) exp(cs_t − cs_s) Δ_s x_s.
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    decay = (cs.unsqueeze(-1) - cs.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    y_diag = ((cc @ bc.transpose(-1, -2)) * decay) @ dtx

    # 2. The state each chunk leaves from its own tokens: Σ_s exp(cs_last − cs_s) Δ_s x_s ⊗ B_s.
    cs_last = cs[..., -1:]
    own = (dtx * (cs_last - cs).exp().unsqueeze(-1)).transpose(-1, -2) @ bc  # (b, H, chunks, P, N)

    # 3. Carry the state across chunks: S_in(next) = exp(cs_last)·S_in + own.
    across = cs_last.squeeze(-1).exp()  # (b, H, chunks)
    state = x.new_zeros(b, H, P, B.shape[-1])
    entering = []
    for k in range(c):
        entering.append(state)
        state = state * across[:, :, k, None, None] + own[:, :, k]
    entering = torch.stack(entering, 2)  # (b, H, chunks, P, N)

    # 4. What the entering state contributes: exp(cs_t) · C_t · S_in.
    y_off = (cc @ entering.transpose(-1, -2)) * cs.exp().unsqueeze(-1)
    return (y_diag + y_off).permute(0, 2, 3, 1, 4).reshape(b, c * L, H, P)[:, :T]


class Moe(nn.Module):
    def __init__(self, c, out_std):
        super().__init__()
        m = c["moe"]
        std, act = c["init_std"], c["activation"]
        self.top_k, self.scaling = m["top_k"], m.get("scaling", 1.0)
        self.rate = m.get("bias_update_rate", 1e-3)
        self.router = normal((m["experts"], c["hidden"]), std)
        self.experts = nn.ModuleList(
            [Mlp(c["hidden"], m["expert_ffn"], act, std, out_std) for _ in range(m["experts"])]
        )
        self.shared = Mlp(c["hidden"], m["shared_ffn"], act, std, out_std) if m.get("shared_ffn") else None
        self.register_buffer("expert_bias", torch.zeros(m["experts"]))
        self.register_buffer("counts", torch.zeros(m["experts"], dtype=torch.long), persistent=False)

    def forward(self, x, ctx):
        b, t, hidden = x.shape
        xs = x.reshape(b * t, hidden)
        k, E = self.top_k, len(self.experts)
        scores = torch.sigmoid(F.linear(xs, self.router))  # (tokens, E)
        chosen = torch.topk(scores.detach() + self.expert_bias, k, -1).indices  # the bias only selects
        picked = scores.gather(1, chosen)
        gates = picked / (picked.sum(-1, keepdim=True) + 1e-20) if k > 1 else picked
        gates = (gates * self.scaling).reshape(-1)
        experts = chosen.reshape(-1)
        per_expert = torch.bincount(experts, minlength=E)
        if ctx["training"]:
            self.counts += per_expert

        # Dispatch: (token, slot) pairs grouped by expert, slots in order inside each group.
        slots = torch.argsort(experts, stable=True)
        out = self.shared(xs) if self.shared is not None else torch.zeros_like(xs)
        start = 0
        for e, n in enumerate(per_expert.tolist()):
            if n == 0:
                continue
            slot = slots[start : start + n]
            start += n
            rows = slot // k
            y = self.experts[e](xs[rows]) * gates[slot, None]
            out = out.index_add(0, rows, y.to(out.dtype))  # autocast: bf16 shared, f32 gates
        return out.reshape(b, t, hidden)

    @torch.no_grad()
    def update_bias(self):
        """bias_e += rate · sign(mean(counts) − count_e); counts restart from 0."""
        counts = self.counts.double()
        self.expert_bias += (torch.sign(counts.mean() - counts) * self.rate).float()
        self.counts.zero_()


class Block(nn.Module):
    """`x + mixer(rms_norm(x))`; the mixer sits under the name nemo-dag gives it."""

    def __init__(self, kind, c, out_std):
        super().__init__()
        self.eps = c["norm_eps"]
        self.norm = ones(c["hidden"])
        if kind == "*":
            self.name, mixer = "attn", Attention(c, out_std)
        elif kind == "-":
            self.name, mixer = "mlp", Mlp(c["hidden"], c["ffn"], c["activation"], c["init_std"], out_std)
        elif kind == "M":
            self.name, mixer = "mamba", Mamba2(c, out_std)
        elif kind == "E":
            self.name, mixer = "moe", Moe(c, out_std)
        else:
            raise ValueError(f"unknown layer symbol {kind!r}")
        self.add_module(self.name, mixer)

    def forward(self, x, ctx):
        h = rms_norm(x, self.norm, self.eps)
        mixer = getattr(self, self.name)
        return x + (mixer(h) if self.name == "mlp" else mixer(h, ctx))


class MtpDepth(nn.Module):
    def __init__(self, kinds, c, out_std):
        super().__init__()
        hidden = c["hidden"]
        self.enorm, self.hnorm = ones(hidden), ones(hidden)
        self.eh_proj = normal((hidden, 2 * hidden), c["init_std"])
        self.blocks = nn.ModuleList([Block(kind, c, out_std) for kind in kinds])
        self.final_norm = ones(hidden)


DEFAULTS = dict(
    vocab=0, heads=0, kv_heads=0, head_dim=0, ffn=0, activation="swiglu", position="rope",
    rope_theta=10000.0, max_seq=4096, norm_eps=1e-5, init_std=0.02, tie_embeddings=False,
    mamba=None, moe=None, mtp_loss_scale=0.3, mtp_shared=False,
)


class Net(nn.Module):
    """nemo-dag's `Model` (net.rs) for a config dict as a manifest writes it, plus `vocab`."""

    def __init__(self, config):
        super().__init__()
        c = {**DEFAULTS, **config}
        self.c = c
        self.main, self.depths = parse_pattern(c["pattern"])
        out_std = c["init_std"] / math.sqrt(2 * max(1, len(self.main)))
        hidden, vocab = c["hidden"], c["vocab"]
        self.embedding = normal((vocab, hidden), c["init_std"])
        self.blocks = nn.ModuleList([Block(kind, c, out_std) for kind in self.main])
        self.final_norm = ones(hidden)
        shared_depths = min(1, len(self.depths)) if c["mtp_shared"] else len(self.depths)
        self.mtp = nn.ModuleList([MtpDepth(self.depths[d], c, out_std) for d in range(shared_depths)])
        self.output = None if c["tie_embeddings"] else normal((vocab, hidden), c["init_std"])
        self.sdpa = False
        self._ctx_cache = {}

    def head(self, h):
        return F.linear(h, self.embedding if self.output is None else self.output)

    def context(self, t):
        if t not in self._ctx_cache:
            rope = None
            if self.c["position"] == "rope" and "*" in self.c["pattern"]:
                rope = rope_tables(self.c["head_dim"], t, self.c["rope_theta"])
            mask = torch.full((t, t), float("-inf")).triu(1)
            self._ctx_cache[t] = dict(rope=rope, mask=mask)
        return dict(self._ctx_cache[t], sdpa=self.sdpa, training=self.training)

    def loss(self, ids, labels, loss_mask=None, normaliser=1.0):
        """ids, labels (B, T) int64; returns (total to differentiate = (Σ masked CE_main +
        mtp_loss_scale/D · Σ_k Σ masked CE_k) / normaliser, Σ CE_main, [Σ CE_k])."""
        c, eps = self.c, self.c["norm_eps"]
        b, t = ids.shape
        if loss_mask is None:
            loss_mask = torch.ones(b, t)
        ctx = self.context(t)
        x = F.embedding(ids, self.embedding)
        for block in self.blocks:
            x = block(x, ctx)

        def ce(h, final_norm, labels, mask):
            logits = self.head(rms_norm(h, final_norm, eps))
            per_token = F.cross_entropy(logits.reshape(b * t, -1), labels.reshape(-1), reduction="none")
            return (per_token * mask.reshape(-1)).sum()

        main = ce(x, self.final_norm, labels, loss_mask)
        total = main / normaliser
        mtp_sums = []
        prev = x
        for k in range(1, len(self.depths) + 1):
            w = self.mtp[0 if c["mtp_shared"] else k - 1]
            # Shift left by k inside each row: the last k positions get id 0 and no loss.
            ids_k = F.pad(ids[:, k:], (0, k))
            labels_k = F.pad(labels[:, k:], (0, k))
            mask_k = F.pad(loss_mask[:, k:], (0, k))
            e = rms_norm(F.embedding(ids_k, self.embedding), w.enorm, eps)
            h = F.linear(torch.cat([e, rms_norm(prev, w.hnorm, eps)], -1), w.eh_proj)
            for block in w.blocks:
                h = block(h, ctx)
            s = ce(h, w.final_norm, labels_k, mask_k)
            mtp_sums.append(s)
            total = total + s * (c["mtp_loss_scale"] / len(self.depths) / normaliser)
            prev = h
        return total, main, mtp_sums

    def moe_layers(self):
        return [m for m in self.modules() if isinstance(m, Moe)]

    def update_moe_biases(self):
        for m in self.moe_layers():
            m.update_bias()

    def param_groups(self, weight_decay):
        """AdamW groups as nemo-dag's trainer makes them: matrices decay, vectors do not."""
        params = list(self.parameters())
        return [
            dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
            dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0),
        ]
