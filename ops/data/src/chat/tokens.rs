//! 5. Tokens and loss mask (step 7)

use super::*;
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
