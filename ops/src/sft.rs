//! `sft`: supervised fine-tuning of an upstream model on packed chat data.
//!
//! ```yaml
//! sft:
//!   op: sft
//!   inputs: {model: "pretrain:model", data: "sft_data:data"}
//!   params: {steps: 100, global_batch: 8, micro_batch: 4, lr: 1e-3, min_lr: 1e-4, warmup: 10}
//! ```
//!
//! The model starts from the upstream artifact's weights only (`finetune`: a fresh optimizer).
//! The data is a `pack` artifact: Parquet rows of packed conversations. Each row becomes one
//! batch row the way Megatron-Bridge's `GPTSFTPackedDataset.collate_fn` does: with boundaries
//! `b = seq_start_id + [len(input_ids)]`, every subsequence `[s, e)` contributes tokens
//! `ids[s..e−1]`, labels `ids[s+1..e]`, loss mask `stored_mask[s..e−1]` (already label-aligned by
//! `pack`), and positions restarting at 0. Attention and Mamba state never cross a subsequence
//! boundary. Rows are padded to the longest row of the micro-batch rounded up to
//! `pad_to_multiple`, with the pad token, loss mask 0, and their own segment.
//!
//! The loss is per token over the global batch: Σ masked cross-entropy / Σ loss mask.
//! Rows are visited in a seeded shuffled order, epoch after epoch.

use crate::training::{
    MODEL_OUTPUTS, UPSTREAM_MODEL, blend_split, check_training, input, model_tokenizer,
    train_and_publish,
};
use model::layers::Layout;
use model::net::Batch;
use nemo_dag_data::sft::packing::PackedRow;
use nemo_dag_data::sft::parquet as packed_parquet;
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use std::path::Path;
use train::order::RowOrder;
use train::{BatchSource, NextToken, Schedule, Trainer, checkpoint};

pub struct Sft;

fn d_pad_multiple() -> usize {
    16
}
fn d_pad_token() -> String {
    "<|endoftext|>".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// Round each micro-batch's row length up to a multiple of this.
    #[serde(default = "d_pad_multiple")]
    pad_to_multiple: usize,
    /// The token padding is filled with (Megatron pads with EOS).
    #[serde(default = "d_pad_token")]
    pad_token: String,
    #[serde(flatten)]
    schedule: Schedule,
}

static SPEC: Spec = Spec {
    name: "sft",
    version: 1,
    summary: "fine-tune an upstream model on packed chat data (loss on assistant tokens)",
    inputs: &[
        UPSTREAM_MODEL,
        Port {
            name: "data",
            required: true,
            what: "a pack artifact",
        },
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(MODEL_OUTPUTS),
    resumable: true,
};

impl Op for Sft {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        if p.pad_to_multiple == 0 {
            return Err(DeclError::new(
                &["params", "pad_to_multiple"],
                "pad_to_multiple must be >= 1",
            ));
        }
        // The model's config comes from the upstream model artifact.
        check_training(None, &p.schedule)
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let model_dir = input(ctx, "model")?;
        let model = checkpoint::load_model(&model_dir)
            .map_err(|e| RunError::new(format!("cannot load the upstream model: {e}")))?;
        let (tokenizer, tok_path) = model_tokenizer(&model_dir)?;
        let pad = tokenizer.token_to_id(&p.pad_token).ok_or_else(|| {
            RunError::new(format!(
                "the model's tokenizer has no pad token `{}`; set params.pad_token",
                p.pad_token
            ))
        })?;
        let data_dir = input(ctx, "data")?;
        let rows = read_train_rows(&data_dir, ctx.log)?;
        let max_len = model.cfg.max_seq;
        let vocab = model.vocab;
        if let Some((i, r)) = rows
            .iter()
            .enumerate()
            .find(|(_, r)| r.input_ids.len() > max_len + 1)
        {
            return Err(RunError::new(format!(
                "packed row {i} has {} tokens, more than the model's max_seq {max_len} + 1; pack with a smaller pack_size",
                r.input_ids.len()
            )));
        }
        if let Some(t) = rows
            .iter()
            .flat_map(|r| r.input_ids.iter())
            .find(|t| **t < 0 || **t as usize >= vocab)
        {
            return Err(RunError::new(format!(
                "token id {t} is outside the model's vocabulary ({vocab}); was the data packed with the model's tokenizer?"
            )));
        }
        writeln!(
            ctx.log,
            "sft: {} packed rows · model {} ({} parameters)",
            rows.len(),
            model.pattern,
            model.params.count()
        )?;
        let mut source = SftData {
            order: RowOrder::new(rows.len(), p.schedule.seed as u32),
            rows,
            pad,
            pad_to_multiple: p.pad_to_multiple,
            micro_batch: p.schedule.micro_batch,
            global_batch: p.schedule.global_batch,
        };
        let tokens: Vec<u64> = (0..p.schedule.steps)
            .map(|s| source.tokens_in_step(s))
            .collect();
        train_and_publish(
            ctx,
            Trainer::new(model, p.schedule.clone()),
            &mut NextToken::new(&mut source),
            &tok_path,
            move |s| tokens.get(s as usize).copied().unwrap_or(0),
        )
    }
}

/// Every row of the train split of a `pack` artifact, in `blend.json` order.
fn read_train_rows(dir: &Path, log: &mut dyn std::io::Write) -> Result<Vec<PackedRow>, RunError> {
    let mut rows = Vec::new();
    for (weight, path) in blend_split(dir, "train", "pack", true)? {
        if weight != 1.0 {
            writeln!(
                log,
                "note: sft reads every train row once per epoch; the blend weight {weight} of {} is not applied",
                path.display()
            )?;
        }
        rows.extend(packed_parquet::read(&path).map_err(|e| RunError::new(e.to_string()))?);
    }
    if rows.is_empty() {
        return Err(RunError::new(format!(
            "{}: the train split has no rows",
            dir.display()
        )));
    }
    Ok(rows)
}

struct SftData {
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
    fn tokens_in_step(&mut self, step: u64) -> u64 {
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
