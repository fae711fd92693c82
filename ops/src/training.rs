//! What the four training ops (`pretrain`, `sft`, `dpo`, `grpo`) and `eval`/`export` share:
//! the input and output declarations of a model, checks of a training stage, the upstream
//! model's tokenizer, reading a `blend.json` split, and training to the end with a checkpoint
//! to resume from, then publishing the model.

use kernels::launch::{Cuda, Launcher, Shim};
use model::checkpoint::{self, ModelFile};
use model::config::ModelConfig;
use nemo_dag_data::chat::CHAT_TEMPLATE_FILE;
use nemo_dag_op::{
    DeclError, Device, Estimate, Facts, Metrics, Plan, Port, Progress, RunContext, RunError,
    Upstream,
};
use serde_json::Value;
use std::path::{Path, PathBuf};
use train::gpu::{DeviceStep, OnDevice};
use train::{Objective, OnCpu, Schedule, Stepper, Trainer};

/// The input every op after `pretrain` reads: the model it starts from.
pub(crate) const UPSTREAM_MODEL: Port = Port {
    name: "model",
    required: true,
    what: "an upstream model: a pretrain or sft artifact's model",
};

/// What every training op publishes: the model, and the checkpoint a rerun resumes from.
pub(crate) const MODEL_OUTPUTS: &[(&str, &str)] =
    &[("model", "model"), ("checkpoint", "checkpoint")];

/// Declaration checks shared by the training ops.
pub(crate) fn check_training(
    model: Option<&ModelConfig>,
    schedule: &Schedule,
) -> Result<(), DeclError> {
    if let Some(model) = model {
        model
            .validate()
            .map_err(|e| DeclError::new(&["params", "model", e.field], e.message))?;
    }
    schedule
        .check()
        .map_err(|(field, msg)| DeclError::new(&["params", field], msg))?;
    Ok(())
}

/// The vocabulary the model is built with: the tokenizer's, or a larger `model.vocab`.
pub(crate) fn model_vocab(cfg: &ModelConfig, tokenizer_vocab: usize) -> Result<usize, RunError> {
    if cfg.vocab == 0 {
        return Ok(tokenizer_vocab);
    }
    if cfg.vocab < tokenizer_vocab {
        return Err(RunError::new(format!(
            "model.vocab is {} but the tokenizer has {tokenizer_vocab} tokens",
            cfg.vocab
        )));
    }
    Ok(cfg.vocab)
}

/// The tokenizer a model artifact carries (`model/tokenizer.json`), and its path.
pub(crate) fn model_tokenizer(
    model_dir: &Path,
) -> Result<(tokenizers::Tokenizer, PathBuf), RunError> {
    let path = model_dir.join("tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| RunError::new(format!("cannot load {}: {e}", path.display())))?;
    Ok((tokenizer, path))
}

pub(crate) fn input(ctx: &RunContext, name: &str) -> Result<PathBuf, RunError> {
    ctx.inputs
        .get(name)
        .cloned()
        .ok_or_else(|| RunError::new(format!("no `{name}` input")))
}

/// The chat template a model carries on ([`CHAT_TEMPLATE_FILE`]): the first of `dirs` that
/// keeps one (a `pack` artifact's, then the upstream model's), or none.
pub(crate) fn carried_template(dirs: &[&Path]) -> Result<Option<String>, RunError> {
    for dir in dirs {
        let path = dir.join(CHAT_TEMPLATE_FILE);
        if path.is_file() {
            let text = std::fs::read_to_string(&path)
                .map_err(|e| RunError::new(format!("{}: {e}", path.display())))?;
            return Ok(Some(text));
        }
    }
    Ok(None)
}

/// Resume from the stage's own checkpoint if an interrupted attempt left one, train (on the
/// GPU the stage's device resolved to, when the GPU trainer can take the objective and the
/// model: [`gpu_for`]), and write `model/` (with the tokenizer, and the chat template the
/// model was trained with, if any) beside `checkpoint/`. A checkpoint is the same files on
/// either device, so an attempt resumes on whichever the next one runs on.
pub(crate) fn train_and_publish(
    ctx: &mut RunContext,
    mut trainer: Trainer,
    objective: &mut dyn Objective,
    tokenizer: &Path,
    chat_template: Option<&str>,
    tokens_per_step: impl Fn(u64) -> u64,
) -> Result<Metrics, RunError> {
    let ckpt = ctx.out_dir.join("checkpoint");
    if let Some(dir) = train::checkpoint::latest(&ckpt) {
        train::checkpoint::restore(&mut trainer, &dir)
            .map_err(|e| RunError::new(format!("cannot resume from {}: {e}", dir.display())))?;
        writeln!(
            ctx.log,
            "resuming from the checkpoint at step {}",
            trainer.step
        )?;
    }
    // The GPU is started here, so that one `auto` cannot start leaves the CPU to train.
    let gpu = gpu_for(ctx, objective, &trainer)?;
    let executor = match &gpu {
        Some(g) => g.or_cpu(ctx.log, Executor::start(g.ordinal))?,
        None => None,
    };
    let t = &mut trainer;
    let summary = match (&gpu, &executor) {
        (Some(g), Some(Executor::Cuda(cuda))) => train_on(
            ctx,
            t,
            objective,
            Some((g, &**cuda)),
            &ckpt,
            tokens_per_step,
        )?,
        (Some(g), Some(Executor::Shim(shim))) => {
            train_on(ctx, t, objective, Some((g, shim)), &ckpt, tokens_per_step)?
        }
        _ => train_on::<Shim>(ctx, t, objective, None, &ckpt, tokens_per_step)?,
    };
    let model_dir = ctx.out_dir.join("model");
    checkpoint::save_model(&trainer.model, &model_dir)
        .map_err(|e| RunError::new(format!("cannot write {}: {e}", model_dir.display())))?;
    // The copy keeps the source's mode, and published files are read-only: replace, do not
    // overwrite, a copy a resumed attempt may already hold.
    let copied = model_dir.join("tokenizer.json");
    let _ = std::fs::remove_file(&copied);
    std::fs::copy(tokenizer, &copied)?;
    if let Some(text) = chat_template {
        let path = model_dir.join(CHAT_TEMPLATE_FILE);
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, text)?;
    }
    let _ = std::fs::remove_dir_all(ctx.out_dir.join("checkpoint.old"));
    match summary {
        Value::Object(m) => Ok(m),
        _ => Ok(Metrics::new()),
    }
}

/// `trainer`'s steps of `objective`, on `device`'s launcher when the GPU trainer can take them
/// there (an `auto` stage whose weights do not fit goes on on the CPU, saying why), else on the
/// CPU, checkpointed into `ckpt`: the loop's summary.
fn train_on<L: Launcher>(
    ctx: &mut RunContext,
    trainer: &mut Trainer,
    objective: &mut dyn Objective,
    device: Option<(&Gpu, &L)>,
    ckpt: &Path,
    tokens_per_step: impl Fn(u64) -> u64,
) -> Result<Value, RunError> {
    let step = match device {
        Some((g, launcher)) => {
            let reference = objective.per_token().and_then(|p| p.reference());
            let step = DeviceStep::upload(launcher, trainer).and_then(|step| {
                let mut step = step.with_precision(train::gpu::TRAINING_PRECISION);
                step.upload_reference(&trainer.model, reference)?;
                Ok(step)
            });
            g.or_cpu(ctx.log, step)?
        }
        None => None,
    };
    if let (Some((_, launcher)), Some(_)) = (device, &step) {
        writeln!(ctx.log, "device: {}", launcher.describe())?;
    }
    let progress = &mut *ctx.progress;
    let mut report = |done, total, figures: &str| {
        progress(Progress {
            done,
            total,
            message: figures.to_string(),
        })
    };
    let (mut on_device, mut on_cpu);
    let stepper: &mut dyn Stepper = match step {
        Some(step) if objective.per_token().is_some() => {
            on_device = OnDevice { step, objective };
            &mut on_device
        }
        _ => {
            on_cpu = OnCpu(objective);
            &mut on_cpu
        }
    };
    trainer.run_on(
        stepper,
        ckpt,
        tokens_per_step,
        ctx.log,
        &mut report,
        ctx.stop_after_step,
    )
}

/// The variable that puts the SIMT shim where a GPU would be: with `NEMO_DAG_CUDA_SHIM=1` the
/// engine finds a "GPU" on any machine, and the ops' GPU branch runs its kernels on the CPU.
/// The tests run the training and scoring ops' GPU branch end to end this way; nobody else
/// has a reason to set it (the shim is slow).
pub const SHIM_VAR: &str = "NEMO_DAG_CUDA_SHIM";

/// Whether [`SHIM_VAR`] is set to 1.
pub fn shim_stands_in() -> bool {
    std::env::var(SHIM_VAR).as_deref() == Ok("1")
}

/// What runs a stage's GPU work: a CUDA device, or the SIMT shim ([`SHIM_VAR`]).
pub(crate) enum Executor {
    Cuda(Box<Cuda>),
    Shim(Shim),
}

impl Executor {
    /// GPU `ordinal` with every kernel compiled, or the shim where it stands in.
    pub(crate) fn start(ordinal: usize) -> Result<Executor, RunError> {
        if shim_stands_in() {
            return Ok(Executor::Shim(Shim::default()));
        }
        Cuda::new(ordinal)
            .map(|cuda| Executor::Cuda(Box::new(cuda)))
            .map_err(|e| RunError::new(format!("cannot start cuda:{ordinal}: {e}")))
    }
}

/// The GPU a stage was given, and whether it must run there (`cuda:N`) or may fall back to
/// the CPU (`auto`).
pub(crate) struct Gpu {
    pub ordinal: usize,
    required: bool,
}

impl Gpu {
    /// The GPU the engine resolved a stage's device to ([`RunContext::device`]): `cuda:N`
    /// must be used, `auto` means GPU 0 where it can be; `None` for the CPU.
    pub(crate) fn of(device: Device) -> Option<Gpu> {
        match device {
            Device::Cuda(ordinal) => Some(Gpu {
                ordinal,
                required: true,
            }),
            Device::Auto => Some(Gpu {
                ordinal: 0,
                required: false,
            }),
            Device::Cpu => None,
        }
    }

    fn or_cpu<T>(
        &self,
        log: &mut dyn std::io::Write,
        what: Result<T, RunError>,
    ) -> Result<Option<T>, RunError> {
        self.or_cpu_for("training", log, what)
    }

    /// `what` when it worked; else, under `cuda:N`, its error, and under `auto`, `None`: the
    /// CPU does the `work`, and the log says why.
    pub(crate) fn or_cpu_for<T>(
        &self,
        work: &str,
        log: &mut dyn std::io::Write,
        what: Result<T, RunError>,
    ) -> Result<Option<T>, RunError> {
        match what {
            Ok(t) => Ok(Some(t)),
            Err(e) if self.required => Err(e),
            Err(e) => {
                writeln!(log, "device auto: {work} on the CPU: {}", e.message)?;
                Ok(None)
            }
        }
    }
}

/// The GPU a stage trains on, from the device the engine resolved for it
/// ([`RunContext::device`]): `cuda:N` must be used, so an objective or a model the GPU trainer
/// cannot take is an error naming what; `auto` uses GPU 0 when it can, and otherwise says in
/// the log why it trains on the CPU. A stage resumed at its last step trains no more, so it
/// starts no GPU.
fn gpu_for(
    ctx: &mut RunContext,
    objective: &mut dyn Objective,
    trainer: &Trainer,
) -> Result<Option<Gpu>, RunError> {
    let Some(gpu) = Gpu::of(ctx.device) else {
        return Ok(None);
    };
    if trainer.step >= trainer.schedule.steps {
        return Ok(None);
    }
    let trainable = match objective.per_token() {
        None => Err(RunError::new(format!(
            "stage `{}`'s objective trains on the CPU only: the GPU trainer minimises \
             objectives of the output head's log-probabilities (pretrain, sft, dpo, grpo)",
            ctx.stage.name
        ))),
        Some(_) => train::gpu::supports(trainer),
    };
    Ok(gpu.or_cpu(ctx.log, trainable)?.map(|()| gpu))
}

/// The `(weight, path)` entries of one split of an artifact's `blend.json` (a `tokenize` or
/// `pack` artifact, named by `kind` in errors). Weights must be positive numbers (written as
/// strings, as Megatron's blend files hold them); an empty or missing split is an error when
/// `required`.
pub(crate) fn blend_split(
    dir: &Path,
    split: &str,
    kind: &str,
    required: bool,
) -> Result<Vec<(f64, PathBuf)>, RunError> {
    let path = dir.join("blend.json");
    let text = std::fs::read_to_string(&path).map_err(|e| {
        RunError::new(format!(
            "{}: {e} (the input must be a {kind} artifact)",
            path.display()
        ))
    })?;
    let blend: Value = serde_json::from_str(&text)
        .map_err(|e| RunError::new(format!("{}: {e}", path.display())))?;
    let list = blend[split].as_array().cloned().unwrap_or_default();
    if list.len() % 2 != 0 || (required && list.is_empty()) {
        return Err(RunError::new(format!(
            "{}: `{split}` must be a non-empty [weight, path, …] list",
            path.display()
        )));
    }
    list.chunks(2)
        .map(|pair| {
            let w = pair[0]
                .as_str()
                .and_then(|s| s.parse::<f64>().ok())
                .or_else(|| pair[0].as_f64())
                .filter(|w| *w > 0.0 && w.is_finite());
            match (w, pair[1].as_str()) {
                (Some(w), Some(rel)) => Ok((w, dir.join(rel))),
                _ => Err(RunError::new(format!(
                    "{}: bad `{split}` entry {pair:?}",
                    path.display()
                ))),
            }
        })
        .collect()
}

/// The model a stage's `model` input will be, before it exists: what the upstream stage
/// declares, or the `config.json` of a model directory the manifest names.
pub(crate) fn planned_model(upstream: &Upstream) -> Option<ModelFile> {
    if let Some(model) = upstream.stages.get("model").and_then(|f| f.model.clone()) {
        return serde_json::from_value(model).ok();
    }
    let dir = upstream.files.get("model")?;
    checkpoint::read_model_file(dir).ok()
}

/// The vocabulary a stage's `tokenizer` input will have: what the upstream stage declares,
/// or the size of the tokenizer.json the manifest names.
pub(crate) fn planned_vocab(upstream: &Upstream, input: &str) -> Option<usize> {
    if let Some(facts) = upstream.stages.get(input) {
        return facts.vocab;
    }
    let file = upstream.files.get(input)?;
    let tokenizer = tokenizers::Tokenizer::from_file(file).ok()?;
    Some(tokenizer.get_vocab_size(true))
}

/// What a training stage hands downstream: its model (the upstream's, trained further) and
/// the estimate of its run.
pub(crate) fn model_plan(model: ModelFile, estimate: Option<Estimate>) -> Plan {
    Plan {
        facts: Facts {
            vocab: Some(model.vocab),
            model: serde_json::to_value(&model).ok(),
            sequence: None,
        },
        estimate,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use model::net::Model;
    use nemo_dag_op::StageDecl;
    use serde_json::json;
    use std::collections::BTreeMap;
    use train::gpu::check::Counting;
    use train::{BatchSource, NextToken};

    /// A model of `pattern` whose attention heads have `head_dim` dimensions.
    fn trainer(pattern: &str, head_dim: usize) -> Trainer {
        let cfg: ModelConfig = serde_json::from_value(json!({
            "pattern": pattern, "hidden": 16, "heads": 2, "kv_heads": 1, "head_dim": head_dim,
            "ffn": 16, "moe": {"experts": 4, "top_k": 2, "expert_ffn": 8}
        }))
        .unwrap();
        let schedule: Schedule = serde_json::from_value(json!({
            "steps": 1, "global_batch": 2, "micro_batch": 2, "lr": 1e-3
        }))
        .unwrap();
        Trainer::new(Model::new(&cfg, 32, 1).unwrap(), schedule)
    }

    /// An objective the GPU trainer cannot minimise: not a function of the head's
    /// log-probabilities.
    struct CpuOnly;

    impl Objective for CpuOnly {
        fn prepare(&mut self, _: &Model, _: u64) -> Result<usize, RunError> {
            Ok(0)
        }
        fn loss(&self, _: &Model, _: usize) -> Result<train::MicroLoss, RunError> {
            Err(RunError::new("never asked"))
        }
    }

    /// `gpu_for` on `device` for `trainer` under `objective`: the GPU it picks (or its error)
    /// and what it wrote in the log.
    fn pick(
        device: Device,
        trainer: &Trainer,
        objective: &mut dyn Objective,
    ) -> (Result<Option<usize>, String>, String) {
        let (inputs, outputs, params) = (BTreeMap::new(), BTreeMap::new(), json!({}));
        let mut log = Vec::new();
        let mut ctx = RunContext {
            stage: StageDecl {
                name: "train",
                params: &params,
                inputs: vec![],
                outputs: &outputs,
                cmd: None,
                world_size: None,
                nodes: None,
            },
            inputs: &inputs,
            out_dir: Path::new("."),
            log: &mut log,
            progress: &mut |_| {},
            stop_after_step: None,
            launcher: &[],
            device,
        };
        let picked = gpu_for(&mut ctx, objective, trainer)
            .map(|gpu| gpu.map(|g| g.ordinal))
            .map_err(|e| e.to_string());
        (picked, String::from_utf8(log).unwrap())
    }

    /// `cuda:N` trains on GPU N or fails naming what the GPU trainer cannot take; `auto`
    /// trains on the GPU when it can and otherwise on the CPU, saying why in the log.
    #[test]
    fn a_stage_trains_on_the_gpu_it_was_given_when_the_gpu_trainer_can() {
        let mut source = Counting(1);
        let source: &mut dyn BatchSource = &mut source;
        let mut next_token = NextToken::new(source);
        assert_eq!(
            pick(Device::Cuda(2), &trainer("*-", 8), &mut next_token).0,
            Ok(Some(2))
        );
        assert_eq!(
            pick(Device::Auto, &trainer("*-", 8), &mut next_token).0,
            Ok(Some(0))
        );
        assert_eq!(
            pick(Device::Cpu, &trainer("*-", 8), &mut next_token),
            (Ok(None), String::new())
        );

        assert_eq!(
            pick(Device::Cuda(1), &trainer("*E-/*E", 8), &mut next_token).0,
            Ok(Some(1))
        );
        let (picked, _) = pick(Device::Cuda(0), &trainer("*E-", 256), &mut next_token);
        let err = picked.unwrap_err();
        assert!(err.contains("attention heads of 256 dimensions"), "{err}");
        let (picked, log) = pick(Device::Auto, &trainer("*E-", 256), &mut next_token);
        assert_eq!(picked, Ok(None));
        assert!(
            log.contains("device auto: training on the CPU")
                && log.contains("heads of 256 dimensions"),
            "{log}"
        );
        assert!(
            !log.contains("device: cpu"),
            "no advice to do what it does: {log}"
        );

        // DPO's objective is the head's log-probabilities: it trains on the GPU.
        let t = trainer("*E-", 8);
        let loss = train::dpo::LossConfig {
            beta: 0.1,
            average_log_probs: false,
            preference_weight: 1.0,
            sft_weight: 0.0,
        };
        let reference = trainer("*E-", 8).model;
        let mut dpo = train::dpo::DpoObjective::new(reference, Vec::new(), loss, &t.schedule);
        assert_eq!(pick(Device::Cuda(3), &t, &mut dpo).0, Ok(Some(3)));

        let err = pick(Device::Cuda(0), &trainer("*-", 8), &mut CpuOnly)
            .0
            .unwrap_err();
        assert!(
            err.contains("stage `train`'s objective trains on the CPU only"),
            "{err}"
        );
        assert_eq!(
            pick(Device::Auto, &trainer("*-", 8), &mut CpuOnly).0,
            Ok(None)
        );
    }
}
