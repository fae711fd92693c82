//! Atomic writes: a reader sees the old content or the new one, never a torn file.

use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

/// Write a file by temp file + rename, optionally fsynced: readers see the old or the new
/// content, never a torn one.
pub fn write_atomic(path: &Path, bytes: &[u8], sync: bool) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let written = File::create(&tmp).and_then(|mut f| {
        f.write_all(bytes)?;
        if sync {
            f.sync_all()?;
        }
        Ok(())
    });
    // A failed write (a full disk) leaves no temp file behind.
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if sync {
        sync_dir(dir);
    }
    Ok(())
}

/// fsync a directory so a rename in it survives a power cut (best effort).
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Make a published file, or every file under a directory, read-only (directories stay
/// writable, so `gc` can remove them without being root). An accidental write to a published
/// output then fails at once instead of changing what later stages consume.
pub fn seal(path: &Path) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::symlink_metadata(path)?;
    if meta.is_dir() {
        for entry in std::fs::read_dir(path)? {
            seal(&entry?.path())?;
        }
    } else if meta.is_file() {
        let mut perms = meta.permissions();
        perms.set_mode(perms.mode() & !0o222);
        std::fs::set_permissions(path, perms)?;
    }
    Ok(())
}

/// fsync every file under `dir`, then the directories themselves.
pub fn sync_tree(dir: &Path) -> io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let ty = entry.file_type()?;
        if ty.is_dir() {
            sync_tree(&entry.path())?;
        } else if ty.is_file() {
            File::open(entry.path())?.sync_all()?;
        }
    }
    sync_dir(dir);
    Ok(())
}
