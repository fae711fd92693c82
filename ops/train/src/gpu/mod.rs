//! The GPU trainer: [`Trainer::step`] as a list of kernel launches on a [`Launcher`], read top
//! to bottom like llm.c's `train_gpt2.cu` — one forward, one backward, one optimizer step.
//!
//! The weights, gradients and AdamW moments live on the device as flat f32 buffers, one slice
//! per parameter in the [`Trainer`]'s order, so the host state a checkpoint is written from is
//! one download away ([`DeviceStep::download`]) and a checkpoint of either device resumes on
//! the other. The same code runs on a GPU ([`kernels::launch::Cuda`]) and, in the tests, on the
//! SIMT shim ([`kernels::launch::Shim`]), where it is held to the CPU trainer step for step.
//!
//! What runs here so far: models whose blocks are all MLPs (pattern `-`, SwiGLU or squared
//! ReLU), tied or untied output head, no MTP depths, f32 throughout, GEMMs through linear.cu.
//! [`DeviceStep::upload`] names anything else. Per step, as [`Trainer::step`]:
//!
//! ```text
//! for each micro-batch:      forward → per-token CE / global loss tokens → backward,
//!                            gradients summed into one buffer, micro-batch by micro-batch
//! global gradient norm → clip → lr from the schedule → AdamW on every parameter
//! ```

pub mod check;
mod launches;

use crate::{BatchSource, Trainer};
use kernels::launch::{Arg, Geometry, Launcher};
use launches::{Kernels, NN, NT, TN, elementwise_grid, row_grid};
use model::config::{Activation, BlockKind};
use model::net::Batch;
use nemo_dag_op::RunError;
use std::collections::BTreeMap;

/// Blocks of the gradient-norm's partial sums (summed in block order by one block), for `n`
/// gradients: one for every 4,096, at most 1,024. A GPU needs about a thousand blocks to read
/// at its memory's speed (64 took 3 ms for 117 M gradients on an H100); the shim, which runs
/// a block per OS thread, needs few for the small models it trains.
fn norm_blocks(n: usize) -> u32 {
    n.div_ceil(4096).clamp(1, 1024) as u32
}

fn device(e: kernels::launch::LaunchError) -> RunError {
    RunError::new(format!("GPU trainer: {e}"))
}

/// One parameter's slice of the flat buffers, in f32 elements.
#[derive(Debug, Clone, Copy)]
struct Slot {
    offset: usize,
    len: usize,
    decay: bool,
}

impl Slot {
    fn at<'b, B>(&self, buffer: &'b B) -> Arg<'b, B> {
        Arg::Ptr(buffer, self.offset * 4)
    }
}

/// The parameters of one MLP block.
struct MlpBlock {
    norm: Slot,
    fc1: Slot,
    fc2: Slot,
}

/// Where each parameter the step touches lives, and the sizes it is launched with.
struct Layout {
    vocab: usize,
    hidden: usize,
    ffn: usize,
    /// fc1's rows: `2·ffn` for SwiGLU (gate, then up), `ffn` for squared ReLU.
    fc1_rows: usize,
    activation: Activation,
    eps: f32,
    embedding: Slot,
    blocks: Vec<MlpBlock>,
    final_norm: Slot,
    /// The output head: the embedding's slot when tied.
    head: Slot,
    slots: Vec<Slot>,
    total: usize,
}

impl Layout {
    fn of(trainer: &Trainer) -> Result<Layout, RunError> {
        let model = &trainer.model;
        let cfg = &model.cfg;
        if let Some(kind) = model.pattern.main.iter().find(|k| **k != BlockKind::Mlp) {
            return Err(unsupported(format!(
                "blocks of kind `{}` (pattern `{}`)",
                kind.symbol(),
                cfg.pattern
            )));
        }
        if !model.pattern.mtp.is_empty() {
            return Err(unsupported("multi-token prediction depths".to_string()));
        }
        let mut slots = Vec::new();
        let mut by_name = BTreeMap::new();
        let mut total = 0;
        for ((name, var), decay) in model.params.iter().zip(&trainer.decay) {
            let slot = Slot {
                offset: total,
                len: var.elem_count(),
                decay: *decay,
            };
            total += slot.len;
            slots.push(slot);
            by_name.insert(name.to_string(), slot);
        }
        let find = |name: &str| {
            by_name
                .get(name)
                .copied()
                .ok_or_else(|| RunError::new(format!("GPU trainer: the model has no `{name}`")))
        };
        let blocks = (0..model.pattern.main.len())
            .map(|i| {
                Ok(MlpBlock {
                    norm: find(&format!("blocks.{i}.norm"))?,
                    fc1: find(&format!("blocks.{i}.mlp.fc1"))?,
                    fc2: find(&format!("blocks.{i}.mlp.fc2"))?,
                })
            })
            .collect::<Result<Vec<_>, RunError>>()?;
        let embedding = find("embedding")?;
        let head = if cfg.tie_embeddings {
            embedding
        } else {
            find("output")?
        };
        Ok(Layout {
            vocab: model.vocab,
            hidden: cfg.hidden,
            ffn: cfg.ffn,
            fc1_rows: match cfg.activation {
                Activation::Swiglu => 2 * cfg.ffn,
                Activation::Relu2 => cfg.ffn,
            },
            activation: cfg.activation,
            eps: cfg.norm_eps as f32,
            embedding,
            blocks,
            final_norm: find("final_norm")?,
            head,
            slots,
            total,
        })
    }
}

fn unsupported(what: String) -> RunError {
    RunError::new(format!(
        "the GPU trainer does not train {what} yet: it trains models of MLP blocks (pattern `-`) \
         so far; run this stage with `device: cpu`"
    ))
}

/// One micro-batch's activations, kept from the forward for the backward, and the backward's
/// scratch. Sized for `rows` tokens; reallocated when a larger micro-batch comes.
struct Activations<B> {
    rows: usize,
    ids: B,
    labels: B,
    /// Per token: its loss mask divided by the global batch's loss tokens.
    dloss: B,
    /// The residual stream entering each block, and after the last one: `(L + 1) × rows × D`.
    xs: B,
    /// Each block's normed input, `L × rows × D`, and each norm's 1/rms, `(L + 1) × rows`.
    normed: B,
    rstd: B,
    /// fc1's output and the activation's, per block.
    fc1_out: B,
    act_out: B,
    final_normed: B,
    logits: B,
    ce: B,
    lse: B,
    dlogits: B,
    dx: B,
    dh: B,
    dnorm_in: B,
    dfc1_out: B,
    dact_out: B,
    dw_partial: B,
    dw: B,
    dtable: B,
}

/// A [`Trainer`]'s weights and AdamW state on a device, and the step that updates them.
pub struct DeviceStep<'l, L: Launcher> {
    launcher: &'l L,
    layout: Layout,
    weights: L::Buffer,
    grads: L::Buffer,
    m: L::Buffer,
    v: L::Buffer,
    norm_partial: L::Buffer,
    norm: L::Buffer,
    acts: Option<Activations<L::Buffer>>,
}

impl<'l, L: Launcher> DeviceStep<'l, L> {
    /// Copies `trainer`'s weights and AdamW moments to the device; an error names what the
    /// GPU trainer cannot train yet.
    pub fn upload(launcher: &'l L, trainer: &Trainer) -> Result<Self, RunError> {
        let layout = Layout::of(trainer)?;
        let weights = trainer.model.params.values().map_err(crate::err)?;
        let weights = launcher.upload_f32(&weights.concat()).map_err(device)?;
        let m = launcher
            .upload_f32(&trainer.opt.m.concat())
            .map_err(device)?;
        let v = launcher
            .upload_f32(&trainer.opt.v.concat())
            .map_err(device)?;
        Ok(DeviceStep {
            launcher,
            grads: launcher.alloc(layout.total * 4).map_err(device)?,
            norm_partial: launcher
                .alloc(norm_blocks(layout.total) as usize * 8)
                .map_err(device)?,
            norm: launcher.alloc(8).map_err(device)?,
            layout,
            weights,
            m,
            v,
            acts: None,
        })
    }

    /// Copies the weights and AdamW moments back into `trainer` (for a checkpoint, or to go on
    /// on the CPU).
    pub fn download(&self, trainer: &mut Trainer) -> Result<(), RunError> {
        let read = |buffer: &L::Buffer, slot: &Slot| {
            self.launcher
                .read_f32(buffer, slot.offset, slot.len)
                .map_err(device)
        };
        for (i, ((_, var), slot)) in trainer
            .model
            .params
            .iter()
            .zip(&self.layout.slots)
            .enumerate()
        {
            let t = candle_core::Tensor::from_vec(
                read(&self.weights, slot)?,
                var.shape(),
                var.device(),
            )
            .map_err(crate::err)?;
            var.set(&t).map_err(crate::err)?;
            trainer.opt.m[i] = read(&self.m, slot)?;
            trainer.opt.v[i] = read(&self.v, slot)?;
        }
        Ok(())
    }

    /// The gradients of the last step, per parameter (clipped when the step clipped them).
    pub fn gradients(&self) -> Result<Vec<Vec<f32>>, RunError> {
        self.layout
            .slots
            .iter()
            .map(|s| {
                self.launcher
                    .read_f32(&self.grads, s.offset, s.len)
                    .map_err(device)
            })
            .collect()
    }

    /// One optimizer step of `trainer` on global batch `trainer.step` of `source`: the device
    /// twin of [`Trainer::step`] with [`crate::NextToken`]. Returns (mean loss, grad norm
    /// before clipping).
    pub fn step(
        &mut self,
        trainer: &mut Trainer,
        source: &mut dyn BatchSource,
    ) -> Result<(f64, f64), RunError> {
        let micro = source.global_batch(trainer.step)?;
        let normaliser = crate::global_loss_tokens(&micro);
        self.zero_grads()?;
        let (mut loss_sum, mut tokens) = (0.0, 0.0);
        for batch in &micro {
            loss_sum += self.forward_backward(batch, normaliser)?;
            tokens += crate::loss_tokens(batch);
        }
        let norm = self.clip(trainer.schedule.clip_grad)?;
        trainer.check_norm(norm)?;
        let lr = trainer.lr();
        self.adamw(trainer, lr)?;
        trainer.opt.t += 1;
        trainer.finish_step(loss_sum / tokens.max(1.0), norm, lr, BTreeMap::new());
        Ok((loss_sum / tokens.max(1.0), norm))
    }

    /// Forward and backward of one micro-batch, its gradients added into `grads`; returns its
    /// summed masked cross-entropy.
    fn forward_backward(&mut self, batch: &Batch, normaliser: f64) -> Result<f64, RunError> {
        let rows = batch.ids.len();
        self.prepare(batch, normaliser)?;
        let (l, acts) = (&self.layout, self.acts.as_ref().ok_or_else(no_acts)?);
        let (w, g) = (&self.weights, &self.grads);
        let (d, v, f, r) = (l.hidden, l.vocab, l.ffn, l.fc1_rows);
        let x_at = |i: usize| Arg::Ptr(&acts.xs, i * rows * d * 4);
        let normed_at = |i: usize| Arg::Ptr(&acts.normed, i * rows * d * 4);
        let rstd_at = |i: usize| Arg::Ptr(&acts.rstd, i * rows * 4);
        let fc1_out_at = |i: usize| Arg::Ptr(&acts.fc1_out, i * rows * r * 4);
        let act_out_at = |i: usize| Arg::Ptr(&acts.act_out, i * rows * f * 4);
        let k = Kernels {
            launcher: self.launcher,
            rows,
        };

        // Forward: x = embed(ids); per block x = x + fc2(act(fc1(rms_norm(x)))).
        k.embedding(l.embedding.at(w), &acts.ids, x_at(0), v, d)?;
        for (i, block) in l.blocks.iter().enumerate() {
            k.rms_norm(
                x_at(i),
                block.norm.at(w),
                normed_at(i),
                rstd_at(i),
                d,
                l.eps,
            )?;
            k.gemm(
                normed_at(i),
                block.fc1.at(w),
                fc1_out_at(i),
                (rows, r, d),
                NT,
                0.0,
            )?;
            k.activation(l.activation, fc1_out_at(i), act_out_at(i), f)?;
            k.copy(x_at(i), x_at(i + 1), rows * d)?;
            k.gemm(
                act_out_at(i),
                block.fc2.at(w),
                x_at(i + 1),
                (rows, d, f),
                NT,
                1.0,
            )?;
        }
        let last = l.blocks.len();
        let final_normed = Arg::Ptr(&acts.final_normed, 0);
        k.rms_norm(
            x_at(last),
            l.final_norm.at(w),
            final_normed,
            rstd_at(last),
            d,
            l.eps,
        )?;
        let logits = Arg::Ptr(&acts.logits, 0);
        k.gemm(final_normed, l.head.at(w), logits, (rows, v, d), NT, 0.0)?;
        k.cross_entropy(logits, acts, v)?;
        let ce = self.launcher.read_f32(&acts.ce, 0, rows).map_err(device)?;
        let loss_sum: f64 = ce
            .iter()
            .zip(&batch.loss_mask)
            .map(|(c, m)| *c as f64 * *m as f64)
            .sum();

        // Backward, in reverse: the head, the final norm, each block, the embedding.
        let (dlogits, dx) = (Arg::Ptr(&acts.dlogits, 0), Arg::Ptr(&acts.dx, 0));
        let (dh, dnorm_in) = (Arg::Ptr(&acts.dh, 0), Arg::Ptr(&acts.dnorm_in, 0));
        k.gemm(dlogits, final_normed, l.head.at(g), (v, d, rows), TN, 1.0)?;
        k.gemm(dlogits, l.head.at(w), dh, (rows, d, v), NN, 0.0)?;
        k.rms_norm_backward(x_at(last), l.final_norm, rstd_at(last), dh, dx, acts, self)?;
        for (i, block) in l.blocks.iter().enumerate().rev() {
            let (dact_out, dfc1_out) = (Arg::Ptr(&acts.dact_out, 0), Arg::Ptr(&acts.dfc1_out, 0));
            k.gemm(dx, block.fc2.at(w), dact_out, (rows, f, d), NN, 0.0)?;
            k.gemm(dx, act_out_at(i), block.fc2.at(g), (d, f, rows), TN, 1.0)?;
            k.activation_backward(l.activation, fc1_out_at(i), dact_out, dfc1_out, f)?;
            k.gemm(
                dfc1_out,
                normed_at(i),
                block.fc1.at(g),
                (r, d, rows),
                TN,
                1.0,
            )?;
            k.gemm(dfc1_out, block.fc1.at(w), dh, (rows, d, r), NN, 0.0)?;
            k.rms_norm_backward(x_at(i), block.norm, rstd_at(i), dh, dnorm_in, acts, self)?;
            k.add(dx, dnorm_in, rows * d)?;
        }
        k.embedding_backward(dx, acts, v, d)?;
        k.add(l.embedding.at(g), Arg::Ptr(&acts.dtable, 0), v * d)?;
        Ok(loss_sum)
    }

    /// Uploads a micro-batch's ids, labels and loss weights, allocating the activations for
    /// its size on first use.
    fn prepare(&mut self, batch: &Batch, normaliser: f64) -> Result<(), RunError> {
        let rows = batch.ids.len();
        if batch.labels.len() != rows || batch.loss_mask.len() != rows {
            return Err(RunError::new(format!(
                "GPU trainer: a micro-batch of {rows} ids has {} labels and {} loss weights",
                batch.labels.len(),
                batch.loss_mask.len()
            )));
        }
        if self.acts.as_ref().is_none_or(|a| a.rows < rows) {
            self.acts = Some(self.allocate(rows)?);
        }
        let acts = self.acts.as_mut().ok_or_else(no_acts)?;
        let dloss: Vec<f32> = batch
            .loss_mask
            .iter()
            .map(|m| (*m as f64 / normaliser) as f32)
            .collect();
        let u32_bytes = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let l = self.launcher;
        l.write(&mut acts.ids, 0, &u32_bytes(&batch.ids))
            .and_then(|_| l.write(&mut acts.labels, 0, &u32_bytes(&batch.labels)))
            .and_then(|_| l.write(&mut acts.dloss, 0, &kernels::launch::f32_bytes(&dloss)))
            .map_err(device)
    }

    fn allocate(&self, rows: usize) -> Result<Activations<L::Buffer>, RunError> {
        let l = &self.layout;
        let (d, v, f, r, blocks) = (l.hidden, l.vocab, l.ffn, l.fc1_rows, l.blocks.len());
        let floats = |n: usize| self.launcher.alloc(n * 4).map_err(device);
        Ok(Activations {
            rows,
            ids: floats(rows)?,
            labels: floats(rows)?,
            dloss: floats(rows)?,
            xs: floats((blocks + 1) * rows * d)?,
            normed: floats(blocks * rows * d)?,
            rstd: floats((blocks + 1) * rows)?,
            fc1_out: floats(blocks * rows * r)?,
            act_out: floats(blocks * rows * f)?,
            final_normed: floats(rows * d)?,
            logits: floats(rows * v)?,
            ce: floats(rows)?,
            lse: floats(rows)?,
            dlogits: floats(rows * v)?,
            dx: floats(rows * d)?,
            dh: floats(rows * d)?,
            dnorm_in: floats(rows * d)?,
            dfc1_out: floats(rows * r)?,
            dact_out: floats(rows * f)?,
            dw_partial: floats(row_grid(rows) as usize * d)?,
            dw: floats(d)?,
            dtable: floats(v * d)?,
        })
    }

    /// Sets every gradient to zero, before a step's first micro-batch.
    fn zero_grads(&mut self) -> Result<(), RunError> {
        let len = self.launcher.len(&self.grads);
        self.launcher
            .write(&mut self.grads, 0, &vec![0u8; len])
            .map_err(device)
    }

    /// The global L2 norm of the gradients (f64 partials summed in block order), and the
    /// gradients scaled to `max_norm` when above it (0: no clipping); returns the norm before.
    fn clip(&mut self, max_norm: f64) -> Result<f64, RunError> {
        let n = self.layout.total;
        let (g, partial, norm) = (&self.grads, &self.norm_partial, &self.norm);
        let l = self.launcher;
        let blocks = norm_blocks(n);
        // SAFETY: grads holds n floats, the partials one double a block, norm one double.
        unsafe {
            l.launch(
                "grad_norm_partials",
                Geometry::linear(blocks, 256),
                &[Arg::Ptr(g, 0), Arg::Usize(n), Arg::Ptr(partial, 0)],
            )
            .and_then(|_| {
                l.launch(
                    "grad_norm_finish",
                    Geometry::linear(1, 256),
                    &[
                        Arg::Ptr(partial, 0),
                        Arg::I32(blocks as i32),
                        Arg::Ptr(norm, 0),
                    ],
                )
            })
            .and_then(|_| {
                l.launch(
                    "grad_clip_f32",
                    Geometry::linear(elementwise_grid(n), 256),
                    &[
                        Arg::Ptr(g, 0),
                        Arg::Usize(n),
                        Arg::Ptr(norm, 0),
                        Arg::F64(max_norm),
                    ],
                )
            })
            .map_err(device)?;
        }
        let norm = l.read_f64(norm, 0, 1).map_err(device)?;
        Ok(norm.first().copied().unwrap_or(f64::NAN))
    }

    /// AdamW on every parameter, with the bias corrections of step `opt.t + 1` computed as
    /// [`crate::optim::AdamW::step`] computes them (f64, rounded to f32).
    fn adamw(&mut self, trainer: &Trainer, lr: f64) -> Result<(), RunError> {
        let c = trainer.schedule.adamw();
        let t = trainer.opt.t + 1;
        let bc1 = 1.0 - c.beta1.powi(t as i32);
        let bc2 = 1.0 - c.beta2.powi(t as i32);
        for slot in &self.layout.slots {
            let wd = if slot.decay {
                c.weight_decay as f32
            } else {
                0.0
            };
            let args = [
                slot.at(&self.weights),
                slot.at(&self.grads),
                slot.at(&self.m),
                slot.at(&self.v),
                Arg::Null,
                Arg::Usize(slot.len),
                Arg::F32(lr as f32),
                Arg::F32(c.beta1 as f32),
                Arg::F32(c.beta2 as f32),
                Arg::F32(bc1 as f32),
                Arg::F32(bc2 as f32),
                Arg::F32(c.eps as f32),
                Arg::F32(wd),
            ];
            // SAFETY: each slot holds `len` floats of the weights, grads and moments.
            unsafe {
                self.launcher.launch(
                    "adamw_f32",
                    Geometry::linear(elementwise_grid(slot.len), 256),
                    &args,
                )
            }
            .map_err(device)?;
        }
        Ok(())
    }
}

fn no_acts() -> RunError {
    RunError::new("GPU trainer: the activations were not allocated".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::{Counting, tempdir, weights};
    use crate::{NextToken, Schedule, checkpoint};
    use kernels::launch::Shim;
    use kernels::simt::Schedule as Warps;
    use model::config::ModelConfig;
    use model::net::Model;
    use serde_json::json;

    /// A model of MLP blocks on the counting task: two blocks, untied head unless `tied`.
    fn trainer(activation: &str, tied: bool, clip: f64) -> Trainer {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "--", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 48,
            "activation": activation, "tie_embeddings": tied
        }))
        .unwrap();
        let schedule: Schedule = serde_json::from_value(json!({
            "steps": 6, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, "min_lr": 1e-3,
            "warmup": 2, "log_interval": 1, "clip_grad": clip
        }))
        .unwrap();
        Trainer::new(Model::new(&cfg, 32, 11).unwrap(), schedule)
    }

    fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
        a.iter()
            .flatten()
            .zip(b.iter().flatten())
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    /// The step's kernels, run by the SIMT shim, give the CPU trainer's gradients: every
    /// launch of the forward and backward (embedding, RMSNorm, GEMMs, activations,
    /// cross-entropy, and the sums over paths and micro-batches) is in this comparison.
    #[test]
    fn one_step_on_the_shim_gives_the_cpu_gradients() {
        for (activation, tied) in [("relu2", false), ("swiglu", true)] {
            let (diff, largest) = check::gradients(&Shim::default(), activation, tied).unwrap();
            assert!(
                diff <= check::GRADIENT_TOLERANCE * largest.max(1.0),
                "{activation}, tied {tied}: gradients {diff} apart (largest {largest})"
            );
        }
    }

    /// Six steps with clipping and the lr schedule on the shim follow the CPU trainer's curve;
    /// both warp schedules give the same bytes (no races, no order-dependent sums); the
    /// weights and moments come back into a checkpoint the CPU trainer resumes from.
    #[test]
    fn steps_on_the_shim_follow_the_cpu_trainer_and_resume_on_the_cpu() {
        let mut cpu = trainer("swiglu", false, 0.5);
        let mut objective_source = Counting(2);
        let mut objective = NextToken::new(&mut objective_source);
        for _ in 0..4 {
            cpu.step(&mut objective).unwrap();
        }
        let run_on = |warps| {
            let mut t = trainer("swiglu", false, 0.5);
            let shim = Shim { schedule: warps };
            let mut step = DeviceStep::upload(&shim, &t).unwrap();
            for _ in 0..4 {
                step.step(&mut t, &mut Counting(2)).unwrap();
            }
            step.download(&mut t).unwrap();
            t
        };
        let on_shim = run_on(Warps::Forward);
        let reversed = run_on(Warps::Reverse);
        assert_eq!(
            weights(&on_shim),
            weights(&reversed),
            "the warp order shows"
        );
        assert_eq!(on_shim.opt, reversed.opt);
        assert_eq!(on_shim.step, 4);
        assert_eq!(on_shim.opt.t, 4);
        for (a, b) in on_shim.curve.iter().zip(&cpu.curve) {
            assert_eq!((a.step, a.lr), (b.step, b.lr));
            assert!((a.loss - b.loss).abs() < 1e-4 * b.loss, "{a:?} vs {b:?}");
            assert!(
                (a.grad_norm - b.grad_norm).abs() < 1e-4 * b.grad_norm,
                "{a:?} vs {b:?}"
            );
        }
        assert_eq!(on_shim.curve.len(), cpu.curve.len());
        let diff = max_diff(&weights(&on_shim), &weights(&cpu));
        assert!(diff < 1e-3, "weights after 4 steps are {diff} apart");

        // The device's state, checkpointed, resumes on the CPU for the last two steps.
        let dir = tempdir("gpu-resume");
        checkpoint::save(&on_shim, &dir).unwrap();
        let mut resumed = trainer("swiglu", false, 0.5);
        checkpoint::restore(&mut resumed, &dir).unwrap();
        assert_eq!(weights(&resumed), weights(&on_shim));
        let mut source = Counting(2);
        let mut objective = NextToken::new(&mut source);
        for _ in 0..2 {
            resumed.step(&mut objective).unwrap();
            cpu.step(&mut objective).unwrap();
        }
        let last = |t: &Trainer| t.curve.last().map(|p| p.loss).unwrap();
        assert!((last(&resumed) - last(&cpu)).abs() < 1e-3 * last(&cpu));
    }

    #[test]
    fn a_model_the_gpu_trainer_cannot_train_yet_is_named() {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "*-", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 48
        }))
        .unwrap();
        let t = Trainer::new(
            Model::new(&cfg, 32, 1).unwrap(),
            trainer("relu2", false, 1.0).schedule,
        );
        let err = DeviceStep::upload(&Shim::default(), &t)
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("blocks of kind `*`") && err.contains("device: cpu"),
            "{err}"
        );
    }
}
