//! Attempts: the directory one `exec` builds a key in, `tmp/<key>.<attempt>/`.
//!
//! Every attempt gets a directory of its own, so that a dead attempt's processes (a background
//! job of a `cmd` stage that outlived a `kill -9`, say) can never write into what the next
//! attempt publishes. A resumable op (training) resumes from its last attempt's directory — but
//! only once every process of that attempt is gone: each attempt records its host and process
//! group in `attempt.json`, and a group that still has members on this host is never adopted.
//! An attempt on another host is taken as gone (a cluster kills a job's whole allocation).

use super::Store;
use crate::diag::{Result, io_err};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The marker file in an attempt's directory; removed before the directory is published.
pub const MARKER: &str = "attempt.json";

#[derive(Debug, Serialize, Deserialize)]
struct Marker {
    host: String,
    pgid: i32,
    pid: u32,
    started_at: String,
}

/// An attempt's directory, and whether it continues an earlier attempt's.
#[derive(Debug)]
pub struct Attempt {
    pub dir: PathBuf,
    pub resumed: bool,
}

impl Store {
    /// Start an attempt at `key` (the caller holds the key's lock). With `resumable`, the
    /// newest earlier attempt whose processes are all gone is adopted; every other finished
    /// attempt of the key is removed. Attempts that still have live processes are left alone
    /// (`gc` removes them later).
    pub fn start_attempt(&self, key: &str, resumable: bool) -> Result<Attempt> {
        let tmp = self.root.join("tmp");
        let name = format!(
            "{key}.{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or_default()
        );
        let dir = tmp.join(name);
        let mut earlier = self.earlier_attempts(key);
        earlier.sort_by(|a, b| b.1.cmp(&a.1)); // newest first
        let mut adopted = false;
        for (old, _) in earlier {
            if still_running(&old) {
                continue;
            }
            if resumable && !adopted {
                std::fs::rename(&old, &dir).map_err(|e| io_err("cannot resume from", &old, e))?;
                adopted = true;
            } else {
                let _ = std::fs::remove_dir_all(&old);
            }
        }
        std::fs::create_dir_all(&dir).map_err(|e| io_err("cannot create", &dir, e))?;
        let marker = Marker {
            host: super::hostname(),
            // SAFETY: getpgrp has no preconditions.
            pgid: unsafe { libc::getpgrp() },
            pid: std::process::id(),
            started_at: super::timestamp(),
        };
        let json = serde_json::to_vec(&marker).map_err(|e| miette::miette!("{e}"))?;
        let path = dir.join(MARKER);
        super::write_atomic(&path, &json, false).map_err(|e| io_err("cannot write", &path, e))?;
        Ok(Attempt {
            dir,
            resumed: adopted,
        })
    }

    /// Earlier attempts at `key`, with the time each was started (for ordering).
    fn earlier_attempts(&self, key: &str) -> Vec<(PathBuf, String)> {
        let prefix = format!("{key}.");
        std::fs::read_dir(self.root.join("tmp"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| {
                let name = e.file_name();
                let name = name.to_string_lossy();
                // `tmp/<key>` is an attempt of an older nemo-dag, kept for resuming.
                name.starts_with(&prefix) || name == key
            })
            .map(|e| {
                let started = read_marker(&e.path())
                    .map(|m| m.started_at)
                    .unwrap_or_default();
                (e.path(), started)
            })
            .collect()
    }
}

fn read_marker(dir: &Path) -> Option<Marker> {
    serde_json::from_slice(&std::fs::read(dir.join(MARKER)).ok()?).ok()
}

/// Whether an attempt's process group still has a member on this host.
pub fn still_running(dir: &Path) -> bool {
    let Some(m) = read_marker(dir) else {
        return false;
    };
    if m.host != super::hostname() || m.pgid <= 1 {
        return false;
    }
    if let Some(live) = live_members(m.pgid) {
        return live;
    }
    // SAFETY: signal 0 only checks that the group exists and may be signalled.
    let alive = unsafe { libc::kill(-m.pgid, 0) } == 0;
    alive || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Whether process group `pgid` has a member that is not a zombie, from `/proc` (`None` where
/// there is no `/proc` to read). A zombie counts for `kill(-pgid, 0)` but can write nothing, and
/// in a container whose PID 1 does not reap orphans (no `--init`) one can linger for ever: a
/// `srun` helper orphaned by a finished job did, and kept the job's attempt from ever resuming.
fn live_members(pgid: i32) -> Option<bool> {
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name
            .to_str()
            .is_some_and(|n| n.bytes().all(|b| b.is_ascii_digit()))
        {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue; // gone since the listing
        };
        // `pid (comm) state ppid pgrp …`; comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next();
        let group = fields.nth(1).and_then(|g| g.parse::<i32>().ok());
        if group == Some(pgid) && state != Some("Z") && state != Some("X") {
            return Some(true);
        }
    }
    Some(false)
}

/// The key an entry of `tmp/` belongs to.
pub fn key_of_attempt(name: &str) -> &str {
    name.split('.').next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(name: &str) -> Store {
        let root =
            std::env::temp_dir().join(format!("nemo-dag-attempt-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let store = Store::new(root);
        store.ensure().unwrap();
        store
    }

    #[test]
    fn a_group_whose_only_member_is_a_zombie_is_gone() {
        use std::os::unix::process::CommandExt;
        let mut zombie = std::process::Command::new("true")
            .process_group(0)
            .spawn()
            .unwrap();
        let mut live = std::process::Command::new("sleep")
            .arg("5")
            .process_group(0)
            .spawn()
            .unwrap();
        // `true` exits at once; not waited for, it stays a zombie of this process.
        let pgid = zombie.id() as i32;
        let zombie_seen = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            std::fs::read_to_string(format!("/proc/{pgid}/stat")).is_ok_and(|s| {
                s.rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
            })
        });
        assert!(zombie_seen);
        // SAFETY: signal 0 to a group this test made.
        assert_eq!(
            unsafe { libc::kill(-pgid, 0) },
            0,
            "kill(2) still counts a zombie"
        );
        assert_eq!(live_members(pgid), Some(false));
        assert_eq!(live_members(live.id() as i32), Some(true));
        live.kill().unwrap();
        live.wait().unwrap();
        zombie.wait().unwrap();
    }

    #[test]
    fn an_attempt_whose_processes_live_is_never_adopted() {
        let store = store("live");
        // Our own process group is alive: as a stray of a dead attempt would be.
        let first = store.start_attempt("k", true).unwrap();
        std::fs::write(first.dir.join("checkpoint"), "step 5").unwrap();
        let second = store.start_attempt("k", true).unwrap();
        assert!(!second.resumed);
        assert_ne!(first.dir, second.dir);
        assert!(
            first.dir.join("checkpoint").exists(),
            "a live attempt is left alone"
        );
        let _ = std::fs::remove_dir_all(&store.root);
    }

    #[test]
    fn a_dead_attempt_is_adopted_when_resumable_and_removed_when_not() {
        let store = store("dead");
        let dead = |key: &str| {
            let a = store.start_attempt(key, false).unwrap();
            // A group that no longer exists: a child that has exited and been reaped.
            let mut child = std::process::Command::new("true").spawn().unwrap();
            let pgid = child.id() as i32;
            child.wait().unwrap();
            let marker = Marker {
                host: crate::store::hostname(),
                pgid,
                pid: child.id(),
                started_at: crate::store::timestamp(),
            };
            std::fs::write(a.dir.join(MARKER), serde_json::to_vec(&marker).unwrap()).unwrap();
            std::fs::write(a.dir.join("checkpoint"), "step 5").unwrap();
            a.dir
        };
        let old = dead("r");
        let resumed = store.start_attempt("r", true).unwrap();
        assert!(resumed.resumed);
        assert!(!old.exists());
        assert!(
            resumed.dir.join("checkpoint").exists(),
            "the checkpoint comes along"
        );

        let old = dead("n");
        let fresh = store.start_attempt("n", false).unwrap();
        assert!(!fresh.resumed);
        assert!(
            !old.exists(),
            "a dead attempt of a non-resumable op is removed"
        );
        assert!(!fresh.dir.join("checkpoint").exists());
        let _ = std::fs::remove_dir_all(&store.root);
    }
}
