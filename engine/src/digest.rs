//! Content digests of files and directories (blake3), remembered between runs.
//!
//! A file's digest is memoised by (path, size, mtime, ctime, inode): while those are unchanged
//! the file is not read again, so an unchanged 100 GB corpus costs one `stat`. A file modified
//! within the last [`RACY_SECONDS`] is never memoised — its timestamp could still match after
//! a later write in the same tick (git's "racy clean" problem). A directory's digest covers its
//! sorted entries: relative path, kind, and content digest. What is not the directory's content
//! is skipped ([`NOT_CONTENT`]): a `.nemo-dag` store inside it, a git repository's `.git` (a
//! `git status` rewrites its index, and a checkout given as an input would otherwise change its
//! key without a file of the working tree changing), and Python's `__pycache__` (bytecode of
//! the sources beside it, which running the code writes).
//!
//! Digests describe what a program reading the path sees: symbolic links are followed (a link
//! to a file is that file's content, a link to a directory that directory's), and only regular
//! files and directories have a digest. A FIFO would block the reader forever and a device
//! like `/dev/zero` never ends, so they, dangling links and link cycles are errors.

use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

const RACY_SECONDS: i64 = 2;
/// Directories inside an input directory that are not its content.
pub const NOT_CONTENT: [&str; 3] = [".nemo-dag", ".git", "__pycache__"];
/// Files at least this large are hashed memory-mapped on every core.
const PARALLEL_BYTES: u64 = 16 << 20;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
struct Stamp {
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
    ino: u64,
}

impl Stamp {
    fn of(meta: &std::fs::Metadata) -> Stamp {
        Stamp {
            size: meta.len(),
            mtime_ns: meta
                .mtime()
                .saturating_mul(1_000_000_000)
                .saturating_add(meta.mtime_nsec()),
            ctime_ns: meta
                .ctime()
                .saturating_mul(1_000_000_000)
                .saturating_add(meta.ctime_nsec()),
            ino: meta.ino(),
        }
    }
}

/// (Not `#[serde(flatten)]`: serde's flatten cannot carry every integer type, and a memo
/// that fails to load silently costs a full re-hash of every input.)
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Memo {
    stamp: Stamp,
    digest: String,
}

/// Computes digests, reusing the memo of earlier runs.
#[derive(Debug, Default)]
pub struct Digester {
    memo: HashMap<PathBuf, Memo>,
    dirty: bool,
    now_ns: i64,
}

impl Digester {
    /// Load the memo saved at `memo_file` (a missing or unreadable memo is just empty).
    pub fn load(memo_file: &Path) -> Digester {
        let memo = std::fs::read(memo_file)
            .ok()
            .and_then(|bytes| serde_json::from_slice(&bytes).ok())
            .unwrap_or_default();
        Digester {
            memo,
            dirty: false,
            now_ns: now_ns(),
        }
    }

    /// A digester that remembers nothing (for freshly written outputs).
    pub fn fresh() -> Digester {
        Digester {
            now_ns: now_ns(),
            ..Default::default()
        }
    }

    /// Write the memo back if it changed (temp file + rename: never a torn memo).
    pub fn save(&self, memo_file: &Path) -> io::Result<()> {
        if !self.dirty {
            return Ok(());
        }
        let bytes = serde_json::to_vec(&self.memo).map_err(io::Error::other)?;
        crate::store::write_atomic(memo_file, &bytes, false)
    }

    /// The digest of a file or directory (hex), as a reader following links sees it.
    pub fn digest(&mut self, path: &Path) -> io::Result<String> {
        let meta = std::fs::metadata(path)?;
        if meta.is_dir() {
            self.digest_dir(path)
        } else {
            check_regular(path, &meta)?;
            self.digest_file(path, &meta)
        }
    }

    fn digest_file(&mut self, path: &Path, meta: &std::fs::Metadata) -> io::Result<String> {
        let stamp = Stamp::of(meta);
        if let Some(m) = self.memo.get(path)
            && m.stamp == stamp
        {
            return Ok(m.digest.clone());
        }
        let digest = hash_file(path, meta.len())?.to_hex().to_string();
        // As git does, raciness is judged by mtime (ctime is still part of the stamp).
        let settled = self.now_ns - stamp.mtime_ns > RACY_SECONDS * 1_000_000_000;
        if settled {
            self.memo.insert(
                path.to_path_buf(),
                Memo {
                    stamp,
                    digest: digest.clone(),
                },
            );
            self.dirty = true;
        }
        Ok(digest)
    }

    /// A directory's entries (links followed), sorted by relative path, then hashed.
    fn digest_dir(&mut self, root: &Path) -> io::Result<String> {
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"nemo-dag dir v1\n");
        let mut entries = Vec::new();
        let mut visiting = vec![std::fs::canonicalize(root)?];
        walk(root, PathBuf::new(), &mut visiting, &mut entries)?;
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        for (rel, meta) in entries {
            let name = rel.to_string_lossy();
            if meta.is_dir() {
                hasher.update(format!("D {name}\n").as_bytes());
            } else {
                let d = self.digest_file(&root.join(&rel), &meta)?;
                hasher.update(format!("F {name}\0{d}\n").as_bytes());
            }
        }
        Ok(hasher.finalize().to_hex().to_string())
    }
}

/// Collect every entry under `root/rel` with the metadata of what it names (links followed).
/// `visiting` holds the canonical directories on the current path, to refuse link cycles.
fn walk(
    root: &Path,
    rel: PathBuf,
    visiting: &mut Vec<PathBuf>,
    out: &mut Vec<(PathBuf, std::fs::Metadata)>,
) -> io::Result<()> {
    for child in std::fs::read_dir(root.join(&rel))? {
        let child = child?;
        if NOT_CONTENT.iter().any(|skip| child.file_name() == *skip) {
            continue;
        }
        let child_rel = rel.join(child.file_name());
        let full = root.join(&child_rel);
        let meta = std::fs::metadata(&full).map_err(|e| {
            let dangling = e.kind() == io::ErrorKind::NotFound;
            io::Error::new(
                e.kind(),
                if dangling {
                    format!("{} is a symbolic link to nothing", full.display())
                } else {
                    format!("{}: {e}", full.display())
                },
            )
        })?;
        if meta.is_dir() {
            let canonical = std::fs::canonicalize(&full)?;
            if visiting.contains(&canonical) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} links back to a directory above it", full.display()),
                ));
            }
            out.push((child_rel.clone(), meta));
            visiting.push(canonical);
            walk(root, child_rel, visiting, out)?;
            visiting.pop();
        } else {
            check_regular(&full, &meta)?;
            out.push((child_rel, meta));
        }
    }
    Ok(())
}

/// Only regular files are read to the end: a FIFO blocks, a device may never end.
fn check_regular(path: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    if meta.is_file() {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{} is not a regular file or directory (a FIFO, socket or device cannot be an input)",
            path.display()
        ),
    ))
}

/// blake3 of a file's bytes: small files read at once, large ones memory-mapped on every core.
pub fn hash_file(path: &Path, len: u64) -> io::Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    if len >= PARALLEL_BYTES {
        hasher.update_mmap_rayon(path)?;
    } else {
        hasher.update(&std::fs::read(path)?);
    }
    Ok(hasher.finalize())
}

fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_hash_their_sorted_contents() {
        let tmp = std::env::temp_dir().join(format!("nemo-dag-digest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(tmp.join("a/sub")).unwrap();
        std::fs::write(tmp.join("a/x.txt"), "x").unwrap();
        std::fs::write(tmp.join("a/sub/y.txt"), "y").unwrap();
        let mut d = Digester::fresh();
        let first = d.digest(&tmp.join("a")).unwrap();
        assert_eq!(first, Digester::fresh().digest(&tmp.join("a")).unwrap());
        std::fs::write(tmp.join("a/sub/y.txt"), "z").unwrap();
        assert_ne!(first, Digester::fresh().digest(&tmp.join("a")).unwrap());
        std::fs::rename(tmp.join("a/sub/y.txt"), tmp.join("a/sub/w.txt")).unwrap();
        let renamed = Digester::fresh().digest(&tmp.join("a")).unwrap();
        std::fs::write(tmp.join("a/sub/w.txt"), "y").unwrap();
        assert_ne!(
            renamed, first,
            "a renamed file changes the directory digest"
        );
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    /// A checkout's git metadata and Python's bytecode caches are not its content: writing
    /// them leaves the digest as it was, while an edit to a source beside them changes it.
    #[test]
    fn git_metadata_and_bytecode_caches_are_not_a_directorys_content() {
        let tmp = std::env::temp_dir().join(format!("nemo-dag-skip-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(tmp.join("co/pkg")).unwrap();
        std::fs::write(tmp.join("co/pkg/run.py"), "print(1)\n").unwrap();
        let digest = || Digester::fresh().digest(&tmp.join("co")).unwrap();
        let first = digest();
        for (dir, file) in [
            (".git", "index"),
            ("pkg/__pycache__", "run.cpython-312.pyc"),
        ] {
            std::fs::create_dir_all(tmp.join("co").join(dir)).unwrap();
            std::fs::write(tmp.join("co").join(dir).join(file), "written by a tool").unwrap();
            assert_eq!(digest(), first, "{dir}");
        }
        std::fs::write(tmp.join("co/pkg/run.py"), "print(2)\n").unwrap();
        assert_ne!(digest(), first);
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    #[test]
    fn the_memo_survives_a_save_and_load_and_is_used() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-memo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("data.bin");
        std::fs::write(&file, b"settled content").unwrap();
        // Backdate the file so it is past the racy window.
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&file)
            .unwrap()
            .set_modified(old)
            .unwrap();
        let memo = dir.join("digests.json");
        let mut d = Digester::load(&memo);
        let first = d.digest(&file).unwrap();
        d.save(&memo).unwrap();
        let loaded = Digester::load(&memo);
        assert_eq!(loaded.memo.len(), 1, "the saved memo must load back");
        assert_eq!(loaded.memo[&file].digest, first);
        // A recent change (ctime moves) is noticed even if the size stays the same.
        std::fs::write(&file, b"changed content").unwrap();
        let mut again = Digester::load(&memo);
        assert_ne!(again.digest(&file).unwrap(), first);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_digest_is_its_blake3() {
        let tmp = std::env::temp_dir().join(format!("nemo-dag-file-{}", std::process::id()));
        std::fs::write(&tmp, b"hello").unwrap();
        let d = Digester::fresh().digest(&tmp).unwrap();
        assert_eq!(d, blake3::hash(b"hello").to_hex().to_string());
        std::fs::remove_file(&tmp).unwrap();
    }
}
