//! Compiled kernels on disk, keyed by blake3 of everything that decides the output: the
//! source, the architecture, NVRTC's version and the options. A second run of the same binary
//! on the same machine compiles nothing.
//!
//! One file per entry, `<key>.cubin` or `<key>.ptx`: a magic line, the program log's length
//! (8 bytes, little-endian), the log, then the image. It is written to a temporary file in the
//! same directory and renamed into place, so a reader never sees half an entry and two
//! processes compiling the same kernel both end with a whole one.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::nvrtc::ImageKind;

/// The environment variable that moves the cache (default `$XDG_CACHE_HOME/nemo-dag/kernels`,
/// else `~/.cache/nemo-dag/kernels`).
pub const CACHE_DIR_VAR: &str = "NEMO_DAG_KERNEL_CACHE";

/// First bytes of every entry; a new layout gets a new magic, so old entries read as misses.
const MAGIC: &[u8] = b"nemo-dag kernel cache 1\n";

/// A directory of compiled kernels.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

/// What the cache did for one compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheOutcome {
    /// Read back: NVRTC did not run.
    Hit,
    /// Compiled and written to the cache.
    Stored,
    /// Compiled, but the entry could not be written (the reason): the next run compiles again.
    NotStored(String),
    /// No cache was asked for.
    Off,
}

/// An entry read back.
#[derive(Debug)]
pub(crate) struct Entry {
    pub image: Vec<u8>,
    pub log: String,
}

impl KernelCache {
    /// A cache in `dir` (created on the first store).
    pub fn at(dir: impl Into<PathBuf>) -> KernelCache {
        KernelCache { dir: dir.into() }
    }

    /// The user's cache: `$NEMO_DAG_KERNEL_CACHE`, `$XDG_CACHE_HOME/nemo-dag/kernels` or
    /// `$HOME/.cache/nemo-dag/kernels`; `None` when none of those is set.
    pub fn user() -> Option<KernelCache> {
        let var = |name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let dir = var(CACHE_DIR_VAR)
            .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("nemo-dag/kernels")))
            .or_else(|| var("HOME").map(|d| d.join(".cache/nemo-dag/kernels")))?;
        Some(KernelCache::at(dir))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The key of a compile: every input is length-prefixed, so no two lists of inputs hash
    /// the same bytes.
    pub fn key(source: &str, arch: &str, nvrtc_version: (i32, i32), options: &[String]) -> String {
        let mut hasher = blake3::Hasher::new();
        let mut field = |bytes: &[u8]| {
            hasher.update(&(bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        };
        field(MAGIC);
        field(source.as_bytes());
        field(arch.as_bytes());
        field(format!("{}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
        for option in options {
            field(option.as_bytes());
        }
        hasher.finalize().to_hex().to_string()
    }

    fn path(&self, key: &str, kind: ImageKind) -> PathBuf {
        let extension = match kind {
            ImageKind::Cubin => "cubin",
            ImageKind::Ptx => "ptx",
        };
        self.dir.join(format!("{key}.{extension}"))
    }

    /// The entry for `key`, if there is a whole one. A missing, truncated or foreign file is a
    /// miss, never an error: the kernel is compiled again and the entry replaced.
    pub(crate) fn load(&self, key: &str, kind: ImageKind) -> Option<Entry> {
        let bytes = fs::read(self.path(key, kind)).ok()?;
        let rest = bytes.strip_prefix(MAGIC)?;
        let (length, rest) = rest.split_first_chunk::<8>()?;
        let length = usize::try_from(u64::from_le_bytes(*length)).ok()?;
        if length > rest.len() {
            return None;
        }
        let (log, image) = rest.split_at(length);
        let log = String::from_utf8(log.to_vec()).ok()?;
        Some(Entry {
            image: image.to_vec(),
            log,
        })
    }

    /// Writes the entry for `key` atomically.
    pub(crate) fn store(
        &self,
        key: &str,
        kind: ImageKind,
        image: &[u8],
        log: &str,
    ) -> CacheOutcome {
        let target = self.path(key, kind);
        match write_atomically(
            &self.dir,
            &target,
            &[
                MAGIC,
                &(log.len() as u64).to_le_bytes(),
                log.as_bytes(),
                image,
            ],
        ) {
            Ok(()) => CacheOutcome::Stored,
            Err(error) => CacheOutcome::NotStored(format!("{}: {error}", target.display())),
        }
    }
}

/// Writes `parts` to a fresh temporary file beside `target`, then renames it over `target`.
fn write_atomically(dir: &Path, target: &Path, parts: &[&[u8]]) -> std::io::Result<()> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    fs::create_dir_all(dir)?;
    let unique = COUNTER.fetch_add(1, Ordering::Relaxed);
    let temporary = dir.join(format!(".tmp-{}-{unique}", std::process::id()));
    let written = (|| {
        let mut file = fs::File::create_new(&temporary)?;
        for part in parts {
            file.write_all(part)?;
        }
        file.sync_all()?;
        fs::rename(&temporary, target)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&temporary);
    }
    written
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "nemo-dag-kernel-cache-{name}-{}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn an_entry_reads_back_as_it_was_stored() {
        let cache = KernelCache::at(scratch("roundtrip"));
        let key = KernelCache::key("src", "sm_90", (13, 0), &[]);
        assert!(cache.load(&key, ImageKind::Cubin).is_none());
        assert_eq!(
            cache.store(&key, ImageKind::Cubin, b"\x7fELF\0image", "ptxas info"),
            CacheOutcome::Stored
        );
        let entry = cache.load(&key, ImageKind::Cubin).expect("stored");
        assert_eq!(entry.image, b"\x7fELF\0image");
        assert_eq!(entry.log, "ptxas info");
        // The PTX of the same key is another entry.
        assert!(cache.load(&key, ImageKind::Ptx).is_none());
        let leftovers: Vec<_> = fs::read_dir(cache.dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn a_truncated_entry_is_a_miss() {
        let cache = KernelCache::at(scratch("truncated"));
        let key = KernelCache::key("src", "sm_90", (13, 0), &[]);
        cache.store(&key, ImageKind::Cubin, b"image", "a log of some length");
        let path = cache.path(&key, ImageKind::Cubin);
        let bytes = fs::read(&path).expect("stored");
        fs::write(&path, &bytes[..MAGIC.len() + 10]).expect("truncate");
        assert!(cache.load(&key, ImageKind::Cubin).is_none());
        let _ = fs::remove_dir_all(cache.dir());
    }

    #[test]
    fn every_input_of_a_compile_changes_the_key() {
        let options = ["-std=c++17".to_string()];
        let base = KernelCache::key("src", "sm_90", (13, 0), &options);
        assert_ne!(base, KernelCache::key("src ", "sm_90", (13, 0), &options));
        assert_ne!(base, KernelCache::key("src", "sm_80", (13, 0), &options));
        assert_ne!(base, KernelCache::key("src", "sm_90", (13, 2), &options));
        assert_ne!(base, KernelCache::key("src", "sm_90", (13, 0), &[]));
        assert_eq!(base, KernelCache::key("src", "sm_90", (13, 0), &options));
    }
}
