//! The op protocol: everything nemo-dag's engine and its ops share, and nothing else.
//!
//! An op is a plain Rust value implementing [`Op`]: it declares itself once ([`Spec`]: name,
//! version, inputs, outputs), validates its typed params against a stage ([`Op::check`]) and,
//! given the resolved inputs and a private output directory, produces its outputs
//! ([`Op::run`]). The engine holds it as an [`AnyOp`], which parses the params once. An op never
//! knows which executor runs it, where the store lives, or how keys are computed; the engine
//! never knows what an op computes, only its name, version, declared outputs and `run`. Neither
//! side imports the other: both import this crate, and the `nemo-dag` binary hands the engine
//! a [`Registry`] of the ops it was built with.
//!
//! - [`StageDecl`]: a stage as the op sees it; [`DeclError`]: what is wrong with it, and where.
//! - [`RunContext`]: inputs, output directory, log and [`Progress`] of one run; [`RunError`]:
//!   why it failed.
//! - [`Registry`]: the ops a binary offers, and the nearest name to a misspelt one.
//! - [`Device`]: a stage's `resources.device`, and the [`GpuProbe`] a binary checks it with.
//! - [`Plan`]: what a stage hands downstream and what it will cost ([`Estimate`]), before it
//!   runs.
//! - [`process`]: shell quoting and die-with-parent, for every place that starts a process.

pub mod device;
pub mod plan;
pub mod process;
pub mod registry;

pub use device::{DEVICE_FORMS, Device, GpuProbe};
pub use plan::{Estimate, Facts, Plan, Upstream};
pub use registry::{Registry, nearest};

use serde::de::DeserializeOwned;
use serde_json::Value;
use std::collections::BTreeMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A stage as the op sees it: everything from the manifest that determines its output.
#[derive(Debug, Clone)]
pub struct StageDecl<'a> {
    /// The stage's name in the manifest.
    pub name: &'a str,
    /// Free-form parameters, after templating and overrides.
    pub params: &'a Value,
    /// Input names (values are resolved later, at run time).
    pub inputs: Vec<&'a str>,
    /// Declared outputs: name → path relative to the stage's output directory.
    pub outputs: &'a BTreeMap<String, String>,
    /// The command line, for ops that take one (`cmd`).
    pub cmd: Option<&'a str>,
    /// The ranks a launched stage runs (`resources.launch`: nodes × ranks per node); `None`
    /// for a stage that is not launched.
    pub world_size: Option<u64>,
    /// The machines a launched stage runs on (`resources.nodes`); `None` for a stage that is
    /// not launched.
    pub nodes: Option<u64>,
}

/// A problem with a stage declaration, located by a path inside the stage
/// (for example `["params", "n"]` or `["cmd"]`) so the engine can point at the manifest.
#[derive(Debug, Clone, PartialEq)]
pub struct DeclError {
    pub path: Vec<String>,
    pub message: String,
    pub help: Option<String>,
}

impl DeclError {
    pub fn new(path: &[&str], message: impl Into<String>) -> Self {
        DeclError {
            path: path.iter().map(|s| s.to_string()).collect(),
            message: message.into(),
            help: None,
        }
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }
}

/// Why a stage failed while running: a message, what to do about it, and the error it came
/// from. Its `Display` is the message, then `help: …` on a line of its own when there is help.
///
/// Any error converts into it with `?`, keeping the error as its source (as `anyhow::Error`
/// does; for that, `RunError` itself does not implement `std::error::Error`).
#[derive(Debug)]
pub struct RunError {
    pub message: String,
    pub help: Option<String>,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

impl RunError {
    pub fn new(message: impl Into<String>) -> Self {
        RunError {
            message: message.into(),
            help: None,
            source: None,
        }
    }

    pub fn with_help(mut self, help: impl Into<String>) -> Self {
        self.help = Some(help.into());
        self
    }

    /// The error this one came from, if any.
    pub fn source(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
    }
}

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)?;
        if let Some(help) = &self.help {
            write!(f, "\n  help: {help}")?;
        }
        Ok(())
    }
}

impl<E: std::error::Error + Send + Sync + 'static> From<E> for RunError {
    fn from(e: E) -> Self {
        RunError {
            message: e.to_string(),
            help: None,
            source: Some(Box::new(e)),
        }
    }
}

/// What an op gets when it runs: resolved inputs and a private, empty output directory, and
/// the two channels back to the engine besides its outputs: the log and progress.
pub struct RunContext<'a> {
    pub stage: StageDecl<'a>,
    /// Input name → absolute path of a file or directory (a source file or an upstream output).
    pub inputs: &'a BTreeMap<String, PathBuf>,
    /// The directory outputs are written to; it is published atomically after `run` returns Ok.
    pub out_dir: &'a Path,
    /// The stage's log: everything written here is kept next to the artifact and shown live.
    pub log: &'a mut dyn Write,
    /// How far the stage has come (training steps); the engine draws it as a progress bar.
    pub progress: &'a mut dyn FnMut(Progress),
    /// End a resumable stage after this step's checkpoint, failing it as a preemption would
    /// (drills and tests of resume: `NEMO_DAG_STOP_AFTER_STEP`, read by the engine).
    pub stop_after_step: Option<u64>,
    /// The argv that starts a program once per rank (`srun …`, `torchrun …`), the program's
    /// own argv following it; empty: the program runs once, here. Set by the engine from the
    /// stage's `resources.launch`; an op starts its work through [`RunContext::command`].
    pub launcher: &'a [String],
    /// Where the op trains, as the engine resolved the stage's `resources.device` for this
    /// machine and op: [`Device::Cpu`]; [`Device::Cuda`], a GPU the engine found usable and
    /// the op must train on (or fail); or [`Device::Auto`], GPU 0 found usable, to train on
    /// when the op can, and else on the CPU, saying why in its log. Always `Cpu` for an op
    /// whose [`Spec::gpu`] is false.
    pub device: Device,
}

impl RunContext<'_> {
    /// A command that runs `program` once per rank under the stage's launcher, or once when
    /// the stage has none. Arguments added to it go to `program`.
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> std::process::Command {
        match self.launcher.split_first() {
            Some((launcher, args)) => {
                let mut command = std::process::Command::new(launcher);
                command.args(args).arg(program);
                command
            }
            None => std::process::Command::new(program),
        }
    }
}

/// How far a stage has come: `done` of `total` steps, and a one-line summary of the latest
/// figures (`loss 2.1234 | lr 1.0e-3`).
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    pub done: u64,
    pub total: u64,
    pub message: String,
}

impl Progress {
    /// What starts a progress line on a stage process's stderr.
    pub const PREFIX: &'static str = "nemo-dag:progress ";

    /// The line a stage process writes to its stderr (never to its log):
    /// `nemo-dag:progress 20/300 loss 2.1234 | lr 1.0e-3`.
    pub fn to_line(&self) -> String {
        format!(
            "{}{}/{} {}",
            Self::PREFIX,
            self.done,
            self.total,
            self.message
        )
    }

    /// The progress a line of [`Progress::to_line`] carries; `None` for any other line.
    pub fn from_line(line: &str) -> Option<Progress> {
        let rest = line.strip_prefix(Self::PREFIX)?;
        let (counts, message) = rest.split_once(' ').unwrap_or((rest, ""));
        let (done, total) = counts.split_once('/')?;
        Some(Progress {
            done: done.parse().ok()?,
            total: total.parse().ok()?,
            message: message.to_string(),
        })
    }
}

/// Numbers and facts an op reports about its run; stored as `metrics` in `artifact.json`.
pub type Metrics = serde_json::Map<String, Value>;

/// What an op is, declared once: the engine lists it (`nemo-dag ops`) and checks every stage
/// of the op against it (input names, outputs) before the op's own [`Op::check`] runs.
#[derive(Debug)]
pub struct Spec {
    /// The name used in manifests (`op: cmd`).
    pub name: &'static str,
    /// Bumped whenever the op's output for the same inputs changes; part of every key.
    pub version: u32,
    /// One line for `nemo-dag ops`.
    pub summary: &'static str,
    /// The inputs the op reads by name.
    pub inputs: &'static [Port],
    /// Whether a stage may name inputs besides [`Spec::inputs`], and what they are (the
    /// datasets of `tokenize`, the placeholders of `cmd`); `None`: it may not.
    pub other_inputs: Option<&'static str>,
    pub outputs: Outputs,
    /// Whether the op can continue from what an interrupted attempt left in its output
    /// directory (training checkpoints). Others start from an empty directory every time.
    pub resumable: bool,
    /// Whether the op starts its work once per rank of the stage's `resources.launch`, under
    /// [`RunContext::launcher`] (through [`RunContext::command`], or, as the Megatron ops do,
    /// at the head of a script it writes). Any other op refuses `launch` when the manifest
    /// loads, instead of quietly running once.
    pub launched: bool,
    /// Whether the op runs on a GPU when its stage's `resources.device` asks for one
    /// (`cuda`, or `auto` where one is found; [`RunContext::device`]). The engine refuses
    /// `cuda` for any other op, since it would run on the CPU.
    pub gpu: bool,
}

/// One named input of an op.
#[derive(Debug)]
pub struct Port {
    pub name: &'static str,
    /// A stage without it is refused; an optional one is read when present.
    pub required: bool,
    /// What it is, for `nemo-dag ops` and error messages.
    pub what: &'static str,
}

/// Where an op's outputs come from.
#[derive(Debug)]
pub enum Outputs {
    /// The op names them: name → path inside the output directory. A stage may not declare
    /// outputs of its own.
    Fixed(&'static [(&'static str, &'static str)]),
    /// The stage declares them (`cmd`).
    Declared,
}

/// An op, as its author writes it: its spec, and `check` and `run` over its typed params. The
/// blanket [`AnyOp`] impl parses the params once, in `check`, and hands `run` exactly the value
/// `check` approved.
pub trait Op: Sync {
    /// The op's parameters (`#[serde(deny_unknown_fields)]`, so a misspelt one is an error at
    /// its path in the manifest).
    type Params: DeserializeOwned + Send + Sync + 'static;
    /// The op's declaration.
    fn spec(&self) -> &'static Spec;
    /// Validate the declaration before anything runs (the engine has already checked the
    /// input names and outputs against the spec).
    fn check(&self, params: &Self::Params, stage: &StageDecl) -> Result<(), DeclError>;
    /// Produce every output under `ctx.out_dir`.
    fn run(&self, params: &Self::Params, ctx: &mut RunContext) -> Result<Metrics, RunError>;
    /// The container image the stage's ranks run in, when the op names one. It comes from the
    /// params, so it is part of the stage's key: the image is the software that ran. A launch
    /// under Slurm starts the ranks in it instead of the profile's image.
    fn image(&self, _params: &Self::Params) -> Option<String> {
        None
    }
    /// Whether the op's params can name its image ([`Op::image`]): its software is the
    /// image's. A stage of such an op that names none would run in whatever image the
    /// executor's profile gives, which is not in the key, so the engine refuses that.
    fn names_image(&self) -> bool {
        false
    }
    /// For `run --dry-run`: the script a run of the stage will write and run, with what does
    /// not exist yet (its inputs, its attempt directory) named, when the op has one to show.
    /// `launcher` is the argv that will start it once per rank ([`RunContext::launcher`]).
    fn preview(
        &self,
        _params: &Self::Params,
        _stage: &StageDecl,
        _launcher: &[String],
    ) -> Option<String> {
        None
    }
    /// What the stage will hand downstream and what it will cost, from its params, its
    /// upstream's facts and its declaration (a launched stage's ranks); called on checked
    /// params. Ops that cost little plan nothing.
    fn plan(&self, params: &Self::Params, upstream: &Upstream, stage: &StageDecl) -> Plan {
        let _ = (params, upstream, stage);
        Plan::default()
    }
    /// Refuse a declaration that cannot work with what the stages above will hand it (a
    /// sequence length that is not the packed rows' length), from their facts: called on
    /// checked params when the manifest loads, so the error points at the manifest before
    /// anything runs.
    fn check_upstream(&self, params: &Self::Params, upstream: &Upstream) -> Result<(), DeclError> {
        let _ = (params, upstream);
        Ok(())
    }
}

/// What a successful [`AnyOp::check`] approved (the op's parsed params), for [`AnyOp::run`].
pub struct Checked(Box<dyn std::any::Any + Send + Sync>);

impl fmt::Debug for Checked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Checked(..)")
    }
}

/// An op as the engine holds it (`&dyn AnyOp` in the [`Registry`]): every [`Op`] is one.
pub trait AnyOp: Sync {
    fn spec(&self) -> &'static Spec;
    /// Parse the params and validate the declaration.
    fn check(&self, stage: &StageDecl) -> Result<Checked, DeclError>;
    /// Run with what `check` approved for this same stage.
    fn run(&self, checked: &Checked, ctx: &mut RunContext) -> Result<Metrics, RunError>;
    /// Plan with what `check` approved for this same stage ([`Op::plan`]).
    fn plan(&self, checked: &Checked, upstream: &Upstream, stage: &StageDecl) -> Plan;
    /// Check what `check` approved against the upstream's facts ([`Op::check_upstream`]).
    fn check_upstream(&self, checked: &Checked, upstream: &Upstream) -> Result<(), DeclError>;
    /// The container image the stage names through its params ([`Op::image`]).
    fn image(&self, checked: &Checked) -> Option<String>;
    /// Whether the op's params can name its image ([`Op::names_image`]).
    fn names_image(&self) -> bool;
    /// What a run of the stage will execute ([`Op::preview`]).
    fn preview(&self, checked: &Checked, stage: &StageDecl, launcher: &[String]) -> Option<String>;

    fn name(&self) -> &'static str {
        self.spec().name
    }
    fn version(&self) -> u32 {
        self.spec().version
    }
    fn summary(&self) -> &'static str {
        self.spec().summary
    }
    fn resumable(&self) -> bool {
        self.spec().resumable
    }
    /// The outputs a stage of the op produces: name → path relative to the output directory.
    fn outputs(&self, stage: &StageDecl) -> BTreeMap<String, String> {
        match self.spec().outputs {
            Outputs::Fixed(list) => list
                .iter()
                .map(|(n, p)| (n.to_string(), p.to_string()))
                .collect(),
            Outputs::Declared => stage.outputs.clone(),
        }
    }
}

impl<T: Op> AnyOp for T {
    fn spec(&self) -> &'static Spec {
        Op::spec(self)
    }

    fn check(&self, stage: &StageDecl) -> Result<Checked, DeclError> {
        let params: T::Params = typed_params(stage.params)?;
        Op::check(self, &params, stage)?;
        Ok(Checked(Box::new(params)))
    }

    fn run(&self, checked: &Checked, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let params = checked.0.downcast_ref::<T::Params>().ok_or_else(|| {
            RunError::new(format!(
                "{}: run was given what another op's check approved",
                Op::spec(self).name
            ))
        })?;
        Op::run(self, params, ctx)
    }

    fn plan(&self, checked: &Checked, upstream: &Upstream, stage: &StageDecl) -> Plan {
        match checked.0.downcast_ref::<T::Params>() {
            Some(params) => Op::plan(self, params, upstream, stage),
            None => Plan::default(),
        }
    }

    fn check_upstream(&self, checked: &Checked, upstream: &Upstream) -> Result<(), DeclError> {
        match checked.0.downcast_ref::<T::Params>() {
            Some(params) => Op::check_upstream(self, params, upstream),
            None => Ok(()),
        }
    }

    fn image(&self, checked: &Checked) -> Option<String> {
        Op::image(self, checked.0.downcast_ref::<T::Params>()?)
    }

    fn names_image(&self) -> bool {
        Op::names_image(self)
    }

    fn preview(&self, checked: &Checked, stage: &StageDecl, launcher: &[String]) -> Option<String> {
        Op::preview(
            self,
            checked.0.downcast_ref::<T::Params>()?,
            stage,
            launcher,
        )
    }
}

/// Parse an op's `params` into its typed struct; an unknown or mistyped field becomes a
/// [`DeclError`] at its path (`params.vocab_size`), which the engine points at in the manifest.
pub fn typed_params<T: DeserializeOwned>(params: &Value) -> Result<T, DeclError> {
    serde_path_to_error::deserialize(params).map_err(|e| {
        let mut path = vec!["params".to_string()];
        for seg in e.path().iter() {
            match seg {
                serde_path_to_error::Segment::Map { key } => path.push(key.clone()),
                serde_path_to_error::Segment::Seq { index } => path.push(index.to_string()),
                _ => {}
            }
        }
        let message = format!("{}: {}", path.join("."), e.into_inner());
        DeclError {
            path,
            message,
            help: None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;
    use serde_json::json;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct EchoParams {
        n: u32,
    }

    /// Writes its `n` into the metrics; refuses `n: 0` in its own check.
    struct Echo;

    static ECHO: Spec = Spec {
        name: "echo",
        version: 1,
        summary: "test op",
        inputs: &[],
        other_inputs: None,
        outputs: Outputs::Fixed(&[("out", "out.txt")]),
        resumable: false,
        launched: false,
        gpu: false,
    };

    impl Op for Echo {
        type Params = EchoParams;
        fn spec(&self) -> &'static Spec {
            &ECHO
        }
        fn check(&self, p: &EchoParams, _: &StageDecl) -> Result<(), DeclError> {
            if p.n == 0 {
                return Err(DeclError::new(&["params", "n"], "n must be > 0"));
            }
            Ok(())
        }
        fn run(&self, p: &EchoParams, _: &mut RunContext) -> Result<Metrics, RunError> {
            Ok(Metrics::from_iter([("n".to_string(), json!(p.n))]))
        }
    }

    /// Another op, to hand Echo's approved params to.
    struct Other;

    impl Op for Other {
        type Params = Value;
        fn spec(&self) -> &'static Spec {
            &ECHO
        }
        fn check(&self, _: &Value, _: &StageDecl) -> Result<(), DeclError> {
            Ok(())
        }
        fn run(&self, _: &Value, _: &mut RunContext) -> Result<Metrics, RunError> {
            Ok(Metrics::new())
        }
    }

    fn run(op: &dyn AnyOp, checked: &Checked) -> Result<Metrics, RunError> {
        let (inputs, mut log) = (BTreeMap::new(), Vec::new());
        let params = json!({});
        let outputs = BTreeMap::new();
        let mut ctx = RunContext {
            stage: StageDecl {
                name: "s",
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
            device: Device::Cpu,
        };
        op.run(checked, &mut ctx)
    }

    #[test]
    fn a_command_runs_under_the_stage_launcher() {
        let (inputs, outputs, params) = (BTreeMap::new(), BTreeMap::new(), json!({}));
        let mut log = Vec::new();
        let launcher = ["srun".to_string(), "--ntasks=2".to_string()];
        let mut ctx = RunContext {
            stage: StageDecl {
                name: "s",
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
            launcher: &launcher,
            device: Device::Cpu,
        };
        let argv = |c: &std::process::Command| -> Vec<String> {
            std::iter::once(c.get_program())
                .chain(c.get_args())
                .map(|a| a.to_string_lossy().into_owned())
                .collect()
        };
        let mut launched = ctx.command("sh");
        launched.args(["-c", "true"]);
        assert_eq!(argv(&launched), ["srun", "--ntasks=2", "sh", "-c", "true"]);
        ctx.launcher = &[];
        let mut once = ctx.command("sh");
        once.args(["-c", "true"]);
        assert_eq!(argv(&once), ["sh", "-c", "true"]);
    }

    #[test]
    fn any_error_becomes_a_run_error_with_question_mark_and_stays_its_source() {
        fn fails() -> Result<(), RunError> {
            Err(std::io::Error::other("disk on fire"))?;
            Ok(())
        }
        let e = fails().unwrap_err();
        assert_eq!(e.message, "disk on fire");
        assert_eq!(
            e.source().map(|s| s.to_string()).as_deref(),
            Some("disk on fire")
        );
        let e = RunError::new("no model").with_help("add `inputs: {model: …}`");
        assert_eq!(e.to_string(), "no model\n  help: add `inputs: {model: …}`");
    }

    #[test]
    fn check_parses_the_params_once_and_run_gets_what_it_approved() {
        let decl = |params: &Value| -> Result<Checked, DeclError> {
            let outputs = BTreeMap::new();
            AnyOp::check(
                &Echo,
                &StageDecl {
                    name: "s",
                    params,
                    inputs: vec![],
                    outputs: &outputs,
                    cmd: None,
                    world_size: None,
                    nodes: None,
                },
            )
        };
        let checked = decl(&json!({"n": 3})).unwrap();
        // The context's own params are ignored: run reads what check approved.
        assert_eq!(run(&Echo, &checked).unwrap()["n"], 3);
        let misspelt = decl(&json!({"m": 3})).unwrap_err();
        assert_eq!(misspelt.path, ["params", "m"]);
        let refused = decl(&json!({"n": 0})).unwrap_err();
        assert_eq!(refused.message, "n must be > 0");
        // What one op approved is no other op's params: an error, not a panic.
        let err = run(&Other, &checked).unwrap_err();
        assert!(err.message.contains("another op's check"), "{err}");
        let other = AnyOp::check(
            &Other,
            &StageDecl {
                name: "s",
                params: &json!({}),
                inputs: vec![],
                outputs: &BTreeMap::new(),
                cmd: None,
                world_size: None,
                nodes: None,
            },
        )
        .unwrap();
        let err = run(&Echo, &other).unwrap_err();
        assert!(err.message.contains("another op's check"), "{err}");
    }

    #[test]
    fn progress_lines_round_trip_and_other_lines_are_not_progress() {
        let p = Progress {
            done: 20,
            total: 300,
            message: "loss 2.1234 | lr 1.000e-3".into(),
        };
        assert_eq!(
            p.to_line(),
            "nemo-dag:progress 20/300 loss 2.1234 | lr 1.000e-3"
        );
        assert_eq!(Progress::from_line(&p.to_line()), Some(p));
        let bare = Progress {
            done: 3,
            total: 3,
            message: String::new(),
        };
        assert_eq!(Progress::from_line(&bare.to_line()), Some(bare));
        for other in [
            "step     20/300 | loss 2.1234",
            "nemo-dag:progress x/3 loss",
            "resuming from the checkpoint at step 3",
            "",
        ] {
            assert_eq!(Progress::from_line(other), None, "{other}");
        }
    }
}
