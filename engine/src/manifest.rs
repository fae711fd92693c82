//! Loading a manifest: file → vars → Jinja → parse → variant merge → overrides → typed,
//! validated stages in dependency order.
//!
//! The steps, in order (each error points at the text that caused it, exit code 2):
//! 1. Read the `vars:` block of the manifest (and of the `-c` variant). It is plain data,
//!    read before templating, so it cannot itself use Jinja.
//! 2. Apply `vars.*=…` overrides to those vars.
//! 3. Render the manifest (and the variant) with minijinja, `vars` as the context; an undefined
//!    variable is an error, never an empty string.
//! 4. Parse YAML or TOML into one tree ([`crate::doc`]) and deep-merge the variant over it.
//! 5. Apply every other `KEY.PATH=VALUE` override; the key must already exist.
//! 6. Deserialize into typed stages (unknown fields are errors), resolve inputs (a file
//!    relative to the manifest, or `STAGE:OUTPUT`), let each op check its declaration,
//!    and order the stages, naming the whole cycle if there is one.

use crate::diag::{InputError, Source};
use crate::doc::{self, Format, KeyPath, Spans};
use nemo_dag_op::{AnyOp, DEVICE_FORMS, DeclError, Device, Outputs, Registry, Spec, StageDecl};
use petgraph::graph::{DiGraph, NodeIndex};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The longest stage name, in characters: names are table columns (`status`, `graph`), file
/// and job names.
pub const MAX_STAGE_NAME: usize = 128;

/// The largest manifest or variant file, and the largest text its template renders to: a
/// recipe is kilobytes, and every later step (parse, spans, the compiled-tree cache) costs
/// memory in proportion.
pub const MAX_MANIFEST_BYTES: usize = 8 << 20;

/// The work a template may do while rendering, in minijinja's fuel: one unit per
/// instruction, and one per 64 bytes of data it makes, checked before a known-size
/// allocation. A thousand-stage loop takes a few tens of thousands; this stops two nested
/// `range(100000)` loops, or `"a" * 100000000`, within a second.
pub const TEMPLATE_FUEL: u64 = 1_000_000;

/// What the command line says about which manifest to load and how.
#[derive(Debug, Clone)]
pub struct LoadArgs {
    pub path: PathBuf,
    /// The ops a stage may name (the `nemo-dag` binary's registry).
    pub ops: Registry,
    pub variant: Option<String>,
    pub overrides: Vec<String>,
    /// Where compiled trees are remembered (`<store>/cache/manifests`), if anywhere.
    pub cache_dir: Option<PathBuf>,
    /// Remember this manifest's compiled tree there (commands that write: `run`).
    pub write_cache: bool,
}

impl LoadArgs {
    /// Load `path` as it is: no variant, no overrides, no compiled-tree cache.
    pub fn new(path: impl Into<PathBuf>, ops: Registry) -> Self {
        LoadArgs {
            path: path.into(),
            ops,
            variant: None,
            overrides: Vec::new(),
            cache_dir: None,
            write_cache: false,
        }
    }
}

/// A manifest's tree after templating, merging and overrides, remembered by `run` so that
/// later commands skip Jinja and YAML when none of what the tree depends on changed: the
/// manifest's text, the variant's, the overrides, and the engine version. Validation still runs
/// every time; any error falls back to a full load, for the diagnostic with its source.
#[derive(Serialize, Deserialize)]
struct CompiledTree {
    key: String,
    tree: Value,
}

#[derive(Debug)]
pub struct Manifest {
    /// Absolute path of the manifest file.
    pub path: PathBuf,
    /// The directory input paths are relative to.
    pub dir: PathBuf,
    /// The variant file merged over the base, if any.
    pub variant: Option<PathBuf>,
    pub overrides: Vec<String>,
    pub vars: Value,
    pub stages: BTreeMap<String, Stage>,
    /// Stage names, every stage after the stages it consumes.
    pub order: Vec<String>,
    locator: Locator,
    /// Every stage's plan, made when the manifest loads ([`Manifest::plans`]).
    plans: BTreeMap<String, nemo_dag_op::Plan>,
}

pub struct Stage {
    pub name: String,
    pub op: &'static dyn AnyOp,
    pub params: Value,
    pub inputs: BTreeMap<String, Input>,
    pub outputs: BTreeMap<String, String>,
    pub cmd: Option<String>,
    pub resources: Resources,
    /// Upstream stage names, sorted, without repeats.
    pub deps: Vec<String>,
    /// Where the stage sits in a sweep, when it is one copy of a swept stage.
    pub sweep: Option<crate::sweep::Point>,
}

impl std::fmt::Debug for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stage")
            .field("name", &self.name)
            .field("op", &self.op.name())
            .field("params", &self.params)
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish_non_exhaustive()
    }
}

impl Stage {
    pub fn decl(&self) -> StageDecl<'_> {
        StageDecl {
            name: &self.name,
            params: &self.params,
            inputs: self.inputs.keys().map(String::as_str).collect(),
            outputs: &self.outputs,
            cmd: self.cmd.as_deref(),
            world_size: self.resources.launch().map(|l| l.world_size()),
            nodes: self.resources.launch().map(|l| u64::from(l.nodes)),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// A file or directory, as written in the manifest and resolved against its directory.
    File { written: String, path: PathBuf },
    /// An output of another stage.
    Stage { stage: String, output: String },
}

/// What a stage asks of the machine. Used by executors; never part of a key.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    pub cpus: Option<u32>,
    pub gpus: Option<u32>,
    pub mem: Option<Value>,
    pub time: Option<Value>,
    pub nodes: Option<u32>,
    /// Ranks per node of a launched stage (torchrun's `--nproc-per-node`); needs `launch`.
    pub ntasks_per_node: Option<u32>,
    /// What starts the command once per rank: `none` (the default), `torchrun` or `srun`
    /// ([`crate::launch`]).
    pub launch: Option<String>,
    pub device: Option<String>,
    /// Let the cluster requeue the job after a node failure or preemption.
    pub requeue: Option<bool>,
}

/// The largest `cpus` a stage may ask for.
const MAX_CPUS: u32 = 10_000;
/// The most `gpus` (per node) a stage may ask for.
const MAX_GPUS: u32 = 1_024;
/// The most `nodes` a stage may ask for.
const MAX_NODES: u32 = 100_000;
/// The largest `mem`, in bytes: 64 TiB.
const MAX_MEM: u64 = 64 << 40;

impl Resources {
    /// The wall-clock limit `time` sets, if any. Checked when the manifest loads, so a
    /// loaded stage's `time` is always one.
    pub fn time_limit(&self) -> Option<std::time::Duration> {
        self.time
            .as_ref()
            .and_then(|t| crate::duration::parse(t).ok())
    }

    /// The memory `mem` asks for, in bytes, if any (`Some(0)`: Slurm's "all of a node's").
    pub fn mem_bytes(&self) -> Option<u64> {
        self.mem.as_ref().and_then(|m| parse_mem(m).ok())
    }

    /// The ranks `launch` starts, if any. Checked when the manifest loads.
    pub fn launch(&self) -> Option<crate::launch::Launch> {
        crate::launch::Launch::of(self)
    }

    /// The first field that is not a sensible request, and why.
    fn check(&self) -> Result<(), (&'static str, String)> {
        within("cpus", self.cpus, 1, MAX_CPUS)?;
        within("gpus", self.gpus, 0, MAX_GPUS)?;
        within("nodes", self.nodes, 1, MAX_NODES)?;
        if let Some(mem) = &self.mem {
            parse_mem(mem).map_err(|why| ("mem", why))?;
        }
        if let Some(time) = &self.time {
            crate::duration::parse(time).map_err(|why| ("time", why))?;
        }
        match self.device.as_deref() {
            Some(d) if d.trim().is_empty() => {
                return Err((
                    "device",
                    format!("is empty: write {DEVICE_FORMS}, or leave it out"),
                ));
            }
            Some(d) => {
                Device::parse(d).map_err(|why| ("device", why))?;
            }
            None => {}
        }
        Ok(())
    }
}

fn within(
    field: &'static str,
    value: Option<u32>,
    min: u32,
    max: u32,
) -> Result<(), (&'static str, String)> {
    match value {
        Some(v) if v < min => Err((field, format!("{v}: it takes at least {min}"))),
        Some(v) if v > max => Err((field, format!("{v}: it takes at most {max}"))),
        _ => Ok(()),
    }
}

/// Slurm's `--mem`: megabytes, or a whole number with a unit K, M, G or T; 0 is all of a
/// node's memory. Returns bytes.
fn parse_mem(value: &Value) -> Result<u64, String> {
    let text = scalar_text(value);
    let not_a_size = || {
        format!(
            "`{text}` is not a memory size: write megabytes (`512`) or a whole number with K, M, G or T (`16G`), as Slurm's --mem takes"
        )
    };
    let (digits, unit) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => (&text[..i], c.to_ascii_uppercase()),
        _ => (text.as_str(), 'M'),
    };
    let shift = match unit {
        'K' => 10,
        'M' => 20,
        'G' => 30,
        'T' => 40,
        _ => return Err(not_a_size()),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(not_a_size());
    }
    let bytes = digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .filter(|b| *b <= MAX_MEM);
    bytes.ok_or_else(|| format!("`{text}`: it takes at most {}T", MAX_MEM >> 40))
}

/// A scalar as the text it was written as (`90`, `16G`).
fn scalar_text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawManifest {
    #[serde(default)]
    #[allow(dead_code)]
    vars: Value,
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    stages: BTreeMap<String, RawStage>,
}

#[derive(Deserialize, Clone)]
#[serde(deny_unknown_fields)]
struct RawStage {
    op: String,
    #[serde(default = "empty_object")]
    params: Value,
    #[serde(default)]
    inputs: BTreeMap<String, String>,
    #[serde(default)]
    outputs: BTreeMap<String, String>,
    cmd: Option<String>,
    #[serde(default)]
    resources: Resources,
    /// Values to sweep ([`crate::sweep`]), checked there for the error's place.
    #[serde(default)]
    matrix: Option<Value>,
    #[serde(default)]
    #[allow(dead_code)]
    description: Option<String>,
    /// Set on a sweep's copies: where it sits, and which copy of each swept upstream stage
    /// its inputs read.
    #[serde(skip)]
    point: Option<crate::sweep::Point>,
    #[serde(skip)]
    reads: BTreeMap<String, String>,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// The texts a loaded manifest came from, to point errors at them. Spans are computed
/// only when an error needs them (a second parse), keeping the common path fast.
#[derive(Debug)]
struct Document {
    source: Source,
    format: Format,
    spans: std::sync::OnceLock<Spans>,
}

impl Document {
    fn spans(&self) -> &Spans {
        self.spans.get_or_init(|| {
            doc::parse(self.format, &self.source.text, true)
                .map(|(_, spans)| spans)
                .unwrap_or_default()
        })
    }
}

#[derive(Debug, Default)]
struct Locator {
    docs: Vec<Document>, // base first, then the variant
    /// The arguments, and the nodes overrides set: (key path, index of the override).
    command_line: Option<CommandLine>,
    overridden: Vec<(KeyPath, usize)>,
}

impl Locator {
    /// An error pointing at `path`: at the override that set it (or a node above it), else
    /// in the variant if it sets that node, else the base.
    fn error(&self, path: &[String], want_key: bool, message: impl Into<String>) -> InputError {
        let err = InputError::new(message);
        let set_by = self
            .overridden
            .iter()
            .rev()
            .find(|(set, _)| path.starts_with(set));
        if let (Some((_, index)), Some(command_line)) = (set_by, &self.command_line) {
            return command_line.at_override(*index, err);
        }
        let exact = self
            .docs
            .iter()
            .rev()
            .find_map(|d| d.spans().get(path).map(|s| (d, s)));
        if let Some((doc, span)) = exact {
            let range = if want_key && !span.key.is_empty() {
                span.key.clone()
            } else {
                span.value.clone()
            };
            return err.at(&doc.source, range, "here");
        }
        match self
            .docs
            .iter()
            .rev()
            .find_map(|d| d.spans().nearest(path, want_key).map(|r| (d, r)))
        {
            Some((doc, range)) => err.at(&doc.source, range, "here"),
            None => err,
        }
    }
}

impl Manifest {
    /// The manifest's name: its file's, without the extension (`super3`).
    pub fn name(&self) -> &str {
        self.path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("manifest")
    }

    /// Every stage's plan: what it hands downstream and its estimate ([`crate::estimate`]).
    pub fn plans(&self) -> &BTreeMap<String, nemo_dag_op::Plan> {
        &self.plans
    }

    /// A stage's estimate of what it needs, when its op makes one.
    pub fn estimate(&self, stage: &str) -> Option<&nemo_dag_op::Estimate> {
        self.plans().get(stage).and_then(|p| p.estimate.as_ref())
    }

    /// The stages named on the command line: a stage by its name, a swept stage by its
    /// declared name (every copy of it), in the order given.
    pub fn expand_names(&self, names: &[String], flag: &str) -> Result<Vec<String>, InputError> {
        let mut out = Vec::new();
        for name in names {
            if self.stages.contains_key(name) {
                out.push(name.clone());
                continue;
            }
            let copies: Vec<String> = self
                .order
                .iter()
                .filter(|s| {
                    self.stages[*s]
                        .sweep
                        .as_ref()
                        .is_some_and(|p| &p.base == name)
                })
                .cloned()
                .collect();
            if copies.is_empty() {
                return Err(InputError::new(format!(
                    "{flag} {name}: the manifest has no stage `{name}`"
                ))
                .help(crate::diag::did_you_mean(
                    name,
                    "stages",
                    self.order.iter().map(String::as_str),
                )));
            }
            out.extend(copies);
        }
        Ok(out)
    }

    /// An error pointing at a node of this manifest.
    pub fn error_at(&self, path: &[&str], message: impl Into<String>) -> InputError {
        let mut path: KeyPath = path.iter().map(|s| s.to_string()).collect();
        // A sweep's copy is declared under its base name.
        if path.len() > 1
            && path[0] == "stages"
            && let Some(point) = self.stages.get(&path[1]).and_then(|s| s.sweep.as_ref())
        {
            path[1] = point.base.clone();
        }
        self.locator.error(&path, false, message)
    }

    pub fn load(args: &LoadArgs) -> Result<Manifest, InputError> {
        let path = std::path::absolute(&args.path)
            .map_err(|e| InputError::new(format!("cannot resolve {}: {e}", args.path.display())))?;
        let base = read_source(&path)?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let command_line = CommandLine::new(args);
        let variant_path = args
            .variant
            .as_deref()
            .map(|v| find_variant(&path, v))
            .transpose()
            .map_err(|e| command_line.at_variant(e))?;
        let variant = variant_path
            .as_deref()
            .map(read_source)
            .transpose()
            .map_err(|e| command_line.at_variant(e))?;

        let tree_key = {
            let mut h = blake3::Hasher::new();
            h.update(b"nemo-dag compiled tree v1\0");
            h.update(env!("CARGO_PKG_VERSION").as_bytes());
            for text in [Some(&base.text), variant.as_ref().map(|v| &v.text)] {
                h.update(b"\0");
                h.update(text.map(|t| t.as_bytes()).unwrap_or(b"-"));
            }
            for o in &args.overrides {
                h.update(b"\0");
                h.update(o.as_bytes());
            }
            h.finalize().to_hex().to_string()
        };
        let cache_file = args.cache_dir.as_ref().map(|d| {
            let id = blake3::hash(format!("{}\n{:?}", path.display(), variant_path).as_bytes());
            d.join(format!("{}.json", &id.to_hex()[..16]))
        });
        if let Some(file) = &cache_file
            && let Some(cached) = std::fs::read(file)
                .ok()
                .and_then(|b| serde_json::from_slice::<CompiledTree>(&b).ok())
                .filter(|c| c.key == tree_key)
            && let Ok(m) = Manifest::from_tree(
                path.clone(),
                dir.clone(),
                variant_path.clone(),
                args,
                &cached.tree,
                Locator::default(),
            )
        {
            return Ok(m);
        }

        // 1–2. vars: base, then the variant's, then `vars.*` overrides.
        let (var_overrides, overrides): (Vec<_>, Vec<_>) = args
            .overrides
            .iter()
            .enumerate()
            .partition(|(_, o)| o.starts_with("vars."));
        let mut vars = extract_vars(&base)?;
        if let Some(v) = &variant {
            merge(&mut vars, extract_vars(v)?);
        }
        let mut vars_doc = serde_json::json!({ "vars": vars });
        let mut overridden = Vec::new();
        for (index, o) in var_overrides {
            let set =
                apply_override(&mut vars_doc, o).map_err(|e| command_line.at_override(index, e))?;
            overridden.push((set, index));
        }
        let vars = vars_doc["vars"].take();

        // 3–4. render, parse, merge.
        let mut locator = Locator::default();
        let mut tree = render_and_parse(&base, &vars, &mut locator)?;
        if let Some(v) = &variant {
            let over = render_and_parse(v, &vars, &mut locator)?;
            merge(&mut tree, over);
        }
        if !tree.is_object() {
            return Err(locator
                .error(&[], false, "a manifest must be a mapping with a `stages:` section")
                .help("start from: `stages:\n  hello: {op: cmd, outputs: {o: o.txt}, cmd: \"echo hi > {outputs.o}\"}`"));
        }

        // 5. overrides of any other key.
        for (index, o) in overrides {
            let set =
                apply_override(&mut tree, o).map_err(|e| command_line.at_override(index, e))?;
            overridden.push((set, index));
        }
        locator.command_line = Some(command_line);
        locator.overridden = overridden;
        if let Some(map) = tree.as_object_mut()
            && (map.contains_key("vars") || !vars.is_null())
        {
            map.insert("vars".into(), vars.clone());
        }
        let manifest = Manifest::from_tree(path, dir, variant_path, args, &tree, locator)?;
        if args.write_cache
            && let Some(file) = &cache_file
            && let Ok(bytes) = serde_json::to_vec(&CompiledTree {
                key: tree_key,
                tree,
            })
        {
            let _ = crate::store::write_atomic(file, &bytes, false);
        }
        Ok(manifest)
    }

    /// 6. Typed stages from the final tree.
    fn from_tree(
        path: PathBuf,
        dir: PathBuf,
        variant: Option<PathBuf>,
        args: &LoadArgs,
        tree: &Value,
        locator: Locator,
    ) -> Result<Manifest, InputError> {
        // The plain deserializer is fast; only on an error do we walk again to learn the path.
        let raw: RawManifest = match RawManifest::deserialize(tree) {
            Ok(raw) => raw,
            Err(_) => serde_path_to_error::deserialize(tree).map_err(|e| {
                let path: KeyPath = e
                    .path()
                    .iter()
                    .filter_map(|seg| match seg {
                        serde_path_to_error::Segment::Map { key } => Some(key.clone()),
                        serde_path_to_error::Segment::Seq { index } => Some(index.to_string()),
                        _ => None,
                    })
                    .collect();
                let inner = e.into_inner().to_string();
                let help = inner.contains("unknown field").then(|| {
                    "check the spelling; see docs/manifest.md for every field a stage takes"
                        .to_string()
                });
                locator
                    .error(&path, true, schema_message(&path, &inner))
                    .maybe_help(help)
            })?,
        };
        let mut manifest = Manifest {
            path,
            dir,
            variant,
            overrides: args.overrides.clone(),
            vars: tree.get("vars").cloned().unwrap_or(Value::Null),
            stages: BTreeMap::new(),
            order: Vec::new(),
            locator,
            plans: BTreeMap::new(),
        };
        let stages = manifest.expand_sweeps(raw.stages)?;
        manifest.build_stages(stages, args.ops)?;
        manifest.order = manifest.topological_order()?;
        // Planned in graph order, each stage against what the stages above will hand it: a
        // declaration that cannot work with them is an error at its place, before anything runs.
        manifest.plans = crate::estimate::plans(&manifest).map_err(|(name, e)| {
            let mut path = vec!["stages", name.as_str()];
            path.extend(e.path.iter().map(String::as_str));
            manifest
                .error_at(&path, format!("stage `{name}`: {}", e.message))
                .maybe_help(e.help)
        })?;
        Ok(manifest)
    }

    fn check_stage_name(&self, name: &str) -> Result<(), InputError> {
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '-')
        {
            return Err(self.locator.error(
                &["stages".to_string(), name.to_string()],
                true,
                format!("stage name `{name}` may only use letters, digits, `_` and `-`"),
            ));
        }
        Ok(())
    }

    /// Each swept stage replaced by its copies ([`crate::sweep`]).
    fn expand_sweeps(
        &self,
        mut raw: BTreeMap<String, RawStage>,
    ) -> Result<BTreeMap<String, RawStage>, InputError> {
        if raw.values().all(|r| r.matrix.is_none()) {
            return Ok(raw);
        }
        // Before any copy is named: a declared name that looks like one must not be replaced.
        for name in raw.keys() {
            self.check_stage_name(name)?;
        }
        let declared: Vec<crate::sweep::Declared> = raw
            .iter()
            .map(|(name, r)| crate::sweep::Declared {
                name,
                matrix: r.matrix.as_ref(),
                params: &r.params,
                upstream: r
                    .inputs
                    .values()
                    .filter_map(|i| parse_reference(i).map(|(stage, _)| stage))
                    .collect(),
            })
            .collect();
        let copies = crate::sweep::expand(&declared).map_err(|e| {
            self.locator
                .error(&e.path, e.at_key, e.message)
                .maybe_help(e.help)
        })?;
        for (name, copies) in copies {
            let Some(declared) = raw.remove(&name) else {
                continue;
            };
            self.check_not_overridden(&name, copies.first())?;
            for copy in copies {
                let mut stage = declared.clone();
                if stage.params.is_object() {
                    for (path, value) in copy.set {
                        crate::sweep::set(&mut stage.params, &path, value);
                    }
                }
                stage.point = Some(copy.point);
                stage.reads = copy.upstream;
                raw.insert(copy.name, stage);
            }
        }
        Ok(raw)
    }

    /// An override of a param the stage's matrix sweeps would be silently replaced by the
    /// swept values: refuse it, at the argument.
    fn check_not_overridden(
        &self,
        name: &str,
        copy: Option<&crate::sweep::Copy>,
    ) -> Result<(), InputError> {
        for (path, _) in copy.map(|c| c.set.as_slice()).unwrap_or_default() {
            let swept: KeyPath = ["stages", name, "params"]
                .into_iter()
                .map(str::to_string)
                .chain(path.iter().cloned())
                .collect();
            let hit = self
                .locator
                .overridden
                .iter()
                .find(|(set, _)| set.starts_with(&swept) || swept.starts_with(set));
            if let (Some((_, index)), Some(command_line)) = (hit, &self.locator.command_line) {
                let axis = path.join(".");
                let err = InputError::new(format!(
                    "stage `{name}` sweeps params.{axis} (its `matrix`), so this override would have no effect"
                ))
                .help(if path.len() == 1 {
                    format!("change the swept values instead: stages.{name}.matrix.{axis}.0=VALUE sets the first")
                } else {
                    "change the swept values under `matrix` in the manifest instead".to_string()
                });
                return Err(command_line.at_override(*index, err));
            }
        }
        Ok(())
    }

    fn build_stages(
        &mut self,
        raw: BTreeMap<String, RawStage>,
        ops: Registry,
    ) -> Result<(), InputError> {
        if raw.is_empty() {
            return Err(self.error_at(&["stages"], "the manifest declares no stages"));
        }
        let names: std::collections::BTreeSet<String> = raw.keys().cloned().collect();
        for (name, r) in raw {
            // A sweep's copy is declared under its base name.
            let declared = r
                .point
                .as_ref()
                .map_or_else(|| name.clone(), |p| p.base.clone());
            let loc = |rest: &[&str]| -> KeyPath {
                ["stages", declared.as_str()]
                    .iter()
                    .chain(rest)
                    .map(|s| s.to_string())
                    .collect()
            };
            self.check_stage_name(&declared)?;
            let matrix = r.matrix.clone().filter(|_| r.point.is_some());
            let length = name.chars().count();
            if length > MAX_STAGE_NAME {
                return Err(self.locator.error(
                    &loc(&[]),
                    true,
                    format!(
                        "stage name `{name}` is {length} characters long; a name has at most {MAX_STAGE_NAME} characters"
                    ),
                ));
            }
            let op = ops.get(&r.op).ok_or_else(|| {
                self.locator
                    .error(&loc(&["op"]), false, format!("unknown op `{}`", r.op))
                    .help(crate::diag::did_you_mean(
                        &r.op,
                        "the ops are",
                        ops.names().into_iter(),
                    ))
            })?;
            r.resources.check().map_err(|(field, why)| {
                self.locator.error(
                    &loc(&["resources", field]),
                    false,
                    format!("stage `{name}`: resources.{field}: {why}"),
                )
            })?;
            let launched: Vec<&str> = ops
                .iter()
                .filter(|o| o.spec().launched)
                .map(|o| o.name())
                .collect();
            crate::launch::check(&r.resources, op, &launched).map_err(|(field, why, help)| {
                self.locator
                    .error(
                        &loc(&["resources", field]),
                        false,
                        format!("stage `{name}`: resources.{field}: {why}"),
                    )
                    .help(help)
            })?;
            if !r.params.is_object() {
                return Err(self.locator.error(
                    &loc(&["params"]),
                    false,
                    "`params` must be a mapping of names to values",
                ));
            }
            if r.cmd.is_some() && op.name() != "cmd" {
                return Err(self.locator.error(
                    &loc(&["cmd"]),
                    true,
                    format!(
                        "`cmd:` belongs to `op: cmd` stages; `{}` takes its settings from `params`",
                        op.name()
                    ),
                ));
            }
            let mut inputs = BTreeMap::new();
            for (input, written) in &r.inputs {
                let at = loc(&["inputs", input]);
                let resolved = match parse_reference(written) {
                    Some((stage, output)) => {
                        let stage = r.reads.get(stage).map_or(stage, String::as_str);
                        if !names.contains(stage) {
                            return Err(self
                                .locator
                                .error(&at, false, format!("input `{input}` refers to `{stage}:{output}`, but there is no stage `{stage}`"))
                                .help(format!(
                                    "{}; a file path that contains ':' can be written as `./{written}`",
                                    crate::diag::did_you_mean(stage, "stages", names.iter().map(String::as_str))
                                )));
                        }
                        Input::Stage {
                            stage: stage.to_string(),
                            output: output.to_string(),
                        }
                    }
                    None => {
                        let path = self.dir.join(written);
                        if !path.exists() {
                            return Err(self
                                .locator
                                .error(&at, false, format!("input `{input}`: {} does not exist", path.display()))
                                .help("input paths are relative to the manifest's directory; to use another stage's output write `STAGE:OUTPUT`"));
                        }
                        Input::File {
                            written: written.clone(),
                            path,
                        }
                    }
                };
                inputs.insert(input.clone(), resolved);
            }
            let mut stage = Stage {
                name: name.clone(),
                op,
                params: r.params,
                inputs,
                outputs: r.outputs,
                cmd: r.cmd,
                resources: r.resources,
                deps: Vec::new(),
                sweep: r.point,
            };
            let decl = stage.decl();
            check_spec(op.spec(), &decl)
                .and_then(|()| op.check(&decl).map(drop))
                .map_err(|e| {
                    // A value the matrix set is wrong at its place in the matrix.
                    let place = matrix_place(matrix.as_ref(), &stage.params, &e.path);
                    let path = place.as_ref().unwrap_or(&e.path);
                    let rest: Vec<&str> = path.iter().map(String::as_str).collect();
                    self.locator
                        .error(&loc(&rest), false, format!("stage `{name}`: {}", e.message))
                        .maybe_help(e.help)
                })?;
            stage.outputs = op.outputs(&stage.decl());
            let mut deps: Vec<String> = stage
                .inputs
                .values()
                .filter_map(|i| match i {
                    Input::Stage { stage, .. } => Some(stage.clone()),
                    Input::File { .. } => None,
                })
                .collect();
            deps.sort();
            deps.dedup();
            stage.deps = deps;
            self.stages.insert(name, stage);
        }
        // Every `STAGE:OUTPUT` must name an output that stage produces.
        for stage in self.stages.values() {
            for (input, i) in &stage.inputs {
                if let Input::Stage { stage: up, output } = i {
                    let producer = &self.stages[up];
                    if !producer.outputs.contains_key(output) {
                        return Err(self
                            .error_at(
                                &["stages", &stage.name, "inputs", input],
                                format!("stage `{up}` has no output `{output}`"),
                            )
                            .help(crate::diag::did_you_mean(
                                output,
                                &format!("`{up}` produces"),
                                producer.outputs.keys().map(String::as_str),
                            )));
                    }
                }
            }
        }
        Ok(())
    }

    fn topological_order(&self) -> Result<Vec<String>, InputError> {
        let mut graph = DiGraph::<&str, ()>::new();
        let index: HashMap<&str, NodeIndex> = self
            .stages
            .keys()
            .map(|n| (n.as_str(), graph.add_node(n.as_str())))
            .collect();
        for stage in self.stages.values() {
            for dep in &stage.deps {
                graph.add_edge(index[dep.as_str()], index[stage.name.as_str()], ());
            }
        }
        match petgraph::algo::toposort(&graph, None) {
            Ok(order) => Ok(order.into_iter().map(|i| graph[i].to_string()).collect()),
            Err(cycle) => {
                let names = find_cycle(&graph, cycle.node_id());
                let first = names.first().cloned().unwrap_or_default();
                Err(self
                    .error_at(&["stages", &first], format!("dependency cycle: {}", names.join(" → ")))
                    .help("a stage cannot consume its own output, directly or through other stages; remove one of these inputs"))
            }
        }
    }
}

/// The nodes of one cycle through `start`, as names, first repeated at the end.
fn find_cycle(graph: &DiGraph<&str, ()>, start: NodeIndex) -> Vec<String> {
    // Breadth-first from `start` along edges until we come back to it: the shortest cycle.
    let mut parent: HashMap<NodeIndex, NodeIndex> = HashMap::new();
    let mut queue = std::collections::VecDeque::from([start]);
    while let Some(n) = queue.pop_front() {
        for next in graph.neighbors(n) {
            if next == start {
                let mut path = vec![n];
                let mut cur = n;
                while cur != start {
                    cur = parent[&cur];
                    path.push(cur);
                }
                path.reverse();
                let mut names: Vec<String> = path.iter().map(|i| graph[*i].to_string()).collect();
                names.push(graph[start].to_string());
                return names;
            }
            if let std::collections::hash_map::Entry::Vacant(e) = parent.entry(next) {
                e.insert(n);
                queue.push_back(next);
            }
        }
    }
    vec![graph[start].to_string()]
}

/// A stage against its op's [`Spec`], the same for every op: every input is one the op reads
/// (unless it takes any), each required input is there, and only an op whose outputs the
/// stage declares gets `outputs:`.
fn check_spec(spec: &Spec, stage: &StageDecl) -> Result<(), DeclError> {
    let listed = || {
        spec.inputs
            .iter()
            .map(|p| format!("`{}` ({})", p.name, p.what))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if spec.other_inputs.is_none() {
        for name in &stage.inputs {
            if !spec.inputs.iter().any(|p| p.name == *name) {
                let help = if spec.inputs.is_empty() {
                    format!("{} takes no inputs", spec.name)
                } else {
                    crate::diag::did_you_mean(
                        name,
                        &format!("the inputs of {}", spec.name),
                        spec.inputs.iter().map(|p| p.name),
                    )
                };
                return Err(DeclError::new(
                    &["inputs", name],
                    format!("{} has no input named `{name}`", spec.name),
                )
                .with_help(help));
            }
        }
    }
    for port in spec.inputs.iter().filter(|p| p.required) {
        if !stage.inputs.contains(&port.name) {
            return Err(DeclError::new(
                &["inputs"],
                format!(
                    "{} needs an input named `{}` ({})",
                    spec.name, port.name, port.what
                ),
            )
            .with_help(format!("the inputs of {}: {}", spec.name, listed())));
        }
    }
    if let Outputs::Fixed(outputs) = spec.outputs
        && !stage.outputs.is_empty()
    {
        let names: Vec<&str> = outputs.iter().map(|(n, _)| *n).collect();
        return Err(DeclError::new(
            &["outputs"],
            format!(
                "{} names its own outputs ({}); a stage of it declares none",
                spec.name,
                names.join(", ")
            ),
        )
        .with_help("remove `outputs:` and refer to them as `STAGE:OUTPUT`"));
    }
    Ok(())
}

/// Where a param of a sweep's copy came from, when its stage's matrix set it:
/// `matrix.AXIS.INDEX`, for an error about `path` (`params.lr`) to point at the swept value.
fn matrix_place(matrix: Option<&Value>, params: &Value, path: &[String]) -> Option<KeyPath> {
    let rest = path.strip_prefix(&["params".to_string()])?;
    for (axis, values) in matrix?.as_object()? {
        let axis_path: Vec<&str> = axis.split('.').collect();
        if rest.len() < axis_path.len() || rest.iter().zip(&axis_path).any(|(a, b)| a != b) {
            continue;
        }
        let mut value = params;
        for seg in &axis_path {
            value = value.get(seg)?;
        }
        let index = values.as_array()?.iter().position(|v| v == value)?;
        return Some(vec!["matrix".into(), axis.clone(), index.to_string()]);
    }
    None
}

/// `STAGE:OUTPUT` when the text has that shape; a path otherwise.
pub fn parse_reference(text: &str) -> Option<(&str, &str)> {
    let (stage, output) = text.split_once(':')?;
    let ident = |s: &str| {
        !s.is_empty()
            && s.chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '-' || c == '.')
    };
    (ident(stage) && ident(output) && !stage.contains('.')).then_some((stage, output))
}

fn schema_message(path: &[String], inner: &str) -> String {
    let inner = inner.trim_end_matches(|c: char| c.is_whitespace());
    if path.is_empty() {
        format!("manifest: {inner}")
    } else {
        format!("{}: {inner}", path.join("."))
    }
}

fn read_source(path: &Path) -> Result<Source, InputError> {
    let cannot_read = |e: std::io::Error| {
        let help = if e.kind() == std::io::ErrorKind::NotFound {
            "check the path; manifests are YAML (.yaml/.yml) or TOML (.toml) files"
        } else {
            "check that the file is readable UTF-8 text"
        };
        InputError::new(format!("cannot read manifest {}: {e}", path.display())).help(help)
    };
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|file| {
            use std::io::Read;
            file.take(MAX_MANIFEST_BYTES as u64 + 1)
                .read_to_end(&mut bytes)
        })
        .map_err(cannot_read)?;
    if bytes.len() > MAX_MANIFEST_BYTES {
        return Err(InputError::new(format!(
            "manifest {} holds more than {}",
            path.display(),
            mebibytes(MAX_MANIFEST_BYTES)
        ))
        .help("a manifest is a recipe: keep data in input files, and let Jinja loops write repeated stages"));
    }
    if Format::from_path(path).is_none() {
        return Err(InputError::new(format!(
            "{}: unknown manifest format; use a .yaml, .yml or .toml file",
            path.display()
        )));
    }
    let name = path.display().to_string();
    match String::from_utf8(bytes) {
        Ok(text) => Ok(Source {
            name,
            text: Arc::from(text),
        }),
        Err(e) => Err(not_utf8(name, e)),
    }
}

/// A manifest with bytes that are not UTF-8: the first, by offset, line and column.
fn not_utf8(name: String, e: std::string::FromUtf8Error) -> InputError {
    let at = e.utf8_error().valid_up_to();
    let bytes = e.as_bytes();
    let byte = bytes.get(at).copied().unwrap_or_default();
    let line_start = bytes[..at]
        .iter()
        .rposition(|b| *b == b'\n')
        .map_or(0, |i| i + 1);
    let line = bytes[..at].iter().filter(|b| **b == b'\n').count() + 1;
    let message = format!(
        "manifest {name} is not UTF-8: byte {byte:#04x} at offset {at} (line {line}, column {})",
        at - line_start + 1
    );
    // Shown with U+FFFD for each bad sequence; the text before the first is unchanged.
    let shown = Source {
        name,
        text: Arc::from(String::from_utf8_lossy(bytes).into_owned()),
    };
    InputError::new(message)
        .at(&shown, at..at + '\u{fffd}'.len_utf8(), "not UTF-8")
        .help("save the manifest as UTF-8 text")
}

/// The variants `-c NAME` finds beside a manifest (`<dir>/<stem>/NAME.{yaml,yml,toml}`), sorted.
pub fn variants(manifest: &Path) -> Vec<String> {
    let dir = manifest.parent().unwrap_or(Path::new("."));
    let stem = manifest.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let mut available: Vec<String> = std::fs::read_dir(dir.join(stem))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            Format::from_path(&p)?;
            Some(p.file_stem()?.to_str()?.to_string())
        })
        .collect();
    available.sort();
    available.dedup();
    available
}

/// `-c NAME`: `<dir>/<stem>/NAME.{yaml,yml,toml}`; a value with `/` or a suffix is a path.
fn find_variant(manifest: &Path, variant: &str) -> Result<PathBuf, InputError> {
    let looks_like_path = variant.contains('/') || Format::from_path(Path::new(variant)).is_some();
    if looks_like_path {
        let p = PathBuf::from(variant);
        return if p.is_file() {
            Ok(std::path::absolute(&p).unwrap_or(p))
        } else {
            Err(InputError::new(format!(
                "variant file {variant} does not exist"
            )))
        };
    }
    let dir = manifest.parent().unwrap_or(Path::new("."));
    let stem = manifest.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    let tried: Vec<PathBuf> = ["yaml", "yml", "toml"]
        .iter()
        .map(|ext| dir.join(stem).join(format!("{variant}.{ext}")))
        .collect();
    if let Some(found) = tried.iter().find(|p| p.is_file()) {
        return Ok(found.clone());
    }
    let available = variants(manifest);
    let tried: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    Err(InputError::new(format!(
        "no variant `{variant}`: tried {}",
        tried.join(", ")
    ))
    .help(if available.is_empty() {
        format!("this manifest has no variants; create {}", tried[0])
    } else {
        format!("available variants: {}", available.join(", "))
    }))
}

/// The `vars:` block, read from the raw text before templating.
fn extract_vars(source: &Source) -> Result<Value, InputError> {
    let format = Format::from_path(Path::new(&source.name)).unwrap_or(Format::Yaml);
    let text: &str = &source.text;
    let mut block = String::new();
    let mut start = None;
    let mut inside = false;
    for (offset, line) in line_offsets(text) {
        let top_level = !line.starts_with([' ', '\t']) && !line.trim().is_empty();
        let opens = match format {
            Format::Yaml => line.starts_with("vars:"),
            Format::Toml => {
                line.starts_with("[vars]")
                    || line.starts_with("[vars.")
                    || line.starts_with("vars =")
                    || line.starts_with("vars=")
            }
        };
        let continues = match format {
            Format::Yaml => !top_level || line.starts_with('#'),
            Format::Toml => !line.starts_with('['),
        };
        if opens {
            inside = true;
            start.get_or_insert(offset);
        } else if inside && !continues {
            inside = false;
        }
        if inside {
            block.push_str(line);
            block.push('\n');
        }
    }
    let Some(start) = start else {
        return Ok(Value::Object(Default::default()));
    };
    if block.contains("{{") || block.contains("{%") {
        return Err(
            InputError::new("`vars` is read before templating, so it cannot use Jinja")
                .at(source, start..start + 4, "here")
                .help("give vars plain values; use them elsewhere as {{ name }}"),
        );
    }
    let (value, _) = doc::parse(format, &block, false).map_err(|e| {
        InputError::new(e.message).at(source, start + e.span.start..start + e.span.end, "here")
    })?;
    match value.get("vars") {
        Some(Value::Object(m)) => Ok(Value::Object(m.clone())),
        Some(Value::Null) | None => Ok(Value::Object(Default::default())),
        Some(_) => Err(
            InputError::new("`vars` must be a mapping of names to values").at(
                source,
                start..start + 4,
                "here",
            ),
        ),
    }
}

fn line_offsets(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let mut offset = 0;
    text.split_inclusive('\n').map(move |raw| {
        let at = offset;
        offset += raw.len();
        (at, raw.trim_end_matches(['\n', '\r']))
    })
}

fn render_and_parse(
    source: &Source,
    vars: &Value,
    locator: &mut Locator,
) -> Result<Value, InputError> {
    let format = Format::from_path(Path::new(&source.name)).unwrap_or(Format::Yaml);
    let rendered = render(source, vars)?;
    let rendered_source = if rendered.trim_end() == source.text.trim_end() {
        source.clone()
    } else {
        Source {
            name: format!("{} (after templating)", source.name),
            text: Arc::from(rendered),
        }
    };
    let (value, _) = doc::parse(format, &rendered_source.text, false)
        .map_err(|e| InputError::new(e.message).at(&rendered_source, e.span, "here"))?;
    locator.docs.push(Document {
        source: rendered_source,
        format,
        spans: std::sync::OnceLock::new(),
    });
    Ok(value)
}

/// The manifest's text through minijinja: strict about undefined variables, with a budget
/// of work ([`TEMPLATE_FUEL`]) and of output ([`MAX_MANIFEST_BYTES`]).
fn render(source: &Source, vars: &Value) -> Result<String, InputError> {
    let mut env = minijinja::Environment::new();
    env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
    env.set_fuel(Some(TEMPLATE_FUEL));
    let mut out = BoundedWriter::default();
    let result = env
        .template_from_str(&source.text)
        .and_then(|t| t.render_captured_to(minijinja::value::Serde(vars), &mut out));
    let Err(e) = result else {
        return Ok(String::from_utf8_lossy(&out.bytes).into_owned());
    };
    let span = e
        .range()
        .or_else(|| e.line().map(|l| line_range(&source.text, l)))
        .unwrap_or(0..0);
    let error = if out.overflowed {
        InputError::new(format!(
            "the manifest renders to more than {}",
            mebibytes(MAX_MANIFEST_BYTES)
        ))
        .help("a manifest is a recipe: keep data in input files")
    } else if e.kind() == minijinja::ErrorKind::OutOfFuel {
        InputError::new(format!(
            "template error: the template does too much work (more than {TEMPLATE_FUEL} steps)"
        ))
        .help("a manifest's loops write its stages: thousands of iterations, not millions")
    } else {
        let what = match e.detail() {
            Some(d) => format!("{}: {d}", e.kind()),
            None => e.kind().to_string(),
        };
        InputError::new(format!("template error: {what}"))
            .help("template variables come from `vars:` (and `vars.NAME=VALUE` overrides)")
    };
    Err(error.at(source, span, "here"))
}

/// Collects rendered bytes, up to [`MAX_MANIFEST_BYTES`]; a write past that fails the render.
#[derive(Default)]
struct BoundedWriter {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for BoundedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_MANIFEST_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("the manifest renders too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn mebibytes(bytes: usize) -> String {
    format!("{} MiB", bytes >> 20)
}

fn line_range(text: &str, line: usize) -> std::ops::Range<usize> {
    line_offsets(text)
        .nth(line.saturating_sub(1))
        .map(|(at, l)| at..at + l.len())
        .unwrap_or(0..0)
}

/// Deep merge: mappings merge key by key, anything else is replaced.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        b.insert(k, v);
                    }
                }
            }
        }
        (slot, over) => *slot = over,
    }
}

/// `a.b.c=VALUE`: set an existing key; the value is typed like a YAML scalar. Returns the
/// key path it set.
fn apply_override(tree: &mut Value, text: &str) -> Result<KeyPath, InputError> {
    let Some((key, raw)) = text.split_once('=') else {
        let mut e = InputError::new(format!("override `{text}` is not KEY.PATH=VALUE"));
        if tree["stages"].get(text).is_some() {
            e = e.help(format!(
                "to run only `{text}` and what it needs: nemo-dag run MANIFEST --target {text}"
            ));
        }
        return Err(e);
    };
    let path: Vec<&str> = key.split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(InputError::new(format!(
            "override `{text}`: `{key}` is not a valid key path"
        )));
    }
    let mut node = tree;
    for (depth, seg) in path.iter().enumerate() {
        let here = path[..depth].join(".");
        let next = match node {
            Value::Object(m) => {
                if !m.contains_key(*seg) {
                    let where_ = if here.is_empty() {
                        "the manifest".to_string()
                    } else {
                        format!("`{here}`")
                    };
                    let help = if m.is_empty() {
                        format!("keys at {where_}: none")
                    } else {
                        crate::diag::did_you_mean(
                            seg,
                            &format!("keys at {where_}"),
                            m.keys().map(String::as_str),
                        )
                    };
                    return Err(InputError::new(format!(
                        "override `{text}`: {where_} has no key `{seg}`, so there is nothing to override"
                    ))
                    .help(format!("{help}; an override only changes a value the manifest already sets")));
                }
                m.get_mut(*seg)
            }
            Value::Array(items) => seg.parse::<usize>().ok().and_then(|i| items.get_mut(i)),
            _ => None,
        };
        node = next.ok_or_else(|| {
            InputError::new(format!(
                "override `{text}`: `{here}` has no element `{seg}`"
            ))
        })?;
    }
    *node = doc::plain_scalar(raw);
    Ok(path.iter().map(|s| s.to_string()).collect())
}

/// The arguments that shape a load, `-c VARIANT` then the `KEY.PATH=VALUE` overrides, as
/// one text that errors about them point into.
#[derive(Debug)]
struct CommandLine {
    source: Source,
    variant: Option<std::ops::Range<usize>>,
    overrides: Vec<std::ops::Range<usize>>,
}

impl CommandLine {
    fn new(args: &LoadArgs) -> CommandLine {
        let mut text = String::new();
        let mut add = |arg: &str| {
            if !text.is_empty() {
                text.push(' ');
            }
            let start = text.len();
            text.push_str(arg);
            start..text.len()
        };
        let variant = args.variant.as_deref().map(|v| {
            let flag = add("-c");
            flag.start..add(v).end
        });
        let overrides = args.overrides.iter().map(|o| add(o)).collect();
        CommandLine {
            source: Source {
                name: "command line".into(),
                text: Arc::from(text),
            },
            variant,
            overrides,
        }
    }

    /// `err`, pointing at the `index`th override.
    fn at_override(&self, index: usize, err: InputError) -> InputError {
        match self.overrides.get(index) {
            Some(range) => err.at(&self.source, range.clone(), "this argument"),
            None => err,
        }
    }

    /// `err`, pointing at `-c VARIANT`.
    fn at_variant(&self, err: InputError) -> InputError {
        match &self.variant {
            Some(range) => err.at(&self.source, range.clone(), "this argument"),
            None => err,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_and_paths() {
        assert_eq!(parse_reference("gen:nums"), Some(("gen", "nums")));
        assert_eq!(parse_reference("data/corpus.txt"), None);
        assert_eq!(parse_reference("./gen:nums"), None);
    }

    #[test]
    fn overrides_must_name_existing_keys() {
        let mut tree = serde_json::json!({"stages": {"a": {"params": {"lr": 0.1}}}});
        apply_override(&mut tree, "stages.a.params.lr=1e-4").unwrap();
        assert_eq!(
            tree["stages"]["a"]["params"]["lr"],
            serde_json::json!(0.0001)
        );
        let err = apply_override(&mut tree, "stages.a.params.zzz=1").unwrap_err();
        assert!(err.message.contains("zzz"));
    }

    #[test]
    fn time_and_mem_read_as_slurm_reads_them() {
        use serde_json::json;
        use std::time::Duration;
        let minutes = |m: u64| Duration::from_secs(m * 60);
        for (written, want) in [
            (json!(90), minutes(90)),
            (json!("90"), minutes(90)),
            (json!("5:30"), Duration::from_secs(5 * 60 + 30)),
            (json!("04:00:00"), minutes(240)),
            (json!("100:00:00"), minutes(6000)),
            (json!("2-12"), minutes((2 * 24 + 12) * 60)),
            (json!("1-00:30"), minutes(24 * 60 + 30)),
            (
                json!("1-02:03:04"),
                Duration::from_secs(86_400 + 2 * 3600 + 3 * 60 + 4),
            ),
        ] {
            assert_eq!(crate::duration::parse(&written), Ok(want), "{written}");
            let r = Resources {
                time: Some(written.clone()),
                ..Resources::default()
            };
            assert_eq!(r.time_limit(), Some(want), "{written}");
        }
        for bad in [
            json!(0),
            json!("00:00:00"),
            json!(1.5),
            json!(-3),
            json!("soon"),
            json!("1:60"),
            json!("1-24"),
            json!("1-1:2:3:4"),
            json!("::"),
            json!("UNLIMITED"),
            json!("999999999999999999999"),
            json!(600_000),
        ] {
            assert!(crate::duration::parse(&bad).is_err(), "{bad}");
        }
        assert_eq!(Resources::default().time_limit(), None);
        for (written, want) in [
            (json!(512), 512 << 20),
            (json!("16G"), 16 << 30),
            (json!("16g"), 16 << 30),
            (json!("100K"), 100 << 10),
            (json!(0), 0),
            (json!("2T"), 2 << 40),
        ] {
            assert_eq!(parse_mem(&written), Ok(want), "{written}");
        }
        for bad in [
            json!("lots"),
            json!("G"),
            json!("1.5G"),
            json!(-1),
            json!("16GB"),
            json!("65T"),
            json!(1e30),
        ] {
            assert!(parse_mem(&bad).is_err(), "{bad}");
        }
    }
}
