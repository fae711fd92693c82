//! Mamba-2's depthwise causal convolution of width `K` over `[x, B, C]`, with bias, each tap
//! cut where it would reach before the token's run, then SiLU (step 2 of the mixer in
//! `mamba_ssm/modules/mamba2.py` and Megatron-LM's `megatron/core/ssm/mamba_mixer.py`):
//! `y_t = silu(bias + Σ_j w_j ⊙ x_{t−(K−1−j)})`.
//!
//! Written out of candle ops it is five nodes per tap (shift, pad, two broadcast products, a
//! sum), and every broadcast product's backward is a reduction over all tokens. Backward:
//! `dpre = dy ⊙ silu'(pre)`, `dx_s = Σ_j dpre_{s+K−1−j} ⊙ w_j` (over the taps that reached
//! `s`; computed by scattering each token's `dpre` back along its taps),
//! `dw_j = Σ_t dpre_t ⊙ x_{t−(K−1−j)}`, `dbias = Σ_t dpre_t`. It runs on the calling thread
//! and sums over tokens in token order: the bytes never depend on the thread count.
//!
//! Must match: [`causal_conv_silu_plain`] within 1e-6 forward, 1e-5 in gradients.

use crate::rows::{slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, bail};

// 1. Reference ----------------------------------------------------------------------------

/// The convolution from candle primitives, `x (B, T, C)`, `weight (C, K)`, `bias (C)`: each
/// tap masked where it would reach before the sequence or the token's run, then SiLU. The spec
/// the fused op is tested against.
pub fn causal_conv_silu_plain(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    starts: &[usize],
) -> Result<Tensor> {
    let (batch, len, ch) = x.dims3()?;
    let taps = weight.dim(1)?;
    // out_t = bias + Σ_j w_j · in_{t−(K−1−j)}, each tap masked where it would reach
    // before the sequence or before the token's run.
    let mut conv = bias.reshape((1, 1, ch))?.broadcast_as((batch, len, ch))?;
    for j in 0..taps {
        let shift = taps - 1 - j;
        if shift >= len {
            continue;
        }
        let mask: Vec<f32> = (0..batch * len)
            .map(|i| {
                let t = i % len;
                (t >= shift && t - shift >= starts[i]) as u8 as f32
            })
            .collect();
        let mask = Tensor::from_vec(mask, (batch, len, 1), x.device())?;
        let shifted = if shift == 0 {
            x.clone()
        } else {
            x.narrow(1, 0, len - shift)?.pad_with_zeros(1, shift, 0)?
        };
        let w = weight.narrow(1, j, 1)?.reshape((1, 1, ch))?;
        conv = conv.add(&shifted.broadcast_mul(&mask)?.broadcast_mul(&w)?)?;
    }
    conv.silu()
}

// 2. CPU, one graph node with its backward -------------------------------------------------

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

// 3. The kernel ---------------------------------------------------------------------------

/// Mamba-2's depthwise causal convolution and SiLU as one node: `x (B, T, C)`, `weight (C, K)`
/// (tap `K−1` multiplies the current token), `bias (C)`; `starts[b·T + t]` is the first token
/// of token `t`'s run in row `b` (taps reaching before it read zero). One fused node for f32
/// on the CPU, [`causal_conv_silu_plain`] elsewhere.
pub fn causal_conv_silu(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    starts: &[usize],
) -> Result<Tensor> {
    if !crate::fused_here(x) {
        return causal_conv_silu_plain(x, weight, bias, starts);
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// Run starts of rows of `len` tokens whose ids are `segments` (a run is a stretch of equal
    /// ids; no ids: one run per row).
    fn starts(segments: &[u32], rows: usize, len: usize) -> Vec<usize> {
        (0..rows * len)
            .map(|i| {
                let (row, mut t) = (i / len, i % len);
                while !segments.is_empty() && t > 0 && segments[row * len + t - 1] == segments[i] {
                    t -= 1;
                }
                if segments.is_empty() { 0 } else { t }
            })
            .collect()
    }

    /// The fused convolution + SiLU against the plain taps, values and gradients (input,
    /// weight, bias), with packed runs (a run starting mid-row, and one of a single token),
    /// for widths 1, 2 and 4 and a sequence shorter than the window.
    #[test]
    fn causal_conv_silu_matches_the_plain_taps_forward_and_backward() {
        let ch = 6;
        for (k, len, segments) in [
            (
                4,
                9,
                vec![1, 1, 1, 2, 2, 2, 2, 3, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5],
            ),
            (2, 9, vec![]),
            (1, 5, vec![]),
            (4, 2, vec![1, 2, 3, 3]),
        ] {
            let mut rng = Rng::new(11 + k as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[2, len, ch], 3.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[ch, k], 0.5)).unwrap();
            let b = Var::from_tensor(&randn(&mut rng, &[ch], 0.5)).unwrap();
            let starts = starts(&segments, 2, len);
            let fused = causal_conv_silu(x.as_tensor(), &w, &b, &starts).unwrap();
            let plain = causal_conv_silu_plain(x.as_tensor(), &w, &b, &starts).unwrap();
            let diff = max_diff(&fused, &plain);
            assert!(diff < 1e-6, "k {k}: {diff}");
            let g = randn(&mut rng, &[2, len, ch], 1.0);
            for diff in grad_diffs(&fused, &plain, &g, &[&x, &w, &b]) {
                assert!(diff < 1e-5, "k {k}: gradient off by {diff}");
            }
        }
        let mut rng = Rng::new(1);
        let x = randn(&mut rng, &[1, 3, ch], 1.0);
        let (w, b) = (randn(&mut rng, &[ch, 4], 1.0), randn(&mut rng, &[ch], 1.0));
        let err = causal_conv_silu(&x, &w, &b, &[0, 0]);
        assert!(err.is_err(), "run starts for 2 tokens, not 3");
    }

    /// What causal_conv_silu.cu computes through the SIMT shim: y, dx, dw and dbias for `grid`
    /// blocks of `block` threads, in one schedule.
    fn cuda(
        (x, w, bias, dy): (&[f32], &[f32], &[f32], &[f32]),
        starts: &[i32],
        (len, ch, k): (usize, usize, usize),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let tokens = starts.len();
        let (mut y, mut dpre, mut dx) = (
            vec![0f32; x.len()],
            vec![0f32; x.len()],
            vec![0f32; x.len()],
        );
        let mut partial = vec![0f32; grid as usize * (k + 1) * ch];
        let (mut dw, mut dbias) = (vec![0f32; ch * k], vec![0f32; ch]);
        let (n, t, c, kk, blocks) = (tokens as i32, len as i32, ch as i32, k as i32, grid as i32);
        let (x, w, bias, dy, st) = (
            x.as_ptr(),
            w.as_ptr(),
            bias.as_ptr(),
            dy.as_ptr(),
            starts.as_ptr(),
        );
        let (yp, dpp, dxp) = (y.as_mut_ptr(), dpre.as_mut_ptr(), dx.as_mut_ptr());
        let (pp, dwp, dbp) = (partial.as_mut_ptr(), dw.as_mut_ptr(), dbias.as_mut_ptr());
        // SAFETY: x, y, dy, dpre and dx hold tokens × C values, w and dw C × K, bias and dbias
        // C, starts one a token, the partials (K + 1) × C a block.
        unsafe {
            let fwd = [
                arg(&x),
                arg(&w),
                arg(&bias),
                arg(&st),
                arg(&yp),
                arg(&n),
                arg(&t),
                arg(&c),
                arg(&kk),
            ];
            launch_1d("causal_conv_silu_fwd_f32", grid, block, schedule, &fwd).unwrap();
            let dpre = [
                arg(&x),
                arg(&w),
                arg(&bias),
                arg(&st),
                arg(&dy),
                arg(&dpp),
                arg(&n),
                arg(&t),
                arg(&c),
                arg(&kk),
            ];
            launch_1d("causal_conv_silu_dpre_f32", grid, block, schedule, &dpre).unwrap();
            let dx = [
                arg(&w),
                arg(&st),
                arg(&dpp),
                arg(&dxp),
                arg(&n),
                arg(&t),
                arg(&c),
                arg(&kk),
            ];
            launch_1d("causal_conv_silu_dx_f32", grid, block, schedule, &dx).unwrap();
            let partials = [
                arg(&x),
                arg(&st),
                arg(&dpp),
                arg(&pp),
                arg(&n),
                arg(&t),
                arg(&c),
                arg(&kk),
            ];
            launch_1d(
                "causal_conv_silu_dw_partials_f32",
                grid,
                block,
                schedule,
                &partials,
            )
            .unwrap();
            let reduce = [
                arg(&pp),
                arg(&dwp),
                arg(&dbp),
                arg(&blocks),
                arg(&c),
                arg(&kk),
            ];
            let pairs = ((k + 1) * ch).div_ceil(64) as u32;
            launch_1d("causal_conv_silu_dw_reduce", pairs, 64, schedule, &reduce).unwrap();
        }
        vec![y, dx, dw, dbias]
    }

    /// causal_conv_silu.cu, executed by the SIMT shim, against the plain taps: values within
    /// 1e-6, dx within 1e-5, the weight's and the bias's gradients within 1e-4 (sums over
    /// every token, up to ~100 at 120 tokens, added in block partials: a few ulp off the
    /// reference's order), with packed runs (one
    /// starting mid-row, runs of one token, a row shorter than the window), widths 1 to 4,
    /// channel counts that are not multiples of the block, grids that loop and grids that leave
    /// threads (and the weight gradient's blocks) idle, in both schedules, which must give the
    /// same bytes: the weight gradient has no atomics.
    #[test]
    fn the_cuda_kernels_match_the_plain_taps() {
        let runs = vec![1, 1, 1, 2, 2, 2, 2, 3, 4, 5, 5, 5, 5, 5, 5, 5, 5, 5];
        for (rows, len, ch, k, segments) in [
            (2, 9, 6, 4, runs),
            (1, 1, 1, 1, vec![]),
            (2, 9, 37, 2, vec![]),
            (2, 2, 5, 4, vec![1, 2, 3, 3]),
            (3, 40, 70, 4, (0..120).map(|i| i / 7).collect()),
            (1, 300, 3, 3, vec![]),
        ] {
            let mut rng = Rng::new(17 * ch as u64 + k as u64 + len as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[rows, len, ch], 3.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[ch, k], 0.5)).unwrap();
            let b = Var::from_tensor(&randn(&mut rng, &[ch], 0.5)).unwrap();
            let dy = randn(&mut rng, &[rows, len, ch], 1.0);
            let starts = starts(&segments, rows, len);
            let plain = causal_conv_silu_plain(x.as_tensor(), &w, &b, &starts).unwrap();
            let mut want = vec![values(&plain)];
            want.extend(plain_grads(&plain, &dy, &[&x, &w, &b]));
            let inputs = [&x, &w, &b].map(|v| values(v.as_tensor()));
            let dyv = values(&dy);
            let inputs = (&inputs[0][..], &inputs[1][..], &inputs[2][..], &dyv[..]);
            let starts: Vec<i32> = starts.iter().map(|&s| s as i32).collect();
            let tokens = (rows * len) as u32;
            for launch in [(1, 32), (3, 64), (tokens, 128), (tokens + 5, 32), (2, 1024)] {
                let at = format!("{rows} × {len} tokens, C {ch}, K {k}, grid × block {launch:?}");
                let got =
                    in_both_schedules(&at, |s| cuda(inputs, &starts, (len, ch, k), launch, s));
                for (what, got, want, tolerance) in [
                    // 1.9e-6 on an H100, where the taps' products and sums are fused
                    // into FMAs and expf is CUDA's (within 2 ulp); 1e-6 on the shim.
                    ("y", &got[0], &want[0], 4e-6),
                    ("dx", &got[1], &want[1], 1e-5),
                    ("dw", &got[2], &want[2], 1e-4),
                    ("dbias", &got[3], &want[3], 1e-4),
                ] {
                    let gap = largest_gap(got, want);
                    assert!(gap < tolerance, "{at}: {what} is {gap} from the plain taps");
                }
            }
        }
    }
}
