//! Training ops end to end: generate → train_tokenizer → tokenize → pretrain (dense and hybrid)
//! → pack → sft → export, → rl_data → grpo → dpo, and eval (perplexity, multiple choice,
//! generation), through the CLI as a user runs them.
//!
//! The exported Llama checkpoint is checked against our own logits by a numpy transcription of
//! transformers' Llama forward (always, with `NEMO_DAG_PYTHON`), and by `transformers` itself
//! when `NEMO_DAG_TORCH_PYTHON` names a Python that has torch and transformers (opt-in: CPU torch
//! from PyPI is a multi-GB install, too heavy for every CI run; the test prints that it skips).

use nemo_dag_data::chat::{ChatTemplate, Conversation, NANO3_TEMPLATE, RenderFlags, RowFields};
use nemo_dag_model::checkpoint::load_model;
use nemo_dag_model::layers::Layout;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{Project, not_cached, output, python, states, table_column};

const RECIPE: &str = r#"
vars:
  steps: 8
stages:
  problems:
    op: generate
    params: {kind: arithmetic, count: 400, seed: 7, max_operand: 20}
  tokenizer:
    op: train_tokenizer
    inputs: {corpus: "problems:pretrain"}
    params:
      vocab_size: 300
      special_tokens: ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
  pretrain_data:
    op: tokenize
    inputs: {tokenizer: "tokenizer:tokenizer", arithmetic: "problems:pretrain"}
    params: {num_shards: 2, add_eos: true}
  pretrain:
    op: pretrain
    inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer"}
    params:
      model: {pattern: "*-*-", hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, ffn: 64, max_seq: 128}
      seq_length: 32
      steps: {{ steps }}
      global_batch: 8
      micro_batch: 4
      lr: 1e-2
      min_lr: 1e-3
      warmup: 2
      log_interval: 2
      save_interval: 3
  sft_data:
    op: pack
    inputs: {tokenizer: "tokenizer:tokenizer", arithmetic: "problems:chat"}
    params: {chat_template: nano3, pack_size: 128, num_shards: 1}
  sft:
    op: sft
    inputs: {model: "pretrain:model", data: "sft_data:data"}
    params: {steps: 3, global_batch: 4, micro_batch: 2, lr: 1e-3, log_interval: 1}
  export:
    op: export
    inputs: {model: "sft:model"}
    params: {format: llama}
  eval_sft:
    op: eval
    inputs: {model: "sft:model", data: "pretrain_data:data", tasks: "problems:prompts", choices: "problems:choices"}
    params:
      perplexity: {split: train, seq_length: 32, max_windows: 4}
      multiple_choice: {limit: 8, batch: 8}
      generation: {split: test, limit: 6, max_tokens: 8, batch: 4, contains: ["<tool_call>"]}
  rl_data:
    op: rl_data
    inputs: {prompts: "problems:prompts"}
    params: {valid_fraction: 0.1, test_fraction: 0.1}
  grpo:
    op: grpo
    inputs: {model: "sft:model", prompts: "rl_data:data"}
    params:
      num_prompts_per_step: 2
      num_generations_per_prompt: 4
      max_new_tokens: 6
      reference_policy_kl_penalty: 0.01
      steps: 2
      global_batch: 8
      micro_batch: 4
      lr: 1e-3
      log_interval: 1
      save_interval: 1
  dpo:
    op: dpo
    inputs: {model: "grpo:model", data: "problems:preferences"}
    params: {steps: 2, global_batch: 4, micro_batch: 2, lr: 1e-3, log_interval: 1}
"#;

/// A hybrid Mamba-2 / attention / MoE model with two shared MTP depths on the same data.
const HYBRID: &str = r#"
  hybrid:
    op: pretrain
    inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer"}
    params:
      model:
        pattern: "ME*-/*E/*E"
        hidden: 32
        heads: 2
        kv_heads: 1
        head_dim: 16
        ffn: 64
        activation: relu2
        position: none
        mamba: {heads: 4, head_dim: 16, state: 8, groups: 2, chunk: 16}
        moe: {experts: 4, top_k: 2, expert_ffn: 32, shared_ffn: 32, scaling: 2.5}
        mtp_shared: true
      seq_length: 32
      steps: 6
      global_batch: 4
      micro_batch: 2
      lr: 5e-3
      log_interval: 1
  export_hybrid:
    op: export
    inputs: {model: "hybrid:model"}
    params: {format: nemotron_h}
  import_llama:
    op: import_model
    inputs: {hf: "export:hf"}
    params: {source: "the recipe's own export"}
  reexport_llama:
    op: export
    inputs: {model: "import_llama:model"}
  import_hybrid:
    op: import_model
    inputs: {hf: "export_hybrid:hf"}
  reexport_hybrid:
    op: export
    inputs: {model: "import_hybrid:model"}
    params: {format: nemotron_h}
  sft_imported:
    op: sft
    inputs: {model: "import_hybrid:model", data: "sft_data:data"}
    params: {steps: 2, global_batch: 4, micro_batch: 2, lr: 1e-3, log_interval: 1}
  sft_sweep:
    op: sft
    inputs: {model: "pretrain:model", data: "sft_data:data"}
    params: {steps: 2, global_batch: 4, micro_batch: 2, lr: 1e-3, log_interval: 1}
    matrix: {lr: [1.0e-3, 3.0e-3]}
  eval_sweep:
    op: eval
    inputs: {model: "sft_sweep:model", data: "pretrain_data:data"}
    params:
      perplexity: {split: train, seq_length: 32, max_windows: 2}
"#;

fn show(p: &Project, stage: &str) -> Value {
    p.json(&["show", stage, "--manifest", "recipe.yaml", "--json"])
}

fn output_path(p: &Project, stage: &str, out: &str) -> PathBuf {
    PathBuf::from(show(p, stage)["outputs"][out]["path"].as_str().unwrap())
}

fn curve(p: &Project, stage: &str) -> Vec<f64> {
    show(p, stage)["metrics"]["curve"]
        .as_array()
        .unwrap()
        .iter()
        .map(|pt| pt["loss"].as_f64().unwrap())
        .collect()
}

#[test]
fn a_recipe_pretrains_fine_tunes_and_exports_a_model_transformers_reads() {
    let p = Project::new("train-recipe");
    p.write("recipe.yaml", &format!("{RECIPE}{HYBRID}"));
    let run = p.ok(&["run", "recipe.yaml"]);
    let all = [
        "problems",
        "tokenizer",
        "pretrain_data",
        "pretrain",
        "sft_data",
        "sft",
        "export",
        "eval_sft",
        "rl_data",
        "grpo",
        "dpo",
        "hybrid",
        "export_hybrid",
        "import_llama",
        "reexport_llama",
        "import_hybrid",
        "reexport_hybrid",
        "sft_imported",
        "sft_sweep[lr=1e-3]",
        "sft_sweep[lr=3e-3]",
        "eval_sweep[lr=1e-3]",
        "eval_sweep[lr=3e-3]",
    ];
    let s = states(&p.json(&["status", "recipe.yaml", "--json"]));
    for stage in all {
        assert_eq!(s[stage], "up-to-date", "{stage}\n{run}");
    }

    // The loss falls, and the artifact says where training ended.
    for stage in ["pretrain", "hybrid", "sft"] {
        let c = curve(&p, stage);
        assert!(c.iter().all(|l| l.is_finite()), "{stage}: {c:?}");
        assert!(c.last() < c.first(), "{stage} loss did not fall: {c:?}");
    }
    let m = show(&p, "pretrain")["metrics"].clone();
    assert_eq!(m["step"], 8);
    assert!(m["final_loss"].as_f64().unwrap() > 0.0);
    let model_dir = output_path(&p, "pretrain", "model");
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        assert!(model_dir.join(f).is_file(), "model/{f}");
    }

    // eval: perplexity below uniform guessing, an accuracy, a results file.
    let e = show(&p, "eval_sft")["metrics"].clone();
    let ppl = e["perplexity"]["perplexity"].as_f64().unwrap();
    assert!(
        ppl > 1.0 && ppl < 300.0 * 0.5,
        "perplexity {ppl} vs vocabulary 300"
    );
    let acc = e["generation"]["accuracy"].as_f64().unwrap();
    assert!(
        (0.0..=1.0).contains(&acc) && e["generation"]["samples"] == 6,
        "{e}"
    );
    let calls = e["generation"]["contains"]["<tool_call>"].as_f64();
    assert!(calls.is_some_and(|c| (0.0..=1.0).contains(&c)), "{e}");
    assert!(
        output_path(&p, "eval_sft", "results")
            .join("results.json")
            .is_file()
    );

    // Multiple choice by log-likelihood: a score per metric, the chance level beside it.
    let mc = &e["multiple_choice"];
    assert_eq!(mc["samples"], 8, "{e}");
    assert_eq!(mc["chance"], 0.25);
    for metric in ["acc", "acc_norm"] {
        assert!((0.0..=1.0).contains(&mc[metric].as_f64().unwrap()), "{mc}");
    }

    // grpo and dpo: their figures per step, in the curve and the log.
    let g = show(&p, "grpo")["metrics"].clone();
    assert_eq!(g["step"], 2, "{g}");
    for point in g["curve"].as_array().unwrap() {
        for k in ["reward", "accuracy", "response_length", "truncated", "kl"] {
            assert!(
                point["metrics"][k].is_number(),
                "grpo curve lacks {k}: {point}"
            );
        }
    }
    let d = show(&p, "dpo")["metrics"].clone();
    let first = &d["curve"][0]["metrics"];
    assert!(
        (first["preference_loss"].as_f64().unwrap() - std::f64::consts::LN_2).abs() < 1e-5,
        "at step 1 the policy is the reference: loss ln 2\n{d}"
    );

    check_tensorboard(&p);

    // A second run reruns nothing.
    let again = p.ok(&["run", "recipe.yaml", "--json"]).json();
    assert!(states(&again).values().all(|s| s == "cached"), "{again}");

    // Changing one SFT parameter reruns sft and what depends on it, nothing else.
    let sft_before = show(&p, "sft")["key"].as_str().unwrap().to_string();
    let changed = p
        .ok(&["run", "recipe.yaml", "stages.sft.params.lr=2e-3", "--json"])
        .json();
    let ran = not_cached(&changed);
    assert_eq!(
        ran,
        [
            "dpo:executed",
            "eval_sft:executed",
            "export:executed",
            "grpo:executed",
            "import_llama:executed",
            "reexport_llama:executed",
            "sft:executed"
        ],
        "{changed}"
    );

    // The exported Llama gives our logits, and so does the hybrid exported as NemotronH.
    check_plot(&p, &sft_before);
    check_runs(&p);
    check_report(&p);
    check_export(&p);
    check_chat_files(&p);
    check_nemotron_h_export(&p);

    // The dense model is no NemotronH (rotary attention, SwiGLU): the export fails, says why,
    // and publishes nothing.
    let refused = p.run(&[
        "run",
        "recipe.yaml",
        "stages.export.params.format=nemotron_h",
        "--target",
        "export",
    ]);
    assert_eq!(refused.code, 1, "{refused}");
    assert!(
        refused
            .stderr
            .contains("no NemotronH equivalent: attention with rotary positions"),
        "{refused}"
    );

    check_imports(&p);
}

/// Both exports imported back and exported again give the same files, byte for byte; an
/// imported model fine-tunes; an option we do not implement is refused by name.
fn check_imports(p: &Project) {
    for (first, again) in [
        ("export", "reexport_llama"),
        ("export_hybrid", "reexport_hybrid"),
    ] {
        for file in [
            "model.safetensors",
            "config.json",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
        ] {
            let read = |stage| std::fs::read(output_path(p, stage, "hf").join(file)).unwrap();
            assert!(
                read(first) == read(again),
                "{again}/hf/{file} differs from {first}'s"
            );
        }
    }
    let m = show(p, "import_llama")["metrics"].clone();
    assert_eq!(m["architecture"], "LlamaForCausalLM", "{m}");
    assert_eq!(m["pattern"], "*-*-", "{m}");
    assert_eq!(m["source"], "the recipe's own export", "{m}");
    let m = show(p, "import_hybrid")["metrics"].clone();
    assert_eq!(m["pattern"], "ME*-", "{m}");
    let c = curve(p, "sft_imported");
    assert!(c.iter().all(|l| l.is_finite()) && c.len() == 2, "{c:?}");

    // A checkpoint with biases on its attention is another model: refused, naming the key.
    let hf = output_path(p, "export", "hf");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    config["attention_bias"] = json!(true);
    p.write("biased/config.json", &config.to_string());
    for file in ["model.safetensors", "tokenizer.json"] {
        std::fs::copy(hf.join(file), p.dir.join("biased").join(file)).unwrap();
    }
    p.write(
        "import.yaml",
        "stages:\n  base:\n    op: import_model\n    inputs: {hf: biased}\n",
    );
    let out = p.run(&["run", "import.yaml"]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr
            .contains("`attention_bias: true` is not implemented"),
        "{out}"
    );
}

/// The chat template `pack` rendered the SFT data with reaches the export's
/// `tokenizer_config.json` through sft's model, and renders conversations there (jinja2 as
/// transformers sets it up, and transformers itself when NEMO_DAG_TORCH_PYTHON is set) as our
/// renderer does; `generate` stops where our eval does. A model that saw no chat data (the
/// pretrained hybrid) has no template and ends its documents with `<|endoftext|>`.
fn check_chat_files(p: &Project) {
    let read = |dir: &Path, file: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join(file)).unwrap()).unwrap()
    };
    let hf = output_path(p, "export", "hf");
    let tokenizer_config = read(&hf, "tokenizer_config.json");
    assert_eq!(tokenizer_config["chat_template"], NANO3_TEMPLATE);
    assert_eq!(tokenizer_config["eos_token"], "<|im_end|>");
    let tokenizer = tokenizers::Tokenizer::from_file(hf.join("tokenizer.json")).unwrap();
    let id = |t: &str| tokenizer.token_to_id(t).unwrap();
    let stops = json!([id("<|im_end|>"), id("<|endoftext|>")]);
    assert_eq!(read(&hf, "generation_config.json")["eos_token_id"], stops);
    assert_eq!(read(&hf, "config.json")["eos_token_id"], stops);
    assert_eq!(
        read(&hf, "generation_config.json")["pad_token_id"],
        id("<|endoftext|>")
    );
    let pretrained = output_path(p, "export_hybrid", "hf");
    let untemplated = read(&pretrained, "tokenizer_config.json");
    assert!(untemplated.get("chat_template").is_none(), "{untemplated}");
    assert_eq!(untemplated["eos_token"], "<|endoftext|>");

    // A plain turn, a reasoning turn with a tool call and its result (tojson, non-ASCII), and
    // a generation prompt without thinking, as eval asks for one.
    let conversations = [
        (
            json!({"messages": [
                {"role": "system", "content": "You add numbers."},
                {"role": "user", "content": "What is 3 + 4?"},
                {"role": "assistant", "content": "7"}]}),
            false,
            true,
        ),
        (
            json!({"messages": [
                {"role": "user", "content": "Use the tool: 2 + 5 «ünï»"},
                {"role": "assistant", "content": "", "reasoning_content": "I should call add.",
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "add", "arguments": {"a": 2, "b": 5}}}]},
                {"role": "tool", "content": "7"},
                {"role": "assistant", "content": "It is 7."}],
             "tools": [{"type": "function", "function": {
                "name": "add", "description": "Add two numbers.",
                "parameters": {"type": "object",
                               "properties": {"a": {"type": "integer", "description": "first"},
                                              "b": {"type": "integer", "enum": [5, 6]}},
                               "required": ["a", "b"]}}}]}),
            false,
            true,
        ),
        (
            json!({"messages": [{"role": "user", "content": "What is 9 - 4?"}]}),
            true,
            false,
        ),
    ];
    let template = ChatTemplate::new(NANO3_TEMPLATE).unwrap();
    let cases: Vec<Value> = conversations
        .iter()
        .map(|(record, generation_prompt, thinking)| {
            let c = Conversation::from_row(&record.to_string(), &RowFields::default()).unwrap();
            let flags = RenderFlags {
                enable_thinking: *thinking,
                ..RenderFlags::default()
            };
            let expected = template
                .render(&c.messages, c.tools.as_deref(), *generation_prompt, flags)
                .unwrap();
            json!({"messages": record["messages"], "tools": record.get("tools"),
                   "add_generation_prompt": generation_prompt, "enable_thinking": thinking,
                   "expected": expected})
        })
        .collect();
    let case = p.write("chat_cases.json", &Value::from(cases).to_string());
    let script = crate::common::repo().join("tests/py/check_chat_template.py");
    let ways = [python(), torch_python("the exported chat template")];
    for (py, flag) in ways.into_iter().zip([None, Some("--transformers")]) {
        let Some(py) = py else { continue };
        let mut c = Command::new(py);
        c.arg(&script).arg(&hf).arg(&case).args(flag);
        let out = output(c);
        assert_eq!(
            out.code, 0,
            "the exported chat template renders otherwise: {out}"
        );
        eprintln!("chat template check: {}", out.stdout.trim());
    }
}

/// The hybrid exported as `NemotronHForCausalLM`: its MTP depths left out and said so, and its
/// logits recomputed from the checkpoint alone by a numpy transcription of transformers'
/// forward (and by transformers itself when NEMO_DAG_TORCH_PYTHON is set).
fn check_nemotron_h_export(p: &Project) {
    let m = show(p, "export_hybrid")["metrics"].clone();
    assert_eq!(m["layers"], 4, "{m}");
    assert!(m["mtp_tensors_left_out"].as_u64().unwrap() > 0, "{m}");
    // 20 tokens: more than a Mamba chunk (16), so transformers' chunked scan crosses chunks.
    let case = logits_case(p, "hybrid", 20, "case_hybrid.json");
    let hf = output_path(p, "export_hybrid", "hf");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(hf.join("config.json")).unwrap()).unwrap();
    assert_eq!(
        config["layers_block_type"],
        json!(["linear_attention", "moe", "full_attention", "mlp"])
    );
    assert_eq!(config["routed_scaling_factor"], 2.5);
    let script = crate::common::repo().join("tests/py/check_nemotron_h.py");
    if let Some(py) = python() {
        let mut c = Command::new(py);
        c.arg(&script).arg(&hf).arg(&case);
        let out = output(c);
        assert_eq!(
            out.code, 0,
            "numpy NemotronH disagrees with our logits: {out}"
        );
        eprintln!("numpy NemotronH check: {}", out.stdout.trim());
    }
    if let Some(py) = torch_python("the NemotronH export") {
        let mut c = Command::new(py);
        let saved = p.path("saved_by_transformers");
        c.arg(&script).arg(&hf).arg(&case).arg("--transformers");
        c.arg("--save").arg(&saved);
        let out = output(c);
        assert_eq!(out.code, 0, "transformers disagrees with our logits: {out}");
        eprintln!("transformers NemotronH check: {}", out.stdout.trim());
        // What transformers writes itself (save_pretrained; 5.23 writes the hub's layout)
        // imports to the same model: exported again, the same tensors as our first export.
        p.write(
            "saved.yaml",
            "stages:\n  base:\n    op: import_model\n    inputs: {hf: saved_by_transformers}\n  \
             again:\n    op: export\n    inputs: {model: \"base:model\"}\n    params: {format: nemotron_h}\n",
        );
        p.ok(&["run", "saved.yaml"]);
        let again = PathBuf::from(
            p.json(&["show", "again", "--manifest", "saved.yaml", "--json"])["outputs"]["hf"]
                ["path"]
                .as_str()
                .unwrap(),
        );
        let tensors = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
        assert!(
            tensors(&again) == tensors(&hf),
            "transformers' save_pretrained, imported and exported, changed the tensors"
        );
    }
}

/// The two SFT runs' losses, overlaid: a curve of 3 points each, told apart by their lr.
fn check_plot(p: &Project, sft_before: &str) {
    let out = p.ok(&[
        "plot",
        &sft_before[..12],
        "sft",
        "--manifest",
        "recipe.yaml",
        "-o",
        "curves.svg",
    ]);
    assert!(out.stderr.contains("2 curves of `loss`"), "{out}");
    let doc = std::fs::read_to_string(p.path("curves.svg")).unwrap();
    let curves: Vec<&str> = doc
        .split("<polyline")
        .skip(1)
        .map(|c| {
            c.split("points=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
        })
        .collect();
    assert_eq!(curves.len(), 2, "{doc}");
    assert!(
        curves.iter().all(|c| c.split(' ').count() == 3),
        "{curves:?}"
    );
    assert!(
        doc.contains("lr=0.001") && doc.contains("lr=0.002"),
        "{doc}"
    );
    // A swept stage's name plots every copy, told apart by the swept value.
    let sweep = p.ok(&["plot", "sft_sweep", "--manifest", "recipe.yaml"]);
    assert_eq!(sweep.stdout.matches("<polyline").count(), 2, "{sweep}");
    assert!(
        sweep.stdout.contains("lr=0.001") && sweep.stdout.contains("lr=0.003"),
        "{sweep}"
    );
    // The same chart as a PNG, at twice the SVG's width (800); any other file type is refused
    // and nothing is written.
    let png = p.ok(&[
        "plot",
        "sft_sweep",
        "--manifest",
        "recipe.yaml",
        "-o",
        "sweep.png",
    ]);
    assert!(png.stderr.contains("2 curves of `loss`"), "{png}");
    let bytes = std::fs::read(p.path("sweep.png")).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert_eq!(u32::from_be_bytes(bytes[16..20].try_into().unwrap()), 1600);
    let jpeg = p.run(&["plot", "sft", "--manifest", "recipe.yaml", "-o", "c.jpg"]);
    assert_eq!(jpeg.code, 2, "{jpeg}");
    assert!(jpeg.stderr.contains("plot writes .svg or .png"), "{jpeg}");
    assert!(!p.path("c.jpg").exists());
    let none = p.run(&[
        "plot",
        "sft",
        "--metric",
        "rewad",
        "--manifest",
        "recipe.yaml",
    ]);
    assert_eq!(none.code, 2, "{none}");
    assert!(none.stderr.contains("has no `rewad`"), "{none}");
}

/// Each training stage's curve is in a TensorBoard event file in its artifact, which
/// TensorBoard's own reader (from PyPI) reads back: every figure of every point, at its step.
fn check_tensorboard(p: &Project) {
    let Some(py) = python() else { return };
    let has_reader = Command::new(&py)
        .args(["-c", "import tensorboard"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !has_reader {
        assert!(
            std::env::var("NEMO_DAG_REQUIRE_PYTHON").as_deref() != Ok("1"),
            "NEMO_DAG_REQUIRE_PYTHON=1 but {py} cannot import tensorboard"
        );
        eprintln!(
            "skipping the TensorBoard read-back: {py} lacks tensorboard (scripts/test installs it)"
        );
        return;
    }
    for (stage, tags) in [
        ("sft", vec!["train/loss", "train/lr", "train/grad_norm"]),
        ("grpo", vec!["train/loss", "train/reward", "train/kl"]),
        ("dpo", vec!["train/preference_loss"]),
    ] {
        let a = show(p, stage);
        let dir = a["tensorboard"].as_str().unwrap_or_else(|| panic!("{a}"));
        let read = output({
            let mut c = Command::new(&py);
            c.arg(crate::common::repo().join("tests/py/read_tensorboard.py"))
                .arg(dir);
            c
        });
        assert_eq!(read.code, 0, "{stage}: {read}");
        let events: Value = serde_json::from_str(&read.stdout).unwrap();
        let curve = a["metrics"]["curve"].as_array().unwrap();
        assert_eq!(
            events["files"].as_array().map(Vec::len),
            Some(1),
            "{events}"
        );
        assert_eq!(
            events["records"],
            curve.len() + 1,
            "a version record, then a point each"
        );
        for tag in tags {
            let name = tag.trim_start_matches("train/");
            let want: Vec<(i64, f64)> = curve
                .iter()
                .map(|pt| {
                    let v = pt.get(name).or_else(|| pt["metrics"].get(name)).unwrap();
                    (pt["step"].as_i64().unwrap(), v.as_f64().unwrap())
                })
                .collect();
            let got: Vec<(i64, f64)> = events["scalars"][tag]
                .as_array()
                .unwrap_or_else(|| panic!("{stage}: no {tag} in {events}"))
                .iter()
                .map(|e| (e[0].as_i64().unwrap(), e[1].as_f64().unwrap()))
                .collect();
            assert_eq!(got.len(), want.len(), "{stage} {tag}");
            for ((gs, gv), (ws, wv)) in got.iter().zip(&want) {
                // Scalars are single precision in the file.
                assert!(
                    gs == ws && (gv - wv).abs() <= wv.abs() * 1e-6 + 1e-30,
                    "{stage} {tag}: {got:?} vs {want:?}"
                );
            }
        }
    }
}

/// `runs` after the three runs above: a row per run and point of the sweep, the learning rates
/// that differ as columns, and the final figures an eval keeps under paths.
fn check_runs(p: &Project) {
    let runs = p.json(&["runs", "recipe.yaml", "--json"])["runs"].clone();
    assert_eq!(runs.as_array().map(Vec::len), Some(3), "{runs}");
    let last = &runs[2];
    assert_eq!(last["overrides"][0], "stages.sft.params.lr=2e-3", "{last}");
    let accuracy = &last["stages"]["eval_sft"]["metrics"]["generation.accuracy"];
    assert!(
        accuracy.as_f64().is_some_and(|a| (0.0..=1.0).contains(&a)),
        "{last}"
    );
    assert_eq!(
        last["stages"]["eval_sweep[lr=3e-3]"]["sweep"],
        json!({"stage": "eval_sweep", "point": "lr=3e-3", "ordinal": 1}),
        "{last}"
    );
    let table = p.ok(&["runs", "recipe.yaml"]).stdout;
    let column = |name: &str| table_column(&table, name);
    assert_eq!(column("run"), ["1", "1", "2", "2", "3", "3"], "{table}");
    assert_eq!(column("sweep"), ["lr=1e-3", "lr=3e-3"].repeat(3), "{table}");
    assert_eq!(
        column("sft_sweep.lr"),
        ["0.001", "0.003"].repeat(3),
        "{table}"
    );
    assert_eq!(
        column("sft.lr"),
        ["0.001", "0.001", "0.001", "0.001", "0.002", "0.002"],
        "{table}"
    );
    // The swept copies' figures sit in their point's row, under the declared name.
    let losses = column("sft_sweep.final_loss");
    assert!(losses[0] != losses[1] && losses[0] == losses[2], "{table}");
    assert_eq!(column("built")[2], "0 of 22", "{table}");
}

/// `report` draws every training stage's curves, one chart per metric its points carry, with a
/// point per curve point; it is one file with nothing to fetch; and a real browser (headless
/// Chromium, which scripts/test installs) loads it without a console message, finds the same
/// charts, and paints it.
fn check_report(p: &Project) {
    let out = p.ok(&[
        "report",
        "recipe.yaml",
        "stages.sft.params.lr=2e-3",
        "-o",
        "report.html",
    ]);
    assert!(out.stderr.contains("wrote report.html"), "{out}");
    let html = std::fs::read_to_string(p.path("report.html")).unwrap();
    for fetch in [
        "<script",
        "<link",
        "src=",
        "href=\"http",
        "@import",
        "url(http",
    ] {
        assert!(
            !html.contains(fetch),
            "the report is not self-contained: {fetch}"
        );
    }
    // What each training stage's charts must hold: a polyline of one point per curve point.
    let mut expected: Vec<(String, String, usize)> = Vec::new();
    let status = p.json(&[
        "status",
        "recipe.yaml",
        "stages.sft.params.lr=2e-3",
        "--json",
    ]);
    for stage in states(&status).keys() {
        let Some(curve) = show(p, stage)["metrics"]["curve"].as_array().cloned() else {
            continue;
        };
        // Each metric, with the number of points that carry it.
        let mut metrics: std::collections::BTreeMap<String, usize> = Default::default();
        for point in &curve {
            for map in [point.as_object(), point["metrics"].as_object()]
                .into_iter()
                .flatten()
            {
                for (k, v) in map {
                    if v.is_number() && k != "step" {
                        *metrics.entry(k.clone()).or_default() += 1;
                    }
                }
            }
        }
        for (m, points) in metrics {
            expected.push((stage.to_string(), m, points));
        }
    }
    for must in ["reward", "preference_loss", "grad_norm", "lr"] {
        assert!(
            expected.iter().any(|(_, m, _)| m == must),
            "no {must} curve: {expected:?}"
        );
    }
    let charts = |doc: &str| -> Vec<(String, String, usize)> {
        doc.split("<div class=\"chart\" data-stage=\"")
            .skip(1)
            .map(|c| {
                let stage = c.split('"').next().unwrap().to_string();
                let metric = c
                    .split("data-metric=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap();
                let points = c
                    .split("points=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap();
                (stage, metric.to_string(), points.split_whitespace().count())
            })
            .collect()
    };
    let mut drawn = charts(&html);
    drawn.sort();
    expected.sort();
    assert_eq!(
        drawn, expected,
        "the charts, by stage and metric, with their points"
    );
    // What the last run (the one with lr=2e-3) did: built sft, found pretrain in the store.
    let outcome = |stage: &str| {
        html.split(&format!("<tr data-stage=\"{stage}\">"))
            .nth(1)
            .and_then(|row| row.split("<td class=\"outcome\">").nth(1))
            .and_then(|cell| cell.split("</td>").next())
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(outcome("sft"), "executed");
    assert_eq!(outcome("pretrain"), "cached (hit)");
    // Why each stage ran, in the run that built what is shown.
    let why = |stage: &str| {
        html.split(&format!("<tr data-stage=\"{stage}\">"))
            .nth(1)
            .and_then(|row| row.split("<td class=\"why\">").nth(1))
            .and_then(|cell| cell.split("</td>").next())
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(why("sft"), "params.lr: 0.001 → 0.002");
    assert_eq!(why("grpo"), "upstream sft changed");
    assert_eq!(why("pretrain"), "never run");
    assert!(
        html.contains("<table class=\"metrics\" data-stage=\"eval_sft\">"),
        "eval table"
    );
    assert_eq!(
        html.matches("<g class=\"stage\"").count(),
        22,
        "a box per stage"
    );
    // The sweep: a row per copy with its value and final figures, and its curves overlaid.
    let table = |stage: &str| {
        html.split(&format!("<table class=\"sweep\" data-stage=\"{stage}\">"))
            .nth(1)
            .and_then(|t| t.split("</table>").next())
            .unwrap_or_else(|| panic!("no sweep table for {stage}"))
            .to_string()
    };
    let sft = table("sft_sweep");
    for needle in [
        "<th>lr</th>",
        "<th>final_loss</th>",
        "<code>sft_sweep[lr=1e-3]</code>",
        "<code>sft_sweep[lr=3e-3]</code>",
    ] {
        assert!(sft.contains(needle), "{needle} in {sft}");
    }
    let eval = table("eval_sweep");
    assert!(eval.contains("<th>perplexity.perplexity</th>"), "{eval}");
    assert_eq!(eval.matches("<tr><td>").count(), 2, "{eval}");
    let overlaid = html
        .split("<div class=\"chart\" data-sweep=\"sft_sweep\" data-metric=\"loss\">")
        .nth(1)
        .and_then(|c| c.split("</div>").next())
        .expect("the sweep's loss chart");
    assert_eq!(overlaid.matches("<polyline").count(), 2, "{overlaid}");

    let Some(chromium) = chromium("report") else {
        return;
    };
    let url = format!("file://{}", p.path("report.html").display());
    let profile = format!("--user-data-dir={}", p.path("chromium-profile").display());
    let headless = |args: &[&str]| {
        let o = std::process::Command::new("timeout")
            .arg("120")
            .arg(&chromium)
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--enable-logging=stderr",
                "--v=0",
                &profile,
            ])
            .args(args)
            .arg(&url)
            .output()
            .unwrap_or_else(|e| panic!("cannot run {chromium}: {e}"));
        assert!(
            o.status.success(),
            "{chromium} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        (
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    let (dom, log) = headless(&["--dump-dom"]);
    assert!(!log.contains(":CONSOLE"), "console messages:\n{log}");
    let mut seen = charts(&dom);
    seen.sort();
    assert_eq!(seen, expected, "the browser's document has the same charts");
    let shot = p.path("report.png");
    headless(&[
        "--hide-scrollbars",
        "--window-size=1280,2000",
        &format!("--screenshot={}", shot.display()),
    ]);
    let python = std::env::var("NEMO_DAG_PYTHON").unwrap_or_else(|_| "python3".into());
    // The first curve colour of `plot`'s palette: what only a drawn chart paints.
    let measured = std::process::Command::new(&python)
        .arg(crate::common::repo().join("tests/py/png_ink.py"))
        .arg(&shot)
        .arg("4e79a7")
        .output()
        .unwrap();
    assert!(
        measured.status.success(),
        "png_ink.py: {}",
        String::from_utf8_lossy(&measured.stderr)
    );
    let text = String::from_utf8_lossy(&measured.stdout).into_owned();
    let mut words = text.split_whitespace();
    let ink: f64 = words.next().and_then(|w| w.parse().ok()).unwrap();
    let curve_pixels: u64 = words.next().and_then(|w| w.parse().ok()).unwrap();
    assert!(
        ink > 0.02,
        "the screenshot is nearly blank: {ink} of its pixels are not white"
    );
    assert!(
        curve_pixels > 300,
        "the screenshot shows no drawn curve: {curve_pixels} pixels of the curve colour"
    );

    // A change not run yet: the stages it touches are shown from their last run, marked so.
    p.ok(&[
        "report",
        "recipe.yaml",
        "stages.sft.params.lr=3e-3",
        "-o",
        "stale.html",
    ]);
    let stale = std::fs::read_to_string(p.path("stale.html")).unwrap();
    assert!(
        stale.contains("<g class=\"stage\" data-state=\"stale\"><title>sft: stale</title>"),
        "sft is stale in the drawing"
    );
    assert!(
        stale.contains("data-state=\"pending-upstream\"><title>grpo: pending-upstream"),
        "grpo waits on it"
    );
    assert!(
        stale.contains("params.lr: 0.002 → 0.003"),
        "why sft would run"
    );
    assert!(
        stale.contains("<h3>sft <code>"),
        "sft's curves from its last run"
    );
    assert!(stale.contains("(last run)"), "marked as the last run's");
}

/// Headless Chromium, if there is one: `NEMO_DAG_CHROMIUM`, else `chromium` on the PATH.
/// `NEMO_DAG_REQUIRE_CHROMIUM=1` (scripts/test) turns a missing one into a failure.
fn chromium(test: &str) -> Option<String> {
    let candidate = std::env::var("NEMO_DAG_CHROMIUM").unwrap_or_else(|_| "chromium".into());
    let ok = std::process::Command::new(&candidate)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(candidate);
    }
    if std::env::var("NEMO_DAG_REQUIRE_CHROMIUM").as_deref() == Ok("1") {
        panic!("{test}: NEMO_DAG_REQUIRE_CHROMIUM=1 but {candidate} does not run");
    }
    eprintln!("skipping the browser check of {test}: no chromium (scripts/test installs it)");
    None
}

/// Our logits for a few ids, next to the exported checkpoint, checked by Python.
fn check_export(p: &Project) {
    let case = logits_case(p, "sft", 12, "case.json");
    let hf = output_path(p, "export", "hf");
    let script = crate::common::repo().join("tests/py/check_export.py");
    if let Some(py) = python() {
        let mut c = Command::new(py);
        c.arg(&script).arg(&hf).arg(&case);
        let out = output(c);
        assert_eq!(out.code, 0, "numpy Llama disagrees with our logits: {out}");
    }
    if let Some(py) = torch_python("the exported model") {
        let mut c = Command::new(py);
        c.arg(&script).arg(&hf).arg(&case).arg("--transformers");
        let out = output(c);
        assert_eq!(out.code, 0, "transformers disagrees with our logits: {out}");
        eprintln!("transformers check: {}", out.stdout.trim());
    }
}

/// Our logits for `n` fixed ids, from the model `stage` published, written to `file` for the
/// Python checks beside an export.
fn logits_case(p: &Project, stage: &str, n: u32, file: &str) -> PathBuf {
    let model = load_model(&output_path(p, stage, "model")).unwrap();
    let ids: Vec<u32> = (0..n).map(|i| (i * 37 + 5) % model.vocab as u32).collect();
    let logits = model.logits(&ids, &Layout::plain(1, ids.len())).unwrap();
    let logits: Vec<Vec<f32>> = logits.squeeze(0).unwrap().to_vec2().unwrap();
    p.write(file, &json!({"ids": ids, "logits": logits}).to_string())
}

/// `NEMO_DAG_TORCH_PYTHON`, or `None` after saying that the transformers check of `what` is
/// skipped.
fn torch_python(what: &str) -> Option<String> {
    let py = std::env::var("NEMO_DAG_TORCH_PYTHON").ok();
    if py.is_none() {
        eprintln!(
            "skipping the transformers check of {what}: set NEMO_DAG_TORCH_PYTHON to a Python with torch and transformers"
        );
    }
    py
}

#[test]
fn an_interrupted_pretrain_resumes_to_the_same_weights() {
    let straight = Project::new("train-straight");
    straight.write("recipe.yaml", RECIPE);
    straight.ok(&["run", "recipe.yaml", "--target", "pretrain"]);

    let p = Project::new("train-resume");
    p.write("recipe.yaml", RECIPE);
    let mut stop = p.command(&["run", "recipe.yaml", "--target", "pretrain"]);
    stop.env("NEMO_DAG_STOP_AFTER_STEP", "3");
    let stopped = output(stop);
    assert_ne!(stopped.code, 0, "a preempted stage fails\n{stopped}");
    assert!(stopped.stderr.contains("stopped after step 3"), "{stopped}");

    let resumed = p.ok(&["run", "recipe.yaml", "--target", "pretrain"]);
    assert!(
        resumed
            .stderr
            .contains("resuming from the checkpoint at step 3"),
        "{resumed}"
    );
    let digest = |p: &Project| show(p, "pretrain")["outputs"]["model"]["digest"].clone();
    assert_eq!(
        digest(&p),
        digest(&straight),
        "3 steps + resume must give the bytes of an uninterrupted run"
    );
    assert_eq!(curve(&p, "pretrain"), curve(&straight, "pretrain"));
}

#[test]
fn model_config_mistakes_point_at_the_manifest() {
    let p = Project::new("train-errors");
    p.write(
        "recipe.yaml",
        &RECIPE.replace("pattern: \"*-*-\"", "pattern: \"*-X-\""),
    );
    let out = p.run(&["run", "recipe.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("unknown layer symbol `X`"), "{out}");
    assert!(out.stderr.contains("at character 3"), "{out}");
    assert!(out.stderr.contains("recipe.yaml"), "names the file: {out}");
    assert!(!p.store().exists(), "nothing written");

    p.write(
        "recipe.yaml",
        &RECIPE.replace("pattern: \"*-*-\"", "pattern: \"M*-\""),
    );
    let out = p.run(&["run", "recipe.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("need a `mamba:` section"), "{out}");

    p.write(
        "recipe.yaml",
        &RECIPE.replace("micro_batch: 4", "micro_batch: 3"),
    );
    let out = p.run(&["run", "recipe.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("must be a positive multiple"), "{out}");
}
