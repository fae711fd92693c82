//! SFT chat data: chat templates, role chunks and loss masks.
//!
//! This module turns one chat record (a JSONL row with a list of OpenAI-style messages and
//! optional tool definitions) into token sequences with a per-token loss mask, the way
//! Nemotron's SFT data preparation does before packing (reference
//! `shared/reference/nemotron-recipes.md` §1.7 "SFT chat → packed Parquet", steps 1–7; the
//! testable behaviours are the chat bullets of §6.4). Packing, Parquet and splits (steps 8–13)
//! live elsewhere.
//!
//! The pipeline, top to bottom:
//!
//! 1. **Templates** ([`TemplateSource`], [`load_template`], [`ChatTemplate`]): the bundled
//!    `nano3` Jinja template, a template file, an inline string, or the `chat_template` of a
//!    Hugging Face `tokenizer_config.json` (step 4). Templates are rendered with minijinja,
//!    configured to behave like the Jinja2 environment `transformers` renders chat templates
//!    with (trim/lstrip blocks, Python-style `tojson` and `string`, a few Python string/dict
//!    methods).
//! 2. **Records** ([`Json`], [`Message`], [`Conversation`]): the `used_in` filter (step 1),
//!    the `<tool_call>`-without-`# Tools` validation (step 2) and parsing tool-call arguments
//!    given as JSON strings (step 3).
//! 3. **Role chunks** ([`role_chunks`]): incremental rendering cuts the fully rendered
//!    conversation into one chunk per turn (step 5); reasoning conversations become one
//!    sequence per user turn (step 6).
//! 4. **Tokens and mask** ([`tokenize_chunks`]): each chunk is tokenized on its own; the mask
//!    is 1 on assistant chunks (step 7).
//! 5. **Per-row driver** ([`process_row`], [`ChatStats`]): all of the above for one JSONL
//!    line, counting dropped rows the way Nemotron's shard processor does.
//!
//! Nemotron does not use Megatron-Bridge's `{% generation %}`-based masking for nano3
//! (§3.1); it uses the incremental-render chunker reproduced here.

use minijinja::value::{Enumerator, Kwargs, Object, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// 1. Templates
// ---------------------------------------------------------------------------------------------

/// The bundled `nano3` chat template (reference §1.7 step 4).
///
/// ChatML-like turns `<|im_start|>{role}\n…<|im_end|>\n`. The behaviour, as the reference
/// states it and, where the reference is silent, as Nemotron's `nano3.jinja` does it:
///
/// - **System turn.** A leading system message becomes the system turn; the system turn is
///   written even when there is no system message (`<|im_start|>system\n<|im_end|>\n`).
/// - **Tools** are described inside the system turn, after the system text (separated by a
///   blank line when that text is non-empty), under a `# Tools` header: a `<tools>` list with
///   one `<function>` element per tool (`<name>`, trimmed `<description>`, `<parameters>` with
///   one `<parameter>` per property — `<name>`, `<type>`, `<description>`, `<enum>` as JSON, then
///   any other schema key as `<key>value</key>` — then the parameters' extra keys and
///   `<required>` as JSON), followed by fixed instructions showing the tool-call format.
/// - **Assistant turns.** Non-blank `reasoning_content` is written
///   `<think>\n{reasoning}\n</think>\n{content}`; a turn without reasoning and without think
///   tags of its own gets an empty `<think></think>` in front of its content. The text is
///   trimmed. With `truncate_history_thinking` (default on), assistant turns *before the last
///   user turn* keep only what follows their last `</think>`, behind an empty
///   `<think></think>` (a plain turn keeps that text as it is, so a reasoning turn becomes
///   `<think></think>\n{content}`; a turn with tool calls has it trimmed).
/// - **Tool calls** follow the assistant text on a new line, one
///   `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n…</function>\n</tool_call>\n`
///   per call; a value that is an object or a list is written as JSON, anything else as
///   Python's `str()` would (so `true` becomes `True`).
/// - **Tool results** are written inside a *user* turn as `<tool_response>\n…\n</tool_response>\n`;
///   consecutive tool messages share one user turn (as in the original, a tool message that
///   is the very first turn does not open one).
/// - **Generation prompt**: `<|im_start|>assistant\n<think>\n` with thinking on,
///   `<|im_start|>assistant\n<think></think>` with thinking off.
pub const NANO3_TEMPLATE: &str = include_str!("templates/nano3.jinja");

/// The names [`TemplateSource::Bundled`] accepts.
pub const BUNDLED_TEMPLATES: &[&str] = &["nano3"];

/// Where a chat template comes from (reference §1.7 step 4: a bundled name, a `.jinja` path or
/// an inline string; plus a Hugging Face `tokenizer_config.json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateSource {
    /// A template shipped with nemo-dag, by name (`nano3`).
    Bundled(String),
    /// The template text itself.
    Inline(String),
    /// A file holding the template text (`.jinja`).
    File(PathBuf),
    /// A Hugging Face `tokenizer_config.json` (or the directory holding it); its
    /// `chat_template` field, else a `chat_template.jinja` next to it.
    TokenizerConfig(PathBuf),
}

impl TemplateSource {
    /// Interpret a `chat_template` parameter the way Nemotron does: a bundled name, else an
    /// existing path (a `.json` file or a directory means a tokenizer config), else the
    /// template text itself.
    pub fn from_param(param: &str) -> TemplateSource {
        if BUNDLED_TEMPLATES.contains(&param) {
            return TemplateSource::Bundled(param.to_string());
        }
        let path = Path::new(param);
        if !param.contains('\n') && path.exists() {
            if path.is_dir() || path.extension().is_some_and(|e| e == "json") {
                return TemplateSource::TokenizerConfig(path.to_path_buf());
            }
            return TemplateSource::File(path.to_path_buf());
        }
        TemplateSource::Inline(param.to_string())
    }
}

/// The template text a [`TemplateSource`] names.
pub fn load_template(src: &TemplateSource) -> Result<String, String> {
    match src {
        TemplateSource::Bundled(name) => match name.as_str() {
            "nano3" => Ok(NANO3_TEMPLATE.to_string()),
            other => Err(format!(
                "unknown bundled chat template {other:?} (bundled: {})",
                BUNDLED_TEMPLATES.join(", ")
            )),
        },
        TemplateSource::Inline(text) => Ok(text.clone()),
        TemplateSource::File(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read chat template {}: {e}", path.display())),
        TemplateSource::TokenizerConfig(path) => template_from_tokenizer_config(path),
    }
}

/// `chat_template` of a `tokenizer_config.json`: a string, or a list of `{name, template}`
/// from which `default` is taken (what `transformers` uses when no name is asked for).
/// Newer checkpoints keep the template in a `chat_template.jinja` beside the config instead.
fn template_from_tokenizer_config(path: &Path) -> Result<String, String> {
    let config_path = if path.is_dir() {
        path.join("tokenizer_config.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&config_path)
        .map_err(|e| format!("cannot read {}: {e}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not valid JSON: {e}", config_path.display()))?;
    match config.get("chat_template") {
        Some(serde_json::Value::String(t)) => Ok(t.clone()),
        Some(serde_json::Value::Array(list)) => {
            let named = |want: &str| {
                list.iter().find_map(|entry| {
                    (entry.get("name")?.as_str()? == want)
                        .then(|| entry.get("template")?.as_str().map(str::to_string))
                        .flatten()
                })
            };
            named("default").ok_or_else(|| {
                format!(
                    "{}: chat_template lists several templates but none named \"default\"",
                    config_path.display()
                )
            })
        }
        Some(serde_json::Value::Null) | None => {
            let sibling = config_path
                .parent()
                .unwrap_or_else(|| Path::new("."))
                .join("chat_template.jinja");
            std::fs::read_to_string(&sibling).map_err(|_| {
                format!(
                    "{} has no chat_template and there is no {}",
                    config_path.display(),
                    sibling.display()
                )
            })
        }
        Some(_) => Err(format!(
            "{}: chat_template is neither a string nor a list",
            config_path.display()
        )),
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Records: ordered JSON, messages, conversations (steps 1–3)
// ---------------------------------------------------------------------------------------------

/// A JSON value that keeps object keys in document order.
///
/// Templates iterate tool schemas and tool-call arguments (`|items`), and Python dicts keep
/// insertion order, so the rendered text depends on key order. `serde_json::Value` (without
/// its `preserve_order` feature, which the workspace does not enable) sorts keys; this type
/// does not. A repeated key keeps its first position and its last value, like `json.loads`.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parse JSON text.
    pub fn parse(text: &str) -> Result<Json, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    /// The value under `key`, for an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Object(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    fn get_mut(&mut self, key: &str) -> Option<&mut Json> {
        match self {
            Json::Object(entries) => entries.iter_mut().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn is_null(&self) -> bool {
        matches!(self, Json::Null)
    }

    /// The template value: objects become ordered maps.
    pub fn to_value(&self) -> Value {
        match self {
            Json::Null => Value::from(()),
            Json::Bool(b) => Value::from(*b),
            Json::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Value::from(i)
                } else if let Some(u) = n.as_u64() {
                    Value::from(u)
                } else {
                    Value::from(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            Json::String(s) => Value::from(s.as_str()),
            Json::Array(items) => Value::from(items.iter().map(Json::to_value).collect::<Vec<_>>()),
            Json::Object(entries) => Value::from_object(OrderedMap(
                entries
                    .iter()
                    .map(|(k, v)| (Value::from(k.as_str()), v.to_value()))
                    .collect(),
            )),
        }
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        struct JsonVisitor;
        impl<'de> Visitor<'de> for JsonVisitor {
            type Value = Json;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<Json, E> {
                Ok(Json::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Json, E> {
                Ok(Json::Number(v.into()))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Json, E> {
                Ok(Json::Number(v.into()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
                serde_json::Number::from_f64(v)
                    .map(Json::Number)
                    .ok_or_else(|| E::custom("non-finite number"))
            }
            fn visit_str<E>(self, v: &str) -> Result<Json, E> {
                Ok(Json::String(v.to_string()))
            }
            fn visit_string<E>(self, v: String) -> Result<Json, E> {
                Ok(Json::String(v))
            }
            fn visit_unit<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_none<E>(self) -> Result<Json, E> {
                Ok(Json::Null)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Json, D::Error> {
                Json::deserialize(d)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Json::Array(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
                let mut entries: Vec<(String, Json)> = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, Json>()? {
                    match entries.iter_mut().find(|(k, _)| *k == key) {
                        Some(slot) => slot.1 = value,
                        None => entries.push((key, value)),
                    }
                }
                Ok(Json::Object(entries))
            }
        }
        deserializer.deserialize_any(JsonVisitor)
    }
}

impl Serialize for Json {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Json::Null => serializer.serialize_unit(),
            Json::Bool(b) => serializer.serialize_bool(*b),
            Json::Number(n) => n.serialize(serializer),
            Json::String(s) => serializer.serialize_str(s),
            Json::Array(items) => {
                let mut seq = serializer.serialize_seq(Some(items.len()))?;
                for item in items {
                    seq.serialize_element(item)?;
                }
                seq.end()
            }
            Json::Object(entries) => {
                let mut map = serializer.serialize_map(Some(entries.len()))?;
                for (k, v) in entries {
                    map.serialize_entry(k, v)?;
                }
                map.end()
            }
        }
    }
}

/// A template map that iterates in insertion order (see [`Json`]).
#[derive(Debug)]
struct OrderedMap(Vec<(Value, Value)>);

impl Object for OrderedMap {
    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        self.0
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        Enumerator::Values(self.0.iter().map(|(k, _)| k.clone()).collect())
    }

    fn enumerator_len(self: &Arc<Self>) -> Option<usize> {
        Some(self.0.len())
    }
}

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        Some(match s {
            "system" => Role::System,
            "user" => Role::User,
            "assistant" => Role::Assistant,
            "tool" => Role::Tool,
            _ => return None,
        })
    }
}

/// One chat message (OpenAI format). `content: null` reads as an empty string; keys other
/// than the four typed ones (`name`, `tool_call_id`, …) are kept in `extra`, in order, and
/// passed to the template.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "Json")]
pub struct Message {
    pub role: Role,
    pub content: String,
    pub reasoning_content: Option<String>,
    pub tool_calls: Option<Vec<Json>>,
    pub extra: Vec<(String, Json)>,
}

impl Message {
    /// A message with only a role and content.
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message {
            role,
            content: content.into(),
            reasoning_content: None,
            tool_calls: None,
            extra: Vec::new(),
        }
    }

    /// Whether this message carries reasoning (reference §1.7 step 6: "non-empty
    /// `reasoning_content`").
    pub fn has_reasoning(&self) -> bool {
        self.reasoning_content
            .as_deref()
            .is_some_and(|r| !r.is_empty())
    }

    /// Whether the template writes this turn's reasoning as an empty `<think></think>`: it
    /// keeps reasoning only when it is a string that is not blank.
    fn reasoning_renders_empty(&self) -> bool {
        self.reasoning_content
            .as_deref()
            .is_none_or(|r| r.trim().is_empty())
    }

    /// The message as JSON, typed fields first.
    pub fn to_json(&self) -> Json {
        let mut entries = vec![
            (
                "role".to_string(),
                Json::String(self.role.as_str().to_string()),
            ),
            ("content".to_string(), Json::String(self.content.clone())),
        ];
        if let Some(r) = &self.reasoning_content {
            entries.push(("reasoning_content".to_string(), Json::String(r.clone())));
        }
        if let Some(calls) = &self.tool_calls {
            entries.push(("tool_calls".to_string(), Json::Array(calls.clone())));
        }
        entries.extend(self.extra.iter().cloned());
        Json::Object(entries)
    }
}

impl TryFrom<Json> for Message {
    type Error = String;

    fn try_from(json: Json) -> Result<Message, String> {
        let Json::Object(entries) = json else {
            return Err("a message must be a JSON object".to_string());
        };
        let mut role = None;
        let mut message = Message::new(Role::User, "");
        for (key, value) in entries {
            match key.as_str() {
                "role" => {
                    let name = value.as_str().ok_or("message role must be a string")?;
                    role = Some(Role::parse(name).ok_or_else(|| {
                        format!("unknown message role {name:?} (system, user, assistant, tool)")
                    })?);
                }
                "content" => {
                    message.content = match value {
                        Json::Null => String::new(),
                        Json::String(s) => s,
                        _ => return Err("message content must be a string".to_string()),
                    }
                }
                "reasoning_content" => {
                    message.reasoning_content = match value {
                        Json::Null => None,
                        Json::String(s) => Some(s),
                        _ => return Err("reasoning_content must be a string".to_string()),
                    }
                }
                "tool_calls" => {
                    message.tool_calls = match value {
                        Json::Null => None,
                        Json::Array(calls) => Some(calls),
                        _ => return Err("tool_calls must be a list".to_string()),
                    }
                }
                _ => message.extra.push((key, value)),
            }
        }
        message.role = role.ok_or("message has no role")?;
        Ok(message)
    }
}

impl Serialize for Message {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(serializer)
    }
}

/// A conversation: messages and the tool definitions offered to the model.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Conversation {
    pub messages: Vec<Message>,
    #[serde(default)]
    pub tools: Option<Vec<Json>>,
}

/// Which fields of a record hold the messages and the tools (reference §1.7: configurable,
/// `messages_field="messages"`, `tools_field="tools"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowFields {
    pub messages_field: String,
    pub tools_field: String,
}

impl Default for RowFields {
    fn default() -> Self {
        RowFields {
            messages_field: "messages".to_string(),
            tools_field: "tools".to_string(),
        }
    }
}

impl Conversation {
    /// Parse one JSONL line; see [`Conversation::from_record`].
    pub fn from_row(line: &str, fields: &RowFields) -> Result<Conversation, DropReason> {
        let record = Json::parse(line).map_err(DropReason::InvalidRow)?;
        Conversation::from_record(&record, fields)
    }

    /// Build a conversation from a parsed record, in the reference's order: no messages ⇒
    /// dropped; validation (step 2); typed messages; tool-call arguments given as JSON strings
    /// parsed into objects (step 3).
    pub fn from_record(record: &Json, fields: &RowFields) -> Result<Conversation, DropReason> {
        if !matches!(record, Json::Object(_)) {
            return Err(DropReason::InvalidRow(
                "a record must be a JSON object".into(),
            ));
        }
        let raw_messages = match record.get(&fields.messages_field) {
            None | Some(Json::Null) => return Err(DropReason::NoMessages),
            Some(Json::Array(items)) if items.is_empty() => return Err(DropReason::NoMessages),
            Some(Json::Array(items)) => items,
            Some(_) => {
                return Err(DropReason::InvalidRow(format!(
                    "field {:?} is not a list of messages",
                    fields.messages_field
                )));
            }
        };
        validate_tool_markup(raw_messages)?;
        let mut messages = raw_messages
            .iter()
            .map(|m| Message::try_from(m.clone()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(DropReason::InvalidRow)?;
        for message in messages.iter_mut().filter(|m| m.role == Role::Assistant) {
            for call in message.tool_calls.iter_mut().flatten() {
                parse_tool_arguments(call)?;
            }
        }
        let tools = match record.get(&fields.tools_field) {
            None | Some(Json::Null) => None,
            Some(Json::Array(items)) => Some(items.clone()),
            // Some datasets store the tool list as a JSON string.
            Some(Json::String(text)) => match Json::parse(text) {
                Ok(Json::Array(items)) => Some(items),
                _ => {
                    return Err(DropReason::InvalidRow(format!(
                        "field {:?} is a string that is not a JSON list",
                        fields.tools_field
                    )));
                }
            },
            Some(_) => {
                return Err(DropReason::InvalidRow(format!(
                    "field {:?} is not a list of tools",
                    fields.tools_field
                )));
            }
        };
        Ok(Conversation { messages, tools })
    }

    /// A reasoning conversation has a message with non-empty `reasoning_content` (step 6).
    pub fn has_reasoning(&self) -> bool {
        self.messages.iter().any(Message::has_reasoning)
    }
}

/// Step 2: a `<tool_call>` in any message's content or reasoning while no message's content
/// or reasoning contains a `# Tools` header ⇒ the row is dropped.
///
/// Like Nemotron's `validate_conversation`, only the messages are searched: the tool list
/// (which the template renders under `# Tools`) does not count, and structured `tool_calls`
/// are not `<tool_call>` text.
fn validate_tool_markup(raw_messages: &[Json]) -> Result<(), DropReason> {
    let texts = || {
        raw_messages.iter().flat_map(|m| {
            ["content", "reasoning_content"]
                .into_iter()
                .filter_map(move |k| m.get(k).and_then(Json::as_str))
        })
    };
    let has_call = texts().any(|t| t.contains("<tool_call>"));
    if has_call && !texts().any(|t| t.contains("# Tools")) {
        return Err(DropReason::ToolCallWithoutToolsHeader);
    }
    Ok(())
}

/// Step 3: `function.arguments` given as a JSON string becomes the object it encodes (a
/// call without the `function` wrapper is handled the same way on its own `arguments`).
fn parse_tool_arguments(call: &mut Json) -> Result<(), DropReason> {
    let holder = if matches!(call.get("function"), Some(Json::Object(_))) {
        call.get_mut("function")
    } else {
        Some(call)
    };
    let Some(args) = holder.and_then(|h| h.get_mut("arguments")) else {
        return Ok(());
    };
    if let Json::String(text) = args {
        *args = Json::parse(text)
            .map_err(|e| DropReason::BadToolArguments(format!("{e} in {text:?}")))?;
    }
    Ok(())
}

/// Step 1: whether a record's `used_in` value (a list, or a comma-separated string) names
/// `filter` (nano3 keeps `nano_v3`).
pub fn matches_used_in(used_in: Option<&Json>, filter: &str) -> bool {
    match used_in {
        Some(Json::Array(items)) => items.iter().any(|i| i.as_str() == Some(filter)),
        Some(Json::String(s)) => s == filter || s.split(',').any(|part| part.trim() == filter),
        _ => false,
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Rendering
// ---------------------------------------------------------------------------------------------

/// A compiled chat template, in an environment that renders like the one `transformers` uses
/// for chat templates: `trim_blocks` and `lstrip_blocks`, undefined values as in Jinja2,
/// `tojson` as Python's `json.dumps` (insertion order, `", "`/`": "` separators, no HTML
/// escaping), `string` and printing of `True`/`False`/`None`/lists/dicts as Python's `str()`,
/// `raise_exception(msg)`, and the Python string/dict methods templates commonly call
/// (`strip`, `lstrip`, `rstrip`, `startswith`, `endswith`, `split`, `upper`, `lower`,
/// `replace`, `items`, `keys`, `values`, `get`).
pub struct ChatTemplate {
    env: Environment<'static>,
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

const TEMPLATE_NAME: &str = "chat_template";

impl ChatTemplate {
    /// Compile template text.
    pub fn new(source: impl Into<String>) -> Result<ChatTemplate, String> {
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
        env.add_template_owned(TEMPLATE_NAME, source.into())
            .map_err(|e| format!("chat template does not compile: {e:#}"))?;
        Ok(ChatTemplate { env })
    }

    /// Load and compile a template from its source.
    pub fn load(src: &TemplateSource) -> Result<ChatTemplate, String> {
        ChatTemplate::new(load_template(src)?)
    }

    /// Render messages (and tools) to text, as `apply_chat_template(tokenize=False)` would.
    pub fn render(
        &self,
        messages: &[Message],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        flags: RenderFlags,
    ) -> Result<String, String> {
        let messages: Vec<Value> = messages.iter().map(|m| m.to_json().to_value()).collect();
        self.render_values(&messages, &tools_value(tools), add_generation_prompt, flags)
            .map_err(|e| format!("{e:#}"))
    }

    /// Render already-converted messages. The switches are passed both as top-level
    /// variables and inside `chat_template_kwargs`, as Nemotron's data prep does.
    fn render_values(
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

fn tools_value(tools: Option<&[Json]>) -> Value {
    match tools {
        Some(list) => Value::from(list.iter().map(Json::to_value).collect::<Vec<_>>()),
        None => Value::from(()),
    }
}

/// Python's `float.__repr__`: shortest round-trip digits, positional for exponents −4..15
/// (always with a fractional part), scientific otherwise (`1e+16`, `1.5e-05`).
fn py_float_repr(x: f64) -> String {
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

// ---------------------------------------------------------------------------------------------
// 4. Role chunks (steps 5–6)
// ---------------------------------------------------------------------------------------------

/// A piece of rendered text spoken by one role; `trained` is true for assistant chunks, the
/// only ones the loss sees (reference §1.7 step 7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub role: String,
    pub text: String,
    pub trained: bool,
}

impl Chunk {
    fn new(role: &str, text: &str) -> Chunk {
        Chunk {
            role: role.to_string(),
            text: text.to_string(),
            trained: role == "assistant",
        }
    }
}

/// How a conversation is rendered into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatOptions {
    /// Drop the thinking of assistant turns before the last user turn (default on, step 4).
    pub truncate_history_thinking: bool,
    /// Force thinking on or off; `None` (the default) does what Nemotron does: thinking on
    /// exactly for reasoning conversations, which picks the generation prompt.
    pub enable_thinking: Option<bool>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        ChatOptions {
            truncate_history_thinking: true,
            enable_thinking: None,
        }
    }
}

/// Why a row produced no sequences. [`ChatStats::record_drop`] counts them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DropReason {
    /// Step 1: the record's `used_in` does not name the filter.
    NotUsedIn,
    /// The messages field is missing, null or empty.
    NoMessages,
    /// The row is not valid JSON or a message is malformed.
    InvalidRow(String),
    /// Step 2: `<tool_call>` in a message without a `# Tools` header in any message.
    ToolCallWithoutToolsHeader,
    /// Step 3: tool-call arguments given as a string that is not JSON.
    BadToolArguments(String),
    /// Step 5: rendering the messages up to `message_index` did not give a prefix of the full
    /// rendering.
    RenderMismatch { message_index: usize },
    /// The template failed to render.
    Render(String),
}

impl fmt::Display for DropReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DropReason::NotUsedIn => f.write_str("filtered out by used_in"),
            DropReason::NoMessages => f.write_str("no messages"),
            DropReason::InvalidRow(why) => write!(f, "invalid row: {why}"),
            DropReason::ToolCallWithoutToolsHeader => {
                f.write_str("<tool_call> present but no message has a # Tools header")
            }
            DropReason::BadToolArguments(why) => write!(f, "tool-call arguments: {why}"),
            DropReason::RenderMismatch { message_index } => write!(
                f,
                "incremental rendering up to message {message_index} does not match the full rendering"
            ),
            DropReason::Render(why) => write!(f, "chat template failed: {why}"),
        }
    }
}

/// The text the nano3 template gives an assistant turn whose reasoning renders empty, used
/// instead of the thinking-on generation prompt `<|im_start|>assistant\n<think>\n` (which
/// would not be a prefix of that turn). Nemotron's chunker hard-codes it the same way.
const EMPTY_THINKING_PROMPT: &str = "<|im_start|>assistant\n<think></think>";

/// End of the system turn in a rendering.
const END_OF_TURN: &str = "<|im_end|>\n";

/// Steps 5–6: the sequences one conversation yields, each a list of role chunks whose texts
/// concatenate to the rendering of the messages it covers.
///
/// - **Non-reasoning conversation**: one sequence, one chunk per message (consecutive tool
///   messages merged), every assistant chunk trained.
/// - **Reasoning conversation** (some message has non-empty `reasoning_content`): one
///   sequence per user turn *i*, covering the messages before user turn *i+1* (the last one:
///   all messages). Everything up to the last user message and its generation prompt becomes
///   two masked chunks (system part = up to the first `<|im_end|>\n`, then the user part);
///   the turns after it are chunked one per message, so only the assistant turn(s) after the
///   last user message are trained. A sequence that ends on its user turn (the next message
///   is another user turn, or nothing) is skipped.
///
/// A first chunk that holds both the system turn and a user turn (no system message) is split
/// in two, as Nemotron's `split_system_user_chunks` does.
///
/// Every prefix rendering must be a prefix of the full rendering, or the row is dropped with
/// [`DropReason::RenderMismatch`]; this includes the rendering up to the last user message of
/// a reasoning sequence, which Nemotron uses without checking.
pub fn role_chunks(
    template: &ChatTemplate,
    conv: &Conversation,
    opts: &ChatOptions,
) -> Result<Vec<Vec<Chunk>>, DropReason> {
    let reasoning = conv.has_reasoning();
    let flags = RenderFlags {
        enable_thinking: opts.enable_thinking.unwrap_or(reasoning),
        truncate_history_thinking: opts.truncate_history_thinking,
    };
    let renderer = Renderer {
        template,
        values: conv
            .messages
            .iter()
            .map(|m| m.to_json().to_value())
            .collect(),
        messages: &conv.messages,
        tools: tools_value(conv.tools.as_deref()),
        flags,
    };
    let mut sequences = Vec::new();
    if reasoning {
        let user_turns: Vec<usize> = (0..conv.messages.len())
            .filter(|&i| conv.messages[i].role == Role::User)
            .collect();
        for (k, &user) in user_turns.iter().enumerate() {
            let end = user_turns
                .get(k + 1)
                .copied()
                .unwrap_or(conv.messages.len());
            if user + 1 == end {
                continue;
            }
            sequences.push(split_system_user(renderer.chunks(end, Some(user))?));
        }
    } else {
        sequences.push(split_system_user(
            renderer.chunks(conv.messages.len(), None)?,
        ));
    }
    Ok(sequences)
}

/// Renders prefixes of one conversation (messages converted to template values once).
struct Renderer<'a> {
    template: &'a ChatTemplate,
    messages: &'a [Message],
    values: Vec<Value>,
    tools: Value,
    flags: RenderFlags,
}

impl Renderer<'_> {
    fn render(&self, count: usize, add_generation_prompt: bool) -> Result<String, DropReason> {
        self.template
            .render_values(
                &self.values[..count],
                &self.tools,
                add_generation_prompt,
                self.flags,
            )
            .map_err(|e| DropReason::Render(format!("{e:#}")))
    }

    /// Chunk the first `len` messages. With `last_user`, everything up to that user message
    /// (and the generation prompt after it) becomes a system chunk and a user chunk, and only
    /// the messages after it are chunked one by one.
    fn chunks(&self, len: usize, last_user: Option<usize>) -> Result<Vec<Chunk>, DropReason> {
        let full = self.render(len, false)?;
        let mut chunks = Vec::new();
        let (mut previous, first) = match last_user {
            Some(user) => {
                let user_end = self.prefix_end(&full, len, user)?;
                let system_end = full
                    .find(END_OF_TURN)
                    .map_or(0, |p| p + END_OF_TURN.len())
                    .min(user_end);
                chunks.push(Chunk::new("system", &full[..system_end]));
                chunks.push(Chunk::new("user", &full[system_end..user_end]));
                (user_end, user + 1)
            }
            None => (0, 0),
        };
        for i in first..len {
            let role = self.messages[i].role;
            if role == Role::Tool && i + 1 < len && self.messages[i + 1].role == Role::Tool {
                continue; // consecutive tool results: one chunk, ending at the last of them
            }
            let end = self.prefix_end(&full, len, i)?;
            chunks.push(Chunk::new(
                role.as_str(),
                full.get(previous..end).unwrap_or(""),
            ));
            previous = end;
        }
        Ok(chunks)
    }

    /// Where message `i` ends in `full` (the rendering of the first `len` messages): the
    /// length of the rendering of messages `..=i`, which must be a prefix of `full`.
    ///
    /// A user or tool message followed by an assistant turn is rendered with the generation
    /// prompt, so the prompt belongs to that chunk and the assistant chunk is its content and
    /// `<|im_end|>\n`. With thinking on, an assistant turn whose reasoning renders empty starts
    /// `<think></think>`, not the prompt's `<think>\n`; for a turn before such an assistant turn
    /// (whatever its role) the rendering without prompt plus [`EMPTY_THINKING_PROMPT`] is used,
    /// as Nemotron does.
    fn prefix_end(&self, full: &str, len: usize, i: usize) -> Result<usize, DropReason> {
        let role = self.messages[i].role;
        let next = self.messages[..len].get(i + 1);
        let next_is_assistant = next.is_some_and(|m| m.role == Role::Assistant);
        let prefix = if self.flags.enable_thinking
            && role != Role::Assistant
            && next.is_some_and(|m| m.role == Role::Assistant && m.reasoning_renders_empty())
        {
            self.render(i + 1, false)? + EMPTY_THINKING_PROMPT
        } else {
            let with_prompt = matches!(role, Role::User | Role::Tool) && next_is_assistant;
            self.render(i + 1, with_prompt)?
        };
        if full.starts_with(&prefix) {
            Ok(prefix.len())
        } else {
            Err(DropReason::RenderMismatch { message_index: i })
        }
    }
}

/// Split a first `user` chunk that also holds the system turn (the template always writes
/// one) into a `system` chunk up to the first `<|im_end|>\n` and a `user` chunk with the rest.
fn split_system_user(mut chunks: Vec<Chunk>) -> Vec<Chunk> {
    let Some(first) = chunks.first() else {
        return chunks;
    };
    if first.role != "user"
        || !first.text.contains("<|im_start|>system")
        || !first.text.contains("<|im_start|>user")
    {
        return chunks;
    }
    let Some(end) = first.text.find(END_OF_TURN).map(|p| p + END_OF_TURN.len()) else {
        return chunks;
    };
    let first = chunks.remove(0);
    let (system, user) = first.text.split_at(end);
    chunks.insert(0, Chunk::new("user", user));
    chunks.insert(0, Chunk::new("system", system));
    chunks
}

// ---------------------------------------------------------------------------------------------
// 5. Tokens and loss mask (step 7)
// ---------------------------------------------------------------------------------------------

/// Token ids and the loss mask over them, one entry per token.
pub type TokenizedSequence = (Vec<u32>, Vec<u8>);

/// Step 7: tokenize each chunk on its own (`encode` must add no special tokens), mask 1 on
/// every token of a trained (assistant) chunk and 0 elsewhere, concatenate; no EOS is
/// appended; truncate to `max_doc_tokens` when set.
pub fn tokenize_chunks(
    chunks: &[Chunk],
    encode: impl Fn(&str) -> Vec<u32>,
    max_doc_tokens: Option<usize>,
) -> TokenizedSequence {
    let mut ids = Vec::new();
    let mut mask = Vec::new();
    for chunk in chunks {
        let tokens = encode(&chunk.text);
        mask.extend(std::iter::repeat_n(u8::from(chunk.trained), tokens.len()));
        ids.extend(tokens);
    }
    if let Some(max) = max_doc_tokens {
        ids.truncate(max);
        mask.truncate(max);
    }
    (ids, mask)
}

// ---------------------------------------------------------------------------------------------
// 6. One row, end to end, with counters
// ---------------------------------------------------------------------------------------------

/// Everything [`process_row`] needs besides the template and the tokenizer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowConfig {
    pub fields: RowFields,
    /// Keep only records whose `used_in_field` names this (step 1); `None` keeps all.
    pub used_in_filter: Option<String>,
    pub used_in_field: String,
    pub max_doc_tokens: Option<usize>,
    pub chat: ChatOptions,
}

impl Default for RowConfig {
    fn default() -> Self {
        RowConfig {
            fields: RowFields::default(),
            used_in_filter: None,
            used_in_field: "used_in".to_string(),
            max_doc_tokens: None,
            chat: ChatOptions::default(),
        }
    }
}

/// Row and sequence counters, named as Nemotron's shard processor names them: every dropped
/// row counts in `num_filtered`; validation drops also in `num_validation_errors`; bad
/// arguments, malformed rows and template failures/mismatches also in `num_errors`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ChatStats {
    pub num_input_rows: u64,
    pub num_output_sequences: u64,
    pub num_filtered: u64,
    pub num_validation_errors: u64,
    pub num_truncated: u64,
    pub num_errors: u64,
}

impl ChatStats {
    pub fn record_drop(&mut self, reason: &DropReason) {
        self.num_filtered += 1;
        match reason {
            DropReason::NotUsedIn | DropReason::NoMessages => {}
            DropReason::ToolCallWithoutToolsHeader => self.num_validation_errors += 1,
            DropReason::InvalidRow(_)
            | DropReason::BadToolArguments(_)
            | DropReason::RenderMismatch { .. }
            | DropReason::Render(_) => self.num_errors += 1,
        }
    }
}

/// Steps 1–7 for one JSONL line: the token ids and loss masks of every sequence it yields
/// (sequences without tokens are skipped), or the reason it yields none. `stats` counts the
/// row, its drop or its sequences and truncations.
pub fn process_row(
    template: &ChatTemplate,
    line: &str,
    cfg: &RowConfig,
    encode: impl Fn(&str) -> Vec<u32>,
    stats: &mut ChatStats,
) -> Result<Vec<TokenizedSequence>, DropReason> {
    stats.num_input_rows += 1;
    let result = row_sequences(template, line, cfg, &encode, stats);
    if let Err(reason) = &result {
        stats.record_drop(reason);
    }
    result
}

fn row_sequences(
    template: &ChatTemplate,
    line: &str,
    cfg: &RowConfig,
    encode: &impl Fn(&str) -> Vec<u32>,
    stats: &mut ChatStats,
) -> Result<Vec<TokenizedSequence>, DropReason> {
    let record = Json::parse(line).map_err(DropReason::InvalidRow)?;
    if let Some(filter) = &cfg.used_in_filter
        && !matches_used_in(record.get(&cfg.used_in_field), filter)
    {
        return Err(DropReason::NotUsedIn);
    }
    let conv = Conversation::from_record(&record, &cfg.fields)?;
    let mut out = Vec::new();
    for chunks in role_chunks(template, &conv, &cfg.chat)? {
        let (mut ids, mut mask) = tokenize_chunks(&chunks, encode, None);
        if ids.is_empty() {
            continue;
        }
        if let Some(max) = cfg.max_doc_tokens
            && ids.len() > max
        {
            ids.truncate(max);
            mask.truncate(max);
            stats.num_truncated += 1;
        }
        stats.num_output_sequences += 1;
        out.push((ids, mask));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// Tests
// ---------------------------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;

    fn nano3() -> ChatTemplate {
        ChatTemplate::load(&TemplateSource::Bundled("nano3".into())).unwrap()
    }

    fn msg(role: Role, content: &str) -> Message {
        Message::new(role, content)
    }

    fn reasoning(content: &str, thought: &str) -> Message {
        Message {
            reasoning_content: Some(thought.into()),
            ..Message::new(Role::Assistant, content)
        }
    }

    fn conv(messages: Vec<Message>) -> Conversation {
        Conversation {
            messages,
            tools: None,
        }
    }

    const OFF: RenderFlags = RenderFlags {
        enable_thinking: false,
        truncate_history_thinking: true,
    };
    const ON: RenderFlags = RenderFlags {
        enable_thinking: true,
        truncate_history_thinking: true,
    };

    /// The fixed instructions the nano3 template appends after the tool list.
    const TOOL_INSTRUCTIONS: &str = "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>";

    /// One token per byte: chunk boundaries and masks are easy to read off.
    fn bytes(text: &str) -> Vec<u32> {
        text.bytes().map(u32::from).collect()
    }

    fn texts(chunks: &[Chunk]) -> Vec<(&str, &str, bool)> {
        chunks
            .iter()
            .map(|c| (c.role.as_str(), c.text.as_str(), c.trained))
            .collect()
    }

    // --- rendering -------------------------------------------------------------------------

    #[test]
    fn renders_system_user_assistant() {
        let messages = [
            msg(Role::System, "You are helpful."),
            msg(Role::User, "Hi"),
            msg(Role::Assistant, "Hello!"),
        ];
        let text = nano3().render(&messages, None, false, OFF).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are helpful.<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n<think></think>Hello!<|im_end|>\n"
        );
    }

    #[test]
    fn writes_an_empty_system_turn_and_both_generation_prompts() {
        let messages = [msg(Role::User, "Hi")];
        let t = nano3();
        let base = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n";
        assert_eq!(t.render(&messages, None, false, ON).unwrap(), base);
        assert_eq!(
            t.render(&messages, None, true, ON).unwrap(),
            format!("{base}<|im_start|>assistant\n<think>\n")
        );
        assert_eq!(
            t.render(&messages, None, true, OFF).unwrap(),
            format!("{base}<|im_start|>assistant\n<think></think>")
        );
    }

    #[test]
    fn renders_reasoning_and_truncates_history_thinking() {
        let messages = [
            msg(Role::User, "2+2?"),
            reasoning("4", "Add them."),
            msg(Role::User, "3+3?"),
            reasoning(" 6 ", "Again."),
        ];
        let t = nano3();
        let head = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n";
        let tail = "<|im_start|>user\n3+3?<|im_end|>\n\
                    <|im_start|>assistant\n<think>\nAgain.\n</think>\n 6<|im_end|>\n";
        // Default: the turn before the last user turn loses its thinking; what followed
        // `</think>` is kept as it was, newline included.
        assert_eq!(
            t.render(&messages, None, false, ON).unwrap(),
            format!("{head}<|im_start|>assistant\n<think></think>\n4<|im_end|>\n{tail}")
        );
        // Without truncation every turn keeps it.
        let keep = RenderFlags {
            truncate_history_thinking: false,
            ..ON
        };
        assert_eq!(
            t.render(&messages, None, false, keep).unwrap(),
            format!(
                "{head}<|im_start|>assistant\n<think>\nAdd them.\n</think>\n4<|im_end|>\n{tail}"
            )
        );
        // Blank reasoning counts as none.
        let blank = [msg(Role::User, "q"), reasoning("a", " \n ")];
        assert!(
            t.render(&blank, None, false, ON)
                .unwrap()
                .ends_with("<|im_start|>assistant\n<think></think>a<|im_end|>\n")
        );
    }

    /// A record with tools (keys deliberately not in alphabetical order), a tool call whose
    /// arguments are a JSON string, a tool response and the final answer.
    const TOOL_ROW: &str = r#"{
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather",
                 "arguments": "{\"unit\": \"c\", \"city\": \"Paris\", \"detail\": true, \"days\": [1, 2]}"}}
            ]},
            {"role": "tool", "content": "{\"temp\": 21}", "tool_call_id": "c1"},
            {"role": "assistant", "content": "21C."}
        ],
        "tools": [
            {"type": "function", "function": {
                "name": "get_weather",
                "description": " Current weather. ",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "unit": {"type": "string", "enum": ["c", "f"]},
                        "city": {"type": "string", "description": "City name", "minLength": 1},
                        "when": {"type": ["string", "null"]}
                    },
                    "required": ["city"],
                    "additionalProperties": false
                }
            }}
        ]
    }"#;

    const TOOL_SYSTEM: &str = "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>get_weather</name>\n<description>Current weather.</description>\n<parameters>\n<parameter>\n<name>unit</name>\n<type>string</type>\n<enum>[\"c\", \"f\"]</enum>\n</parameter>\n<parameter>\n<name>city</name>\n<type>string</type>\n<description>City name</description>\n<minLength>1</minLength>\n</parameter>\n<parameter>\n<name>when</name>\n<type>['string', 'null']</type>\n</parameter>\n<additionalProperties>False</additionalProperties>\n<required>[\"city\"]</required>\n</parameters>\n</function>\n</tools>";

    const TOOL_CALL_TURN: &str = "<|im_start|>assistant\n<think></think>\n<tool_call>\n<function=get_weather>\n<parameter=unit>\nc\n</parameter>\n<parameter=city>\nParis\n</parameter>\n<parameter=detail>\nTrue\n</parameter>\n<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>\n<|im_end|>\n";

    #[test]
    fn renders_tools_tool_calls_and_tool_responses() {
        let c = Conversation::from_row(TOOL_ROW, &RowFields::default()).unwrap();
        // Step 3: the string arguments became an object, in document order.
        let args = c.messages[2].tool_calls.as_ref().unwrap()[0]
            .get("function")
            .and_then(|f| f.get("arguments"))
            .unwrap();
        assert!(matches!(args, Json::Object(e) if e[0].0 == "unit" && e[1].0 == "city"));
        let text = nano3()
            .render(&c.messages, c.tools.as_deref(), false, OFF)
            .unwrap();
        let expected = format!(
            "{TOOL_SYSTEM}{TOOL_INSTRUCTIONS}<|im_end|>\n\
             <|im_start|>user\nWeather in Paris?<|im_end|>\n\
             {TOOL_CALL_TURN}\
             <|im_start|>user\n<tool_response>\n{{\"temp\": 21}}\n</tool_response>\n<|im_end|>\n\
             <|im_start|>assistant\n<think></think>21C.<|im_end|>\n"
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn tools_without_system_message_start_the_system_turn_directly() {
        let tools = vec![Json::parse(r#"{"name": "noop"}"#).unwrap()];
        let text = nano3()
            .render(&[msg(Role::User, "x")], Some(&tools), false, OFF)
            .unwrap();
        assert!(text.starts_with(
            "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n\
             <tools>\n<function>\n<name>noop</name>\n<parameters>\n</parameters>\n</function>\n</tools>\n\n"
        ));
    }

    #[test]
    fn history_tool_call_turn_keeps_only_text_after_thinking() {
        let call = Json::parse(r#"{"function": {"name": "f", "arguments": {}}}"#).unwrap();
        let messages = [
            msg(Role::User, "a"),
            Message {
                tool_calls: Some(vec![call]),
                ..reasoning("Let me look.", "hmm")
            },
            msg(Role::Tool, "r"),
            msg(Role::User, "b"),
        ];
        let text = nano3().render(&messages, None, false, ON).unwrap();
        assert!(text.contains(
            "<|im_start|>assistant\n<think></think>Let me look.\n<tool_call>\n<function=f>\n</function>\n</tool_call>\n<|im_end|>\n"
        ));
    }

    #[test]
    fn python_compatible_filters() {
        let t = ChatTemplate::new(
            "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ true }}|{{ none }}|{{ 1.5e20 }}|{{ 'a\"b' | tojson }}|{{ ' hi '.strip() }}|{{ 'a,b'.split(',') | length }}|{{ m.get('k', 'd') }}",
        )
        .unwrap();
        let env_ctx = minijinja::context! {
            x => Json::parse(r#"{"b": [1, 2.0], "a": {}}"#).unwrap().to_value(),
            m => Json::parse("{}").unwrap().to_value(),
        };
        let tmpl = t.env.get_template(TEMPLATE_NAME).unwrap();
        assert_eq!(
            tmpl.render(env_ctx).unwrap(),
            "{\"b\": [1, 2.0], \"a\": {}}|{\n  \"b\": [\n    1,\n    2.0\n  ],\n  \"a\": {}\n}|True|None|1.5e+20|\"a\\\"b\"|hi|2|d"
        );
        assert_eq!(py_float_repr(1e16), "1e+16");
        assert_eq!(py_float_repr(1e15), "1000000000000000.0");
        assert_eq!(py_float_repr(1.5e-5), "1.5e-05");
        assert_eq!(py_float_repr(0.0001), "0.0001");
    }

    // --- role chunks -----------------------------------------------------------------------

    #[test]
    fn multi_turn_chunks_train_every_assistant_turn() {
        let c = conv(vec![
            msg(Role::System, "S"),
            msg(Role::User, "q1"),
            msg(Role::Assistant, "a1"),
            msg(Role::User, "q2"),
            msg(Role::Assistant, "a2"),
        ]);
        let t = nano3();
        let seqs = role_chunks(&t, &c, &ChatOptions::default()).unwrap();
        assert_eq!(seqs.len(), 1);
        assert_eq!(
            texts(&seqs[0]),
            vec![
                ("system", "<|im_start|>system\nS<|im_end|>\n", false),
                (
                    "user",
                    "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think></think>",
                    false
                ),
                ("assistant", "a1<|im_end|>\n", true),
                (
                    "user",
                    "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think></think>",
                    false
                ),
                ("assistant", "a2<|im_end|>\n", true),
            ]
        );
        let joined: String = seqs[0].iter().map(|c| c.text.as_str()).collect();
        assert_eq!(
            joined,
            t.render(&c.messages, None, false, OFF).unwrap(),
            "chunks cover the full rendering"
        );
    }

    #[test]
    fn first_chunk_is_split_into_system_and_user() {
        let c = conv(vec![msg(Role::User, "q"), msg(Role::Assistant, "a")]);
        let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
        assert_eq!(
            texts(&seqs[0]),
            vec![
                ("system", "<|im_start|>system\n<|im_end|>\n", false),
                (
                    "user",
                    "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think></think>",
                    false
                ),
                ("assistant", "a<|im_end|>\n", true),
            ]
        );
    }

    #[test]
    fn reasoning_conversation_gives_one_sequence_per_user_turn() {
        let c = conv(vec![
            msg(Role::System, "S"),
            msg(Role::User, "q1"),
            reasoning("a1", "r1"),
            msg(Role::User, "q2"),
            reasoning("a2", "r2"),
        ]);
        let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
        assert_eq!(seqs.len(), 2);
        assert_eq!(
            texts(&seqs[0]),
            vec![
                ("system", "<|im_start|>system\nS<|im_end|>\n", false),
                (
                    "user",
                    "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think>\n",
                    false
                ),
                ("assistant", "r1\n</think>\na1<|im_end|>\n", true),
            ]
        );
        // The second sequence holds the first exchange masked (its thinking truncated) and
        // trains only the final answer.
        assert_eq!(
            texts(&seqs[1]),
            vec![
                ("system", "<|im_start|>system\nS<|im_end|>\n", false),
                (
                    "user",
                    "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\n<think></think>\na1<|im_end|>\n\
                     <|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n<think>\n",
                    false
                ),
                ("assistant", "r2\n</think>\na2<|im_end|>\n", true),
            ]
        );
    }

    #[test]
    fn reasoning_sequences_ending_on_a_user_turn_are_skipped() {
        let c = conv(vec![
            msg(Role::User, "q1"),
            msg(Role::User, "q2"),
            reasoning("a", "r"),
            msg(Role::User, "q3"),
        ]);
        let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
        assert_eq!(seqs.len(), 1, "only q2's sequence has an answer");
        assert_eq!(seqs[0].last().unwrap().text, "r\n</think>\na<|im_end|>\n");
        assert!(seqs[0][1].text.contains("q1") && seqs[0][1].text.contains("q2"));
    }

    #[test]
    fn reasoning_turns_after_tools_train_all_final_assistant_spans() {
        let call = Json::parse(r#"{"function": {"name": "f", "arguments": {"x": 1}}}"#).unwrap();
        let c = conv(vec![
            msg(Role::User, "q"),
            Message {
                tool_calls: Some(vec![call]),
                ..reasoning("", "need f")
            },
            msg(Role::Tool, "out"),
            msg(Role::Assistant, "done"), // no reasoning: renders <think></think>
        ]);
        let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
        assert_eq!(
            texts(&seqs[0]),
            vec![
                ("system", "<|im_start|>system\n<|im_end|>\n", false),
                (
                    "user",
                    "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\n",
                    false
                ),
                (
                    "assistant",
                    "need f\n</think>\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>\n<|im_end|>\n",
                    true
                ),
                (
                    "tool",
                    "<|im_start|>user\n<tool_response>\nout\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n<think></think>",
                    false
                ),
                ("assistant", "done<|im_end|>\n", true),
            ]
        );
    }

    #[test]
    fn consecutive_tool_messages_merge_into_one_chunk() {
        let calls = Json::parse(
            r#"[{"function": {"name": "a", "arguments": {}}}, {"function": {"name": "b", "arguments": {}}}]"#,
        )
        .unwrap();
        let Json::Array(calls) = calls else {
            unreachable!()
        };
        let c = conv(vec![
            msg(Role::User, "q"),
            Message {
                tool_calls: Some(calls),
                ..msg(Role::Assistant, "")
            },
            msg(Role::Tool, "A"),
            msg(Role::Tool, "B"),
            msg(Role::Assistant, "ok"),
        ]);
        let seqs = role_chunks(&nano3(), &c, &ChatOptions::default()).unwrap();
        let roles: Vec<&str> = seqs[0].iter().map(|c| c.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "assistant"]);
        assert_eq!(
            seqs[0][3].text,
            "<|im_start|>user\n<tool_response>\nA\n</tool_response>\n<tool_response>\nB\n</tool_response>\n<|im_end|>\n<|im_start|>assistant\n<think></think>"
        );
        assert_eq!(seqs[0][4].text, "ok<|im_end|>\n");
    }

    #[test]
    fn inconsistent_template_is_a_render_mismatch() {
        // Marks the last message, so a prefix rendering is not a prefix of the full one.
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.last %}[END]{% endif %}{% endfor %}",
        )
        .unwrap();
        let c = conv(vec![msg(Role::User, "q"), msg(Role::Assistant, "a")]);
        assert_eq!(
            role_chunks(&t, &c, &ChatOptions::default()),
            Err(DropReason::RenderMismatch { message_index: 0 })
        );
        // A consistent custom template chunks fine.
        let ok = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
        )
        .unwrap();
        let seqs = role_chunks(&ok, &c, &ChatOptions::default()).unwrap();
        assert_eq!(
            texts(&seqs[0]),
            vec![
                ("user", "<user>q<assistant>", false),
                ("assistant", "a", true)
            ]
        );
    }

    // --- records ---------------------------------------------------------------------------

    #[test]
    fn tool_call_text_without_tools_header_drops_the_row() {
        let fields = RowFields::default();
        let bad = r#"{"messages": [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "<tool_call>\n<function=f>\n</function>\n</tool_call>"}]}"#;
        assert_eq!(
            Conversation::from_row(bad, &fields),
            Err(DropReason::ToolCallWithoutToolsHeader)
        );
        let in_reasoning = r#"{"messages": [{"role": "assistant", "content": "x", "reasoning_content": "<tool_call>"}]}"#;
        assert_eq!(
            Conversation::from_row(in_reasoning, &fields),
            Err(DropReason::ToolCallWithoutToolsHeader)
        );
        let good = r##"{"messages": [{"role": "system", "content": "# Tools\nf()"},
            {"role": "assistant", "content": "<tool_call>f</tool_call>"}]}"##;
        assert!(Conversation::from_row(good, &fields).is_ok());

        let mut stats = ChatStats::default();
        let out = process_row(&nano3(), bad, &RowConfig::default(), bytes, &mut stats);
        assert_eq!(out, Err(DropReason::ToolCallWithoutToolsHeader));
        assert_eq!(
            (
                stats.num_input_rows,
                stats.num_filtered,
                stats.num_validation_errors
            ),
            (1, 1, 1)
        );
    }

    #[test]
    fn record_parsing_fields_and_errors() {
        let fields = RowFields {
            messages_field: "conv".into(),
            tools_field: "fns".into(),
        };
        let row = r#"{"conv": [{"role": "user", "content": null, "name": "ann"}], "fns": "[{\"name\": \"f\"}]"}"#;
        let c = Conversation::from_row(row, &fields).unwrap();
        assert_eq!(c.messages[0].content, "");
        assert_eq!(
            c.messages[0].extra,
            vec![("name".into(), Json::String("ann".into()))]
        );
        assert_eq!(c.tools.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            Conversation::from_row(r#"{"conv": []}"#, &fields),
            Err(DropReason::NoMessages)
        );
        assert!(matches!(
            Conversation::from_row(r#"{"conv": [{"role": "robot", "content": "x"}]}"#, &fields),
            Err(DropReason::InvalidRow(_))
        ));
        let bad_args = r#"{"conv": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]}"#;
        assert!(matches!(
            Conversation::from_row(bad_args, &fields),
            Err(DropReason::BadToolArguments(_))
        ));
        // serde: a Conversation deserializes directly too.
        let direct: Conversation =
            serde_json::from_str(r#"{"messages": [{"role": "tool", "content": "r"}]}"#).unwrap();
        assert_eq!(direct.messages[0].role, Role::Tool);
    }

    #[test]
    fn used_in_filter() {
        let list = Json::parse(r#"["nano_v3", "x"]"#).unwrap();
        assert!(matches_used_in(Some(&list), "nano_v3"));
        assert!(matches_used_in(
            Some(&Json::String("a, nano_v3".into())),
            "nano_v3"
        ));
        assert!(!matches_used_in(
            Some(&Json::String("nano_v2".into())),
            "nano_v3"
        ));
        assert!(!matches_used_in(None, "nano_v3"));
        let cfg = RowConfig {
            used_in_filter: Some("nano_v3".into()),
            ..RowConfig::default()
        };
        let mut stats = ChatStats::default();
        let row = r#"{"used_in": ["other"], "messages": [{"role": "user", "content": "q"}]}"#;
        assert_eq!(
            process_row(&nano3(), row, &cfg, bytes, &mut stats),
            Err(DropReason::NotUsedIn)
        );
        assert_eq!((stats.num_filtered, stats.num_errors), (1, 0));
    }

    // --- tokens and masks ------------------------------------------------------------------

    #[test]
    fn mask_is_one_exactly_on_assistant_chunk_tokens() {
        let c = conv(vec![
            msg(Role::User, "q1"),
            msg(Role::Assistant, "a1"),
            msg(Role::User, "q2"),
            msg(Role::Assistant, "a2"),
        ]);
        let t = nano3();
        let chunks = role_chunks(&t, &c, &ChatOptions::default())
            .unwrap()
            .remove(0);
        let (ids, mask) = tokenize_chunks(&chunks, bytes, None);
        let full = t.render(&c.messages, None, false, OFF).unwrap();
        assert_eq!(ids, bytes(&full), "no special tokens, no EOS");
        let trained: String = ids
            .iter()
            .zip(&mask)
            .filter(|(_, m)| **m == 1)
            .map(|(id, _)| char::from(*id as u8))
            .collect();
        assert_eq!(trained, "a1<|im_end|>\na2<|im_end|>\n");
        // The generation prompt (in the user chunk) is not trained.
        let prompt_at = full.find("<|im_start|>assistant").unwrap();
        assert_eq!(mask[prompt_at], 0);

        let (short_ids, short_mask) = tokenize_chunks(&chunks, bytes, Some(10));
        assert_eq!((short_ids.len(), short_mask.len()), (10, 10));
        assert_eq!(short_ids, ids[..10]);
    }

    #[test]
    fn process_row_end_to_end() {
        let mut stats = ChatStats::default();
        let cfg = RowConfig {
            max_doc_tokens: Some(1000),
            ..RowConfig::default()
        };
        let seqs = process_row(&nano3(), TOOL_ROW, &cfg, bytes, &mut stats).unwrap();
        assert_eq!(seqs.len(), 1);
        let (ids, mask) = &seqs[0];
        assert_eq!(ids.len(), 1000);
        assert_eq!(mask.len(), 1000);
        assert!(
            mask.iter().all(|&m| m == 0),
            "the first 1000 bytes are system text"
        );
        assert_eq!(
            (
                stats.num_input_rows,
                stats.num_output_sequences,
                stats.num_truncated
            ),
            (1, 1, 1)
        );

        let full = process_row(&nano3(), TOOL_ROW, &RowConfig::default(), bytes, &mut stats)
            .unwrap()
            .remove(0);
        let trained: Vec<u8> = full
            .0
            .iter()
            .zip(&full.1)
            .filter(|(_, m)| **m == 1)
            .map(|(id, _)| *id as u8)
            .collect();
        let call_body = TOOL_CALL_TURN
            .strip_prefix("<|im_start|>assistant\n<think></think>")
            .unwrap();
        assert_eq!(
            String::from_utf8(trained).unwrap(),
            format!("{call_body}21C.<|im_end|>\n")
        );
    }

    // --- sources ---------------------------------------------------------------------------

    #[test]
    fn template_sources() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("t.jinja");
        std::fs::write(&file, "{{ messages | length }}").unwrap();
        let config = dir.join("tokenizer_config.json");
        std::fs::write(&config, r#"{"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]}"#).unwrap();

        assert_eq!(
            load_template(&TemplateSource::Bundled("nano3".into())).unwrap(),
            NANO3_TEMPLATE
        );
        assert!(load_template(&TemplateSource::Bundled("lightning35".into())).is_err());
        assert_eq!(
            load_template(&TemplateSource::Inline("X".into())).unwrap(),
            "X"
        );
        assert_eq!(
            load_template(&TemplateSource::File(file.clone())).unwrap(),
            "{{ messages | length }}"
        );
        assert_eq!(
            load_template(&TemplateSource::TokenizerConfig(dir.clone())).unwrap(),
            "D"
        );

        assert_eq!(
            TemplateSource::from_param("nano3"),
            TemplateSource::Bundled("nano3".into())
        );
        assert_eq!(
            TemplateSource::from_param(file.to_str().unwrap()),
            TemplateSource::File(file.clone())
        );
        assert_eq!(
            TemplateSource::from_param(config.to_str().unwrap()),
            TemplateSource::TokenizerConfig(config.clone())
        );
        assert_eq!(
            TemplateSource::from_param("{{ x }}"),
            TemplateSource::Inline("{{ x }}".into())
        );

        std::fs::write(&config, r#"{"chat_template": null}"#).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "J").unwrap();
        assert_eq!(
            load_template(&TemplateSource::TokenizerConfig(config)).unwrap(),
            "J"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
