//! SFT chat data: chat templates, role chunks and loss masks.
//!
//! This module turns one chat record (a JSONL row with a list of OpenAI-style messages and
//! optional tool definitions) into token sequences with a per-token loss mask, the way
//! Nemotron's SFT data preparation does before packing (NVIDIA-NeMo/Nemotron
//! `src/nemotron/data_prep/core/chat_template.py` and `core/chat_sft_shard_core.py`; "step N"
//! below is docs/parity.md, "SFT data", step N). Packing, Parquet and splits (steps 8–13)
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
//! One file per step, in that order: `template`, `record`, `render`, `chunks`, `tokens`, `row`;
//! their public items are re-exported here, and the imports below are shared by all of them.
//!
//! Nemotron does not use Megatron-Bridge's `{% generation %}`-based masking for nano3
//! (Megatron-Bridge's `_chat_preprocess`); it uses the incremental-render chunker reproduced here.

use minijinja::value::{Enumerator, Kwargs, Object, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::ser::{SerializeMap, SerializeSeq, Serializer};
use serde::{Deserialize, Serialize};
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod chunks;
mod record;
mod render;
mod row;
mod template;
#[cfg(test)]
mod tests;
mod tokens;

pub use chunks::*;
pub use record::*;
pub use render::*;
pub use row::*;
pub use template::*;
pub use tokens::*;
