//! The transformer pieces: RMSNorm, rotary position embedding, causal self-attention with
//! grouped-query heads, and the MLP. Tensors are `(batch, time, channels)` unless noted.
//!
//! Packed sequences: a row may hold several independent subsequences (SFT packing). Each token
//! carries its subsequence id (`segments`) and its position inside that subsequence
//! (`positions`); attention only looks back inside the same subsequence, and rotary
//! positions restart at 0 for each, as in Megatron-Bridge. Pretraining rows are one segment with
//! positions 0..T.

use super::config::{Activation, ModelConfig, Position};
use super::params::{Init, constant_f32};
use candle_core::{DType, Result, Tensor};
use kernels::RopeTables;

pub use kernels::{linear, rms_norm, softmax, split_heads};

/// Where each token sits in a batch of packed rows.
#[derive(Debug, Clone)]
pub struct Layout {
    pub batch: usize,
    pub len: usize,
    /// Row-major `batch × len`: the token's position inside its subsequence.
    pub positions: Vec<u32>,
    /// Row-major `batch × len`: the subsequence id inside the row.
    pub segments: Vec<u32>,
}

impl Layout {
    /// Unpacked rows: one segment per row, positions `0..len`.
    pub fn plain(batch: usize, len: usize) -> Layout {
        Layout {
            batch,
            len,
            positions: (0..batch).flat_map(|_| 0..len as u32).collect(),
            segments: vec![0; batch * len],
        }
    }

    /// The additive attention mask `(batch, 1, len, len)`: 0 where query `i` may attend to key
    /// `j` (same subsequence and `j ≤ i`), −∞ elsewhere.
    pub fn attention_mask(&self) -> Result<Tensor> {
        let (b, t) = (self.batch, self.len);
        let mut mask = vec![f32::NEG_INFINITY; b * t * t];
        for row in 0..b {
            let seg = &self.segments[row * t..(row + 1) * t];
            for i in 0..t {
                for j in 0..=i {
                    if seg[j] == seg[i] {
                        mask[(row * t + i) * t + j] = 0.0;
                    }
                }
            }
        }
        constant_f32(mask, &[b, 1, t, t])
    }
}

/// Rotary tables for the `rotate_half` convention of Hugging Face Llama: dimension `i` and
/// `i + d/2` rotate together at frequency `theta^(-2i/d)`.
pub struct Rope {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub fn new(head_dim: usize, max_seq: usize, theta: f64) -> Result<Rope> {
        let positions: Vec<u32> = (0..max_seq as u32).collect();
        let (cos, sin) = kernels::rope_angles(head_dim, theta, &positions);
        Ok(Rope {
            cos: constant_f32(cos, &[max_seq, head_dim])?,
            sin: constant_f32(sin, &[max_seq, head_dim])?,
        })
    }

    /// `(cos, sin)` for the layout's positions, shaped `(batch, 1, len, head_dim)`.
    pub fn tables(&self, layout: &Layout) -> Result<(Tensor, Tensor)> {
        let max = self.cos.dim(0)?;
        if let Some(p) = layout.positions.iter().find(|p| **p as usize >= max) {
            candle_core::bail!("position {p} is beyond the model's max_seq {max}")
        }
        let idx = Tensor::from_vec(
            layout.positions.clone(),
            layout.positions.len(),
            self.cos.device(),
        )?;
        let d = self.cos.dim(1)?;
        let shape = (layout.batch, 1, layout.len, d);
        Ok((
            self.cos.index_select(&idx, 0)?.reshape(shape)?,
            self.sin.index_select(&idx, 0)?.reshape(shape)?,
        ))
    }
}

impl Rope {
    /// The same tables as [`Rope::tables`], as the [`kernels::rope`] kernel takes them.
    pub fn fused_tables(&self, layout: &Layout) -> Result<RopeTables> {
        let (cos, sin) = self.tables(layout)?;
        RopeTables::new(&cos, &sin)
    }
}

/// What every block of one forward pass shares: the layout, its mask and rotary tables.
pub struct Context<'a> {
    pub layout: &'a Layout,
    pub mask: Option<Tensor>,
    pub rope: Option<RopeTables>,
    /// A training forward: MoE routers count tokens for load balancing.
    pub training: bool,
    /// Per token: false for padding (MoE routers do not count it).
    pub valid: Option<&'a [bool]>,
}

/// Causal self-attention with grouped-query heads: `heads` query heads share `kv_heads`
/// key/value heads. One fused `qkv` projection (no bias), one output projection.
pub struct Attention {
    pub qkv: Tensor,
    pub proj: Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    pub fn new(init: &mut Init, cfg: &ModelConfig, out_std: f64) -> Result<Attention> {
        let (h, k, d) = (cfg.heads, cfg.kv_heads(), cfg.head_dim);
        Ok(Attention {
            qkv: init.normal("qkv", &[(h + 2 * k) * d, cfg.hidden], cfg.init_std)?,
            proj: init.normal("proj", &[cfg.hidden, h * d], out_std)?,
            heads: h,
            kv_heads: k,
            head_dim: d,
        })
    }

    /// `x (B, T, hidden) → (B, T, hidden)`: the `qkv` projection, [`kernels::attention`] and
    /// the output projection.
    pub fn forward(&self, x: &Tensor, ctx: &Context) -> Result<Tensor> {
        let qkv = linear(x, &self.qkv)?;
        let y = kernels::attention(
            &qkv,
            ctx.mask.as_ref(),
            ctx.rope.as_ref(),
            self.heads,
            self.kv_heads,
            self.head_dim,
        )?;
        linear(&y, &self.proj)
    }
}

/// What one attention block keeps while decoding: the keys (after RoPE) and values of every
/// token fed so far, `(B, kv_heads, T, head_dim)`; `None` before the first token.
#[derive(Default)]
pub struct KvCache {
    pub keys: Option<Tensor>,
    pub values: Option<Tensor>,
}

impl KvCache {
    /// Tokens held per row.
    pub fn len(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dims()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Attention {
    /// One token per row while decoding: `x (B, 1, hidden) → (B, 1, hidden)`. The token's key
    /// and value are appended to `cache`; the query then attends to every cached key the
    /// additive `mask (B, 1, 1, T)` leaves at 0 (T counts the new token). `rope` holds each
    /// row's position of this token, as a layout of `B` rows of length 1.
    pub fn step(
        &self,
        x: &Tensor,
        cache: &mut KvCache,
        rope: Option<&RopeTables>,
        mask: &Tensor,
    ) -> Result<Tensor> {
        let (b, one, _) = x.dims3()?;
        let (h, k, d) = (self.heads, self.kv_heads, self.head_dim);
        let qkv = linear(x, &self.qkv)?;
        let (q, kk, v) = split_heads(&qkv, h, k, d, rope)?;
        let append = |past: &Option<Tensor>, new: Tensor| -> Result<Tensor> {
            match past {
                Some(p) => Tensor::cat(&[p, &new], 2),
                None => Ok(new),
            }
        };
        let keys = append(&cache.keys, kk)?;
        let values = append(&cache.values, v)?;
        let t = keys.dim(2)?;
        let repeat = |x: &Tensor| -> Result<Tensor> {
            if h == k {
                return Ok(x.clone());
            }
            x.unsqueeze(2)?
                .broadcast_as((b, k, h / k, t, d))?
                .reshape((b, h, t, d))
        };
        let scale = 1.0 / (d as f64).sqrt();
        let scores = (q.matmul(&repeat(&keys)?.t()?)? * scale)?.broadcast_add(mask)?;
        let y = softmax(&scores)?.matmul(&repeat(&values)?)?; // (B, heads, 1, D)
        cache.keys = Some(keys);
        cache.values = Some(values);
        let y = y.transpose(1, 2)?.reshape((b, one, h * d))?;
        linear(&y, &self.proj)
    }
}

/// The dense MLP: `fc2(act(fc1(x)))`. With SwiGLU, `fc1` holds the gate and the up
/// projection stacked (`2·ffn` rows) and `act([g, u]) = SiLU(g) ⊙ u`; with squared ReLU it is
/// `relu(x)²` on `ffn` rows.
pub struct Mlp {
    pub fc1: Tensor,
    pub fc2: Tensor,
    activation: Activation,
}

impl Mlp {
    pub fn new(
        init: &mut Init,
        hidden: usize,
        ffn: usize,
        activation: Activation,
        std: f64,
        out_std: f64,
    ) -> Result<Mlp> {
        let rows = match activation {
            Activation::Swiglu => 2 * ffn,
            Activation::Relu2 => ffn,
        };
        Ok(Mlp {
            fc1: init.normal("fc1", &[rows, hidden], std)?,
            fc2: init.normal("fc2", &[hidden, ffn], out_std)?,
            activation,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = activate(&linear(x, &self.fc1)?, self.activation)?;
        linear(&h, &self.fc2)
    }
}

/// The MLP activation on `fc1`'s output (for SwiGLU: gate half, then up half).
pub fn activate(h: &Tensor, activation: Activation) -> Result<Tensor> {
    match activation {
        Activation::Swiglu => kernels::swiglu(h),
        Activation::Relu2 => kernels::relu2(h),
    }
}

/// Whether the config uses rotary embeddings on attention blocks.
pub fn uses_rope(cfg: &ModelConfig) -> bool {
    cfg.position == Position::Rope
}

/// f32 everywhere: training and checkpoints are single precision on the CPU.
pub const DTYPE: DType = DType::F32;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::params::{ParamStore, Rng};
    use candle_core::Device;

    fn cfg(heads: usize, kv: usize) -> ModelConfig {
        serde_json::from_value(serde_json::json!({
            "pattern": "*", "hidden": 16, "heads": heads, "kv_heads": kv, "head_dim": 4
        }))
        .unwrap()
    }

    fn randn(rng: &mut Rng, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| rng.normal() as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn rms_norm_and_softmax_match_their_formulas() {
        let x = Tensor::new(&[[3.0f32, 4.0], [1.0, -1.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let y = kernels::rms_norm_plain(&x, &w, 0.0)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        let r = (12.5f32).sqrt();
        assert!((y[0][0] - 3.0 / r).abs() < 1e-6 && (y[0][1] - 8.0 / r).abs() < 1e-6);
        let p = softmax(&x).unwrap().to_vec2::<f32>().unwrap();
        let e = 1.0 / (1.0 + 1f32.exp());
        assert!((p[0][0] - e).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn cross_entropy_is_minus_log_softmax_at_the_label() {
        let logits = Tensor::new(&[[1.0f32, 2.0, 3.0], [0.0, 0.0, 0.0]], &Device::Cpu).unwrap();
        let labels = Tensor::new(&[2u32, 0], &Device::Cpu).unwrap();
        let l = kernels::cross_entropy_plain(&logits, &labels)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let lse = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
        assert!((l[0] - (lse - 3.0)).abs() < 1e-5 && (l[1] - 3f32.ln()).abs() < 1e-6);
    }

    #[test]
    fn attention_never_looks_ahead_or_across_packed_subsequences() {
        // A row packing two subsequences [a b c | d e] must give, for d and e, exactly what
        // the subsequence [d e] gives alone (with positions restarting at 0).
        let mut rng = Rng::new(3);
        let mut store = ParamStore::default();
        let c = cfg(4, 2);
        let attn = Attention::new(&mut Init::new(&mut rng, &mut store), &c, 0.02).unwrap();
        let rope = Rope::new(4, 16, 10000.0).unwrap();
        let x = randn(&mut rng, &[1, 5, 16]);
        let packed = Layout {
            batch: 1,
            len: 5,
            positions: vec![0, 1, 2, 0, 1],
            segments: vec![0, 0, 0, 1, 1],
        };
        let run = |x: &Tensor, layout: &Layout| {
            let ctx = Context {
                layout,
                mask: Some(layout.attention_mask().unwrap()),
                rope: Some(rope.fused_tables(layout).unwrap()),
                training: false,
                valid: None,
            };
            attn.forward(x, &ctx).unwrap()
        };
        let y = run(&x, &packed);
        let alone = run(&x.narrow(1, 3, 2).unwrap(), &Layout::plain(1, 2));
        assert!(max_diff(&y.narrow(1, 3, 2).unwrap(), &alone) < 1e-6);
        let first = run(&x.narrow(1, 0, 3).unwrap(), &Layout::plain(1, 3));
        assert!(max_diff(&y.narrow(1, 0, 3).unwrap(), &first) < 1e-6);
        // Causality: changing a later token leaves earlier outputs alone.
        let mut v = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[2 * 16] += 1.0;
        let x2 = Tensor::from_vec(v, (1, 5, 16), &Device::Cpu).unwrap();
        let y2 = run(&x2, &packed);
        assert!(max_diff(&y.narrow(1, 0, 2).unwrap(), &y2.narrow(1, 0, 2).unwrap()) < 1e-7);
        assert!(max_diff(&y.narrow(1, 2, 1).unwrap(), &y2.narrow(1, 2, 1).unwrap()) > 1e-6);
    }

    #[test]
    fn grouped_query_attention_equals_repeated_kv_heads() {
        // kv_heads = 1 serving 2 query heads must equal kv_heads = 2 with both KV heads equal.
        let mut rng = Rng::new(5);
        let mut store = ParamStore::default();
        let gqa = Attention::new(&mut Init::new(&mut rng, &mut store), &cfg(2, 1), 0.02).unwrap();
        let q = gqa.qkv.narrow(0, 0, 8).unwrap();
        let k = gqa.qkv.narrow(0, 8, 4).unwrap();
        let v = gqa.qkv.narrow(0, 12, 4).unwrap();
        let full = Attention {
            qkv: Tensor::cat(&[&q, &k, &k, &v, &v], 0).unwrap(),
            proj: gqa.proj.clone(),
            heads: 2,
            kv_heads: 2,
            head_dim: 4,
        };
        let x = randn(&mut rng, &[2, 3, 16]);
        let layout = Layout::plain(2, 3);
        let ctx = Context {
            layout: &layout,
            mask: Some(layout.attention_mask().unwrap()),
            rope: None,
            training: false,
            valid: None,
        };
        let a = gqa.forward(&x, &ctx).unwrap();
        let b = full.forward(&x, &ctx).unwrap();
        assert!(max_diff(&a, &b) < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_half_a_head_apart() {
        let rope = Rope::new(4, 8, 10000.0).unwrap();
        let layout = Layout::plain(1, 2);
        let (cos, sin) = rope.tables(&layout).unwrap();
        let x = Tensor::new(&[1.0f32, 0.0, 0.0, 0.0], &Device::Cpu)
            .unwrap()
            .reshape((1, 1, 1, 4))
            .unwrap()
            .broadcast_as((1, 1, 2, 4))
            .unwrap()
            .contiguous()
            .unwrap();
        let y = kernels::rope_plain(&x, &cos, &sin)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // position 0: unchanged; position 1: dims (0, 2) rotate by angle 1 rad.
        assert_eq!(&y[0..4], &[1.0, 0.0, 0.0, 0.0]);
        assert!((y[4] - 1f32.cos()).abs() < 1e-6 && (y[6] - 1f32.sin()).abs() < 1e-6);
        assert!(rope.tables(&Layout::plain(1, 9)).is_err(), "beyond max_seq");
    }

    #[test]
    fn every_attention_and_mlp_weight_gets_a_gradient() {
        let mut rng = Rng::new(9);
        let mut store = ParamStore::default();
        let c = cfg(2, 1);
        let mut init = Init::new(&mut rng, &mut store);
        let attn = Attention::new(&mut init.sub("attn"), &c, 0.02).unwrap();
        let mlp = Mlp::new(&mut init.sub("mlp"), 16, 8, Activation::Swiglu, 0.02, 0.02).unwrap();
        let x = randn(&mut rng, &[1, 4, 16]);
        let layout = Layout::plain(1, 4);
        let rope = Rope::new(4, 8, 10000.0).unwrap();
        let ctx = Context {
            layout: &layout,
            mask: Some(layout.attention_mask().unwrap()),
            rope: Some(rope.fused_tables(&layout).unwrap()),
            training: true,
            valid: None,
        };
        let y = mlp.forward(&attn.forward(&x, &ctx).unwrap()).unwrap();
        let grads = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
        for (name, var) in store.iter() {
            let g = grads.get(var.as_tensor()).expect(name);
            let gv = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // Query and key rows of the fused projection too (a fused softmax would zero them).
            let rows = var.dim(0).unwrap();
            let cols = gv.len() / rows;
            let dead = (0..rows)
                .filter(|r| gv[r * cols..(r + 1) * cols].iter().all(|v| *v == 0.0))
                .count();
            assert_eq!(dead, 0, "{name}: {dead} of {rows} rows have no gradient");
        }
    }
}
