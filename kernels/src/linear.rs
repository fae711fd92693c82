//! `y = x · wᵀ` for `x` of any rank ≥ 2 and a weight stored `(out, in)` as in PyTorch
//! (`torch.nn.functional.linear` without bias).
//!
//! Backward: `dx = g · w`, `dw = gᵀ · x`. Must match: [`linear_plain`] within 1e-5.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, bail};

// 1. Reference ----------------------------------------------------------------------------

/// `x @ wᵀ` from candle ops: the spec the fused op is tested against.
pub fn linear_plain(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims();
    let last = dims[dims.len() - 1];
    let rows = x.elem_count() / last;
    let y = x.reshape((rows, last))?.matmul(&w.t()?)?;
    let mut out = dims.to_vec();
    let n = out.len();
    out[n - 1] = w.dim(0)?;
    y.reshape(out)
}

// 2. CPU, one graph node with its backward -------------------------------------------------

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

// 3. The kernel ---------------------------------------------------------------------------

/// `x · wᵀ` for `x` `(…, K)` and `w` `(N, K)`. On the CPU one graph node: forward
/// `x.reshape(rows, K).matmul(wᵀ)` straight on the storages, backward `dx = g · w`,
/// `dw = gᵀ · x` over the rows. Written out of candle ops ([`linear_plain`]: reshape,
/// transpose, matmul, reshape) each view is a node whose backward allocates a zero gradient
/// and adds into it; here there is one node. [`linear_plain`] elsewhere.
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !(x.device().is_cpu() && w.device().is_cpu()) {
        return linear_plain(x, w);
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn linear_matches_the_plain_ops_forward_and_backward() {
        for dims in [vec![1, 1], vec![5, 7], vec![2, 9, 33], vec![2, 3, 4, 16]] {
            let mut rng = Rng::new(dims.iter().product::<usize>() as u64);
            let k = *dims.last().unwrap();
            let x = Var::from_tensor(&randn(&mut rng, &dims, 1.0)).unwrap();
            let w = Var::from_tensor(&randn(&mut rng, &[6, k], 1.0)).unwrap();
            let fused = linear(x.as_tensor(), w.as_tensor()).unwrap();
            let plain = linear_plain(x.as_tensor(), w.as_tensor()).unwrap();
            assert_eq!(fused.dims(), plain.dims());
            assert!(
                max_diff(&fused, &plain) < 1e-5,
                "{}",
                max_diff(&fused, &plain)
            );
            let g = randn(&mut rng, plain.dims(), 1.0);
            for diff in grad_diffs(&fused, &plain, &g, &[&x, &w]) {
                assert!(diff < 1e-5, "{diff}");
            }
        }
        // A view with an offset (a narrowed input) goes through `contiguous` first.
        let mut rng = Rng::new(1);
        let x = randn(&mut rng, &[4, 10], 1.0).narrow(1, 2, 5).unwrap();
        let w = randn(&mut rng, &[3, 5], 1.0);
        let plain = linear_plain(&x, &w).unwrap();
        assert!(max_diff(&linear(&x, &w).unwrap(), &plain) < 1e-5);
        let bad = randn(&mut rng, &[3, 4], 1.0);
        assert!(linear(&x, &bad).is_err(), "a weight of the wrong width");
    }
}
