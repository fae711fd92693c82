//! What a stage's processes used of the machine: CPU time, bytes read and written, peak
//! memory. Measured in the `exec` process that runs the op, so it covers the op's own work and
//! every child it started and waited for (a `cmd`'s command and what that starts). A launched
//! stage's ranks are not its children (`srun` starts them under Slurm's daemons), so `exec`
//! records no CPU time or bytes for it.

use std::time::Duration;

/// Counters that only grow: CPU time and I/O, of this process and its waited-for children.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    pub user: Duration,
    pub system: Duration,
    /// From `/proc/self/io` (`rchar`, `wchar`): bytes through read and write system calls, to
    /// files, pipes and sockets alike. Pages of a memory-mapped file are not counted. `None`
    /// where the kernel does not say.
    pub read: Option<u64>,
    pub written: Option<u64>,
}

impl Counters {
    /// The counters now.
    pub fn now() -> Counters {
        let (user_self, system_self) = cpu(libc::RUSAGE_SELF);
        let (user_children, system_children) = cpu(libc::RUSAGE_CHILDREN);
        let io = std::fs::read_to_string("/proc/self/io").ok();
        let field = |name: &str| {
            io.as_deref()?
                .lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Counters {
            user: user_self + user_children,
            system: system_self + system_children,
            read: field("rchar"),
            written: field("wchar"),
        }
    }

    /// What was used between `earlier` and `self`.
    pub fn since(&self, earlier: &Counters) -> Counters {
        let minus = |a: Option<u64>, b: Option<u64>| Some(a?.saturating_sub(b?));
        Counters {
            user: self.user.saturating_sub(earlier.user),
            system: self.system.saturating_sub(earlier.system),
            read: minus(self.read, earlier.read),
            written: minus(self.written, earlier.written),
        }
    }
}

/// User and system CPU time of `who` (`RUSAGE_SELF` or `RUSAGE_CHILDREN`).
fn cpu(who: libc::c_int) -> (Duration, Duration) {
    let Some(usage) = rusage(who) else {
        return (Duration::ZERO, Duration::ZERO);
    };
    let time = |t: libc::timeval| {
        Duration::from_secs(u64::try_from(t.tv_sec).unwrap_or(0))
            + Duration::from_micros(u64::try_from(t.tv_usec).unwrap_or(0))
    };
    (time(usage.ru_utime), time(usage.ru_stime))
}

/// The peak resident memory of this process or of its largest waited-for child, in bytes.
pub fn peak_rss_bytes() -> u64 {
    let peak = |who| {
        rusage(who).map_or(0, |u| u64::try_from(u.ru_maxrss).unwrap_or(0) * 1024) // Linux: KiB
    };
    peak(libc::RUSAGE_SELF).max(peak(libc::RUSAGE_CHILDREN))
}

fn rusage(who: libc::c_int) -> Option<libc::rusage> {
    // SAFETY: getrusage fills the struct it is given; all-zero is a valid rusage.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    (unsafe { libc::getrusage(who, &mut usage) } == 0).then_some(usage)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Work done between two readings shows in their difference: CPU time spun here, bytes
    /// written to and read back from a file, and a child's CPU time once it is waited for.
    #[test]
    fn counters_see_cpu_io_and_children() {
        let before = Counters::now();
        // Spin for 300 ms of this thread's CPU time (not wall time: on a busy machine a wall
        // clock spin gets less CPU than it asks for).
        let thread_cpu = || {
            let mut t = libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            // SAFETY: clock_gettime writes the timespec it is given.
            unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
            Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
        };
        let start = thread_cpu();
        let mut x = 0u64;
        while thread_cpu() - start < Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        let dir = std::env::temp_dir().join(format!("nemo-dag-usage-{}", std::process::id()));
        let data = vec![7u8; 3 << 20];
        std::fs::File::create(&dir)
            .and_then(|mut f| f.write_all(&data))
            .unwrap();
        let mut back = Vec::new();
        std::fs::File::open(&dir)
            .and_then(|mut f| f.read_to_end(&mut back))
            .unwrap();
        let _ = std::fs::remove_file(&dir);
        let used = Counters::now().since(&before);
        assert!(
            used.user + used.system >= Duration::from_millis(200),
            "{used:?}"
        );
        if let (Some(r), Some(w)) = (used.read, used.written) {
            assert!(w >= 3 << 20 && r >= 3 << 20, "{used:?}");
        }

        let before = Counters::now();
        let status = std::process::Command::new("sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
            .status()
            .unwrap();
        assert!(status.success());
        let used = Counters::now().since(&before);
        assert!(
            used.user + used.system >= Duration::from_millis(50),
            "a child's CPU time: {used:?}"
        );
    }
}
