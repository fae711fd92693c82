//! The Mamba-2 mixer (state-space duality, "SSD"), as Nemotron-H's `M` blocks use it
//! (Megatron-LM `megatron/core/ssm/mamba_mixer.py`, `MambaMixer`; see docs/parity.md, "Mamba-2").
//!
//! Notation: `d` = hidden, `H` heads of `P` channels (`d_inner = H·P`), `G` groups sharing the
//! `B` and `C` projections, `N` state size, `K` convolution width. For every token:
//!
//! 1. `in_proj` (no bias) maps `u ∈ R^d` to `[z, x, B, C, dt]`, widths
//!    `d_inner, d_inner, G·N, G·N, H`, in that order.
//! 2. A depthwise causal convolution of width `K` runs over the `d_inner + 2·G·N` channels of
//!    `[x, B, C]` (zero left padding, tap `K−1` multiplies the current token, with bias), then
//!    SiLU; the result is split back into `x`, `B`, `C`.
//! 3. Head `h` uses group `g = h / (H/G)`. The step size is `Δ = softplus(dt + dt_bias)` and
//!    the (negative) decay rate `A_h = −exp(A_log_h)`.
//! 4. Each head keeps a state `S ∈ R^{P×N}`, zero at the start of every sequence:
//!    `S_t = exp(Δ_t·A)·S_{t−1} + Δ_t·(x_t ⊗ B_t)` and `y_t = S_t·C_t + D·x_t`.
//! 5. Gated RMSNorm: `v = y ⊙ SiLU(z)`, normalised within each of `G` contiguous groups of
//!    `d_inner/G` channels, times a learned weight.
//! 6. `out_proj` (no bias) maps `d_inner → d`. The surrounding block adds the residual.
//!
//! **Training: the chunked (SSD) form.** Step 4 is a linear recurrence, so it can be unrolled.
//! With `a_t = Δ_t·A` and the running sum `cs_t = a_1 + … + a_t`, the contribution of token `s`
//! to the output at `t ≥ s` is `(C_t·B_s) · exp(cs_t − cs_s) · Δ_s x_s`. The sequence is cut
//! into chunks of `L` tokens ([`MambaConfig::chunk`]):
//! - inside a chunk that sum is a masked `L×L` "attention" matrix `(C Bᵀ) ⊙ exp(segsum)`
//!   applied to `Δx` (a matmul, like causal attention without softmax);
//! - each chunk also summarises its own inputs as the state it leaves behind,
//!   `Σ_s exp(cs_last − cs_s) Δ_s x_s ⊗ B_s`;
//! - a short sequential pass over the chunks carries the state from chunk to chunk, each
//!   chunk decaying it by `exp(cs_last)`;
//! - every token then reads the state that entered its chunk: `exp(cs_t) · C_t · S_in`.
//!
//! The sum of the two parts equals the recurrence exactly (up to float rounding);
//! [`Mamba2::forward_sequential`] runs the recurrence literally, as the reference.
//!
//! **Packed sequences.** A row may hold several subsequences (`segments`, one id per token). The
//! convolution window and the state never reach across a change of id: every term above that
//! would link a token to one before the start of its own run is masked to zero.
//!
//! **Decoding** ([`Mamba2::step`]) keeps, per sequence, the last `K` convolution inputs (the
//! window rolls left, newest last) and the `(H, P, N)` state, and advances both by one token.

use super::config::MambaConfig;
use super::layers::linear;
use super::params::{Init, constant_f32};
use candle_core::{D, DType, Result, Tensor};

/// Batched matmul over any number of leading dimensions (candle's own matmul wants ≤ 4 dims
/// and contiguous batches): `(…, m, k) @ (…, k, n) → (…, m, n)`.
fn bmm(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let dims = a.dims();
    let r = dims.len();
    let (m, k, n) = (dims[r - 2], dims[r - 1], b.dim(D::Minus1)?);
    let batch: usize = dims[..r - 2].iter().product();
    let y = a
        .contiguous()?
        .reshape((batch, m, k))?
        .matmul(&b.contiguous()?.reshape((batch, k, n))?)?;
    let mut out = dims[..r - 2].to_vec();
    out.extend([m, n]);
    y.reshape(out)
}

/// `softplus(v) = ln(1 + eᵛ)`, written as `max(v, 0) + ln(1 + e^{−|v|})` so it cannot overflow.
fn softplus(v: &Tensor) -> Result<Tensor> {
    v.relu()? + (v.abs()?.neg()?.exp()? + 1.0)?.log()?
}

/// For every token, the index (inside its row) of the first token of its run of equal segment
/// ids. An empty `segments` means one run per row.
pub fn run_starts(segments: &[u32], batch: usize, len: usize) -> Result<Vec<usize>> {
    if segments.is_empty() {
        return Ok(vec![0; batch * len]);
    }
    if segments.len() != batch * len {
        candle_core::bail!(
            "mamba2: {} segment ids for a batch of {batch} rows of {len} tokens",
            segments.len()
        )
    }
    let mut starts = vec![0; batch * len];
    for row in 0..batch {
        for t in 1..len {
            let i = row * len + t;
            starts[i] = if segments[i] == segments[i - 1] {
                starts[i - 1]
            } else {
                t
            };
        }
    }
    Ok(starts)
}

/// `(batch, time, groups, n)` → `(batch, time, heads, n)`: head `h` reads group `h / (H/G)`.
fn groups_to_heads(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, l, g, n) = t.dims4()?;
    if g == heads {
        return Ok(t.clone());
    }
    t.unsqueeze(3)?
        .broadcast_as((b, l, g, heads / g, n))?
        .reshape((b, l, heads, n))
}

/// The scan of step 4 without the `D·x` skip, in chunked (SSD) form.
/// `x (B,T,H,P)`, `dt = Δ (B,T,H)`, `a = A (H)` (negative), `b`, `c (B,T,G,N)`,
/// `starts` from [`run_starts`]; returns `y (B,T,H,P)`.
fn ssd_chunked(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    starts: &[usize],
    chunk: usize,
) -> Result<Tensor> {
    let (batch, len, heads, p) = x.dims4()?;
    let n = b.dim(3)?;
    let l = chunk.max(1).min(len.max(1));
    let chunks = len.div_ceil(l);
    let pad = chunks * l - len;

    // Host-side masks from the run starts; padding tokens continue the row's last run.
    let start = |row: usize, t: usize| starts[row * len + t.min(len - 1)];
    let mut intra = vec![0u8; batch * chunks * l * l]; // s ≤ t and s in t's run
    let mut from_in = vec![0f32; batch * chunks * l]; // the entering state reaches t
    let mut to_last = vec![0f32; batch * chunks * l]; // s reaches the chunk's last token
    let mut carry = vec![0f32; batch * chunks]; // the entering state crosses the chunk
    for row in 0..batch {
        for ch in 0..chunks {
            let first = ch * l;
            let last_start = start(row, first + l - 1);
            let rc = row * chunks + ch;
            carry[rc] = (last_start < first) as u8 as f32;
            for t in 0..l {
                let st = start(row, first + t);
                from_in[rc * l + t] = (st < first) as u8 as f32;
                to_last[rc * l + t] = (last_start <= first + t) as u8 as f32;
                for s in 0..=t {
                    intra[(rc * l + t) * l + s] = (st <= first + s) as u8;
                }
            }
        }
    }
    let dev = x.device();
    let intra = Tensor::from_vec(intra, (batch, 1, chunks, l, l), dev)?;
    let from_in = constant_f32(from_in, &[batch, 1, chunks, l])?;
    let to_last = constant_f32(to_last, &[batch, 1, chunks, l])?;
    let carry = constant_f32(carry, &[batch, 1, chunks])?;

    // Heads first, time cut into chunks: (B, H, chunks, L, ·).
    let chunked = |t: &Tensor| -> Result<Tensor> {
        let w = t.dim(3)?;
        t.pad_with_zeros(1, 0, pad)?
            .reshape((batch, chunks, l, heads, w))?
            .permute((0, 3, 1, 2, 4))?
            .contiguous()
    };
    let xc = chunked(x)?;
    let bc = chunked(&groups_to_heads(b, heads)?)?;
    let cc = chunked(&groups_to_heads(c, heads)?)?;
    let dtc = chunked(&dt.unsqueeze(3)?)?.squeeze(4)?; // (B,H,chunks,L)
    let da = dtc.broadcast_mul(&a.reshape((1, heads, 1, 1))?)?;
    let cs = da.cumsum(D::Minus1)?; // cs_t = a_1 + … + a_t inside the chunk
    let dtx = xc.broadcast_mul(&dtc.unsqueeze(4)?)?; // Δ_s x_s

    // 1. Inside each chunk: y_t = Σ_{s ≤ t, same run} (C_t·B_s) exp(cs_t − cs_s) Δ_s x_s.
    let shape = (batch, heads, chunks, l, l);
    let segsum = cs.unsqueeze(4)?.broadcast_sub(&cs.unsqueeze(3)?)?; // [t, s] = cs_t − cs_s
    let neg_inf = Tensor::full(f32::NEG_INFINITY, shape, dev)?;
    let decay = intra
        .broadcast_as(shape)?
        .where_cond(&segsum, &neg_inf)?
        .exp()?;
    let scores = bmm(&cc, &bc.t()?)?.mul(&decay)?;
    let y_diag = bmm(&scores, &dtx)?;

    // 2. The state each chunk leaves behind from its own tokens:
    //    Σ_s exp(cs_last − cs_s) Δ_s x_s ⊗ B_s, as (B,H,chunks,P,N).
    let cs_last = cs.narrow(3, l - 1, 1)?;
    let to_end = cs_last.broadcast_sub(&cs)?.exp()?.broadcast_mul(&to_last)?;
    let own = bmm(&dtx.broadcast_mul(&to_end.unsqueeze(4)?)?.t()?, &bc)?;

    // 3. Carry the state across chunks: S_in(next) = exp(cs_last)·S_in + own.
    let across = cs_last.squeeze(3)?.exp()?.broadcast_mul(&carry)?; // (B,H,chunks)
    let mut state = Tensor::zeros((batch, heads, p, n), DType::F32, dev)?;
    let mut entering = Vec::with_capacity(chunks);
    for ch in 0..chunks {
        entering.push(state.clone());
        let keep = across.narrow(2, ch, 1)?.unsqueeze(3)?; // (B,H,1,1)
        state = state
            .broadcast_mul(&keep)?
            .add(&own.narrow(2, ch, 1)?.squeeze(2)?)?;
    }
    let entering = Tensor::stack(&entering, 2)?; // (B,H,chunks,P,N)

    // 4. What the entering state contributes: exp(cs_t) · C_t · S_in.
    let reach = cs.exp()?.broadcast_mul(&from_in)?;
    let y_off = bmm(&cc, &entering.t()?)?.broadcast_mul(&reach.unsqueeze(4)?)?;

    // Back to (B, T, H, P).
    (y_diag + y_off)?
        .permute((0, 2, 3, 1, 4))?
        .reshape((batch, chunks * l, heads, p))?
        .narrow(1, 0, len)
}

/// The same scan as [`ssd_chunked`], one token at a time: the recurrence of step 4, literally.
fn ssd_sequential(
    x: &Tensor,
    dt: &Tensor,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    starts: &[usize],
) -> Result<Tensor> {
    let (batch, len, heads, p) = x.dims4()?;
    let n = b.dim(3)?;
    let b = groups_to_heads(b, heads)?;
    let c = groups_to_heads(c, heads)?;
    let mut state = Tensor::zeros((batch, heads, p, n), DType::F32, x.device())?;
    let mut ys = Vec::with_capacity(len);
    for t in 0..len {
        // 0 where token t starts a new run: the state is forgotten.
        let keep: Vec<f32> = (0..batch)
            .map(|row| (starts[row * len + t] < t) as u8 as f32)
            .collect();
        let keep = constant_f32(keep, &[batch, 1])?;
        let dt_t = dt.narrow(1, t, 1)?.squeeze(1)?; // (B,H)
        let decay = dt_t
            .broadcast_mul(&a.unsqueeze(0)?)?
            .exp()?
            .broadcast_mul(&keep)?;
        let x_t = x.narrow(1, t, 1)?.squeeze(1)?; // (B,H,P)
        let b_t = b.narrow(1, t, 1)?.squeeze(1)?; // (B,H,N)
        let c_t = c.narrow(1, t, 1)?.squeeze(1)?;
        let input = x_t
            .broadcast_mul(&dt_t.unsqueeze(2)?)?
            .unsqueeze(3)?
            .broadcast_mul(&b_t.unsqueeze(2)?)?; // Δ x ⊗ B, (B,H,P,N)
        state = state
            .broadcast_mul(&decay.unsqueeze(2)?.unsqueeze(3)?)?
            .add(&input)?;
        ys.push(bmm(&state, &c_t.unsqueeze(3)?)?.squeeze(3)?); // S·C, (B,H,P)
    }
    Tensor::stack(&ys, 1)
}

/// One Mamba-2 mixer: parameters and sizes.
pub struct Mamba2 {
    in_proj: Tensor,
    conv_weight: Tensor,
    conv_bias: Tensor,
    dt_bias: Tensor,
    a_log: Tensor,
    d: Tensor,
    norm: Tensor,
    out_proj: Tensor,
    heads: usize,
    head_dim: usize,
    groups: usize,
    state: usize,
    conv: usize,
    chunk: usize,
    norm_eps: f64,
}

/// The decode state of one batch of sequences.
pub struct Mamba2Cache {
    /// The last `K` inputs of the convolution, `(B, K, channels)`, newest last.
    pub conv: Tensor,
    /// The SSM state, `(B, H, P, N)`.
    pub ssm: Tensor,
}

/// What the input projection and the convolution make of the tokens.
struct Mixed {
    /// Gate, `(…, d_inner)`.
    z: Tensor,
    /// Inputs, `(…, H, P)`.
    x: Tensor,
    /// `B` and `C`, `(…, G, N)`.
    b: Tensor,
    c: Tensor,
    /// `Δ = softplus(dt + dt_bias)`, `(…, H)`.
    dt: Tensor,
}

impl Mamba2 {
    /// Parameters created through `init` in this order with these names: in_proj, conv_weight,
    /// conv_bias, dt_bias, a_log, d, norm, out_proj.
    pub fn new(
        init: &mut Init,
        hidden: usize,
        cfg: &MambaConfig,
        norm_eps: f64,
        std: f64,
        out_std: f64,
    ) -> Result<Mamba2> {
        let (h, p, g, n, k) = (cfg.heads, cfg.head_dim, cfg.groups, cfg.state, cfg.conv);
        if h == 0 || p == 0 || g == 0 || n == 0 || k == 0 || cfg.chunk == 0 || !h.is_multiple_of(g)
        {
            candle_core::bail!(
                "mamba2: heads ({h}), head_dim ({p}), state ({n}), conv ({k}) and chunk ({}) must be > 0 and heads a multiple of groups ({g})",
                cfg.chunk
            )
        }
        let d_inner = h * p;
        let channels = d_inner + 2 * g * n;
        let in_proj = init.normal("in_proj", &[2 * d_inner + 2 * g * n + h, hidden], std)?;
        let bound = 1.0 / (k as f64).sqrt(); // Kaiming-uniform for a depthwise conv: fan_in = K
        let conv_weight = init.uniform("conv_weight", &[channels, k], -bound, bound)?;
        let conv_bias = init.uniform("conv_bias", &[channels], -bound, bound)?;
        // dt ~ exp(U(ln 1e-3, ln 1e-1)) ≥ 1e-4; the bias is its inverse softplus.
        let dt_bias = init.with("dt_bias", &[h], |r| {
            let (lo, hi) = (1e-3f64.ln(), 1e-1f64.ln());
            let dt = (lo + (hi - lo) * r.uniform()).exp().max(1e-4);
            dt + (-(-dt).exp_m1()).ln()
        })?;
        let a_log = init.with("a_log", &[h], |r| (1.0 + 15.0 * r.uniform()).ln())?;
        let d = init.constant("d", &[h], 1.0)?;
        let norm = init.constant("norm", &[d_inner], 1.0)?;
        let out_proj = init.normal("out_proj", &[hidden, d_inner], out_std)?;
        Ok(Mamba2 {
            in_proj,
            conv_weight,
            conv_bias,
            dt_bias,
            a_log,
            d,
            norm,
            out_proj,
            heads: h,
            head_dim: p,
            groups: g,
            state: n,
            conv: k,
            chunk: cfg.chunk,
            norm_eps,
        })
    }

    fn d_inner(&self) -> usize {
        self.heads * self.head_dim
    }

    fn conv_channels(&self) -> usize {
        self.d_inner() + 2 * self.groups * self.state
    }

    /// Steps 1–3 for a whole batch `(B, T, hidden)`: projection, causal convolution that
    /// stops at run starts, SiLU, split, softplus.
    fn mix(&self, u: &Tensor, starts: &[usize]) -> Result<Mixed> {
        let (di, ch) = (self.d_inner(), self.conv_channels());
        let zxbcdt = linear(u, &self.in_proj)?;
        let z = zxbcdt.narrow(2, 0, di)?;
        let xbc = zxbcdt.narrow(2, di, ch)?;
        let dt = zxbcdt.narrow(2, di + ch, self.heads)?;

        let xbc = kernels::causal_conv_silu(&xbc, &self.conv_weight, &self.conv_bias, starts)?;
        self.split(&z, &xbc, &dt)
    }

    /// Split the convolved `[x, B, C]` into heads and groups; `Δ = softplus(dt + dt_bias)`.
    fn split(&self, z: &Tensor, xbc: &Tensor, dt: &Tensor) -> Result<Mixed> {
        let lead: Vec<usize> = z.dims()[..z.rank() - 1].to_vec();
        let shaped = |t: Tensor, a: usize, b: usize| -> Result<Tensor> {
            let mut dims = lead.clone();
            dims.extend([a, b]);
            t.reshape(dims)
        };
        let (di, gn) = (self.d_inner(), self.groups * self.state);
        let last = xbc.rank() - 1;
        Ok(Mixed {
            z: z.clone(),
            x: shaped(xbc.narrow(last, 0, di)?, self.heads, self.head_dim)?,
            b: shaped(xbc.narrow(last, di, gn)?, self.groups, self.state)?,
            c: shaped(xbc.narrow(last, di + gn, gn)?, self.groups, self.state)?,
            dt: softplus(&dt.broadcast_add(&self.dt_bias)?)?,
        })
    }

    /// `A = −exp(A_log)`, `(H)`.
    fn a(&self) -> Result<Tensor> {
        self.a_log.exp()?.neg()
    }

    /// Steps 5–6: `y (…, H, P)` plus the `D·x` skip, gated RMSNorm per group, `out_proj`.
    fn finish(&self, y: &Tensor, m: &Mixed) -> Result<Tensor> {
        let y = y.add(&m.x.broadcast_mul(&self.d.unsqueeze(1)?)?)?;
        let lead = &y.dims()[..y.rank() - 2];
        let flat: Vec<usize> = lead.iter().copied().chain([self.d_inner()]).collect();
        let y = y.reshape(flat)?;
        let v = kernels::gated_rms_norm(&y, &m.z, &self.norm, self.groups, self.norm_eps)?;
        linear(&v, &self.out_proj)
    }

    /// x: (B, T, hidden) f32 (already RMS-normed by the surrounding block; no residual added).
    /// `segments`: B·T subsequence ids, row-major (empty: one sequence per row); the conv window
    /// and the SSM state never cross a change of id within a row. Chunked SSD form,
    /// differentiable.
    pub fn forward(&self, x: &Tensor, segments: &[u32]) -> Result<Tensor> {
        let (batch, len, hidden) = x.dims3()?;
        if len == 0 {
            return Tensor::zeros((batch, 0, hidden), DType::F32, x.device());
        }
        let starts = run_starts(segments, batch, len)?;
        let m = self.mix(x, &starts)?;
        let y = ssd_chunked(&m.x, &m.dt, &self.a()?, &m.b, &m.c, &starts, self.chunk)?;
        self.finish(&y, &m)
    }

    /// The plain sequential recurrence of step 4 above (the reference; slow, differentiable).
    pub fn forward_sequential(&self, x: &Tensor, segments: &[u32]) -> Result<Tensor> {
        let (batch, len, hidden) = x.dims3()?;
        if len == 0 {
            return Tensor::zeros((batch, 0, hidden), DType::F32, x.device());
        }
        let starts = run_starts(segments, batch, len)?;
        let m = self.mix(x, &starts)?;
        let y = ssd_sequential(&m.x, &m.dt, &self.a()?, &m.b, &m.c, &starts)?;
        self.finish(&y, &m)
    }

    /// An empty decode state for `batch` sequences: a zero conv window and a zero SSM state.
    pub fn cache(&self, batch: usize) -> Result<Mamba2Cache> {
        let dev = self.in_proj.device();
        Ok(Mamba2Cache {
            conv: Tensor::zeros((batch, self.conv, self.conv_channels()), DType::F32, dev)?,
            ssm: Tensor::zeros(
                (batch, self.heads, self.head_dim, self.state),
                DType::F32,
                dev,
            )?,
        })
    }

    /// One token for each of B sequences: `x_t (B, hidden) → (B, hidden)`, updating the cache.
    pub fn step(&self, x_t: &Tensor, cache: &mut Mamba2Cache) -> Result<Tensor> {
        let (di, ch, k) = (self.d_inner(), self.conv_channels(), self.conv);
        let zxbcdt = linear(x_t, &self.in_proj)?;
        let z = zxbcdt.narrow(1, 0, di)?;
        let xbc = zxbcdt.narrow(1, di, ch)?;
        let dt = zxbcdt.narrow(1, di + ch, self.heads)?;

        // Roll the window left, newest last; the convolution is a weighted sum over it.
        let window = if k == 1 {
            xbc.unsqueeze(1)?
        } else {
            Tensor::cat(&[&cache.conv.narrow(1, 1, k - 1)?, &xbc.unsqueeze(1)?], 1)?
        };
        let conv = window
            .broadcast_mul(&self.conv_weight.t()?.unsqueeze(0)?)?
            .sum(1)?
            .broadcast_add(&self.conv_bias)?;
        let m = self.split(&z, &conv.silu()?, &dt)?;

        // S = exp(Δ·A)·S + Δ·x ⊗ B;  y = S·C.
        let b = m.b.unsqueeze(1)?;
        let c = m.c.unsqueeze(1)?;
        let b = groups_to_heads(&b, self.heads)?.squeeze(1)?; // (B,H,N)
        let c = groups_to_heads(&c, self.heads)?.squeeze(1)?;
        let decay = m.dt.broadcast_mul(&self.a()?)?.exp()?; // (B,H)
        let input =
            m.x.broadcast_mul(&m.dt.unsqueeze(2)?)?
                .unsqueeze(3)?
                .broadcast_mul(&b.unsqueeze(2)?)?;
        let ssm = cache
            .ssm
            .broadcast_mul(&decay.unsqueeze(2)?.unsqueeze(3)?)?
            .add(&input)?;
        let y = bmm(&ssm, &c.unsqueeze(3)?)?.squeeze(3)?;
        cache.conv = window.detach();
        cache.ssm = ssm.detach();
        self.finish(&y, &m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{ParamStore, Rng, to_f32_vec};
    use std::time::Instant;

    fn config(
        heads: usize,
        head_dim: usize,
        state: usize,
        groups: usize,
        conv: usize,
        chunk: usize,
    ) -> MambaConfig {
        MambaConfig {
            heads,
            head_dim,
            state,
            groups,
            conv,
            chunk,
        }
    }

    fn build(hidden: usize, cfg: &MambaConfig, seed: u64) -> (Mamba2, ParamStore) {
        let mut rng = Rng::new(seed);
        let mut store = ParamStore::default();
        let m = Mamba2::new(
            &mut Init::new(&mut rng, &mut store),
            hidden,
            cfg,
            1e-5,
            0.5,
            0.5,
        )
        .unwrap();
        (m, store)
    }

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = Rng::new(seed);
        let n = shape.iter().product();
        constant_f32((0..n).map(|_| rng.normal() as f32).collect(), shape).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        assert_eq!(a.dims(), b.dims());
        let (a, b) = (to_f32_vec(a).unwrap(), to_f32_vec(b).unwrap());
        a.iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn values(store: &ParamStore, name: &str) -> Vec<f64> {
        to_f32_vec(store.get(name).unwrap().as_tensor())
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    }

    #[test]
    fn parameters_are_named_in_order_and_initialised_as_the_reference_says() {
        let cfg = config(4, 3, 5, 2, 4, 8);
        let (_, store) = build(8, &cfg, 1);
        let names: Vec<&str> = store.iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "in_proj",
                "conv_weight",
                "conv_bias",
                "dt_bias",
                "a_log",
                "d",
                "norm",
                "out_proj"
            ]
        );
        let shape = |n: &str| store.get(n).unwrap().dims().to_vec();
        assert_eq!(shape("in_proj"), [2 * 12 + 2 * 2 * 5 + 4, 8]);
        assert_eq!(shape("conv_weight"), [12 + 20, 4]);
        assert_eq!(shape("out_proj"), [8, 12]);
        for a in values(&store, "a_log") {
            assert!(
                (0.0..=16f64.ln()).contains(&a),
                "A = exp({a}) outside [1, 16]"
            );
        }
        for b in values(&store, "dt_bias") {
            let dt = b.exp().ln_1p(); // softplus(dt_bias) = the initial Δ
            assert!((0.999e-3..=1.001e-1).contains(&dt), "initial Δ {dt}");
        }
        assert!(
            values(&store, "d")
                .iter()
                .chain(&values(&store, "norm"))
                .all(|v| *v == 1.0)
        );
        assert!(values(&store, "conv_weight").iter().all(|w| w.abs() <= 0.5));
        let (_, again) = build(8, &cfg, 1);
        assert_eq!(
            values(&store, "in_proj"),
            values(&again, "in_proj"),
            "same seed, same model"
        );
    }

    /// The scan alone, on numbers small enough to follow by hand:
    /// A = −ln 2 (so exp(Δ·A) = 2^−Δ), B = 1, C = 2, x = 1..5, Δ = [1, 1, 2, 1, 1],
    /// and a new subsequence starting at t = 3.
    #[test]
    fn the_recurrence_gives_hand_computed_numbers() {
        let x = constant_f32(vec![1., 2., 3., 4., 5.], &[1, 5, 1, 1]).unwrap();
        let dt = constant_f32(vec![1., 1., 2., 1., 1.], &[1, 5, 1]).unwrap();
        let a = constant_f32(vec![-std::f32::consts::LN_2], &[1]).unwrap();
        let b = constant_f32(vec![1.; 5], &[1, 5, 1, 1]).unwrap();
        let c = constant_f32(vec![2.; 5], &[1, 5, 1, 1]).unwrap();
        let starts = run_starts(&[7, 7, 7, 9, 9], 1, 5).unwrap();
        assert_eq!(starts, [0, 0, 0, 3, 3]);
        // S1 = 1;  S2 = ½·1 + 2 = 2.5;  S3 = ¼·2.5 + 2·3 = 6.625;  reset: S4 = 4;  S5 = ½·4 + 5 = 7.
        let want = [2.0, 5.0, 13.25, 8.0, 14.0];
        let seq = to_f32_vec(&ssd_sequential(&x, &dt, &a, &b, &c, &starts).unwrap()).unwrap();
        for chunk in [1, 2, 3, 5, 8] {
            let got =
                to_f32_vec(&ssd_chunked(&x, &dt, &a, &b, &c, &starts, chunk).unwrap()).unwrap();
            for i in 0..5 {
                assert!(
                    (got[i] - want[i]).abs() < 1e-5,
                    "chunk {chunk}: {got:?} vs {want:?}"
                );
            }
        }
        for i in 0..5 {
            assert!((seq[i] - want[i]).abs() < 1e-5, "{seq:?} vs {want:?}");
        }
    }

    /// The whole mixer against a scalar f64 transcription of steps 1–6 of the module doc.
    #[test]
    fn the_mixer_matches_a_scalar_transcription_of_the_reference() {
        let (hid, h, p, n, g, k) = (3, 4, 2, 2, 2, 2);
        let cfg = config(h, p, n, g, k, 2);
        let (m, store) = build(hid, &cfg, 5);
        let len = 5;
        let u = randn(&[1, len, hid], 6);
        let got = to_f32_vec(&m.forward(&u, &[]).unwrap()).unwrap();

        let uv: Vec<f64> = to_f32_vec(&u).unwrap().into_iter().map(f64::from).collect();
        let (w_in, cw, cb) = (
            values(&store, "in_proj"),
            values(&store, "conv_weight"),
            values(&store, "conv_bias"),
        );
        let (dtb, alog, dd) = (
            values(&store, "dt_bias"),
            values(&store, "a_log"),
            values(&store, "d"),
        );
        let (nw, w_out) = (values(&store, "norm"), values(&store, "out_proj"));
        let (di, ch) = (h * p, h * p + 2 * g * n);
        let width = 2 * di + 2 * g * n + h;
        let silu = |v: f64| v / (1.0 + (-v).exp());
        let proj: Vec<Vec<f64>> = (0..len)
            .map(|t| {
                (0..width)
                    .map(|o| (0..hid).map(|i| w_in[o * hid + i] * uv[t * hid + i]).sum())
                    .collect()
            })
            .collect();
        let mut state = vec![0.0; h * p * n];
        for t in 0..len {
            // Causal conv: tap K−1 is the current token.
            let xbc: Vec<f64> = (0..ch)
                .map(|c| {
                    let mut acc = cb[c];
                    for j in 0..k {
                        let back = k - 1 - j;
                        if t >= back {
                            acc += cw[c * k + j] * proj[t - back][di + c];
                        }
                    }
                    silu(acc)
                })
                .collect();
            let mut y = vec![0.0; di];
            for head in 0..h {
                let grp = head / (h / g);
                let delta = (proj[t][di + ch + head] + dtb[head]).exp().ln_1p();
                let decay = (-delta * alog[head].exp()).exp();
                for pi in 0..p {
                    let xv = xbc[head * p + pi];
                    for ni in 0..n {
                        let bv = xbc[di + grp * n + ni];
                        let s = &mut state[(head * p + pi) * n + ni];
                        *s = decay * *s + delta * xv * bv;
                        y[head * p + pi] += *s * xbc[di + g * n + grp * n + ni];
                    }
                    y[head * p + pi] += dd[head] * xv;
                }
            }
            let v: Vec<f64> = (0..di).map(|i| y[i] * silu(proj[t][i])).collect();
            let gs = di / g;
            let normed: Vec<f64> = (0..di)
                .map(|i| {
                    let grp = &v[(i / gs) * gs..(i / gs + 1) * gs];
                    let ms = grp.iter().map(|a| a * a).sum::<f64>() / gs as f64;
                    v[i] / (ms + 1e-5).sqrt() * nw[i]
                })
                .collect();
            for o in 0..hid {
                let want: f64 = (0..di).map(|i| w_out[o * di + i] * normed[i]).sum();
                let diff = (got[t * hid + o] as f64 - want).abs();
                assert!(diff < 1e-4, "t {t} out {o}: {} vs {want}", got[t * hid + o]);
            }
        }
    }

    #[test]
    fn chunked_form_equals_the_sequential_recurrence() {
        let cfg = config(4, 3, 5, 2, 4, 4);
        let (m, _) = build(8, &cfg, 11);
        let (b, t) = (2, 13); // 13 is not a multiple of the chunk (4)
        let x = randn(&[b, t, 8], 12);
        let mut segments = vec![0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3];
        segments.extend([5, 5, 5, 5, 5, 5, 5, 5, 6, 6, 6, 6, 6]); // a boundary on a chunk edge
        let started = Instant::now();
        let mut worst = 0f32;
        for segs in [&[][..], &segments[..]] {
            let chunked = m.forward(&x, segs).unwrap();
            let seq = m.forward_sequential(&x, segs).unwrap();
            assert_eq!(chunked.dims(), [b, t, 8]);
            let diff = max_diff(&chunked, &seq);
            worst = worst.max(diff);
            assert!(diff < 1e-4, "max |chunked − sequential| = {diff}");
            assert!(to_f32_vec(&seq).unwrap().iter().any(|v| v.abs() > 1e-2));
        }
        // Other chunk lengths, including one longer than the sequence.
        for chunk in [1, 3, 64] {
            let cfg = config(4, 3, 5, 2, 4, chunk);
            let (m, _) = build(8, &cfg, 11);
            let diff = max_diff(
                &m.forward(&x, &segments).unwrap(),
                &m.forward_sequential(&x, &segments).unwrap(),
            );
            worst = worst.max(diff);
            assert!(diff < 1e-4, "chunk {chunk}: {diff}");
        }
        eprintln!(
            "max |chunked − sequential| = {worst:e} ({:?})",
            started.elapsed()
        );
    }

    /// Large steps (Δ ≈ 5, A up to 16) make `cs_t − cs_s` far beyond f32's exp range in the
    /// masked (anti-causal) half of each chunk: it must stay masked, not become inf·0 = NaN.
    #[test]
    fn large_steps_stay_finite_and_exact() {
        let cfg = config(4, 3, 5, 2, 4, 16);
        let (m, store) = build(8, &cfg, 13);
        let big = constant_f32(vec![5.0; 4], &[4]).unwrap();
        store.get("dt_bias").unwrap().set(&big).unwrap();
        let x = randn(&[2, 37, 8], 14);
        let segments: Vec<u32> = (0..74).map(|i| ((i % 37) / 10) as u32).collect();
        let chunked = m.forward(&x, &segments).unwrap();
        assert!(to_f32_vec(&chunked).unwrap().iter().all(|v| v.is_finite()));
        let diff = max_diff(&chunked, &m.forward_sequential(&x, &segments).unwrap());
        assert!(diff < 1e-4, "{diff}");
        let loss = chunked.sqr().unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in store.iter() {
            let g = to_f32_vec(grads.get(var.as_tensor()).unwrap()).unwrap();
            assert!(
                g.iter().all(|v| v.is_finite()),
                "{name}: non-finite gradient"
            );
        }
    }

    #[test]
    fn packed_subsequences_do_not_see_each_other() {
        let cfg = config(4, 2, 3, 2, 4, 4);
        let (m, _) = build(6, &cfg, 21);
        let t = 11;
        let x = randn(&[2, t, 6], 22);
        let rows: [Vec<u32>; 2] = [
            vec![0, 0, 0, 1, 1, 2, 2, 2, 2, 2, 2],
            vec![4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0],
        ];
        let segments: Vec<u32> = rows.concat();
        let packed = m.forward(&x, &segments).unwrap();
        for (row, segs) in rows.iter().enumerate() {
            let mut s = 0;
            while s < t {
                let e = (s..t).find(|&i| segs[i] != segs[s]).unwrap_or(t);
                let alone = m
                    .forward(
                        &x.narrow(0, row, 1).unwrap().narrow(1, s, e - s).unwrap(),
                        &[],
                    )
                    .unwrap();
                let part = packed
                    .narrow(0, row, 1)
                    .unwrap()
                    .narrow(1, s, e - s)
                    .unwrap();
                let diff = max_diff(&alone, &part);
                assert!(diff < 1e-5, "row {row} tokens {s}..{e}: {diff}");
                s = e;
            }
        }
        // And packing does change the output (the test would pass vacuously otherwise).
        assert!(max_diff(&packed, &m.forward(&x, &[]).unwrap()) > 1e-3);
    }

    #[test]
    fn decoding_token_by_token_equals_the_full_forward() {
        let cfg = config(4, 3, 5, 2, 4, 4);
        let (m, _) = build(8, &cfg, 31);
        let (b, t) = (2, 9);
        let x = randn(&[b, t, 8], 32);
        let full = m.forward(&x, &[]).unwrap();
        let mut cache = m.cache(b).unwrap();
        let mut worst = 0f32;
        for i in 0..t {
            let y = m
                .step(&x.narrow(1, i, 1).unwrap().squeeze(1).unwrap(), &mut cache)
                .unwrap();
            let diff = max_diff(&y, &full.narrow(1, i, 1).unwrap().squeeze(1).unwrap());
            worst = worst.max(diff);
            assert!(diff < 1e-4, "token {i}: {diff}");
        }
        assert_eq!(cache.ssm.dims(), [b, 4, 3, 5]);
        assert_eq!(cache.conv.dims(), [b, 4, 12 + 20]);
        eprintln!("max |step − forward| = {worst:e}");
    }

    #[test]
    fn every_parameter_gets_a_gradient() {
        let cfg = config(4, 3, 5, 2, 4, 4);
        let (m, store) = build(8, &cfg, 41);
        let x = randn(&[2, 10, 8], 42);
        let segments: Vec<u32> = (0..20).map(|i| (i % 10 >= 6) as u32).collect();
        let loss = m
            .forward(&x, &segments)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        for (name, var) in store.iter() {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            assert_eq!(g.dims(), var.dims(), "{name}");
            let norm = to_f32_vec(g).unwrap().iter().map(|v| v.abs()).sum::<f32>();
            assert!(
                norm > 0.0 && norm.is_finite(),
                "{name}: gradient |·|₁ = {norm}"
            );
        }
    }

    #[test]
    fn chunked_and_sequential_gradients_agree() {
        let cfg = config(2, 2, 3, 1, 4, 3);
        let (m, store) = build(4, &cfg, 51);
        let x = randn(&[1, 7, 4], 52);
        let g1 = m
            .forward(&x, &[])
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let g2 = m
            .forward_sequential(&x, &[])
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        for (name, var) in store.iter() {
            let (a, b) = (
                g1.get(var.as_tensor()).unwrap(),
                g2.get(var.as_tensor()).unwrap(),
            );
            let diff = max_diff(a, b);
            assert!(diff < 1e-3, "{name}: {diff}");
        }
    }
}
