//! Pretraining samples as Megatron-LM's `GPTDataset` and `BlendedDataset` read them
//! (`megatron/core/datasets/gpt_dataset.py`, `blended_dataset.py`): each dataset of the blend a
//! stream of `seq_length + 1`-token samples built from the document, sample and shuffle indices
//! of the seed, the datasets mixed by the greedy blending rule. Inputs are a sample's first
//! `seq_length` tokens, labels its last `seq_length`, and every label counts in the loss.

use crate::BatchSource;
use model::layers::Layout;
use model::net::Batch;
use nemo_dag_data::megatron::IndexedReader;
use nemo_dag_data::megatron::gpt_dataset::{
    GptIndices, blend_indices, build_gpt_indices, sample_tokens,
};
use nemo_dag_op::RunError;
use std::path::PathBuf;

/// One dataset of the blend, with its indices.
struct Dataset {
    reader: IndexedReader,
    indices: GptIndices,
}

/// The train split of a `tokenize` artifact as Megatron's blended GPT datasets: global batch
/// `s` is blended samples `s·G … (s+1)·G − 1`, each `seq_length + 1` tokens.
pub struct PretrainData {
    datasets: Vec<Dataset>,
    /// Sample `i` of the blend is sample `which[i].1` of dataset `which[i].0`.
    which: Vec<(u16, u64)>,
    seq_length: usize,
    vocab: usize,
    micro_batch: usize,
    global_batch: usize,
}

impl PretrainData {
    /// Open the datasets of `blend` (`(weight, .bin/.idx prefix)`, as `blend.json`'s train split
    /// lists them) and plan `samples` samples of the blend.
    pub fn open(
        blend: Vec<(f64, PathBuf)>,
        seq_length: usize,
        samples: usize,
        seed: u32,
        vocab: usize,
        micro_batch: usize,
        global_batch: usize,
    ) -> Result<PretrainData, RunError> {
        let (weights, prefixes): (Vec<f64>, Vec<PathBuf>) = blend.into_iter().unzip();
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
            .map_err(|e| RunError::new(format!("{}: {}", prefix.display(), e.message)))?;
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
        .map_err(|e| RunError::new(e.message))?;
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
