//! The whole network: embedding → blocks of the layer pattern → final RMSNorm → output head,
//! plus the optional multi-token-prediction (MTP) depths, and the training loss.
//!
//! ```text
//! x = embed(ids)
//! for each symbol of the pattern:  x = x + mixer(rms_norm(x))       (M, *, -, E)
//! logits = output(rms_norm(x))                         loss = CE(logits, labels)
//! MTP depth k = 1..D:  h = eh_proj([rms_norm(embed(ids shifted left k)); rms_norm(h)])
//!                      h = the depth's blocks(h);  loss += (scale / D) · CE(output(norm(h)), labels shifted left k)
//! ```
//!
//! The loss is per token (`calculate_per_token_loss`): the sum of masked cross-entropies divided
//! by a normaliser the caller gives, the number of loss tokens in the *global* batch, so that
//! gradients summed over micro-batches are exactly those of the global batch.

use super::config::{BlockKind, ModelConfig, Pattern};
use super::layers::{Attention, Context, Layout, Mlp, Rope, linear, rms_norm};
use super::mamba2::Mamba2;
use super::moe::Moe;
use super::params::{Init, ParamStore, Rng};
use candle_core::{Device, Result, Tensor};
use kernels::cross_entropy;

/// One pre-norm residual block.
pub struct Block {
    pub kind: BlockKind,
    pub norm: Tensor,
    pub mixer: Mixer,
}

pub enum Mixer {
    Attention(Attention),
    Mlp(Mlp),
    Mamba(Mamba2),
    Moe(Moe),
}

impl Block {
    fn new(init: &mut Init, kind: BlockKind, cfg: &ModelConfig, out_std: f64) -> Result<Block> {
        let norm = init.constant("norm", &[cfg.hidden], 1.0)?;
        let std = cfg.init_std;
        let mixer = match kind {
            BlockKind::Attention => {
                Mixer::Attention(Attention::new(&mut init.sub("attn"), cfg, out_std)?)
            }
            BlockKind::Mlp => Mixer::Mlp(Mlp::new(
                &mut init.sub("mlp"),
                cfg.hidden,
                cfg.ffn,
                cfg.activation,
                std,
                out_std,
            )?),
            BlockKind::Mamba => {
                let m = cfg
                    .mamba
                    .as_ref()
                    .ok_or_else(|| candle_core::Error::Msg("Mamba blocks need `mamba:`".into()))?;
                Mixer::Mamba(Mamba2::new(
                    &mut init.sub("mamba"),
                    cfg.hidden,
                    m,
                    cfg.norm_eps,
                    std,
                    out_std,
                )?)
            }
            BlockKind::Moe => {
                let m = cfg
                    .moe
                    .as_ref()
                    .ok_or_else(|| candle_core::Error::Msg("MoE blocks need `moe:`".into()))?;
                Mixer::Moe(Moe::new(
                    &mut init.sub("moe"),
                    cfg.hidden,
                    m,
                    cfg.activation,
                    std,
                    out_std,
                )?)
            }
        };
        Ok(Block { kind, norm, mixer })
    }

    fn forward(&self, x: &Tensor, ctx: &Context, eps: f64) -> Result<Tensor> {
        let h = rms_norm(x, &self.norm, eps)?;
        let y = match &self.mixer {
            Mixer::Attention(a) => a.forward(&h, ctx)?,
            Mixer::Mlp(m) => m.forward(&h)?,
            Mixer::Mamba(m) => m.forward(&h, &ctx.layout.segments)?,
            Mixer::Moe(m) => m.forward(&h, ctx.training, ctx.valid)?,
        };
        x + y
    }
}

/// One MTP depth's own weights (shared by every depth when `mtp_shared`).
pub struct MtpDepth {
    pub enorm: Tensor,
    pub hnorm: Tensor,
    pub eh_proj: Tensor,
    pub blocks: Vec<Block>,
    pub final_norm: Tensor,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub pattern: Pattern,
    pub vocab: usize,
    pub params: ParamStore,
    pub embedding: Tensor,
    pub blocks: Vec<Block>,
    pub final_norm: Tensor,
    /// `None` when the output head is the embedding (`tie_embeddings`).
    pub output: Option<Tensor>,
    pub mtp: Vec<MtpDepth>,
    rope: Option<Rope>,
}

/// A micro-batch: `batch × len` tokens, row-major, with their labels and loss mask.
#[derive(Debug, Clone)]
pub struct Batch {
    pub ids: Vec<u32>,
    pub labels: Vec<u32>,
    pub loss_mask: Vec<f32>,
    pub layout: Layout,
    /// Per token: false for padding.
    pub valid: Option<Vec<bool>>,
}

/// The loss of one micro-batch: `total` to differentiate, and its parts as plain numbers.
pub struct Loss {
    pub total: Tensor,
    /// Σ masked CE of the main head and the number of tokens it covers.
    pub main_sum: f64,
    pub tokens: f64,
    /// Σ masked CE per MTP depth.
    pub mtp_sums: Vec<f64>,
}

impl Model {
    /// A freshly initialised model; the same config, vocab and seed give the same weights.
    pub fn new(cfg: &ModelConfig, vocab: usize, seed: u64) -> Result<Model> {
        let pattern = cfg
            .validate()
            .map_err(|e| candle_core::Error::Msg(format!("model.{}: {}", e.field, e.message)))?;
        let mut rng = Rng::new(seed);
        let mut params = ParamStore::default();
        let mut init = Init::new(&mut rng, &mut params);
        let layers = pattern.main.len().max(1);
        let out_std = cfg.init_std / (2.0 * layers as f64).sqrt();
        let embedding = init.normal("embedding", &[vocab, cfg.hidden], cfg.init_std)?;
        let mut blocks = Vec::new();
        for (i, kind) in pattern.main.iter().enumerate() {
            blocks.push(Block::new(
                &mut init.sub(&format!("blocks.{i}")),
                *kind,
                cfg,
                out_std,
            )?);
        }
        let final_norm = init.constant("final_norm", &[cfg.hidden], 1.0)?;
        let depths = if cfg.mtp_shared {
            pattern.mtp.len().min(1)
        } else {
            pattern.mtp.len()
        };
        let mut mtp = Vec::new();
        for d in 0..depths {
            let mut di = init.sub(&format!("mtp.{d}"));
            let enorm = di.constant("enorm", &[cfg.hidden], 1.0)?;
            let hnorm = di.constant("hnorm", &[cfg.hidden], 1.0)?;
            let eh_proj = di.normal("eh_proj", &[cfg.hidden, 2 * cfg.hidden], cfg.init_std)?;
            let mut blocks = Vec::new();
            for (i, kind) in pattern.mtp[d].iter().enumerate() {
                blocks.push(Block::new(
                    &mut di.sub(&format!("blocks.{i}")),
                    *kind,
                    cfg,
                    out_std,
                )?);
            }
            let final_norm = di.constant("final_norm", &[cfg.hidden], 1.0)?;
            mtp.push(MtpDepth {
                enorm,
                hnorm,
                eh_proj,
                blocks,
                final_norm,
            });
        }
        let output = if cfg.tie_embeddings {
            None
        } else {
            Some(init.normal("output", &[vocab, cfg.hidden], cfg.init_std)?)
        };
        let rope = if pattern.count(BlockKind::Attention) > 0 && super::layers::uses_rope(cfg) {
            Some(Rope::new(cfg.head_dim, cfg.max_seq, cfg.rope_theta)?)
        } else {
            None
        };
        Ok(Model {
            cfg: cfg.clone(),
            pattern,
            vocab,
            params,
            embedding,
            blocks,
            final_norm,
            output,
            mtp,
            rope,
        })
    }

    /// The output head: `h (…, hidden) → (…, vocab)` (the embedding when tied).
    pub fn head(&self, h: &Tensor) -> Result<Tensor> {
        linear(h, self.output.as_ref().unwrap_or(&self.embedding))
    }

    /// The rotary tables of attention blocks, when the model uses RoPE.
    pub fn rope(&self) -> Option<&Rope> {
        self.rope.as_ref()
    }

    fn embed(&self, ids: &[u32], layout: &Layout) -> Result<Tensor> {
        let idx = Tensor::from_vec(ids.to_vec(), ids.len(), &Device::Cpu)?;
        self.embedding
            .index_select(&idx, 0)?
            .reshape((layout.batch, layout.len, self.cfg.hidden))
    }

    fn context<'a>(
        &self,
        layout: &'a Layout,
        training: bool,
        valid: Option<&'a [bool]>,
    ) -> Result<Context<'a>> {
        let attention = self.pattern.count(BlockKind::Attention) > 0;
        Ok(Context {
            layout,
            mask: if attention {
                Some(layout.attention_mask()?)
            } else {
                None
            },
            rope: match &self.rope {
                Some(r) => Some(r.fused_tables(layout)?),
                None => None,
            },
            training,
            valid,
        })
    }

    /// The main stack's hidden states `(B, T, hidden)`, before the final norm.
    pub fn hidden(&self, ids: &[u32], ctx: &Context) -> Result<Tensor> {
        let mut x = self.embed(ids, ctx.layout)?;
        for block in &self.blocks {
            x = block.forward(&x, ctx, self.cfg.norm_eps)?;
        }
        Ok(x)
    }

    /// Logits `(B, T, vocab)` of the main head.
    pub fn logits(&self, ids: &[u32], layout: &Layout) -> Result<Tensor> {
        let ctx = self.context(layout, false, None)?;
        let h = self.hidden(ids, &ctx)?;
        self.head(&rms_norm(&h, &self.final_norm, self.cfg.norm_eps)?)
    }

    /// The per-token loss of a micro-batch divided by `normaliser` (loss tokens in the global batch).
    pub fn loss(&self, batch: &Batch, normaliser: f64, training: bool) -> Result<Loss> {
        let layout = &batch.layout;
        let n = layout.batch * layout.len;
        let ctx = self.context(layout, training, batch.valid.as_deref())?;
        let h = self.hidden(&batch.ids, &ctx)?;
        let logits = self.head(&rms_norm(&h, &self.final_norm, self.cfg.norm_eps)?)?;
        let labels = Tensor::from_vec(batch.labels.clone(), n, &Device::Cpu)?;
        let mask = Tensor::from_vec(batch.loss_mask.clone(), n, &Device::Cpu)?;
        let ce = (cross_entropy(&logits.reshape((n, self.vocab))?, &labels)? * &mask)?.sum_all()?;
        let main_sum = ce.to_scalar::<f32>()? as f64;
        let tokens: f64 = batch.loss_mask.iter().map(|m| *m as f64).sum();
        let mut total = (ce / normaliser)?;

        let depths = self.pattern.mtp.len();
        let mut mtp_sums = Vec::with_capacity(depths);
        let mut prev = h;
        for k in 1..=depths {
            let weights = &self.mtp[if self.cfg.mtp_shared { 0 } else { k - 1 }];
            let (ids_k, labels_k, mask_k) = shift_left(batch, k);
            let e = rms_norm(
                &self.embed(&ids_k, layout)?,
                &weights.enorm,
                self.cfg.norm_eps,
            )?;
            let hn = rms_norm(&prev, &weights.hnorm, self.cfg.norm_eps)?;
            let mut x = linear(&Tensor::cat(&[&e, &hn], 2)?, &weights.eh_proj)?;
            for block in &weights.blocks {
                x = block.forward(&x, &ctx, self.cfg.norm_eps)?;
            }
            let logits = self.head(&rms_norm(&x, &weights.final_norm, self.cfg.norm_eps)?)?;
            let labels = Tensor::from_vec(labels_k, n, &Device::Cpu)?;
            let mask = Tensor::from_vec(mask_k, n, &Device::Cpu)?;
            let ce =
                (cross_entropy(&logits.reshape((n, self.vocab))?, &labels)? * &mask)?.sum_all()?;
            mtp_sums.push(ce.to_scalar::<f32>()? as f64);
            let scale = self.cfg.mtp_loss_scale / depths as f64 / normaliser;
            total = (total + (ce * scale)?)?;
            prev = x;
        }
        Ok(Loss {
            total,
            main_sum,
            tokens,
            mtp_sums,
        })
    }

    /// Every MoE layer, main stack first.
    pub fn moe_layers(&self) -> impl Iterator<Item = (String, &Moe)> {
        let main = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (format!("blocks.{i}"), b));
        let mtp = self.mtp.iter().enumerate().flat_map(|(d, m)| {
            m.blocks
                .iter()
                .enumerate()
                .map(move |(i, b)| (format!("mtp.{d}.blocks.{i}"), b))
        });
        main.chain(mtp).filter_map(|(name, b)| match &b.mixer {
            Mixer::Moe(m) => Some((format!("{name}.moe.expert_bias"), m)),
            _ => None,
        })
    }

    /// Aux-loss-free balancing: after each global batch, move every router's expert bias.
    pub fn update_moe_biases(&self) {
        for (_, moe) in self.moe_layers() {
            moe.update_bias();
        }
    }
}

/// Inputs, labels and loss mask for MTP depth `k`: ids shifted left by `k` inside each row;
/// a position keeps its loss only if the label `k` further on is still in the same packed
/// subsequence (rolled-in positions are masked).
pub fn shift_left(batch: &Batch, k: usize) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let (b, t) = (batch.layout.batch, batch.layout.len);
    let seg = &batch.layout.segments;
    let mut ids = vec![0u32; b * t];
    let mut labels = vec![0u32; b * t];
    let mut mask = vec![0f32; b * t];
    for row in 0..b {
        for i in 0..t {
            let at = row * t + i;
            if i + k < t {
                ids[at] = batch.ids[at + k];
                labels[at] = batch.labels[at + k];
                if seg[at + k] == seg[at] {
                    mask[at] = batch.loss_mask[at + k];
                }
            }
        }
    }
    (ids, labels, mask)
}
