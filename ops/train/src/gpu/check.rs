//! `nemo-dag gpu-check`: does the GPU trainer on this device train as the CPU trainer does,
//! and how fast? Each part prints a line; the verdict is the last.
//!
//! 1. **Gradients.** One step of small models ([`MODELS`]: MLP blocks with SwiGLU, MLP
//!    blocks with squared ReLU and a tied head, attention and MLP blocks on packed rows): every
//!    gradient of the device's step against the CPU trainer's (candle's autograd), within
//!    [`GRADIENT_TOLERANCE`] of the largest.
//! 2. **Curve.** Steps of the attention model with clipping and the lr schedule: the device's
//!    losses and gradient norms against the CPU trainer's, within [`CURVE_TOLERANCE`].
//! 3. **Determinism.** The same steps again on the device: the same weight bytes.
//! 4. **Speed** (`speed_steps` > 0): tokens per second of the device and of the CPU trainer on
//!    a larger model, side by side, with the ratio.

use super::DeviceStep;
use crate::{BatchSource, NextToken, Schedule, Trainer};
use kernels::launch::Launcher;
use model::config::ModelConfig;
use model::layers::Layout;
use model::net::{Batch, Model};
use model::params::to_f32_vec;
use nemo_dag_op::RunError;
use serde_json::json;
use std::io::Write;
use std::time::Instant;

/// Largest gradient difference allowed, relative to the largest gradient.
pub const GRADIENT_TOLERANCE: f32 = 1e-5;
/// Largest relative difference of a step's loss or gradient norm.
pub const CURVE_TOLERANCE: f64 = 1e-4;

fn trainer(pattern: &str, activation: &str, tied: bool, size: Size) -> Result<Trainer, RunError> {
    let cfg: ModelConfig = serde_json::from_value(json!({
        "pattern": pattern, "hidden": size.hidden, "heads": 4, "kv_heads": 2, "head_dim": 8,
        "ffn": size.ffn, "activation": activation, "tie_embeddings": tied
    }))
    .map_err(|e| RunError::new(format!("gpu-check's model: {e}")))?;
    let schedule: Schedule = serde_json::from_value(json!({
        "steps": size.steps, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, "min_lr": 1e-3,
        "warmup": 2, "log_interval": 1, "clip_grad": 0.5
    }))
    .map_err(|e| RunError::new(format!("gpu-check's schedule: {e}")))?;
    let model = Model::new(&cfg, size.vocab, 11).map_err(crate::err)?;
    Ok(Trainer::new(model, schedule))
}

#[derive(Debug, Clone, Copy)]
struct Size {
    hidden: usize,
    ffn: usize,
    vocab: usize,
    steps: u64,
}

/// The models the gradients are checked on: (pattern, activation, tied head). The attention
/// model (grouped-query heads, RoPE) trains on [`PackedCounting`]'s rows of two segments.
pub const MODELS: [(&str, &str, bool); 3] = [
    ("--", "swiglu", false),
    ("--", "relu2", true),
    ("*-*-", "swiglu", false),
];

/// The curve's and the determinism check's model: attention and MLP blocks.
const CURVE_MODEL: &str = "*-";

const SMALL: Size = Size {
    hidden: 32,
    ffn: 48,
    vocab: 32,
    steps: 4,
};

/// Runs the check on `launcher`, writing a line per part to `out`; `Ok(true)` when every part
/// passed.
pub fn run<L: Launcher>(
    launcher: &L,
    speed_steps: u64,
    out: &mut dyn Write,
) -> Result<bool, RunError> {
    writeln!(out, "device       {}", launcher.describe())?;
    let mut ok = true;
    for (pattern, activation, tied) in MODELS {
        let (diff, largest) = gradients(launcher, pattern, activation, tied)?;
        let pass = diff <= GRADIENT_TOLERANCE * largest.max(1.0);
        ok &= pass;
        writeln!(
            out,
            "gradients    `{pattern}` {activation}, {} head: largest difference {diff:.2e} \
             (largest gradient {largest:.3}, tolerance {:.0e} of it): {}",
            if tied { "tied" } else { "untied" },
            GRADIENT_TOLERANCE,
            verdict(pass)
        )?;
    }
    let (worst, device_curve) = curve(launcher)?;
    let pass = worst <= CURVE_TOLERANCE;
    ok &= pass;
    writeln!(
        out,
        "curve        `{CURVE_MODEL}`, {} steps, losses {}: largest relative difference from the CPU {worst:.2e} \
         (tolerance {CURVE_TOLERANCE:.0e}): {}",
        device_curve.len(),
        device_curve
            .iter()
            .map(|l| format!("{l:.4}"))
            .collect::<Vec<_>>()
            .join(" "),
        verdict(pass)
    )?;
    let same = deterministic(launcher)?;
    ok &= same;
    writeln!(
        out,
        "determinism  the same steps twice: {}",
        if same {
            "the same weight bytes: ok"
        } else {
            "different weight bytes: FAILED"
        }
    )?;
    if speed_steps > 0 {
        speed(launcher, speed_steps, out)?;
    }
    writeln!(out, "result       {}", if ok { "ok" } else { "FAILED" })?;
    Ok(ok)
}

fn verdict(pass: bool) -> &'static str {
    if pass { "ok" } else { "FAILED" }
}

/// The largest difference between the device's and the CPU's gradients of step 1, and the
/// largest gradient, for a model of `pattern` on packed rows.
pub(crate) fn gradients<L: Launcher>(
    launcher: &L,
    pattern: &str,
    activation: &str,
    tied: bool,
) -> Result<(f32, f32), RunError> {
    let mut t = trainer(pattern, activation, tied, SMALL)?;
    t.schedule.clip_grad = 0.0;
    let want = cpu_gradients(&t, &mut PackedCounting(2))?;
    let mut step = DeviceStep::upload(launcher, &t)?;
    step.step(&mut t, &mut PackedCounting(2))?;
    let got = step.gradients()?;
    let largest = want.iter().flatten().fold(0f32, |m, g| m.max(g.abs()));
    let diff = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    Ok((diff, largest))
}

/// The CPU's gradients of global step 0, summed over its micro-batches.
pub(crate) fn cpu_gradients(
    t: &Trainer,
    source: &mut dyn BatchSource,
) -> Result<Vec<Vec<f32>>, RunError> {
    let micro = source.global_batch(0)?;
    let normaliser = crate::global_loss_tokens(&micro);
    let mut sums: Vec<Vec<f32>> = t
        .model
        .params
        .iter()
        .map(|(_, v)| vec![0.0; v.elem_count()])
        .collect();
    for batch in &micro {
        let loss = t.model.loss(batch, normaliser, true).map_err(crate::err)?;
        let grads = loss.total.backward().map_err(crate::err)?;
        for (sum, (_, var)) in sums.iter_mut().zip(t.model.params.iter()) {
            if let Some(g) = grads.get(var.as_tensor()) {
                let g = to_f32_vec(g).map_err(crate::err)?;
                sum.iter_mut().zip(g).for_each(|(s, g)| *s += g);
            }
        }
    }
    Ok(sums)
}

/// The largest relative difference of the device's losses and norms from the CPU trainer's
/// over [`SMALL`]'s steps, and the device's losses.
fn curve<L: Launcher>(launcher: &L) -> Result<(f64, Vec<f64>), RunError> {
    let mut cpu = trainer(CURVE_MODEL, "swiglu", false, SMALL)?;
    let mut source = PackedCounting(2);
    let mut objective = NextToken::new(&mut source);
    let mut on_device = trainer(CURVE_MODEL, "swiglu", false, SMALL)?;
    let mut step = DeviceStep::upload(launcher, &on_device)?;
    let (mut worst, mut losses) = (0f64, Vec::new());
    for _ in 0..SMALL.steps {
        let (cpu_loss, cpu_norm) = cpu.step(&mut objective)?;
        let (loss, norm) = step.step(&mut on_device, &mut PackedCounting(2))?;
        worst = worst
            .max((loss - cpu_loss).abs() / cpu_loss.abs().max(1e-12))
            .max((norm - cpu_norm).abs() / cpu_norm.abs().max(1e-12));
        losses.push(loss);
    }
    Ok((worst, losses))
}

/// Whether two runs of the same steps on the device end with the same weight bytes.
fn deterministic<L: Launcher>(launcher: &L) -> Result<bool, RunError> {
    let run = || -> Result<Vec<u8>, RunError> {
        let mut t = trainer(CURVE_MODEL, "swiglu", false, SMALL)?;
        let mut step = DeviceStep::upload(launcher, &t)?;
        for _ in 0..SMALL.steps {
            step.step(&mut t, &mut PackedCounting(2))?;
        }
        step.download(&mut t)?;
        let mut bytes = Vec::new();
        for (_, var) in t.model.params.iter() {
            for x in to_f32_vec(var.as_tensor()).map_err(crate::err)? {
                bytes.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(bytes)
    };
    Ok(run()? == run()?)
}

/// Rows of a repeating arithmetic sequence: next token = (token + 3) mod 32, learnable;
/// `Counting(n)` gives n micro-batches of 2 rows of 12 tokens a step. The check's data, and
/// the training tests'.
pub struct Counting(pub u64);

impl BatchSource for Counting {
    fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError> {
        let (b, t) = (2, 12);
        (0..self.0)
            .map(|m| {
                let mut ids = Vec::new();
                let mut labels = Vec::new();
                for r in 0..b as u64 {
                    let start = (step * 7 + m * 3 + r * 5) % 32;
                    let seq: Vec<u32> = (0..=t as u64)
                        .map(|i| ((start + 3 * i) % 32) as u32)
                        .collect();
                    ids.extend_from_slice(&seq[..t]);
                    labels.extend_from_slice(&seq[1..]);
                }
                Ok(Batch {
                    loss_mask: vec![1.0; ids.len()],
                    ids,
                    labels,
                    layout: Layout::plain(b, t),
                    valid: None,
                })
            })
            .collect()
    }
}

/// [`Counting`]'s rows, each packed as two sequences (tokens 0–4 and 5–11) as SFT packs
/// them: positions restart at 0 at the second, and the first one's last token has no label
/// in the row (loss mask 0).
pub struct PackedCounting(pub u64);

/// Where [`PackedCounting`] cuts each row.
const CUT: usize = 5;

impl BatchSource for PackedCounting {
    fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError> {
        let mut micro = Counting(self.0).global_batch(step)?;
        for batch in &mut micro {
            let (rows, len) = (batch.layout.batch, batch.layout.len);
            for r in 0..rows {
                for i in 0..len {
                    let at = r * len + i;
                    let second = usize::from(i >= CUT);
                    batch.layout.segments[at] = second as u32;
                    batch.layout.positions[at] = (i - second * CUT) as u32;
                }
                batch.loss_mask[r * len + CUT - 1] = 0.0;
            }
        }
        Ok(micro)
    }
}

/// Random tokens in rows of `len`, `micro` micro-batches of `rows` each step.
struct Random {
    vocab: u32,
    rows: usize,
    len: usize,
    micro: usize,
}

impl BatchSource for Random {
    fn global_batch(&mut self, step: u64) -> Result<Vec<Batch>, RunError> {
        let mut rng = kernels::rng::Rng::new(step + 1);
        Ok((0..self.micro)
            .map(|_| {
                let n = self.rows * self.len;
                let ids: Vec<u32> = (0..n)
                    .map(|_| (rng.next_u64() % u64::from(self.vocab)) as u32)
                    .collect();
                let mut labels = ids[1..].to_vec();
                labels.push(0);
                Batch {
                    loss_mask: vec![1.0; n],
                    ids,
                    labels,
                    layout: Layout::plain(self.rows, self.len),
                    valid: None,
                }
            })
            .collect())
    }
}

/// Tokens per second of the device and of the CPU trainer, `steps` steps each, on a model of
/// four MLP blocks of hidden 1024, vocabulary 32,768, 8 × 512 tokens a micro-batch.
fn speed<L: Launcher>(launcher: &L, steps: u64, out: &mut dyn Write) -> Result<(), RunError> {
    let size = Size {
        hidden: 1024,
        ffn: 4096,
        vocab: 32768,
        steps,
    };
    let source = || Random {
        vocab: 32768,
        rows: 8,
        len: 512,
        micro: 1,
    };
    let tokens = (8 * 512 * steps) as f64;
    let mut on_device = trainer("----", "swiglu", false, size)?;
    let mut step = DeviceStep::upload(launcher, &on_device)?;
    let mut data = source();
    step.step(&mut on_device, &mut data)?; // warm-up: allocations, first launches
    on_device.step = 0;
    let clock = Instant::now();
    for _ in 0..steps {
        step.step(&mut on_device, &mut data)?;
    }
    let device_rate = tokens / clock.elapsed().as_secs_f64().max(1e-9);
    let mut cpu = trainer("----", "swiglu", false, size)?;
    let mut data = source();
    let mut objective = NextToken::new(&mut data);
    let clock = Instant::now();
    for _ in 0..steps {
        cpu.step(&mut objective)?;
    }
    let cpu_rate = tokens / clock.elapsed().as_secs_f64().max(1e-9);
    writeln!(
        out,
        "speed        4 MLP blocks, hidden 1024, vocab 32768, 4096 tokens a step, {steps} steps: \
         device {device_rate:.0} tokens/s, CPU trainer {cpu_rate:.0} tokens/s ({:.2}x)",
        device_rate / cpu_rate
    )?;
    Ok(())
}
