//! Cached decoding: feed one token per row, get the next-token logits, without recomputing the
//! sequence so far.
//!
//! ```text
//! state = model.start_decode(B)                  one cache per block of the main stack
//! for each step:  logits (B, vocab) = model.decode_step(&mut state, ids)      ids[r]: Option<u32>
//! ```
//!
//! What each block keeps ([`BlockCache`]):
//! - attention (`*`): the keys (after RoPE) and values of every step, `(B, kv_heads, T, head_dim)`
//!   ([`KvCache`]), appended each step;
//! - Mamba-2 (`M`): the convolution window and the SSM state ([`Mamba2Cache`]);
//! - MLP (`-`) and MoE (`E`, an inference forward routes each token on its own): nothing.
//!
//! **Rows that sit a step out.** `ids[r] = None` means row `r` has no token this step: left
//! padding before a shorter prompt, or a row that has finished. Every row still runs (the
//! shapes stay rectangular) but the step leaves no trace in that row: its Mamba caches are put
//! back as they were, its key and value are masked out of every later step, and its position
//! does not advance. A row's RoPE position is the number of real tokens it fed before (0 for
//! the first), so a left-padded prompt decodes exactly as it would alone. The logits of a row
//! that sat out are meaningless.
//!
//! **Prefill** (`sampling::prefill`) feeds the prompts one token per step, left padded. That is
//! `O(T)` small forwards instead of one chunked one — fine for our tiny models, and it needs no
//! second code path to keep equal to the first. MTP depths are training-only and not used here.

use super::layers::{KvCache, Layout, rms_norm};
use super::mamba2::Mamba2Cache;
use super::net::{Mixer, Model};
use super::params::constant_f32;
use candle_core::{Device, Result, Tensor};

/// What one block of the main stack keeps between steps.
pub enum BlockCache {
    Attention(KvCache),
    Mamba(Mamba2Cache),
    /// MLP and MoE blocks see one token at a time and keep nothing.
    None,
}

/// The decode state of a batch of rows.
pub struct DecodeState {
    pub batch: usize,
    /// One per block of the main stack, in order.
    pub blocks: Vec<BlockCache>,
    /// Row-major `batch × steps`: whether the row fed a real token at that step (its key is
    /// visible to later steps).
    real: Vec<Vec<bool>>,
    /// Per row: real tokens fed so far (the RoPE position of the next one).
    positions: Vec<usize>,
}

impl DecodeState {
    /// Steps fed so far (real or not).
    pub fn steps(&self) -> usize {
        self.real.first().map_or(0, Vec::len)
    }

    /// Per row: real tokens fed so far.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// The additive key mask of the current step `(B, 1, 1, T)`: 0 for keys of real tokens,
    /// −∞ for the others, except that a row always sees its own newest key (so a row that sits
    /// the step out still gets a finite, if meaningless, softmax).
    fn key_mask(&self) -> Result<Tensor> {
        let t = self.steps();
        let mut mask = vec![f32::NEG_INFINITY; self.batch * t];
        for (r, row) in self.real.iter().enumerate() {
            for (j, real) in row.iter().enumerate() {
                if *real || j + 1 == t {
                    mask[r * t + j] = 0.0;
                }
            }
        }
        constant_f32(mask, &[self.batch, 1, 1, t])
    }
}

impl Model {
    /// Empty caches for `batch` rows.
    pub fn start_decode(&self, batch: usize) -> Result<DecodeState> {
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for block in &self.blocks {
            blocks.push(match &block.mixer {
                Mixer::Attention(_) => BlockCache::Attention(KvCache::default()),
                Mixer::Mamba(m) => BlockCache::Mamba(m.cache(batch)?),
                Mixer::Mlp(_) | Mixer::Moe(_) => BlockCache::None,
            });
        }
        Ok(DecodeState {
            batch,
            blocks,
            real: vec![Vec::new(); batch],
            positions: vec![0; batch],
        })
    }

    /// Feed one token per row (`None`: the row sits this step out) and return the logits of
    /// the next token, `(B, vocab)`.
    pub fn decode_step(&self, state: &mut DecodeState, ids: &[Option<u32>]) -> Result<Tensor> {
        let b = state.batch;
        if ids.len() != b {
            candle_core::bail!("decode_step: {} ids for a batch of {b} rows", ids.len())
        }
        if let Some(id) = ids.iter().flatten().find(|id| **id as usize >= self.vocab) {
            candle_core::bail!(
                "token id {id} is outside the model's vocabulary ({})",
                self.vocab
            )
        }
        // Bookkeeping first: this step's key is visible from now on only for real tokens.
        let layout = Layout {
            batch: b,
            len: 1,
            positions: (0..b)
                .map(|r| {
                    if ids[r].is_some() {
                        state.positions[r] as u32
                    } else {
                        0
                    }
                })
                .collect(),
            segments: vec![0; b],
        };
        for (r, id) in ids.iter().enumerate() {
            state.real[r].push(id.is_some());
            if id.is_some() {
                state.positions[r] += 1;
            }
        }
        let rope = match self.rope() {
            Some(r) => Some(r.fused_tables(&layout)?),
            None => None,
        };
        let mask = if state
            .blocks
            .iter()
            .any(|c| matches!(c, BlockCache::Attention(_)))
        {
            Some(state.key_mask()?)
        } else {
            None
        };
        // (B, 1, 1) true for rows with a real token: where their Mamba caches move on.
        let active: Vec<u8> = ids.iter().map(|id| id.is_some() as u8).collect();
        let active = Tensor::from_vec(active, (b, 1, 1), &Device::Cpu)?;

        let tokens: Vec<u32> = ids.iter().map(|id| id.unwrap_or(0)).collect();
        let idx = Tensor::from_vec(tokens, b, &Device::Cpu)?;
        let mut x = self
            .embedding
            .index_select(&idx, 0)?
            .reshape((b, 1, self.cfg.hidden))?;
        let eps = self.cfg.norm_eps;
        for (block, cache) in self.blocks.iter().zip(state.blocks.iter_mut()) {
            let h = rms_norm(&x, &block.norm, eps)?;
            let y = match (&block.mixer, cache) {
                (Mixer::Attention(a), BlockCache::Attention(kv)) => {
                    let mask = mask
                        .as_ref()
                        .ok_or_else(|| candle_core::Error::Msg("decode: no key mask".into()))?;
                    a.step(&h, kv, rope.as_ref(), mask)?
                }
                (Mixer::Mamba(m), BlockCache::Mamba(c)) => {
                    let (conv, ssm) = (c.conv.clone(), c.ssm.clone());
                    let y = m.step(&h.squeeze(1)?, c)?.unsqueeze(1)?;
                    c.conv = keep_where(&active, &c.conv, &conv)?;
                    c.ssm = keep_where(&active, &c.ssm, &ssm)?;
                    y
                }
                (Mixer::Mlp(m), _) => m.forward(&h)?,
                (Mixer::Moe(m), _) => m.forward(&h, false, None)?,
                _ => candle_core::bail!("decode: a block's cache does not match its kind"),
            };
            x = (x + y)?;
        }
        let logits = self.head(&rms_norm(&x, &self.final_norm, eps)?)?;
        logits.squeeze(1)
    }
}

/// Per row: `new` where `active` (B, 1, 1) is set, `old` elsewhere.
fn keep_where(active: &Tensor, new: &Tensor, old: &Tensor) -> Result<Tensor> {
    let shape = new.dims().to_vec();
    let mut cond = active.clone();
    while cond.rank() < shape.len() {
        cond = cond.unsqueeze(cond.rank())?;
    }
    cond.broadcast_as(shape)?.where_cond(new, old)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    /// A hybrid of every block kind: Mamba, GQA attention with RoPE, MLP and MoE.
    pub(crate) fn hybrid(seed: u64) -> Model {
        let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
            "pattern": "M*-E*M", "hidden": 16, "heads": 4, "kv_heads": 2, "head_dim": 4,
            "ffn": 32, "max_seq": 64, "init_std": 0.5,
            "mamba": {"heads": 2, "head_dim": 8, "state": 4, "chunk": 4},
            "moe": {"experts": 4, "top_k": 2, "expert_ffn": 8, "shared_ffn": 8}
        }))
        .unwrap();
        Model::new(&cfg, 40, seed).unwrap()
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2::<f32>().unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn cached_decode_equals_the_full_forward_token_by_token() {
        let model = hybrid(7);
        let prompts: Vec<Vec<u32>> = vec![
            vec![5, 6, 7, 8, 9, 10, 11, 12, 13],
            vec![11, 12],
            vec![1, 2, 3, 4, 39],
        ];
        let longest = 9;
        // The full forward of each sequence alone, unpadded: logits at every position.
        let full: Vec<Vec<Vec<f32>>> = prompts
            .iter()
            .map(|p| {
                let l = model.logits(p, &Layout::plain(1, p.len())).unwrap();
                l.squeeze(0).unwrap().to_vec2::<f32>().unwrap()
            })
            .collect();
        let mut state = model.start_decode(prompts.len()).unwrap();
        let mut worst = 0f32;
        let mut compared = 0;
        for s in 0..longest {
            let ids: Vec<Option<u32>> = prompts
                .iter()
                .map(|p| (s + p.len()).checked_sub(longest).map(|i| p[i]))
                .collect();
            let logits = rows(&model.decode_step(&mut state, &ids).unwrap());
            for (r, p) in prompts.iter().enumerate() {
                if let Some(i) = (s + p.len()).checked_sub(longest) {
                    let d = max_diff(&logits[r], &full[r][i]);
                    worst = worst.max(d);
                    compared += 1;
                    assert!(d < 1e-4, "row {r}, token {i}: |cached − full| = {d}");
                }
            }
        }
        assert_eq!(compared, 9 + 2 + 5);
        assert_eq!(state.positions(), &[9, 2, 5]);
        let scale = full
            .iter()
            .flatten()
            .flatten()
            .fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            scale > 0.5,
            "logits too small for the tolerance to mean much: {scale}"
        );
        eprintln!("max |decode_step − logits| = {worst:e} (max |logit| {scale})");

        // Padding is not invisible by accident: feeding the pads as real tokens changes row 1.
        let mut leaky = model.start_decode(1).unwrap();
        let mut last = Vec::new();
        for id in std::iter::repeat_n(0, longest - 2).chain([11, 12]) {
            last = rows(&model.decode_step(&mut leaky, &[Some(id)]).unwrap()).remove(0);
        }
        assert!(max_diff(&last, &full[1][1]) > 1e-3);
    }

    #[test]
    fn a_row_that_sits_out_keeps_its_state() {
        // Row 0 pauses for two steps in the middle; its next logits equal an unpaused decode.
        let model = hybrid(8);
        let seq = [3u32, 4, 5, 6];
        let mut paused = model.start_decode(2).unwrap();
        let mut plain = model.start_decode(1).unwrap();
        let mut a = Vec::new();
        let mut b = Vec::new();
        for (i, id) in seq.iter().enumerate() {
            if i == 2 {
                for _ in 0..2 {
                    model.decode_step(&mut paused, &[None, Some(9)]).unwrap();
                }
            }
            a = rows(
                &model
                    .decode_step(&mut paused, &[Some(*id), Some(1)])
                    .unwrap(),
            )
            .remove(0);
            b = rows(&model.decode_step(&mut plain, &[Some(*id)]).unwrap()).remove(0);
        }
        assert!(max_diff(&a, &b) < 1e-4);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let model = hybrid(9);
        let mut state = model.start_decode(2).unwrap();
        assert!(model.decode_step(&mut state, &[Some(1)]).is_err());
        assert!(model.decode_step(&mut state, &[Some(1), Some(40)]).is_err());
        let mut decoder = crate::sampling::CpuDecoder::new(&model, 2).unwrap();
        assert!(crate::sampling::prefill(&mut decoder, &[vec![1], vec![]]).is_err());
    }
}
