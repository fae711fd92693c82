//! `pretrain`: train a model from scratch on a `tokenize` artifact.
//!
//! ```yaml
//! pretrain:
//!   op: pretrain
//!   inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer"}
//!   params:
//!     model: {pattern: "*-*-*-*-", hidden: 128, heads: 4, kv_heads: 2, head_dim: 32, ffn: 384}
//!     seq_length: 128
//!     steps: 300
//!     global_batch: 16
//!     micro_batch: 8
//!     lr: 3e-3
//!     min_lr: 3e-4
//!     warmup: 30
//!     save_interval: 100
//! ```
//!
//! The data is read the way Megatron's `GPTDataset` and `BlendedDataset` read it: the train
//! split's datasets from `blend.json`, each a stream of `seq_length + 1`-token samples built
//! from the document, sample and shuffle indices of the seed, mixed by the greedy blending
//! rule; the global batch of step `s` is samples `s·G … (s+1)·G − 1`. Inputs are a sample's
//! first `seq_length` tokens, labels its last `seq_length`, every label counts in the loss.
//!
//! Outputs: `model/` (config.json, model.safetensors, tokenizer.json) and `checkpoint/` (the
//! model plus AdamW state and progress). The op is resumable: a stage killed or preempted
//! after a checkpoint continues from it on the next run and ends with the same weights.

use crate::training::{
    MODEL_OUTPUTS, blend_split, check_training, input, model_vocab, train_and_publish,
};
use model::config::ModelConfig;
use model::layers::Layout;
use model::net::{Batch, Model};
use nemo_dag_data::megatron::IndexedReader;
use nemo_dag_data::megatron::gpt_dataset::{
    GptIndices, blend_indices, build_gpt_indices, sample_tokens,
};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use train::{self, BatchSource, NextToken, Schedule, Trainer};

pub struct Pretrain;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    model: ModelConfig,
    seq_length: usize,
    #[serde(flatten)]
    schedule: Schedule,
}

static SPEC: Spec = Spec {
    name: "pretrain",
    version: 1,
    summary: "train a model from scratch on tokenized data (Megatron GPTDataset sampling)",
    inputs: &[
        Port {
            name: "data",
            required: true,
            what: "a tokenize artifact",
        },
        Port {
            name: "tokenizer",
            required: true,
            what: "the tokenizer.json the data was tokenized with",
        },
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(MODEL_OUTPUTS),
    resumable: true,
};

impl Op for Pretrain {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, _stage: &StageDecl) -> Result<(), DeclError> {
        check_training(Some(&p.model), &p.schedule)?;
        if p.seq_length == 0 || p.seq_length > p.model.max_seq {
            return Err(DeclError::new(
                &["params", "seq_length"],
                format!(
                    "seq_length must be between 1 and model.max_seq ({})",
                    p.model.max_seq
                ),
            ));
        }
        Ok(())
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let (tokenizer, tok_path) = crate::load_tokenizer(ctx.inputs)?;
        let vocab = model_vocab(&p.model, tokenizer.get_vocab_size(true))?;
        let data_dir = input(ctx, "data")?;
        let samples = p.schedule.steps as usize * p.schedule.global_batch;
        let mut source = PretrainData::open(
            &data_dir,
            p.seq_length,
            samples,
            p.schedule.seed as u32,
            vocab,
            p.schedule.micro_batch,
            p.schedule.global_batch,
        )?;
        let model = Model::new(&p.model, vocab, p.schedule.seed).map_err(train::err)?;
        writeln!(
            ctx.log,
            "model: pattern {} · {} parameters · vocab {vocab}",
            model.pattern,
            model.params.count()
        )?;
        let (seq, g) = (p.seq_length as u64, p.schedule.global_batch as u64);
        train_and_publish(
            ctx,
            Trainer::new(model, p.schedule.clone()),
            &mut NextToken::new(&mut source),
            tok_path,
            |_| seq * g,
        )
    }
}

/// The train split of a `tokenize` artifact as Megatron's blended GPT datasets.
struct Dataset {
    reader: IndexedReader,
    indices: GptIndices,
}

pub(crate) struct PretrainData {
    datasets: Vec<Dataset>,
    /// Sample `i` of the blend is sample `which[i].1` of dataset `which[i].0`.
    which: Vec<(u16, u64)>,
    seq_length: usize,
    vocab: usize,
    micro_batch: usize,
    global_batch: usize,
}

impl PretrainData {
    fn open(
        dir: &Path,
        seq_length: usize,
        samples: usize,
        seed: u32,
        vocab: usize,
        micro_batch: usize,
        global_batch: usize,
    ) -> Result<PretrainData, RunError> {
        let (weights, prefixes): (Vec<f64>, Vec<PathBuf>) =
            blend_split(dir, "train", "tokenize", true)?
                .into_iter()
                .unzip();
        let total: f64 = weights.iter().sum();
        let weights: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let mut datasets = Vec::new();
        for (prefix, w) in prefixes.iter().zip(&weights) {
            let reader = IndexedReader::open(prefix)
                .map_err(|e| RunError::new(format!("{}: {e}", prefix.display())))?;
            // Megatron asks each blended component for ceil(ceil(N·w)·1.005) samples.
            let wanted = if prefixes.len() == 1 {
                samples as u64
            } else {
                ((samples as f64 * w).ceil() * 1.005).ceil() as u64
            };
            let docs: Vec<u32> = (0..reader.len() as u32).collect();
            let indices = build_gpt_indices(
                reader.sequence_lengths(),
                &docs,
                seq_length,
                Some(wanted),
                seed,
                true,
            )
            .map_err(|e| RunError::new(format!("{}: {}", prefix.display(), e.0)))?;
            datasets.push(Dataset { reader, indices });
        }
        let which = if datasets.len() == 1 {
            (0..samples as u64).map(|i| (0u16, i)).collect()
        } else {
            let (d, s) = blend_indices(&weights, samples);
            d.into_iter().zip(s).collect()
        };
        Ok(PretrainData {
            datasets,
            which,
            seq_length,
            vocab,
            micro_batch,
            global_batch,
        })
    }

    /// The `seq_length + 1` tokens of blended sample `i`.
    fn sample(&self, i: usize) -> Result<Vec<u32>, RunError> {
        let (d, s) = *self
            .which
            .get(i)
            .ok_or_else(|| RunError::new(format!("sample {i} is beyond the planned samples")))?;
        let ds = &self.datasets[d as usize];
        let mut failed = None;
        let tokens = sample_tokens(
            ds.reader.sequence_lengths(),
            &ds.indices.document_index,
            &ds.indices.sample_index,
            &ds.indices.shuffle_index,
            s as usize,
            self.seq_length,
            true,
            0,
            |doc, offset, len| match ds.reader.tokens(doc as usize, offset, len) {
                Ok(tokens) => tokens,
                Err(e) => {
                    failed = Some(e);
                    Vec::new()
                }
            },
        )
        .map_err(|e| RunError::new(e.0))?;
        if let Some(e) = failed {
            return Err(RunError::new(e.to_string()));
        }
        if let Some(t) = tokens.iter().find(|t| **t as usize >= self.vocab) {
            return Err(RunError::new(format!(
                "token id {t} is outside the model's vocabulary ({}); was the data tokenized with another tokenizer?",
                self.vocab
            )));
        }
        Ok(tokens)
    }
}

impl BatchSource for PretrainData {
    fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError> {
        let first = step as usize * self.global_batch;
        let t = self.seq_length;
        let mut out = Vec::new();
        for m in 0..self.global_batch / self.micro_batch {
            let (mut ids, mut labels) = (Vec::new(), Vec::new());
            for r in 0..self.micro_batch {
                let tokens = self.sample(first + m * self.micro_batch + r)?;
                ids.extend_from_slice(&tokens[..t]);
                labels.extend_from_slice(&tokens[1..]);
            }
            out.push(Batch {
                loss_mask: vec![1.0; ids.len()],
                ids,
                labels,
                layout: Layout::plain(self.micro_batch, t),
                valid: None,
            });
        }
        Ok(out)
    }
}
