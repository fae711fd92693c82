//! A mixture-of-experts layer's routing on a device (`moe.cu`): the router's sigmoid scores,
//! the gates of the chosen experts, the permutation of tokens into expert order
//! ([`Permutation`]) and back, and their backwards. The CPU layer is ops/model's `moe.rs`
//! (Megatron-LM's `topk_routing_with_score_function` with a sigmoid score); the references
//! below are the candle ops it is built from — `gather` and a normalisation for the gates,
//! `index_select` to dispatch, `index_add` to combine — and autograd through them is the
//! backward's.
//!
//! Which experts a token goes to is decided on the host (ops/model's `Moe::select`, from the
//! scores the device computed), then [`Permutation::of`] lays the choice out as the kernels
//! read it.
//!
//! Must match: the scores and gates within 1e-6 relative to their largest magnitude (the
//! device's `expf` is not the host's), the router's gradient within 1e-5 (another order of
//! the same terms), the dispatch and combine to the byte (the same products added in the same
//! order as `index_add`), the gate gradients within 1e-5 (a dot product in a tree).

/// Where each (token, chosen expert) pair goes when a micro-batch's tokens are laid out in
/// expert order, as `moe.cu` reads it. With `k` choices per token there are `rows · k`
/// permuted rows: expert 0's tokens in ascending order, then expert 1's, and so on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permutation {
    /// Per permuted row: the token it comes from.
    pub routes: Vec<u32>,
    /// Per permuted row: its (token, choice) slot, `token · k + j`, where its gate is.
    pub slots: Vec<u32>,
    /// Per token, `k` entries: its permuted rows, ascending (so in expert order).
    pub pos: Vec<u32>,
    /// Per expert `e`: its permuted rows are `offsets[e]..offsets[e + 1]` (`experts + 1`
    /// entries).
    pub offsets: Vec<usize>,
}

impl Permutation {
    /// The layout of `chosen` (row-major `(tokens, k)` expert ids, each below `experts`, a
    /// token's ids distinct), or a message naming the first id out of range.
    pub fn of(chosen: &[u32], experts: usize, k: usize) -> Result<Permutation, String> {
        if k == 0 || !chosen.len().is_multiple_of(k) {
            return Err(format!(
                "{} expert choices are not rows of {k}",
                chosen.len()
            ));
        }
        if let Some((slot, e)) = chosen
            .iter()
            .enumerate()
            .find(|(_, e)| **e as usize >= experts)
        {
            return Err(format!("choice {slot} names expert {e} of {experts}"));
        }
        let mut offsets = vec![0usize; experts + 1];
        for &e in chosen {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..experts {
            offsets[e + 1] += offsets[e];
        }
        let mut next = offsets.clone();
        let n = chosen.len();
        let (mut routes, mut slots, mut pos) = (vec![0u32; n], vec![0u32; n], vec![0u32; n]);
        // Slots in ascending order: each expert's tokens come out ascending.
        for (slot, &e) in chosen.iter().enumerate() {
            let row = next[e as usize];
            next[e as usize] += 1;
            routes[row] = (slot / k) as u32;
            slots[row] = slot as u32;
            pos[slot] = row as u32;
        }
        for token in pos.chunks_mut(k) {
            token.sort_unstable();
        }
        Ok(Permutation {
            routes,
            slots,
            pos,
            offsets,
        })
    }

    /// The permuted rows of expert `e`.
    pub fn rows_of(&self, e: usize) -> std::ops::Range<usize> {
        self.offsets[e]..self.offsets[e + 1]
    }
}

#[cfg(test)]
mod tests {
    use super::Permutation;
    use crate::launch::{Arg, Launcher, Shim};
    use crate::testing::*;
    use candle_core::D;

    type ShimBuffer = <Shim as Launcher>::Buffer;

    /// The launches tried: grids that loop, leave threads idle, or give every row its threads.
    const LAUNCHES: [(u32, u32); 4] = [(1, 32), (3, 64), (7, 128), (64, 256)];
    /// (tokens, experts, k, hidden): sizes that are not multiples of the block, k = 1 and
    /// k = experts among them.
    const SHAPES: [(usize, usize, usize, usize); 5] = [
        (1, 1, 1, 1),
        (7, 5, 2, 3),
        (33, 8, 3, 40),
        (50, 16, 1, 7),
        (9, 4, 4, 33),
    ];

    /// `k` distinct experts per token, in a random order (as a selection by s + bias gives).
    fn random_choice(rng: &mut Rng, tokens: usize, experts: usize, k: usize) -> Vec<u32> {
        (0..tokens)
            .flat_map(|_| {
                let mut all: Vec<u32> = (0..experts as u32).collect();
                for i in (1..experts).rev() {
                    let j = (rng.uniform() * (i + 1) as f64) as usize;
                    all.swap(i, j.min(i));
                }
                all.truncate(k);
                all
            })
            .collect()
    }

    fn ids(v: &[u32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
    }

    /// ops/model/src/moe.rs's gates: sigmoid from differentiable primitives, the chosen raw
    /// scores gathered, normalised when k > 1, scaled.
    fn gates_ref(logits: &Tensor, chosen: &[u32], k: usize, scaling: f64) -> (Tensor, Tensor) {
        let scores = (logits.neg().unwrap().exp().unwrap() + 1.0)
            .unwrap()
            .recip()
            .unwrap();
        let tokens = logits.dim(0).unwrap();
        let chosen = ids(chosen).reshape((tokens, k)).unwrap();
        let picked = scores.gather(&chosen, 1).unwrap();
        let gates = if k > 1 {
            let total = (picked.sum_keepdim(D::Minus1).unwrap() + 1e-20).unwrap();
            picked.broadcast_div(&total).unwrap()
        } else {
            picked
        };
        (scores, (gates * scaling).unwrap())
    }

    #[test]
    fn the_permutation_lays_tokens_out_in_expert_order() {
        // Tokens 0..3 choose (2, 0), (0, 1), (2, 1): expert 0 gets tokens 0, 1; expert 1
        // tokens 1, 2; expert 2 tokens 0, 2; expert 3 none.
        let p = Permutation::of(&[2, 0, 0, 1, 2, 1], 4, 2).unwrap();
        assert_eq!(p.offsets, [0, 2, 4, 6, 6]);
        assert_eq!(p.routes, [0, 1, 1, 2, 0, 2]);
        assert_eq!(p.slots, [1, 2, 3, 5, 0, 4]);
        assert_eq!(p.pos, [0, 4, 1, 2, 3, 5], "each token's rows, ascending");
        assert_eq!(p.rows_of(3), 6..6);
        for (row, &slot) in p.slots.iter().enumerate() {
            let (token, k) = (slot as usize / 2, 2);
            assert_eq!(p.routes[row] as usize, token);
            assert!(p.pos[token * k..token * k + k].contains(&(row as u32)));
        }
        assert!(
            Permutation::of(&[0, 4], 4, 2)
                .unwrap_err()
                .contains("expert 4")
        );
        assert!(Permutation::of(&[0, 1, 2], 4, 2).is_err(), "not rows of k");
    }

    /// Scores, gates and the router's gradient through both, against autograd through the
    /// CPU layer's candle ops.
    #[test]
    fn scores_gates_and_the_router_gradient_match_autograd() {
        for (tokens, experts, k, _) in SHAPES {
            let scaling = if k > 1 { 2.5 } else { 1.5 };
            let mut rng = Rng::new((tokens * 13 + experts * 3 + k) as u64);
            let logits = Var::from_tensor(&randn(&mut rng, &[tokens, experts], 2.0)).unwrap();
            let chosen = random_choice(&mut rng, tokens, experts, k);
            let dgates = randn(&mut rng, &[tokens, k], 1.0);
            let (scores, gates) = gates_ref(logits.as_tensor(), &chosen, k, scaling);
            let want = plain_grads(&gates, &dgates, &[&logits]).remove(0);
            let sizes = [tokens, experts, k].map(|v| Arg::I32(v as i32));
            for launch_at in LAUNCHES {
                let at = format!("({tokens}, {experts}, k {k}), {launch_at:?}");
                let got = in_both_schedules(&at, |schedule| {
                    let shim = Shim { schedule };
                    let s = shim.upload_f32(&values(logits.as_tensor())).unwrap();
                    let c = shim.upload_u32(&chosen).unwrap();
                    let dg = shim.upload_f32(&values(&dgates)).unwrap();
                    let g = shim.alloc(tokens * k * 4).unwrap();
                    let dl = shim.upload_f32(&vec![7.0; tokens * experts]).unwrap();
                    let n = Arg::Usize(tokens * experts);
                    launch_on(&shim, "moe_scores_f32", launch_at, &[Arg::Ptr(&s, 0), n]);
                    let (s_at, c_at) = (Arg::Ptr(&s, 0), Arg::Ptr(&c, 0));
                    let fwd = [&[s_at, c_at, Arg::Ptr(&g, 0)], &sizes[..]].concat();
                    let fwd = [&fwd[..], &[Arg::F32(scaling as f32)]].concat();
                    launch_on(&shim, "moe_gates_fwd_f32", launch_at, &fwd);
                    let bwd = [
                        &[s_at, c_at, Arg::Ptr(&dg, 0), Arg::Ptr(&dl, 0)],
                        &sizes[..],
                    ];
                    let bwd = [&bwd.concat()[..], &[Arg::F32(scaling as f32)]].concat();
                    launch_on(&shim, "moe_gates_bwd_f32", launch_at, &bwd);
                    let read = |b: &ShimBuffer, n| shim.read_f32(b, 0, n).unwrap();
                    vec![
                        read(&s, tokens * experts),
                        read(&g, tokens * k),
                        read(&dl, tokens * experts),
                    ]
                });
                assert_close(&got[0], &values(&scores), 1e-6, &at);
                assert_close(&got[1], &values(&gates), 1e-6, &at);
                assert_close(&got[2], &want, 1e-5, &at);
            }
        }
    }

    /// The CPU layer's dispatch and combine: per expert, its tokens' rows `index_select`ed,
    /// and `out.index_add(rows, y · g)` in expert order.
    fn combine_ref(base: &Tensor, yp: &Tensor, gates: &Tensor, p: &Permutation) -> Tensor {
        let experts = p.offsets.len() - 1;
        let gates = gates.flatten_all().unwrap();
        let mut out = base.clone();
        for e in 0..experts {
            let rows = p.rows_of(e);
            if rows.is_empty() {
                continue;
            }
            let tokens = ids(&p.routes[rows.clone()]);
            let slots = ids(&p.slots[rows.clone()]);
            let y = yp.narrow(0, rows.start, rows.len()).unwrap();
            let g = gates.index_select(&slots, 0).unwrap().unsqueeze(1).unwrap();
            out = out
                .index_add(&tokens, &y.broadcast_mul(&g).unwrap(), 0)
                .unwrap();
        }
        out
    }

    /// Dispatch (`x` into expert order), combine (weighted back onto `out`), and their
    /// backwards: the gradient of each permuted row (`dout` dispatched with its gate), of each
    /// gate (`dout · yp`), and of the input (the rows' gradients combined without gates).
    #[test]
    fn dispatch_and_combine_match_index_select_index_add_and_autograd() {
        for (tokens, experts, k, d) in SHAPES {
            let mut rng = Rng::new((tokens * 5 + experts * 11 + k * 7 + d) as u64);
            let p =
                Permutation::of(&random_choice(&mut rng, tokens, experts, k), experts, k).unwrap();
            let n = tokens * k;
            let x = Var::from_tensor(&randn(&mut rng, &[tokens, d], 1.0)).unwrap();
            let yp = Var::from_tensor(&randn(&mut rng, &[n, d], 1.0)).unwrap();
            let gates = Var::from_tensor(&randn(&mut rng, &[tokens, k], 1.0)).unwrap();
            let base = randn(&mut rng, &[tokens, d], 1.0);
            let dout = randn(&mut rng, &[tokens, d], 1.0);
            let dxp = randn(&mut rng, &[n, d], 1.0);
            let xp_want = x.as_tensor().index_select(&ids(&p.routes), 0).unwrap();
            let out_want = combine_ref(&base, yp.as_tensor(), gates.as_tensor(), &p);
            let grads = plain_grads(&out_want, &dout, &[&yp, &gates]);
            let dx_want = plain_grads(&xp_want, &dxp, &[&x]).remove(0);
            let sizes = [Arg::I32(n as i32), Arg::I32(d as i32)];
            for launch_at in LAUNCHES {
                let at = format!("({tokens}, {experts}, k {k}, d {d}), {launch_at:?}");
                let got = in_both_schedules(&at, |schedule| {
                    let shim = Shim { schedule };
                    let up = |t: &Tensor| shim.upload_f32(&values(t)).unwrap();
                    let (xb, yb, gb) =
                        (up(x.as_tensor()), up(yp.as_tensor()), up(gates.as_tensor()));
                    let (out, dob, dxpb) = (up(&base), up(&dout), up(&dxp));
                    let routes = shim.upload_u32(&p.routes).unwrap();
                    let slots = shim.upload_u32(&p.slots).unwrap();
                    let pos = shim.upload_u32(&p.pos).unwrap();
                    let (xp, dyp) = (
                        shim.alloc(n * d * 4).unwrap(),
                        shim.alloc(n * d * 4).unwrap(),
                    );
                    let dg = shim.alloc(n * 4).unwrap();
                    let dx = shim.upload_f32(&vec![7.0; tokens * d]).unwrap();
                    let (r, s) = (Arg::Ptr(&routes, 0), Arg::Ptr(&slots, 0));
                    let gather = |from, gates, to| [&[from, r, s, gates, to][..], &sizes].concat();
                    let dispatch = gather(Arg::Ptr(&xb, 0), Arg::Null, Arg::Ptr(&xp, 0));
                    launch_on(&shim, "moe_gather_f32", launch_at, &dispatch);
                    let routed = gather(Arg::Ptr(&dob, 0), Arg::Ptr(&gb, 0), Arg::Ptr(&dyp, 0));
                    launch_on(&shim, "moe_gather_f32", launch_at, &routed);
                    let shape = [tokens, k, d].map(|v| Arg::I32(v as i32));
                    let combine = |from, gates, base, to| {
                        [&[from, Arg::Ptr(&pos, 0), s, gates, base, to][..], &shape].concat()
                    };
                    let (yb, gb, ob) = (Arg::Ptr(&yb, 0), Arg::Ptr(&gb, 0), Arg::Ptr(&out, 0));
                    launch_on(
                        &shim,
                        "moe_combine_f32",
                        launch_at,
                        &combine(yb, gb, ob, ob),
                    );
                    // No base: what `dx` held (garbage) is overwritten.
                    let back = combine(Arg::Ptr(&dxpb, 0), Arg::Null, Arg::Null, Arg::Ptr(&dx, 0));
                    launch_on(&shim, "moe_combine_f32", launch_at, &back);
                    let dgates = [&[Arg::Ptr(&dob, 0), yb, r, s, Arg::Ptr(&dg, 0)][..], &sizes];
                    launch_on(&shim, "moe_gate_grads_f32", launch_at, &dgates.concat());
                    let read = |b: &ShimBuffer, n| shim.read_f32(b, 0, n).unwrap();
                    vec![
                        read(&xp, n * d),
                        read(&out, tokens * d),
                        read(&dyp, n * d),
                        read(&dg, n),
                        read(&dx, tokens * d),
                    ]
                });
                assert_eq!(got[0], values(&xp_want), "{at}: dispatch");
                assert_eq!(got[1], values(&out_want), "{at}: combine");
                assert_eq!(got[2], grads[0], "{at}: the permuted rows' gradient");
                assert_close(&got[3], &grads[1], 1e-5, &format!("{at}: gates"));
                assert_eq!(got[4], dx_want, "{at}: the input's gradient");
            }
        }
    }
}
