//! `resources.device` on a machine with no usable GPU (this one, and CI): `cuda` fails the
//! stage before it starts, with what is missing, and writes nothing; `auto` runs on the CPU
//! and says so (docs/manifest.md, "resources.device").

use crate::common::*;
use nemo_dag_kernels::cuda::CudaLibrary;

fn manifest(device: &str) -> String {
    format!(
        "stages:\n  a:\n    op: cmd\n    outputs: {{o: o.txt}}\n    cmd: \"echo hi > {{outputs.o}}\"\n    resources: {{device: \"{device}\"}}\n"
    )
}

/// Whether the driver library opens here; the no-GPU paths are only testable where it does not.
fn driver_present(test: &str) -> bool {
    let present = CudaLibrary::Driver.is_present();
    if present {
        eprintln!("{test}: skipped: libcuda opens on this machine, so it is not one with no GPU");
    }
    present
}

#[test]
fn device_cuda_without_a_gpu_fails_the_stage_before_it_starts_and_writes_nothing() {
    if driver_present("device_cuda_without_a_gpu_fails") {
        return;
    }
    for device in ["cuda", "cuda:1"] {
        let p = Project::new("device-cuda");
        p.write("m.yaml", &manifest(device));
        let out = p.run(&["run", "m.yaml"]);
        assert_ne!(out.code, 0, "{out}");
        let ordinal = if device == "cuda" { "cuda:0" } else { "cuda:1" };
        for needle in [
            ordinal,
            "CUDA driver library",
            "libcuda.so.1",
            "LD_LIBRARY_PATH",
            "device: auto",
        ] {
            assert!(
                out.stderr.contains(needle),
                "stderr lacks {needle:?}\n{out}"
            );
        }
        assert!(!out.stderr.contains("panicked"), "{out}");
        assert!(
            !out.stderr.contains("see its log"),
            "no log was written, so none is pointed at\n{out}"
        );
        assert!(p.artifact_dirs().is_empty(), "nothing is published\n{out}");
        let logs: Vec<_> = snapshot(&p.store())
            .into_iter()
            .filter(|(path, _)| path.ends_with("log.txt"))
            .collect();
        assert!(logs.is_empty(), "no attempt was started: {logs:?}");
    }
}

#[test]
fn device_auto_without_a_gpu_runs_on_the_cpu_and_says_why() {
    if driver_present("device_auto_without_a_gpu_runs_on_the_cpu") {
        return;
    }
    let p = Project::new("device-auto");
    p.write("m.yaml", &manifest("auto"));
    let out = p.ok(&["run", "m.yaml"]);
    for needle in [
        "device auto: no usable GPU",
        "libcuda.so.1",
        "running on the CPU",
    ] {
        assert!(
            out.stderr.contains(needle),
            "stderr lacks {needle:?}\n{out}"
        );
    }
    assert_eq!(p.artifact_dirs().len(), 1, "{out}");
}

#[test]
fn device_cpu_runs_on_the_cpu_without_a_word() {
    let p = Project::new("device-cpu");
    p.write("m.yaml", &manifest("cpu"));
    let out = p.ok(&["run", "m.yaml"]);
    assert!(
        !out.stderr.contains("GPU") && !out.stderr.contains("cuda"),
        "{out}"
    );
}

/// `gpu-check --shim` runs the GPU trainer's step on the SIMT shim and holds it to the CPU
/// trainer: every part says ok, and the verdict is the last line.
#[test]
fn gpu_check_on_the_shim_holds_the_gpu_trainer_to_the_cpu_trainer() {
    let p = Project::new("gpu-check-shim");
    let out = p.run(&["gpu-check", "--shim", "--json", "check.json"]);
    assert_eq!(out.code, 0, "{out}");
    let lines: Vec<&str> = out.stdout.lines().collect();
    let passing = |part: &str| {
        lines
            .iter()
            .filter(|l| l.starts_with(part) && l.ends_with("ok"))
            .count()
    };
    assert_eq!(passing("gradients    `--`"), 2, "{out}");
    assert_eq!(passing("gradients    `*-*-`"), 1, "{out}");
    assert_eq!(passing("gradients    `M*M-`"), 1, "{out}");
    assert_eq!(passing("gradients    `M*E-E`"), 1, "{out}");
    assert_eq!(passing("gradients    `ME*-/*E`"), 1, "{out}");
    assert_eq!(passing("matmul       bf16 operands"), 1, "{out}");
    assert!(
        lines.contains(&"nccl         skipped: the SIMT shim has one rank and no NCCL"),
        "{out}"
    );
    assert_eq!(passing("curve        `M*-`, f32 matmuls"), 1, "{out}");
    assert_eq!(passing("curve        `M*-`, bf16 matmuls"), 1, "{out}");
    assert_eq!(passing("objective    dpo on `M*E-/*`"), 1, "{out}");
    assert_eq!(passing("objective    grpo on `M*E-/*`"), 1, "{out}");
    assert_eq!(passing("decoding     `M*-E*M`"), 1, "{out}");
    assert_eq!(passing("determinism"), 1, "{out}");
    assert_eq!(lines.last().copied(), Some("result       ok"), "{out}");

    // --json: the same parts, as figures a script reads.
    let text = std::fs::read_to_string(p.path("check.json")).unwrap();
    let report: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(report["ok"], true, "{text}");
    assert!(
        report["device"].as_str().unwrap().contains("shim"),
        "{text}"
    );
    let gradients = report["gradients"].as_array().unwrap();
    assert_eq!(gradients.len(), 6, "{text}");
    for part in gradients {
        let (diff, largest) = (part["difference"].as_f64(), part["largest"].as_f64());
        assert!(diff.unwrap() <= 1e-5 * largest.unwrap(), "{part}");
        assert!(
            part["parameter"].as_str().is_some_and(|p| !p.is_empty()),
            "{part}"
        );
        assert_eq!(part["ok"], true, "{part}");
    }
    // On the shim the bf16 products are linear.cu's; the host's are held to 1e-4 of Σ|a·b|.
    let matmul = &report["matmul"];
    assert!(
        matmul["backend"]
            .as_str()
            .unwrap()
            .contains("gemm_bf16_f32"),
        "{text}"
    );
    assert!(matmul["difference"].as_f64().unwrap() <= 1e-4, "{text}");
    assert_eq!(report["nccl"]["ran"], false, "{text}");
    // The f32 curve is held to 1e-4 of the CPU's, the bf16 one (bf16 operands against the
    // CPU's f32) to 1e-2.
    let curves = report["curves"].as_array().unwrap();
    let precisions: Vec<&str> = curves
        .iter()
        .filter_map(|c| c["precision"].as_str())
        .collect();
    assert_eq!(precisions, ["f32", "bf16"], "{text}");
    for (curve, tolerance) in curves.iter().zip([1e-4, 1e-2]) {
        assert_eq!(curve["losses"].as_array().unwrap().len(), 4, "{curve}");
        assert!(
            curve["difference"].as_f64().unwrap() <= tolerance,
            "{curve}"
        );
    }
    let objectives = report["objectives"].as_array().unwrap();
    let names: Vec<&str> = objectives
        .iter()
        .filter_map(|o| o["objective"].as_str())
        .collect();
    assert_eq!(names, ["dpo", "grpo"], "{text}");
    for part in objectives {
        assert!(part["relative"].as_f64().unwrap() <= 1e-5, "{part}");
        assert!(part["curve_difference"].as_f64().unwrap() <= 1e-4, "{part}");
        assert_eq!(part["ok"], true, "{part}");
    }
    // The device decoder's logits, step by step, against the CPU decoder's.
    let decoding = &report["decoding"];
    assert!(decoding["difference"].as_f64().unwrap() <= 1e-4, "{text}");
    assert_eq!(decoding["ok"], true, "{text}");
    assert_eq!(report["determinism"]["same_bytes"], true, "{text}");
    assert_eq!(
        report["speed"],
        serde_json::json!([]),
        "the shim is not timed: {text}"
    );
    assert_eq!(report["decode_speed"], serde_json::Value::Null, "{text}");
    assert!(!p.path("check.json.partial").exists());
    let leftovers: Vec<_> = std::fs::read_dir(p.path("."))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".tmp"))
        .collect();
    assert!(
        leftovers.is_empty(),
        "a temporary file is left: {leftovers:?}"
    );
}

#[test]
fn gpu_check_without_a_gpu_says_what_is_missing_and_fails() {
    if driver_present("gpu_check_without_a_gpu") {
        return;
    }
    let p = Project::new("gpu-check-none");
    let out = p.run(&["gpu-check"]);
    assert_eq!(out.code, 1, "{out}");
    for needle in [
        "gpu-check cannot run",
        "cuda:0",
        "CUDA driver library",
        "LD_LIBRARY_PATH",
    ] {
        assert!(
            out.stderr.contains(needle),
            "stderr lacks {needle:?}\n{out}"
        );
    }
    assert!(!out.stderr.contains("panicked"), "{out}");
    let out = p.run(&["gpu-check", "--device", "cpu"]);
    assert_eq!(out.code, 2, "{out}");
    assert!(out.stderr.contains("--device cpu is not a GPU"), "{out}");
}

/// `nemo-dag ops` says which ops train on a GPU: the ones `device: cuda` is allowed for.
#[test]
fn the_ops_that_train_on_a_gpu_are_listed() {
    let p = Project::new("ops-gpu");
    let out = p.ok(&["ops"]);
    let mut op = "";
    let mut on_gpu = Vec::new();
    for line in out.stdout.lines() {
        if !line.starts_with(' ') {
            op = line.split_whitespace().next().unwrap_or("");
        } else if line.trim() == "device: runs on a GPU under `device: cuda` or `auto`" {
            on_gpu.push(op);
        }
    }
    assert_eq!(on_gpu, ["pretrain", "sft", "dpo", "grpo", "eval"], "{out}");
}

/// A tiny hybrid's pretrain and its eval, on `vars.device`.
const PIPELINE: &str = include_str!("../bench/gpu_ops.yaml");

/// The training and scoring ops' GPU branch end to end, with the SIMT shim standing in for a
/// GPU (`NEMO_DAG_CUDA_SHIM=1`): a `device: cuda` pretrain of a Mamba-2/attention/MoE model
/// trains on the device (its log says so), checkpoints and publishes its model, and its losses
/// follow the same stage's on the CPU within bf16's tolerance (the device multiplies in bf16);
/// the `device: cuda` eval of that model scores its perplexity on the device, within the same
/// tolerance of the CPU's, and decodes its answers there (KV and SSM caches on the device), the
/// CPU's greedy answers; and a `device: cuda` GRPO stage decodes its rollouts and trains there.
#[test]
fn the_ops_gpu_branch_trains_and_scores_on_the_shim_as_the_cpu_does() {
    let on_cpu = Project::new("gpu-branch-cpu");
    on_cpu.write("m.yaml", PIPELINE);
    on_cpu.ok(&["run", "m.yaml"]);
    let on_shim = Project::new("gpu-branch-shim");
    on_shim.write("m.yaml", PIPELINE);
    let mut shimmed = on_shim.command(&["run", "m.yaml", "vars.device=cuda"]);
    shimmed.env("NEMO_DAG_CUDA_SHIM", "1");
    let out = output(shimmed);
    assert_eq!(out.code, 0, "{out}");
    let show = |p: &Project, stage: &str| p.json(&["show", stage, "--json"]);
    // The device is not part of a key; the models differ in their low bits, so the evals,
    // which read them, are keyed apart.
    let key = |p: &Project, stage: &str| show(p, stage)["key"].clone();
    assert_eq!(key(&on_cpu, "pretrain"), key(&on_shim, "pretrain"));
    assert_ne!(key(&on_cpu, "eval"), key(&on_shim, "eval"));
    let logs: Vec<String> = on_shim
        .artifact_dirs()
        .iter()
        .filter_map(|dir| std::fs::read_to_string(dir.join("log.txt")).ok())
        .filter(|log| log.contains("device: the SIMT shim"))
        .collect();
    assert_eq!(
        logs.len(),
        3,
        "the pretrain's, the eval's and GRPO's logs\n{out}"
    );
    assert!(
        logs.iter()
            .any(|l| l.contains("generation: 8 prompts, decoded on the device")),
        "{logs:?}"
    );

    let losses = |p: &Project| -> Vec<f64> {
        show(p, "pretrain")["metrics"]["curve"]
            .as_array()
            .unwrap()
            .iter()
            .map(|point| point["loss"].as_f64().unwrap())
            .collect()
    };
    let (cpu, shim) = (losses(&on_cpu), losses(&on_shim));
    eprintln!("losses on the shim {shim:?}, on the CPU {cpu:?}");
    assert_eq!(cpu.len(), 4, "{cpu:?}");
    assert_eq!(shim.len(), cpu.len(), "{shim:?}");
    for (got, want) in shim.iter().zip(&cpu) {
        assert!((got - want).abs() <= 1e-2 * want, "{shim:?} vs {cpu:?}");
    }
    assert_ne!(shim, cpu, "bf16 matmuls are not the CPU's f32 to the bit");
    let ppl = |p: &Project| {
        show(p, "eval")["metrics"]["perplexity"]["loss"]
            .as_f64()
            .unwrap()
    };
    let (got, want) = (ppl(&on_shim), ppl(&on_cpu));
    eprintln!("eval loss on the shim {got}, on the CPU {want}");
    assert!((got - want).abs() <= 1e-2 * want, "{got} vs {want}");
    let answers = |p: &Project| -> Vec<String> {
        show(p, "eval")["metrics"]["generation"]["examples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["response"].as_str().unwrap().to_string())
            .collect()
    };
    let (got, want) = (answers(&on_shim), answers(&on_cpu));
    assert_eq!(got.len(), 5, "{got:?}");
    assert_eq!(got, want, "greedy answers on the device and on the CPU");

    // GRPO trains both steps on the device, its rollouts decoded there, and publishes; the
    // figures of a step are the rollouts' (sampled in bf16 on the device, in f32 on the CPU).
    let curve = |p: &Project| show(p, "grpo")["metrics"]["curve"].clone();
    let (got, want) = (curve(&on_shim), curve(&on_cpu));
    eprintln!("grpo on the shim {got}, on the CPU {want}");
    for c in [&got, &want] {
        let steps = c.as_array().unwrap();
        assert_eq!(steps.len(), 2, "{c}");
        for step in steps {
            let length = step["metrics"]["response_length"].as_f64().unwrap();
            assert!((1.0..=4.0).contains(&length), "{step}");
        }
    }
}
