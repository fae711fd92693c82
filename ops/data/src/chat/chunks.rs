//! 4. Role chunks (steps 5–6)

use super::*;
/// A piece of rendered text spoken by one role; `trained` is true for assistant chunks, the
/// only ones the loss sees (Nemotron `_tokenize_chunks_with_mask`).
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

impl DropReason {
    /// Whether the row itself is malformed (not JSON, not an object, no or ill-typed
    /// messages, tool arguments that are not JSON, a template that cannot render it), as
    /// opposed to a well-formed row that a rule drops (the `used_in` filter, Nemotron's
    /// tool-call validation, a template whose renders are not prefixes of each other). A
    /// caller decides what to do with the first kind (`pack`'s `on_bad_row`); the second is
    /// only counted, as Nemotron counts it.
    pub fn is_malformed(&self) -> bool {
        match self {
            DropReason::NoMessages
            | DropReason::InvalidRow(_)
            | DropReason::BadToolArguments(_)
            | DropReason::Render(_) => true,
            DropReason::NotUsedIn
            | DropReason::ToolCallWithoutToolsHeader
            | DropReason::RenderMismatch { .. } => false,
        }
    }
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
