//! The stage key: the one hash that decides whether a stage must run.
//!
//! ```text
//! key = blake3("nemo-dag key v1\n" ++ canonical JSON of {
//!         op, op_version, params, cmd, outputs,      (after templating and overrides)
//!         inputs: { name: content digest }          (source files and consumed upstream outputs)
//!       })
//! ```
//! Canonical JSON has sorted keys, no whitespace and one number form (see [`crate::doc`]).
//! Resources, the executor, the store path and the manifest's formatting are not in the key.
//! Because a downstream key covers the *content* of what it consumes (not the upstream key),
//! an upstream rerun that produces identical bytes leaves the downstream key unchanged:
//! early cutoff falls out of the definition.

use crate::manifest::Stage;
use crate::store::InputRecord;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write;

pub const KEY_FORMAT: &str = "nemo-dag key v1";

/// The key of a stage given the digests of everything it consumes: the canonical JSON of
/// `{cmd, inputs, op, op_version, outputs, params}` (keys in that sorted order), written
/// straight into one buffer — this runs for every stage on every `status`.
pub fn stage_key(stage: &Stage, inputs: &BTreeMap<String, InputRecord>) -> String {
    let mut text = String::with_capacity(512);
    text.push_str(KEY_FORMAT);
    text.push('\n');
    text.push_str("{\"cmd\":");
    match &stage.cmd {
        Some(cmd) => push_json_str(&mut text, cmd),
        None => text.push_str("null"),
    }
    text.push_str(",\"inputs\":{");
    for (i, (name, record)) in inputs.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        push_json_str(&mut text, name);
        text.push(':');
        push_json_str(&mut text, record.digest());
    }
    text.push_str("},\"op\":");
    push_json_str(&mut text, stage.op.name());
    let _ = write!(
        text,
        ",\"op_version\":{},\"outputs\":{{",
        stage.op.version()
    );
    for (i, (name, path)) in stage.outputs.iter().enumerate() {
        if i > 0 {
            text.push(',');
        }
        push_json_str(&mut text, name);
        text.push(':');
        push_json_str(&mut text, path);
    }
    text.push_str("},\"params\":");
    canonical(&stage.params, &mut text);
    text.push('}');
    blake3::hash(text.as_bytes()).to_hex().to_string()
}

fn push_json_str(out: &mut String, s: &str) {
    if s.bytes()
        .all(|b| b >= 0x20 && b != b'"' && b != b'\\' && b < 0x7f)
    {
        out.push('"');
        out.push_str(s);
        out.push('"');
    } else {
        let _ = write!(out, "{}", Value::String(s.to_string()));
    }
}

/// Sorted keys, no whitespace, numbers as serde_json prints them (shortest round-trip form).
pub fn canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                push_json_str(out, k);
                out.push(':');
                canonical(&map[k], out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                canonical(v, out);
            }
            out.push(']');
        }
        other => {
            let _ = write!(out, "{other}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn canonical_json_sorts_keys_and_normalises_numbers() {
        let mut a = String::new();
        canonical(&json!({"b": 1, "a": {"y": [1, 2.5], "x": "s"}}), &mut a);
        assert_eq!(a, r#"{"a":{"x":"s","y":[1,2.5]},"b":1}"#);
        let mut x = String::new();
        let mut y = String::new();
        canonical(&crate::doc::plain_scalar("1e-4"), &mut x);
        canonical(&crate::doc::plain_scalar("0.0001"), &mut y);
        assert_eq!(x, y);
    }

    #[test]
    fn the_direct_key_encoding_is_the_canonical_json_of_the_components() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.yaml");
        std::fs::write(
            &path,
            "stages:\n  s:\n    op: cmd\n    params: {b: [1, 2.5], a: {z: \"q\\\"x\", y: null}}\n    outputs: {o: o.txt, \"é\": e.txt}\n    cmd: \"echo > {outputs.o}\"\n",
        )
        .unwrap();
        let m = crate::manifest::Manifest::load(&crate::manifest::LoadArgs::new(
            path,
            crate::testing::ops(),
        ))
        .unwrap();
        let stage = &m.stages["s"];
        let inputs = BTreeMap::from([(
            "x\ty".to_string(),
            InputRecord::File {
                path: "p".into(),
                digest: "d1".into(),
            },
        )]);
        let digests: serde_json::Map<String, Value> = inputs
            .iter()
            .map(|(k, r)| (k.clone(), Value::String(r.digest().into())))
            .collect();
        let parts = serde_json::json!({
            "op": stage.op.name(), "op_version": stage.op.version(), "params": stage.params,
            "cmd": stage.cmd, "outputs": stage.outputs, "inputs": digests,
        });
        let mut text = format!("{KEY_FORMAT}\n");
        canonical(&parts, &mut text);
        assert_eq!(
            stage_key(stage, &inputs),
            blake3::hash(text.as_bytes()).to_hex().to_string()
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
