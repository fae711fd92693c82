//! The op protocol: everything nemo-dag's engine and its ops share, and nothing else.
//!
//! An op is a plain Rust value implementing [`Op`]: it validates its stage declaration
//! ([`Op::check`]), names the outputs it will produce ([`Op::outputs`]) and, given the
//! resolved inputs and a private output directory, produces them ([`Op::run`]). An op never
//! knows which executor runs it, where the store lives, or how keys are computed; the engine
//! never knows what an op computes, only its name, version, declared outputs and `run`. Neither
//! side imports the other: both import this crate, and the `nemo-dag` binary hands the engine
//! a [`Registry`] of the ops it was built with.
//!
//! - [`StageDecl`]: a stage as the op sees it; [`DeclError`]: what is wrong with it, and where.
//! - [`RunContext`]: inputs, output directory and log of one run; [`RunError`]: why it failed.
//! - [`Registry`]: the ops a binary offers, and the nearest name to a misspelt one.
//! - [`process`]: shell quoting and die-with-parent, for every place that starts a process.

pub mod process;
pub mod registry;

pub use registry::{Registry, nearest};

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

/// Why a stage failed while running: a message, what to do about it, and the error it came
/// from. Its `Display` is the message, then `help: …` on a line of its own when there is help.
#[derive(Debug)]
pub struct RunError {
    pub message: String,
    pub help: Option<String>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl RunError {
    pub fn new(message: impl Into<String>) -> Self {
        RunError {
            message: message.into(),
            help: None,
            source: None,
        }
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// `context: source`, keeping `source` as the error's cause.
    pub fn caused_by(
        context: impl fmt::Display,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        RunError {
            message: format!("{context}: {source}"),
            help: None,
            source: Some(Box::new(source)),
        }
    }
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(help) = &self.help {
            write!(f, "\n  help: {help}")?;
        }
        Ok(())
    }
}

impl std::error::Error for RunError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<std::io::Error> for RunError {
    fn from(e: std::io::Error) -> Self {
        RunError {
            message: e.to_string(),
            help: None,
            source: Some(Box::new(e)),
        }
    }
}

impl From<String> for RunError {
    fn from(message: String) -> Self {
        RunError::new(message)
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
