//! `megatron_pretrain`, `megatron_sft` and `megatron_export` (docs/scale.md): the wiring
//! between nemo-dag's artifacts and Megatron-Bridge's `run_recipe.py` and
//! `run_conversion.py`, proven against stand-ins for them (`tests/py/fake_run_recipe.py`,
//! `tests/py/fake_run_conversion.py`) that check every argument they get (the keys against
//! Megatron-Bridge 0.6's own config tree, the converter's flags against its parser, the data
//! files, the tokenizer, the checkpoint directory a resume finds) and write checkpoints and
//! Hugging Face directories the way Megatron-Bridge does, or fail half-way when told to.

use crate::common::{Out, Project, listing, repo};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A project with the tiny data stages, a pretrain and an SFT through the stand-in.
pub(crate) fn project(name: &str) -> Project {
    let p = Project::new(name);
    let mb = p.path("mb/scripts/training");
    std::fs::create_dir_all(&mb).unwrap();
    std::os::unix::fs::symlink(
        repo().join("tests/py/fake_run_recipe.py"),
        mb.join("run_recipe.py"),
    )
    .unwrap();
    let conversion = p.path("mb/scripts/conversion");
    std::fs::create_dir_all(&conversion).unwrap();
    std::os::unix::fs::symlink(
        repo().join("tests/py/fake_run_conversion.py"),
        conversion.join("run_conversion.py"),
    )
    .unwrap();
    let manifest = r#"
vars: {steps: 10}
stages:
  problems:
    op: generate
    params: {kind: arithmetic, count: 300, seed: 7, max_operand: 20}
  tokenizer:
    op: train_tokenizer
    inputs: {corpus: "problems:pretrain"}
    params: {vocab_size: 300}
  pretrain_data:
    op: tokenize
    inputs: {tokenizer: "tokenizer:tokenizer", arithmetic: "problems:pretrain"}
    params: {num_shards: 4, valid_shards: 1, test_shards: 1, add_eos: true}
  pretrain:
    op: megatron_pretrain
    inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer"}
    params:
      recipe: nemotron_3_nano_pretrain_config
      mb_root: "MB_ROOT"
      python: python3
      seq_length: 64
      steps: {{ steps }}
      global_batch: 8
      micro_batch: 2
      save_interval: 4
      lr: 3e-3
      parallel: {tp: 1, ep: 1}
      overrides: {model.num_layers: 4, model.hybrid_layer_pattern: "M*M-"}
  sft_data:
    op: pack
    inputs: {tokenizer: "tokenizer:tokenizer", arithmetic: "problems:chat"}
    params: {chat_template: nano3, pack_size: 256, num_shards: 2}
  sft:
    op: megatron_sft
    inputs: {model: "pretrain:checkpoint", data: "sft_data:data", tokenizer: "tokenizer:tokenizer"}
    params:
      recipe: nemotron_3_nano_sft_config
      mb_root: "MB_ROOT"
      python: python3
      seq_length: 256
      steps: 6
      global_batch: 4
      micro_batch: 1
      save_interval: 3
"#
    .replace("MB_ROOT", &p.path("mb").display().to_string());
    p.write("m.yaml", &manifest);
    p
}

/// Run with the stand-in's knobs; every launch appends its argv to `argv.jsonl`.
pub(crate) fn run(p: &Project, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut c = p.command(args);
    c.env("FAKE_MB_ARGV_LOG", p.path("argv.jsonl"));
    for (k, v) in env {
        c.env(k, v);
    }
    crate::common::output(c)
}

/// The launches so far, oldest first.
pub(crate) fn launches(p: &Project) -> Vec<Value> {
    std::fs::read_to_string(p.path("argv.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The value of `key=` in a launch's argv.
pub(crate) fn arg<'a>(launch: &'a Value, key: &str) -> Option<&'a str> {
    launch["argv"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
}

pub(crate) fn output(p: &Project, stage: &str, out: &str) -> PathBuf {
    let v = p.json(&["show", stage, "--manifest", "m.yaml", "--json"]);
    PathBuf::from(v["outputs"][out]["path"].as_str().unwrap())
}

/// The published pretrain checkpoint holds `iteration` alone, with the two trackers.
pub(crate) fn assert_final_iteration_alone(p: &Project, iteration: &str) {
    assert_eq!(
        names(&output(p, "pretrain", "checkpoint")),
        [
            iteration,
            "latest_checkpointed_iteration.txt",
            "latest_train_state.pt"
        ]
    );
}

pub(crate) fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
fn pretrain_and_sft_run_megatron_bridge_on_our_artifacts_and_publish_the_final_iteration() {
    let p = project("mb-run");
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");

    let data = output(&p, "pretrain_data", "data");
    let launches = launches(&p);
    assert_eq!(launches.len(), 2, "one launch per stage: {launches:?}");
    let (pretrain, sft) = (&launches[0], &launches[1]);
    let argv = pretrain["argv"].as_array().unwrap();
    assert_eq!(
        argv[..4],
        [
            "--recipe",
            "nemotron_3_nano_pretrain_config",
            "--mode",
            "pretrain"
        ]
    );

    // The tokenize artifact's blend.json, as Megatron per-split blends of absolute prefixes.
    let blend: Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("blend.json")).unwrap()).unwrap();
    let split = |name: &str| -> String {
        let list = blend[name].as_array().unwrap();
        let prefixes: Vec<String> = list
            .chunks(2)
            .map(|pair| format!("'{}'", data.join(pair[1].as_str().unwrap()).display()))
            .collect();
        let weights: Vec<String> = list
            .chunks(2)
            .map(|pair| {
                let w: f64 = pair[0].as_str().unwrap().parse().unwrap();
                format!("{w:.1}")
            })
            .collect();
        format!("[[{}],[{}]]", prefixes.join(","), weights.join(","))
    };
    assert_eq!(
        arg(pretrain, "dataset.blend_per_split").unwrap(),
        format!("[{},{},{}]", split("train"), split("valid"), split("test"))
    );
    assert_eq!(arg(pretrain, "dataset.split"), Some("null"));
    assert_eq!(arg(pretrain, "train.train_iters"), Some("10"));
    assert_eq!(arg(pretrain, "optimizer.lr"), Some("0.003"));
    assert_eq!(arg(pretrain, "model.num_layers"), Some("4"));
    assert_eq!(arg(pretrain, "model.hybrid_layer_pattern"), Some("'M*M-'"));
    assert_eq!(
        arg(pretrain, "checkpoint.exit_on_missing_checkpoint"),
        Some("false")
    );
    assert_eq!(arg(pretrain, "checkpoint.ckpt_step"), None);

    // Published: the final iteration alone with trackers naming it, and the run's record.
    let ckpt = output(&p, "pretrain", "checkpoint");
    assert_final_iteration_alone(&p, "iter_0000010");
    assert_eq!(
        std::fs::read_to_string(ckpt.join("latest_checkpointed_iteration.txt")).unwrap(),
        "10"
    );
    let run_dir = output(&p, "pretrain", "run");
    let script = std::fs::read_to_string(run_dir.join("launch.sh")).unwrap();
    assert!(
        script.contains("--recipe nemotron_3_nano_pretrain_config --mode pretrain"),
        "{script}"
    );
    for name in [
        "config.yaml",
        "tokenizer/tokenizer.json",
        "tokenizer/tokenizer_config.json",
    ] {
        assert!(
            run_dir.join(name).is_file(),
            "run/{name}: {:?}",
            listing(&run_dir)
        );
    }
    assert!(
        !run_dir.join("data_cache").exists(),
        "scratch is not published"
    );
    let show = p.json(&["show", "pretrain", "--manifest", "m.yaml", "--json"]);
    assert_eq!(show["metrics"]["final_iteration"], 10, "{show}");
    assert_eq!(show["metrics"]["lm_loss"], 0.909091, "{show}");

    // SFT: the pack artifact's Parquet as it is, and pretrain's final iteration as its start.
    let pack = output(&p, "sft_data", "data");
    assert_eq!(
        arg(sft, "checkpoint.pretrained_checkpoint").unwrap(),
        format!("'{}'", ckpt.join("iter_0000010").display())
    );
    assert_eq!(
        arg(sft, "dataset.offline_packing_specs.packed_train_data_path").unwrap(),
        format!("'{}'", pack.join("splits/train").display())
    );
    assert_eq!(
        arg(sft, "dataset.offline_packing_specs.packed_sequence_size"),
        Some("256")
    );
    assert_eq!(arg(sft, "dataset.seq_length"), Some("256"));

    // Everything is cached now; nothing launches again.
    let again = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(again.code, 0, "{again}");
    // The pack artifact SFT read in place is as it was published.
    p.ok(&["verify", "sft_data", "--manifest", "m.yaml"]);
    assert_eq!(self::launches(&p).len(), 2);
}

/// A Megatron-Bridge checkout named as the stage's `checkout` input is what the launch runs
/// (here with no container: from where it is, not from `mb_root`, which does not exist on this
/// machine), and its files are in the key: a changed file reruns the stage and what follows it,
/// where a checkout reached only through `mb_root` would leave the cached run of the old code.
#[test]
fn a_checkout_input_is_what_runs_and_its_files_are_in_the_key() {
    let p = project("mb-checkout");
    let mb = p.path("mb").display().to_string();
    let manifest = std::fs::read_to_string(p.path("m.yaml"))
        .unwrap()
        .replace(
            r#"inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer"}"#,
            r#"inputs: {data: "pretrain_data:data", tokenizer: "tokenizer:tokenizer", checkout: mb}"#,
        )
        .replacen(&format!("mb_root: \"{mb}\""), "mb_root: /opt/Megatron-Bridge", 1);
    p.write("m.yaml", &manifest);
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");
    let script = std::fs::read_to_string(output(&p, "pretrain", "run").join("launch.sh")).unwrap();
    assert!(
        script.contains(&format!("{mb}/scripts/training/run_recipe.py")),
        "{script}"
    );
    assert_eq!(launches(&p).len(), 2);

    let keys = |p: &Project| crate::common::keys(&p.json(&["status", "m.yaml", "--json"]));
    let before = keys(&p);
    p.write(
        "mb/scripts/training/patch.py",
        "# a change to the checkout\n",
    );
    let after = keys(&p);
    for stage in ["pretrain", "sft"] {
        assert_ne!(before[stage], after[stage], "{stage}");
    }
    assert_eq!(before["pretrain_data"], after["pretrain_data"]);
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");
    assert_eq!(launches(&p).len(), 4, "both stages ran again\n{out}");
}

#[test]
fn a_kill_mid_save_resumes_from_the_last_whole_iteration_of_this_attempt() {
    let p = project("mb-resume");
    // Something left by an older run where the recipes save by default: never read.
    p.write(
        "nemo_experiments/default/checkpoints/latest_checkpointed_iteration.txt",
        "999",
    );
    let killed = run(
        &p,
        &["run", "m.yaml", "--target", "pretrain"],
        &[("FAKE_MB_DIE_AT", "8")],
    );
    assert_eq!(killed.code, 1, "{killed}");
    assert!(
        killed
            .stderr
            .contains("Megatron-Bridge exited with status 137")
            && killed
                .stderr
                .contains("the next run resumes from iteration 4"),
        "{killed}"
    );

    let out = run(&p, &["run", "m.yaml", "--target", "pretrain"], &[]);
    assert_eq!(out.code, 0, "{out}");
    let launches = launches(&p);
    let resumed = launches.last().unwrap();
    assert_eq!(arg(resumed, "checkpoint.ckpt_step"), Some("4"), "{resumed}");
    assert_eq!(
        arg(resumed, "checkpoint.exit_on_missing_checkpoint"),
        Some("true")
    );
    // The half-written iteration 8 was gone, and the trackers said 4, before it started.
    assert_eq!(resumed["trackers_at_start"], "4", "{resumed}");
    let at_start: Vec<&str> = resumed["ckpt_at_start"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        at_start.contains(&"iter_0000004") && !at_start.contains(&"iter_0000008"),
        "{at_start:?}"
    );
    // Its own attempt directory, not the stale default one.
    let save = arg(resumed, "checkpoint.save").unwrap();
    assert!(
        save.contains("/.nemo-dag/") && save.ends_with("/out/checkpoint'"),
        "{save}"
    );
    assert_eq!(arg(resumed, "checkpoint.load"), Some(save));
    assert_final_iteration_alone(&p, "iter_0000010");
}

#[test]
fn an_exit_0_short_of_the_last_step_is_a_failure_the_next_run_resumes() {
    for (env, stopped_at) in [
        (("FAKE_MB_SIGTERM_AT", "8"), "8"),
        (("NEMO_DAG_STOP_AFTER_STEP", "4"), "4"),
    ] {
        let p2 = project("mb-short");
        let out = run(&p2, &["run", "m.yaml", "--target", "pretrain"], &[env]);
        assert_eq!(out.code, 1, "{out}");
        assert!(
            out.stderr.contains(&format!(
                "exited 0 but stopped at iteration {stopped_at} of 10"
            )),
            "{out}"
        );
        assert!(
            p2.artifact_dirs()
                .iter()
                .all(|d| !d.join("out/checkpoint").exists())
        );
        let last = launches(&p2).pop().unwrap();
        if env.0 == "NEMO_DAG_STOP_AFTER_STEP" {
            assert_eq!(arg(&last, "train.exit_interval"), Some("4"));
        }
        let out = run(&p2, &["run", "m.yaml", "--target", "pretrain"], &[]);
        assert_eq!(out.code, 0, "{out}");
        assert_eq!(
            arg(launches(&p2).last().unwrap(), "checkpoint.ckpt_step"),
            Some(stopped_at)
        );
    }
}

#[test]
fn the_declaration_is_checked_before_anything_runs() {
    for (params, needles) in [
        (
            r#"overrides: {"+model.nope": 1}"#,
            &["stage `pretrain`: `+model.nope`", "`+` override", "m.yaml"][..],
        ),
        (
            r#"overrides: {checkpoint.save: /elsewhere}"#,
            &["checkpoint.save", "set by nemo-dag"][..],
        ),
        (
            r#"overrides: {train.train_iters: 5}"#,
            &["set params.steps"][..],
        ),
        (
            r#"recipe: "a b""#,
            &["`a b` is not a recipe name", "m.yaml"][..],
        ),
        (
            r#"global_batch: 7"#,
            &["not a multiple of micro_batch 2"][..],
        ),
        (r#"mb_root: opt/mb"#, &["`opt/mb`", "absolute"][..]),
    ] {
        let p = project("mb-decl");
        let text = std::fs::read_to_string(p.path("m.yaml")).unwrap();
        let key = params.split(':').next().unwrap().trim_matches('"');
        // Replace the param if the stage has it, else add it.
        let line = format!("      {params}\n");
        let text = match text.find(&format!("      {key}:")) {
            Some(at) => {
                let end = at + text[at..].find('\n').unwrap() + 1;
                format!("{}{line}{}", &text[..at], &text[end..])
            }
            None => text.replacen(
                "      python: python3\n",
                &format!("      python: python3\n{line}"),
                1,
            ),
        };
        p.write("m.yaml", &text);
        let out = p.run(&["run", "m.yaml"]);
        assert_eq!(out.code, 2, "{params}: {out}");
        for n in needles {
            assert!(
                out.stderr.contains(n),
                "{params}: stderr should say {n:?}\n{out}"
            );
        }
        assert!(!p.store().exists(), "{params}: nothing written");
    }

    // A layout Megatron-Core would refuse on the cluster: 2 ranks, tp 4.
    let p = project("mb-decl-world");
    let layer = "model.hybrid_layer_pattern: \"M*M-\"}\n";
    let text = std::fs::read_to_string(p.path("m.yaml"))
        .unwrap()
        .replace("parallel: {tp: 1, ep: 1}", "parallel: {tp: 4, ep: 1}")
        .replacen(
            layer,
            &format!("{layer}    resources: {{launch: torchrun, gpus: 2}}\n"),
            1,
        );
    p.write("m.yaml", &text);
    let out = p.run(&["run", "m.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    for n in ["runs 2 ranks", "not a multiple of tp·pp·cp = 4", "m.yaml"] {
        assert!(out.stderr.contains(n), "stderr should say {n:?}\n{out}");
    }
    assert!(!p.store().exists(), "nothing written");

    // SFT's sequence is the packed rows' length: a seq_length that is not the pack stage's
    // pack_size is refused at its line, for every command that loads the manifest.
    let p = project("mb-decl-packed");
    let text = std::fs::read_to_string(p.path("m.yaml"))
        .unwrap()
        .replace("      seq_length: 256\n", "      seq_length: 512\n");
    p.write("m.yaml", &text);
    let line = text
        .lines()
        .position(|l| l == "      seq_length: 512")
        .unwrap()
        + 1;
    for command in [
        &["run", "m.yaml"][..],
        &["validate", "m.yaml"],
        &["status", "m.yaml"],
    ] {
        let out = p.run(command);
        assert_eq!(out.code, 2, "{command:?}: {out}");
        for n in [
            "stage `sft`: seq_length 512 is not the length of the `data` input's packed rows (256",
            // (The manifest has templates: the place is in the rendered text.)
            &format!("m.yaml (after templating):{line}:"),
            "set seq_length: 256",
        ] {
            assert!(
                out.stderr.contains(n),
                "{command:?}: stderr should say {n:?}\n{out}"
            );
        }
        assert!(!p.store().exists(), "{command:?}: nothing written");
    }
}

#[test]
fn an_image_is_honoured_or_the_stage_refuses_to_run_outside_it() {
    let p = project("mb-image");
    let text = std::fs::read_to_string(p.path("m.yaml")).unwrap().replacen(
        "      python: python3\n",
        "      python: python3\n      image: nvcr.io/nvidia/nemo:25.11\n",
        1,
    );
    p.write("m.yaml", &text);
    let out = run(&p, &["run", "m.yaml", "--target", "pretrain"], &[]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr
            .contains("names image `nvcr.io/nvidia/nemo:25.11`")
            && out.stderr.contains("launch: srun"),
        "{out}"
    );
    assert!(launches(&p).is_empty(), "nothing was launched");
}

#[test]
fn sft_refuses_a_model_that_is_not_a_megatron_checkpoint() {
    let p = project("mb-wrong-model");
    let text = std::fs::read_to_string(p.path("m.yaml")).unwrap().replace(
        "{model: \"pretrain:checkpoint\"",
        "{model: \"pretrain:run\"",
    );
    p.write("m.yaml", &text);
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 1, "{out}");
    assert!(
        out.stderr.contains("input `model`") && out.stderr.contains("not a Megatron checkpoint"),
        "{out}"
    );
}

#[test]
fn the_default_variants_dry_run_shows_the_documented_launch_and_every_override() {
    // Megatron-Bridge's Slurm examples (examples/models/nemotron/nemotron_3/*/slurm_*.sh):
    // `srun --mpi=pmix --container-image=… --container-mounts=…`, one task per GPU, then
    // `python /opt/Megatron-Bridge/scripts/training/run_recipe.py --recipe … --mode …` and
    // `key=value` overrides.
    let keys: std::collections::BTreeSet<String> =
        std::fs::read_to_string(repo().join("tests/fixtures/megatron-bridge-0.6-keys.txt"))
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(str::to_string)
            .collect();
    let p = crate::scale::recipes();
    let profile = "[gpu]\nexecutor = \"slurm\"\npartition = \"batch\"\nmpi = \"pmix\"\n";
    p.write("manifests/.git", "");
    // The containers must see the store (here, under the project) at the same path: checked
    // before anything is submitted.
    p.write(
        "manifests/env.toml",
        &format!("{profile}mounts = [\"/lustre:/lustre\"]\n"),
    );
    let unmounted = p.run(&["run", "manifests/nano3.yaml", "--batch", "gpu", "--dry-run"]);
    assert_eq!(unmounted.code, 2, "{unmounted}");
    assert!(
        unmounted
            .stderr
            .contains("runs in image `nvcr.io/nvidia/nemo:25.11.nemotron_3_nano`, where")
            && unmounted.stderr.contains("is not mounted at the same path")
            && unmounted.stderr.contains("mounts = ["),
        "{unmounted}"
    );
    assert!(unmounted.stdout.is_empty(), "{unmounted}");
    let shared = p.dir.display();
    // A stage that names no image would run in the profile's, which its key does not see.
    p.write(
        "manifests/env.toml",
        &format!(
            "{profile}container_image = \"lab.sqsh\"\nmounts = [\"/lustre:/lustre\", \"{shared}:{shared}\"]\n"
        ),
    );
    let unnamed = p.run(&[
        "run",
        "manifests/nano3.yaml",
        "--batch",
        "gpu",
        "--dry-run",
        "stages.sft.params.image=null",
    ]);
    assert_eq!(unnamed.code, 2, "{unnamed}");
    assert!(
        unnamed.stderr.contains("stage `sft` names no image")
            && unnamed.stderr.contains("profile `gpu`'s `lab.sqsh`")
            && unnamed.stderr.contains("image: \"lab.sqsh\""),
        "{unnamed}"
    );
    assert!(unnamed.stdout.is_empty(), "{unnamed}");
    p.write(
        "manifests/env.toml",
        &format!("{profile}mounts = [\"/lustre:/lustre\", \"{shared}:{shared}\"]\n"),
    );
    for (manifest, image, stages) in [
        (
            "nano3",
            "nvcr.io/nvidia/nemo:25.11.nemotron_3_nano",
            [
                ("pretrain", 4, "nemotron_3_nano_pretrain_config"),
                ("sft", 2, "nemotron_3_nano_sft_config"),
            ],
        ),
        (
            "super3",
            "nvcr.io/nvidia/nemo:26.02.nemotron_3_super",
            [
                ("pretrain", 8, "nemotron_3_super_pretrain_config"),
                ("sft", 2, "nemotron_3_super_sft_config"),
            ],
        ),
    ] {
        let path = format!("manifests/{manifest}.yaml");
        let out = p.ok(&["run", &path, "--batch", "gpu", "--dry-run"]);
        assert!(
            !p.path("manifests/.nemo-dag").exists(),
            "a dry run writes nothing"
        );
        let preview = |stage: &str| -> &str {
            let head = format!(
                "# ---- {stage}: what nemo-dag exec runs in it (inputs and the attempt directory named; resolved when it runs) ----"
            );
            out.stdout
                .split(&head)
                .nth(1)
                .unwrap_or_else(|| panic!("{manifest} {stage}: no launch.sh preview\n{out}"))
                .split("\n# ---- ")
                .next()
                .unwrap()
        };
        // The export: Megatron-Bridge's own Nemotron 3 conversion example
        // (examples/models/nemotron/nemotron_3/*/conversion.sh): one node of 8 GPUs, tp 1,
        // ep 8, the Base model as the reference; its argv accepted by the converter's parser.
        let export = preview("export");
        assert!(
            export.contains(&format!(
                "exec srun --mpi=pmix --nodes=1 --ntasks=8 --ntasks-per-node=8 --kill-on-bad-exit=1 --container-image={image} "
            )) && export.contains(
                "nemo-dag-rank python /opt/Megatron-Bridge/scripts/conversion/run_conversion.py \\\n"
            ),
            "{export}"
        );
        let argv = export
            .lines()
            .find(|l| l.starts_with("  export "))
            .unwrap_or_else(|| panic!("{export}"));
        let reference = match manifest {
            "nano3" => "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-Base-BF16",
            _ => "nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16",
        };
        assert!(
            argv.contains(&format!("export --device gpu --hf-model {reference} --megatron-path \"<input model>/iter_<final>\" --hf-path \"<out>/hf\""))
                && argv.contains("--tp 1 --pp 1 --ep 8 --etp 1 --distributed-save"),
            "{argv}"
        );
        let fake = repo().join("tests/py/fake_run_conversion.py");
        let parsed = crate::common::output({
            let mut c = std::process::Command::new("bash");
            c.arg("-c")
                .arg(format!("exec python3 {} {argv}", fake.display()))
                .env("FAKE_CONVERT_PARSE_ONLY", "1")
                .env("WORLD_SIZE", "8")
                .env("HF_HUB_OFFLINE", "1");
            c
        });
        assert_eq!(parsed.code, 0, "{manifest}: {parsed}");
        // GRPO: NeMo-RL on one Ray node per machine, in NeMo-RL's image, with NeMo-RL's own
        // config for the model; every override a key of that config (NeMo-RL 0.7's
        // grpo_nanov3.yaml; its super-v3 branch's stage1_rlvr.yaml).
        let (nodes, rl_image, config, fixture) = match manifest {
            "nano3" => (
                32,
                "nvcr.io/nvidia/nemo-rl:v0.7.0",
                "examples/nemo_gym/grpo_nanov3.yaml",
                "nemo-rl-0.7-grpo-nanov3-keys.txt",
            ),
            _ => (
                109,
                "nvcr.io/nvidia/nemo-rl:v0.5.0.nemotron_3_super",
                "examples/configs/super/stage1_rlvr.yaml",
                "nemo-rl-super-v3-stage1-rlvr-keys.txt",
            ),
        };
        let rl_keys = std::fs::read_to_string(repo().join("tests/fixtures").join(fixture)).unwrap();
        let grpo = preview("grpo");
        assert!(
            grpo.contains(&format!("exec srun --mpi=pmix --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 --container-image={rl_image} ")),
            "{manifest}: {grpo}"
        );
        let words: Vec<&str> = grpo
            .lines()
            .skip_while(|l| !l.contains(&format!("run_grpo_nemo_gym.py --config {config}")))
            .skip(1)
            .map(|l| l.trim().trim_end_matches(" \\").trim_matches('"'))
            .collect();
        assert!(words.len() >= 14, "{manifest}: {grpo}");
        for word in words {
            let key = word.split('=').next().unwrap();
            assert!(
                rl_keys.lines().any(|k| k == key),
                "{manifest}: `{key}` is not a key of {config}"
            );
        }
        for (stage, nodes, recipe) in stages {
            let script = preview(stage);
            let srun = format!(
                "exec srun --mpi=pmix --nodes={nodes} --ntasks={} --ntasks-per-node=8 --kill-on-bad-exit=1 --container-image={image} --container-mounts=/lustre:/lustre,{shared}:{shared} ",
                nodes * 8
            );
            assert!(
                script.contains(&srun),
                "{manifest} {stage}: {srun}\n{script}"
            );
            assert!(
                script.contains(
                    "nemo-dag-rank python /opt/Megatron-Bridge/scripts/training/run_recipe.py \\\n"
                ),
                "{script}"
            );
            let mode = if stage == "sft" { "sft" } else { "pretrain" };
            assert!(
                script.contains(&format!("\n  --recipe {recipe} --mode {mode} \\\n")),
                "{script}"
            );
            // Every override: one `key=value` line, a key Megatron-Bridge 0.6's config has.
            let overrides: Vec<&str> = script
                .lines()
                .skip_while(|l| !l.starts_with("  --recipe"))
                .skip(1)
                .map(|l| l.trim().trim_end_matches(" \\").trim_matches('"'))
                .collect();
            assert!(overrides.len() > 25, "{script}");
            for word in &overrides {
                let key = word.split('=').next().unwrap();
                assert!(
                    keys.contains(key),
                    "{manifest} {stage}: `{key}` is not a Megatron-Bridge 0.6 key"
                );
            }
            for needed in [
                "checkpoint.save='<out>/checkpoint'",
                "checkpoint.load='<out>/checkpoint'",
                "checkpoint.async_save=false",
                "train.exit_signal_handler=true",
                "tokenizer.tokenizer_model='<out>/run/tokenizer'",
            ] {
                assert!(
                    overrides.contains(&needed),
                    "{manifest} {stage}: {needed}\n{script}"
                );
            }
            if mode == "pretrain" {
                assert!(overrides.contains(&"dataset.split=null"), "{script}");
                assert!(overrides.contains(&"dataset.path_to_cache='<out>/run/data_cache'"));
            } else {
                assert!(
                    overrides
                        .contains(&"checkpoint.pretrained_checkpoint='<input model>/iter_<final>'")
                );
                assert!(
                    overrides.contains(&"dataset.offline_packing_specs.packed_sequence_size=8192")
                );
            }
        }
    }
}

/// The default variants' Megatron stages are planned per GPU before anything is submitted:
/// `validate` prints each GPU's memory and the step's FLOPs, and a Slurm profile whose GPUs
/// are too small for a stage's weights and optimizer (`gpu_memory`) refuses it at the stage's
/// resources, submitting nothing.
#[test]
fn megatron_stages_are_planned_per_gpu_and_refused_by_a_profile_whose_gpus_are_too_small() {
    let p = crate::scale::recipes();
    p.write("manifests/.git", "");
    let shared = p.dir.display();
    let profile = |memory: &str| {
        format!(
            "[gpu]\nexecutor = \"slurm\"\npartition = \"batch\"\nmpi = \"pmix\"\ngpu_memory = \"{memory}\"\nmounts = [\"{shared}:{shared}\"]\n"
        )
    };
    let plan = p.ok(&["validate", "manifests/super3.yaml"]);
    for stage in ["pretrain", "sft"] {
        let line = plan
            .stderr
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{stage}: ")))
            .unwrap_or_else(|| panic!("no plan for {stage}\n{plan}"));
        assert!(
            line.contains("peak on each GPU (weights and optimizer ")
                && line.contains("routed experts' weights and optimizer")
                && line.contains("PFLOP/step")
                && line.contains("123.6 B parameters (13.0 B active)"),
            "{line}"
        );
    }
    // NeMo-RL's GRPO is planned on the policy's GPUs (those vLLM and the judges leave), from
    // its config's parallelism, with vLLM's share of the weights beside it.
    let grpo = plan
        .stderr
        .lines()
        .find(|l| l.trim_start().starts_with("grpo: "))
        .unwrap_or_else(|| panic!("no plan for grpo\n{plan}"));
    assert!(
        grpo.contains("peak on each GPU (weights and optimizer ")
            && grpo.contains("the policy's 256 GPUs: TP 4 PP 1 EP 8 CP 8")
            && grpo.contains("full recompute")
            && grpo.contains("vLLM (TP 4, on 72 nodes of its own)"),
        "{grpo}"
    );
    // Nodes that leave the policy none are refused before anything runs.
    let few = p.run(&[
        "validate",
        "manifests/super3.yaml",
        "stages.grpo.resources.nodes=77",
    ]);
    assert_eq!(few.code, 2, "{few}");
    // A rank per GPU (no ntasks_per_node) is refused too: NeMo-RL wants one Ray node a machine.
    let ranks = p.run(&[
        "validate",
        "manifests/super3.yaml",
        "stages.grpo.resources.ntasks_per_node=null",
    ]);
    assert_eq!(ranks.code, 2, "{ranks}");
    assert!(ranks.stderr.contains("one rank per node, not 8"), "{ranks}");
    assert!(
        few.stderr.contains("77 nodes leave the policy none")
            && few.stderr.contains("nodes: 81 at least"),
        "{few}"
    );
    // 80 GiB GPUs hold what each stage needs for certain.
    p.write("manifests/env.toml", &profile("80GiB"));
    for manifest in ["nano3", "super3"] {
        let path = format!("manifests/{manifest}.yaml");
        p.ok(&["run", &path, "--batch", "gpu", "--dry-run"]);
    }
    // 40 GiB ones do not hold nano3's SFT: 45.7 GiB of weights and optimizer each.
    p.write("manifests/env.toml", &profile("40GiB"));
    let out = p.run(&["run", "manifests/nano3.yaml", "--batch", "gpu", "--dry-run"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(
        out.stderr
            .contains("stage `sft` needs at least 45.7 GiB on each GPU")
            && out
                .stderr
                .contains("profile `gpu`'s GPUs have (gpu_memory 40.0 GiB)")
            && out.stderr.contains("spread it over more GPUs"),
        "{out}"
    );
    assert!(out.stdout.is_empty(), "{out}");
    assert!(!p.path("manifests/.nemo-dag").exists(), "nothing written");
}

/// A Megatron stage launched on this machine's GPUs (`torchrun`, one node) plans per GPU:
/// that plan is not held to this machine's RAM (it was, and refused the run).
#[test]
fn a_per_gpu_plan_is_not_held_to_this_machines_ram() {
    let p = project("mb-local-gpus");
    let manifest = std::fs::read_to_string(p.path("m.yaml")).unwrap();
    let manifest = manifest
        .replace(
            "    op: megatron_sft\n",
            "    op: megatron_sft\n    resources: {launch: torchrun, gpus: 2}\n",
        )
        .replace(
            "      save_interval: 3\n",
            "      save_interval: 3\n      parallel: {ep: 2}\n",
        );
    p.write("m.yaml", &manifest);
    let plan = p.ok(&["validate", "m.yaml"]);
    assert!(
        plan.stderr.contains("sft: ") && plan.stderr.contains("peak on each GPU"),
        "{plan}"
    );
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert!(
        !out.stderr.contains("more than this machine has"),
        "a per-GPU plan held to RAM:\n{out}"
    );
    // The stages before it ran; the stage itself got as far as its launcher.
    assert!(!launches(&p).is_empty(), "{out}");
}

/// Opt-in: the overrides a run renders, applied by Megatron-Bridge 0.6's own config loader
/// (`process_config_with_overrides`, then the dataset config's `finalize`/`validate`), with
/// `NEMO_DAG_MB_PYTHON` a Python 3.12 that has megatron-bridge 0.6 (docs/scale.md).
#[test]
fn megatron_bridges_own_config_loader_accepts_the_rendered_overrides() {
    let Some(python) = std::env::var_os("NEMO_DAG_MB_PYTHON") else {
        eprintln!(
            "skipping megatron_config_loader: megatron-bridge >= 0.4 needs Python 3.12 and imports transformer_engine, which PyPI ships only as a CUDA source build; set NEMO_DAG_MB_PYTHON to a Python 3.12 with megatron-bridge 0.6 (docs/scale.md)"
        );
        return;
    };
    let p = project("mb-loader");
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");
    let launches = launches(&p);
    assert_eq!(launches.len(), 2);
    for launch in &launches {
        let argv: Vec<&str> = launch["argv"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let (recipe, mode) = (argv[1], argv[3]);
        let file = p.write(&format!("{mode}.overrides"), &(argv[4..].join("\n") + "\n"));
        let check = std::process::Command::new(&python)
            .arg(repo().join("tests/py/mb_config_check.py"))
            .args([recipe, mode])
            .arg(&file)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
        assert_eq!(check.status.code(), Some(0), "{recipe} {mode}:\n{text}");
        assert!(text.contains("ok"), "{text}");
    }
}

/// Slurm's warning before a time limit or a preemption is a SIGTERM to the job's `nemo-dag
/// exec`: it passes the signal on and gives Megatron-Bridge time to save the iteration it is
/// in, so the next run resumes from there rather than from the last periodic save.
#[test]
fn a_sigterm_lets_megatron_bridge_save_before_the_stage_stops() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;
    let p = project("mb-term");
    let data = run(&p, &["run", "m.yaml", "--target", "pretrain_data"], &[]);
    assert_eq!(data.code, 0, "{data}");
    let store = p.store();
    let mut exec = p.command(&[
        "exec",
        "--stage",
        "pretrain",
        "--store",
        store.to_str().unwrap(),
        "m.yaml",
        "vars.steps=40",
    ]);
    exec.env("FAKE_MB_ARGV_LOG", p.path("argv.jsonl"))
        .env("FAKE_MB_SECONDS_PER_ITER", "0.1")
        .env("NEMO_DAG_TERM_GRACE", "20")
        .stderr(std::process::Stdio::piped())
        .process_group(0); // as a Slurm batch step or the local executor starts it
    let mut child = exec.spawn().unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut lines = Vec::new();
    for line in stderr.lines() {
        let line = line.unwrap();
        let at_6 = line.starts_with("nemo-dag:progress 6/40");
        lines.push(line);
        if at_6 {
            // SAFETY: signalling the child we started.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            break;
        }
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(1), "{lines:?}");

    // The save on SIGTERM was between the periodic ones (4, 8): the rerun resumes from it.
    let out = run(
        &p,
        &["run", "m.yaml", "vars.steps=40", "--target", "pretrain"],
        &[],
    );
    assert_eq!(out.code, 0, "{out}");
    let resumed = launches(&p).pop().unwrap();
    let step: u64 = arg(&resumed, "checkpoint.ckpt_step")
        .unwrap_or_else(|| panic!("no resume: {resumed}"))
        .parse()
        .unwrap();
    assert!(
        (6..8).contains(&step),
        "resumed from {step}, not the SIGTERM save: {resumed}"
    );
}

#[test]
fn a_run_that_saved_its_last_step_but_was_not_published_publishes_without_a_launch() {
    let p = project("mb-saved-last");
    let crashed = run(
        &p,
        &["run", "m.yaml", "--target", "pretrain"],
        &[("FAKE_MB_FAIL_AT_EXIT", "1")],
    );
    assert_eq!(crashed.code, 1, "{crashed}");
    assert!(
        crashed
            .stderr
            .contains("the next run resumes from iteration 10"),
        "{crashed}"
    );
    let out = run(&p, &["run", "m.yaml", "--target", "pretrain"], &[]);
    assert_eq!(out.code, 0, "{out}");
    assert!(
        out.stderr.contains("iteration 10 of 10 is saved already"),
        "{out}"
    );
    assert_eq!(launches(&p).len(), 1, "Megatron-Bridge was launched again");
    assert_final_iteration_alone(&p, "iter_0000010");
}

/// The export stage the tests add to the project: the SFT checkpoint through the converter on
/// the CPU, one process.
const EXPORT_STAGE: &str = r#"
  hf:
    op: megatron_export
    inputs: {model: "sft:checkpoint", tokenizer: "tokenizer:tokenizer"}
    params:
      hf_model: nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16
      mb_root: "MB_ROOT"
      python: python3
      device: cpu
"#;

pub(crate) fn with_export(p: &Project) {
    let manifest = std::fs::read_to_string(p.path("m.yaml")).unwrap()
        + &EXPORT_STAGE.replace("MB_ROOT", &p.path("mb").display().to_string());
    p.write("m.yaml", &manifest);
}

/// The id of `token` in a tokenizer.json.
fn token_id(tokenizer: &Value, token: &str) -> Option<u64> {
    tokenizer["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["content"] == token)
        .and_then(|t| t["id"].as_u64())
        .or_else(|| tokenizer["model"]["vocab"][token].as_u64())
}

#[test]
fn an_sft_checkpoint_exports_to_hugging_face_with_the_tokenizer_it_was_trained_with() {
    let p = project("mb-export");
    with_export(&p);
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");

    // The converter got the SFT checkpoint's final iteration and an empty destination.
    let launches = launches(&p);
    let export: Vec<&Value> = launches
        .iter()
        .filter(|l| l["script"] == "run_conversion.py")
        .collect();
    assert_eq!(export.len(), 1, "{launches:?}");
    let argv: Vec<&str> = export[0]["argv"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    let flag = |name: &str| {
        let at = argv
            .iter()
            .position(|w| *w == name)
            .unwrap_or_else(|| panic!("no {name}: {argv:?}"));
        argv[at + 1]
    };
    let sft_ckpt = output(&p, "sft", "checkpoint");
    assert_eq!(argv[..3], ["export", "--device", "cpu"]);
    assert_eq!(
        flag("--hf-model"),
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
    );
    assert_eq!(
        flag("--megatron-path"),
        sft_ckpt.join("iter_0000006").display().to_string()
    );
    assert!(flag("--hf-path").ends_with("/hf"), "{argv:?}");
    assert!(argv.contains(&"--no-distributed-save"), "{argv:?}");

    // The checkpoint carries the chat template of the pack it was fine-tuned on.
    let template =
        std::fs::read_to_string(output(&p, "sft_data", "data").join("chat_template.jinja"))
            .unwrap();
    assert_eq!(
        std::fs::read_to_string(sft_ckpt.join("chat_template.jinja")).unwrap(),
        template
    );

    // The published directory: the converter's weights, our tokenizer in place of the
    // reference's, and token ids that are ours.
    let hf = output(&p, "hf", "hf");
    let read = |name: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(hf.join(name)).unwrap()).unwrap()
    };
    assert!(
        !hf.join("special_tokens_map.json").exists(),
        "{:?}",
        names(&hf)
    );
    let ours = output(&p, "tokenizer", "tokenizer");
    assert_eq!(
        std::fs::read(hf.join("tokenizer.json")).unwrap(),
        std::fs::read(&ours).unwrap()
    );
    let tokenizer: Value = serde_json::from_str(&std::fs::read_to_string(&ours).unwrap()).unwrap();
    let tokenizer_config = read("tokenizer_config.json");
    assert_eq!(tokenizer_config["chat_template"], template.as_str());
    assert_eq!(tokenizer_config["eos_token"], "<|im_end|>");
    let config = read("config.json");
    let stops = [
        token_id(&tokenizer, "<|im_end|>").unwrap(),
        token_id(&tokenizer, "<|endoftext|>").unwrap(),
    ];
    assert_eq!(config["eos_token_id"], serde_json::json!(stops), "{config}");
    assert_eq!(config["pad_token_id"], stops[1], "{config}");
    assert_eq!(config["bos_token_id"], Value::Null, "{config}");
    assert_eq!(
        read("generation_config.json")["eos_token_id"],
        serde_json::json!(stops)
    );
    assert_eq!(config["vocab_size"], 384);
    assert_eq!(config["architectures"][0], "NemotronHForCausalLM");
    let show = p.json(&["show", "hf", "--manifest", "m.yaml", "--json"]);
    assert_eq!(show["metrics"]["tensors"], 3, "{show}");
    assert_eq!(show["metrics"]["iteration"], "iter_0000006", "{show}");
    let script = std::fs::read_to_string(output(&p, "hf", "run").join("launch.sh")).unwrap();
    assert!(
        script.contains("scripts/conversion/run_conversion.py"),
        "{script}"
    );
}

#[test]
fn an_export_that_is_not_a_whole_model_for_this_tokenizer_fails_and_publishes_nothing() {
    let p = project("mb-export-bad");
    with_export(&p);
    p.ok(&["run", "m.yaml", "--target", "sft"]);
    for (env, says) in [
        (
            "FAKE_CONVERT_TRUNCATE",
            "describes 48 bytes of tensor data, but 42 follow it",
        ),
        (
            "FAKE_CONVERT_VOCAB",
            "has vocab_size 128, fewer than the 300 tokens",
        ),
        (
            "FAKE_CONVERT_FAIL",
            "Megatron-Bridge's converter exited with status 1",
        ),
    ] {
        let value = if env == "FAKE_CONVERT_VOCAB" {
            "128"
        } else {
            "1"
        };
        let out = run(&p, &["run", "m.yaml"], &[(env, value)]);
        assert_eq!(out.code, 1, "{env}: {out}");
        assert!(out.stderr.contains(says), "{env}: {out}");
        let status = p.json(&["status", "m.yaml", "--json"]);
        assert_eq!(
            crate::common::states(&status)["hf"],
            "stale",
            "{env}: nothing is published: {status}"
        );
    }
    // The stage's declaration is checked before anything runs: a GPU export needs a launcher.
    let gpu = std::fs::read_to_string(p.path("m.yaml"))
        .unwrap()
        .replace("device: cpu", "device: gpu");
    p.write("m.yaml", &gpu);
    let out = p.run(&["validate", "m.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(
        out.stderr
            .contains("the GPU converter runs one rank per GPU and needs a launcher"),
        "{out}"
    );
}
