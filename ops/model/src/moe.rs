//! The mixture-of-experts layer of Nemotron-H's `E` blocks: a sigmoid router with top-k
//! selection, routed experts, an optional shared expert, and aux-loss-free load balancing
//! (Megatron-LM `megatron/core/transformer/moe/moe_utils.py: topk_routing_with_score_function`,
//! `moe/router.py`, DeepSeek-V3's expert bias).
//!
//! For every token `x` (a row of the `(B, T, hidden)` input):
//!
//! 1. **Scores.** `s = sigmoid(router · x)`, one independent score in (0, 1) per expert, in f32
//!    (not a softmax: experts do not compete for probability mass).
//! 2. **Selection.** The `k` experts with the largest `s + bias` are chosen. The per-expert
//!    `bias` is not trained by gradient; it only decides *which* experts a token goes to.
//! 3. **Gates.** The weight of a chosen expert uses the raw score, never the bias:
//!    `g_e = s_e / (Σ_chosen s + 1e-20)` when `k > 1` (just `s_e` when `k = 1`), times the
//!    scaling factor (`moe_router_topk_scaling_factor`, 2.5 in Nemotron 3).
//! 4. **Experts.** Each expert is a small MLP: `fc1 → activation → fc2`, with squared ReLU
//!    (Nemotron, not gated) or SwiGLU (`fc1` makes `[gate, up]`, output `SiLU(gate) ⊙ up`).
//! 5. **Output.** `Σ_chosen g_e · expert_e(x) + shared(x)`, where the shared expert (when
//!    configured) sees every token. The surrounding block adds the residual.
//!
//! Tokens are dispatched, not densely computed: for expert `e` the rows routed to it are
//! gathered (`index_select`), run through the expert, scaled by their gates and scattered back
//! (`index_add`). An expert that receives no token is not run (and gets no gradient).
//!
//! **Aux-loss-free balancing.** During a training forward the layer counts, per expert, the
//! (non-padding) tokens routed to it. After each global batch [`Moe::update_bias`] nudges
//! every bias by a fixed step towards balance, `bias_e += rate · sign(mean(counts) − count_e)`
//! (0 when equal), so under-used experts become more likely to be selected, over-used less;
//! then the counts restart from zero. The bias and counts sit behind mutexes so the layer is
//! `Send + Sync` and a forward can take `&self`.

use super::config::{Activation, MoeConfig};
use super::layers::{Mlp, linear};
use super::params::Init;
use candle_core::{D, DType, Result, Tensor};
use std::sync::{Mutex, MutexGuard};

/// `1 / (1 + e^{−v})`, from differentiable primitives.
fn sigmoid(v: &Tensor) -> Result<Tensor> {
    (v.neg()?.exp()? + 1.0)?.recip()
}

/// A poisoned lock (a panic elsewhere while holding it) still holds valid numbers.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which experts each token goes to, and with what weight.
pub struct Routing {
    /// Row-major `(tokens, k)`: the chosen experts, best `s + bias` first.
    pub experts: Vec<u32>,
    /// `(tokens, k)` gate weights (normalised raw scores × scaling), differentiable.
    pub gates: Tensor,
}

/// A mixture-of-experts layer.
pub struct Moe {
    router: Tensor,
    experts: Vec<Mlp>,
    shared: Option<Mlp>,
    top_k: usize,
    scaling: f64,
    rate: f64,
    /// Selection bias per expert (f32, moved by [`Moe::update_bias`], not by gradient).
    bias: Mutex<Vec<f32>>,
    /// Tokens routed to each expert since the last bias update.
    counts: Mutex<Vec<u64>>,
}

impl Moe {
    /// Parameter names, in order: router, experts.{e}.fc1, experts.{e}.fc2 (for e in 0..E),
    /// shared.fc1, shared.fc2 (when shared_ffn > 0). fc2 ~ N(0, out_std), the rest N(0, std).
    pub fn new(
        init: &mut Init,
        hidden: usize,
        cfg: &MoeConfig,
        activation: Activation,
        std: f64,
        out_std: f64,
    ) -> Result<Moe> {
        let e = cfg.experts;
        if e == 0 || cfg.top_k == 0 || cfg.top_k > e || cfg.expert_ffn == 0 {
            candle_core::bail!(
                "moe needs experts > 0, 0 < top_k <= experts and expert_ffn > 0 (got {e} experts, top_k {}, expert_ffn {})",
                cfg.top_k,
                cfg.expert_ffn
            )
        }
        let router = init.normal("router", &[e, hidden], std)?;
        let experts = (0..e)
            .map(|i| {
                let mut sub = init.sub(&format!("experts.{i}"));
                Mlp::new(&mut sub, hidden, cfg.expert_ffn, activation, std, out_std)
            })
            .collect::<Result<Vec<_>>>()?;
        let shared = if cfg.shared_ffn > 0 {
            let mut sub = init.sub("shared");
            Some(Mlp::new(
                &mut sub,
                hidden,
                cfg.shared_ffn,
                activation,
                std,
                out_std,
            )?)
        } else {
            None
        };
        Ok(Moe {
            router,
            experts,
            shared,
            top_k: cfg.top_k,
            scaling: cfg.scaling,
            rate: cfg.bias_update_rate,
            bias: Mutex::new(vec![0.0; e]),
            counts: Mutex::new(vec![0; e]),
        })
    }

    /// Step 2 for the scores `s` of some tokens (row-major `(tokens, experts)`): each token's
    /// `k` experts with the largest `s + bias`, best first, ties to the lower expert index.
    /// The GPU trainer calls it on the scores its device computed.
    pub fn select(&self, scores: &[f32]) -> Vec<u32> {
        let (e, k) = (self.experts.len(), self.top_k);
        let bias = lock(&self.bias).clone();
        let mut experts = Vec::with_capacity(scores.len() / e * k);
        let mut order: Vec<usize> = (0..e).collect();
        for row in scores.chunks(e) {
            order.sort_by(|&a, &b| (row[b] + bias[b]).total_cmp(&(row[a] + bias[a])));
            experts.extend(order[..k].iter().map(|&i| i as u32));
            order.sort_unstable();
        }
        experts
    }

    /// Counts, for the next bias update, the chosen experts (row-major `(tokens, k)`) of every
    /// token whose `valid` entry is true (None: all).
    pub fn count(&self, chosen: &[u32], valid: Option<&[bool]>) {
        let mut counts = lock(&self.counts);
        for (i, token) in chosen.chunks(self.top_k).enumerate() {
            if valid.is_none_or(|v| v.get(i).copied().unwrap_or(false)) {
                for &e in token {
                    counts[e as usize] += 1;
                }
            }
        }
    }

    /// Steps 1–3 for `x (tokens, hidden)`: sigmoid scores, top-k on `s + bias`, gates from the
    /// raw scores.
    pub fn route(&self, x: &Tensor) -> Result<Routing> {
        let (tokens, _) = x.dims2()?;
        let k = self.top_k;
        let scores = sigmoid(&linear(&x.to_dtype(DType::F32)?, &self.router)?)?; // (tokens, E)

        // Selection happens on the host: it is discrete, and the bias takes part only here.
        let experts = self.select(&scores.detach().flatten_all()?.to_vec1::<f32>()?);

        let chosen = Tensor::from_vec(experts.clone(), (tokens, k), x.device())?;
        let picked = scores.gather(&chosen, 1)?; // raw s of the chosen experts
        let gates = if k > 1 {
            picked.broadcast_div(&(picked.sum_keepdim(D::Minus1)? + 1e-20)?)?
        } else {
            picked
        };
        Ok(Routing {
            experts,
            gates: (gates * self.scaling)?,
        })
    }

    /// x: (B, T, hidden) → (B, T, hidden), no residual. With `count` (a training forward) the
    /// chosen experts of every token whose `valid` entry is true (None: all) are counted.
    pub fn forward(&self, x: &Tensor, count: bool, valid: Option<&[bool]>) -> Result<Tensor> {
        let (b, t, hidden) = x.dims3()?;
        let tokens = b * t;
        if let Some(v) = valid
            && v.len() != tokens
        {
            candle_core::bail!(
                "moe: {} validity flags for {tokens} tokens ({b} rows of {t})",
                v.len()
            )
        }
        let xs = x.reshape((tokens, hidden))?;
        let routing = self.route(&xs)?;
        let k = self.top_k;

        if count {
            self.count(&routing.experts, valid);
        }

        // Group (token, slot) pairs by expert: which rows each expert sees, and their gates.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        for (slot, &e) in routing.experts.iter().enumerate() {
            rows[e as usize].push((slot / k) as u32);
            slots[e as usize].push(slot as u32);
        }
        let gates = routing.gates.to_dtype(x.dtype())?.flatten_all()?;

        let mut out = match &self.shared {
            Some(shared) => shared.forward(&xs)?,
            None => xs.zeros_like()?,
        };
        for (e, expert) in self.experts.iter().enumerate() {
            if rows[e].is_empty() {
                continue;
            }
            let n = rows[e].len();
            let idx = Tensor::from_vec(std::mem::take(&mut rows[e]), n, x.device())?;
            let slot = Tensor::from_vec(std::mem::take(&mut slots[e]), n, x.device())?;
            let y = expert.forward(&xs.index_select(&idx, 0)?)?;
            let g = gates.index_select(&slot, 0)?.unsqueeze(1)?;
            out = out.index_add(&idx, &y.broadcast_mul(&g)?, 0)?;
        }
        out.reshape((b, t, hidden))
    }

    /// After each global batch: `bias_e += rate · sign(mean(counts) − count_e)` (0 when equal),
    /// then the counts restart from 0.
    pub fn update_bias(&self) {
        let mut counts = lock(&self.counts);
        let mut bias = lock(&self.bias);
        let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
        for (b, &c) in bias.iter_mut().zip(counts.iter()) {
            let c = c as f64;
            let sign = if mean > c {
                1.0
            } else if mean < c {
                -1.0
            } else {
                0.0
            };
            *b += (sign * self.rate) as f32;
        }
        counts.iter_mut().for_each(|c| *c = 0);
    }

    pub fn bias(&self) -> Vec<f32> {
        lock(&self.bias).clone()
    }

    /// Replace the bias (restoring a checkpoint); errors on a wrong length.
    pub fn set_bias(&self, bias: &[f32]) -> Result<()> {
        let mut current = lock(&self.bias);
        if bias.len() != current.len() {
            candle_core::bail!(
                "moe: a bias of {} values for {} experts",
                bias.len(),
                current.len()
            )
        }
        current.copy_from_slice(bias);
        Ok(())
    }

    pub fn counts(&self) -> Vec<u64> {
        lock(&self.counts).clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{ParamStore, Rng, constant_f32, to_f32_vec};

    fn config(experts: usize, top_k: usize, shared_ffn: usize, scaling: f64) -> MoeConfig {
        MoeConfig {
            experts,
            top_k,
            expert_ffn: 6,
            shared_ffn,
            scaling,
            bias_update_rate: 1e-3,
        }
    }

    fn build(hidden: usize, cfg: &MoeConfig, act: Activation, seed: u64) -> (Moe, ParamStore) {
        let mut rng = Rng::new(seed);
        let mut store = ParamStore::default();
        let moe = Moe::new(
            &mut Init::new(&mut rng, &mut store),
            hidden,
            cfg,
            act,
            0.5,
            0.3,
        )
        .unwrap();
        (moe, store)
    }

    fn randn(shape: &[usize], seed: u64) -> Tensor {
        let mut rng = Rng::new(seed);
        let n = shape.iter().product();
        constant_f32((0..n).map(|_| rng.normal() as f32).collect(), shape).unwrap()
    }

    fn values(store: &ParamStore, name: &str) -> Vec<f64> {
        to_f32_vec(store.get(name).unwrap().as_tensor())
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    }

    /// `W (out, in) · x`.
    fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
        w.chunks(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    fn expert_ref(store: &ParamStore, prefix: &str, act: Activation, x: &[f64]) -> Vec<f64> {
        let h = matvec(&values(store, &format!("{prefix}.fc1")), x);
        let a: Vec<f64> = match act {
            Activation::Relu2 => h.iter().map(|v| v.max(0.0).powi(2)).collect(),
            Activation::Swiglu => {
                let f = h.len() / 2;
                (0..f)
                    .map(|i| h[i] / (1.0 + (-h[i]).exp()) * h[f + i])
                    .collect()
            }
        };
        matvec(&values(store, &format!("{prefix}.fc2")), &a)
    }

    fn scores_ref(store: &ParamStore, x: &[f64]) -> Vec<f64> {
        matvec(&values(store, "router"), x)
            .iter()
            .map(|v| 1.0 / (1.0 + (-v).exp()))
            .collect()
    }

    /// The layer, one token at a time, in f64, straight from the definition.
    fn dense_ref(
        moe: &Moe,
        store: &ParamStore,
        cfg: &MoeConfig,
        act: Activation,
        x: &Tensor,
    ) -> (Vec<f64>, Vec<Vec<usize>>) {
        let hidden = x.dim(2).unwrap();
        let xs: Vec<f64> = to_f32_vec(x).unwrap().into_iter().map(f64::from).collect();
        let bias = moe.bias();
        let mut out = Vec::new();
        let mut chosen_all = Vec::new();
        for tok in xs.chunks(hidden) {
            let s = scores_ref(store, tok);
            let mut order: Vec<usize> = (0..cfg.experts).collect();
            order.sort_by(|&a, &b| (s[b] + bias[b] as f64).total_cmp(&(s[a] + bias[a] as f64)));
            let chosen = order[..cfg.top_k].to_vec();
            let total: f64 = chosen.iter().map(|&e| s[e]).sum();
            let mut y = vec![0.0; hidden];
            if cfg.shared_ffn > 0 {
                y = expert_ref(store, "shared", act, tok);
            }
            for &e in &chosen {
                let gate = if cfg.top_k > 1 {
                    s[e] / (total + 1e-20)
                } else {
                    s[e]
                } * cfg.scaling;
                let ye = expert_ref(store, &format!("experts.{e}"), act, tok);
                for i in 0..hidden {
                    y[i] += gate * ye[i];
                }
            }
            out.extend(y);
            chosen_all.push(chosen);
        }
        (out, chosen_all)
    }

    fn assert_close(got: &Tensor, want: &[f64], tol: f64) -> f64 {
        let got = to_f32_vec(got).unwrap();
        assert_eq!(got.len(), want.len());
        let worst = got
            .iter()
            .zip(want)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(worst < tol, "max |moe − reference| = {worst}");
        worst
    }

    #[test]
    fn parameters_are_named_in_order_with_the_activation_shapes() {
        let (_, store) = build(5, &config(3, 2, 4, 1.0), Activation::Swiglu, 1);
        let names: Vec<(&str, Vec<usize>)> =
            store.iter().map(|(n, v)| (n, v.dims().to_vec())).collect();
        let want: Vec<(&str, Vec<usize>)> = vec![
            ("router", vec![3, 5]),
            ("experts.0.fc1", vec![12, 5]),
            ("experts.0.fc2", vec![5, 6]),
            ("experts.1.fc1", vec![12, 5]),
            ("experts.1.fc2", vec![5, 6]),
            ("experts.2.fc1", vec![12, 5]),
            ("experts.2.fc2", vec![5, 6]),
            ("shared.fc1", vec![8, 5]),
            ("shared.fc2", vec![5, 4]),
        ];
        assert_eq!(names, want);
        let (_, store) = build(5, &config(2, 1, 0, 1.0), Activation::Relu2, 1);
        let names: Vec<(&str, Vec<usize>)> =
            store.iter().map(|(n, v)| (n, v.dims().to_vec())).collect();
        assert_eq!(names[1], ("experts.0.fc1", vec![6, 5]));
        assert_eq!(names.len(), 5, "no shared expert");
        let std = |v: Vec<f64>| (v.iter().map(|a| a * a).sum::<f64>() / v.len() as f64).sqrt();
        let (_, big) = build(64, &config(2, 1, 0, 1.0), Activation::Relu2, 2);
        assert!((std(values(&big, "experts.0.fc1")) - 0.5).abs() < 0.05);
        assert!(
            (std(values(&big, "experts.0.fc2")) - 0.3).abs() < 0.03,
            "fc2 uses out_std"
        );
    }

    #[test]
    fn output_equals_a_dense_per_token_reference() {
        for (act, k, shared, scaling) in [
            (Activation::Relu2, 2, 8, 2.5),
            (Activation::Swiglu, 3, 0, 1.0),
            (Activation::Relu2, 1, 0, 2.0),
            (Activation::Swiglu, 2, 5, 1.5),
        ] {
            let cfg = config(5, k, shared, scaling);
            let (moe, store) = build(7, &cfg, act, 3);
            let x = randn(&[2, 6, 7], 4);
            moe.set_bias(&[0.05, -0.02, 0.0, 0.1, -0.1]).unwrap();
            let got = moe.forward(&x, false, None).unwrap();
            assert_eq!(got.dims(), [2, 6, 7]);
            let (want, _) = dense_ref(&moe, &store, &cfg, act, &x);
            let worst = assert_close(&got, &want, 1e-4);
            eprintln!("{act:?} k={k} shared={shared}: max |moe − dense| = {worst:e}");
        }
    }

    #[test]
    fn gates_of_chosen_experts_are_normalised_and_scaled() {
        let x = randn(&[10, 6], 5);
        for (k, scaling) in [(3, 2.5), (1, 2.0)] {
            let cfg = config(6, k, 0, scaling);
            let (moe, store) = build(6, &cfg, Activation::Relu2, 6);
            let r = moe.route(&x).unwrap();
            let gates = r.gates.to_vec2::<f32>().unwrap();
            let xs: Vec<f64> = to_f32_vec(&x).unwrap().into_iter().map(f64::from).collect();
            for (i, tok) in xs.chunks(6).enumerate() {
                let s = scores_ref(&store, tok);
                let chosen = &r.experts[i * k..(i + 1) * k];
                let total: f64 = chosen.iter().map(|&e| s[e as usize]).sum();
                for (j, &e) in chosen.iter().enumerate() {
                    let want = if k > 1 {
                        s[e as usize] / total
                    } else {
                        s[e as usize]
                    } * scaling;
                    assert!(
                        (gates[i][j] as f64 - want).abs() < 1e-5,
                        "token {i} expert {e}"
                    );
                }
                if k > 1 {
                    let sum: f32 = gates[i].iter().sum();
                    assert!(
                        (sum as f64 - scaling).abs() < 1e-5,
                        "gates sum to the scaling factor"
                    );
                }
                // Top-k by score (no bias here): no unchosen expert scores higher.
                let worst_chosen = chosen
                    .iter()
                    .map(|&e| s[e as usize])
                    .fold(f64::MAX, f64::min);
                assert!(
                    (0..6)
                        .filter(|e| !chosen.contains(&(*e as u32)))
                        .all(|e| s[e] < worst_chosen)
                );
            }
        }
    }

    #[test]
    fn the_bias_changes_which_experts_but_not_the_gate_values() {
        let cfg = config(4, 2, 0, 2.5);
        let (moe, store) = build(6, &cfg, Activation::Relu2, 7);
        let x = randn(&[1, 3, 6], 8);
        let xs = x.reshape((3, 6)).unwrap();
        let before = moe.route(&xs).unwrap();
        let tok: Vec<f64> = to_f32_vec(&xs.narrow(0, 0, 1).unwrap())
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        let s = scores_ref(&store, &tok);
        // The expert token 0 likes least gets a large bias: now it is always chosen, first.
        let low = (0..4).min_by(|&a, &b| s[a].total_cmp(&s[b])).unwrap();
        assert!(!before.experts[..2].contains(&(low as u32)));
        let mut bias = vec![0.0; 4];
        bias[low] = 5.0;
        moe.set_bias(&bias).unwrap();
        let after = moe.route(&xs).unwrap();
        assert_eq!(
            after.experts[0], low as u32,
            "the bias decides the selection"
        );
        assert_ne!(after.experts[..2], before.experts[..2]);
        let other = after.experts[1] as usize;
        let gates = after.gates.to_vec2::<f32>().unwrap();
        // Gates come from the raw scores: s_low / (s_low + s_other), not (s_low + 5) / (…).
        let want_low = s[low] / (s[low] + s[other]) * 2.5;
        let want_other = s[other] / (s[low] + s[other]) * 2.5;
        assert!(
            (gates[0][0] as f64 - want_low).abs() < 1e-5,
            "{} vs {want_low}",
            gates[0][0]
        );
        assert!((gates[0][1] as f64 - want_other).abs() < 1e-5);
        // The forward follows the biased selection.
        let (want, chosen) = dense_ref(&moe, &store, &cfg, Activation::Relu2, &x);
        assert!(chosen.iter().all(|c| c[0] == low));
        assert_close(&moe.forward(&x, false, None).unwrap(), &want, 1e-4);
        assert!(moe.set_bias(&[0.0; 3]).is_err(), "wrong length");
    }

    #[test]
    fn the_shared_expert_is_added_to_every_token() {
        // Same seed: the router and routed experts are drawn first, so they are identical.
        let (with, store) = build(6, &config(4, 2, 8, 2.5), Activation::Relu2, 9);
        let (without, _) = build(6, &config(4, 2, 0, 2.5), Activation::Relu2, 9);
        let x = randn(&[2, 3, 6], 10);
        let diff = (with.forward(&x, false, None).unwrap()
            - without.forward(&x, false, None).unwrap())
        .unwrap();
        let xs: Vec<f64> = to_f32_vec(&x).unwrap().into_iter().map(f64::from).collect();
        let want: Vec<f64> = xs
            .chunks(6)
            .flat_map(|t| expert_ref(&store, "shared", Activation::Relu2, t))
            .collect();
        assert_close(&diff, &want, 1e-4);
        assert!(want.iter().any(|v| v.abs() > 1e-2));
    }

    /// Router = 10·I on one-hot tokens: token "e" goes to expert e (k = 1).
    fn steered(seed: u64) -> (Moe, ParamStore) {
        let cfg = config(4, 1, 0, 1.0);
        let (moe, store) = build(4, &cfg, Activation::Relu2, seed);
        let eye: Vec<f32> = (0..16)
            .map(|i| if i % 5 == 0 { 10.0 } else { 0.0 })
            .collect();
        store
            .get("router")
            .unwrap()
            .set(&constant_f32(eye, &[4, 4]).unwrap())
            .unwrap();
        (moe, store)
    }

    fn one_hot(experts: &[usize]) -> Tensor {
        let mut v = vec![0f32; experts.len() * 4];
        for (i, &e) in experts.iter().enumerate() {
            v[i * 4 + e] = 1.0;
        }
        constant_f32(v, &[1, experts.len(), 4]).unwrap()
    }

    #[test]
    fn counting_skips_padding_and_eval_forwards() {
        let (moe, _) = steered(11);
        let x = one_hot(&[0, 0, 1, 1, 2, 2, 2, 3, 3, 3]);
        let mut valid = vec![true; 10];
        valid[8] = false; // two padding tokens routed to expert 3
        valid[9] = false;
        moe.forward(&x, true, Some(&valid)).unwrap();
        assert_eq!(moe.counts(), [2, 2, 3, 1]);
        moe.forward(&x, false, Some(&valid)).unwrap();
        moe.forward(&x, false, None).unwrap();
        assert_eq!(
            moe.counts(),
            [2, 2, 3, 1],
            "count = false leaves the counts alone"
        );
        moe.forward(&x, true, None).unwrap();
        assert_eq!(moe.counts(), [4, 4, 6, 4], "None = every token counts");
        assert!(
            moe.forward(&x, true, Some(&valid[..3])).is_err(),
            "wrong validity length"
        );
    }

    #[test]
    fn update_bias_moves_each_bias_by_the_sign_of_mean_minus_count() {
        let (moe, _) = steered(12);
        let start = [0.02f32, -0.03, 0.0, 1e-4];
        moe.set_bias(&start).unwrap();
        // Small biases: the one-hot routing (scores ≈ 1 vs 0.5) still decides.
        moe.forward(&one_hot(&[0, 0, 1, 1, 2, 2, 2, 3]), true, None)
            .unwrap();
        let counts = moe.counts();
        assert_eq!(counts, [2, 2, 3, 1]); // mean 2: equal, equal, above, below
        moe.update_bias();
        let rate = 1e-3f32;
        let want = [start[0], start[1], start[2] - rate, start[3] + rate];
        assert_eq!(moe.bias(), want, "exactly ±rate (f32) or unchanged");
        let moved: Vec<f32> = moe.bias().iter().zip(&start).map(|(a, b)| a - b).collect();
        assert_eq!(moved[..2], [0.0, 0.0]);
        assert!(
            (moved[2] + 1e-3).abs() < 1e-7 && (moved[3] - 1e-3).abs() < 1e-7,
            "{moved:?}"
        );
        assert_eq!(moe.counts(), [0, 0, 0, 0], "counts reset");
        // A second batch with nothing counted: every count equals the mean (0), nothing moves.
        moe.update_bias();
        assert_eq!(moe.bias(), want);
        // Under-used experts rise, over-used fall: mean 1.5 over counts [3, 0, 2, 1].
        moe.forward(&one_hot(&[0, 0, 0, 2, 2, 3]), true, None)
            .unwrap();
        moe.update_bias();
        let after = moe.bias();
        let signs: Vec<f32> = after
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).signum())
            .collect();
        assert_eq!(signs, [-1.0, 1.0, -1.0, 1.0]);
    }

    #[test]
    fn every_parameter_gets_a_gradient_except_idle_experts() {
        let cfg = config(5, 2, 6, 2.5);
        for act in [Activation::Relu2, Activation::Swiglu] {
            let (moe, store) = build(6, &cfg, act, 13);
            moe.set_bias(&[0.0, 0.0, -100.0, 0.0, 0.0]).unwrap(); // expert 2 never chosen
            let x = randn(&[2, 8, 6], 14);
            let loss = moe
                .forward(&x, true, None)
                .unwrap()
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            assert_eq!(moe.counts()[2], 0);
            for (name, var) in store.iter() {
                let g = grads.get(var.as_tensor());
                if name.starts_with("experts.2.") {
                    assert!(g.is_none(), "{name}: an idle expert has no gradient");
                    continue;
                }
                let g = g.unwrap_or_else(|| panic!("{act:?} {name}: no gradient"));
                assert_eq!(g.dims(), var.dims());
                let norm: f32 = to_f32_vec(g).unwrap().iter().map(|v| v.abs()).sum();
                assert!(
                    norm > 0.0 && norm.is_finite(),
                    "{act:?} {name}: |grad| = {norm}"
                );
            }
        }
    }

    #[test]
    fn the_layer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Moe>();
    }
}
