//! Builds the SIMT shim (cuda/simt) and the C entry points that run each `.cu` kernel through
//! it (cuda/launch), so the kernels' tests execute the CUDA sources on the CPU. The release
//! binary never calls them: it compiles the same `.cu` sources with NVRTC for a GPU.

fn main() {
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include("cuda/simt")
        .flag("-include")
        .flag("simt.h")
        .flag_if_supported("-Wno-unused-parameter")
        .file("cuda/simt/simt.cpp");
    let mut launchers: Vec<_> = std::fs::read_dir("cuda/launch")
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    launchers.sort();
    for file in launchers
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cpp"))
    {
        build.file(file);
    }
    build.compile("simt");
    println!("cargo:rerun-if-changed=cuda");
    let kernels = std::fs::read_dir("src").into_iter().flatten().flatten();
    for cu in kernels.filter(|e| e.path().extension().is_some_and(|x| x == "cu")) {
        println!("cargo:rerun-if-changed={}", cu.path().display());
    }
}
