//! Reading documents from dataset files: the one place that knows the input formats.
//!
//! - `.jsonl` / `.json` / `.ndjson` (JSON Lines): one document per line, its text in a
//!   configurable field (`text` by default). A blank line is skipped.
//! - `.parquet`: one document per row, its text in the same configurable column. Every codec
//!   pyarrow, pandas and Spark write is read (snappy, gzip, lz4, brotli, zstd).
//! - `.txt` / `.md` / any other file: the whole file is one document (a blank file is none).
//! - A directory: every file in it, recursively, in path order (hidden files skipped).
//!
//! Extensions are compared case-insensitively (`corpus.JSONL` is JSON Lines). A compressed
//! file (`.gz`, `.zst`, …) is refused by name rather than read as text.
//!
//! Problems are never silent: a malformed JSON line, a missing or non-string text field, or
//! invalid UTF-8 is an error naming the file and line — or, with [`OnBadRow::Skip`], a skip that
//! is counted and reported in the artifact's metrics.

use serde_json::Value;
use std::path::{Path, PathBuf};

/// What a data op does with a row it cannot use: the one policy every op's `on_bad_row` param
/// deserializes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRow {
    /// Stop with an error naming the file and line (the default).
    #[default]
    Fail,
    /// Skip the row and count it.
    Skip,
}

impl OnBadRow {
    /// A bad row at `at` (`file:line`) for the reason `why`: under `skip`, counted in
    /// `skipped`; under `fail`, the error naming it.
    pub fn bad_row(self, at: &str, why: &str, skipped: &mut u64) -> Result<(), crate::Error> {
        match self {
            OnBadRow::Skip => {
                *skipped += 1;
                Ok(())
            }
            OnBadRow::Fail => Err(crate::Error::new(format!("{at}: {why}"))
                .with_help("set `on_bad_row: skip` to skip and count such rows")),
        }
    }
}

/// One document and where it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Document {
    pub text: String,
    pub file: PathBuf,
    /// 1-based line for JSONL rows; 0 for whole-file documents.
    pub line: usize,
}

/// How a file's documents are read, by its extension (compared case-insensitively).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `.jsonl`, `.json`, `.ndjson`: one document per line.
    JsonLines,
    /// `.parquet`: one document per row.
    Parquet,
    /// Anything else: the whole file is one document.
    Text,
}

impl Format {
    /// The format of `file`. A compressed file is an error: read as text it would be one
    /// document of binary noise.
    pub fn of(file: &Path) -> Result<Format, crate::Error> {
        let ext = file
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("jsonl" | "json" | "ndjson") => Ok(Format::JsonLines),
            Some("parquet") => Ok(Format::Parquet),
            Some(ext) => match decompressor(ext) {
                Some(tool) => Err(crate::Error::new(format!(
                    "{}: a compressed file (.{ext}); nemo-dag reads JSONL, Parquet and text files uncompressed",
                    file.display()
                ))
                .with_help(format!(
                    "decompress it first (`{tool} {}`) and use the result as the input",
                    file.display()
                ))),
                None => Ok(Format::Text),
            },
            None => Ok(Format::Text),
        }
    }
}

/// The command that decompresses files with extension `ext`, for the compressed formats.
fn decompressor(ext: &str) -> Option<&'static str> {
    Some(match ext {
        "gz" | "tgz" | "gzip" => "gunzip -k",
        "bz2" => "bunzip2 -k",
        "xz" | "lzma" => "unxz -k",
        "zst" | "zstd" => "zstd -d",
        "lz4" => "lz4 -d",
        "br" => "brotli -d",
        "zip" => "unzip",
        "7z" => "7z x",
        _ => return None,
    })
}

/// The files of an input (a file, or every file under a directory), sorted by path.
pub fn files_of(path: &Path) -> Result<Vec<PathBuf>, crate::Error> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let mut out = Vec::new();
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))? {
            let entry = entry.map_err(|e| format!("{}: {e}", dir.display()))?;
            if entry.file_name().to_string_lossy().starts_with('.') {
                continue;
            }
            let p = entry.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The lines of a JSON Lines file, numbered from 1, blank ones left out: each line's text
/// (without its `\r\n` or `\n`), or why it is not text (invalid UTF-8, with the byte of the
/// line and the file it starts at).
pub fn json_lines(bytes: &[u8]) -> impl Iterator<Item = (usize, Result<&str, String>)> {
    let mut line_start = 0;
    bytes
        .split(|b| *b == b'\n')
        .enumerate()
        .filter_map(move |(i, raw)| {
            let start = line_start;
            line_start += raw.len() + 1;
            if raw.iter().all(u8::is_ascii_whitespace) {
                return None;
            }
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            let text = std::str::from_utf8(raw).map_err(|e| invalid_utf8(e.valid_up_to(), start));
            Some((i + 1, text))
        })
}

/// Read a file: the bytes, or an error naming the file.
fn read_bytes(file: &Path) -> Result<Vec<u8>, crate::Error> {
    std::fs::read(file).map_err(|e| crate::Error::new(format!("{}: {e}", file.display())))
}

/// The bytes of a file of rows that `op` reads as JSON Lines whatever its extension, for
/// [`json_lines`]; a Parquet or compressed file is an error naming it.
pub fn read_json_lines(file: &Path, op: &str) -> Result<Vec<u8>, crate::Error> {
    if Format::of(file)? == Format::Parquet {
        return Err(crate::Error::new(format!(
            "{}: {op} reads JSON Lines files, not Parquet",
            file.display()
        )));
    }
    read_bytes(file)
}

/// Where invalid UTF-8 starts, as one looks for it: the byte of its line and of the file.
fn invalid_utf8(in_line: usize, line_start: usize) -> String {
    format!(
        "invalid UTF-8 at byte {in_line} of the line (file offset {})",
        line_start + in_line
    )
}

/// A whole file as text, or the error naming the line, and the byte, where its UTF-8 breaks.
fn whole_text(file: &Path, bytes: Vec<u8>) -> Result<String, (String, String)> {
    String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        let before = &e.as_bytes()[..offset];
        let line = 1 + before.iter().filter(|b| **b == b'\n').count();
        let line_start = before
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(0, |i| i + 1);
        (
            format!("{}:{line}", file.display()),
            invalid_utf8(offset - line_start, line_start),
        )
    })
}

/// Counts of rows that were read and skipped.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct ReadStats {
    pub rows: u64,
    pub skipped: u64,
}

/// Call `each` with every document of `file`, in order, stopping after `limit` documents.
pub fn read_documents<E: From<crate::Error>>(
    file: &Path,
    text_field: &str,
    on_bad: OnBadRow,
    limit: Option<u64>,
    stats: &mut ReadStats,
    mut each: impl FnMut(Document) -> Result<(), E>,
) -> Result<(), E> {
    let reached = |stats: &ReadStats| limit.is_some_and(|l| stats.rows >= l);
    let format = Format::of(file)?;
    if format == Format::Parquet {
        return read_parquet(file, text_field, on_bad, limit, stats, each);
    }
    let bytes = read_bytes(file)?;
    if format == Format::Text {
        if reached(stats) {
            return Ok(());
        }
        match whole_text(file, bytes) {
            Ok(text) if text.trim().is_empty() => {}
            Ok(text) => {
                stats.rows += 1;
                each(Document {
                    text,
                    file: file.to_path_buf(),
                    line: 0,
                })?;
            }
            Err((at, why)) => on_bad.bad_row(&at, &why, &mut stats.skipped)?,
        }
        return Ok(());
    }
    for (line, text) in json_lines(&bytes) {
        if reached(stats) {
            break;
        }
        match text.and_then(|t| parse_row(t, text_field)) {
            Ok(text) => {
                stats.rows += 1;
                each(Document {
                    text,
                    file: file.to_path_buf(),
                    line,
                })?;
            }
            Err(why) => {
                let at = format!("{}:{line}", file.display());
                on_bad.bad_row(&at, &why, &mut stats.skipped)?;
            }
        }
    }
    Ok(())
}

fn read_parquet<E: From<crate::Error>>(
    file: &Path,
    text_field: &str,
    on_bad: OnBadRow,
    limit: Option<u64>,
    stats: &mut ReadStats,
    mut each: impl FnMut(Document) -> Result<(), E>,
) -> Result<(), E> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    use parquet::record::Field;
    let at = |e: &dyn std::fmt::Display| crate::Error::new(format!("{}: {e}", file.display()));
    let f = std::fs::File::open(file).map_err(|e| at(&e))?;
    let reader = SerializedFileReader::new(f).map_err(|e| at(&e))?;
    let columns: Vec<String> = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema()
        .get_fields()
        .iter()
        .map(|c| c.name().to_string())
        .collect();
    if !columns.iter().any(|c| c == text_field) {
        return Err(E::from(at(&format!(
            "no column `{text_field}` (columns: {})",
            columns.join(", ")
        ))));
    }
    for (i, row) in reader.get_row_iter(None).map_err(|e| at(&e))?.enumerate() {
        if limit.is_some_and(|l| stats.rows >= l) {
            break;
        }
        let row = row.map_err(|e| at(&e))?;
        let text = row
            .get_column_iter()
            .find(|(name, _)| name.as_str() == text_field)
            .and_then(|(_, v)| match v {
                Field::Str(s) => Some(s.clone()),
                _ => None,
            });
        match text {
            Some(text) => {
                stats.rows += 1;
                each(Document {
                    text,
                    file: file.to_path_buf(),
                    line: i + 1,
                })?;
            }
            None => on_bad.bad_row(
                &format!("{} row {}", file.display(), i + 1),
                &format!("`{text_field}` is null or not a string"),
                &mut stats.skipped,
            )?,
        }
    }
    Ok(())
}

fn parse_row(line: &str, text_field: &str) -> Result<String, String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    match value.get(text_field) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Null) | None => Err(format!("no `{text_field}` field")),
        Some(other) => Err(format!(
            "`{text_field}` is not a string but {}",
            kind(other)
        )),
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str, bytes: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("nemo-dag-text-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    fn read(p: &Path, on_bad: OnBadRow) -> Result<(Vec<String>, ReadStats), String> {
        let mut docs = Vec::new();
        let mut stats = ReadStats::default();
        read_documents::<String>(p, "text", on_bad, None, &mut stats, |d| {
            docs.push(d.text);
            Ok(())
        })?;
        Ok((docs, stats))
    }

    #[test]
    fn jsonl_errors_name_file_and_line_or_are_counted() {
        let p = tmp(
            "a.jsonl",
            b"{\"text\": \"one\"}\n\n{\"txt\": \"x\"}\n{bad\n{\"text\": 5}\n{\"text\": \"two\"}\n",
        );
        let err = read(&p, OnBadRow::Fail).unwrap_err();
        assert!(err.contains("a.jsonl:3: no `text` field"), "{err}");
        let (docs, stats) = read(&p, OnBadRow::Skip).unwrap();
        assert_eq!(docs, vec!["one", "two"]);
        assert_eq!(
            stats,
            ReadStats {
                rows: 2,
                skipped: 3
            }
        );
    }

    #[test]
    fn invalid_utf8_is_an_error() {
        let p = tmp("b.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"\xff\"}\n");
        let err = read(&p, OnBadRow::Fail).unwrap_err();
        // Line 2 starts at file offset 15; the bad byte is the 11th of the line.
        assert!(
            err.contains("b.jsonl:2: invalid UTF-8 at byte 10 of the line (file offset 25)"),
            "{err}"
        );
        let p = tmp("c.txt", b"line one\nab\xffcd");
        let err = read(&p, OnBadRow::Fail).unwrap_err();
        assert!(
            err.contains("c.txt:2: invalid UTF-8 at byte 2 of the line (file offset 11)"),
            "{err}"
        );
    }

    #[test]
    fn parquet_rows_are_documents_and_nulls_are_bad_rows() {
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::writer::SerializedFileWriter;
        let schema = std::sync::Arc::new(
            parquet::schema::parser::parse_message_type(
                "message m { OPTIONAL BINARY text (UTF8); }",
            )
            .unwrap(),
        );
        let p = tmp("f.parquet", b"");
        let mut w = SerializedFileWriter::new(
            std::fs::File::create(&p).unwrap(),
            schema,
            Default::default(),
        )
        .unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values = [ByteArray::from("first doc"), ByteArray::from("third doc")];
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&[1, 0, 1]), None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
        let err = read(&p, OnBadRow::Fail).unwrap_err();
        assert!(err.contains("f.parquet row 2"), "{err}");
        let (docs, stats) = read(&p, OnBadRow::Skip).unwrap();
        assert_eq!(docs, vec!["first doc", "third doc"]);
        assert_eq!(
            stats,
            ReadStats {
                rows: 2,
                skipped: 1
            }
        );
        let mut s = ReadStats::default();
        let e = read_documents::<String>(&p, "body", OnBadRow::Fail, None, &mut s, |_| Ok(()))
            .unwrap_err();
        assert!(e.contains("no column `body` (columns: text)"), "{e}");
    }

    /// A one-column Parquet file of `texts`, compressed with `codec`.
    fn text_parquet(name: &str, texts: &[&str], codec: parquet::basic::Compression) -> PathBuf {
        use parquet::data_type::{ByteArray, ByteArrayType};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        let schema = std::sync::Arc::new(
            parquet::schema::parser::parse_message_type(
                "message m { REQUIRED BINARY text (UTF8); }",
            )
            .unwrap(),
        );
        let props = WriterProperties::builder().set_compression(codec).build();
        let p = tmp(name, b"");
        let mut w = SerializedFileWriter::new(
            std::fs::File::create(&p).unwrap(),
            schema,
            std::sync::Arc::new(props),
        )
        .unwrap();
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = texts.iter().map(|t| ByteArray::from(*t)).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
        w.close().unwrap();
        p
    }

    /// pyarrow and pandas write snappy by default; Spark and others gzip, lz4 or brotli.
    #[test]
    fn parquet_of_every_common_codec_is_read() {
        use parquet::basic::{BrotliLevel, Compression, GzipLevel, ZstdLevel};
        let texts = ["first document", "second — ünïcode 🙂", "third"];
        for (name, codec) in [
            ("none", Compression::UNCOMPRESSED),
            ("snappy", Compression::SNAPPY),
            ("gzip", Compression::GZIP(GzipLevel::default())),
            ("lz4", Compression::LZ4),
            ("lz4_raw", Compression::LZ4_RAW),
            ("brotli", Compression::BROTLI(BrotliLevel::default())),
            ("zstd", Compression::ZSTD(ZstdLevel::default())),
        ] {
            let p = text_parquet(&format!("codec-{name}.parquet"), &texts, codec);
            let (docs, _) = read(&p, OnBadRow::Fail).unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(docs, texts, "{name}");
        }
    }

    #[test]
    fn extensions_are_case_insensitive() {
        let p = tmp("upper.JSONL", b"{\"text\": \"one\"}\n{\"text\": \"two\"}\n");
        assert_eq!(read(&p, OnBadRow::Fail).unwrap().0, vec!["one", "two"]);
        let p = tmp("upper.NDJson", b"{\"text\": \"three\"}\n");
        assert_eq!(read(&p, OnBadRow::Fail).unwrap().0, vec!["three"]);
        let p = text_parquet(
            "upper.PARQUET",
            &["four"],
            parquet::basic::Compression::SNAPPY,
        );
        assert_eq!(read(&p, OnBadRow::Fail).unwrap().0, vec!["four"]);
    }

    #[test]
    fn compressed_files_are_refused_by_name() {
        // A gzip header: read as text it would be one document of binary noise, or an
        // invalid-UTF-8 error that does not say why.
        for name in [
            "corpus.jsonl.gz",
            "corpus.txt.GZ",
            "corpus.jsonl.zst",
            "corpus.bz2",
        ] {
            let p = tmp(name, b"\x1f\x8b\x08\x00\x00\x00\x00\x00");
            let err = read(&p, OnBadRow::Skip).unwrap_err();
            assert!(err.contains(name) && err.contains("compressed"), "{err}");
            assert!(err.contains("decompress"), "{err}");
        }
    }

    #[test]
    fn a_blank_text_file_is_no_document() {
        let p = tmp("blank.txt", b" \n\t\n");
        let (docs, stats) = read(&p, OnBadRow::Fail).unwrap();
        assert!(docs.is_empty(), "{docs:?}");
        assert_eq!(stats, ReadStats::default());
    }

    #[test]
    fn a_text_file_is_one_document_and_limits_apply() {
        let p = tmp("d.txt", b"line one\nline two\n");
        assert_eq!(
            read(&p, OnBadRow::Fail).unwrap().0,
            vec!["line one\nline two\n"]
        );
        let p = tmp(
            "e.jsonl",
            b"{\"text\":\"1\"}\n{\"text\":\"2\"}\n{\"text\":\"3\"}\n",
        );
        let mut stats = ReadStats::default();
        let mut n = 0;
        read_documents::<String>(&p, "text", OnBadRow::Fail, Some(2), &mut stats, |_| {
            n += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!(n, 2);
    }
}
