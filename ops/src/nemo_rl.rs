//! `nemo_rl_grpo`: GRPO at real scale, by NVIDIA NeMo-RL (<https://github.com/NVIDIA-NeMo/RL>,
//! v0.7) with NeMo-Gym environments, on a Hugging Face model and an `rl_data` artifact.
//!
//! ```yaml
//! grpo:
//!   op: nemo_rl_grpo
//!   inputs: {model: "export:hf", data: "rl_data:data"}
//!   resources: {launch: srun, nodes: 4, gpus: 8, ntasks_per_node: 1}
//!   params:
//!     image: nvcr.io/nvidia/nemo-rl:v0.7.0
//!     config: examples/nemo_gym/grpo_nanov3.yaml
//!     steps: 100
//!     prompts_per_step: 128
//!     generations_per_prompt: 16
//!     save_period: 10
//! ```
//!
//! The stage runs NeMo-RL's `examples/nemo_gym/run_grpo_nemo_gym.py --config C` with `key=value`
//! overrides, in `image`. NeMo-RL runs on a Ray cluster: under a launcher the stage starts one
//! Ray node per Slurm node (the first node's rank is Ray's head and runs the driver; the
//! others join it and leave when it is gone), as NeMo-RL's own `ray.sub` does; without one
//! NeMo-RL starts Ray itself on the one machine. What the op owns, and the reason:
//!
//! - **Data.** `data.train.data_path` and `data.validation.data_path` are the `rl_data`
//!   artifact's `train.jsonl` and `val.jsonl`: NeMo-Gym rows whose `agent_ref` names the agent
//!   server each row goes to.
//! - **Model.** `policy.model_name` and `policy.tokenizer.name` are the `model` input, a Hugging
//!   Face directory (`megatron_export`'s or `export`'s `hf`): vLLM generates from it, and the
//!   Megatron policy converts it once into the attempt's `run/megatron_cache`
//!   (`NRL_MEGATRON_CHECKPOINT_DIR`), never into a cache shared by path under `HF_HOME`.
//! - **Checkpoints.** `checkpointing.checkpoint_dir` is the attempt's own `checkpoint/`. NeMo-RL
//!   always resumes from the newest `step_N` there (there is no switch), so a resume is always
//!   of this key's run. A save writes `tmp_step_N` and renames it: before every launch the
//!   directory is cut back to its complete `step_N` directories ([`prepare`]).
//! - **Publish.** Only when NeMo-RL exits 0 *and* `step_<steps>` is saved: its time-budget stop
//!   (`checkpointing.checkpoint_must_save_by`) saves and exits 0 too. The artifact holds that
//!   step alone (`checkpoint/step_<steps>`: the policy's weights and optimizer, the resolved
//!   `config.yaml`, `training_info.json`), and `run/` (`launch.sh`, `rank.sh`, NeMo-RL's logs).
//!
//! **The plan.** For a config nemo-dag knows ([`KNOWN`]: NeMo-RL's Nemotron 3 Nano and Super
//! GRPO configs), `validate` and `--dry-run` print each policy GPU's memory and a step's
//! training FLOPs, from the config's placement and parallelism and Megatron-LM's rules
//! ([`crate::megatron::estimate`], full recompute as the configs' `activation_checkpointing`),
//! every rollout at `sequence_length`; and vLLM's bf16 weights per generation GPU beside the
//! share of its memory the config gives vLLM. A stage whose nodes leave the policy no machine
//! after vLLM's and the judges' is refused before it is submitted.

use crate::megatron::estimate::{self, Defaults, FULL_RECOMPUTE, Precision, Run};
use crate::megatron::overrides::{Override, check_user_of, scalar};
use crate::megatron::{Software, check_env_names, check_image, text};
use crate::saves::{self, Save};
use crate::training::input;
use nemo_dag_op::plan::{Estimate, Plan};
use nemo_dag_op::process::{describe_exit, readable_shell_word, run_logged};
use nemo_dag_op::{
    DeclError, Metrics, Op, Outputs, Port, Progress, RunContext, RunError, Spec, StageDecl,
    Upstream,
};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io;
use std::path::Path;

pub struct NemoRlGrpo;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// The container image every Ray node runs in (pyxis `--container-image`).
    #[serde(default)]
    image: Option<String>,
    /// NeMo-RL's checkout inside the image; the driver runs from it.
    #[serde(default = "default_root")]
    rl_root: String,
    /// The GRPO config, relative to `rl_root` or absolute.
    #[serde(default = "default_config")]
    config: String,
    /// The driver, relative to `rl_root`.
    #[serde(default = "default_script")]
    script: String,
    /// The interpreter, as words (the images run NeMo-RL through uv).
    #[serde(default = "default_python")]
    python: String,
    /// Ray's command line, as words.
    #[serde(default = "default_ray")]
    ray: String,
    /// GPUs of each node NeMo-RL uses (`cluster.gpus_per_node`).
    #[serde(default = "default_gpus")]
    gpus_per_node: u64,
    steps: u64,
    prompts_per_step: u64,
    generations_per_prompt: u64,
    save_period: u64,
    /// The longest prompt plus generation, in tokens (`policy.max_total_sequence_length`, vLLM's
    /// `max_model_len`): at most the model's context (`max_position_embeddings`).
    sequence_length: u64,
    #[serde(default = "default_seed")]
    seed: u64,
    /// Exported in the rank script before anything starts.
    #[serde(default)]
    env: BTreeMap<String, String>,
    /// Any other config key: `{"loss_fn.ratio_clip_max": 0.28}`, passed last.
    #[serde(default)]
    overrides: BTreeMap<String, Value>,
}

fn default_root() -> String {
    "/opt/nemo-rl".into()
}
fn default_config() -> String {
    "examples/nemo_gym/grpo_nanov3.yaml".into()
}
fn default_script() -> String {
    "examples/nemo_gym/run_grpo_nemo_gym.py".into()
}
fn default_python() -> String {
    "uv run --no-sync python".into()
}
fn default_ray() -> String {
    "uv run --no-sync ray".into()
}
fn default_gpus() -> u64 {
    8
}
fn default_seed() -> u64 {
    42
}

/// A NeMo-RL GRPO config nemo-dag can plan: its model, and how it places and shards it.
struct Known {
    /// The config's path under `rl_root`.
    config: &'static str,
    /// The Megatron-Bridge recipe whose model (`megatron::estimate::recipe`) the config trains.
    model: &'static str,
    /// `policy.megatron_cfg`'s tensor, pipeline, expert and context parallel sizes, and
    /// sequence parallelism.
    parallel: (u64, u64, u64, u64, bool),
    /// Nodes vLLM has to itself (`policy.generation.colocated.resources.num_nodes`; 0: it is
    /// colocated with the policy and sleeps while the policy trains), and NeMo-Gym's judges
    /// (`env.nemo_gym.num_gpu_nodes`).
    generation_nodes: u64,
    judge_nodes: u64,
    /// GPUs of each of vLLM's own nodes (`colocated.resources.gpus_per_node`), which NeMo-RL
    /// requires `cluster.gpus_per_node` to equal; none when colocated.
    generation_gpus_per_node: Option<u64>,
    /// `policy.train_global_batch_size` when the config's `loss_fn.force_on_policy_ratio`
    /// requires a step's rollouts to be exactly one optimizer step.
    on_policy_batch: Option<u64>,
    /// vLLM's tensor parallelism and the share of each GPU's memory it takes.
    vllm_tp: u64,
    vllm_memory: f64,
}

/// The configs of the recipes' default variants: NeMo-RL v0.7's `grpo_nanov3.yaml` and the
/// `super-v3` branch's `stage1_rlvr.yaml` (their keys are in tests/fixtures).
const KNOWN: [Known; 2] = [
    Known {
        config: "examples/nemo_gym/grpo_nanov3.yaml",
        model: "nemotron_3_nano_sft_config",
        parallel: (2, 2, 8, 4, true),
        generation_nodes: 0,
        judge_nodes: 0,
        generation_gpus_per_node: None,
        on_policy_batch: None,
        vllm_tp: 4,
        vllm_memory: 0.5,
    },
    Known {
        config: "examples/configs/super/stage1_rlvr.yaml",
        model: "nemotron_3_super_sft_config",
        parallel: (4, 1, 8, 8, true),
        generation_nodes: 72,
        judge_nodes: 5,
        generation_gpus_per_node: Some(8),
        on_policy_batch: Some(4096),
        vllm_tp: 4,
        vllm_memory: 0.8,
    },
];

/// Overrides that change what [`KNOWN`] says of a config: its model, parallelism, placement,
/// precision, recompute or the tokens of a micro-batch.
const CHANGES_THE_PLAN: [&str; 7] = [
    "policy.megatron_cfg.",
    "policy.generation.",
    "policy.precision",
    "policy.train_micro_batch_size",
    "policy.train_global_batch_size",
    "policy.sequence_packing.",
    "env.nemo_gym.num_gpu_nodes",
];

impl Known {
    /// GPUs the policy trains on, out of `nodes` machines of `gpus_per_node`: what vLLM's own
    /// nodes and the judges' leave (NeMo-RL's `grpo.setup`); `Err` says why there are none,
    /// or why Megatron cannot shard the model over them.
    fn policy_gpus(&self, nodes: u64, gpus_per_node: u64) -> Result<u64, String> {
        let taken = self.generation_nodes + self.judge_nodes;
        let gpus = nodes.saturating_sub(taken) * gpus_per_node;
        if gpus == 0 {
            return Err(format!(
                "{nodes} nodes leave the policy none: {} gives vLLM {} nodes of its own and \
                 NeMo-Gym's judges {}",
                self.config, self.generation_nodes, self.judge_nodes
            ));
        }
        let (tp, pp, ep, cp, _) = self.parallel;
        let (dense, experts) = (tp * pp * cp, ep * pp);
        if !gpus.is_multiple_of(dense) || !gpus.is_multiple_of(experts) {
            return Err(format!(
                "{nodes} nodes leave the policy {gpus} GPUs, which Megatron cannot shard {}'s \
                 model over: its GPUs must be a multiple of TP × PP × CP = {dense} and of \
                 EP × PP = {experts}",
                self.config
            ));
        }
        Ok(gpus)
    }

    /// The fewest nodes of `gpus_per_node` that [`Known::policy_gpus`] accepts.
    fn fewest_nodes(&self, gpus_per_node: u64) -> u64 {
        let first = self.generation_nodes + self.judge_nodes + 1;
        (first..first + 1024)
            .find(|n| self.policy_gpus(*n, gpus_per_node).is_ok())
            .unwrap_or(first)
    }
}

impl Params {
    /// The config's entry in [`KNOWN`], unless an override changes what it says.
    fn known(&self) -> Option<&'static Known> {
        let changed = self
            .overrides
            .keys()
            .any(|k| CHANGES_THE_PLAN.iter().any(|c| k.starts_with(c)));
        let config = self.config.trim_start_matches("./");
        let root = self.rl_root.trim_end_matches('/');
        KNOWN
            .iter()
            .find(|k| k.config == config || config == format!("{root}/{}", k.config))
            .filter(|_| !changed)
    }

    /// What a known config asks of the stage's machines, rollouts and GPUs: `Err` with the
    /// field at fault and why.
    fn fits(&self, known: &Known, nodes: u64) -> Result<u64, (&'static [&'static str], String)> {
        if let Some(want) = known.generation_gpus_per_node
            && want != self.gpus_per_node
        {
            return Err((
                &["params", "gpus_per_node"],
                format!(
                    "{} runs vLLM on nodes of {want} GPUs, and NeMo-RL requires every node to have as many (cluster.gpus_per_node {})",
                    known.config, self.gpus_per_node
                ),
            ));
        }
        if let Some(batch) = known.on_policy_batch
            && self.prompts_per_step * self.generations_per_prompt != batch
        {
            return Err((
                &["params", "prompts_per_step"],
                format!(
                    "{} trains on-policy (loss_fn.force_on_policy_ratio): a step's {} × {} rollouts must be its train_global_batch_size, {batch}",
                    known.config, self.prompts_per_step, self.generations_per_prompt
                ),
            ));
        }
        known
            .policy_gpus(nodes, self.gpus_per_node)
            .map_err(|why| (&["resources", "nodes"][..], why))
    }

    /// Each policy GPU's memory and a step's training FLOPs on `nodes` machines.
    fn estimate(&self, nodes: u64) -> Option<Estimate> {
        let known = self.known()?;
        let world = self.fits(known, nodes).ok()?;
        let model = estimate::recipe(known.model)?;
        // The RL policy trains without MTP (`mtp_num_layers: 0`).
        let shape = estimate::Shape {
            mtp: "",
            mtp_depths: 0,
            ..model.shape
        };
        let (tp, pp, ep, cp, sp) = known.parallel;
        let recipe = estimate::Recipe {
            shape,
            defaults: Defaults {
                tp,
                pp,
                ep,
                etp: 1,
                cp,
                sp,
                // bf16 gradients (`grad_reduce_in_fp32: false`); the precision-aware
                // optimizer's fp32 Adam moments and, with bf16 weights, only the 16 low bits of
                // each fp32 main weight (Megatron-Core's `store_param_remainders`, on by
                // default); distributed.
                precision: Precision {
                    grad: 2,
                    main: 2,
                    ..Precision::MEGATRON
                },
                recompute: FULL_RECOMPUTE,
                capacity: None,
            },
        };
        let rollouts = self.prompts_per_step * self.generations_per_prompt;
        let run = Run::of(
            &recipe.defaults,
            world,
            self.sequence_length,
            (1, rollouts),
            self.steps,
        );
        let mut e = estimate::estimate(&recipe, &run);
        let weights = shape.parameters().total() * 2 / known.vllm_tp;
        let placement = match known.generation_nodes {
            0 => "on the policy's GPUs, asleep while it trains".to_string(),
            n => format!("on {n} nodes of its own"),
        };
        e.basis = format!(
            "the policy's {}; every rollout at {} tokens; vLLM (TP {}, {placement}): {} of bf16 weights a GPU, within the {:.0}% of its memory the config gives vLLM",
            e.basis,
            self.sequence_length,
            known.vllm_tp,
            nemo_dag_op::plan::bytes(weights),
            known.vllm_memory * 100.0
        );
        Some(e)
    }
}

/// Ray's head port (NeMo-RL's `ray.sub` uses the same).
const RAY_PORT: u16 = 9900;

/// The keys the op sets, and from what.
const SET_BY_THE_OP: &[(&str, &str)] = &[
    ("policy.model_name", "the `model` input"),
    ("policy.tokenizer.name", "the `model` input"),
    ("data.train.data_path", "the `data` input"),
    ("data.validation.data_path", "the `data` input"),
    ("checkpointing.enabled", "the op (always on)"),
    (
        "checkpointing.checkpoint_dir",
        "the op (the attempt's checkpoint/)",
    ),
    ("checkpointing.save_period", "params.save_period"),
    ("grpo.max_num_steps", "params.steps"),
    ("grpo.num_prompts_per_step", "params.prompts_per_step"),
    (
        "grpo.num_generations_per_prompt",
        "params.generations_per_prompt",
    ),
    ("grpo.seed", "params.seed"),
    ("policy.max_total_sequence_length", "params.sequence_length"),
    ("cluster.num_nodes", "resources.nodes"),
    ("cluster.gpus_per_node", "params.gpus_per_node"),
    ("logger.log_dir", "the op (the attempt's run/logs)"),
];

static SPEC: Spec = Spec {
    name: "nemo_rl_grpo",
    version: 1,
    summary: "GRPO with NeMo-RL and NeMo-Gym on a Hugging Face model and an rl_data artifact, one Ray node per Slurm node",
    inputs: &[
        Port {
            name: "model",
            required: true,
            what: "a Hugging Face model directory (the `hf` of megatron_export or export)",
        },
        Port {
            name: "data",
            required: true,
            what: "an rl_data artifact (train.jsonl, val.jsonl)",
        },
        Port {
            name: "checkout",
            required: false,
            what: "a NeMo-RL checkout (a directory) to run instead of the image's: mounted at \
                   `rl_root` in the container, or run from where it is without one; its files \
                   are in the key",
        },
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("checkpoint", "checkpoint"), ("run", "run")]),
    resumable: true,
    launched: true,
    gpu: false,
};

impl Op for NemoRlGrpo {
    type Params = Params;
    fn spec(&self) -> &'static Spec {
        &SPEC
    }
    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        check_params(p)?;
        let (Some(ranks), Some(nodes)) = (stage.world_size, stage.nodes) else {
            return Ok(());
        };
        // One Ray node per machine: rank.sh would fail on the cluster, after submission.
        if ranks != nodes {
            return Err(DeclError::new(
                &["resources", "ntasks_per_node"],
                format!(
                    "nemo_rl_grpo starts one Ray node per machine, so one rank per node, not {}",
                    ranks / nodes.max(1)
                ),
            )
            .with_help("ntasks_per_node: 1 (without it, a stage gets a rank per GPU of `gpus`)"));
        }
        let Some(known) = p.known() else {
            return Ok(());
        };
        p.fits(known, nodes).map(|_| ()).map_err(|(at, why)| {
            let error = DeclError::new(at, why);
            match at {
                ["resources", "nodes"] => error.with_help(format!(
                    "nodes: {} at least (the config's own cluster.num_nodes is what it was tuned for)",
                    known.fewest_nodes(p.gpus_per_node)
                )),
                _ => error,
            }
        })
    }
    /// Each policy GPU's memory and a step's work, for a config nemo-dag knows.
    fn plan(&self, p: &Params, _: &Upstream, stage: &StageDecl) -> Plan {
        Plan {
            estimate: stage.nodes.and_then(|nodes| p.estimate(nodes)),
            ..Plan::default()
        }
    }
    fn image(&self, p: &Params) -> Option<String> {
        p.image.clone()
    }
    fn names_image(&self) -> bool {
        true
    }
    fn preview(&self, p: &Params, stage: &StageDecl, launcher: &[String]) -> Option<String> {
        let words = overrides(p, "<input model>", "<input data>", "<out>");
        let software = Software::of_preview(stage, launcher, &p.rl_root);
        Some(format!(
            "{}# run/rank.sh, which launch.sh starts on every rank:\n{}",
            launch_script(stage.name, &software.launcher, "<out>"),
            rank_script(p, &software.root, stage.name, "<out>", &words)
        ))
    }
    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        run(p, ctx)
    }
}

fn check_params(p: &Params) -> Result<(), DeclError> {
    let at = |field: &str, message: String| DeclError::new(&["params", field], message);
    if p.image.as_deref().is_some_and(|i| i.trim().is_empty()) {
        return Err(at("image", "an empty image name".into()));
    }
    if !p.rl_root.starts_with('/') {
        return Err(at(
            "rl_root",
            format!("`{}` must be an absolute path inside the image", p.rl_root),
        ));
    }
    for (field, value) in [
        ("config", &p.config),
        ("script", &p.script),
        ("python", &p.python),
        ("ray", &p.ray),
    ] {
        if value.split_whitespace().next().is_none() {
            return Err(at(field, format!("an empty {field}")));
        }
    }
    for (field, value) in [
        ("steps", p.steps),
        ("prompts_per_step", p.prompts_per_step),
        ("generations_per_prompt", p.generations_per_prompt),
        ("save_period", p.save_period),
        ("sequence_length", p.sequence_length),
        ("gpus_per_node", p.gpus_per_node),
    ] {
        if value == 0 {
            return Err(at(field, format!("{field} must be at least 1")));
        }
    }
    check_env_names(&p.env)?;
    check_user_of(
        &p.overrides,
        SET_BY_THE_OP,
        "NeMo-RL",
        "with `+key=` NeMo-RL adds a key its config lacks, and its config model lets unknown keys through, so a misspelt key would be silently ignored: override keys that exist, without a prefix",
    )
}

fn run(p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
    check_image(p.image.as_deref(), "NeMo-RL", ctx)?;
    let out = std::path::absolute(ctx.out_dir)?;
    let run_dir = out.join("run");
    let ckpt = out.join("checkpoint");
    std::fs::create_dir_all(&run_dir)?;
    let model = input(ctx, "model")?;
    if !model.join("config.json").is_file() {
        return Err(RunError::new(format!(
            "input `model`: {} has no config.json: not a Hugging Face model directory",
            model.display()
        ))
        .with_help("wire `model` to the `hf` output of a megatron_export or export stage"));
    }
    check_context(p, &model)?;
    let data = input(ctx, "data")?;
    let mut train_rows = 0;
    for split in ["train.jsonl", "val.jsonl"] {
        let rows = std::fs::read_to_string(data.join(split))
            .map(|t| t.lines().filter(|l| !l.trim().is_empty()).count())
            .unwrap_or(0);
        if rows == 0 {
            return Err(RunError::new(format!(
                "input `data`: {} holds no rows (NeMo-RL validates on val.jsonl every val_period steps)",
                data.join(split).display()
            ))
            .with_help("wire `data` to an rl_data artifact; give it a valid_fraction above 0"));
        }
        if split == "train.jsonl" {
            train_rows = rows as u64;
        }
    }
    check_enough_rows(p, train_rows)?;

    let out_text = text(&out)?;
    let words = overrides(p, &text(&model)?, &text(&data)?, &out_text);
    let software = Software::of_run(ctx, &p.rl_root)?;
    std::fs::write(
        run_dir.join("rank.sh"),
        rank_script(p, &software.root, ctx.stage.name, &out_text, &words),
    )?;
    let launch = run_dir.join("launch.sh");
    std::fs::write(
        &launch,
        launch_script(ctx.stage.name, &software.launcher, &out_text),
    )?;

    let resumed = prepare(&ckpt)?;
    let (status, last) = match resumed {
        Some(n) if n >= p.steps => {
            writeln!(
                ctx.log,
                "nemo-dag: step {n} of {} is saved already; publishing it without a launch",
                p.steps
            )?;
            (None, Last::default())
        }
        _ => {
            match resumed {
                Some(n) => writeln!(
                    ctx.log,
                    "nemo-dag: NeMo-RL resumes from step {n} of {}",
                    p.steps
                )?,
                None => writeln!(
                    ctx.log,
                    "nemo-dag: starting NeMo-RL GRPO ({} steps)",
                    p.steps
                )?,
            }
            writeln!(ctx.log, "nemo-dag: {}", launch.display())?;
            let (status, last) = follow(ctx, &launch, &out, p.steps)?;
            (Some(status), last)
        }
    };
    let newest = newest_complete(&ckpt)?;
    let resume = match newest {
        Some(n) => format!("the next run resumes from step {n}"),
        None => "no step was saved: the next run starts over".into(),
    };
    if let Some(status) = status.filter(|s| !s.success()) {
        return Err(
            RunError::new(format!("NeMo-RL {}; {resume}", describe_exit(status)))
                .with_help("the log above says why (under a launcher, which rank failed first)"),
        );
    }
    if newest.is_none_or(|n| n < p.steps) {
        let at = newest.map_or("before its first save".to_string(), |n| {
            format!("at step {n} of {}", p.steps)
        });
        return Err(RunError::new(format!(
            "NeMo-RL exited 0 but stopped {at} (its checkpoint_must_save_by time budget); {resume}"
        )));
    }
    // Read before anything is removed; NeMo-RL writes it with Python's json, which may hold NaN.
    let info = read_info(&ckpt.join(step_dir(p.steps))).unwrap_or(Value::Null);
    keep_only(&ckpt, p.steps)?;
    let cache = run_dir.join("megatron_cache");
    if cache.exists() {
        std::fs::remove_dir_all(cache)?;
    }
    let mut m = Metrics::new();
    m.insert("image".into(), json!(p.image));
    m.insert("config".into(), json!(p.config));
    m.insert("final_step".into(), json!(p.steps));
    m.insert("resumed_from_step".into(), json!(resumed));
    m.insert("consumed_samples".into(), info["consumed_samples"].clone());
    m.insert("avg_reward".into(), json!(last.reward));
    m.insert("loss".into(), json!(last.loss));
    Ok(m)
}

/// vLLM refuses a `max_model_len` beyond the model's context: the stage's sequence length must
/// fit the `max_position_embeddings` of the model's config.json (which Megatron-Bridge's export
/// takes from the checkpoint's sequence length).
fn check_context(p: &Params, model: &Path) -> Result<(), RunError> {
    let path = model.join("config.json");
    let config: Value = std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| RunError::new(format!("input `model`: {}: {e}", path.display())))?;
    match config["max_position_embeddings"].as_u64() {
        Some(context) if context < p.sequence_length => Err(RunError::new(format!(
            "params.sequence_length {} is longer than the model's context ({context}, max_position_embeddings in {}): vLLM would refuse it",
            p.sequence_length,
            path.display()
        ))
        .with_help(format!("set sequence_length to at most {context}"))),
        _ => Ok(()),
    }
}

/// NeMo-RL ends a run at the end of its last epoch as at its last step (saving, exit 0): with
/// too few rows for `steps` the stage could never publish. The epochs are an override's, or
/// the one epoch of NeMo-RL's Nemotron configs (`grpo.max_num_epochs: 1`).
fn check_enough_rows(p: &Params, rows: u64) -> Result<(), RunError> {
    let epochs = p
        .overrides
        .get("grpo.max_num_epochs")
        .and_then(Value::as_u64)
        .unwrap_or(1);
    let needed = p.steps.saturating_mul(p.prompts_per_step);
    if rows.saturating_mul(epochs) >= needed {
        return Ok(());
    }
    Err(RunError::new(format!(
        "input `data`: train.jsonl holds {rows} prompts, but {} steps × {} prompts_per_step need {needed} in {epochs} epoch(s): NeMo-RL would stop at the end of the data, short of step {}",
        p.steps, p.prompts_per_step, p.steps
    ))
    .with_help("lower steps or prompts_per_step, give rl_data more prompts, or set overrides `grpo.max_num_epochs`"))
}

/// The last figures NeMo-RL printed.
#[derive(Default)]
struct Last {
    reward: Option<f64>,
    loss: Option<f64>,
}

/// Run `launch.sh`, its output into the log; `Step N/T` lines into progress.
fn follow(
    ctx: &mut RunContext,
    launch: &Path,
    out: &Path,
    steps: u64,
) -> Result<(std::process::ExitStatus, Last), RunError> {
    let mut command = std::process::Command::new("bash");
    command
        .arg(launch)
        .current_dir(out.join("run"))
        .env("NEMO_DAG_STAGE", ctx.stage.name)
        .env("NEMO_DAG_OUT", out);
    let mut last = Last::default();
    let progress = &mut *ctx.progress;
    let status = run_logged(&mut command, ctx.log, &mut |line| {
        if let Some(reward) = figure(line, "Avg Reward:") {
            last.reward = Some(reward);
        } else if let Some(loss) = figure(line, "Loss:") {
            last.loss = Some(loss);
        } else if let Some(done) = step_line(line) {
            progress(Progress {
                done,
                total: steps,
                message: last
                    .reward
                    .map(|r| format!("avg reward {r:.4}"))
                    .unwrap_or_default(),
            });
        }
    })?;
    Ok((status, last))
}

/// `========================= Step 3/200 =========================` → 3.
fn step_line(line: &str) -> Option<u64> {
    let rest = line
        .trim()
        .strip_prefix("=")?
        .trim_start_matches('=')
        .trim();
    let (n, _) = rest.strip_prefix("Step ")?.split_once('/')?;
    n.trim().parse().ok()
}

/// `  • Avg Reward: 0.4531` → 0.4531, for `label`.
fn figure(line: &str, label: &str) -> Option<f64> {
    let rest = line.trim().strip_prefix('•')?.trim().strip_prefix(label)?;
    rest.trim().parse().ok()
}

/// Every override, in order: the inputs, the run's length and shape, the attempt's
/// directories, then the stage's own. `model`, `data` and `out` are rendered paths.
fn overrides(p: &Params, model: &str, data: &str, out: &str) -> Vec<Override> {
    let q = |s: String| format!("'{s}'");
    let mut words = vec![
        Override::new("policy.model_name", q(model.to_string())),
        Override::new("policy.tokenizer.name", q(model.to_string())),
        Override::new("data.train.data_path", q(format!("{data}/train.jsonl"))),
        Override::new("data.validation.data_path", q(format!("{data}/val.jsonl"))),
        Override::new("grpo.max_num_steps", p.steps.to_string()),
        Override::new("grpo.num_prompts_per_step", p.prompts_per_step.to_string()),
        Override::new(
            "grpo.num_generations_per_prompt",
            p.generations_per_prompt.to_string(),
        ),
        Override::new("grpo.seed", p.seed.to_string()),
        Override::new(
            "policy.max_total_sequence_length",
            p.sequence_length.to_string(),
        ),
        Override::new("checkpointing.enabled", "true"),
        Override::new(
            "checkpointing.checkpoint_dir",
            q(format!("{out}/checkpoint")),
        ),
        Override::new("checkpointing.save_period", p.save_period.to_string()),
        Override::new("logger.log_dir", q(format!("{out}/run/logs"))),
        // The shape of the Ray cluster the rank script started: known when it runs.
        Override::new("cluster.num_nodes", "${NEMO_DAG_NODES}"),
        Override::new("cluster.gpus_per_node", p.gpus_per_node.to_string()),
    ];
    // Checked when the manifest loaded.
    words.extend(
        p.overrides
            .iter()
            .filter_map(|(key, value)| Some(Override::new(key, scalar(value).ok()?))),
    );
    words
}

/// `launch.sh`: the rank script once per rank under the launcher.
fn launch_script(stage: &str, launcher: &[String], out: &str) -> String {
    let mut head: Vec<String> = launcher.iter().map(|w| readable_shell_word(w)).collect();
    head.push("bash".into());
    head.push(readable_shell_word(&format!("{out}/run/rank.sh")));
    format!(
        "#!/bin/bash\n# nemo-dag nemo_rl_grpo · stage {stage}: run/rank.sh once per rank\nset -euo pipefail\nexec {}\n",
        head.join(" ")
    )
}

/// `rank.sh`: one Ray node per machine (the other ranks of a machine leave at once); the first
/// machine's is the head and runs the driver, the others join it and leave when it is gone.
/// `root` is NeMo-RL's checkout the driver runs from: `rl_root`, or a `checkout` input.
fn rank_script(p: &Params, root: &str, stage: &str, out: &str, words: &[Override]) -> String {
    let ray = p
        .ray
        .split_whitespace()
        .map(readable_shell_word)
        .collect::<Vec<_>>()
        .join(" ");
    let python = p
        .python
        .split_whitespace()
        .map(readable_shell_word)
        .collect::<Vec<_>>()
        .join(" ");
    let mut s = format!(
        "#!/bin/bash\n# nemo-dag nemo_rl_grpo · stage {stage} · config {config}\nset -euo pipefail\n",
        config = p.config
    );
    for (key, value) in [
        ("HF_HUB_OFFLINE", "1".to_string()),
        // No bytecode beside the sources: a `checkout` input's key is its files.
        ("PYTHONDONTWRITEBYTECODE", "1".to_string()),
        ("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0".to_string()),
        (
            "NRL_MEGATRON_CHECKPOINT_DIR",
            format!("{out}/run/megatron_cache"),
        ),
    ] {
        s.push_str(&format!("export {key}={}\n", readable_shell_word(&value)));
    }
    for (key, value) in &p.env {
        s.push_str(&format!("export {key}={}\n", readable_shell_word(value)));
    }
    s.push_str(&format!(
        r#"cd {root}
fail() {{ echo "nemo_rl_grpo: $*" >&2; exit 1; }}
# One Ray node per machine: the launcher's other ranks on it leave.
if [ "${{LOCAL_RANK:-0}}" != 0 ]; then exit 0; fi
export NEMO_DAG_NODES=$(( ${{WORLD_SIZE:-1}} / ${{LOCAL_WORLD_SIZE:-1}} ))
if [ "$NEMO_DAG_NODES" -gt 1 ]; then
  # Ray must see every GPU of the machine: one task per machine, not one bound to each GPU.
  [ "${{LOCAL_WORLD_SIZE:-1}}" = 1 ] || fail "one rank per machine is needed (resources.ntasks_per_node: 1), not ${{LOCAL_WORLD_SIZE}}"
  # The head by its address, as ray.sub resolves it; workers' ports below vLLM's and Gym's.
  ip=$(getent hosts "${{MASTER_ADDR:?the job script exports MASTER_ADDR}}" | awk '{{print $1; exit}}' || true)
  head="${{ip:-$MASTER_ADDR}}:{port}"
  ports="--min-worker-port=10002 --max-worker-port=11000"
  poll="${{NEMO_DAG_RAY_POLL:-5}}"  # seconds between Ray's answers awaited
  if [ "${{RANK:-0}}" != 0 ]; then
    # A worker: join the head (retrying while it starts), and leave once it has been gone for
    # three polls in a row (the driver ended; one slow answer is not the end).
    joined=0
    for _ in $(seq 120); do
      if {ray} start --address="$head" $ports; then joined=1; break; fi
      sleep "$poll"
    done
    [ "$joined" = 1 ] || fail "could not join Ray's head at $head after 120 tries"
    gone=0
    while [ "$gone" -lt 3 ]; do
      sleep "$poll"
      if {ray} status --address="$head" >/dev/null 2>&1; then gone=0; else gone=$((gone + 1)); fi
    done
    {ray} stop --force >/dev/null 2>&1 || true
    exit 0
  fi
  {ray} start --head --node-ip-address="${{head%:*}}" --port={port} $ports --disable-usage-stats
  trap '{ray} stop --force >/dev/null 2>&1 || true' EXIT
  export RAY_ADDRESS="$head"
  # Wait, as ray.sub does, until every machine's GPUs have joined (360 polls: 30 minutes).
  want=$(( NEMO_DAG_NODES * {gpus} ))
  have=0
  for _ in $(seq 360); do
    have=$({ray} status --address="$head" 2>/dev/null | sed -n 's|^ *[0-9.]*/\([0-9.]*\) GPU.*|\1|p' | head -n1 || true)
    if [ "${{have%.*}}" -ge "$want" ] 2>/dev/null; then break; fi
    sleep "$poll"
  done
  [ "${{have%.*}}" -ge "$want" ] 2>/dev/null || fail "Ray counts ${{have:-no}} GPUs after 360 polls, not the $want of $NEMO_DAG_NODES machines"
fi
{python} {script} --config {config}"#,
        root = readable_shell_word(root),
        port = RAY_PORT,
        gpus = p.gpus_per_node,
        script = readable_shell_word(&p.script),
        config = readable_shell_word(&p.config),
    ));
    for word in words {
        // cluster.num_nodes is the shell's: every other word is one literal argument.
        let rendered = match word.value.as_str() {
            "${NEMO_DAG_NODES}" => format!("{}=\"$NEMO_DAG_NODES\"", word.key),
            _ => readable_shell_word(&word.word()),
        };
        s.push_str(&format!(" \\\n  {rendered}"));
    }
    s.push('\n');
    s
}

// NeMo-RL's checkpoint directory (`nemo_rl/utils/checkpoint.py`, v0.7.0):
//
//   checkpoint/
//     step_10/              training_info.json, config.yaml, train_dataloader.pt, policy/…
//     tmp_step_20/          a save in progress: written, then renamed to step_20
//     old_step_10/          step_10 moved aside while a save of step 10 replaced it
//
// NeMo-RL resumes from the highest `step_N` alone. A kill mid-save leaves `tmp_step_N`, which a
// later save of that step would reuse as it is; a kill between the two renames leaves
// `old_step_N` as the only whole copy.

/// `step_20` for 20.
pub fn step_dir(n: u64) -> String {
    format!("step_{n}")
}

fn parse_step(name: &str, prefix: &str) -> Option<u64> {
    let digits = name.strip_prefix(prefix)?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

/// Whether a `step_N` directory is a finished save: a non-empty training_info.json (NeMo-RL
/// writes it first, into `tmp_step_N`, and renames the directory only after the weights), its
/// config and its weights. Presence, not parsing: Python's json writes NaN, which is not JSON.
fn complete(dir: &Path) -> bool {
    std::fs::metadata(dir.join("training_info.json")).is_ok_and(|m| m.is_file() && m.len() > 0)
        && dir.join("config.yaml").is_file()
        && dir.join("policy/weights").is_dir()
}

fn read_info(dir: &Path) -> Result<Value, RunError> {
    let path = dir.join("training_info.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| RunError::new(format!("{}: {e}", path.display())))?;
    serde_json::from_str(&text).map_err(|e| RunError::new(format!("{}: {e}", path.display())))
}

/// Every `step_N` directory, in step order, with whether it is complete.
fn scan(dir: &Path) -> io::Result<Vec<Save>> {
    saves::scan(dir, |name| parse_step(name, "step_"), complete)
}

/// The newest complete step.
pub fn newest_complete(dir: &Path) -> io::Result<Option<u64>> {
    Ok(saves::newest(&scan(dir)?))
}

/// Before a launch: an `old_step_N` whose `step_N` is missing is put back; saves in progress
/// (`tmp_step_*`), what was moved aside, and every `step_N` that is incomplete or newer than
/// the newest complete one are removed, so NeMo-RL resumes from a whole step. Returns it.
pub fn prepare(dir: &Path) -> io::Result<Option<u64>> {
    std::fs::create_dir_all(dir)?;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if let Some(n) = parse_step(name, "old_step_") {
            let whole = dir.join(step_dir(n));
            if whole.exists() {
                std::fs::remove_dir_all(entry.path())?;
            } else {
                std::fs::rename(entry.path(), whole)?;
            }
        } else if parse_step(name, "tmp_step_").is_some() {
            std::fs::remove_dir_all(entry.path())?;
        }
    }
    saves::drop_unusable(scan(dir)?)
}

/// After a finished run: step `n` alone.
pub fn keep_only(dir: &Path, n: u64) -> io::Result<()> {
    saves::keep_only(scan(dir)?, n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::names;

    fn params(config: &str, overrides: Value) -> Params {
        serde_json::from_value(json!({
            "config": config, "steps": 100, "prompts_per_step": 256,
            "generations_per_prompt": 16, "save_period": 10, "sequence_length": 8192,
            "overrides": overrides
        }))
        .unwrap()
    }

    /// Super's RLVR config on its 109 nodes: the policy gets the 32 machines vLLM (72) and the
    /// judges (5) leave, 256 GPUs; each holds 1/8 of every layer's 512 routed experts (EP 8)
    /// at 2 + 2 + 10/32 bytes a parameter (bf16 weight and gradient; the main weight's 16
    /// low bits and fp32 moments over the 32 expert-data-parallel ranks), and each layer's
    /// input for the backward under full recompute; vLLM's TP-4 share of the bf16 weights is
    /// named.
    #[test]
    fn a_known_config_is_planned_on_the_policys_gpus() {
        let p = params("examples/configs/super/stage1_rlvr.yaml", json!({}));
        let e = p.estimate(109).unwrap();
        let experts = e
            .memory
            .iter()
            .find(|(name, _)| name.starts_with("routed experts"))
            .unwrap()
            .1 as f64;
        let model = estimate::recipe("nemotron_3_super_sft_config")
            .unwrap()
            .shape;
        let want = (model.decoder().experts / 8) as f64 * (2.0 + 2.0 + 10.0 / 32.0);
        assert!((experts - want).abs() <= 1e-6 * want, "{experts} vs {want}");
        assert!(e.basis.contains("the policy's 256 GPUs"), "{}", e.basis);
        assert!(
            e.basis.contains("full recompute") && e.basis.contains("vLLM (TP 4, on 72 nodes"),
            "{}",
            e.basis
        );
        // Under full recompute, activations are a small part: each layer's input of 8192/8
        // tokens split over TP 4, and one layer recomputed.
        let activations = e.memory.iter().find(|(n, _)| n == "activations").unwrap().1;
        let inputs = 88 * 2 * (8192 / 8) * 4096 / 4;
        assert!(
            activations > inputs && activations < 4 * inputs,
            "{activations}"
        );
        // Fewer nodes: the same config's vLLM and judges take the first 77, and the policy's
        // GPUs must be a multiple of TP × PP × CP = 32 (and of EP × PP = 8): 81 nodes at least.
        assert!(p.estimate(77).is_none());
        assert!(
            KNOWN[1]
                .policy_gpus(78, 8)
                .unwrap_err()
                .contains("a multiple of TP × PP × CP = 32")
        );
        assert!(p.estimate(80).is_none());
        let fewest = p.estimate(81).unwrap();
        assert!(
            fewest.basis.contains("the policy's 32 GPUs"),
            "{}",
            fewest.basis
        );
        assert_eq!(KNOWN[1].fewest_nodes(8), 81);
        // Nodes of other than 8 GPUs, and rollouts that are not the config's on-policy batch,
        // do not fit it.
        let mut other = params("examples/configs/super/stage1_rlvr.yaml", json!({}));
        other.gpus_per_node = 4;
        assert_eq!(
            other.fits(&KNOWN[1], 109).unwrap_err().0,
            ["params", "gpus_per_node"]
        );
        other.gpus_per_node = 8;
        other.generations_per_prompt = 8;
        assert_eq!(
            other.fits(&KNOWN[1], 109).unwrap_err().0,
            ["params", "prompts_per_step"]
        );
        // A config nemo-dag does not know, or one whose parallelism is overridden, is not
        // planned.
        assert!(
            params("examples/configs/grpo_math_1B.yaml", json!({}))
                .estimate(109)
                .is_none()
        );
        let changed = params(
            "examples/configs/super/stage1_rlvr.yaml",
            json!({"policy.megatron_cfg.tensor_model_parallel_size": 8}),
        );
        assert!(changed.estimate(109).is_none());
    }

    fn save(dir: &Path, name: &str, n: u64, whole: bool) {
        let d = dir.join(name);
        std::fs::create_dir_all(d.join("policy/weights")).unwrap();
        std::fs::write(d.join("config.yaml"), "grpo: {}\n").unwrap();
        if whole {
            std::fs::write(
                d.join("training_info.json"),
                format!("{{\"total_steps\": {n}, \"consumed_samples\": 8}}"),
            )
            .unwrap();
        }
    }

    /// NeMo-RL resumes from the highest `step_N`: whatever a kill left is undone first.
    #[test]
    fn a_kill_mid_save_leaves_only_whole_steps_for_nemo_rl_to_resume() {
        let dir = crate::testing::scratch("rl-ckpt-kill");
        let ckpt = dir.as_path();
        save(ckpt, "step_10", 10, true);
        save(ckpt, "tmp_step_20", 20, true); // killed before the rename
        save(ckpt, "step_30", 30, false); // no training_info.json: not NeMo-RL's doing, not whole
        save(ckpt, "old_step_40", 40, true); // killed between the two renames
        assert_eq!(prepare(ckpt).unwrap(), Some(40));
        assert_eq!(names(ckpt), ["step_10", "step_40"]);
        keep_only(ckpt, 40).unwrap();
        assert_eq!(names(ckpt), ["step_40"]);
    }

    #[test]
    fn an_old_step_beside_its_replacement_is_dropped() {
        let dir = crate::testing::scratch("rl-ckpt-old");
        let ckpt = dir.as_path();
        save(ckpt, "step_10", 10, true);
        save(ckpt, "old_step_10", 10, true);
        assert_eq!(prepare(ckpt).unwrap(), Some(10));
        assert_eq!(names(ckpt), ["step_10"]);
    }

    /// `rank.sh` on two machines, as the launcher starts it: the first machine's rank is Ray's
    /// head and starts the driver only once both machines' GPUs have joined; the other joins
    /// and leaves when the head is gone; ranks bound to single GPUs are refused. Ray is a
    /// stand-in that keeps the cluster in a directory (`start`, `status`, `stop` as Ray's CLI).
    #[test]
    fn the_rank_script_makes_one_ray_cluster_of_the_machines_and_runs_the_driver_on_its_head() {
        let dir = crate::testing::scratch("rl-ray");
        let state = dir.join("ray");
        std::fs::create_dir_all(&state).unwrap();
        let ray = dir.join("ray.sh");
        std::fs::write(
            &ray,
            r#"#!/bin/bash
s="$FAKE_RAY_STATE"
case "$1" in
  start)
    if [ "$2" = --head ]; then echo 2 > "$s/head"; echo "head on $3";
    elif [ -f "$s/head" ]; then echo $(( $(cat "$s/head") )) > "$s/head"; touch "$s/worker"; echo joined;
    else exit 1; fi ;;
  status)
    [ -f "$s/head" ] || exit 1
    n=1; [ -f "$s/worker" ] && n=2
    printf 'Resources\n---\nUsage:\n 0.0/%s.0 CPU\n 0.0/%s.0 GPU\n' $((n * 4)) $((n * 2)) ;;
  stop)
    if [ "$RANK" = 0 ]; then rm -f "$s/head"; else rm -f "$s/worker"; echo "$RANK" > "$s/worker-left"; fi ;;
esac
"#,
        )
        .unwrap();
        let driver = dir.join("driver.sh");
        std::fs::write(
            &driver,
            "#!/bin/bash\nbash \"$FAKE_RAY\" status > \"$FAKE_RAY_STATE/seen\"\necho \"$@\" > \"$FAKE_RAY_STATE/driver-args\"\n",
        )
        .unwrap();
        let p: Params = serde_json::from_value(json!({
            "rl_root": dir, "python": "bash", "script": driver, "ray": format!("bash {}", ray.display()),
            "config": "c.yaml", "gpus_per_node": 2, "steps": 2, "prompts_per_step": 1,
            "generations_per_prompt": 2, "save_period": 1, "sequence_length": 64,
        }))
        .unwrap();
        let words = overrides(&p, "/m", "/d", dir.to_str().unwrap());
        let script = dir.join("rank.sh");
        std::fs::write(
            &script,
            rank_script(&p, &p.rl_root, "grpo", dir.to_str().unwrap(), &words),
        )
        .unwrap();
        let rank = |rank: u32, local_world: u32| {
            std::process::Command::new("bash")
                .arg(&script)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", "0")
                .env("WORLD_SIZE", (2 * local_world).to_string())
                .env("LOCAL_WORLD_SIZE", local_world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("NEMO_DAG_RAY_POLL", "0.2")
                .env("FAKE_RAY_STATE", &state)
                .env("FAKE_RAY", &ray)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        };
        // Two ranks bound to one machine's GPUs each would hide the others from Ray.
        let bound = rank(0, 2).wait_with_output().unwrap();
        assert!(!bound.status.success());
        assert!(
            String::from_utf8_lossy(&bound.stderr).contains("resources.ntasks_per_node: 1"),
            "{bound:?}"
        );
        // The worker machine starts first and waits for the head.
        let worker = rank(1, 1);
        std::thread::sleep(std::time::Duration::from_millis(300));
        let head = rank(0, 1).wait_with_output().unwrap();
        assert!(head.status.success(), "{head:?}");
        let worker = worker.wait_with_output().unwrap();
        assert!(
            worker.status.success(),
            "the worker leaves once the head is gone: {worker:?}"
        );
        let seen = std::fs::read_to_string(state.join("seen")).unwrap();
        assert!(
            seen.contains(" 0.0/4.0 GPU"),
            "the driver started before every GPU joined: {seen}"
        );
        let args = std::fs::read_to_string(state.join("driver-args")).unwrap();
        assert!(
            args.contains("--config c.yaml") && args.contains("cluster.num_nodes=2"),
            "{args}"
        );
        assert_eq!(
            std::fs::read_to_string(state.join("worker-left"))
                .unwrap()
                .trim(),
            "1"
        );
        assert!(
            !state.join("head").exists(),
            "the head stops Ray when the driver ends"
        );
    }

    #[test]
    fn nemo_rl_log_lines_give_progress_and_figures() {
        assert_eq!(
            step_line("========================= Step 3/200 ========================="),
            Some(3)
        );
        assert_eq!(
            step_line("========================= Epoch 1/1 ========================="),
            None
        );
        assert_eq!(step_line("Saving checkpoint for step 10..."), None);
        assert_eq!(
            figure("  • Avg Reward: 0.4531", "Avg Reward:"),
            Some(0.4531)
        );
        assert_eq!(figure("  • Loss: 0.0123", "Loss:"), Some(0.0123));
        assert_eq!(figure("  • Generation KL Error: 0.0011", "Loss:"), None);
    }
}
