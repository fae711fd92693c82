//! `generate`: synthetic data a tiny model can actually learn, as a cached artifact.
//!
//! ```yaml
//! problems:
//!   op: generate
//!   params: {kind: arithmetic, count: 10000, seed: 7, max_operand: 99}
//! ```
//!
//! `kind: arithmetic` makes `count` problems `a op b` (`op` from `ops`, default `+` and `-`;
//! operands in `0..=max_operand`) with exactly checkable answers, in the three shapes the
//! recipe's stages consume:
//!
//! | output | rows | used by |
//! | --- | --- | --- |
//! | `pretrain` (`pretrain.jsonl`) | `{"text": "What is 12 + 35? 12 + 35 = 47. The answer is \boxed{47}."}` | `train_tokenizer`, `tokenize` → `pretrain` |
//! | `chat` (`chat.jsonl`) | `{"messages": [user "What is 12 + 35?", assistant "The answer is \boxed{47}."]}`, every third with `reasoning_content` | `pack` → `sft` |
//! | `prompts` (`prompts.jsonl`) | `{"question": "What is 12 + 35?", "expected_answer": "47"}` | `rl_data` → `grpo`, `eval` |
//! | `choices` (`choices.jsonl`) | `{"context": "What is 12 + 35? 12 + 35 =", "choices": ["47", "48", "46", "57"], "gold": 0}`: the answer and three near misses (±1, +10), the answer at position `i mod 4` | `eval` (`multiple_choice`) |
//! | `preferences` (`preferences.jsonl`) | NeMo-RL preference rows: `{"context": [user "What is 12 + 35?"], "completions": [{"rank": 0, "completion": [assistant "The answer is \boxed{47}."]}, {"rank": 1, "completion": [assistant "<tool_call>{…}</tool_call>\nThe answer is \boxed{47}."]}]}` | `dpo` |
//!
//! The preference pairs teach what nano3's DPO stage teaches (Nemotron nano3 `rl.md`): not to call
//! tools that were never offered. Both completions give the right answer; the rejected one
//! first makes a hallucinated call, `<tool_call>{"name": "calculator", "arguments":
//! {"expression": "12 + 35"}}</tool_call>`, although the context offers no tools. Neither
//! carries reasoning, so the pair differs only in the call.
//!
//! The same seed gives byte-identical files (CPython's `random.Random(seed)` drives it, so a
//! Python script can reproduce the data exactly).

use nemo_dag_data::random::PyRandom;
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::{Value, json};
use std::fmt::Write as _;

pub struct Generate;

fn d_seed() -> u64 {
    0
}
fn d_max() -> u64 {
    99
}
fn d_ops() -> Vec<String> {
    vec!["+".into(), "-".into()]
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    kind: String,
    count: usize,
    #[serde(default = "d_seed")]
    seed: u64,
    #[serde(default = "d_max")]
    max_operand: u64,
    #[serde(default = "d_ops")]
    ops: Vec<String>,
}

static SPEC: Spec = Spec {
    name: "generate",
    version: 2,
    summary: "synthetic, exactly checkable data (arithmetic) as pretrain text, chat, RL prompts and preference pairs",
    inputs: &[],
    other_inputs: None,
    outputs: Outputs::Fixed(&[
        ("pretrain", "pretrain.jsonl"),
        ("chat", "chat.jsonl"),
        ("prompts", "prompts.jsonl"),
        ("preferences", "preferences.jsonl"),
        ("choices", "choices.jsonl"),
    ]),
    resumable: false,
    launched: false,
    gpu: false,
};

impl Op for Generate {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        if p.kind != "arithmetic" {
            return Err(DeclError::new(
                &["params", "kind"],
                format!("unknown kind `{}`: use arithmetic", p.kind),
            ));
        }
        if let Some(op) = p
            .ops
            .iter()
            .find(|o| !matches!(o.as_str(), "+" | "-" | "*"))
        {
            return Err(DeclError::new(
                &["params", "ops"],
                format!("unknown operator `{op}`: use +, - or *"),
            ));
        }
        if p.ops.is_empty() || p.count == 0 || p.max_operand == 0 {
            return Err(DeclError::new(
                &["params"],
                "count, max_operand and ops must not be empty or zero",
            ));
        }
        Ok(())
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let mut rng = PyRandom::new(p.seed);
        let (mut pretrain, mut chat, mut prompts) = (String::new(), String::new(), String::new());
        let mut preferences = String::new();
        let mut choices = String::new();
        for i in 0..p.count {
            let a = rng.randbelow(p.max_operand + 1);
            let b = rng.randbelow(p.max_operand + 1);
            let op = &p.ops[rng.randbelow(p.ops.len() as u64) as usize];
            let answer = match op.as_str() {
                "+" => (a + b) as i64,
                "-" => a as i64 - b as i64,
                _ => (a * b) as i64,
            };
            let expr = format!("{a} {op} {b}");
            let question = format!("What is {expr}?");
            let line = |v: Value| v.to_string() + "\n";
            pretrain.push_str(&line(json!({
                "text": format!("{question} {expr} = {answer}. The answer is \\boxed{{{answer}}}.")
            })));
            let direct = format!("The answer is \\boxed{{{answer}}}.");
            let mut assistant = json!({"role": "assistant", "content": direct});
            if i % 3 == 0 {
                assistant["reasoning_content"] = json!(format!("{expr} = {answer}."));
            }
            chat.push_str(&line(
                json!({"messages": [{"role": "user", "content": question}, assistant]}),
            ));
            prompts.push_str(&line(
                json!({"question": question, "expected_answer": answer.to_string()}),
            ));
            // Written by hand so the call's keys keep their natural order (name, arguments).
            let call = format!(
                r#"<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>"#
            );
            choices.push_str(&line(multiple_choice(i, &expr, answer)));
            preferences.push_str(&line(json!({
                "context": [{"role": "user", "content": question}],
                "completions": [
                    {"rank": 0, "completion": [{"role": "assistant", "content": direct}]},
                    {"rank": 1, "completion": [
                        {"role": "assistant", "content": format!("{call}\n{direct}")}
                    ]},
                ],
            })));
        }
        std::fs::write(ctx.out_dir.join("pretrain.jsonl"), pretrain)?;
        std::fs::write(ctx.out_dir.join("chat.jsonl"), chat)?;
        std::fs::write(ctx.out_dir.join("prompts.jsonl"), prompts)?;
        std::fs::write(ctx.out_dir.join("preferences.jsonl"), preferences)?;
        std::fs::write(ctx.out_dir.join("choices.jsonl"), choices)?;
        let mut summary = String::new();
        let _ = write!(
            summary,
            "{} arithmetic problems ({}), operands 0..={}",
            p.count,
            p.ops.join(" "),
            p.max_operand
        );
        writeln!(ctx.log, "{summary}")?;
        let mut m = Metrics::new();
        m.insert("rows".into(), Value::from(p.count));
        Ok(m)
    }
}

/// A multiple-choice row for problem `i`: the continuation of the pretraining text's
/// `"… 12 + 35 ="`, with the answer among three near misses, at position `i mod 4`. No random
/// draws, so the other outputs keep their bytes.
fn multiple_choice(i: usize, expr: &str, answer: i64) -> Value {
    let mut options = vec![answer + 1, answer - 1, answer + 10];
    let gold = i % 4;
    options.insert(gold, answer);
    json!({
        "context": format!("What is {expr}? {expr} ="),
        "choices": options.iter().map(i64::to_string).collect::<Vec<_>>(),
        "gold": gold,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nemo_dag_op::AnyOp;
    use std::collections::BTreeMap;

    #[test]
    fn the_same_seed_gives_the_same_problems_and_answers_check() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-gen-{}", std::process::id()));
        let run = |d: &std::path::Path| {
            std::fs::create_dir_all(d).unwrap();
            let params =
                json!({"kind": "arithmetic", "count": 50, "seed": 3, "ops": ["+", "-", "*"]});
            crate::testing::run_op(&Generate, params, BTreeMap::new(), d)
                .0
                .unwrap();
            std::fs::read_to_string(d.join("prompts.jsonl")).unwrap()
        };
        let a = run(&dir.join("a"));
        assert_eq!(a, run(&dir.join("b")));
        for line in a.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            let q = v["question"]
                .as_str()
                .unwrap()
                .trim_start_matches("What is ")
                .trim_end_matches('?');
            let parts: Vec<&str> = q.split(' ').collect();
            let (x, y): (i64, i64) = (parts[0].parse().unwrap(), parts[2].parse().unwrap());
            let want = match parts[1] {
                "+" => x + y,
                "-" => x - y,
                _ => x * y,
            };
            assert_eq!(v["expected_answer"], want.to_string());
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn preference_pairs_prefer_the_direct_answer_to_a_hallucinated_tool_call() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-gen-pref-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let params = json!({"kind": "arithmetic", "count": 30, "seed": 3, "ops": ["+", "-", "*"]});
        let outputs = AnyOp::outputs(
            &Generate,
            &StageDecl {
                name: "g",
                params: &params,
                inputs: vec![],
                outputs: &BTreeMap::new(),
                cmd: None,
                world_size: None,
                nodes: None,
            },
        );
        assert_eq!(outputs["preferences"], "preferences.jsonl");
        crate::testing::run_op(&Generate, params, BTreeMap::new(), &dir)
            .0
            .unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        // The existing outputs keep their bytes (first rows of seed 3, as before preferences).
        let first = |f: &str| read(f).lines().next().unwrap().to_string();
        assert_eq!(
            first("pretrain.jsonl"),
            r#"{"text":"What is 30 * 75? 30 * 75 = 2250. The answer is \\boxed{2250}."}"#
        );
        assert_eq!(
            first("chat.jsonl"),
            r#"{"messages":[{"content":"What is 30 * 75?","role":"user"},{"content":"The answer is \\boxed{2250}.","reasoning_content":"30 * 75 = 2250.","role":"assistant"}]}"#
        );
        assert_eq!(
            first("prompts.jsonl"),
            r#"{"expected_answer":"2250","question":"What is 30 * 75?"}"#
        );
        // One pair per problem: the chat's question, its answer chosen, and the same answer
        // after a tool call (to tools that were never offered) rejected.
        let chat: Vec<Value> = read("chat.jsonl")
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let rows: Vec<Value> = read("preferences.jsonl")
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(rows.len(), chat.len());
        for (row, c) in rows.iter().zip(&chat) {
            let question = &c["messages"][0]["content"];
            let answer = c["messages"][1]["content"].as_str().unwrap();
            assert_eq!(
                row["context"],
                json!([{"role": "user", "content": question}])
            );
            let expr = question
                .as_str()
                .unwrap()
                .trim_start_matches("What is ")
                .trim_end_matches('?');
            let call = format!(
                r#"<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expr}"}}}}</tool_call>"#
            );
            assert_eq!(
                row["completions"],
                json!([
                    {"rank": 0, "completion": [{"role": "assistant", "content": answer}]},
                    {"rank": 1, "completion": [
                        {"role": "assistant", "content": format!("{call}\n{answer}")}
                    ]},
                ])
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn multiple_choice_rows_hold_the_answer_once_among_near_misses() {
        for i in 0..8 {
            let row = multiple_choice(i, "12 + 35", 47);
            assert_eq!(row["context"], "What is 12 + 35? 12 + 35 =");
            let choices: Vec<&str> = row["choices"]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c.as_str().unwrap())
                .collect();
            let gold = row["gold"].as_u64().unwrap() as usize;
            assert_eq!(gold, i % 4, "the answer's position cycles");
            assert_eq!(choices[gold], "47");
            let mut distinct = choices.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), 4, "{choices:?}");
        }
    }
}
