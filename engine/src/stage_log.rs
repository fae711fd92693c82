//! A stage's `log.txt`: everything the op writes goes to the file and, live, to stderr.
//!
//! The file is capped ([`DEFAULT_LIMIT`], or `NEMO_DAG_LOG_LIMIT` bytes): past the cap its
//! head is kept, the middle is dropped, and the last [`TAIL`] bytes are kept in memory and
//! written at the end after a line that says how much was not kept — the end of a log is
//! where a failure explains itself. stderr still gets every byte.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Write};
use std::path::Path;

pub const DEFAULT_LIMIT: u64 = 64 << 20;
const TAIL: usize = 64 << 10;

pub struct StageLog {
    file: File,
    path: std::path::PathBuf,
    /// Bytes the file may hold before the tail.
    head_limit: u64,
    written: u64,
    dropped: u64,
    tail: VecDeque<u8>,
    tail_limit: usize,
}

impl StageLog {
    /// Open (append to) the log at `path`.
    pub fn open(path: &Path) -> io::Result<StageLog> {
        let file = File::options().create(true).append(true).open(path)?;
        let written = file.metadata()?.len();
        let limit = std::env::var("NEMO_DAG_LOG_LIMIT")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(DEFAULT_LIMIT);
        let tail_limit = TAIL.min(usize::try_from(limit / 4).unwrap_or(TAIL));
        Ok(StageLog {
            file,
            path: path.to_path_buf(),
            head_limit: limit.saturating_sub(tail_limit as u64),
            written,
            dropped: 0,
            tail: VecDeque::new(),
            tail_limit,
        })
    }

    /// Write what the cap held back: a line saying how much was dropped, then the tail.
    pub fn finish(mut self) -> io::Result<()> {
        if self.dropped > 0 {
            writeln!(
                self.file,
                "\n[nemo-dag: {} bytes of this log not kept (the cap is NEMO_DAG_LOG_LIMIT={} bytes); its last {} bytes follow]",
                self.dropped,
                self.head_limit + self.tail_limit as u64,
                self.tail.len()
            )?;
        }
        let (a, b) = self.tail.as_slices();
        self.file.write_all(a)?;
        self.file.write_all(b)?;
        self.file.flush()
    }
}

impl Write for StageLog {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = io::stderr().write_all(buf);
        let room = usize::try_from(self.head_limit.saturating_sub(self.written)).unwrap_or(0);
        let (head, rest) = buf.split_at(room.min(buf.len()));
        // An error names the log: "No space left on device" alone says nothing of where.
        self.file.write_all(head).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot write the stage log {}: {e}", self.path.display()),
            )
        })?;
        self.written += head.len() as u64;
        // Past the cap: keep the newest bytes, count what falls out.
        self.tail.extend(rest);
        while self.tail.len() > self.tail_limit {
            let excess = self.tail.len() - self.tail_limit;
            self.tail.drain(..excess);
            self.dropped += excess as u64;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}
