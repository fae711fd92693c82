// mimalloc: the tokenizer's many small allocations made glibc's malloc/free about a third of
// `tokenize`'s time (perf); see docs/performance.md.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(nemo_dag::cli::main());
}
