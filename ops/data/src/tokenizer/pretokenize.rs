//! GPT-2's pre-tokenization regex, hand-written:
//!
//! ```text
//! 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//! ```
//!
//! The character classes are taken from `regex-syntax`, the same Unicode tables the `regex`
//! crate (and through it `fancy-regex`, which `tokenizers` uses) matches `\p{L}`, `\p{N}` and
//! `\s` with, so a character is a letter here exactly when it is one for the library's regex.
//! The alternation is leftmost-first, so at each position the scanner tries the alternatives in
//! the pattern's order.

use std::sync::LazyLock;

/// Which of the pattern's classes a character is in (the three are disjoint).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(crate) enum Class {
    /// `\p{L}`
    Letter = 0,
    /// `\p{N}`
    Number = 1,
    /// `\s`
    Space = 2,
    /// `[^\s\p{L}\p{N}]`
    Other = 3,
}

struct Tables {
    /// The class of every Basic Multilingual Plane character, by code point.
    bmp: Vec<Class>,
    /// Sorted, disjoint ranges of the classes above the BMP (everything else is `Other`).
    astral: Vec<(u32, u32, Class)>,
}

/// `None` if `regex-syntax` could not give the class (it always can for these patterns).
fn ranges(pattern: &str) -> Option<Vec<(u32, u32)>> {
    use regex_syntax::hir::{Class as HirClass, HirKind};
    let hir = regex_syntax::Parser::new().parse(pattern).ok()?;
    match hir.kind() {
        HirKind::Class(HirClass::Unicode(c)) => Some(
            c.ranges()
                .iter()
                .map(|r| (r.start() as u32, r.end() as u32))
                .collect(),
        ),
        _ => None,
    }
}

static TABLES: LazyLock<Option<Tables>> = LazyLock::new(|| {
    let mut bmp = vec![Class::Other; 0x1_0000];
    let mut astral = Vec::new();
    for (pattern, class) in [
        (r"\p{L}", Class::Letter),
        (r"\p{N}", Class::Number),
        (r"\s", Class::Space),
    ] {
        for (lo, hi) in ranges(pattern)? {
            for cp in lo..=hi.min(0xFFFF) {
                bmp[cp as usize] = class;
            }
            if hi > 0xFFFF {
                astral.push((lo.max(0x1_0000), hi, class));
            }
        }
    }
    astral.sort_unstable_by_key(|r| r.0);
    Some(Tables { bmp, astral })
});

/// Whether the Unicode tables could be built (checked once when an encoder is loaded).
pub(crate) fn tables_available() -> bool {
    TABLES.is_some()
}

/// The class of a character.
#[inline]
pub(crate) fn class_of(c: char) -> Class {
    let cp = c as u32;
    let Some(t) = TABLES.as_ref() else {
        return Class::Other;
    };
    if cp < 0x1_0000 {
        return t.bmp[cp as usize];
    }
    match t.astral.binary_search_by(|r| {
        if r.1 < cp {
            std::cmp::Ordering::Less
        } else if r.0 > cp {
            std::cmp::Ordering::Greater
        } else {
            std::cmp::Ordering::Equal
        }
    }) {
        Ok(i) => t.astral[i].2,
        Err(_) => Class::Other,
    }
}

/// The class and UTF-8 length of the character starting at byte `i` of `s`.
#[inline]
fn char_at(s: &str, i: usize) -> (Class, usize) {
    let b = s.as_bytes()[i];
    if b < 0x80 {
        return (ASCII[b as usize], 1);
    }
    match s[i..].chars().next() {
        Some(c) => (class_of(c), c.len_utf8()),
        None => (Class::Other, 1),
    }
}

/// ASCII classes, fixed (and checked against the tables in the tests).
static ASCII: [Class; 128] = {
    let mut t = [Class::Other; 128];
    let mut i = 0;
    while i < 128 {
        let c = i as u8;
        t[i] = if c.is_ascii_alphabetic() {
            Class::Letter
        } else if c.is_ascii_digit() {
            Class::Number
        } else if matches!(c, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r') {
            Class::Space
        } else {
            Class::Other
        };
        i += 1;
    }
    t
};

#[cfg(test)]
pub(crate) fn ascii_class(b: u8) -> Class {
    ASCII[b as usize]
}

/// The end of the run of `class` characters starting at byte `i`.
#[inline]
fn run_end(s: &str, mut i: usize, class: Class) -> usize {
    let bytes = s.as_bytes();
    while i < bytes.len() {
        let b = bytes[i];
        if b < 0x80 {
            if ASCII[b as usize] != class {
                break;
            }
            i += 1;
        } else {
            let (c, len) = char_at(s, i);
            if c != class {
                break;
            }
            i += len;
        }
    }
    i
}

/// The end of the regex match that starts at byte `p` (`p < s.len()`). Every character is in
/// one of the classes, so the matches tile the string and the next one starts here.
#[inline]
fn match_end(s: &str, p: usize) -> usize {
    let bytes = s.as_bytes();
    let (class, len) = char_at(s, p);
    // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive)
    if bytes[p] == b'\'' {
        if let Some(b"re" | b"ve" | b"ll") = bytes.get(p + 1..p + 3) {
            return p + 3;
        }
        if let Some(b's' | b't' | b'm' | b'd') = bytes.get(p + 1) {
            return p + 2;
        }
    }
    if class != Class::Space {
        // \p{L}+ | \p{N}+ | [^\s\p{L}\p{N}]+
        return run_end(s, p + len, class);
    }
    if bytes[p] == b' ' && p + 1 < bytes.len() {
        // ' ?X+' with the space: a space then a run of one non-space class.
        let (next, next_len) = char_at(s, p + 1);
        if next != Class::Space {
            return run_end(s, p + 1 + next_len, next);
        }
    }
    // \s+(?!\S) | \s+ : a whitespace run followed by a non-space keeps its last character for
    // the next match, unless the run is that one character.
    let end = run_end(s, p + len, Class::Space);
    if end == bytes.len() || end == p + len {
        return end;
    }
    let mut last = end - 1;
    while !s.is_char_boundary(last) {
        last -= 1;
    }
    last
}

/// Calls `f` with every word (non-empty, consecutive, covering `s`) of GPT-2's split of `s`.
#[inline]
pub(crate) fn for_each_word<'a>(s: &'a str, mut f: impl FnMut(&'a str)) {
    let mut p = 0;
    while p < s.len() {
        let end = match_end(s, p);
        f(&s[p..end]);
        p = end;
    }
}

/// A stretch of text that [`split_between_words`] cannot cut and that is longer than a caller
/// allows: where it starts and its length, in bytes. It is one word of GPT-2's split, with the
/// whitespace before it if there is more than one character of that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LongWord {
    pub start: usize,
    pub len: usize,
}

/// `text` cut into consecutive pieces of at most `piece_bytes` bytes (longer only where no cut
/// is possible), so that the pieces split into exactly the words of the whole by GPT-2's split:
/// a BPE trainer fed the pieces counts the same words, and learns the same merges, while it
/// pre-tokenizes only a piece at a time. A stretch that cannot be cut longer than
/// `max_word_bytes` is an error.
///
/// Where a cut is safe: after a word that does not end in whitespace. No alternative of the
/// pattern looks behind, so the words after the cut are the whole text's; and the words before
/// it end the same at the end of a piece, since a letter, number or other run, or a
/// contraction, ends where its class does. A cut after whitespace is not safe: `\s+(?!\S)`
/// gives a run's last character to the next word only when a non-space follows the run, which
/// at the end of a piece none does.
pub fn split_between_words(
    text: &str,
    piece_bytes: usize,
    max_word_bytes: usize,
) -> Result<Vec<&str>, LongWord> {
    if text.len() <= piece_bytes.min(max_word_bytes) || !tables_available() {
        return Ok(vec![text]);
    }
    let mut pieces = Vec::new();
    // The current piece starts at `start`; `cut` is its last safe cut so far.
    let (mut start, mut cut, mut p) = (0, 0, 0);
    let mut cut_at = |end: usize, cut: &mut usize| -> Result<(), LongWord> {
        if end - *cut > max_word_bytes {
            return Err(LongWord {
                start: *cut,
                len: end - *cut,
            });
        }
        if end - start > piece_bytes && *cut > start {
            pieces.push(&text[start..*cut]);
            start = *cut;
        }
        *cut = end;
        Ok(())
    };
    while p < text.len() {
        let end = match_end(text, p);
        if !ends_in_space(&text[p..end]) {
            cut_at(end, &mut cut)?;
        }
        p = end;
    }
    if cut < text.len() {
        cut_at(text.len(), &mut cut)?;
    }
    pieces.push(&text[start..]);
    Ok(pieces)
}

/// Whether a word's last character is whitespace.
fn ends_in_space(word: &str) -> bool {
    word.chars()
        .next_back()
        .is_some_and(|c| class_of(c) == Class::Space)
}
