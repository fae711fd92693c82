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
//!
//! The same seed gives byte-identical files (CPython's `random.Random(seed)` drives it, so a
//! Python script can reproduce the data exactly).

use crate::pyrandom::PyRandom;
use crate::{DeclError, Metrics, Op, RunContext, RunError, StageDecl, typed_params};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
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
struct Params {
    kind: String,
    count: usize,
    #[serde(default = "d_seed")]
    seed: u64,
    #[serde(default = "d_max")]
    max_operand: u64,
    #[serde(default = "d_ops")]
    ops: Vec<String>,
}

impl Op for Generate {
    fn name(&self) -> &'static str {
        "generate"
    }

    fn version(&self) -> u32 {
        1
    }

    fn summary(&self) -> &'static str {
        "synthetic, exactly checkable data (arithmetic) as pretrain text, chat and RL prompts"
    }

    fn check(&self, stage: &StageDecl) -> Result<(), DeclError> {
        let p: Params = typed_params(stage.params)?;
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
        if !stage.inputs.is_empty() || !stage.outputs.is_empty() {
            return Err(DeclError::new(
                &[],
                "generate takes no inputs and names its own outputs",
            ));
        }
        Ok(())
    }

    fn outputs(&self, _stage: &StageDecl) -> BTreeMap<String, String> {
        [
            ("pretrain", "pretrain.jsonl"),
            ("chat", "chat.jsonl"),
            ("prompts", "prompts.jsonl"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn run(&self, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let p: Params = typed_params(ctx.stage.params).map_err(|e| RunError(e.message))?;
        let mut rng = PyRandom::new(p.seed);
        let (mut pretrain, mut chat, mut prompts) = (String::new(), String::new(), String::new());
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
            let mut assistant = json!({"role": "assistant", "content": format!("The answer is \\boxed{{{answer}}}.")});
            if i % 3 == 0 {
                assistant["reasoning_content"] = json!(format!("{expr} = {answer}."));
            }
            chat.push_str(&line(
                json!({"messages": [{"role": "user", "content": question}, assistant]}),
            ));
            prompts.push_str(&line(
                json!({"question": question, "expected_answer": answer.to_string()}),
            ));
        }
        std::fs::write(ctx.out_dir.join("pretrain.jsonl"), pretrain)?;
        std::fs::write(ctx.out_dir.join("chat.jsonl"), chat)?;
        std::fs::write(ctx.out_dir.join("prompts.jsonl"), prompts)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_problems_and_answers_check() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-gen-{}", std::process::id()));
        let run = |d: &std::path::Path| {
            std::fs::create_dir_all(d).unwrap();
            let params =
                json!({"kind": "arithmetic", "count": 50, "seed": 3, "ops": ["+", "-", "*"]});
            let outputs = Generate.outputs(&StageDecl {
                name: "g",
                params: &params,
                inputs: vec![],
                outputs: &BTreeMap::new(),
                cmd: None,
            });
            let inputs = BTreeMap::new();
            let mut log = Vec::new();
            let mut ctx = RunContext {
                stage: StageDecl {
                    name: "g",
                    params: &params,
                    inputs: vec![],
                    outputs: &outputs,
                    cmd: None,
                },
                inputs: &inputs,
                out_dir: d,
                log: &mut log,
            };
            Generate.run(&mut ctx).unwrap();
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
}
