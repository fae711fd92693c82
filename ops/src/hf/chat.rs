//! The files beside the weights that say how to talk to a model: `tokenizer_config.json` (the
//! special tokens and the chat template) and `generation_config.json` (when to stop), as
//! transformers' `save_pretrained` writes them for a `PreTrainedTokenizerFast`.
//!
//! The stop tokens are the ones our `eval` and `grpo` stop generating at: `<|im_end|>`, which
//! ends an assistant turn of the ChatML-style templates, and `<|endoftext|>`, which ends a
//! document. A model with a chat template ends its answers with the first, so that is its
//! `eos_token`; a model without one (pretrained only) ends documents with the second. The pad
//! token is `<|endoftext|>`, as `sft` pads with it. A tokenizer without these tokens gets an
//! explicit `null` rather than a wrong id (left out, transformers' class defaults would fill in
//! ids 1 and 2). Only `input_ids` and `attention_mask` go to the model: no `token_type_ids`,
//! which `generate` would refuse.

use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;

use nemo_dag_data::chat::STOP_TOKENS;

const END_OF_TURN: &str = STOP_TOKENS[0];
const END_OF_TEXT: &str = STOP_TOKENS[1];

/// What to write beside an exported model: its `tokenizer_config.json`, its
/// `generation_config.json`, and the token ids its `config.json` names.
pub struct ChatFiles {
    pub tokenizer_config: Value,
    pub generation_config: Value,
    /// `eos_token_id` and `pad_token_id`, for `config.json` (transformers reads the generation
    /// defaults from there when `generation_config.json` is absent).
    pub config_ids: Map<String, Value>,
}

/// The files for a model with `tokenizer`, trained with `chat_template` (if any), on
/// sequences of at most `max_seq` tokens.
pub fn files(tokenizer: &Tokenizer, chat_template: Option<&str>, max_seq: usize) -> ChatFiles {
    let has = |t: &str| tokenizer.token_to_id(t).is_some();
    let eos = if chat_template.is_some() && has(END_OF_TURN) {
        Some(END_OF_TURN)
    } else {
        [END_OF_TEXT, END_OF_TURN].into_iter().find(|t| has(t))
    };
    let pad = has(END_OF_TEXT).then_some(END_OF_TEXT);
    let stops: Vec<u32> = STOP_TOKENS
        .iter()
        .filter_map(|t| tokenizer.token_to_id(t))
        .collect();
    let pad_id = pad.and_then(|t| tokenizer.token_to_id(t));

    let mut tokenizer_config = Map::new();
    tokenizer_config.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
    tokenizer_config.insert("bos_token".into(), Value::Null);
    tokenizer_config.insert("eos_token".into(), json!(eos));
    tokenizer_config.insert("pad_token".into(), json!(pad));
    tokenizer_config.insert("unk_token".into(), Value::Null);
    tokenizer_config.insert("clean_up_tokenization_spaces".into(), json!(false));
    tokenizer_config.insert("model_max_length".into(), json!(max_seq));
    tokenizer_config.insert(
        "model_input_names".into(),
        json!(["input_ids", "attention_mask"]),
    );
    if let Some(template) = chat_template {
        tokenizer_config.insert("chat_template".into(), json!(template));
    }

    let eos_ids = match stops.as_slice() {
        [one] => json!(one),
        many => json!(many),
    };
    let mut config_ids = Map::new();
    config_ids.insert("bos_token_id".into(), Value::Null);
    config_ids.insert(
        "eos_token_id".into(),
        if stops.is_empty() {
            Value::Null
        } else {
            eos_ids
        },
    );
    config_ids.insert("pad_token_id".into(), json!(pad_id));
    let generation_config = config_ids.clone();
    ChatFiles {
        tokenizer_config: Value::Object(tokenizer_config),
        generation_config: Value::Object(generation_config),
        config_ids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::wordlevel::WordLevel;

    fn tokenizer(words: &[&str]) -> Tokenizer {
        let vocab = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), i as u32))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("a".into())
            .build()
            .unwrap();
        Tokenizer::new(model)
    }

    #[test]
    fn a_chat_model_ends_its_turn_and_stops_at_either_end() {
        let t = tokenizer(&["a", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]);
        let f = files(&t, Some("{{ messages }}"), 512);
        assert_eq!(f.tokenizer_config["eos_token"], "<|im_end|>");
        assert_eq!(f.tokenizer_config["pad_token"], "<|endoftext|>");
        assert_eq!(f.tokenizer_config["chat_template"], "{{ messages }}");
        assert_eq!(f.tokenizer_config["model_max_length"], 512);
        assert_eq!(f.generation_config["eos_token_id"], json!([3, 1]));
        assert_eq!(f.generation_config["pad_token_id"], 1);
        assert_eq!(f.config_ids["eos_token_id"], json!([3, 1]));
    }

    #[test]
    fn a_model_without_a_template_ends_documents_and_names_only_tokens_it_has() {
        let t = tokenizer(&["a", "<|endoftext|>", "<|im_end|>"]);
        let f = files(&t, None, 64);
        assert_eq!(f.tokenizer_config["eos_token"], "<|endoftext|>");
        assert!(f.tokenizer_config.get("chat_template").is_none());

        let bare = tokenizer(&["a", "b"]);
        let f = files(&bare, Some("t"), 64);
        assert_eq!(f.tokenizer_config["eos_token"], Value::Null);
        assert_eq!(f.tokenizer_config["pad_token"], Value::Null);
        assert_eq!(f.generation_config["eos_token_id"], Value::Null);
        assert_eq!(f.config_ids["pad_token_id"], Value::Null);
        assert_eq!(f.config_ids["bos_token_id"], Value::Null);
    }
}
