//! Mamba-2's chunked SSD scan's CUDA kernels (`ssd.cu`), held to the recurrence they compute.
//! The CPU version lives in ops/model (`src/mamba2.rs`: `ssd_chunked`, tested there against
//! `ssd_sequential`); this file restates the sequential recurrence from candle ops as
//! `ssd_plain` and tests the kernels against it. Per row and head, with `A < 0` and `B`, `C`
//! of the head's group:
//!
//! ```text
//! S_t = keep_t · exp(Δ_t A) · S_{t−1} + Δ_t x_t ⊗ B_t        y_t = S_t · C_t
//! ```
//!
//! with `keep_t = 0` where token `t` starts a packed run (the state is forgotten).
//!
//! Must match: `ssd_plain` within 1e-6 relative to the largest `|y|` (the chunked form
//! sums in a different order and takes `exp` of cumulative sums, not products of `exp`; the
//! test shapes reach 3e-7), and autograd through it within 1e-5 relative to each gradient's
//! largest magnitude (the test shapes reach 5e-7).

#[cfg(test)]
mod tests {
    use crate::testing::*;
    use candle_core::{D, DType, Result};

    /// `(…, m, k) @ (…, k, n)` over the leading dimensions.
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

    /// `(B, T, G, N)` → `(B, T, H, N)`: head `h` reads group `h / (H/G)`.
    fn groups_to_heads(t: &Tensor, heads: usize) -> Result<Tensor> {
        let (b, l, g, n) = t.dims4()?;
        t.unsqueeze(3)?
            .broadcast_as((b, l, g, heads / g, n))?
            .reshape((b, l, heads, n))
    }

    /// The scan one token at a time from candle ops (ops/model's `ssd_sequential`):
    /// `x (B,T,H,P)`, `dt (B,T,H)`, `a (H)`, `b`, `c (B,T,G,N)`, `starts (B·T)`; `y (B,T,H,P)`.
    fn ssd_plain(
        x: &Tensor,
        dt: &Tensor,
        a: &Tensor,
        (b, c): (&Tensor, &Tensor),
        starts: &[usize],
    ) -> Result<Tensor> {
        let (batch, len, heads, p) = x.dims4()?;
        let n = b.dim(3)?;
        let (b, c) = (groups_to_heads(b, heads)?, groups_to_heads(c, heads)?);
        let mut state = Tensor::zeros((batch, heads, p, n), DType::F32, x.device())?;
        let mut ys = Vec::with_capacity(len);
        for t in 0..len {
            let keep: Vec<f32> = (0..batch)
                .map(|row| (starts[row * len + t] < t) as u8 as f32)
                .collect();
            let keep = Tensor::from_vec(keep, (batch, 1), x.device())?;
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

    /// The sizes of one scan.
    #[derive(Clone, Copy, Debug)]
    struct Dims {
        batch: usize,
        len: usize,
        heads: usize,
        p: usize,
        groups: usize,
        n: usize,
    }

    /// Random inputs of a scan: x, dt (Δ > 0, softplus-like), a (< 0), b, c.
    fn inputs(d: Dims, rng: &mut Rng, step: f64) -> [Tensor; 5] {
        let Dims {
            batch,
            len,
            heads,
            p,
            groups,
            n,
        } = d;
        let x = randn(rng, &[batch, len, heads, p], 1.0);
        let dt = randn(rng, &[batch, len, heads], 1.0).abs().unwrap();
        let dt = dt.affine(step, 0.01).unwrap();
        let a = (randn(rng, &[heads], 1.0).abs().unwrap().neg().unwrap() - 0.1).unwrap();
        let b = randn(rng, &[batch, len, groups, n], 1.0);
        let c = randn(rng, &[batch, len, groups, n], 1.0);
        [x, dt, a, b, c]
    }

    /// Run starts of `batch` rows of `len` tokens whose runs begin at `cuts` in every row.
    fn starts(batch: usize, len: usize, cuts: &[usize]) -> Vec<usize> {
        (0..batch * len)
            .map(|i| {
                let t = i % len;
                cuts.iter().copied().filter(|&c| c <= t).max().unwrap_or(0)
            })
            .collect()
    }

    /// The reference against the recurrence written out in f64, element by element.
    #[test]
    fn the_reference_is_the_recurrence() {
        let d = Dims {
            batch: 2,
            len: 7,
            heads: 4,
            p: 3,
            groups: 2,
            n: 5,
        };
        let mut rng = Rng::new(3);
        let [x, dt, a, b, c] = inputs(d, &mut rng, 1.0);
        let starts = starts(d.batch, d.len, &[3, 4]);
        let got = values(&ssd_plain(&x, &dt, &a, (&b, &c), &starts).unwrap());
        let [x, dt, a, b, c] = [&x, &dt, &a, &b, &c].map(values);
        let per_group = d.heads / d.groups;
        for row in 0..d.batch {
            for h in 0..d.heads {
                let mut s = vec![0f64; d.p * d.n];
                for t in 0..d.len {
                    let tok = row * d.len + t;
                    let delta = dt[tok * d.heads + h] as f64;
                    let keep = if starts[tok] < t { 1.0 } else { 0.0 };
                    let decay = keep * (delta * a[h] as f64).exp();
                    let bc = (tok * d.groups + h / per_group) * d.n;
                    for i in 0..d.p {
                        let xi = x[(tok * d.heads + h) * d.p + i] as f64;
                        let mut y = 0.0;
                        for k in 0..d.n {
                            let e = i * d.n + k;
                            s[e] = decay * s[e] + delta * xi * b[bc + k] as f64;
                            y += s[e] * c[bc + k] as f64;
                        }
                        let at = (tok * d.heads + h) * d.p + i;
                        assert!(
                            (got[at] as f64 - y).abs() < 1e-5,
                            "{at}: {} vs {y}",
                            got[at]
                        );
                    }
                }
            }
        }
    }

    /// What ssd.cu's four launches compute through the SIMT shim: y, for chunks of `chunk`
    /// tokens and `grid` blocks of `block` threads, in one schedule.
    fn cuda(
        [x, dt, a, b, c]: &[Vec<f32>; 5],
        starts: &[i32],
        (d, chunk): (Dims, usize),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let chunks = d.len.div_ceil(chunk);
        let items = d.batch * d.heads * chunks;
        let mut cs = vec![0f32; items * chunk];
        let (mut own, mut entering) =
            (vec![0f32; items * d.p * d.n], vec![0f32; items * d.p * d.n]);
        let mut y = vec![0f32; x.len()];
        let [batch, len, heads, p, groups, n, l] =
            [d.batch, d.len, d.heads, d.p, d.groups, d.n, chunk].map(|v| v as i32);
        let (x, dt, a, b, c, st) = (
            x.as_ptr(),
            dt.as_ptr(),
            a.as_ptr(),
            b.as_ptr(),
            c.as_ptr(),
            starts.as_ptr(),
        );
        let (csp, ownp, enp, yp) = (
            cs.as_mut_ptr(),
            own.as_mut_ptr(),
            entering.as_mut_ptr(),
            y.as_mut_ptr(),
        );
        // SAFETY: every buffer holds what ssd.cu's layouts index: x and y B·T·H·P values, dt
        // B·T·H, a H, b and c B·T·G·N, starts B·T, cs B·H·chunks·chunk, own and entering
        // B·H·chunks·P·N.
        unsafe {
            let cumsum = [
                arg(&dt),
                arg(&a),
                arg(&csp),
                arg(&batch),
                arg(&len),
                arg(&heads),
                arg(&l),
            ];
            launch_1d("ssd_chunk_cumsum_f32", grid, block, schedule, &cumsum).unwrap();
            let state = [
                arg(&x),
                arg(&dt),
                arg(&b),
                arg(&csp),
                arg(&st),
                arg(&ownp),
                arg(&batch),
                arg(&len),
                arg(&heads),
                arg(&p),
                arg(&groups),
                arg(&n),
                arg(&l),
            ];
            launch_1d("ssd_chunk_state_f32", grid, block, schedule, &state).unwrap();
            let passing = [
                arg(&csp),
                arg(&st),
                arg(&ownp),
                arg(&enp),
                arg(&batch),
                arg(&len),
                arg(&heads),
                arg(&p),
                arg(&n),
                arg(&l),
            ];
            launch_1d("ssd_state_passing_f32", grid, block, schedule, &passing).unwrap();
            let scan = [
                arg(&x),
                arg(&dt),
                arg(&b),
                arg(&c),
                arg(&csp),
                arg(&st),
                arg(&enp),
                arg(&yp),
                arg(&batch),
                arg(&len),
                arg(&heads),
                arg(&p),
                arg(&groups),
                arg(&n),
                arg(&l),
            ];
            launch_1d("ssd_chunk_scan_f32", grid, block, schedule, &scan).unwrap();
        }
        vec![y, entering]
    }

    /// What ssd.cu's backward computes through the SIMT shim from the forward's entering
    /// states: dx, ddt, da, db and dc.
    fn cuda_bwd(
        [x, dt, a, b, c]: &[Vec<f32>; 5],
        (starts, entering, dy): (&[i32], &[f32], &[f32]),
        (d, chunk): (Dims, usize),
        (grid, block): (u32, u32),
        schedule: Schedule,
    ) -> Vec<Vec<f32>> {
        use crate::simt::{arg, launch_1d};
        let rows = d.batch * d.heads;
        let mut scratch = vec![0f32; rows * (chunk + 5) * d.p * d.n];
        let (mut dx, mut ddt) = (vec![0f32; x.len()], vec![0f32; dt.len()]);
        let per_head = d.batch * d.len * d.heads * d.n;
        let (mut db_h, mut dc_h, mut da_row) =
            (vec![0f32; per_head], vec![0f32; per_head], vec![0f32; rows]);
        let (mut db, mut dc, mut da) = (
            vec![0f32; b.len()],
            vec![0f32; c.len()],
            vec![0f32; d.heads],
        );
        let [batch, len, heads, p, groups, n, l] =
            [d.batch, d.len, d.heads, d.p, d.groups, d.n, chunk].map(|v| v as i32);
        let (x, dt, a, b, c) = (x.as_ptr(), dt.as_ptr(), a.as_ptr(), b.as_ptr(), c.as_ptr());
        let (st, en, dy) = (starts.as_ptr(), entering.as_ptr(), dy.as_ptr());
        let (sp, dxp, ddtp) = (scratch.as_mut_ptr(), dx.as_mut_ptr(), ddt.as_mut_ptr());
        let (dbh, dch, dar) = (db_h.as_mut_ptr(), dc_h.as_mut_ptr(), da_row.as_mut_ptr());
        let (dbp, dcp, dap) = (db.as_mut_ptr(), dc.as_mut_ptr(), da.as_mut_ptr());
        // SAFETY: as the forward's buffers, plus scratch (chunk + 5)·P·N a (row, head), db_h
        // and dc_h B·T·H·N, da_row B·H, da H.
        unsafe {
            let bwd = [
                arg(&x),
                arg(&dt),
                arg(&a),
                arg(&b),
                arg(&c),
                arg(&st),
                arg(&en),
                arg(&dy),
                arg(&sp),
                arg(&dxp),
                arg(&ddtp),
                arg(&dbh),
                arg(&dch),
                arg(&dar),
                arg(&batch),
                arg(&len),
                arg(&heads),
                arg(&p),
                arg(&groups),
                arg(&n),
                arg(&l),
            ];
            launch_1d("ssd_bwd_f32", grid, block, schedule, &bwd).unwrap();
            let reduce = [
                arg(&dbh),
                arg(&dch),
                arg(&dar),
                arg(&dbp),
                arg(&dcp),
                arg(&dap),
                arg(&batch),
                arg(&len),
                arg(&heads),
                arg(&groups),
                arg(&n),
            ];
            launch_1d("ssd_bwd_reduce_f32", grid, block, schedule, &reduce).unwrap();
        }
        vec![dx, ddt, da, db, dc]
    }

    /// ssd.cu's backward, through the SIMT shim, against autograd through the recurrence:
    /// every input's gradient within 1e-5 of its largest magnitude, with packed runs, chunks
    /// that do not divide the sequence, several heads a group, blocks smaller than P·N (threads
    /// loop) and larger (threads idle), in both schedules (the same bytes).
    #[test]
    fn the_cuda_backward_matches_autograd_through_the_recurrence() {
        let dims = |batch, len, heads, p, groups, n| Dims {
            batch,
            len,
            heads,
            p,
            groups,
            n,
        };
        for (d, cuts, chunk, step) in [
            (dims(1, 1, 1, 1, 1, 1), vec![], 1, 1.0),
            (dims(2, 13, 4, 3, 2, 5), vec![3, 4, 8], 4, 1.0),
            (dims(2, 13, 4, 3, 1, 5), vec![], 5, 1.0),
            (dims(1, 30, 2, 16, 2, 8), vec![16, 17], 8, 0.3),
            (dims(2, 20, 2, 4, 2, 6), vec![5, 10], 64, 5.0),
        ] {
            let mut rng = Rng::new(d.len as u64 * 5 + d.n as u64);
            let inputs = inputs(d, &mut rng, step);
            let vars = inputs.each_ref().map(|t| Var::from_tensor(t).unwrap());
            let starts = starts(d.batch, d.len, &cuts);
            let [x, dt, a, b, c] = vars.each_ref().map(|v| v.as_tensor());
            let y = ssd_plain(x, dt, a, (b, c), &starts).unwrap();
            let dy = randn(&mut rng, y.dims(), 1.0);
            let want = plain_grads(&y, &dy, &vars.each_ref());
            let host = inputs.each_ref().map(values);
            let starts: Vec<i32> = starts.iter().map(|&s| s as i32).collect();
            let dyv = values(&dy);
            let [_, entering] = &cuda(&host, &starts, (d, chunk), (3, 64), Schedule::Forward)[..]
            else {
                unreachable!("the forward returns y and the entering states")
            };
            for launch in [(1, 32), (3, 64), (1, 256)] {
                let at = format!("{d:?}, chunk {chunk}, grid × block {launch:?}");
                let bwd = |s| cuda_bwd(&host, (&starts, entering, &dyv), (d, chunk), launch, s);
                let got = in_both_schedules(&at, bwd);
                for ((what, got), want) in
                    ["dx", "ddt", "da", "db", "dc"].iter().zip(&got).zip(&want)
                {
                    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
                    let gap = largest_gap(got, want) / scale;
                    assert!(gap < 1e-5, "{at}: {what} is {gap} (relative) from autograd");
                }
            }
        }
    }

    /// ssd.cu, executed by the SIMT shim, against the recurrence: y within 1e-6 of the largest
    /// |y|, with packed runs (one starting on a chunk's first token, one mid-chunk, runs of
    /// one token), chunks of 1 token, of sizes that do not divide the sequence and longer than
    /// it, one group and several, large steps (Δ = 5·|N(0, 1)| + 0.01: decays far below f32's
    /// precision), grids that loop and grids that leave blocks idle, in both schedules (the
    /// same bytes).
    #[test]
    fn the_cuda_kernels_match_the_recurrence() {
        let dims = |batch, len, heads, p, groups, n| Dims {
            batch,
            len,
            heads,
            p,
            groups,
            n,
        };
        for (d, cuts, chunks, step) in [
            (dims(1, 1, 1, 1, 1, 1), vec![], vec![1, 4], 1.0),
            (
                dims(2, 13, 4, 3, 2, 5),
                vec![3, 4, 8],
                vec![1, 4, 5, 64],
                1.0,
            ),
            (dims(2, 13, 4, 3, 1, 5), vec![], vec![4], 1.0),
            (dims(1, 40, 2, 16, 2, 8), vec![16, 17, 30], vec![8, 16], 0.3),
            (dims(2, 20, 2, 4, 2, 6), vec![5, 10], vec![8], 5.0),
        ] {
            let mut rng = Rng::new(d.len as u64 * 7 + d.p as u64);
            let inputs = inputs(d, &mut rng, step);
            let starts = starts(d.batch, d.len, &cuts);
            let [x, dt, a, b, c] = &inputs;
            let want = values(&ssd_plain(x, dt, a, (b, c), &starts).unwrap());
            let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
            let host = inputs.each_ref().map(values);
            let starts: Vec<i32> = starts.iter().map(|&s| s as i32).collect();
            for chunk in chunks {
                let items = (d.batch * d.heads * d.len.div_ceil(chunk)) as u32;
                for launch in [(1, 32), (3, 64), (items, 128), (items + 2, 32)] {
                    let at = format!("{d:?}, chunk {chunk}, grid × block {launch:?}");
                    let got =
                        in_both_schedules(&at, |s| cuda(&host, &starts, (d, chunk), launch, s));
                    let gap = largest_gap(&got[0], &want) / scale;
                    assert!(
                        gap < 1e-6,
                        "{at}: y is {gap} (relative) from the recurrence"
                    );
                }
            }
        }
    }
}
