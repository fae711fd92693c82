//! A fast encoder for byte-level BPE `tokenizer.json`s (GPT-2's family), the one `tokenize`
//! uses when it can, with the `tokenizers` crate as the fallback and the reference.
//!
//! This module owns reading such a `tokenizer.json` and deciding whether it is a configuration
//! reproduced here exactly ([`FastBpe::from_json`] says `Unsupported` with the reason
//! otherwise), and encoding text to the ids `tokenizers::Tokenizer::encode(text, false)` gives.
//! Supported, exactly as the library does it:
//!
//! - **model**: `BPE` with a vocabulary holding all 256 byte-level characters, merges as
//!   `"a b"` strings or `["a", "b"]` pairs, no dropout, no subword prefix/suffix,
//!   `ignore_merges` either way. (`unk_token` and `byte_fallback` are accepted because with
//!   every byte in the vocabulary they never apply.)
//! - **normalizer**: none.
//! - **pre-tokenizer**: `ByteLevel` (`add_prefix_space` either way, `use_regex` either way; the
//!   GPT-2 regex is hand-written in [`pretokenize`]), or a `Sequence` of a `Split` on a regex
//!   (behaviour `Isolated`, not inverted; run with `fancy-regex` as the library does) and a
//!   `ByteLevel` without regex or prefix space, as Llama-3-style tokenizers have.
//! - **added tokens**: split out first as the library does — leftmost-longest match of the
//!   non-normalized tokens on the text, then of the normalized ones on what is left — for
//!   tokens without `single_word`/`lstrip`/`rstrip`.
//! - **post-processor**: anything that adds nothing when special tokens are not added (none,
//!   `ByteLevel`, `TemplateProcessing`, `BertProcessing`, `RobertaProcessing`, a `Sequence` of
//!   them); no truncation, no padding.
//!
//! Speed comes from encoding on bytes (a word is a byte range of the text; its byte-level
//! characters are never built), a per-thread word → ids cache keyed by the word's bytes, and
//! merges by rank over a small vector (the library's heap algorithm for long words).

mod pretokenize;
#[cfg(test)]
mod tests;

pub use pretokenize::{LongWord, split_between_words};

use serde_json::Value;
use std::cell::RefCell;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

type Hasher = ahash::RandomState;

/// Why a `tokenizer.json` is left to the `tokenizers` crate.
#[derive(Debug, Clone, PartialEq)]
pub struct Unsupported(pub String);

impl std::fmt::Display for Unsupported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn unsupported<T>(why: impl Into<String>) -> Result<T, Unsupported> {
    Err(Unsupported(why.into()))
}

/// How a piece of text (between added tokens) is split into words.
enum Split {
    /// GPT-2's regex ([`pretokenize`]).
    Gpt2,
    /// The whole piece is one word (`ByteLevel` with `use_regex: false`).
    Whole,
    /// A `Split` regex, matches and the text between them each a word.
    Regex(Box<fancy_regex::Regex>),
}

/// Leftmost-longest matching of a set of added tokens, as the library's Aho-Corasick does.
struct AddedMatcher {
    /// Tokens by first byte, longest first.
    by_first: HashMap<u8, Vec<(Vec<u8>, u32)>>,
    first: [bool; 256],
}

impl Default for AddedMatcher {
    fn default() -> Self {
        AddedMatcher {
            by_first: HashMap::new(),
            first: [false; 256],
        }
    }
}

impl AddedMatcher {
    fn add(&mut self, content: &str, id: u32) {
        let bytes = content.as_bytes().to_vec();
        self.first[bytes[0] as usize] = true;
        let list = self.by_first.entry(bytes[0]).or_default();
        list.push((bytes, id));
        list.sort_by_key(|t| std::cmp::Reverse(t.0.len()));
    }

    fn is_empty(&self) -> bool {
        self.by_first.is_empty()
    }

    /// Calls `text` for the non-empty pieces between matches and `token` for each match, in
    /// order.
    fn split<E>(
        &self,
        s: &str,
        mut text: impl FnMut(&str) -> Result<(), E>,
        mut token: impl FnMut(u32),
    ) -> Result<(), E> {
        if self.is_empty() {
            return if s.is_empty() { Ok(()) } else { text(s) };
        }
        let bytes = s.as_bytes();
        let mut start = 0;
        let mut i = 0;
        while i < bytes.len() {
            if self.first[bytes[i] as usize] {
                let found = self.by_first.get(&bytes[i]).and_then(|list| {
                    list.iter()
                        .find(|(pat, _)| bytes[i..].starts_with(pat))
                        .map(|(pat, id)| (pat.len(), *id))
                });
                if let Some((len, id)) = found {
                    if start < i {
                        text(&s[start..i])?;
                    }
                    token(id);
                    i += len;
                    start = i;
                    continue;
                }
            }
            i += 1;
        }
        if start < bytes.len() {
            text(&s[start..])?;
        }
        Ok(())
    }
}

/// A byte-level BPE encoder that gives the same ids as the `tokenizers` crate for the
/// configurations it accepts.
pub struct FastBpe {
    /// Identifies this encoder's entries in the per-thread caches.
    id: u64,
    /// Each byte's byte-level character, and its id.
    byte_chars: [char; 256],
    byte_ids: [u32; 256],
    /// `(left << 32 | right)` → `(rank, merged id)`.
    merges: HashMap<u64, (u32, u32), Hasher>,
    /// With `ignore_merges`: the vocabulary, to take a whole word that is a token as it is.
    whole_words: Option<HashMap<String, u32, Hasher>>,
    split: Split,
    add_prefix_space: bool,
    /// Added tokens matched on the raw text, then those matched on the normalized text.
    added_raw: AddedMatcher,
    added_normalized: AddedMatcher,
}

/// GPT-2's byte → character table (`bytes_to_unicode`): printable bytes map to themselves, the
/// others to U+0100 onwards in byte order.
fn byte_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\0')
        };
    }
    table
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn get<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key).unwrap_or(&Value::Null)
}

fn flag(v: &Value, key: &str, default: bool) -> Result<bool, Unsupported> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => unsupported(format!("`{key}` is {other}, not a boolean")),
    }
}

fn type_of(v: &Value) -> &str {
    get(v, "type").as_str().unwrap_or("")
}

impl FastBpe {
    /// Reads a `tokenizer.json`; `Unsupported` says why it is not a configuration this encoder
    /// reproduces exactly.
    pub fn from_json(json: &str) -> Result<FastBpe, Unsupported> {
        let v: Value = serde_json::from_str(json)
            .map_err(|e| Unsupported(format!("not a tokenizer.json: {e}")))?;
        if !pretokenize::tables_available() {
            return unsupported("the Unicode class tables could not be built");
        }
        for key in ["truncation", "padding", "normalizer"] {
            if !get(&v, key).is_null() {
                return unsupported(format!("has a {key}"));
            }
        }
        check_post_processor(get(&v, "post_processor"))?;
        let (split, add_prefix_space) = pre_tokenizer(get(&v, "pre_tokenizer"))?;

        let model = get(&v, "model");
        if type_of(model) != "BPE" {
            return unsupported(format!("model `{}` is not BPE", type_of(model)));
        }
        match get(model, "dropout") {
            Value::Null => {}
            d if d.as_f64() == Some(0.0) => {}
            d => return unsupported(format!("BPE dropout {d}")),
        }
        for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
            match get(model, key) {
                Value::Null => {}
                Value::String(s) if s.is_empty() => {}
                other => return unsupported(format!("BPE {key} {other}")),
            }
        }
        let ignore_merges = flag(model, "ignore_merges", false)?;
        let vocab: HashMap<String, u32, Hasher> = match get(model, "vocab") {
            Value::Object(map) => map
                .iter()
                .map(
                    |(k, id)| match id.as_u64().and_then(|i| u32::try_from(i).ok()) {
                        Some(id) => Ok((k.clone(), id)),
                        None => unsupported(format!("vocab id of `{k}` is {id}")),
                    },
                )
                .collect::<Result<_, _>>()?,
            _ => return unsupported("BPE vocab is not an object"),
        };
        let chars = byte_chars();
        let mut byte_ids = [0u32; 256];
        for (b, c) in chars.iter().enumerate() {
            match vocab.get(c.to_string().as_str()) {
                Some(id) => byte_ids[b] = *id,
                None => {
                    return unsupported(format!("byte {b:#04x} ({c}) is not in the vocabulary"));
                }
            }
        }

        let pairs: Vec<(String, String)> = match get(model, "merges") {
            Value::Array(list) => {
                let mut pairs = Vec::with_capacity(list.len());
                for m in list {
                    match m {
                        Value::String(line) if line.starts_with("#version") => {}
                        Value::String(line) => match line.split(' ').collect::<Vec<_>>()[..] {
                            [a, b] => pairs.push((a.to_string(), b.to_string())),
                            _ => return unsupported(format!("bad merge `{line}`")),
                        },
                        Value::Array(ab) => match &ab[..] {
                            [Value::String(a), Value::String(b)] => {
                                pairs.push((a.clone(), b.clone()))
                            }
                            _ => return unsupported(format!("bad merge {m}")),
                        },
                        _ => return unsupported(format!("bad merge {m}")),
                    }
                }
                pairs
            }
            _ => return unsupported("BPE merges are not a list"),
        };
        let mut merges = HashMap::with_capacity_and_hasher(pairs.len(), Hasher::default());
        for (rank, (a, b)) in pairs.iter().enumerate() {
            let id = |t: &str| {
                vocab.get(t).copied().ok_or_else(|| {
                    Unsupported(format!("merge part `{t}` is not in the vocabulary"))
                })
            };
            let new_id = id(&format!("{a}{b}"))?;
            merges.insert(pair_key(id(a)?, id(b)?), (rank as u32, new_id));
        }

        let (added_raw, added_normalized) = added_tokens(get(&v, "added_tokens"), &vocab)?;
        Ok(FastBpe {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            byte_chars: chars,
            byte_ids,
            merges,
            whole_words: ignore_merges.then_some(vocab),
            split,
            add_prefix_space,
            added_raw,
            added_normalized,
        })
    }

    /// The ids of `text`, as `Tokenizer::encode(text, false)` gives them.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 1);
        self.encode_into(text, &mut ids)?;
        Ok(ids)
    }

    /// Appends the ids of `text` to `out`. Fails only where the library fails too: a `Split`
    /// regex that gives up (backtracking limit).
    pub fn encode_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        CACHE.with(|cache| {
            let mut cache = cache.borrow_mut();
            if cache.owner != self.id {
                *cache = WordCache::new(self.id);
            }
            let cache = &mut *cache;
            // Both passes push tokens to `out`; a RefCell lets the two closures share it.
            let out = RefCell::new(out);
            self.added_raw.split(
                text,
                |piece| {
                    self.added_normalized.split(
                        piece,
                        |piece| self.encode_piece(piece, cache, &mut out.borrow_mut()),
                        |id| out.borrow_mut().push(id),
                    )
                },
                |id| out.borrow_mut().push(id),
            )
        })
    }

    /// Encodes a non-empty piece of text that holds no added token.
    fn encode_piece(
        &self,
        piece: &str,
        cache: &mut WordCache,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        let spaced;
        let piece = if self.add_prefix_space && !piece.starts_with(' ') {
            spaced = format!(" {piece}");
            spaced.as_str()
        } else {
            piece
        };
        match &self.split {
            Split::Gpt2 => {
                pretokenize::for_each_word(piece, |w| self.encode_word(w.as_bytes(), cache, out))
            }
            Split::Whole => self.encode_word(piece.as_bytes(), cache, out),
            Split::Regex(re) => {
                let mut prev = 0;
                for m in re.find_iter(piece) {
                    let m = m.map_err(|e| format!("pre-tokenizer regex failed: {e}"))?;
                    if prev < m.start() {
                        self.encode_word(&piece.as_bytes()[prev..m.start()], cache, out);
                    }
                    if m.start() < m.end() {
                        self.encode_word(&piece.as_bytes()[m.start()..m.end()], cache, out);
                    }
                    prev = m.end();
                }
                if prev < piece.len() {
                    self.encode_word(&piece.as_bytes()[prev..], cache, out);
                }
            }
        }
        Ok(())
    }

    #[inline]
    fn encode_word(&self, word: &[u8], cache: &mut WordCache, out: &mut Vec<u32>) {
        if let Some(&(start, len)) = cache.words.get(word) {
            out.extend_from_slice(&cache.ids[start as usize..(start + len) as usize]);
            return;
        }
        let from = out.len();
        self.merge_word(word, out);
        cache.insert(word, &out[from..]);
    }

    /// BPE on one word's bytes, appending the ids to `out`.
    fn merge_word(&self, word: &[u8], out: &mut Vec<u32>) {
        if let Some(vocab) = &self.whole_words {
            let s: String = word.iter().map(|b| self.byte_chars[*b as usize]).collect();
            if let Some(id) = vocab.get(&s) {
                out.push(*id);
                return;
            }
        }
        let mut symbols: Vec<u32> = word.iter().map(|b| self.byte_ids[*b as usize]).collect();
        if symbols.len() > 64 {
            self.merge_long(&mut symbols);
        } else {
            self.merge_short(&mut symbols);
        }
        out.extend_from_slice(&symbols);
    }

    /// Repeatedly merges the lowest-ranked adjacent pair (the leftmost on ties) — the order in
    /// which the library's heap merges.
    fn merge_short(&self, symbols: &mut Vec<u32>) {
        // ranks[i]: the merge of symbols[i] and symbols[i + 1], if any.
        let mut ranks: Vec<Option<(u32, u32)>> = symbols
            .windows(2)
            .map(|w| self.merges.get(&pair_key(w[0], w[1])).copied())
            .collect();
        loop {
            let mut best: Option<(usize, u32, u32)> = None;
            for (i, r) in ranks.iter().enumerate() {
                if let Some((rank, new_id)) = *r
                    && best.is_none_or(|b| rank < b.1)
                {
                    best = Some((i, rank, new_id));
                }
            }
            let Some((i, _, new_id)) = best else { break };
            symbols[i] = new_id;
            symbols.remove(i + 1);
            ranks.remove(i);
            if i > 0 {
                ranks[i - 1] = self.merges.get(&pair_key(symbols[i - 1], new_id)).copied();
            }
            if i + 1 < symbols.len() {
                ranks[i] = self.merges.get(&pair_key(new_id, symbols[i + 1])).copied();
            }
        }
    }

    /// The library's algorithm (`Word::merge_all`): a min-heap of (rank, position) with stale
    /// entries skipped; O(n log n) for long words.
    fn merge_long(&self, symbols: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        struct Sym {
            c: u32,
            prev: usize,
            next: usize,
            alive: bool,
        }
        let n = symbols.len();
        let mut syms: Vec<Sym> = symbols
            .iter()
            .enumerate()
            .map(|(i, c)| Sym {
                c: *c,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == n { NONE } else { i + 1 },
                alive: true,
            })
            .collect();
        let mut heap: BinaryHeap<std::cmp::Reverse<(u32, usize, u32)>> = symbols
            .windows(2)
            .enumerate()
            .filter_map(|(i, w)| {
                self.merges
                    .get(&pair_key(w[0], w[1]))
                    .map(|&(rank, new_id)| std::cmp::Reverse((rank, i, new_id)))
            })
            .collect();
        while let Some(std::cmp::Reverse((_, pos, new_id))) = heap.pop() {
            if !syms[pos].alive || syms[pos].next == NONE {
                continue;
            }
            let right = syms[pos].next;
            match self.merges.get(&pair_key(syms[pos].c, syms[right].c)) {
                Some(&(_, id)) if id == new_id => {}
                _ => continue,
            }
            syms[pos].c = new_id;
            syms[pos].next = syms[right].next;
            syms[right].alive = false;
            let next = syms[pos].next;
            if next != NONE {
                syms[next].prev = pos;
            }
            let prev = syms[pos].prev;
            if prev != NONE
                && let Some(&(rank, id)) = self.merges.get(&pair_key(syms[prev].c, new_id))
            {
                heap.push(std::cmp::Reverse((rank, prev, id)));
            }
            if next != NONE
                && let Some(&(rank, id)) = self.merges.get(&pair_key(new_id, syms[next].c))
            {
                heap.push(std::cmp::Reverse((rank, pos, id)));
            }
        }
        symbols.clear();
        symbols.extend(syms.iter().filter(|s| s.alive).map(|s| s.c));
    }
}

#[inline]
fn pair_key(a: u32, b: u32) -> u64 {
    (u64::from(a) << 32) | u64::from(b)
}

fn check_post_processor(p: &Value) -> Result<(), Unsupported> {
    match type_of(p) {
        _ if p.is_null() => Ok(()),
        // These add special tokens only when asked to, and tokenize never asks.
        "ByteLevel" | "TemplateProcessing" | "BertProcessing" | "RobertaProcessing" => Ok(()),
        "Sequence" => match get(p, "processors") {
            Value::Array(list) => list.iter().try_for_each(check_post_processor),
            _ => unsupported("post-processor Sequence without processors"),
        },
        other => unsupported(format!("post-processor `{other}`")),
    }
}

/// The word split and `add_prefix_space` of a supported pre-tokenizer.
fn pre_tokenizer(p: &Value) -> Result<(Split, bool), Unsupported> {
    match type_of(p) {
        "ByteLevel" => {
            let split = if flag(p, "use_regex", true)? {
                Split::Gpt2
            } else {
                Split::Whole
            };
            Ok((split, flag(p, "add_prefix_space", true)?))
        }
        "Sequence" => {
            let list = get(p, "pretokenizers").as_array().map(Vec::as_slice);
            let Some([split, byte_level]) = list else {
                return unsupported("pre-tokenizer Sequence other than [Split, ByteLevel]");
            };
            if type_of(split) != "Split"
                || get(split, "behavior").as_str() != Some("Isolated")
                || flag(split, "invert", false)?
            {
                return unsupported("pre-tokenizer Sequence: the Split is not an Isolated split");
            }
            let Some(pattern) = get(get(split, "pattern"), "Regex").as_str() else {
                return unsupported("pre-tokenizer Sequence: the Split pattern is not a regex");
            };
            if type_of(byte_level) != "ByteLevel"
                || flag(byte_level, "use_regex", true)?
                || flag(byte_level, "add_prefix_space", true)?
            {
                return unsupported(
                    "pre-tokenizer Sequence: the ByteLevel has use_regex or add_prefix_space",
                );
            }
            let re = fancy_regex::Regex::new(pattern)
                .map_err(|e| Unsupported(format!("Split regex: {e}")))?;
            Ok((Split::Regex(Box::new(re)), false))
        }
        _ if p.is_null() => unsupported("no pre-tokenizer"),
        other => unsupported(format!("pre-tokenizer `{other}`")),
    }
}

/// The added tokens' matchers (non-normalized, normalized), with the ids the library assigns
/// when it loads the file; a file whose ids differ from those is left to the library.
fn added_tokens(
    list: &Value,
    vocab: &HashMap<String, u32, Hasher>,
) -> Result<(AddedMatcher, AddedMatcher), Unsupported> {
    let mut raw = AddedMatcher::default();
    let mut normalized = AddedMatcher::default();
    let Value::Array(list) = list else {
        return if list.is_null() {
            Ok((raw, normalized))
        } else {
            unsupported("added_tokens is not a list")
        };
    };
    let mut next_id = vocab.len() as u64;
    let mut seen = std::collections::HashSet::new();
    for t in list {
        let content = get(t, "content").as_str().unwrap_or("");
        if content.is_empty() {
            continue;
        }
        for key in ["single_word", "lstrip", "rstrip"] {
            if flag(t, key, false)? {
                return unsupported(format!("added token `{content}` has {key}"));
            }
        }
        if !seen.insert(content.to_string()) {
            return unsupported(format!("added token `{content}` appears twice"));
        }
        let id = match vocab.get(content) {
            Some(id) => u64::from(*id),
            None => {
                next_id += 1;
                next_id - 1
            }
        };
        if get(t, "id").as_u64() != Some(id) {
            return unsupported(format!(
                "added token `{content}` has id {} but would be loaded as {id}",
                get(t, "id")
            ));
        }
        let id = u32::try_from(id).map_err(|_| Unsupported(format!("added token id {id}")))?;
        // Without a normalizer a normalized token is matched as it is written.
        let Some(normalized_flag) = get(t, "normalized").as_bool() else {
            return unsupported(format!("added token `{content}` has no `normalized` flag"));
        };
        if normalized_flag {
            normalized.add(content, id);
        } else {
            raw.add(content, id);
        }
    }
    Ok((raw, normalized))
}

/// Per-thread word → ids cache of one encoder.
struct WordCache {
    owner: u64,
    words: HashMap<Box<[u8]>, (u32, u32), Hasher>,
    /// The ids of all cached words, back to back.
    ids: Vec<u32>,
}

/// Words longer than this are not cached (the library's limit too), nor more than this many.
const MAX_CACHED_WORD: usize = 256;
const MAX_CACHED_WORDS: usize = 1 << 20;

impl WordCache {
    fn new(owner: u64) -> Self {
        WordCache {
            owner,
            words: HashMap::default(),
            ids: Vec::new(),
        }
    }

    fn insert(&mut self, word: &[u8], ids: &[u32]) {
        if word.len() >= MAX_CACHED_WORD || self.words.len() >= MAX_CACHED_WORDS {
            return;
        }
        let start = self.ids.len() as u32;
        self.ids.extend_from_slice(ids);
        self.words.insert(word.into(), (start, ids.len() as u32));
    }
}

thread_local! {
    static CACHE: RefCell<WordCache> = RefCell::new(WordCache::new(0));
}
