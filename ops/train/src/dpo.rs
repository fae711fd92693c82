//! Direct Preference Optimization (Rafailov et al. 2023) as NeMo-RL computes it
//! (`nemo_rl/algorithms/loss/loss_functions.py: DPOLossFn`): the loss of tokenized preference
//! pairs against a frozen reference model, as a training [`Objective`].
//!
//! **Loss.** With `π_θ` the policy (starting from the upstream weights) and `π_ref` a second,
//! frozen copy of the same weights, each completion `y` of prompt `x` gets
//!
//! ```text
//! r(y) = Σ_t [log π_θ(y_t | x, y_<t) − log π_ref(y_t | x, y_<t)]     over response tokens
//!        (÷ the response's token count when preference_average_log_probs)
//! Δ    = r(chosen) − r(rejected)
//! L    = preference_loss_weight · mean_pairs[−log σ(β·Δ)]
//!      + sft_loss_weight        · mean_pairs[−(1/|chosen|) Σ_t log π_θ(chosen_t | …)]
//! ```
//!
//! with `−log σ(z) = softplus(−z)` computed stably. The mean is over the global batch's pairs:
//! every micro-batch divides by the global pair count, so the gradients of the micro-batches
//! add up to the global batch's. At the first step `π_θ = π_ref`, so `Δ = 0` and `L = ln 2`.
//!
//! **Batches.** A micro-batch of `m` pairs is `2m` rows, chosen and rejected interleaved (even
//! rows chosen, odd rows rejected), padded on the right to the longest row with mask 0 (padding
//! after a row's end cannot change its tokens under a causal model). Pairs are visited in a
//! seeded order reshuffled every epoch, a pure function of the step, so a resumed run sees what
//! an uninterrupted one would. The reference log-probabilities are recomputed with each
//! micro-batch, in the same layout as the policy's (no cache: a run rarely sees a pair twice).
//! On a GPU both models run on the device and the loss's derivative in each token's
//! log-probability is taken on the host ([`PerToken::grad`]).
//!

use crate::order::RowOrder;
use crate::{MicroLoss, Objective, PerToken, Schedule, Tally, TokenGrad, err, token_logprobs};
use candle_core::{DType, Tensor};
use model::layers::Layout;
use model::net::{Batch, Model};
use nemo_dag_op::RunError;
use std::borrow::Cow;
use std::collections::BTreeMap;

/// A tokenized conversation: `ids[start..]` is the response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    pub ids: Vec<u32>,
    pub start: usize,
}

impl Sequence {
    /// Response tokens (each predicted from the tokens before it).
    pub fn response_len(&self) -> usize {
        self.ids.len() - self.start
    }
}

/// A tokenized preference pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub chosen: Sequence,
    pub rejected: Sequence,
}

/// The loss's settings (the params of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossConfig {
    pub beta: f64,
    pub average_log_probs: bool,
    pub preference_weight: f64,
    pub sft_weight: f64,
}

/// One micro-batch's share of the global batch's loss, and its figures summed over its pairs.
pub struct Terms {
    /// The micro-batch's part of the global loss, to differentiate.
    pub total: Tensor,
    pub sums: PairSums,
}

/// A micro-batch's figures, summed over its pairs.
#[derive(Debug, Default)]
pub struct PairSums {
    /// Σ over pairs of the pair's weighted loss.
    pub loss_sum: f64,
    /// Σ −log σ(β·Δ).
    pub preference_sum: f64,
    /// Σ chosen mean-token NLL.
    pub sft_sum: f64,
    /// Pairs with Δ > 0.
    pub correct: f64,
    /// Σ Δ.
    pub margin_sum: f64,
}

/// `softplus(x) = log(1 + eˣ)`, stable for any `x`: `max(x, 0) + log(1 + e^(−|x|))`. The
/// branch is chosen by a constant mask, so the gradient at `x = 0` is σ(0) = ½ whatever
/// convention the library's `relu`/`abs` follow at 0 — and at the first DPO step every Δ is
/// exactly 0.
fn softplus(x: &Tensor) -> candle_core::Result<Tensor> {
    let pos = x.ge(0.0)?.to_dtype(x.dtype())?.detach();
    let relu = (x * &pos)?;
    let abs = (x * pos.affine(2.0, -1.0)?)?;
    relu + (abs.neg()?.exp()? + 1.0)?.log()?
}

/// The DPO loss of a micro-batch from per-row sums over response tokens, rows interleaved
/// chosen/rejected: `policy` Σ log π_θ (differentiable), `reference` Σ log π_ref (constant),
/// `counts` the response lengths. Pair losses are divided by `global_pairs`.
pub fn preference_terms(
    policy: &Tensor,
    reference: &Tensor,
    counts: &[f32],
    cfg: &LossConfig,
    global_pairs: usize,
) -> candle_core::Result<Terms> {
    let rows = counts.len();
    let pairs = rows / 2;
    let dev = policy.device();
    let counts_t = Tensor::from_vec(counts.to_vec(), rows, dev)?;
    let mut reward = (policy - reference.detach())?;
    if cfg.average_log_probs {
        reward = (reward / &counts_t)?;
    }
    let by_pair = reward.reshape((pairs, 2))?;
    let delta = (by_pair.narrow(1, 0, 1)? - by_pair.narrow(1, 1, 1)?)?.squeeze(1)?;
    let pref = softplus(&delta.affine(-cfg.beta, 0.0)?)?;
    let chosen_nll = (policy.reshape((pairs, 2))?.narrow(1, 0, 1)?.squeeze(1)?
        / counts_t.reshape((pairs, 2))?.narrow(1, 0, 1)?.squeeze(1)?)?
    .neg()?;
    let per_pair =
        (pref.affine(cfg.preference_weight, 0.0)? + chosen_nll.affine(cfg.sft_weight, 0.0)?)?;
    let total = (per_pair.sum_all()? / global_pairs as f64)?;
    let host =
        |t: &Tensor| -> candle_core::Result<Vec<f64>> { t.to_dtype(DType::F64)?.to_vec1::<f64>() };
    let (delta, pref, nll, per_pair) = (
        host(&delta)?,
        host(&pref)?,
        host(&chosen_nll)?,
        host(&per_pair)?,
    );
    Ok(Terms {
        total,
        sums: PairSums {
            loss_sum: per_pair.iter().sum(),
            preference_sum: pref.iter().sum(),
            sft_sum: nll.iter().sum(),
            correct: delta.iter().filter(|d| **d > 0.0).count() as f64,
            margin_sum: delta.iter().sum(),
        },
    })
}

impl PairSums {
    /// The figures [`DpoObjective::metrics`] reads, for a micro-batch of `pairs` pairs.
    fn tally(&self, pairs: usize) -> Tally {
        Tally::from([
            ("pairs", pairs as f64),
            ("correct", self.correct),
            ("margin", self.margin_sum),
            ("preference", self.preference_sum),
            ("sft", self.sft_sum),
        ])
    }
}

/// A micro-batch of pairs as model inputs: `2m` rows (chosen, rejected, chosen, …), each the
/// conversation shifted by one (labels = the next token), padded on the right with mask 0.
pub struct Collated {
    pub ids: Vec<u32>,
    pub labels: Vec<u32>,
    pub mask: Vec<f32>,
    pub layout: Layout,
    /// Response tokens per row.
    pub counts: Vec<f32>,
}

pub fn collate(pairs: &[&Pair]) -> Collated {
    let seqs: Vec<&Sequence> = pairs
        .iter()
        .flat_map(|p| [&p.chosen, &p.rejected])
        .collect();
    let len = seqs
        .iter()
        .map(|s| s.ids.len().saturating_sub(1))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut c = Collated {
        ids: Vec::with_capacity(seqs.len() * len),
        labels: Vec::with_capacity(seqs.len() * len),
        mask: Vec::with_capacity(seqs.len() * len),
        layout: Layout::plain(seqs.len(), len),
        counts: Vec::with_capacity(seqs.len()),
    };
    for s in seqs {
        let n = s.ids.len().saturating_sub(1);
        for t in 0..len {
            if t < n {
                c.ids.push(s.ids[t]);
                c.labels.push(s.ids[t + 1]);
                // Label t is token t + 1: a response token from `start` on.
                c.mask.push(if t + 1 >= s.start { 1.0 } else { 0.0 });
            } else {
                c.ids.push(0);
                c.labels.push(0);
                c.mask.push(0.0);
            }
        }
        c.counts.push(s.response_len() as f32);
    }
    c
}

/// The DPO objective over a fixed set of pairs (see the module docs).
pub struct DpoObjective {
    reference: Model,
    pairs: Vec<Pair>,
    order: RowOrder,
    cfg: LossConfig,
    global_batch: usize,
    micro_batch: usize,
    /// The prepared step's pair indices, in order.
    step_pairs: Vec<usize>,
}

impl DpoObjective {
    /// `reference` is the frozen model; `pairs` must not be empty.
    pub fn new(
        reference: Model,
        pairs: Vec<Pair>,
        cfg: LossConfig,
        schedule: &Schedule,
    ) -> DpoObjective {
        DpoObjective {
            reference,
            order: RowOrder::new(pairs.len().max(1), schedule.seed as u32),
            pairs,
            cfg,
            global_batch: schedule.global_batch,
            micro_batch: schedule.micro_batch.max(1),
            step_pairs: Vec::new(),
        }
    }

    fn pairs_of_step(&mut self, step: u64) -> Vec<usize> {
        let g = self.global_batch as u64;
        (step * g..(step + 1) * g)
            .map(|i| self.order.row(i))
            .collect()
    }

    /// The pairs trained on.
    pub fn pairs(&self) -> &[Pair] {
        &self.pairs
    }

    /// Micro-batch `i` of the prepared step: its pairs, collated.
    fn micro(&self, i: usize) -> (usize, Collated) {
        let from = (i * self.micro_batch).min(self.step_pairs.len());
        let to = ((i + 1) * self.micro_batch).min(self.step_pairs.len());
        let pairs: Vec<&Pair> = self.step_pairs[from..to]
            .iter()
            .map(|k| &self.pairs[*k])
            .collect();
        (pairs.len(), collate(&pairs))
    }

    /// Tokens the model reads in global step `step` (both completions, unpadded).
    pub fn tokens_in_step(&mut self, step: u64) -> u64 {
        self.pairs_of_step(step)
            .into_iter()
            .map(|i| (self.pairs[i].chosen.ids.len() + self.pairs[i].rejected.ids.len()) as u64)
            .sum()
    }
}

impl Objective for DpoObjective {
    fn prepare(&mut self, _model: &Model, step: u64) -> Result<usize, RunError> {
        if self.pairs.is_empty() {
            return Err(RunError::new("dpo: no preference pairs"));
        }
        self.step_pairs = self.pairs_of_step(step);
        Ok(self.global_batch.div_ceil(self.micro_batch))
    }

    fn per_token(&self) -> Option<&dyn PerToken> {
        Some(self)
    }

    fn loss(&self, model: &Model, i: usize) -> Result<MicroLoss, RunError> {
        let (pairs, c) = self.micro(i);
        let (b, t) = (c.layout.batch, c.layout.len);
        let mask = Tensor::from_vec(c.mask, (b, t), &candle_core::Device::Cpu).map_err(err)?;
        let sums = |m: &Model| -> candle_core::Result<Tensor> {
            (token_logprobs(m, &c.ids, &c.labels, &c.layout)? * &mask)?.sum(1)
        };
        let policy = sums(model).map_err(err)?;
        let reference = sums(&self.reference).map_err(err)?.detach();
        let terms = preference_terms(&policy, &reference, &c.counts, &self.cfg, self.global_batch)
            .map_err(err)?;
        Ok(MicroLoss {
            total: terms.total,
            sum: terms.sums.loss_sum,
            count: pairs as f64,
            tally: terms.sums.tally(pairs),
        })
    }

    fn metrics(&mut self, tally: &Tally) -> BTreeMap<String, f64> {
        let f = |k: &str| tally.get(k).copied().unwrap_or(0.0);
        let n = f("pairs").max(1.0);
        let mut m = BTreeMap::from([
            ("accuracy".to_string(), f("correct") / n),
            ("reward_margin".to_string(), f("margin") / n),
            ("preference_loss".to_string(), f("preference") / n),
        ]);
        if self.cfg.sft_weight > 0.0 {
            m.insert("sft_loss".to_string(), f("sft") / n);
        }
        m
    }
}

/// The loss of the module docs as a function of each token's log-probability, for the GPU
/// trainer: the per-row sums over response tokens, Δ, and the derivative of every pair's loss
/// in its two sums (`d softplus(x)/dx = σ(x)`), spread back over the response tokens.
impl PerToken for DpoObjective {
    fn batch(&self, i: usize) -> Result<Cow<'_, Batch>, RunError> {
        let (_, c) = self.micro(i);
        Ok(Cow::Owned(Batch {
            ids: c.ids,
            labels: c.labels,
            loss_mask: c.mask,
            layout: c.layout,
            valid: None,
        }))
    }

    fn reference(&self) -> Option<&Model> {
        Some(&self.reference)
    }

    fn grad(
        &self,
        i: usize,
        logp: &[f32],
        reference: Option<&[f32]>,
    ) -> Result<TokenGrad, RunError> {
        let (pairs, c) = self.micro(i);
        let reference =
            reference.ok_or_else(|| RunError::new("dpo: no reference log-probabilities"))?;
        let len = c.layout.len;
        let sums = |values: &[f32]| -> Vec<f64> {
            values
                .chunks(len)
                .zip(c.mask.chunks(len))
                .map(|(v, m)| v.iter().zip(m).map(|(v, m)| *v as f64 * *m as f64).sum())
                .collect()
        };
        let (policy, refs) = (sums(logp), sums(reference));
        let cfg = &self.cfg;
        let per_token = |row: usize| -> f64 {
            if cfg.average_log_probs {
                1.0 / c.counts[row] as f64
            } else {
                1.0
            }
        };
        let reward = |row: usize| (policy[row] - refs[row]) * per_token(row);
        let global = self.global_batch as f64;
        let mut terms = PairSums::default();
        // ∂loss/∂(Σ log π) of each row.
        let mut drow = vec![0.0; c.counts.len()];
        for pair in 0..pairs {
            let (chosen, rejected) = (2 * pair, 2 * pair + 1);
            let delta = reward(chosen) - reward(rejected);
            let x = -cfg.beta * delta;
            let preference = x.max(0.0) + (-x.abs()).exp().ln_1p();
            let sigmoid = if x >= 0.0 {
                1.0 / (1.0 + (-x).exp())
            } else {
                x.exp() / (1.0 + x.exp())
            };
            let count = c.counts[chosen] as f64;
            let nll = -policy[chosen] / count;
            terms.loss_sum += cfg.preference_weight * preference + cfg.sft_weight * nll;
            terms.preference_sum += preference;
            terms.sft_sum += nll;
            terms.correct += f64::from(u8::from(delta > 0.0));
            terms.margin_sum += delta;
            let dreward = cfg.preference_weight * -cfg.beta * sigmoid / global;
            drow[chosen] = dreward * per_token(chosen) - cfg.sft_weight / count / global;
            drow[rejected] = -dreward * per_token(rejected);
        }
        Ok(TokenGrad {
            dlogp: c
                .mask
                .iter()
                .enumerate()
                .map(|(t, m)| (drow[t / len] * *m as f64) as f32)
                .collect(),
            sum: terms.loss_sum,
            count: pairs as f64,
            tally: terms.tally(pairs),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Point, Trainer, checkpoint};
    use candle_core::{Device, Var};
    use model::config::ModelConfig;
    use model::params::to_f32_vec;
    use serde_json::json;
    use std::path::{Path, PathBuf};

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nemo-dag-dpo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    // --- training on token-level pairs with a tiny model ---

    const VOCAB: usize = 16;

    fn cfg(beta: f64, average: bool) -> LossConfig {
        LossConfig {
            beta,
            average_log_probs: average,
            preference_weight: 1.0,
            sft_weight: 0.0,
        }
    }

    fn t(v: &[f32]) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap()
    }

    fn close(a: f64, b: f64, tol: f64) -> bool {
        (a - b).abs() <= tol
    }

    #[test]
    fn the_loss_matches_hand_computed_values() {
        // Rows: chosen 1, rejected 1, chosen 2, rejected 2 (sums over response tokens).
        let policy = t(&[-3.0, -5.0, -6.0, -2.0]);
        let reference = t(&[-4.0, -4.5, -5.0, -2.5]);
        let counts = [2.0, 4.0, 2.0, 4.0];
        // Pair 1: r_c = 1, r_r = -0.5, Δ = 1.5; pair 2: r_c = -1, r_r = 0.5, Δ = -1.5.
        // β = 0.5: −log σ(0.75) = ln(1 + e^-0.75) = 0.386871006…, −log σ(−0.75) = 1.136871006….
        let s = preference_terms(&policy, &reference, &counts, &cfg(0.5, false), 2).unwrap();
        let total = s.total.to_scalar::<f32>().unwrap() as f64;
        assert!(
            close(total, (0.386_871_006 + 1.136_871_006) / 2.0, 1e-6),
            "{total}"
        );
        assert!(close(s.sums.preference_sum, 1.523_742_012, 1e-6));
        assert_eq!(s.sums.correct, 1.0, "only pair 1 has Δ > 0");
        assert!(close(s.sums.margin_sum, 0.0, 1e-6));
        // The same micro-batch as half of a global batch of 4 pairs contributes half as much.
        let half = preference_terms(&policy, &reference, &counts, &cfg(0.5, false), 4).unwrap();
        assert!(close(
            half.total.to_scalar::<f32>().unwrap() as f64,
            total / 2.0,
            1e-7
        ));

        // Averaged log-probs: pair 1 r_c = 1/2, r_r = -0.5/4, Δ = 0.625 → ln(1 + e^-0.3125) =
        // 0.549054862…; pair 2 Δ = -0.625 → ln(1 + e^0.3125) = 0.861554862….
        let a = preference_terms(&policy, &reference, &counts, &cfg(0.5, true), 2).unwrap();
        let total = a.total.to_scalar::<f32>().unwrap() as f64;
        assert!(
            close(total, (0.549_054_862 + 0.861_554_862) / 2.0, 1e-6),
            "{total}"
        );
        assert!(close(a.sums.margin_sum, 0.0, 1e-6));
        assert_eq!(a.sums.correct, 1.0);

        // SFT term: the chosen responses' mean token NLL, 3/2 and 6/2, averaged over pairs.
        let sft = LossConfig {
            preference_weight: 0.0,
            sft_weight: 1.0,
            ..cfg(0.5, false)
        };
        let s = preference_terms(&policy, &reference, &counts, &sft, 2).unwrap();
        assert!(close(
            s.total.to_scalar::<f32>().unwrap() as f64,
            2.25,
            1e-6
        ));
        assert!(close(s.sums.sft_sum, 4.5, 1e-6));

        // Δ = 0 everywhere (policy = reference): ln 2, no pair counts as correct, and the
        // gradient is −β·σ(0)/G on chosen rows and +β·σ(0)/G on rejected ones, not 0.
        let v = Var::from_tensor(&reference).unwrap();
        let s = preference_terms(v.as_tensor(), &reference, &counts, &cfg(0.5, false), 2).unwrap();
        let l = s.total.to_scalar::<f32>().unwrap() as f64;
        assert!(close(l, std::f64::consts::LN_2, 1e-6), "{l}");
        assert_eq!(s.sums.correct, 0.0);
        let g = s.total.backward().unwrap();
        let g = g.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap();
        for (k, x) in g.iter().enumerate() {
            let want = if k % 2 == 0 { -0.125 } else { 0.125 };
            assert!(close(*x as f64, want, 1e-7), "grad {g:?}");
        }
    }

    #[test]
    fn the_loss_is_stable_for_large_margins() {
        let counts = [1.0, 1.0];
        let big = preference_terms(
            &t(&[0.0, -400.0]),
            &t(&[0.0, 0.0]),
            &counts,
            &cfg(1.0, false),
            1,
        )
        .unwrap();
        assert!(close(
            big.total.to_scalar::<f32>().unwrap() as f64,
            0.0,
            1e-6
        ));
        let bad = preference_terms(
            &t(&[-400.0, 0.0]),
            &t(&[0.0, 0.0]),
            &counts,
            &cfg(1.0, false),
            1,
        )
        .unwrap();
        assert!(close(
            bad.total.to_scalar::<f32>().unwrap() as f64,
            400.0,
            1e-3
        ));
    }

    #[test]
    fn collation_interleaves_pads_right_and_masks_the_response() {
        let a = Pair {
            chosen: Sequence {
                ids: vec![1, 2, 3, 4],
                start: 2,
            },
            rejected: Sequence {
                ids: vec![1, 2, 5, 6, 7],
                start: 2,
            },
        };
        let c = collate(&[&a]);
        assert_eq!((c.layout.batch, c.layout.len), (2, 4));
        assert_eq!(c.ids, [1, 2, 3, 0, 1, 2, 5, 6]);
        assert_eq!(c.labels, [2, 3, 4, 0, 2, 5, 6, 7]);
        // Labels 3, 4 are chosen's response; 5, 6, 7 rejected's.
        assert_eq!(c.mask, [0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(c.counts, [2.0, 3.0]);
    }

    fn tiny(seed: u64) -> Model {
        let cfg: ModelConfig = serde_json::from_value(
            json!({"pattern": "*-", "hidden": 16, "heads": 2, "head_dim": 8, "ffn": 32, "max_seq": 32}),
        )
        .unwrap();
        Model::new(&cfg, VOCAB, seed).unwrap()
    }

    /// Six pairs over prompts [1, 2+k, 3]: chosen answers with 4…, rejected with 9…, of
    /// different lengths so micro-batches pad.
    fn token_pairs() -> Vec<Pair> {
        (0..6u32)
            .map(|k| {
                let prompt = vec![1, 2 + k % 3, 3];
                let mut chosen = prompt.clone();
                chosen.extend([4, 5 + k % 2, 6]);
                let mut rejected = prompt.clone();
                rejected.extend([9, 10 + k % 3, 11, 12, 13][..2 + (k as usize % 4)].iter());
                Pair {
                    chosen: Sequence {
                        ids: chosen,
                        start: 3,
                    },
                    rejected: Sequence {
                        ids: rejected,
                        start: 3,
                    },
                }
            })
            .collect()
    }

    fn schedule(steps: u64, global: usize, micro: usize, save_interval: u64) -> Schedule {
        serde_json::from_value(json!({
            "steps": steps, "global_batch": global, "micro_batch": micro, "lr": 1e-2,
            "log_interval": 1, "save_interval": save_interval, "seed": 5
        }))
        .unwrap()
    }

    fn weights(m: &Model) -> Vec<Vec<f32>> {
        m.params.values().unwrap()
    }

    #[test]
    fn dpo_steps_raise_the_margin_from_zero() {
        let s = schedule(12, 4, 2, 0);
        let mut objective = DpoObjective::new(tiny(3), token_pairs(), cfg(0.5, false), &s);
        let mut trainer = Trainer::new(tiny(3), s);
        let dir = tempdir("margin");
        trainer
            .run(
                &mut objective,
                &dir.join("ckpt"),
                |_| 0,
                &mut Vec::new(),
                &mut |_, _, _| {},
                None,
            )
            .unwrap();
        let first: &Point = &trainer.curve[0];
        let last: &Point = trainer.curve.last().unwrap();
        assert_eq!(first.step, 1);
        // Policy = reference at step 1: Δ = 0 exactly, loss ln 2.
        assert!(
            close(first.loss, std::f64::consts::LN_2, 1e-6),
            "{}",
            first.loss
        );
        assert_eq!(first.metrics["accuracy"], 0.0);
        assert_eq!(first.metrics["reward_margin"], 0.0);
        assert!(close(
            first.metrics["preference_loss"],
            std::f64::consts::LN_2,
            1e-6
        ));
        // The gradient moves the policy towards the chosen completions.
        assert!(
            last.metrics["reward_margin"] > 1.0,
            "margin {} → {}",
            first.metrics["reward_margin"],
            last.metrics["reward_margin"]
        );
        assert_eq!(last.metrics["accuracy"], 1.0, "{:?}", last.metrics);
        assert!(
            last.loss < 0.5 * std::f64::consts::LN_2,
            "loss {}",
            last.loss
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Σ over micro-batches of the gradients of step 0.
    fn step_gradients(micro: usize, loss: LossConfig) -> (Vec<Vec<f32>>, BTreeMap<String, f64>) {
        let s = schedule(1, 4, micro, 0);
        // A reference that differs from the policy, so Δ ≠ 0.
        let mut objective = DpoObjective::new(tiny(99), token_pairs(), loss, &s);
        let model = tiny(3);
        let n = objective.prepare(&model, 0).unwrap();
        assert_eq!(n, 4 / micro);
        let mut sums: Vec<Vec<f32>> = model
            .params
            .iter()
            .map(|(_, v)| vec![0.0; v.elem_count()])
            .collect();
        let mut tally = Tally::new();
        for i in 0..n {
            let l = objective.loss(&model, i).unwrap();
            for (k, v) in &l.tally {
                *tally.entry(k).or_insert(0.0) += v;
            }
            let grads = l.total.backward().unwrap();
            for (k, (_, var)) in model.params.iter().enumerate() {
                if let Some(g) = grads.get(var.as_tensor()) {
                    for (s, x) in sums[k].iter_mut().zip(to_f32_vec(g).unwrap()) {
                        *s += x;
                    }
                }
            }
        }
        (sums, objective.metrics(&tally))
    }

    #[test]
    fn micro_batches_add_up_to_the_global_batch() {
        let loss = LossConfig {
            sft_weight: 0.3,
            ..cfg(0.5, true)
        };
        let (one, m1) = step_gradients(4, loss);
        let (two, m2) = step_gradients(2, loss);
        let mut largest = 0.0f32;
        for (a, b) in one.iter().flatten().zip(two.iter().flatten()) {
            assert!((a - b).abs() <= 1e-5, "{a} vs {b}");
            largest = largest.max(a.abs());
        }
        assert!(largest > 1e-3, "the gradients are not all zero");
        for (k, v) in &m1 {
            assert!(close(*v, m2[k], 1e-5), "{k}: {v} vs {}", m2[k]);
        }
    }

    #[test]
    fn same_seed_same_weights_and_resume_is_exact() {
        let dir = tempdir("resume");
        let run = |save: u64, stop: Option<u64>, ckpt: &Path, resume: bool| {
            let s = schedule(6, 4, 2, save);
            let mut objective = DpoObjective::new(tiny(3), token_pairs(), cfg(0.5, false), &s);
            let mut trainer = Trainer::new(tiny(3), s);
            if resume {
                checkpoint::restore(&mut trainer, &checkpoint::latest(ckpt).unwrap()).unwrap();
            }
            let r = trainer.run(
                &mut objective,
                ckpt,
                |_| 0,
                &mut Vec::new(),
                &mut |_, _, _| {},
                stop,
            );
            (trainer, r.is_ok())
        };
        let (straight, ok) = run(0, None, &dir.join("a"), false);
        assert!(ok);
        let (_, ok) = run(3, Some(3), &dir.join("b"), false);
        assert!(!ok, "stopped after step 3");
        let (resumed, ok) = run(3, None, &dir.join("b"), true);
        assert!(ok);
        assert_eq!(weights(&straight.model), weights(&resumed.model));
        assert_eq!(straight.curve, resumed.curve);
        assert_eq!(straight.opt, resumed.opt);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
