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
//! any JSONL file): one pair a line, in either of NeMo-RL's shapes
//! ([`nemo_dag_data::preference`]).
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
//! **Loss.** [`train::dpo`]: `−log σ(β·Δ)` of each pair's reward margin against a frozen
//! copy of the upstream weights, plus an optional SFT term on the chosen completion.
//!
//! **Metrics** per logged step (in the log and the artifact's `curve`): `accuracy` (fraction of
//! pairs with `Δ > 0`), `reward_margin` (mean `Δ`, without β), `preference_loss` (mean
//! `−log σ(β·Δ)`), and `sft_loss` when `sft_loss_weight > 0`. The last step's values are also
//! top-level metrics of the artifact, beside `pairs`, `dropped_not_prefix`,
//! `dropped_prompt_too_long` and `truncated`.
//!
//! Outputs as `sft`: `model` (weights, config, tokenizer) and `checkpoint` (resumable).

use crate::training::{
    MODEL_OUTPUTS, UPSTREAM_MODEL, check_training, input, model_plan, model_tokenizer,
    planned_model, train_and_publish,
};
use nemo_dag_data::chat::{ChatTemplate, Message, RenderFlags, TemplateSource};
use nemo_dag_data::preference::{PreferenceRow, read_preferences};
use nemo_dag_op::{
    DeclError, Metrics, Op, Outputs, Plan, Port, RunContext, RunError, Spec, StageDecl, Upstream,
};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;
use train::dpo::{DpoObjective, LossConfig, Pair, Sequence};
use train::footprint::{Shape, Sized};
use train::{Schedule, Trainer, checkpoint};

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
pub struct Params {
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

static SPEC: Spec = Spec {
    name: "dpo",
    // 2: its model keeps the chat template it rendered the pairs with (`chat_template.jinja`).
    version: 2,
    summary: "direct preference optimization of an upstream model on chosen/rejected pairs",
    inputs: &[
        UPSTREAM_MODEL,
        Port {
            name: "data",
            required: true,
            what: "preference pairs: a generate artifact or a JSONL file",
        },
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(MODEL_OUTPUTS),
    resumable: true,
    launched: false,
    gpu: true,
};

impl Op for Dpo {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
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
        check_training(None, &p.schedule)
    }

    /// The upstream model, trained on micro-batches of `micro_batch` pairs (twice as many
    /// rows) beside a frozen copy of itself. Rows are padded to the longest of their
    /// micro-batch, which the plan cannot know: it takes every row at `max_length`, an upper
    /// bound.
    fn plan(&self, p: &Params, upstream: &Upstream, _: &StageDecl) -> Plan {
        let Some(model) = planned_model(upstream) else {
            return Plan::default();
        };
        let estimate = Sized::new(&model.config, model.vocab).map(|sized| {
            let shape = Shape {
                rows: 2 * p.schedule.micro_batch,
                len: p.max_length.unwrap_or(model.config.max_seq),
                micro_batches: p
                    .schedule
                    .global_batch
                    .div_ceil(p.schedule.micro_batch.max(1)),
                steps: p.schedule.steps,
            };
            let reference = vec![("reference model".to_string(), sized.weight_bytes())];
            sized.training_between(2, shape, reference, "dpo, rows at max_length")
        });
        model_plan(model, estimate)
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
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
            Trainer::new(model, p.schedule.clone()),
            &mut objective,
            &tok_path,
            Some(template.source()),
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
        metrics.insert("pairs".into(), Value::from(objective.pairs().len()));
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
// Tokens
// ---------------------------------------------------------------------------------------------

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

#[cfg(test)]
mod tests {
    use super::*;
    use model::config::ModelConfig;
    use model::net::Model;
    use serde_json::json;
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nemo-dag-dpo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    // --- data ---

    // --- the op, in-process: generate → train_tokenizer → (a model) → dpo ---

    /// A generate artifact and a fresh model (with its tokenizer) on its problems.
    fn setup(dir: &Path) -> (PathBuf, PathBuf) {
        let data = dir.join("gen");
        let params = json!({"kind": "arithmetic", "count": 24, "seed": 1, "max_operand": 9});
        crate::testing::run_op(&crate::generate::Generate, params, BTreeMap::new(), &data)
            .0
            .unwrap();
        let tok = dir.join("tok");
        let inputs = BTreeMap::from([("corpus".to_string(), data.join("pretrain.jsonl"))]);
        crate::testing::run_op(
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
        let (r, log) = crate::testing::run_op(&Dpo, params.clone(), inputs.clone(), &out);
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
        let before = checkpoint::load_model(&model_dir).unwrap().params.values();
        let after = checkpoint::load_model(&out.join("model"))
            .unwrap()
            .params
            .values();
        assert_ne!(before.unwrap(), after.unwrap());
        // A max_length the model cannot hold is refused.
        let mut p = params.clone();
        p["max_length"] = json!(129);
        let (r, _) = crate::testing::run_op(&Dpo, p, inputs, &dir.join("too-long"));
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
