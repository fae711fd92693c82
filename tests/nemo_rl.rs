//! `nemo_rl_grpo` (docs/scale.md): the wiring between nemo-dag's artifacts and NeMo-RL's
//! `run_grpo_nemo_gym.py`, proven against a stand-in for it (`tests/py/fake_run_grpo.py`) that
//! checks every override against NeMo-RL 0.7's own GRPO config, the model directory, the Gym rows
//! and the attempt's directories, and resumes and saves the way NeMo-RL does (or dies mid-save,
//! or stops at its time budget, when told to).

use crate::common::{Out, Project, repo};
use crate::megatron::{arg, names, output, project, with_export};
use serde_json::Value;

/// The Megatron project with its export, then Gym data and GRPO through the stand-in.
fn grpo_project(name: &str) -> Project {
    let p = project(name);
    with_export(&p);
    let drivers = p.path("rl/examples/nemo_gym");
    std::fs::create_dir_all(&drivers).unwrap();
    std::os::unix::fs::symlink(
        repo().join("tests/py/fake_run_grpo.py"),
        drivers.join("run_grpo_nemo_gym.py"),
    )
    .unwrap();
    std::fs::write(drivers.join("grpo_nanov3.yaml"), "grpo: {}\n").unwrap();
    let stages = r#"
  rl_data:
    op: rl_data
    inputs: {prompts: "problems:prompts"}
    params: {env: math, valid_fraction: 0.1, test_fraction: 0.1}
  grpo:
    op: nemo_rl_grpo
    inputs: {model: "hf:hf", data: "rl_data:data"}
    params:
      rl_root: "RL_ROOT"
      python: python3
      steps: 6
      prompts_per_step: 4
      generations_per_prompt: 2
      save_period: 2
      sequence_length: 512
"#
    .replace("RL_ROOT", &p.path("rl").display().to_string());
    let manifest = std::fs::read_to_string(p.path("m.yaml")).unwrap() + &stages;
    p.write("m.yaml", &manifest);
    p
}

fn run(p: &Project, args: &[&str], env: &[(&str, &str)]) -> Out {
    let mut c = p.command(args);
    c.env("FAKE_RL_ARGV_LOG", p.path("rl-argv.jsonl"));
    for (k, v) in env {
        c.env(k, v);
    }
    crate::common::output(c)
}

fn launches(p: &Project) -> Vec<Value> {
    std::fs::read_to_string(p.path("rl-argv.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A NeMo-RL checkout named as the stage's `checkout` input is what the driver runs from
/// (here, with no container, from where it is, not from `rl_root`), and its files are in the
/// key: an edit to the checkout runs GRPO again.
#[test]
fn a_nemo_rl_checkout_input_is_what_runs_and_its_files_are_in_the_key() {
    let p = grpo_project("rl-checkout");
    let rl = p.path("rl").display().to_string();
    let manifest = std::fs::read_to_string(p.path("m.yaml"))
        .unwrap()
        .replace(
            r#"inputs: {model: "hf:hf", data: "rl_data:data"}"#,
            r#"inputs: {model: "hf:hf", data: "rl_data:data", checkout: rl}"#,
        )
        .replace(&format!("rl_root: \"{rl}\""), "rl_root: /opt/nemo-rl");
    p.write("m.yaml", &manifest);
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");
    let rank = std::fs::read_to_string(output(&p, "grpo", "run").join("rank.sh")).unwrap();
    assert!(rank.contains(&format!("cd {rl}")), "{rank}");
    assert_eq!(launches(&p).len(), 1);

    p.write(
        "rl/examples/nemo_gym/patch.py",
        "# a change to the checkout\n",
    );
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");
    assert_eq!(launches(&p).len(), 2, "GRPO ran again\n{out}");
}

#[test]
fn grpo_runs_nemo_rl_on_the_exported_model_and_gym_rows_and_publishes_the_last_step() {
    let p = grpo_project("rl-run");
    let out = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(out.code, 0, "{out}");
    let launches = launches(&p);
    assert_eq!(launches.len(), 1, "{launches:?}");
    let l = &launches[0];
    let hf = output(&p, "hf", "hf");
    let data = output(&p, "rl_data", "data");
    assert_eq!(
        arg(l, "policy.model_name").unwrap(),
        format!("'{}'", hf.display())
    );
    assert_eq!(
        arg(l, "data.train.data_path").unwrap(),
        format!("'{}'", data.join("train.jsonl").display())
    );
    assert_eq!(arg(l, "grpo.max_num_steps"), Some("6"));
    assert_eq!(arg(l, "grpo.num_generations_per_prompt"), Some("2"));
    assert_eq!(arg(l, "cluster.num_nodes"), Some("1"));
    assert_eq!(arg(l, "policy.max_total_sequence_length"), Some("512"));
    assert_eq!(l["resumed_from"], Value::Null);

    // Published: the last step alone, and the run's scripts; no converted-weights cache.
    let ckpt = output(&p, "grpo", "checkpoint");
    assert_eq!(names(&ckpt), ["step_6"]);
    let run_dir = output(&p, "grpo", "run");
    assert!(run_dir.join("rank.sh").is_file() && run_dir.join("launch.sh").is_file());
    assert!(!run_dir.join("megatron_cache").exists());
    let show = p.json(&["show", "grpo", "--manifest", "m.yaml", "--json"]);
    assert_eq!(show["metrics"]["final_step"], 6, "{show}");
    assert_eq!(show["metrics"]["avg_reward"], 1.0, "{show}");
    assert_eq!(show["metrics"]["consumed_samples"], 24, "{show}");

    let again = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(again.code, 0, "{again}");
    assert_eq!(
        self::launches(&p).len(),
        1,
        "cached: nothing launches again"
    );
}

#[test]
fn a_kill_mid_save_or_a_time_budget_stop_resumes_from_the_last_whole_step() {
    let p = grpo_project("rl-resume");
    // Killed while saving step 4: step 2 is whole, tmp_step_4 is not.
    let killed = run(&p, &["run", "m.yaml"], &[("FAKE_RL_DIE_AT", "4")]);
    assert_eq!(killed.code, 1, "{killed}");
    assert!(
        killed.stderr.contains("the next run resumes from step 2"),
        "{killed}"
    );
    // NeMo-RL's time budget: it saves step 4 and exits 0, short of the end.
    let stopped = run(&p, &["run", "m.yaml"], &[("FAKE_RL_TIMEOUT_AT", "4")]);
    assert_eq!(stopped.code, 1, "{stopped}");
    assert!(
        stopped
            .stderr
            .contains("NeMo-RL exited 0 but stopped at step 4 of 6"),
        "{stopped}"
    );
    let done = run(&p, &["run", "m.yaml"], &[]);
    assert_eq!(done.code, 0, "{done}");
    let launches = launches(&p);
    let resumed: Vec<&Value> = launches.iter().map(|l| &l["resumed_from"]).collect();
    assert_eq!(resumed, [&Value::Null, &Value::from(2), &Value::from(4)]);
    // The stand-in refuses to start beside a tmp_step_*: the op cleared it.
    assert_eq!(launches[1]["ckpt_at_start"], serde_json::json!(["step_2"]));
    assert_eq!(names(&output(&p, "grpo", "checkpoint")), ["step_6"]);
}

#[test]
fn grpo_overrides_of_keys_the_op_sets_or_with_prefixes_are_refused_before_anything_runs() {
    let p = grpo_project("rl-decl");
    let manifest = std::fs::read_to_string(p.path("m.yaml")).unwrap();
    for (key, says) in [
        ("grpo.max_num_steps", "set by nemo-dag from params.steps"),
        ("+grpo.new_key", "a `+` override is not passed to NeMo-RL"),
        (
            "checkpointing.checkpoint_dir",
            "set by nemo-dag from the op",
        ),
    ] {
        p.write(
            "m.yaml",
            &manifest.replace(
                "      save_period: 2\n",
                &format!("      save_period: 2\n      overrides: {{\"{key}\": 3}}\n"),
            ),
        );
        let out = p.run(&["run", "m.yaml"]);
        assert_eq!(out.code, 2, "{key}: {out}");
        assert!(out.stderr.contains(says), "{key}: {out}");
        assert!(!p.path(".nemo-dag").exists(), "{key}: nothing is written");
    }
}

#[test]
fn grpo_refuses_a_context_longer_than_the_models_and_fewer_prompts_than_its_steps_need() {
    let p = grpo_project("rl-fit");
    let manifest = std::fs::read_to_string(p.path("m.yaml")).unwrap();
    for (from, to, says) in [
        (
            "sequence_length: 512",
            "sequence_length: 9000",
            "params.sequence_length 9000 is longer than the model's context (8192",
        ),
        (
            "steps: 6\n      prompts_per_step: 4",
            "steps: 600\n      prompts_per_step: 4",
            "but 600 steps × 4 prompts_per_step need 2400 in 1 epoch(s)",
        ),
    ] {
        assert!(manifest.contains(from), "{from}");
        p.write("m.yaml", &manifest.replace(from, to));
        let out = run(&p, &["run", "m.yaml"], &[]);
        assert_eq!(out.code, 1, "{out}");
        assert!(out.stderr.contains(says), "{out}");
    }
    assert!(launches(&p).is_empty(), "NeMo-RL never started");
}
