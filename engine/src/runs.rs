//! `nemo-dag runs`: the run history as one table, as `dvc exp show` shows experiments. A row
//! is a run (a row for each point of a sweep the run made); its columns are when it ran, its
//! variant and overrides, how many stages it built, then the params and the final metrics of
//! its stages by `stage.path`. By default only the params and metrics that differ between the
//! rows shown are columns (all of them when there is one row): a recipe has hundreds of
//! figures, and the ones that changed are what a comparison is about.

use crate::diff::{plain, same};
use crate::store::history::Entry;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

/// Which columns to show.
#[derive(Debug, Clone, Default)]
pub struct Columns {
    /// Every param and metric, not only those that differ between the rows.
    pub all: bool,
    /// Only the params whose `stage.path` contains one of these (all of them when empty).
    pub params: Vec<String>,
    /// Only the metrics whose `stage.path` contains one of these.
    pub metrics: Vec<String>,
}

/// One row: a run, or one point of the sweeps in it.
struct Row<'a> {
    entry: &'a Entry,
    point: Option<&'a str>,
    params: BTreeMap<String, &'a Value>,
    metrics: BTreeMap<String, &'a Value>,
}

/// The rows of `entries`: a run with sweeps has one row per point, each with the stages that
/// are not swept and the copies at that point, under their declared names.
fn rows(entries: &[Entry]) -> Vec<Row<'_>> {
    let mut out = Vec::new();
    for entry in entries {
        let mut points: Vec<(usize, &str)> = entry
            .stages
            .values()
            .filter_map(|s| s.sweep.as_ref())
            .map(|s| (s.ordinal, s.point.as_str()))
            .collect();
        points.sort();
        let mut seen = BTreeSet::new();
        points.retain(|(_, p)| seen.insert(*p));
        let points: Vec<Option<&str>> = if points.is_empty() {
            vec![None]
        } else {
            points.into_iter().map(|(_, p)| Some(p)).collect()
        };
        for point in points {
            let mut row = Row {
                entry,
                point,
                params: BTreeMap::new(),
                metrics: BTreeMap::new(),
            };
            for (name, stage) in &entry.stages {
                let name = match &stage.sweep {
                    None => name.as_str(),
                    Some(s) if Some(s.point.as_str()) == point => s.stage.as_str(),
                    Some(_) => continue,
                };
                for (path, v) in &stage.params {
                    row.params.insert(format!("{name}.{path}"), v);
                }
                for (path, v) in &stage.metrics {
                    row.metrics.insert(format!("{name}.{path}"), v);
                }
            }
            out.push(row);
        }
    }
    out
}

/// The column names among `figures` to show: those matching a filter when there are filters,
/// else all of them with `all`, else those that differ between the rows. Also how many were
/// left out because they are the same in every row.
fn chosen(
    maps: &[&BTreeMap<String, &Value>],
    filters: &[String],
    all: bool,
) -> (Vec<String>, usize) {
    let names: BTreeSet<&String> = maps.iter().flat_map(|m| m.keys()).collect();
    if !filters.is_empty() {
        let picked = names
            .into_iter()
            .filter(|n| filters.iter().any(|f| n.contains(f.as_str())))
            .cloned()
            .collect();
        return (picked, 0);
    }
    let differs = |name: &String| {
        let values: Vec<Option<&&Value>> = maps.iter().map(|m| m.get(name)).collect();
        values.iter().any(|v| !same(v.copied(), values[0].copied()))
    };
    // One row differs from nothing: all of it is shown.
    let all = all || maps.len() < 2;
    let (shown, same): (Vec<&String>, Vec<&String>) =
        names.into_iter().partition(|n| all || differs(n));
    (shown.into_iter().cloned().collect(), same.len())
}

fn cell(v: Option<&&Value>) -> String {
    let Some(v) = v else { return "–".into() };
    let text = plain(v).replace('\n', " ");
    if text.chars().count() > 40 {
        format!("{}…", text.chars().take(39).collect::<String>())
    } else {
        text
    }
}

/// The table of `entries` (oldest first) as aligned text.
pub fn table(entries: &[Entry], columns: &Columns) -> String {
    if entries.is_empty() {
        return "no runs recorded yet: `nemo-dag run MANIFEST` records each run\n".into();
    }
    let rows = rows(entries);
    let params: Vec<_> = rows.iter().map(|r| &r.params).collect();
    let metrics: Vec<_> = rows.iter().map(|r| &r.metrics).collect();
    let (params, same_params) = chosen(&params, &columns.params, columns.all);
    let (metrics, same_metrics) = chosen(&metrics, &columns.metrics, columns.all);
    let manifests: BTreeSet<&str> = entries.iter().map(|e| e.manifest.as_str()).collect();
    let any = |f: &dyn Fn(&Entry) -> bool| entries.iter().any(f);

    let mut header: Vec<String> = vec!["run".into(), "finished".into()];
    if manifests.len() > 1 {
        header.push("manifest".into());
    }
    if any(&|e| e.variant.is_some()) {
        header.push("variant".into());
    }
    if any(&|e| !e.overrides.is_empty()) {
        header.push("overrides".into());
    }
    if rows.iter().any(|r| r.point.is_some()) {
        header.push("sweep".into());
    }
    header.push("built".into());
    if any(&|e| {
        e.stages
            .values()
            .any(|s| s.outcome.as_deref() == Some("failed"))
    }) {
        header.push("failed".into());
    }
    let fixed = header.len();
    header.extend(params.iter().cloned());
    header.extend(metrics.iter().cloned());

    let mut body: Vec<Vec<String>> = Vec::new();
    for r in &rows {
        let e = r.entry;
        let mut line = vec![
            e.run.to_string(),
            e.finished_at.replace('T', " ").chars().take(19).collect(),
        ];
        for name in &header[2..fixed] {
            line.push(match name.as_str() {
                "manifest" => file_name(&e.manifest),
                "variant" => e.variant.as_deref().map(file_name).unwrap_or_default(),
                "overrides" => e.overrides.join(" "),
                "sweep" => r.point.unwrap_or_default().to_string(),
                "built" => {
                    let reached = e.stages.values().filter(|s| s.outcome.is_some()).count();
                    let built = e
                        .stages
                        .values()
                        .filter(|s| s.outcome.as_deref() == Some("executed"))
                        .count();
                    format!("{built} of {reached}")
                }
                "failed" => {
                    let failed: Vec<&str> = e
                        .stages
                        .iter()
                        .filter(|(_, s)| s.outcome.as_deref() == Some("failed"))
                        .map(|(n, _)| n.as_str())
                        .collect();
                    failed.join(" ")
                }
                _ => String::new(),
            });
        }
        line.extend(params.iter().map(|p| cell(r.params.get(p))));
        line.extend(metrics.iter().map(|m| cell(r.metrics.get(m))));
        body.push(line);
    }

    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            std::iter::once(&header[i])
                .chain(body.iter().map(|l| &l[i]))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let numeric: Vec<bool> = (0..header.len())
        .map(|i| {
            body.iter()
                .all(|l| l[i] == "–" || l[i].parse::<f64>().is_ok())
        })
        .collect();
    let mut out = String::new();
    for line in std::iter::once(&header).chain(&body) {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let pad = widths[i] - c.chars().count();
                if numeric[i] && !std::ptr::eq(line, &header) {
                    format!("{}{c}", " ".repeat(pad))
                } else {
                    format!("{c}{}", " ".repeat(pad))
                }
            })
            .collect();
        let _ = writeln!(out, "{}", cells.join("  ").trim_end());
    }
    if same_params + same_metrics > 0 {
        let _ = writeln!(
            out,
            "({same_params} params and {same_metrics} metrics that are the same in every row are not shown: --all shows them)"
        );
    }
    out
}

fn file_name(path: &str) -> String {
    std::path::Path::new(path)
        .file_name()
        .map_or_else(|| path.to_string(), |n| n.to_string_lossy().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_cell_shows_integers_whole_and_other_numbers_short() {
        let show = |v: Value| cell(Some(&&v));
        assert_eq!(show(json!(1234567)), "1234567");
        assert_eq!(show(json!(1234568)), "1234568");
        assert_eq!(show(json!(0.001)), "0.001");
        assert_eq!(show(json!(1.5e-5)), "1.500e-5");
        assert_eq!(cell(None), "–");
    }
}
