//! What differs between two published artifacts, as `dvc params diff` and `dvc metrics diff`
//! show it: the params that changed (old → new, by dotted path), the inputs whose content
//! changed, and the numeric metrics (at any depth: an eval's `generation.accuracy`) with their
//! deltas. Curves and other arrays in the metrics are not compared point by point (`plot` is
//! for those), and neither is text (a `cmd` stage's rendered command names its attempt's own
//! directory, so it differs in every run). Two runs of the history compare stage by stage.

use crate::store::history::Entry;
use crate::store::{Artifact, InputRecord, short};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// One value that differs: `None` where one side has no such entry.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    pub name: String,
    pub a: Option<Value>,
    pub b: Option<Value>,
}

impl Change {
    /// `b − a`, when both are numbers.
    pub fn delta(&self) -> Option<f64> {
        Some(self.b.as_ref()?.as_f64()? - self.a.as_ref()?.as_f64()?)
    }
}

/// The differences between artifact `a` and artifact `b`.
#[derive(Debug, Clone, PartialEq)]
pub struct Diff {
    pub a: Side,
    pub b: Side,
    pub params: Vec<Change>,
    pub inputs: Vec<Change>,
    pub metrics: Vec<Change>,
}

/// Which artifact a side is.
#[derive(Debug, Clone, PartialEq)]
pub struct Side {
    pub stage: String,
    pub op: String,
    pub key: String,
    pub built: String,
}

impl Side {
    fn of(a: &Artifact) -> Side {
        Side {
            stage: a.stage.clone(),
            op: format!("{} v{}", a.op, a.op_version),
            key: a.key.clone(),
            built: a.started_at.clone(),
        }
    }
}

/// Compares `a` with `b`.
pub fn diff(a: &Artifact, b: &Artifact) -> Diff {
    let mut pa = BTreeMap::new();
    flatten("", &a.params, &mut pa);
    if let Some(cmd) = &a.cmd {
        pa.insert("cmd".into(), Value::from(cmd.clone()));
    }
    let mut pb = BTreeMap::new();
    flatten("", &b.params, &mut pb);
    if let Some(cmd) = &b.cmd {
        pb.insert("cmd".into(), Value::from(cmd.clone()));
    }
    let input = |i: &InputRecord| match i {
        InputRecord::File { path, digest } => json!(format!("{path} ({})", short(digest))),
        InputRecord::Upstream {
            stage,
            output,
            digest,
            ..
        } => json!(format!("{stage}:{output} ({})", short(digest))),
    };
    let ia: BTreeMap<String, Value> = a
        .inputs
        .iter()
        .map(|(n, i)| (n.clone(), input(i)))
        .collect();
    let ib: BTreeMap<String, Value> = b
        .inputs
        .iter()
        .map(|(n, i)| (n.clone(), input(i)))
        .collect();
    Diff {
        a: Side::of(a),
        b: Side::of(b),
        params: changes(&pa, &pb),
        inputs: changes(&ia, &ib),
        metrics: changes(&final_metrics(&a.metrics), &final_metrics(&b.metrics)),
    }
}

/// `value`'s leaves by dotted path (`model.hidden`); arrays are leaves.
pub(crate) fn flatten(prefix: &str, value: &Value, out: &mut BTreeMap<String, Value>) {
    match value {
        Value::Object(map) if !map.is_empty() => {
            for (k, v) in map {
                // A key with a dot of its own (a Megatron override, `model.num_layers`) is
                // quoted, so it never reads as a nested path.
                let k = if k.contains('.') {
                    format!("\"{k}\"")
                } else {
                    k.clone()
                };
                let path = if prefix.is_empty() {
                    k
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&path, v, out);
            }
        }
        _ if prefix.is_empty() => {}
        _ => {
            out.insert(prefix.to_string(), value.clone());
        }
    }
}

/// An artifact's final figures by dotted path: the numbers and flags among its metrics, at
/// any depth (an eval's `generation.accuracy`), not inside arrays (curves, examples).
pub fn final_metrics(metrics: &serde_json::Map<String, Value>) -> BTreeMap<String, Value> {
    let mut flat = BTreeMap::new();
    flatten("", &Value::Object(metrics.clone()), &mut flat);
    flat.retain(|_, v| v.is_number() || v.is_boolean());
    flat
}

fn changes(a: &BTreeMap<String, Value>, b: &BTreeMap<String, Value>) -> Vec<Change> {
    let names: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    // Numbers compare by value: `1` and `1.0` are the same.
    names
        .into_iter()
        .filter(|n| !same(a.get(*n), b.get(*n)))
        .map(|n| Change {
            name: n.clone(),
            a: a.get(n).cloned(),
            b: b.get(n).cloned(),
        })
        .collect()
}

/// Whether two values are the same; numbers compare by value: `1` and `1.0` are the same.
pub(crate) fn same(x: Option<&Value>, y: Option<&Value>) -> bool {
    match (x, y) {
        (Some(x), Some(y)) if x.is_number() && y.is_number() => x.as_f64() == y.as_f64(),
        _ => x == y,
    }
}

/// A value as text: a whole number as it is (a seed of 1234567 is not 1.235e6), another
/// number short ([`number`]), text as it is, anything else as JSON.
pub(crate) fn plain(v: &Value) -> String {
    match v {
        Value::Number(n) => match n.as_f64() {
            Some(f) if !(n.is_i64() || n.is_u64()) => number(f),
            _ => n.to_string(),
        },
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// A change as the last cells of a Markdown table's row: `` `name` | a | b | Δ ``.
fn markdown_cells(c: &Change) -> String {
    let cell = |s: String| s.replace('|', "\\|");
    format!(
        "`{}` | {} | {} | {}",
        cell(c.name.replace('`', "'")),
        cell(shown(&c.a)),
        cell(shown(&c.b)),
        c.delta().map(signed).unwrap_or_default()
    )
}

fn shown(v: &Option<Value>) -> String {
    match v {
        None => "–".into(),
        Some(Value::String(s)) => s.clone(),
        Some(v) => v.to_string(),
    }
}

/// A signed difference, short: `+0.5`, `-2`, `+1.5e-5`.
fn signed(d: f64) -> String {
    match d {
        0.0 => "0".into(),
        d if d < 0.0 => format!("-{}", number(-d)),
        d => format!("+{}", number(d)),
    }
}

/// A number, short: six places at most between 0.001 and a million (`0.5`, `2`), else with
/// an exponent (`1.500e-5`): a learning rate of 1e-7 is not 0.
pub(crate) fn number(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if (1e-3..1e6).contains(&v.abs()) {
        let fixed = format!("{v:.6}");
        return fixed
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string();
    }
    format!("{v:.3e}")
}

/// `(+0.12, +3.4%)`, or nothing for values that are not both numbers.
fn delta_text(c: &Change) -> String {
    let Some(d) = c.delta() else {
        return String::new();
    };
    let a = c.a.as_ref().and_then(Value::as_f64).unwrap_or(0.0);
    let relative = if a != 0.0 {
        format!(", {:+.1}%", 100.0 * d / a.abs())
    } else {
        String::new()
    };
    format!("({}{relative})", signed(d))
}

impl Diff {
    /// Whether the two artifacts differ in nothing compared.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty() && self.inputs.is_empty() && self.metrics.is_empty()
    }

    /// The plain-text listing.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for (label, s) in [("a", &self.a), ("b", &self.b)] {
            let _ = writeln!(
                out,
                "{label}  {} [{}] {}, built {}",
                s.stage,
                short(&s.key),
                s.op,
                s.built
            );
        }
        if self.is_empty() {
            out.push_str("no differences in params, inputs or metrics\n");
            return out;
        }
        listing(
            &mut out,
            "",
            &[
                ("params", &self.params),
                ("inputs", &self.inputs),
                ("metrics", &self.metrics),
            ],
        );
        out
    }

    /// A Markdown table, for a pull-request comment.
    pub fn markdown(&self) -> String {
        let mut out = format!(
            "`{}` [`{}`] → `{}` [`{}`]\n\n",
            self.a.stage,
            short(&self.a.key),
            self.b.stage,
            short(&self.b.key)
        );
        if self.is_empty() {
            out.push_str("No differences in params, inputs or metrics.\n");
            return out;
        }
        out.push_str("| | name | a | b | Δ |\n| --- | --- | --- | --- | --- |\n");
        for (title, list) in [
            ("param", &self.params),
            ("input", &self.inputs),
            ("metric", &self.metrics),
        ] {
            for c in list {
                let _ = writeln!(out, "| {title} | {} |", markdown_cells(c));
            }
        }
        out
    }

    /// The differences as JSON.
    pub fn json(&self) -> Value {
        let side = |s: &Side| json!({"stage": s.stage, "op": s.op, "key": s.key, "built": s.built});
        json!({
            "a": side(&self.a),
            "b": side(&self.b),
            "params": change_list(&self.params),
            "inputs": change_list(&self.inputs),
            "metrics": change_list(&self.metrics),
        })
    }
}

/// What differs between two runs of the history, stage by stage, from what the history kept
/// of each (params and final metrics): it needs no artifact, so it works after `gc`.
#[derive(Debug, Clone, PartialEq)]
pub struct RunsDiff {
    pub a: RunSide,
    pub b: RunSide,
    /// The stages whose key differs between the runs, in name order.
    pub stages: Vec<StageDiff>,
    /// How many stages have the same key in both.
    pub same: usize,
}

/// Which run a side is.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSide {
    pub run: u64,
    pub manifest: String,
    pub variant: Option<String>,
    pub overrides: Vec<String>,
    pub finished_at: String,
}

/// One stage whose artifact differs between two runs; a key is `None` on the side without it.
#[derive(Debug, Clone, PartialEq)]
pub struct StageDiff {
    pub stage: String,
    pub a: Option<String>,
    pub b: Option<String>,
    pub params: Vec<Change>,
    pub metrics: Vec<Change>,
}

/// Compares run `a` with run `b`.
pub fn diff_runs(a: &Entry, b: &Entry) -> RunsDiff {
    let side = |e: &Entry| RunSide {
        run: e.run,
        manifest: e.manifest.clone(),
        variant: e.variant.clone(),
        overrides: e.overrides.clone(),
        finished_at: e.finished_at.clone(),
    };
    let names: BTreeSet<&String> = a.stages.keys().chain(b.stages.keys()).collect();
    let mut stages = Vec::new();
    let mut same = 0;
    let empty = BTreeMap::new();
    for name in names {
        let (sa, sb) = (a.stages.get(name), b.stages.get(name));
        let key = |s: Option<&crate::store::history::StageEntry>| s.and_then(|s| s.key.clone());
        if sa.is_some() && sb.is_some() && key(sa) == key(sb) && key(sa).is_some() {
            same += 1;
            continue;
        }
        let (pa, pb) = (
            sa.map_or(&empty, |s| &s.params),
            sb.map_or(&empty, |s| &s.params),
        );
        let (ma, mb) = (
            sa.map_or(&empty, |s| &s.metrics),
            sb.map_or(&empty, |s| &s.metrics),
        );
        let both = sa.is_some() && sb.is_some();
        stages.push(StageDiff {
            stage: name.clone(),
            a: key(sa),
            b: key(sb),
            params: if both { changes(pa, pb) } else { Vec::new() },
            metrics: if both { changes(ma, mb) } else { Vec::new() },
        });
    }
    RunsDiff {
        a: side(a),
        b: side(b),
        stages,
        same,
    }
}

impl RunSide {
    fn line(&self) -> String {
        let mut line = format!("run {}  {}", self.run, self.manifest);
        if let Some(v) = &self.variant {
            let _ = write!(line, " -c {v}");
        }
        for o in &self.overrides {
            let _ = write!(line, " {o}");
        }
        let _ = write!(line, ", finished {}", self.finished_at);
        line
    }
}

impl StageDiff {
    fn keys(&self) -> String {
        let key = |k: &Option<String>| k.as_deref().map_or("–", short).to_string();
        format!("{} → {}", key(&self.a), key(&self.b))
    }
}

impl RunsDiff {
    pub fn text(&self) -> String {
        let mut out = format!("a  {}\nb  {}\n", self.a.line(), self.b.line());
        for s in &self.stages {
            let _ = writeln!(out, "{}  {}", s.stage, s.keys());
            listing(
                &mut out,
                "  ",
                &[("params", &s.params), ("metrics", &s.metrics)],
            );
        }
        let _ = writeln!(
            out,
            "{} stage(s) differ; {} have the same artifact in both runs",
            self.stages.len(),
            self.same
        );
        out
    }

    pub fn markdown(&self) -> String {
        let mut out = format!(
            "run {} → run {}: {} stage(s) differ, {} the same\n\n",
            self.a.run,
            self.b.run,
            self.stages.len(),
            self.same
        );
        if self.stages.is_empty() {
            return out;
        }
        out.push_str("| stage | | name | a | b | Δ |\n| --- | --- | --- | --- | --- | --- |\n");
        for s in &self.stages {
            let _ = writeln!(out, "| `{}` | key | | {} | | |", s.stage, s.keys());
            for (title, list) in [("param", &s.params), ("metric", &s.metrics)] {
                for c in list {
                    let _ = writeln!(out, "| `{}` | {title} | {} |", s.stage, markdown_cells(c));
                }
            }
        }
        out
    }

    pub fn json(&self) -> Value {
        let side = |s: &RunSide| {
            json!({"run": s.run, "manifest": s.manifest, "variant": s.variant,
                   "overrides": s.overrides, "finished_at": s.finished_at})
        };
        let stages: Vec<Value> = self
            .stages
            .iter()
            .map(|s| {
                json!({"stage": s.stage, "a": s.a, "b": s.b,
                       "params": change_list(&s.params), "metrics": change_list(&s.metrics)})
            })
            .collect();
        json!({"a": side(&self.a), "b": side(&self.b), "stages": stages, "same": self.same})
    }
}

/// Each non-empty list under its title, a change a line: `name  old → new  (delta)`.
fn listing(out: &mut String, indent: &str, lists: &[(&str, &Vec<Change>)]) {
    for (title, list) in lists {
        if list.is_empty() {
            continue;
        }
        let _ = writeln!(out, "{indent}{title}");
        let width = list.iter().map(|c| c.name.len()).max().unwrap_or(0);
        for c in *list {
            let line = format!(
                "{indent}  {:width$}  {} → {}  {}",
                c.name,
                shown(&c.a),
                shown(&c.b),
                delta_text(c)
            );
            let _ = writeln!(out, "{}", line.trim_end());
        }
    }
}

fn change_list(l: &[Change]) -> Vec<Value> {
    l.iter()
        .map(|c| json!({"name": c.name, "a": c.a, "b": c.b, "delta": c.delta()}))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(key: &str, params: Value, metrics: Value, digest: &str) -> Artifact {
        serde_json::from_value(json!({
            "schema": 1, "key": key, "stage": "sft", "op": "sft", "op_version": 1,
            "params": params,
            "inputs": {"model": {"kind": "upstream", "stage": "pretrain", "output": "model",
                                 "key": "k", "digest": digest}},
            "outputs": {}, "metrics": metrics, "upstream_keys": [], "manifest": "m.yaml",
            "started_at": "2026-11-24T00:00:00Z", "seconds": 1.0, "host": "h",
            "engine_version": "0"
        }))
        .unwrap()
    }

    #[test]
    fn an_evals_nested_figures_are_compared_by_path() {
        let eval = |accuracy: f64, perplexity: f64| {
            json!({"generation": {"accuracy": accuracy, "examples": [{"reward": accuracy}],
                                  "split": "test"},
                   "perplexity": {"perplexity": perplexity, "tokens": 8192}})
        };
        let d = diff(
            &artifact("aaaa", json!({}), eval(0.5, 12.9), "d"),
            &artifact("bbbb", json!({}), eval(0.65, 54.7), "d"),
        );
        let names: Vec<&str> = d.metrics.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["generation.accuracy", "perplexity.perplexity"]);
        let line = d
            .text()
            .lines()
            .find(|l| l.contains("generation.accuracy"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "));
        assert_eq!(
            line.as_deref(),
            Some("generation.accuracy 0.5 → 0.65 (+0.15, +30.0%)")
        );
    }

    #[test]
    fn changed_params_inputs_and_metrics_are_listed_with_deltas() {
        let a = artifact(
            "aaaa",
            json!({"lr": 1e-3, "model": {"hidden": 32, "heads": 4}, "steps": 8}),
            json!({"final_loss": 2.0, "step": 8, "curve": [1, 2], "command": "a"}),
            "d1",
        );
        let b = artifact(
            "bbbb",
            json!({"lr": 2e-3, "model": {"hidden": 32, "heads": 8}, "steps": 8, "warmup": 2}),
            json!({"final_loss": 1.5, "step": 8, "curve": [1, 2, 3], "command": "b"}),
            "d2",
        );
        let d = diff(&a, &b);
        let names = |l: &[Change]| l.iter().map(|c| c.name.clone()).collect::<Vec<_>>();
        assert_eq!(names(&d.params), ["lr", "model.heads", "warmup"]);
        assert_eq!(d.params[2].a, None);
        assert_eq!(names(&d.inputs), ["model"]);
        // The curve is no single value, and the command is text: neither is compared.
        assert_eq!(names(&d.metrics), ["final_loss"]);
        assert_eq!(d.metrics[0].delta(), Some(-0.5));
        let text = d.text();
        assert!(
            text.contains("final_loss  2.0 → 1.5  (-0.5, -25.0%)"),
            "{text}"
        );
        assert!(text.contains("warmup       – → 2"), "{text}");
        assert!(
            d.markdown()
                .contains("| metric | `final_loss` | 2.0 | 1.5 | -0.5 |")
        );
        assert_eq!(d.json()["metrics"][0]["delta"], -0.5);
        assert_eq!(
            (signed(2e-5), signed(-3.0), signed(1e7)),
            ("+2.000e-5".into(), "-3".into(), "+1.000e7".into())
        );
        assert!(diff(&a, &a).is_empty());
        // A dotted key is not a nested path; 1 and 1.0 are one value.
        let c = artifact(
            "c",
            json!({"overrides": {"model.x": 1}, "model": {"x": 1}}),
            json!({}),
            "d",
        );
        let e = artifact(
            "e",
            json!({"overrides": {"model.x": 1.0}, "model": {"x": 2}}),
            json!({}),
            "d",
        );
        assert_eq!(names(&diff(&c, &e).params), ["model.x"]);
        let mut flat = BTreeMap::new();
        flatten("", &json!({"overrides": {"model.x": 1}}), &mut flat);
        assert!(flat.contains_key("overrides.\"model.x\""), "{flat:?}");
        assert!(diff(&a, &a).text().contains("no differences"));
    }
}
