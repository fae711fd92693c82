//! Execution profiles from `env.toml`, with the Nemotron CLI's schema.
//!
//! ```toml
//! [wandb]                      # reserved sections are not profiles:
//! project = "nano3"            #   [wandb] [mlflow] [artifacts] [cache] [cli]
//!
//! [cluster]
//! executor = "slurm"
//! account = "llm"
//! partition = "batch"
//! run_partition = "interactive"   # used by --run
//! batch_partition = "batch"       # used by --batch
//! time = "04:00:00"
//! mounts = ["/lustre:/lustre"]
//!
//! [cluster-gpu]
//! extends = "cluster"             # child keys override the parent's; env_vars merge; mounts add up
//! gpus_per_node = 8
//! ```
//!
//! The file is found as the Nemotron CLI finds it: `$NEMO_DAG_ENV_FILE` if set, else the first
//! `env.toml` walking up from the manifest's directory, stopping at the project root (a
//! directory holding `.git`, `pyproject.toml` or `Cargo.toml`).

use crate::diag::{InputError, Source};
use crate::doc::{self, Format};
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const RESERVED: [&str; 5] = ["wandb", "mlflow", "artifacts", "cache", "cli"];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Executor {
    #[default]
    Local,
    Slurm,
}

/// One resolved profile (its `extends` chain already applied).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    #[serde(skip)]
    pub name: String,
    #[serde(default)]
    pub executor: Executor,
    #[serde(default)]
    pub extends: Option<String>,
    pub account: Option<String>,
    pub partition: Option<String>,
    pub run_partition: Option<String>,
    pub batch_partition: Option<String>,
    pub nodes: Option<u32>,
    pub ntasks_per_node: Option<u32>,
    pub nproc_per_node: Option<u32>,
    pub gpus_per_node: Option<u32>,
    pub cpus_per_task: Option<u32>,
    pub time: Option<String>,
    pub mem: Option<String>,
    pub exclusive: Option<bool>,
    #[serde(default)]
    pub mounts: Vec<String>,
    #[serde(alias = "container")]
    pub container_image: Option<String>,
    /// The memory of each GPU of the profile's nodes (`80GiB`): a launched stage whose
    /// weights and optimizer alone would need more per GPU is refused before it is submitted.
    #[serde(default, deserialize_with = "size")]
    pub gpu_memory: Option<u64>,
    /// The PMI a launched stage's `srun` step uses (`srun --mpi=`; `pmix` for Megatron-Bridge
    /// under pyxis, as its Slurm examples run it).
    pub mpi: Option<String>,
    #[serde(default)]
    pub startup_commands: Vec<String>,
    #[serde(default)]
    pub env_vars: BTreeMap<String, String>,
    /// The store a job uses on its node, where the nodes do not see the submitting store: the
    /// job pulls its inputs from the shared cache (`[cache]`) and pushes what it builds. The
    /// job's shell expands it, so `$TMPDIR`, `$USER` and `$SLURM_JOB_ID` may be used.
    pub node_store: Option<String>,
}

/// Where `env.toml` is for a manifest in `start`.
pub fn find_env_file(start: &Path) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NEMO_DAG_ENV_FILE") {
        return Some(PathBuf::from(p));
    }
    let mut dir = Some(start.to_path_buf());
    while let Some(d) = dir {
        let candidate = d.join("env.toml");
        if candidate.is_file() {
            return Some(candidate);
        }
        if [".git", "pyproject.toml", "Cargo.toml"]
            .iter()
            .any(|m| d.join(m).exists())
        {
            return None;
        }
        dir = d.parent().map(Path::to_path_buf);
    }
    None
}

/// One reserved section of the `env.toml` found from a manifest's directory (`[cache]`,
/// `[mlflow]`), with what its errors need to point into the file.
pub struct Section {
    /// The file it is in.
    pub file: PathBuf,
    pub table: serde_json::Map<String, Value>,
    name: &'static str,
    source: Source,
    spans: doc::Spans,
}

impl Section {
    /// `[name]` of the env file found from `start`; `None` when there is no file or no such
    /// section. A file that does not parse is an error at its place.
    pub fn load(start: &Path, name: &'static str) -> Result<Option<Section>, InputError> {
        let Some(file) = find_env_file(start) else {
            return Ok(None);
        };
        let Ok(text) = std::fs::read_to_string(&file) else {
            return Ok(None); // a missing env.toml is no section; `load` reports it where a profile is needed
        };
        let source = Source {
            name: file.display().to_string(),
            text: Arc::from(text),
        };
        let (tree, spans) = doc::parse(Format::Toml, &source.text, true)
            .map_err(|e| InputError::new(e.message).at(&source, e.span, "here"))?;
        let Some(section) = tree.get(name) else {
            return Ok(None);
        };
        let table = section.as_object().cloned();
        let section = Section {
            file,
            table: table.clone().unwrap_or_default(),
            name,
            source,
            spans,
        };
        match table {
            Some(_) => Ok(Some(section)),
            None => Err(section.at("", format!("[{name}] must be a table"))),
        }
    }

    /// An error at `key` of the section (at its header for `""`).
    pub fn at(&self, key: &str, message: String) -> InputError {
        let path = vec![self.name.to_string(), key.to_string()];
        let err = InputError::new(message);
        match self.spans.nearest(&path, key.is_empty()) {
            Some(range) => err.at(&self.source, range, "here"),
            None => err,
        }
    }

    /// A key the section does not take, if any, as an error at it with the nearest name.
    pub fn check_keys(&self, keys: &[&str]) -> Result<(), InputError> {
        match self.table.keys().find(|k| !keys.contains(&k.as_str())) {
            None => Ok(()),
            Some(key) => Err(self
                .at(key, format!("[{}] has no key `{key}`", self.name))
                .help(crate::diag::did_you_mean(
                    key,
                    &format!("[{}] keys", self.name),
                    keys.iter().copied(),
                ))),
        }
    }

    /// The text at `key`: absent, or a non-empty string.
    pub fn text(&self, key: &str) -> Result<Option<String>, InputError> {
        match self.table.get(key) {
            None => Ok(None),
            Some(Value::String(s)) if !s.trim().is_empty() => Ok(Some(s.clone())),
            Some(_) => Err(self.at(
                key,
                format!("{}.{key} must be a non-empty string", self.name),
            )),
        }
    }
}

/// Load profile `name` from the env file found from `start`.
pub fn load(start: &Path, name: &str) -> Result<Profile, InputError> {
    let path = find_env_file(start).ok_or_else(|| {
        InputError::new(format!("profile `{name}` asked for, but no env.toml was found"))
            .help(format!(
                "create env.toml beside the manifest (or in a parent up to the project root), or set NEMO_DAG_ENV_FILE; searched from {}",
                start.display()
            ))
    })?;
    let text = std::fs::read_to_string(&path)
        .map_err(|e| InputError::new(format!("cannot read {}: {e}", path.display())))?;
    let source = Source {
        name: path.display().to_string(),
        text: Arc::from(text),
    };
    let (tree, spans) = doc::parse(Format::Toml, &source.text, true)
        .map_err(|e| InputError::new(e.message).at(&source, e.span, "here"))?;
    let tables = tree.as_object().cloned().unwrap_or_default();
    let available: Vec<&str> = tables
        .keys()
        .map(String::as_str)
        .filter(|k| !RESERVED.contains(k))
        .collect();
    let at = |path: &[&str], message: String| {
        let key: Vec<String> = path.iter().map(|s| s.to_string()).collect();
        let err = InputError::new(message);
        match spans.nearest(&key, true) {
            Some(range) => err.at(&source, range, "here"),
            None => err,
        }
    };
    if RESERVED.contains(&name) || !tables.contains_key(name) {
        return Err(InputError::new(format!("no profile `{name}` in {}", path.display())).help(
            if available.is_empty() {
                "the file defines no profiles; add a table like [mycluster] with executor = \"slurm\"".to_string()
            } else {
                crate::diag::did_you_mean(name, "available profiles", available.iter().copied())
            },
        ));
    }

    // Walk the `extends` chain from the child up, then merge parent-first.
    let mut chain = vec![name.to_string()];
    loop {
        let current = &chain[chain.len() - 1];
        let Some(parent) = tables[current.as_str()].get("extends") else {
            break;
        };
        let Some(parent) = parent.as_str() else {
            return Err(at(
                &[current, "extends"],
                "`extends` must name a profile".into(),
            ));
        };
        if chain.iter().any(|c| c == parent) {
            let mut cycle = chain.clone();
            cycle.push(parent.to_string());
            return Err(at(
                &[current, "extends"],
                format!("profile `extends` cycle: {}", cycle.join(" → ")),
            ));
        }
        if !tables.contains_key(parent) || RESERVED.contains(&parent) {
            return Err(at(
                &[current, "extends"],
                format!("profile `{current}` extends unknown profile `{parent}`"),
            )
            .help(crate::diag::did_you_mean(
                parent,
                "available profiles",
                available.iter().copied(),
            )));
        }
        chain.push(parent.to_string());
    }
    let mut merged = Value::Object(Default::default());
    let mut mounts: Vec<Value> = Vec::new();
    for link in chain.iter().rev() {
        let table = tables[link.as_str()].clone();
        if let Some(Value::Array(m)) = table.get("mounts") {
            mounts.extend(m.iter().cloned());
        }
        crate::manifest::merge(&mut merged, table);
    }
    if let Value::Object(m) = &mut merged {
        m.insert("mounts".into(), Value::Array(mounts));
        m.remove("extends");
    }
    let mut profile: Profile = serde_path_to_error::deserialize(&merged).map_err(|e| {
        let field = e.path().to_string();
        // Point at the first table in the chain that sets the bad field.
        let owner = chain
            .iter()
            .find(|c| {
                tables[c.as_str()]
                    .get(field.split('.').next().unwrap_or(""))
                    .is_some()
            })
            .cloned()
            .unwrap_or_else(|| name.to_string());
        at(
            &[&owner, &field],
            format!("profile `{owner}`: {field}: {}", e.into_inner()),
        )
    })?;
    if let Some(Err(why)) = profile
        .time
        .as_ref()
        .map(|t| crate::duration::parse(&Value::String(t.clone())))
    {
        let owner = chain
            .iter()
            .find(|c| tables[c.as_str()].get("time").is_some())
            .cloned()
            .unwrap_or_else(|| name.to_string());
        return Err(at(
            &[&owner, "time"],
            format!("profile `{owner}`: time: {why}"),
        ));
    }
    if let Some(Err(why)) = profile.node_store.as_deref().map(check_node_store) {
        let owner = chain
            .iter()
            .find(|c| tables[c.as_str()].get("node_store").is_some())
            .cloned()
            .unwrap_or_else(|| name.to_string());
        return Err(at(
            &[&owner, "node_store"],
            format!("profile `{owner}`: node_store: {why}"),
        ));
    }
    profile.name = name.to_string();
    Ok(profile)
}

/// `gpu_memory = "80GiB"`, in bytes.
fn size<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    text.map(|t| nemo_dag_op::plan::parse_bytes(&t).map_err(serde::de::Error::custom))
        .transpose()
}

/// A node store is an absolute path, or one that starts with a variable the job's shell
/// expands (`$TMPDIR/nemo-dag`), with nothing in it the shell would read as more than that.
fn check_node_store(path: &str) -> Result<(), String> {
    if !(path.starts_with('/') || path.starts_with('$')) {
        return Err(format!(
            "`{path}` is neither an absolute path nor one under a variable such as $TMPDIR"
        ));
    }
    match path
        .chars()
        .find(|c| matches!(c, '"' | '`' | '\\' | '\n' | '\r' | '(' | ')' | ';' | '@'))
    {
        Some(c) => Err(format!(
            "`{}` may not be in it: the job's shell expands only its variables",
            c.escape_default()
        )),
        None => Ok(()),
    }
}

impl Profile {
    /// The wall-clock limit `time` sets, if any. Checked when the profile loads.
    pub fn time_limit(&self) -> Option<std::time::Duration> {
        let time = Value::String(self.time.clone()?);
        crate::duration::parse(&time).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_env(text: &str) -> (PathBuf, PathBuf) {
        let dir = std::env::temp_dir().join(format!(
            "nemo-dag-profile-{}-{}",
            std::process::id(),
            blake3::hash(text.as_bytes()).to_hex()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("env.toml"), text).unwrap();
        std::fs::write(dir.join("Cargo.toml"), "").unwrap();
        (dir.clone(), dir.join("env.toml"))
    }

    #[test]
    fn extends_merges_child_over_parent() {
        let (dir, _) = write_env(
            "[wandb]\nproject='x'\n[base]\nexecutor='slurm'\npartition='p'\nmounts=['/a:/a']\nenv_vars={A='1',B='2'}\n[gpu]\nextends='base'\ngpus_per_node=8\nmounts=['/b:/b']\nenv_vars={B='3'}\n",
        );
        let p = load(&dir, "gpu").unwrap();
        assert_eq!(p.executor, Executor::Slurm);
        assert_eq!(p.partition.as_deref(), Some("p"));
        assert_eq!(p.gpus_per_node, Some(8));
        assert_eq!(p.mounts, vec!["/a:/a", "/b:/b"]);
        assert_eq!(p.env_vars["A"], "1");
        assert_eq!(p.env_vars["B"], "3");
    }

    #[test]
    fn cycles_unknown_parents_and_unknown_profiles_are_errors() {
        let (dir, _) =
            write_env("[a]\nextends='b'\n[b]\nextends='a'\n[c]\nextends='zz'\n[cli]\ntheme='x'\n");
        let e = load(&dir, "a").unwrap_err();
        assert!(e.message.contains("a → b → a"), "{}", e.message);
        let e = load(&dir, "c").unwrap_err();
        assert!(e.message.contains("zz"), "{}", e.message);
        let e = load(&dir, "nope").unwrap_err();
        assert!(
            e.help.as_deref().unwrap_or("").contains("a, b, c"),
            "{:?}",
            e.help
        );
        let e = load(&dir, "cli").unwrap_err();
        assert!(e.message.contains("no profile `cli`"), "{}", e.message);
        let (dir, _) = write_env("[mycluster]\nexecutor='slurm'\n[local]\nexecutor='local'\n");
        let e = load(&dir, "mycluter").unwrap_err();
        assert!(
            e.help
                .as_deref()
                .unwrap_or("")
                .starts_with("did you mean `mycluster`?"),
            "{:?}",
            e.help
        );
    }

    #[test]
    fn a_node_store_is_an_absolute_path_or_under_a_variable_and_nothing_more() {
        let (dir, _) = write_env(
            "[ok]\nnode_store='/raid/nemo-dag'\n[tmp]\nnode_store='$TMPDIR/nd-$SLURM_JOB_ID'\n[rel]\nnode_store='scratch'\n[sub]\nnode_store='/tmp/$(whoami)'\n[quote]\nnode_store='/tmp/a\"b'\n",
        );
        assert_eq!(
            load(&dir, "ok").unwrap().node_store.as_deref(),
            Some("/raid/nemo-dag")
        );
        assert!(load(&dir, "tmp").is_ok());
        let e = load(&dir, "rel").unwrap_err();
        assert!(
            e.message.contains("neither an absolute path"),
            "{}",
            e.message
        );
        for bad in ["sub", "quote"] {
            let e = load(&dir, bad).unwrap_err();
            assert!(
                e.message
                    .contains("may not be in it: the job's shell expands only its variables"),
                "{bad}: {}",
                e.message
            );
        }
    }

    #[test]
    fn a_time_slurm_would_refuse_is_an_error_at_the_profile_that_sets_it() {
        let (dir, _) =
            write_env("[base]\ntime='4h'\n[lab]\nextends='base'\n[ok]\ntime='1-00:30'\n");
        let e = load(&dir, "lab").unwrap_err();
        assert!(
            e.message
                .starts_with("profile `base`: time: `4h` is not a time limit"),
            "{}",
            e.message
        );
        let ok = load(&dir, "ok").unwrap();
        assert_eq!(
            ok.time_limit(),
            Some(std::time::Duration::from_secs(86_400 + 1800))
        );
    }
}
