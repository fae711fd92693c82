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
//! The algorithm is [`train::grpo`]; this op reads the prompts, loads the policy (and the
//! reference model when the KL term is on), scores responses with `nemo_dag_data::reward`, and
//! publishes the trained model. One GRPO step, top to bottom:
//!
//! 1. Take the next `num_prompts_per_step` prompts of the train split (a seeded order, epoch
//!    after epoch) and repeat each `num_generations_per_prompt` times, contiguously.
//! 2. Generate a response for every repeat with the current weights (temperature, top-p; each
//!    rollout has its own seeded generator) until `<|im_end|>`/`<|endoftext|>` or
//!    `max_new_tokens`.
//! 3. Score each response with its environment (`math`: the last `\boxed{}` by value; `mcq`: the
//!    letter). An environment that fails scores 0.
//! 4. Advantages per group of identical prompts ([`grpo::advantages`]): leave-one-out baseline and
//!    standard deviation, divided only where the deviation is > 0.
//! 5. The loss of every response token ([`grpo::token_loss`]): `max(−A·r, −A·clip(r, 1 − ε_low,
//!    1 + ε_high))` with `r = π_θ / π_old`, plus `β · k3` KL to the reference model when
//!    `reference_policy_kl_penalty > 0`, summed over the global batch's response tokens and
//!    divided by their number (`token_level_loss`), or averaged per response first.
//! 6. One AdamW step (the shared [`Trainer`]: clipping, schedule, checkpoints).
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

use crate::training::{
    MODEL_OUTPUTS, UPSTREAM_MODEL, check_training, input, model_plan, model_tokenizer,
    planned_model, train_and_publish,
};
use model::sampling::Sampling;
use nemo_dag_data::chat::{ChatTemplate, Message, RenderFlags, STOP_TOKENS, TemplateSource};
use nemo_dag_op::{
    DeclError, Metrics, Op, Outputs, Plan, Port, RunContext, RunError, Spec, StageDecl, Upstream,
};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;
use train::footprint::{Shape, Sized};
use train::grpo::{self, LossConfig, Prompt, Rollouts};
use train::{Schedule, Trainer, checkpoint};

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

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
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

impl Params {
    /// The algorithm's settings.
    fn config(&self) -> grpo::Config {
        grpo::Config {
            prompts_per_step: self.num_prompts_per_step,
            generations: self.num_generations_per_prompt,
            sampling: Sampling {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: None,
                max_tokens: self.max_new_tokens,
            },
            seed: self.schedule.seed,
            micro_batch: self.schedule.micro_batch,
            normalize_rewards: self.normalize_rewards,
            leave_one_out: self.use_leave_one_out_baseline,
            overlong_filtering: self.overlong_filtering,
            advantage_clip: (self.advantage_clip_low, self.advantage_clip_high),
            loss: self.loss.clone(),
        }
    }

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

static SPEC: Spec = Spec {
    name: "grpo",
    // 2: its model keeps the chat template it rendered the prompts with (`chat_template.jinja`).
    version: 2,
    summary: "reinforcement learning (GRPO) on prompts with verifiable answers",
    inputs: &[
        UPSTREAM_MODEL,
        Port {
            name: "prompts",
            required: true,
            what: "an rl_data artifact or a JSONL file of its rows",
        },
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(MODEL_OUTPUTS),
    resumable: true,
    launched: false,
    gpu: true,
};

impl Op for Grpo {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        p.check()?;
        check_training(None, &p.schedule)
    }

    /// The upstream model: each step generates `num_prompts_per_step ×
    /// num_generations_per_prompt` rollouts with the decoding caches, then trains on
    /// micro-batches of `micro_batch` of them. A rollout is a prompt and up to
    /// `max_new_tokens`; prompt lengths are not known before the data is read, so the plan
    /// takes every rollout at the model's `max_seq`, an upper bound.
    fn plan(&self, p: &Params, upstream: &Upstream, _: &StageDecl) -> Plan {
        let Some(model) = planned_model(upstream) else {
            return Plan::default();
        };
        let estimate = Sized::new(&model.config, model.vocab).map(|sized| {
            let len = model.config.max_seq;
            let rollouts = p.num_prompts_per_step * p.num_generations_per_prompt;
            let micro = p.schedule.micro_batch.max(1);
            let shape = Shape {
                rows: micro,
                len,
                micro_batches: rollouts.div_ceil(micro),
                steps: p.schedule.steps,
            };
            let mut extra = vec![(
                "rollout caches".to_string(),
                sized.cache_bytes(rollouts, len),
            )];
            if p.loss.reference_policy_kl_penalty > 0.0 {
                extra.push(("reference model".to_string(), sized.weight_bytes()));
            }
            sized.training_between(2, shape, extra, "grpo, rollouts at max_seq")
        });
        model_plan(model, estimate)
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
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
        let template = ChatTemplate::load(&TemplateSource::from_param(&p.chat_template))
            .map_err(RunError::new)?;
        let prompts = read_prompts(
            &input(ctx, "prompts")?,
            p,
            &template,
            &tokenizer,
            model.cfg.max_seq,
        )?;
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
        let stops: Vec<u32> = STOP_TOKENS
            .iter()
            .filter_map(|t| tokenizer.token_to_id(t))
            .collect();
        let score = |prompt: &Prompt, response: &[u32]| -> f64 {
            let text = tokenizer.decode(response, true).unwrap_or_default();
            // An environment that cannot score the response gives it 0 (as NeMo-RL and Gym do).
            nemo_dag_data::reward::score(&prompt.env, &text, &prompt.expected).unwrap_or(0.0)
        };
        let mut objective = Rollouts::new(p.config(), prompts, reference, stops, &score);
        let tokens = objective.tokens.clone();
        train_and_publish(
            ctx,
            Trainer::new(model, p.schedule.clone()),
            &mut objective,
            &tok_path,
            Some(template.source()),
            move |_| tokens.load(std::sync::atomic::Ordering::Relaxed),
        )
    }
}

/// The train split of an `rl_data` artifact (or a JSONL file of the same rows), rendered with
/// the chat template's generation prompt.
fn read_prompts(
    path: &Path,
    p: &Params,
    template: &ChatTemplate,
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
        nemo_dag_data::reward::score(&env, "", "").map_err(|e| at(e.message))?;
        let rendered = template
            .render(&messages, None, true, RenderFlags::default())
            .map_err(|e| at(e.message))?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
