//! Errors a user can act on: every bad-input error is a [`miette`] diagnostic that points at
//! the place in the manifest (or the command line) that caused it, and says what to do next.

use miette::{Diagnostic, NamedSource, SourceSpan};
use std::ops::Range;
use std::sync::Arc;

/// Bad input: a manifest, override or command-line problem. Exit code 2, nothing written.
#[derive(Debug, thiserror::Error, Diagnostic)]
#[error("{message}")]
#[diagnostic(code(nemo_dag::input))]
pub struct InputError {
    pub message: String,
    #[source_code]
    pub source_code: Option<NamedSource<Arc<str>>>,
    #[label("{label}")]
    pub span: Option<SourceSpan>,
    pub label: String,
    #[help]
    pub help: Option<String>,
}

impl InputError {
    pub fn new(message: impl Into<String>) -> Self {
        InputError {
            message: message.into(),
            source_code: None,
            span: None,
            label: String::new(),
            help: None,
        }
    }

    /// Point at `span` in a source text called `name`.
    pub fn at(mut self, source: &Source, span: Range<usize>, label: impl Into<String>) -> Self {
        self.source_code = Some(NamedSource::new(&source.name, source.text.clone()));
        let start = span.start.min(source.text.len());
        let len = span
            .end
            .saturating_sub(span.start)
            .min(source.text.len() - start);
        self.span = Some(SourceSpan::new(start.into(), len));
        self.label = label.into();
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

/// A text an error can point into: a manifest file as written, or as rendered by Jinja.
#[derive(Debug, Clone)]
pub struct Source {
    pub name: String,
    pub text: Arc<str>,
}

/// What a command ends with: bad input (exit 2), a failed stage (exit 1), or an interruption.
#[derive(Debug)]
pub enum Failure {
    Input(Box<InputError>),
    Stage(String),
    /// Ctrl-C: running stages were stopped, nothing partial was published.
    Interrupted,
    Other(miette::Report),
}

impl From<InputError> for Failure {
    fn from(e: InputError) -> Self {
        Failure::Input(Box::new(e))
    }
}

impl From<miette::Report> for Failure {
    fn from(e: miette::Report) -> Self {
        Failure::Other(e)
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Failure::Other(miette::Report::msg(e.to_string()))
    }
}

pub type Result<T, E = Failure> = std::result::Result<T, E>;

/// Shorthand for an I/O error with the path it happened on.
pub fn io_err(what: &str, path: &std::path::Path, e: std::io::Error) -> Failure {
    Failure::Other(miette::miette!("{what} {}: {e}", path.display()))
}

/// Help for a name that is not there: the nearest of `candidates` when one is close, then the
/// list (`did you mean `sft`? stages: data, pretrain, sft`).
pub fn did_you_mean<'a>(
    wanted: &str,
    what: &str,
    candidates: impl Iterator<Item = &'a str> + Clone,
) -> String {
    let all: Vec<&str> = candidates.clone().collect();
    match nemo_dag_op::nearest(wanted, candidates) {
        Some(near) => format!("did you mean `{near}`? {what}: {}", all.join(", ")),
        None => format!("{what}: {}", all.join(", ")),
    }
}
