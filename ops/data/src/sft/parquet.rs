//! Packed SFT shards as Parquet: one row per packed bin with exactly the columns
//! Megatron-Bridge's packed-Parquet dataset reads (`data/packing/parquet.py`), as Nemotron's
//! `packing/writers.py` writes them:
//!
//! ```text
//! input_ids:    list<int32>   the concatenated token ids of the bin (unpadded)
//! loss_mask:    list<uint8>   label-aligned per subsequence (see crate::sft::packing)
//! seq_start_id: list<int32>   where each packed sequence starts
//! ```
//!
//! zstd-compressed, row groups of 1,000 bins, written to `<name>.tmp` and renamed, so a crash
//! never leaves a valid-looking shard. This uses the `parquet` crate's column writer directly
//! (no Arrow): a list column is one leaf column of values with repetition levels (0 starts a
//! row, 1 continues it) and definition levels (1 for a value, 0 for an empty list).

use crate::sft::packing::PackedRow;
use parquet::basic::{Compression, ZstdLevel};
use parquet::data_type::Int32Type;
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::file::writer::SerializedFileWriter;
use parquet::record::{ListAccessor, RowAccessor};
use parquet::schema::parser::parse_message_type;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

const SCHEMA: &str = "
message packed_sft {
  REQUIRED group input_ids (LIST) { REPEATED group list { REQUIRED INT32 element; } }
  REQUIRED group loss_mask (LIST) { REPEATED group list { REQUIRED INT32 element (INTEGER(8,false)); } }
  REQUIRED group seq_start_id (LIST) { REPEATED group list { REQUIRED INT32 element; } }
}";

pub const ROW_GROUP_BINS: usize = 1000;

fn err(path: &Path, e: impl std::fmt::Display) -> crate::Error {
    crate::Error::new(format!("{}: {e}", path.display()))
}

/// The values of column `i` (in schema order) of one row, as the INT32 Parquet stores.
fn column_values(row: &PackedRow, i: usize) -> Vec<i32> {
    match i {
        0 => row.input_ids.clone(),
        1 => row.loss_mask.iter().map(|m| i32::from(*m)).collect(),
        _ => row.seq_start_id.clone(),
    }
}

/// Write `rows` as one Parquet shard at `path`.
pub fn write(path: &Path, rows: &[PackedRow]) -> crate::Result<()> {
    let schema = Arc::new(parse_message_type(SCHEMA).map_err(|e| err(path, e))?);
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::ZSTD(ZstdLevel::default()))
            .build(),
    );
    let tmp = path.with_extension("parquet.tmp");
    let file = File::create(&tmp)?;
    let mut writer = SerializedFileWriter::new(file, schema, props).map_err(|e| err(path, e))?;
    for group in rows.chunks(ROW_GROUP_BINS) {
        let mut rg = writer.next_row_group().map_err(|e| err(path, e))?;
        for column in 0..3 {
            let mut values = Vec::new();
            let mut def = Vec::new();
            let mut rep = Vec::new();
            for row in group {
                let list = column_values(row, column);
                if list.is_empty() {
                    def.push(0);
                    rep.push(0);
                }
                for (i, v) in list.into_iter().enumerate() {
                    values.push(v);
                    def.push(1);
                    rep.push(i16::from(i > 0));
                }
            }
            let mut col = rg
                .next_column()
                .map_err(|e| err(path, e))?
                .ok_or_else(|| err(path, "schema has fewer columns than written"))?;
            col.typed::<Int32Type>()
                .write_batch(&values, Some(&def), Some(&rep))
                .map_err(|e| err(path, e))?;
            col.close().map_err(|e| err(path, e))?;
        }
        rg.close().map_err(|e| err(path, e))?;
    }
    writer.close().map_err(|e| err(path, e))?;
    File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path).map_err(crate::Error::from)
}

/// Read a shard back (tests, and the SFT data loader).
pub fn read(path: &Path) -> crate::Result<Vec<PackedRow>> {
    let file = File::open(path)?;
    let reader = SerializedFileReader::new(file).map_err(|e| err(path, e))?;
    let names: Vec<String> = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema()
        .get_fields()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    if names != ["input_ids", "loss_mask", "seq_start_id"] {
        return Err(err(
            path,
            format!("not a packed SFT shard: columns {names:?}"),
        ));
    }
    let mut rows = Vec::new();
    for row in reader.get_row_iter(None).map_err(|e| err(path, e))? {
        let row = row.map_err(|e| err(path, e))?;
        let list = |i: usize| -> crate::Result<Vec<i32>> {
            let l = row.get_list(i).map_err(|e| err(path, e))?;
            (0..l.len())
                .map(|j| {
                    l.get_int(j)
                        .or_else(|_| l.get_ubyte(j).map(i32::from))
                        .map_err(|e| err(path, e))
                })
                .collect()
        };
        let mask = list(1)?
            .into_iter()
            .map(|m| u8::try_from(m).map_err(|_| err(path, "loss_mask value out of range")))
            .collect::<crate::Result<Vec<u8>>>()?;
        rows.push(PackedRow {
            input_ids: list(0)?,
            loss_mask: mask,
            seq_start_id: list(2)?,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_round_trip_with_empty_and_many_row_groups() {
        let dir = std::env::temp_dir().join(format!("nemo-dag-pq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let rows: Vec<PackedRow> = (0..2500)
            .map(|i: i32| PackedRow {
                input_ids: (0..i % 7).map(|t| t * 1000 + i).collect(),
                loss_mask: (0..(i % 7)).map(|t| (t % 2) as u8).collect(),
                seq_start_id: if i % 7 == 0 { vec![] } else { vec![0] },
            })
            .collect();
        let path = dir.join("shard_000000.parquet");
        write(&path, &rows).unwrap();
        assert!(!dir.join("shard_000000.parquet.tmp").exists());
        assert_eq!(read(&path).unwrap(), rows);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
