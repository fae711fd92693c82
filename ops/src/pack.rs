//! `pack`: chat conversations → packed SFT sequences in Parquet, as Nemotron's SFT data prep
//! makes them (NVIDIA-NeMo/Nemotron `src/nemotron/data_prep/`; see docs/parity.md, "SFT data").
//!
//! ```yaml
//! pack:
//!   op: pack
//!   inputs: {tokenizer: "tok:tokenizer", chat: "gen_chat:data"}
//!   params: {chat_template: nano3, pack_size: 4096, algorithm: first_fit_shuffle}
//! ```
//!
//! For every conversation ([`nemo_dag_data::chat`]): render it with the chat template, cut it into role
//! chunks by incremental rendering, expand reasoning conversations into one sequence per user
//! turn, tokenize each chunk on its own and set the loss mask to 1 exactly on assistant tokens.
//! A malformed row (invalid UTF-8, not JSON, not an object, no or ill-typed messages, tool
//! arguments that are not JSON, a template that cannot render it) fails the stage naming its
//! file and line, or with `on_bad_row: skip` is dropped and counted (`skipped_rows`); rows a
//! rule drops (the `used_in` filter, a `<tool_call>` without a `# Tools` header, renders that
//! are not prefixes of each other) are counted, as Nemotron counts them. Then, per shard
//! ([`nemo_dag_data::sft::packing`]): pack the sequences into bins of at most `pack_size` tokens (a
//! conversation is never split; an over-long one is truncated and counted), materialize each
//! bin with `seq_start_id` and the label-aligned mask, and write
//! `shards/<dataset>/shard_<i:06d>.parquet` ([`nemo_dag_data::sft::parquet`]). Shards never mix
//! datasets. Finally whole shards are split into train/valid/test by the ratio rule and a seeded
//! shuffle, and `splits/<split>/<position:06d>__<dataset>__shard_<i:06d>.parquet` relative
//! symlinks plus `blend.json` record the result. `chat_template.jinja` keeps the template the
//! rows were rendered with: `sft` passes it on to its model, and `export` to transformers.
//!
//! Inputs: `tokenizer` (a tokenizer.json), optional `chat_template` (a Jinja file) or
//! `tokenizer_config` (a Hugging Face tokenizer_config.json with `chat_template`); every other
//! input is a chat dataset: a JSON Lines file, or a directory of them, read whatever their
//! extension (a Parquet or compressed file is an error).

use nemo_dag_data::chat::{
    self, ChatOptions, ChatStats, ChatTemplate, DropReason, RowConfig, RowFields, TemplateSource,
};
use nemo_dag_data::sft::packing::{self, Algorithm, PackStats, Sequence};
use nemo_dag_data::sft::parquet as packed_parquet;
use nemo_dag_data::text::{self, OnBadRow, files_of};
use nemo_dag_op::{
    DeclError, Facts, Metrics, Op, Outputs, Plan, Port, RunContext, RunError, Spec, StageDecl,
    Upstream,
};
use rayon::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub struct Pack;

const RESERVED_INPUTS: [&str; 3] = ["tokenizer", "chat_template", "tokenizer_config"];

fn d_template() -> String {
    "nano3".into()
}
fn d_pack_size() -> usize {
    4096
}
fn d_algorithm() -> String {
    "first_fit_shuffle".into()
}
fn d_seed() -> u64 {
    42
}
fn d_one() -> usize {
    1
}
fn d_train() -> f64 {
    0.98
}
fn d_split() -> f64 {
    0.01
}
fn d_messages() -> String {
    "messages".into()
}
fn d_tools() -> String {
    "tools".into()
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    /// A bundled template name (`nano3`) or an inline Jinja template; a template file is given
    /// as the input `chat_template` instead (so its content is part of the key).
    #[serde(default = "d_template")]
    chat_template: String,
    #[serde(default = "d_pack_size")]
    pack_size: usize,
    #[serde(default = "d_algorithm")]
    algorithm: String,
    #[serde(default = "d_seed")]
    seed: u64,
    #[serde(default = "d_one")]
    num_shards: usize,
    #[serde(default = "d_train")]
    train_ratio: f64,
    #[serde(default = "d_split")]
    valid_ratio: f64,
    #[serde(default = "d_split")]
    test_ratio: f64,
    #[serde(default)]
    max_doc_tokens: Option<usize>,
    #[serde(default = "d_messages")]
    messages_field: String,
    #[serde(default = "d_tools")]
    tools_field: String,
    #[serde(default)]
    used_in_filter: Option<String>,
    #[serde(default)]
    truncate_history_thinking: Option<bool>,
    /// Read only the first N rows of each dataset (into one shard).
    #[serde(default)]
    sample: Option<usize>,
    /// Dataset (input name) → weight; 1 when not given. With non-uniform weights each split
    /// keeps whole shards so that its row mix matches the weights (`_select_weighted_shards`).
    #[serde(default)]
    weights: BTreeMap<String, f64>,
    /// A malformed row (not JSON, not an object, no or ill-typed messages, invalid UTF-8):
    /// `fail` names its file and line; `skip` drops and counts it.
    #[serde(default)]
    on_bad_row: OnBadRow,
    /// Publish a dataset that gives no sequences instead of failing.
    #[serde(default)]
    allow_empty: bool,
}

impl Params {
    fn algorithm(&self) -> Result<Algorithm, nemo_dag_data::Error> {
        Algorithm::from_name(&self.algorithm, self.seed)
    }
}

static SPEC: Spec = Spec {
    name: "pack",
    // 2: the artifact keeps the chat template it rendered with (`chat_template.jinja`).
    version: 2,
    summary: "chat JSONL → chat-templated, loss-masked, packed Parquet shards + train/valid/test splits",
    inputs: &[
        Port {
            name: "tokenizer",
            required: true,
            what: "a tokenizer.json",
        },
        Port {
            name: "chat_template",
            required: false,
            what: "a Jinja chat template file",
        },
        Port {
            name: "tokenizer_config",
            required: false,
            what: "a tokenizer_config.json whose chat_template is used",
        },
    ],
    other_inputs: Some("the chat datasets to pack"),
    outputs: Outputs::Fixed(&[("data", "data")]),
    resumable: false,
    launched: false,
    gpu: false,
};

impl Op for Pack {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        if !stage.inputs.iter().any(|i| !RESERVED_INPUTS.contains(i)) {
            return Err(DeclError::new(
                &["inputs"],
                "pack needs at least one chat JSONL input besides `tokenizer`",
            ));
        }
        p.algorithm()
            .map_err(|e| DeclError::new(&["params", "algorithm"], e))?;
        if p.pack_size == 0 || p.num_shards == 0 {
            return Err(DeclError::new(
                &["params", "pack_size"],
                "pack_size and num_shards must be at least 1",
            ));
        }
        packing::split_shard_counts(p.num_shards, p.train_ratio, p.valid_ratio, p.test_ratio)
            .map_err(|e| DeclError::new(&["params", "train_ratio"], e))?;
        for (name, w) in &p.weights {
            if !stage.inputs.contains(&name.as_str()) || RESERVED_INPUTS.contains(&name.as_str()) {
                return Err(DeclError::new(
                    &["params", "weights", name],
                    format!("`{name}` is not a dataset input of this stage"),
                ));
            }
            if !(*w >= 0.0 && w.is_finite()) {
                return Err(DeclError::new(
                    &["params", "weights", name],
                    "a weight must be ≥ 0",
                ));
            }
        }
        let has_file =
            stage.inputs.contains(&"chat_template") || stage.inputs.contains(&"tokenizer_config");
        if !has_file {
            ChatTemplate::load(&param_template(&p.chat_template))
                .map_err(|e| DeclError::new(&["params", "chat_template"], e))?;
        }
        Ok(())
    }

    /// Tells the stages downstream how long a packed row is.
    fn plan(&self, p: &Params, _: &Upstream, _: &StageDecl) -> Plan {
        Plan {
            facts: Facts {
                sequence: Some(p.pack_size),
                ..Facts::default()
            },
            estimate: None,
        }
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let (tokenizer, _) = crate::load_tokenizer(ctx.inputs)?;
        let source = match (
            ctx.inputs.get("chat_template"),
            ctx.inputs.get("tokenizer_config"),
        ) {
            (Some(f), _) => TemplateSource::File(f.clone()),
            (None, Some(f)) => TemplateSource::TokenizerConfig(f.clone()),
            (None, None) => param_template(&p.chat_template),
        };
        let template = ChatTemplate::load(&source)
            .map_err(|e| RunError::new(format!("chat template: {e}")))?;
        let algorithm = p.algorithm().map_err(RunError::new)?;
        let mut chat_opts = ChatOptions::default();
        if let Some(t) = p.truncate_history_thinking {
            chat_opts.truncate_history_thinking = t;
        }
        let cfg = RowConfig {
            fields: RowFields {
                messages_field: p.messages_field.clone(),
                tools_field: p.tools_field.clone(),
            },
            used_in_filter: p.used_in_filter.clone(),
            max_doc_tokens: p.max_doc_tokens,
            chat: chat_opts,
            ..Default::default()
        };

        // Rows of every dataset, dealt into shards (row i → shard i mod n).
        let shards_per_dataset = if p.sample.is_some() { 1 } else { p.num_shards };
        let mut datasets: Vec<Dataset> = Vec::new();
        let mut jobs: Vec<Job> = Vec::new();
        for (name, path) in ctx
            .inputs
            .iter()
            .filter(|(n, _)| !RESERVED_INPUTS.contains(&n.as_str()))
        {
            let (files, rows) = read_rows(path, p.sample)?;
            let mut dealt: Vec<Vec<Row>> = (0..shards_per_dataset).map(|_| Vec::new()).collect();
            for (i, row) in rows.into_iter().enumerate() {
                dealt[i % shards_per_dataset].push(row);
            }
            jobs.extend(dealt.into_iter().enumerate().map(|(index, rows)| Job {
                dataset: datasets.len(),
                index,
                rows,
            }));
            datasets.push(Dataset {
                name: name.clone(),
                files,
            });
        }

        let out = ctx.out_dir.join("data");
        let encode = |text: &str| -> Vec<u32> {
            // A plain tokenizer.json (no truncation or padding configured) cannot fail here.
            tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        };
        let results: Vec<Result<ShardOut, ShardError>> = jobs
            .par_iter()
            .map(|job| {
                let dataset = &datasets[job.dataset];
                let found = shard_sequences(job, dataset, &template, &cfg, encode, p.on_bad_row)?;
                let lengths: Vec<usize> = found.seqs.iter().map(|s| s.tokens.len()).collect();
                let bins = packing::pack(&lengths, p.pack_size, &algorithm);
                let rows: Vec<_> = bins
                    .iter()
                    .map(|b| packing::materialize(&found.seqs, b, p.pack_size))
                    .collect();
                let rel = PathBuf::from("shards")
                    .join(&dataset.name)
                    .join(format!("shard_{:06}.parquet", job.index));
                let path = out.join(&rel);
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(RunError::from)?;
                }
                packed_parquet::write(&path, &rows).map_err(RunError::from)?;
                Ok(ShardOut {
                    dataset: dataset.name.clone(),
                    index: job.index,
                    rel,
                    chat: found.stats,
                    skipped: found.skipped,
                    pack: PackStats::compute(&lengths, bins.len(), p.pack_size),
                })
            })
            .collect();
        let shards = first_error(results)?;
        if !p.allow_empty {
            for dataset in &datasets {
                refuse_empty(&dataset.name, &shards)?;
            }
        }

        // Whole shards into splits, then symlinks and blend.json.
        let (_, valid_n, test_n) =
            packing::split_shard_counts(shards.len(), p.train_ratio, p.valid_ratio, p.test_ratio)
                .map_err(RunError::new)?;
        let (train, valid, test) =
            packing::assign_splits(shards.iter().collect(), p.seed, valid_n, test_n);
        let weight = |d: &str| p.weights.get(d).copied().unwrap_or(1.0);
        let (train, valid, test) = (
            weighted(train, &p.weights),
            weighted(valid, &p.weights),
            weighted(test, &p.weights),
        );
        if train.is_empty() {
            return Err(RunError::new(
                "the train split has no shard: add data, shards, or weight",
            ));
        }
        let mut blend = serde_json::Map::new();
        let mut split_rows = serde_json::Map::new();
        for (split, list) in [("train", &train), ("valid", &valid), ("test", &test)] {
            let dir = out.join("splits").join(split);
            std::fs::create_dir_all(&dir)?;
            let mut entries = Vec::new();
            for (pos, s) in list.iter().enumerate() {
                let name = format!("{pos:06}__{}__shard_{:06}.parquet", s.dataset, s.index);
                std::os::unix::fs::symlink(Path::new("../..").join(&s.rel), dir.join(&name))?;
                entries.push(Value::from(crate::format_weight(weight(&s.dataset))));
                entries.push(Value::from(format!("splits/{split}/{name}")));
            }
            blend.insert(split.into(), Value::Array(entries));
            split_rows.insert(
                format!("{split}_rows"),
                Value::from(
                    list.iter()
                        .map(|s| s.pack.num_packed_sequences)
                        .sum::<usize>(),
                ),
            );
        }
        let text = serde_json::to_string_pretty(&Value::Object(blend))
            .map_err(|e| RunError::new(e.to_string()))?;
        std::fs::write(out.join("blend.json"), text + "\n")?;
        // The template the sequences were rendered with, for the model trained on them.
        std::fs::write(out.join(chat::CHAT_TEMPLATE_FILE), template.source())?;

        // Totals over all shards.
        let lengths_total: usize = shards.iter().map(|s| s.pack.total_tokens).sum();
        let seqs: usize = shards.iter().map(|s| s.pack.num_sequences).sum();
        let bins: usize = shards.iter().map(|s| s.pack.num_packed_sequences).sum();
        let sum = |f: fn(&ChatStats) -> u64| shards.iter().map(|s| f(&s.chat)).sum::<u64>();
        let factor = if bins == 0 {
            0.0
        } else {
            packing::py_round(seqs as f64 / bins as f64, 2)
        };
        let efficiency = if bins == 0 {
            0.0
        } else {
            packing::py_round(
                lengths_total as f64 / (bins * p.pack_size) as f64 * 100.0,
                1,
            )
        };
        writeln!(
            ctx.log,
            "{} rows → {seqs} sequences → {bins} packed rows of ≤ {} tokens (factor {factor}, efficiency {efficiency}%); {} rows dropped",
            sum(|c| c.num_input_rows),
            p.pack_size,
            sum(|c| c.num_filtered)
        )?;
        let mut m = Metrics::new();
        m.insert("pack_size".into(), Value::from(p.pack_size));
        m.insert("num_rows".into(), Value::from(sum(|c| c.num_input_rows)));
        m.insert("num_sequences".into(), Value::from(seqs));
        m.insert("num_packed_sequences".into(), Value::from(bins));
        m.insert("total_tokens".into(), Value::from(lengths_total));
        m.insert(
            "num_truncated_to_pack_size".into(),
            Value::from(
                shards
                    .iter()
                    .map(|s| s.pack.num_truncated_to_pack_size)
                    .sum::<usize>(),
            ),
        );
        m.insert("packing_factor".into(), json!(factor));
        m.insert("packing_efficiency".into(), json!(efficiency));
        m.insert("num_filtered".into(), Value::from(sum(|c| c.num_filtered)));
        m.insert(
            "num_validation_errors".into(),
            Value::from(sum(|c| c.num_validation_errors)),
        );
        m.insert("num_errors".into(), Value::from(sum(|c| c.num_errors)));
        m.insert(
            "skipped_rows".into(),
            Value::from(shards.iter().map(|s| s.skipped).sum::<u64>()),
        );
        m.insert(
            "num_truncated".into(),
            Value::from(sum(|c| c.num_truncated)),
        );
        m.insert("num_shards".into(), Value::from(shards.len()));
        m.insert("data_format".into(), Value::from("packed_sft_parquet"));
        for (k, v) in split_rows {
            m.insert(k, v);
        }
        Ok(m)
    }
}

struct ShardOut {
    dataset: String,
    index: usize,
    rel: PathBuf,
    chat: ChatStats,
    /// Malformed rows skipped under `on_bad_row: skip`.
    skipped: u64,
    pack: PackStats,
}

/// A dataset input: its name and its files, in the order they are read.
struct Dataset {
    name: String,
    files: Vec<PathBuf>,
}

/// One row of a dataset: its file (an index into [`Dataset::files`]), its line, and its text
/// or why it is not text.
struct Row {
    file: usize,
    line: usize,
    text: Result<String, String>,
}

/// The rows of one shard of a dataset (an index into the datasets).
struct Job {
    dataset: usize,
    index: usize,
    rows: Vec<Row>,
}

/// The rows of a dataset input, in file and line order (the first `sample` of them), and its
/// files.
fn read_rows(path: &Path, sample: Option<usize>) -> Result<(Vec<PathBuf>, Vec<Row>), RunError> {
    let files = files_of(path)?;
    let mut rows = Vec::new();
    for (file, name) in files.iter().enumerate() {
        if sample.is_some_and(|n| rows.len() >= n) {
            break;
        }
        let bytes = text::read_json_lines(name, "pack")?;
        rows.extend(text::json_lines(&bytes).map(|(line, text)| Row {
            file,
            line,
            text: text.map(str::to_string),
        }));
    }
    if let Some(n) = sample {
        rows.truncate(n);
    }
    Ok((files, rows))
}

/// What one shard's rows gave.
struct ShardSequences {
    seqs: Vec<Sequence>,
    stats: ChatStats,
    skipped: u64,
}

/// Why a shard failed: a malformed row (at its dataset, file and line, so that of several
/// shards' failures the first in reading order is reported), or anything else.
struct ShardError {
    at: (usize, usize, usize),
    error: RunError,
}

impl From<RunError> for ShardError {
    fn from(error: RunError) -> Self {
        ShardError {
            at: (usize::MAX, usize::MAX, usize::MAX),
            error,
        }
    }
}

/// A shard's rows through the chat pipeline: their sequences and counts. A malformed row
/// stops it under `on_bad_row: fail`; rows a rule drops are only counted.
fn shard_sequences(
    job: &Job,
    dataset: &Dataset,
    template: &ChatTemplate,
    cfg: &RowConfig,
    encode: impl Fn(&str) -> Vec<u32>,
    on_bad: OnBadRow,
) -> Result<ShardSequences, ShardError> {
    let mut found = ShardSequences {
        seqs: Vec::new(),
        stats: ChatStats::default(),
        skipped: 0,
    };
    for row in &job.rows {
        let result = match &row.text {
            Ok(text) => chat::process_row(template, text, cfg, &encode, &mut found.stats),
            Err(why) => Err(chat::unreadable_row(why, &mut found.stats)),
        };
        let reason = match result {
            Ok(seqs) => {
                found.seqs.extend(
                    seqs.into_iter()
                        .map(|(tokens, mask)| Sequence { tokens, mask }),
                );
                continue;
            }
            Err(reason) if reason.is_malformed() => reason,
            Err(_) => continue,
        };
        let at = format!("{}:{}", dataset.files[row.file].display(), row.line);
        on_bad
            .bad_row(&at, &describe(&reason, cfg), &mut found.skipped)
            .map_err(|e| ShardError {
                at: (job.dataset, row.file, row.line),
                error: e.into(),
            })?;
    }
    Ok(found)
}

/// A malformed row's reason as its error says it: an unreadable line as is, a missing
/// messages field with its name.
fn describe(reason: &DropReason, cfg: &RowConfig) -> String {
    match reason {
        DropReason::InvalidRow(why) if why.starts_with("invalid UTF-8") => why.clone(),
        DropReason::NoMessages => format!(
            "no messages (field `{}` is missing, null or empty)",
            cfg.fields.messages_field
        ),
        other => other.to_string(),
    }
}

/// Every shard, or the failure of the first failing row in reading order.
fn first_error(results: Vec<Result<ShardOut, ShardError>>) -> Result<Vec<ShardOut>, RunError> {
    let mut shards = Vec::with_capacity(results.len());
    let mut first: Option<ShardError> = None;
    for r in results {
        match r {
            Ok(shard) => shards.push(shard),
            Err(e) if first.as_ref().is_none_or(|f| e.at < f.at) => first = Some(e),
            Err(_) => {}
        }
    }
    match first {
        Some(e) => Err(e.error),
        None => Ok(shards),
    }
}

/// A split's shards after weighting: zero-weight datasets leave; with non-uniform weights,
/// whole shards are subsampled to match them ([`packing::subsample_by_weight`]).
fn weighted<'a>(list: Vec<&'a ShardOut>, weights: &BTreeMap<String, f64>) -> Vec<&'a ShardOut> {
    let weight = |d: &str| weights.get(d).copied().unwrap_or(1.0);
    let list: Vec<&ShardOut> = list
        .into_iter()
        .filter(|s| weight(&s.dataset) > 0.0)
        .collect();
    let mut names: Vec<&str> = list.iter().map(|s| s.dataset.as_str()).collect();
    names.sort();
    names.dedup();
    let w: Vec<f64> = names.iter().map(|n| weight(n)).collect();
    if w.windows(2).all(|x| x[0] == x[1]) {
        return list;
    }
    let index: Vec<(usize, usize)> = list
        .iter()
        .map(|s| {
            (
                names.iter().position(|n| *n == s.dataset).unwrap_or(0),
                s.pack.num_packed_sequences,
            )
        })
        .collect();
    packing::subsample_by_weight(&index, &w)
        .into_iter()
        .map(|i| list[i])
        .collect()
}

/// An error if the dataset `name` gave no sequences: a wrong field name, a filter that keeps
/// nothing, or rows that were all skipped must not publish an empty dataset.
fn refuse_empty(name: &str, shards: &[ShardOut]) -> Result<(), RunError> {
    let mine = || shards.iter().filter(|s| s.dataset == name);
    if mine().any(|s| s.pack.num_sequences > 0) {
        return Ok(());
    }
    let rows: u64 = mine().map(|s| s.chat.num_input_rows).sum();
    let dropped: u64 = mine().map(|s| s.chat.num_filtered).sum();
    let skipped: u64 = mine().map(|s| s.skipped).sum();
    Err(RunError::new(format!(
        "dataset `{name}` gave no sequences: {rows} rows read, {dropped} dropped ({skipped} of them malformed)"
    ))
    .with_help("check the input and `messages_field`/`used_in_filter`; set `allow_empty: true` to publish an empty dataset"))
}

/// A `chat_template` param: a bundled name, or inline Jinja (template files come as inputs).
fn param_template(param: &str) -> TemplateSource {
    if param.contains("{{") || param.contains("{%") {
        TemplateSource::Inline(param.to_string())
    } else {
        TemplateSource::Bundled(param.to_string())
    }
}
