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

/// A string as one POSIX shell word, quoted only when it must be: `--nodes=2` stays as it is,
/// `a b` becomes `'a b'`. For command lines people read (job scripts, logs).
pub fn shell_word(value: &str) -> String {
    let plain = !value.is_empty()
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-=:,@+".contains(c));
    if plain {
        value.to_string()
    } else {
        shell_quote(value)
    }
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

    #[test]
    fn a_word_is_quoted_only_when_it_must_be() {
        assert_eq!(shell_word("--nodes=2"), "--nodes=2");
        assert_eq!(shell_word("/a:/b,/c@d+e"), "/a:/b,/c@d+e");
        assert_eq!(shell_word(""), "''");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("$RANK"), "'$RANK'");
        assert_eq!(shell_word("~"), "'~'");
    }
}
