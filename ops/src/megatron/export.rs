//! `megatron_export`: a Megatron checkpoint as a Hugging Face model directory, converted by
//! Megatron-Bridge's own converter (`scripts/conversion/run_conversion.py export`, v0.6), with
//! the tokenizer the model was trained with.
//!
//! ```yaml
//! hf:
//!   op: megatron_export
//!   inputs: {model: "sft:checkpoint", tokenizer: "tokenizer:tokenizer"}
//!   resources: {launch: srun, nodes: 1, gpus: 8}     # one rank per GPU, as the converter runs
//!   params:
//!     hf_model: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16   # the architecture's reference
//!     image: nvcr.io/nvidia/nemo:25.11.nemotron_3_nano
//!     parallel: {ep: 8}
//! ```
//!
//! Megatron-Bridge builds the Hugging Face model from a reference (`hf_model`: a Hub name found
//! in `HF_HOME`, never downloaded mid-job, or a directory in the image) whose config it adapts
//! to the checkpoint's own architecture and vocabulary, maps the weights, and saves the
//! reference's tokenizer beside them. That tokenizer is not the one the model was trained
//! with, and the token ids `config.json` and `generation_config.json` name are the
//! reference's. So after the converter exits, the op:
//!
//! - checks what it wrote: `config.json`, and every safetensors shard its index lists, each
//!   whole (the header's tensors fill the file exactly);
//! - replaces the reference's tokenizer files with the stage's `tokenizer.json`, a
//!   `tokenizer_config.json` with the chat template the checkpoint carries (a `megatron_sft`
//!   checkpoint carries its pack's), and the end/pad token ids of that tokenizer in
//!   `config.json` and `generation_config.json` ([`crate::hf::chat`]);
//! - refuses a `vocab_size` smaller than the tokenizer's vocabulary.
//!
//! The output `hf/` is what `transformers.AutoModelForCausalLM.from_pretrained` and NeMo-RL's
//! policy load. `run/` keeps `launch.sh`.

use super::{
    CHECKOUT, Software, check_groups, check_image, check_software, default_mb_root, default_python,
    text,
};
use crate::hf;
use crate::training::{carried_template, input};
use nemo_dag_op::process::{describe_exit, readable_shell_word, run_logged};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;

pub struct MegatronExport;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// The Hugging Face model the converter takes the architecture's code and config layout
    /// from: a Hub name (read from `HF_HOME` in the image) or an absolute directory.
    hf_model: String,
    /// A Hub commit of `hf_model`, resolved in the local cache (`--hf-revision`).
    #[serde(default)]
    hf_revision: Option<String>,
    #[serde(default)]
    image: Option<String>,
    #[serde(default = "default_mb_root")]
    mb_root: String,
    #[serde(default = "default_python")]
    python: String,
    /// `gpu` (one rank per GPU, the converter's distributed backend) or `cpu` (one process).
    #[serde(default)]
    device: Device,
    /// The weights' dtype (`--torch-dtype`).
    #[serde(default)]
    dtype: Dtype,
    /// How the ranks hold the model while converting (the GPU backend only).
    #[serde(default)]
    parallel: Parallel,
    /// `false` lets the checkpoint and the reference differ in parameter names
    /// (`--not-strict`); by default a mismatch fails the export.
    #[serde(default = "default_strict")]
    strict: bool,
    #[serde(default)]
    env: BTreeMap<String, String>,
}

fn default_strict() -> bool {
    true
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Device {
    Cpu,
    #[default]
    Gpu,
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Dtype {
    #[default]
    Bfloat16,
    Float16,
    Float32,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Float16 => "float16",
            Dtype::Float32 => "float32",
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Parallel {
    #[serde(default = "one")]
    tp: u64,
    #[serde(default = "one")]
    pp: u64,
    #[serde(default = "one")]
    ep: u64,
    #[serde(default = "one")]
    etp: u64,
}

impl Default for Parallel {
    fn default() -> Self {
        Parallel {
            tp: 1,
            pp: 1,
            ep: 1,
            etp: 1,
        }
    }
}

fn one() -> u64 {
    1
}

static SPEC: Spec = Spec {
    name: "megatron_export",
    version: 1,
    summary: "convert a Megatron checkpoint to a Hugging Face model with Megatron-Bridge's converter, with the tokenizer it was trained with",
    inputs: &[
        super::CHECKPOINT,
        Port {
            name: "tokenizer",
            required: true,
            what: "the tokenizer.json the model was trained with",
        },
        CHECKOUT,
    ],
    other_inputs: None,
    outputs: Outputs::Fixed(&[("hf", "hf"), ("run", "run")]),
    resumable: false,
    launched: true,
    gpu: false,
};

impl Op for MegatronExport {
    type Params = Params;
    fn spec(&self) -> &'static Spec {
        &SPEC
    }
    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        check_params(p, stage.world_size)
    }
    fn image(&self, p: &Params) -> Option<String> {
        p.image.clone()
    }
    fn names_image(&self) -> bool {
        true
    }
    fn preview(&self, p: &Params, stage: &StageDecl, launcher: &[String]) -> Option<String> {
        Some(launch_script(
            p,
            stage.name,
            &Software::of_preview(stage, launcher, &p.mb_root),
            "<input model>/iter_<final>",
            "<out>/hf",
        ))
    }
    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        run(p, ctx)
    }
}

fn check_params(p: &Params, world: Option<u64>) -> Result<(), DeclError> {
    let at = |field: &str, message: String| DeclError::new(&["params", field], message);
    check_software(&p.image, &p.mb_root, &p.python, &p.env)?;
    if p.hf_model.trim().is_empty() || p.hf_model.chars().any(char::is_whitespace) {
        return Err(at(
            "hf_model",
            format!(
                "`{}` is not a Hugging Face model name or directory",
                p.hf_model
            ),
        ));
    }
    if p.hf_revision
        .as_deref()
        .is_some_and(|r| r.trim().is_empty())
    {
        return Err(at("hf_revision", "an empty revision".into()));
    }
    // The converter resolves a revision in the Hub cache; a directory has none.
    if p.hf_revision.is_some() && p.hf_model.starts_with('/') {
        return Err(at(
            "hf_revision",
            format!(
                "`{}` is a directory, not a Hub model: it has no revision",
                p.hf_model
            ),
        ));
    }
    let par = &p.parallel;
    for (name, value) in [
        ("tp", par.tp),
        ("pp", par.pp),
        ("ep", par.ep),
        ("etp", par.etp),
    ] {
        if value == 0 {
            return Err(DeclError::new(
                &["params", "parallel", name],
                format!("parallel.{name} must be at least 1"),
            ));
        }
    }
    match p.device {
        // run_conversion.py: "CPU conversion requires TP=PP=EP=ETP=1", in one process.
        Device::Cpu => {
            if [par.tp, par.pp, par.ep, par.etp] != [1, 1, 1, 1] {
                return Err(at(
                    "parallel",
                    "the CPU converter runs one process: tp, pp, ep and etp must be 1".into(),
                )
                .with_help("set device: gpu to convert on GPUs, one rank per GPU"));
            }
            if let Some(world) = world.filter(|w| *w > 1) {
                return Err(DeclError::new(
                    &["resources"],
                    format!(
                        "the CPU converter runs one process, but the stage launches {world} ranks"
                    ),
                )
                .with_help("launch one rank (nodes: 1, ntasks_per_node: 1), or set device: gpu"));
            }
        }
        // The GPU backend joins a process group from the launcher's variables: it needs one.
        Device::Gpu => {
            let Some(world) = world else {
                return Err(DeclError::new(
                    &["resources", "launch"],
                    "the GPU converter runs one rank per GPU and needs a launcher",
                )
                .with_help("set resources: {launch: srun, nodes: …, gpus: …}, or device: cpu"));
            };
            check_groups(
                world,
                &[("tp", par.tp), ("pp", par.pp)],
                &[("etp", par.etp), ("ep", par.ep), ("pp", par.pp)],
            )?;
        }
    }
    Ok(())
}

fn run(p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
    check_image(p.image.as_deref(), "Megatron-Bridge's converter", ctx)?;
    let out = std::path::absolute(ctx.out_dir)?;
    let hf_dir = out.join("hf");
    let run_dir = out.join("run");
    std::fs::create_dir_all(&run_dir)?;
    let model = input(ctx, "model")?;
    let iteration = super::checkpoint::final_iteration(&model).map_err(|why| {
        RunError::new(format!("input `model`: {why}")).with_help(
            "wire `model` to the `checkpoint` output of a megatron_pretrain or megatron_sft stage",
        )
    })?;
    let (tokenizer, tokenizer_path) = crate::load_tokenizer(ctx.inputs)?;
    let template = carried_template(&[&model])?;
    // The converter refuses a destination that is not empty: an earlier attempt's is removed.
    if hf_dir.exists() {
        std::fs::remove_dir_all(&hf_dir)?;
    }
    let script = run_dir.join("launch.sh");
    std::fs::write(
        &script,
        launch_script(
            p,
            ctx.stage.name,
            &Software::of_run(ctx, &p.mb_root)?,
            &text(&iteration)?,
            &text(&hf_dir)?,
        ),
    )?;
    writeln!(
        ctx.log,
        "nemo-dag: converting {} to Hugging Face ({}, reference {})\nnemo-dag: {}",
        iteration.display(),
        p.dtype.name(),
        p.hf_model,
        script.display()
    )?;
    let mut command = std::process::Command::new("bash");
    command
        .arg(&script)
        .current_dir(&run_dir)
        .env("NEMO_DAG_STAGE", ctx.stage.name)
        .env("NEMO_DAG_OUT", &out);
    let status = run_logged(&mut command, ctx.log, &mut |_| {})?;
    if !status.success() {
        return Err(RunError::new(format!(
            "Megatron-Bridge's converter {}",
            describe_exit(status)
        ))
        .with_help("the log above says why"));
    }

    let checked = check_written(&hf_dir)?;
    let vocab = tokenizer.get_vocab_size(true);
    let mut config = checked.config;
    let declared = config["vocab_size"].as_u64();
    if declared.is_none_or(|v| (v as usize) < vocab) {
        return Err(RunError::new(format!(
            "the exported config.json has vocab_size {}, fewer than the {vocab} tokens of {}: the checkpoint was not trained with this tokenizer",
            declared.map_or("(none)".into(), |v| v.to_string()),
            tokenizer_path.display()
        ))
        .with_help("wire `tokenizer` to the tokenizer the model's data was tokenized with"));
    }
    let context = config["max_position_embeddings"]
        .as_u64()
        .ok_or_else(|| {
            RunError::new(
                "the exported config.json has no max_position_embeddings: cannot tell the model's context length",
            )
        })?;
    let talk = hf::chat::files(&tokenizer, template.as_deref(), context as usize);
    let replaced = replace_tokenizer(&hf_dir, &tokenizer_path)?;
    if let Value::Object(c) = &mut config {
        c.extend(talk.config_ids);
    }
    for (name, value) in [
        ("config.json", &config),
        ("tokenizer_config.json", &talk.tokenizer_config),
        ("generation_config.json", &talk.generation_config),
    ] {
        let text = serde_json::to_string_pretty(value)
            .map_err(|e| RunError::new(format!("{name}: {e}")))?;
        std::fs::write(hf_dir.join(name), text + "\n")?;
    }
    writeln!(
        ctx.log,
        "nemo-dag: {} tensors in {} shard(s); replaced the reference's tokenizer files ({}) with {}{}",
        checked.tensors,
        checked.shards,
        if replaced.is_empty() {
            "none".to_string()
        } else {
            replaced.join(", ")
        },
        tokenizer_path.display(),
        if template.is_some() {
            " and the checkpoint's chat template"
        } else {
            " (the checkpoint carries no chat template)"
        }
    )?;

    let mut m = Metrics::new();
    m.insert("hf_model".into(), json!(p.hf_model));
    m.insert("image".into(), json!(p.image));
    m.insert(
        "iteration".into(),
        json!(iteration.file_name().and_then(|n| n.to_str())),
    );
    m.insert("architectures".into(), config["architectures"].clone());
    m.insert("vocab_size".into(), json!(declared));
    m.insert("tensors".into(), json!(checked.tensors));
    m.insert("shards".into(), json!(checked.shards));
    m.insert("chat_template".into(), json!(template.is_some()));
    Ok(m)
}

/// What the converter wrote, once checked.
struct Written {
    config: Value,
    tensors: usize,
    shards: usize,
}

/// `config.json` parses, and every shard the index lists is there and whole.
fn check_written(dir: &Path) -> Result<Written, RunError> {
    let fail = |why: String| {
        RunError::new(format!(
            "Megatron-Bridge's converter exited 0, but its output is not a whole model: {why}"
        ))
    };
    let config_path = dir.join("config.json");
    let config: Value = std::fs::read_to_string(&config_path)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(&t).map_err(|e| e.to_string()))
        .map_err(|e| fail(format!("{}: {e}", config_path.display())))?;
    let shards = hf::shard_files(dir).map_err(fail)?;
    let mut tensors = 0;
    for shard in &shards {
        tensors += hf::shard_tensors(&dir.join(shard)).map_err(fail)?.len();
    }
    if tensors == 0 {
        return Err(fail(format!("{} holds no tensor", dir.display())));
    }
    Ok(Written {
        config,
        tensors,
        shards: shards.len(),
    })
}

/// The tokenizer files a `save_pretrained` of the reference may have written: all go, so
/// nothing of the reference's vocabulary is left for a loader to prefer.
const REFERENCE_TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
];

/// Remove the reference's tokenizer files and copy ours in; the names removed.
fn replace_tokenizer(dir: &Path, ours: &Path) -> Result<Vec<String>, RunError> {
    let mut removed = Vec::new();
    for name in REFERENCE_TOKENIZER_FILES {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => removed.push(name.to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
    }
    std::fs::copy(ours, dir.join("tokenizer.json"))?;
    Ok(removed)
}

/// `launch.sh`: the converter once per rank, from `iteration` into `hf` (rendered paths, or
/// placeholders in a preview).
fn launch_script(
    p: &Params,
    stage: &str,
    software: &Software,
    iteration: &str,
    hf: &str,
) -> String {
    let mut s = super::script_head(
        &format!("megatron_export · stage {stage} · reference {}", p.hf_model),
        &p.env,
        software,
        &p.python,
        "scripts/conversion/run_conversion.py",
    );
    let device = match p.device {
        Device::Cpu => "cpu",
        Device::Gpu => "gpu",
    };
    let par = &p.parallel;
    let mut words: Vec<String> = [
        "export",
        "--device",
        device,
        "--hf-model",
        &p.hf_model,
        "--megatron-path",
        iteration,
        "--hf-path",
        hf,
        "--torch-dtype",
        p.dtype.name(),
    ]
    .into_iter()
    .map(str::to_string)
    .collect();
    if let Some(revision) = &p.hf_revision {
        words.extend(["--hf-revision".into(), revision.clone()]);
    }
    for (flag, value) in [
        ("--tp", par.tp),
        ("--pp", par.pp),
        ("--ep", par.ep),
        ("--etp", par.etp),
    ] {
        words.extend([flag.to_string(), value.to_string()]);
    }
    if !p.strict {
        words.push("--not-strict".into());
    }
    // The GPU backend's default: each rank saves its own shards, none gathers the model.
    words.push(match p.device {
        Device::Cpu => "--no-distributed-save".into(),
        Device::Gpu => "--distributed-save".into(),
    });
    words.push("--no-progress".into());
    let words: Vec<String> = words.iter().map(|w| readable_shell_word(w)).collect();
    s.push_str(&format!("  {}\n", words.join(" ")));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(v: Value) -> Params {
        serde_json::from_value(v).unwrap()
    }

    /// What the converter would refuse after the queue wait is refused at the field.
    #[test]
    fn a_layout_the_converter_cannot_run_is_refused_at_its_field() {
        let field = |v: Value, world| check_params(&params(v), world).unwrap_err().path.join(".");
        let gpu = json!({"hf_model": "m", "parallel": {"ep": 8}});
        assert!(check_params(&params(gpu.clone()), Some(8)).is_ok());
        assert_eq!(field(gpu.clone(), Some(12)), "params.parallel.ep");
        assert_eq!(field(gpu, None), "resources.launch");
        let cpu = json!({"hf_model": "m", "device": "cpu"});
        assert!(check_params(&params(cpu.clone()), None).is_ok());
        assert!(check_params(&params(cpu.clone()), Some(1)).is_ok());
        assert_eq!(field(cpu, Some(2)), "resources");
        assert_eq!(
            field(
                json!({"hf_model": "m", "device": "cpu", "parallel": {"tp": 2}}),
                None
            ),
            "params.parallel"
        );
        assert_eq!(
            field(json!({"hf_model": "a b"}), Some(1)),
            "params.hf_model"
        );
        assert_eq!(
            field(
                json!({"hf_model": "/models/x", "hf_revision": "abc"}),
                Some(8)
            ),
            "params.hf_revision"
        );
    }
}
