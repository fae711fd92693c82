//! `eval`: score a model artifact — perplexity on held-out tokens, multiple-choice accuracy by
//! log-likelihood, and accuracy on generation tasks checked by a verifier.
//!
//! ```yaml
//! eval_sft:
//!   op: eval
//!   inputs: {model: "sft:model", data: "pretrain_data:data", tasks: "rl_data:data",
//!            choices: "eval_problems:choices"}
//!   params:
//!     perplexity: {split: valid, seq_length: 128, max_windows: 64}
//!     multiple_choice: {limit: 100, target_delimiter: " "}
//!     generation: {split: test, limit: 100, max_tokens: 32, chat_template: nano3,
//!                  temperature: 0.0, top_p: 1.0, seed: 0, stop: ["</answer>"],
//!                  contains: ["<tool_call>"]}
//! ```
//!
//! **Perplexity** (`data`: a `tokenize` artifact): the documents of one split of its
//! `blend.json`, in order, as one token stream cut into windows of `seq_length + 1` tokens (stride
//! `seq_length`); `exp(Σ cross-entropy / tokens)` over at most `max_windows` windows.
//!
//! **Multiple choice** (`choices`: a JSONL file of `{context, choices, gold}` rows): each
//! choice's log-likelihood after the context, `acc` and `acc_norm` as lm-evaluation-harness
//! scores them ([`train::choice`]), with the chance level for reference.
//!
//! **Generation** (`tasks`: an `rl_data` artifact, whose `<split>.jsonl` is read, or any JSONL
//! file): each row's `question` becomes a user turn rendered with the chat template and a
//! generation prompt; the model decodes (greedily by default; `temperature`, `top_p`, `top_k`
//! sample, row `i` of the file from its own generator seeded by `seed` and `i`) until
//! `<|im_end|>`/`<|endoftext|>`, a `stop` string, or `max_tokens`; the response (cut before a
//! stop string) is scored against `expected_answer` by the row's `env` (default `env` param,
//! `math`) with [`nemo_dag_data::reward`]. Accuracy is the mean score. Decoding is cached (KV caches for
//! attention, conv/SSM states for Mamba: [`model::decode`]), batched `batch` prompts at a
//! time with left padding that no row can see.
//!
//! **On a GPU** (the stage's `resources.device`): the model's weights are uploaded once;
//! perplexity and multiple choice are scored by the GPU trainer's forward
//! ([`train::gpu::Scoring`], bf16 matmuls as training's), and generation decodes there with
//! the same weights and matmuls ([`train::gpu::Decoding`]: KV and SSM caches on the device, the
//! host sampling from each step's logits), one `batch` of prompts after another.
//!
//! Output `results/results.json`; the same numbers are the artifact's metrics, and the log ends
//! with a small table.

use crate::training::{Executor, Gpu, blend_split, input, model_tokenizer};
use kernels::launch::Launcher;
use model::net::Model;
use model::sampling::Sampling;
use nemo_dag_data::chat::{ChatTemplate, Message, RenderFlags, Role, STOP_TOKENS, TemplateSource};
use nemo_dag_data::megatron::IndexedReader;
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::Path;
use train::eval::Scorer;
use train::gpu::{DeviceStep, Scoring};
use train::{self, checkpoint};

pub struct Eval;

fn d_valid() -> String {
    "valid".into()
}
fn d_test() -> String {
    "test".into()
}
fn d_seq() -> usize {
    128
}
fn d_windows() -> usize {
    64
}
fn d_limit() -> usize {
    100
}
fn d_max_tokens() -> usize {
    32
}
fn d_template() -> String {
    "nano3".into()
}
fn d_env() -> String {
    "math".into()
}
fn d_batch() -> usize {
    16
}
fn d_top_p() -> f64 {
    1.0
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Perplexity {
    #[serde(default = "d_valid")]
    split: String,
    #[serde(default = "d_seq")]
    seq_length: usize,
    #[serde(default = "d_windows")]
    max_windows: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Generation {
    #[serde(default = "d_test")]
    split: String,
    /// At most this many rows (the first ones).
    #[serde(default = "d_limit")]
    limit: usize,
    #[serde(default = "d_max_tokens")]
    max_tokens: usize,
    #[serde(default = "d_template")]
    chat_template: String,
    #[serde(default = "d_env")]
    env: String,
    /// Prompts decoded together.
    #[serde(default = "d_batch")]
    batch: usize,
    /// 0: greedy (argmax).
    #[serde(default)]
    temperature: f64,
    /// Nucleus sampling: the smallest most-likely set with this much probability.
    #[serde(default = "d_top_p")]
    top_p: f64,
    #[serde(default)]
    top_k: Option<usize>,
    #[serde(default)]
    seed: u64,
    /// A response ends before the first of these strings.
    #[serde(default)]
    stop: Vec<String>,
    /// Also report the fraction of responses that contain each of these strings (special
    /// tokens such as `<tool_call>` included), e.g. how often a model calls a tool unasked.
    #[serde(default)]
    contains: Vec<String>,
}

impl Generation {
    /// The algorithm's settings.
    fn config(&self) -> train::eval::Generation {
        train::eval::Generation {
            sampling: Sampling {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
                max_tokens: self.max_tokens,
            },
            batch: self.batch,
            seed: self.seed,
            stop: self.stop.clone(),
            contains: self.contains.clone(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    #[serde(default)]
    perplexity: Option<Perplexity>,
    #[serde(default)]
    multiple_choice: Option<MultipleChoice>,
    #[serde(default)]
    generation: Option<Generation>,
}

fn d_delimiter() -> String {
    " ".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MultipleChoice {
    /// At most this many rows (the first ones).
    #[serde(default = "d_limit")]
    limit: usize,
    /// Put between the context and each choice (lm-eval's `target_delimiter`).
    #[serde(default = "d_delimiter")]
    target_delimiter: String,
    /// Sequences scored together.
    #[serde(default = "d_batch")]
    batch: usize,
}

static SPEC: Spec = Spec {
    name: "eval",
    version: 2,
    summary: "score a model: perplexity on held-out tokens, accuracy on verifiable generation tasks",
    inputs: &[
        Port {
            name: "model",
            required: true,
            what: "the model to score",
        },
        Port {
            name: "data",
            required: false,
            what: "a tokenize artifact, for perplexity",
        },
        Port {
            name: "choices",
            required: false,
            what: "a JSONL file of {context, choices, gold} rows, for multiple_choice",
        },
        Port {
            name: "tasks",
            required: false,
            what: "a JSONL file of prompts with answers, for generation",
        },
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("results", "results")]),
    resumable: false,
    launched: false,
    gpu: true,
};

impl Op for Eval {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        let need = |name: &str, why: &str| -> Result<(), DeclError> {
            if stage.inputs.contains(&name) {
                Ok(())
            } else {
                Err(DeclError::new(
                    &["inputs"],
                    format!("eval needs an input named `{name}` {why}"),
                ))
            }
        };
        if p.perplexity.is_none() && p.generation.is_none() && p.multiple_choice.is_none() {
            return Err(DeclError::new(
                &["params"],
                "eval needs at least one of `perplexity:`, `multiple_choice:`, `generation:` in params",
            ));
        }
        if let Some(mc) = &p.multiple_choice {
            need(
                "choices",
                "(a JSONL file of {context, choices, gold} rows) for multiple_choice",
            )?;
            if mc.limit == 0 || mc.batch == 0 {
                return Err(DeclError::new(
                    &["params", "multiple_choice"],
                    "limit and batch must be > 0",
                ));
            }
        }
        if let Some(ppl) = &p.perplexity {
            need("data", "(a tokenize artifact) for perplexity")?;
            if ppl.seq_length == 0 || ppl.max_windows == 0 {
                return Err(DeclError::new(
                    &["params", "perplexity"],
                    "seq_length and max_windows must be > 0",
                ));
            }
        }
        if let Some(g) = &p.generation {
            need(
                "tasks",
                "(an rl_data artifact or a JSONL file) for generation",
            )?;
            if g.batch == 0 || g.max_tokens == 0 {
                return Err(DeclError::new(
                    &["params", "generation"],
                    "batch and max_tokens must be > 0",
                ));
            }
            let field = |name: &str, message: &str| {
                Err(DeclError::new(&["params", "generation", name], message))
            };
            if !(g.temperature >= 0.0 && g.temperature.is_finite()) {
                return field("temperature", "temperature must be >= 0 (0: greedy)");
            }
            if !(g.top_p > 0.0 && g.top_p <= 1.0) {
                return field("top_p", "top_p must be in (0, 1]");
            }
            if g.top_k == Some(0) {
                return field(
                    "top_k",
                    "top_k must be > 0 (leave it out to keep every token)",
                );
            }
            if g.stop.iter().any(String::is_empty) {
                return field("stop", "stop strings must not be empty");
            }
            if g.contains.iter().any(String::is_empty) {
                return field(
                    "contains",
                    "an empty string is in every response: name what to look for",
                );
            }
            nemo_dag_data::reward::score(&g.env, "", "")
                .map_err(|e| DeclError::new(&["params", "generation", "env"], e))?;
        }
        Ok(())
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let model_dir = input(ctx, "model")?;
        let model = checkpoint::load_model(&model_dir)
            .map_err(|e| RunError::new(format!("cannot load the model: {e}")))?;
        let gpu = Gpu::of(ctx.device);
        let executor = match &gpu {
            Some(gpu) => {
                let started =
                    train::gpu::can_score(&model).and_then(|()| Executor::start(gpu.ordinal));
                gpu.or_cpu_for("scoring", ctx.log, started)?
            }
            None => None,
        };
        let mut scorer: Box<dyn Scorer + '_> = match (&gpu, &executor) {
            (Some(g), Some(Executor::Cuda(cuda))) => scorer(ctx, g, &**cuda, &model)?,
            (Some(g), Some(Executor::Shim(shim))) => scorer(ctx, g, shim, &model)?,
            _ => Box::new(train::eval::Cpu(&model)),
        };
        let mut results = serde_json::Map::new();
        let mut table = Vec::new();
        if let Some(ppl) = &p.perplexity {
            let r = perplexity(scorer.as_mut(), &input(ctx, "data")?, ppl)?;
            table.push(format!(
                "perplexity   {:<10} {:>10.3}   ({} tokens; uniform guessing: {})",
                ppl.split,
                r["perplexity"].as_f64().unwrap_or(f64::NAN),
                r["tokens"],
                model.vocab
            ));
            results.insert("perplexity".into(), r);
        }
        let tokenizer = || model_tokenizer(&model_dir).map(|(t, _)| t);
        if let Some(mc) = &p.multiple_choice {
            let questions = train::choice::read(&input(ctx, "choices")?, mc.limit)?;
            let r = train::choice::evaluate(
                scorer.as_mut(),
                &tokenizer()?,
                &questions,
                &mc.target_delimiter,
                mc.batch,
            )?;
            for metric in ["acc", "acc_norm"] {
                table.push(format!(
                    "{:<12} {:<10} {:>10.3}   ({} questions; chance {:.3})",
                    "choice",
                    metric,
                    r[metric].as_f64().unwrap_or(f64::NAN),
                    r["samples"],
                    r["chance"].as_f64().unwrap_or(f64::NAN)
                ));
            }
            results.insert("multiple_choice".into(), r);
        }
        if let Some(g) = &p.generation {
            let tokenizer = tokenizer()?;
            let tasks = input(ctx, "tasks")?;
            let decoders = scorer.decoders();
            let r = generation(&model, &tokenizer, &tasks, g, decoders)?;
            let on = if decoders.is_some() {
                "the device"
            } else {
                "the CPU"
            };
            writeln!(
                ctx.log,
                "generation: {} prompts, decoded on {on}",
                r["samples"]
            )?;
            table.push(format!(
                "{:<12} {:<10} {:>10.3}   ({} prompts)",
                g.env,
                "accuracy",
                r["accuracy"].as_f64().unwrap_or(f64::NAN),
                r["samples"]
            ));
            for s in &g.contains {
                table.push(format!(
                    "{:<12} {:<10} {:>10.3}   (fraction of responses)",
                    "contains",
                    s,
                    r["contains"][s].as_f64().unwrap_or(f64::NAN),
                ));
            }
            results.insert("generation".into(), r);
        }
        let out = ctx.out_dir.join("results");
        std::fs::create_dir_all(&out)?;
        let text = serde_json::to_string_pretty(&Value::Object(results.clone()))
            .map_err(|e| RunError::new(e.to_string()))?;
        std::fs::write(out.join("results.json"), text + "\n")?;
        writeln!(ctx.log, "task         split           value")?;
        for line in table {
            writeln!(ctx.log, "{line}")?;
        }
        Ok(results)
    }
}

/// What scores `model` on `launcher`, the stage's GPU, and decodes its generation there: the
/// GPU trainer's forward and the device decoder, on weights uploaded once; or, when they cannot
/// be and the device is `auto`, the CPU (the log says why).
fn scorer<'a, L: Launcher>(
    ctx: &mut RunContext,
    gpu: &Gpu,
    launcher: &'a L,
    model: &'a Model,
) -> Result<Box<dyn Scorer + 'a>, RunError> {
    let uploaded = DeviceStep::upload_for_scoring(launcher, model)
        .map(|step| step.with_precision(train::gpu::TRAINING_PRECISION));
    Ok(match gpu.or_cpu_for("scoring", ctx.log, uploaded)? {
        Some(step) => {
            writeln!(ctx.log, "device: {}", launcher.describe())?;
            Box::new(Scoring { step, model })
        }
        None => Box::new(train::eval::Cpu(model)),
    })
}

/// Perplexity on the start of a split of a `tokenize` artifact ([`train::eval::perplexity`]).
fn perplexity(scorer: &mut dyn Scorer, data: &Path, p: &Perplexity) -> Result<Value, RunError> {
    let mut stream: Vec<u32> = Vec::new();
    let want = p.max_windows * p.seq_length + 1;
    for (_, prefix) in blend_split(data, &p.split, "tokenize", false)? {
        let reader = IndexedReader::open(&prefix)
            .map_err(|e| RunError::new(format!("{}: {e}", prefix.display())))?;
        for i in 0..reader.len() {
            if stream.len() >= want {
                break;
            }
            stream.extend(
                reader
                    .sequence(i)
                    .map_err(|e| RunError::new(e.to_string()))?,
            );
        }
    }
    let (mean, tokens) = train::eval::perplexity(scorer, &stream, p.seq_length, p.max_windows)
        .map_err(|e| {
            RunError::new(format!(
                "split `{}` of {}: {}",
                p.split,
                data.join("blend.json").display(),
                e.message
            ))
        })?;
    // A model that knows nothing scores about its vocabulary size: the reference point.
    Ok(json!({
        "split": p.split,
        "tokens": tokens,
        "loss": mean,
        "perplexity": mean.exp(),
        "uniform_perplexity": scorer.model().vocab,
    }))
}

/// Rows `{question, expected_answer, env?}` of a task file (or an rl_data artifact's split).
fn read_tasks(
    path: &Path,
    split: &str,
    limit: usize,
) -> Result<Vec<(String, String, Option<String>)>, RunError> {
    let file = if path.is_dir() {
        let name = if split == "valid" { "val" } else { split };
        path.join(format!("{name}.jsonl"))
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file)
        .map_err(|e| RunError::new(format!("{}: {e}", file.display())))?;
    let mut rows = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        if rows.len() >= limit {
            break;
        }
        let v: Value = serde_json::from_str(line)
            .map_err(|e| RunError::new(format!("{}:{}: {e}", file.display(), i + 1)))?;
        let field = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .or_else(|| v[k].as_i64().map(|n| n.to_string()))
        };
        let (Some(q), Some(a)) = (field("question"), field("expected_answer")) else {
            return Err(RunError::new(format!(
                "{}:{}: a task row needs `question` and `expected_answer`",
                file.display(),
                i + 1
            )));
        };
        rows.push((q, a, field("env")));
    }
    if rows.is_empty() {
        return Err(RunError::new(format!(
            "{} has no task rows",
            file.display()
        )));
    }
    Ok(rows)
}

fn generation(
    model: &Model,
    tokenizer: &tokenizers::Tokenizer,
    tasks: &Path,
    g: &Generation,
    decoders: Option<&dyn train::Decoders>,
) -> Result<Value, RunError> {
    let rows = read_tasks(tasks, &g.split, g.limit)?;
    let template =
        ChatTemplate::load(&TemplateSource::from_param(&g.chat_template)).map_err(RunError::new)?;
    let stops: Vec<u32> = STOP_TOKENS
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    let mut prompts = Vec::new();
    for (q, _, _) in &rows {
        let text = template
            .render(
                &[Message::new(Role::User, q.clone())],
                None,
                true,
                RenderFlags::default(),
            )
            .map_err(RunError::new)?;
        let enc = tokenizer
            .encode(text, false)
            .map_err(|e| RunError::new(format!("cannot tokenize a prompt: {e}")))?;
        prompts.push(enc.get_ids().to_vec());
    }
    let config = g.config();
    let responses = train::eval::respond(model, tokenizer, &prompts, &stops, &config, decoders)?;
    let mut total = 0.0;
    let mut hits = vec![0usize; g.contains.len()];
    let mut examples = Vec::new();
    for ((q, expected, env), r) in rows.iter().zip(&responses) {
        let reward =
            nemo_dag_data::reward::score(env.as_deref().unwrap_or(&g.env), &r.text, expected)
                .map_err(RunError::new)?;
        total += reward;
        for (hit, holds) in hits.iter_mut().zip(&r.contains) {
            *hit += usize::from(*holds);
        }
        if examples.len() < 5 {
            examples.push(json!({"question": q, "response": r.text, "expected_answer": expected, "reward": reward}));
        }
    }
    let contains: serde_json::Map<String, Value> = g
        .contains
        .iter()
        .zip(&hits)
        .map(|(s, h)| (s.clone(), json!(*h as f64 / rows.len() as f64)))
        .collect();
    let mut result = json!({
        "split": g.split,
        "samples": rows.len(),
        "accuracy": total / rows.len() as f64,
        "examples": examples,
    });
    if !contains.is_empty() {
        result["contains"] = Value::Object(contains);
    }
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    use nemo_dag_op::{AnyOp, DeclError, StageDecl};
    use std::collections::BTreeMap;

    fn check(generation: Value) -> Result<(), DeclError> {
        let params = json!({ "generation": generation });
        let outputs = BTreeMap::new();
        AnyOp::check(
            &Eval,
            &StageDecl {
                name: "eval",
                params: &params,
                inputs: vec!["model", "tasks"],
                outputs: &outputs,
                cmd: None,
                world_size: None,
                nodes: None,
            },
        )
        .map(drop)
    }

    #[test]
    fn sampling_params_are_checked_by_name() {
        assert!(check(json!({})).is_ok());
        assert!(
            check(
                json!({"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3,
                         "stop": ["</answer>"]})
            )
            .is_ok()
        );
        for (bad, field) in [
            (json!({"temperature": -0.1}), "temperature"),
            (json!({"top_p": 0.0}), "top_p"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"top_k": 0}), "top_k"),
            (json!({"stop": [""]}), "stop"),
        ] {
            let err = check(bad.clone()).unwrap_err();
            assert_eq!(err.path, ["params", "generation", field], "{bad}");
            assert!(err.message.contains(field), "{}", err.message);
        }
    }

    #[test]
    fn multiple_choice_needs_its_choices_input() {
        let params = json!({ "multiple_choice": {"limit": 10} });
        let outputs = BTreeMap::new();
        let decl = |inputs| StageDecl {
            name: "eval",
            params: &params,
            inputs,
            outputs: &outputs,
            cmd: None,
            world_size: None,
            nodes: None,
        };
        assert!(AnyOp::check(&Eval, &decl(vec!["model", "choices"])).is_ok());
        let err = AnyOp::check(&Eval, &decl(vec!["model"])).unwrap_err();
        assert!(err.message.contains("`choices`"), "{}", err.message);
        let empty = json!({});
        let err = AnyOp::check(
            &Eval,
            &StageDecl {
                params: &empty,
                ..decl(vec!["model"])
            },
        )
        .unwrap_err();
        assert!(err.message.contains("multiple_choice"), "{}", err.message);
    }

    /// Where lm-eval's multiple-choice requests split a context that ends in a space, with a
    /// tokenizer trained as `train_tokenizer` trains one.
    #[test]
    fn trailing_context_spaces_move_into_the_continuation() {
        let tok = crate::train_tokenizer::tests::tokenizer(&["Question: 2+2? Answer: 4. 7 9 11"]);
        let (ctx, cont) = train::choice::encode_pair(&tok, "Question: 2+2? Answer: ", "4").unwrap();
        let whole = tok.encode("Question: 2+2? Answer: 4", false).unwrap();
        assert_eq!([ctx.clone(), cont.clone()].concat(), whole.get_ids());
        assert_eq!(tok.decode(&cont, false).unwrap(), " 4");
        assert_eq!(tok.decode(&ctx, false).unwrap(), "Question: 2+2? Answer:");
    }
}
