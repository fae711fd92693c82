//! `nemo-dag report`: a manifest's state as one self-contained HTML file, for people who would
//! rather look than read. In the spirit of Snakemake's `--report` and Nextflow's
//! `-with-report`, offline and from the store alone: no script, no font, no fetch.
//!
//! It holds, top to bottom: the pipeline drawn as SVG, each stage in the colour of its state;
//! a table of the stages (state, key, when and how long it ran, its CPU time, peak memory and
//! bytes read and written, and why it would run again); each sweep's copies side by side; every training stage's curves, one chart per metric; each stage's final
//! metrics (an eval stage's scores among them); and the lineage of each final stage.
//!
//! A stage that is not up to date is shown from the artifact of the manifest's last run, where
//! there is one, and says so.

use crate::graph::{self, escape};
use crate::manifest::Manifest;
use crate::plan::{Freshness, StagePlan};
use crate::store::{Artifact, RunRecord, Store, short};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// One stage as the report shows it: its plan, and the artifact it is shown from.
struct Shown<'a> {
    plan: &'a StagePlan,
    artifact: Option<Artifact>,
    /// The artifact is the last run's, not the stage's current key.
    from_last_run: bool,
    /// The last run recorded the stage.
    recorded: bool,
}

/// The report of `manifest` against `store`, as one HTML document.
pub fn html(manifest: &Manifest, store: &Store, plans: &[StagePlan], record: &RunRecord) -> String {
    let shown: Vec<Shown> = plans
        .iter()
        .map(|plan| {
            let current = plan
                .key
                .as_deref()
                .filter(|_| plan.freshness == Freshness::UpToDate)
                .and_then(|k| store.load(k));
            let last = || record.stages.get(&plan.name).and_then(|k| store.load(k));
            match current {
                Some(a) => Shown {
                    plan,
                    artifact: Some(a),
                    from_last_run: false,
                    recorded: true,
                },
                None => Shown {
                    plan,
                    artifact: last(),
                    from_last_run: true,
                    recorded: record.stages.contains_key(&plan.name),
                },
            }
        })
        .collect();

    let mut h = String::new();
    let title = manifest.path.display().to_string();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>nemo-dag report: {}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        escape(&title)
    );
    let _ = writeln!(h, "<h1>{}</h1>", escape(&title));
    let mut about = Vec::new();
    if let Some(v) = &manifest.variant {
        about.push(format!(
            "variant <code>{}</code>",
            escape(&v.display().to_string())
        ));
    }
    if !manifest.overrides.is_empty() {
        about.push(format!(
            "overrides <code>{}</code>",
            escape(&manifest.overrides.join(" "))
        ));
    }
    about.push(format!(
        "store <code>{}</code>",
        escape(&store.root.display().to_string())
    ));
    if !record.finished_at.is_empty() {
        about.push(format!("last run finished {}", escape(&record.finished_at)));
    }
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for p in plans {
        *counts.entry(p.freshness.as_str()).or_default() += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
    about.push(format!("{} stage(s): {}", plans.len(), counts.join(", ")));
    let _ = writeln!(h, "<p class=\"about\">{}</p>", about.join(" · "));

    let _ = writeln!(h, "<h2>Pipeline</h2>");
    let _ = writeln!(
        h,
        "<div class=\"figure\">{}</div>",
        graph::render(manifest, plans, graph::Format::Svg)
    );

    stages_table(&mut h, manifest, &shown, record);
    sweeps(&mut h, manifest, &shown);
    curves(&mut h, &shown);
    final_metrics(&mut h, &shown);
    lineage(&mut h, manifest, store, &shown);

    h.push_str("</body>\n</html>\n");
    h
}

const STYLE: &str = "body{font-family:sans-serif;margin:24px;color:#212121;max-width:1200px}\
h1{font-size:22px;margin-bottom:4px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ccc}\
h3{font-size:15px;margin-bottom:4px}.about{color:#555}code{background:#f3f3f3;padding:1px 4px}\
table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}\
th{background:#f5f5f5}td.num{text-align:right;font-variant-numeric:tabular-nums}\
.up-to-date{background:#c8e6c9}.stale{background:#ffe0b2}.pending-upstream{background:#e0e0e0}\
.note{color:#777;font-size:12px}.figure svg{max-width:100%;height:auto}.charts{display:flex;flex-wrap:wrap;gap:12px}.chart svg{width:380px;height:auto}.chart polyline{vector-effect:non-scaling-stroke;stroke-width:2}\
.wide{overflow-x:auto}.sweep td{white-space:nowrap}";

fn stages_table(h: &mut String, manifest: &Manifest, shown: &[Shown], record: &RunRecord) {
    let _ = writeln!(h, "<h2>Stages</h2>\n<table class=\"stages\">");
    let _ = writeln!(
        h,
        "<tr><th>stage</th><th>op</th><th>state</th><th>key</th><th>last run</th><th>why it ran</th><th>ran</th><th>seconds</th><th>CPU seconds</th><th>peak memory</th><th>read / written</th><th>why it would run</th></tr>"
    );
    for s in shown {
        let p = s.plan;
        let key = p.key.as_deref().map(short).unwrap_or("-");
        let resources = s.artifact.as_ref().and_then(|a| a.resources.as_ref());
        let cpu = resources
            .and_then(|r| Some(r.cpu_user_seconds? + r.cpu_system_seconds?))
            .map(|c| format!("{c:.2}"))
            .unwrap_or_default();
        let io = resources
            .and_then(|r| {
                let b = nemo_dag_op::plan::bytes;
                Some(format!("{} / {}", b(r.read_bytes?), b(r.written_bytes?)))
            })
            .unwrap_or_default();
        let (ran, seconds, peak) = match &s.artifact {
            Some(a) => (
                format!(
                    "{}{}",
                    escape(&a.started_at),
                    if s.from_last_run {
                        format!(
                            "<br><span class=\"note\">last run, key {}</span>",
                            short(&a.key)
                        )
                    } else {
                        String::new()
                    }
                ),
                format!("{:.2}", a.seconds),
                a.resources
                    .as_ref()
                    .map(|r| nemo_dag_op::plan::bytes(r.peak_rss_bytes))
                    .unwrap_or_default(),
            ),
            None if s.from_last_run && s.recorded => (
                "<span class=\"note\">its last run's artifact is gone (gc)</span>".into(),
                String::new(),
                String::new(),
            ),
            None => ("never".into(), String::new(), String::new()),
        };
        let lines = |reasons: &[String]| -> String {
            let escaped: Vec<String> = reasons.iter().map(|r| escape(r)).collect();
            escaped.join("<br>")
        };
        let why = lines(&p.reasons);
        // Whether the last run recorded the artifact shown: then its record says what that
        // run did with it (built it, or found it: a cache hit, here or in the shared cache),
        // and why the run that built it built it.
        let in_record = s
            .artifact
            .as_ref()
            .is_some_and(|a| record.stages.get(&p.name) == Some(&a.key));
        let outcome = Some(&p.name)
            .filter(|_| in_record)
            .and_then(|name| record.outcomes.get(name))
            .map(|o| match o.as_str() {
                "cached" | "cutoff" => format!("{o} (hit)"),
                "pulled" => "pulled (shared cache)".to_string(),
                other => other.to_string(),
            })
            .unwrap_or_default();
        let why_ran = Some(&p.name)
            .filter(|_| in_record)
            .and_then(|name| record.why.get(name))
            .map(|w| lines(w))
            .unwrap_or_default();
        let _ = writeln!(
            h,
            "<tr data-stage=\"{name}\"><td>{name}</td><td>{}</td><td class=\"{state}\">{state}</td><td><code>{key}</code></td><td class=\"outcome\">{outcome}</td><td class=\"why\">{why_ran}</td><td>{ran}</td><td class=\"num\">{seconds}</td><td class=\"num\">{cpu}</td><td class=\"num\">{peak}</td><td class=\"num\">{io}</td><td>{why}</td></tr>",
            manifest.stages[&p.name].op.name(),
            name = escape(&p.name),
            state = p.freshness.as_str(),
        );
    }
    h.push_str("</table>\n");
}

/// Each swept stage ([`crate::sweep`]): a table of its copies, one row each, with the swept
/// values and the final numeric metrics side by side, and its copies' curves overlaid, one
/// chart per metric.
fn sweeps(h: &mut String, manifest: &Manifest, shown: &[Shown]) {
    // In the manifest's order, each sweep's copies in the matrix's.
    let mut swept: Vec<(&str, Vec<(usize, &Shown)>)> = Vec::new();
    for s in shown {
        let Some(point) = &manifest.stages[&s.plan.name].sweep else {
            continue;
        };
        let copy = (point.ordinal, s);
        match swept.iter_mut().find(|(base, _)| *base == point.base) {
            Some((_, copies)) => copies.push(copy),
            None => swept.push((point.base.as_str(), vec![copy])),
        }
    }
    if swept.is_empty() {
        return;
    }
    let _ = writeln!(h, "<h2>Sweeps</h2>");
    for (base, mut copies) in swept {
        copies.sort_by_key(|(ordinal, _)| *ordinal);
        let copies: Vec<&Shown> = copies.into_iter().map(|(_, s)| s).collect();
        let axes: Vec<&str> = manifest.stages[&copies[0].plan.name]
            .sweep
            .iter()
            .flat_map(|p| p.values.iter().map(|(k, _)| k.as_str()))
            .collect();
        let finals: Vec<BTreeMap<String, Value>> = copies
            .iter()
            .map(|s| {
                s.artifact
                    .as_ref()
                    .map(|a| crate::diff::final_metrics(&a.metrics))
                    .unwrap_or_default()
            })
            .collect();
        // The figures that differ between the copies; those that do not are named below.
        let all: std::collections::BTreeSet<&String> =
            finals.iter().flat_map(|f| f.keys()).collect();
        let (columns, same): (Vec<&String>, Vec<&String>) = all.into_iter().partition(|k| {
            let values: Vec<Option<&Value>> = finals.iter().map(|f| f.get(*k)).collect();
            values.len() < 2 || values.iter().any(|v| *v != values[0])
        });
        let _ = writeln!(
            h,
            "<h3>{} <span class=\"note\">{} copies</span></h3>\n<div class=\"wide\"><table class=\"sweep\" data-stage=\"{}\">",
            escape(base),
            copies.len(),
            escape(base)
        );
        h.push_str("<tr><th>stage</th>");
        for axis in &axes {
            let _ = write!(h, "<th>{}</th>", escape(axis));
        }
        for c in &columns {
            let _ = write!(h, "<th>{}</th>", escape(c));
        }
        h.push_str("</tr>\n");
        for (s, metrics) in copies.iter().zip(&finals) {
            let point = manifest.stages[&s.plan.name].sweep.as_ref();
            let _ = write!(
                h,
                "<tr><td><code>{}</code>{}</td>",
                escape(&s.plan.name),
                if s.artifact.is_none() {
                    " <span class=\"note\">(not run)</span>"
                } else {
                    last_run_note(s)
                }
            );
            for (_, v) in point.iter().flat_map(|p| p.values.iter()) {
                let _ = write!(
                    h,
                    "<td class=\"num\">{}</td>",
                    escape(&crate::sweep::label(v))
                );
            }
            for c in &columns {
                let v = metrics.get(*c).map(cell).unwrap_or_default();
                let _ = write!(h, "<td class=\"num\">{v}</td>");
            }
            h.push_str("</tr>\n");
        }
        h.push_str("</table></div>\n");
        if !same.is_empty() {
            let listed: Vec<String> = same
                .iter()
                .map(|k| {
                    let v = finals.iter().find_map(|f| f.get(*k)).map(cell);
                    format!("{} {}", escape(k), v.unwrap_or_default())
                })
                .collect();
            let _ = writeln!(
                h,
                "<p class=\"note\">the same in every copy: {}</p>",
                listed.join(", ")
            );
        }

        let artifacts: Vec<Artifact> = copies.iter().filter_map(|s| s.artifact.clone()).collect();
        let curve: Vec<Value> = artifacts
            .iter()
            .filter_map(|a| a.metrics.get("curve").and_then(Value::as_array))
            .flatten()
            .cloned()
            .collect();
        let charts: Vec<String> = curve_metrics(&curve)
            .into_iter()
            .filter_map(|metric| {
                let series = crate::plot::series(&artifacts, &metric).ok()?;
                Some(format!(
                    "<div class=\"chart\" data-sweep=\"{}\" data-metric=\"{}\">{}</div>\n",
                    escape(base),
                    escape(&metric),
                    crate::plot::svg(&series, &metric)
                ))
            })
            .collect();
        if !charts.is_empty() {
            let _ = writeln!(h, "<div class=\"charts\">\n{}</div>", charts.concat());
        }
    }
}

/// The metrics a curve's points carry, the loss first.
fn curve_metrics(curve: &[Value]) -> Vec<String> {
    let mut names = std::collections::BTreeSet::new();
    for point in curve {
        names.extend(crate::plot::names(point));
    }
    let mut names: Vec<String> = names.into_iter().collect();
    names.sort_by_key(|n| (n != "loss", n.clone()));
    names
}

fn curves(h: &mut String, shown: &[Shown]) {
    let trained: Vec<&Shown> = shown
        .iter()
        .filter(|s| {
            s.artifact
                .as_ref()
                .and_then(|a| a.metrics.get("curve"))
                .and_then(Value::as_array)
                .is_some_and(|c| !c.is_empty())
        })
        .collect();
    if trained.is_empty() {
        return;
    }
    let _ = writeln!(h, "<h2>Training curves</h2>");
    for s in trained {
        let Some(a) = &s.artifact else { continue };
        let curve = a.metrics["curve"].as_array().cloned().unwrap_or_default();
        let charts: Vec<String> = curve_metrics(&curve)
            .into_iter()
            .filter_map(|metric| {
                let series = crate::plot::series(std::slice::from_ref(a), &metric).ok()?;
                Some(format!(
                    "<div class=\"chart\" data-stage=\"{}\" data-metric=\"{}\">{}</div>\n",
                    escape(&s.plan.name),
                    escape(&metric),
                    crate::plot::svg(&series, &metric)
                ))
            })
            .collect();
        if charts.is_empty() {
            continue;
        }
        let _ = writeln!(
            h,
            "<h3>{} <code>{}</code>{}</h3>\n<div class=\"charts\">\n{}</div>",
            escape(&s.plan.name),
            short(&a.key),
            last_run_note(s),
            charts.concat()
        );
    }
}

fn last_run_note(s: &Shown) -> &'static str {
    if s.from_last_run {
        " <span class=\"note\">(last run)</span>"
    } else {
        ""
    }
}

/// A metric as a table cell: a whole number as it is, another short as `diff` writes it (a
/// learning rate of 1e-7 is not 0), a boolean, or text and lists as they are, cut at 120
/// characters.
fn cell(v: &Value) -> String {
    let text = crate::diff::plain(v);
    match text.char_indices().nth(120) {
        Some((cut, _)) => format!("{}…", escape(&text[..cut])),
        None => escape(&text),
    }
}

fn final_metrics(h: &mut String, shown: &[Shown]) {
    let mut opened = false;
    for s in shown {
        let Some(a) = &s.artifact else { continue };
        // Nested metrics (an eval's `perplexity.ppl`) by their dotted path.
        let mut flat = BTreeMap::new();
        for (k, v) in a.metrics.iter().filter(|(k, _)| k.as_str() != "curve") {
            crate::diff::flatten(k, v, &mut flat);
        }
        let rows: Vec<(String, String)> = flat.iter().map(|(k, v)| (escape(k), cell(v))).collect();
        if rows.is_empty() {
            continue;
        }
        if !opened {
            let _ = writeln!(h, "<h2>Final metrics</h2>");
            opened = true;
        }
        let _ = writeln!(
            h,
            "<h3>{} <code>{}</code>{}</h3>\n<table class=\"metrics\" data-stage=\"{}\">",
            escape(&s.plan.name),
            short(&a.key),
            last_run_note(s),
            escape(&s.plan.name)
        );
        for (k, v) in rows {
            let _ = writeln!(h, "<tr><th>{k}</th><td class=\"num\">{v}</td></tr>");
        }
        h.push_str("</table>\n");
    }
}

/// For each stage nothing else consumes: the artifacts its artifact was built from, as
/// `nemo-dag lineage` walks them (its `upstream_keys`, and theirs), in the manifest's order,
/// each with its op, key and params.
fn lineage(h: &mut String, manifest: &Manifest, store: &Store, shown: &[Shown]) {
    let consumed: std::collections::BTreeSet<&str> = manifest
        .stages
        .values()
        .flat_map(|s| s.deps.iter().map(String::as_str))
        .collect();
    let position: BTreeMap<&str, usize> = manifest
        .order
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let _ = writeln!(h, "<h2>Lineage</h2>");
    for s in shown
        .iter()
        .filter(|s| !consumed.contains(s.plan.name.as_str()))
    {
        let _ = writeln!(h, "<h3>{}{}</h3>", escape(&s.plan.name), last_run_note(s));
        let Some(a) = &s.artifact else {
            h.push_str("<p class=\"note\">not built</p>\n");
            continue;
        };
        // Every ancestor once, by key; an artifact gc removed is named by its key alone.
        let mut seen = std::collections::BTreeSet::new();
        let mut queue = vec![a.key.clone()];
        let mut found: Vec<(usize, String)> = Vec::new();
        while let Some(key) = queue.pop() {
            if !seen.insert(key.clone()) {
                continue;
            }
            let item = match store.load(&key) {
                Some(up) => {
                    queue.extend(up.upstream_keys.iter().cloned());
                    let at = position
                        .get(up.stage.as_str())
                        .copied()
                        .unwrap_or(usize::MAX);
                    (
                        at,
                        format!(
                            "<li><b>{}</b> ({}) <code>{}</code> <span class=\"note\">{}</span></li>",
                            escape(&up.stage),
                            escape(&up.op),
                            short(&up.key),
                            cell(&up.params)
                        ),
                    )
                }
                None => (
                    usize::MAX,
                    format!(
                        "<li><code>{}</code> <span class=\"note\">artifact gone</span></li>",
                        short(&key)
                    ),
                ),
            };
            found.push(item);
        }
        found.sort();
        let items: Vec<String> = found.into_iter().map(|(_, li)| li).collect();
        let _ = writeln!(h, "<ol class=\"lineage\">{}</ol>", items.concat());
    }
}
