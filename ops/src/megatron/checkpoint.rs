//! Megatron-Bridge's checkpoint directory, as the ops read and tidy it between launches.
//!
//! ```text
//! checkpoint/
//!   latest_train_state.pt               Bridge's tracker, read first on load
//!   latest_checkpointed_iteration.txt   Megatron-LM's tracker: the iteration, no newline
//!   iter_0000200/                       iter_{:07d}: torch_dist shards, .metadata, common.pt,
//!     …                                 metadata.json, then train_state.pt, run_config.yaml
//! ```
//!
//! A synchronous save writes the shards, waits for every rank, then (rank 0) `train_state.pt`,
//! both trackers (neither atomically) and last `run_config.yaml`
//! (`src/megatron/bridge/training/checkpointing.py` `save_checkpoint`, Megatron-Bridge v0.6.0).
//! So an iteration is *complete* only when all of those exist, and a tracker may point at one
//! a kill left half-written: the scan of the directory is the truth, never the tracker.

use crate::saves::{self, Save};
use std::io;
use std::path::{Path, PathBuf};

pub const TRACKER: &str = "latest_checkpointed_iteration.txt";
pub const TRAIN_STATE_TRACKER: &str = "latest_train_state.pt";

/// `iter_0000200` for 200.
pub fn iteration_dir(n: u64) -> String {
    format!("iter_{n:07}")
}

/// The iteration a directory name holds: `iter_0000200` → 200.
fn parse_iteration(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("iter_")?;
    (digits.len() >= 7 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Whether every file of a finished synchronous save is there.
pub fn complete(iter: &Path) -> bool {
    let non_empty = |name: &str| {
        std::fs::metadata(iter.join(name))
            .map(|m| m.is_file() && m.len() > 0)
            .unwrap_or(false)
    };
    non_empty("run_config.yaml")
        && iter.join("train_state.pt").is_file()
        && iter.join(".metadata").is_file()
        && iter.join("metadata.json").is_file()
}

/// Every `iter_*` directory: (iteration, complete, path), in iteration order.
pub fn scan(dir: &Path) -> io::Result<Vec<Save>> {
    saves::scan(dir, parse_iteration, complete)
}

/// The newest complete iteration.
pub fn newest_complete(dir: &Path) -> io::Result<Option<u64>> {
    Ok(saves::newest(&scan(dir)?))
}

/// Before a launch: keep only what a resume may read. Every iteration newer than the newest
/// complete one, or incomplete, is deleted, with stray `*.tmp` files; the trackers are
/// rewritten to name the newest complete iteration, or removed when there is none. Returns it.
pub fn prepare(dir: &Path) -> io::Result<Option<u64>> {
    std::fs::create_dir_all(dir)?;
    let newest = saves::drop_unusable(scan(dir)?)?;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "tmp") && path.is_file() {
            std::fs::remove_file(&path)?;
        }
    }
    match newest {
        Some(n) => write_trackers(dir, n)?,
        None => {
            for tracker in [TRACKER, TRAIN_STATE_TRACKER] {
                match std::fs::remove_file(dir.join(tracker)) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
        }
    }
    Ok(newest)
}

/// After a finished run: the final iteration `n` alone, with trackers that name it.
pub fn keep_only(dir: &Path, n: u64) -> io::Result<()> {
    saves::keep_only(scan(dir)?, n)?;
    write_trackers(dir, n)
}

/// Both trackers name iteration `n`, each written whole or not at all (temp file + rename).
fn write_trackers(dir: &Path, n: u64) -> io::Result<()> {
    let state = std::fs::read(dir.join(iteration_dir(n)).join("train_state.pt"))?;
    for (name, bytes) in [
        (TRACKER, n.to_string().into_bytes()),
        (TRAIN_STATE_TRACKER, state),
    ] {
        let tmp = dir.join(format!("{name}.nemo-dag.tmp"));
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, dir.join(name))?;
    }
    Ok(())
}

/// The final iteration of a published checkpoint (a `megatron_pretrain`/`megatron_sft`
/// artifact's `checkpoint`): the directory its tracker names, which must be complete.
/// `Err` says what is wrong, for a message that names the input.
pub fn final_iteration(dir: &Path) -> Result<PathBuf, String> {
    let tracker = dir.join(TRACKER);
    let text = std::fs::read_to_string(&tracker).map_err(|e| {
        format!(
            "{}: {e}: not a Megatron checkpoint directory (the `checkpoint` output of a megatron_pretrain or megatron_sft stage)",
            tracker.display()
        )
    })?;
    let n: u64 = text.trim().parse().map_err(|_| {
        format!(
            "{}: `{}` is not an iteration",
            tracker.display(),
            text.trim()
        )
    })?;
    let iter = dir.join(iteration_dir(n));
    if !complete(&iter) {
        return Err(format!(
            "{}: the tracker names iteration {n}, but {} is missing or incomplete",
            tracker.display(),
            iter.display()
        ));
    }
    Ok(iter)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::names;

    fn save(dir: &Path, n: u64, whole: bool) {
        let iter = dir.join(iteration_dir(n));
        std::fs::create_dir_all(&iter).unwrap();
        for f in ["__0_0.distcp", ".metadata", "common.pt", "metadata.json"] {
            std::fs::write(iter.join(f), b"x").unwrap();
        }
        if whole {
            std::fs::write(iter.join("train_state.pt"), format!("{{\"step\": {n}}}")).unwrap();
            std::fs::write(iter.join("run_config.yaml"), b"model: {}\n").unwrap();
        }
        std::fs::write(dir.join(TRACKER), n.to_string()).unwrap();
    }

    #[test]
    fn a_kill_mid_save_is_undone_and_the_trackers_name_the_last_whole_iteration() {
        let dir = crate::testing::scratch("mb-ckpt-kill");
        let ckpt = dir.as_path().join("checkpoint");
        std::fs::create_dir_all(&ckpt).unwrap();
        save(&ckpt, 4, true);
        save(&ckpt, 8, false); // killed between the shards and train_state.pt
        std::fs::create_dir_all(ckpt.join("iter_00000009")).unwrap(); // a name MB never writes
        std::fs::write(ckpt.join("x.tmp"), b"").unwrap();
        assert_eq!(std::fs::read_to_string(ckpt.join(TRACKER)).unwrap(), "8");

        assert_eq!(prepare(&ckpt).unwrap(), Some(4));
        assert_eq!(names(&ckpt), ["iter_0000004", TRACKER, TRAIN_STATE_TRACKER]);
        assert_eq!(std::fs::read_to_string(ckpt.join(TRACKER)).unwrap(), "4");
        assert_eq!(
            std::fs::read(ckpt.join(TRAIN_STATE_TRACKER)).unwrap(),
            std::fs::read(ckpt.join("iter_0000004/train_state.pt")).unwrap()
        );
        assert_eq!(final_iteration(&ckpt).unwrap(), ckpt.join("iter_0000004"));
    }

    #[test]
    fn nothing_whole_means_a_fresh_start_without_trackers() {
        let dir = crate::testing::scratch("mb-ckpt-fresh");
        let ckpt = dir.as_path().join("checkpoint");
        assert_eq!(prepare(&ckpt).unwrap(), None, "a missing directory is made");
        save(&ckpt, 2, false);
        std::fs::write(ckpt.join(TRAIN_STATE_TRACKER), b"{}").unwrap();
        assert_eq!(prepare(&ckpt).unwrap(), None);
        assert!(names(&ckpt).is_empty(), "{:?}", names(&ckpt));
    }

    #[test]
    fn the_published_checkpoint_holds_the_final_iteration_alone() {
        let dir = crate::testing::scratch("mb-ckpt-publish");
        let ckpt = dir.as_path();
        save(ckpt, 8, true);
        save(ckpt, 10, true);
        keep_only(ckpt, 10).unwrap();
        assert_eq!(names(ckpt), ["iter_0000010", TRACKER, TRAIN_STATE_TRACKER]);
        assert_eq!(std::fs::read_to_string(ckpt.join(TRACKER)).unwrap(), "10");
    }

    #[test]
    fn a_tracker_naming_a_missing_iteration_is_not_a_checkpoint() {
        let dir = crate::testing::scratch("mb-ckpt-tracker");
        assert!(
            final_iteration(dir.as_path())
                .unwrap_err()
                .contains("not a Megatron checkpoint")
        );
        std::fs::write(dir.as_path().join(TRACKER), "12").unwrap();
        assert!(
            final_iteration(dir.as_path())
                .unwrap_err()
                .contains("names iteration 12")
        );
        assert_eq!(parse_iteration("iter_0000012"), Some(12));
        assert_eq!(parse_iteration("iter_12"), None);
        assert_eq!(parse_iteration("iter_00000x2"), None);
    }
}
