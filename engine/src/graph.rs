//! The stage graph as text: an indented tree for people, Graphviz `dot`, Mermaid, or JSON
//! (nodes with op, state and key; edges `STAGE:OUTPUT → input`).

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
    }
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
