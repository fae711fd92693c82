//! `rl_data`: prompts with verifiable answers → NeMo-Gym-shaped JSONL for GRPO
//! (as Nemotron's `recipes/nano3/stage2_rl/data_prep.py` emits and NeMo-Gym consumes).
//!
//! ```yaml
//! rl_data:
//!   op: rl_data
//!   inputs: {prompts: "gen_math:problems"}   # JSONL rows: {question, expected_answer, env?, options?}
//!   params: {env: math, valid_fraction: 0.05, test_fraction: 0.05}
//! ```
//!
//! Each output row is what a Gym resource server consumes:
//!
//! ```json
//! {"responses_create_params": {"input": [{"role": "user", "content": "Solve … \\boxed{}.\n\n2+3?"}]},
//!  "question": "2+3?", "expected_answer": "5", "env": "math",
//!  "agent_ref": {"type": "responses_api_agents", "name": "math_with_judge_simple_agent"}}
//! ```
//!
//! Environments: `math` (the answer is compared by value inside the last `\boxed{}`) and `mcq`
//! (rows carry `options` {letter: text}; the answer is one letter, graded
//! `strict_single_letter_boxed`). Every row is validated: a missing answer, an unknown
//! environment or an `mcq` answer that is not one of its options is an error naming file and
//! line (as is invalid UTF-8 or a line that is not a JSON object), or with `on_bad_row: skip` is
//! dropped and counted (`skipped_rows`). Rows keep a `split` field (`train`/`val`/`validation`/`test`) when they have one, as
//! Nemotron keeps the source's splits; otherwise they are split by a seeded shuffle (Python's
//! `random.Random(seed)`). Output: `train.jsonl`, `val.jsonl`, `test.jsonl` and `manifest.json`
//! (`{"train": "train.jsonl", "val": …, "test": …}`, paths relative to it).

use nemo_dag_data::random::PyRandom;
use nemo_dag_data::text::{self, OnBadRow, files_of};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;

pub struct RlData;

pub const MATH_PROMPT: &str = "Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{}.";
pub const MCQ_PROMPT: &str = "Answer the following multiple choice question. Put the letter of the correct option (and only the letter) inside \\boxed{}.";

fn default_question() -> String {
    "question".into()
}
fn default_answer() -> String {
    "expected_answer".into()
}
fn default_env() -> String {
    "math".into()
}
fn default_seed() -> u64 {
    42
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    #[serde(default = "default_question")]
    question_field: String,
    #[serde(default = "default_answer")]
    answer_field: String,
    /// The environment of rows that do not name one in an `env` field.
    #[serde(default = "default_env")]
    env: String,
    #[serde(default)]
    system_prompt: Option<String>,
    #[serde(default)]
    valid_fraction: f64,
    #[serde(default)]
    test_fraction: f64,
    #[serde(default = "default_seed")]
    seed: u64,
    #[serde(default)]
    sample: Option<usize>,
    /// A row that is not JSON, not an object, or not a valid prompt: `fail` names its file and
    /// line; `skip` drops and counts it.
    #[serde(default)]
    on_bad_row: OnBadRow,
    /// Publish an input that gives no rows instead of failing.
    #[serde(default)]
    allow_empty: bool,
}

/// The NeMo-Gym agent server a row is sent to: `agent_ref.name` names an agent instance of the
/// merged Gym config (its rollout collection posts each row to that server), not the resources
/// server that grades it (Gym's `resources_servers/*/configs/*.yaml` declare
/// `math_with_judge_simple_agent` and `mcqa_simple_agent`).
fn agent_for(env: &str) -> Option<&'static str> {
    match env {
        "math" => Some("math_with_judge_simple_agent"),
        "mcq" => Some("mcqa_simple_agent"),
        _ => None,
    }
}

static SPEC: Spec = Spec {
    name: "rl_data",
    // 2: `agent_ref` names the Gym agent server (`math_with_judge_simple_agent`), with its type;
    // 1 named the resources server, which Gym's rollout collection cannot post to.
    version: 2,
    summary: "prompts with verifiable answers → Gym-shaped RL JSONL (train/val/test + manifest.json)",
    inputs: &[],
    other_inputs: Some("the prompt datasets"),
    outputs: Outputs::Fixed(&[("data", "data")]),
    resumable: false,
    launched: false,
    gpu: false,
};

impl Op for RlData {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        if agent_for(&p.env).is_none() {
            return Err(DeclError::new(
                &["params", "env"],
                format!("unknown environment `{}`: use math or mcq", p.env),
            ));
        }
        let bad = |f: f64| !(0.0..1.0).contains(&f);
        if bad(p.valid_fraction)
            || bad(p.test_fraction)
            || p.valid_fraction + p.test_fraction >= 1.0
        {
            return Err(DeclError::new(
                &["params", "valid_fraction"],
                "valid_fraction and test_fraction must be in [0, 1) and leave room for train",
            ));
        }
        if stage.inputs.is_empty() {
            return Err(DeclError::new(
                &["inputs"],
                "rl_data needs at least one JSONL input of prompts",
            ));
        }
        Ok(())
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let mut fixed: BTreeMap<&'static str, Vec<Value>> = BTreeMap::new();
        let mut unsplit: Vec<Value> = Vec::new();
        let mut envs: BTreeMap<String, u64> = BTreeMap::new();
        let mut skipped = 0u64;
        for (name, path) in ctx.inputs {
            let (mut rows, skipped_before) = (0u64, skipped);
            for file in files_of(path)? {
                let bytes = text::read_json_lines(&file, "rl_data")?;
                let mut taken = 0;
                for (line, text) in text::json_lines(&bytes) {
                    if p.sample.is_some_and(|s| taken >= s) {
                        break;
                    }
                    let (record, split) = match text.and_then(|t| parse_row(t, p)) {
                        Ok(row) => row,
                        Err(why) => {
                            let at = format!("{}:{line}", file.display());
                            p.on_bad_row.bad_row(&at, &why, &mut skipped)?;
                            continue;
                        }
                    };
                    *envs
                        .entry(record["env"].as_str().unwrap_or("").to_string())
                        .or_default() += 1;
                    match split {
                        Some(s) => fixed.entry(s).or_default().push(record),
                        None => unsplit.push(record),
                    }
                    taken += 1;
                    rows += 1;
                }
            }
            if rows == 0 && !p.allow_empty {
                return Err(RunError::new(format!(
                    "input `{name}` has no rows ({} skipped as bad)",
                    skipped - skipped_before
                ))
                .with_help(
                    "check the input; set `allow_empty: true` to publish an empty dataset",
                ));
            }
        }
        // Rows without a split: a seeded shuffle, then test, valid, and the rest train.
        let n = unsplit.len();
        PyRandom::new(p.seed).shuffle(&mut unsplit);
        let n_test = (n as f64 * p.test_fraction).round() as usize;
        let n_val = ((n as f64 * p.valid_fraction).round() as usize).min(n - n_test);
        let mut rest = unsplit.split_off(n_test);
        let test = unsplit;
        let train = rest.split_off(n_val);
        fixed.entry("test").or_default().extend(test);
        fixed.entry("val").or_default().extend(rest);
        fixed.entry("train").or_default().extend(train);

        let out = ctx.out_dir.join("data");
        std::fs::create_dir_all(&out)?;
        let mut manifest = Map::new();
        let mut m = Metrics::new();
        for split in ["train", "val", "test"] {
            let rows = fixed.remove(split).unwrap_or_default();
            let mut body = String::new();
            for r in &rows {
                body.push_str(&serde_json::to_string(r).map_err(|e| RunError::new(e.to_string()))?);
                body.push('\n');
            }
            std::fs::write(out.join(format!("{split}.jsonl")), body)?;
            manifest.insert(split.into(), Value::from(format!("{split}.jsonl")));
            m.insert(format!("{split}_rows"), Value::from(rows.len()));
            writeln!(ctx.log, "{split}: {} rows", rows.len())?;
        }
        let text = serde_json::to_string_pretty(&Value::Object(manifest))
            .map_err(|e| RunError::new(e.to_string()))?;
        std::fs::write(out.join("manifest.json"), text + "\n")?;
        m.insert("skipped_rows".into(), Value::from(skipped));
        m.insert(
            "environments".into(),
            serde_json::to_value(envs).unwrap_or(Value::Null),
        );
        Ok(m)
    }
}

/// One line of prompts: its Gym record and the split it asks for, or why it is not one.
fn parse_row(line: &str, p: &Params) -> Result<(Value, Option<&'static str>), String> {
    let row: Map<String, Value> =
        serde_json::from_str(line).map_err(|e| format!("not a JSON object: {e}"))?;
    gym_record(&row, p)
}

/// One validated Gym record, and the split the row asks for.
fn gym_record(
    row: &Map<String, Value>,
    p: &Params,
) -> Result<(Value, Option<&'static str>), String> {
    let text_field = |name: &str| -> Result<String, String> {
        match row.get(name) {
            Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.clone()),
            Some(Value::Number(n)) => Ok(n.to_string()),
            Some(Value::String(_)) | Some(Value::Null) | None => Err(format!("missing `{name}`")),
            Some(_) => Err(format!("`{name}` must be a string")),
        }
    };
    let question = text_field(&p.question_field)?;
    let answer = text_field(&p.answer_field)?;
    let env = match row.get("env") {
        Some(Value::String(e)) => e.clone(),
        _ => p.env.clone(),
    };
    let agent =
        agent_for(&env).ok_or_else(|| format!("unknown environment `{env}`: use math or mcq"))?;
    let mut record = json!({
        "question": question,
        "expected_answer": answer,
        "env": env,
        "agent_ref": {"type": "responses_api_agents", "name": agent},
    });
    let prompt = match env.as_str() {
        "mcq" => {
            let Some(Value::Object(options)) = row.get("options") else {
                return Err("an mcq row needs `options`: {letter: text}".into());
            };
            if !options.contains_key(answer.trim()) {
                return Err(format!(
                    "answer `{answer}` is not one of the options ({})",
                    options.keys().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
            let listed: Vec<String> = options
                .iter()
                .map(|(k, v)| format!("{k}. {}", v.as_str().unwrap_or_default()))
                .collect();
            record["options"] = Value::Object(options.clone());
            record["grading_mode"] = Value::from("strict_single_letter_boxed");
            format!("{MCQ_PROMPT}\n\n{question}\n\n{}", listed.join("\n"))
        }
        _ => format!("{MATH_PROMPT}\n\n{question}"),
    };
    let mut input = Vec::new();
    if let Some(system) = &p.system_prompt {
        input.push(json!({"role": "system", "content": system}));
    }
    input.push(json!({"role": "user", "content": prompt}));
    record["responses_create_params"] = json!({ "input": input });
    let split = match row.get("split").and_then(Value::as_str) {
        None => None,
        Some("train") => Some("train"),
        Some("val" | "valid" | "validation") => Some("val"),
        Some("test") => Some("test"),
        Some(other) => return Err(format!("unknown split `{other}`: use train, val or test")),
    };
    Ok((record, split))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        serde_json::from_value(json!({})).unwrap()
    }

    fn row(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn math_rows_become_gym_records() {
        let (r, split) = gym_record(
            &row(json!({"question": "2+3?", "expected_answer": 5})),
            &params(),
        )
        .unwrap();
        assert_eq!(split, None);
        assert_eq!(r["expected_answer"], "5");
        assert_eq!(
            r["agent_ref"],
            json!({"type": "responses_api_agents", "name": "math_with_judge_simple_agent"})
        );
        let content = r["responses_create_params"]["input"][0]["content"]
            .as_str()
            .unwrap();
        assert!(
            content.starts_with(MATH_PROMPT) && content.ends_with("2+3?"),
            "{content}"
        );
    }

    #[test]
    fn invalid_rows_say_why() {
        let p = params();
        assert_eq!(
            gym_record(&row(json!({"question": "q"})), &p).unwrap_err(),
            "missing `expected_answer`"
        );
        let mcq = json!({"question": "q", "expected_answer": "E", "env": "mcq", "options": {"A": "x", "B": "y"}});
        assert!(
            gym_record(&row(mcq), &p)
                .unwrap_err()
                .contains("not one of the options")
        );
        let bad_env = json!({"question": "q", "expected_answer": "1", "env": "chess"});
        assert!(
            gym_record(&row(bad_env), &p)
                .unwrap_err()
                .contains("unknown environment")
        );
        let bad_split = json!({"question": "q", "expected_answer": "1", "split": "dev"});
        assert!(
            gym_record(&row(bad_split), &p)
                .unwrap_err()
                .contains("unknown split")
        );
    }

    #[test]
    fn mcq_rows_list_their_options() {
        let mcq = json!({"question": "Sky?", "expected_answer": "B", "env": "mcq", "options": {"A": "red", "B": "blue"}, "split": "validation"});
        let (r, split) = gym_record(&row(mcq), &params()).unwrap();
        assert_eq!(split, Some("val"));
        assert_eq!(r["agent_ref"]["name"], "mcqa_simple_agent");
        assert!(
            r["responses_create_params"]["input"][0]["content"]
                .as_str()
                .unwrap()
                .ends_with("A. red\nB. blue")
        );
    }
}
