//! The CUDA kernels against NVRTC 13.0, with no GPU: every `.cu` compiles for `sm_90`, spills
//! nothing and stays under its register ceiling; the compile cache hits the second time; and
//! no kernel uses what NVRTC lacks.
//!
//! NVRTC comes from the `nvidia-cuda-nvrtc` wheel `scripts/test` installs (with the headers of
//! `nvidia-cuda-runtime`), found through `LD_LIBRARY_PATH` and `NEMO_DAG_CUDA_HOME`. Where it is
//! missing these tests skip, saying why, unless `NEMO_DAG_REQUIRE_NVRTC=1` (set by
//! `scripts/test`), where they fail.

use std::path::{Path, PathBuf};
use std::time::Instant;

use nemo_dag_kernels::cuda::{
    CacheOutcome, CompileError, ImageKind, KernelCache, KernelSource, Nvrtc, SOURCES,
};

/// The architecture CI compiles for: the GPU machine's Hopper.
const ARCH: &str = "sm_90";

/// Toolchain fixtures: kernels that check NVRTC and the headers themselves, not the model's.
const FIXTURES: &[KernelSource] = &[KernelSource {
    name: "warp_sum_bf16.cu",
    text: include_str!("fixtures/warp_sum_bf16.cu"),
}];

/// The most registers each kernel may use on `sm_90`, a little above what it uses with NVRTC
/// 13.0: a change that needs more says so here. Every kernel must have a line. The
/// element-wise kernels' 32 is also what lets a multiprocessor hold its full 2,048 threads.
const REGISTER_CEILINGS: &[(&str, u32)] = &[
    ("warp_sum_bf16", 24),
    ("adamw_f32", 48),                        // 44 on NVRTC 13.0
    ("add_f32", 32),                          // 29 on NVRTC 13.0
    ("attention_bwd_delta_f32", 40),          // 32 on NVRTC 13.0
    ("attention_bwd_dkv_bf16_d128", 255),     // 244 on NVRTC 13.0
    ("attention_bwd_dkv_bf16_d16", 136),      // 119 on NVRTC 13.0
    ("attention_bwd_dkv_bf16_d32", 144),      // 136 on NVRTC 13.0
    ("attention_bwd_dkv_bf16_d64", 216),      // 202 on NVRTC 13.0
    ("attention_bwd_dkv_f32", 168),           // 154 on NVRTC 13.0
    ("attention_bwd_dq_bf16_d128", 248),      // 238 on NVRTC 13.0
    ("attention_bwd_dq_bf16_d16", 144),       // 128 on NVRTC 13.0
    ("attention_bwd_dq_bf16_d32", 176),       // 168 on NVRTC 13.0
    ("attention_bwd_dq_bf16_d64", 176),       // 168 on NVRTC 13.0
    ("attention_bwd_dq_f32", 104),            // 95 on NVRTC 13.0
    ("attention_fwd_bf16_d128", 184),         // 170 on NVRTC 13.0
    ("attention_fwd_bf16_d16", 136),          // 128 on NVRTC 13.0
    ("attention_fwd_bf16_d32", 136),          // 121 on NVRTC 13.0
    ("attention_fwd_bf16_d64", 160),          // 151 on NVRTC 13.0
    ("attention_fwd_f32", 104),               // 94 on NVRTC 13.0
    ("attention_pack_bf16", 48),              // 34 on NVRTC 13.0
    ("cast_bf16", 24),                        // 16 on NVRTC 13.0
    ("causal_conv_silu_dpre_f32", 40),        // 32 on NVRTC 13.0
    ("causal_conv_silu_dw_partials_f32", 48), // 40 on NVRTC 13.0
    ("causal_conv_silu_dw_reduce", 40),       // 32 on NVRTC 13.0
    ("causal_conv_silu_dx_f32", 32),          // 24 on NVRTC 13.0
    ("causal_conv_silu_fwd_f32", 40),         // 32 on NVRTC 13.0
    ("copy_columns_f32", 24),                 // 16 on NVRTC 13.0
    ("copy_f32", 32),                         // 29 on NVRTC 13.0
    ("cross_entropy_bwd_f32", 40),            // 30 on NVRTC 13.0
    ("cross_entropy_bwd_to_bf16", 40),        // 32 on NVRTC 13.0
    ("cross_entropy_fwd_f32", 32),            // 26 on NVRTC 13.0
    ("decode_attention_f32", 48),             // 40 on NVRTC 13.0
    ("decode_conv_step_f32", 40),             // 32 on NVRTC 13.0
    ("decode_kv_append_f32", 32),             // 28 on NVRTC 13.0
    ("decode_ssm_step_f32", 48),              // 38 on NVRTC 13.0
    ("embedding_bwd_f32", 32),                // 22 on NVRTC 13.0
    ("embedding_fwd_f32", 24),                // 18 on NVRTC 13.0
    ("gated_rms_norm_bwd_f32", 40),           // 30 on NVRTC 13.0
    ("gated_rms_norm_dw_reduce", 40),         // 32 on NVRTC 13.0
    ("gated_rms_norm_fwd_f32", 40),           // 32 on NVRTC 13.0
    ("gemm_bf16_f32", 128),                   // 116 on NVRTC 13.0
    ("gemm_bf16_f32_a16", 128),               // 116 on NVRTC 13.0
    ("gemm_bf16_f32_ab16", 128),              // 120 on NVRTC 13.0
    ("gemm_bf16_f32_b16", 128),               // 120 on NVRTC 13.0
    ("gemm_f32", 128),                        // 116 on NVRTC 13.0
    ("grad_clip_f32", 32),                    // 24 on NVRTC 13.0
    ("grad_norm_finish", 24),                 // 18 on NVRTC 13.0
    ("grad_norm_partials", 32),               // 26 on NVRTC 13.0
    ("mamba_a_bwd_f32", 32),                  // 26 on NVRTC 13.0
    ("mamba_a_fwd_f32", 32),                  // 24 on NVRTC 13.0
    ("mamba_dt_bwd_f32", 24),                 // 16 on NVRTC 13.0
    ("mamba_dt_fwd_f32", 24),                 // 16 on NVRTC 13.0
    ("mamba_head_sums_f32", 32),              // 26 on NVRTC 13.0
    ("mamba_skip_bwd_f32", 40),               // 30 on NVRTC 13.0
    ("mamba_skip_fwd_f32", 40),               // 30 on NVRTC 13.0
    ("moe_combine_f32", 40),                  // 32 on NVRTC 13.0
    ("moe_gate_grads_f32", 40),               // 30 on NVRTC 13.0
    ("moe_gates_bwd_f32", 48),                // 36 on NVRTC 13.0
    ("moe_gates_fwd_f32", 40),                // 32 on NVRTC 13.0
    ("moe_gather_f32", 32),                   // 20 on NVRTC 13.0
    ("moe_scores_f32", 24),                   // 16 on NVRTC 13.0
    ("relu2_bwd_f32", 32),                    // 32 on NVRTC 13.0
    ("relu2_bwd_to_bf16", 32),                // 32 on NVRTC 13.0
    ("relu2_fwd_f32", 32),                    // 30 on NVRTC 13.0
    ("relu2_fwd_to_bf16", 32),                // 27 on NVRTC 13.0
    ("rms_norm_bwd_f32", 40),                 // 30 on NVRTC 13.0
    ("rms_norm_dw_reduce", 40),               // 32 on NVRTC 13.0
    ("rms_norm_fwd_bf16", 32),                // 25 on NVRTC 13.0
    ("rms_norm_fwd_f32", 32),                 // 24 on NVRTC 13.0
    ("rms_norm_fwd_to_bf16", 32),             // 25 on NVRTC 13.0
    ("rope_bwd_f32", 32),                     // 24 on NVRTC 13.0
    ("rope_fwd_f32", 32),                     // 24 on NVRTC 13.0
    ("ssd_bwd_f32", 104),                     // 96 on NVRTC 13.0
    ("ssd_bwd_reduce_f32", 40),               // 32 on NVRTC 13.0
    ("ssd_chunk_cumsum_f32", 40),             // 36 on NVRTC 13.0
    ("ssd_chunk_scan_f32", 64),               // 56 on NVRTC 13.0
    ("ssd_chunk_state_f32", 80),              // 72 on NVRTC 13.0
    ("ssd_state_passing_f32", 48),            // 40 on NVRTC 13.0
    ("swiglu_bwd_f32", 32),                   // 27 on NVRTC 13.0
    ("swiglu_bwd_to_bf16", 32),               // 26 on NVRTC 13.0
    ("swiglu_fwd_f32", 32),                   // 24 on NVRTC 13.0
    ("swiglu_fwd_to_bf16", 32),               // 24 on NVRTC 13.0
];

/// NVRTC, or `None` with the reason printed; a failure when `NEMO_DAG_REQUIRE_NVRTC=1`.
fn nvrtc_or_skip(test: &str) -> Option<Nvrtc> {
    match Nvrtc::load() {
        Ok(nvrtc) => Some(nvrtc),
        Err(error) if std::env::var("NEMO_DAG_REQUIRE_NVRTC").as_deref() == Ok("1") => {
            panic!("NEMO_DAG_REQUIRE_NVRTC=1 but NVRTC cannot be used: {error}")
        }
        Err(error) => {
            eprintln!("{test}: skipped: {error}");
            None
        }
    }
}

fn scratch_cache(name: &str) -> KernelCache {
    let dir = std::env::temp_dir().join(format!("nemo-dag-nvrtc-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    KernelCache::at(dir)
}

#[test]
fn every_kernel_compiles_for_sm_90_without_spills_and_under_its_register_ceiling() {
    let Some(nvrtc) = nvrtc_or_skip("every_kernel_compiles_for_sm_90") else {
        return;
    };
    let (major, minor) = nvrtc.version();
    eprintln!(
        "NVRTC {major}.{minor}, headers from {}",
        nvrtc.include_dir().display()
    );
    let mut problems = Vec::new();
    for source in SOURCES.iter().chain(FIXTURES) {
        let started = Instant::now();
        let compiled = match nvrtc.compile(source, ARCH, None) {
            Ok(compiled) => compiled,
            Err(error) => {
                problems.push(error.to_string());
                continue;
            }
        };
        let elapsed = started.elapsed();
        assert_eq!(compiled.image_kind, ImageKind::Cubin);
        let entries: Vec<_> = compiled.kernels.iter().filter(|k| k.entry).collect();
        if entries.is_empty() {
            problems.push(format!(
                "{}: the assembler reported no kernel:\n{}",
                source.name, compiled.log
            ));
        }
        for kernel in &compiled.kernels {
            eprintln!(
                "{:<24} {:<28} {:>3} registers, {} B spilled, {} B smem, {} B stack, {:.0} ms",
                source.name,
                kernel.name,
                kernel.registers,
                kernel.spill_bytes(),
                kernel.shared_bytes,
                kernel.stack_bytes,
                elapsed.as_secs_f64() * 1e3
            );
            if kernel.spill_bytes() > 0 {
                problems.push(format!(
                    "{}: {} spills {} bytes to local memory ({} stored, {} loaded)",
                    source.name,
                    kernel.name,
                    kernel.spill_bytes(),
                    kernel.spill_store_bytes,
                    kernel.spill_load_bytes
                ));
            }
            if !kernel.entry {
                continue;
            }
            match REGISTER_CEILINGS
                .iter()
                .find(|(name, _)| *name == kernel.name)
            {
                None => problems.push(format!(
                    "{}: {} has no register ceiling in REGISTER_CEILINGS (it uses {})",
                    source.name, kernel.name, kernel.registers
                )),
                Some((_, ceiling)) if kernel.registers > *ceiling => problems.push(format!(
                    "{}: {} uses {} registers, over its ceiling of {ceiling}",
                    source.name, kernel.name, kernel.registers
                )),
                Some(_) => {}
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The attention variant bench/gpu_session.sh times against the default (`ATTN_ASYNC=0`:
/// tiles copied through registers, one stage) compiles too, under options of its own, so its
/// compile is cached apart.
#[test]
fn the_attention_without_cp_async_compiles_for_sm_90() {
    let Some(nvrtc) = nvrtc_or_skip("the_attention_without_cp_async_compiles") else {
        return;
    };
    let plain = nvrtc.clone().with_defines("ATTN_ASYNC=0").unwrap();
    assert!(plain.options(ARCH).contains(&"-DATTN_ASYNC=0".to_string()));
    assert_ne!(plain.options(ARCH), nvrtc.options(ARCH));
    let source = SOURCES
        .iter()
        .find(|s| s.name.ends_with("attention.cu"))
        .expect("attention.cu is embedded");
    let compiled = plain.compile(source, ARCH, None).unwrap();
    for kernel in ["attention_fwd_bf16_d64", "attention_bwd_dkv_bf16_d64"] {
        assert!(
            compiled.kernels.iter().any(|k| k.name == kernel),
            "{kernel} is not in {:?}",
            compiled.kernels.iter().map(|k| &k.name).collect::<Vec<_>>()
        );
    }
}

#[test]
fn the_second_compile_of_a_kernel_is_read_from_the_cache() {
    let Some(nvrtc) = nvrtc_or_skip("the_second_compile_of_a_kernel_is_read_from_the_cache") else {
        return;
    };
    let cache = scratch_cache("hit");
    let first = nvrtc
        .compile(&FIXTURES[0], ARCH, Some(&cache))
        .expect("the fixture compiles");
    assert_eq!(first.cache, CacheOutcome::Stored);
    let started = Instant::now();
    let second = nvrtc
        .compile(&FIXTURES[0], ARCH, Some(&cache))
        .expect("read back");
    eprintln!(
        "cache hit in {:.2} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    assert_eq!(second.cache, CacheOutcome::Hit);
    assert_eq!(second.image, first.image);
    assert_eq!(
        second.kernels, first.kernels,
        "the report is kept with the image"
    );
    // Another architecture is another entry.
    let other = nvrtc
        .compile(&FIXTURES[0], "sm_80", Some(&cache))
        .expect("sm_80 compiles");
    assert_eq!(other.cache, CacheOutcome::Stored);
    let _ = std::fs::remove_dir_all(cache.dir());
}

#[test]
fn a_compute_arch_gives_ptx_for_the_driver_to_jit() {
    let Some(nvrtc) = nvrtc_or_skip("a_compute_arch_gives_ptx_for_the_driver_to_jit") else {
        return;
    };
    let compiled = nvrtc
        .compile(&FIXTURES[0], "compute_90", None)
        .expect("the fixture compiles");
    assert_eq!(compiled.image_kind, ImageKind::Ptx);
    let ptx = String::from_utf8_lossy(&compiled.image);
    assert!(ptx.contains(".target sm_90"), "{ptx}");
    assert!(ptx.contains(".entry warp_sum_bf16"), "{ptx}");
}

#[test]
fn a_source_nvrtc_rejects_comes_back_with_its_log_naming_file_and_line() {
    let Some(nvrtc) = nvrtc_or_skip("a_source_nvrtc_rejects_comes_back_with_its_log") else {
        return;
    };
    let source = KernelSource {
        name: "uses_infinity.cu",
        text: "extern \"C\" __global__ void k(float* x) {\n    x[0] = INFINITY;\n}\n",
    };
    match nvrtc.compile(&source, ARCH, None) {
        Err(CompileError::Rejected { name, arch, log }) => {
            assert_eq!((name.as_str(), arch.as_str()), ("uses_infinity.cu", ARCH));
            assert!(
                log.contains("uses_infinity.cu(2)") && log.contains("INFINITY"),
                "{log}"
            );
        }
        other => panic!("expected NVRTC to reject INFINITY, got {other:?}"),
    }
}

/// Every `.cu` under `kernels/src` and the fixtures, with its path relative to `kernels/`.
fn cu_files() -> Vec<(PathBuf, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in ["src", "tests/fixtures"] {
        collect_cu(&root.join(dir), &mut files);
    }
    files
        .into_iter()
        .map(|path| {
            let relative = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            (relative, text)
        })
        .collect()
}

fn collect_cu(dir: &Path, files: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            collect_cu(&path, files);
        } else if path.extension().is_some_and(|e| e == "cu") {
            files.push(path);
        }
    }
}

/// Lines of `text` that use the identifier `INFINITY` outside a `//` comment.
fn infinity_lines(text: &str) -> Vec<usize> {
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = line.split("//").next().unwrap_or_default();
            code.match_indices("INFINITY").any(|(at, word)| {
                let before = code[..at].chars().next_back();
                let after = code[at + word.len()..].chars().next();
                !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
            })
        })
        .map(|(index, _)| index + 1)
        .collect()
}

/// NVRTC has no `math.h`, so `INFINITY` is undefined there (nvcc accepts it): use
/// `CUDART_INF_F` from `math_constants.h`.
#[test]
fn no_kernel_uses_infinity_which_nvrtc_does_not_define() {
    let found: Vec<String> = cu_files()
        .iter()
        .flat_map(|(path, text)| {
            infinity_lines(text)
                .into_iter()
                .map(move |line| format!("{}:{line}", path.display()))
        })
        .collect();
    assert!(
        found.is_empty(),
        "INFINITY is undefined under NVRTC; use CUDART_INF_F (math_constants.h) at:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_infinity_scan_sees_the_identifier_and_nothing_else() {
    let text = "float a = INFINITY;\n// INFINITY in a comment\nfloat b = CUDART_INF_F;\nint NOT_INFINITY_X;\nx = -INFINITY;";
    assert_eq!(infinity_lines(text), vec![1, 5]);
}

/// The table in `kernels/src/cuda/sources.rs` is the one place that embeds sources: a `.cu`
/// missing from it would never be compiled or checked.
#[test]
fn every_cu_file_under_src_is_embedded_and_every_embedded_one_is_a_file() {
    let on_disk: Vec<String> = cu_files()
        .into_iter()
        .filter_map(|(path, _)| {
            path.strip_prefix("src")
                .ok()
                .map(|p| p.display().to_string())
        })
        .collect();
    let embedded: Vec<&str> = SOURCES.iter().map(|s| s.name).collect();
    let missing: Vec<_> = on_disk
        .iter()
        .filter(|name| !embedded.contains(&name.as_str()))
        .collect();
    let stale: Vec<_> = embedded
        .iter()
        .filter(|name| !on_disk.iter().any(|d| d == *name))
        .collect();
    assert!(
        missing.is_empty(),
        "add these to SOURCES in kernels/src/cuda/sources.rs: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "SOURCES names files that are not under kernels/src: {stale:?}"
    );
}
