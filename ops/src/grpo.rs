//! `grpo`: Group Relative Policy Optimization on prompts with verifiable answers, as NeMo-RL
//! does it (`nemo_rl/algorithms/grpo.py`; the details in docs/parity.md, "GRPO").
//!
//! ```yaml
//! grpo:
//!   op: grpo
//!   inputs: {model: "sft:model", prompts: "rl_data:data"}
//!   params:
//!     steps: 20
//!     num_prompts_per_step: 8
//!     num_generations_per_prompt: 8
//!     global_batch: 64              # = prompts × generations: one optimizer step per GRPO step
//!     micro_batch: 16
//!     max_new_tokens: 24
//!     lr: 1e-4
//! ```
//!
//! One GRPO step, top to bottom ([`Rollouts::prepare`], then [`Rollouts::loss`] per micro-batch):
//!
//! 1. Take the next `num_prompts_per_step` prompts of the train split (a seeded order, epoch
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
//! 6. One AdamW step (the shared [`train::Trainer`]: clipping, schedule, checkpoints).
//!
//! The rollouts of a step are exactly one optimizer step's batch (`global_batch` must equal
//! prompts × generations), so π_old is the current policy: `r` is 1 in value and carries the
//! gradient of log π_θ — NeMo-RL's `force_on_policy_ratio`. `overlong_filtering` gives
//! responses that hit `max_new_tokens` without a stop token no loss, but keeps their reward in
//! their group's baseline. Everything a step does is a function of the step number and the
//! weights, so a resumed run generates the same rollouts as an uninterrupted one.
//!
//! Metrics per step (log line and curve): `reward` (mean), `accuracy` (fraction of responses
//! scoring 1), `response_length` (mean new tokens), `truncated` (fraction that hit the limit),
//! `kl` (mean k3 per response token, only when the KL term is on).

use crate::pretrain::{check_training, input, model_outputs, model_tokenizer, train_and_publish};
use crate::sft::RowOrder;
use candle_core::{Device, Tensor};
use model::layers::Layout;
use model::net::Model;
use model::params::Rng;
use model::sampling::{Sampling, generate_split};
use nemo_dag_data::chat::{ChatTemplate, Message, RenderFlags, TemplateSource};
use nemo_dag_op::{DeclError, Metrics, Op, RunContext, RunError, StageDecl, typed_params};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use train::{self, MicroLoss, Objective, Schedule, Tally, Trainer, checkpoint, token_logprobs};

pub struct Grpo;

fn d_template() -> String {
    "nano3".into()
}
fn d_env() -> String {
    "math".into()
}
fn d_max_new() -> usize {
    32
}
fn d_one() -> f64 {
    1.0
}
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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    num_prompts_per_step: usize,
    num_generations_per_prompt: usize,
    #[serde(default = "d_max_new")]
    max_new_tokens: usize,
    #[serde(default = "d_one")]
    temperature: f64,
    #[serde(default = "d_one")]
    top_p: f64,
    #[serde(default = "d_template")]
    chat_template: String,
    /// The environment of rows that do not name one.
    #[serde(default = "d_env")]
    env: String,
    /// What the user turn is: the row's Gym `messages` (`responses_create_params.input`, with
    /// rl_data's instruction), or its bare `question` (as `eval` and the generated chat data
    /// phrase it).
    #[serde(default)]
    prompt: PromptField,
    #[serde(default = "d_true")]
    normalize_rewards: bool,
    #[serde(default = "d_true")]
    use_leave_one_out_baseline: bool,
    #[serde(default)]
    overlong_filtering: bool,
    #[serde(default)]
    advantage_clip_low: Option<f64>,
    #[serde(default)]
    advantage_clip_high: Option<f64>,
    #[serde(flatten)]
    loss: LossConfig,
    #[serde(flatten)]
    schedule: Schedule,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum PromptField {
    #[default]
    Messages,
    Question,
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

impl Params {
    fn rollouts_per_step(&self) -> usize {
        self.num_prompts_per_step * self.num_generations_per_prompt
    }

    fn check(&self) -> Result<(), DeclError> {
        let bad = |field: &str, msg: String| Err(DeclError::new(&["params", field], msg));
        if self.num_prompts_per_step == 0 {
            return bad("num_prompts_per_step", "must be >= 1".into());
        }
        if self.num_generations_per_prompt < 2 {
            return bad(
                "num_generations_per_prompt",
                "must be >= 2: advantages compare the responses to one prompt".into(),
            );
        }
        if self.schedule.global_batch != self.rollouts_per_step() {
            return Err(DeclError::new(
                &["params", "global_batch"],
                format!(
                    "grpo takes one optimizer step per GRPO step, so global_batch must be \
                     num_prompts_per_step × num_generations_per_prompt = {}",
                    self.rollouts_per_step()
                ),
            )
            .with_help(format!("global_batch: {}", self.rollouts_per_step())));
        }
        if self.max_new_tokens == 0 {
            return bad("max_new_tokens", "must be >= 1".into());
        }
        if !(self.temperature > 0.0 && self.temperature.is_finite()) {
            return bad(
                "temperature",
                "must be > 0: GRPO needs different responses to one prompt".into(),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", "must be in (0, 1]".into());
        }
        let l = &self.loss;
        if !(l.ratio_clip_min >= 0.0 && l.ratio_clip_min < 1.0) {
            return bad("ratio_clip_min", "must be in [0, 1)".into());
        }
        if !(l.ratio_clip_max >= 0.0 && l.ratio_clip_max.is_finite()) {
            return bad("ratio_clip_max", "must be >= 0".into());
        }
        if l.ratio_clip_c.is_some_and(|c| c <= 1.0 || !c.is_finite()) {
            return bad("ratio_clip_c", "the dual clip must be > 1".into());
        }
        if !(l.reference_policy_kl_penalty >= 0.0 && l.reference_policy_kl_penalty.is_finite()) {
            return bad("reference_policy_kl_penalty", "must be >= 0".into());
        }
        if let (Some(lo), Some(hi)) = (self.advantage_clip_low, self.advantage_clip_high)
            && lo > hi
        {
            return bad(
                "advantage_clip_low",
                "must be <= advantage_clip_high".into(),
            );
        }
        nemo_dag_data::reward::score(&self.env, "", "")
            .map_err(|e| DeclError::new(&["params", "env"], e))?;
        Ok(())
    }
}

impl Op for Grpo {
    fn name(&self) -> &'static str {
        "grpo"
    }

    fn version(&self) -> u32 {
        1
    }

    fn summary(&self) -> &'static str {
        "reinforcement learning (GRPO) on prompts with verifiable answers"
    }

    fn check(&self, stage: &StageDecl) -> Result<(), DeclError> {
        let p: Params = typed_params(stage.params)?;
        p.check()?;
        check_training(stage, None, &p.schedule, &["model", "prompts"])
    }

    fn outputs(&self, _stage: &StageDecl) -> BTreeMap<String, String> {
        model_outputs()
    }

    fn resumable(&self) -> bool {
        true
    }

    fn run(&self, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let p: Params = typed_params(ctx.stage.params).map_err(|e| RunError::new(e.message))?;
        let model_dir = input(ctx, "model")?;
        let load = || {
            checkpoint::load_model(&model_dir).map_err(|e| {
                RunError::new(format!(
                    "cannot load the model {}: {e}",
                    model_dir.display()
                ))
            })
        };
        let model = load()?;
        let reference = if p.loss.reference_policy_kl_penalty > 0.0 {
            Some(load()?)
        } else {
            None
        };
        let (tokenizer, tok_path) = model_tokenizer(&model_dir)?;
        let prompts = read_prompts(&input(ctx, "prompts")?, &p, &tokenizer, model.cfg.max_seq)?;
        writeln!(
            ctx.log,
            "grpo: {} train prompts · {} × {} rollouts per step · model {} ({} parameters){}",
            prompts.len(),
            p.num_prompts_per_step,
            p.num_generations_per_prompt,
            model.pattern,
            model.params.count(),
            if reference.is_some() {
                format!(" · KL β {}", p.loss.reference_policy_kl_penalty)
            } else {
                String::new()
            }
        )?;
        let stops: Vec<u32> = ["<|im_end|>", "<|endoftext|>"]
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        let score = |prompt: &Prompt, response: &[u32]| -> f64 {
            let text = tokenizer.decode(response, true).unwrap_or_default();
            // An environment that cannot score the response gives it 0 (as NeMo-RL and Gym do).
            nemo_dag_data::reward::score(&prompt.env, &text, &prompt.expected).unwrap_or(0.0)
        };
        let mut objective = Rollouts::new(&p, prompts, reference, stops, &score);
        let tokens = objective.tokens.clone();
        train_and_publish(
            ctx,
            Trainer::new(model, p.schedule.clone()),
            &mut objective,
            &tok_path,
            move |_| tokens.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// One train prompt: its rendered tokens and how its responses are scored.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub ids: Vec<u32>,
    pub expected: String,
    pub env: String,
}

/// The train split of an `rl_data` artifact (or a JSONL file of the same rows), rendered with
/// the chat template's generation prompt.
fn read_prompts(
    path: &Path,
    p: &Params,
    tokenizer: &tokenizers::Tokenizer,
    max_seq: usize,
) -> Result<Vec<Prompt>, RunError> {
    let file = if path.is_dir() {
        path.join("train.jsonl")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| RunError::new(format!("{}: {e}", file.display())))?;
    let template =
        ChatTemplate::load(&TemplateSource::from_param(&p.chat_template)).map_err(RunError::new)?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = |msg: String| RunError::new(format!("{}:{}: {msg}", file.display(), i + 1));
        let row: Value = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
        let input = &row["responses_create_params"]["input"];
        let messages: Vec<Message> = match (p.prompt, row["question"].as_str()) {
            (PromptField::Messages, _) if input.is_array() => serde_json::from_value(input.clone())
                .map_err(|e| at(format!("responses_create_params.input: {e}")))?,
            (PromptField::Question, Some(q)) => {
                vec![Message::new(nemo_dag_data::chat::Role::User, q)]
            }
            (PromptField::Messages, _) => {
                return Err(at(
                    "a prompt row needs `responses_create_params.input` (messages): \
                     is this an rl_data artifact? (`prompt: question` reads `question` instead)"
                        .into(),
                ));
            }
            (PromptField::Question, None) => {
                return Err(at(
                    "a prompt row needs a `question` (params.prompt is `question`)".into(),
                ));
            }
        };
        let expected = match &row["expected_answer"] {
            Value::String(s) => s.clone(),
            Value::Number(n) => n.to_string(),
            _ => return Err(at("a prompt row needs `expected_answer`".into())),
        };
        let env = row["env"].as_str().unwrap_or(&p.env).to_string();
        nemo_dag_data::reward::score(&env, "", "").map_err(at)?;
        let rendered = template
            .render(&messages, None, true, RenderFlags::default())
            .map_err(at)?;
        let ids = tokenizer
            .encode(rendered, false)
            .map_err(|e| at(format!("cannot tokenize the prompt: {e}")))?
            .get_ids()
            .to_vec();
        if ids.len() + p.max_new_tokens > max_seq {
            return Err(at(format!(
                "the prompt has {} tokens; with max_new_tokens {} that exceeds the model's max_seq {max_seq}",
                ids.len(),
                p.max_new_tokens
            )));
        }
        prompts.push(Prompt { ids, expected, env });
    }
    if prompts.is_empty() {
        return Err(RunError::new(format!("{} has no prompts", file.display())));
    }
    Ok(prompts)
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
    ids: Vec<u32>,
    labels: Vec<u32>,
    layout: Layout,
    /// Per token: the advantage of its response (0 off the response).
    adv: Tensor,
    /// Per token: its share of the global loss (0 off the response, and for filtered rollouts).
    weight: Tensor,
    /// Response tokens of the micro-batch (1/0), for the KL metric.
    mask: Tensor,
    /// Reference log-probs, when the KL term is on.
    reference: Option<Tensor>,
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
    fn new(
        p: &Params,
        prompts: Vec<Prompt>,
        reference: Option<Model>,
        stops: Vec<u32>,
        score: &'a Score<'a>,
    ) -> Rollouts<'a> {
        Rollouts {
            order: RowOrder::new(prompts.len(), p.schedule.seed as u32),
            prompts,
            prompts_per_step: p.num_prompts_per_step,
            generations: p.num_generations_per_prompt,
            sampling: Sampling {
                temperature: p.temperature,
                top_p: p.top_p,
                top_k: None,
                max_tokens: p.max_new_tokens,
            },
            seed: p.schedule.seed,
            micro_batch: p.schedule.micro_batch,
            normalize: p.normalize_rewards,
            leave_one_out: p.use_leave_one_out_baseline,
            overlong_filtering: p.overlong_filtering,
            advantage_clip: (p.advantage_clip_low, p.advantage_clip_high),
            loss: p.loss.clone(),
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
}

impl Objective for Rollouts<'_> {
    fn prepare(&mut self, model: &Model, step: u64) -> Result<usize, RunError> {
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
        let completions = generate_split(
            model,
            &prompt_ids,
            &self.sampling,
            &[],
            &mut rngs,
            kernels::workers::threads(),
            |_, ids| ids.last().is_some_and(|t| stops.contains(t)),
        )
        .map_err(train::err)?;
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
            let layout = Layout::plain(b, t);
            let tensor = |v: Vec<f32>| Tensor::from_vec(v, (b, t), &Device::Cpu);
            let reference = match &self.reference {
                Some(r) => Some(
                    token_logprobs(r, &ids, &labels, &layout)
                        .map_err(train::err)?
                        .detach(),
                ),
                None => None,
            };
            self.micro.push(Micro {
                adv: tensor(a).map_err(train::err)?,
                weight: tensor(w).map_err(train::err)?,
                mask: tensor(mask).map_err(train::err)?,
                ids,
                labels,
                layout,
                reference,
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

    fn loss(&self, model: &Model, i: usize) -> Result<MicroLoss, RunError> {
        let m = &self.micro[i];
        let mut tally = Tally::new();
        let logp = token_logprobs(model, &m.ids, &m.labels, &m.layout).map_err(train::err)?;
        // On-policy: π_old is these very weights, so the ratio is 1 in value.
        let old = logp.detach();
        let mut per_token = token_loss(&logp, &old, &m.adv, &self.loss).map_err(train::err)?;
        if let Some(reference) = &m.reference {
            let kl = kl_k3(&logp, reference).map_err(train::err)?;
            let masked = (&kl * &m.mask)
                .and_then(|k| k.sum_all()?.to_scalar::<f32>())
                .map_err(train::err)?;
            let count = m
                .mask
                .sum_all()
                .and_then(|c| c.to_scalar::<f32>())
                .map_err(train::err)?;
            tally.insert("kl_sum", masked as f64);
            tally.insert("kl_tokens", count as f64);
            per_token =
                (per_token + (kl * self.loss.reference_policy_kl_penalty)).map_err(train::err)?;
        }
        let total = (per_token * &m.weight)
            .and_then(|l| l.sum_all())
            .map_err(train::err)?;
        let value = total.to_scalar::<f32>().map_err(train::err)? as f64;
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use model::config::ModelConfig;
    use serde_json::json;

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

    fn params(extra: Value) -> Params {
        let mut p = json!({
            "num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_new_tokens": 3,
            "steps": 30, "global_batch": 16, "micro_batch": 8, "lr": 0.05, "weight_decay": 0.0,
            "reference_policy_kl_penalty": 0.0, "seed": 5
        });
        for (k, v) in extra.as_object().unwrap() {
            p[k] = v.clone();
        }
        serde_json::from_value(p).unwrap()
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
        let p = params(json!({}));
        let mut objective = Rollouts::new(&p, prompts(), None, vec![], &starts_with_3);
        let mut trainer = Trainer::new(tiny_model(), p.schedule.clone());
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
            let p = params(json!({"seed": seed, "steps": 3}));
            let mut objective = Rollouts::new(&p, prompts(), None, vec![], &starts_with_3);
            let mut trainer = Trainer::new(tiny_model(), p.schedule.clone());
            let mut seen = Vec::new();
            for _ in 0..3 {
                trainer.step(&mut objective).unwrap();
                seen.push(objective.micro[0].ids.clone());
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
        let p = params(json!({"steps": 4, "reference_policy_kl_penalty": 0.01}));
        let weights = |t: &Trainer| -> Vec<Vec<f32>> {
            t.model
                .params
                .iter()
                .map(|(_, v)| model::params::to_f32_vec(v).unwrap())
                .collect()
        };
        let reference = || Some(tiny_model());
        let mut straight = Trainer::new(tiny_model(), p.schedule.clone());
        let mut o = Rollouts::new(&p, prompts(), reference(), vec![0], &starts_with_3);
        for _ in 0..4 {
            straight.step(&mut o).unwrap();
        }
        // Two steps, a checkpoint, and a fresh process's trainer and objective for the rest.
        let dir = std::env::temp_dir().join(format!("nemo-dag-grpo-resume-{}", std::process::id()));
        let mut first = Trainer::new(tiny_model(), p.schedule.clone());
        let mut o = Rollouts::new(&p, prompts(), reference(), vec![0], &starts_with_3);
        for _ in 0..2 {
            first.step(&mut o).unwrap();
        }
        checkpoint::save(&first, &dir).unwrap();
        let mut resumed = Trainer::new(tiny_model(), p.schedule.clone());
        checkpoint::restore(&mut resumed, &dir).unwrap();
        let mut o = Rollouts::new(&p, prompts(), reference(), vec![0], &starts_with_3);
        for _ in 0..2 {
            resumed.step(&mut o).unwrap();
        }
        let untrained = Trainer::new(tiny_model(), p.schedule.clone());
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
            let p = params(extra);
            let mut o = Rollouts::new(&p, prompts(), None, vec![0], &starts_with_3);
            o.prepare(&model, 0).unwrap();
            let cat = |f: fn(&Micro) -> &Tensor| -> Vec<f32> {
                o.micro
                    .iter()
                    .flat_map(|m| f(m).flatten_all().unwrap().to_vec1::<f32>().unwrap())
                    .collect()
            };
            (cat(|m| &m.weight), cat(|m| &m.mask))
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

    #[test]
    fn bad_params_name_the_field() {
        let check = |extra: Value| params(extra).check().unwrap_err().path.join(".");
        assert_eq!(
            check(json!({"global_batch": 8, "micro_batch": 8})),
            "params.global_batch"
        );
        assert_eq!(
            check(json!({"num_generations_per_prompt": 1})),
            "params.num_generations_per_prompt"
        );
        assert_eq!(check(json!({"temperature": 0.0})), "params.temperature");
        assert_eq!(check(json!({"ratio_clip_c": 0.5})), "params.ratio_clip_c");
        assert_eq!(check(json!({"env": "chess"})), "params.env");
    }
}
