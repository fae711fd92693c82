//! Cached decoding on the device, as ops/model's `decode.rs` decodes on the CPU: feed one token
//! per row, get each row's next-token logits, without running the sequence so far again. What
//! GRPO's rollouts and eval's generation decode with when their stage runs on a GPU.
//!
//! ```text
//! x = embed(ids)                                                     one token a row
//! per block of the main stack:  h = rms_norm(x)
//!   *   qkv = h · qkvᵀ; q, and k, v appended to the block's cache     decode_kv_append_f32
//!       y = softmax(q·kᵀ/√d) · v over the steps the row fed           decode_attention_f32
//!   M   [z, xBC, dt] = h · in_projᵀ; window ← xBC, SiLU(conv)         decode_conv_step_f32
//!       Δ, A; S ← exp(Δ·A)·S + Δ·x⊗B, y = S·C + D·x                   mamba2.cu, decode_ssm_step_f32
//!       gated RMSNorm                                                 gated_rms_norm.cu
//!   -   SwiGLU or squared ReLU MLP;   E  MoE (experts chosen on the host, as in training)
//!   x = x + out_proj(y)
//! logits = rms_norm(x) · headᵀ                                        read back for sampling
//! ```
//!
//! Each block keeps, per row: attention, the keys (after RoPE) and values of every step,
//! `(B, kv_heads, max_len, head_dim)`; Mamba-2, its convolution window `(B, K, channels)` and SSM
//! state `(B, H, P, N)`. A row that sits a step out (`None`: left padding, or finished) still
//! runs, but its Mamba-2 caches stay as they were, its key is never seen by a later step, and
//! its position does not advance: the CPU decoder's rules, so a left-padded prompt decodes as
//! it would alone. The matmuls run at the decoder's precision; MTP depths are not used.

use super::launches::{Kernels, NT};
use super::{
    Activations, Body, DeviceStep, Heads, Mixer, Slots, device, mamba_scratch, moe_layer,
    moe_scratch, no_acts,
};
use crate::Decoders;
use kernels::launch::{Arg, Geometry, Launcher};
use model::layers::Layout;
use model::net::Model;
use model::sampling::Decoder;
use nemo_dag_op::RunError;

/// Threads per block of decode_attention_f32 (at most its `DECODE_MAX_THREADS`).
const ATTENTION_BLOCK: u32 = 128;

/// What one block of the main stack keeps between steps.
enum Cache<B> {
    Attention {
        keys: B,
        values: B,
    },
    Mamba {
        window: B,
        state: B,
    },
    /// MLP and MoE blocks see one token at a time and keep nothing.
    None,
}

/// Attention's per-step buffers, shared by the attention blocks.
struct AttentionScratch<B> {
    /// This step's queries after RoPE, `(B, heads, head_dim)`.
    q: B,
    /// The scores, then the probabilities, of every step so far, `(B, heads, max_len)`.
    scores: B,
    /// Whether each (step, row) fed a real token, int32 `(max_len, B)`.
    real: B,
    /// RoPE's cos and sin at each row's position, `(B, head_dim)`; none without RoPE.
    cos: Option<B>,
    sin: Option<B>,
}

/// A batch of rows decoding on the device with the weights of a [`DeviceStep`] (a trainer's
/// current ones, or a model uploaded for scoring) at its precision: the activations of one
/// token a row, and each block's caches. A [`Decoder`], so `model::sampling::generate_with`
/// samples from it exactly as from the CPU's.
pub struct Decoding<'s, 'l, 'm, L: Launcher> {
    step: &'s DeviceStep<'l, L>,
    acts: Activations<L::Buffer>,
    model: &'m Model,
    rows: usize,
    max_len: usize,
    caches: Vec<Cache<L::Buffer>>,
    attention: Option<AttentionScratch<L::Buffer>>,
    /// Per row, int32: whether it feeds a real token this step.
    active: L::Buffer,
    /// Steps fed so far, and per row the real tokens among them (its next RoPE position).
    steps: usize,
    positions: Vec<usize>,
}

impl<'s, 'l, 'm, L: Launcher> Decoding<'s, 'l, 'm, L> {
    /// Empty caches for `rows` rows of up to `max_len` steps of `model`, whose weights `step`
    /// holds.
    pub fn start(
        step: &'s DeviceStep<'l, L>,
        model: &'m Model,
        rows: usize,
        max_len: usize,
    ) -> Result<Self, RunError> {
        let launcher = step.launcher;
        // One token a row, forward only: no scan over chunks (its scratch and the states
        // entering each chunk are empty), no backward.
        let acts = step.allocate(rows.max(1), 0, 0, false)?;
        let floats = |n: usize| launcher.alloc(n.max(1) * 4).map_err(device);
        let l = &step.layout;
        let main = l.stacks.first().ok_or_else(no_acts)?;
        let mut caches = Vec::with_capacity(main.blocks.len());
        for block in &l.blocks[main.blocks.clone()] {
            caches.push(match block.mixer() {
                Some(Mixer::Attention(h)) if matches!(block.body, Body::Projected(_)) => {
                    let n = rows * h.kv_heads * max_len * h.dim;
                    Cache::Attention {
                        keys: floats(n)?,
                        values: floats(n)?,
                    }
                }
                Some(Mixer::Mamba(s)) => Cache::Mamba {
                    window: floats(rows * s.conv * s.channels())?,
                    state: floats(rows * s.inner() * s.state)?,
                },
                _ => Cache::None,
            });
        }
        let attention = l
            .attention_heads()
            .map(|h| {
                let table = || l.rope.then(|| floats(rows * h.dim)).transpose();
                Ok::<_, RunError>(AttentionScratch {
                    q: floats(rows * h.heads * h.dim)?,
                    scores: floats(rows * h.heads * max_len)?,
                    real: floats(max_len * rows)?,
                    cos: table()?,
                    sin: table()?,
                })
            })
            .transpose()?;
        Ok(Decoding {
            active: floats(rows)?,
            step,
            acts,
            model,
            rows,
            max_len,
            caches,
            attention,
            steps: 0,
            positions: vec![0; rows],
        })
    }

    /// Feeds one token per row (`None`: the row sits this step out) and returns each row's
    /// next-token logits (a row that sat out gets meaningless ones).
    pub fn feed(&mut self, ids: &[Option<u32>]) -> Result<Vec<Vec<f32>>, RunError> {
        let (b, t) = (self.rows, self.steps);
        let vocab = self.step.layout.vocab;
        if ids.len() != b {
            return Err(RunError::new(format!(
                "GPU decoder: {} ids for {b} rows",
                ids.len()
            )));
        }
        if let Some(id) = ids.iter().flatten().find(|id| **id as usize >= vocab) {
            return Err(RunError::new(format!(
                "GPU decoder: token id {id} is outside the model's vocabulary ({vocab})"
            )));
        }
        if t >= self.max_len {
            return Err(RunError::new(format!(
                "GPU decoder: its caches hold {} steps, all fed",
                self.max_len
            )));
        }
        self.upload_step(ids)?;
        self.steps += 1;

        let (step, l, acts) = (self.step, &self.step.layout, &self.acts);
        let w = &step.weights;
        let (d, k) = (
            l.hidden,
            Kernels {
                launcher: step.launcher,
                rows: b,
                precision: step.precision,
            },
        );
        let at = Slots {
            acts,
            rows: b,
            hidden: d,
        };
        let main = l.stacks.first().ok_or_else(no_acts)?;
        k.embedding(l.embedding.at(w), &acts.inputs[0].ids, at.x(0), vocab, d)?;
        for (i, cache) in main.blocks.clone().zip(&self.caches) {
            let (block, a, x) = (&l.blocks[i], &acts.blocks[i], main.slot(i));
            k.enter_block(&at, block.norm.at(w), (i, x), l.eps, false)?;
            let p = match &block.body {
                Body::Moe(experts) => {
                    let (scratch, layer) = (moe_scratch(acts)?, moe_layer(self.model, main, i)?);
                    k.moe(
                        w,
                        experts,
                        layer,
                        (false, None),
                        at.normed(i),
                        a,
                        scratch,
                        d,
                    )?;
                    k.add(at.x(x + 1), scratch.output(), b * d)?;
                    continue;
                }
                Body::Projected(p) => p,
            };
            let (projected, mixed) = (Arg::Ptr(&a.projected, 0), Arg::Ptr(&a.mixed, 0));
            k.gemm(
                at.normed(i),
                p.w_in.at(w),
                projected,
                (b, p.in_width, d),
                NT,
                0.0,
            )?;
            match (p.mixer, cache) {
                (Mixer::Mlp(activation), _) => {
                    k.activation(activation, projected, mixed, p.mid_width, false)?
                }
                (Mixer::Attention(heads), Cache::Attention { keys, values }) => {
                    let scratch = self.attention.as_ref().ok_or_else(no_acts)?;
                    k.attention_step(
                        projected,
                        mixed,
                        heads,
                        (keys, values),
                        scratch,
                        t,
                        self.max_len,
                    )?
                }
                (Mixer::Mamba(ssm), Cache::Mamba { window, state }) => {
                    let scratch = mamba_scratch(acts)?;
                    k.mamba_step(w, &ssm, a, scratch, (window, state), &self.active)?
                }
                _ => {
                    return Err(RunError::new(
                        "GPU decoder: a block's cache does not match its kind",
                    ));
                }
            }
            k.gemm(
                mixed,
                p.w_out.at(w),
                at.x(x + 1),
                (b, d, p.mid_width),
                NT,
                1.0,
            )?;
        }
        let (normed, logits) = (Arg::Ptr(&acts.final_normed, 0), Arg::Ptr(&acts.logits, 0));
        let out = main.output();
        k.rms_norm(
            at.x(out),
            main.final_norm.at(w),
            normed,
            at.rstd(out),
            d,
            l.eps,
            false,
        )?;
        k.gemm(normed, l.head.at(w), logits, (b, vocab, d), NT, 0.0)?;
        let flat = step
            .launcher
            .read_f32(&acts.logits, 0, b * vocab)
            .map_err(device)?;
        Ok(flat.chunks(vocab.max(1)).map(<[f32]>::to_vec).collect())
    }

    /// This step's ids, the rows' flags (and the attention blocks' column of them), and RoPE's
    /// tables at each row's position; then the rows that fed a real token move on.
    fn upload_step(&mut self, ids: &[Option<u32>]) -> Result<(), RunError> {
        let (b, t) = (self.rows, self.steps);
        let launcher = self.step.launcher;
        let tokens: Vec<u8> = ids
            .iter()
            .flat_map(|id| id.unwrap_or(0).to_le_bytes())
            .collect();
        let flags: Vec<u8> = ids
            .iter()
            .flat_map(|id| (id.is_some() as i32).to_le_bytes())
            .collect();
        launcher
            .write(&mut self.acts.inputs[0].ids, 0, &tokens)
            .map_err(device)?;
        launcher
            .write(&mut self.active, 0, &flags)
            .map_err(device)?;
        let positions: Vec<u32> = (0..b)
            .map(|r| {
                if ids[r].is_some() {
                    self.positions[r] as u32
                } else {
                    0
                }
            })
            .collect();
        if let Some(scratch) = self.attention.as_mut() {
            launcher
                .write(&mut scratch.real, t * b * 4, &flags)
                .map_err(device)?;
            if let (Some(rope), Some(cos), Some(sin)) = (
                self.model.rope(),
                scratch.cos.as_mut(),
                scratch.sin.as_mut(),
            ) {
                let layout = Layout {
                    batch: b,
                    len: 1,
                    positions,
                    segments: vec![0; b],
                };
                let tables = rope.fused_tables(&layout).map_err(crate::err)?;
                let f32_bytes = kernels::launch::f32_bytes;
                launcher
                    .write(cos, 0, &f32_bytes(&tables.cos))
                    .map_err(device)?;
                launcher
                    .write(sin, 0, &f32_bytes(&tables.sin))
                    .map_err(device)?;
            }
        }
        for (r, id) in ids.iter().enumerate() {
            if id.is_some() {
                self.positions[r] += 1;
            }
        }
        Ok(())
    }
}

impl<L: Launcher> Decoder for Decoding<'_, '_, '_, L> {
    fn rows(&self) -> usize {
        self.rows
    }
    fn step(&mut self, ids: &[Option<u32>]) -> candle_core::Result<Vec<Vec<f32>>> {
        self.feed(ids)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))
    }
}

/// A device's decoders: each with the step's weights, as they are now.
impl<L: Launcher> Decoders for DeviceStep<'_, L> {
    fn start<'a>(
        &'a self,
        model: &'a Model,
        rows: usize,
        max_len: usize,
    ) -> Result<Box<dyn Decoder + 'a>, RunError> {
        Ok(Box::new(Decoding::start(self, model, rows, max_len)?))
    }
}

impl<L: Launcher> Kernels<'_, L> {
    /// One token a row of an attention block at step `t`: the query, key and value from
    /// `qkv` (RoPE at each row's position), the key and value appended to the block's caches,
    /// then `y` (`rows × heads·dim`), the query's attention over the steps its row fed.
    #[allow(clippy::too_many_arguments)]
    fn attention_step(
        &self,
        qkv: Arg<'_, L::Buffer>,
        y: Arg<'_, L::Buffer>,
        h: Heads,
        (keys, values): (&L::Buffer, &L::Buffer),
        s: &AttentionScratch<L::Buffer>,
        t: usize,
        max_len: usize,
    ) -> Result<(), RunError> {
        fn table<B>(x: &Option<B>) -> Arg<'_, B> {
            x.as_ref().map_or(Arg::Null, |b| Arg::Ptr(b, 0))
        }
        let sizes = [self.rows, t, max_len, h.heads, h.kv_heads, h.dim].map(|v| Arg::I32(v as i32));
        let append = [
            qkv,
            table(&s.cos),
            table(&s.sin),
            Arg::Ptr(&s.q, 0),
            Arg::Ptr(keys, 0),
            Arg::Ptr(values, 0),
        ];
        let width = (h.heads + 2 * h.kv_heads) * h.dim;
        self.elementwise(
            "decode_kv_append_f32",
            self.rows * width,
            &[&append[..], &sizes].concat(),
        )?;
        let attend = [
            Arg::Ptr(&s.q, 0),
            Arg::Ptr(keys, 0),
            Arg::Ptr(values, 0),
            Arg::Ptr(&s.real, 0),
            Arg::Ptr(&s.scores, 0),
            y,
        ];
        let items = (self.rows * h.heads) as u32;
        let geometry = Geometry::linear(items.clamp(1, 1024), ATTENTION_BLOCK);
        self.run(
            "decode_attention_f32",
            geometry,
            &[&attend[..], &sizes].concat(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::launch::Shim;
    use kernels::simt::Schedule;
    use model::config::ModelConfig;
    use model::params::Rng;
    use model::sampling::{Sampling, generate_with};

    /// Every block kind the decoder keeps caches for, and those it does not: Mamba-2 with two
    /// groups, GQA attention with RoPE or none, an MLP and an MoE block.
    fn hybrid(position: &str, seed: u64) -> Model {
        let cfg: ModelConfig = serde_json::from_value(serde_json::json!({
            "pattern": "M*-E*M", "hidden": 16, "heads": 4, "kv_heads": 2, "head_dim": 4,
            "ffn": 32, "max_seq": 64, "init_std": 0.5, "position": position,
            "mamba": {"heads": 4, "head_dim": 4, "groups": 2, "state": 4, "chunk": 4},
            "moe": {"experts": 4, "top_k": 2, "expert_ffn": 8, "shared_ffn": 8}
        }))
        .unwrap();
        Model::new(&cfg, 40, seed).unwrap()
    }

    /// Step after step, with rows sitting steps out (left padding, a row that finished and
    /// one that resumes), the device's logits are the CPU decoder's within f32 rounding
    /// (gpu-check's decoding part), with RoPE and without, in both warp schedules; a decoder
    /// whose caches are full says so.
    #[test]
    fn the_device_decoder_gives_the_cpu_decoders_logits_step_by_step() {
        let steps = super::super::check::DECODE_STEPS;
        for position in ["rope", "none"] {
            let model = hybrid(position, 3);
            for schedule in kernels::simt::SCHEDULES {
                let shim = Shim { schedule };
                let gap = super::super::check::decoding(&shim, &model, &steps).unwrap();
                let tolerance = super::super::check::DECODE_TOLERANCE;
                assert!(gap <= tolerance, "{position} {schedule:?}: {gap:e}");
            }
        }
        let model = hybrid("rope", 3);
        let shim = Shim::default();
        let weights = DeviceStep::upload_for_scoring(&shim, &model).unwrap();
        let mut gpu = Decoding::start(&weights, &model, 3, 2).unwrap();
        for ids in &steps[..2] {
            assert!(gpu.feed(ids).is_ok(), "its caches hold 2 steps");
        }
        let full = gpu.feed(&steps[2]).unwrap_err().to_string();
        assert!(full.contains("hold 2 steps, all fed"), "{full}");
    }

    /// Sampling from the device decoder gives the CPU's completions: the same tokens from the
    /// same generators, prompts of different lengths, stop ids and all.
    #[test]
    fn generation_on_the_device_samples_the_cpus_completions() {
        let model = hybrid("rope", 11);
        let prompts: Vec<Vec<u32>> = vec![vec![3, 4, 5, 6], vec![7], vec![8, 9]];
        let sampling = Sampling {
            temperature: 0.8,
            top_p: 0.95,
            top_k: None,
            max_tokens: 6,
        };
        let rngs = || (0..3).map(|r| Rng::new(100 + r)).collect::<Vec<_>>();
        let stops = [0u32];
        let cpu =
            model::sampling::generate(&model, &prompts, &sampling, &stops, &mut rngs()).unwrap();
        let shim = Shim {
            schedule: Schedule::Forward,
        };
        let weights = DeviceStep::upload_for_scoring(&shim, &model).unwrap();
        let mut gpu = Decoding::start(&weights, &model, 3, 10).unwrap();
        let got = generate_with(
            &mut gpu,
            &prompts,
            &sampling,
            &stops,
            &mut rngs(),
            |_, _| false,
        )
        .unwrap();
        assert_eq!(got, cpu);
        assert!(cpu.iter().any(|c| c.ids.len() > 1), "the rows generate");
    }
}
