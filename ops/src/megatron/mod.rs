//! `megatron_pretrain` and `megatron_sft`: a stage trained by NVIDIA Megatron-Bridge
//! (<https://github.com/NVIDIA-NeMo/Megatron-Bridge>, v0.6), the engine of the Nemotron 3
//! recipes, on nemo-dag's own data artifacts.
//!
//! ```yaml
//! pretrain:
//!   op: megatron_pretrain
//!   inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer"}
//!   resources: {launch: srun, nodes: 4, gpus: 8}      # one rank per GPU, under Slurm
//!   params:
//!     recipe: nemotron_3_nano_pretrain_config
//!     image: nvcr.io/nvidia/nemo:25.11.nemotron_3_nano
//!     seq_length: 8192
//!     steps: 39735
//!     global_batch: 1024
//!     micro_batch: 1
//!     save_interval: 200
//!     parallel: {ep: 8}
//! ```
//!
//! The stage runs Megatron-Bridge's `scripts/training/run_recipe.py --recipe R --mode pretrain`
//! (or `sft`) once per rank, in `image`, with `key=value` overrides rendered from the params
//! ([`overrides`]). What the op owns, and the reason:
//!
//! - **Data.** Pretraining reads the `tokenize` artifact's `blend.json` as Megatron per-split
//!   blends (`dataset.blend_per_split`, `dataset.split=null`); SFT reads the `pack` artifact's
//!   packed Parquet as it is (Megatron-Bridge's offline packed-Parquet dataset). Megatron's
//!   index cache goes to the attempt's `run/data_cache`, never into the read-only input.
//! - **Tokenizer.** The stage's `tokenizer.json`, staged as a Hugging Face tokenizer directory
//!   whose `eos_token` is the end-of-document token, with the vocabulary taken from it.
//! - **Checkpoints.** `checkpoint.save` and `checkpoint.load` are both the attempt's own
//!   `checkpoint/`: a resume is always of this key's run. (The recipes' default directory,
//!   `nemo_experiments/default/checkpoints` under the working directory, silently resumes
//!   whatever ran there before.) Before every launch the directory is cut back to its newest
//!   complete iteration ([`checkpoint::prepare`]) and the run told to load exactly that one.
//! - **Publish.** Only when Megatron-Bridge exits 0 *and* the newest complete iteration is the
//!   last step: a SIGTERM save or `train.exit_interval` also exit 0. The artifact holds that
//!   iteration alone with its trackers (`checkpoint/`), and `run/` (`launch.sh`, the script of
//!   the last launch; Megatron-Bridge's resolved `config.yaml`; the tokenizer; TensorBoard
//!   events).
//!
//! The outputs are Megatron `torch_dist` checkpoints: `megatron_sft` reads one, the native
//! ops (`eval`, `export`, `dpo`, `grpo`) do not.

pub mod checkpoint;
pub mod estimate;
pub mod export;
pub mod overrides;

use crate::format_weight as float;
use crate::training::{blend_split, carried_template, input};
use nemo_dag_data::chat::CHAT_TEMPLATE_FILE;
use nemo_dag_op::process::{describe_exit, readable_shell_word, run_logged};
use nemo_dag_op::{
    DeclError, Estimate, Metrics, Op, Outputs, Plan, Port, Progress, RunContext, RunError, Spec,
    StageDecl, Upstream,
};
use overrides::{Override, list, quoted};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

/// Both ops, told apart by what they run: `run_recipe.py --mode pretrain` or `--mode sft`.
pub struct Megatron(pub Mode);

/// The params of both ops: which recipe, in which image, and the run's shape. Every param is
/// part of the key, the image too: it is the software that runs.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// The recipe function `run_recipe.py --recipe` builds the config with.
    recipe: String,
    /// The container image the ranks run in (pyxis `--container-image`, under `launch: srun`).
    #[serde(default)]
    image: Option<String>,
    /// Megatron-Bridge's checkout inside the image.
    #[serde(default = "default_mb_root")]
    mb_root: String,
    /// The interpreter, as words (`uv run --no-sync python` for an image built with uv).
    #[serde(default = "default_python")]
    python: String,
    seq_length: u64,
    steps: u64,
    global_batch: u64,
    micro_batch: u64,
    save_interval: u64,
    /// Checkpoints kept while training (`checkpoint.most_recent_k`); the artifact keeps the last.
    #[serde(default = "default_keep")]
    keep_checkpoints: u64,
    #[serde(default)]
    lr: Option<f64>,
    #[serde(default)]
    min_lr: Option<f64>,
    #[serde(default)]
    warmup: Option<u64>,
    #[serde(default)]
    weight_decay: Option<f64>,
    #[serde(default)]
    beta1: Option<f64>,
    #[serde(default)]
    beta2: Option<f64>,
    #[serde(default)]
    clip_grad: Option<f64>,
    #[serde(default = "default_seed")]
    seed: u64,
    #[serde(default)]
    eval_interval: Option<u64>,
    #[serde(default)]
    eval_iters: Option<u64>,
    #[serde(default = "default_log_interval")]
    log_interval: u64,
    #[serde(default)]
    parallel: Parallel,
    /// The tokenizer's end-of-document token, Megatron's EOD.
    #[serde(default = "default_eos")]
    eos_token: String,
    /// Exported in `launch.sh` before the launch.
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// Any other config key: `{"model.num_layers": 4}`, passed last as `model.num_layers=4`.
    #[serde(default)]
    overrides: BTreeMap<String, Value>,
}

/// Model parallelism; each is rendered only when given (the recipe's own otherwise).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Parallel {
    tp: Option<u64>,
    pp: Option<u64>,
    ep: Option<u64>,
    etp: Option<u64>,
    cp: Option<u64>,
    sp: Option<bool>,
}

impl Params {
    /// What [`estimate::estimate`] makes of the stage on `world` ranks: none for a recipe
    /// whose model nemo-dag does not know, or whose `overrides` change what the table says of
    /// it (the model, its parallelism, recompute, precision or optimizer).
    fn estimate(&self, world: Option<u64>) -> Option<Estimate> {
        let recipe = estimate::recipe(&self.recipe)?;
        let changes = ["model.", "optimizer.", "ddp.", "mixed_precision"];
        if self
            .overrides
            .keys()
            .any(|k| changes.iter().any(|c| k.starts_with(c)))
        {
            return None;
        }
        let (d, par) = (&recipe.defaults, &self.parallel);
        let run = estimate::Run {
            world: world?,
            tp: par.tp.unwrap_or(d.tp),
            pp: par.pp.unwrap_or(d.pp),
            ep: par.ep.unwrap_or(d.ep),
            etp: par.etp.unwrap_or(d.etp),
            cp: par.cp.unwrap_or(d.cp),
            sp: par.sp.unwrap_or(d.sp),
            seq: self.seq_length,
            micro_batch: self.micro_batch,
            global_batch: self.global_batch,
            steps: self.steps,
        };
        Some(estimate::estimate(&recipe, &run))
    }
}

fn default_mb_root() -> String {
    "/opt/Megatron-Bridge".into()
}
fn default_python() -> String {
    "python".into()
}
fn default_keep() -> u64 {
    2
}
fn default_seed() -> u64 {
    1234
}
fn default_log_interval() -> u64 {
    10
}
fn default_eos() -> String {
    "<|endoftext|>".into()
}

const OUTPUTS: &[(&str, &str)] = &[("checkpoint", "checkpoint"), ("run", "run")];

static PRETRAIN: Spec = Spec {
    name: "megatron_pretrain",
    version: 1,
    summary: "pretrain with Megatron-Bridge's run_recipe.py on a tokenize artifact (per-split blends)",
    inputs: &[
        Port {
            name: "data",
            required: true,
            what: "a tokenize artifact",
        },
        Port {
            name: "tokenizer",
            required: true,
            what: "the tokenizer.json the data was tokenized with",
        },
        CHECKOUT,
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(OUTPUTS),
    resumable: true,
    launched: true,
    gpu: false,
};

/// The input a Megatron-Bridge stage may name to run a checkout of its own: its files are part
/// of the key, so a changed checkout reruns the stage (a checkout mounted by the profile alone
/// is not, and a cached result would silently be of the old code).
pub(crate) const CHECKOUT: Port = Port {
    name: "checkout",
    required: false,
    what: "a Megatron-Bridge checkout (a directory) to run instead of the image's: mounted at \
           `mb_root` in the container, or run from where it is without one; its files are in \
           the key",
};

/// What a launch runs Megatron-Bridge (or NeMo-RL, `rl_root` for `mb_root`) with: the
/// launcher's words and the root of the checkout it runs.
pub(crate) struct Software {
    pub launcher: Vec<String>,
    pub root: String,
}

impl Software {
    /// The image's `mb_root` under `launcher`; or, with a `checkout` input, that checkout:
    /// mounted over `mb_root` when the launcher starts a container (pyxis
    /// `--container-image`), else run from where it is.
    pub(crate) fn of(launcher: &[String], mb_root: &str, checkout: Option<&str>) -> Software {
        let mut launcher = launcher.to_vec();
        let Some(checkout) = checkout else {
            return Software {
                launcher,
                root: mb_root.to_string(),
            };
        };
        // Read-only: running the code must not change the files its key was made of.
        let mount = format!("{checkout}:{}:ro", mb_root.trim_end_matches('/'));
        let root = mb_root.to_string();
        if let Some(mounts) = launcher
            .iter_mut()
            .find(|w| w.starts_with("--container-mounts="))
        {
            mounts.push(',');
            mounts.push_str(&mount);
            return Software { launcher, root };
        }
        if let Some(at) = launcher
            .iter()
            .position(|w| w.starts_with("--container-image="))
        {
            launcher.insert(at + 1, format!("--container-mounts={mount}"));
            return Software { launcher, root };
        }
        Software {
            launcher,
            root: checkout.to_string(),
        }
    }

    /// A run's software: its launcher, and its `checkout` input if it names one (a path that
    /// a mount list can hold: no `,` or `:`).
    pub(crate) fn of_run(ctx: &RunContext, mb_root: &str) -> Result<Software, RunError> {
        let checkout = match ctx.inputs.get(CHECKOUT.name) {
            Some(path) => {
                let path = text(path)?;
                if path.contains([',', ':']) {
                    return Err(RunError::new(format!(
                        "the checkout `{path}` cannot be mounted: pyxis's mount list separates \
                         paths with `,` and `:`"
                    ))
                    .with_help("move it to a path without `,` or `:`"));
                }
                Some(path)
            }
            None => None,
        };
        Ok(Software::of(ctx.launcher, mb_root, checkout.as_deref()))
    }

    /// A dry run's software: the `checkout` input, if declared, by its placeholder.
    pub(crate) fn of_preview(stage: &StageDecl, launcher: &[String], mb_root: &str) -> Software {
        let declared = stage.inputs.contains(&CHECKOUT.name);
        Software::of(launcher, mb_root, declared.then_some("<input checkout>"))
    }
}

/// The input every op after `megatron_pretrain` reads: the Megatron checkpoint it starts from.
pub(crate) const CHECKPOINT: Port = Port {
    name: "model",
    required: true,
    what: "the `checkpoint` of a megatron_pretrain or megatron_sft stage",
};

static SFT: Spec = Spec {
    name: "megatron_sft",
    // 2: the checkpoint carries the chat template of the pack it was fine-tuned on.
    version: 2,
    summary: "fine-tune a Megatron checkpoint with Megatron-Bridge's run_recipe.py on a pack artifact",
    inputs: &[
        CHECKPOINT,
        Port {
            name: "data",
            required: true,
            what: "a pack artifact (packed Parquet)",
        },
        Port {
            name: "tokenizer",
            required: true,
            what: "the tokenizer.json the data was packed with",
        },
        CHECKOUT,
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(OUTPUTS),
    resumable: true,
    launched: true,
    gpu: false,
};

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Mode {
    Pretrain,
    Sft,
}

impl Mode {
    fn spec(self) -> &'static Spec {
        match self {
            Mode::Pretrain => &PRETRAIN,
            Mode::Sft => &SFT,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Mode::Pretrain => "pretrain",
            Mode::Sft => "sft",
        }
    }
}

impl Op for Megatron {
    type Params = Params;
    fn spec(&self) -> &'static Spec {
        self.0.spec()
    }
    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        check_params(p)?;
        match stage.world_size {
            Some(world) => check_parallel(p, world),
            None => Ok(()),
        }
    }
    /// Each GPU's memory and the step's work ([`estimate`]), when the recipe's model is known
    /// and the stage is launched on ranks.
    fn plan(&self, p: &Params, _: &Upstream, stage: &StageDecl) -> Plan {
        Plan {
            estimate: p.estimate(stage.world_size),
            ..Plan::default()
        }
    }
    /// SFT reads the pack artifact's rows as they are: `seq_length` is the
    /// `packed_sequence_size` Megatron-Bridge is told, so it must be the rows' `pack_size`.
    fn check_upstream(&self, p: &Params, upstream: &Upstream) -> Result<(), DeclError> {
        let packed = upstream.stages.get("data").and_then(|f| f.sequence);
        match (self.0, packed) {
            (Mode::Sft, Some(rows)) if rows as u64 != p.seq_length => Err(DeclError::new(
                &["params", "seq_length"],
                format!(
                    "seq_length {} is not the length of the `data` input's packed rows ({rows}, its pack stage's pack_size): Megatron-Bridge takes each packed row as one sequence of seq_length tokens",
                    p.seq_length
                ),
            )
            .with_help(format!(
                "set seq_length: {rows}, or pack_size to {} in the pack stage",
                p.seq_length
            ))),
            _ => Ok(()),
        }
    }
    fn image(&self, p: &Params) -> Option<String> {
        p.image.clone()
    }
    fn names_image(&self) -> bool {
        true
    }
    fn preview(&self, p: &Params, stage: &StageDecl, launcher: &[String]) -> Option<String> {
        Some(preview(self.0, p, stage, launcher))
    }
    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        run(self.0, p, ctx)
    }
}

fn check_params(p: &Params) -> Result<(), DeclError> {
    let at = |field: &str, message: String| DeclError::new(&["params", field], message);
    if p.recipe.is_empty()
        || !p
            .recipe
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(at(
            "recipe",
            format!(
                "`{}` is not a recipe name: a Megatron-Bridge recipe function, like `nemotron_3_nano_pretrain_config`",
                p.recipe
            ),
        ));
    }
    check_software(&p.image, &p.mb_root, &p.python, &p.env)?;
    for (field, value) in [
        ("seq_length", p.seq_length),
        ("steps", p.steps),
        ("global_batch", p.global_batch),
        ("micro_batch", p.micro_batch),
        ("save_interval", p.save_interval),
        ("keep_checkpoints", p.keep_checkpoints),
        ("log_interval", p.log_interval),
    ] {
        if value == 0 {
            return Err(at(field, format!("{field} must be at least 1")));
        }
    }
    if !p.global_batch.is_multiple_of(p.micro_batch) {
        return Err(at(
            "global_batch",
            format!(
                "global_batch {} is not a multiple of micro_batch {}",
                p.global_batch, p.micro_batch
            ),
        ));
    }
    let par = &p.parallel;
    for (name, value) in [
        ("tp", par.tp),
        ("pp", par.pp),
        ("ep", par.ep),
        ("etp", par.etp),
        ("cp", par.cp),
    ] {
        if value == Some(0) {
            return Err(DeclError::new(
                &["params", "parallel", name],
                format!("parallel.{name} must be at least 1"),
            ));
        }
    }
    overrides::check_user(&p.overrides)
}

/// The software a stage runs, as both ops declare it: an image (if any), Megatron-Bridge's
/// checkout inside it, the interpreter, and the variables `launch.sh` exports.
fn check_software(
    image: &Option<String>,
    mb_root: &str,
    python: &str,
    env: &BTreeMap<String, String>,
) -> Result<(), DeclError> {
    let at = |field: &str, message: String| DeclError::new(&["params", field], message);
    if image.as_deref().is_some_and(|i| i.trim().is_empty()) {
        return Err(at("image", "an empty image name".into()));
    }
    if !mb_root.starts_with('/') {
        return Err(at(
            "mb_root",
            format!(
                "`{mb_root}` must be an absolute path inside the image (Megatron-Bridge's scripts are run by their path)"
            ),
        ));
    }
    if python.split_whitespace().next().is_none() {
        return Err(at("python", "an empty interpreter".into()));
    }
    check_env_names(env)
}

/// Every key of `params.env` is a shell variable's name.
pub(crate) fn check_env_names(env: &BTreeMap<String, String>) -> Result<(), DeclError> {
    for key in env.keys() {
        let ok = key
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(DeclError::new(
                &["params", "env", key],
                format!("`{key}` is not an environment variable name"),
            ));
        }
    }
    Ok(())
}

/// The parallel layout against the stage's `world` ranks, as Megatron-Core's
/// `initialize_model_parallel` will require it, before anything is queued: the ranks are a
/// multiple of tp·pp·cp (the model-parallel group) and of etp·ep·pp (the expert group), and the
/// global batch is a multiple of micro_batch × the data-parallel size. Only what the stage
/// gives is checked: a factor left to the recipe counts as 1 in the divisibility checks (so
/// they never refuse a layout that could work: a recipe may set etp, which Megatron otherwise
/// takes from tp), and the batch check needs tp, pp and cp all given.
fn check_parallel(p: &Params, world: u64) -> Result<(), DeclError> {
    let par = &p.parallel;
    let given = |v: Option<u64>| v.unwrap_or(1);
    let model = check_groups(
        world,
        &[
            ("tp", given(par.tp)),
            ("pp", given(par.pp)),
            ("cp", given(par.cp)),
        ],
        &[
            ("etp", given(par.etp)),
            ("ep", given(par.ep)),
            ("pp", given(par.pp)),
        ],
    )?;
    if let (Some(_), Some(_), Some(_)) = (par.tp, par.pp, par.cp) {
        let data = world / model;
        if !p
            .global_batch
            .is_multiple_of(p.micro_batch.saturating_mul(data))
        {
            return Err(DeclError::new(
                &["params", "global_batch"],
                format!(
                    "global_batch {} is not a multiple of micro_batch {} × {data} data-parallel \
                     ranks ({world} ranks / tp·pp·cp {model})",
                    p.global_batch, p.micro_batch
                ),
            ));
        }
    }
    Ok(())
}

/// The ranks against Megatron-Core's two groups: `world` must be a multiple of the product of
/// the model-parallel sizes (`model`: tp·pp·cp) and of the expert-parallel sizes (`expert`:
/// etp·ep·pp). An error points at `tp` or at `ep`. Returns the model-parallel size.
fn check_groups(
    world: u64,
    model: &[(&str, u64)],
    expert: &[(&str, u64)],
) -> Result<u64, DeclError> {
    let mut sizes = [0u64; 2];
    for (i, group) in [model, expert].into_iter().enumerate() {
        let field = ["tp", "ep"][i];
        let at = |message: String| DeclError::new(&["params", "parallel", field], message);
        let names: Vec<&str> = group.iter().map(|(name, _)| *name).collect();
        let product = group
            .iter()
            .try_fold(1u64, |acc, (_, f)| acc.checked_mul(*f))
            .ok_or_else(|| at(format!("the parallel sizes {} overflow", names.join("·"))))?;
        if !world.is_multiple_of(product) {
            let whose = match i {
                0 => " (resources: nodes × ranks per node)",
                _ => "",
            };
            return Err(at(format!(
                "the stage runs {world} ranks{whose}, not a multiple of {} = {product}",
                names.join("·")
            )));
        }
        sizes[i] = product;
    }
    Ok(sizes[0])
}

/// Launch Megatron-Bridge for this attempt, follow it, and publish its final iteration.
fn run(mode: Mode, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
    check_image(p.image.as_deref(), "Megatron-Bridge", ctx)?;
    let out = std::path::absolute(ctx.out_dir)?;
    let run_dir = out.join("run");
    let ckpt = out.join("checkpoint");
    std::fs::create_dir_all(&run_dir)?;

    // Every path is rendered from these two strings, checked once for Hydra.
    let out_text = text(&out)?;
    let data_words = match mode {
        Mode::Pretrain => pretrain_data(&input(ctx, "data")?, &out_text, p)?,
        Mode::Sft => {
            let mut words = sft_data(&input(ctx, "data")?, &run_dir, &out_text, p)?;
            let model = input(ctx, "model")?;
            let iteration = checkpoint::final_iteration(&model).map_err(|why| {
                RunError::new(format!("input `model`: {why}")).with_help(
                    "wire `model` to the `checkpoint` output of a megatron_pretrain or megatron_sft stage",
                )
            })?;
            words.push(Override::new(
                "checkpoint.pretrained_checkpoint",
                format!("'{}'", text(&iteration)?),
            ));
            words
        }
    };
    stage_tokenizer(ctx, &run_dir, p)?;
    let resumed = checkpoint::prepare(&ckpt)?;
    // Megatron's exit_interval is periodic (`iteration % exit_interval == 0`): a run resumed
    // past it stops at its next multiple, or at the end.
    let stop = ctx.stop_after_step.filter(|n| *n < p.steps);
    let words = assemble(p, &out_text, data_words, resumed, stop);

    let software = Software::of_run(ctx, &p.mb_root)?;
    let script = run_dir.join("launch.sh");
    std::fs::write(
        &script,
        launch_script(mode, p, ctx.stage.name, &software, &words),
    )?;
    // An attempt that saved its last step and was then stopped before it was published (a kill
    // during the publish, a crash in teardown) has nothing left to train: launching again
    // would only have Megatron-Bridge save that iteration once more, over itself.
    let (status, loss) = match resumed {
        Some(n) if n == p.steps => {
            writeln!(
                ctx.log,
                "nemo-dag: iteration {n} of {n} is saved already; publishing it without a launch"
            )?;
            (None, None)
        }
        _ => {
            match resumed {
                Some(n) => writeln!(
                    ctx.log,
                    "nemo-dag: resuming Megatron-Bridge from iteration {n} of {}",
                    p.steps
                )?,
                None => writeln!(
                    ctx.log,
                    "nemo-dag: starting Megatron-Bridge ({} steps)",
                    p.steps
                )?,
            }
            writeln!(ctx.log, "nemo-dag: {}", script.display())?;
            let (status, loss) = launch(ctx, &script, &out, p.steps)?;
            (Some(status), loss)
        }
    };

    let newest = checkpoint::newest_complete(&ckpt)?;
    let resume = match newest {
        Some(n) => format!("the next run resumes from iteration {n}"),
        None => "no complete checkpoint was written: the next run starts over".into(),
    };
    if let Some(status) = status.filter(|s| !s.success()) {
        let how = describe_exit(status);
        return Err(RunError::new(format!("Megatron-Bridge {how}; {resume}"))
            .with_help("the log above says why (with a launcher, which rank failed first)"));
    }
    if newest != Some(p.steps) {
        let at = newest.map_or("before its first checkpoint".to_string(), |n| {
            format!("at iteration {n} of {}", p.steps)
        });
        return Err(RunError::new(format!(
            "Megatron-Bridge exited 0 but stopped {at} (a SIGTERM save, or train.exit_interval); {resume}"
        )));
    }
    checkpoint::keep_only(&ckpt, p.steps)?;
    // The chat template the model was fine-tuned with goes on with its checkpoint, as a
    // native model carries it, for an export to write into tokenizer_config.json.
    if mode == Mode::Sft {
        let from = [input(ctx, "data")?, input(ctx, "model")?];
        if let Some(template) = carried_template(&[&from[0], &from[1]])? {
            std::fs::write(ckpt.join(CHAT_TEMPLATE_FILE), template)?;
        }
    }
    // Megatron's index cache: rebuilt from the data by any reader, not part of the result.
    let cache = run_dir.join("data_cache");
    if cache.exists() {
        std::fs::remove_dir_all(cache)?;
    }
    let mut metrics = Metrics::new();
    metrics.insert("recipe".into(), json!(p.recipe));
    metrics.insert("image".into(), json!(p.image));
    metrics.insert("final_iteration".into(), json!(p.steps));
    metrics.insert("resumed_from_iteration".into(), json!(resumed));
    metrics.insert(
        "lm_loss".into(),
        json!(loss.and_then(|l| l.parse::<f64>().ok())),
    );
    Ok(metrics)
}

/// Run `launch.sh`, its output into the stage's log and Megatron's iteration lines into
/// progress; its exit status and the last `lm loss` it printed.
fn launch(
    ctx: &mut RunContext,
    script: &Path,
    out: &Path,
    steps: u64,
) -> Result<(std::process::ExitStatus, Option<String>), RunError> {
    let mut command = std::process::Command::new("bash");
    command
        .arg(script)
        .current_dir(out.join("run"))
        .env("NEMO_DAG_STAGE", ctx.stage.name)
        .env("NEMO_DAG_OUT", out);
    let mut loss = None;
    let progress = &mut *ctx.progress;
    let status = run_logged(&mut command, ctx.log, &mut |line| {
        if let Some((done, line_loss)) = iteration_line(line) {
            let message = line_loss.as_ref().map(|l| format!("lm loss {l}"));
            if line_loss.is_some() {
                loss = line_loss;
            }
            progress(Progress {
                done,
                total: steps,
                message: message.unwrap_or_default(),
            });
        }
    })?;
    Ok((status, loss))
}

/// `params.image` names the software, so the ranks must start in it: under Slurm the engine's
/// `srun` launch carries `--container-image` for it. Anywhere else it cannot be honoured.
pub(crate) fn check_image(
    image: Option<&str>,
    program: &str,
    ctx: &RunContext,
) -> Result<(), RunError> {
    let Some(image) = image else {
        return Ok(());
    };
    let flag = format!("--container-image={image}");
    if ctx.launcher.contains(&flag) {
        return Ok(());
    }
    Err(RunError::new(format!(
        "stage `{}` names image `{image}`, but this run would start {program} outside it",
        ctx.stage.name
    ))
    .with_help(format!(
        "run it on a Slurm profile with `resources.launch: srun` (pyxis starts every rank in the image); on a machine that is already inside the image, override `stages.{}.params.image=null`",
        ctx.stage.name
    )))
}

/// Every word of a launch, in order: the schedule, the data (`data_words`), the tokenizer, the
/// checkpoints, the logs, then the stage's own overrides. `out` is the attempt's directory as
/// it is rendered (a real path, or `<out>` in a preview).
fn assemble(
    p: &Params,
    out: &str,
    data_words: Vec<Override>,
    resumed: Option<u64>,
    stop: Option<u64>,
) -> Vec<Override> {
    let mut words = schedule(p);
    words.extend(data_words);
    words.extend([
        Override::new("tokenizer.tokenizer_type", "HuggingFaceTokenizer"),
        Override::new("tokenizer.tokenizer_model", place(out, "run/tokenizer")),
        Override::new("tokenizer.use_tokenizer_vocab_size", "true"),
    ]);
    words.extend(checkpoints(out, resumed, p));
    if let Some(n) = stop {
        words.push(Override::new("train.exit_interval", n.to_string()));
    }
    words.extend([
        Override::new("logger.log_interval", p.log_interval.to_string()),
        Override::new("logger.tensorboard_dir", place(out, "run/tb")),
        Override::new("logger.save_config_filepath", place(out, "run/config.yaml")),
    ]);
    // Checked when the manifest loaded ([`overrides::check_user`]).
    words.extend(
        p.overrides
            .iter()
            .filter_map(|(key, value)| Some(Override::new(key, overrides::scalar(value).ok()?))),
    );
    words
}

/// `launch.sh` as a run of the stage will write it, its inputs and attempt directory named
/// (`<input data>`, `<out>`) since they do not exist yet: for `run --dry-run`.
fn preview(mode: Mode, p: &Params, stage: &StageDecl, launcher: &[String]) -> String {
    let out = "<out>";
    let data_words = match mode {
        Mode::Pretrain => {
            let mut words = vec![
                Override::new(
                    "dataset.blend_per_split",
                    "<the train, valid and test blends of <input data>/blend.json>",
                ),
                Override::new("dataset.split", "null"),
                Override::new("dataset.path_to_cache", place(out, "run/data_cache")),
            ];
            words.extend(validation(p, true));
            words
        }
        Mode::Sft => {
            let mut words = packed(p, "<input data>", "<input data>/splits/valid", out, true);
            words.push(Override::new(
                "checkpoint.pretrained_checkpoint",
                "'<input model>/iter_<final>'",
            ));
            words
        }
    };
    let words = assemble(p, out, data_words, None, None);
    let software = Software::of_preview(stage, launcher, &p.mb_root);
    launch_script(mode, p, stage.name, &software, &words)
}

/// A path under a rendered directory, as a quoted Hydra string.
fn place(dir: &str, rel: &str) -> String {
    format!("'{dir}/{rel}'")
}

/// The run's length, batch, optimizer, seed, parallelism and sequence length.
fn schedule(p: &Params) -> Vec<Override> {
    let mut words = vec![
        Override::new("train.train_iters", p.steps.to_string()),
        Override::new("train.global_batch_size", p.global_batch.to_string()),
        Override::new("train.micro_batch_size", p.micro_batch.to_string()),
    ];
    let par = &p.parallel;
    for (key, value) in [
        ("model.tensor_model_parallel_size", par.tp),
        ("model.pipeline_model_parallel_size", par.pp),
        ("model.expert_model_parallel_size", par.ep),
        ("model.expert_tensor_parallel_size", par.etp),
        ("model.context_parallel_size", par.cp),
    ] {
        if let Some(v) = value {
            words.push(Override::new(key, v.to_string()));
        }
    }
    if let Some(sp) = par.sp {
        words.push(Override::new("model.sequence_parallel", sp.to_string()));
    }
    for (key, value) in [
        ("optimizer.lr", p.lr),
        ("optimizer.min_lr", p.min_lr),
        ("optimizer.weight_decay", p.weight_decay),
        ("optimizer.adam_beta1", p.beta1),
        ("optimizer.adam_beta2", p.beta2),
        ("optimizer.clip_grad", p.clip_grad),
    ] {
        if let Some(v) = value {
            words.push(Override::new(key, float(v)));
        }
    }
    if let Some(w) = p.warmup {
        words.push(Override::new("scheduler.lr_warmup_iters", w.to_string()));
    }
    words.push(Override::new("rng.seed", p.seed.to_string()));
    words.push(Override::new(
        "dataset.seq_length",
        p.seq_length.to_string(),
    ));
    words
}

/// The validation cadence: the params', or none when the data has no validation split.
fn validation(p: &Params, has_valid: bool) -> Vec<Override> {
    if !has_valid {
        return vec![Override::new("validation.eval_iters", "0")];
    }
    let mut words = Vec::new();
    if let Some(v) = p.eval_interval {
        words.push(Override::new("validation.eval_interval", v.to_string()));
    }
    if let Some(v) = p.eval_iters {
        words.push(Override::new("validation.eval_iters", v.to_string()));
    }
    words
}

/// A `tokenize` artifact as Megatron per-split blends. Megatron-Core refuses a `split` beside
/// `blend_per_split` (`BlendedMegatronDatasetConfig.__post_init__`), so it is `null`.
fn pretrain_data(data: &Path, out: &str, p: &Params) -> Result<Vec<Override>, RunError> {
    let mut splits = Vec::new();
    let mut has_valid = false;
    for split in ["train", "valid", "test"] {
        let blend = blend_split(data, split, "tokenize", split == "train")?;
        if blend.is_empty() {
            splits.push("null".to_string());
            continue;
        }
        has_valid |= split == "valid";
        let mut prefixes = Vec::new();
        let mut weights = Vec::new();
        for (w, prefix) in blend {
            for ext in ["bin", "idx"] {
                let file = prefix.with_extension(ext);
                if !file.is_file() {
                    return Err(RunError::new(format!(
                        "input `data`: {} is missing (named by blend.json's `{split}` split)",
                        file.display()
                    )));
                }
            }
            prefixes.push(format!("'{}'", text(&prefix)?));
            weights.push(float(w));
        }
        splits.push(list([list(prefixes), list(weights)]));
    }
    let mut words = vec![
        Override::new("dataset.blend_per_split", list(splits)),
        Override::new("dataset.split", "null"),
        Override::new("dataset.path_to_cache", place(out, "run/data_cache")),
    ];
    words.extend(validation(p, has_valid));
    Ok(words)
}

/// A `pack` artifact's packed Parquet, read as it is: `splits/train` and `splits/valid` are
/// directories of shards (Megatron-Bridge reads a directory's `*.parquet` in sorted order).
/// The packing metadata file must exist; `[]` is its value without CUDA-graph padding.
fn sft_data(data: &Path, run_dir: &Path, out: &str, p: &Params) -> Result<Vec<Override>, RunError> {
    let shards = |split: &str| -> Result<usize, RunError> {
        let dir = data.join("splits").join(split);
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(RunError::new(format!("{}: {e}", dir.display()))),
        };
        Ok(entries
            .filter_map(Result::ok)
            .filter(|e| e.path().extension().is_some_and(|x| x == "parquet"))
            .count())
    };
    if shards("train")? == 0 {
        return Err(RunError::new(format!(
            "input `data`: {} holds no .parquet shard (the input must be a pack artifact)",
            data.join("splits/train").display()
        )));
    }
    let has_valid = shards("valid")? > 0;
    std::fs::write(run_dir.join("pack_metadata.json"), "[]")?;
    let data = text(data)?;
    // Named even when there is no validation split: left unset, Megatron-Bridge derives a
    // path inside the dataset root, the read-only pack artifact.
    let valid = match has_valid {
        true => format!("{data}/splits/valid"),
        false => {
            std::fs::create_dir_all(run_dir.join("no_valid"))?;
            format!("{out}/run/no_valid")
        }
    };
    Ok(packed(p, &data, &valid, out, has_valid))
}

/// The dataset words of packed SFT data under `data` (rendered directories, unquoted).
fn packed(p: &Params, data: &str, valid: &str, out: &str, has_valid: bool) -> Vec<Override> {
    let specs = "dataset.offline_packing_specs";
    let mut words = vec![
        Override::new("dataset.hf_dataset", "null"),
        Override::new("dataset.hf_validation_proportion", "null"),
        Override::new("dataset.dataset_root", format!("'{data}'")),
        Override::new("dataset.enable_offline_packing", "true"),
        Override::new(
            &format!("{specs}.packed_sequence_size"),
            p.seq_length.to_string(),
        ),
        Override::new(
            &format!("{specs}.packed_train_data_path"),
            place(data, "splits/train"),
        ),
        Override::new(
            &format!("{specs}.packed_val_data_path"),
            format!("'{valid}'"),
        ),
        Override::new(
            &format!("{specs}.packed_metadata_path"),
            place(out, "run/pack_metadata.json"),
        ),
        Override::new("dataset.do_validation", has_valid.to_string()),
        // Otherwise Megatron-Bridge builds an unpacked test set from `<dataset_root>/test.jsonl`.
        Override::new("dataset.do_test", "false"),
    ];
    words.extend(validation(p, has_valid));
    words
}

/// The `tokenizer` input as a Hugging Face tokenizer directory in `run/tokenizer`, its
/// `eos_token` Megatron's end of document (the vocabulary is taken from it).
fn stage_tokenizer(ctx: &RunContext, run_dir: &Path, p: &Params) -> Result<(), RunError> {
    let (tokenizer, path) = crate::load_tokenizer(ctx.inputs)?;
    if tokenizer.token_to_id(&p.eos_token).is_none() {
        return Err(RunError::new(format!(
            "input `tokenizer`: {} has no token `{}` to end documents with",
            path.display(),
            p.eos_token
        ))
        .with_help("set params.eos_token to the tokenizer's end-of-document token"));
    }
    let dir = run_dir.join("tokenizer");
    std::fs::create_dir_all(&dir)?;
    // Replace, never overwrite: a resumed attempt holds the copy already, read-only like the
    // published file it was copied from.
    let staged = dir.join("tokenizer.json");
    match std::fs::remove_file(&staged) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
        _ => {}
    }
    std::fs::copy(path, &staged)?;
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": p.eos_token,
        "pad_token": p.eos_token,
        "bos_token": null,
        "model_max_length": p.seq_length,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    Ok(())
}

/// Save and load in the attempt's own directory, synchronously, and resume exactly the
/// iteration [`checkpoint::prepare`] kept.
fn checkpoints(out: &str, resumed: Option<u64>, p: &Params) -> Vec<Override> {
    let dir = place(out, "checkpoint");
    let mut words = vec![
        Override::new("checkpoint.save", dir.clone()),
        Override::new("checkpoint.load", dir),
        Override::new("checkpoint.save_interval", p.save_interval.to_string()),
        Override::new("checkpoint.ckpt_format", "torch_dist"),
        Override::new("checkpoint.async_save", "false"),
        Override::new("checkpoint.most_recent_k", p.keep_checkpoints.to_string()),
    ];
    match resumed {
        Some(n) => {
            words.push(Override::new(
                "checkpoint.exit_on_missing_checkpoint",
                "true",
            ));
            words.push(Override::new("checkpoint.ckpt_step", n.to_string()));
        }
        None => words.push(Override::new(
            "checkpoint.exit_on_missing_checkpoint",
            "false",
        )),
    }
    // SIGTERM (Slurm's warning before the end of the time limit) saves, then exits 0.
    words.push(Override::new("train.exit_signal_handler", "true"));
    words
}

/// A path as text a Hydra quoted string can hold (see [`overrides::quoted`]).
pub(crate) fn text(path: &Path) -> Result<String, RunError> {
    let text = path
        .to_str()
        .ok_or_else(|| RunError::new(format!("{}: not UTF-8", path.display())))?;
    quoted(text).map_err(|why| {
        RunError::new(format!("path {why}")).with_help(
            "move the store (or the input) to a path without quotes, backslashes or control characters",
        )
    })?;
    Ok(text.to_string())
}

/// `launch.sh`: the script a launch runs, kept in the artifact's `run/` (each launch of a
/// resumed attempt writes it again).
fn launch_script(
    mode: Mode,
    p: &Params,
    stage: &str,
    software: &Software,
    words: &[Override],
) -> String {
    let mut s = script_head(
        &format!("{} · stage {stage} · recipe {}", mode.spec().name, p.recipe),
        &p.env,
        software,
        &p.python,
        "scripts/training/run_recipe.py",
    );
    s.push_str(&format!(
        "  --recipe {} --mode {}",
        readable_shell_word(&p.recipe),
        mode.name()
    ));
    for word in words {
        s.push_str(&format!(" \\\n  {}", readable_shell_word(&word.word())));
    }
    s.push('\n');
    s
}

/// The head of a `launch.sh`: a comment naming what it runs, the environment (Megatron-Bridge's
/// own Slurm examples' NCCL settings, no Hub downloads mid-job, then the stage's `env`), and
/// `exec`, the launcher, the interpreter and `script` under the software's root, its arguments
/// to follow.
fn script_head(
    what: &str,
    env: &BTreeMap<String, String>,
    software: &Software,
    python: &str,
    script: &str,
) -> String {
    let mut s = format!("#!/bin/bash\n# nemo-dag {what}\nset -euo pipefail\n");
    // As Megatron-Bridge's own Slurm examples set them (examples/models/nemotron/…/slurm_*.sh);
    // a recipe that names a Hub model must find it in HF_HOME, never download mid-job.
    // No bytecode written beside the sources: a `checkout` input runs from where it is when
    // no container starts, and its key is its files.
    for line in [
        "export TORCH_NCCL_AVOID_RECORD_STREAMS=1",
        "export NCCL_NVLS_ENABLE=0",
        "export HF_HUB_OFFLINE=1",
        "export PYTHONDONTWRITEBYTECODE=1",
    ] {
        s.push_str(line);
        s.push('\n');
    }
    for (key, value) in env {
        s.push_str(&format!("export {key}={}\n", readable_shell_word(value)));
    }
    let launcher = software.launcher.iter().map(|w| readable_shell_word(w));
    let mut head: Vec<String> = launcher.collect();
    head.extend(python.split_whitespace().map(readable_shell_word));
    head.push(readable_shell_word(&format!(
        "{}/{script}",
        software.root.trim_end_matches('/')
    )));
    s.push_str(&format!("exec {} \\\n", head.join(" ")));
    s
}

/// A Megatron training log line's iteration and loss:
/// ` [2026-…] iteration       10/    1000 | consumed samples: … | lm loss: 1.234E+01 | …`.
fn iteration_line(line: &str) -> Option<(u64, Option<String>)> {
    let rest = &line[line.find("iteration")? + "iteration".len()..];
    let (done, _) = rest.split_once('/')?;
    let done = done.trim().parse().ok()?;
    let loss = line.find("lm loss:").map(|at| {
        line[at + "lm loss:".len()..]
            .trim_start()
            .split(|c: char| c.is_whitespace() || c == '|')
            .next()
            .unwrap_or_default()
            .to_string()
    });
    Some((done, loss.filter(|l| !l.is_empty())))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `checkout` is mounted over `mb_root` where the launcher starts a container (added to
    /// the profile's mounts, or as the first), and run from where it is where none is started.
    #[test]
    fn a_checkout_is_mounted_into_the_container_or_run_in_place() {
        let words = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let root = "/opt/Megatron-Bridge/";
        let mounted = Software::of(
            &words(&[
                "srun",
                "--container-image=nemo.sqsh",
                "--container-mounts=/a:/a",
                "--mpi=pmix",
            ]),
            root,
            Some("/lustre/mb"),
        );
        assert_eq!(
            mounted.launcher,
            words(&[
                "srun",
                "--container-image=nemo.sqsh",
                "--container-mounts=/a:/a,/lustre/mb:/opt/Megatron-Bridge:ro",
                "--mpi=pmix"
            ])
        );
        assert_eq!(mounted.root, root);
        let first = Software::of(
            &words(&["srun", "--container-image=nemo.sqsh"]),
            root,
            Some("/m"),
        );
        assert_eq!(
            first.launcher,
            words(&[
                "srun",
                "--container-image=nemo.sqsh",
                "--container-mounts=/m:/opt/Megatron-Bridge:ro"
            ])
        );
        let in_place = Software::of(&words(&["srun", "--ntasks=2"]), root, Some("/m"));
        assert_eq!(
            (in_place.launcher, in_place.root.as_str()),
            (words(&["srun", "--ntasks=2"]), "/m")
        );
        let image = Software::of(&words(&["srun"]), root, None);
        assert_eq!(
            (image.launcher, image.root.as_str()),
            (words(&["srun"]), root)
        );
    }

    #[test]
    fn megatron_log_lines_give_progress_and_loss() {
        let line = " [2026-11-24 10:00:00] iteration       10/    1000 | consumed samples:        10240 | lm loss: 1.234560E+01 | grad norm: 3.1 |";
        assert_eq!(
            iteration_line(line),
            Some((10, Some("1.234560E+01".to_string())))
        );
        assert_eq!(
            iteration_line("iteration 3/10 | lm loss: 1.0"),
            Some((3, Some("1.0".into())))
        );
        assert_eq!(iteration_line("iteration 3/10"), Some((3, None)));
        assert_eq!(
            iteration_line("saving checkpoint at iteration 200 to …"),
            None
        );
        assert_eq!(iteration_line("no numbers"), None);
    }

    fn params(parallel: serde_json::Value, global_batch: u64) -> Params {
        serde_json::from_value(serde_json::json!({
            "recipe": "r", "seq_length": 8, "steps": 1, "global_batch": global_batch,
            "micro_batch": 1, "save_interval": 1, "parallel": parallel
        }))
        .unwrap()
    }

    /// A stage is estimated only when the table describes what it runs: a known recipe, on
    /// ranks, with no override of the model, the optimizer, DDP or mixed precision (which
    /// change the bytes a parameter costs); the stage's own parallelism wins over the
    /// recipe's.
    #[test]
    fn a_stage_is_estimated_only_as_the_recipe_table_describes_it() {
        let stage = |extra: serde_json::Value| -> Params {
            let mut p = serde_json::json!({
                "recipe": "nemotron_3_nano_sft_config", "seq_length": 2048, "steps": 1,
                "global_batch": 64, "micro_batch": 1, "save_interval": 1
            });
            for (k, v) in extra.as_object().unwrap() {
                p[k] = v.clone();
            }
            serde_json::from_value(p).unwrap()
        };
        let none = serde_json::json!({});
        let on_8 = stage(none.clone()).estimate(Some(8)).unwrap();
        assert!(on_8.basis.contains("TP 1 PP 1 EP 8"), "{on_8}");
        assert!(stage(none.clone()).estimate(None).is_none(), "not launched");
        let tp4 = stage(serde_json::json!({"parallel": {"tp": 4, "sp": true}}));
        let tp4 = tp4.estimate(Some(16)).unwrap();
        assert!(tp4.basis.contains("TP 4 PP 1 EP 8"), "{tp4}");
        assert!(tp4.least_bytes < on_8.least_bytes);
        for key in [
            "model.num_layers",
            "optimizer.use_precision_aware_optimizer",
            "ddp.use_distributed_optimizer",
            "mixed_precision.grad_reduce_in_fp32",
        ] {
            let p = stage(serde_json::json!({"overrides": {key: true}}));
            assert!(p.estimate(Some(8)).is_none(), "{key}");
        }
        let p = stage(serde_json::json!({"overrides": {"train.manual_gc": true}}));
        assert!(p.estimate(Some(8)).is_some());
        let p = stage(serde_json::json!({"recipe": "llama3_8b_pretrain_config"}));
        assert!(p.estimate(Some(8)).is_none());
    }

    /// Layouts Megatron-Core would refuse after the queue wait are refused at plan time, at the
    /// field; layouts that may work with the recipe's own values are let through.
    #[test]
    fn a_parallel_layout_that_does_not_divide_the_ranks_is_refused() {
        use serde_json::json;
        let ok = |par, gb, world| check_parallel(&params(par, gb), world);
        let field = |par, gb, world| ok(par, gb, world).unwrap_err().path.join(".");
        // 2 nodes × 8 GPUs.
        assert!(ok(json!({"tp": 4, "pp": 2, "cp": 1, "ep": 2}), 64, 16).is_ok());
        assert!(ok(json!({"tp": 4, "pp": 2, "etp": 1, "ep": 8}), 64, 16).is_ok());
        assert_eq!(field(json!({"tp": 3}), 64, 16), "params.parallel.tp");
        assert_eq!(
            field(json!({"tp": 4, "pp": 8}), 64, 16),
            "params.parallel.tp"
        );
        // The expert group: etp·ep·pp; an etp left to the recipe may be 1.
        let expert = |par| field(par, 64, 16);
        assert_eq!(expert(json!({"etp": 2, "ep": 16})), "params.parallel.ep");
        assert_eq!(expert(json!({"pp": 2, "ep": 16})), "params.parallel.ep");
        assert!(ok(json!({"tp": 2, "ep": 16}), 64, 16).is_ok());
        // The batch: 16 / (2·2·1) = 4 data-parallel ranks; 6 is no multiple of 1 × 4.
        let full = json!({"tp": 2, "pp": 2, "cp": 1});
        assert_eq!(field(full.clone(), 6, 16), "params.global_batch");
        assert!(ok(full, 8, 16).is_ok());
        // With pp left to the recipe the data-parallel size is unknown: no batch check.
        assert!(ok(json!({"tp": 2, "cp": 1}), 6, 16).is_ok());
    }
}
