//! Process helpers the engine's executors and the `cmd` op share.

/// Quote a string as one POSIX shell word: `it's` → `'it'\''s'`.
pub fn shell_quote(value: &str) -> String {
    let mut quoted = String::with_capacity(value.len() + 2);
    quoted.push('\'');
    for c in value.chars() {
        if c == '\'' {
            quoted.push_str("'\\''");
        } else {
            quoted.push(c);
        }
    }
    quoted.push('\'');
    quoted
}

/// For `pre_exec`: the child gets SIGKILL when the thread that spawned it exits, so a killed
/// driver never leaves its stage commands running.
pub fn die_with_parent() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on the calling process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
    Ok(())
}

/// For `pre_exec` of a child that cleans up after itself: it gets SIGTERM when the thread that
/// spawned it exits (`nemo-dag exec` then kills its whole process group).
pub fn term_with_parent() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_PDEATHSIG) only sets a flag on the calling process.
    unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quoted_word_survives_the_shell() {
        assert_eq!(shell_quote("plain"), "'plain'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", shell_quote("a'b $(x) \"c\"\n")))
            .output()
            .unwrap();
        assert_eq!(out.stdout, b"a'b $(x) \"c\"\n");
    }
}
