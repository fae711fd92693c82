//! Embedding lookup: row `ids[t]` of a `(V, D)` table for every token `t`, as
//! `torch.nn.Embedding` and Megatron-LM's `VocabParallelEmbedding` on one device.
//!
//! Backward: `dtable[v] = Σ_{t : ids[t] = v} dout[t]`, summed in token order. The reference
//! is already a single gather (candle's `index_select`, whose backward adds the rows in
//! token order), so there is no fused CPU version; the CUDA kernels (`embedding.cu`) must
//! give its bytes, forward and backward: each table row's sum has one writer and runs in
//! token order, with no atomics. An id outside the vocabulary is an error here and a NaN row
//! in the CUDA forward.

use candle_core::{Result, Tensor};

// 1. Reference ----------------------------------------------------------------------------

/// Rows `ids` `(N,)` u32 of `table` `(V, D)`, `(N, D)`: the spec of the CUDA kernels.
pub fn embedding_plain(ids: &Tensor, table: &Tensor) -> Result<Tensor> {
    table.index_select(ids, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    /// embedding.cu's output and dtable through the SIMT shim, for `grid` blocks of `block`
    /// threads.
    fn cuda(
        (table, ids, dout): (&[f32], &[u32], &[f32]),
        dim: usize,
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let (n, v) = (ids.len(), table.len() / dim);
        let (mut out, mut dtable) = (vec![0f32; n * dim], vec![f32::NAN; v * dim]);
        let (tokens, vocab, d) = (n as i32, v as i32, dim as i32);
        // SAFETY: table and dtable hold V × D values, out and dout N × D, ids N.
        unsafe {
            launch_1d(
                "embedding_fwd_f32",
                grid,
                block,
                schedule,
                &[
                    arg(&table.as_ptr()),
                    arg(&ids.as_ptr()),
                    arg(&out.as_mut_ptr()),
                    arg(&tokens),
                    arg(&vocab),
                    arg(&d),
                ],
            )
            .unwrap();
            launch_1d(
                "embedding_bwd_f32",
                grid,
                block,
                schedule,
                &[
                    arg(&dout.as_ptr()),
                    arg(&ids.as_ptr()),
                    arg(&dtable.as_mut_ptr()),
                    arg(&tokens),
                    arg(&vocab),
                    arg(&d),
                ],
            )
            .unwrap();
        }
        vec![out, dtable]
    }

    /// embedding.cu, executed by the SIMT shim: the plain ops' bytes, forward and backward,
    /// with ids repeated many times (their rows' gradients add up in token order) and rows
    /// never looked up (zero gradient), vocabularies that do not split evenly over the grid,
    /// grids larger than the vocabulary, widths not a multiple of the block, both schedules.
    /// dtable starts as NaN: every row, looked up or not, is written.
    #[test]
    fn the_cuda_kernels_give_the_plain_ops_bytes() {
        for (n, v, d) in [(1, 1, 1), (7, 5, 3), (50, 37, 70), (200, 301, 33)] {
            let mut rng = Rng::new((n * v * d) as u64);
            let table = Var::from_tensor(&randn(&mut rng, &[v, d], 1.0)).unwrap();
            // Skewed ids, as token counts are: low ids often, some never.
            let ids: Vec<u32> = (0..n)
                .map(|_| ((rng.normal().abs() * v as f64 / 3.0) as usize % v) as u32)
                .collect();
            let id_tensor = Tensor::from_vec(ids.clone(), n, &Device::Cpu).unwrap();
            let g = randn(&mut rng, &[n, d], 1.0);
            let plain = embedding_plain(&id_tensor, table.as_tensor()).unwrap();
            let want = vec![values(&plain), plain_grads(&plain, &g, &[&table]).remove(0)];
            let (tv, gv) = (values(table.as_tensor()), values(&g));
            for launch in [(1, 32), (3, 64), (v as u32 + 2, 256), (8, 1024)] {
                let at = format!("N {n}, V {v}, D {d}, grid × block {launch:?}");
                let got = in_both_schedules(&at, |rev| cuda((&tv, &ids, &gv), d, launch, rev));
                assert_eq!(got, want, "{at}");
            }
        }
    }

    /// An id outside the vocabulary gives a NaN row in the forward and touches no row of
    /// dtable.
    #[test]
    fn the_cuda_forward_gives_a_nan_row_for_an_id_outside_the_vocabulary() {
        let (v, d) = (4, 3);
        let table: Vec<f32> = (0..v * d).map(|i| i as f32).collect();
        // Buffers on the heap, where the kernel tests' GPU mirror finds them (crate::mirror).
        let (ids, dout) = ([1, 9].to_vec(), [1.0; 6].to_vec());
        let got = cuda((&table, &ids, &dout), d, (2, 32), Schedule::Forward);
        assert_eq!(got[0][..d], [3.0, 4.0, 5.0]);
        assert!(got[0][d..].iter().all(|x| x.is_nan()));
        let mut want = vec![0.0; v * d];
        want[d..2 * d].copy_from_slice(&[1.0; 3]);
        assert_eq!(got[1], want);
    }
}
