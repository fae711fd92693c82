//! The training loop shared by every training op (`pretrain`, `sft`, `dpo`, `grpo`), and its
//! checkpoints.
//!
//! What is minimised is an [`Objective`]; `pretrain` and `sft` use [`NextToken`], the per-token
//! cross-entropy of a [`BatchSource`]. One optimizer step, top to bottom ([`Trainer::step`]):
//!
//! 1. The objective prepares global step N: it reads that step's micro-batches (an RL
//!    objective also generates its rollouts here). Everything it does is a pure function of
//!    the step number and the weights, so resuming at step N sees exactly what an
//!    uninterrupted run would have seen.
//! 2. For [`NextToken`]: count the loss tokens of the whole global batch; every micro-batch's
//!    loss is its summed cross-entropy divided by that count (per-token loss), so the
//!    gradients summed over micro-batches are the global batch's.
//! 3. Backward each micro-batch and add its gradients up, in micro-batch order. With more
//!    than one thread the micro-batches run side by side, one per worker thread (data
//!    parallelism inside the process; see [`Trainer::threads`]); the sums are still taken in
//!    micro-batch order, so the thread count never changes which bytes come out.
//! 4. Clip to the global norm, take the learning rate from the schedule, AdamW.
//! 5. Move the MoE routers' expert biases (aux-loss-free balancing).
//!
//! Checkpoints ([`checkpoint`]) hold the weights, AdamW's moments and step, and the curve so
//! far; with them a resumed run continues bit for bit.

pub mod checkpoint;
pub mod choice;
pub mod data;
pub mod dpo;
pub mod eval;
pub mod footprint;
pub mod gpu;
pub mod grpo;
pub mod optim;
pub mod order;

use candle_core::Tensor;
use model::net::{Batch, Model};
use model::params::to_f32_vec;
use model::sampling::Decoder;
use nemo_dag_op::RunError;
use optim::{AdamW, AdamWConfig, Decay};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::Write;
use std::time::Instant;

fn d_beta1() -> f64 {
    0.9
}
fn d_beta2() -> f64 {
    0.95
}
fn d_eps() -> f64 {
    1e-8
}
fn d_wd() -> f64 {
    0.1
}
fn d_clip() -> f64 {
    1.0
}
fn d_seed() -> u64 {
    1234
}
fn d_log() -> u64 {
    10
}

/// The optimisation settings common to `pretrain` and `sft` (flattened into their params).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Optimizer steps (each one global batch).
    pub steps: u64,
    /// Sequences per optimizer step.
    pub global_batch: usize,
    /// Sequences per forward/backward; `global_batch` must be a multiple of it.
    pub micro_batch: usize,
    pub lr: f64,
    #[serde(default)]
    pub min_lr: f64,
    #[serde(default)]
    pub warmup: u64,
    #[serde(default)]
    pub decay: Decay,
    #[serde(default = "d_wd")]
    pub weight_decay: f64,
    #[serde(default = "d_beta1")]
    pub beta1: f64,
    #[serde(default = "d_beta2")]
    pub beta2: f64,
    #[serde(default = "d_eps")]
    pub eps: f64,
    /// Global gradient-norm clip (0: off).
    #[serde(default = "d_clip")]
    pub clip_grad: f64,
    #[serde(default = "d_seed")]
    pub seed: u64,
    #[serde(default = "d_log")]
    pub log_interval: u64,
    /// Checkpoint every this many steps (0: only at the end).
    #[serde(default)]
    pub save_interval: u64,
}

impl Schedule {
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.steps == 0 {
            return Err(("steps", "steps must be > 0".into()));
        }
        if self.micro_batch == 0
            || self.global_batch == 0
            || !self.global_batch.is_multiple_of(self.micro_batch)
        {
            return Err((
                "global_batch",
                format!(
                    "global_batch ({}) must be a positive multiple of micro_batch ({})",
                    self.global_batch, self.micro_batch
                ),
            ));
        }
        if !self.lr.is_finite()
            || !self.min_lr.is_finite()
            || self.lr <= 0.0
            || self.min_lr < 0.0
            || self.min_lr > self.lr
        {
            return Err(("lr", "need lr > 0 and 0 <= min_lr <= lr".into()));
        }
        Ok(())
    }

    fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
        }
    }
}

/// Where batches come from: the micro-batches of global step `step`.
pub trait BatchSource: Send + Sync {
    fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError>;
}

/// What one optimizer step minimises.
///
/// `loss` takes `&self`: the micro-batches of a step may be computed on several threads at
/// once. Whatever a micro-batch adds to the step's figures goes in its [`MicroLoss::tally`];
/// the trainer sums the tallies (in micro-batch order) and hands them to `metrics`.
pub trait Objective: Sync {
    /// Get ready for global step `step` (0-based) with the weights as they are now; returns
    /// how many micro-batches the step has.
    fn prepare(&mut self, model: &Model, step: u64) -> Result<usize, RunError>;
    /// [`Objective::prepare`] for a step on a device, where what the objective generates
    /// (GRPO's rollouts) decodes with `decoders`; by default, [`Objective::prepare`].
    fn prepare_on(
        &mut self,
        model: &Model,
        step: u64,
        decoders: &dyn Decoders,
    ) -> Result<usize, RunError> {
        let _ = decoders;
        self.prepare(model, step)
    }
    /// The loss of micro-batch `i` of the prepared step. The losses of all micro-batches add
    /// up to the global batch's loss (each divides by a global count, not its own).
    fn loss(&self, model: &Model, i: usize) -> Result<MicroLoss, RunError>;
    /// Figures of the prepared step beyond the loss (rewards, accuracy, KL…), logged and
    /// kept in the curve; `tally` is the sum of the micro-batches' tallies.
    fn metrics(&mut self, tally: &Tally) -> BTreeMap<String, f64> {
        let _ = tally;
        BTreeMap::new()
    }
    /// The objective as a function of the output head's per-token log-probabilities
    /// ([`PerToken`]): what the GPU trainer ([`gpu::DeviceStep`]) minimises. `None`: the
    /// objective trains on the CPU only.
    fn per_token(&self) -> Option<&dyn PerToken> {
        None
    }
}

/// Where generation decodes when a step or a score runs on a device: each call starts a
/// [`Decoder`] of `rows` rows and up to `max_len` steps with `model`'s weights as the device
/// holds them ([`gpu::Decoding`]).
pub trait Decoders {
    fn start<'a>(
        &'a self,
        model: &'a Model,
        rows: usize,
        max_len: usize,
    ) -> Result<Box<dyn Decoder + 'a>, RunError>;
}

/// An objective whose loss on a micro-batch is a function of the log-probabilities the main
/// output head gives the micro-batch's labels, `logp[t] = log softmax(logits[t])[labels[t]]`,
/// and of a frozen reference model's: next-token cross-entropy (`−Σ mask·logp`, with the MTP
/// heads' losses beside it), DPO (sums of `logp − ref` over each completion) and GRPO (the
/// clipped surrogate and the k3 KL per token). The GPU trainer runs the network, hands each
/// micro-batch's `logp` to [`PerToken::grad`], and back-propagates the gradient it returns;
/// everything between the two is the objective's own arithmetic on the host.
pub trait PerToken {
    /// Micro-batch `i` of the step [`Objective::prepare`] prepared: ids, labels and layout
    /// (its loss mask is what the MTP heads read, when they are trained).
    fn batch(&self, i: usize) -> Result<std::borrow::Cow<'_, Batch>, RunError>;
    /// When the MTP heads are trained (next-token cross-entropy): what their masked
    /// cross-entropy is divided by, the global batch's loss tokens, as the main head's is.
    /// `None`: the objective reads the main head only, and MTP depths get no gradient.
    fn mtp_normaliser(&self) -> Option<f64> {
        None
    }
    /// Whether the policy's forward counts the tokens each MoE expert gets, for the
    /// aux-loss-free bias update after the step: as the CPU trainer does, a training forward
    /// ([`Model::loss`], next-token cross-entropy) counts, and the log-probabilities DPO and
    /// GRPO read through [`Model::logits`] do not.
    fn counts_experts(&self) -> bool {
        false
    }
    /// The frozen model whose log-probabilities [`PerToken::grad`] reads, if any.
    fn reference(&self) -> Option<&Model> {
        None
    }
    /// Micro-batch `i`'s loss from the policy's `logp` (and the reference's, when
    /// [`PerToken::reference`] is given): its figures, and `∂loss/∂logp` per token.
    fn grad(
        &self,
        i: usize,
        logp: &[f32],
        reference: Option<&[f32]>,
    ) -> Result<TokenGrad, RunError>;
}

/// What [`PerToken::grad`] gives for one micro-batch: the loss's gradient in each token's
/// log-probability, and the figures a [`MicroLoss`] carries.
pub struct TokenGrad {
    pub dlogp: Vec<f32>,
    pub sum: f64,
    pub count: f64,
    pub tally: Tally,
}

/// How an optimizer step is taken: on the CPU by candle's autograd ([`OnCpu`]), or on a GPU
/// by a [`gpu::DeviceStep`] ([`gpu::OnDevice`]). [`Trainer::run_on`] drives either.
pub trait Stepper {
    /// One optimizer step of `trainer` (its step count and curve advance); returns (mean
    /// loss, grad norm before clipping).
    fn step(&mut self, trainer: &mut Trainer) -> Result<(f64, f64), RunError>;
    /// Brings `trainer`'s weights and optimizer state up to date with the stepper's, before a
    /// checkpoint or the model is written from it.
    fn sync(&mut self, trainer: &mut Trainer) -> Result<(), RunError> {
        let _ = trainer;
        Ok(())
    }
}

/// Steps on the CPU: [`Trainer::step`] on an objective.
pub struct OnCpu<'o, 'a>(pub &'o mut (dyn Objective + 'a));

impl Stepper for OnCpu<'_, '_> {
    fn step(&mut self, trainer: &mut Trainer) -> Result<(f64, f64), RunError> {
        trainer.step(self.0)
    }
}

/// Named sums a micro-batch contributes to its step's figures (see [`Objective::metrics`]).
pub type Tally = BTreeMap<&'static str, f64>;

/// One micro-batch's loss: `total` to differentiate, and `sum / count` added into the logged
/// loss of the step (Σ sum / Σ count over the micro-batches).
pub struct MicroLoss {
    pub total: Tensor,
    pub sum: f64,
    pub count: f64,
    pub tally: Tally,
}

/// The language-model objective of `pretrain` and `sft`: per-token cross-entropy over the
/// loss tokens of a [`BatchSource`]'s global batch (plus the MTP heads' scaled losses).
pub struct NextToken<'a> {
    source: &'a mut dyn BatchSource,
    micro: Vec<Batch>,
    normaliser: f64,
}

impl<'a> NextToken<'a> {
    pub fn new(source: &'a mut dyn BatchSource) -> NextToken<'a> {
        NextToken {
            source,
            micro: Vec::new(),
            normaliser: 1.0,
        }
    }
}

impl Objective for NextToken<'_> {
    fn per_token(&self) -> Option<&dyn PerToken> {
        Some(self)
    }

    fn prepare(&mut self, _model: &Model, step: u64) -> Result<usize, RunError> {
        self.micro = self.source.global_batch(step)?;
        self.normaliser = global_loss_tokens(&self.micro);
        Ok(self.micro.len())
    }

    fn loss(&self, model: &Model, i: usize) -> Result<MicroLoss, RunError> {
        let loss = model
            .loss(&self.micro[i], self.normaliser, true)
            .map_err(err)?;
        Ok(MicroLoss {
            total: loss.total,
            sum: loss.main_sum,
            count: loss.tokens,
            tally: Tally::new(),
        })
    }
}

/// `loss = −Σ mask·logp / normaliser`: `∂loss/∂logp = −mask / normaliser`, the figures those
/// of [`NextToken::loss`] (the main head's summed cross-entropy over its loss tokens).
impl PerToken for NextToken<'_> {
    fn batch(&self, i: usize) -> Result<std::borrow::Cow<'_, Batch>, RunError> {
        self.micro
            .get(i)
            .map(std::borrow::Cow::Borrowed)
            .ok_or_else(|| RunError::new(format!("no micro-batch {i} in the prepared step")))
    }

    fn mtp_normaliser(&self) -> Option<f64> {
        Some(self.normaliser)
    }

    fn counts_experts(&self) -> bool {
        true
    }

    fn grad(
        &self,
        i: usize,
        logp: &[f32],
        _reference: Option<&[f32]>,
    ) -> Result<TokenGrad, RunError> {
        let batch = self.batch(i)?;
        let mask = &batch.loss_mask;
        Ok(TokenGrad {
            dlogp: mask
                .iter()
                .map(|m| -((*m as f64 / self.normaliser) as f32))
                .collect(),
            sum: logp
                .iter()
                .zip(mask)
                .map(|(l, m)| -*l as f64 * *m as f64)
                .sum(),
            count: loss_tokens(&batch),
            tally: Tally::new(),
        })
    }
}

/// The loss tokens of a micro-batch: the sum of its loss mask.
pub fn loss_tokens(batch: &Batch) -> f64 {
    batch.loss_mask.iter().map(|m| *m as f64).sum()
}

/// What every micro-batch's summed cross-entropy is divided by: the loss tokens of the whole
/// global batch (at least 1), so the micro-batches' gradients add up to the global batch's.
pub fn global_loss_tokens(micro: &[Batch]) -> f64 {
    micro.iter().map(loss_tokens).sum::<f64>().max(1.0)
}

/// Per-token log-probabilities `(B, T)` of `labels` under the model: `out[b, t] =
/// log softmax(logits[b, t])[labels[b, t]]`, differentiable (the preference and RL objectives'
/// building block).
pub fn token_logprobs(
    model: &Model,
    ids: &[u32],
    labels: &[u32],
    layout: &model::layers::Layout,
) -> candle_core::Result<Tensor> {
    let n = layout.batch * layout.len;
    let logits = model.logits(ids, layout)?.reshape((n, model.vocab))?;
    let labels = Tensor::from_vec(labels.to_vec(), n, logits.device())?;
    kernels::cross_entropy(&logits, &labels)?
        .neg()?
        .reshape((layout.batch, layout.len))
}

/// One logged point of the training curve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Point {
    pub step: u64,
    pub loss: f64,
    pub lr: f64,
    pub grad_norm: f64,
    /// The objective's own figures (see [`Objective::metrics`]); absent for `pretrain`/`sft`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
}

/// A model, its optimizer state and its progress.
pub struct Trainer {
    pub model: Model,
    pub opt: AdamW,
    pub schedule: Schedule,
    /// Optimizer steps done.
    pub step: u64,
    pub curve: Vec<Point>,
    /// The objective's figures for the last step.
    pub last_metrics: BTreeMap<String, f64>,
    /// Micro-batches computed at once, each on its own single-threaded worker
    /// ([`kernels::workers`]); starts at candle's thread count. With 1 (or a step of one
    /// micro-batch) they run on the calling thread, with candle's own threads.
    pub threads: usize,
    decay: Vec<bool>,
}

pub fn err(e: candle_core::Error) -> RunError {
    RunError::new(format!("training: {e}"))
}

/// What a micro-batch's backward leaves for the step: its loss figures and its gradient per
/// parameter (`None` for a parameter it does not reach).
struct MicroGrads {
    sum: f64,
    count: f64,
    tally: Tally,
    grads: Vec<Option<Tensor>>,
}

fn micro_grads(objective: &dyn Objective, model: &Model, i: usize) -> Result<MicroGrads, RunError> {
    let loss = objective.loss(model, i)?;
    let store = loss.total.backward().map_err(err)?;
    let grads = model
        .params
        .iter()
        .map(|(_, var)| store.get(var.as_tensor()).cloned())
        .collect();
    Ok(MicroGrads {
        sum: loss.sum,
        count: loss.count,
        tally: loss.tally,
        grads,
    })
}

impl Trainer {
    pub fn new(model: Model, schedule: Schedule) -> Trainer {
        let sizes: Vec<usize> = model.params.iter().map(|(_, v)| v.elem_count()).collect();
        let decay = model.params.iter().map(|(_, v)| v.rank() >= 2).collect();
        Trainer {
            model,
            opt: AdamW::new(&sizes),
            schedule,
            step: 0,
            curve: Vec::new(),
            last_metrics: BTreeMap::new(),
            threads: kernels::workers::threads(),
            decay,
        }
    }

    /// One optimizer step on global step `self.step` of the objective; returns (mean loss,
    /// grad norm before clipping).
    pub fn step(&mut self, objective: &mut dyn Objective) -> Result<(f64, f64), RunError> {
        let micro = objective.prepare(&self.model, self.step)?;
        // Gradients summed over the micro-batches, per parameter, in plain buffers: the first
        // micro-batch's gradient is copied out, later ones are added in place, always in
        // micro-batch order (so the sums are the same bytes as `acc + g` tensor by tensor,
        // however many threads computed them).
        let mut sums: Vec<Option<Vec<f32>>> = vec![None; self.model.params.len()];
        let (mut loss_sum, mut tokens) = (0.0, 0.0);
        let mut tally = Tally::new();
        let wave = self.threads.max(1);
        for start in (0..micro).step_by(wave) {
            let (model, objective) = (&self.model, &*objective);
            let done = kernels::workers::map(wave.min(micro - start), wave, |k| {
                micro_grads(objective, model, start + k)
            })
            .map_err(|e| RunError::new(format!("cannot start a training thread: {e}")))?;
            for m in done {
                let m = m?;
                loss_sum += m.sum;
                tokens += m.count;
                for (k, v) in m.tally {
                    *tally.entry(k).or_insert(0.0) += v;
                }
                for (sum, g) in sums.iter_mut().zip(m.grads) {
                    if let Some(g) = g {
                        match sum {
                            Some(acc) => add_into(acc, &g).map_err(err)?,
                            None => *sum = Some(to_f32_vec(&g).map_err(err)?),
                        }
                    }
                }
            }
        }
        let mut grads = Vec::with_capacity(sums.len());
        for (sum, (_, var)) in sums.into_iter().zip(self.model.params.iter()) {
            grads.push(sum.unwrap_or_else(|| vec![0.0; var.elem_count()]));
        }
        let norm = optim::clip(&mut grads, self.schedule.clip_grad);
        self.check_norm(norm)?;
        let s = &self.schedule;
        let lr = self.lr();
        let mut weights = Vec::with_capacity(grads.len());
        for (_, var) in self.model.params.iter() {
            weights.push(to_f32_vec(var.as_tensor()).map_err(err)?);
        }
        self.opt
            .step(&mut weights, &grads, &self.decay, lr, &s.adamw());
        for ((_, var), w) in self.model.params.iter().zip(weights) {
            let t = Tensor::from_vec(w, var.shape(), var.device()).map_err(err)?;
            var.set(&t).map_err(err)?;
        }
        self.model.update_moe_biases();
        let loss = loss_sum / tokens.max(1.0);
        let metrics = objective.metrics(&tally);
        self.finish_step(loss, norm, lr, metrics);
        Ok((loss, norm))
    }

    /// The learning rate of the step about to be taken.
    pub fn lr(&self) -> f64 {
        let s = &self.schedule;
        optim::lr_at(self.step, s.steps, s.lr, s.min_lr, s.warmup, s.decay)
    }

    /// A step whose gradient norm is not finite stops the run: its update would be garbage.
    pub fn check_norm(&self, norm: f64) -> Result<(), RunError> {
        if norm.is_finite() {
            return Ok(());
        }
        Err(RunError::new(format!(
            "step {}: the gradient norm is {norm}; lower lr or check the data",
            self.step + 1
        )))
    }

    /// Counts a step taken (on any device) and keeps its point of the curve when it is
    /// logged: every `log_interval` steps, the first and the last.
    pub fn finish_step(&mut self, loss: f64, norm: f64, lr: f64, metrics: BTreeMap<String, f64>) {
        self.step += 1;
        self.last_metrics = metrics;
        let s = &self.schedule;
        if self.step.is_multiple_of(s.log_interval.max(1)) || self.step == s.steps || self.step == 1
        {
            self.curve.push(Point {
                step: self.step,
                loss,
                lr,
                grad_norm: norm,
                metrics: self.last_metrics.clone(),
            });
        }
    }

    /// Train to `schedule.steps`, checkpointing into `ckpt_dir` every `save_interval` steps
    /// and at the end. Every `log_interval` steps it writes a line to `log` and tells
    /// `progress` (step, steps, figures); `stop_after` ends early (after its checkpoint), as a
    /// preempted job would.
    pub fn run(
        &mut self,
        objective: &mut dyn Objective,
        ckpt_dir: &std::path::Path,
        tokens_per_step: impl Fn(u64) -> u64,
        log: &mut dyn Write,
        progress: &mut dyn FnMut(u64, u64, &str),
        stop_after: Option<u64>,
    ) -> Result<Value, RunError> {
        let mut stepper = OnCpu(objective);
        self.run_on(
            &mut stepper,
            ckpt_dir,
            tokens_per_step,
            log,
            progress,
            stop_after,
        )
    }

    /// [`Trainer::run`] with the steps taken by `stepper` (on the CPU or a GPU): the same
    /// log lines, progress, checkpoints and summary whichever it is.
    pub fn run_on(
        &mut self,
        stepper: &mut dyn Stepper,
        ckpt_dir: &std::path::Path,
        tokens_per_step: impl Fn(u64) -> u64,
        log: &mut dyn Write,
        progress: &mut dyn FnMut(u64, u64, &str),
        stop_after: Option<u64>,
    ) -> Result<Value, RunError> {
        let s = self.schedule.clone();
        let start = self.step;
        let clock = Instant::now();
        let mut window = (Instant::now(), 0u64);
        let mut last = (f64::NAN, f64::NAN);
        while self.step < s.steps {
            last = stepper.step(self)?;
            window.1 += tokens_per_step(self.step - 1);
            if self.step.is_multiple_of(s.log_interval.max(1)) || self.step == s.steps {
                let secs = window.0.elapsed().as_secs_f64();
                let extra: String = self
                    .last_metrics
                    .iter()
                    .map(|(k, v)| format!(" | {k} {v:.4}"))
                    .collect();
                let figures = format!(
                    "loss {:.4} | lr {:.3e} | grad norm {:.3} | {:.0} tokens/s{extra}",
                    last.0,
                    optim::lr_at(self.step - 1, s.steps, s.lr, s.min_lr, s.warmup, s.decay),
                    last.1,
                    window.1 as f64 / secs.max(1e-9)
                );
                writeln!(log, "step {:>6}/{} | {figures}", self.step, s.steps)?;
                progress(self.step, s.steps, &figures);
                window = (Instant::now(), 0);
            }
            let save = s.save_interval > 0 && self.step.is_multiple_of(s.save_interval);
            if save || self.step == s.steps {
                stepper.sync(self)?;
                checkpoint::save(self, ckpt_dir).map_err(|e| {
                    RunError::new(format!(
                        "cannot write checkpoint in {}: {e}",
                        ckpt_dir.display()
                    ))
                })?;
                writeln!(log, "checkpoint: step {} saved", self.step)?;
            }
            if stop_after.is_some_and(|n| self.step >= n) && self.step < s.steps {
                return Err(RunError::new(format!(
                    "stopped after step {} as asked; run again to resume",
                    self.step
                )));
            }
        }
        let seconds = clock.elapsed().as_secs_f64();
        let tokens: u64 = (start..self.step).map(&tokens_per_step).sum();
        Ok(json!({
            "step": self.step,
            "final_loss": last.0,
            "parameters": self.model.params.count(),
            "tokens_trained": tokens,
            "tokens_per_second": tokens as f64 / seconds.max(1e-9),
            "resumed_from_step": start,
            "curve": self.curve,
        }))
    }
}

/// `acc += g` element by element, reading `g`'s storage in place when it is a contiguous f32
/// CPU tensor (a backward pass's gradients are), else through a copy.
fn add_into(acc: &mut [f32], g: &Tensor) -> candle_core::Result<()> {
    if g.elem_count() != acc.len() {
        candle_core::bail!("gradient of {} values for {}", g.elem_count(), acc.len())
    }
    kernels::rows::with_values(g, |values| kernels::simd::add_assign(acc, values))
}

#[cfg(test)]
mod tests {
    use super::*;
    pub(crate) use crate::gpu::check::Counting;
    use model::config::ModelConfig;

    fn trainer(steps: u64, save_interval: u64) -> Trainer {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": "*-*-", "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 64
        }))
        .unwrap();
        let schedule: Schedule = serde_json::from_value(json!({
            "steps": steps, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, "min_lr": 1e-3,
            "warmup": 2, "log_interval": 5, "save_interval": save_interval
        }))
        .unwrap();
        Trainer::new(Model::new(&cfg, 32, 11).unwrap(), schedule)
    }

    pub(crate) fn weights(t: &Trainer) -> Vec<Vec<f32>> {
        t.model
            .params
            .iter()
            .map(|(_, v)| to_f32_vec(v.as_tensor()).unwrap())
            .collect()
    }

    #[test]
    fn the_loss_falls_on_a_learnable_sequence() {
        let mut t = trainer(40, 0);
        let dir = tempdir("falls");
        let mut told = Vec::new();
        let summary = t
            .run(
                &mut NextToken::new(&mut Counting(2)),
                &dir.join("ckpt"),
                |_| 48,
                &mut Vec::new(),
                &mut |done, total, figures: &str| told.push((done, total, figures.to_string())),
                None,
            )
            .unwrap();
        // Progress comes with every logged step, ending at the last, with the log's figures.
        let (done, total, figures) = told.last().unwrap();
        assert_eq!((*done, *total), (40, 40));
        assert!(figures.starts_with("loss "), "{figures}");
        assert!(told.windows(2).all(|w| w[0].0 < w[1].0), "{told:?}");
        let first = t.curve.first().unwrap().loss;
        let last = summary["final_loss"].as_f64().unwrap();
        assert!(first > 3.0, "starts near ln(32) = 3.47: {first}");
        assert!(last < first * 0.5, "loss {first} → {last}");
    }

    #[test]
    fn same_seed_same_bytes_and_resume_is_exact() {
        let dir = tempdir("resume");
        // 2N straight.
        let mut straight = trainer(8, 0);
        straight
            .run(
                &mut NextToken::new(&mut Counting(2)),
                &dir.join("a"),
                |_| 48,
                &mut Vec::new(),
                &mut |_, _, _| {},
                None,
            )
            .unwrap();
        // N, stop (as a preemption after the step-4 checkpoint), then resume in a fresh trainer.
        let mut first = trainer(8, 4);
        let stopped = first.run(
            &mut NextToken::new(&mut Counting(2)),
            &dir.join("b"),
            |_| 48,
            &mut Vec::new(),
            &mut |_, _, _| {},
            Some(4),
        );
        assert!(stopped.is_err(), "stop_after ends the run early");
        let mut resumed = trainer(8, 4);
        checkpoint::restore(&mut resumed, &checkpoint::latest(&dir.join("b")).unwrap()).unwrap();
        assert_eq!(resumed.step, 4);
        resumed
            .run(
                &mut NextToken::new(&mut Counting(2)),
                &dir.join("b"),
                |_| 48,
                &mut Vec::new(),
                &mut |_, _, _| {},
                None,
            )
            .unwrap();
        assert_eq!(
            weights(&straight),
            weights(&resumed),
            "resumed weights differ"
        );
        assert_eq!(straight.opt, resumed.opt);
        assert_eq!(straight.curve, resumed.curve);
        // And the checkpoints are the same bytes.
        for f in [
            "model.safetensors",
            "optimizer.safetensors",
            "state.json",
            "config.json",
        ] {
            let a = std::fs::read(dir.join("a").join(f)).unwrap();
            let b = std::fs::read(dir.join("b").join(f)).unwrap();
            assert!(a == b, "{f} differs");
        }
    }

    #[test]
    fn micro_batches_on_worker_threads_give_the_same_bytes_as_one_thread() {
        // Five micro-batches a step: two threads run waves of 2, 2, 1; three run 3, 2.
        let run = |threads: usize| {
            let mut t = trainer(6, 0);
            t.threads = threads;
            for _ in 0..6 {
                t.step(&mut NextToken::new(&mut Counting(5))).unwrap();
            }
            (weights(&t), t.opt.clone(), t.curve.clone())
        };
        let one = run(1);
        assert!(one.2.last().unwrap().loss < one.2[0].loss, "it trained");
        for threads in [2, 3] {
            let other = run(threads);
            assert!(one.0 == other.0, "{threads} threads: weights differ");
            assert!(
                one.1 == other.1,
                "{threads} threads: optimizer state differs"
            );
            assert_eq!(one.2, other.2, "{threads} threads: curve differs");
        }
    }

    pub(crate) fn tempdir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("nemo-dag-train-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
