//! Builds the SIMT shim (cuda/simt) with every CUDA kernel, so the kernels' tests execute the
//! `.cu` sources on the CPU. Each `.cu` file under src/ (and the shim's own checks under
//! cuda/checks/) becomes one C++ translation unit; each of its `extern "C" __global__` kernels
//! gets a launcher that takes its arguments as cuLaunchKernel does, and one table maps the
//! kernels' names to them (`simt_launch_named`, called by src/simt.rs). The release binary
//! never calls the shim: it compiles the same `.cu` sources with NVRTC for a GPU.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

// The kernels of a source, found the same way here and by the GPU launcher at run time.
#[path = "src/cuda/kernel_names.rs"]
#[allow(dead_code)] // kernel_params serves the kernels' tests on a GPU
mod kernel_names;
use kernel_names::kernel_names;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default());
    let mut sources = cu_files(Path::new("src"));
    sources.extend(cu_files(Path::new("cuda/checks")));
    sources.sort();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include("cuda/simt")
        .flag("-include")
        .flag("simt.h")
        // Kernels carry `#pragma unroll` for NVRTC, which the host compiler does not know.
        .flag_if_supported("-Wno-unknown-pragmas")
        .file("cuda/simt/simt.cpp");
    let mut table = String::new();
    for (n, source) in sources.iter().enumerate() {
        let text = std::fs::read_to_string(source).unwrap_or_default();
        let kernels = kernel_names(&text);
        let mut unit = format!("#include \"{}\"\n", absolute(source).display());
        for name in &kernels {
            let _ = writeln!(
                unit,
                "extern \"C\" int simt_kernel_{name}(const simt::Geometry* g, void** params) {{ \
                 return simt::launch_erased({name}, *g, params); }}"
            );
            let _ = writeln!(table, "{name}");
        }
        let path = out.join(format!("simt_unit_{n}.cpp"));
        write_if_changed(&path, &unit);
        build.file(path);
        println!("cargo:rerun-if-changed={}", source.display());
    }
    let registry = registry(&table);
    let path = out.join("simt_registry.cpp");
    write_if_changed(&path, &registry);
    build.file(path);
    build.compile("simt");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-changed=src");
}

/// The `.cu` files under `dir`, recursively.
fn cu_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(cu_files(&path));
        } else if path.extension().is_some_and(|e| e == "cu") {
            found.push(path);
        }
    }
    found
}

/// The table of every kernel, by name.
fn registry(names: &str) -> String {
    let mut text = String::from("#include <cstring>\n#include <string>\n");
    for name in names.lines() {
        let _ = writeln!(
            text,
            "extern \"C\" int simt_kernel_{name}(const simt::Geometry*, void**);"
        );
    }
    text.push_str(
        "namespace {\nstruct Entry { const char* name; int (*launch)(const simt::Geometry*, void**); };\n\
         const Entry entries[] = {\n",
    );
    for name in names.lines() {
        let _ = writeln!(text, "    {{\"{name}\", simt_kernel_{name}}},");
    }
    text.push_str(
        "    {nullptr, nullptr}};\n}  // namespace\n\
         extern \"C\" int simt_launch_named(const char* name, const simt::Geometry* g, void** params) {\n\
         for (const Entry* e = entries; e->name != nullptr; ++e) {\n\
         if (std::strcmp(e->name, name) == 0) { return e->launch(g, params); }\n}\n\
         static thread_local std::string why;\n\
         why = std::string(\"no kernel named `\") + name + \"` in the shim\";\n\
         return simt::refuse(why.c_str());\n}\n",
    );
    text
}

fn absolute(path: &Path) -> PathBuf {
    std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf())
}

/// Leave an unchanged file alone, so cc does not rebuild it.
fn write_if_changed(path: &Path, text: &str) {
    if std::fs::read_to_string(path).ok().as_deref() != Some(text) {
        let _ = std::fs::write(path, text);
    }
}
