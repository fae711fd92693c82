//! A training stage's curve as points in time: each point's step, wall time and figures, as the
//! TensorBoard and MLflow exports write them.
//!
//! A stage does not time its steps one by one: a point's wall time is spread between the
//! stage's start and its end by its step (the last point at the end). The figures of a point are
//! those `plot` finds in it ([`crate::plot::names`]): its own, and those under its `metrics`.

use crate::store::Artifact;
use serde_json::Value;

/// One point of a curve.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    pub step: i64,
    /// Seconds since 1970.
    pub wall_time: f64,
    /// Each figure the point carries, by name (`loss`, `lr`, `reward`), sorted.
    pub values: Vec<(String, f64)>,
}

/// The points of `artifact`'s curve, in its order; `None` when its metrics hold no curve. A
/// point with no whole step is left out.
pub fn points(artifact: &Artifact) -> Option<Vec<Point>> {
    let curve = artifact.metrics.get("curve")?.as_array()?;
    let start = start(artifact);
    let last = curve.iter().filter_map(step).fold(0, i64::max) as f64;
    Some(
        curve
            .iter()
            .filter_map(|point| {
                let step = step(point)?;
                let values = crate::plot::names(point)
                    .into_iter()
                    .filter_map(|name| {
                        let x = crate::plot::value(point, &name)?;
                        Some((name, x))
                    })
                    .collect();
                let wall_time = if last > 0.0 {
                    start + artifact.seconds * step as f64 / last
                } else {
                    start
                };
                Some(Point {
                    step,
                    wall_time,
                    values,
                })
            })
            .collect(),
    )
}

/// When the stage started, in seconds since 1970 (0 for a timestamp that does not read).
pub fn start(artifact: &Artifact) -> f64 {
    unix_seconds(&artifact.started_at).unwrap_or(0.0)
}

/// When the stage ended, in seconds since 1970.
pub fn end(artifact: &Artifact) -> f64 {
    start(artifact) + artifact.seconds
}

/// A curve point's step: a whole number, written as an integer or not (`100.0`).
fn step(point: &Value) -> Option<i64> {
    let s = &point["step"];
    s.as_i64()
        .or_else(|| s.as_f64().filter(|x| x.fract() == 0.0).map(|x| x as i64))
}

/// Seconds since 1970 of a timestamp as the store writes it (`2026-11-25T06:41:05.242Z`).
fn unix_seconds(t: &str) -> Option<f64> {
    let (date, time) = t.strip_suffix('Z')?.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let mut hms = time.splitn(3, ':');
    let (h, min) = (
        hms.next()?.parse::<f64>().ok()?,
        hms.next()?.parse::<f64>().ok()?,
    );
    let s = hms.next()?.parse::<f64>().ok()?;
    // Days from 1970-01-01 to a civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days as f64 * 86_400.0 + h * 3600.0 + min * 60.0 + s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_timestamp_is_read_as_unix_seconds() {
        assert_eq!(unix_seconds("1970-01-01T00:00:00.000Z"), Some(0.0));
        assert_eq!(
            unix_seconds("2026-11-25T06:41:05.250Z"),
            Some(1_795_588_865.25)
        );
        assert_eq!(unix_seconds("yesterday"), None);
    }

    #[test]
    fn points_are_spread_from_the_start_to_the_end_by_step() {
        let mut a: Artifact = serde_json::from_value(serde_json::json!({
            "schema": 1, "key": "k", "stage": "sft", "op": "sft", "op_version": 1,
            "params": {}, "inputs": {}, "outputs": {}, "upstream_keys": [], "manifest": "m",
            "started_at": "1970-01-01T00:00:10.000Z", "seconds": 4.0, "host": "h",
            "engine_version": "0",
            "metrics": {"curve": [
                {"step": 1, "loss": 3.0, "metrics": {"reward": 0.5}},
                {"step": 2.0, "loss": 2.0},
                {"step": 2.5, "loss": 1.0},
                {"step": 4, "loss": 1.5, "lr": 1e-4}
            ]}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        let p = points(&a).unwrap_or_default();
        let steps: Vec<(i64, f64)> = p.iter().map(|p| (p.step, p.wall_time)).collect();
        assert_eq!(steps, [(1, 11.0), (2, 12.0), (4, 14.0)]);
        assert_eq!(
            p[0].values,
            [("loss".to_string(), 3.0), ("reward".to_string(), 0.5)]
        );
        assert_eq!(p[2].values.len(), 2);
        assert_eq!(end(&a), 14.0);
        a.metrics.remove("curve");
        assert_eq!(points(&a), None);
    }
}
