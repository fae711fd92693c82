//! Cross-entropy of the logits against the labels, fused with the softmax over the vocabulary
//! (as Megatron-LM's `fused_vocab_parallel_cross_entropy`, on one device): per row
//! `lse(x) − x[label]`.
//!
//! Backward: `dx = g · (softmax(x) − onehot)`. Must match: [`cross_entropy_plain`] within 1e-5,
//! the fused CPU op and the CUDA kernels (`cross_entropy.cu`, an online max/sum, one block a
//! row) alike. A label outside the vocabulary is an error here; the CUDA kernels, which
//! cannot return one, make that row's loss and gradient NaN.

use crate::rows::{PAR_MIN, for_rows, slice, with_values};
use crate::simd;
use candle_core::{CpuStorage, CustomOp2, D, Layout, Result, Shape, Tensor, bail};
use rayon::prelude::*;

// 1. Reference ----------------------------------------------------------------------------

/// Cross-entropy `-log softmax(logits)[label]` per position, `(N,)`, from candle primitives.
/// `logits` is `(N, vocab)`, `labels` `(N,)` u32.
pub fn cross_entropy_plain(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(D::Minus1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let picked = shifted.gather(&labels.unsqueeze(1)?, 1)?;
    (lse - picked)?.squeeze(1)
}

// 2. CPU, one graph node with its backward -------------------------------------------------

struct CrossEntropy;

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
            simd::log_sum_exp(row) - row[labels[r] as usize]
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
        let labels = labels.to_vec1::<u32>()?;
        let g = grad.to_vec1::<f32>()?;
        let mut out = vec![0f32; n * v];
        with_values(logits, |x| {
            let row = |(r, d): (usize, &mut [f32])| {
                let xs = &x[r * v..(r + 1) * v];
                simd::scaled_exp_shifted(xs, simd::log_sum_exp(xs), g[r], d);
                d[labels[r] as usize] -= g[r];
            };
            for_rows(&mut out, v, row);
        })?;
        Ok((Some(Tensor::from_vec(out, (n, v), logits.device())?), None))
    }
}

// 3. The kernel ---------------------------------------------------------------------------

/// Per-row cross-entropy `−log softmax(logits)[label]`: `logits` `(N, V)`, `labels` `(N,)` u32.
/// One fused pass for f32 on the CPU, [`cross_entropy_plain`] elsewhere.
pub fn cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    if !crate::fused_here(logits) {
        return cross_entropy_plain(logits, labels);
    }
    logits
        .contiguous()?
        .apply_op2(&labels.contiguous()?, CrossEntropy)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn cross_entropy_matches_the_plain_ops_forward_and_backward() {
        for (n, v) in [(5, 11), (300, 257)] {
            let mut rng = Rng::new(n as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[n, v], 3.0)).unwrap();
            let labels: Vec<u32> = (0..n).map(|i| ((i * 7919) % v) as u32).collect();
            let labels = Tensor::from_vec(labels, n, &Device::Cpu).unwrap();
            let w = randn(&mut rng, &[n], 1.0);
            let fused = cross_entropy(x.as_tensor(), &labels).unwrap();
            let plain = cross_entropy_plain(x.as_tensor(), &labels).unwrap();
            assert!(max_diff(&fused, &plain) < 1e-5);
            for diff in grad_diffs(&fused, &plain, &w, &[&x]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
        let x = Tensor::zeros((1, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        let bad = Tensor::new(&[3u32], &Device::Cpu).unwrap();
        assert!(
            cross_entropy(&x, &bad).is_err(),
            "a label outside the vocabulary"
        );
    }

    /// cross_entropy.cu's per-row loss and dlogits through the SIMT shim, for `grid` blocks
    /// of `block` threads: loss, dlogits, and dlogits from `cross_entropy_bwd_to_bf16` (its bf16
    /// values as f32).
    fn cuda(
        (x, labels, dloss): (&[f32], &[u32], &[f32]),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let (n, v) = (labels.len(), x.len() / labels.len());
        let (mut loss, mut lse, mut dx) = (vec![0f32; n], vec![0f32; n], vec![0f32; n * v]);
        let mut dx16 = vec![0u16; n * v];
        let (rows, vocab) = (n as i32, v as i32);
        // SAFETY: x and dx hold N × V values; labels, dloss, loss and lse one a row.
        unsafe {
            launch_1d(
                "cross_entropy_fwd_f32",
                grid,
                block,
                schedule,
                &[
                    arg(&x.as_ptr()),
                    arg(&labels.as_ptr()),
                    arg(&loss.as_mut_ptr()),
                    arg(&lse.as_mut_ptr()),
                    arg(&rows),
                    arg(&vocab),
                ],
            )
            .unwrap();
            let outputs: [(&str, *mut std::ffi::c_void); 2] = [
                ("cross_entropy_bwd_f32", dx.as_mut_ptr().cast()),
                ("cross_entropy_bwd_to_bf16", dx16.as_mut_ptr().cast()),
            ];
            for (kernel, out) in outputs {
                let (x, labels, lse, dloss) =
                    (x.as_ptr(), labels.as_ptr(), lse.as_ptr(), dloss.as_ptr());
                let params = [
                    arg(&x),
                    arg(&labels),
                    arg(&lse),
                    arg(&dloss),
                    arg(&out),
                    arg(&rows),
                    arg(&vocab),
                ];
                launch_1d(kernel, grid, block, schedule, &params).unwrap();
            }
        }
        vec![loss, dx, widened(&dx16)]
    }

    /// cross_entropy.cu, executed by the SIMT shim, against the plain ops within 1e-5, loss
    /// and dlogits: vocabularies smaller than the block (idle threads enter the online sum
    /// empty) and not multiples of it, rows beyond the grid, logits large enough that a
    /// running maximum is replaced many times, vocabularies of a multiple of four (read four
    /// values at a time) and not, in both schedules. dlogits in bf16 are the f32 ones
    /// rounded, bit for bit.
    #[test]
    fn the_cuda_kernels_match_the_plain_ops() {
        for (n, v) in [(1, 1), (5, 11), (9, 1000), (3, 3001)] {
            let mut rng = Rng::new(13 * v as u64 + n as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[n, v], 3.0)).unwrap();
            let labels: Vec<u32> = (0..n).map(|i| ((i * 7919 + 3) % v) as u32).collect();
            let label_tensor = Tensor::from_vec(labels.clone(), n, &Device::Cpu).unwrap();
            let w = randn(&mut rng, &[n], 1.0);
            let plain = cross_entropy_plain(x.as_tensor(), &label_tensor).unwrap();
            let want = [values(&plain), plain_grads(&plain, &w, &[&x]).remove(0)];
            let (xv, wv) = (values(x.as_tensor()), values(&w));
            for launch in [(1, 32), (2, 64), (n as u32, 256), (3, 1024)] {
                let at = format!("N {n}, V {v}, grid × block {launch:?}");
                let got = in_both_schedules(&at, |rev| cuda((&xv, &labels, &wv), launch, rev));
                for (what, got, want) in [("loss", &got[0], &want[0]), ("dx", &got[1], &want[1])] {
                    let gap = largest_gap(got, want);
                    assert!(gap < 1e-5, "{at}: {what} is {gap} from the plain ops");
                }
                assert!(
                    rounded_to_bf16(&got[1], &got[2]),
                    "{at}: bf16 dlogits are not the f32 ones rounded"
                );
            }
        }
    }

    /// A label outside the vocabulary poisons its own row (loss and gradient NaN) and no
    /// other: the CPU op refuses it; the GPU's step stops at the gradient-norm check.
    #[test]
    fn the_cuda_kernels_poison_a_row_whose_label_is_outside_the_vocabulary() {
        let (n, v) = (3, 40);
        let mut rng = Rng::new(5);
        let x = values(&randn(&mut rng, &[n, v], 1.0));
        // Buffers on the heap, where the kernel tests' GPU mirror finds them (crate::mirror).
        let (labels, dloss) = ([2, v as u32, 7].to_vec(), [1.0; 3].to_vec());
        let got = cuda((&x, &labels, &dloss), (2, 32), Schedule::Forward);
        assert!(got[0][1].is_nan() && got[1][v..2 * v].iter().all(|d| d.is_nan()));
        let finite = |d: &[f32]| d.iter().all(|d| d.is_finite());
        assert!(got[0][0].is_finite() && got[0][2].is_finite());
        assert!(finite(&got[1][..v]) && finite(&got[1][2 * v..]));
    }
}
