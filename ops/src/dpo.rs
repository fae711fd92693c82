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
    MODEL_OUTPUTS, UPSTREAM_MODEL, check_training, input, model_tokenizer, train_and_publish,
};
use nemo_dag_data::chat::{ChatTemplate, Json, Message, RenderFlags, Role, TemplateSource};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::Value;
use std::path::{Path, PathBuf};
use train::dpo::{DpoObjective, LossConfig, Pair, Sequence};
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
    version: 1,
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

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nemo-dag-dpo-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
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
