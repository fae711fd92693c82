//! Executed stages as MLflow runs: with `[mlflow] tracking_uri` in `env.toml`, or
//! `MLFLOW_TRACKING_URI` in the environment, each stage a run builds becomes a run of an MLflow
//! experiment once it is published (over [`nemo_dag_mlflow`], MLflow's REST API).
//!
//! ```toml
//! [mlflow]
//! tracking_uri = "http://mlflow.internal:5000"   # MLFLOW_TRACKING_URI wins over it
//! experiment = "super3"                          # default: MLFLOW_EXPERIMENT_NAME, else the manifest's name
//! ```
//!
//! An MLflow run holds the stage's params (flattened: `optim.lr`), every figure of its curve at
//! each step (`train/loss`, as in TensorBoard), its final metrics and what it used
//! (`resources.peak_rss_bytes`), and tags that tie it to the store: the stage key, the
//! upstream keys, the manifest, where the artifact is. The tracker is a copy for people to look
//! at: it is never read back, and it cannot fail a run. The first request that fails is said
//! once, and nothing more is sent that run.

use crate::diag::InputError;
use crate::executor::profile::Section;
use crate::store::{Artifact, InputRecord};
use nemo_dag_mlflow::{Client, Metric, Status};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Mutex;

/// The keys `[mlflow]` takes.
const KEYS: [&str; 2] = ["tracking_uri", "experiment"];

/// Where a run's stages are tracked, and how far it got.
#[derive(Debug)]
pub struct Tracker {
    client: Client,
    experiment: String,
    /// Where the tracking URI came from, for messages.
    from: String,
    state: tokio::sync::Mutex<State>,
    /// Why tracking stopped, once a request failed (said once).
    down: Mutex<Option<String>>,
}

#[derive(Debug, Default)]
struct State {
    experiment_id: Option<String>,
    logged: usize,
}

/// What a run adds to each of its stages' tags.
#[derive(Debug, Clone, Default)]
pub struct RunTags {
    /// The command line that ran it.
    pub argv: Vec<String>,
    /// The manifest's variant (`-c tiny`), if any.
    pub variant: Option<String>,
}

impl RunTags {
    pub fn new(manifest: &crate::manifest::Manifest, argv: &[String]) -> RunTags {
        RunTags {
            argv: argv.to_vec(),
            variant: manifest.variant.as_ref().map(|v| v.display().to_string()),
        }
    }
}

impl Tracker {
    /// The tracker of a run of the manifest in `start`, if one is configured: `[mlflow]` in the
    /// `env.toml` found from there, or `MLFLOW_TRACKING_URI`. A bad `[mlflow]` is an error at
    /// its place; an `MLFLOW_TRACKING_URI` nemo-dag cannot use is a warning (it may be set for
    /// other tools), and the run is not tracked.
    pub fn load(start: &Path, manifest_name: &str) -> Result<Option<Tracker>, InputError> {
        let section = Section::load(start, "mlflow")?;
        if let Some(s) = &section {
            s.check_keys(&KEYS)?;
        }
        // A tracking_uri in the file is checked even when the environment's wins over it.
        let mut from_file = None;
        if let Some(s) = &section
            && let Some(uri) = s.text("tracking_uri")?
        {
            let client = Client::new(&uri).map_err(|why| {
                s.at("tracking_uri", format!("mlflow.tracking_uri: {why}"))
                    .help("start one with `mlflow server --host 127.0.0.1 --port 5000` and write `tracking_uri = \"http://127.0.0.1:5000\"`")
            })?;
            from_file = Some((client, s));
        }
        let experiment = match &section {
            Some(s) => s.text("experiment")?,
            None => None,
        };
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let (client, from) = match (var("MLFLOW_TRACKING_URI"), from_file) {
            (Some(uri), _) => match Client::new(&uri) {
                Ok(c) => (c, "MLFLOW_TRACKING_URI".to_string()),
                Err(why) => {
                    eprintln!(
                        "nemo-dag: warning: MLFLOW_TRACKING_URI {why}; this run is not tracked"
                    );
                    return Ok(None);
                }
            },
            (None, Some((client, s))) => (client, format!("[mlflow] in {}", s.file.display())),
            (None, None) => return Ok(None),
        };
        let experiment = experiment
            .or_else(|| var("MLFLOW_EXPERIMENT_NAME"))
            .unwrap_or_else(|| manifest_name.to_string());
        Ok(Some(Tracker {
            client,
            experiment,
            from,
            state: tokio::sync::Mutex::new(State::default()),
            down: Mutex::new(None),
        }))
    }

    /// Log one published stage as an MLflow run. Never fails: a server that cannot be used is
    /// said once (on stderr), and every later call does nothing; a stage whose run the server
    /// refuses (a value it will not take) is said, and the next stage is tried.
    pub async fn stage(&self, artifact: &Artifact, artifact_dir: &Path, run: &RunTags) {
        self.record(Record::built(artifact, artifact_dir, run))
            .await;
    }

    /// Log one run ([`Record::failed`]), as [`Tracker::stage`] does.
    pub async fn record(&self, record: Record) {
        if !self.up() {
            return;
        }
        // One stage at a time: the experiment is found once, and a server that fails is asked
        // once, not by every stage that ended meanwhile.
        let mut state = self.state.lock().await;
        if !self.up() {
            return;
        }
        match self.send(&mut state, &record).await {
            Ok(()) => state.logged += 1,
            Err(e) if e.is_down() => self.went_down(&e.to_string()),
            Err(e) => eprintln!(
                "nemo-dag: warning: MLflow refused the run of `{}`: {e}",
                record.name
            ),
        }
    }

    async fn send(&self, state: &mut State, record: &Record) -> Result<(), nemo_dag_mlflow::Error> {
        let experiment_id = match &state.experiment_id {
            Some(id) => id.clone(),
            None => {
                let id = self.client.experiment(&self.experiment).await?;
                state.experiment_id = Some(id.clone());
                id
            }
        };
        let run_id = self
            .client
            .create_run(&experiment_id, &record.name, record.start, &record.tags)
            .await?;
        let logged = self
            .client
            .log(&run_id, &record.params, &record.metrics, &[])
            .await;
        let status = match &logged {
            Ok(()) => record.status,
            Err(_) => Status::Failed,
        };
        // A run that could not be logged whole is ended all the same (marked failed), so that
        // it does not show as running forever.
        let ended = self.client.end_run(&run_id, status, record.end).await;
        logged.and(ended)
    }

    /// The line a run ends with when it tracked something: how many stages, and where.
    pub async fn summary(&self) -> Option<String> {
        let state = self.state.lock().await;
        let id = state.experiment_id.as_ref().filter(|_| state.logged > 0)?;
        Some(format!(
            "mlflow: {} stage(s) logged to experiment `{}`: {}",
            state.logged,
            self.experiment,
            self.client.experiment_url(id)
        ))
    }

    /// Log each of `keys` (published in `store`) as a run, one after another, until `stop`
    /// says the user interrupted: what a cluster run does once its jobs have ended. A key the
    /// store does not have (built in a node's own store and not pulled back) is said, and
    /// passed over.
    pub fn stages(
        &self,
        store: &crate::store::Store,
        keys: &[String],
        run: &RunTags,
        stop: &dyn Fn() -> bool,
    ) {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            let mut absent = 0;
            for key in keys {
                if stop() {
                    eprintln!("nemo-dag: interrupted: the stages not yet sent to MLflow are not tracked");
                    break;
                }
                match store.load(key) {
                    Some(artifact) => self.stage(&artifact, &store.artifact_dir(key), run).await,
                    None => absent += 1,
                }
            }
            if absent > 0 {
                eprintln!(
                    "nemo-dag: warning: {absent} stage(s) built on the cluster are not in this store, and are not tracked in MLflow"
                );
            }
            if let Some(line) = self.summary().await {
                eprintln!("{line}");
            }
        });
    }

    fn up(&self) -> bool {
        self.down.lock().map(|d| d.is_none()).unwrap_or(false)
    }

    fn went_down(&self, why: &str) {
        let Ok(mut down) = self.down.lock() else {
            return;
        };
        if down.is_none() {
            eprintln!(
                "nemo-dag: warning: MLflow at {} ({}) cannot be used: {why}; the run goes on, and tracks nothing more",
                self.client.base(),
                self.from
            );
            *down = Some(why.to_string());
        }
    }
}

/// A stage that failed, as the run that ran it knows it.
#[derive(Debug)]
pub struct Failed<'a> {
    pub stage: &'a crate::manifest::Stage,
    pub key: &'a str,
    /// The keys of the stages it read.
    pub upstream_keys: Vec<String>,
    pub manifest: &'a Path,
    pub error: &'a str,
    pub log: Option<&'a str>,
    /// How long it ran, in seconds, up to now.
    pub seconds: f64,
}

/// What one MLflow run holds.
#[derive(Debug)]
pub struct Record {
    name: String,
    /// Milliseconds since 1970.
    start: i64,
    end: i64,
    status: Status,
    params: Vec<(String, String)>,
    metrics: Vec<Metric>,
    tags: Vec<(String, String)>,
}

impl Record {
    /// A published stage: its params, curve, final figures and lineage.
    fn built(artifact: &Artifact, artifact_dir: &Path, run: &RunTags) -> Record {
        Record {
            name: artifact.stage.clone(),
            start: ms(crate::curve::start(artifact)),
            end: ms(crate::curve::end(artifact)),
            status: Status::Finished,
            params: params(&artifact.params, artifact.cmd.as_deref()),
            metrics: metrics(artifact),
            tags: tags(artifact, artifact_dir, run),
        }
    }

    /// A stage that failed, to be marked `FAILED`: no artifact, so no figures; its params,
    /// key and what it read, the error and where its log is.
    pub fn failed(f: &Failed, run: &RunTags) -> Record {
        let end = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let stage = f.stage;
        let mut tags = common_tags(
            &stage.name,
            f.key,
            &format!("{}@{}", stage.op.name(), stage.op.version()),
            &f.manifest.display().to_string(),
            &f.upstream_keys,
            run,
        );
        tags.push(("nemo_dag.host".into(), crate::store::hostname()));
        tags.push(("nemo_dag.error".into(), f.error.to_string()));
        if let Some(log) = f.log {
            tags.push(("nemo_dag.log".into(), log.to_string()));
        }
        Record {
            name: stage.name.clone(),
            start: ms(end - f.seconds),
            end: ms(end),
            status: Status::Failed,
            params: params(&stage.params, stage.cmd.as_deref()),
            metrics: vec![Metric {
                key: "seconds".into(),
                value: f.seconds,
                timestamp: ms(end),
                step: 0,
            }],
            tags,
        }
    }
}

/// The stage's params by dotted path, as text; a `cmd` stage's command beside them.
fn params(params: &Value, cmd: Option<&str>) -> Vec<(String, String)> {
    let mut flat = BTreeMap::new();
    crate::diff::flatten("", params, &mut flat);
    let mut out: Vec<(String, String)> = flat
        .iter()
        .map(|(k, v)| (k.clone(), crate::diff::plain(v)))
        .collect();
    if let Some(cmd) = cmd {
        out.push(("cmd".to_string(), cmd.to_string()));
    }
    out
}

/// Every figure of the curve at its step (`train/<name>`, as TensorBoard's tags), then the
/// final metrics and what the stage used, at the last step.
fn metrics(artifact: &Artifact) -> Vec<Metric> {
    let points = crate::curve::points(artifact).unwrap_or_default();
    let mut out: Vec<Metric> = points
        .iter()
        .flat_map(|p| {
            p.values.iter().map(|(name, value)| Metric {
                key: format!("train/{name}"),
                value: *value,
                timestamp: ms(p.wall_time),
                step: p.step,
            })
        })
        .collect();
    let step = points.iter().map(|p| p.step).max().unwrap_or(0);
    let end = ms(crate::curve::end(artifact));
    let mut finals = crate::diff::final_metrics(&artifact.metrics);
    if let Some(r) = &artifact.resources {
        let mut used = BTreeMap::new();
        let r = serde_json::to_value(r).unwrap_or_default();
        crate::diff::flatten("resources", &r, &mut used);
        finals.extend(used.into_iter().filter(|(_, v)| v.is_number()));
    }
    finals.insert("seconds".into(), Value::from(artifact.seconds));
    out.extend(finals.iter().filter_map(|(name, v)| {
        let value = v.as_f64().or_else(|| v.as_bool().map(f64::from))?;
        Some(Metric {
            key: name.clone(),
            value,
            timestamp: end,
            step,
        })
    }));
    out
}

/// What ties the MLflow run to the store and the recipe.
fn tags(artifact: &Artifact, artifact_dir: &Path, run: &RunTags) -> Vec<(String, String)> {
    let mut out = common_tags(
        &artifact.stage,
        &artifact.key,
        &format!("{}@{}", artifact.op, artifact.op_version),
        &artifact.manifest,
        &artifact.upstream_keys,
        run,
    );
    out.extend([
        (
            "nemo_dag.artifact".into(),
            artifact_dir.display().to_string(),
        ),
        ("nemo_dag.host".into(), artifact.host.clone()),
        ("nemo_dag.version".into(), artifact.engine_version.clone()),
    ]);
    for (name, input) in &artifact.inputs {
        let value = match input {
            InputRecord::Upstream {
                stage, output, key, ..
            } => format!("{stage}:{output} {key}"),
            InputRecord::File { path, digest } => format!("{path} {digest}"),
        };
        out.push((format!("nemo_dag.input.{name}"), value));
    }
    out
}

/// The tags of every run: the stage, its key, its op, the manifest, what it read, how it was
/// run, and who ran it.
fn common_tags(
    stage: &str,
    key: &str,
    op: &str,
    manifest: &str,
    upstream_keys: &[String],
    run: &RunTags,
) -> Vec<(String, String)> {
    let mut out = vec![
        ("nemo_dag.key".into(), key.to_string()),
        ("nemo_dag.stage".into(), stage.to_string()),
        ("nemo_dag.op".into(), op.to_string()),
        ("nemo_dag.manifest".into(), manifest.to_string()),
        ("nemo_dag.upstream_keys".into(), upstream_keys.join(" ")),
        ("nemo_dag.command".into(), run.argv.join(" ")),
        ("mlflow.source.name".into(), manifest.to_string()),
    ];
    if let Some(v) = &run.variant {
        out.push(("nemo_dag.variant".into(), v.clone()));
    }
    if let Ok(user) = std::env::var("USER") {
        out.push(("mlflow.user".into(), user));
    }
    out
}

/// Seconds since 1970 as whole milliseconds.
fn ms(seconds: f64) -> i64 {
    (seconds * 1000.0).round() as i64
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn artifact() -> Artifact {
        serde_json::from_value(json!({
            "schema": 1, "key": "abc", "stage": "sft[lr=1e-3]", "op": "sft", "op_version": 2,
            "params": {"lr": 1e-3, "optim": {"betas": [0.9, 0.95]}, "name": "x"},
            "inputs": {"model": {"kind": "upstream", "stage": "pretrain", "output": "model", "key": "k1", "digest": "d"}},
            "outputs": {}, "upstream_keys": ["k1"], "manifest": "recipe.yaml",
            "started_at": "1970-01-01T00:00:10.000Z", "seconds": 2.0, "host": "h",
            "engine_version": "0.1.0",
            "metrics": {
                "curve": [{"step": 1, "loss": 3.0, "lr": 1e-3}, {"step": 2, "loss": 2.0, "lr": 5e-4}],
                "final_loss": 2.0,
                "generation": {"accuracy": 0.5, "samples": 6}
            }
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn params_are_flattened_to_dotted_names() {
        let a = artifact();
        let p = params(&a.params, a.cmd.as_deref());
        assert_eq!(
            p,
            [
                ("lr".to_string(), "0.001".to_string()),
                ("name".into(), "x".into()),
                ("optim.betas".into(), "[0.9,0.95]".into()),
            ]
        );
    }

    #[test]
    fn a_curve_is_logged_at_its_steps_and_the_final_figures_at_the_last() {
        let m = metrics(&artifact());
        let at = |key: &str| -> Vec<(i64, f64, i64)> {
            m.iter()
                .filter(|x| x.key == key)
                .map(|x| (x.step, x.value, x.timestamp))
                .collect()
        };
        assert_eq!(at("train/loss"), [(1, 3.0, 11_000), (2, 2.0, 12_000)]);
        assert_eq!(at("train/lr").len(), 2);
        assert_eq!(at("final_loss"), [(2, 2.0, 12_000)]);
        assert_eq!(at("generation.accuracy"), [(2, 0.5, 12_000)]);
        assert_eq!(at("seconds"), [(2, 2.0, 12_000)]);
    }

    #[test]
    fn tags_tie_the_run_to_its_key_inputs_and_manifest() {
        let t: BTreeMap<String, String> = tags(
            &artifact(),
            Path::new("/s/artifacts/abc"),
            &RunTags {
                argv: vec!["nemo-dag".into(), "run".into(), "recipe.yaml".into()],
                variant: None,
            },
        )
        .into_iter()
        .collect();
        assert_eq!(t["nemo_dag.key"], "abc");
        assert_eq!(t["nemo_dag.op"], "sft@2");
        assert_eq!(t["nemo_dag.upstream_keys"], "k1");
        assert_eq!(t["nemo_dag.input.model"], "pretrain:model k1");
        assert_eq!(t["nemo_dag.artifact"], "/s/artifacts/abc");
        assert_eq!(t["nemo_dag.command"], "nemo-dag run recipe.yaml");
    }
}
