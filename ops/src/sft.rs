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
//! batch row ([`train::data::sft`]) the way Megatron-Bridge's `GPTSFTPackedDataset.collate_fn`
//! does: with boundaries
//! `b = seq_start_id + [len(input_ids)]`, every subsequence `[s, e)` contributes tokens
//! `ids[s..e−1]`, labels `ids[s+1..e]`, loss mask `stored_mask[s..e−1]` (already label-aligned by
//! `pack`), and positions restarting at 0. Attention and Mamba state never cross a subsequence
//! boundary. Rows are padded to the longest row of the micro-batch rounded up to
//! `pad_to_multiple`, with the pad token, loss mask 0, and their own segment.
//!
//! The loss is per token over the global batch: Σ masked cross-entropy / Σ loss mask.
//! Rows are visited in a seeded shuffled order, epoch after epoch.

use crate::training::{
    MODEL_OUTPUTS, UPSTREAM_MODEL, blend_split, carried_template, check_training, input,
    model_plan, model_tokenizer, planned_model, train_and_publish,
};
use nemo_dag_data::sft::packing::PackedRow;
use nemo_dag_data::sft::parquet as packed_parquet;
use nemo_dag_op::{
    DeclError, Metrics, Op, Outputs, Plan, Port, RunContext, RunError, Spec, StageDecl, Upstream,
};
use serde::Deserialize;
use std::path::Path;
use train::data::sft::SftData;
use train::footprint::{Shape, Sized};
use train::{NextToken, Schedule, Trainer, checkpoint};

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
    // 2: its model keeps the chat template its data was rendered with (`chat_template.jinja`).
    version: 2,
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
    launched: false,
    gpu: true,
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

    /// The upstream model, trained further on micro-batches of `micro_batch` packed rows of
    /// the pack stage's `pack_size` (the model's `max_seq` when that is not known).
    fn plan(&self, p: &Params, upstream: &Upstream, _: &StageDecl) -> Plan {
        let Some(model) = planned_model(upstream) else {
            return Plan::default();
        };
        let len = upstream
            .stages
            .get("data")
            .and_then(|f| f.sequence)
            .unwrap_or(model.config.max_seq);
        let estimate = Sized::new(&model.config, model.vocab).map(|sized| {
            let shape = Shape {
                rows: p.schedule.micro_batch,
                len,
                micro_batches: p.schedule.global_batch / p.schedule.micro_batch.max(1),
                steps: p.schedule.steps,
            };
            sized.training(shape, Vec::new(), "sft")
        });
        model_plan(model, estimate)
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
        let mut source = SftData::new(
            rows,
            p.schedule.seed as u32,
            pad,
            p.pad_to_multiple,
            p.schedule.micro_batch,
            p.schedule.global_batch,
        );
        let tokens: Vec<u64> = (0..p.schedule.steps)
            .map(|s| source.tokens_in_step(s))
            .collect();
        // The template the rows were rendered with; a model trained on them answers in it.
        let template = carried_template(&[&data_dir, &model_dir])?;
        train_and_publish(
            ctx,
            Trainer::new(model, p.schedule.clone()),
            &mut NextToken::new(&mut source),
            &tok_path,
            template.as_deref(),
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
