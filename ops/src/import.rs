//! `import`: a file or directory from outside the store, published as an artifact that records
//! where it came from.
//!
//! ```yaml
//! corpus:
//!   op: import
//!   inputs: {path: /datasets/climbmix}             # a file or a directory
//!   params: {source: "nvidia/Nemotron-ClimbMix@9f1e2d"}  # optional: where *it* came from
//! ```
//!
//! The input is content-hashed like any input (the digest memo keeps a file's digest while its
//! size, times and inode are unchanged, so an untouched 10 GB directory costs one `stat` per
//! file on every later run), and the stage's key covers that digest and `source`: a changed
//! file is imported again, an unchanged one never is. `lineage` of anything built from the
//! artifact ends at this stage, with the path, its digest and the `source`.
//!
//! The files are cloned into the artifact's `data/`: a directory's tree, or a file under its own
//! name (readers choose a format by its extension; a `tokenizer` input may name the directory) by a
//! reflink where the filesystem shares blocks between files (Btrfs, XFS, bcachefs, ZFS 2.2+:
//! no data is copied and the two files stay independent), and copied otherwise; the log and the
//! metrics say how many of each. Never a hard link: a hard-linked file *is* the user's file, so
//! sealing the artifact read-only would change their file's mode, an edit of their file in
//! place would change the published artifact, and the link itself would reset the change time
//! the digest memo keys on (a second full hash).

use crate::training::input;
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::Value;
use std::fs::File;
use std::io;
use std::path::Path;

pub struct Import;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// Where the input came from (a hub repository and revision, a URL, a ticket): recorded in
    /// the artifact and shown by `lineage`; part of the key.
    #[serde(default)]
    pub source: Option<String>,
}

static SPEC: Spec = Spec {
    name: "import",
    version: 1,
    summary: "publish a file or directory from outside the store as an artifact, with its origin",
    inputs: &[Port {
        name: "path",
        required: true,
        what: "the file or directory to import",
    }],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("data", "data")]),
    resumable: false,
    launched: false,
    gpu: false,
};

impl Op for Import {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        if p.source.as_deref().is_some_and(|s| s.trim().is_empty()) {
            return Err(DeclError::new(
                &["params", "source"],
                "an empty source says nothing: name where the data came from, or leave it out",
            ));
        }
        Ok(())
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let from = input(ctx, "path")?;
        // A file keeps its name inside `data/`: readers choose a format by the extension.
        let to = match from.file_name() {
            Some(name) if from.is_file() => ctx.out_dir.join("data").join(name),
            _ => ctx.out_dir.join("data"),
        };
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| at(parent, e))?;
        }
        let mut tally = Tally::default();
        clone_tree(&from, &to, &mut tally)?;
        let origin = std::fs::canonicalize(&from).unwrap_or_else(|_| from.clone());
        writeln!(
            ctx.log,
            "imported {} ({} files, {} bytes){}: {} reflinked, {} copied",
            origin.display(),
            tally.files,
            tally.bytes,
            p.source
                .as_deref()
                .map(|s| format!(" from {s}"))
                .unwrap_or_default(),
            tally.reflinked,
            tally.files - tally.reflinked,
        )?;
        let mut m = Metrics::new();
        m.insert("origin".into(), Value::from(origin.display().to_string()));
        if let Some(source) = &p.source {
            m.insert("source".into(), Value::from(source.clone()));
        }
        m.insert("files".into(), Value::from(tally.files));
        m.insert("bytes".into(), Value::from(tally.bytes));
        m.insert("reflinked".into(), Value::from(tally.reflinked));
        m.insert("copied".into(), Value::from(tally.files - tally.reflinked));
        Ok(m)
    }
}

#[derive(Debug, Default, PartialEq)]
struct Tally {
    files: u64,
    bytes: u64,
    reflinked: u64,
}

/// Clone `from` (a file, or a directory and everything under it, links followed as the input's
/// digest follows them) to `to`. A store inside the directory is left out, as the digest
/// leaves it out.
fn clone_tree(from: &Path, to: &Path, tally: &mut Tally) -> Result<(), RunError> {
    let meta = std::fs::metadata(from).map_err(|e| at(from, e))?;
    if meta.is_dir() {
        std::fs::create_dir_all(to).map_err(|e| at(to, e))?;
        let mut entries = std::fs::read_dir(from)
            .map_err(|e| at(from, e))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| at(from, e))?;
        entries.sort_by_key(|e| e.file_name());
        for entry in entries.into_iter().filter(|e| e.file_name() != ".nemo-dag") {
            clone_tree(&entry.path(), &to.join(entry.file_name()), tally)?;
        }
    } else if meta.is_file() {
        tally.reflinked += u64::from(clone_file(from, to).map_err(|e| at(from, e))?);
        tally.files += 1;
        tally.bytes += meta.len();
    } else {
        return Err(RunError::new(format!(
            "{}: only files and directories can be imported",
            from.display()
        )));
    }
    Ok(())
}

fn at(path: &Path, e: io::Error) -> RunError {
    RunError::new(format!("{}: {e}", path.display()))
}

/// Clone one file: a reflink (`FICLONE`) where the filesystem can share its blocks, else a
/// copy. Whether it was a reflink.
fn clone_file(from: &Path, to: &Path) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let source = File::open(from)?;
    let target = File::create_new(to)?;
    // SAFETY: both descriptors are open for the duration of the call; FICLONE reads nothing
    // from our memory.
    let shared = unsafe { libc::ioctl(target.as_raw_fd(), libc::FICLONE, source.as_raw_fd()) };
    if shared == 0 {
        target.set_permissions(source.metadata()?.permissions())?;
        return Ok(true);
    }
    drop(target);
    std::fs::remove_file(to)?;
    std::fs::copy(from, to)?;
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_cloned_whole_without_a_store_inside_it() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-import-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::create_dir_all(src.join(".nemo-dag/artifacts")).unwrap();
        std::fs::write(src.join("a.jsonl"), b"{\"text\": \"a\"}\n").unwrap();
        std::fs::write(src.join("sub/b.jsonl"), b"bb").unwrap();
        std::fs::write(src.join(".nemo-dag/artifacts/x"), b"not data").unwrap();
        let mut tally = Tally::default();
        clone_tree(&src, &dir.join("out"), &mut tally).unwrap();
        assert_eq!((tally.files, tally.bytes), (2, 16));
        assert_eq!(std::fs::read(dir.join("out/sub/b.jsonl")).unwrap(), b"bb");
        assert!(!dir.join("out/.nemo-dag").exists());

        // A file is imported as a file.
        let mut one = Tally::default();
        clone_tree(&src.join("a.jsonl"), &dir.join("one"), &mut one).unwrap();
        assert_eq!(
            std::fs::read(dir.join("one")).unwrap(),
            b"{\"text\": \"a\"}\n"
        );
        assert_eq!(one.files, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
