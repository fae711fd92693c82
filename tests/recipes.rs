//! The shipped recipes: every manifest and variant validates as written (the real-scale default
//! variants included, which this CPU never runs), and the TOML twin of nano3 is the same recipe
//! as its YAML — the same stages, ops, parameters and inputs, so the same keys.

use nemo_dag_engine::manifest::{LoadArgs, Manifest};
use std::path::PathBuf;

use crate::common::Project;

fn manifests_dir() -> PathBuf {
    crate::common::repo().join("manifests")
}

fn load(file: &str, variant: Option<&str>) -> Manifest {
    load_with(file, variant, &[])
}

fn load_with(file: &str, variant: Option<&str>, overrides: &[&str]) -> Manifest {
    Manifest::load(&LoadArgs {
        variant: variant.map(str::to_string),
        overrides: overrides.iter().map(|o| o.to_string()).collect(),
        ..LoadArgs::new(manifests_dir().join(file), nemo_dag_ops::registry())
    })
    .unwrap_or_else(|e| panic!("{file} -c {variant:?}: {e:?}"))
}

#[test]
fn every_shipped_recipe_and_variant_validates() {
    let p = Project::new("recipes-validate");
    for (file, variants) in [
        ("demo.yaml", &[None, Some("tiny")][..]),
        ("data-prep.yaml", &[None, Some("tiny")][..]),
        ("llama.yaml", &[None, Some("tiny")][..]),
        ("nano3.yaml", &[None, Some("tiny")][..]),
        ("nano3.toml", &[None, Some("tiny")][..]),
        ("super3.yaml", &[None, Some("tiny")][..]),
    ] {
        for variant in variants {
            let path = manifests_dir().join(file);
            let store = p.path("store");
            let mut args = vec![
                "validate",
                path.to_str().unwrap(),
                "--store",
                store.to_str().unwrap(),
            ];
            if let Some(v) = variant {
                args.extend(["-c", v]);
            }
            let out = p.run(&args);
            assert_eq!(out.code, 0, "{file} -c {variant:?}\n{out}");
        }
    }
}

#[test]
fn the_toml_twin_of_nano3_is_the_same_recipe() {
    // The default: data, then Megatron-Bridge's pretrain, SFT and export, then NeMo-RL's GRPO;
    // tiny: the whole native DAG.
    for (variant, stages) in [(None, 9), (Some("tiny"), 14)] {
        let yaml = load("nano3.yaml", variant);
        let toml = load("nano3.toml", variant);
        assert_eq!(
            yaml.stages.keys().collect::<Vec<_>>(),
            toml.stages.keys().collect::<Vec<_>>(),
            "-c {variant:?}"
        );
        for (name, y) in &yaml.stages {
            let t = &toml.stages[name];
            assert_eq!(y.op.name(), t.op.name(), "{name} -c {variant:?}");
            assert_eq!(y.params, t.params, "{name} params -c {variant:?}");
            assert_eq!(y.inputs, t.inputs, "{name} inputs -c {variant:?}");
            assert_eq!(y.outputs, t.outputs, "{name} outputs -c {variant:?}");
        }
        assert_eq!(yaml.order.len(), stages, "-c {variant:?}");
    }
}

#[test]
fn the_default_variants_train_with_megatron_bridge_on_a_cluster() {
    // Megatron-Bridge's own recipes, as its Slurm examples run them: nano3 on 4 × 8 GPUs
    // (EP 8), super3 on 8 × 8 (PP 2, EP 32); SFT reads pretrain's checkpoint.
    for (file, recipe, nodes, sft_recipe) in [
        (
            "nano3.yaml",
            "nemotron_3_nano_pretrain_config",
            4,
            "nemotron_3_nano_sft_config",
        ),
        (
            "super3.yaml",
            "nemotron_3_super_pretrain_config",
            8,
            "nemotron_3_super_sft_config",
        ),
    ] {
        let m = load(file, None);
        let pretrain = &m.stages["pretrain"];
        assert_eq!(pretrain.op.name(), "megatron_pretrain", "{file}");
        assert_eq!(pretrain.params["recipe"], recipe, "{file}");
        assert!(
            pretrain.params["image"]
                .as_str()
                .unwrap()
                .starts_with("nvcr.io/nvidia/nemo:")
        );
        assert_eq!(pretrain.resources.launch.as_deref(), Some("srun"), "{file}");
        assert_eq!(
            (pretrain.resources.nodes, pretrain.resources.gpus),
            (Some(nodes), Some(8))
        );
        let sft = &m.stages["sft"];
        assert_eq!(sft.op.name(), "megatron_sft", "{file}");
        assert_eq!(sft.params["recipe"], sft_recipe, "{file}");
        assert_eq!(
            sft.params["seq_length"],
            m.stages["sft_data"].params["pack_size"]
        );
        assert!(matches!(
            &sft.inputs["model"],
            nemo_dag_engine::manifest::Input::Stage { stage, output } if stage == "pretrain" && output == "checkpoint"
        ));
        // The fine-tuned checkpoint goes on as a Hugging Face model.
        let export = &m.stages["export"];
        assert_eq!(export.op.name(), "megatron_export", "{file}");
        assert!(matches!(
            &export.inputs["model"],
            nemo_dag_engine::manifest::Input::Stage { stage, output } if stage == "sft" && output == "checkpoint"
        ));
        // The RL stage is NeMo-RL's GRPO on that model, with NeMo-RL's own config for the
        // model on the nodes that config asks for (cluster.num_nodes), one Ray node each.
        let (config, rl_nodes) = match file {
            "nano3.yaml" => ("examples/nemo_gym/grpo_nanov3.yaml", 32),
            _ => ("examples/configs/super/stage1_rlvr.yaml", 109),
        };
        let grpo = &m.stages["grpo"];
        assert_eq!(grpo.op.name(), "nemo_rl_grpo", "{file}");
        assert!(matches!(
            &grpo.inputs["model"],
            nemo_dag_engine::manifest::Input::Stage { stage, output } if stage == "export" && output == "hf"
        ));
        assert_eq!(grpo.params["config"], config, "{file}");
        assert_eq!(
            (grpo.resources.nodes, grpo.resources.ntasks_per_node),
            (Some(rl_nodes), Some(1)),
            "{file}"
        );
        // Its prompts and generations make exactly one optimizer step of the config's
        // train_global_batch_size (nano3 2048, super3 4096), which its on-policy ratio needs.
        let batch = grpo.params["prompts_per_step"].as_u64().unwrap()
            * grpo.params["generations_per_prompt"].as_u64().unwrap();
        assert_eq!(
            batch,
            if file == "nano3.yaml" { 2048 } else { 4096 },
            "{file}"
        );
    }
}

#[test]
fn the_native_real_scale_variants_hold_the_real_architectures() {
    // Megatron-Bridge's Nano3: 52 layers (23 Mamba-2, 23 MoE, 6 attention), hidden 2688,
    // 128 experts top-6; Super3 is 88 layers, hidden 4096, 512 experts top-22, 2 MTP depths.
    let nano3 = load_with("nano3.yaml", None, &["vars.backend=native"]);
    let model = &nano3.stages["pretrain"].params["model"];
    let pattern = model["pattern"].as_str().unwrap();
    let count = |c| pattern.chars().filter(|x| *x == c).count();
    assert_eq!(
        (pattern.len(), count('M'), count('E'), count('*')),
        (52, 23, 23, 6)
    );
    assert_eq!(model["hidden"], 2688);
    assert_eq!(
        (
            model["moe"]["experts"].as_u64(),
            model["moe"]["top_k"].as_u64()
        ),
        (Some(128), Some(6))
    );
    let super3 = load_with("super3.yaml", None, &["vars.backend=native"]);
    let model = &super3.stages["pretrain"].params["model"];
    let pattern = model["pattern"].as_str().unwrap();
    let main = pattern.split('/').next().unwrap();
    assert_eq!((main.len(), pattern.split('/').count() - 1), (88, 2));
    assert_eq!(model["hidden"], 4096);
    assert_eq!(
        (
            model["moe"]["experts"].as_u64(),
            model["moe"]["top_k"].as_u64()
        ),
        (Some(512), Some(22))
    );
    // Nemotron's tiny Super3 (super3/tiny_model.py): MEM*EME with two shared `*E` MTP depths.
    let tiny = load("super3.yaml", Some("tiny"));
    assert_eq!(
        tiny.stages["pretrain"].params["model"]["pattern"],
        "MEM*EME/*E/*E"
    );
}

#[test]
fn a_tiny_recipe_built_as_nemotron_h_ends_with_its_transformers_checkpoint() {
    // Only a model without RoPE is a NemotronH, so only then does the DAG end with `export`.
    for (file, last) in [
        ("super3.yaml", "grpo"),
        ("nano3.yaml", "dpo"),
        ("nano3.toml", "dpo"),
    ] {
        let rope = load(file, Some("tiny"));
        assert!(!rope.stages.contains_key("export"), "{file} -c tiny");
        let nope = load_with(file, Some("tiny"), &["vars.position=none"]);
        let export = &nope.stages["export"];
        assert_eq!(export.op.name(), "export", "{file}");
        assert_eq!(export.params["format"], "nemotron_h", "{file}");
        let input = format!("{:?}", export.inputs);
        assert!(input.contains(&format!("\"{last}\"")), "{file}: {input}");
        assert_eq!(
            nope.stages["pretrain"].params["model"]["position"], "none",
            "{file}"
        );
    }
}
