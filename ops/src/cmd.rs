//! `cmd`: run any external program as a stage.
//!
//! ```yaml
//! gen:
//!   op: cmd
//!   params: {n: 3}
//!   outputs: {nums: nums.txt}
//!   cmd: "seq {params.n} > {outputs.nums}"
//! ```
//!
//! The command runs under `sh -c` in the stage's private output directory. Before it runs,
//! the placeholders `{inputs.NAME}`, `{outputs.NAME}` and `{params.KEY}` (`{params.a.b}` for
//! nested values) are replaced by *single-quoted* shell words, so a parameter value is always
//! one literal argument and can never inject shell syntax. Any other brace (`awk '{print $1}'`)
//! is left alone. Every declared output must exist when the command exits 0, or the stage fails.

use nemo_dag_op::process::{die_with_parent, shell_quote};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, RunContext, RunError, Spec, StageDecl};
use serde_json::Value;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};

pub struct Cmd;

static SPEC: Spec = Spec {
    name: "cmd",
    version: 1,
    summary: "run a shell command with quoted {inputs.X} {outputs.X} {params.X} placeholders",
    inputs: &[],
    other_inputs: Some("any input, as `{inputs.NAME}` in the command"),
    outputs: Outputs::Declared,
    resumable: false,
};

impl Op for Cmd {
    type Params = Value;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, _params: &Value, stage: &StageDecl) -> Result<(), DeclError> {
        let Some(cmd) = stage.cmd else {
            return Err(
                DeclError::new(&[], "a `cmd` stage needs a `cmd:` command line")
                    .with_help("add e.g. `cmd: \"seq {params.n} > {outputs.nums}\"`"),
            );
        };
        if stage.outputs.is_empty() {
            return Err(
                DeclError::new(&[], "a `cmd` stage must declare at least one output").with_help(
                    "add e.g. `outputs: {result: result.txt}` and write to {outputs.result}",
                ),
            );
        }
        for (name, rel) in stage.outputs {
            check_relative(rel).map_err(|why| DeclError::new(&["outputs", name], why))?;
        }
        for piece in parse(cmd) {
            if let Piece::Placeholder { kind, path } = piece {
                resolve(kind, &path, stage, None).map_err(|why| DeclError::new(&["cmd"], why))?;
            }
        }
        Ok(())
    }

    fn run(&self, _params: &Value, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let cmd = ctx.stage.cmd.ok_or_else(|| RunError::new("no cmd"))?;
        let line = expand(cmd, &ctx.stage, ctx)?;
        for rel in ctx.stage.outputs.values() {
            if let Some(parent) = ctx.out_dir.join(rel).parent() {
                std::fs::create_dir_all(parent)?;
            }
        }
        writeln!(ctx.log, "$ {line}")?;

        // One pipe for stdout and stderr keeps their lines in the order the program wrote them.
        let (mut reader, writer) = std::io::pipe()?;
        let mut command = Command::new("sh");
        command
            .arg("-c")
            .arg(&line)
            .current_dir(ctx.out_dir)
            .env("NEMO_DAG_STAGE", ctx.stage.name)
            .env("NEMO_DAG_OUT", ctx.out_dir)
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer);
        // If the process driving this stage dies, the command dies with it.
        // SAFETY: die_with_parent only calls prctl, which is async-signal-safe.
        unsafe {
            command.pre_exec(die_with_parent);
        }
        let mut child = command
            .spawn()
            .map_err(|e| RunError::new(format!("cannot start `sh`: {e}")))?;
        drop(command); // closes our copies of the pipe's write end
        let mut buf = [0u8; 8192];
        loop {
            let n = reader.read(&mut buf)?;
            if n == 0 {
                break;
            }
            ctx.log.write_all(&buf[..n])?;
            ctx.log.flush()?;
        }
        let status = child.wait()?;
        if !status.success() {
            let how = match status.code() {
                Some(code) => format!("exited with status {code}"),
                None => "was killed by a signal".to_string(),
            };
            return Err(RunError::new(format!("the command {how}")));
        }
        let missing: Vec<String> = ctx
            .stage
            .outputs
            .iter()
            .filter(|(_, rel)| !ctx.out_dir.join(rel).exists())
            .map(|(name, rel)| format!("{name} ({rel})"))
            .collect();
        if !missing.is_empty() {
            return Err(RunError::new(format!(
                "the command exited 0 but did not write the declared output(s): {}",
                missing.join(", ")
            )));
        }
        let mut metrics = Metrics::new();
        metrics.insert("command".into(), Value::String(line));
        Ok(metrics)
    }
}

fn check_relative(rel: &str) -> Result<(), String> {
    let path = std::path::Path::new(rel);
    if rel.is_empty() || path.is_absolute() {
        return Err(format!(
            "output path `{rel}` must be a relative path inside the stage's output directory"
        ));
    }
    if path
        .components()
        .any(|c| matches!(c, std::path::Component::ParentDir))
    {
        return Err(format!("output path `{rel}` must not contain `..`"));
    }
    Ok(())
}

#[derive(Debug, PartialEq)]
enum Piece<'a> {
    Text(&'a str),
    Placeholder { kind: &'a str, path: Vec<&'a str> },
}

/// Split a command line into literal text and `{inputs|outputs|params.…}` placeholders.
fn parse(cmd: &str) -> Vec<Piece<'_>> {
    let mut pieces = Vec::new();
    let mut rest = cmd;
    let mut text_start = 0usize;
    let mut offset = 0usize;
    while let Some(open) = rest.find('{') {
        let after = &rest[open + 1..];
        let close = after.find('}');
        let placeholder = close.and_then(|close| {
            let inner = &after[..close];
            let (kind, tail) = inner.split_once('.')?;
            let valid_kind = matches!(kind, "inputs" | "outputs" | "params");
            let valid_tail = !tail.is_empty()
                && tail.split('.').all(|p| {
                    !p.is_empty()
                        && p.chars()
                            .all(|c| c.is_alphanumeric() || c == '_' || c == '-')
                });
            (valid_kind && valid_tail).then(|| (close, kind, tail.split('.').collect::<Vec<_>>()))
        });
        match placeholder {
            Some((close, kind, path)) => {
                let start = offset + open;
                if start > text_start {
                    pieces.push(Piece::Text(&cmd[text_start..start]));
                }
                pieces.push(Piece::Placeholder { kind, path });
                let end = start + 1 + close + 1;
                text_start = end;
                offset = end;
                rest = &cmd[end..];
            }
            None => {
                offset += open + 1;
                rest = &cmd[offset..];
            }
        }
    }
    if text_start < cmd.len() {
        pieces.push(Piece::Text(&cmd[text_start..]));
    }
    pieces
}

/// The unquoted value of one placeholder; with no run context, only checks that it exists.
fn resolve(
    kind: &str,
    path: &[&str],
    stage: &StageDecl,
    ctx: Option<&RunContext>,
) -> Result<String, String> {
    let name = path.join(".");
    match kind {
        "inputs" => {
            if path.len() != 1 || !stage.inputs.contains(&path[0]) {
                return Err(format!(
                    "`{{inputs.{name}}}` names no input of this stage (inputs: {})",
                    list(stage.inputs.iter().copied())
                ));
            }
            Ok(ctx
                .and_then(|c| c.inputs.get(path[0]))
                .map(|p| p.display().to_string())
                .unwrap_or_default())
        }
        "outputs" => {
            let Some(rel) = stage.outputs.get(path[0]).filter(|_| path.len() == 1) else {
                return Err(format!(
                    "`{{outputs.{name}}}` names no declared output (outputs: {})",
                    list(stage.outputs.keys().map(String::as_str))
                ));
            };
            Ok(ctx
                .map(|c| c.out_dir.join(rel).display().to_string())
                .unwrap_or_default())
        }
        _ => {
            let mut value = stage.params;
            for key in path {
                value = value.get(*key).ok_or_else(|| {
                    format!("`{{params.{name}}}` names no parameter of this stage")
                })?;
            }
            Ok(match value {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            })
        }
    }
}

fn list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let names: Vec<&str> = names.collect();
    if names.is_empty() {
        "none".to_string()
    } else {
        names.join(", ")
    }
}

/// Replace every placeholder by its single-quoted value.
fn expand(cmd: &str, stage: &StageDecl, ctx: &RunContext) -> Result<String, RunError> {
    let mut line = String::with_capacity(cmd.len());
    for piece in parse(cmd) {
        match piece {
            Piece::Text(text) => line.push_str(text),
            Piece::Placeholder { kind, path } => {
                let value = resolve(kind, &path, stage, Some(ctx)).map_err(RunError::new)?;
                line.push_str(&shell_quote(&value));
            }
        }
    }
    Ok(line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nemo_dag_op::AnyOp;
    use std::collections::BTreeMap;

    #[test]
    fn placeholders_are_found_and_other_braces_kept() {
        let pieces = parse("awk '{print $1}' {inputs.a} > {outputs.b}{x.y}");
        assert_eq!(
            pieces,
            vec![
                Piece::Text("awk '{print $1}' "),
                Piece::Placeholder {
                    kind: "inputs",
                    path: vec!["a"]
                },
                Piece::Text(" > "),
                Piece::Placeholder {
                    kind: "outputs",
                    path: vec!["b"]
                },
                Piece::Text("{x.y}"),
            ]
        );
    }

    #[test]
    fn quoting_survives_the_shell() {
        for value in ["plain", "it's", "$(touch X)", "a\nb", "'; rm -rf / #", ""] {
            let out = Command::new("sh")
                .arg("-c")
                .arg(format!("printf %s {}", shell_quote(value)))
                .output()
                .expect("sh runs");
            assert_eq!(String::from_utf8_lossy(&out.stdout), value);
        }
    }

    #[test]
    fn unknown_placeholders_are_declaration_errors() {
        let params = serde_json::json!({"n": 3});
        let outputs = BTreeMap::from([("o".to_string(), "o.txt".to_string())]);
        let stage = StageDecl {
            name: "s",
            params: &params,
            inputs: vec!["data"],
            outputs: &outputs,
            cmd: Some("cat {inputs.data} {params.m} > {outputs.o}"),
        };
        let err = AnyOp::check(&Cmd, &stage).unwrap_err();
        assert_eq!(err.path, vec!["cmd"]);
        assert!(err.message.contains("params.m"), "{}", err.message);
    }
}
