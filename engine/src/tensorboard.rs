//! TensorBoard event files from a training stage's curve, so that `tensorboard --logdir` (and
//! `wandb sync --sync-tensorboard`) show what `plot` and `report` show.
//!
//! Every artifact whose metrics hold a `curve` gets `tensorboard/<stage>/events.out.tfevents.…`
//! beside its `artifact.json` when it is built (a push to the shared cache carries it with the
//! rest of the artifact): one scalar per figure of each curve point, tagged `train/loss`,
//! `train/lr`, `train/reward`, …, at the point's step. The file is made from `artifact.json`
//! alone: the same artifact gives the same bytes. It is not an output: no key or digest covers
//! it, and a stage that reads the artifact never sees it.
//!
//! The format is TensorFlow's: a file of TFRecords (length, masked CRC-32C of the length, the
//! bytes, their masked CRC-32C), each an `Event` protocol buffer
//! (tensorflow/core/util/event.proto: `wall_time` 1, `step` 2, `file_version` 3, `summary` 5;
//! `Summary.Value`: `tag` 1, `simple_value` 2), written here by hand. Steps are not timed one
//! by one: a point's wall time is spread between the stage's start and end by its step.

use crate::store::Artifact;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// The directory under an artifact that holds its event files.
pub const DIR: &str = "tensorboard";

/// Write `artifact`'s curve as an event file under `dir/tensorboard/<stage>/`; `None` when it
/// has no curve.
pub fn write(dir: &Path, artifact: &Artifact) -> std::io::Result<Option<PathBuf>> {
    let Some(curve) = artifact.metrics.get("curve").and_then(Value::as_array) else {
        return Ok(None);
    };
    let start = unix_seconds(&artifact.started_at).unwrap_or(0.0);
    let last = curve.iter().filter_map(step).fold(0, i64::max) as f64;
    let mut file = Vec::new();
    record(
        &mut file,
        &event(start, 0, Body::FileVersion("brain.Event:2")),
    );
    for point in curve {
        let Some(step) = step(point) else {
            continue;
        };
        // The figures `plot` finds in a point: its own, and those under its `metrics`.
        let values: Vec<(String, f32)> = crate::plot::names(point)
            .into_iter()
            .filter_map(|name| {
                let x = crate::plot::value(point, &name)?;
                Some((format!("train/{name}"), x as f32))
            })
            .collect();
        let at = if last > 0.0 {
            start + artifact.seconds * step as f64 / last
        } else {
            start
        };
        record(&mut file, &event(at, step, Body::Scalars(&values)));
    }
    let out = dir.join(DIR).join(safe(&artifact.stage));
    std::fs::create_dir_all(&out)?;
    // The name TensorBoard's own writer gives (`.tfevents.` is what readers look for), made
    // from the artifact: the same artifact, the same name.
    let path = out.join(format!(
        "events.out.tfevents.{:010}.{}.nemo-dag",
        start as u64,
        safe(&artifact.host)
    ));
    std::fs::write(&path, file)?;
    // Read-only, as everything published is.
    crate::store::seal(&dir.join(DIR))?;
    Ok(Some(path))
}

/// A curve point's step: a whole number, written as an integer or not (`100.0`).
fn step(point: &Value) -> Option<i64> {
    let s = &point["step"];
    s.as_i64()
        .or_else(|| s.as_f64().filter(|x| x.fract() == 0.0).map(|x| x as i64))
}

/// A path segment: a copy's name (`sft[lr=1e-3]`) keeps its brackets, a `/` does not pass.
pub fn safe(name: &str) -> String {
    name.replace(['/', '\\'], "_")
}

enum Body<'a> {
    FileVersion(&'a str),
    Scalars(&'a [(String, f32)]),
}

/// An `Event` message.
fn event(wall_time: f64, step: i64, body: Body) -> Vec<u8> {
    let mut e = Vec::new();
    key(&mut e, 1, 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    if step != 0 {
        key(&mut e, 2, 0);
        varint(&mut e, step as u64);
    }
    match body {
        Body::FileVersion(v) => bytes(&mut e, 3, v.as_bytes()),
        Body::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, x) in values {
                let mut value = Vec::new();
                bytes(&mut value, 1, tag.as_bytes());
                key(&mut value, 2, 5);
                value.extend_from_slice(&x.to_le_bytes());
                bytes(&mut summary, 1, &value);
            }
            bytes(&mut e, 5, &summary);
        }
    }
    e
}

/// A field's key: its number and wire type (0 varint, 1 64-bit, 2 bytes, 5 32-bit).
fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
    varint(out, field << 3 | wire);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field.
fn bytes(out: &mut Vec<u8>, field: u64, data: &[u8]) {
    key(out, field, 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// One TFRecord.
fn record(out: &mut Vec<u8>, data: &[u8]) {
    let length = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&length);
    out.extend_from_slice(&masked_crc(&length).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// CRC-32C (Castagnoli), masked as TFRecords mask it.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
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
    fn crc32c_is_castagnolis_and_masked_as_tfrecords_do() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xc78a_b0e5);
    }

    /// The bytes TensorBoard's own writer gives for the same events.
    #[test]
    fn events_are_framed_as_tensorboards_writer_frames_them() {
        let mut out = Vec::new();
        record(&mut out, &event(0.0, 0, Body::FileVersion("brain.Event:2")));
        assert_eq!(
            hex(&out),
            "1800000000000000a37f4b22090000000000000000\
             1a0d627261696e2e4576656e743a32eedf28a3"
        );
        let mut out = Vec::new();
        let values = [("train/loss".to_string(), 2.5f32)];
        record(
            &mut out,
            &event(1_700_000_000.5, 100, Body::Scalars(&values)),
        );
        assert_eq!(
            hex(&out),
            "200000000000000029eda9500900002040fc54d9411064\
             2a130a110a0a747261696e2f6c6f7373150000204\
             09c94672d"
        );
    }

    #[test]
    fn a_store_timestamp_is_read_as_unix_seconds() {
        assert_eq!(unix_seconds("1970-01-01T00:00:00.000Z"), Some(0.0));
        assert_eq!(
            unix_seconds("2026-11-25T06:41:05.250Z"),
            Some(1_795_588_865.25)
        );
        assert_eq!(unix_seconds("yesterday"), None);
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
