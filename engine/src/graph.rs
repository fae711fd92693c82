//! The stage graph as text: an indented tree for people, Graphviz `dot`, Mermaid, JSON (nodes
//! with op, state and key; edges `STAGE:OUTPUT → input`), or an SVG drawing (the report's).

use crate::manifest::{Input, Manifest};
use crate::plan::{Freshness, StagePlan};
use serde_json::{Value, json};
use std::collections::BTreeMap;

/// How `nemo-dag graph` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Ascii,
    Dot,
    Mermaid,
    Json,
    Svg,
}

/// The manifest's graph in `format`, each stage with its state from `plans`.
pub fn render(manifest: &Manifest, plans: &[StagePlan], format: Format) -> String {
    let state: BTreeMap<&str, &StagePlan> = plans.iter().map(|p| (p.name.as_str(), p)).collect();
    let edges = edges(manifest);
    match format {
        Format::Json => {
            let nodes: Vec<Value> = manifest
                .order
                .iter()
                .map(|n| {
                    let p = state[n.as_str()];
                    json!({"name": n, "op": manifest.stages[n].op.name(), "state": p.freshness.as_str(), "key": p.key})
                })
                .collect();
            let edges: Vec<Value> = edges
                .iter()
                .map(|(from, output, to, input)| json!({"from": from, "output": output, "to": to, "input": input}))
                .collect();
            json!({"nodes": nodes, "edges": edges}).to_string()
        }
        Format::Dot => {
            let mut s = String::from(
                "digraph pipeline {\n  rankdir=LR;\n  node [shape=box, style=\"rounded,filled\"];\n",
            );
            for n in &manifest.order {
                let p = state[n.as_str()];
                s.push_str(&format!(
                    "  \"{n}\" [label=\"{n}\\n{}\\n{}\", fillcolor=\"{}\"];\n",
                    manifest.stages[n].op.name(),
                    p.freshness.as_str(),
                    color(p.freshness)
                ));
            }
            for (from, output, to, input) in &edges {
                s.push_str(&format!(
                    "  \"{from}\" -> \"{to}\" [label=\"{output} → {input}\"];\n"
                ));
            }
            s.push('}');
            s
        }
        Format::Mermaid => {
            let id: BTreeMap<&str, String> = manifest
                .order
                .iter()
                .enumerate()
                .map(|(i, n)| (n.as_str(), format!("s{i}")))
                .collect();
            let mut s = String::from("flowchart LR\n");
            for n in &manifest.order {
                let p = state[n.as_str()];
                s.push_str(&format!(
                    "  {}[\"{n}<br/>{} · {}\"]:::{}\n",
                    id[n.as_str()],
                    manifest.stages[n].op.name(),
                    p.freshness.as_str(),
                    p.freshness.as_str().replace('-', "_")
                ));
            }
            for (from, output, to, _) in &edges {
                s.push_str(&format!(
                    "  {} -->|{output}| {}\n",
                    id[from.as_str()],
                    id[to.as_str()]
                ));
            }
            for f in [
                Freshness::UpToDate,
                Freshness::Stale,
                Freshness::PendingUpstream,
            ] {
                s.push_str(&format!(
                    "  classDef {} fill:{}\n",
                    f.as_str().replace('-', "_"),
                    color(f)
                ));
            }
            s.trim_end().to_string()
        }
        Format::Ascii => ascii_graph(manifest, &state),
        Format::Svg => svg(manifest, &state),
    }
}

/// Stages by depth (the longest path from a source).
fn depths(manifest: &Manifest) -> BTreeMap<&str, usize> {
    let mut depth: BTreeMap<&str, usize> = BTreeMap::new();
    for n in &manifest.order {
        let d = manifest.stages[n]
            .deps
            .iter()
            .map(|d| depth[d.as_str()] + 1)
            .max()
            .unwrap_or(0);
        depth.insert(n, d);
    }
    depth
}

const BOX_W: f64 = 170.0;
const BOX_H: f64 = 46.0;
const COLUMN: f64 = 230.0;
const ROW: f64 = 64.0;
const MARGIN: f64 = 16.0;

/// The graph drawn left to right, a column per depth, each stage a box coloured by its state
/// (as `dot` colours it), each `STAGE:OUTPUT` input an arrow. Plain SVG: no script, no font.
fn svg(manifest: &Manifest, state: &BTreeMap<&str, &StagePlan>) -> String {
    use std::fmt::Write as _;
    let depth = depths(manifest);
    let mut row_in: BTreeMap<usize, usize> = BTreeMap::new();
    let mut at: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
    for n in &manifest.order {
        let d = depth[n.as_str()];
        let row = row_in.entry(d).or_default();
        at.insert(n, (MARGIN + d as f64 * COLUMN, MARGIN + *row as f64 * ROW));
        *row += 1;
    }
    let columns = depth.values().copied().max().map_or(0, |d| d + 1);
    let rows = row_in.values().copied().max().unwrap_or(0);
    let width = 2.0 * MARGIN + columns.saturating_sub(1) as f64 * COLUMN + BOX_W;
    let height = 2.0 * MARGIN + rows.saturating_sub(1) as f64 * ROW + BOX_H;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"dag\" width=\"{width}\" height=\"{height}\" viewBox=\"0 0 {width} {height}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(
        s,
        "<defs><marker id=\"arrow\" viewBox=\"0 0 10 10\" refX=\"10\" refY=\"5\" markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" fill=\"#607d8b\"/></marker></defs>"
    );
    let mut drawn = std::collections::BTreeSet::new();
    for (from, _, to, _) in edges(manifest) {
        if !drawn.insert((from.clone(), to.clone())) {
            continue;
        }
        let ((x1, y1), (x2, y2)) = (at[from.as_str()], at[to.as_str()]);
        let (x1, y1, x2, y2) = (x1 + BOX_W, y1 + BOX_H / 2.0, x2, y2 + BOX_H / 2.0);
        let bend = (x2 - x1) / 2.0;
        let _ = writeln!(
            s,
            "<path class=\"edge\" d=\"M{x1},{y1} C{},{y1} {},{y2} {x2},{y2}\" fill=\"none\" stroke=\"#607d8b\" marker-end=\"url(#arrow)\"><title>{} → {}</title></path>",
            x1 + bend,
            x2 - bend,
            escape(&from),
            escape(&to)
        );
    }
    for n in &manifest.order {
        let (x, y) = at[n.as_str()];
        let p = state[n.as_str()];
        let _ = writeln!(
            s,
            "<g class=\"stage\" data-state=\"{state}\"><title>{name}: {state}</title><rect x=\"{x}\" y=\"{y}\" width=\"{BOX_W}\" height=\"{BOX_H}\" rx=\"6\" fill=\"{fill}\" stroke=\"#546e7a\"/><text x=\"{tx}\" y=\"{ty1}\" text-anchor=\"middle\" font-weight=\"bold\">{name}</text><text x=\"{tx}\" y=\"{ty2}\" text-anchor=\"middle\" fill=\"#37474f\">{op} · {state}</text></g>",
            state = p.freshness.as_str(),
            name = escape(n),
            fill = color(p.freshness),
            tx = x + BOX_W / 2.0,
            ty1 = y + 19.0,
            ty2 = y + 36.0,
            op = manifest.stages[n].op.name(),
        );
    }
    s.push_str("</svg>");
    s
}

/// Text for SVG and HTML.
pub fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn color(f: Freshness) -> &'static str {
    match f {
        Freshness::UpToDate => "#c8e6c9",
        Freshness::Stale => "#ffe0b2",
        Freshness::PendingUpstream => "#e0e0e0",
    }
}

/// (from stage, output, to stage, input) for every `STAGE:OUTPUT` input.
fn edges(manifest: &Manifest) -> Vec<(String, String, String, String)> {
    let mut out = Vec::new();
    for name in &manifest.order {
        for (input, source) in &manifest.stages[name].inputs {
            if let Input::Stage { stage, output } = source {
                out.push((stage.clone(), output.clone(), name.clone(), input.clone()));
            }
        }
    }
    out
}

/// Stages by depth (longest path from a source), each with its state and what it consumes.
fn ascii_graph(manifest: &Manifest, state: &BTreeMap<&str, &StagePlan>) -> String {
    let depth = depths(manifest);
    let width = manifest.order.iter().map(|n| n.len()).max().unwrap_or(0);
    let mut s = String::new();
    let max_depth = depth.values().copied().max().unwrap_or(0);
    for level in 0..=max_depth {
        for n in manifest.order.iter().filter(|n| depth[n.as_str()] == level) {
            let p = state[n.as_str()];
            let stage = &manifest.stages[n];
            let from: Vec<String> = stage
                .inputs
                .values()
                .map(|i| match i {
                    Input::Stage { stage, output } => format!("{stage}:{output}"),
                    Input::File { written, .. } => written.clone(),
                })
                .collect();
            let arrow = if from.is_empty() {
                String::new()
            } else {
                format!("  ◀ {}", from.join(", "))
            };
            s.push_str(&format!(
                "{}{} {:<width$}  [{}] {}{}\n",
                "  ".repeat(level),
                if level == 0 { "●" } else { "└▶" },
                n,
                stage.op.name(),
                p.freshness.as_str(),
                arrow
            ));
        }
    }
    s.trim_end().to_string()
}
