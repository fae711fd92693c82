//! 3. Rendering

use super::*;
/// A compiled chat template, in an environment that renders like the one `transformers` uses
/// for chat templates: `trim_blocks` and `lstrip_blocks`, undefined values as in Jinja2,
/// `tojson` as Python's `json.dumps` (insertion order, `", "`/`": "` separators, no HTML
/// escaping), `string` and printing of `True`/`False`/`None`/lists/dicts as Python's `str()`,
/// `raise_exception(msg)`, and the Python string/dict methods templates commonly call
/// (`strip`, `lstrip`, `rstrip`, `startswith`, `endswith`, `split`, `upper`, `lower`,
/// `replace`, `items`, `keys`, `values`, `get`).
pub struct ChatTemplate {
    pub(super) env: Environment<'static>,
    source: String,
}

/// The switches a render takes besides the messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RenderFlags {
    pub enable_thinking: bool,
    pub truncate_history_thinking: bool,
}

impl Default for RenderFlags {
    fn default() -> Self {
        RenderFlags {
            enable_thinking: true,
            truncate_history_thinking: true,
        }
    }
}

pub(super) const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compile template text.
    pub fn new(source: impl Into<String>) -> Result<ChatTemplate, crate::Error> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.add_filter("tojson", py_tojson);
        env.add_filter("string", py_string_filter);
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.set_formatter(py_formatter);
        env.set_unknown_method_callback(py_method);
        let source = source.into();
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| format!("chat template does not compile: {e:#}"))?;
        Ok(ChatTemplate { env, source })
    }

    /// The template's text, as compiled (what a model trained on its renders keeps).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Load and compile a template from its source.
    pub fn load(src: &TemplateSource) -> Result<ChatTemplate, crate::Error> {
        ChatTemplate::new(load_template(src)?)
    }

    /// Render messages (and tools) to text, as `apply_chat_template(tokenize=False)` would.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        flags: RenderFlags,
    ) -> Result<String, crate::Error> {
        let messages: Vec<Value> = messages.iter().map(|m| m.to_json().to_value()).collect();
        self.render_values(&messages, &tools_value(tools), add_generation_prompt, flags)
            .map_err(|e| crate::Error::new(format!("{e:#}")))
    }

    /// Render already-converted messages. The switches are passed both as top-level
    /// variables and inside `chat_template_kwargs`, as Nemotron's data prep does.
    pub(super) fn render_values(
        &self,
        messages: &[Value],
        tools: &Value,
        add_generation_prompt: bool,
        flags: RenderFlags,
    ) -> Result<String, Error> {
        let template = self.env.get_template(TEMPLATE_NAME)?;
        template.render(minijinja::context! {
            messages => Value::from(messages.to_vec()),
            tools => tools.clone(),
            add_generation_prompt => add_generation_prompt,
            enable_thinking => flags.enable_thinking,
            truncate_history_thinking => flags.truncate_history_thinking,
            chat_template_kwargs => minijinja::context! {
                enable_thinking => flags.enable_thinking,
                truncate_history_thinking => flags.truncate_history_thinking,
            },
        })
    }
}

pub(super) fn tools_value(tools: Option<&[Json]>) -> Value {
    match tools {
        Some(list) => Value::from(list.iter().map(Json::to_value).collect::<Vec<_>>()),
        None => Value::from(()),
    }
}

/// Python's `float.__repr__`: shortest round-trip digits, positional for exponents −4..15
/// (always with a fractional part), scientific otherwise (`1e+16`, `1.5e-05`).
pub(super) fn py_float_repr(x: f64) -> String {
    if x.is_nan() {
        return "nan".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".into() } else { "-inf".into() };
    }
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let fixed = format!("{x}");
        if fixed.contains('.') {
            fixed
        } else {
            fixed + ".0"
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.unsigned_abs())
    }
}

fn py_number(v: &Value) -> String {
    if v.is_integer() {
        v.to_string()
    } else {
        f64::try_from(v.clone()).map_or_else(|_| v.to_string(), py_float_repr)
    }
}

/// Python's `repr()` of a string: single quotes unless the text has a single quote and no
/// double quote; backslash, quote, `\n`, `\r`, `\t` escaped; other control characters `\xNN`.
fn py_str_repr(s: &str, out: &mut String) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if c.is_control() && (c as u32) < 0x100 => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr()` of a template value (used for items inside lists and dicts).
fn py_repr(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::String => py_str_repr(v.as_str().unwrap_or_default(), out),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_repr(&key, out)?;
                out.push_str(": ");
                py_repr(&v.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => out.push_str(&py_str(v)?),
    }
    Ok(())
}

/// Python's `str()` of a template value.
fn py_str(v: &Value) -> Result<String, Error> {
    Ok(match v.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::None => "None".into(),
        ValueKind::Bool => if v.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number => py_number(v),
        ValueKind::String => v.as_str().unwrap_or_default().to_string(),
        ValueKind::Seq | ValueKind::Map => {
            let mut out = String::new();
            py_repr(v, &mut out)?;
            out
        }
        _ => v.to_string(),
    })
}

/// The `string` filter, as Jinja2 under Python (`true|string` is `True`).
fn py_string_filter(v: &Value) -> Result<Value, Error> {
    if v.kind() == ValueKind::String {
        return Ok(v.clone());
    }
    Ok(Value::from(py_str(v)?))
}

/// Printing `{{ value }}`: booleans, none, floats and containers as Python prints them.
fn py_formatter(
    out: &mut minijinja::Output,
    state: &mut State,
    value: &Value,
) -> Result<(), Error> {
    let text = match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => py_str(value)?,
        ValueKind::Number if !value.is_integer() => py_number(value),
        _ => return minijinja::escape_formatter(out, state, value),
    };
    out.write_str(&text)
        .map_err(|_| Error::new(ErrorKind::WriteFailure, "cannot write template output"))
}

/// `json.dumps` settings.
struct PyJson {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }

    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn dump(&self, v: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match v.kind() {
            ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                let text = py_number(v);
                out.push_str(match text.as_str() {
                    "nan" => "NaN",
                    "inf" => "Infinity",
                    "-inf" => "-Infinity",
                    _ => &text,
                });
            }
            ValueKind::String => self.string(v.as_str().unwrap_or_default(), out),
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = v.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    self.dump(item, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = v.try_iter()?.collect();
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                if self.sort_keys {
                    keys.sort();
                }
                out.push('{');
                for (i, key) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(depth + 1, out);
                    match key.kind() {
                        ValueKind::String => self.string(key.as_str().unwrap_or_default(), out),
                        ValueKind::Number | ValueKind::Bool | ValueKind::None => {
                            let mut text = String::new();
                            self.dump(key, depth, &mut text)?;
                            self.string(&text, out);
                        }
                        _ => {
                            return Err(Error::new(
                                ErrorKind::InvalidOperation,
                                format!("tojson: keys must be strings, not {}", key.kind()),
                            ));
                        }
                    }
                    out.push_str(&self.key_sep);
                    self.dump(&v.get_item(key)?, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push('}');
            }
            kind => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("tojson: a value of type {kind} is not JSON serializable"),
                ));
            }
        }
        Ok(())
    }
}

/// `tojson` as `transformers` defines it: `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, each settable by keyword.
fn py_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) if v.kind() == ValueKind::String => Some(v.as_str().unwrap_or_default().into()),
        Some(v) => Some(" ".repeat(v.as_usize().ok_or_else(|| {
            Error::new(
                ErrorKind::InvalidOperation,
                "tojson: indent must be a number",
            )
        })?)),
    };
    let (item_sep, key_sep) = match separators {
        Some(seps) if !seps.is_none() => {
            let parts: Vec<String> = seps.try_iter()?.map(|s| s.to_string()).collect();
            match parts.as_slice() {
                [item, key] => (item.clone(), key.clone()),
                _ => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: separators must be a pair of strings",
                    ));
                }
            }
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let dumper = PyJson {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    dumper.dump(value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python methods on strings and dicts that chat templates call (`content.split('</think>')`,
/// `message.get('x')`, …).
fn py_method(
    state: &mut State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let arg_str = |i: usize| args.get(i).and_then(Value::as_str);
    if let Some(s) = value.as_str() {
        let strip_set = |i: usize| arg_str(i).map(|c| c.chars().collect::<Vec<char>>());
        return Ok(match method {
            "strip" => Value::from(match strip_set(0) {
                Some(set) => s.trim_matches(&set[..]),
                None => s.trim(),
            }),
            "lstrip" => Value::from(match strip_set(0) {
                Some(set) => s.trim_start_matches(&set[..]),
                None => s.trim_start(),
            }),
            "rstrip" => Value::from(match strip_set(0) {
                Some(set) => s.trim_end_matches(&set[..]),
                None => s.trim_end(),
            }),
            "startswith" => Value::from(arg_str(0).is_some_and(|p| s.starts_with(p))),
            "endswith" => Value::from(arg_str(0).is_some_and(|p| s.ends_with(p))),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "split" | "replace" => {
                let mut call = vec![value.clone()];
                call.extend(args.iter().cloned());
                return state.apply_filter(method, &call);
            }
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => state.apply_filter("items", std::slice::from_ref(value)),
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => {
                let keys: Vec<Value> = value.try_iter()?.collect();
                let values = keys
                    .iter()
                    .map(|k| value.get_item(k))
                    .collect::<Result<Vec<_>, _>>()?;
                Ok(Value::from(values))
            }
            "get" => {
                let key = args.first().cloned().unwrap_or_default();
                let found = value.get_item(&key)?;
                Ok(if found.is_undefined() {
                    args.get(1).cloned().unwrap_or_else(|| Value::from(()))
                } else {
                    found
                })
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}
