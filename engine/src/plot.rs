//! One metric of several artifacts' curves, overlaid in one SVG chart: the training stages'
//! `metrics.curve` (`loss`, `lr`, `grad_norm`, … at the top of each point, or under its
//! `metrics`, as GRPO's `reward` and DPO's figures are). Each curve's legend says what sets it
//! apart: the stage, its key, and the params that differ among the plotted artifacts.
//!
//! The SVG is written here, line by line, and is the same bytes for the same artifacts: no
//! plotting library, no fonts, no scripts; any browser or image viewer shows it. [`png`] draws
//! the same SVG as a PNG with resvg, its text in Noto Sans built into the binary, so the
//! picture does not depend on the fonts a machine has.

use crate::diff::{diff, flatten};
use crate::graph::escape;
use crate::store::{Artifact, short};
use serde_json::Value;
use std::collections::BTreeSet;
use std::fmt::Write as _;

/// One artifact's curve of one metric: `(step, value)` in step order.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// The value of `metric` at one curve point, at its top or under `metrics`.
pub fn value(point: &Value, metric: &str) -> Option<f64> {
    point
        .get(metric)
        .or_else(|| point.get("metrics").and_then(|m| m.get(metric)))
        .and_then(Value::as_f64)
}

/// The metrics a curve point carries.
pub fn names(point: &Value) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for map in [point.as_object(), point["metrics"].as_object()]
        .into_iter()
        .flatten()
    {
        for (k, v) in map {
            if v.is_number() && k != "step" {
                out.insert(k.clone());
            }
        }
    }
    out
}

/// `metric`'s curve of each artifact, labelled; an artifact with no curve, or a metric no point
/// of it has, is an error that says what there is.
pub fn series(artifacts: &[Artifact], metric: &str) -> Result<Vec<Series>, String> {
    let mut differing = BTreeSet::new();
    if let Some(first) = artifacts.first() {
        for a in &artifacts[1..] {
            differing.extend(diff(first, a).params.into_iter().map(|c| c.name));
        }
    }
    let mut out = Vec::with_capacity(artifacts.len());
    for a in artifacts {
        let Some(curve) = a.metrics.get("curve").and_then(Value::as_array) else {
            return Err(format!(
                "{} [{}] has no curve: only the training stages record one",
                a.stage,
                short(&a.key)
            ));
        };
        let points: Vec<(f64, f64)> = curve
            .iter()
            .filter_map(|p| Some((p.get("step")?.as_f64()?, value(p, metric)?)))
            .filter(|(_, y)| y.is_finite())
            .collect();
        if points.is_empty() {
            let there: BTreeSet<String> = curve.iter().flat_map(names).collect();
            let there: Vec<String> = there.into_iter().collect();
            return Err(format!(
                "{} [{}] has no `{metric}` in its curve; it has: {}",
                a.stage,
                short(&a.key),
                there.join(", ")
            ));
        }
        let mut label = format!("{} [{}]", a.stage, &a.key[..a.key.len().min(8)]);
        let mut flat = std::collections::BTreeMap::new();
        flatten("", &a.params, &mut flat);
        for name in &differing {
            let v = flat.get(name).map_or("–".to_string(), |v| match v {
                Value::String(s) => s.clone(),
                v => v.to_string(),
            });
            let _ = write!(label, " {name}={v}");
        }
        out.push(Series { label, points });
    }
    Ok(out)
}

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
/// Room under the plot for the x axis and the legend, one line per curve.
const BOTTOM_AXIS: f64 = 50.0;
const LEGEND_LINE: f64 = 18.0;
/// Tableau's ten colours: each curve its own, in order.
const COLOURS: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];

/// Tick positions covering `[lo, hi]`: about five, at 1, 2 or 5 times a power of ten.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let span = (hi - lo).max(f64::EPSILON * lo.abs().max(1.0));
    let raw = span / 5.0;
    let power = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * power)
        .min_by(|a, b| (a / raw).ln().abs().total_cmp(&(b / raw).ln().abs()))
        .unwrap_or(power);
    let first = (lo / step).ceil() * step;
    (0..)
        .map(|i| first + i as f64 * step)
        .take_while(|t| *t <= hi + step * 1e-9)
        .take(12)
        .collect()
}

/// A number for an axis label: short, with an exponent when it is very large or small.
fn label(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    if (1e-3..1e5).contains(&v.abs()) {
        let fixed = format!("{v:.4}");
        return fixed
            .trim_end_matches('0')
            .trim_end_matches('.')
            .to_string();
    }
    format!("{v:.2e}")
}

/// The chart of `series` as an SVG document: `metric` against the step.
pub fn svg(series: &[Series], metric: &str) -> String {
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (f64::MAX, f64::MIN, f64::MAX, f64::MIN);
    for &(x, y) in all() {
        (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
    }
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if x1 == x0 {
        x1 = x0 + 1.0;
    }
    if y1 == y0 {
        let pad = y0.abs().max(1.0) * 0.05;
        (y0, y1) = (y0 - pad, y1 + pad);
    }
    let height = HEIGHT + LEGEND_LINE * series.len() as f64;
    let bottom = HEIGHT - BOTTOM_AXIS;
    let sx = |x: f64| LEFT + (x - x0) / (x1 - x0) * (WIDTH - LEFT - RIGHT);
    let sy = |y: f64| bottom - (y - y0) / (y1 - y0) * (bottom - TOP);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{WIDTH}\" height=\"{height}\" \
         viewBox=\"0 0 {WIDTH} {height}\" font-family=\"sans-serif\" font-size=\"12\">"
    );
    let _ = writeln!(
        out,
        "<rect width=\"{WIDTH}\" height=\"{height}\" fill=\"white\"/>"
    );
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">{} by step</text>",
        WIDTH / 2.0,
        escape(metric)
    );
    // Axes, grid and tick labels.
    for t in ticks(y0, y1) {
        let y = sy(t);
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{y:.2}\" x2=\"{:.2}\" y2=\"{y:.2}\" stroke=\"#e0e0e0\"/>\
             <text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"end\">{}</text>",
            WIDTH - RIGHT,
            LEFT - 6.0,
            y + 4.0,
            label(t)
        );
    }
    // Steps are whole numbers: no tick between two of them.
    for t in ticks(x0, x1).into_iter().filter(|t| t.fract() == 0.0) {
        let x = sx(t);
        let _ = writeln!(
            out,
            "<line x1=\"{x:.2}\" y1=\"{bottom}\" x2=\"{x:.2}\" y2=\"{:.2}\" stroke=\"#333\"/>\
             <text x=\"{x:.2}\" y=\"{:.2}\" text-anchor=\"middle\">{}</text>",
            bottom + 5.0,
            bottom + 18.0,
            label(t)
        );
    }
    let _ = writeln!(
        out,
        "<path d=\"M{LEFT} {TOP}V{bottom}H{:.2}\" fill=\"none\" stroke=\"#333\"/>",
        WIDTH - RIGHT
    );
    let _ = writeln!(
        out,
        "<text x=\"{:.2}\" y=\"{:.2}\" text-anchor=\"middle\">step</text>",
        (LEFT + WIDTH - RIGHT) / 2.0,
        bottom + 36.0
    );
    // The curves, then the legend.
    for (i, s) in series.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let points: Vec<String> = s
            .points
            .iter()
            .map(|&(x, y)| format!("{:.2},{:.2}", sx(x), sy(y)))
            .collect();
        let _ = writeln!(
            out,
            "<polyline fill=\"none\" stroke=\"{colour}\" stroke-width=\"2\" points=\"{}\"/>",
            points.join(" ")
        );
        let y = HEIGHT + LEGEND_LINE * i as f64;
        let _ = writeln!(
            out,
            "<line x1=\"{LEFT}\" y1=\"{:.2}\" x2=\"{:.2}\" y2=\"{:.2}\" stroke=\"{colour}\" \
             stroke-width=\"3\"/><text x=\"{:.2}\" y=\"{y:.2}\">{}</text>",
            y - 4.0,
            LEFT + 24.0,
            y - 4.0,
            LEFT + 30.0,
            escape(&s.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// The family our SVG asks for, and the one font [`png`] has to give it.
const FONT_FAMILY: &str = "Noto Sans";

/// `svg` drawn as a PNG at `scale` times its size (2 for a sharp picture on a high-density
/// screen). Only [`notosans`]' Regular face is loaded: the system's fonts are never read, and
/// the same SVG gives the same bytes.
pub fn png(svg: &str, scale: f32) -> Result<Vec<u8>, String> {
    use resvg::{tiny_skia, usvg};
    let mut fonts = usvg::fontdb::Database::new();
    fonts.load_font_data(notosans::REGULAR_TTF.to_vec());
    // Every generic family is the one font we have.
    fonts.set_sans_serif_family(FONT_FAMILY);
    fonts.set_serif_family(FONT_FAMILY);
    let options = usvg::Options {
        font_family: FONT_FAMILY.into(),
        fontdb: std::sync::Arc::new(fonts),
        ..usvg::Options::default()
    };
    let tree =
        usvg::Tree::from_str(svg, &options).map_err(|e| format!("not an SVG we can draw: {e}"))?;
    let size = tree
        .size()
        .to_int_size()
        .scale_by(scale)
        .ok_or_else(|| format!("an SVG of {:?} cannot be drawn at {scale}x", tree.size()))?;
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height())
        .ok_or_else(|| format!("no {}x{} picture can be made", size.width(), size.height()))?;
    resvg::render(
        &tree,
        tiny_skia::Transform::from_scale(scale, scale),
        &mut pixmap.as_mut(),
    );
    pixmap
        .encode_png()
        .map_err(|e| format!("cannot encode the PNG: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn artifact(key: &str, lr: f64, curve: Value) -> Artifact {
        serde_json::from_value(json!({
            "schema": 1, "key": key, "stage": "sft", "op": "sft", "op_version": 1,
            "params": {"lr": lr, "steps": 3}, "inputs": {}, "outputs": {},
            "metrics": {"curve": curve, "final_loss": 1.0}, "upstream_keys": [],
            "manifest": "m.yaml", "started_at": "t", "seconds": 1.0, "host": "h",
            "engine_version": "0"
        }))
        .unwrap()
    }

    #[test]
    fn two_runs_overlay_with_a_legend_of_what_differs() {
        let a = artifact(
            "aaaaaaaaaa",
            1e-3,
            json!([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.5}]),
        );
        let b = artifact(
            "bbbbbbbbbb",
            2e-3,
            json!([{"step": 1, "loss": 3.0, "metrics": {"reward": 0.5}}, {"step": 2, "loss": 1.0}]),
        );
        let s = series(&[a.clone(), b.clone()], "loss").unwrap();
        assert_eq!(s[0].label, "sft [aaaaaaaa] lr=0.001");
        assert_eq!(s[1].points, [(1.0, 3.0), (2.0, 1.0)]);
        let doc = svg(&s, "loss");
        assert_eq!(doc.matches("<polyline").count(), 2);
        let first = doc.split("<polyline").nth(1).unwrap();
        let points = first
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(points.split(' ').count(), 3, "{points}");
        assert!(doc.contains("lr=0.002") && doc.starts_with("<svg") && doc.ends_with("</svg>\n"));
        assert_eq!(doc, svg(&s, "loss"), "the same bytes twice");
        // A metric under `metrics`, and one nobody has, named with what there is.
        assert_eq!(
            series(std::slice::from_ref(&b), "reward").unwrap()[0].points,
            [(1.0, 0.5)]
        );
        let why = series(&[a], "rewad").unwrap_err();
        assert!(why.contains("no `rewad`") && why.contains("loss"), "{why}");
    }

    /// The PNG is the SVG drawn: its size is the SVG's times the scale, and its text is there
    /// (dark pixels in the title's box, none in an empty corner), in the built-in font.
    #[test]
    fn the_png_draws_the_svg_with_its_text() {
        let a = artifact(
            "aaaaaaaa",
            1e-3,
            json!([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]),
        );
        let doc = svg(&series(&[a], "loss").unwrap(), "loss");
        let bytes = png(&doc, 2.0).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        let (width, height) = (
            u32::from_be_bytes(bytes[16..20].try_into().unwrap()),
            u32::from_be_bytes(bytes[20..24].try_into().unwrap()),
        );
        let svg_height: f64 = doc
            .split("height=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(
            (width, height),
            ((2.0 * WIDTH) as u32, (2.0 * svg_height) as u32)
        );
        assert_eq!(bytes, png(&doc, 2.0).unwrap(), "the same bytes twice");

        // Decode: count dark pixels in the title's box and in an empty strip at the top left.
        let pixmap = resvg::tiny_skia::Pixmap::decode_png(&bytes).unwrap();
        let dark = |x0: u32, y0: u32, x1: u32, y1: u32| {
            let mut n = 0;
            for y in y0..y1 {
                for x in x0..x1 {
                    let p = pixmap.pixel(x, y).unwrap();
                    n += usize::from(
                        u16::from(p.red()) + u16::from(p.green()) + u16::from(p.blue()) < 200,
                    );
                }
            }
            n
        };
        let mid = width / 2;
        let title = dark(mid - 160, 20, mid + 160, 56);
        assert!(
            title > 300,
            "the title \"loss by step\" is drawn: {title} dark pixels"
        );
        assert_eq!(dark(0, 0, 40, 16), 0, "the top-left corner is empty");
    }

    #[test]
    fn ticks_are_round_numbers_covering_the_range() {
        assert_eq!(ticks(0.0, 10.0), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(ticks(1.2, 3.9), [1.5, 2.0, 2.5, 3.0, 3.5]);
        assert_eq!(label(0.00012), "1.20e-4");
        assert_eq!(label(2.5), "2.5");
    }
}
