//! 2. Records: ordered JSON, messages, conversations (steps 1–3)

use super::*;
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
    pub fn parse(text: &str) -> Result<Json, crate::Error> {
        serde_json::from_str(text).map_err(|e| crate::Error::new(e.to_string()))
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

    /// Whether this message carries reasoning (as Nemotron's `create_masked_messages`: a non-empty
    /// `reasoning_content`").
    pub fn has_reasoning(&self) -> bool {
        self.reasoning_content
            .as_deref()
            .is_some_and(|r| !r.is_empty())
    }

    /// Whether the template writes this turn's reasoning as an empty `<think></think>`: it
    /// keeps reasoning only when it is a string that is not blank.
    pub(super) fn reasoning_renders_empty(&self) -> bool {
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
    type Error = crate::Error;

    fn try_from(json: Json) -> Result<Message, crate::Error> {
        let Json::Object(entries) = json else {
            return Err(crate::Error::new("a message must be a JSON object"));
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
                        _ => {
                            return Err(crate::Error::new("message content must be a string"));
                        }
                    }
                }
                "reasoning_content" => {
                    message.reasoning_content = match value {
                        Json::Null => None,
                        Json::String(s) => Some(s),
                        _ => {
                            return Err(crate::Error::new("reasoning_content must be a string"));
                        }
                    }
                }
                "tool_calls" => {
                    message.tool_calls = match value {
                        Json::Null => None,
                        Json::Array(calls) => Some(calls),
                        _ => {
                            return Err(crate::Error::new("tool_calls must be a list"));
                        }
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

/// Which fields of a record hold the messages and the tools (configurable as in Nemotron's
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
        let record = Json::parse(line).map_err(|e| DropReason::InvalidRow(e.message))?;
        Conversation::from_record(&record, fields)
    }

    /// Build a conversation from a parsed record, in Nemotron's order: no messages ⇒
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
            .map_err(|e| DropReason::InvalidRow(e.message))?;
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
