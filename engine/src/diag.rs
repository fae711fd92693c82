//! Errors a user can act on: every bad-input error is a [`miette`] diagnostic that points at
//! the place in the manifest (or the command line) that caused it, and says what to do next.
//!
//! What an error shows is bounded whatever the input: a value longer than [`MAX_WORD`]
//! characters is shortened in the message and help, and the source is shown as a few lines
//! around the place, each clipped to [`MAX_SHOWN_LINE`] bytes ([`Excerpt`]). miette would
//! otherwise wrap a multi-megabyte value word by word, and it panics padding a label past
//! column 65,535.

use miette::{Diagnostic, MietteError, MietteSpanContents, SourceCode, SourceSpan, SpanContents};
use std::ops::Range;
use std::sync::Arc;

/// The longest run of non-blank characters a message or help keeps whole.
pub const MAX_WORD: usize = 240;
/// The longest message or help, in characters.
const MAX_MESSAGE: usize = 4_000;
/// The most bytes of one source line an error shows.
pub const MAX_SHOWN_LINE: usize = 200;
/// The most lines of a multi-line span an error shows.
const MAX_SHOWN_SPAN_LINES: usize = 8;

/// Bad input: a manifest, override or command-line problem. Exit code 2, nothing written.
#[derive(Debug, thiserror::Error, Diagnostic)]
#[error("{message}")]
#[diagnostic(code(nemo_dag::input))]
pub struct InputError {
    pub message: String,
    #[source_code]
    pub source_code: Option<Excerpt>,
    #[label("{label}")]
    pub span: Option<SourceSpan>,
    pub label: String,
    #[help]
    pub help: Option<String>,
}

impl InputError {
    pub fn new(message: impl Into<String>) -> Self {
        InputError {
            message: shorten(message.into()),
            source_code: None,
            span: None,
            label: String::new(),
            help: None,
        }
    }

    /// Point at `span` in a source text called `name`.
    pub fn at(mut self, source: &Source, span: Range<usize>, label: impl Into<String>) -> Self {
        let (excerpt, span) = Excerpt::around(source, span);
        self.source_code = Some(excerpt);
        self.span = Some(span);
        self.label = label.into();
        self
    }

    pub fn help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(shorten(help.into()));
        self
    }

    /// The help, if there is one.
    pub fn maybe_help(mut self, help: Option<String>) -> Self {
        self.help = help.map(shorten);
        self
    }
}

/// `text` with every run of more than [`MAX_WORD`] non-blank characters shortened to its
/// start and end around how many bytes were cut, and at most [`MAX_MESSAGE`] characters.
pub fn shorten(text: String) -> String {
    let long_word = text
        .split(char::is_whitespace)
        .any(|w| w.len() > MAX_WORD && w.chars().count() > MAX_WORD);
    if !long_word && text.len() <= MAX_MESSAGE {
        return text;
    }
    let mut out = String::new();
    for piece in text.split_inclusive(char::is_whitespace) {
        let word = piece.trim_end_matches(char::is_whitespace);
        let blank = &piece[word.len()..];
        if word.chars().count() > MAX_WORD {
            let head = prefix_chars(word, MAX_WORD * 2 / 3);
            let tail = suffix_chars(word, MAX_WORD / 6);
            let cut = word.len() - head.len() - tail.len();
            out.push_str(&format!("{head}[…{cut} bytes…]{tail}"));
        } else {
            out.push_str(word);
        }
        out.push_str(blank);
        if out.chars().count() > MAX_MESSAGE {
            let kept = prefix_chars(&out, MAX_MESSAGE).len();
            out.truncate(kept);
            out.push_str(" […]");
            break;
        }
    }
    out
}

/// The first `n` characters of `s`.
fn prefix_chars(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or(s, |(i, _)| &s[..i])
}

/// The last `n` characters of `s`.
fn suffix_chars(s: &str, n: usize) -> &str {
    match n {
        0 => "",
        n => s
            .char_indices()
            .rev()
            .nth(n - 1)
            .map_or(s, |(i, _)| &s[i..]),
    }
}

/// What an error shows of a source: the lines of the span (at most
/// [`MAX_SHOWN_SPAN_LINES`]) and one line either side, each clipped to a window of
/// [`MAX_SHOWN_LINE`] bytes around the place, with the real line and column numbers.
#[derive(Debug, Clone)]
pub struct Excerpt {
    name: String,
    text: String,
    /// The line (from 0) of the source that the excerpt's first line is.
    first_line: usize,
    /// For each line of the excerpt: the bytes of the source line before its first shown
    /// byte, less the `…` shown instead.
    shift: Vec<usize>,
}

impl Excerpt {
    /// The excerpt of `source` around `span`, and the span within it.
    fn around(source: &Source, span: Range<usize>) -> (Excerpt, SourceSpan) {
        let text: &str = &source.text;
        let start = floor_char_boundary(text, span.start.min(text.len()));
        let end = floor_char_boundary(text, span.end.clamp(start, text.len()));
        let line_of_start = text[..start].bytes().filter(|b| *b == b'\n').count();
        // Lines as byte ranges without their newline: one before, the span's, one after.
        let line_at = |at: usize| {
            let from = text[..at].rfind('\n').map_or(0, |i| i + 1);
            let to = text[at..].find('\n').map_or(text.len(), |i| at + i);
            from..to
        };
        let mut lines = vec![line_at(start)];
        let first_line = if line_of_start > 0 {
            lines.insert(0, line_at(lines[0].start - 1));
            line_of_start - 1
        } else {
            line_of_start
        };
        let span_first = lines.len() - 1;
        while let Some(last) = lines.last().cloned()
            && last.end < end
            && lines.len() - span_first < MAX_SHOWN_SPAN_LINES
        {
            lines.push(line_at(last.end + 1));
        }
        let end = end.min(lines[lines.len() - 1].end.max(start));
        if let Some(last) = lines.last().cloned()
            && last.end + 1 < text.len()
        {
            lines.push(line_at(last.end + 1));
        }

        let mut excerpt = Excerpt {
            name: source.name.clone(),
            text: String::new(),
            first_line,
            shift: Vec::new(),
        };
        let (mut shown_start, mut shown_end) = (0, 0);
        for line in lines {
            if !excerpt.text.is_empty() {
                excerpt.text.push('\n');
            }
            let window = window(text, &line, start);
            let offset = excerpt.text.len();
            let cut_before = window.start > line.start;
            if cut_before {
                excerpt.text.push('…');
            }
            let shown_at = excerpt.text.len();
            excerpt.text.push_str(&text[window.clone()]);
            if window.end < line.end {
                excerpt.text.push('…');
            }
            excerpt
                .shift
                .push((window.start - line.start).saturating_sub(shown_at - offset));
            let map = |at: usize| shown_at + at.clamp(window.start, window.end) - window.start;
            if line.contains(&start) || line.end == start {
                shown_start = map(start);
            }
            if line.start <= end && end <= line.end {
                shown_end = map(end);
            }
        }
        let span = SourceSpan::new(shown_start.into(), shown_end.saturating_sub(shown_start));
        (excerpt, span)
    }
}

/// The bytes of `line` to show: all of it if short, else a window of [`MAX_SHOWN_LINE`]
/// bytes around `at` (when `at` is on the line, its end included) or from its start.
fn window(text: &str, line: &Range<usize>, at: usize) -> Range<usize> {
    if line.len() <= MAX_SHOWN_LINE {
        return line.clone();
    }
    let from = if line.contains(&at) || line.end == at {
        floor_char_boundary(text, at.saturating_sub(MAX_SHOWN_LINE / 4).max(line.start))
    } else {
        line.start
    };
    let to = floor_char_boundary(text, (from + MAX_SHOWN_LINE).min(line.end));
    from..to
}

fn floor_char_boundary(text: &str, mut at: usize) -> usize {
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    at
}

impl SourceCode for Excerpt {
    fn read_span<'a>(
        &'a self,
        span: &SourceSpan,
        context_lines_before: usize,
        context_lines_after: usize,
    ) -> Result<Box<dyn SpanContents<'a> + 'a>, MietteError> {
        let inner =
            self.text
                .as_str()
                .read_span(span, context_lines_before, context_lines_after)?;
        let line = inner.line();
        // miette reads a span alone (no context) for the `file:line:column` it shows.
        let column = if context_lines_before == 0 {
            inner.column() + self.shift.get(line).copied().unwrap_or(0)
        } else {
            inner.column()
        };
        Ok(Box::new(MietteSpanContents::new_named(
            self.name.clone(),
            inner.data(),
            *inner.span(),
            self.first_line + line,
            column,
            inner.line_count(),
        )))
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

/// The failure in one line, for a message that quotes it (a stage's line, a warning).
impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Input(e) => f.write_str(&e.message),
            Failure::Stage(s) => f.write_str(s),
            Failure::Interrupted => f.write_str("interrupted"),
            Failure::Other(r) => write!(f, "{r}"),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn render(e: InputError) -> String {
        let mut out = String::new();
        miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode_nocolor())
            .render_report(&mut out, &e)
            .expect("renders");
        out
    }

    fn source(text: &str) -> Source {
        Source {
            name: "m.yaml".into(),
            text: Arc::from(text),
        }
    }

    #[test]
    fn long_words_are_shortened_with_what_was_cut() {
        assert_eq!(shorten("short words stay".into()), "short words stay");
        let long = format!("unknown op `{}`, see below", "é".repeat(10_000));
        let short = shorten(long);
        assert!(short.starts_with("unknown op `éé"), "{short}");
        assert!(short.contains("bytes…]"), "{short}");
        assert!(short.ends_with("éé`, see below"), "{short}");
        assert!(short.chars().count() < MAX_WORD + 40, "{short}");
        let many = "word ".repeat(10_000);
        assert!(shorten(many).chars().count() <= MAX_MESSAGE + 4);
    }

    #[test]
    fn a_place_far_along_a_line_is_shown_clipped_with_its_real_column() {
        let text = format!(
            "a: 1\nb: {}XYZ{}\nc: 3\n",
            "x".repeat(80_000),
            "y".repeat(80_000)
        );
        let at = text.find("XYZ").expect("there");
        let shown = render(InputError::new("bad").at(&source(&text), at..at + 3, "here"));
        let column = at - text.find("b:").expect("there") + 1;
        assert!(shown.contains(&format!("[m.yaml:2:{column}]")), "{shown}");
        assert!(
            shown.contains("…xxx") && shown.contains("XYZyyy"),
            "{shown}"
        );
        assert!(shown.contains("a: 1") && shown.contains("c: 3"), "{shown}");
        assert!(shown.len() < 2_000, "{shown}");
    }

    #[test]
    fn any_span_of_any_text_renders() {
        let texts = [
            String::new(),
            "a".into(),
            "\n\n\n".into(),
            "é\r\nü\r\n".into(),
            format!("{}\n", "ß".repeat(70_000)),
            "line\n".repeat(100),
            format!("k: {}", "x".repeat(300)),
        ];
        for text in &texts {
            let len = text.len();
            for span in [
                0..0,
                0..len,
                len..len,
                len..len + 5,
                1..2,
                len / 2..len,
                Range { start: 3, end: 1 },
            ] {
                let shown = render(InputError::new("bad").at(&source(text), span.clone(), "here"));
                assert!(
                    shown.len() < 4_000,
                    "{span:?} of {:?}…: {shown}",
                    text.chars().take(20).collect::<String>()
                );
            }
        }
        // A span over many lines shows only its first ones.
        let text = "line\n".repeat(100);
        let shown = render(InputError::new("bad").at(&source(&text), 0..text.len(), "here"));
        assert!(shown.lines().count() < 20, "{shown}");
    }
}
