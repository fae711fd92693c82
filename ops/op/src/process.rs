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

/// [`shell_word`], but a word that holds single quotes and nothing double quotes would expand
/// goes in double quotes: `"checkpoint.save='/out/ckpt'"` reads better in a script than
/// `'checkpoint.save='\''/out/ckpt'\'''`.
pub fn readable_shell_word(value: &str) -> String {
    let bare = shell_word(value);
    if bare == value || value.contains(['"', '$', '`', '\\', '!']) {
        bare
    } else {
        format!("\"{value}\"")
    }
}

/// How a finished process ended, for a message: `exited with status 2`, `was killed by a
/// signal`.
pub fn describe_exit(status: std::process::ExitStatus) -> String {
    match status.code() {
        Some(code) => format!("exited with status {code}"),
        None => "was killed by a signal".to_string(),
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

/// Run `command` to its end with stdout and stderr in one pipe (so their lines keep the order
/// the program wrote them), every byte copied to `log` as it comes and every whole line handed
/// to `on_line` (progress parsing). The command dies with the thread that started it. `Err`
/// only when it cannot start or its output cannot be read; its exit status is the caller's.
pub fn run_logged(
    command: &mut std::process::Command,
    log: &mut dyn std::io::Write,
    on_line: &mut dyn FnMut(&str),
) -> Result<std::process::ExitStatus, crate::RunError> {
    use std::io::Read;
    use std::os::unix::process::CommandExt;
    let (mut reader, writer) = std::io::pipe()?;
    command
        .stdin(std::process::Stdio::null())
        .stdout(writer.try_clone()?)
        .stderr(writer);
    // SAFETY: die_with_parent only calls prctl, which is async-signal-safe.
    unsafe {
        command.pre_exec(die_with_parent);
    }
    let mut child = command.spawn().map_err(|e| {
        crate::RunError::new(format!(
            "cannot start `{}`: {e}",
            command.get_program().to_string_lossy()
        ))
    })?;
    // Our copies of the pipe's write end live in `command`: replace them, or the read below
    // never sees the end of the output.
    command.stdout(std::process::Stdio::null());
    command.stderr(std::process::Stdio::null());
    let mut buf = [0u8; 8192];
    let mut line = Vec::new();
    loop {
        let n = reader.read(&mut buf)?;
        if n == 0 {
            break;
        }
        log.write_all(&buf[..n])?;
        log.flush()?;
        for &b in &buf[..n] {
            if b == b'\n' {
                on_line(&String::from_utf8_lossy(&line));
                line.clear();
            } else {
                line.push(b);
            }
        }
    }
    if !line.is_empty() {
        on_line(&String::from_utf8_lossy(&line));
    }
    Ok(child.wait()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_logged_run_keeps_the_output_in_order_and_hands_over_every_line() {
        let mut command = std::process::Command::new("sh");
        command
            .arg("-c")
            .arg("echo one; echo two >&2; printf three; exit 3");
        let mut log = Vec::new();
        let mut lines = Vec::new();
        let status = run_logged(&mut command, &mut log, &mut |l| lines.push(l.to_string()))
            .expect("sh starts");
        assert_eq!(status.code(), Some(3));
        assert_eq!(String::from_utf8_lossy(&log), "one\ntwo\nthree");
        assert_eq!(lines, ["one", "two", "three"]);
        let missing = run_logged(
            &mut std::process::Command::new("/no/such/program"),
            &mut log,
            &mut |_| {},
        );
        assert!(missing.is_err_and(|e| e.message.contains("cannot start `/no/such/program`")));
    }

    #[test]
    fn a_readable_word_reads_as_written_and_means_what_it_says() {
        assert_eq!(
            readable_shell_word("train.train_iters=10"),
            "train.train_iters=10"
        );
        assert_eq!(
            readable_shell_word("checkpoint.save='/s/out/checkpoint'"),
            "\"checkpoint.save='/s/out/checkpoint'\""
        );
        assert_eq!(readable_shell_word("a'$b"), "'a'\\''$b'");
        for word in ["checkpoint.save='/s/o'", "a'$b", "plain", "x y"] {
            let out = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", readable_shell_word(word)))
                .output()
                .unwrap();
            assert_eq!(String::from_utf8_lossy(&out.stdout), word);
        }
    }

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
