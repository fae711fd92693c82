//! `tokenize`: text datasets → Megatron `.bin`/`.idx` shards and a `blend.json`, as Nemotron's
//! pretrain data prep makes them (Nemotron `data_prep/recipes/pretrain.py`; see docs/parity.md).
//!
//! ```yaml
//! tokenize:
//!   op: tokenize
//!   inputs:
//!     tokenizer: "train_tok:tokenizer"   # any Hugging Face tokenizer.json
//!     books: data/shakespeare.txt
//!     math: "gen_math:problems"
//!   params:
//!     datasets:                          # one blend (split into train/valid/test by shard)...
//!       - {input: books, weight: 1.0}
//!       - {input: math, weight: 0.5}
//!     # ...or per-split blends: train: [...], valid: [...], test: [...]
//!     num_shards: 4
//!     valid_shards: 1
//!     test_shards: 1
//!     add_eos: true
//! ```
//!
//! What happens, in order:
//! 1. **Plan** each dataset's files into `num_shards` shards, deterministically: files sorted by
//!    size (largest first, then path), each put into the currently lightest shard. With fewer
//!    files than shards, a file is split by rows: it gets shards in proportion to its size, and
//!    shard `j` of `k` reads the rows with `row % k == j`. `sample: N` reads the first N rows of
//!    each dataset into one shard.
//! 2. **Tokenize** every shard (all shards in parallel, each with batch encoding): drop documents
//!    shorter than `min_doc_chars` characters, encode without special tokens, prepend BOS if
//!    `add_bos`, append EOS if `add_eos`, then truncate to `max_doc_tokens`; documents that end
//!    up empty are never written; a dataset that writes none is an error unless `allow_empty`.
//!    Encoding is [`nemo_dag_data::tokenizer::FastBpe`] when the tokenizer.json
//!    is a byte-level BPE configuration it reproduces exactly (the same ids as the `tokenizers`
//!    crate), else the `tokenizers` crate itself; the stage log says which (`encoder: …`).
//! 3. **Write** `datasets/<name>/shard_<i:06d>.{bin,idx}` (MMIDIDX v1; see [`nemo_dag_data::megatron`]).
//! 4. **Split and blend**: in single-blend mode all shards of all datasets are shuffled together
//!    with Python's `random.Random(seed)` (seed 42 by default, as Nemotron); the first
//!    `test_shards` go to test, the next `valid_shards` to valid, the rest to train. Each shard
//!    keeps its dataset's weight; zero-weight datasets are left out. `blend.json` is
//!    `{"train": ["w", "datasets/<name>/shard_000000", …], "valid": […], "test": […]}`, the format
//!    Megatron-Bridge's `per_split_data_args_path` reads. Prefixes are relative to `blend.json`'s
//!    directory, so an artifact never depends on where the store is.
//!
//! **dtype.** Tokens are stored as int32 by default (Nemotron's writer default). `uint16` halves
//! the size and is allowed when every id fits: the tokenizer's vocabulary, added tokens included,
//! must be below 65,500 (Megatron's `preprocess_data.py` rule); `auto` picks uint16 exactly then.

use nemo_dag_data::megatron::{DType, IndexedWriter, smallest_for_vocab};
use nemo_dag_data::text::{self, OnBadRow, ReadStats};
use nemo_dag_op::{DeclError, Metrics, Op, Outputs, Port, RunContext, RunError, Spec, StageDecl};
use rayon::prelude::*;
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub struct Tokenize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetSpec {
    /// The stage input holding the dataset's files.
    input: String,
    /// Name in the output (defaults to the input name).
    #[serde(default)]
    name: Option<String>,
    #[serde(default = "one")]
    weight: f64,
    #[serde(default)]
    text_field: Option<String>,
}

fn one() -> f64 {
    1.0
}
fn default_shards() -> usize {
    1
}
fn default_true() -> bool {
    true
}
fn default_text_field() -> String {
    "text".into()
}
fn default_eos() -> Option<String> {
    Some("<|endoftext|>".into())
}
fn default_seed() -> u64 {
    42
}
fn default_dtype() -> String {
    "int32".into()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Params {
    #[serde(default)]
    datasets: Option<Vec<DatasetSpec>>,
    #[serde(default)]
    train: Option<Vec<DatasetSpec>>,
    #[serde(default)]
    valid: Option<Vec<DatasetSpec>>,
    #[serde(default)]
    test: Option<Vec<DatasetSpec>>,
    #[serde(default = "default_shards")]
    num_shards: usize,
    #[serde(default)]
    valid_shards: usize,
    #[serde(default)]
    test_shards: usize,
    #[serde(default)]
    add_bos: bool,
    #[serde(default = "default_true")]
    add_eos: bool,
    #[serde(default)]
    bos_token: Option<String>,
    #[serde(default = "default_eos")]
    eos_token: Option<String>,
    #[serde(default)]
    min_doc_chars: Option<usize>,
    #[serde(default)]
    max_doc_tokens: Option<usize>,
    /// `int32` (default), `uint16`, or `auto`.
    #[serde(default = "default_dtype")]
    dtype: String,
    #[serde(default)]
    sample: Option<u64>,
    #[serde(default = "default_text_field")]
    text_field: String,
    #[serde(default)]
    on_bad_row: OnBadRow,
    #[serde(default = "default_seed")]
    seed: u64,
    /// Publish a dataset that gives no documents instead of failing.
    #[serde(default)]
    allow_empty: bool,
}

/// The blend: which datasets go to which split (`None` = split by shard shuffle).
struct Blend {
    single: Option<Vec<DatasetSpec>>,
    per_split: BTreeMap<&'static str, Vec<DatasetSpec>>,
}

impl Params {
    fn blend(&self, inputs: &[&str]) -> Result<Blend, DeclError> {
        let per_split = [
            ("train", &self.train),
            ("valid", &self.valid),
            ("test", &self.test),
        ];
        let any_split = per_split.iter().any(|(_, s)| s.is_some());
        match (&self.datasets, any_split) {
            (Some(_), true) => Err(DeclError::new(
                &["params"],
                "give either `datasets` (one blend) or `train`/`valid`/`test` (per-split blends), not both",
            )),
            (Some(d), false) => Ok(Blend {
                single: Some(d.clone()),
                per_split: BTreeMap::new(),
            }),
            (None, true) => Ok(Blend {
                single: None,
                per_split: per_split
                    .iter()
                    .filter_map(|(name, s)| s.as_ref().map(|s| (*name, s.clone())))
                    .collect(),
            }),
            (None, false) => Ok(Blend {
                single: Some(
                    inputs
                        .iter()
                        .filter(|i| **i != "tokenizer")
                        .map(|i| DatasetSpec {
                            input: i.to_string(),
                            name: None,
                            weight: 1.0,
                            text_field: None,
                        })
                        .collect(),
                ),
                per_split: BTreeMap::new(),
            }),
        }
    }
}

impl Blend {
    fn all(&self) -> Vec<(&'static str, &DatasetSpec)> {
        match &self.single {
            Some(d) => d.iter().map(|d| ("", d)).collect(),
            None => self
                .per_split
                .iter()
                .flat_map(|(s, ds)| ds.iter().map(move |d| (*s, d)))
                .collect(),
        }
    }
}

static SPEC: Spec = Spec {
    name: "tokenize",
    version: 1,
    summary: "text datasets → Megatron .bin/.idx shards + blend.json (train/valid/test)",
    inputs: &[Port {
        name: "tokenizer",
        required: true,
        what: "a tokenizer.json",
    }],
    other_inputs: Some("the text datasets to tokenize"),
    outputs: Outputs::Fixed(&[("data", "data")]),
    resumable: false,
    launched: false,
    gpu: false,
};

impl Op for Tokenize {
    type Params = Params;

    fn spec(&self) -> &'static Spec {
        &SPEC
    }

    fn check(&self, p: &Params, stage: &StageDecl) -> Result<(), DeclError> {
        let blend = p.blend(&stage.inputs)?;
        let all = blend.all();
        if all.is_empty() {
            return Err(DeclError::new(
                &["inputs"],
                "tokenize needs at least one dataset input besides `tokenizer`",
            ));
        }
        let mut names = std::collections::BTreeSet::new();
        for (i, (split, d)) in all.iter().enumerate() {
            let at = if split.is_empty() { "datasets" } else { split };
            if !stage.inputs.contains(&d.input.as_str()) || d.input == "tokenizer" {
                return Err(DeclError::new(
                    &["params", at],
                    format!(
                        "dataset {i}: `{}` is not a dataset input of this stage",
                        d.input
                    ),
                ));
            }
            if !(d.weight >= 0.0 && d.weight.is_finite()) {
                return Err(DeclError::new(
                    &["params", at],
                    format!("dataset `{}`: weight must be ≥ 0", d.input),
                ));
            }
            let name = d.name.as_deref().unwrap_or(&d.input);
            if !names.insert((split.to_string(), name.to_string())) {
                return Err(DeclError::new(
                    &["params", at],
                    format!("dataset name `{name}` appears twice"),
                ));
            }
        }
        if p.num_shards == 0 {
            return Err(DeclError::new(
                &["params", "num_shards"],
                "num_shards must be at least 1",
            ));
        }
        if blend.single.is_some()
            && p.sample.is_none()
            && p.valid_shards + p.test_shards >= p.num_shards * all.len()
        {
            return Err(DeclError::new(
                &["params", "valid_shards"],
                format!(
                    "valid_shards + test_shards = {} leaves no shard for train ({} shards in all)",
                    p.valid_shards + p.test_shards,
                    p.num_shards * all.len()
                ),
            ));
        }
        if !matches!(p.dtype.as_str(), "int32" | "uint16" | "auto") {
            return Err(DeclError::new(
                &["params", "dtype"],
                format!("dtype `{}`: use int32, uint16 or auto", p.dtype),
            ));
        }
        if p.add_bos && p.bos_token.is_none() {
            return Err(DeclError::new(
                &["params", "add_bos"],
                "add_bos needs `bos_token`",
            ));
        }
        if p.add_eos && p.eos_token.is_none() {
            return Err(DeclError::new(
                &["params", "add_eos"],
                "add_eos needs `eos_token`",
            ));
        }
        Ok(())
    }

    fn run(&self, p: &Params, ctx: &mut RunContext) -> Result<Metrics, RunError> {
        let (tokenizer, tok_path) = crate::load_tokenizer(ctx.inputs)?;
        let special = |name: &str, token: &Option<String>| -> Result<Option<u32>, RunError> {
            token
                .as_ref()
                .map(|t| {
                    tokenizer.token_to_id(t).ok_or_else(|| {
                        RunError::new(format!(
                            "{name} `{t}` is not a token of {}",
                            tok_path.display()
                        ))
                    })
                })
                .transpose()
        };
        let bos = if p.add_bos {
            special("bos_token", &p.bos_token)?
        } else {
            None
        };
        let eos = if p.add_eos {
            special("eos_token", &p.eos_token)?
        } else {
            None
        };
        let vocab = tokenizer.get_vocab_size(true);
        let dtype = match p.dtype.as_str() {
            "uint16" if smallest_for_vocab(vocab) != DType::U16 => {
                return Err(RunError::new(format!(
                    "dtype uint16 needs a vocabulary below 65,500 tokens; this tokenizer has {vocab}: use int32"
                )));
            }
            "uint16" => DType::U16,
            "auto" => smallest_for_vocab(vocab),
            _ => DType::I32,
        };
        let blend = p
            .blend(&ctx.stage.inputs)
            .map_err(|e| RunError::new(e.message))?;
        let shards_per_dataset = if p.sample.is_some() { 1 } else { p.num_shards };

        // 1. Plan every dataset's shards.
        let mut jobs: Vec<ShardJob> = Vec::new();
        for (split, d) in blend.all() {
            let path = ctx
                .inputs
                .get(&d.input)
                .ok_or_else(|| RunError::new(format!("no input `{}`", d.input)))?;
            let name = d.name.clone().unwrap_or_else(|| d.input.clone());
            let files = sized_files(path)?;
            for (i, reads) in plan_shards(&files, shards_per_dataset)
                .into_iter()
                .enumerate()
            {
                jobs.push(ShardJob {
                    split,
                    dataset: name.clone(),
                    weight: d.weight,
                    text_field: d.text_field.clone().unwrap_or_else(|| p.text_field.clone()),
                    reads,
                    prefix: PathBuf::from("datasets")
                        .join(&name)
                        .join(format!("shard_{i:06}")),
                });
            }
        }

        // 2–3. Tokenize and write every shard, in parallel.
        let settings = Settings {
            bos,
            eos,
            min_doc_chars: p.min_doc_chars,
            max_doc_tokens: p.max_doc_tokens,
            on_bad: p.on_bad_row,
            sample: p.sample,
            dtype,
        };
        let out_dir = ctx.out_dir.join("data");
        // Our own byte-level BPE where it reproduces this tokenizer.json exactly, else the
        // `tokenizers` crate (see `nemo_dag_data::tokenizer`).
        let fast = match nemo_dag_data::tokenizer::FastBpe::from_json(&std::fs::read_to_string(
            &tok_path,
        )?) {
            Ok(fast) => {
                writeln!(ctx.log, "encoder: nemo-dag's byte-level BPE (fast path)")?;
                Some(fast)
            }
            Err(why) => {
                writeln!(
                    ctx.log,
                    "encoder: the tokenizers crate (fast path unsupported: {why})"
                )?;
                None
            }
        };
        let encoder = Encoder {
            tokenizer: &tokenizer,
            fast: fast.as_ref(),
        };
        let results: Vec<Result<ShardResult, RunError>> = jobs
            .par_iter()
            .map(|job| tokenize_shard(&encoder, job, &settings, &out_dir))
            .collect();
        let mut shards = Vec::with_capacity(results.len());
        for r in results {
            shards.push(r?);
        }
        if !p.allow_empty {
            for (split, d) in blend.all() {
                refuse_empty(split, d.name.as_deref().unwrap_or(&d.input), &shards)?;
            }
        }

        // 4. Splits and blend.json.
        let mut splits: BTreeMap<&str, Vec<&ShardResult>> =
            BTreeMap::from([("train", vec![]), ("valid", vec![]), ("test", vec![])]);
        let written: Vec<&ShardResult> = shards.iter().filter(|s| s.weight > 0.0).collect();
        if blend.single.is_some() {
            let (train, valid, test) = nemo_dag_data::sft::packing::assign_splits(
                written,
                p.seed,
                p.valid_shards,
                p.test_shards,
            );
            splits.insert("train", train);
            splits.insert("valid", valid);
            splits.insert("test", test);
        } else {
            for s in written {
                splits.entry(s.split).or_default().push(s);
            }
        }
        let mut blend_json = serde_json::Map::new();
        let mut split_tokens = serde_json::Map::new();
        for (split, list) in &splits {
            let entries: Vec<Value> = list
                .iter()
                .flat_map(|s| {
                    [
                        Value::String(crate::format_weight(s.weight)),
                        Value::String(s.prefix.display().to_string()),
                    ]
                })
                .collect();
            blend_json.insert(split.to_string(), Value::Array(entries));
            split_tokens.insert(
                format!("{split}_tokens"),
                Value::from(list.iter().map(|s| s.tokens).sum::<u64>()),
            );
        }
        let text = serde_json::to_string_pretty(&Value::Object(blend_json))
            .map_err(|e| RunError::new(e.to_string()))?;
        std::fs::write(out_dir.join("blend.json"), text + "\n")?;

        let mut per_dataset: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
        for s in &shards {
            let e = per_dataset.entry(s.dataset.clone()).or_default();
            e.0 += s.documents;
            e.1 += s.tokens;
            e.2 += s.skipped;
        }
        for (name, (docs, tokens, skipped)) in &per_dataset {
            writeln!(
                ctx.log,
                "dataset {name}: {docs} documents, {tokens} tokens, {skipped} rows skipped"
            )?;
        }
        let total_tokens: u64 = shards.iter().map(|s| s.tokens).sum();
        let mut m = Metrics::new();
        m.insert("total_tokens".into(), Value::from(total_tokens));
        m.insert(
            "documents".into(),
            Value::from(shards.iter().map(|s| s.documents).sum::<u64>()),
        );
        m.insert("num_shards".into(), Value::from(shards.len()));
        m.insert("dtype".into(), Value::from(dtype.name()));
        m.insert("vocab_size".into(), Value::from(vocab));
        m.insert(
            "tokenizer_digest".into(),
            Value::from(blake3_file(&tok_path)?),
        );
        m.insert(
            "skipped_rows".into(),
            Value::from(shards.iter().map(|s| s.skipped).sum::<u64>()),
        );
        for (k, v) in split_tokens {
            m.insert(k, v);
        }
        m.insert(
            "source_datasets".into(),
            Value::Array(
                blend
                    .all()
                    .iter()
                    .map(|(split, d)| {
                        let name = d.name.clone().unwrap_or_else(|| d.input.clone());
                        let (docs, tokens, _) = per_dataset.get(&name).copied().unwrap_or_default();
                        json!({"name": name, "input": d.input, "weight": d.weight, "split": if split.is_empty() { Value::Null } else { Value::from(*split) }, "documents": docs, "tokens": tokens})
                    })
                    .collect(),
            ),
        );
        writeln!(
            ctx.log,
            "{total_tokens} tokens in {} shards ({})",
            shards.len(),
            dtype.name()
        )?;
        Ok(m)
    }
}

/// An error if the dataset `name` (of `split`, in per-split blends) wrote no document: an
/// empty or blank input, a wrong `text_field` with skipped rows, or a `min_doc_chars` that
/// keeps nothing must not publish an empty dataset.
fn refuse_empty(split: &str, name: &str, shards: &[ShardResult]) -> Result<(), RunError> {
    let mine = || {
        shards
            .iter()
            .filter(|s| s.split == split && s.dataset == name)
    };
    if mine().any(|s| s.documents > 0) {
        return Ok(());
    }
    let sum = |f: fn(&ShardResult) -> u64| mine().map(f).sum::<u64>();
    let of_split = if split.is_empty() {
        String::new()
    } else {
        format!(" (split {split})")
    };
    Err(RunError::new(format!(
        "dataset `{name}`{of_split} has no documents: {} documents read, {} shorter than `min_doc_chars`, {} rows skipped as bad",
        sum(|s| s.rows),
        sum(|s| s.short),
        sum(|s| s.skipped),
    ))
    .with_help("check the input and `text_field`; set `allow_empty: true` to publish an empty dataset"))
}

fn blake3_file(path: &Path) -> Result<String, RunError> {
    Ok(blake3::hash(&std::fs::read(path)?).to_hex().to_string())
}

/// Which rows of which files one shard reads.
#[derive(Debug, Clone, PartialEq)]
struct FileRead {
    file: PathBuf,
    /// Read rows with `row % modulus == remainder` (1, 0 = every row).
    modulus: usize,
    remainder: usize,
}

struct ShardJob {
    split: &'static str,
    dataset: String,
    weight: f64,
    text_field: String,
    reads: Vec<FileRead>,
    prefix: PathBuf,
}

struct ShardResult {
    split: &'static str,
    dataset: String,
    weight: f64,
    prefix: PathBuf,
    /// Documents written.
    documents: u64,
    tokens: u64,
    /// Bad rows skipped (each counted by one shard only, however many read its file).
    skipped: u64,
    /// Documents of this shard read, and those of them dropped by `min_doc_chars`.
    rows: u64,
    short: u64,
}

struct Settings {
    bos: Option<u32>,
    eos: Option<u32>,
    min_doc_chars: Option<usize>,
    max_doc_tokens: Option<usize>,
    on_bad: OnBadRow,
    sample: Option<u64>,
    dtype: DType,
}

fn sized_files(path: &Path) -> Result<Vec<(PathBuf, u64)>, RunError> {
    text::files_of(path)?
        .into_iter()
        .map(|f| {
            let len = std::fs::metadata(&f)
                .map_err(|e| RunError::new(format!("{}: {e}", f.display())))?
                .len();
            Ok((f, len))
        })
        .collect()
}

/// Assign files to `n` shards: largest file first into the lightest shard (ties: lowest index);
/// with fewer files than shards, split files by rows in proportion to their size.
fn plan_shards(files: &[(PathBuf, u64)], n: usize) -> Vec<Vec<FileRead>> {
    let mut sorted: Vec<&(PathBuf, u64)> = files.iter().collect();
    sorted.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let mut shards: Vec<Vec<FileRead>> = vec![Vec::new(); n];
    if files.len() >= n {
        let mut load = vec![0u64; n];
        for (file, size) in sorted {
            let lightest = (0..n).min_by_key(|i| (load[*i], *i)).unwrap_or(0);
            load[lightest] += size;
            shards[lightest].push(FileRead {
                file: file.clone(),
                modulus: 1,
                remainder: 0,
            });
        }
    } else if !files.is_empty() {
        // Every file gets at least one shard; the rest go by size (largest remainder).
        let total: u64 = sorted.iter().map(|f| f.1.max(1)).sum();
        let spare = n - sorted.len();
        let ideal: Vec<f64> = sorted
            .iter()
            .map(|f| spare as f64 * f.1.max(1) as f64 / total as f64)
            .collect();
        let mut counts: Vec<usize> = ideal.iter().map(|x| 1 + x.floor() as usize).collect();
        let mut left = n - counts.iter().sum::<usize>();
        let mut order: Vec<usize> = (0..sorted.len()).collect();
        order.sort_by(|a, b| {
            (ideal[*b].fract())
                .total_cmp(&ideal[*a].fract())
                .then(a.cmp(b))
        });
        for i in order {
            if left == 0 {
                break;
            }
            counts[i] += 1;
            left -= 1;
        }
        let mut next = 0;
        for (f, k) in sorted.iter().zip(counts) {
            for r in 0..k {
                shards[next].push(FileRead {
                    file: f.0.clone(),
                    modulus: k,
                    remainder: r,
                });
                next += 1;
            }
        }
    }
    for s in &mut shards {
        s.sort_by(|a, b| a.file.cmp(&b.file));
    }
    shards
}

const BATCH: usize = 1000;

/// The tokenizer, and our fast encoder of it when it has one.
struct Encoder<'a> {
    tokenizer: &'a tokenizers::Tokenizer,
    fast: Option<&'a nemo_dag_data::tokenizer::FastBpe>,
}

impl Encoder<'_> {
    /// Each text's ids without special tokens, with `bos` before and `eos` after.
    fn encode_batch(
        &self,
        texts: Vec<String>,
        bos: Option<u32>,
        eos: Option<u32>,
    ) -> Result<Vec<Vec<u32>>, String> {
        if let Some(fast) = self.fast {
            return texts
                .par_iter()
                .map(|text| {
                    let mut ids = Vec::with_capacity(text.len() / 3 + 2);
                    ids.extend(bos);
                    fast.encode_into(text, &mut ids)?;
                    ids.extend(eos);
                    Ok(ids)
                })
                .collect();
        }
        let encodings = self
            .tokenizer
            .encode_batch_fast(texts, false)
            .map_err(|e| e.to_string())?;
        Ok(encodings
            .iter()
            .map(|enc| {
                let mut ids: Vec<u32> = Vec::with_capacity(enc.get_ids().len() + 2);
                ids.extend(bos);
                ids.extend_from_slice(enc.get_ids());
                ids.extend(eos);
                ids
            })
            .collect())
    }
}

fn tokenize_shard(
    encoder: &Encoder,
    job: &ShardJob,
    s: &Settings,
    out_dir: &Path,
) -> Result<ShardResult, RunError> {
    let prefix = out_dir.join(&job.prefix);
    if let Some(parent) = prefix.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut writer = IndexedWriter::create(&prefix, s.dtype)
        .map_err(|e| RunError::new(format!("{}: {e}", prefix.display())))?;
    let mut stats = ReadStats::default();
    let mut documents = 0u64;
    let mut tokens = 0u64;
    let mut batch: Vec<String> = Vec::with_capacity(BATCH);
    let mut flush = |batch: &mut Vec<String>, writer: &mut IndexedWriter| -> Result<(), RunError> {
        if batch.is_empty() {
            return Ok(());
        }
        let documents_ids = encoder
            .encode_batch(std::mem::take(batch), s.bos, s.eos)
            .map_err(|e| RunError::new(format!("{}: tokenizer failed: {e}", job.dataset)))?;
        for mut ids in documents_ids {
            if let Some(max) = s.max_doc_tokens {
                ids.truncate(max);
            }
            if ids.is_empty() {
                continue;
            }
            writer
                .add_document(&ids)
                .map_err(|e| RunError::new(format!("{}: {e}", prefix.display())))?;
            documents += 1;
            tokens += ids.len() as u64;
        }
        Ok(())
    };
    let limit = s.sample;
    let (mut rows, mut short) = (0u64, 0u64);
    for read in &job.reads {
        let mut row = 0usize;
        let skipped_before = stats.skipped;
        text::read_documents::<RunError>(
            &read.file,
            &job.text_field,
            s.on_bad,
            limit,
            &mut stats,
            |doc| {
                let mine = row % read.modulus == read.remainder;
                row += 1;
                if !mine {
                    return Ok(());
                }
                rows += 1;
                if s.min_doc_chars
                    .is_some_and(|m| doc.text.chars().count() < m)
                {
                    short += 1;
                    return Ok(());
                }
                batch.push(doc.text);
                if batch.len() == BATCH {
                    flush(&mut batch, &mut writer)?;
                }
                Ok(())
            },
        )?;
        if read.remainder != 0 {
            // The shard that reads the file's first share counts its skipped rows.
            stats.skipped = skipped_before;
        }
    }
    flush(&mut batch, &mut writer)?;
    writer
        .finish()
        .map_err(|e| RunError::new(format!("{}: {e}", prefix.display())))?;
    Ok(ShardResult {
        split: job.split,
        dataset: job.dataset.clone(),
        weight: job.weight,
        prefix: job.prefix.clone(),
        documents,
        tokens,
        skipped: stats.skipped,
        rows,
        short,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(name: &str, size: u64) -> (PathBuf, u64) {
        (PathBuf::from(name), size)
    }

    #[test]
    fn files_go_largest_first_into_the_lightest_shard() {
        let files = [f("a", 10), f("b", 50), f("c", 30), f("d", 30), f("e", 5)];
        let plan = plan_shards(&files, 2);
        let names: Vec<Vec<&str>> = plan
            .iter()
            .map(|s| s.iter().map(|r| r.file.to_str().unwrap()).collect())
            .collect();
        // b(50)→0; c(30)→1; d(30)→1 (30<50); a(10)→0 (50<60); e(5)→0 (60=60, lower index)
        assert_eq!(names, vec![vec!["a", "b", "e"], vec!["c", "d"]]);
    }

    #[test]
    fn fewer_files_than_shards_split_rows_disjointly() {
        let files = [f("big", 300), f("small", 100)];
        let plan = plan_shards(&files, 4);
        let reads: Vec<(String, usize, usize)> = plan
            .iter()
            .flatten()
            .map(|r| (r.file.display().to_string(), r.modulus, r.remainder))
            .collect();
        assert_eq!(
            reads,
            vec![
                ("big".into(), 3, 0),
                ("big".into(), 3, 1),
                ("big".into(), 3, 2),
                ("small".into(), 1, 0)
            ]
        );
    }
}
