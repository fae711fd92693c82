//! Fused CPU kernels for the two hottest element-wise paths of training, each with its backward
//! and each tested against the plain composition of candle ops it replaces
//! ([`super::layers::softmax`], [`super::layers::token_losses`]).
//!
//! Written out of candle primitives, `softmax(scale·s + mask)` over the `(B, H, T, T)` attention
//! scores costs seven passes forward and more backward, each allocating a tensor; the
//! cross-entropy over the vocabulary likewise. Here each is one pass per row forward and one
//! backward (rows in parallel with rayon; every row is computed the same way whatever the
//! thread count, so results are deterministic).
//!
//! - [`masked_softmax`]: `p = softmax(scale·s + mask)` row-wise; backward
//!   `ds = scale · p ⊙ (g − Σ_j g_j p_j)`.
//! - [`cross_entropy`]: per row `lse(x) − x[label]`; backward `dx = g · (softmax(x) − onehot)`.
//! - [`rope`]: `y = x·cos + R(x)·sin` with `R([a, b]) = [−b, a]`; backward
//!   `dx = g·cos + Rᵀ(g·sin)` with `Rᵀ([a, b]) = [b, −a]`.
//! - [`rms_norm`]: per row `y = x · r · w` with `r = 1/sqrt(mean(x²) + eps)`; backward
//!   `dw = Σ_rows g ⊙ x · r` and `dx = r · (g ⊙ w) − x · r³/D · Σ_j g_j w_j x_j`.
//! - [`swiglu`]: `y = silu(g) ⊙ u` on the stacked `[g, u]`; backward
//!   `dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`, `du = dy ⊙ silu(g)`.
//! - [`linear`]: `y = x · wᵀ` over all leading dimensions as one graph node (candle's GEMM);
//!   backward `dx = g · w`, `dw = gᵀ · x`.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, D, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;
use std::sync::Arc;

fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    let Some((start, end)) = l.contiguous_offsets() else {
        bail!("fused op: input is not contiguous")
    };
    Ok(&s.as_slice::<f32>()?[start..end])
}

/// Rows are processed in parallel only when there is enough work to pay for it.
const PAR_MIN: usize = 1 << 15;

/// `f(index, row)` over `out` cut in rows of `width`, in parallel when `out` is large.
fn for_rows(out: &mut [f32], width: usize, f: impl Fn((usize, &mut [f32])) + Send + Sync) {
    if out.len() >= PAR_MIN {
        out.par_chunks_mut(width).enumerate().for_each(f);
    } else {
        out.chunks_mut(width).enumerate().for_each(f);
    }
}

struct MaskedSoftmax {
    scale: f32,
}

impl CustomOp2 for MaskedSoftmax {
    fn name(&self) -> &'static str {
        "masked-softmax"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, t2) = l1.shape().dims4()?;
        if l2.shape().dims4()? != (b, 1, t, t2) {
            bail!(
                "masked-softmax: mask shape {:?} for scores {:?}",
                l2.shape(),
                l1.shape()
            )
        }
        let (s, m) = (slice(s1, l1)?, slice(s2, l2)?);
        let mut out = vec![0f32; s.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let (bi, i) = (r / (h * t), r % t);
            let x = &s[r * t2..(r + 1) * t2];
            let mask = &m[(bi * t + i) * t2..(bi * t + i + 1) * t2];
            let mut max = f32::NEG_INFINITY;
            for j in 0..t2 {
                y[j] = self.scale * x[j] + mask[j];
                max = max.max(y[j]);
            }
            // Masked entries (−∞, half of a causal row) are exactly 0 after exp: skip the call.
            let mut sum = 0f32;
            for v in y.iter_mut() {
                if *v == f32::NEG_INFINITY {
                    *v = 0.0;
                } else {
                    *v = (*v - max).exp();
                    sum += *v;
                }
            }
            let inv = 1.0 / sum;
            for v in y.iter_mut() {
                *v *= inv;
            }
        };
        for_rows(&mut out, t2, row);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        _scores: &Tensor,
        _mask: &Tensor,
        p: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let t2 = p.dim(D::Minus1)?;
        let pv = p.flatten_all()?.to_vec1::<f32>()?;
        let gv = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; pv.len()];
        let scale = self.scale;
        let row = |(r, d): (usize, &mut [f32])| {
            let (p, g) = (&pv[r * t2..(r + 1) * t2], &gv[r * t2..(r + 1) * t2]);
            let dot: f32 = p.iter().zip(g).map(|(a, b)| a * b).sum();
            for j in 0..t2 {
                d[j] = scale * p[j] * (g[j] - dot);
            }
        };
        for_rows(&mut out, t2, row);
        Ok((Some(Tensor::from_vec(out, p.shape(), p.device())?), None))
    }
}

/// `softmax(scale·scores + mask)` over the last dimension; `scores` is `(B, H, T, T)`, `mask`
/// `(B, 1, T, T)` (additive, 0 or −∞, not differentiated).
pub fn masked_softmax(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    scores.contiguous()?.apply_op2(
        &mask.contiguous()?,
        MaskedSoftmax {
            scale: scale as f32,
        },
    )
}

struct CrossEntropy;

/// Log-sum-exp of a row, max-shifted.
fn lse(x: &[f32]) -> f32 {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + x.iter().map(|v| (v - max).exp()).sum::<f32>().ln()
}

impl CustomOp2 for CrossEntropy {
    fn name(&self) -> &'static str {
        "cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, v) = l1.shape().dims2()?;
        let x = slice(s1, l1)?;
        let Some((start, end)) = l2.contiguous_offsets() else {
            bail!("cross-entropy: labels are not contiguous")
        };
        let labels = &s2.as_slice::<u32>()?[start..end];
        if labels.len() != n {
            bail!("cross-entropy: {} labels for {n} rows", labels.len())
        }
        if let Some(l) = labels.iter().find(|l| **l as usize >= v) {
            bail!("cross-entropy: label {l} outside the vocabulary of {v}")
        }
        let loss = |r: usize| {
            let row = &x[r * v..(r + 1) * v];
            lse(row) - row[labels[r] as usize]
        };
        let out: Vec<f32> = if x.len() >= PAR_MIN {
            (0..n).into_par_iter().map(loss).collect()
        } else {
            (0..n).map(loss).collect()
        };
        Ok((CpuStorage::F32(out), Shape::from(n)))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        labels: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, v) = logits.dims2()?;
        let x = logits.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let labels = labels.to_vec1::<u32>()?;
        let g = grad.to_vec1::<f32>()?;
        let mut out = vec![0f32; n * v];
        let row = |(r, d): (usize, &mut [f32])| {
            let xs = &x[r * v..(r + 1) * v];
            let l = lse(xs);
            for j in 0..v {
                d[j] = g[r] * (xs[j] - l).exp();
            }
            d[labels[r] as usize] -= g[r];
        };
        for_rows(&mut out, v, row);
        Ok((Some(Tensor::from_vec(out, (n, v), logits.device())?), None))
    }
}

/// Per-row cross-entropy `−log softmax(logits)[label]`: `logits` `(N, V)`, `labels` `(N,)` u32.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    logits
        .contiguous()?
        .apply_op2(&labels.contiguous()?, CrossEntropy)
}

/// Rotary tables for one forward pass: `cos` and `sin` per (row, position, dim), row-major
/// `(batch, len, head_dim)`, shared by every attention block.
#[derive(Clone)]
pub struct RopeTables {
    pub cos: Arc<Vec<f32>>,
    pub sin: Arc<Vec<f32>>,
    pub batch: usize,
    pub len: usize,
    pub dim: usize,
}

struct RopeOp {
    t: RopeTables,
    /// The backward map `g·cos + Rᵀ(g·sin)` instead of the forward one.
    transpose: bool,
}

impl CustomOp1 for RopeOp {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, d) = l.shape().dims4()?;
        let tb = &self.t;
        if (b, t, d) != (tb.batch, tb.len, tb.dim) || d % 2 != 0 {
            bail!(
                "rope: input {:?} for tables of {}x{}x{}",
                l.shape(),
                tb.batch,
                tb.len,
                tb.dim
            )
        }
        let x = slice(s, l)?;
        let half = d / 2;
        let mut out = vec![0f32; x.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let (bi, ti) = (r / (h * t), r % t);
            let at = (bi * t + ti) * d;
            let (cos, sin) = (&tb.cos[at..at + d], &tb.sin[at..at + d]);
            let xs = &x[r * d..(r + 1) * d];
            for j in 0..half {
                if self.transpose {
                    y[j] = xs[j] * cos[j] + xs[j + half] * sin[j + half];
                    y[j + half] = xs[j + half] * cos[j + half] - xs[j] * sin[j];
                } else {
                    y[j] = xs[j] * cos[j] - xs[j + half] * sin[j];
                    y[j + half] = xs[j + half] * cos[j + half] + xs[j] * sin[j + half];
                }
            }
        };
        for_rows(&mut out, d, row);
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let op = RopeOp {
            t: self.t.clone(),
            transpose: !self.transpose,
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&op)?))
    }
}

/// Rotary embedding of `x` `(B, H, T, D)` in the `rotate_half` convention, in one pass.
pub fn rope(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    x.contiguous()?.apply_op1(RopeOp {
        t: tables.clone(),
        transpose: false,
    })
}

struct RmsNorm {
    eps: f32,
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = l1.shape().dims().last().copied().unwrap_or(0);
        let (x, w) = (slice(s1, l1)?, slice(s2, l2)?);
        if w.len() != d || d == 0 {
            bail!("rms-norm: weight of {} for rows of {d}", w.len())
        }
        let mut out = vec![0f32; x.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let xs = &x[r * d..(r + 1) * d];
            let ms = xs.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + self.eps).sqrt();
            for j in 0..d {
                y[j] = xs[j] * inv * w[j];
            }
        };
        for_rows(&mut out, d, row);
        Ok((CpuStorage::F32(out), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let d = w.elem_count();
        let xv = x.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let wv = w.to_vec1::<f32>()?;
        let gv = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let rows = xv.len() / d;
        let mut dx = vec![0f32; xv.len()];
        // dw sums over rows in row order: the same bytes whatever the thread count.
        let mut dw = vec![0f32; d];
        for r in 0..rows {
            let (xs, g) = (&xv[r * d..(r + 1) * d], &gv[r * d..(r + 1) * d]);
            let ms = xs.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let inv = 1.0 / (ms + self.eps).sqrt();
            let dot: f32 = (0..d).map(|j| g[j] * wv[j] * xs[j]).sum();
            let k = inv * inv * inv * dot / d as f32;
            let out = &mut dx[r * d..(r + 1) * d];
            for j in 0..d {
                dw[j] += g[j] * xs[j] * inv;
                out[j] = inv * g[j] * wv[j] - k * xs[j];
            }
        }
        Ok((
            Some(Tensor::from_vec(dx, x.shape(), x.device())?),
            Some(Tensor::from_vec(dw, w.shape(), w.device())?),
        ))
    }
}

/// RMSNorm over the last dimension, `x / sqrt(mean(x²) + eps) * weight`, in one pass.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2(&weight.contiguous()?, RmsNorm { eps: eps as f32 })
}

struct Swiglu;

/// `σ(g) = 1 / (1 + e^−g)`.
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

impl CustomOp1 for Swiglu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let mut dims = l.shape().dims().to_vec();
        let Some(last) = dims.last_mut() else {
            bail!("swiglu: a scalar input")
        };
        if *last % 2 != 0 {
            bail!("swiglu: an odd last dimension {}", *last)
        }
        let f = *last / 2;
        *last = f;
        let h = slice(s, l)?;
        let mut out = vec![0f32; h.len() / 2];
        if f > 0 {
            let row = |(r, y): (usize, &mut [f32])| {
                let (g, u) = h[r * 2 * f..(r + 1) * 2 * f].split_at(f);
                for j in 0..f {
                    y[j] = g[j] * sigmoid(g[j]) * u[j];
                }
            };
            for_rows(&mut out, f, row);
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }

    fn bwd(&self, h: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let w = h.dim(D::Minus1)?;
        let f = w / 2;
        let hv = h.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let gv = grad.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; hv.len()];
        if f > 0 {
            let row = |(r, d): (usize, &mut [f32])| {
                let (g, u) = hv[r * w..(r + 1) * w].split_at(f);
                let dy = &gv[r * f..(r + 1) * f];
                let (dg, du) = d.split_at_mut(f);
                for j in 0..f {
                    let s = sigmoid(g[j]);
                    du[j] = dy[j] * g[j] * s;
                    dg[j] = dy[j] * u[j] * s * (1.0 + g[j] * (1.0 - s));
                }
            };
            for_rows(&mut out, w, row);
        }
        Ok(Some(Tensor::from_vec(out, h.shape(), h.device())?))
    }
}

/// SwiGLU on the stacked `fc1` output `h = [g, u]` (last dimension `2F`, gate half first):
/// `silu(g) ⊙ u` with `silu(g) = g·σ(g)`, in one pass; backward
/// `dg = dy ⊙ u ⊙ σ(g)·(1 + g·(1 − σ(g)))`, `du = dy ⊙ silu(g)`. Must match the plain
/// composition `h.narrow(g).silu() * h.narrow(u)` of [`super::layers::activate_plain`].
pub fn swiglu(h: &Tensor) -> Result<Tensor> {
    h.contiguous()?.apply_op1(Swiglu)
}

struct Linear;

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "linear"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (n, k) = l2.shape().dims2()?;
        let mut dims = l1.shape().dims().to_vec();
        match dims.last_mut() {
            Some(last) if *last == k && k > 0 => *last = n,
            _ => bail!(
                "linear: input {:?} for a weight {:?}",
                l1.shape(),
                l2.shape()
            ),
        }
        if !l1.is_contiguous() {
            bail!("linear: input is not contiguous")
        }
        let m = l1.shape().elem_count() / k;
        // candle's own GEMM on the storages: x (m×k) · wᵀ (the weight's layout transposed).
        let lhs = Layout::contiguous_with_offset((m, k), l1.start_offset());
        let out = s1.matmul(s2, (1, m, n, k), &lhs, &l2.transpose(0, 1)?)?;
        Ok((out, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (n, k) = w.dims2()?;
        let m = x.elem_count() / k;
        let g = grad.reshape((m, n))?;
        let dx = g.matmul(w)?.reshape(x.shape())?;
        let dw = g.t()?.matmul(&x.reshape((m, k))?)?;
        Ok((Some(dx), Some(dw)))
    }
}

/// `x · wᵀ` for `x` `(…, K)` and `w` `(N, K)` as one graph node: forward
/// `x.reshape(rows, K).matmul(wᵀ)` straight on the storages, backward `dx = g · w`,
/// `dw = gᵀ · x` over the rows. Written out of candle ops ([`super::layers::linear_plain`]:
/// reshape, transpose, matmul, reshape) each view is a node whose backward allocates a zero
/// gradient and adds into it; here there is one node. Must match `linear_plain`.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear)
}

#[cfg(test)]
mod tests {
    use super::super::layers::{softmax, token_losses};
    use super::super::params::Rng;
    use super::*;
    use candle_core::{Device, Var};

    fn randn(rng: &mut Rng, shape: &[usize], std: f64) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| (rng.normal() * std) as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// A causal mask with a packed boundary, (b, 1, t, t).
    fn mask(b: usize, t: usize) -> Tensor {
        let mut m = vec![f32::NEG_INFINITY; b * t * t];
        for r in 0..b {
            for i in 0..t {
                for j in 0..=i {
                    if (i < t / 2) == (j < t / 2) {
                        m[(r * t + i) * t + j] = 0.0;
                    }
                }
            }
        }
        Tensor::from_vec(m, (b, 1, t, t), &Device::Cpu).unwrap()
    }

    #[test]
    fn masked_softmax_matches_the_plain_ops_forward_and_backward() {
        // Big enough to take the parallel path too.
        for (b, h, t) in [(2, 3, 7), (2, 4, 96)] {
            let mut rng = Rng::new(t as u64);
            let s = Var::from_tensor(&randn(&mut rng, &[b, h, t, t], 2.0)).unwrap();
            let m = mask(b, t);
            let w = randn(&mut rng, &[b, h, t, t], 1.0);
            let scale = 0.35;
            let fused = masked_softmax(s.as_tensor(), &m, scale).unwrap();
            let plain =
                softmax(&(s.as_tensor() * scale).unwrap().broadcast_add(&m).unwrap()).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-6);
            let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gp = (plain * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let (gf, gp) = (
                gf.get(s.as_tensor()).unwrap(),
                gp.get(s.as_tensor()).unwrap(),
            );
            assert!(max_diff(gf, gp) < 1e-5, "{}", max_diff(gf, gp));
        }
    }

    #[test]
    fn cross_entropy_matches_the_plain_ops_forward_and_backward() {
        for (n, v) in [(5, 11), (300, 257)] {
            let mut rng = Rng::new(n as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[n, v], 3.0)).unwrap();
            let labels: Vec<u32> = (0..n).map(|i| ((i * 7919) % v) as u32).collect();
            let labels = Tensor::from_vec(labels, n, &Device::Cpu).unwrap();
            let w = randn(&mut rng, &[n], 1.0);
            let fused = cross_entropy(x.as_tensor(), &labels).unwrap();
            let plain = token_losses(x.as_tensor(), &labels).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-5);
            let gf = (fused * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let gp = (plain * &w).unwrap().sum_all().unwrap().backward().unwrap();
            let (gf, gp) = (
                gf.get(x.as_tensor()).unwrap(),
                gp.get(x.as_tensor()).unwrap(),
            );
            assert!(max_diff(gf, gp) < 1e-5, "{}", max_diff(gf, gp));
        }
        let x = Tensor::zeros((1, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let bad = Tensor::new(&[3u32], &Device::Cpu).unwrap();
        assert!(
            cross_entropy(&x, &bad).is_err(),
            "a label outside the vocabulary"
        );
    }

    #[test]
    fn rms_norm_matches_the_plain_ops_forward_and_backward() {
        for (rows, d) in [(3, 5), (300, 128)] {
            let mut rng = Rng::new(d as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[rows, d], 2.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[d], 1.0)).unwrap();
            let g = randn(&mut rng, &[rows, d], 1.0);
            let fused = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            let plain =
                super::super::layers::rms_norm_plain(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-5);
            let gf = (fused * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gp = (plain * &g).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &w] {
                let (a, b) = (
                    gf.get(v.as_tensor()).unwrap(),
                    gp.get(v.as_tensor()).unwrap(),
                );
                assert!(max_diff(a, b) < 1e-4, "{}", max_diff(a, b));
            }
        }
    }

    #[test]
    fn rope_matches_the_plain_ops_forward_and_backward() {
        let (b, h, t, d) = (2, 3, 5, 8);
        let rope = super::super::layers::Rope::new(d, 16, 10000.0).unwrap();
        let layout = super::super::layers::Layout {
            batch: b,
            len: t,
            positions: vec![0, 1, 2, 0, 1, 3, 4, 5, 6, 7],
            segments: vec![0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
        };
        let (cos, sin) = rope.tables(&layout).unwrap();
        let tables = rope.fused_tables(&layout).unwrap();
        let mut rng = Rng::new(4);
        let x = Var::from_tensor(&randn(&mut rng, &[b, h, t, d], 1.0)).unwrap();
        let g = randn(&mut rng, &[b, h, t, d], 1.0);
        let fused = super::rope(x.as_tensor(), &tables).unwrap();
        let plain = super::super::layers::apply_rope(x.as_tensor(), &cos, &sin).unwrap();
        assert!(max_diff(&fused, &plain) < 1e-6);
        let gf = (fused * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let gp = (plain * &g).unwrap().sum_all().unwrap().backward().unwrap();
        let (a, c) = (
            gf.get(x.as_tensor()).unwrap(),
            gp.get(x.as_tensor()).unwrap(),
        );
        assert!(max_diff(a, c) < 1e-6, "{}", max_diff(a, c));
    }

    #[test]
    fn swiglu_matches_the_plain_ops_forward_and_backward() {
        use super::super::config::Activation;
        // Big enough to take the parallel path too.
        for (rows, f) in [(3, 5), (300, 192)] {
            let mut rng = Rng::new(f as u64);
            let h = Var::from_tensor(&randn(&mut rng, &[rows, 2 * f], 2.0)).unwrap();
            let g = randn(&mut rng, &[rows, f], 1.0);
            let fused = swiglu(h.as_tensor()).unwrap();
            let plain =
                super::super::layers::activate_plain(h.as_tensor(), Activation::Swiglu).unwrap();
            assert!(
                max_diff(&fused, &plain) < 1e-5,
                "{}",
                max_diff(&fused, &plain)
            );
            let gf = (fused * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gp = (plain * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let (a, b) = (
                gf.get(h.as_tensor()).unwrap(),
                gp.get(h.as_tensor()).unwrap(),
            );
            assert!(max_diff(a, b) < 1e-5, "{}", max_diff(a, b));
        }
        let odd = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(swiglu(&odd).is_err(), "an odd width has no halves");
    }

    #[test]
    fn linear_matches_the_plain_ops_forward_and_backward() {
        for dims in [vec![1, 1], vec![5, 7], vec![2, 9, 33], vec![2, 3, 4, 16]] {
            let mut rng = Rng::new(dims.iter().product::<usize>() as u64);
            let k = *dims.last().unwrap();
            let x = Var::from_tensor(&randn(&mut rng, &dims, 1.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[6, k], 1.0)).unwrap();
            let fused = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let plain = super::super::layers::linear_plain(x.as_tensor(), w.as_tensor()).unwrap();
            assert_eq!(fused.dims(), plain.dims());
            assert!(
                max_diff(&fused, &plain) < 1e-5,
                "{}",
                max_diff(&fused, &plain)
            );
            let g = randn(&mut rng, plain.dims(), 1.0);
            let gf = (fused * &g).unwrap().sum_all().unwrap().backward().unwrap();
            let gp = (plain * &g).unwrap().sum_all().unwrap().backward().unwrap();
            for v in [&x, &w] {
                let (a, b) = (
                    gf.get(v.as_tensor()).unwrap(),
                    gp.get(v.as_tensor()).unwrap(),
                );
                assert!(max_diff(a, b) < 1e-5, "{}", max_diff(a, b));
            }
        }
        // A view with an offset (a narrowed input) goes through `contiguous` first.
        let mut rng = Rng::new(1);
        let x = randn(&mut rng, &[4, 10], 1.0).narrow(1, 2, 5).unwrap();
        let w = randn(&mut rng, &[3, 5], 1.0);
        let plain = super::super::layers::linear_plain(&x, &w).unwrap();
        assert!(max_diff(&linear(&x, &w).unwrap(), &plain) < 1e-5);
        let bad = randn(&mut rng, &[3, 4], 1.0);
        assert!(linear(&x, &bad).is_err(), "a weight of the wrong width");
    }
}
