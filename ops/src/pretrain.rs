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
//! The data is read ([`train::data::pretrain`]) the way Megatron's `GPTDataset` and
//! `BlendedDataset` read it: the train
//! split's datasets from `blend.json`, each a stream of `seq_length + 1`-token samples built
//! from the document, sample and shuffle indices of the seed, mixed by the greedy blending
//! rule; the global batch of step `s` is samples `s·G … (s+1)·G − 1`. Inputs are a sample's
//! first `seq_length` tokens, labels its last `seq_length`, every label counts in the loss.
//!
//! Outputs: `model/` (config.json, model.safetensors, tokenizer.json) and `checkpoint/` (the
//! model plus AdamW state and progress). The op is resumable: a stage killed or preempted
//! after a checkpoint continues from it on the next run and ends with the same weights.

use crate::training::{
    MODEL_OUTPUTS, blend_split, check_training, input, model_plan, model_vocab, planned_vocab,
    train_and_publish,
};
use model::checkpoint::ModelFile;
use model::config::ModelConfig;
use model::net::Model;
use nemo_dag_op::{
    DeclError, Metrics, Op, Outputs, Plan, Port, RunContext, RunError, Spec, StageDecl, Upstream,
};
use serde::Deserialize;
use train::data::pretrain::PretrainData;
use train::footprint::{Shape, Sized};
use train::{self, NextToken, Schedule, Trainer};

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
    launched: false,
    gpu: true,
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

    /// The model it trains, and its run's footprint: micro-batches of `micro_batch` samples
    /// of `seq_length` tokens.
    fn plan(&self, p: &Params, upstream: &Upstream, _: &StageDecl) -> Plan {
        let vocab = match p.model.vocab {
            0 => planned_vocab(upstream, "tokenizer"),
            v => Some(v),
        };
        let Some(vocab) = vocab else {
            return Plan::default();
        };
        let estimate = Sized::new(&p.model, vocab).map(|model| {
            let shape = Shape {
                rows: p.schedule.micro_batch,
                len: p.seq_length,
                micro_batches: p.schedule.global_batch / p.schedule.micro_batch.max(1),
                steps: p.schedule.steps,
            };
            model.training(shape, Vec::new(), "pretrain")
        });
        model_plan(ModelFile::new(&p.model, vocab), estimate)
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let (tokenizer, tok_path) = crate::load_tokenizer(ctx.inputs)?;
        let vocab = model_vocab(&p.model, tokenizer.get_vocab_size(true))?;
        let data_dir = input(ctx, "data")?;
        let samples = p.schedule.steps as usize * p.schedule.global_batch;
        let mut source = PretrainData::open(
            blend_split(&data_dir, "train", "tokenize", true)?,
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
            &tok_path,
            None,
            |_| seq * g,
        )
    }
}
