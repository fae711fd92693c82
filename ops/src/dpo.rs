//! `dpo`: Direct Preference Optimization of an upstream model on preference pairs, as NeMo-RL
//! does it (`nemo_rl/algorithms/loss/loss_functions.py: DPOLossFn`, `docs/guides/dpo.md`).
//!
//! ```yaml
//! dpo:
//!   op: dpo
//!   inputs: {model: "sft:model", data: "problems:preferences"}
//!   params:
//!     beta: 0.05                        # reference_policy_kl_penalty
//!     steps: 50
//!     global_batch: 8                   # pairs per optimizer step
//!     micro_batch: 4                    # pairs per forward/backward
//!     lr: 5e-4
//! ```
//!
//! **Data** (`data`: a `generate` artifact's directory, whose `preferences.jsonl` is read, or
//! any JSONL file). One pair a line, in either of NeMo-RL's shapes:
//!
//! - `{"context": [messages], "completions": [{"rank": 0, "completion": [messages]},
//!   {"rank": 1, "completion": [messages]}]}`: exactly two completions with different ranks;
//!   the lower rank is preferred (`chosen`).
//! - `{"prompt": …, "chosen": …, "rejected": …}` (`BinaryPreferenceDataset`): `prompt` a string
//!   (one user message) or a message list; `chosen`/`rejected` a string (one assistant
//!   message) or a message list.
//!
//! A row may also carry `tools` (a list of tool definitions, rendered by the template); other
//! keys (`task_name`, …) are ignored. Anything else is an error naming the file and line.
//!
//! **Tokens.** For each completion, the conversation `context + completion` is rendered with
//! the chat template and tokenized with the model's `tokenizer.json`; the prompt is the
//! context rendered with the generation prompt. The response is the conversation's tokens
//! after the prompt's — a row whose prompt tokens are not a prefix of the conversation's is
//! dropped and counted. The generation prompt is rendered with `enable_thinking` on when the
//! completion's first turn carries reasoning and off otherwise, so that with nano3's template
//! (`<think>\n` vs `<think></think>`) it is the prefix the completion actually starts with.
//! A conversation longer than `max_length` tokens loses the end of its response (counted);
//! one whose prompt leaves no response token is dropped.
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
//!
//! **Metrics** per logged step (in the log and the artifact's `curve`): `accuracy` (fraction of
//! pairs with `Δ > 0`), `reward_margin` (mean `Δ`, without β), `preference_loss` (mean
//! `−log σ(β·Δ)`), and `sft_loss` when `sft_loss_weight > 0`. The last step's values are also
//! top-level metrics of the artifact, beside `pairs`, `dropped_not_prefix`,
//! `dropped_prompt_too_long` and `truncated`.
//!
//! Outputs as `sft`: `model` (weights, config, tokenizer) and `checkpoint` (resumable).

use crate::pretrain::{check_training, input, model_outputs, model_tokenizer, train_and_publish};
use crate::sft::RowOrder;
use candle_core::{DType, Tensor};
use model::layers::Layout;
use model::net::Model;
use nemo_dag_data::chat::{ChatTemplate, Json, Message, RenderFlags, Role, TemplateSource};
use nemo_dag_op::{DeclError, Metrics, Op, RunContext, RunError, StageDecl, typed_params};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use train::{self, MicroLoss, Objective, Schedule, Tally, Trainer, checkpoint, token_logprobs};

pub struct Dpo;

fn d_beta() -> f64 {
    0.05
}
fn d_one() -> f64 {
    1.0
}
fn d_template() -> String {
    "nano3".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    /// β, NeMo-RL's `reference_policy_kl_penalty`.
    #[serde(default = "d_beta")]
    beta: f64,
    /// Divide each completion's log-ratio sum by its token count.
    #[serde(default)]
    preference_average_log_probs: bool,
    #[serde(default = "d_one")]
    preference_loss_weight: f64,
    #[serde(default)]
    sft_loss_weight: f64,
    /// A bundled template name, a Jinja file, or a tokenizer_config.json.
    #[serde(default = "d_template")]
    chat_template: String,
    /// Tokens per conversation (prompt + response); default the model's `max_seq`.
    #[serde(default)]
    max_length: Option<usize>,
    #[serde(flatten)]
    schedule: Schedule,
}

impl Op for Dpo {
    fn name(&self) -> &'static str {
        "dpo"
    }

    fn version(&self) -> u32 {
        1
    }

    fn summary(&self) -> &'static str {
        "direct preference optimization of an upstream model on chosen/rejected pairs"
    }

    fn check(&self, stage: &StageDecl) -> Result<(), DeclError> {
        let p: Params = typed_params(stage.params)?;
        if !(p.beta.is_finite() && p.beta > 0.0) {
            return Err(DeclError::new(&["params", "beta"], "beta must be > 0"));
        }
        for (name, w) in [
            ("preference_loss_weight", p.preference_loss_weight),
            ("sft_loss_weight", p.sft_loss_weight),
        ] {
            if !(w.is_finite() && w >= 0.0) {
                return Err(DeclError::new(
                    &["params", name],
                    format!("{name} must be a number >= 0"),
                ));
            }
        }
        if p.preference_loss_weight == 0.0 && p.sft_loss_weight == 0.0 {
            return Err(DeclError::new(
                &["params", "preference_loss_weight"],
                "preference_loss_weight and sft_loss_weight are both 0: nothing to train",
            ));
        }
        if p.max_length.is_some_and(|m| m < 2) {
            return Err(DeclError::new(
                &["params", "max_length"],
                "max_length must be >= 2 (a prompt token and a response token)",
            ));
        }
        check_training(stage, None, &p.schedule, &["model", "data"])
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
            checkpoint::load_model(&model_dir)
                .map_err(|e| RunError::new(format!("cannot load the upstream model: {e}")))
        };
        let (model, reference) = (load()?, load()?);
        let (tokenizer, tok_path) = model_tokenizer(&model_dir)?;
        let max_length = p.max_length.unwrap_or(model.cfg.max_seq);
        if max_length > model.cfg.max_seq {
            return Err(RunError::new(format!(
                "max_length {max_length} is more than the model's max_seq {}",
                model.cfg.max_seq
            )));
        }
        let template = ChatTemplate::load(&TemplateSource::from_param(&p.chat_template))
            .map_err(RunError::new)?;
        let (file, rows) = read_preferences(&input(ctx, "data")?)?;
        let tokens = Tokens {
            template: &template,
            tokenizer: &tokenizer,
            max_length,
            vocab: model.vocab,
        };
        let (pairs, stats) = tokens.pairs(&file, &rows)?;
        writeln!(
            ctx.log,
            "dpo: {} pairs from {} · {} dropped (prompt not a prefix of the conversation) · {} dropped (prompt ≥ max_length {max_length}) · {} truncated · model {} ({} parameters)",
            pairs.len(),
            file.display(),
            stats.not_prefix,
            stats.prompt_too_long,
            stats.truncated,
            model.pattern,
            model.params.count()
        )?;
        if pairs.is_empty() {
            return Err(RunError::new(format!(
                "{}: no usable preference pair ({} rows)",
                file.display(),
                rows.len()
            )));
        }
        let loss = LossConfig {
            beta: p.beta,
            average_log_probs: p.preference_average_log_probs,
            preference_weight: p.preference_loss_weight,
            sft_weight: p.sft_loss_weight,
        };
        let mut objective = DpoObjective::new(reference, pairs, loss, &p.schedule);
        let tokens: Vec<u64> = (0..p.schedule.steps)
            .map(|s| objective.tokens_in_step(s))
            .collect();
        let mut metrics = train_and_publish(
            ctx,
            Trainer::new(model, p.schedule),
            &mut objective,
            &tok_path,
            move |s| tokens.get(s as usize).copied().unwrap_or(0),
        )?;
        // The last step's figures (the curve always holds the final step).
        let last = metrics
            .get("curve")
            .and_then(Value::as_array)
            .and_then(|c| c.last())
            .and_then(|pt| pt.get("metrics"))
            .and_then(Value::as_object)
            .cloned()
            .unwrap_or_default();
        metrics.extend(last);
        metrics.insert("pairs".into(), Value::from(objective.pairs.len()));
        metrics.insert("dropped_not_prefix".into(), Value::from(stats.not_prefix));
        metrics.insert(
            "dropped_prompt_too_long".into(),
            Value::from(stats.prompt_too_long),
        );
        metrics.insert("truncated".into(), Value::from(stats.truncated));
        Ok(metrics)
    }
}

// ---------------------------------------------------------------------------------------------
// Data
// ---------------------------------------------------------------------------------------------

/// One preference row: a context and two completions, the chosen one first.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceRow {
    /// 1-based line in its file.
    pub line: usize,
    pub context: Vec<Message>,
    pub tools: Option<Vec<Json>>,
    pub chosen: Vec<Message>,
    pub rejected: Vec<Message>,
}

/// The preference file an input names (a `generate` directory's `preferences.jsonl`, or the
/// file itself) and its rows.
pub fn read_preferences(path: &Path) -> Result<(PathBuf, Vec<PreferenceRow>), RunError> {
    let file = if path.is_dir() {
        path.join("preferences.jsonl")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| {
        RunError::new(format!(
            "{}: {e} (the data must be a generate artifact's directory or a preference JSONL file)",
            file.display()
        ))
    })?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", file.display(), i + 1);
        let json = Json::parse(line).map_err(|e| RunError::new(format!("{at}: not JSON: {e}")))?;
        let row = parse_row(&json, i + 1).map_err(|why| RunError::new(format!("{at}: {why}")))?;
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(RunError::new(format!(
            "{} has no preference rows",
            file.display()
        )));
    }
    Ok((file, rows))
}

const SHAPES: &str = "a preference row is {\"context\": [messages], \"completions\": [{\"rank\": 0, \"completion\": [messages]}, {\"rank\": 1, \"completion\": [messages]}]} or {\"prompt\": …, \"chosen\": …, \"rejected\": …}";

/// One row in either shape (see the module docs).
fn parse_row(v: &Json, line: usize) -> Result<PreferenceRow, String> {
    if !matches!(v, Json::Object(_)) {
        return Err(format!("not a JSON object; {SHAPES}"));
    }
    let tools = match v.get("tools") {
        None | Some(Json::Null) => None,
        Some(Json::Array(items)) => Some(items.clone()),
        Some(_) => return Err("`tools` must be a list of tool definitions".into()),
    };
    let (context, chosen, rejected) = if v.get("context").is_some()
        || v.get("completions").is_some()
    {
        let context = messages(v.get("context"), "context", None)?;
        let completions = match v.get("completions") {
            Some(Json::Array(items)) => items,
            Some(_) => return Err("`completions` must be a list".into()),
            None => return Err("missing `completions`".into()),
        };
        if completions.len() != 2 {
            return Err(format!(
                "DPO needs exactly two completions, this row has {}",
                completions.len()
            ));
        }
        let mut ranked = Vec::new();
        for (k, c) in completions.iter().enumerate() {
            let rank = match c.get("rank") {
                Some(Json::Number(n)) => n
                    .as_i64()
                    .ok_or_else(|| format!("completions[{k}].rank must be an integer"))?,
                Some(_) => return Err(format!("completions[{k}].rank must be an integer")),
                None => return Err(format!("completions[{k}] has no `rank`")),
            };
            let name = format!("completions[{k}].completion");
            ranked.push((rank, messages(c.get("completion"), &name, None)?));
        }
        if ranked[0].0 == ranked[1].0 {
            return Err(format!(
                "both completions have rank {}; the lower rank is the preferred one",
                ranked[0].0
            ));
        }
        ranked.sort_by_key(|(rank, _)| *rank);
        let rejected = ranked.pop().map(|(_, m)| m).unwrap_or_default();
        let chosen = ranked.pop().map(|(_, m)| m).unwrap_or_default();
        (context, chosen, rejected)
    } else if v.get("prompt").is_some() || v.get("chosen").is_some() || v.get("rejected").is_some()
    {
        (
            messages(v.get("prompt"), "prompt", Some(Role::User))?,
            messages(v.get("chosen"), "chosen", Some(Role::Assistant))?,
            messages(v.get("rejected"), "rejected", Some(Role::Assistant))?,
        )
    } else {
        return Err(SHAPES.into());
    };
    Ok(PreferenceRow {
        line,
        context,
        tools,
        chosen,
        rejected,
    })
}

/// A non-empty message list; a string is one message of `string_role` where that is allowed.
fn messages(
    v: Option<&Json>,
    name: &str,
    string_role: Option<Role>,
) -> Result<Vec<Message>, String> {
    match (v, string_role) {
        (None | Some(Json::Null), _) => Err(format!("missing `{name}`")),
        (Some(Json::String(s)), Some(role)) => Ok(vec![Message::new(role, s.clone())]),
        (Some(Json::Array(items)), _) if items.is_empty() => {
            Err(format!("`{name}` is an empty message list"))
        }
        (Some(Json::Array(items)), _) => items
            .iter()
            .enumerate()
            .map(|(k, m)| Message::try_from(m.clone()).map_err(|e| format!("{name}[{k}]: {e}")))
            .collect(),
        (Some(_), Some(_)) => Err(format!("`{name}` must be a string or a message list")),
        (Some(_), None) => Err(format!("`{name}` must be a message list")),
    }
}

// ---------------------------------------------------------------------------------------------
// Tokens
// ---------------------------------------------------------------------------------------------

/// A tokenized conversation: `ids[start..]` is the response.
#[derive(Debug, Clone, PartialEq)]
pub struct Sequence {
    pub ids: Vec<u32>,
    pub start: usize,
}

impl Sequence {
    /// Response tokens (each predicted from the tokens before it).
    fn response_len(&self) -> usize {
        self.ids.len() - self.start
    }
}

/// A tokenized preference pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    pub chosen: Sequence,
    pub rejected: Sequence,
}

/// Rows that did not become pairs as they were, by reason.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct TokenStats {
    pub not_prefix: u64,
    pub prompt_too_long: u64,
    pub truncated: u64,
}

enum Tokenized {
    Kept(Sequence, bool),
    NotPrefix,
    PromptTooLong,
}

struct Tokens<'a> {
    template: &'a ChatTemplate,
    tokenizer: &'a tokenizers::Tokenizer,
    max_length: usize,
    vocab: usize,
}

impl Tokens<'_> {
    fn pairs(
        &self,
        file: &Path,
        rows: &[PreferenceRow],
    ) -> Result<(Vec<Pair>, TokenStats), RunError> {
        let mut stats = TokenStats::default();
        let mut pairs = Vec::new();
        for row in rows {
            let at = |e: String| RunError::new(format!("{}:{}: {e}", file.display(), row.line));
            let c = self.completion(row, &row.chosen).map_err(at)?;
            let r = self.completion(row, &row.rejected).map_err(at)?;
            match (c, r) {
                (Tokenized::Kept(chosen, tc), Tokenized::Kept(rejected, tr)) => {
                    stats.truncated += u64::from(tc || tr);
                    pairs.push(Pair { chosen, rejected });
                }
                (Tokenized::NotPrefix, _) | (_, Tokenized::NotPrefix) => stats.not_prefix += 1,
                _ => stats.prompt_too_long += 1,
            }
        }
        Ok((pairs, stats))
    }

    fn completion(&self, row: &PreferenceRow, completion: &[Message]) -> Result<Tokenized, String> {
        let first = completion.first();
        let thinking = first.is_some_and(|m| {
            m.reasoning_content
                .as_deref()
                .is_some_and(|r| !r.trim().is_empty())
                || m.content.trim_start().starts_with("<think>")
        });
        let flags = RenderFlags {
            enable_thinking: thinking,
            ..RenderFlags::default()
        };
        let tools = row.tools.as_deref();
        let prompt = self.template.render(&row.context, tools, true, flags)?;
        let mut all = row.context.clone();
        all.extend(completion.iter().cloned());
        let full = self.template.render(&all, tools, false, flags)?;
        let (prompt, mut ids) = (self.encode(&prompt)?, self.encode(&full)?);
        if !ids.starts_with(&prompt) || ids.len() == prompt.len() {
            return Ok(Tokenized::NotPrefix);
        }
        if let Some(t) = ids.iter().find(|t| **t as usize >= self.vocab) {
            return Err(format!(
                "token id {t} is outside the model's vocabulary ({})",
                self.vocab
            ));
        }
        if prompt.len() >= self.max_length {
            return Ok(Tokenized::PromptTooLong);
        }
        let truncated = ids.len() > self.max_length;
        ids.truncate(self.max_length);
        Ok(Tokenized::Kept(
            Sequence {
                ids,
                start: prompt.len(),
            },
            truncated,
        ))
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| format!("cannot tokenize: {e}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Loss
// ---------------------------------------------------------------------------------------------

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
        loss_sum: per_pair.iter().sum(),
        preference_sum: pref.iter().sum(),
        sft_sum: nll.iter().sum(),
        correct: delta.iter().filter(|d| **d > 0.0).count() as f64,
        margin_sum: delta.iter().sum(),
    })
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

    fn loss(&self, model: &Model, i: usize) -> Result<MicroLoss, RunError> {
        let from = (i * self.micro_batch).min(self.step_pairs.len());
        let to = ((i + 1) * self.micro_batch).min(self.step_pairs.len());
        let pairs: Vec<&Pair> = self.step_pairs[from..to]
            .iter()
            .map(|k| &self.pairs[*k])
            .collect();
        let c = collate(&pairs);
        let (b, t) = (c.layout.batch, c.layout.len);
        let mask =
            Tensor::from_vec(c.mask, (b, t), &candle_core::Device::Cpu).map_err(train::err)?;
        let sums = |m: &Model| -> candle_core::Result<Tensor> {
            (token_logprobs(m, &c.ids, &c.labels, &c.layout)? * &mask)?.sum(1)
        };
        let policy = sums(model).map_err(train::err)?;
        let reference = sums(&self.reference).map_err(train::err)?.detach();
        let terms = preference_terms(&policy, &reference, &c.counts, &self.cfg, self.global_batch)
            .map_err(train::err)?;
        Ok(MicroLoss {
            total: terms.total,
            sum: terms.loss_sum,
            count: pairs.len() as f64,
            tally: Tally::from([
                ("pairs", pairs.len() as f64),
                ("correct", terms.correct),
                ("margin", terms.margin_sum),
                ("preference", terms.preference_sum),
                ("sft", terms.sft_sum),
            ]),
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use model::config::ModelConfig;
    use model::params::to_f32_vec;
    use serde_json::json;
    use train::Point;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nemo-dag-dpo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

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
        assert!(close(s.preference_sum, 1.523_742_012, 1e-6));
        assert_eq!(s.correct, 1.0, "only pair 1 has Δ > 0");
        assert!(close(s.margin_sum, 0.0, 1e-6));
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
        assert!(close(a.margin_sum, 0.0, 1e-6));
        assert_eq!(a.correct, 1.0);

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
        assert!(close(s.sft_sum, 4.5, 1e-6));

        // Δ = 0 everywhere (policy = reference): ln 2, no pair counts as correct, and the
        // gradient is −β·σ(0)/G on chosen rows and +β·σ(0)/G on rejected ones, not 0.
        let v = Var::from_tensor(&reference).unwrap();
        let s = preference_terms(v.as_tensor(), &reference, &counts, &cfg(0.5, false), 2).unwrap();
        let l = s.total.to_scalar::<f32>().unwrap() as f64;
        assert!(close(l, std::f64::consts::LN_2, 1e-6), "{l}");
        assert_eq!(s.correct, 0.0);
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

    // --- training on token-level pairs with a tiny model ---

    const VOCAB: usize = 16;

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
        m.params
            .iter()
            .map(|(_, v)| to_f32_vec(v.as_tensor()).unwrap())
            .collect()
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
            let r = trainer.run(&mut objective, ckpt, |_| 0, &mut Vec::new(), stop);
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

    // --- data ---

    fn read_err(dir: &Path, rows: &str) -> String {
        let f = dir.join("p.jsonl");
        std::fs::write(&f, rows).unwrap();
        read_preferences(&f).unwrap_err().message
    }

    #[test]
    fn both_shapes_read_and_bad_rows_name_their_line() {
        let dir = tempdir("rows");
        let f = dir.join("p.jsonl");
        let good = r#"{"context": [{"role": "user", "content": "q"}], "completions": [{"rank": 1, "completion": [{"role": "assistant", "content": "bad"}]}, {"rank": 0, "completion": [{"role": "assistant", "content": "good"}]}], "task_name": "x"}"#;
        let binary = r#"{"prompt": "q", "chosen": "good", "rejected": [{"role": "assistant", "content": "bad"}]}"#;
        std::fs::write(&f, format!("{good}\n\n{binary}\n")).unwrap();
        let (file, rows) = read_preferences(&f).unwrap();
        assert_eq!(file, f);
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r.context, [Message::new(Role::User, "q")]);
            assert_eq!(
                r.chosen,
                [Message::new(Role::Assistant, "good")],
                "lower rank first"
            );
            assert_eq!(r.rejected, [Message::new(Role::Assistant, "bad")]);
        }
        assert_eq!((rows[0].line, rows[1].line), (1, 3));
        // A directory reads its preferences.jsonl.
        std::fs::rename(&f, dir.join("preferences.jsonl")).unwrap();
        assert_eq!(read_preferences(&dir).unwrap().1, rows);

        let at = format!("{}:2: ", dir.join("p.jsonl").display());
        let three = good.replace(
            r#"{"rank": 0,"#,
            r#"{"rank": 2, "completion": [{"role": "assistant", "content": "x"}]}, {"rank": 0,"#,
        );
        for (bad, why) in [
            (three.as_str(), "exactly two completions, this row has 3"),
            (
                &good.replace(r#""rank": 0"#, r#""rank": 1"#),
                "both completions have rank 1",
            ),
            (
                &good.replace(r#""rank": 0, "#, ""),
                "completions[1] has no `rank`",
            ),
            (
                r#"{"context": [{"role": "user", "content": "q"}]}"#,
                "missing `completions`",
            ),
            (r#"{"completions": []}"#, "missing `context`"),
            (r#"{"prompt": "q", "chosen": "a"}"#, "missing `rejected`"),
            (
                r#"{"prompt": 3, "chosen": "a", "rejected": "b"}"#,
                "`prompt` must be a string or a message list",
            ),
            (
                r#"{"prompt": "q", "chosen": [], "rejected": "b"}"#,
                "`chosen` is an empty message list",
            ),
            (
                r#"{"prompt": "q", "chosen": [{"content": "a"}], "rejected": "b"}"#,
                "chosen[0]: message has no role",
            ),
            (r#"{"messages": []}"#, "a preference row is"),
            ("[1, 2]", "not a JSON object"),
            ("{oops", "not JSON"),
        ] {
            let e = read_err(&dir, &format!("{good}\n{bad}\n"));
            assert!(e.starts_with(&at) && e.contains(why), "{bad}\n→ {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    // --- the op, in-process: generate → train_tokenizer → (a model) → dpo ---

    fn run_op(
        op: &dyn Op,
        params: Value,
        inputs: BTreeMap<String, PathBuf>,
        out: &Path,
    ) -> (Result<Metrics, RunError>, String) {
        std::fs::create_dir_all(out).unwrap();
        let names: Vec<&str> = inputs.keys().map(String::as_str).collect();
        let decl = StageDecl {
            name: op.name(),
            params: &params,
            inputs: names.clone(),
            outputs: &BTreeMap::new(),
            cmd: None,
        };
        op.check(&decl).unwrap();
        let outputs = op.outputs(&decl);
        let mut log = Vec::new();
        let mut ctx = RunContext {
            stage: StageDecl {
                outputs: &outputs,
                ..decl
            },
            inputs: &inputs,
            out_dir: out,
            log: &mut log,
        };
        let r = op.run(&mut ctx);
        (r, String::from_utf8(log).unwrap())
    }

    /// A generate artifact and a fresh model (with its tokenizer) on its problems.
    fn setup(dir: &Path) -> (PathBuf, PathBuf) {
        let data = dir.join("gen");
        let params = json!({"kind": "arithmetic", "count": 24, "seed": 1, "max_operand": 9});
        run_op(&crate::generate::Generate, params, BTreeMap::new(), &data)
            .0
            .unwrap();
        let tok = dir.join("tok");
        let inputs = BTreeMap::from([("corpus".to_string(), data.join("pretrain.jsonl"))]);
        run_op(
            &crate::train_tokenizer::TrainTokenizer,
            json!({"vocab_size": 300}),
            inputs,
            &tok,
        )
        .0
        .unwrap();
        let tokenizer = tokenizers::Tokenizer::from_file(tok.join("tokenizer.json")).unwrap();
        let cfg: ModelConfig = serde_json::from_value(
            json!({"pattern": "*-", "hidden": 16, "heads": 2, "head_dim": 8, "ffn": 32, "max_seq": 128}),
        )
        .unwrap();
        let model = Model::new(&cfg, tokenizer.get_vocab_size(true), 1).unwrap();
        let model_dir = dir.join("model");
        checkpoint::save_model(&model, &model_dir).unwrap();
        std::fs::copy(tok.join("tokenizer.json"), model_dir.join("tokenizer.json")).unwrap();
        (data, model_dir)
    }

    #[test]
    fn the_op_trains_on_generated_preferences_and_publishes_a_model() {
        let dir = tempdir("op");
        let (data, model_dir) = setup(&dir);
        let inputs = BTreeMap::from([
            ("model".to_string(), model_dir.clone()),
            ("data".to_string(), data.clone()),
        ]);
        let params = json!({"steps": 3, "global_batch": 4, "micro_batch": 2, "lr": 1e-3,
                            "beta": 0.1, "max_length": 48, "log_interval": 1});
        let out = dir.join("dpo");
        let (r, log) = run_op(&Dpo, params.clone(), inputs.clone(), &out);
        let m = r.unwrap_or_else(|e| panic!("{e}\n{log}"));
        assert_eq!(m["pairs"], 24, "{log}");
        assert_eq!(m["dropped_not_prefix"], 0, "{log}");
        assert_eq!(m["dropped_prompt_too_long"], 0, "{log}");
        // The rejected completions (a tool call, then the answer) run past 48 tokens.
        assert!(m["truncated"].as_u64().unwrap() > 0, "{log}");
        assert_eq!(m["step"], 3);
        for k in ["accuracy", "reward_margin", "preference_loss"] {
            assert!(m[k].as_f64().is_some_and(f64::is_finite), "{k}: {m:?}");
        }
        assert!(log.contains("accuracy"), "{log}");
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            assert!(out.join("model").join(f).is_file(), "model/{f}");
        }
        assert!(checkpoint::latest(&out.join("checkpoint")).is_some());
        // The published weights moved away from the upstream ones.
        let before = weights(&checkpoint::load_model(&model_dir).unwrap());
        let after = weights(&checkpoint::load_model(&out.join("model")).unwrap());
        assert_ne!(before, after);
        // A max_length the model cannot hold is refused.
        let mut p = params.clone();
        p["max_length"] = json!(129);
        let (r, _) = run_op(&Dpo, p, inputs, &dir.join("too-long"));
        assert!(r.unwrap_err().message.contains("max_seq 128"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn responses_start_where_the_generation_prompt_ends() {
        let dir = tempdir("tokens");
        let (_, model_dir) = setup(&dir);
        let tokenizer = tokenizers::Tokenizer::from_file(model_dir.join("tokenizer.json")).unwrap();
        let template = ChatTemplate::load(&TemplateSource::from_param("nano3")).unwrap();
        let tokens = Tokens {
            template: &template,
            tokenizer: &tokenizer,
            max_length: 128,
            vocab: tokenizer.get_vocab_size(true),
        };
        let f = dir.join("p.jsonl");
        std::fs::write(
            &f,
            concat!(
                r#"{"prompt": "What is 1 + 2?", "chosen": [{"role": "assistant", "content": "3", "reasoning_content": "1 + 2 = 3."}], "rejected": "4"}"#,
                "\n"
            ),
        )
        .unwrap();
        let (_, rows) = read_preferences(&f).unwrap();
        let (pairs, stats) = tokens.pairs(&f, &rows).unwrap();
        assert_eq!(stats, TokenStats::default());
        let text = |s: &Sequence, from: usize| tokenizer.decode(&s.ids[from..], false).unwrap();
        // With reasoning, the prompt ends in `<think>\n`; without, in `<think></think>`.
        let c = &pairs[0].chosen;
        assert!(
            text(c, 0)
                .ends_with("<|im_start|>assistant\n<think>\n1 + 2 = 3.\n</think>\n3<|im_end|>\n")
        );
        assert_eq!(text(c, c.start), "1 + 2 = 3.\n</think>\n3<|im_end|>\n");
        let r = &pairs[0].rejected;
        assert_eq!(text(r, r.start), "4<|im_end|>\n");
        assert!(text(r, 0)[..].contains("<think></think>4"));
        // max_length cuts the response's end; a prompt that fills it drops the row.
        let short = Tokens {
            max_length: r.start + 1,
            ..tokens
        };
        let (cut, stats) = short.pairs(&f, &rows).unwrap();
        assert_eq!(stats.truncated, 1);
        assert_eq!(cut[0].rejected.ids.len(), r.start + 1);
        let none = Tokens {
            max_length: r.start.min(c.start),
            ..tokens
        };
        let (kept, stats) = none.pairs(&f, &rows).unwrap();
        assert!(kept.is_empty());
        assert_eq!(stats.prompt_too_long, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
