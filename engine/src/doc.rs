//! Parsed manifest documents: YAML or TOML text → one JSON-like value tree, plus the byte
//! span of every key and value so any later error can point at the line that caused it.
//!
//! YAML is read with the YAML 1.2 core schema (`yes`/`no`/`on`/`off` stay strings; only
//! `true`/`false` are booleans), duplicate keys are an error (never last-wins), and `<<`
//! merge keys are applied. Numbers are normalised once, here: a float with an integral value
//! becomes an integer, so `1.0` and `1`, `1e-4` and `0.0001` are the same value everywhere.

use serde_json::{Map, Number, Value};
use std::collections::HashMap;
use std::ops::Range;

/// The most values a YAML document may hold, its aliases expanded: a few hundred bytes of
/// nested aliases can otherwise expand to gigabytes (the "billion laughs").
pub const MAX_NODES: usize = 1_000_000;

/// The deepest nesting of a YAML document, its aliases included. The parser limits flow
/// style (`[[[…]]]`) but not block style (`- - - …`), and the tree is built recursively.
pub const MAX_DEPTH: usize = 100;

/// A path to a node: `["stages", "train", "params", "lr"]`.
pub type KeyPath = Vec<String>;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Toml,
}

impl Format {
    pub fn from_path(path: &std::path::Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "yaml" | "yml" => Some(Format::Yaml),
            "toml" => Some(Format::Toml),
            _ => None,
        }
    }
}

/// Where a node is in its document.
#[derive(Debug, Clone, Default)]
pub struct NodeSpan {
    /// The key that names the node (empty for the root and sequence items).
    pub key: Range<usize>,
    /// The node's value.
    pub value: Range<usize>,
}

/// A syntax error at a byte offset.
#[derive(Debug)]
pub struct SyntaxError {
    pub message: String,
    pub span: Range<usize>,
}

#[derive(Debug, Default)]
pub struct Spans(HashMap<KeyPath, NodeSpan>);

impl Spans {
    pub fn get(&self, path: &[String]) -> Option<&NodeSpan> {
        self.0.get(path)
    }

    /// The span of the deepest existing node on `path` (an error about a missing child
    /// points at its parent).
    pub fn nearest(&self, path: &[String], want_key: bool) -> Option<Range<usize>> {
        (0..=path.len()).rev().find_map(|n| {
            let span = self.0.get(&path[..n])?;
            let range = if want_key && !span.key.is_empty() {
                &span.key
            } else {
                &span.value
            };
            Some(range.clone())
        })
    }
}

/// Parse a document. With `spans`, also record where every node is (used to point errors at
/// the text; it costs about as much as the parse itself, so the fast path skips it).
pub fn parse(format: Format, text: &str, spans: bool) -> Result<(Value, Spans), SyntaxError> {
    match format {
        Format::Yaml => yaml::parse(text, spans),
        Format::Toml => toml_doc::parse(text, spans),
    }
}

/// Type a plain scalar the way the YAML 1.2 core schema does (also used for `KEY=VALUE`
/// overrides on the command line).
pub fn plain_scalar(s: &str) -> Value {
    match s {
        "" | "~" | "null" | "Null" | "NULL" => return Value::Null,
        "true" | "True" | "TRUE" => return Value::Bool(true),
        "false" | "False" | "FALSE" => return Value::Bool(false),
        _ => {}
    }
    if let Ok(i) = s.parse::<i64>() {
        return Value::from(i);
    }
    let radix = |prefix: &str, radix| {
        s.strip_prefix(prefix)
            .and_then(|digits| i64::from_str_radix(digits, radix).ok())
    };
    if let Some(i) = radix("0x", 16).or_else(|| radix("0o", 8)) {
        return Value::from(i);
    }
    let numeric = s.bytes().any(|b| b.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_digit() || b"+-.eE".contains(&b));
    if numeric && let Ok(f) = s.parse::<f64>() {
        return number(f);
    }
    Value::String(s.to_string())
}

/// One number form: integral floats become integers; others keep their shortest repr.
pub fn number(f: f64) -> Value {
    if f.fract() == 0.0 && f.abs() < 9.007_199_254_740_992e15 {
        Value::from(f as i64)
    } else {
        Number::from_f64(f)
            .map(Value::Number)
            .unwrap_or_else(|| Value::String(f.to_string()))
    }
}

mod yaml {
    use super::*;
    use saphyr_parser::{Event, Parser, ScalarStyle, Span};

    pub fn parse(text: &str, track: bool) -> Result<(Value, Spans), SyntaxError> {
        let mut builder = Builder {
            track,
            parser: Parser::new_from_str(text),
            offsets: char_offsets(text),
            spans: Spans::default(),
            anchors: HashMap::new(),
            nodes: 0,
            deepest: 0,
        };
        builder.document()
    }

    /// saphyr reports positions in characters; miette wants bytes.
    fn char_offsets(text: &str) -> Option<Vec<usize>> {
        if text.is_ascii() {
            return None;
        }
        let mut offsets: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        offsets.push(text.len());
        Some(offsets)
    }

    struct Builder<'a> {
        track: bool,
        parser: Parser<'a, saphyr_parser::StrInput<'a>>,
        offsets: Option<Vec<usize>>,
        spans: Spans,
        anchors: HashMap<usize, Anchored>,
        /// Values built so far, aliases counted by what they expand to.
        nodes: usize,
        /// The deepest level reached inside the node being built.
        deepest: usize,
    }

    /// An anchored value, with what an alias to it adds to the document.
    struct Anchored {
        value: Value,
        nodes: usize,
        height: usize,
    }

    impl<'a> Builder<'a> {
        fn byte(&self, index: usize) -> usize {
            match &self.offsets {
                None => index,
                Some(o) => o
                    .get(index)
                    .copied()
                    .unwrap_or_else(|| o.last().copied().unwrap_or(0)),
            }
        }

        fn range(&self, span: &Span) -> Range<usize> {
            self.byte(span.start.index())..self.byte(span.end.index())
        }

        fn next(&mut self) -> Result<(Event<'a>, Span), SyntaxError> {
            match self.parser.next_event() {
                Some(Ok(ev)) => Ok(ev),
                Some(Err(e)) => {
                    let at = self.byte(e.marker().index());
                    Err(SyntaxError {
                        message: format!("YAML syntax error: {}", e.info()),
                        span: at..at,
                    })
                }
                None => Err(SyntaxError {
                    message: "unexpected end of YAML input".into(),
                    span: 0..0,
                }),
            }
        }

        fn document(&mut self) -> Result<(Value, Spans), SyntaxError> {
            let mut root = Value::Null;
            loop {
                let (ev, span) = self.next()?;
                match ev {
                    Event::StreamStart | Event::DocumentStart(_) | Event::Nothing => {}
                    Event::StreamEnd => break,
                    Event::DocumentEnd => {
                        // Only the first document is read; a second one is an error.
                        let (ev, span) = self.next()?;
                        if !matches!(ev, Event::StreamEnd) {
                            let r = self.range(&span);
                            return Err(SyntaxError {
                                message: "a manifest holds one YAML document; found a second `---`"
                                    .into(),
                                span: r,
                            });
                        }
                        break;
                    }
                    ev => {
                        let mut path = Vec::new();
                        root = self.node(ev, span, &mut path, 0)?;
                    }
                }
            }
            Ok((root, std::mem::take(&mut self.spans)))
        }

        /// One node at `depth`, with everything under it; counts and limits what it holds.
        fn node(
            &mut self,
            ev: Event<'a>,
            span: Span,
            path: &mut KeyPath,
            depth: usize,
        ) -> Result<Value, SyntaxError> {
            let start = self.range(&span);
            if depth > MAX_DEPTH {
                return Err(SyntaxError {
                    message: format!("YAML nested deeper than {MAX_DEPTH} levels"),
                    span: start,
                });
            }
            self.count(1, &start)?;
            let nodes_before = self.nodes;
            let deepest_outside = std::mem::replace(&mut self.deepest, depth);
            let built = self.node_value(ev, start.clone(), path, depth);
            let height = self.deepest - depth;
            self.deepest = self.deepest.max(deepest_outside);
            let (value, anchor, end) = built?;
            if anchor > 0 {
                let anchored = Anchored {
                    value: value.clone(),
                    nodes: self.nodes - nodes_before + 1,
                    height,
                };
                self.anchors.insert(anchor, anchored);
            }
            if self.track {
                self.spans.0.insert(
                    path.clone(),
                    NodeSpan {
                        key: 0..0,
                        value: start.start..end.max(start.start),
                    },
                );
            }
            Ok(value)
        }

        /// Count `n` more values in the document.
        fn count(&mut self, n: usize, at: &Range<usize>) -> Result<(), SyntaxError> {
            self.nodes = self.nodes.saturating_add(n);
            if self.nodes > MAX_NODES {
                return Err(SyntaxError {
                    message: format!(
                        "the YAML document holds more than {MAX_NODES} values, its aliases expanded"
                    ),
                    span: at.clone(),
                });
            }
            Ok(())
        }

        /// An alias: a copy of its anchor's value, counted and limited as if written out.
        fn alias(
            &mut self,
            id: usize,
            at: &Range<usize>,
            depth: usize,
        ) -> Result<Value, SyntaxError> {
            let Some(anchored) = self.anchors.get(&id) else {
                return Err(SyntaxError {
                    message: "YAML alias refers to an unknown anchor".into(),
                    span: at.clone(),
                });
            };
            let (nodes, height) = (anchored.nodes, anchored.height);
            if depth + height > MAX_DEPTH {
                return Err(SyntaxError {
                    message: format!(
                        "YAML nested deeper than {MAX_DEPTH} levels through this alias"
                    ),
                    span: at.clone(),
                });
            }
            self.deepest = self.deepest.max(depth + height);
            // The alias itself was counted as one value already.
            self.count(nodes.saturating_sub(1), at)
                .map_err(|e| SyntaxError {
                    message: format!(
                        "YAML aliases expand to more than {MAX_NODES} values (an alias bomb?)"
                    ),
                    ..e
                })?;
            Ok(self.anchors[&id].value.clone())
        }

        /// The value of one node, its anchor id (0 for none) and where it ends.
        fn node_value(
            &mut self,
            ev: Event<'a>,
            start: Range<usize>,
            path: &mut KeyPath,
            depth: usize,
        ) -> Result<(Value, usize, usize), SyntaxError> {
            Ok(match ev {
                Event::Scalar(s, style, anchor, tag) => {
                    let tagged_str = tag.as_ref().is_some_and(|t| t.suffix == "str");
                    let v = if style == ScalarStyle::Plain && !tagged_str {
                        plain_scalar(&s)
                    } else {
                        Value::String(s.into_owned())
                    };
                    (v, anchor, start.end)
                }
                Event::Alias(id) => (self.alias(id, &start, depth)?, 0, start.end),
                Event::SequenceStart(anchor, _) => {
                    let mut items = Vec::new();
                    loop {
                        let (ev, span) = self.next()?;
                        if matches!(ev, Event::SequenceEnd) {
                            let end = self.range(&span).end;
                            break (Value::Array(items), anchor, end);
                        }
                        if self.track {
                            path.push(items.len().to_string());
                        }
                        let item = self.node(ev, span, path, depth + 1)?;
                        if self.track {
                            path.pop();
                        }
                        items.push(item);
                    }
                }
                Event::MappingStart(anchor, _) => {
                    let mut map = Map::new();
                    let mut merged = Map::new();
                    let end = loop {
                        let (ev, kspan) = self.next()?;
                        let key_range = self.range(&kspan);
                        let key = match ev {
                            Event::MappingEnd => break key_range.end,
                            Event::Scalar(s, _, _, _) => s.into_owned(),
                            _ => {
                                return Err(SyntaxError {
                                    message: "only plain string keys are supported in manifests"
                                        .into(),
                                    span: key_range,
                                });
                            }
                        };
                        if map.contains_key(&key) {
                            return Err(SyntaxError {
                                message: format!("duplicate key `{key}`"),
                                span: key_range,
                            });
                        }
                        let (ev, vspan) = self.next()?;
                        if self.track {
                            path.push(key.clone());
                        }
                        let value = self.node(ev, vspan, path, depth + 1)?;
                        if self.track {
                            path.pop();
                        }
                        if key == "<<" {
                            let sources = match value {
                                Value::Array(items) => items,
                                other => vec![other],
                            };
                            for source in sources {
                                let Value::Object(m) = source else {
                                    return Err(SyntaxError {
                                        message:
                                            "a `<<` merge takes a mapping or a list of mappings"
                                                .into(),
                                        span: key_range,
                                    });
                                };
                                for (k, v) in m {
                                    merged.entry(k).or_insert(v);
                                }
                            }
                            continue;
                        }
                        if self.track {
                            let mut key_path = path.clone();
                            key_path.push(key.clone());
                            if let Some(ns) = self.spans.0.get_mut(&key_path) {
                                ns.key = key_range;
                            }
                        }
                        map.insert(key, value);
                    };
                    for (k, v) in merged {
                        map.entry(k).or_insert(v);
                    }
                    (Value::Object(map), anchor, end)
                }
                other => {
                    return Err(SyntaxError {
                        message: format!("unexpected YAML event {other:?}"),
                        span: start,
                    });
                }
            })
        }
    }
}

mod toml_doc {
    use super::*;
    use toml::Spanned;
    use toml::de::{DeTable, DeValue};

    pub fn parse(text: &str, _track: bool) -> Result<(Value, Spans), SyntaxError> {
        // toml's parser records spans anyway; keeping them is cheap.
        let table = DeTable::parse(text).map_err(|e| SyntaxError {
            message: format!("TOML syntax error: {}", e.message()),
            span: e.span().unwrap_or(0..0),
        })?;
        let mut spans = Spans::default();
        let mut path = Vec::new();
        let root = convert_table(table.get_ref(), &mut path, &mut spans)?;
        spans.0.insert(
            Vec::new(),
            NodeSpan {
                key: 0..0,
                value: table.span(),
            },
        );
        Ok((root, spans))
    }

    fn convert_table(
        table: &DeTable,
        path: &mut KeyPath,
        spans: &mut Spans,
    ) -> Result<Value, SyntaxError> {
        let mut map = Map::new();
        for (key, value) in table.iter() {
            path.push(key.get_ref().to_string());
            let v = convert(value, path, spans)?;
            spans.0.insert(
                path.clone(),
                NodeSpan {
                    key: key.span(),
                    value: value.span(),
                },
            );
            path.pop();
            map.insert(key.get_ref().to_string(), v);
        }
        Ok(Value::Object(map))
    }

    fn convert(
        value: &Spanned<DeValue>,
        path: &mut KeyPath,
        spans: &mut Spans,
    ) -> Result<Value, SyntaxError> {
        let bad = |what: &str| SyntaxError {
            message: format!("TOML: {what}"),
            span: value.span(),
        };
        Ok(match value.get_ref() {
            DeValue::String(s) => Value::String(s.to_string()),
            DeValue::Boolean(b) => Value::Bool(*b),
            DeValue::Integer(i) => {
                let digits: String = i.as_str().chars().filter(|c| *c != '_').collect();
                let digits = digits
                    .trim_start_matches("0x")
                    .trim_start_matches("0o")
                    .trim_start_matches("0b");
                let n = i64::from_str_radix(digits, i.radix())
                    .map_err(|_| bad("integer out of range"))?;
                Value::from(n)
            }
            DeValue::Float(f) => {
                let text: String = f.as_str().chars().filter(|c| *c != '_').collect();
                let x: f64 = text.parse().map_err(|_| bad("invalid float"))?;
                if !x.is_finite() {
                    return Err(bad("inf and nan are not supported in manifests"));
                }
                number(x)
            }
            DeValue::Datetime(d) => Value::String(d.to_string()),
            DeValue::Array(items) => {
                let mut out = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    path.push(i.to_string());
                    out.push(convert(item, path, spans)?);
                    spans.0.insert(
                        path.clone(),
                        NodeSpan {
                            key: 0..0,
                            value: item.span(),
                        },
                    );
                    path.pop();
                }
                Value::Array(out)
            }
            DeValue::Table(t) => convert_table(t, path, spans)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(path: &[&str]) -> KeyPath {
        path.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn yaml_and_toml_give_the_same_tree() {
        let yaml = "stages:\n  gen:\n    op: cmd\n    params: {n: 3, lr: 1e-4, on: yes, x: 2.0}\n";
        let toml =
            "[stages.gen]\nop = \"cmd\"\nparams = {n = 3, lr = 0.0001, on = \"yes\", x = 2}\n";
        let (a, _) = parse(Format::Yaml, yaml, true).unwrap();
        let (b, _) = parse(Format::Toml, toml, true).unwrap();
        assert_eq!(a, b);
        assert_eq!(a["stages"]["gen"]["params"]["x"], json!(2));
    }

    #[test]
    fn spans_point_at_keys_and_values() {
        let yaml = "stages:\n  gen:\n    op: cmd\n";
        let (_, spans) = parse(Format::Yaml, yaml, true).unwrap();
        let op = spans.get(&p(&["stages", "gen", "op"])).unwrap();
        assert_eq!(&yaml[op.key.clone()], "op");
        assert_eq!(&yaml[op.value.clone()], "cmd");
        let toml = "[stages.gen]\nop = \"cmd\"\n";
        let (_, spans) = parse(Format::Toml, toml, true).unwrap();
        let op = spans.get(&p(&["stages", "gen", "op"])).unwrap();
        assert_eq!(&toml[op.key.clone()], "op");
    }

    #[test]
    fn duplicate_keys_are_errors_and_merges_apply() {
        assert!(parse(Format::Yaml, "a: 1\na: 2\n", false).is_err());
        let (v, _) = parse(
            Format::Yaml,
            "base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n",
            false,
        )
        .unwrap();
        assert_eq!(v["c"], json!({"x": 1, "y": 3}));
    }

    #[test]
    fn scalars_follow_the_core_schema() {
        assert_eq!(plain_scalar("yes"), json!("yes"));
        assert_eq!(plain_scalar("1e-4"), plain_scalar("0.0001"));
        assert_eq!(plain_scalar("0x10"), json!(16));
        assert_eq!(plain_scalar("~"), Value::Null);
        assert_eq!(plain_scalar("1.5"), json!(1.5));
        assert_eq!(plain_scalar("abc"), json!("abc"));
    }

    #[test]
    fn aliases_count_as_what_they_expand_to() {
        let levels = |n: usize| {
            let mut text = String::from("l0: &l0 [a, b, c, d, e, f, g, h, i, j]\n");
            for i in 1..n {
                let aliases = vec![format!("*l{}", i - 1); 10].join(", ");
                text.push_str(&format!("l{i}: &l{i} [{aliases}]\n"));
            }
            text
        };
        let (v, _) = parse(Format::Yaml, &levels(4), false).unwrap();
        assert_eq!(v["l3"][9][9][9][9], json!("j"));
        let err = parse(Format::Yaml, &levels(7), false).unwrap_err();
        assert!(err.message.contains("aliases expand"), "{}", err.message);
        let deep = format!("x:\n  {}1", "- ".repeat(MAX_DEPTH + 1));
        let err = parse(Format::Yaml, &deep, true).unwrap_err();
        assert!(err.message.contains("nested deeper"), "{}", err.message);
        let (v, _) = parse(
            Format::Yaml,
            &format!("x:\n  {}1", "- ".repeat(MAX_DEPTH - 1)),
            true,
        )
        .unwrap();
        assert!(v["x"].is_array());
    }
}
