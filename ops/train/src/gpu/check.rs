//! `nemo-dag gpu-check`: does the GPU trainer on this device train as the CPU trainer does,
//! and how fast? Each part prints a line; the verdict is the last.
//!
//! 1. **Gradients.** One step of small models ([`MODELS`]: MLP blocks with SwiGLU, MLP
//!    blocks with squared ReLU and a tied head, attention and MLP blocks, Mamba-2, attention
//!    and MLP blocks, and a hybrid with MoE blocks, all on packed rows): every gradient of the
//!    device's step, its matmuls in f32, against the CPU trainer's (candle's autograd), within
//!    [`GRADIENT_TOLERANCE`] of the largest gradient of the same parameter.
//! 2. **Matmul.** The bf16 products the training ops use on a GPU ([`TRAINING_PRECISION`]:
//!    cuBLASLt where it is present), each transpose the trainer uses, against the host's
//!    product of the same rounded operands, within [`MATMUL_TOLERANCE`].
//!    Then **NCCL**: an all-reduce over a world of one rank (skipped on the shim).
//! 3. **Curves.** Steps of a hybrid model (Mamba-2, attention and MLP blocks) with clipping and
//!    the lr schedule: the device's losses and gradient norms against the CPU trainer's, within
//!    [`CURVE_TOLERANCE`] with f32 matmuls and [`BF16_CURVE_TOLERANCE`] with bf16 ones.
//! 4. **Objectives.** DPO's and GRPO's gradients and curves, as 1 and 3 (f32 matmuls); GRPO's
//!    rollouts decode on the device.
//!    Then **decoding**: the device decoder's logits ([`super::Decoding`], KV and SSM caches)
//!    against the CPU decoder's, step by step, within [`DECODE_TOLERANCE`] (f32 matmuls).
//! 5. **Determinism.** The same steps twice on the device, bf16 matmuls: the same weight bytes.
//! 6. **Speed** ([`Speed::steps`] > 0): tokens per second of the device (bf16 matmuls) and of the
//!    CPU trainer on three models (four MLP blocks; a dense transformer of GPT-2 small's size;
//!    a tiny hybrid), side by side, with the ratio and the device's model TFLOP/s; then the
//!    tiny hybrid's decoding, new tokens per second on the device and on the CPU ([`DECODE`]).
//!
//! [`run`] also returns every figure as JSON, which `gpu-check --json` writes.

use super::{DeviceStep, TRAINING_PRECISION};
use crate::{BatchSource, NextToken, Objective, Schedule, Trainer, dpo, grpo};
use kernels::launch::{Arg, KernelTime, Launcher};
use kernels::linear::{Gemm, Precision, gemm_reference};
use model::config::ModelConfig;
use model::layers::Layout;
use model::net::{Batch, Model};
use model::params::to_f32_vec;
use nemo_dag_op::RunError;
use serde_json::{Value, json};
use std::io::Write;
use std::time::Instant;

/// Largest gradient difference allowed, relative to the largest gradient of the same
/// parameter (so a parameter with small gradients, like Mamba-2's `dt_bias`, is held as
/// tightly as the embedding).
pub const GRADIENT_TOLERANCE: f32 = 1e-5;
/// Largest relative difference of a step's loss or gradient norm.
pub const CURVE_TOLERANCE: f64 = 1e-4;
/// Largest relative difference of a step's loss or gradient norm when the device multiplies
/// in bf16 and the CPU in f32: bf16 keeps 8 bits of each operand, so a product is off by about
/// 2⁻⁹ of its size, and the gaps grow as the weights part over the steps (8e-4 on the shim
/// after 4 steps).
pub const BF16_CURVE_TOLERANCE: f64 = 1e-2;
/// Largest difference of a bf16 product from the host's, relative to `Σ|a·b|` of the same
/// output (the size the f32 sums' rounding scales with): several hundred times f32's rounding,
/// and far below what a wrong transpose, a lost operand rounding or a stale `c` give (order 1).
pub const MATMUL_TOLERANCE: f64 = 1e-4;
/// Largest difference of the device decoder's logits from the CPU decoder's, relative to the
/// largest logit of the step (4e-7 on the shim; a lost step, a wrong position or a stale
/// cache give order 1).
pub const DECODE_TOLERANCE: f32 = 1e-4;

/// A model of `pattern` at `size`, with `overrides`' top-level keys (an object, or null) put
/// over the config made here.
fn trainer(
    pattern: &str,
    activation: &str,
    tied: bool,
    size: Size,
    overrides: &Value,
) -> Result<Trainer, RunError> {
    let (heads, kv_heads, head_dim) = size.heads;
    let mut cfg = json!({
        "pattern": pattern, "hidden": size.hidden, "heads": heads, "kv_heads": kv_heads,
        "head_dim": head_dim, "ffn": size.ffn, "activation": activation, "tie_embeddings": tied
    });
    if pattern.contains('M') {
        // d_inner = 2·hidden (Mamba's expansion), two groups, chunks of 4 tokens: the scan
        // carries state across chunks, and PackedCounting's cut at 5 falls inside one.
        cfg["mamba"] = json!({
            "heads": size.hidden / 4, "head_dim": 8, "state": 8, "groups": 2, "conv": 4,
            "chunk": 4
        });
    }
    if pattern.contains('E') {
        // Nemotron 3's router at a small size: top-2 of 4 experts by score + bias, gates
        // normalised and scaled by 2.5, a shared expert, the bias moved after every step.
        cfg["moe"] = json!({
            "experts": 4, "top_k": 2, "expert_ffn": 16, "shared_ffn": 24, "scaling": 2.5,
            "bias_update_rate": 1e-2
        });
    }
    if let Some(overrides) = overrides.as_object() {
        for (key, value) in overrides {
            cfg[key] = value.clone();
        }
    }
    let cfg: ModelConfig = serde_json::from_value(cfg)
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
    /// Attention's (heads, kv_heads, head_dim).
    heads: (usize, usize, usize),
    ffn: usize,
    vocab: usize,
    steps: u64,
}

/// The models the gradients are checked on: (pattern, activation, tied head), all on
/// [`PackedCounting`]'s rows of two segments. Attention has grouped-query heads and RoPE;
/// Mamba-2 blocks have two groups and chunks of 4 tokens; MoE blocks route each token to 2
/// of 4 experts and have a shared expert; `ME*-/*E` is the hybrid of the speed part with an
/// MTP depth of attention and MoE after `/`.
pub const MODELS: [(&str, &str, bool); 6] = [
    ("--", "swiglu", false),
    ("--", "relu2", true),
    ("*-*-", "swiglu", false),
    ("M*M-", "relu2", false),
    ("M*E-E", "relu2", false),
    ("ME*-/*E", "relu2", false),
];

/// The curve's and the determinism check's model: Mamba-2, attention and MLP blocks.
const CURVE_MODEL: &str = "M*-";

/// The model DPO and GRPO are checked on: Mamba-2, attention, MoE and MLP blocks and an MTP
/// depth, which neither objective trains (its gradients must stay 0, as on the CPU).
pub const OBJECTIVE_MODEL: &str = "M*E-/*";

/// The objectives beside next-token cross-entropy that the GPU trainer minimises.
pub const OBJECTIVES: [&str; 2] = ["dpo", "grpo"];

// Heads 16 wide: attention has tensor-core kernels for that width, so the bf16 curve and the
// determinism part run them.
const SMALL: Size = Size {
    hidden: 32,
    heads: (4, 2, 16),
    ffn: 48,
    vocab: 32,
    steps: 4,
};

/// What a check found: every part's figures as JSON (what `gpu-check --json` writes), and
/// whether every part passed.
pub struct Report {
    pub ok: bool,
    pub json: Value,
}

/// Runs the check on `launcher` with the speed part `timing` asks for, writing a line per part
/// to `out`.
pub fn run<L: Launcher>(
    launcher: &L,
    timing: Speed,
    out: &mut dyn Write,
) -> Result<Report, RunError> {
    writeln!(out, "device       {}", launcher.describe())?;
    let mut ok = true;
    let mut parts = Vec::new();
    for (pattern, activation, tied) in MODELS {
        let gap = gradients(launcher, pattern, activation, tied)?;
        let pass = gap.passes();
        ok &= pass;
        writeln!(
            out,
            "gradients    `{pattern}` {activation}, {} head: furthest `{}`, {:.2e} apart \
             (its largest gradient {:.2e}; {:.1e} of it, tolerance {GRADIENT_TOLERANCE:.0e}): {}",
            if tied { "tied" } else { "untied" },
            gap.parameter,
            gap.difference,
            gap.largest,
            gap.relative(),
            verdict(pass)
        )?;
        parts.push(json!({
            "pattern": pattern, "activation": activation, "tied": tied,
            "parameter": gap.parameter, "difference": gap.difference, "largest": gap.largest,
            "relative": gap.relative(), "tolerance": GRADIENT_TOLERANCE, "ok": pass
        }));
    }
    let worst = matmul(launcher)?;
    // A GPU without cuBLASLt trains, slowly: the check says what is missing and fails.
    let pass = worst <= MATMUL_TOLERANCE && launcher.lacks().is_none();
    ok &= pass;
    let backend = launcher.gemm_backend(Precision::Bf16);
    writeln!(
        out,
        "matmul       bf16 operands, f32 sums, on {backend}: {} products (every transpose the \
         trainer uses, added onto c, c unaligned, a stored as bf16) within {worst:.1e} of the host's, relative \
         to Σ|a·b| (tolerance {MATMUL_TOLERANCE:.0e}): {}",
        MATMULS.len(),
        verdict(pass)
    )?;
    let matmuls = json!({
        "precision": "bf16", "backend": backend, "difference": worst,
        "tolerance": MATMUL_TOLERANCE, "ok": pass
    });
    let nccl = match all_reduce(launcher) {
        Ok(None) => {
            writeln!(
                out,
                "nccl         skipped: the SIMT shim has one rank and no NCCL"
            )?;
            json!({"ran": false})
        }
        Ok(Some((version, same))) => {
            ok &= same;
            writeln!(
                out,
                "nccl         {version}, all-reduce (sum) of {ALL_REDUCED} floats over a world of \
                 one rank: {}",
                if same {
                    "the same bytes back: ok"
                } else {
                    "different bytes back: FAILED"
                }
            )?;
            json!({"ran": true, "version": version, "same_bytes": same, "ok": same})
        }
        Err(e) => {
            ok = false;
            writeln!(out, "nccl         {e}: FAILED")?;
            json!({"ran": false, "error": e.to_string(), "ok": false})
        }
    };
    let mut curves = Vec::new();
    for (precision, tolerance) in [
        (Precision::F32, CURVE_TOLERANCE),
        (Precision::Bf16, BF16_CURVE_TOLERANCE),
    ] {
        let (worst, device_curve) = curve(launcher, precision)?;
        let pass = worst <= tolerance;
        ok &= pass;
        writeln!(
            out,
            "curve        `{CURVE_MODEL}`, {} matmuls, {} steps, losses {}: largest relative \
             difference from the CPU {worst:.2e} (tolerance {tolerance:.0e}): {}",
            precision.name(),
            device_curve.len(),
            device_curve
                .iter()
                .map(|l| format!("{l:.4}"))
                .collect::<Vec<_>>()
                .join(" "),
            verdict(pass)
        )?;
        curves.push(json!({
            "pattern": CURVE_MODEL, "precision": precision.name(), "losses": device_curve,
            "difference": worst, "tolerance": tolerance, "ok": pass
        }));
    }
    let mut objectives = Vec::new();
    for name in OBJECTIVES {
        let (gap, worst) = objective(launcher, name)?;
        let pass = gap.passes() && worst <= CURVE_TOLERANCE;
        ok &= pass;
        writeln!(
            out,
            "objective    {name} on `{OBJECTIVE_MODEL}`: gradients furthest `{}`, {:.1e} of its \
             largest (tolerance {GRADIENT_TOLERANCE:.0e}); {} steps' losses, norms and figures \
             within {worst:.2e} of the CPU (tolerance {CURVE_TOLERANCE:.0e}): {}",
            gap.parameter,
            gap.relative(),
            SMALL.steps,
            verdict(pass)
        )?;
        objectives.push(json!({
            "objective": name, "pattern": OBJECTIVE_MODEL, "parameter": gap.parameter,
            "difference": gap.difference, "largest": gap.largest, "relative": gap.relative(),
            "curve_difference": worst, "ok": pass
        }));
    }
    let t = trainer(DECODE_MODEL, "relu2", false, SMALL, &Value::Null)?;
    let gap = decoding(launcher, &t.model, &DECODE_STEPS)?;
    let pass = gap <= DECODE_TOLERANCE;
    ok &= pass;
    writeln!(
        out,
        "decoding     `{DECODE_MODEL}`, {} rows of left-padded prompts, {} steps, f32 matmuls: \
         logits within {gap:.1e} of the CPU decoder's, relative to the step's largest \
         (tolerance {DECODE_TOLERANCE:.0e}): {}",
        DECODE_STEPS[0].len(),
        DECODE_STEPS.len(),
        verdict(pass)
    )?;
    let decode = json!({
        "pattern": DECODE_MODEL, "difference": gap, "tolerance": DECODE_TOLERANCE, "ok": pass
    });
    let same = deterministic(launcher, TRAINING_PRECISION)?;
    ok &= same;
    writeln!(
        out,
        "determinism  the same steps twice, {} matmuls: {}",
        TRAINING_PRECISION.name(),
        if same {
            "the same weight bytes: ok"
        } else {
            "different weight bytes: FAILED"
        }
    )?;
    let mut speeds = Vec::new();
    let mut decode_speed = Value::Null;
    if timing.steps > 0 {
        for model in &SPEED_MODELS {
            speeds.push(speed(launcher, model, (timing, TRAINING_PRECISION), out)?);
        }
        decode_speed = decoding_speed(launcher, &SPEED_MODELS[2], DECODE, timing, out)?;
    }
    writeln!(out, "result       {}", if ok { "ok" } else { "FAILED" })?;
    let json = json!({
        "device": launcher.describe(),
        "gradients": parts,
        "matmul": matmuls,
        "nccl": nccl,
        "curves": curves,
        "objectives": objectives,
        "decoding": decode,
        "determinism": {"precision": TRAINING_PRECISION.name(), "same_bytes": same, "ok": same},
        "speed": speeds,
        "decode_speed": decode_speed,
        "ok": ok,
    });
    Ok(Report { ok, json })
}

fn verdict(pass: bool) -> &'static str {
    if pass { "ok" } else { "FAILED" }
}

/// The parameter whose device gradient is furthest from the CPU's, relative to its own
/// largest gradient.
#[derive(Debug)]
pub(crate) struct Gap {
    pub parameter: String,
    pub difference: f32,
    pub largest: f32,
}

impl Gap {
    /// The gradients `got` and `want` of `t`'s parameters, in its order.
    pub fn of(t: &Trainer, got: &[Vec<f32>], want: &[Vec<f32>]) -> Gap {
        let mut worst = Gap {
            parameter: String::new(),
            difference: 0.0,
            largest: 0.0,
        };
        for (((name, _), got), want) in t.model.params.iter().zip(got).zip(want) {
            let gap = Gap {
                parameter: name.to_string(),
                difference: got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max),
                largest: want.iter().fold(0f32, |m, g| m.max(g.abs())),
            };
            if worst.parameter.is_empty() || gap.relative() > worst.relative() {
                worst = gap;
            }
        }
        worst
    }

    pub fn relative(&self) -> f32 {
        self.difference / self.largest.max(f32::MIN_POSITIVE)
    }

    pub fn passes(&self) -> bool {
        self.relative() <= GRADIENT_TOLERANCE
    }
}

/// How far the device's gradients of step 1 are from the CPU's, for a model of `pattern` on
/// packed rows.
pub(crate) fn gradients<L: Launcher>(
    launcher: &L,
    pattern: &str,
    activation: &str,
    tied: bool,
) -> Result<Gap, RunError> {
    let mut t = trainer(pattern, activation, tied, SMALL, &Value::Null)?;
    step_gap(launcher, &mut t, || PackedCounting(2))
}

/// How far the device's gradients of `t`'s first step (unclipped) on `source`'s batches are
/// from the CPU's.
pub(crate) fn step_gap<L: Launcher, S: BatchSource>(
    launcher: &L,
    t: &mut Trainer,
    source: impl Fn() -> S,
) -> Result<Gap, RunError> {
    objective_gap(
        launcher,
        t,
        &mut NextToken::new(&mut source()),
        Precision::F32,
    )
}

/// How far the device's gradients of `t`'s next step (unclipped) of `objective`, its matmuls
/// at `precision`, are from the CPU's.
pub(crate) fn objective_gap<L: Launcher>(
    launcher: &L,
    t: &mut Trainer,
    objective: &mut dyn Objective,
    precision: Precision,
) -> Result<Gap, RunError> {
    t.schedule.clip_grad = 0.0;
    let want = cpu_gradients(t, objective)?;
    let mut step = DeviceStep::upload(launcher, t)?.with_precision(precision);
    step.step_on(t, objective)?;
    Ok(Gap::of(t, &step.gradients()?, &want))
}

/// The CPU's gradients of `t`'s next step of `objective`, summed over its micro-batches.
pub(crate) fn cpu_gradients(
    t: &Trainer,
    objective: &mut dyn Objective,
) -> Result<Vec<Vec<f32>>, RunError> {
    let micro = objective.prepare(&t.model, t.step)?;
    let mut sums: Vec<Vec<f32>> = t
        .model
        .params
        .iter()
        .map(|(_, v)| vec![0.0; v.elem_count()])
        .collect();
    for i in 0..micro {
        let loss = objective.loss(&t.model, i)?;
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

/// DPO or GRPO (`name`) on [`OBJECTIVE_MODEL`]: how far the device's step-1 gradients are from
/// the CPU's, and the largest relative difference of [`SMALL`]'s steps from the CPU trainer's.
/// DPO's reference differs from the policy (so Δ ≠ 0 from the first step) and averages its
/// log-probabilities with an SFT term; GRPO samples 2 responses to each of 2 prompts a step
/// (rewarded for starting with a token below 16) with the k3 KL term to a reference.
pub(crate) fn objective<L: Launcher>(launcher: &L, name: &str) -> Result<(Gap, f64), RunError> {
    let fresh = |seed: u64| -> Result<Trainer, RunError> {
        let mut t = trainer(OBJECTIVE_MODEL, "relu2", false, SMALL, &Value::Null)?;
        t.model = Model::new(&t.model.cfg, SMALL.vocab, seed).map_err(crate::err)?;
        Ok(t)
    };
    let reference = || fresh(29).map(|t| t.model);
    let schedule = fresh(11)?.schedule;
    let pairs: Vec<dpo::Pair> = (0..8u32)
        .map(|k| {
            let prompt = [1, 2 + k % 5, 3];
            let chosen = [4, 5 + k % 2, 6];
            let rejected = [9, 10 + k % 3, 11, 12, 13];
            let sequence = |answer: &[u32]| dpo::Sequence {
                ids: prompt.iter().chain(answer).copied().collect(),
                start: prompt.len(),
            };
            dpo::Pair {
                chosen: sequence(&chosen),
                rejected: sequence(&rejected[..2 + k as usize % 4]),
            }
        })
        .collect();
    let prompts: Vec<grpo::Prompt> = [[1, 2], [4, 5], [6, 1], [2, 2]]
        .iter()
        .map(|ids| grpo::Prompt {
            ids: ids.to_vec(),
            expected: String::new(),
            env: "math".into(),
        })
        .collect();
    let score = |_: &grpo::Prompt, response: &[u32]| f64::from(response.first() < Some(&16));
    let rl = grpo::Config {
        prompts_per_step: 2,
        generations: 2,
        sampling: model::sampling::Sampling {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            max_tokens: 3,
        },
        seed: 5,
        micro_batch: schedule.micro_batch,
        normalize_rewards: true,
        leave_one_out: true,
        overlong_filtering: false,
        advantage_clip: (None, None),
        loss: grpo::LossConfig {
            ratio_clip_min: 0.2,
            ratio_clip_max: 0.28,
            ratio_clip_c: Some(3.0),
            reference_policy_kl_penalty: 0.05,
            token_level_loss: false,
        },
    };
    let make = || -> Result<Box<dyn Objective + '_>, RunError> {
        Ok(match name {
            "dpo" => {
                let loss = dpo::LossConfig {
                    beta: 0.5,
                    average_log_probs: true,
                    preference_weight: 1.0,
                    sft_weight: 0.2,
                };
                Box::new(dpo::DpoObjective::new(
                    reference()?,
                    pairs.clone(),
                    loss,
                    &schedule,
                ))
            }
            _ => {
                let (prompts, reference) = (prompts.clone(), Some(reference()?));
                Box::new(grpo::Rollouts::new(
                    rl.clone(),
                    prompts,
                    reference,
                    vec![],
                    &score,
                ))
            }
        })
    };
    let gap = objective_gap(launcher, &mut fresh(11)?, make()?.as_mut(), Precision::F32)?;
    let (mut cpu, mut on_device) = (fresh(11)?, fresh(11)?);
    let (mut cpu_objective, mut device_objective) = (make()?, make()?);
    let worst = curve_gap(
        launcher,
        (&mut cpu, cpu_objective.as_mut()),
        (&mut on_device, device_objective.as_mut()),
        SMALL.steps,
        Precision::F32,
    )?;
    Ok((gap, worst))
}

/// The products the matmul part checks, each with c's offset in floats: a linear layer's
/// forward (`NT`), its input gradient added onto a residual gradient (`NN`, beta 1) and its
/// weight gradient into a parameter's slot one float past an aligned start (`TN`), at sizes no
/// tile divides; then one of a size the trainer's small layers have; then the head's two
/// backward products from logits' gradients stored as bf16 (`a` read as it is, uncast).
const MATMULS: [(Gemm, usize); 6] = [
    (bf16_product((67, 129, 45), (false, true), 0.0, false), 0),
    (bf16_product((67, 45, 129), (false, false), 1.0, false), 0),
    (bf16_product((129, 45, 67), (true, false), 1.0, false), 1),
    (bf16_product((256, 384, 128), (false, true), 0.0, false), 0),
    (bf16_product((129, 45, 67), (true, false), 1.0, true), 1),
    (bf16_product((67, 45, 129), (false, false), 0.0, true), 0),
];

const fn bf16_product(
    (m, n, k): (usize, usize, usize),
    (trans_a, trans_b): (bool, bool),
    beta: f32,
    a_bf16: bool,
) -> Gemm {
    Gemm {
        m,
        n,
        k,
        trans_a,
        trans_b,
        alpha: 1.0,
        beta,
        precision: Precision::Bf16,
        bf16_inputs: (a_bf16, false),
    }
}

/// Floats the NCCL part all-reduces: not a multiple of any chunk NCCL splits into.
const ALL_REDUCED: usize = 100_003;

/// NCCL's all-reduce over a world of one rank ([`Launcher::all_reduce_sum`]), out of place
/// into a zeroed buffer: NCCL's version and whether the sum (the one rank's values) arrived,
/// the same bytes; `None` where there is no NCCL.
fn all_reduce<L: Launcher>(launcher: &L) -> Result<Option<(String, bool)>, RunError> {
    let device = super::device;
    let mut rng = kernels::rng::Rng::new(9);
    let values: Vec<f32> = (0..ALL_REDUCED).map(|_| rng.normal() as f32).collect();
    let from = launcher.upload_f32(&values).map_err(device)?;
    let mut into = launcher.alloc(ALL_REDUCED * 4).map_err(device)?;
    let Some(version) = launcher
        .all_reduce_sum(&from, &mut into, ALL_REDUCED)
        .map_err(device)?
    else {
        return Ok(None);
    };
    let back = launcher.read_f32(&into, 0, ALL_REDUCED).map_err(device)?;
    let same = back
        .iter()
        .map(|v| v.to_bits())
        .eq(values.iter().map(|v| v.to_bits()));
    Ok(Some((version, same)))
}

/// The largest difference of the device's bf16 products ([`MATMULS`], through
/// [`Launcher::gemm`]) from the host's of the same rounded operands in f64, relative to
/// `Σ|a·b|` of the output.
fn matmul<L: Launcher>(launcher: &L) -> Result<f64, RunError> {
    let device = super::device;
    let mut rng = kernels::rng::Rng::new(5);
    let mut worst = 0f64;
    for (gemm, offset) in MATMULS {
        let (m, n, k) = (gemm.m, gemm.n, gemm.k);
        let mut random =
            |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect::<Vec<_>>() };
        let (a, b, c) = (random(m * k), random(k * n), random(offset + m * n));
        let da = if gemm.bf16_inputs.0 {
            // The bits cast_bf16 writes: the reference rounds `a` the same way.
            let bits: Vec<u8> = a
                .iter()
                .flat_map(|v| {
                    ((kernels::linear::round_bf16(*v).to_bits() >> 16) as u16).to_le_bytes()
                })
                .collect();
            let mut buffer = launcher.alloc(bits.len()).map_err(device)?;
            launcher.write(&mut buffer, 0, &bits).map_err(device)?;
            buffer
        } else {
            launcher.upload_f32(&a).map_err(device)?
        };
        let db = launcher.upload_f32(&b).map_err(device)?;
        let dc = launcher.upload_f32(&c).map_err(device)?;
        let (pa, pb, pc) = (
            Arg::Ptr(&da, 0),
            Arg::Ptr(&db, 0),
            Arg::Ptr(&dc, offset * 4),
        );
        // SAFETY: the buffers hold m·k, k·n and, from c's offset, m·n floats.
        unsafe { launcher.gemm(&gemm, pa, pb, pc) }.map_err(device)?;
        let got = launcher.read_f32(&dc, offset, m * n).map_err(device)?;
        let want = gemm_reference(&gemm, &a, &b, &c[offset..]);
        for (got, (want, size)) in got.iter().zip(want) {
            let gap = (f64::from(*got) - want).abs() / size.max(1e-30);
            worst = worst.max(if gap.is_nan() { f64::INFINITY } else { gap });
        }
    }
    Ok(worst)
}

/// The largest relative difference, over `steps` steps, of the device's losses, gradient norms
/// and objective's figures (`device`: a trainer and its objective) from the CPU trainer's
/// (`cpu`: a trainer of the same model and schedule, and its own objective). A figure on one
/// side only, or not a number, is infinitely far.
pub(crate) fn curve_gap<L: Launcher>(
    launcher: &L,
    cpu: (&mut Trainer, &mut dyn Objective),
    device: (&mut Trainer, &mut dyn Objective),
    steps: u64,
    precision: Precision,
) -> Result<f64, RunError> {
    let mut step = DeviceStep::upload(launcher, device.0)?.with_precision(precision);
    let relative = |a: f64, b: f64| {
        let r = (a - b).abs() / b.abs().max(1e-6);
        if r.is_nan() { f64::INFINITY } else { r }
    };
    let mut worst = 0f64;
    for _ in 0..steps {
        let (cpu_loss, cpu_norm) = cpu.0.step(cpu.1)?;
        let (loss, norm) = step.step_on(device.0, device.1)?;
        worst = worst
            .max(relative(loss, cpu_loss))
            .max(relative(norm, cpu_norm));
        let (want, got) = (&cpu.0.last_metrics, &device.0.last_metrics);
        if want.keys().ne(got.keys()) {
            return Ok(f64::INFINITY);
        }
        for (key, value) in want {
            worst = worst.max(relative(got[key], *value));
        }
    }
    Ok(worst)
}

/// The largest relative difference of the device's losses and norms, its matmuls at
/// `precision`, from the CPU trainer's over [`SMALL`]'s steps, and the device's losses.
fn curve<L: Launcher>(launcher: &L, precision: Precision) -> Result<(f64, Vec<f64>), RunError> {
    let fresh = || trainer(CURVE_MODEL, "swiglu", false, SMALL, &Value::Null);
    let (mut cpu, mut on_device) = (fresh()?, fresh()?);
    let (mut cpu_source, mut device_source) = (PackedCounting(2), PackedCounting(2));
    let worst = curve_gap(
        launcher,
        (&mut cpu, &mut NextToken::new(&mut cpu_source)),
        (&mut on_device, &mut NextToken::new(&mut device_source)),
        SMALL.steps,
        precision,
    )?;
    // SMALL's schedule logs every step: the curve is each step's loss.
    let losses = on_device.curve.iter().map(|p| p.loss).collect();
    Ok((worst, losses))
}

/// The model the decoding part decodes: every block kind, attention with RoPE.
const DECODE_MODEL: &str = "M*-E*M";

/// What the decoding part feeds, a step a line: three rows, one left-padded for two steps, one
/// that sits a step out mid-way (as a finished row does) and comes back.
pub(super) const DECODE_STEPS: [[Option<u32>; 3]; 7] = [
    [Some(5), None, Some(1)],
    [Some(6), None, Some(2)],
    [Some(7), Some(11), Some(3)],
    [Some(8), Some(12), None],
    [Some(9), Some(13), Some(31)],
    [None, Some(14), Some(4)],
    [Some(10), Some(15), Some(0)],
];

/// The device decoder's largest logit gap from the CPU decoder's, feeding `model` the `steps`
/// (a step's ids a row), over the rows that fed a real token, relative to the step's largest
/// logit. The device decoder holds exactly `steps.len()` steps.
pub(super) fn decoding<L: Launcher, const R: usize>(
    launcher: &L,
    model: &Model,
    steps: &[[Option<u32>; R]],
) -> Result<f32, RunError> {
    use model::sampling::{CpuDecoder, Decoder};
    let weights = DeviceStep::upload_for_scoring(launcher, model)?;
    let mut device = super::Decoding::start(&weights, model, R, steps.len())?;
    let mut cpu = CpuDecoder::new(model, R).map_err(crate::err)?;
    let mut worst = 0f32;
    for ids in steps {
        let got = device.feed(ids)?;
        let want = cpu.step(ids).map_err(crate::err)?;
        let fed = || {
            want.iter()
                .zip(&got)
                .zip(ids)
                .filter(|(_, id)| id.is_some())
        };
        let largest = fed()
            .flat_map(|((w, _), _)| w.iter())
            .fold(1e-30f32, |m, v| m.max(v.abs()));
        for ((w, g), _) in fed() {
            let gap = w.iter().zip(g).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            worst = worst.max(gap / largest);
        }
    }
    Ok(worst)
}

/// Whether two runs of the same steps on the device, its matmuls at `precision`, end with the
/// same weight bytes.
fn deterministic<L: Launcher>(launcher: &L, precision: Precision) -> Result<bool, RunError> {
    let run = || -> Result<Vec<u8>, RunError> {
        let mut t = trainer(CURVE_MODEL, "swiglu", false, SMALL, &Value::Null)?;
        let mut step = DeviceStep::upload(launcher, &t)?.with_precision(precision);
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

/// A model the speed part times: `rows × len` random tokens a step, one micro-batch.
struct SpeedModel {
    name: &'static str,
    pattern: &'static str,
    activation: &'static str,
    tied: bool,
    size: Size,
    rows: usize,
    len: usize,
    /// Config keys over [`trainer`]'s (null: none).
    overrides: fn() -> Value,
}

/// The models timed: the four MLP blocks earlier figures were taken on, and a dense
/// transformer of GPT-2 small's size (12 layers of attention and MLP, hidden 768, 12 heads of
/// 64, FFN 3072, a tied vocabulary of 50,304, 8 × 1024 tokens a step: 124 M parameters; RoPE
/// and squared ReLU where GPT-2 has learned positions and GELU); and the tiny hybrid
/// `ME*-/*E` of the CPU training benchmark (bench/train_bench.py's `HYBRID`: Mamba-2, MoE,
/// attention and MLP blocks, one MTP depth, no positional encoding, hidden 128, 16 × 128 tokens
/// a step).
const SPEED_MODELS: [SpeedModel; 3] = [
    SpeedModel {
        name: "4 MLP blocks, hidden 1024",
        pattern: "----",
        activation: "swiglu",
        tied: false,
        size: Size {
            hidden: 1024,
            heads: (4, 2, 8),
            ffn: 4096,
            vocab: 32768,
            steps: 0,
        },
        rows: 8,
        len: 512,
        overrides: || Value::Null,
    },
    SpeedModel {
        name: "GPT-2 small (124M)",
        pattern: "*-*-*-*-*-*-*-*-*-*-*-*-",
        activation: "relu2",
        tied: true,
        size: Size {
            hidden: 768,
            heads: (12, 12, 64),
            ffn: 3072,
            vocab: 50304,
            steps: 0,
        },
        rows: 8,
        len: 1024,
        overrides: || Value::Null,
    },
    SpeedModel {
        name: "tiny hybrid, hidden 128",
        pattern: "ME*-/*E",
        activation: "relu2",
        tied: false,
        size: Size {
            hidden: 128,
            heads: (4, 2, 32),
            ffn: 384,
            vocab: 1024,
            steps: 0,
        },
        rows: 16,
        len: 128,
        overrides: || {
            json!({
                "position": "none",
                "mamba": {"heads": 4, "head_dim": 32, "state": 32, "groups": 1, "chunk": 64},
                "moe": {"experts": 8, "top_k": 2, "expert_ffn": 192, "shared_ffn": 192,
                        "scaling": 2.5}
            })
        },
    },
];

/// Model FLOPs of one training token, as nanoGPT's `estimate_mfu` counts them (after the
/// PaLM paper's appendix B): `6·N` for the parameters' matmuls forward and backward, plus
/// `12·L·H·Q·T` for attention's scores and weighted sums over `T` tokens. `N` counts the
/// parameters a token passes through: of an MoE layer's routed experts, only its top-k. The
/// Mamba-2 scan's own FLOPs are not counted.
fn flops_per_token(t: &Trainer, len: usize) -> f64 {
    let cfg = &t.model.cfg;
    let routed: usize = t
        .model
        .params
        .iter()
        .filter(|(name, _)| name.contains(".moe.experts."))
        .map(|(_, v)| v.elem_count())
        .sum();
    let idle = cfg
        .moe
        .as_ref()
        .map_or(0.0, |m| (m.experts - m.top_k) as f64 / m.experts as f64);
    let params = t.model.params.count() as f64 - routed as f64 * idle;
    let layers = t.model.pattern.count(model::config::BlockKind::Attention) as f64;
    6.0 * params + 12.0 * layers * (cfg.heads * cfg.head_dim * len) as f64
}

/// What the speed part times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speed {
    /// The device's optimizer steps per model, after a warm-up step (0: no speed part).
    pub steps: u64,
    /// The CPU trainer's, after its own warm-up step, for comparison; above 0 the CPU's
    /// decoding is timed too, once after a warm-up run (0: the CPU is not timed at all). A
    /// step of GPT-2 small's 8,192 tokens takes the CPU about twenty seconds on sixteen cores,
    /// so a GPU session times it over few.
    pub cpu_steps: u64,
}

impl Speed {
    /// No speed part.
    pub const NONE: Speed = Speed {
        steps: 0,
        cpu_steps: 0,
    };
}

/// Tokens per second of the device, its matmuls at `precision` and (for comparison) at f32,
/// `speed.steps` steps each after a warm-up step, and of the CPU trainer over
/// `speed.cpu_steps` after its own warm-up, with the device's model TFLOP/s.
fn speed<L: Launcher>(
    launcher: &L,
    m: &SpeedModel,
    (Speed { steps, cpu_steps }, precision): (Speed, Precision),
    out: &mut dyn Write,
) -> Result<Value, RunError> {
    let size = Size { steps, ..m.size };
    let source = || Random {
        vocab: size.vocab as u32,
        rows: m.rows,
        len: m.len,
        micro: 1,
    };
    let tokens_per_step = m.rows * m.len;
    let tokens = (tokens_per_step as u64 * steps) as f64;
    let fresh = || trainer(m.pattern, m.activation, m.tied, size, &(m.overrides)());
    let on_device = |precision| -> Result<(f64, Vec<KernelTime>), RunError> {
        let mut t = fresh()?;
        let mut step = DeviceStep::upload(launcher, &t)?.with_precision(precision);
        let mut data = source();
        step.step(&mut t, &mut data)?; // warm-up: allocations, first launches
        t.step = 0;
        launcher.take_kernel_times();
        let clock = Instant::now();
        for _ in 0..steps {
            step.step(&mut t, &mut data)?;
        }
        let rate = tokens / clock.elapsed().as_secs_f64().max(1e-9);
        Ok((rate, launcher.take_kernel_times()))
    };
    let (device_rate, times) = on_device(precision)?;
    let f32_rate = match precision {
        Precision::F32 => device_rate,
        _ => on_device(Precision::F32)?.0,
    };
    let mut cpu = fresh()?;
    let (flops, parameters) = (flops_per_token(&cpu, m.len), cpu.model.params.count());
    let cpu_rate = if cpu_steps > 0 {
        let mut data = source();
        let mut objective = NextToken::new(&mut data);
        cpu.step(&mut objective)?; // warm-up, as the device's
        let clock = Instant::now();
        for _ in 0..cpu_steps {
            cpu.step(&mut objective)?;
        }
        let tokens = (tokens_per_step as u64 * cpu_steps) as f64;
        Some(tokens / clock.elapsed().as_secs_f64().max(1e-9))
    } else {
        None
    };
    let tflops = device_rate * flops / 1e12;
    let cpu_text = match cpu_rate {
        Some(rate) => format!(
            "CPU trainer {rate:.0} tokens/s over {} ({:.2}x)",
            counted(cpu_steps, "step", "steps"),
            device_rate / rate
        ),
        None => "CPU trainer not timed".to_string(),
    };
    writeln!(
        out,
        "speed        {}, vocab {}, {tokens_per_step} tokens a step, {}: device \
         ({} matmuls) {device_rate:.0} tokens/s ({tflops:.1} model TFLOP/s; f32 matmuls \
         {f32_rate:.0}, {:.2}x), {cpu_text}",
        m.name,
        size.vocab,
        counted(steps, "step", "steps"),
        precision.name(),
        device_rate / f32_rate,
    )?;
    kernel_times(
        &times,
        ("a step", steps),
        tokens_per_step as f64 / device_rate,
        out,
    )?;
    Ok(json!({
        "model": m.name, "pattern": m.pattern, "parameters": parameters,
        "tokens_per_step": tokens_per_step, "steps": steps, "precision": precision.name(),
        "device_tokens_per_s": device_rate, "device_f32_tokens_per_s": f32_rate,
        "cpu_tokens_per_s": cpu_rate, "cpu_steps": cpu_steps,
        "flops_per_token": flops, "device_model_tflops": tflops
    }))
}

/// `n` and its noun: `1 step`, `2 steps`.
fn counted(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Where the time of `what` (a training step, a generation) went, when the launcher timed its
/// launches over `steps` of them of `step_seconds` each (`NEMO_DAG_KERNEL_TIMES`): the
/// launches' share (the rest is the host's: copies, the objective, sampling, waiting), then the
/// kernels and product shapes that took the most, per step, with their shares of the launches'
/// time.
fn kernel_times(
    times: &[KernelTime],
    (what, steps): (&str, u64),
    step_seconds: f64,
    out: &mut dyn Write,
) -> Result<(), RunError> {
    // Enough for every kernel and shape of a dense model's step (GPT-2 small's has 35).
    const SHOWN: usize = 40;
    if times.is_empty() {
        return Ok(());
    }
    let per_step = |seconds: f64| 1e3 * seconds / steps.max(1) as f64;
    let total: f64 = times.iter().map(|t| t.seconds).sum();
    let share = |seconds: f64| 100.0 * seconds / total.max(1e-12);
    writeln!(
        out,
        "  time       {what} {:.3} ms, its launches (waited for one by one) {:.3} ms ({:.1}%)",
        1e3 * step_seconds,
        per_step(total),
        100.0 * per_step(total) / (1e3 * step_seconds).max(1e-12)
    )?;
    // Launches a step: whole unless they vary from step to step (an MoE expert's products).
    let launches = |n: u64| {
        let steps = steps.max(1);
        match n % steps {
            0 => counted(n / steps, "launch", "launches"),
            _ => format!("{:.1} launches", n as f64 / steps as f64),
        }
    };
    for t in times.iter().take(SHOWN) {
        writeln!(
            out,
            "  time       {:>5.1}%  {:>9.3} ms  {:>15}  {}",
            share(t.seconds),
            per_step(t.seconds),
            launches(t.launches),
            t.name
        )?;
    }
    if times.len() > SHOWN {
        let rest: f64 = times[SHOWN..].iter().map(|t| t.seconds).sum();
        let others = times.len() - SHOWN;
        writeln!(
            out,
            "  time       {:>5.1}%  {:>9.3} ms  {others} others",
            share(rest),
            per_step(rest)
        )?;
    }
    Ok(())
}

/// The decoding the speed part times: (rows, prompt tokens, new tokens), as a GRPO step's
/// rollouts of short prompts.
const DECODE: (usize, usize, usize) = (64, 32, 64);

/// New tokens per second of greedy decoding, `rows` random prompts of `prompt` tokens and
/// `new` tokens each (no stop), on the device (bf16 matmuls, as the training ops decode) and,
/// unless `speed.cpu_steps` is 0, on the CPU (the workers GRPO's rollouts use there), each
/// once after a warm-up run.
fn decoding_speed<L: Launcher>(
    launcher: &L,
    m: &SpeedModel,
    (rows, prompt, new): (usize, usize, usize),
    speed: Speed,
    out: &mut dyn Write,
) -> Result<Value, RunError> {
    use model::sampling::{Sampling, generate_split, generate_with};
    let t = trainer(m.pattern, m.activation, m.tied, m.size, &(m.overrides)())?;
    let mut rng = kernels::rng::Rng::new(3);
    let prompts: Vec<Vec<u32>> = (0..rows)
        .map(|_| {
            (0..prompt)
                .map(|_| (rng.next_u64() % m.size.vocab as u64) as u32)
                .collect()
        })
        .collect();
    let sampling = Sampling::greedy(new);
    let rngs = || vec![model::params::Rng::new(0); rows];
    let weights =
        DeviceStep::upload_for_scoring(launcher, &t.model)?.with_precision(TRAINING_PRECISION);
    // New tokens a second, the wall clock and the launches' times of one generation.
    let on_device = || -> Result<(f64, f64, Vec<KernelTime>), RunError> {
        let mut decoder = super::Decoding::start(&weights, &t.model, rows, prompt + new)?;
        launcher.take_kernel_times();
        let clock = Instant::now();
        let done = |_: usize, _: &[u32]| false;
        generate_with(&mut decoder, &prompts, &sampling, &[], &mut rngs(), done)
            .map_err(crate::err)?;
        let seconds = clock.elapsed().as_secs_f64().max(1e-9);
        Ok((
            (rows * new) as f64 / seconds,
            seconds,
            launcher.take_kernel_times(),
        ))
    };
    let threads = kernels::workers::threads();
    let on_cpu = || -> Result<f64, RunError> {
        let clock = Instant::now();
        let done = |_: usize, _: &[u32]| false;
        generate_split(
            &t.model,
            &prompts,
            &sampling,
            &[],
            &mut rngs(),
            threads,
            done,
        )
        .map_err(crate::err)?;
        Ok((rows * new) as f64 / clock.elapsed().as_secs_f64().max(1e-9))
    };
    on_device()?; // warm-up: the first launches
    let (device_rate, seconds, times) = on_device()?;
    let cpu_rate = if speed.cpu_steps > 0 {
        on_cpu()?;
        Some(on_cpu()?)
    } else {
        None
    };
    let cpu_text = match cpu_rate {
        Some(rate) => format!(
            "CPU ({threads} threads) {rate:.0} ({:.2}x)",
            device_rate / rate
        ),
        None => "CPU not timed".to_string(),
    };
    writeln!(
        out,
        "decode       {}, {rows} rows, {prompt} prompt + {new} new tokens, greedy: device \
         ({} matmuls) {device_rate:.0} new tokens/s, {cpu_text}",
        m.name,
        TRAINING_PRECISION.name(),
    )?;
    kernel_times(&times, ("a generation", 1), seconds, out)?;
    Ok(json!({
        "model": m.name, "pattern": m.pattern, "rows": rows, "prompt_tokens": prompt,
        "new_tokens": new, "precision": TRAINING_PRECISION.name(),
        "device_new_tokens_per_s": device_rate, "cpu_new_tokens_per_s": cpu_rate,
        "cpu_threads": threads
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::launch::Shim;

    /// A bf16 step on the shim, attention on the tensor-core kernels (SMALL's heads are 16
    /// wide), gives the CPU's step-1 gradients within what bf16 products cost: every
    /// parameter within 3 % of its own largest gradient (measured: 0.69 %). What it guards is
    /// the trainer's wiring of those kernels: reading dy from the wrong place of the packed
    /// buffer puts a gradient 315 times its largest off. A subtle kernel bug hides in bf16's
    /// noise at initialisation (the forward's scores scaled 1.5 times: 1.1 %), so the kernels'
    /// own test, on sharper random inputs, is what holds their arithmetic.
    #[test]
    fn a_bf16_steps_gradients_through_the_tensor_core_attention_are_the_cpus() {
        let mut t = trainer("*-*-", "swiglu", false, SMALL, &Value::Null).unwrap();
        let mut source = PackedCounting(2);
        let mut objective = NextToken::new(&mut source);
        let shim = Shim::default();
        let gap = objective_gap(&shim, &mut t, &mut objective, Precision::Bf16).unwrap();
        eprintln!("furthest: {gap:?}, {:.2e} of its largest", gap.relative());
        assert!(gap.relative() <= 3e-2, "{gap:?}: {}", gap.relative());
    }

    /// A timed step's report: the launches' share of the step first, then per kernel its time
    /// per step and share of the launches, longest first, the rest on one line.
    #[test]
    fn kernel_times_are_per_step_shares_of_the_launches() {
        let time = |name: &str, launches, seconds| KernelTime {
            name: name.to_string(),
            launches,
            seconds,
        };
        let mut times = vec![
            time("adamw_f32", 30, 0.006),
            time("cuBLASLt 8x8x8 NN", 7, 0.002),
        ];
        times.extend((0..40).map(|i| time(&format!("k{i}"), 2, 0.0001)));
        let mut out = Vec::new();
        // Two steps of 20 ms: 12 ms of launches, 6 ms a step.
        kernel_times(&times, ("a step", 2), 0.020, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 1 + 40 + 1, "{text}");
        assert!(lines[0].contains("a step 20.000 ms") && lines[0].contains("6.000 ms (30.0%)"));
        assert!(
            lines[1].contains("50.0%") && lines[1].contains("3.000 ms"),
            "{}",
            lines[1]
        );
        assert!(lines[1].contains("15 launches  adamw_f32"), "{}", lines[1]);
        // 7 launches over 2 steps (an MoE expert's products vary from step to step).
        assert!(lines[2].contains("3.5 launches  cuBLASLt"), "{}", lines[2]);
        assert!(
            lines[41].contains("2 others") && lines[41].contains("0.100 ms"),
            "{text}"
        );
        let mut none = Vec::new();
        kernel_times(&[], ("a step", 2), 0.020, &mut none).unwrap();
        assert!(
            none.is_empty(),
            "an executor that times nothing prints nothing"
        );
    }

    /// The decoding speed, which only a GPU times, runs through on the shim for a small model:
    /// one line, and both rates positive.
    #[test]
    fn the_decoding_speed_reports_the_device_and_the_cpu() {
        let model = SpeedModel {
            name: "small",
            pattern: "M*E-",
            activation: "relu2",
            tied: false,
            size: SMALL,
            rows: 0,
            len: 0,
            overrides: || Value::Null,
        };
        let mut out = Vec::new();
        let timed = Speed {
            steps: 1,
            cpu_steps: 1,
        };
        let json = decoding_speed(&Shim::default(), &model, (3, 4, 2), timed, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with("decode       small, 3 rows"), "{text}");
        for rate in ["device_new_tokens_per_s", "cpu_new_tokens_per_s"] {
            assert!(
                json[rate].as_f64().is_some_and(|r| r > 0.0),
                "{rate}: {json}"
            );
        }
        // Without CPU steps the CPU is not timed, and the line and the JSON say so.
        let mut out = Vec::new();
        let device_only = Speed {
            cpu_steps: 0,
            ..timed
        };
        let json = decoding_speed(&Shim::default(), &model, (3, 4, 2), device_only, &mut out);
        let (json, text) = (json.unwrap(), String::from_utf8(out).unwrap());
        assert!(text.trim_end().ends_with("CPU not timed"), "{text}");
        assert!(json["cpu_new_tokens_per_s"].is_null(), "{json}");
    }

    /// The speed part, which only a GPU times, runs through on the shim for a small model:
    /// one line, and every rate of its JSON (bf16 and f32 matmuls on the device, the CPU
    /// trainer) a positive number of tokens a second. A mistake in it would otherwise first
    /// show on a lent GPU.
    #[test]
    fn the_speed_part_reports_both_precisions_and_the_cpu() {
        let model = SpeedModel {
            name: "small",
            pattern: "*-",
            activation: "relu2",
            tied: false,
            size: SMALL,
            rows: 2,
            len: 8,
            overrides: || Value::Null,
        };
        let mut out = Vec::new();
        let timed = Speed {
            steps: 1,
            cpu_steps: 1,
        };
        let json = speed(&Shim::default(), &model, (timed, Precision::Bf16), &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.starts_with("speed        small") && text.contains("f32 matmuls"),
            "{text}"
        );
        assert!(
            text.contains("1 step: device") && text.contains("over 1 step ("),
            "{text}"
        );
        assert_eq!(json["precision"], "bf16", "{json}");
        for rate in [
            "device_tokens_per_s",
            "device_f32_tokens_per_s",
            "cpu_tokens_per_s",
        ] {
            assert!(
                json[rate].as_f64().is_some_and(|r| r > 0.0),
                "{rate}: {json}"
            );
        }
        let mut out = Vec::new();
        let device_only = Speed {
            cpu_steps: 0,
            ..timed
        };
        let json = speed(
            &Shim::default(),
            &model,
            (device_only, Precision::Bf16),
            &mut out,
        );
        let (json, text) = (json.unwrap(), String::from_utf8(out).unwrap());
        assert!(text.trim_end().ends_with("CPU trainer not timed"), "{text}");
        assert!(json["cpu_tokens_per_s"].is_null(), "{json}");
    }
}
