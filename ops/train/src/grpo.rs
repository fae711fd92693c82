//! Group Relative Policy Optimization on prompts with verifiable answers, as NeMo-RL
//! does it (`nemo_rl/algorithms/grpo.py`; the details in docs/parity.md, "GRPO").
//!
//! One GRPO step, top to bottom ([`Rollouts::prepare`], then [`Rollouts::loss`] per micro-batch):
//!
//! 1. Take the next `prompts_per_step` prompts of the train split (a seeded order, epoch
//!    after epoch) and repeat each `num_generations_per_prompt` times, contiguously.
//! 2. Generate a response for every repeat with the current weights (temperature, top-p; each
//!    rollout has its own seeded generator) until `<|im_end|>`/`<|endoftext|>` or
//!    `max_new_tokens`.
//! 3. Score each response with its environment (`math`: the last `\boxed{}` by value; `mcq`: the
//!    letter). An environment that fails scores 0.
//! 4. Advantages per group of identical prompts ([`advantages`]): leave-one-out baseline and
//!    standard deviation, divided only where the deviation is > 0.
//! 5. The loss of every response token ([`token_loss`]): `max(−A·r, −A·clip(r, 1 − ε_low,
//!    1 + ε_high))` with `r = π_θ / π_old`, plus `β · k3` KL to the reference model when
//!    `reference_policy_kl_penalty > 0`, summed over the global batch's response tokens and
//!    divided by their number (`token_level_loss`), or averaged per response first.
//! 6. One AdamW step (the shared [`crate::Trainer`]: clipping, schedule, checkpoints).
//!
//! The rollouts of a step are exactly one optimizer step's batch (`global_batch` must equal
//! prompts × generations), so π_old is the current policy: `r` is 1 in value and carries the
//! gradient of log π_θ — NeMo-RL's `force_on_policy_ratio`. `overlong_filtering` gives
//! responses that hit `max_new_tokens` without a stop token no loss, but keeps their reward in
//! their group's baseline. Everything a step does is a function of the step number and the
//! weights, so a resumed run generates the same rollouts as an uninterrupted one.
//!
//! On a GPU ([`crate::gpu`]) everything but the arithmetic of the loss runs on the device: the
//! rollouts decode there with the step's current weights and the trainer's bf16 matmuls
//! ([`crate::gpu::Decoding`], KV and SSM caches; the host samples from each step's logits), and
//! the policy's and the reference's log-probabilities and the backward run there too; the
//! loss's derivative in each log-probability is computed on the host ([`PerToken::grad`]).
//!
//! Metrics per step (log line and curve): `reward` (mean), `accuracy` (fraction of responses
//! scoring 1), `response_length` (mean new tokens), `truncated` (fraction that hit the limit),
//! `kl` (mean k3 per response token, only when the KL term is on).

use crate::order::RowOrder;
use crate::{Decoders, MicroLoss, Objective, PerToken, Tally, TokenGrad, err, token_logprobs};
use candle_core::{Device, Tensor};
use model::layers::Layout;
use model::net::{Batch, Model};
use model::params::Rng;
use model::sampling::{Sampling, decode_length, generate_split, generate_with};
use nemo_dag_op::RunError;
use serde::Deserialize;
use std::collections::BTreeMap;

fn d_true() -> bool {
    true
}
fn d_clip_low() -> f64 {
    0.2
}
fn d_clip_high() -> f64 {
    0.28
}
fn d_kl() -> f64 {
    0.01
}

/// The knobs we implement of NeMo-RL's `loss/loss_functions.py: ClippedPGLossFn`.
#[derive(Debug, Clone, Deserialize)]
pub struct LossConfig {
    #[serde(default = "d_clip_low")]
    pub ratio_clip_min: f64,
    #[serde(default = "d_clip_high")]
    pub ratio_clip_max: f64,
    /// Dual clip `c > 1`: for negative advantages the loss is at most `−A·c`.
    #[serde(default)]
    pub ratio_clip_c: Option<f64>,
    /// β of the k3 KL term to the reference policy (0: no reference model at all).
    #[serde(default = "d_kl")]
    pub reference_policy_kl_penalty: f64,
    /// Σ over the global batch's tokens / their count (true), or the mean of per-response means.
    #[serde(default = "d_true")]
    pub token_level_loss: bool,
}

/// What a GRPO run does each step (the op's params, less the data and the schedule).
#[derive(Debug, Clone)]
pub struct Config {
    /// Prompts drawn per step, and responses generated for each.
    pub prompts_per_step: usize,
    pub generations: usize,
    /// How responses are sampled (temperature, top-p, the new-token limit).
    pub sampling: Sampling,
    /// Seeds the prompt order and every rollout's generator.
    pub seed: u64,
    pub micro_batch: usize,
    /// Divide advantages by their group's standard deviation.
    pub normalize_rewards: bool,
    /// Leave-one-out baseline (the mean of the group's other rewards).
    pub leave_one_out: bool,
    /// Responses cut at the token limit carry no loss.
    pub overlong_filtering: bool,
    /// Advantages clipped to `[low, high]` where given.
    pub advantage_clip: (Option<f64>, Option<f64>),
    pub loss: LossConfig,
}

/// One train prompt: its rendered tokens and how its responses are scored.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub expected: String,
    pub env: String,
}

/// GRPO advantages (NeMo-RL `calculate_baseline_and_std_per_prompt`). Groups are the rollouts with
/// identical prompt ids (`group[i]` is rollout i's group key).
///
/// With leave-one-out, rollout i's baseline is the mean of the *other* rewards of its group
/// and its deviation their Bessel-corrected standard deviation; without, the group's mean and
/// Bessel standard deviation. `A = r − baseline`, divided by `std + 1e-6` only where
/// `normalize` and `std > 0`. A group with a single rollout gets 0.
pub fn advantages(
    rewards: &[f64],
    group: &[usize],
    leave_one_out: bool,
    normalize: bool,
) -> Vec<f64> {
    let mut out = vec![0.0; rewards.len()];
    for (i, r) in rewards.iter().enumerate() {
        let others: Vec<f64> = rewards
            .iter()
            .enumerate()
            .filter(|(j, _)| group[*j] == group[i] && (*j != i || !leave_one_out))
            .map(|(_, r)| *r)
            .collect();
        let members = rewards
            .iter()
            .enumerate()
            .filter(|(j, _)| group[*j] == group[i])
            .count();
        if members <= 1 {
            continue;
        }
        let n = others.len() as f64;
        let baseline = others.iter().sum::<f64>() / n;
        let std = if others.len() >= 2 {
            let var = others.iter().map(|x| (x - baseline).powi(2)).sum::<f64>() / (n - 1.0);
            if var.is_finite() { var.sqrt() } else { 0.0 }
        } else {
            0.0
        };
        let a = r - baseline;
        out[i] = if normalize && std > 0.0 {
            a / (std + 1e-6)
        } else {
            a
        };
    }
    out
}

/// The clipped policy-gradient loss per token (`ClippedPGLossFn`), differentiable in `logp`:
/// `max(−A·r, −A·clip(r, 1 − lo, 1 + hi))` with `r = exp(logp − old)`, and with the dual clip
/// `c` the loss of a negative advantage is at most `−A·c`. All tensors `(B, T)`.
pub fn token_loss(
    logp: &Tensor,
    old: &Tensor,
    adv: &Tensor,
    cfg: &LossConfig,
) -> candle_core::Result<Tensor> {
    let ratio = (logp - old)?.exp()?;
    let clipped = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)?;
    let unclipped_loss = (adv.neg()? * &ratio)?;
    let clipped_loss = (adv.neg()? * &clipped)?;
    let loss = unclipped_loss.maximum(&clipped_loss)?;
    match cfg.ratio_clip_c {
        None => Ok(loss),
        Some(c) => {
            let negative = adv.lt(0.0)?.to_dtype(candle_core::DType::F32)?;
            let capped = loss.minimum(&(adv.neg()? * c)?)?;
            (&negative * capped)? + ((1.0 - &negative)? * loss)?
        }
    }
}

/// The k3 estimator of KL(π_θ ‖ π_ref) per token: `exp(logr) − 1 − logr`, `logr = ref − logp`.
pub fn kl_k3(logp: &Tensor, reference: &Tensor) -> candle_core::Result<Tensor> {
    let logr = (reference - logp)?;
    (logr.exp()? - 1.0)? - logr
}

/// How a rollout is scored: its prompt and its response ids → reward.
pub type Score<'a> = dyn Fn(&Prompt, &[u32]) -> f64 + Sync + 'a;

/// One micro-batch of rollouts, ready for the loss.
struct Micro {
    /// The rollouts' ids, labels and layout; its loss mask marks the response tokens (1/0),
    /// for the KL metric.
    batch: Batch,
    /// Per token: the advantage of its response (0 off the response).
    adv: Vec<f32>,
    /// Per token: its share of the global loss (0 off the response, and for filtered rollouts).
    weight: Vec<f32>,
}

/// GRPO as a training [`Objective`]: each step generates, scores and batches its rollouts.
pub struct Rollouts<'a> {
    prompts: Vec<Prompt>,
    order: RowOrder,
    prompts_per_step: usize,
    generations: usize,
    sampling: Sampling,
    seed: u64,
    micro_batch: usize,
    normalize: bool,
    leave_one_out: bool,
    overlong_filtering: bool,
    advantage_clip: (Option<f64>, Option<f64>),
    loss: LossConfig,
    reference: Option<Model>,
    stops: Vec<u32>,
    score: &'a Score<'a>,
    micro: Vec<Micro>,
    metrics: BTreeMap<String, f64>,
    /// Tokens (prompt + response) trained on in the last prepared step, for tokens/s.
    pub tokens: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl<'a> Rollouts<'a> {
    pub fn new(
        cfg: Config,
        prompts: Vec<Prompt>,
        reference: Option<Model>,
        stops: Vec<u32>,
        score: &'a Score<'a>,
    ) -> Rollouts<'a> {
        Rollouts {
            order: RowOrder::new(prompts.len(), cfg.seed as u32),
            prompts,
            prompts_per_step: cfg.prompts_per_step,
            generations: cfg.generations,
            sampling: cfg.sampling,
            seed: cfg.seed,
            micro_batch: cfg.micro_batch,
            normalize: cfg.normalize_rewards,
            leave_one_out: cfg.leave_one_out,
            overlong_filtering: cfg.overlong_filtering,
            advantage_clip: cfg.advantage_clip,
            loss: cfg.loss,
            reference,
            stops,
            score,
            micro: Vec::new(),
            metrics: BTreeMap::new(),
            tokens: Default::default(),
        }
    }

    /// Rollout `r` of step `step` draws from its own generator, seeded from (seed, step, r).
    fn rng(&self, step: u64, r: usize) -> Rng {
        let mix = |x: u64| Rng::new(x).next_u64();
        Rng::new(mix(self.seed) ^ mix(step.wrapping_add(1 << 32)) ^ mix((r as u64) << 1 | 1 << 63))
    }

    /// [`Objective::prepare`]: the rollouts decode on `decoders` when given, else on the CPU's
    /// worker threads.
    fn prepare_with(
        &mut self,
        model: &Model,
        step: u64,
        decoders: Option<&dyn Decoders>,
    ) -> Result<usize, RunError> {
        // 1. This step's prompts, each repeated `generations` times contiguously.
        let chosen: Vec<usize> = (0..self.prompts_per_step as u64)
            .map(|k| self.order.row(step * self.prompts_per_step as u64 + k))
            .collect();
        let rollouts: Vec<&Prompt> = chosen
            .iter()
            .flat_map(|i| std::iter::repeat_n(&self.prompts[*i], self.generations))
            .collect();
        // 2. Generate with the current weights.
        let prompt_ids: Vec<Vec<u32>> = rollouts.iter().map(|p| p.ids.clone()).collect();
        let mut rngs: Vec<Rng> = (0..rollouts.len()).map(|r| self.rng(step, r)).collect();
        // A row ends on a stop id, which stays in its ids: the policy learns to emit it.
        let stops = &self.stops;
        let stopped = |_: usize, ids: &[u32]| ids.last().is_some_and(|t| stops.contains(t));
        let completions = match decoders {
            Some(decoders) => {
                let steps =
                    decode_length(model, &prompt_ids, self.sampling.max_tokens).map_err(err)?;
                let mut decoder = decoders.start(model, prompt_ids.len(), steps)?;
                generate_with(
                    &mut *decoder,
                    &prompt_ids,
                    &self.sampling,
                    &[],
                    &mut rngs,
                    stopped,
                )
            }
            None => generate_split(
                model,
                &prompt_ids,
                &self.sampling,
                &[],
                &mut rngs,
                kernels::workers::threads(),
                stopped,
            ),
        }
        .map_err(err)?;
        let response = |ids: &[u32]| -> usize {
            ids.len() - usize::from(ids.last().is_some_and(|t| stops.contains(t)))
        };
        // 3. Score; 4. advantages over groups of identical prompts.
        let rewards: Vec<f64> = rollouts
            .iter()
            .zip(&completions)
            .map(|(p, c)| (self.score)(p, &c.ids[..response(&c.ids)]))
            .collect();
        let mut keys: Vec<&[u32]> = Vec::new();
        let group: Vec<usize> = prompt_ids
            .iter()
            .map(|ids| match keys.iter().position(|k| *k == ids.as_slice()) {
                Some(g) => g,
                None => {
                    keys.push(ids);
                    keys.len() - 1
                }
            })
            .collect();
        let mut adv = advantages(&rewards, &group, self.leave_one_out, self.normalize);
        for a in &mut adv {
            if let Some(lo) = self.advantage_clip.0 {
                *a = a.max(lo);
            }
            if let Some(hi) = self.advantage_clip.1 {
                *a = a.min(hi);
            }
        }

        // Each rollout as one training row: prompt + response (+ the stop token it ended on).
        let rows: Vec<(Vec<u32>, usize, bool)> = prompt_ids
            .iter()
            .zip(&completions)
            .map(|(prompt, c)| {
                let mut seq = prompt.clone();
                seq.extend_from_slice(&c.ids);
                // Overlong filtering: a response cut at max_new_tokens carries no loss.
                let kept = c.stopped || !self.overlong_filtering;
                (seq, prompt.len(), kept)
            })
            .collect();
        // 5. Each response token's share of the global loss.
        let response_tokens = |(seq, prompt, _): &(Vec<u32>, usize, bool)| seq.len() - prompt;
        let kept_tokens: usize = rows.iter().filter(|r| r.2).map(response_tokens).sum();
        let kept_rows = rows.iter().filter(|r| r.2).count();
        let share = |row: &(Vec<u32>, usize, bool)| -> f32 {
            if !row.2 {
                0.0
            } else if self.loss.token_level_loss {
                1.0 / kept_tokens.max(1) as f32
            } else {
                1.0 / (response_tokens(row).max(1) * kept_rows.max(1)) as f32
            }
        };
        self.micro.clear();
        for (chunk, start) in rows
            .chunks(self.micro_batch)
            .zip((0..).step_by(self.micro_batch))
        {
            let t = chunk.iter().map(|r| r.0.len() - 1).max().unwrap_or(1);
            let b = chunk.len();
            let mut ids = vec![0u32; b * t];
            let mut labels = vec![0u32; b * t];
            let mut a = vec![0f32; b * t];
            let mut w = vec![0f32; b * t];
            let mut mask = vec![0f32; b * t];
            for (k, row) in chunk.iter().enumerate() {
                let (seq, prompt, _) = row;
                for i in 0..seq.len() - 1 {
                    ids[k * t + i] = seq[i];
                    labels[k * t + i] = seq[i + 1];
                    // Label i + 1 is a response token when i + 1 >= prompt.
                    if i + 1 >= *prompt {
                        a[k * t + i] = adv[start + k] as f32;
                        w[k * t + i] = share(row);
                        mask[k * t + i] = 1.0;
                    }
                }
            }
            self.micro.push(Micro {
                batch: Batch {
                    ids,
                    labels,
                    loss_mask: mask,
                    layout: Layout::plain(b, t),
                    valid: None,
                },
                adv: a,
                weight: w,
            });
        }

        let n = rewards.len() as f64;
        let lengths: f64 = completions.iter().map(|c| response(&c.ids) as f64).sum();
        self.tokens.store(
            rows.iter().map(|r| r.0.len() as u64 - 1).sum(),
            std::sync::atomic::Ordering::Relaxed,
        );
        self.metrics = BTreeMap::from([
            ("reward".to_string(), rewards.iter().sum::<f64>() / n),
            (
                "accuracy".to_string(),
                rewards.iter().filter(|r| **r >= 1.0).count() as f64 / n,
            ),
            ("response_length".to_string(), lengths / n),
            (
                "truncated".to_string(),
                completions.iter().filter(|c| !c.stopped).count() as f64 / n,
            ),
        ]);
        Ok(self.micro.len())
    }
}

impl Objective for Rollouts<'_> {
    fn prepare(&mut self, model: &Model, step: u64) -> Result<usize, RunError> {
        self.prepare_with(model, step, None)
    }

    /// On a device, the rollouts decode there with the step's current weights.
    fn prepare_on(
        &mut self,
        model: &Model,
        step: u64,
        decoders: &dyn Decoders,
    ) -> Result<usize, RunError> {
        self.prepare_with(model, step, Some(decoders))
    }

    fn per_token(&self) -> Option<&dyn PerToken> {
        Some(self)
    }

    fn loss(&self, model: &Model, i: usize) -> Result<MicroLoss, RunError> {
        let m = self.micro.get(i).ok_or_else(|| no_micro(i))?;
        let Batch {
            ids,
            labels,
            layout,
            ..
        } = &m.batch;
        let tensor =
            |v: &[f32]| Tensor::from_vec(v.to_vec(), (layout.batch, layout.len), &Device::Cpu);
        let mut tally = Tally::new();
        let logp = token_logprobs(model, ids, labels, layout).map_err(err)?;
        // On-policy: π_old is these very weights, so the ratio is 1 in value.
        let old = logp.detach();
        let adv = tensor(&m.adv).map_err(err)?;
        let mut per_token = token_loss(&logp, &old, &adv, &self.loss).map_err(err)?;
        if let Some(reference) = &self.reference {
            let reference = token_logprobs(reference, ids, labels, layout)
                .map_err(err)?
                .detach();
            let mask = tensor(&m.batch.loss_mask).map_err(err)?;
            let kl = kl_k3(&logp, &reference).map_err(err)?;
            let masked = (&kl * &mask)
                .and_then(|k| k.sum_all()?.to_scalar::<f32>())
                .map_err(err)?;
            let count = mask
                .sum_all()
                .and_then(|c| c.to_scalar::<f32>())
                .map_err(err)?;
            tally.insert("kl_sum", masked as f64);
            tally.insert("kl_tokens", count as f64);
            per_token = (per_token + (kl * self.loss.reference_policy_kl_penalty)).map_err(err)?;
        }
        let total = (per_token * tensor(&m.weight).map_err(err)?)
            .and_then(|l| l.sum_all())
            .map_err(err)?;
        let value = total.to_scalar::<f32>().map_err(err)? as f64;
        Ok(MicroLoss {
            total,
            sum: value,
            count: 1.0 / self.micro.len() as f64,
            tally,
        })
    }

    fn metrics(&mut self, tally: &Tally) -> BTreeMap<String, f64> {
        let mut m = self.metrics.clone();
        if let (Some(sum), Some(&tokens)) = (tally.get("kl_sum"), tally.get("kl_tokens"))
            && tokens > 0.0
        {
            m.insert("kl".into(), sum / tokens);
        }
        m
    }
}

fn no_micro(i: usize) -> RunError {
    RunError::new(format!("grpo: no micro-batch {i} in the prepared step"))
}

/// `∂/∂logp` of [`token_loss`] on-policy (`old = logp`, so the ratio `r = exp(logp − old)` is 1
/// with `∂r/∂logp = 1`), with candle's rule at the kinks the CPU's autograd goes through:
/// where `maximum` or `minimum` has both sides equal, each side gets half the gradient. The
/// unclipped and clipped losses are always equal at `r = 1`, so each takes half; the clip
/// passes `r`'s gradient whole, or half at a bound of 1 (`ratio_clip_min` or `ratio_clip_max`
/// 0). The dual clip never binds: for `A < 0`, `−A < −A·c`. So with both clips above 0 this is
/// `−A`, the policy gradient.
fn on_policy_dloss(adv: f64, cfg: &LossConfig) -> f64 {
    let half_at = |bound: f64| if bound == 0.0 { 0.5 } else { 1.0 };
    let dclip = half_at(cfg.ratio_clip_min) * half_at(cfg.ratio_clip_max);
    -adv * (1.0 + dclip) / 2.0
}

/// The clipped surrogate and the k3 KL term per token, weighted by each token's share of the
/// global loss, for the GPU trainer: their values, and their derivatives in `logp` (the KL's
/// `1 − exp(ref − logp)`).
impl PerToken for Rollouts<'_> {
    fn batch(&self, i: usize) -> Result<std::borrow::Cow<'_, Batch>, RunError> {
        let m = self.micro.get(i).ok_or_else(|| no_micro(i))?;
        Ok(std::borrow::Cow::Borrowed(&m.batch))
    }

    fn reference(&self) -> Option<&Model> {
        self.reference.as_ref()
    }

    fn grad(
        &self,
        i: usize,
        logp: &[f32],
        reference: Option<&[f32]>,
    ) -> Result<TokenGrad, RunError> {
        let m = self.micro.get(i).ok_or_else(|| no_micro(i))?;
        let beta = self.loss.reference_policy_kl_penalty;
        let (mut sum, mut kl_sum, mut tally) = (0.0, 0.0, Tally::new());
        let mut dlogp = Vec::with_capacity(logp.len());
        for (t, lp) in logp.iter().enumerate() {
            let (adv, weight) = (m.adv[t] as f64, m.weight[t] as f64);
            // At r = 1 every branch of the clipped loss is −A.
            let (mut value, mut d) = (-adv, on_policy_dloss(adv, &self.loss));
            if let Some(reference) = reference {
                let logr = reference[t] as f64 - *lp as f64;
                let kl = logr.exp() - 1.0 - logr;
                kl_sum += kl * m.batch.loss_mask[t] as f64;
                value += beta * kl;
                d += beta * (1.0 - logr.exp());
            }
            sum += weight * value;
            dlogp.push((weight * d) as f32);
        }
        if reference.is_some() {
            tally.insert("kl_sum", kl_sum);
            let tokens = m.batch.loss_mask.iter().map(|x| *x as f64).sum();
            tally.insert("kl_tokens", tokens);
        }
        Ok(TokenGrad {
            dlogp,
            sum,
            count: 1.0 / self.micro.len() as f64,
            tally,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Schedule, Trainer, checkpoint};
    use candle_core::Var;
    use model::config::ModelConfig;
    use serde_json::{Value, json};

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn leave_one_out_advantages_use_the_other_rewards_mean_and_bessel_std() {
        // Rollout 0: the others are [0, 0, 1]: baseline 1/3, std sqrt(1/3).
        let s = (1.0f64 / 3.0).sqrt() + 1e-6;
        let a = advantages(&[1.0, 0.0, 0.0, 1.0], &[0; 4], true, true);
        close(
            &a,
            &[
                (2.0 / 3.0) / s,
                -(2.0 / 3.0) / s,
                -(2.0 / 3.0) / s,
                (2.0 / 3.0) / s,
            ],
        );
        // This is not (r − mean) / std over the whole group.
        let plain = (1.0 - 0.5) / (1.0f64 / 3.0).sqrt();
        assert!((a[0] - plain).abs() > 0.1);
        // Rollout 0's others [0, 0] do not vary: no division. Rollout 1's others [1, 0]: std √½.
        let a = advantages(&[1.0, 0.0, 0.0], &[0; 3], true, true);
        let s = 0.5f64.sqrt() + 1e-6;
        close(&a, &[1.0, -0.5 / s, -0.5 / s]);
        // Without normalisation the baseline only.
        close(
            &advantages(&[1.0, 0.0, 0.0], &[0; 3], true, false),
            &[1.0, -0.5, -0.5],
        );
    }

    #[test]
    fn group_mean_advantages_without_leave_one_out() {
        let s = (1.0f64 / 3.0).sqrt() + 1e-6;
        let a = advantages(&[1.0, 0.0, 0.0], &[0; 3], false, true);
        close(&a, &[(2.0 / 3.0) / s, -(1.0 / 3.0) / s, -(1.0 / 3.0) / s]);
    }

    #[test]
    fn groups_are_identical_prompts_and_equal_rewards_give_zero() {
        // Two interleaved groups: {0, 2} all equal, {1, 3} differ; a lone rollout gets 0.
        let a = advantages(&[1.0, 1.0, 1.0, 0.0, 1.0], &[0, 1, 0, 1, 2], true, false);
        close(&a, &[0.0, 1.0, 0.0, -1.0, 0.0]);
        let a = advantages(&[0.5; 4], &[0; 4], true, true);
        close(&a, &[0.0; 4]);
    }

    fn cfg(c: Option<f64>) -> LossConfig {
        LossConfig {
            ratio_clip_min: 0.2,
            ratio_clip_max: 0.28,
            ratio_clip_c: c,
            reference_policy_kl_penalty: 0.0,
            token_level_loss: true,
        }
    }

    fn row(v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), (1, v.len()), &Device::Cpu).unwrap()
    }

    #[test]
    fn the_clipped_loss_takes_the_pessimistic_side() {
        // Ratios 1.5, 1.5, 0.5, 0.5 against advantages +1, −1, +1, −1.
        let old = row(&[0.0; 4]);
        let logp = row(&[1.5f32.ln(), 1.5f32.ln(), 0.5f32.ln(), 0.5f32.ln()]);
        let adv = row(&[1.0, -1.0, 1.0, -1.0]);
        let l: Vec<f32> = token_loss(&logp, &old, &adv, &cfg(None))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        // max(−1.5, −1.28), max(1.5, 1.28), max(−0.5, −0.8), max(0.5, 0.8)
        let want = [-1.28, 1.5, -0.5, 0.8];
        for (g, w) in l.iter().zip(want) {
            assert!((g - w).abs() < 1e-5, "{l:?}");
        }
        // The dual clip caps a negative advantage's loss at −A·c.
        let logp = row(&[5.0f32.ln(), 5.0f32.ln()]);
        let adv = row(&[-1.0, 1.0]);
        let l: Vec<f32> = token_loss(&logp, &row(&[0.0; 2]), &adv, &cfg(Some(3.0)))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            (l[0] - 3.0).abs() < 1e-5 && (l[1] + 1.28).abs() < 1e-5,
            "{l:?}"
        );
    }

    #[test]
    fn on_policy_the_gradient_is_minus_the_advantage() {
        let logp = Var::from_tensor(&row(&[-1.0, -2.0, -0.5])).unwrap();
        let adv = row(&[2.0, -1.0, 0.5]);
        let loss = token_loss(
            logp.as_tensor(),
            &logp.as_tensor().detach(),
            &adv,
            &cfg(None),
        )
        .unwrap()
        .sum_all()
        .unwrap();
        let g: Vec<f32> = loss
            .backward()
            .unwrap()
            .get(logp.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(g, vec![-2.0, 1.0, -0.5]);
    }

    /// The GPU trainer's host derivative of the clipped loss is what candle's autograd gives
    /// through `token_loss` on-policy, kinks included: clip bounds of 0 (where `clamp` meets
    /// the ratio) and the dual clip, for advantages of both signs and 0.
    #[test]
    fn the_host_derivative_on_policy_is_autograds() {
        for (lo, hi, c) in [
            (0.2, 0.28, None),
            (0.0, 0.28, None),
            (0.2, 0.0, Some(3.0)),
            (0.0, 0.0, Some(1.5)),
        ] {
            let cfg = LossConfig {
                ratio_clip_min: lo,
                ratio_clip_max: hi,
                ratio_clip_c: c,
                ..cfg(None)
            };
            let advantages = [-1.3f32, 0.0, 0.7, 2.0];
            let logp = Var::from_tensor(&row(&[-0.5, -1.0, -2.0, -0.1])).unwrap();
            let old = logp.as_tensor().detach();
            let loss = token_loss(logp.as_tensor(), &old, &row(&advantages), &cfg).unwrap();
            let grads = loss.sum_all().unwrap().backward().unwrap();
            let want = grads.get(logp.as_tensor()).unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            for (a, w) in advantages.iter().zip(want) {
                let got = on_policy_dloss(*a as f64, &cfg);
                assert!(
                    (got - w as f64).abs() < 1e-7,
                    "lo {lo} hi {hi} c {c:?} A {a}: {got} vs autograd {w}"
                );
            }
        }
    }

    #[test]
    fn k3_is_exp_minus_one_minus_log_ratio() {
        let k: Vec<f32> = kl_k3(&row(&[0.0, 0.0]), &row(&[2.0f32.ln(), 0.0]))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            (k[0] - (1.0 - 2.0f32.ln())).abs() < 1e-6 && k[1].abs() < 1e-7,
            "{k:?}"
        );
    }

    /// A run's config and schedule: 4 prompts × 4 rollouts of 3 tokens, 30 steps at lr 0.05,
    /// no KL term; `extra` sets `seed`, `steps`, `reference_policy_kl_penalty`,
    /// `token_level_loss` or `overlong_filtering`.
    fn setup(extra: Value) -> (Config, Schedule) {
        let mut schedule = json!({
            "steps": 30, "global_batch": 16, "micro_batch": 8, "lr": 0.05, "weight_decay": 0.0,
            "seed": 5
        });
        let mut cfg = Config {
            prompts_per_step: 4,
            generations: 4,
            sampling: Sampling {
                temperature: 1.0,
                top_p: 1.0,
                top_k: None,
                max_tokens: 3,
            },
            seed: 5,
            micro_batch: 8,
            normalize_rewards: true,
            leave_one_out: true,
            overlong_filtering: false,
            advantage_clip: (None, None),
            loss: LossConfig {
                ratio_clip_min: 0.2,
                ratio_clip_max: 0.28,
                ratio_clip_c: None,
                reference_policy_kl_penalty: 0.0,
                token_level_loss: true,
            },
        };
        for (k, v) in extra.as_object().unwrap() {
            match k.as_str() {
                "seed" | "steps" => schedule[k] = v.clone(),
                "reference_policy_kl_penalty" => {
                    cfg.loss.reference_policy_kl_penalty = v.as_f64().unwrap()
                }
                "token_level_loss" => cfg.loss.token_level_loss = v.as_bool().unwrap(),
                "overlong_filtering" => cfg.overlong_filtering = v.as_bool().unwrap(),
                _ => panic!("setup has no {k}"),
            }
        }
        cfg.seed = schedule["seed"].as_u64().unwrap();
        (cfg, serde_json::from_value(schedule).unwrap())
    }

    fn tiny_model() -> Model {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "*-", "hidden": 16, "heads": 2, "head_dim": 8, "ffn": 32, "max_seq": 32
        }))
        .unwrap();
        Model::new(&cfg, 12, 9).unwrap()
    }

    fn prompts() -> Vec<Prompt> {
        [[1, 2], [4, 5], [6, 1], [2, 2]]
            .iter()
            .map(|ids| Prompt {
                ids: ids.to_vec(),
                expected: String::new(),
                env: "math".into(),
            })
            .collect()
    }

    /// Reward 1 when the response starts with token 3.
    fn starts_with_3(_: &Prompt, response: &[u32]) -> f64 {
        f64::from(response.first() == Some(&3))
    }

    #[test]
    fn grpo_raises_the_reward_of_a_learnable_task() {
        let (cfg, schedule) = setup(json!({}));
        let mut objective = Rollouts::new(cfg.clone(), prompts(), None, vec![], &starts_with_3);
        let mut trainer = Trainer::new(tiny_model(), schedule.clone());
        let mut rewards = Vec::new();
        for _ in 0..30 {
            trainer.step(&mut objective).unwrap();
            rewards.push(trainer.last_metrics["reward"]);
        }
        let first: f64 = rewards[..5].iter().sum::<f64>() / 5.0;
        let last: f64 = rewards[25..].iter().sum::<f64>() / 5.0;
        assert!(first < 0.3, "starts near 1/12: {rewards:?}");
        assert!(last > 0.8, "GRPO learns to start with 3: {rewards:?}");
    }

    #[test]
    fn the_same_seed_gives_the_same_rollouts_and_weights() {
        let run = |seed: u64| {
            let (cfg, schedule) = setup(json!({"seed": seed, "steps": 3}));
            let mut objective = Rollouts::new(cfg.clone(), prompts(), None, vec![], &starts_with_3);
            let mut trainer = Trainer::new(tiny_model(), schedule.clone());
            let mut seen = Vec::new();
            for _ in 0..3 {
                trainer.step(&mut objective).unwrap();
                seen.push(objective.micro[0].batch.ids.clone());
            }
            let w =
                model::params::to_f32_vec(trainer.model.params.iter().next().unwrap().1).unwrap();
            (seen, w)
        };
        assert_eq!(run(5), run(5));
        assert_ne!(run(5).0, run(6).0, "another seed samples other responses");
    }

    #[test]
    fn a_resumed_run_generates_the_same_rollouts_and_weights() {
        let (cfg, schedule) = setup(json!({"steps": 4, "reference_policy_kl_penalty": 0.01}));
        let weights = |t: &Trainer| -> Vec<Vec<f32>> {
            t.model
                .params
                .iter()
                .map(|(_, v)| model::params::to_f32_vec(v).unwrap())
                .collect()
        };
        let reference = || Some(tiny_model());
        let mut straight = Trainer::new(tiny_model(), schedule.clone());
        let mut o = Rollouts::new(cfg.clone(), prompts(), reference(), vec![0], &starts_with_3);
        for _ in 0..4 {
            straight.step(&mut o).unwrap();
        }
        // Two steps, a checkpoint, and a fresh process's trainer and objective for the rest.
        let dir = std::env::temp_dir().join(format!("nemo-dag-grpo-resume-{}", std::process::id()));
        let mut first = Trainer::new(tiny_model(), schedule.clone());
        let mut o = Rollouts::new(cfg.clone(), prompts(), reference(), vec![0], &starts_with_3);
        for _ in 0..2 {
            first.step(&mut o).unwrap();
        }
        checkpoint::save(&first, &dir).unwrap();
        let mut resumed = Trainer::new(tiny_model(), schedule.clone());
        checkpoint::restore(&mut resumed, &dir).unwrap();
        let mut o = Rollouts::new(cfg.clone(), prompts(), reference(), vec![0], &starts_with_3);
        for _ in 0..2 {
            resumed.step(&mut o).unwrap();
        }
        let untrained = Trainer::new(tiny_model(), schedule.clone());
        assert_ne!(
            weights(&straight),
            weights(&untrained),
            "the steps did learn something"
        );
        assert_eq!(weights(&straight), weights(&resumed));
        assert_eq!(straight.curve, resumed.curve);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn loss_shares_cover_kept_response_tokens_and_overlong_rollouts_get_none() {
        let model = tiny_model();
        // Stop on token 0: some rollouts stop, most hit max_new_tokens.
        let shares = |extra: Value| -> (Vec<f32>, Vec<f32>) {
            let (cfg, _) = setup(extra);
            let mut o = Rollouts::new(cfg.clone(), prompts(), None, vec![0], &starts_with_3);
            o.prepare(&model, 0).unwrap();
            let cat = |f: fn(&Micro) -> &[f32]| -> Vec<f32> {
                o.micro.iter().flat_map(|m| f(m).to_vec()).collect()
            };
            (cat(|m| &m.weight), cat(|m| &m.batch.loss_mask))
        };
        let (w, mask) = shares(json!({}));
        let total: f32 = w.iter().sum();
        assert!(
            (total - 1.0).abs() < 1e-5,
            "token-level shares sum to 1: {total}"
        );
        let tokens = mask.iter().filter(|m| **m > 0.0).count() as f32;
        assert!(
            w.iter()
                .all(|x| *x == 0.0 || (x - 1.0 / tokens).abs() < 1e-7)
        );
        // Sequence level: every response's tokens share 1/16 of the loss.
        let (w, _) = shares(json!({"token_level_loss": false}));
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        // Overlong filtering: the truncated rollouts carry no loss, the others share all of it.
        let (w, _) = shares(json!({"overlong_filtering": true}));
        let (unfiltered, _) = shares(json!({}));
        assert!((w.iter().sum::<f32>() - 1.0).abs() < 1e-5);
        assert_ne!(w, unfiltered, "some rollouts were truncated and filtered");
    }
}
