//! Preference pairs for DPO, as NeMo-RL reads them (`nemo_rl/data/datasets/preference_datasets/`).
//!
//! A preference file (a `generate` artifact's `preferences.jsonl`, or any JSONL file) holds one
//! pair a line, in either of NeMo-RL's shapes:
//!
//! - `{"context": [messages], "completions": [{"rank": 0, "completion": [messages]},
//!   {"rank": 1, "completion": [messages]}]}`: exactly two completions with different ranks;
//!   the lower rank is preferred (`chosen`).
//! - `{"prompt": …, "chosen": …, "rejected": …}` (`BinaryPreferenceDataset`): `prompt` a string
//!   (one user message) or a message list; `chosen`/`rejected` a string (one assistant
//!   message) or a message list.
//!
//! A row may also carry `tools` (a list of tool definitions, rendered by the template); other
//! keys (`task_name`, …) are ignored. Anything else is an error naming the file and line.

use crate::chat::{Json, Message, Role};
use std::path::{Path, PathBuf};

/// One preference row: a context and two completions, the chosen one first.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceRow {
    /// 1-based line in its file.
    pub line: usize,
    pub context: Vec<Message>,
    pub tools: Option<Vec<Json>>,
    pub chosen: Vec<Message>,
    pub rejected: Vec<Message>,
}

/// The preference file an input names (a `generate` directory's `preferences.jsonl`, or the
/// file itself) and its rows.
pub fn read_preferences(path: &Path) -> Result<(PathBuf, Vec<PreferenceRow>), crate::Error> {
    let file = if path.is_dir() {
        path.join("preferences.jsonl")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| {
        format!(
            "{}: {e} (the data must be a generate artifact's directory or a preference JSONL file)",
            file.display()
        )
    })?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = format!("{}:{}", file.display(), i + 1);
        let json = Json::parse(line).map_err(|e| format!("{at}: not JSON: {e}"))?;
        let row = parse_row(&json, i + 1).map_err(|why| format!("{at}: {why}"))?;
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(crate::Error::new(format!(
            "{} has no preference rows",
            file.display()
        )));
    }
    Ok((file, rows))
}

const SHAPES: &str = "a preference row is {\"context\": [messages], \"completions\": [{\"rank\": 0, \"completion\": [messages]}, {\"rank\": 1, \"completion\": [messages]}]} or {\"prompt\": …, \"chosen\": …, \"rejected\": …}";

/// One row in either shape (see the module docs).
fn parse_row(v: &Json, line: usize) -> Result<PreferenceRow, crate::Error> {
    if !matches!(v, Json::Object(_)) {
        return Err(crate::Error::new(format!("not a JSON object; {SHAPES}")));
    }
    let tools = match v.get("tools") {
        None | Some(Json::Null) => None,
        Some(Json::Array(items)) => Some(items.clone()),
        Some(_) => return Err("`tools` must be a list of tool definitions".into()),
    };
    let (context, chosen, rejected) = if v.get("context").is_some()
        || v.get("completions").is_some()
    {
        let context = messages(v.get("context"), "context", None)?;
        let completions = match v.get("completions") {
            Some(Json::Array(items)) => items,
            Some(_) => return Err("`completions` must be a list".into()),
            None => return Err("missing `completions`".into()),
        };
        if completions.len() != 2 {
            return Err(crate::Error::new(format!(
                "DPO needs exactly two completions, this row has {}",
                completions.len()
            )));
        }
        let mut ranked = Vec::new();
        for (k, c) in completions.iter().enumerate() {
            let rank = match c.get("rank") {
                Some(Json::Number(n)) => n
                    .as_i64()
                    .ok_or_else(|| format!("completions[{k}].rank must be an integer"))?,
                Some(_) => {
                    return Err(crate::Error::new(format!(
                        "completions[{k}].rank must be an integer"
                    )));
                }
                None => {
                    return Err(crate::Error::new(format!("completions[{k}] has no `rank`")));
                }
            };
            let name = format!("completions[{k}].completion");
            ranked.push((rank, messages(c.get("completion"), &name, None)?));
        }
        if ranked[0].0 == ranked[1].0 {
            return Err(crate::Error::new(format!(
                "both completions have rank {}; the lower rank is the preferred one",
                ranked[0].0
            )));
        }
        ranked.sort_by_key(|(rank, _)| *rank);
        let rejected = ranked.pop().map(|(_, m)| m).unwrap_or_default();
        let chosen = ranked.pop().map(|(_, m)| m).unwrap_or_default();
        (context, chosen, rejected)
    } else if v.get("prompt").is_some() || v.get("chosen").is_some() || v.get("rejected").is_some()
    {
        (
            messages(v.get("prompt"), "prompt", Some(Role::User))?,
            messages(v.get("chosen"), "chosen", Some(Role::Assistant))?,
            messages(v.get("rejected"), "rejected", Some(Role::Assistant))?,
        )
    } else {
        return Err(SHAPES.into());
    };
    Ok(PreferenceRow {
        line,
        context,
        tools,
        chosen,
        rejected,
    })
}

/// A non-empty message list; a string is one message of `string_role` where that is allowed.
fn messages(
    v: Option<&Json>,
    name: &str,
    string_role: Option<Role>,
) -> Result<Vec<Message>, crate::Error> {
    match (v, string_role) {
        (None | Some(Json::Null), _) => Err(crate::Error::new(format!("missing `{name}`"))),
        (Some(Json::String(s)), Some(role)) => Ok(vec![Message::new(role, s.clone())]),
        (Some(Json::Array(items)), _) if items.is_empty() => Err(crate::Error::new(format!(
            "`{name}` is an empty message list"
        ))),
        (Some(Json::Array(items)), _) => items
            .iter()
            .enumerate()
            .map(|(k, m)| {
                Message::try_from(m.clone())
                    .map_err(|e| crate::Error::new(format!("{name}[{k}]: {e}")))
            })
            .collect(),
        (Some(_), Some(_)) => Err(crate::Error::new(format!(
            "`{name}` must be a string or a message list"
        ))),
        (Some(_), None) => Err(crate::Error::new(format!(
            "`{name}` must be a message list"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("nemo-dag-pref-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn read_err(dir: &Path, rows: &str) -> String {
        let f = dir.join("p.jsonl");
        std::fs::write(&f, rows).unwrap();
        read_preferences(&f).unwrap_err().message
    }

    #[test]
    fn both_shapes_read_and_bad_rows_name_their_line() {
        let dir = tempdir("rows");
        let f = dir.join("p.jsonl");
        let good = r#"{"context": [{"role": "user", "content": "q"}], "completions": [{"rank": 1, "completion": [{"role": "assistant", "content": "bad"}]}, {"rank": 0, "completion": [{"role": "assistant", "content": "good"}]}], "task_name": "x"}"#;
        let binary = r#"{"prompt": "q", "chosen": "good", "rejected": [{"role": "assistant", "content": "bad"}]}"#;
        std::fs::write(&f, format!("{good}\n\n{binary}\n")).unwrap();
        let (file, rows) = read_preferences(&f).unwrap();
        assert_eq!(file, f);
        assert_eq!(rows.len(), 2);
        for r in &rows {
            assert_eq!(r.context, [Message::new(Role::User, "q")]);
            assert_eq!(
                r.chosen,
                [Message::new(Role::Assistant, "good")],
                "lower rank first"
            );
            assert_eq!(r.rejected, [Message::new(Role::Assistant, "bad")]);
        }
        assert_eq!((rows[0].line, rows[1].line), (1, 3));
        // A directory reads its preferences.jsonl.
        std::fs::rename(&f, dir.join("preferences.jsonl")).unwrap();
        assert_eq!(read_preferences(&dir).unwrap().1, rows);

        let at = format!("{}:2: ", dir.join("p.jsonl").display());
        let three = good.replace(
            r#"{"rank": 0,"#,
            r#"{"rank": 2, "completion": [{"role": "assistant", "content": "x"}]}, {"rank": 0,"#,
        );
        for (bad, why) in [
            (three.as_str(), "exactly two completions, this row has 3"),
            (
                &good.replace(r#""rank": 0"#, r#""rank": 1"#),
                "both completions have rank 1",
            ),
            (
                &good.replace(r#""rank": 0, "#, ""),
                "completions[1] has no `rank`",
            ),
            (
                r#"{"context": [{"role": "user", "content": "q"}]}"#,
                "missing `completions`",
            ),
            (r#"{"completions": []}"#, "missing `context`"),
            (r#"{"prompt": "q", "chosen": "a"}"#, "missing `rejected`"),
            (
                r#"{"prompt": 3, "chosen": "a", "rejected": "b"}"#,
                "`prompt` must be a string or a message list",
            ),
            (
                r#"{"prompt": "q", "chosen": [], "rejected": "b"}"#,
                "`chosen` is an empty message list",
            ),
            (
                r#"{"prompt": "q", "chosen": [{"content": "a"}], "rejected": "b"}"#,
                "chosen[0]: message has no role",
            ),
            (r#"{"messages": []}"#, "a preference row is"),
            ("[1, 2]", "not a JSON object"),
            ("{oops", "not JSON"),
        ] {
            let e = read_err(&dir, &format!("{good}\n{bad}\n"));
            assert!(e.starts_with(&at) && e.contains(why), "{bad}\n→ {e}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
