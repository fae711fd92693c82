//! Megatron-LM's indexed dataset: the `.bin` + `.idx` pair ("MMIDIDX", version 1).
//!
//! A dataset is named by a *prefix* `P` (what `--data-path` takes): `P.bin` holds every
//! sequence's token ids back to back (no header, no separators) in one dtype, little-endian;
//! `P.idx` holds, all little-endian:
//!
//! ```text
//! offset  size  field
//! 0       9     magic  "MMIDIDX\0\0"
//! 9       8     version, u64 = 1
//! 17      1     dtype code, u8 (see DType)
//! 18      8     N = sequence count, u64
//! 26      8     D = document-index length, u64 (= documents + 1)
//! 34      4·N   sequence lengths, i32 (tokens)
//! 34+4N   8·N   sequence pointers, i64 (byte offset in .bin = running sum of lengths × itemsize)
//! 34+12N  8·D   document index, i64: 0, then the sequence count after each document
//! ```
//!
//! Document `d` is sequences `index[d] .. index[d+1]`. Multimodal indexes (an extra i8 per
//! sequence after the document index) are not supported.
//!
//! Spec: megatron-core 0.16.1's `megatron/core/datasets/indexed_dataset.py` (`_IndexWriter`,
//! `IndexedDataset`, `DType`) and Megatron-LM's `tools/preprocess_data.py`; the byte layout
//! and a worked example are in docs/parity.md, "Megatron .bin/.idx".
//!
//! Unix only: the reader uses positioned reads so it can be shared between threads.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The 9 bytes every `.idx` starts with.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only index version Megatron reads or writes.
pub const VERSION: u64 = 1;
/// Size of the fixed `.idx` header: magic, version, dtype code, N, D.
pub const HEADER_LEN: u64 = 34;

/// Element type of the token ids in `.bin`, with Megatron's numeric codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    U8,
    I8,
    I16,
    I32,
    I64,
    F32,
    F64,
    U16,
}

impl DType {
    pub const ALL: [DType; 8] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F64,
        DType::F32,
        DType::U16,
    ];

    /// Megatron's code for this dtype (the byte at offset 17 of the `.idx`).
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// numpy's name for the dtype, for messages.
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::U16 => "uint16",
        }
    }

    /// Append `token` to `out` in this dtype, or `None` if it cannot be stored exactly.
    fn encode(self, token: u32, out: &mut Vec<u8>) -> Option<()> {
        match self {
            DType::U8 => out.extend(u8::try_from(token).ok()?.to_le_bytes()),
            DType::I8 => out.extend(i8::try_from(token).ok()?.to_le_bytes()),
            DType::I16 => out.extend(i16::try_from(token).ok()?.to_le_bytes()),
            DType::U16 => out.extend(u16::try_from(token).ok()?.to_le_bytes()),
            DType::I32 => out.extend(i32::try_from(token).ok()?.to_le_bytes()),
            DType::I64 => out.extend(i64::from(token).to_le_bytes()),
            DType::F32 => {
                // float32 holds every integer up to 2^24 exactly, and not all above it.
                if token > 1 << 24 {
                    return None;
                }
                out.extend((token as f32).to_le_bytes())
            }
            DType::F64 => out.extend(f64::from(token).to_le_bytes()),
        }
        Some(())
    }

    /// Read one element (`bytes.len() == self.size()`) as a token id, or `None` if it is
    /// negative, fractional or too large for a `u32`.
    fn decode(self, bytes: &[u8]) -> Option<u32> {
        fn float(x: f64) -> Option<u32> {
            (x.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&x)).then_some(x as u32)
        }
        match self {
            DType::U8 => Some(u32::from(bytes[0])),
            DType::I8 => u32::try_from(i8::from_le_bytes(bytes.try_into().ok()?)).ok(),
            DType::I16 => u32::try_from(i16::from_le_bytes(bytes.try_into().ok()?)).ok(),
            DType::U16 => Some(u32::from(u16::from_le_bytes(bytes.try_into().ok()?))),
            DType::I32 => u32::try_from(i32::from_le_bytes(bytes.try_into().ok()?)).ok(),
            DType::I64 => u32::try_from(i64::from_le_bytes(bytes.try_into().ok()?)).ok(),
            DType::F32 => float(f64::from(f32::from_le_bytes(bytes.try_into().ok()?))),
            DType::F64 => float(f64::from_le_bytes(bytes.try_into().ok()?)),
        }
    }
}

/// The token dtype Megatron-LM's `tools/preprocess_data.py` picks for a vocabulary
/// (`DType.optimal_dtype`): **uint16 when `vocab_size < 65_500`, int32 otherwise**.
///
/// `vocab_size` is the full vocabulary including added tokens (`len(tokenizer)` for a
/// Hugging Face tokenizer): GPT-2's 50,257 → uint16, Llama-3's 128,256 → int32. The margin
/// below 65,536 is Megatron's; `GPTDatasetConfig` uses a different cut-off (int32 only above
/// 65,536) on a fast path, and between the two the tools disagree — we follow
/// `preprocess_data.py`, which is what writes the files.
pub fn smallest_for_vocab(vocab_size: usize) -> DType {
    if vocab_size < 65_500 {
        DType::U16
    } else {
        DType::I32
    }
}

/// `P.bin`, `P.idx`, ...: the prefix with a suffix appended (a prefix may contain dots).
fn path_with(prefix: &Path, suffix: &str) -> PathBuf {
    let mut s = OsString::from(prefix.as_os_str());
    s.push(suffix);
    PathBuf::from(s)
}

/// The data file of a dataset prefix.
pub fn bin_path(prefix: &Path) -> PathBuf {
    path_with(prefix, ".bin")
}

/// The index file of a dataset prefix.
pub fn idx_path(prefix: &Path) -> PathBuf {
    path_with(prefix, ".idx")
}

fn invalid_data(path: &Path, what: impl std::fmt::Display) -> crate::Error {
    crate::Error::new(format!("{}: {what}", path.display()))
}

fn with_path(path: &Path, e: io::Error) -> crate::Error {
    crate::Error::new(format!("{}: {e}", path.display()))
}

/// Make finished renames durable; best effort (not every filesystem allows it).
fn sync_dir_of(path: &Path) {
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// What [`IndexedWriter::finish`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    /// Token ids in `.bin`.
    pub tokens: u64,
    /// Sequences (`N` in the header).
    pub sequences: u64,
    /// Documents (`D - 1` in the header), empty ones included.
    pub documents: u64,
}

/// Writes a dataset one document at a time, document-level like `preprocess_data.py`
/// without `--split-sentences`: each non-empty document is one sequence.
///
/// Tokens go to `P.bin.tmp` as they come; [`finish`](Self::finish) writes `P.idx.tmp` and
/// renames `.bin` first, `.idx` last. `create` deletes any old `P.idx` up front, so at every
/// moment of a crash either no `P.idx` exists or the pair is complete and consistent.
/// Dropping an unfinished writer removes its temporary files.
pub struct IndexedWriter {
    prefix: PathBuf,
    dtype: DType,
    bin: Option<BufWriter<File>>,
    lengths: Vec<i32>,
    document_indices: Vec<i64>,
    tokens: u64,
    buf: Vec<u8>,
}

impl IndexedWriter {
    /// Start a dataset at `prefix` (files `prefix.bin` and `prefix.idx`), replacing any
    /// existing one.
    pub fn create(prefix: &Path, dtype: DType) -> crate::Result<IndexedWriter> {
        let idx = idx_path(prefix);
        match fs::remove_file(&idx) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                return Err(with_path(&idx, e));
            }
            _ => {}
        }
        let tmp = path_with(prefix, ".bin.tmp");
        let bin = File::create(&tmp).map_err(|e| with_path(&tmp, e))?;
        Ok(IndexedWriter {
            prefix: prefix.to_path_buf(),
            dtype,
            bin: Some(BufWriter::new(bin)),
            lengths: Vec::new(),
            document_indices: vec![0],
            tokens: 0,
            buf: Vec::new(),
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Append one document as one sequence. An empty document adds no sequence but still
    /// counts as a document (its document-index entry repeats the previous one), as in
    /// Megatron; callers that want empty documents skipped must skip them.
    ///
    /// Fails, writing nothing, if a token does not fit the dtype (e.g. ≥ 65,536 for uint16).
    pub fn add_document(&mut self, tokens: &[u32]) -> crate::Result<()> {
        let bin_tmp = path_with(&self.prefix, ".bin.tmp");
        let Some(bin) = self.bin.as_mut() else {
            return Err(crate::Error::new(format!(
                "{}: writer failed earlier",
                bin_tmp.display()
            )));
        };
        if !tokens.is_empty() {
            let len = i32::try_from(tokens.len()).map_err(|_| {
                invalid_data(
                    &bin_tmp,
                    format!("document of {} tokens exceeds i32 lengths", tokens.len()),
                )
            })?;
            self.buf.clear();
            for (i, &t) in tokens.iter().enumerate() {
                if self.dtype.encode(t, &mut self.buf).is_none() {
                    return Err(crate::Error::new(format!(
                        "{}: token {t} at position {i} of document {} does not fit dtype {}",
                        bin_tmp.display(),
                        self.document_indices.len() - 1,
                        self.dtype.name()
                    )));
                }
            }
            if let Err(e) = bin.write_all(&self.buf) {
                // The .bin may now hold a partial sequence: refuse further use.
                self.bin = None;
                return Err(with_path(&bin_tmp, e));
            }
            self.lengths.push(len);
            self.tokens += tokens.len() as u64;
        }
        self.document_indices.push(self.lengths.len() as i64);
        Ok(())
    }

    /// Write the index and publish both files under their final names.
    pub fn finish(mut self) -> crate::Result<Summary> {
        let bin_tmp = path_with(&self.prefix, ".bin.tmp");
        let idx_tmp = path_with(&self.prefix, ".idx.tmp");
        let Some(bin) = self.bin.take() else {
            return Err(crate::Error::new(format!(
                "{}: writer failed earlier",
                bin_tmp.display()
            )));
        };
        let bin = bin
            .into_inner()
            .map_err(|e| with_path(&bin_tmp, e.into_error()))?;
        bin.sync_all().map_err(|e| with_path(&bin_tmp, e))?;
        drop(bin);

        let n = self.lengths.len();
        let mut idx = Vec::with_capacity(HEADER_LEN as usize + 12 * n + 8 * (n + 1));
        idx.extend_from_slice(MAGIC);
        idx.extend(VERSION.to_le_bytes());
        idx.push(self.dtype.code());
        idx.extend((n as u64).to_le_bytes());
        idx.extend((self.document_indices.len() as u64).to_le_bytes());
        for len in &self.lengths {
            idx.extend(len.to_le_bytes());
        }
        let mut pointer: i64 = 0;
        for &len in &self.lengths {
            idx.extend(pointer.to_le_bytes());
            pointer += i64::from(len) * self.dtype.size() as i64;
        }
        for d in &self.document_indices {
            idx.extend(d.to_le_bytes());
        }
        let mut f = File::create(&idx_tmp).map_err(|e| with_path(&idx_tmp, e))?;
        f.write_all(&idx).map_err(|e| with_path(&idx_tmp, e))?;
        f.sync_all().map_err(|e| with_path(&idx_tmp, e))?;
        drop(f);

        let (bin_final, idx_final) = (bin_path(&self.prefix), idx_path(&self.prefix));
        fs::rename(&bin_tmp, &bin_final).map_err(|e| with_path(&bin_final, e))?;
        sync_dir_of(&bin_final);
        fs::rename(&idx_tmp, &idx_final).map_err(|e| with_path(&idx_final, e))?;
        sync_dir_of(&idx_final);
        Ok(Summary {
            tokens: self.tokens,
            sequences: n as u64,
            documents: self.document_indices.len() as u64 - 1,
        })
    }
}

impl Drop for IndexedWriter {
    fn drop(&mut self) {
        // After a successful finish the temporaries are gone already; this cleans up after
        // an abandoned or failed writer.
        let _ = fs::remove_file(path_with(&self.prefix, ".bin.tmp"));
        let _ = fs::remove_file(path_with(&self.prefix, ".idx.tmp"));
    }
}

/// A validated dataset: the index in memory, the tokens read from `.bin` on demand.
///
/// `open` checks more than Megatron does (it checks only magic, version and the last
/// document-index entry): the exact `.idx` size, non-negative lengths, pointers equal to the
/// running byte offsets, a document index that starts at 0, never decreases and ends at `N`,
/// and a `.bin` of exactly `Σ lengths × itemsize` bytes.
#[derive(Debug)]
pub struct IndexedReader {
    bin_path: PathBuf,
    bin: File,
    dtype: DType,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    document_indices: Vec<i64>,
}

/// Little-endian cursor over the `.idx` bytes; callers check the total size first.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const K: usize>(&mut self) -> [u8; K] {
        let (head, rest) = self.0.split_at(K);
        self.0 = rest;
        let mut out = [0; K];
        out.copy_from_slice(head);
        out
    }
}

impl IndexedReader {
    pub fn open(prefix: &Path) -> crate::Result<IndexedReader> {
        let idx_p = idx_path(prefix);
        let bin_p = bin_path(prefix);
        let bytes = fs::read(&idx_p).map_err(|e| with_path(&idx_p, e))?;
        let bad = |what: String| invalid_data(&idx_p, what);

        if bytes.len() < HEADER_LEN as usize {
            return Err(bad(format!(
                "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
                bytes.len()
            )));
        }
        let mut f = Fields(&bytes);
        if f.take::<9>() != *MAGIC {
            return Err(bad(format!(
                "not a Megatron index: magic is {:02x?}, expected \"MMIDIDX\\0\\0\"",
                &bytes[..9]
            )));
        }
        let version = u64::from_le_bytes(f.take());
        if version != VERSION {
            return Err(bad(format!("unsupported version {version}, expected 1")));
        }
        let [code] = f.take::<1>();
        let dtype =
            DType::from_code(code).ok_or_else(|| bad(format!("unknown dtype code {code}")))?;
        let n = u64::from_le_bytes(f.take());
        let d = u64::from_le_bytes(f.take());
        let expected = n
            .checked_mul(12)
            .and_then(|x| d.checked_mul(8)?.checked_add(x))
            .and_then(|x| x.checked_add(HEADER_LEN));
        let actual = bytes.len() as u64;
        match expected {
            Some(e) if e == actual => {}
            Some(e) if e.checked_add(n) == Some(actual) => {
                return Err(bad(format!(
                    "{actual} bytes = {e} + one byte per sequence: a multimodal index \
                     (sequence modes), which is not supported"
                )));
            }
            Some(e) if actual < e => {
                return Err(bad(format!(
                    "truncated: {actual} bytes, but N = {n} sequences and D = {d} \
                     document-index entries need {e}"
                )));
            }
            Some(e) => {
                return Err(bad(format!(
                    "{} unexpected trailing bytes after the document index \
                     (N = {n}, D = {d} need {e} bytes)",
                    actual - e
                )));
            }
            None => {
                return Err(bad(format!(
                    "header counts N = {n}, D = {d} are impossibly large"
                )));
            }
        }
        // Both fit in usize: the file holding 12·N + 8·D bytes is in memory.
        let (n, d) = (n as usize, d as usize);

        let lengths: Vec<i32> = (0..n).map(|_| i32::from_le_bytes(f.take())).collect();
        let pointers: Vec<i64> = (0..n).map(|_| i64::from_le_bytes(f.take())).collect();
        let document_indices: Vec<i64> = (0..d).map(|_| i64::from_le_bytes(f.take())).collect();

        let item = dtype.size() as u64;
        let mut offset: u64 = 0;
        for (i, (&len, &ptr)) in lengths.iter().zip(&pointers).enumerate() {
            let len = u64::try_from(len)
                .map_err(|_| bad(format!("sequence {i} has negative length {len}")))?;
            if u64::try_from(ptr).ok() != Some(offset) {
                return Err(bad(format!(
                    "sequence {i} pointer is {ptr}, expected byte offset {offset} \
                     (running sum of lengths × {item})"
                )));
            }
            offset = len
                .checked_mul(item)
                .and_then(|x| x.checked_add(offset))
                .ok_or_else(|| bad("sequence lengths overflow".to_string()))?;
        }
        match document_indices.first() {
            None => {
                return Err(bad("document index is empty (D = 0)".to_string()));
            }
            Some(&first) if first != 0 => {
                return Err(bad(format!("document index starts at {first}, expected 0")));
            }
            _ => {}
        }
        if let Some(w) = document_indices.windows(2).position(|w| w[1] < w[0]) {
            return Err(bad(format!(
                "document index decreases at entry {}: {} after {}",
                w + 1,
                document_indices[w + 1],
                document_indices[w]
            )));
        }
        let last = document_indices[d - 1];
        if last != n as i64 {
            return Err(bad(format!(
                "document index ends at {last}, expected the sequence count {n}"
            )));
        }

        let bin = File::open(&bin_p).map_err(|e| with_path(&bin_p, e))?;
        let bin_len = bin.metadata().map_err(|e| with_path(&bin_p, e))?.len();
        if bin_len != offset {
            return Err(invalid_data(
                &bin_p,
                format!(
                    "{bin_len} bytes, but its index lists {} tokens of {} = {offset} bytes",
                    offset / item,
                    dtype.name()
                ),
            ));
        }
        Ok(IndexedReader {
            bin_path: bin_p,
            bin,
            dtype,
            lengths,
            pointers,
            document_indices,
        })
    }

    /// Number of sequences (`N`).
    pub fn len(&self) -> usize {
        self.lengths.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lengths.is_empty()
    }

    /// Number of documents (`D - 1`), empty ones included.
    pub fn num_documents(&self) -> usize {
        self.document_indices.len() - 1
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Tokens per sequence (validated non-negative).
    pub fn sequence_lengths(&self) -> &[i32] {
        &self.lengths
    }

    /// `D` entries: 0, then the sequence count at the end of each document, ending at `N`.
    pub fn document_indices(&self) -> &[i64] {
        &self.document_indices
    }

    /// The token ids of sequence `i`. Errors if `i` is out of range, the `.bin` changed
    /// since `open`, or a stored value is not a valid id (negative, fractional, > u32::MAX).
    pub fn sequence(&self, i: usize) -> crate::Result<Vec<u32>> {
        let len = self.lengths.get(i).map_or(0, |n| *n as usize);
        self.tokens(i, 0, len)
    }

    /// Tokens `offset .. offset + len` of sequence `i`, reading only those bytes (a training
    /// sample is a slice of a document). Errors as [`IndexedReader::sequence`], and if the
    /// range is not inside the sequence.
    pub fn tokens(&self, i: usize, offset: usize, len: usize) -> crate::Result<Vec<u32>> {
        if i >= self.len() {
            return Err(crate::Error::new(format!(
                "{}: sequence {i} out of range ({} sequences)",
                self.bin_path.display(),
                self.len()
            )));
        }
        // Validated at open: non-negative, and pointer + len·item ≤ the .bin size.
        let size = self.lengths[i] as usize;
        if offset + len > size {
            return Err(crate::Error::new(format!(
                "{}: tokens {offset}..{} of sequence {i}, which has {size}",
                self.bin_path.display(),
                offset + len
            )));
        }
        let item = self.dtype.size();
        let mut raw = vec![0u8; len * item];
        self.bin
            .read_exact_at(&mut raw, (self.pointers[i] as usize + offset * item) as u64)
            .map_err(|e| with_path(&self.bin_path, e))?;
        raw.chunks_exact(item)
            .enumerate()
            .map(|(j, b)| {
                self.dtype.decode(b).ok_or_else(|| {
                    invalid_data(
                        &self.bin_path,
                        format!(
                            "sequence {i}, token {}: bytes {b:02x?} are not a valid {} token id",
                            offset + j,
                            self.dtype.name()
                        ),
                    )
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TestDir(PathBuf);

    impl TestDir {
        fn new(name: &str) -> TestDir {
            static COUNT: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "nemo-dag-megatron-{}-{}-{name}",
                std::process::id(),
                COUNT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            TestDir(dir)
        }

        fn prefix(&self) -> PathBuf {
            self.0.join("corpus_text_document")
        }
    }

    impl Drop for TestDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn write(prefix: &Path, dtype: DType, docs: &[&[u32]]) -> Summary {
        let mut w = IndexedWriter::create(prefix, dtype).unwrap();
        for doc in docs {
            w.add_document(doc).unwrap();
        }
        w.finish().unwrap()
    }

    fn read_all(r: &IndexedReader) -> Vec<Vec<u32>> {
        (0..r.len()).map(|i| r.sequence(i).unwrap()).collect()
    }

    fn round_trip(dtype: DType, docs: &[&[u32]]) {
        let dir = TestDir::new(dtype.name());
        let s = write(&dir.prefix(), dtype, docs);
        let n_tokens: usize = docs.iter().map(|d| d.len()).sum();
        assert_eq!(
            s,
            Summary {
                tokens: n_tokens as u64,
                sequences: docs.len() as u64,
                documents: docs.len() as u64
            }
        );
        let r = IndexedReader::open(&dir.prefix()).unwrap();
        assert_eq!(r.dtype(), dtype);
        assert_eq!(r.len(), docs.len());
        assert_eq!(r.num_documents(), docs.len());
        assert_eq!(read_all(&r), docs);
        let expected_index: Vec<i64> = (0..=docs.len() as i64).collect();
        assert_eq!(r.document_indices(), expected_index);
        let bin_len = fs::metadata(bin_path(&dir.prefix())).unwrap().len();
        assert_eq!(bin_len, (n_tokens * dtype.size()) as u64);
        let idx_len = fs::metadata(idx_path(&dir.prefix())).unwrap().len();
        assert_eq!(
            idx_len,
            34 + 12 * docs.len() as u64 + 8 * (docs.len() as u64 + 1)
        );
    }

    #[test]
    fn round_trip_u16() {
        round_trip(DType::U16, &[&[0, 1, 2], &[65535], &[50256, 7, 7, 7, 9]]);
    }

    #[test]
    fn round_trip_i32() {
        round_trip(
            DType::I32,
            &[&[128_255, 0], &[i32::MAX as u32], &[1, 2, 3, 65536]],
        );
    }

    #[test]
    fn round_trip_every_dtype() {
        for dtype in DType::ALL {
            round_trip(dtype, &[&[0, 1, 127], &[42], &[5, 4, 3, 2, 1]]);
        }
    }

    #[test]
    fn dtype_codes_match_megatron() {
        let codes: Vec<(u8, &str)> = DType::ALL.iter().map(|d| (d.code(), d.name())).collect();
        assert_eq!(
            codes,
            [
                (1, "uint8"),
                (2, "int8"),
                (3, "int16"),
                (4, "int32"),
                (5, "int64"),
                (6, "float64"),
                (7, "float32"),
                (8, "uint16")
            ]
        );
        for d in DType::ALL {
            assert_eq!(DType::from_code(d.code()), Some(d));
        }
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(9), None);
        assert_eq!(DType::U16.size(), 2);
        assert_eq!(DType::F64.size(), 8);
    }

    #[test]
    fn smallest_for_vocab_follows_preprocess_data() {
        assert_eq!(smallest_for_vocab(50_257), DType::U16); // GPT-2
        assert_eq!(smallest_for_vocab(65_499), DType::U16);
        assert_eq!(smallest_for_vocab(65_500), DType::I32);
        assert_eq!(smallest_for_vocab(65_536), DType::I32);
        assert_eq!(smallest_for_vocab(128_256), DType::I32); // Llama-3
    }

    /// Expected bytes derived by hand from the `.idx` layout table in docs/parity.md.
    #[test]
    fn golden_bytes_u16() {
        let dir = TestDir::new("golden");
        let s = write(&dir.prefix(), DType::U16, &[&[1, 2, 3], &[4, 5]]);
        assert_eq!(
            s,
            Summary {
                tokens: 5,
                sequences: 2,
                documents: 2
            }
        );
        #[rustfmt::skip]
        let idx: Vec<u8> = vec![
            // offset 0: magic "MMIDIDX\0\0"
            0x4d, 0x4d, 0x49, 0x44, 0x49, 0x44, 0x58, 0x00, 0x00,
            // offset 9: version, u64 = 1
            0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            // offset 17: dtype code, u8 = 8 (uint16)
            0x08,
            // offset 18: N = 2 sequences, u64
            0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            // offset 26: D = 3 document-index entries (2 documents + 1), u64
            0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            // offset 34: sequence lengths, i32 × 2: 3, 2
            0x03, 0x00, 0x00, 0x00,
            0x02, 0x00, 0x00, 0x00,
            // offset 42: sequence pointers, i64 × 2, bytes: 0, 3 × 2 = 6
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x06, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            // offset 58: document index, i64 × 3: 0, 1, 2
            0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
            // offset 82 = 34 + 12·2 + 8·3: end
        ];
        #[rustfmt::skip]
        let bin: Vec<u8> = vec![
            // tokens as uint16 little-endian, back to back: 1 2 3 | 4 5
            0x01, 0x00, 0x02, 0x00, 0x03, 0x00,
            0x04, 0x00, 0x05, 0x00,
        ];
        assert_eq!(fs::read(idx_path(&dir.prefix())).unwrap(), idx);
        assert_eq!(fs::read(bin_path(&dir.prefix())).unwrap(), bin);
        // Only the final pair is left: no temporaries.
        let mut names: Vec<String> = fs::read_dir(&dir.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            ["corpus_text_document.bin", "corpus_text_document.idx"]
        );
    }

    /// Index bytes of N sequences with the given lengths and document index, built field by
    /// field like Megatron's writer (pointers = running byte offsets).
    fn index_bytes(code: u8, item: i64, lengths: &[i32], doc_index: &[i64]) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        b.extend(1u64.to_le_bytes());
        b.push(code);
        b.extend((lengths.len() as u64).to_le_bytes());
        b.extend((doc_index.len() as u64).to_le_bytes());
        for l in lengths {
            b.extend(l.to_le_bytes());
        }
        let mut p = 0i64;
        for &l in lengths {
            b.extend(p.to_le_bytes());
            p += i64::from(l) * item;
        }
        for d in doc_index {
            b.extend(d.to_le_bytes());
        }
        b
    }

    /// The worked example of docs/parity.md, written by megatron-core 0.16.1's own builder:
    /// sentence-level data with an empty document and a 3-sequence document.
    #[test]
    fn reads_megatron_worked_example() {
        let dir = TestDir::new("worked");
        let lengths = [9, 6, 5, 16, 16];
        let idx = index_bytes(8, 2, &lengths, &[0, 1, 1, 4, 5]);
        assert_eq!(idx.len(), 134);
        assert_eq!(
            &idx[..34],
            b"MMIDIDX\0\0\x01\0\0\0\0\0\0\0\x08\x05\0\0\0\0\0\0\0\x05\0\0\0\0\0\0\0"
        );
        fs::write(idx_path(&dir.prefix()), &idx).unwrap();
        let bin: Vec<u8> = (0u16..52).flat_map(|t| t.to_le_bytes()).collect();
        assert_eq!(bin.len(), 104);
        fs::write(bin_path(&dir.prefix()), &bin).unwrap();

        let r = IndexedReader::open(&dir.prefix()).unwrap();
        assert_eq!(r.len(), 5);
        assert_eq!(r.num_documents(), 4);
        assert_eq!(r.document_indices(), [0, 1, 1, 4, 5]);
        assert_eq!(r.sequence_lengths(), lengths);
        assert_eq!(r.sequence(1).unwrap(), (9..15).collect::<Vec<u32>>());
        assert_eq!(r.sequence(4).unwrap(), (36..52).collect::<Vec<u32>>());
        assert_eq!(r.tokens(4, 3, 5).unwrap(), (39..44).collect::<Vec<u32>>());
        assert_eq!(r.tokens(4, 16, 0).unwrap(), Vec::<u32>::new());
        assert!(
            r.tokens(4, 12, 5).is_err(),
            "a range past the end of the sequence"
        );
    }

    #[test]
    fn empty_document_adds_no_sequence_but_an_index_entry() {
        let dir = TestDir::new("empty");
        let s = write(&dir.prefix(), DType::I32, &[&[7, 8], &[], &[9]]);
        assert_eq!(
            s,
            Summary {
                tokens: 3,
                sequences: 2,
                documents: 3
            }
        );
        let r = IndexedReader::open(&dir.prefix()).unwrap();
        assert_eq!(r.document_indices(), [0, 1, 1, 2]);
        assert_eq!(read_all(&r), [vec![7, 8], vec![9]]);

        // A dataset with no documents at all is valid: N = 0, document index [0].
        let s = write(&dir.prefix(), DType::U16, &[]);
        assert_eq!(s.documents, 0);
        let r = IndexedReader::open(&dir.prefix()).unwrap();
        assert!(r.is_empty());
        assert_eq!(r.document_indices(), [0]);
    }

    #[test]
    fn u16_overflow_is_an_error() {
        let dir = TestDir::new("overflow");
        let mut w = IndexedWriter::create(&dir.prefix(), DType::U16).unwrap();
        w.add_document(&[1, 2]).unwrap();
        let err = w.add_document(&[3, 65536]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("65536") && msg.contains("uint16"), "{msg}");
        // The rejected document left nothing behind; the writer is still usable.
        w.add_document(&[65535]).unwrap();
        let s = w.finish().unwrap();
        assert_eq!(s.sequences, 2);
        let r = IndexedReader::open(&dir.prefix()).unwrap();
        assert_eq!(read_all(&r), [vec![1, 2], vec![65535]]);

        let mut w = IndexedWriter::create(&dir.prefix(), DType::I32).unwrap();
        assert!(w.add_document(&[1 << 31]).is_err());
        let mut w = IndexedWriter::create(&dir.prefix(), DType::F32).unwrap();
        assert!(w.add_document(&[(1 << 24) + 1]).is_err());
    }

    #[test]
    fn unfinished_writer_leaves_no_dataset() {
        let dir = TestDir::new("unfinished");
        write(&dir.prefix(), DType::U16, &[&[1]]);
        let mut w = IndexedWriter::create(&dir.prefix(), DType::U16).unwrap();
        // The old index is gone as soon as a new dataset is started.
        assert!(!idx_path(&dir.prefix()).exists());
        w.add_document(&[1, 2, 3]).unwrap();
        drop(w);
        assert!(IndexedReader::open(&dir.prefix()).is_err());
        assert!(!path_with(&dir.prefix(), ".bin.tmp").exists());
    }

    fn expect_error(prefix: &Path, idx: &[u8], needle: &str) {
        fs::write(idx_path(prefix), idx).unwrap();
        let err = IndexedReader::open(prefix).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
    }

    #[test]
    fn truncated_index_is_an_error_not_a_panic() {
        let dir = TestDir::new("truncated");
        let p = dir.prefix();
        write(&p, DType::U16, &[&[1, 2, 3], &[4, 5]]);
        let good = fs::read(idx_path(&p)).unwrap();
        for cut in 0..good.len() {
            let err = {
                fs::write(idx_path(&p), &good[..cut]).unwrap();
                IndexedReader::open(&p).unwrap_err()
            };
            let msg = err.to_string();
            assert!(msg.contains("corpus_text_document.idx"), "{msg}");
            assert!(msg.contains("truncated"), "cut at {cut}: {msg}");
        }
        let mut long = good.clone();
        long.extend([0; 8]);
        expect_error(&p, &long, "8 unexpected trailing bytes");
        let mut multimodal = good.clone();
        multimodal.extend([0; 2]);
        expect_error(&p, &multimodal, "multimodal");
    }

    #[test]
    fn corrupt_index_is_an_error_not_a_panic() {
        let dir = TestDir::new("corrupt");
        let p = dir.prefix();
        write(&p, DType::U16, &[&[1, 2, 3], &[4, 5]]);
        let good = fs::read(idx_path(&p)).unwrap();
        let patched = |at: usize, bytes: &[u8]| {
            let mut b = good.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            b
        };
        expect_error(&p, &patched(0, b"MMIDIDY"), "not a Megatron index");
        expect_error(&p, &patched(9, &[2]), "unsupported version 2");
        expect_error(&p, &patched(17, &[0]), "unknown dtype code 0");
        expect_error(&p, &patched(17, &[9]), "unknown dtype code 9");
        expect_error(
            &p,
            &patched(18, &u64::MAX.to_le_bytes()),
            "impossibly large",
        );
        expect_error(
            &p,
            &patched(26, &(u64::MAX / 8).to_le_bytes()),
            "impossibly large",
        );
        expect_error(&p, &patched(18, &3u64.to_le_bytes()), "truncated");
        expect_error(
            &p,
            &patched(34, &(-1i32).to_le_bytes()),
            "negative length -1",
        );
        expect_error(
            &p,
            &patched(50, &[4]),
            "sequence 1 pointer is 4, expected byte offset 6",
        );
        expect_error(&p, &patched(58, &[1]), "starts at 1");
        expect_error(&p, &patched(66, &[3]), "decreases at entry 2");
        expect_error(
            &p,
            &patched(74, &[1]),
            "ends at 1, expected the sequence count 2",
        );
        expect_error(&p, &index_bytes(8, 2, &[], &[]), "D = 0");
        // A dtype change makes the .bin the wrong size (and the pointers wrong).
        expect_error(&p, &index_bytes(4, 4, &[3, 2], &[0, 1, 2]), "20 bytes");

        // .bin of the wrong size, or missing.
        fs::write(idx_path(&p), &good).unwrap();
        fs::write(bin_path(&p), [1u8, 0, 2]).unwrap();
        let err = IndexedReader::open(&p).unwrap_err().to_string();
        assert!(err.contains("corpus_text_document.bin: 3 bytes"), "{err}");
        fs::remove_file(bin_path(&p)).unwrap();
        let err = IndexedReader::open(&p).unwrap_err();
        assert!(err.message.contains("No such file"), "{err}");
    }

    #[test]
    fn bad_token_values_are_errors() {
        let dir = TestDir::new("values");
        let p = dir.prefix();
        fs::write(idx_path(&p), index_bytes(4, 4, &[2], &[0, 1])).unwrap();
        fs::write(bin_path(&p), [1u8, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]).unwrap();
        let r = IndexedReader::open(&p).unwrap();
        let err = r.sequence(0).unwrap_err().to_string();
        assert!(err.contains("sequence 0, token 1"), "{err}");
        assert!(r.sequence(1).is_err());

        fs::write(idx_path(&p), index_bytes(7, 4, &[1], &[0, 1])).unwrap();
        fs::write(bin_path(&p), 1.5f32.to_le_bytes()).unwrap();
        let r = IndexedReader::open(&p).unwrap();
        assert!(r.sequence(0).is_err());

        // The .bin shrinking after open is an error too.
        fs::write(bin_path(&p), b"").unwrap();
        assert!(r.sequence(0).is_err());
    }
}
