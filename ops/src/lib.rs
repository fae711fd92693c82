//! The built-in ops of nemo-dag: what a stage *does*.
//!
//! An op is a plain Rust value implementing [`Op`]: it validates its stage declaration
//! ([`Op::check`]), names the outputs it will produce ([`Op::outputs`]) and, given the
//! resolved inputs and a private output directory, produces them ([`Op::run`]). An op
//! never knows which executor runs it, where the store lives, or how keys are computed:
//! the engine owns all of that. Dependencies point one way: engine → ops → kernels.
//!
//! Ops in this crate:
//! - [`cmd`]: run any external program through `sh -c`, with shell-quoted placeholders.
//! - [`generate`]: synthetic, exactly checkable data (arithmetic) for the tiny recipes.
//! - [`train_tokenizer`]: train a byte-level BPE `tokenizer.json` on a corpus.
//! - [`tokenize`]: text datasets → Megatron `.bin`/`.idx` shards and `blend.json`.
//! - [`pack`]: chat JSONL → chat-templated, loss-masked, packed Parquet SFT shards.
//! - [`rl_data`]: prompts with verifiable answers → NeMo-Gym-shaped RL JSONL.
//! - [`pretrain`]: train a model from scratch on tokenized data; [`model`] and [`train`] hold
//!   the networks and the training loop.
//! - [`sft`]: fine-tune an upstream model on packed chat data.
//! - [`dpo`]: direct preference optimization of an upstream model on chosen/rejected pairs.
//! - [`grpo`]: reinforcement learning (GRPO) on prompts with verifiable answers.
//! - [`export`]: a dense model as a Hugging Face Llama checkpoint.
//! - [`eval`]: perplexity, multiple-choice log-likelihood ([`choice`]) and verifiable
//!   generation accuracy of a model ([`reward`] scores).
//!
//! Shared pieces: [`text`] reads documents from dataset files; [`megatron`] writes and reads
//! Megatron's `.bin`/`.idx` token datasets; [`packing`] and [`pyrandom`] are SFT packing and
//! the CPython-compatible shuffles Nemotron's splits use; [`workers`] runs independent pieces
//! of training and generation side by side, one thread each; [`simd`] is the element-wise
//! math of the fused ops and the optimizer, vectorised for the CPU at hand.

pub mod bpe;
pub mod chat;
pub mod choice;
pub mod cmd;
pub mod dpo;
pub mod eval;
pub mod export;
pub mod generate;
pub mod gpt_dataset;
pub mod grpo;
pub mod megatron;
pub mod model;
pub mod pack;
pub mod packed_parquet;
pub mod packing;
pub mod pretrain;
pub mod pyrandom;
pub mod reward;
pub mod rl_data;
pub mod sft;
pub mod simd;
pub mod text;
pub mod tokenize;
pub mod train;
pub mod train_tokenizer;
pub mod workers;

use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A stage as the op sees it: everything from the manifest that determines its output.
#[derive(Debug, Clone)]
pub struct StageDecl<'a> {
    /// The stage's name in the manifest.
    pub name: &'a str,
    /// Free-form parameters, after templating and overrides.
    pub params: &'a Value,
    /// Input names (values are resolved later, at run time).
    pub inputs: Vec<&'a str>,
    /// Declared outputs: name → path relative to the stage's output directory.
    pub outputs: &'a BTreeMap<String, String>,
    /// The command line, for ops that take one (`cmd`).
    pub cmd: Option<&'a str>,
}

/// A problem with a stage declaration, located by a path inside the stage
/// (for example `["params", "n"]` or `["cmd"]`) so the engine can point at the manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct DeclError {
    pub path: Vec<String>,
    pub message: String,
    pub help: Option<String>,
}

impl DeclError {
    pub fn new(path: &[&str], message: impl Into<String>) -> Self {
        DeclError {
            path: path.iter().map(|s| s.to_string()).collect(),
            message: message.into(),
            help: None,
        }
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

/// Why a stage failed while running.
#[derive(Debug)]
pub struct RunError(pub String);

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RunError {}

impl From<std::io::Error> for RunError {
    fn from(e: std::io::Error) -> Self {
        RunError(e.to_string())
    }
}

/// What an op gets when it runs: resolved inputs and a private, empty output directory.
pub struct RunContext<'a> {
    pub stage: StageDecl<'a>,
    /// Input name → absolute path of a file or directory (a source file or an upstream output).
    pub inputs: &'a BTreeMap<String, PathBuf>,
    /// The directory outputs are written to; it is published atomically after `run` returns Ok.
    pub out_dir: &'a Path,
    /// The stage's log: everything written here is kept next to the artifact and shown live.
    pub log: &'a mut dyn Write,
}

/// Numbers and facts an op reports about its run; stored as `metrics` in `artifact.json`.
pub type Metrics = serde_json::Map<String, Value>;

pub trait Op: Sync {
    /// The name used in manifests (`op: cmd`).
    fn name(&self) -> &'static str;
    /// Bumped whenever the op's output for the same inputs changes; part of every key.
    fn version(&self) -> u32;
    /// One line for `--help`-style listings.
    fn summary(&self) -> &'static str;
    /// Validate the declaration before anything runs.
    fn check(&self, stage: &StageDecl) -> Result<(), DeclError>;
    /// The outputs the op produces: name → path relative to the output directory.
    fn outputs(&self, stage: &StageDecl) -> BTreeMap<String, String>;
    /// Whether the op can continue from what an interrupted attempt left in its output
    /// directory (training checkpoints). Others start from an empty directory every time.
    fn resumable(&self) -> bool {
        false
    }
    /// Produce every output under `ctx.out_dir`.
    fn run(&self, ctx: &mut RunContext) -> Result<Metrics, RunError>;
}

/// Every built-in op, in the order `nemo-dag` lists them.
pub fn registry() -> &'static [&'static dyn Op] {
    static OPS: &[&dyn Op] = &[
        &cmd::Cmd,
        &generate::Generate,
        &train_tokenizer::TrainTokenizer,
        &tokenize::Tokenize,
        &pack::Pack,
        &rl_data::RlData,
        &pretrain::Pretrain,
        &sft::Sft,
        &dpo::Dpo,
        &grpo::Grpo,
        &export::Export,
        &eval::Eval,
    ];
    OPS
}

/// Find a built-in op by its manifest name.
pub fn lookup(name: &str) -> Option<&'static dyn Op> {
    registry().iter().copied().find(|op| op.name() == name)
}

/// Parse an op's `params` into its typed struct; an unknown or mistyped field becomes a
/// [`DeclError`] at its path (`params.vocab_size`), which the engine points at in the manifest.
pub fn typed_params<T: DeserializeOwned>(params: &Value) -> Result<T, DeclError> {
    serde_path_to_error::deserialize(params).map_err(|e| {
        let mut path = vec!["params".to_string()];
        for seg in e.path().iter() {
            match seg {
                serde_path_to_error::Segment::Map { key } => path.push(key.clone()),
                serde_path_to_error::Segment::Seq { index } => path.push(index.to_string()),
                _ => {}
            }
        }
        let message = format!("{}: {}", path.join("."), e.into_inner());
        DeclError {
            path,
            message,
            help: None,
        }
    })
}

/// The stage's `tokenizer` input, loaded (`tokenize` and `pack` take one); returns its path too.
pub(crate) fn load_tokenizer(
    inputs: &BTreeMap<String, PathBuf>,
) -> Result<(tokenizers::Tokenizer, &Path), RunError> {
    let path = inputs
        .get("tokenizer")
        .ok_or_else(|| RunError("no `tokenizer` input".into()))?;
    let tokenizer = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| RunError(format!("cannot load tokenizer {}: {e}", path.display())))?;
    Ok((tokenizer, path))
}

/// A blend weight as Python's `str(float)` prints it (`1.0`, `0.5`), as `blend.json` holds it.
pub(crate) fn format_weight(w: f64) -> String {
    if w.fract() == 0.0 {
        format!("{w:.1}")
    } else {
        format!("{w}")
    }
}
