//! `train_tokenizer`: train a byte-level BPE tokenizer on a corpus, so a recipe needs no
//! model hub.
//!
//! ```yaml
//! tokenizer:
//!   op: train_tokenizer
//!   inputs: {corpus: data/shakespeare.txt, chat: "gen_chat:data"}
//!   params:
//!     vocab_size: 4096
//!     special_tokens: ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
//! ```
//!
//! The model is GPT-2's design: text is split by GPT-2's regex into words, words are mapped to
//! bytes (each byte one of 256 visible characters), and BPE merges are learned over those
//! bytes, so every string round-trips and no token is unknown. Special tokens are added whole
//! and never split. The output is a standard Hugging Face `tokenizer.json` that Python's
//! `tokenizers` (and `transformers`) load. Training is deterministic for a fixed corpus: inputs
//! are read in input-name order, files in path order. An input that gives no document is an
//! error unless `allow_empty`: a tokenizer of the byte alphabet alone is never what was meant.
//!
//! Memory is bounded by the corpus (held once) and the word counts, not by the longest
//! document: a document longer than [`PIECE_BYTES`] is fed as pieces cut between words, which
//! the trainer splits into the same words. A word longer than `max_word_bytes` is a bad row.

use nemo_dag_data::text::{self, Document, OnBadRow, ReadStats};
use nemo_dag_data::tokenizer::split_between_words;
use nemo_dag_op::{
    DeclError, Facts, Metrics, Op, Outputs, Plan, RunContext, RunError, Spec, StageDecl, Upstream,
};
use serde::Deserialize;
use serde_json::Value;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, NormalizerWrapper, Tokenizer, TokenizerBuilder};

pub struct TrainTokenizer;

fn default_vocab() -> usize {
    8192
}
fn default_min_frequency() -> u64 {
    2
}
fn default_special() -> Vec<String> {
    [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "</think>",
    ]
    .map(String::from)
    .to_vec()
}
fn default_text_field() -> String {
    "text".into()
}
fn default_max_word_bytes() -> usize {
    1 << 16
}

/// The most text the trainer pre-tokenizes at once. The `tokenizers` trainer holds about 100
/// bytes per byte of a sequence while it splits it into words (each byte's offsets and
/// alignments), so a 200 MB document needed 20 GB; long documents are fed as pieces cut
/// between words ([`split_between_words`]), which give the same words and the same tokenizer.
const PIECE_BYTES: usize = 64 * 1024;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    #[serde(default = "default_vocab")]
    vocab_size: usize,
    #[serde(default = "default_min_frequency")]
    min_frequency: u64,
    #[serde(default = "default_special")]
    special_tokens: Vec<String>,
    /// The text field of JSONL inputs.
    #[serde(default = "default_text_field")]
    text_field: String,
    #[serde(default)]
    on_bad_row: OnBadRow,
    /// Read only the first N documents of each input.
    #[serde(default)]
    sample: Option<u64>,
    /// Train even if an input gives no documents, instead of failing.
    #[serde(default)]
    allow_empty: bool,
    /// The longest word (with the whitespace before it) a document may hold. The trainer
    /// holds each word whole, with about 100 bytes of memory per byte, and its merges take
    /// time that grows with the square of a word's length: a 64 KiB run of one letter trains
    /// in about a second, 1 MiB in minutes.
    #[serde(default = "default_max_word_bytes")]
    max_word_bytes: usize,
}

static SPEC: Spec = Spec {
    name: "train_tokenizer",
    version: 1,
    summary: "train a byte-level BPE tokenizer.json on a corpus (no model hub needed)",
    inputs: &[],
    other_inputs: Some("the text files or folders to train on"),
    outputs: Outputs::Fixed(&[("tokenizer", "tokenizer.json")]),
    resumable: false,
    launched: false,
    gpu: false,
};

impl Op for TrainTokenizer {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        if p.vocab_size < 256 + p.special_tokens.len() {
            return Err(DeclError::new(
                &["params", "vocab_size"],
                format!(
                    "vocab_size {} is below the 256 byte tokens plus {} special tokens",
                    p.vocab_size,
                    p.special_tokens.len()
                ),
            ));
        }
        if p.max_word_bytes == 0 {
            return Err(DeclError::new(
                &["params", "max_word_bytes"],
                "max_word_bytes must be at least 1",
            ));
        }
        if stage.inputs.is_empty() {
            return Err(
                DeclError::new(&[], "train_tokenizer needs at least one input corpus")
                    .with_help("add e.g. `inputs: {corpus: data/corpus.txt}`"),
            );
        }
        Ok(())
    }

    /// Tells the stages downstream the vocabulary they will have (at most `vocab_size`).
    fn plan(&self, p: &Params, _: &Upstream, _: &StageDecl) -> Plan {
        Plan {
            facts: Facts {
                vocab: Some(p.vocab_size),
                ..Facts::default()
            },
            estimate: None,
        }
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        // Documents, long ones as pieces cut between words.
        let mut pieces: Vec<String> = Vec::new();
        let mut stats = ReadStats::default();
        for (name, path) in ctx.inputs {
            let mut input_stats = ReadStats::default();
            let mut skipped_long = 0;
            for file in text::files_of(path)? {
                text::read_documents::<RunError>(
                    &file,
                    &p.text_field,
                    p.on_bad_row,
                    p.sample,
                    &mut input_stats,
                    |d| {
                        push_pieces(d, p, &mut pieces, &mut skipped_long)?;
                        Ok(())
                    },
                )?;
            }
            // A document skipped for a long word was read, but is not trained on.
            input_stats.rows -= skipped_long;
            input_stats.skipped += skipped_long;
            writeln!(
                ctx.log,
                "input {name}: {} documents, {} skipped",
                input_stats.rows, input_stats.skipped
            )?;
            if input_stats.rows == 0 && !p.allow_empty {
                return Err(RunError::new(format!(
                    "input `{name}` has no documents ({} rows skipped as bad): a tokenizer trained on it would hold only the byte alphabet",
                    input_stats.skipped
                ))
                .with_help("check the input and `text_field`; set `allow_empty: true` to train anyway"));
            }
            stats.rows += input_stats.rows;
            stats.skipped += input_stats.skipped;
        }
        let tokenizer = train(&pieces, p)?;
        let out = ctx.out_dir.join("tokenizer.json");
        tokenizer
            .save(&out, true)
            .map_err(|e| RunError::new(format!("cannot save {}: {e}", out.display())))?;
        let vocab = tokenizer.get_vocab_size(true);
        writeln!(
            ctx.log,
            "trained a {vocab}-token byte-level BPE on {} documents",
            stats.rows
        )?;
        let mut m = Metrics::new();
        m.insert("vocab_size".into(), Value::from(vocab));
        m.insert("documents".into(), Value::from(stats.rows));
        m.insert("skipped_rows".into(), Value::from(stats.skipped));
        m.insert(
            "bytes".into(),
            Value::from(pieces.iter().map(|d| d.len() as u64).sum::<u64>()),
        );
        Ok(m)
    }
}

/// Add a document to the training text: whole if it is short, else as pieces of at most
/// [`PIECE_BYTES`] cut between words. A word longer than `max_word_bytes` makes it a bad row.
fn push_pieces(
    doc: Document,
    p: &Params,
    pieces: &mut Vec<String>,
    skipped: &mut u64,
) -> Result<(), RunError> {
    if doc.text.len() <= PIECE_BYTES {
        pieces.push(doc.text);
        return Ok(());
    }
    match split_between_words(&doc.text, PIECE_BYTES, p.max_word_bytes) {
        Ok(cut) => pieces.extend(cut.into_iter().map(str::to_string)),
        Err(long) => {
            let at = match doc.line {
                0 => doc.file.display().to_string(),
                line => format!("{}:{line}", doc.file.display()),
            };
            let why = format!(
                "a word of {} bytes at byte {} of the document is longer than `max_word_bytes` ({}): \
                 the trainer holds each word whole, with about 100 bytes of memory per byte and \
                 time that grows with the square of its length; raise `max_word_bytes` to train \
                 on it",
                long.len, long.start, p.max_word_bytes
            );
            p.on_bad_row.bad_row(&at, &why, skipped)?;
        }
    }
    Ok(())
}

fn train(docs: &[String], p: &Params) -> Result<Tokenizer, RunError> {
    let specials: Vec<AddedToken> = p
        .special_tokens
        .iter()
        .map(|t| AddedToken::from(t.clone(), true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(p.vocab_size)
        .min_frequency(p.min_frequency)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(specials)
        .build();
    let byte_level = ByteLevel::new(false, true, true);
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level))
            .build()
            .map_err(|e| RunError::new(format!("cannot build the tokenizer: {e}")))?;
    tokenizer
        .train(&mut trainer, docs.iter())
        .map_err(|e| RunError::new(format!("BPE training failed: {e}")))?;
    Ok(tokenizer.into())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use nemo_dag_op::AnyOp;
    use std::collections::BTreeMap;

    /// A small byte-level BPE trained on `docs`, for other modules' tests.
    pub(crate) fn tokenizer(docs: &[&str]) -> Tokenizer {
        let docs: Vec<String> = docs.iter().map(|d| d.to_string()).collect();
        train(&docs, &params(300)).unwrap()
    }

    fn params(vocab: usize) -> Params {
        serde_json::from_value(serde_json::json!({"vocab_size": vocab})).unwrap()
    }

    #[test]
    fn training_is_deterministic_and_round_trips() {
        let docs: Vec<String> = (0..200)
            .map(|i| {
                format!(
                    "To be, or not to be: that is the question {i}. Whether 'tis nobler <|im_end|>"
                )
            })
            .collect();
        let a = train(&docs, &params(400)).unwrap();
        let b = train(&docs, &params(400)).unwrap();
        assert_eq!(a.to_string(true).unwrap(), b.to_string(true).unwrap());
        let text = "To be, or not — ünïcode 🙂 <|im_start|>user";
        let enc = a.encode(text, false).unwrap();
        assert_eq!(a.decode(enc.get_ids(), false).unwrap(), text);
        // Special tokens are single ids.
        let id = a.token_to_id("<|im_start|>").unwrap();
        assert!(enc.get_ids().contains(&id));
    }

    #[test]
    fn vocab_below_the_byte_alphabet_is_rejected() {
        let value = serde_json::json!({"vocab_size": 100});
        let outputs = BTreeMap::new();
        let decl = StageDecl {
            name: "t",
            params: &value,
            inputs: vec!["c"],
            outputs: &outputs,
            cmd: None,
            world_size: None,
            nodes: None,
        };
        let err = AnyOp::check(&TrainTokenizer, &decl).unwrap_err();
        assert_eq!(err.path, vec!["params", "vocab_size"]);
        let value = serde_json::json!({"vocab_sise": 1000});
        let decl = StageDecl {
            name: "t",
            params: &value,
            inputs: vec!["c"],
            outputs: &outputs,
            cmd: None,
            world_size: None,
            nodes: None,
        };
        let err = AnyOp::check(&TrainTokenizer, &decl).unwrap_err();
        assert!(err.message.contains("unknown field"), "{}", err.message);
    }
}
