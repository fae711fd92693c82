//! The part of MLflow's tracking REST API that nemo-dag speaks
//! (<https://mlflow.org/docs/latest/api_reference/rest-api.html>): find or create an experiment,
//! create a run, log its params, metrics and tags in batches, and end it. Nothing else: no
//! artifacts, no model registry.
//!
//! Every request is short-lived: a connection gets [`CONNECT_TIMEOUT`], a whole request
//! [`REQUEST_TIMEOUT`]. What a tracker that is down or slow costs is bounded by those; what the
//! caller does about a failure (say it once, stop trying) is the caller's.
//!
//! Credentials come from the environment, as MLflow's own clients take them:
//! `MLFLOW_TRACKING_TOKEN` (a bearer token), or `MLFLOW_TRACKING_USERNAME` and
//! `MLFLOW_TRACKING_PASSWORD` (basic authentication).

use reqwest::{Method, StatusCode, Url};
use serde_json::{Value, json};
use std::time::Duration;

/// How long a connection may take to open.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a whole request may take, answer included.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// `runs/log-batch`'s limits: entities of each kind, and in all, per request.
const MAX_METRICS: usize = 1000;
const MAX_PARAMS: usize = 100;
const MAX_TAGS: usize = 100;
const MAX_ENTITIES: usize = 1000;
/// The longest key, param value and tag value a server takes (MLflow 2 and 3; a tag's limit is
/// higher on newer servers).
const MAX_KEY: usize = 250;
const MAX_PARAM_VALUE: usize = 6000;
const MAX_TAG_VALUE: usize = 5000;

/// A failed request.
#[derive(Debug, Clone, PartialEq)]
pub enum Error {
    /// No answer: the server is down, unreachable, or slower than the timeouts.
    Unreachable(String),
    /// The server answered with an error (its status, and MLflow's message when there is one).
    Refused { status: u16, message: String },
    /// The server answered with something that is not MLflow's answer.
    Unexpected(String),
}

impl Error {
    /// Whether the server as a whole cannot be used (no answer, credentials refused, a failure
    /// of its own), rather than refusing what one request held (a 400 about a value).
    pub fn is_down(&self) -> bool {
        match self {
            Error::Refused { status, .. } => {
                !(400..500).contains(status) || matches!(status, 401 | 403 | 404 | 405 | 429)
            }
            Error::Unreachable(_) | Error::Unexpected(_) => true,
        }
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Unreachable(why) => write!(f, "no answer: {why}"),
            Error::Refused { status, message } => write!(f, "refused ({status}): {message}"),
            Error::Unexpected(what) => write!(f, "not an MLflow answer: {what}"),
        }
    }
}

/// One value of a metric at one step; `timestamp` in milliseconds since the epoch.
#[derive(Debug, Clone, PartialEq)]
pub struct Metric {
    pub key: String,
    pub value: f64,
    pub timestamp: i64,
    pub step: i64,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Finished,
    Failed,
}

/// A tracking server's client.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    /// The tracking URI as given, without a trailing `/`: the UI lives there.
    base: String,
    auth: Auth,
}

#[derive(Debug, Clone)]
enum Auth {
    None,
    Bearer(String),
    Basic(String, String),
}

impl Client {
    /// A client for the server at `tracking_uri` (`http://` or `https://`, with any path prefix
    /// the server is mounted under). Nothing is sent yet. The error says what is wrong with the
    /// URI.
    pub fn new(tracking_uri: &str) -> Result<Client, String> {
        let uri = tracking_uri.trim();
        let url = Url::parse(uri).ok().filter(|u| {
            matches!(u.scheme(), "http" | "https")
                && u.host_str().is_some()
                && u.query().is_none()
                && u.fragment().is_none()
        });
        if url.is_none() {
            return Err(format!(
                "`{tracking_uri}` is not an http:// or https:// server: nemo-dag talks to a tracking server (`mlflow server`) through its REST API, not to a file store or a hosted URI scheme"
            ));
        }
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .build()
            .map_err(|e| format!("cannot make an HTTP client: {e}"))?;
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let auth = match (
            var("MLFLOW_TRACKING_TOKEN"),
            var("MLFLOW_TRACKING_USERNAME"),
        ) {
            (Some(token), _) => Auth::Bearer(token),
            (None, Some(user)) => {
                Auth::Basic(user, var("MLFLOW_TRACKING_PASSWORD").unwrap_or_default())
            }
            (None, None) => Auth::None,
        };
        Ok(Client {
            http,
            base: uri.trim_end_matches('/').to_string(),
            auth,
        })
    }

    /// The tracking URI, as the UI's address.
    pub fn base(&self) -> &str {
        &self.base
    }

    /// The id of the experiment named `name`, created if there is none.
    pub async fn experiment(&self, name: &str) -> Result<String, Error> {
        let by_name = || async {
            let found = self
                .call(
                    Method::GET,
                    "experiments/get-by-name",
                    &[("experiment_name", name)],
                    None,
                )
                .await;
            match found {
                Ok(v) => {
                    let e = &v["experiment"];
                    if e["lifecycle_stage"] == "deleted" {
                        return Err(Error::Refused {
                            status: 200,
                            message: format!(
                                "the experiment `{name}` is deleted: restore it (`mlflow experiments restore`) or name another"
                            ),
                        });
                    }
                    id(e, "experiment_id").map(Some)
                }
                Err(Error::Refused { status: 404, .. }) => Ok(None),
                Err(e) => Err(e),
            }
        };
        if let Some(id) = by_name().await? {
            return Ok(id);
        }
        let created = self
            .call(
                Method::POST,
                "experiments/create",
                &[],
                Some(json!({ "name": name })),
            )
            .await;
        match created {
            Ok(v) => id(&v, "experiment_id"),
            // Another client created it meanwhile.
            Err(Error::Refused { status: 400, .. }) => by_name().await?.ok_or_else(|| {
                Error::Unexpected(format!("experiment `{name}` neither made nor found"))
            }),
            Err(e) => Err(e),
        }
    }

    /// A new run in `experiment_id`, started at `start_time` (ms since the epoch); its id.
    pub async fn create_run(
        &self,
        experiment_id: &str,
        name: &str,
        start_time: i64,
        tags: &[(String, String)],
    ) -> Result<String, Error> {
        let body = json!({
            "experiment_id": experiment_id,
            "run_name": name,
            "start_time": start_time,
            "tags": pairs(tags, MAX_TAG_VALUE),
        });
        let v = self
            .call(Method::POST, "runs/create", &[], Some(body))
            .await?;
        id(&v["run"]["info"], "run_id")
    }

    /// Log params, metrics and tags to a run, in as many requests as the server's limits ask.
    /// Keys are made ones the server takes ([`key`]); two params that end up with one key keep
    /// both, the second with a suffix (a server refuses a param logged twice).
    pub async fn log(
        &self,
        run_id: &str,
        params: &[(String, String)],
        metrics: &[Metric],
        tags: &[(String, String)],
    ) -> Result<(), Error> {
        for body in batches(run_id, params, metrics, tags) {
            self.call(Method::POST, "runs/log-batch", &[], Some(body))
                .await?;
        }
        Ok(())
    }

    /// Mark a run ended at `end_time` (ms since the epoch).
    pub async fn end_run(&self, run_id: &str, status: Status, end_time: i64) -> Result<(), Error> {
        let status = match status {
            Status::Finished => "FINISHED",
            Status::Failed => "FAILED",
        };
        let body = json!({ "run_id": run_id, "status": status, "end_time": end_time });
        self.call(Method::POST, "runs/update", &[], Some(body))
            .await
            .map(drop)
    }

    /// The UI's page of an experiment, as its table of runs (MLflow 3's UI opens on its GenAI
    /// view without `workflowType`; older ones ignore it).
    pub fn experiment_url(&self, experiment_id: &str) -> String {
        format!(
            "{}/#/experiments/{experiment_id}?workflowType=machine_learning",
            self.base
        )
    }

    async fn call(
        &self,
        method: Method,
        endpoint: &str,
        query: &[(&str, &str)],
        body: Option<Value>,
    ) -> Result<Value, Error> {
        let mut url = Url::parse(&format!("{}/api/2.0/mlflow/{endpoint}", self.base))
            .map_err(|e| Error::Unexpected(e.to_string()))?;
        if !query.is_empty() {
            url.query_pairs_mut().extend_pairs(query);
        }
        let mut request = self.http.request(method, url);
        request = match &self.auth {
            Auth::None => request,
            Auth::Bearer(token) => request.bearer_auth(token),
            Auth::Basic(user, password) => request.basic_auth(user, Some(password)),
        };
        if let Some(body) = body {
            request = request
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body.to_string());
        }
        let answer = request
            .send()
            .await
            .map_err(|e| Error::Unreachable(cause(&e)))?;
        let status = answer.status();
        let text = answer
            .text()
            .await
            .map_err(|e| Error::Unreachable(cause(&e)))?;
        let parsed: Option<Value> = serde_json::from_str(&text).ok();
        if status.is_success() {
            return parsed.ok_or_else(|| Error::Unexpected(snippet(&text)));
        }
        let message = parsed
            .as_ref()
            .and_then(|v| v["message"].as_str())
            .map(str::to_string)
            .unwrap_or_else(|| match status {
                StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => {
                    "credentials are missing or not allowed (MLFLOW_TRACKING_TOKEN, or MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD)".to_string()
                }
                _ => snippet(&text),
            });
        Err(Error::Refused {
            status: status.as_u16(),
            message,
        })
    }
}

/// A name as a key the server takes: letters, digits, `_ - . / :` and spaces (`[`, `]`, `=`
/// and anything else become `_`, quotes go), read as a path that is already normal (the server
/// refuses `a//b`, a leading or trailing `/`, and `.` or `..` segments), at most 250 characters.
pub fn key(name: &str) -> String {
    let chars: String = name
        .chars()
        .filter(|c| *c != '"')
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_-./: ".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    let mut k = chars
        .split('/')
        .filter(|segment| !segment.is_empty())
        .map(|segment| match segment {
            "." | ".." => "_",
            other => other,
        })
        .collect::<Vec<_>>()
        .join("/");
    truncate(&mut k, MAX_KEY);
    // Cutting may leave a trailing `/`.
    while k.ends_with('/') {
        k.pop();
    }
    if k.is_empty() {
        k.push('_');
    }
    k
}

/// The bodies of `runs/log-batch` that log everything: params and tags first, then the
/// metrics, each request within the limits.
fn batches(
    run_id: &str,
    params: &[(String, String)],
    metrics: &[Metric],
    tags: &[(String, String)],
) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    let params: Vec<(String, String)> = params
        .iter()
        .map(|(k, v)| {
            let base = key(k);
            let mut unique = base.clone();
            let mut n = 1;
            while !seen.insert(unique.clone()) {
                n += 1;
                let suffix = format!("_{n}");
                let mut stem = base.clone();
                truncate(&mut stem, MAX_KEY - suffix.len());
                unique = format!("{stem}{suffix}");
            }
            (unique, v.clone())
        })
        .collect();
    let (mut p, mut t, mut m) = (&params[..], tags, metrics);
    let mut out = Vec::new();
    while !(p.is_empty() && t.is_empty() && m.is_empty()) {
        let (ps, rest) = p.split_at(p.len().min(MAX_PARAMS));
        p = rest;
        let (ts, rest) = t.split_at(t.len().min(MAX_TAGS));
        t = rest;
        let room = MAX_METRICS.min(MAX_ENTITIES - ps.len() - ts.len());
        let (ms, rest) = m.split_at(m.len().min(room));
        m = rest;
        let metrics: Vec<Value> = ms
            .iter()
            .map(|x| {
                json!({
                    "key": key(&x.key),
                    "value": x.value,
                    "timestamp": x.timestamp,
                    "step": x.step,
                })
            })
            .collect();
        out.push(json!({
            "run_id": run_id,
            "params": pairs(ps, MAX_PARAM_VALUE),
            "tags": pairs(ts, MAX_TAG_VALUE),
            "metrics": metrics,
        }));
    }
    out
}

/// `[{key, value}]`, keys made safe and values cut to `max` characters.
fn pairs(items: &[(String, String)], max: usize) -> Vec<Value> {
    items
        .iter()
        .map(|(k, v)| {
            let mut v = v.clone();
            truncate(&mut v, max);
            json!({ "key": key(k), "value": v })
        })
        .collect()
}

/// Cut `s` to at most `max` characters.
fn truncate(s: &mut String, max: usize) {
    if let Some((at, _)) = s.char_indices().nth(max) {
        s.truncate(at);
    }
}

/// A string id at `field` of `v`.
fn id(v: &Value, field: &str) -> Result<String, Error> {
    v[field]
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| Error::Unexpected(format!("no `{field}` in {}", snippet(&v.to_string()))))
}

/// The innermost cause of a transport error: "connection refused", "operation timed out".
fn cause(e: &reqwest::Error) -> String {
    let mut source: &dyn std::error::Error = e;
    while let Some(next) = source.source() {
        source = next;
    }
    if e.is_timeout() {
        return "timed out".to_string();
    }
    source.to_string()
}

/// The start of a body, for a message.
fn snippet(text: &str) -> String {
    let mut s = text.trim().to_string();
    truncate(&mut s, 200);
    if s.is_empty() {
        "an empty body".to_string()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_ones_the_server_takes() {
        assert_eq!(key("train/loss"), "train/loss");
        assert_eq!(key("sft[lr=1e-3]"), "sft_lr_1e-3_");
        assert_eq!(key("model.\"a.b\""), "model.a.b");
        assert_eq!(key("généré"), "g_n_r_");
        assert_eq!(key(""), "_");
        assert_eq!(key(&"x".repeat(300)).len(), 250);
        // Paths the server normalises, and so refuses.
        assert_eq!(key("blend.s3://bucket/x/"), "blend.s3:/bucket/x");
        assert_eq!(key("/a/./b/../c"), "a/_/b/_/c");
        assert_eq!(key("//"), "_");
    }

    fn metric(i: usize) -> Metric {
        Metric {
            key: "train/loss".into(),
            value: i as f64,
            timestamp: 0,
            step: i as i64,
        }
    }

    #[test]
    fn a_batch_keeps_within_the_servers_limits_and_loses_nothing() {
        let params: Vec<(String, String)> =
            (0..250).map(|i| (format!("p{i}"), i.to_string())).collect();
        let tags: Vec<(String, String)> = (0..30).map(|i| (format!("t{i}"), "v".into())).collect();
        let metrics: Vec<Metric> = (0..2500).map(metric).collect();
        let bodies = batches("r", &params, &metrics, &tags);
        let count = |b: &Value, what: &str| b[what].as_array().map_or(0, Vec::len);
        for b in &bodies {
            assert!(count(b, "params") <= MAX_PARAMS && count(b, "tags") <= MAX_TAGS);
            assert!(count(b, "metrics") <= MAX_METRICS);
            let all = count(b, "params") + count(b, "tags") + count(b, "metrics");
            assert!(all <= MAX_ENTITIES, "{all}");
        }
        let total = |what: &str| bodies.iter().map(|b| count(b, what)).sum::<usize>();
        assert_eq!(
            (total("params"), total("tags"), total("metrics")),
            (250, 30, 2500)
        );
        // Every step once, in order.
        let steps: Vec<i64> = bodies
            .iter()
            .flat_map(|b| b["metrics"].as_array().cloned().unwrap_or_default())
            .map(|m| m["step"].as_i64().unwrap_or(-1))
            .collect();
        assert_eq!(steps, (0..2500).collect::<Vec<i64>>());
        assert_eq!(batches("r", &[], &[], &[]), Vec::<Value>::new());
    }

    #[test]
    fn params_that_become_one_key_are_both_kept_and_long_values_are_cut() {
        let params = vec![
            ("a[b]".to_string(), "1".to_string()),
            ("a_b_".to_string(), "2".to_string()),
            ("long".to_string(), "é".repeat(7000)),
        ];
        let body = &batches("r", &params, &[], &[])[0];
        let p = body["params"].as_array().cloned().unwrap_or_default();
        assert_eq!(p[0], json!({"key": "a_b_", "value": "1"}));
        assert_eq!(p[1], json!({"key": "a_b__2", "value": "2"}));
        let cut = p[2]["value"].as_str().unwrap_or("");
        assert_eq!(cut.chars().count(), MAX_PARAM_VALUE);
        let long = vec![
            ("y".repeat(300), "1".to_string()),
            ("y".repeat(260), "2".to_string()),
        ];
        let body = &batches("r", &long, &[], &[])[0];
        let second = body["params"][1]["key"].as_str().unwrap_or("");
        assert!(
            second.len() == MAX_KEY && second.ends_with("_2"),
            "{second}"
        );
    }

    #[test]
    fn a_refused_value_is_the_stages_problem_and_anything_else_the_servers() {
        let refused = |status| Error::Refused {
            status,
            message: String::new(),
        };
        assert!(!refused(400).is_down());
        for status in [401, 403, 404, 500, 503] {
            assert!(refused(status).is_down(), "{status}");
        }
        assert!(Error::Unreachable("timed out".into()).is_down());
    }

    #[test]
    fn only_an_http_server_is_a_tracking_uri() {
        assert!(Client::new("http://127.0.0.1:5000").is_ok());
        assert!(Client::new("https://mlflow.example.com/prefix/").is_ok());
        for bad in [
            "file:///tmp/mlruns",
            "databricks",
            "sqlite:///x.db",
            "mlruns",
        ] {
            let e = Client::new(bad).map(|_| ()).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[tokio::test]
    async fn a_server_that_is_down_or_silent_costs_at_most_the_timeout() {
        // A port nothing listens on (bound, then closed), and one that accepts and never answers.
        let closed = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .unwrap_or(9);
        let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap_or_else(|e| panic!("{e}"));
        let port = silent.local_addr().map(|a| a.port()).unwrap_or(9);
        std::thread::spawn(move || {
            let mut held = Vec::new();
            while let Ok((conn, _)) = silent.accept() {
                held.push(conn);
            }
        });
        for (port, why) in [(closed, None), (port, Some("timed out"))] {
            let client =
                Client::new(&format!("http://127.0.0.1:{port}")).unwrap_or_else(|e| panic!("{e}"));
            let clock = std::time::Instant::now();
            let tried = tokio::time::timeout(
                REQUEST_TIMEOUT + Duration::from_secs(10),
                client.experiment("x"),
            )
            .await;
            match tried {
                Ok(Err(Error::Unreachable(w))) => {
                    assert!(why.is_none_or(|why| w == why), "{w}")
                }
                other => panic!("port {port}: {other:?}"),
            }
            assert!(clock.elapsed() < REQUEST_TIMEOUT + Duration::from_secs(2));
        }
    }
}
