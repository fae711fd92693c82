//! SFT batches from packed rows, collated as Megatron-Bridge's `GPTSFTPackedDataset.collate_fn`
//! does: with boundaries `b = seq_start_id + [len(input_ids)]`, every subsequence `[s, e)`
//! contributes tokens `ids[s..e−1]`, labels `ids[s+1..e]`, loss mask `stored_mask[s..e−1]`
//! (already label-aligned by `pack`), and positions restarting at 0; attention and Mamba state
//! never cross a subsequence boundary. Rows are padded to the longest row of the micro-batch
//! rounded up to a multiple, with the pad token, loss mask 0, and their own segment.

use crate::BatchSource;
use crate::order::RowOrder;
use model::layers::Layout;
use model::net::Batch;
use nemo_dag_data::sft::packing::PackedRow;
use nemo_dag_op::RunError;

/// The SFT batches of a set of packed rows, visited in a seeded order epoch after epoch.
pub struct SftData {
    rows: Vec<PackedRow>,
    order: RowOrder,
    pad: u32,
    pad_to_multiple: usize,
    micro_batch: usize,
    global_batch: usize,
}

/// One packed row collated as Megatron-Bridge does: tokens, labels, mask, positions, segments.
pub struct Collated {
    pub ids: Vec<u32>,
    pub labels: Vec<u32>,
    pub mask: Vec<f32>,
    pub positions: Vec<u32>,
    pub segments: Vec<u32>,
}

/// Split a packed row into its subsequences and shift each into inputs and labels.
pub fn collate(row: &PackedRow) -> Collated {
    let n = row.input_ids.len();
    let mut bounds: Vec<usize> = row.seq_start_id.iter().map(|s| *s as usize).collect();
    bounds.push(n);
    let mut c = Collated {
        ids: Vec::new(),
        labels: Vec::new(),
        mask: Vec::new(),
        positions: Vec::new(),
        segments: Vec::new(),
    };
    for (seg, w) in bounds.windows(2).enumerate() {
        let (s, e) = (w[0], w[1].min(n));
        if e < s + 2 {
            continue; // a single token has no label
        }
        for j in s..e - 1 {
            c.ids.push(row.input_ids[j] as u32);
            c.labels.push(row.input_ids[j + 1] as u32);
            c.mask
                .push(f32::from(row.loss_mask.get(j).copied().unwrap_or(0)));
            c.positions.push((j - s) as u32);
            c.segments.push(seg as u32);
        }
    }
    c
}

impl SftData {
    /// Batches of `rows` in the seeded order of `seed`, each micro-batch padded with `pad` to
    /// its longest row rounded up to `pad_to_multiple`.
    pub fn new(
        rows: Vec<PackedRow>,
        seed: u32,
        pad: u32,
        pad_to_multiple: usize,
        micro_batch: usize,
        global_batch: usize,
    ) -> SftData {
        SftData {
            order: RowOrder::new(rows.len(), seed),
            rows,
            pad,
            pad_to_multiple,
            micro_batch,
            global_batch,
        }
    }

    /// Tokens the model reads in global step `step` (unpadded).
    pub fn tokens_in_step(&mut self, step: u64) -> u64 {
        let g = self.global_batch as u64;
        (step * g..(step + 1) * g)
            .map(|i| {
                let r = self.order.row(i);
                self.rows[r].input_ids.len() as u64
            })
            .sum()
    }
}

impl BatchSource for SftData {
    fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError> {
        let g = self.global_batch as u64;
        let mut out = Vec::new();
        for m in 0..self.global_batch / self.micro_batch {
            let first = step * g + (m * self.micro_batch) as u64;
            let rows: Vec<Collated> = (first..first + self.micro_batch as u64)
                .map(|i| collate(&self.rows[self.order.row(i)]))
                .collect();
            let longest = rows.iter().map(|r| r.ids.len()).max().unwrap_or(0).max(1);
            let len = longest.div_ceil(self.pad_to_multiple) * self.pad_to_multiple;
            let mut batch = Batch {
                ids: Vec::new(),
                labels: Vec::new(),
                loss_mask: Vec::new(),
                layout: Layout {
                    batch: rows.len(),
                    len,
                    positions: Vec::new(),
                    segments: Vec::new(),
                },
                valid: Some(Vec::new()),
            };
            for r in rows {
                let pad = len - r.ids.len();
                let pad_segment = r.segments.last().map_or(0, |s| s + 1);
                batch.ids.extend(
                    r.ids
                        .iter()
                        .copied()
                        .chain(std::iter::repeat_n(self.pad, pad)),
                );
                batch.labels.extend(
                    r.labels
                        .iter()
                        .copied()
                        .chain(std::iter::repeat_n(self.pad, pad)),
                );
                batch
                    .loss_mask
                    .extend(r.mask.iter().copied().chain(std::iter::repeat_n(0.0, pad)));
                batch
                    .layout
                    .positions
                    .extend(r.positions.iter().copied().chain(0..pad as u32));
                batch.layout.segments.extend(
                    r.segments
                        .iter()
                        .copied()
                        .chain(std::iter::repeat_n(pad_segment, pad)),
                );
                if let Some(v) = batch.valid.as_mut() {
                    v.extend(
                        std::iter::repeat_n(true, r.ids.len())
                            .chain(std::iter::repeat_n(false, pad)),
                    );
                }
            }
            out.push(batch);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collation_shifts_each_subsequence_and_restarts_positions() {
        // Two conversations [10 11 12 13] and [20 21 22], a single-token tail [30].
        let row = PackedRow {
            input_ids: vec![10, 11, 12, 13, 20, 21, 22, 30],
            loss_mask: vec![0, 1, 1, 0, 1, 1, 0, 0],
            seq_start_id: vec![0, 4, 7],
        };
        let c = collate(&row);
        assert_eq!(c.ids, [10, 11, 12, 20, 21]);
        assert_eq!(c.labels, [11, 12, 13, 21, 22]);
        assert_eq!(c.mask, [0.0, 1.0, 1.0, 1.0, 1.0]);
        assert_eq!(c.positions, [0, 1, 2, 0, 1]);
        assert_eq!(c.segments, [0, 0, 0, 1, 1]);
        assert_eq!(
            c.ids.len(),
            row.input_ids.len() - 3,
            "len − number of subsequences"
        );
    }

    #[test]
    fn micro_batches_pad_with_the_pad_token_mask_zero_and_their_own_segment() {
        let rows = vec![
            PackedRow {
                input_ids: vec![1, 2, 3],
                loss_mask: vec![1, 1, 0],
                seq_start_id: vec![0],
            },
            PackedRow {
                input_ids: vec![4, 5, 6, 7, 8],
                loss_mask: vec![1, 1, 1, 1, 0],
                seq_start_id: vec![0],
            },
        ];
        let mut data = SftData {
            order: RowOrder::new(2, 0),
            rows,
            pad: 99,
            pad_to_multiple: 8,
            micro_batch: 2,
            global_batch: 2,
        };
        let batches = data.global_batch(0).unwrap();
        let b = &batches[0];
        assert_eq!(b.layout.len, 8, "longest row (4) rounded up to 8");
        let rows: Vec<&[u32]> = b.ids.chunks(8).collect();
        let short = rows.iter().position(|r| r[0] == 1).unwrap();
        assert_eq!(rows[short], [1, 2, 99, 99, 99, 99, 99, 99]);
        let at = short * 8;
        assert_eq!(
            &b.loss_mask[at..at + 8],
            [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(&b.layout.segments[at..at + 8], [0, 0, 1, 1, 1, 1, 1, 1]);
        assert_eq!(&b.valid.as_ref().unwrap()[at..at + 3], [true, true, false]);
        // Every row appears once per epoch, in a seeded order.
        let mut order = RowOrder::new(5, 3);
        let mut seen: Vec<usize> = (0..5).map(|i| order.row(i)).collect();
        seen.sort();
        assert_eq!(seen, [0, 1, 2, 3, 4]);
    }
}
