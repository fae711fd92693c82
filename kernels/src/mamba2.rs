//! Mamba-2's small steps on a device (`mamba2.cu`): the step size `Δ = softplus(dt + dt_bias)`,
//! the decay rate `A = −exp(A_log)`, the `D·x` skip and the per-head sums of their parameters'
//! gradients, and `copy_columns_f32` (accumulate.cu), which splits a Mamba-2 block's
//! projection into its parts and joins their gradients. The CPU computes them from candle ops
//! in ops/model (`src/mamba2.rs`); the references below are those same ops, and autograd
//! through them is the backward's.
//!
//! Must match: the candle ops within 1e-6 relative to each result's largest magnitude (the
//! device's `expf` and `logf` are not the host's; on the shim the bytes agree at the test
//! shapes), the per-head sums within 1e-5 (a different order of addition), and the column
//! copy to the byte.

#[cfg(test)]
mod tests {
    use crate::launch::{Arg, Launcher, Shim};
    use crate::testing::*;
    use candle_core::{D, Tensor};

    type ShimBuffer = <Shim as Launcher>::Buffer;

    /// The launches tried: grids that loop, leave threads idle, or give a block a head each.
    const LAUNCHES: [(u32, u32); 4] = [(1, 32), (3, 64), (7, 128), (64, 256)];
    /// (rows, heads, P): sizes that are not multiples of the block.
    const SHAPES: [(usize, usize, usize); 4] = [(1, 1, 1), (7, 3, 5), (33, 8, 16), (300, 2, 3)];

    /// ops/model/src/mamba2.rs's softplus: `max(v, 0) + ln(1 + e^{−|v|})`.
    fn softplus(v: &Tensor) -> Tensor {
        let tail = (v.abs().unwrap().neg().unwrap().exp().unwrap() + 1.0).unwrap();
        (v.relu().unwrap() + tail.log().unwrap()).unwrap()
    }

    /// Δ and the gradients of dt and dt_bias, from a projection of `cols` columns whose dt
    /// starts at column `offset`.
    #[test]
    fn the_step_size_and_its_gradients_match_softplus_and_autograd() {
        for (rows, heads, _) in SHAPES {
            let (cols, offset) = (heads + 5, 3);
            let mut rng = Rng::new((rows * 31 + heads) as u64);
            let proj = randn(&mut rng, &[rows, cols], 3.0);
            let bias = Var::from_tensor(&randn(&mut rng, &[heads], 2.0)).unwrap();
            let raw = Var::from_tensor(&proj.narrow(1, offset, heads).unwrap()).unwrap();
            let ddelta = randn(&mut rng, &[rows, heads], 1.0);
            let delta = softplus(&raw.as_tensor().broadcast_add(bias.as_tensor()).unwrap());
            let want = plain_grads(&delta, &ddelta, &[&raw, &bias]);
            for launch_at in LAUNCHES {
                for schedule in crate::simt::SCHEDULES {
                    let at = format!("rows {rows}, heads {heads}, {launch_at:?}, {schedule:?}");
                    let shim = Shim { schedule };
                    let p = shim.upload_f32(&values(&proj)).unwrap();
                    let b = shim.upload_f32(&values(bias.as_tensor())).unwrap();
                    let g = shim.upload_f32(&values(&ddelta)).unwrap();
                    let dt = shim.alloc(rows * heads * 4).unwrap();
                    let draw = shim.alloc(rows * heads * 4).unwrap();
                    let dbias = shim.alloc(heads * 4).unwrap();
                    let sizes = [Arg::I32(rows as i32), Arg::I32(heads as i32)];
                    let head = [
                        Arg::Ptr(&p, 0),
                        Arg::I32(cols as i32),
                        Arg::I32(offset as i32),
                    ];
                    let fwd = [&head[..], &[Arg::Ptr(&b, 0), Arg::Ptr(&dt, 0)], &sizes].concat();
                    launch_on(&shim, "mamba_dt_fwd_f32", launch_at, &fwd);
                    let bwd = [
                        &head[..],
                        &[Arg::Ptr(&b, 0), Arg::Ptr(&g, 0), Arg::Ptr(&draw, 0)],
                        &sizes,
                    ]
                    .concat();
                    launch_on(&shim, "mamba_dt_bwd_f32", launch_at, &bwd);
                    let sums = [
                        Arg::Ptr(&draw, 0),
                        Arg::Null,
                        Arg::Ptr(&dbias, 0),
                        Arg::I32(rows as i32),
                        Arg::I32(heads as i32),
                        Arg::I32(1),
                    ];
                    launch_on(&shim, "mamba_head_sums_f32", launch_at, &sums);
                    let read = |b: &ShimBuffer, n| shim.read_f32(b, 0, n).unwrap();
                    assert_close(&read(&dt, rows * heads), &values(&delta), 1e-6, &at);
                    assert_close(&read(&draw, rows * heads), &want[0], 1e-6, &at);
                    assert_close(&read(&dbias, heads), &want[1], 1e-5, &at);
                }
            }
        }
    }

    #[test]
    fn the_decay_rate_and_its_gradient_match_the_candle_ops() {
        for heads in [1, 5, 40] {
            let mut rng = Rng::new(heads as u64);
            let a_log = Var::from_tensor(&randn(&mut rng, &[heads], 1.5)).unwrap();
            let da = randn(&mut rng, &[heads], 1.0);
            let a = a_log.as_tensor().exp().unwrap().neg().unwrap();
            let want = plain_grads(&a, &da, &[&a_log]).remove(0);
            for launch_at in LAUNCHES {
                let at = format!("heads {heads}, {launch_at:?}");
                let shim = Shim::default();
                let l = shim.upload_f32(&values(a_log.as_tensor())).unwrap();
                let g = shim.upload_f32(&values(&da)).unwrap();
                let (out, dl) = (
                    shim.alloc(heads * 4).unwrap(),
                    shim.alloc(heads * 4).unwrap(),
                );
                let h = Arg::I32(heads as i32);
                launch_on(
                    &shim,
                    "mamba_a_fwd_f32",
                    launch_at,
                    &[Arg::Ptr(&l, 0), Arg::Ptr(&out, 0), h],
                );
                let bwd = [Arg::Ptr(&out, 0), Arg::Ptr(&g, 0), Arg::Ptr(&dl, 0), h];
                launch_on(&shim, "mamba_a_bwd_f32", launch_at, &bwd);
                assert_close(
                    &shim.read_f32(&out, 0, heads).unwrap(),
                    &values(&a),
                    1e-6,
                    &at,
                );
                assert_close(&shim.read_f32(&dl, 0, heads).unwrap(), &want, 1e-6, &at);
            }
        }
    }

    /// y + D·x, and its gradients: dx added onto what is there, dD summed per head.
    #[test]
    fn the_skip_and_its_gradients_match_autograd() {
        for (rows, heads, p) in SHAPES {
            let mut rng = Rng::new((rows * 7 + heads * 3 + p) as u64);
            let y = randn(&mut rng, &[rows, heads, p], 1.0);
            let x = Var::from_tensor(&randn(&mut rng, &[rows, heads, p], 1.0)).unwrap();
            let d = Var::from_tensor(&randn(&mut rng, &[heads], 1.0)).unwrap();
            let dy = randn(&mut rng, &[rows, heads, p], 1.0);
            let dx_before = randn(&mut rng, &[rows, heads, p], 1.0);
            let d_col = d.as_tensor().unsqueeze(D::Minus1).unwrap();
            let out = y
                .add(&x.as_tensor().broadcast_mul(&d_col).unwrap())
                .unwrap();
            let grads = plain_grads(&out, &dy, &[&x, &d]);
            let dx_want: Vec<f32> = values(&dx_before)
                .iter()
                .zip(&grads[0])
                .map(|(a, b)| a + b)
                .collect();
            for launch_at in LAUNCHES {
                for schedule in crate::simt::SCHEDULES {
                    let at = format!("({rows}, {heads}, {p}), {launch_at:?}, {schedule:?}");
                    let shim = Shim { schedule };
                    let yb = shim.upload_f32(&values(&y)).unwrap();
                    let xb = shim.upload_f32(&values(x.as_tensor())).unwrap();
                    let db = shim.upload_f32(&values(d.as_tensor())).unwrap();
                    let gb = shim.upload_f32(&values(&dy)).unwrap();
                    let dxb = shim.upload_f32(&values(&dx_before)).unwrap();
                    let dd = shim.alloc(heads * 4).unwrap();
                    let sizes = [rows, heads, p].map(|v| Arg::I32(v as i32));
                    let fwd = [
                        &[Arg::Ptr(&yb, 0), Arg::Ptr(&xb, 0), Arg::Ptr(&db, 0)],
                        &sizes[..],
                    ];
                    launch_on(&shim, "mamba_skip_fwd_f32", launch_at, &fwd.concat());
                    let bwd = [
                        &[Arg::Ptr(&gb, 0), Arg::Ptr(&db, 0), Arg::Ptr(&dxb, 0)],
                        &sizes[..],
                    ];
                    launch_on(&shim, "mamba_skip_bwd_f32", launch_at, &bwd.concat());
                    let sums = [
                        &[Arg::Ptr(&gb, 0), Arg::Ptr(&xb, 0), Arg::Ptr(&dd, 0)],
                        &sizes[..],
                    ];
                    launch_on(&shim, "mamba_head_sums_f32", launch_at, &sums.concat());
                    let n = rows * heads * p;
                    assert_close(&shim.read_f32(&yb, 0, n).unwrap(), &values(&out), 1e-6, &at);
                    assert_close(&shim.read_f32(&dxb, 0, n).unwrap(), &dx_want, 1e-6, &at);
                    assert_close(&shim.read_f32(&dd, 0, heads).unwrap(), &grads[1], 1e-5, &at);
                }
            }
        }
    }

    /// A range of columns copied between matrices of different widths, into the middle of
    /// the destination and leaving its other columns as they were.
    #[test]
    fn copy_columns_moves_exactly_the_range() {
        for (rows, src_cols, dst_cols, width) in [(1, 1, 1, 1), (5, 9, 4, 3), (70, 33, 40, 20)] {
            let (src_offset, dst_offset) = (src_cols - width, dst_cols - width);
            let mut rng = Rng::new((rows + src_cols) as u64);
            let src = values(&randn(&mut rng, &[rows, src_cols], 1.0));
            let dst = values(&randn(&mut rng, &[rows, dst_cols], 1.0));
            let mut want = dst.clone();
            for r in 0..rows {
                for j in 0..width {
                    want[r * dst_cols + dst_offset + j] = src[r * src_cols + src_offset + j];
                }
            }
            for launch_at in LAUNCHES {
                let shim = Shim::default();
                let (s, d) = (
                    shim.upload_f32(&src).unwrap(),
                    shim.upload_f32(&dst).unwrap(),
                );
                let args = [
                    Arg::Ptr(&d, 0),
                    Arg::I32(dst_cols as i32),
                    Arg::I32(dst_offset as i32),
                    Arg::Ptr(&s, 0),
                    Arg::I32(src_cols as i32),
                    Arg::I32(src_offset as i32),
                    Arg::I32(rows as i32),
                    Arg::I32(width as i32),
                ];
                launch_on(&shim, "copy_columns_f32", launch_at, &args);
                let got = shim.read_f32(&d, 0, rows * dst_cols).unwrap();
                assert_eq!(
                    got, want,
                    "rows {rows}, {src_cols} → {dst_cols}, {launch_at:?}"
                );
            }
        }
    }
}
