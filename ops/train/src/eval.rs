//! Scoring a model, the algorithms of `eval` (multiple choice is [`crate::choice`]):
//!
//! - [`perplexity`]: the mean next-token loss over consecutive windows of a held-out token
//!   stream (nemo-dag's own measure; a model that knows nothing scores its vocabulary size).
//! - [`respond`]: generated responses to prompts (cached decoding: batches side by side on the
//!   CPU's workers, or one after another on a device's [`Decoders`]), each cut before its first
//!   stop string, with the substrings it holds. The caller scores them
//!   (`nemo_dag_data::reward`, as NeMo-Gym's verifiers do).
//! - [`greedy`]: greedy decoding of a batch of prompts.

use crate::{Decoders, err};
use model::layers::Layout;
use model::net::Model;
use model::params::Rng;
use model::sampling::{
    Completion, Sampling, StopStrings, decode_length, generate, generate_until, generate_with,
};
use nemo_dag_op::RunError;

/// What scores tokens under a model: each label's log-probability. [`Cpu`] runs the model's
/// own forward; `gpu::Scoring` runs the GPU trainer's on a device.
pub trait Scorer {
    /// The model scored (its vocabulary and context length).
    fn model(&self) -> &Model;

    /// The log-probability of each of `labels` after `ids`, rows of `layout`, row-major.
    fn logp(&mut self, ids: &[u32], labels: &[u32], layout: &Layout) -> Result<Vec<f32>, RunError>;

    /// Where generation with the same weights decodes, when not on the CPU: the device's.
    fn decoders(&self) -> Option<&dyn Decoders> {
        None
    }
}

/// Scoring on the CPU: the model's inference forward ([`crate::token_logprobs`]).
pub struct Cpu<'m>(pub &'m Model);

impl Scorer for Cpu<'_> {
    fn model(&self) -> &Model {
        self.0
    }

    fn logp(&mut self, ids: &[u32], labels: &[u32], layout: &Layout) -> Result<Vec<f32>, RunError> {
        crate::token_logprobs(self.0, ids, labels, layout)
            .and_then(|l| l.flatten_all()?.to_vec1::<f32>())
            .map_err(err)
    }
}

/// Mean loss per token and the tokens scored: the stream cut into at most `max_windows`
/// consecutive windows of `seq_length` inputs (each label the next token), 8 windows a batch.
pub fn perplexity(
    scorer: &mut dyn Scorer,
    stream: &[u32],
    seq_length: usize,
    max_windows: usize,
) -> Result<(f64, u64), RunError> {
    if stream.len() < seq_length + 1 {
        return Err(RunError::new(format!(
            "{} tokens, fewer than one window of {}",
            stream.len(),
            seq_length + 1
        )));
    }
    let vocab = scorer.model().vocab;
    if let Some(t) = stream.iter().find(|t| **t as usize >= vocab) {
        return Err(RunError::new(format!(
            "token id {t} is outside the model's vocabulary ({vocab})"
        )));
    }
    let windows = ((stream.len() - 1) / seq_length).min(max_windows);
    let (mut sum, mut tokens) = (0.0, 0u64);
    for chunk in (0..windows).collect::<Vec<_>>().chunks(8) {
        let t = seq_length;
        let (mut ids, mut labels) = (Vec::new(), Vec::new());
        for w in chunk {
            ids.extend_from_slice(&stream[w * t..w * t + t]);
            labels.extend_from_slice(&stream[w * t + 1..w * t + t + 1]);
        }
        let logp = scorer.logp(&ids, &labels, &Layout::plain(chunk.len(), t))?;
        sum -= logp.iter().map(|l| f64::from(*l)).sum::<f64>();
        tokens += logp.len() as u64;
    }
    Ok((sum / tokens.max(1) as f64, tokens))
}

/// How [`respond`] generates.
#[derive(Debug, Clone)]
pub struct Generation {
    pub sampling: Sampling,
    /// Prompts decoded together.
    pub batch: usize,
    /// Row `i` samples from its own generator, seeded from `(seed, i)`.
    pub seed: u64,
    /// A response ends before the first of these strings.
    pub stop: Vec<String>,
    /// Substrings to look for in each response (special tokens kept, e.g. `<tool_call>`).
    pub contains: Vec<String>,
}

/// One generated response.
#[derive(Debug, Clone, PartialEq)]
pub struct Response {
    /// The response text, cut before its first stop string.
    pub text: String,
    /// For each of [`Generation::contains`], whether the response holds it.
    pub contains: Vec<bool>,
}

/// A response to each of `prompts` (token ids), in order, decoded on `decoders` when given,
/// else on the CPU. A row ends on one of `stop_ids`, a stop string, or `max_tokens`; on the CPU
/// what a row generates depends on its index and the seed only (not on `batch` or the other
/// rows). On a device it may also depend on how many rows its batch has: a library such as
/// cuBLASLt picks its algorithm by the product's shape, and another order of sums can round a
/// logit differently.
pub fn respond(
    model: &Model,
    tokenizer: &tokenizers::Tokenizer,
    prompts: &[Vec<u32>],
    stop_ids: &[u32],
    g: &Generation,
    decoders: Option<&dyn Decoders>,
) -> Result<Vec<Response>, RunError> {
    let stop_strings = StopStrings {
        tokenizer,
        stops: &g.stop,
    };
    let batches: Vec<&[Vec<u32>]> = prompts.chunks(g.batch.max(1)).collect();
    let batch = |i: usize, decoders: Option<&dyn Decoders>| -> Result<Vec<Completion>, RunError> {
        let start = i * g.batch.max(1);
        let mut rngs: Vec<Rng> = (start..start + batches[i].len())
            .map(|r| row_rng(g.seed, r))
            .collect();
        let stopped = |_: usize, ids: &[u32]| stop_strings.hit(ids);
        match decoders {
            None => generate_until(model, batches[i], &g.sampling, stop_ids, &mut rngs, stopped),
            Some(d) => {
                let steps = decode_length(model, batches[i], g.sampling.max_tokens).map_err(err)?;
                let mut decoder = d.start(model, batches[i].len(), steps)?;
                let (s, stops) = (&g.sampling, stop_ids);
                generate_with(&mut *decoder, batches[i], s, stops, &mut rngs, stopped)
            }
        }
        .map_err(err)
    };
    let outputs: Vec<Result<Vec<Completion>, RunError>> = match decoders {
        Some(d) => (0..batches.len()).map(|i| batch(i, Some(d))).collect(),
        None => kernels::workers::map(batches.len(), kernels::workers::threads(), |i| {
            batch(i, None)
        })
        .map_err(|e| RunError::new(format!("cannot start a generation thread: {e}")))?,
    };
    let mut responses = Vec::with_capacity(prompts.len());
    for batch in outputs {
        for out in batch? {
            let (text, _) = stop_strings.cut(&out.ids).map_err(RunError::new)?;
            let contains = holds(tokenizer, &out.ids, g)?;
            responses.push(Response { text, contains });
        }
    }
    Ok(responses)
}

/// Whether a response holds each of `g.contains`: its ids decoded with special tokens kept
/// (`<tool_call>` is one in the recipes' tokenizers), cut before the first stop string.
fn holds(
    tokenizer: &tokenizers::Tokenizer,
    ids: &[u32],
    g: &Generation,
) -> Result<Vec<bool>, RunError> {
    if g.contains.is_empty() {
        return Ok(Vec::new());
    }
    let raw = tokenizer
        .decode(ids, false)
        .map_err(|e| RunError::new(format!("cannot decode a response: {e}")))?;
    let (raw, _) = model::sampling::cut_at_stop(&raw, &g.stop);
    Ok(g.contains
        .iter()
        .map(|s| raw.contains(s.as_str()))
        .collect())
}

/// The generator of row `i` of a task file: its own SplitMix64 stream, so a row's sample
/// depends on `seed` and `i` only (not on `batch` or the other rows).
fn row_rng(seed: u64, i: usize) -> Rng {
    Rng::new(seed ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Greedy decoding of a batch of prompts (left padded; the padding is invisible to every row),
/// cached. Returns each row's generated ids, stop excluded.
pub fn greedy(
    model: &Model,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    stops: &[u32],
) -> Result<Vec<Vec<u32>>, RunError> {
    let mut rngs = vec![Rng::new(0); prompts.len()];
    let out = generate(
        model,
        prompts,
        &Sampling::greedy(max_tokens),
        stops,
        &mut rngs,
    )
    .map_err(err)?;
    Ok(out.into_iter().map(|c| c.ids).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::config::ModelConfig;
    use serde_json::{Value, json};

    #[test]
    fn batched_left_padded_greedy_equals_one_prompt_at_a_time() {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "M*-", "hidden": 16, "heads": 2, "head_dim": 8, "ffn": 32,
            "mamba": {"heads": 2, "head_dim": 8, "state": 4, "chunk": 4}, "max_seq": 64
        }))
        .unwrap();
        let model = Model::new(&cfg, 40, 3).unwrap();
        let prompts = vec![vec![5, 6, 7, 8, 9], vec![11, 12], vec![1, 2, 3]];
        let together = greedy(&model, &prompts, 6, &[]).unwrap();
        for (p, got) in prompts.iter().zip(&together) {
            let alone = greedy(&model, std::slice::from_ref(p), 6, &[]).unwrap();
            assert_eq!(&alone[0], got, "prompt {p:?}");
            assert_eq!(got.len(), 6);
        }
        // A stop token ends a row and is not part of its output.
        let first = together[0][0];
        let stopped = greedy(&model, &prompts[..1], 6, &[first]).unwrap();
        assert!(stopped[0].is_empty());
    }

    #[test]
    fn contains_reads_special_tokens_and_stops_at_a_stop_string() {
        let vocab: serde_json::Map<String, Value> = ["<unk>", "the", "answer", "STOP"]
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let tokenizer: tokenizers::Tokenizer = json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 4, "content": "<tool_call>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        })
        .to_string()
        .parse()
        .unwrap();
        let g = Generation {
            sampling: Sampling::greedy(4),
            batch: 1,
            seed: 0,
            stop: vec!["STOP".into()],
            contains: vec!["<tool_call>".into(), "answer".into()],
        };
        // Decoding for the score skips special tokens; `contains` must still see the call.
        assert_eq!(tokenizer.decode(&[4, 1], true).unwrap(), "the");
        assert_eq!(holds(&tokenizer, &[4, 1], &g).unwrap(), [true, false]);
        assert_eq!(holds(&tokenizer, &[1, 2, 4], &g).unwrap(), [true, true]);
        // Nothing after the stop string counts.
        assert_eq!(
            holds(&tokenizer, &[1, 3, 4, 2], &g).unwrap(),
            [false, false]
        );
    }

    #[test]
    fn a_row_draws_from_its_own_generator() {
        // Row i's stream depends on (seed, i) only, and differs between rows and seeds.
        let draw = |seed, i| row_rng(seed, i).next_u64();
        assert_eq!(draw(0, 3), draw(0, 3));
        assert_ne!(draw(0, 3), draw(0, 4));
        assert_ne!(draw(0, 3), draw(1, 3));
    }
}
