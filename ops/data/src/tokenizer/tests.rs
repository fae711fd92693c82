//! [`FastBpe`] against the `tokenizers` crate, id for id, on tokenizers trained here the way
//! `train_tokenizer` trains them (and variants of their `tokenizer.json`).

use super::pretokenize::{Class, ascii_class, class_of};
use super::*;
use std::str::FromStr;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, NormalizerWrapper, Tokenizer, TokenizerBuilder};

const SPECIALS: [&str; 5] = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
];

/// Varied text: prose, contractions, numbers, whitespace runs, scripts, symbols, special tokens.
fn corpus() -> Vec<String> {
    let mut texts: Vec<String> = [
        "",
        " ",
        "  ",
        "\n",
        "\n\n",
        "a",
        "Hello, world! This is a test of the tokenizer.",
        "It's what they're saying: we've, I'm, you'll, he'd, don't.",
        "IT'S LOUD, THEY'RE 'S 'T 'RE 'VE 'M 'LL 'D ''s 's's 'x' ' s",
        "can't won't 'tis o'clock rock 'n' roll",
        "Numbers: 1 12 123 1234 3.14159 1,000,000 2026-11-23 0x1F 1e-9 ½ ² Ⅻ ٣٤ १२३",
        "Punctuation runs: !!! ??? ... --- *** ((())) [[ ]] {} <> // \\\\ @#$%^&*",
        "multiple   spaces    here     and\ttabs\t\there  \t  mixed",
        "lines\nand\n\nparagraphs\n\n\nend\n",
        "trailing spaces   ",
        "spaces before newline   \n   next line",
        " leading space",
        "   leading spaces",
        "\r\nwindows\r\nlines\r\n",
        "naïve café über résumé déjà vu Ærø Łódź",
        "combining: e\u{301} a\u{308} n\u{303} o\u{302}\u{323}",
        "CJK: 北京 東京 한국어 日本語のテキスト 中文，标点。",
        "Arabic: مرحبا بالعالم ١٢٣ and Hebrew: שלום",
        "Devanagari: नमस्ते दुनिया, Thai: สวัสดีครับ",
        "emoji 🙂🙂 👍🏽 👨‍👩‍👧 🇫🇷 and symbols ™ © ® ° ± × ÷ → ∞ ≠ €100 £5 ¥",
        "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𐍈 astral letters and digits",
        "unicode spaces:\u{a0}nbsp\u{2003}em\u{3000}ideographic\u{2028}ls\u{85}nel\u{200b}zwsp",
        "controls \u{0}\u{1}\u{1c}\u{1f}\u{7f} end",
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\nIt is 4.\n</think>\n4<|im_end|>",
        "<|endoftext|>",
        "text<|endoftext|>more text <|endoftext|> <|endoftext|><|endoftext|>",
        "<|im_start <|im_end| <|endoftext <| |> <think </think",
        "code: fn main() { println!(\"{}\", x + 1); } // comment\n    indented();",
        "url https://example.com/path?q=1&r=two#frag and email a.b@c.de",
        "a'b a’b a‘b “quoted” «guillemets» „low“",
        "x  y   z\t\tw \n v \n\n u",
        "ends with apostrophe'",
        "'",
        "''",
        "' '",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    texts.push("a".repeat(300));
    texts.push("ab".repeat(150));
    texts.push("1234567890".repeat(30));
    texts.push(" ".repeat(200) + "x");
    texts.push("the ".repeat(100));
    texts.push("Supercalifragilisticexpialidocious".repeat(5));
    texts
}

/// Training text: the corpus plus some English, so that merges are deep.
fn training_docs() -> Vec<String> {
    let mut docs = corpus();
    for i in 0..300 {
        docs.push(format!(
            "To be, or not to be: that is the question {i}. Whether 'tis nobler in the mind to \
             suffer the slings and arrows of outrageous fortune, or to take arms against a sea of \
             troubles. It's {} o'clock; they're here, we've got {i}.{} ½ — naïve café 北京 🙂",
            i * 7,
            i % 13
        ));
    }
    docs
}

/// A byte-level BPE trained as `train_tokenizer` trains one.
fn train(vocab: usize, add_prefix_space: bool) -> Tokenizer {
    train_on(&training_docs(), vocab, add_prefix_space)
}

/// A byte-level BPE trained on `docs` as `train_tokenizer` trains one.
fn train_on<S: AsRef<str> + Send + Sync>(
    docs: &[S],
    vocab: usize,
    add_prefix_space: bool,
) -> Tokenizer {
    let specials: Vec<AddedToken> = SPECIALS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(specials)
        .build();
    let byte_level = ByteLevel::new(add_prefix_space, true, true);
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel>::new()
            .with_model(BPE::default())
            .with_normalizer(None)
            .with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level))
            .build()
            .unwrap();
    tokenizer.train(&mut trainer, docs.iter()).unwrap();
    Tokenizer::from(tokenizer)
}

fn json_of(tok: &Tokenizer) -> Value {
    serde_json::from_str(&tok.to_string(false).unwrap()).unwrap()
}

/// The library and the fast encoder, both loaded from `json`.
fn both(json: &Value) -> (Tokenizer, FastBpe) {
    let text = json.to_string();
    let lib = Tokenizer::from_str(&text).unwrap();
    let fast = FastBpe::from_json(&text).unwrap();
    (lib, fast)
}

fn assert_same(lib: &Tokenizer, fast: &FastBpe, texts: &[String], what: &str) {
    for t in texts {
        let want = lib.encode(t.as_str(), false).unwrap().get_ids().to_vec();
        // Twice: the second time from the word cache.
        for _ in 0..2 {
            let got = fast.encode(t).unwrap();
            assert_eq!(got, want, "{what}: {t:?}");
        }
    }
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Random strings over a mixed alphabet (pieces of words, whitespace of every kind, digits,
/// apostrophes, scripts, astral characters, special-token fragments).
fn random_texts(n: usize, seed: u64) -> Vec<String> {
    let alphabet = [
        "a",
        "b",
        "e",
        "s",
        "t",
        "r",
        "v",
        "m",
        "l",
        "d",
        "S",
        "T",
        "RE",
        "the",
        "and",
        "ing",
        "0",
        "1",
        "42",
        "3.14",
        "½",
        "²",
        "٣",
        "Ⅻ",
        " ",
        " ",
        " ",
        "  ",
        "\t",
        "\n",
        "\n\n",
        "\r\n",
        "\u{a0}",
        "\u{3000}",
        "\u{2028}",
        "\u{85}",
        "\u{b}",
        "\u{c}",
        "\u{1c}",
        "'",
        "'s",
        "'re",
        "'ll",
        "'d",
        "'ve",
        "'m",
        "'t",
        "’",
        ".",
        ",",
        "!",
        "?",
        "-",
        "—",
        "(",
        ")",
        "$",
        "_",
        "é",
        "e\u{301}",
        "ü",
        "ß",
        "北",
        "京",
        "한",
        "ا",
        "ل",
        "न",
        "\u{94d}",
        "🙂",
        "👍🏽",
        "\u{200d}",
        "𝔘",
        "𝟙",
        "𐍈",
        "\u{0}",
        "<",
        "|",
        ">",
        "<|",
        "|>",
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<think>",
        "<|im",
    ];
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| {
            let len = rng.below(40);
            (0..len)
                .map(|_| alphabet[rng.below(alphabet.len())])
                .collect()
        })
        .collect()
}

#[test]
fn ascii_classes_match_the_unicode_tables() {
    for b in 0..128u8 {
        assert_eq!(ascii_class(b), class_of(char::from(b)), "byte {b:#04x}");
    }
    // \p{L} is not char::is_alphabetic (which includes e.g. combining marks and Roman numerals).
    assert_eq!(class_of('\u{301}'), Class::Other);
    assert_eq!(class_of('Ⅻ'), Class::Number);
    assert_eq!(class_of('𝔘'), Class::Letter);
    assert_eq!(class_of('𝟙'), Class::Number);
    assert_eq!(class_of('\u{3000}'), Class::Space);
    assert_eq!(class_of('\u{200b}'), Class::Other);
}

#[test]
fn trained_tokenizer_encodes_like_the_library() {
    let (lib, fast) = both(&json_of(&train(1000, false)));
    assert_same(&lib, &fast, &corpus(), "trained");
    assert_same(&lib, &fast, &training_docs()[..50], "training docs");
}

#[test]
fn random_strings_encode_like_the_library() {
    let (lib, fast) = both(&json_of(&train(1000, false)));
    assert_same(&lib, &fast, &random_texts(5000, 7), "random");
}

#[test]
fn prefix_space_and_added_tokens_encode_like_the_library() {
    let mut tok = train(800, true);
    // Non-special (normalized) added tokens, matched after the special ones, one of them
    // overlapping a special token and one not in the vocabulary.
    tok.add_tokens([
        AddedToken::from("<|im", false),
        AddedToken::from(" the", false),
        AddedToken::from("zebra crossing", false),
    ])
    .unwrap();
    let (lib, fast) = both(&json_of(&tok));
    assert_same(&lib, &fast, &corpus(), "prefix space");
    assert_same(&lib, &fast, &random_texts(2000, 11), "prefix space, random");
}

#[test]
fn ignore_merges_and_string_merges_encode_like_the_library() {
    let mut json = json_of(&train(1000, false));
    json["model"]["ignore_merges"] = Value::Bool(true);
    let merges: Vec<Value> = json["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            Value::String(format!(
                "{} {}",
                m[0].as_str().unwrap(),
                m[1].as_str().unwrap()
            ))
        })
        .collect();
    json["model"]["merges"] = Value::Array(merges);
    let (lib, fast) = both(&json);
    assert_same(&lib, &fast, &corpus(), "ignore_merges");
    assert_same(
        &lib,
        &fast,
        &random_texts(2000, 13),
        "ignore_merges, random",
    );
}

#[test]
fn split_regex_sequence_encodes_like_the_library() {
    // Llama-3's pre-tokenizer: a GPT-4-style Split, then ByteLevel without its own regex.
    let mut json = json_of(&train(1000, false));
    json["pre_tokenizer"] = serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
             "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]
    });
    let (lib, fast) = both(&json);
    assert_same(&lib, &fast, &corpus(), "split regex");
    assert_same(&lib, &fast, &random_texts(2000, 17), "split regex, random");
}

#[test]
fn byte_level_without_regex_encodes_like_the_library() {
    let mut json = json_of(&train(600, false));
    json["pre_tokenizer"]["use_regex"] = Value::Bool(false);
    let (lib, fast) = both(&json);
    assert_same(&lib, &fast, &corpus(), "no regex");
}

#[test]
fn configurations_it_does_not_reproduce_are_unsupported() {
    let base = json_of(&train(400, false));
    let refuse = |edit: &dyn Fn(&mut Value), why: &str| {
        let mut json = base.clone();
        edit(&mut json);
        let err = FastBpe::from_json(&json.to_string()).err();
        assert!(
            err.as_ref().is_some_and(|e| e.0.contains(why)),
            "{why}: {err:?}"
        );
    };
    refuse(
        &|j| j["normalizer"] = serde_json::json!({"type": "NFC"}),
        "normalizer",
    );
    refuse(
        &|j| j["model"]["dropout"] = serde_json::json!(0.1),
        "dropout",
    );
    refuse(
        &|j| j["model"]["continuing_subword_prefix"] = serde_json::json!("##"),
        "continuing_subword_prefix",
    );
    refuse(
        &|j| j["added_tokens"][0]["lstrip"] = Value::Bool(true),
        "lstrip",
    );
    refuse(
        &|j| j["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"}),
        "Whitespace",
    );
    refuse(
        &|j| j["post_processor"] = serde_json::json!({"type": "Custom"}),
        "Custom",
    );
    refuse(
        &|j| j["truncation"] = serde_json::json!({"max_length": 8}),
        "truncation",
    );
    refuse(
        &|j| j["model"]["type"] = serde_json::json!("WordPiece"),
        "not BPE",
    );
    refuse(
        &|j| {
            let vocab = j["model"]["vocab"].as_object_mut().unwrap();
            vocab.remove("Ġ");
        },
        "not in the vocabulary",
    );
    assert!(FastBpe::from_json("not json").is_err());
}

#[test]
fn encoders_share_threads_without_mixing_caches() {
    let (lib_a, a) = both(&json_of(&train(500, false)));
    let (lib_b, b) = both(&json_of(&train(900, true)));
    for t in corpus() {
        assert_eq!(
            a.encode(&t).unwrap(),
            lib_a.encode(t.as_str(), false).unwrap().get_ids()
        );
        assert_eq!(
            b.encode(&t).unwrap(),
            lib_b.encode(t.as_str(), false).unwrap().get_ids()
        );
    }
}

/// GPT-2's split, word by word, against the library's `ByteLevel` pre-tokenizer (the encoding
/// tests alone would miss a split the merges happen not to cross).
#[test]
fn gpt2_words_match_the_library_pre_tokenizer() {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let byte_level = ByteLevel::new(false, true, true);
    let mut texts = corpus();
    texts.extend(random_texts(20_000, 23));
    for t in &texts {
        let mut pre = PreTokenizedString::from(t.as_str());
        byte_level.pre_tokenize(&mut pre).unwrap();
        let want: Vec<&str> = pre
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (start, end), _)| &t[start..end])
            .collect();
        let mut got = Vec::new();
        super::pretokenize::for_each_word(t, |w| got.push(w));
        assert_eq!(got, want, "{t:?}");
    }
}

/// The library's `ByteLevel` words of `text`.
fn library_words(text: &str) -> Vec<String> {
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
    let mut pre = PreTokenizedString::from(text);
    ByteLevel::new(false, true, true)
        .pre_tokenize(&mut pre)
        .unwrap();
    pre.get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, (start, end), _)| text[start..end].to_string())
        .collect()
}

/// Cut between GPT-2 words, a long text's pieces have exactly its words by the library's own
/// pre-tokenizer (a cut after whitespace, or inside a word, would change them), so a
/// trainer fed the pieces learns the same tokenizer.
#[test]
fn pieces_cut_between_words_have_the_words_of_the_whole() {
    let mut texts = corpus();
    texts.extend(random_texts(2_000, 29));
    let whole = texts.join("");
    let want = library_words(&whole);
    for piece_bytes in [1, 2, 5, 16, 100, 4096] {
        let pieces = split_between_words(&whole, piece_bytes, usize::MAX).unwrap();
        assert_eq!(pieces.concat(), whole);
        let got: Vec<String> = pieces.iter().flat_map(|p| library_words(p)).collect();
        if let Some(i) = (0..got.len().min(want.len())).find(|i| got[*i] != want[*i]) {
            let lo = i.saturating_sub(3);
            panic!(
                "pieces of at most {piece_bytes} bytes: got {:?}, want {:?}",
                &got[lo..(i + 3).min(got.len())],
                &want[lo..(i + 3).min(want.len())]
            );
        }
        assert_eq!(got, want, "pieces of at most {piece_bytes} bytes");
        // A piece is longer than asked only where no cut is possible: within a word, or a
        // whitespace run and the word after it.
        let mut uncuttable = vec![0];
        for w in &want {
            *uncuttable.last_mut().unwrap() += w.len();
            if !w.ends_with(char::is_whitespace) {
                uncuttable.push(0);
            }
        }
        let longest = uncuttable.into_iter().max().unwrap();
        assert!(
            pieces.iter().all(|p| p.len() <= piece_bytes.max(longest)),
            "{piece_bytes}"
        );
    }
    let trained = |docs: &[&str]| train_on(docs, 600, false).to_string(false).unwrap();
    let pieces = split_between_words(&whole, 64, usize::MAX).unwrap();
    assert!(pieces.len() > 100);
    assert_eq!(trained(&pieces), trained(&[whole.as_str()]));
}

#[test]
fn a_word_longer_than_allowed_is_an_error_saying_where() {
    let text = format!("short words {} then more", "x".repeat(50));
    assert_eq!(
        split_between_words(&text, 8, 49),
        Err(LongWord { start: 11, len: 51 })
    );
    assert_eq!(split_between_words(&text, 8, 51).unwrap().concat(), text);
    assert_eq!(
        split_between_words("tiny", 8, 2),
        Err(LongWord { start: 0, len: 4 })
    );
}
