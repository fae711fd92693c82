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
//! `Summary.Value`: `tag` 1, `simple_value` 2), written here by hand. Each point's wall time is
//! [`crate::curve::points`]'.

use crate::store::Artifact;
use std::path::{Path, PathBuf};

/// The directory under an artifact that holds its event files.
pub const DIR: &str = "tensorboard";

/// Write `artifact`'s curve as an event file under `dir/tensorboard/<stage>/`; `None` when it
/// has no curve.
pub fn write(dir: &Path, artifact: &Artifact) -> std::io::Result<Option<PathBuf>> {
    let Some(points) = crate::curve::points(artifact) else {
        return Ok(None);
    };
    let start = crate::curve::start(artifact);
    let mut file = Vec::new();
    record(
        &mut file,
        &event(start, 0, Body::FileVersion("brain.Event:2")),
    );
    for point in points {
        let values: Vec<(String, f32)> = point
            .values
            .into_iter()
            .map(|(name, x)| (format!("train/{name}"), x as f32))
            .collect();
        record(
            &mut file,
            &event(point.wall_time, point.step, Body::Scalars(&values)),
        );
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

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
