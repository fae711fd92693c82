//! 1. Templates

use super::*;
/// The bundled `nano3` chat template (Nemotron's `src/nemotron/data_prep/templates/nano3.jinja`).
///
/// ChatML-like turns `<|im_start|>{role}\n…<|im_end|>\n`. The behaviour, as Nemotron's
/// `nano3.jinja` renders it (and its `core/chat_template.py` relies on it):
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

/// The file a `pack` artifact (beside `blend.json`) and a model artifact (beside
/// `tokenizer.json`) keep their chat template in: the text a model's conversations were
/// rendered with, which `export` writes into `tokenizer_config.json`. The name is the one
/// `transformers` saves a template under.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The tokens a chat model's generation stops at: the end of an assistant turn of the
/// ChatML-style templates, and the end of a document. `eval` and `grpo` stop there, and
/// `export` tells transformers' `generate` to.
pub const STOP_TOKENS: [&str; 2] = ["<|im_end|>", "<|endoftext|>"];

/// The names [`TemplateSource::Bundled`] accepts.
pub const BUNDLED_TEMPLATES: &[&str] = &["nano3"];

/// Where a chat template comes from (`_apply_chat_template`: a bundled name, a `.jinja` path or
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
pub fn load_template(src: &TemplateSource) -> Result<String, crate::Error> {
    match src {
        TemplateSource::Bundled(name) => match name.as_str() {
            "nano3" => Ok(NANO3_TEMPLATE.to_string()),
            other => Err(crate::Error::new(format!(
                "unknown bundled chat template {other:?} (bundled: {})",
                BUNDLED_TEMPLATES.join(", ")
            ))),
        },
        TemplateSource::Inline(text) => Ok(text.clone()),
        TemplateSource::File(path) => std::fs::read_to_string(path).map_err(|e| {
            crate::Error::new(format!("cannot read chat template {}: {e}", path.display()))
        }),
        TemplateSource::TokenizerConfig(path) => template_from_tokenizer_config(path),
    }
}

/// `chat_template` of a `tokenizer_config.json`: a string, or a list of `{name, template}`
/// from which `default` is taken (what `transformers` uses when no name is asked for).
/// Newer checkpoints keep the template in a `chat_template.jinja` beside the config instead.
fn template_from_tokenizer_config(path: &Path) -> Result<String, crate::Error> {
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
                crate::Error::new(format!(
                    "{}: chat_template lists several templates but none named \"default\"",
                    config_path.display()
                ))
            })
        }
        Some(serde_json::Value::Null) | None => {
            let sibling = config_path
                .parent()
                .unwrap_or_else(|| Path::new("."))
                .join("chat_template.jinja");
            std::fs::read_to_string(&sibling).map_err(|_| {
                crate::Error::new(format!(
                    "{} has no chat_template and there is no {}",
                    config_path.display(),
                    sibling.display()
                ))
            })
        }
        Some(_) => Err(crate::Error::new(format!(
            "{}: chat_template is neither a string nor a list",
            config_path.display()
        ))),
    }
}
