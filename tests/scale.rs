//! Plan before running: every training stage's memory and FLOPs are estimated before it starts,
//! printed by `validate`, `status` and `run --dry-run`, recorded beside the measured peak, and a
//! stage that cannot fit this machine is refused before anything runs.

use crate::common::{Project, repo};
use serde_json::Value;
use std::process::Command;

/// A project holding a copy of the shipped manifests (recipes and their data), without the
/// store a run of them in the checkout leaves beside them (the README's
/// `run manifests/demo.yaml` makes `manifests/.nemo-dag`): the tests here assert that a
/// refused run writes no store.
pub(crate) fn recipes() -> Project {
    let p = Project::new("scale");
    let status = Command::new("cp")
        .arg("-r")
        .arg(repo().join("manifests"))
        .arg(&p.dir)
        .status()
        .unwrap();
    assert!(status.success());
    let store = p.path("manifests/.nemo-dag");
    if store.exists() {
        std::fs::remove_dir_all(&store).unwrap();
    }
    p
}

#[test]
fn the_real_scale_super3_asks_for_a_cluster_before_anything_runs() {
    let p = recipes();
    // The default: Megatron-Bridge stages that start their ranks with srun.
    let out = p.run(&["run", "manifests/super3.yaml"]);
    assert_eq!(out.code, 2, "{out}");
    for needle in [
        "stage `pretrain`: launch: srun starts its ranks as tasks of a Slurm job",
        "needs a Slurm profile",
        "--batch PROFILE",
        "-c tiny",
    ] {
        assert!(out.stderr.contains(needle), "missing {needle:?}\n{out}");
    }
    assert!(
        !p.path("manifests/.nemo-dag").exists(),
        "the refused run wrote a store"
    );
}

#[test]
fn the_real_scale_super3_on_the_native_ops_is_refused_by_its_memory_plan() {
    let p = recipes();
    let out = p.run(&["run", "manifests/super3.yaml", "vars.backend=native"]);
    assert_eq!(out.code, 2, "{out}");
    for needle in [
        "stage `pretrain` needs an estimated",
        "TiB of memory, more than this machine has",
        "of RAM",
        "parameters",
        "activations",
        "-c tiny",
        "--batch PROFILE",
        "--no-memory-check",
    ] {
        assert!(out.stderr.contains(needle), "missing {needle:?}\n{out}");
    }
    // Nothing ran: not even the data stages upstream of pretrain.
    assert!(
        !p.path("manifests/.nemo-dag").exists(),
        "the refused run wrote a store"
    );
}

#[test]
fn validate_status_and_dry_run_print_each_training_stages_plan() {
    let p = recipes();
    let validate = p.ok(&["validate", "manifests/super3.yaml", "-c", "tiny"]);
    for stage in ["pretrain", "sft", "grpo"] {
        let line = validate
            .stderr
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{stage}: ")))
            .unwrap_or_else(|| panic!("no plan for {stage}\n{validate}"));
        assert!(
            line.contains("peak on cpu") && line.contains("FLOP/step"),
            "{line}"
        );
    }
    // Rollouts whose length the plan cannot know: a range, not a figure.
    let grpo = validate
        .stderr
        .lines()
        .find(|l| l.trim_start().starts_with("grpo: "))
        .unwrap_or_default();
    assert!(
        grpo.contains(" to ") && grpo.contains("peak on cpu") && !grpo.contains('≈'),
        "{grpo}"
    );
    assert!(
        !validate.stderr.contains("eval_pretrain: "),
        "eval makes no estimate\n{validate}"
    );

    let dry = p.ok(&["run", "manifests/super3.yaml", "-c", "tiny", "--dry-run"]);
    assert!(dry.stderr.contains("· plan: ≈"), "{dry}");

    let status = p.json(&["status", "manifests/super3.yaml", "-c", "tiny", "--json"]);
    let pretrain = status["stages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == "pretrain")
        .unwrap();
    let estimate = &pretrain["estimate"];
    let parts: u64 = estimate["memory"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(estimate["peak_bytes"].as_u64(), Some(parts), "{estimate}");
    assert!(estimate["flops_per_step"].as_f64().unwrap() > 0.0);
    assert_eq!(estimate["steps"], 500);
}

/// The artifacts of one stage of a run: its recorded resources.
fn resources(p: &Project, manifest: &str, stage: &str) -> Value {
    let out = p.ok(&["show", stage, "--manifest", manifest, "--json"]);
    out.json()["resources"].clone()
}

#[test]
fn the_tiny_recipes_estimates_hold_their_measured_peaks() {
    let p = recipes();
    // Every training stage of the three tiny recipes, a few steps each: a step's memory does
    // not depend on how many steps there are.
    let few = [
        "stages.pretrain.params.steps=4",
        "stages.sft.params.steps=4",
    ];
    let runs: [(&str, &[&str], &[&str]); 3] = [
        ("manifests/llama.yaml", &["sft"], &[]),
        (
            "manifests/nano3.yaml",
            &["grpo", "dpo"],
            &["stages.grpo.params.steps=1", "stages.dpo.params.steps=2"],
        ),
        (
            "manifests/super3.yaml",
            &["grpo"],
            &["stages.grpo.params.steps=1"],
        ),
    ];
    let mut report = Vec::new();
    for (manifest, targets, more) in runs {
        let mut args = vec!["run", manifest, "-c", "tiny"];
        for t in targets {
            args.extend(["--target", t]);
        }
        args.extend(few);
        args.extend(more);
        p.ok(&args);
        for stage in ["pretrain", "sft", "grpo", "dpo"] {
            if stage == "grpo" && !targets.contains(&"grpo")
                || stage == "dpo" && !targets.contains(&"dpo")
            {
                continue;
            }
            let r = resources(&p, manifest, stage);
            let measured = r["peak_rss_bytes"].as_f64().unwrap();
            let planned = r["estimate"]["peak_bytes"].as_f64().unwrap();
            report.push(format!(
                "{manifest} {stage}: planned {:.0} MiB, measured {:.0} MiB ({:.2})",
                planned / 1048576.0,
                measured / 1048576.0,
                planned / measured
            ));
            let ratio = planned / measured;
            let least = r["estimate"]["least_bytes"].as_f64();
            let holds = match (stage, least) {
                // Rows of a known length: the estimate is held to ±30 %.
                ("pretrain" | "sft", None) => (0.7..=1.3).contains(&ratio),
                // Rows whose length the plan cannot know: between every row at its shortest
                // and every row at its longest.
                ("dpo" | "grpo", Some(least)) => least <= measured && measured <= planned,
                _ => false,
            };
            assert!(holds, "{}", report.join("\n"));
        }
    }
    eprintln!("{}", report.join("\n"));
}
