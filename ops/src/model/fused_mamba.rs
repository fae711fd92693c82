//! Fused CPU ops for the Mamba-2 mixer ([`super::mamba2`]), each one graph node with its own
//! backward and each tested against the plain composition of candle ops it replaces (kept in
//! `mamba2.rs` as the reference, and used off the CPU).
//!
//! - [`causal_conv_silu`] (step 2 of the mixer): the depthwise causal convolution of width `K`
//!   over `[x, B, C]`, with bias, each tap cut where it would reach before the token's run,
//!   then SiLU: `y_t = silu(bias + Σ_j w_j ⊙ x_{t−(K−1−j)})`. Written out of candle ops it is
//!   five nodes per tap (shift, pad, two broadcast products, a sum), and every broadcast
//!   product's backward is a reduction over all tokens. Backward:
//!   `dpre = dy ⊙ silu'(pre)`, `dx_s = Σ_j dpre_{s+K−1−j} ⊙ w_j` (over the taps that reached
//!   `s`; computed by scattering each token's `dpre` back along its taps),
//!   `dw_j = Σ_t dpre_t ⊙ x_{t−(K−1−j)}`, `dbias = Σ_t dpre_t`.
//! - [`gated_rms_norm`] (step 5): `v = y ⊙ silu(z)`, RMS-normalised within each of `G`
//!   contiguous groups, times the weight; backward as [`crate::simd::gated_norm_grad`] says.
//!
//! Both run on the calling thread (training runs each micro-batch on a worker of its own), and
//! every sum over tokens runs in token order: the bytes never depend on the thread count.

use super::fused::{slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};

struct CausalConvSilu {
    /// For every token (row-major over `(batch, len)`), the index inside its row of the first
    /// token of its run: a tap reaching before it reads zero.
    starts: Vec<usize>,
    len: usize,
}

impl CausalConvSilu {
    /// `(tokens, channels, width)` from the shapes, checked against each other.
    fn dims(&self, x: &Shape, w: &Shape, b: &Shape) -> Result<(usize, usize, usize)> {
        let (batch, len, ch) = x.dims3()?;
        let (wc, k) = w.dims2()?;
        if wc != ch || b.dims() != [ch] || ch == 0 || k == 0 {
            bail!("causal-conv: input {x:?}, weight {w:?}, bias {b:?}")
        }
        if len != self.len || self.starts.len() != batch * len {
            bail!(
                "causal-conv: {} run starts for {batch} rows of {len} tokens",
                self.starts.len()
            )
        }
        Ok((batch * len, ch, k))
    }

    /// The taps that reach token `i` (row-major) from token `i − shift`: `(tap j, shift)`.
    fn taps(&self, i: usize, k: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let t = i % self.len;
        let start = self.starts[i];
        (0..k)
            .map(move |j| (j, k - 1 - j))
            .filter(move |&(_, shift)| t >= shift && t - shift >= start)
    }

    /// The convolution before SiLU for every token: `pre_t = bias + Σ_j w_j ⊙ x_{t−shift_j}`,
    /// taps in order `j = 0..K` (`wt` is the weight transposed to `(K, channels)`).
    fn pre(
        &self,
        x: &[f32],
        wt: &[f32],
        bias: &[f32],
        (tokens, ch, k): (usize, usize, usize),
    ) -> Vec<f32> {
        let mut pre = vec![0f32; tokens * ch];
        for (i, row) in pre.chunks_mut(ch).enumerate() {
            row.copy_from_slice(bias);
            for (j, shift) in self.taps(i, k) {
                let src = &x[(i - shift) * ch..(i - shift + 1) * ch];
                simd::mul_add_assign(row, src, &wt[j * ch..(j + 1) * ch]);
            }
        }
        pre
    }
}

/// `(C, K)` → `(K, C)`, so that each tap's weights are contiguous across channels.
fn transpose(w: &[f32], ch: usize, k: usize) -> Vec<f32> {
    let mut wt = vec![0f32; ch * k];
    for c in 0..ch {
        for j in 0..k {
            wt[j * ch + c] = w[c * k + j];
        }
    }
    wt
}

impl CustomOp3 for CausalConvSilu {
    fn name(&self) -> &'static str {
        "causal-conv-silu"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let dims = self.dims(l1.shape(), l2.shape(), l3.shape())?;
        let (x, w, bias) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let wt = transpose(w, dims.1, dims.2);
        let mut y = self.pre(x, &wt, bias, dims);
        simd::silu_in_place(&mut y);
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (tokens, ch, k) = self.dims(x.shape(), w.shape(), bias.shape())?;
        let (wv, bv) = (w.flatten_all()?.to_vec1::<f32>()?, bias.to_vec1::<f32>()?);
        let wt = transpose(&wv, ch, k);
        let mut dx = vec![0f32; tokens * ch];
        let mut dwt = vec![0f32; k * ch];
        let mut dbias = vec![0f32; ch];
        with_values(x, |xv| {
            with_values(grad, |gv| {
                let pre = self.pre(xv, &wt, &bv, (tokens, ch, k));
                let mut dpre = vec![0f32; tokens * ch];
                simd::silu_grad(&pre, gv, &mut dpre);
                for i in 0..tokens {
                    let d = &dpre[i * ch..(i + 1) * ch];
                    simd::add_assign(&mut dbias, d);
                    for (j, shift) in self.taps(i, k) {
                        let src = i - shift;
                        let dw = &mut dwt[j * ch..(j + 1) * ch];
                        simd::mul_add_assign(dw, d, &xv[src * ch..(src + 1) * ch]);
                        let dxs = &mut dx[src * ch..(src + 1) * ch];
                        simd::mul_add_assign(dxs, d, &wt[j * ch..(j + 1) * ch]);
                    }
                }
            })
        })??;
        let dw = transpose(&dwt, k, ch); // (K, C) → (C, K)
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), x.device())?),
            Some(Tensor::from_vec(dw, w.shape(), w.device())?),
            Some(Tensor::from_vec(dbias, bias.shape(), bias.device())?),
        ))
    }
}

/// Mamba-2's depthwise causal convolution and SiLU as one node: `x (B, T, C)`, `weight (C, K)`
/// (tap `K−1` multiplies the current token), `bias (C)`; `starts[b·T + t]` is the first token
/// of token `t`'s run in row `b` (taps reaching before it read zero). Must match the plain
/// composition in `Mamba2::conv_plain`.
pub fn causal_conv_silu(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    starts: &[usize],
) -> Result<Tensor> {
    let len = x.dim(1)?;
    x.contiguous()?.apply_op3(
        &weight.contiguous()?,
        &bias.contiguous()?,
        CausalConvSilu {
            starts: starts.to_vec(),
            len,
        },
    )
}

struct GatedRmsNorm {
    groups: usize,
    eps: f32,
}

impl GatedRmsNorm {
    /// `(rows, channels)` from `y`, `z` (same shape) and the weight `(channels)`.
    fn dims(&self, y: &Shape, z: &Shape, w: &Shape) -> Result<(usize, usize)> {
        let d = w.elem_count();
        if y != z
            || y.dims().last() != Some(&d)
            || d == 0
            || self.groups == 0
            || !d.is_multiple_of(self.groups)
        {
            bail!(
                "gated-rms-norm: y {y:?}, z {z:?}, weight {w:?}, {} groups",
                self.groups
            )
        }
        Ok((y.elem_count() / d, d))
    }
}

impl CustomOp3 for GatedRmsNorm {
    fn name(&self) -> &'static str {
        "gated-rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, d) = self.dims(l1.shape(), l2.shape(), l3.shape())?;
        let (y, z, w) = (slice(s1, l1)?, slice(s2, l2)?, slice(s3, l3)?);
        let mut out = vec![0f32; rows * d];
        let mut v = vec![0f32; d];
        for (r, o) in out.chunks_mut(d).enumerate() {
            let at = r * d..(r + 1) * d;
            simd::gated_norm(
                &y[at.clone()],
                &z[at],
                w,
                (self.groups, self.eps),
                &mut v,
                o,
            );
        }
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        y: &Tensor,
        z: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (rows, d) = self.dims(y.shape(), z.shape(), w.shape())?;
        let wv = w.flatten_all()?.to_vec1::<f32>()?;
        let (mut dy, mut dz, mut dw) = (vec![0f32; rows * d], vec![0f32; rows * d], vec![0f32; d]);
        let (mut v, mut gw) = (vec![0f32; d], vec![0f32; d]);
        with_values(y, |yv| {
            with_values(z, |zv| {
                with_values(grad, |gv| {
                    for r in 0..rows {
                        let at = r * d..(r + 1) * d;
                        simd::gated_norm_grad(
                            (&yv[at.clone()], &zv[at.clone()], &wv, &gv[at.clone()]),
                            (self.groups, self.eps),
                            &mut v,
                            &mut gw,
                            &mut dy[at.clone()],
                            &mut dz[at],
                            &mut dw,
                        );
                    }
                })
            })
        })???;
        Ok((
            Some(Tensor::from_vec(dy, y.shape(), y.device())?),
            Some(Tensor::from_vec(dz, z.shape(), z.device())?),
            Some(Tensor::from_vec(dw, w.shape(), w.device())?),
        ))
    }
}

/// Mamba-2's gated RMSNorm as one node: `y`, `z` `(…, D)`, `weight (D)`; per row
/// `v = y ⊙ silu(z)` normalised by `1/sqrt(mean(v²) + eps)` within each of `groups` contiguous
/// groups of `D/groups` channels, times `weight`. Must match `Mamba2::gated_norm_plain`.
pub fn gated_rms_norm(
    y: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    y.contiguous()?.apply_op3(
        &z.contiguous()?,
        &weight.contiguous()?,
        GatedRmsNorm {
            groups,
            eps: eps as f32,
        },
    )
}
