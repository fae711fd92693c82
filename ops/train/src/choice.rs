//! Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores them
//! (EleutherAI/lm-evaluation-harness `lm_eval/api/task.py`, `output_type: multiple_choice`).
//!
//! A task row is `{"context": "...", "choices": ["...", ...], "gold": 0}` (`gold` an index, a
//! choice string, or a list of either: any of them counts as right). For every choice the
//! model scores the continuation `target_delimiter + choice` after the context:
//!
//! ```text
//! whole        = tokens(context + continuation)
//! continuation = whole[len(tokens(context)):]          (lm-eval's _encode_pair)
//! ll(choice)   = Σ log p(continuation token | everything before it)
//! acc          = [argmax_i ll_i ∈ gold]
//! acc_norm     = [argmax_i ll_i / len(choice_i in characters) ∈ gold]
//! ```
//!
//! Trailing spaces of the context move to the continuation first, as lm-eval does, so
//! `"Q: 2+2? A:" + " 4"` is tokenised the way the model saw such text. When a row is longer
//! than the model's `max_seq`, the context loses tokens from the left.

use crate::eval::Scorer;
use model::layers::Layout;

use nemo_dag_op::RunError;
use serde_json::{Value, json};
use std::path::Path;

/// One multiple-choice question.
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    pub context: String,
    pub choices: Vec<String>,
    /// Indices of the right choices.
    pub gold: Vec<usize>,
}

/// The rows of a task JSONL file (at most `limit`), validated: each error names file and line.
pub fn read(path: &Path, limit: usize) -> Result<Vec<Question>, RunError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| RunError::new(format!("{}: {e}", path.display())))?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if rows.len() >= limit {
            break;
        }
        let at = |msg: &str| RunError::new(format!("{}:{}: {msg}", path.display(), i + 1));
        let v: Value = serde_json::from_str(line).map_err(|e| at(&e.to_string()))?;
        let context = v["context"]
            .as_str()
            .ok_or_else(|| at("a multiple-choice row needs a string `context`"))?;
        let choices: Vec<String> = v["choices"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|c| c.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        if choices.len() < 2 || Some(choices.len()) != v["choices"].as_array().map(Vec::len) {
            return Err(at("`choices` must be a list of at least two strings"));
        }
        let one = |g: &Value| -> Option<usize> {
            match g {
                Value::Number(n) => n
                    .as_u64()
                    .map(|n| n as usize)
                    .filter(|n| *n < choices.len()),
                Value::String(s) => choices.iter().position(|c| c == s),
                _ => None,
            }
        };
        let gold: Option<Vec<usize>> = match &v["gold"] {
            Value::Array(list) if !list.is_empty() => list.iter().map(one).collect(),
            g => one(g).map(|i| vec![i]),
        };
        let gold = gold.ok_or_else(|| {
            at("`gold` must be a choice index, a choice string, or a list of them")
        })?;
        rows.push(Question {
            context: context.to_string(),
            choices,
            gold,
        });
    }
    if rows.is_empty() {
        return Err(RunError::new(format!(
            "{} has no task rows",
            path.display()
        )));
    }
    Ok(rows)
}

/// The context's tokens and the continuation's, lm-eval style (see the module doc).
pub fn encode_pair(
    tokenizer: &tokenizers::Tokenizer,
    context: &str,
    continuation: &str,
) -> Result<(Vec<u32>, Vec<u32>), RunError> {
    let spaces = context.len() - context.trim_end_matches(' ').len();
    let (context, moved) = context.split_at(context.len() - spaces);
    let continuation = format!("{moved}{continuation}");
    let encode = |text: &str| -> Result<Vec<u32>, RunError> {
        Ok(tokenizer
            .encode(text, false)
            .map_err(|e| RunError::new(format!("cannot tokenize: {e}")))?
            .get_ids()
            .to_vec())
    };
    let whole = encode(&format!("{context}{continuation}"))?;
    let ctx = encode(context)?;
    let split = ctx.len().min(whole.len());
    Ok((whole[..split].to_vec(), whole[split..].to_vec()))
}

/// Σ log p(continuation | context) for each (context, continuation) pair, `batch` at a time.
pub fn loglikelihoods(
    scorer: &mut dyn Scorer,
    pairs: &[(Vec<u32>, Vec<u32>)],
    batch: usize,
) -> Result<Vec<f64>, RunError> {
    let max_seq = scorer.model().cfg.max_seq;
    let mut out = Vec::with_capacity(pairs.len());
    for chunk in pairs.chunks(batch.max(1)) {
        // Each row: (context + continuation)[..-1] predicting [1..]; the context keeps at most
        // max_seq + 1 − |continuation| tokens, cut from the left.
        let rows: Vec<(Vec<u32>, usize)> = chunk
            .iter()
            .map(|(ctx, cont)| {
                let keep = (max_seq + 1).saturating_sub(cont.len()).min(ctx.len());
                let mut seq = ctx[ctx.len() - keep..].to_vec();
                seq.extend_from_slice(cont);
                (seq, cont.len())
            })
            .collect();
        if let Some((seq, _)) = rows.iter().find(|(s, c)| *c == 0 || s.len() < 2) {
            return Err(RunError::new(format!(
                "a choice has no tokens to score (row of {} tokens)",
                seq.len()
            )));
        }
        // Every continuation token is scored after the one before it, so at least one context
        // token must stand before the first.
        if let Some((_, cont)) = rows.iter().find(|(s, c)| *c >= s.len()) {
            return Err(RunError::new(format!(
                "a choice of {cont} tokens has nothing before it to follow: its context is \
                 empty, or the choice is longer than the model's context ({max_seq} tokens)"
            )));
        }
        let t = rows.iter().map(|(s, _)| s.len() - 1).max().unwrap_or(1);
        let b = rows.len();
        let (mut ids, mut labels) = (vec![0u32; b * t], vec![0u32; b * t]);
        for (r, (seq, _)) in rows.iter().enumerate() {
            ids[r * t..r * t + seq.len() - 1].copy_from_slice(&seq[..seq.len() - 1]);
            labels[r * t..r * t + seq.len() - 1].copy_from_slice(&seq[1..]);
        }
        let logp = scorer.logp(&ids, &labels, &Layout::plain(b, t))?;
        for (r, (seq, cont)) in rows.iter().enumerate() {
            let end = r * t + seq.len() - 1;
            out.push(logp[end - cont..end].iter().map(|x| *x as f64).sum());
        }
    }
    Ok(out)
}

/// Score every question: `acc`, `acc_norm`, and the first few rows' log-likelihoods.
pub fn evaluate(
    scorer: &mut dyn Scorer,
    tokenizer: &tokenizers::Tokenizer,
    questions: &[Question],
    delimiter: &str,
    batch: usize,
) -> Result<Value, RunError> {
    let mut pairs = Vec::new();
    for q in questions {
        for c in &q.choices {
            pairs.push(encode_pair(
                tokenizer,
                &q.context,
                &format!("{delimiter}{c}"),
            )?);
        }
    }
    let ll = loglikelihoods(scorer, &pairs, batch)?;
    let (mut acc, mut acc_norm) = (0.0, 0.0);
    let mut examples = Vec::new();
    let mut at = 0;
    for q in questions {
        let scores = &ll[at..at + q.choices.len()];
        at += q.choices.len();
        let (by_sum, by_char) = pick(scores, &q.choices);
        acc += f64::from(q.gold.contains(&by_sum));
        acc_norm += f64::from(q.gold.contains(&by_char));
        if examples.len() < 3 {
            examples.push(json!({"context": q.context, "choices": q.choices, "gold": q.gold, "loglikelihoods": scores}));
        }
    }
    let n = questions.len() as f64;
    Ok(json!({
        "samples": questions.len(),
        "acc": acc / n,
        "acc_norm": acc_norm / n,
        "chance": questions.iter().map(|q| q.gold.len() as f64 / q.choices.len() as f64).sum::<f64>() / n,
        "examples": examples,
    }))
}

/// The choice `acc` picks (largest log-likelihood) and the one `acc_norm` picks (largest
/// log-likelihood per character of the choice).
pub fn pick(scores: &[f64], choices: &[String]) -> (usize, usize) {
    let normed: Vec<f64> = scores
        .iter()
        .zip(choices)
        .map(|(s, c)| s / c.chars().count().max(1) as f64)
        .collect();
    (argmax(scores), argmax(&normed))
}

/// Index of the largest score; the first on ties (numpy's argmax).
fn argmax(v: &[f64]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::Cpu;
    use model::config::ModelConfig;
    use model::net::Model;

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!(
            "nemo-dag-choice-{name}-{}.jsonl",
            std::process::id()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn gold_is_an_index_a_choice_or_a_list_and_bad_rows_name_the_line() {
        let p = write(
            "ok",
            r#"{"context": "2+2=", "choices": ["3", "4"], "gold": 1}
{"context": "1+1=", "choices": ["2", "5"], "gold": "2"}

{"context": "x", "choices": ["a", "b", "c"], "gold": [0, "c"]}
"#,
        );
        let q = read(&p, 10).unwrap();
        assert_eq!(
            q.iter().map(|q| q.gold.clone()).collect::<Vec<_>>(),
            vec![vec![1], vec![0], vec![0, 2]]
        );
        assert_eq!(read(&p, 1).unwrap().len(), 1);
        for (bad, what) in [
            (r#"{"choices": ["a", "b"], "gold": 0}"#, "context"),
            (
                r#"{"context": "c", "choices": ["a"], "gold": 0}"#,
                "choices",
            ),
            (
                r#"{"context": "c", "choices": ["a", 1], "gold": 0}"#,
                "choices",
            ),
            (
                r#"{"context": "c", "choices": ["a", "b"], "gold": 2}"#,
                "gold",
            ),
            (
                r#"{"context": "c", "choices": ["a", "b"], "gold": "z"}"#,
                "gold",
            ),
        ] {
            let p = write(
                "bad",
                &format!(
                    "{}\n{bad}\n",
                    r#"{"context": "c", "choices": ["a", "b"], "gold": 0}"#
                ),
            );
            let e = read(&p, 10).unwrap_err().message;
            assert!(e.contains(":2:") && e.contains(what), "{e}");
        }
    }

    fn model() -> Model {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "*-", "hidden": 16, "heads": 2, "head_dim": 8, "ffn": 32, "max_seq": 16
        }))
        .unwrap();
        Model::new(&cfg, 20, 4).unwrap()
    }

    #[test]
    fn the_loglikelihood_is_the_sum_over_continuation_tokens_only() {
        let m = model();
        let (ctx, cont) = (vec![3, 4, 5], vec![6, 7]);
        let ll = loglikelihoods(
            &mut Cpu(&m),
            &[(ctx.clone(), cont.clone()), (vec![1], vec![2])],
            2,
        )
        .unwrap();
        // By hand from the full logits of the unpadded row.
        let seq = [3u32, 4, 5, 6, 7];
        let logits = m
            .logits(&seq[..4], &Layout::plain(1, 4))
            .unwrap()
            .squeeze(0)
            .unwrap();
        let logp = model::layers::softmax(&logits)
            .unwrap()
            .log()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let want = logp[2][6] as f64 + logp[3][7] as f64;
        assert!((ll[0] - want).abs() < 1e-4, "{} vs {want}", ll[0]);
        // Batched with a shorter row (right padding) changes nothing.
        let alone = loglikelihoods(&mut Cpu(&m), &[(ctx, cont)], 1).unwrap();
        assert!((alone[0] - ll[0]).abs() < 1e-5);
        // A context longer than max_seq loses tokens from the left, and still scores.
        let long = loglikelihoods(
            &mut Cpu(&m),
            &[((0..40).map(|i| i % 20).collect(), vec![1, 2])],
            1,
        )
        .unwrap();
        assert!(long[0].is_finite() && long[0] < 0.0);
    }

    /// A continuation with nothing before it to follow (an empty context, or a choice longer
    /// than the model's context) is an error naming it, in any row of a batch: never a score
    /// read partly from the row before.
    #[test]
    fn a_choice_with_nothing_before_it_is_an_error() {
        let m = model(); // max_seq 16
        let fine = (vec![3, 4], vec![5]);
        let long: Vec<u32> = (0..20).map(|i| i % 20).collect();
        for bad in [(vec![], vec![6, 7]), (vec![1, 2], long)] {
            let err = loglikelihoods(&mut Cpu(&m), &[fine.clone(), bad], 2).unwrap_err();
            assert!(err.message.contains("nothing before it"), "{}", err.message);
        }
    }

    #[test]
    fn acc_picks_by_sum_and_acc_norm_by_sum_per_character() {
        // The long choice loses on the sum but wins per character (−0.6 vs −4 per char);
        // "é" is one character, not two bytes.
        let choices = ["aaaaaaaaaa".to_string(), "b".to_string(), "é".to_string()];
        assert_eq!(pick(&[-6.0, -4.0, -5.0], &choices), (1, 0));
        assert_eq!(pick(&[-60.0, -4.0, -3.0], &choices), (2, 2));
        assert_eq!(
            pick(&[-1.0, -1.0, -1.0], &choices).0,
            0,
            "ties go to the first"
        );
    }
}
