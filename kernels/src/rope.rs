//! Rotary position embedding (Su et al. 2021) in the `rotate_half` convention of Hugging Face
//! Llama (`transformers/models/llama/modeling_llama.py`: `apply_rotary_pos_emb`): dimension
//! `i` and `i + d/2` rotate together at frequency `theta^(-2i/d)`, so
//! `y = x·cos + R(x)·sin` with `R([a, b]) = [−b, a]`.
//!
//! Backward: `dx = g·cos + Rᵀ(g·sin)` with `Rᵀ([a, b]) = [b, −a]`. Must match: [`rope_plain`]
//! within 1e-6, the fused CPU op and the CUDA kernels (`rope.cu`) alike.

use crate::rows::{for_rows, slice};
use candle_core::{CpuStorage, CustomOp1, D, Layout, Result, Shape, Tensor, bail};
use std::sync::Arc;

// 1. Reference ----------------------------------------------------------------------------

/// The rotation angles' `(cos, sin)` for every position of `positions`, row-major
/// `(positions.len(), head_dim)`: dimension `i` turns at `theta^(-2·(i mod d/2)/d)` radians
/// per position, computed in f64 and rounded once.
pub fn rope_angles(head_dim: usize, theta: f64, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(positions.len() * head_dim);
    let mut sin = Vec::with_capacity(positions.len() * head_dim);
    for &p in positions {
        for i in 0..head_dim {
            let freq = 1.0 / theta.powf((2 * (i % half)) as f64 / head_dim as f64);
            let angle = p as f64 * freq;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// `x·cos + rotate_half(x)·sin` from candle primitives, with `rotate_half([a, b]) = [−b, a]`;
/// `x` is `(B, H, T, D)`, `cos` and `sin` broadcast to it: the spec the fused op is tested
/// against.
pub fn rope_plain(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let a = x.narrow(D::Minus1, 0, d / 2)?;
    let b = x.narrow(D::Minus1, d / 2, d / 2)?;
    let rotated = Tensor::cat(&[&b.neg()?, &a], D::Minus1)?;
    x.broadcast_mul(cos)? + rotated.broadcast_mul(sin)?
}

// 2. CPU, one graph node with its backward -------------------------------------------------

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

impl RopeTables {
    /// The tables of `(batch, 1, len, dim)` `cos` and `sin` tensors.
    pub fn new(cos: &Tensor, sin: &Tensor) -> Result<RopeTables> {
        let (batch, _, len, dim) = cos.dims4()?;
        Ok(RopeTables {
            cos: Arc::new(cos.flatten_all()?.to_vec1::<f32>()?),
            sin: Arc::new(sin.flatten_all()?.to_vec1::<f32>()?),
            batch,
            len,
            dim,
        })
    }

    /// `(cos, sin)` as `(batch, 1, len, dim)` tensors on `device`.
    pub fn tensors(&self, device: &candle_core::Device) -> Result<(Tensor, Tensor)> {
        let shape = (self.batch, 1, self.len, self.dim);
        Ok((
            Tensor::from_slice(&self.cos, shape, device)?,
            Tensor::from_slice(&self.sin, shape, device)?,
        ))
    }
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
        let mut out = vec![0f32; x.len()];
        let row = |(r, y): (usize, &mut [f32])| {
            let (bi, ti) = (r / (h * t), r % t);
            let at = (bi * t + ti) * d;
            let (cos, sin) = (&tb.cos[at..at + d], &tb.sin[at..at + d]);
            rope_row(&x[r * d..(r + 1) * d], cos, sin, y, self.transpose);
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

// 3. The kernel ---------------------------------------------------------------------------

/// Rotary embedding of `x` `(B, H, T, D)` in the `rotate_half` convention: one fused pass for
/// f32 on the CPU, [`rope_plain`] elsewhere.
pub fn rope(x: &Tensor, tables: &RopeTables) -> Result<Tensor> {
    if !crate::fused_here(x) {
        let (cos, sin) = tables.tensors(x.device())?;
        return rope_plain(x, &cos, &sin);
    }
    x.contiguous()?.apply_op1(RopeOp {
        t: tables.clone(),
        transpose: false,
    })
}

/// The rotary map of one row of `d = 2·half` values, forward `x·cos + R(x)·sin` or, with
/// `transpose`, its transpose `x·cos + Rᵀ(x·sin)` (the backward).
pub(crate) fn rope_row(x: &[f32], cos: &[f32], sin: &[f32], y: &mut [f32], transpose: bool) {
    let half = x.len() / 2;
    for j in 0..half {
        if transpose {
            y[j] = x[j] * cos[j] + x[j + half] * sin[j + half];
            y[j + half] = x[j + half] * cos[j + half] - x[j] * sin[j];
        } else {
            y[j] = x[j] * cos[j] - x[j + half] * sin[j];
            y[j + half] = x[j + half] * cos[j + half] + x[j] * sin[j + half];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::*;

    #[test]
    fn rope_matches_the_plain_ops_forward_and_backward() {
        let (b, h, t, d) = (2, 3, 5, 8);
        let tables = rope_tables(d, &[0, 1, 2, 0, 1, 3, 4, 5, 6, 7], b, t);
        let (cos, sin) = tables.tensors(&Device::Cpu).unwrap();
        let mut rng = Rng::new(4);
        let x = Var::from_tensor(&randn(&mut rng, &[b, h, t, d], 1.0)).unwrap();
        let g = randn(&mut rng, &[b, h, t, d], 1.0);
        let fused = rope(x.as_tensor(), &tables).unwrap();
        let plain = rope_plain(x.as_tensor(), &cos, &sin).unwrap();
        assert!(max_diff(&fused, &plain) < 1e-6);
        for diff in grad_diffs(&fused, &plain, &g, &[&x]) {
            assert!(diff < 1e-6, "{diff}");
        }
    }

    #[test]
    fn angles_turn_pairs_half_a_head_apart_at_the_llama_frequencies() {
        let (cos, sin) = rope_angles(4, 10000.0, &[0, 3]);
        assert_eq!(&cos[..4], &[1.0; 4]);
        assert_eq!(&sin[..4], &[0.0; 4]);
        // Position 3: dims 0 and 2 turn at 1 rad/position, dims 1 and 3 at 10000^-0.5.
        let slow = 3.0f64 * 0.01;
        assert_eq!(
            cos[4..],
            [
                3f64.cos() as f32,
                slow.cos() as f32,
                3f64.cos() as f32,
                slow.cos() as f32
            ]
        );
        assert_eq!(
            sin[4..],
            [
                3f64.sin() as f32,
                slow.sin() as f32,
                3f64.sin() as f32,
                slow.sin() as f32
            ]
        );
    }

    /// rope.cu's y and dx through the SIMT shim, for `grid` blocks of `block` threads.
    fn cuda(
        (x, dy): (&[f32], &[f32]),
        tables: &RopeTables,
        heads: usize,
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let (b, t, d) = (tables.batch as i32, tables.len as i32, tables.dim as i32);
        let mut out = vec![vec![0f32; x.len()], vec![0f32; x.len()]];
        for (backward, input) in [x, dy].into_iter().enumerate() {
            // SAFETY: input and output hold B·H·T·D values, the tables B·T·D.
            let name = ["rope_fwd_f32", "rope_bwd_f32"][backward];
            let (input, out) = (input.as_ptr(), out[backward].as_mut_ptr());
            let (cos, sin, h) = (tables.cos.as_ptr(), tables.sin.as_ptr(), heads as i32);
            let params = [
                arg(&input),
                arg(&cos),
                arg(&sin),
                arg(&out),
                arg(&b),
                arg(&h),
                arg(&t),
                arg(&d),
            ];
            unsafe { launch_1d(name, grid, block, schedule, &params) }.unwrap();
        }
        out
    }

    /// rope.cu, executed by the SIMT shim, against the plain ops within 1e-6, forward and
    /// backward, with positions that restart inside a row (packed sequences), head counts and
    /// lengths that are not multiples of the block, grids that loop or leave threads idle, in
    /// both schedules.
    #[test]
    fn the_cuda_kernels_match_the_plain_ops() {
        for (b, h, t, d) in [(1, 1, 1, 2), (2, 3, 5, 8), (3, 5, 7, 64), (1, 2, 33, 128)] {
            let positions: Vec<u32> = (0..b * t).map(|i| ((i * 7) % (t + 3)) as u32).collect();
            let tables = rope_tables(d, &positions, b, t);
            let (cos, sin) = tables.tensors(&Device::Cpu).unwrap();
            let mut rng = Rng::new((b * h * t * d) as u64);
            let x = Var::from_tensor(&randn(&mut rng, &[b, h, t, d], 1.0)).unwrap();
            let g = randn(&mut rng, &[b, h, t, d], 1.0);
            let plain = rope_plain(x.as_tensor(), &cos, &sin).unwrap();
            let want = [values(&plain), plain_grads(&plain, &g, &[&x]).remove(0)];
            let (xv, gv) = (values(x.as_tensor()), values(&g));
            for launch in [(1, 32), (3, 64), ((b * h * t) as u32, 256), (40, 1024)] {
                let at = format!("(B, H, T, D) {:?}, grid × block {launch:?}", (b, h, t, d));
                let got = in_both_schedules(&at, |rev| cuda((&xv, &gv), &tables, h, launch, rev));
                for (what, got, want) in [("y", &got[0], &want[0]), ("dx", &got[1], &want[1])] {
                    let gap = largest_gap(got, want);
                    assert!(gap < 1e-6, "{at}: {what} is {gap} from the plain ops");
                }
            }
        }
    }
}
