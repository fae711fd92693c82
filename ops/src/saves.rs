//! A directory of numbered saves that a trainer writes and resumes from: Megatron-Bridge's
//! `iter_0000200/`, NeMo-RL's `step_20/`. Each op says how a save is named and when one is
//! whole; what to keep between launches and at the end is the same for both.

use std::io;
use std::path::{Path, PathBuf};

/// One save: its number, whether it is whole, its directory.
pub type Save = (u64, bool, PathBuf);

/// Every save in `dir` (none when it is missing), in number order: the entries `number`
/// gives a number to, each judged by `whole`.
pub fn scan(
    dir: &Path,
    number: impl Fn(&str) -> Option<u64>,
    whole: impl Fn(&Path) -> bool,
) -> io::Result<Vec<Save>> {
    let mut found = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(found),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        if let Some(n) = entry.file_name().to_str().and_then(&number) {
            found.push((n, whole(&entry.path()), entry.path()));
        }
    }
    found.sort_unstable();
    Ok(found)
}

/// The newest whole save.
pub fn newest(found: &[Save]) -> Option<u64> {
    found
        .iter()
        .filter(|(_, ok, _)| *ok)
        .map(|(n, _, _)| *n)
        .next_back()
}

/// Before a launch: remove every save a resume must not read (one that is not whole, or
/// newer than the newest whole one). Returns the newest whole save.
pub fn drop_unusable(found: Vec<Save>) -> io::Result<Option<u64>> {
    let newest = newest(&found);
    for (n, ok, path) in found {
        if !ok || Some(n) > newest {
            std::fs::remove_dir_all(path)?;
        }
    }
    Ok(newest)
}

/// After a finished run: save `n` alone.
pub fn keep_only(found: Vec<Save>, n: u64) -> io::Result<()> {
    for (m, _, path) in found {
        if m != n {
            std::fs::remove_dir_all(path)?;
        }
    }
    Ok(())
}
