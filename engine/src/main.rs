// mimalloc: the tokenizer's many small allocations made glibc's malloc/free about a third of
// `tokenize`'s time (perf); see docs/performance.md.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h (the same slot in mimalloc v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

fn main() {
    // Keep freed memory instead of returning it to the OS: training frees and reallocates
    // multi-megabyte tensors every step, and each fresh mapping costs the kernel a page
    // fault and zeroing (perf: ~15% of a CPU training step). A CLI process can hold its peak.
    // SAFETY: sets one integer option; mimalloc reads options at purge time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    // candle splits large element-wise ops over its own pool of spinning threads, sized by
    // CANDLE_NUM_THREADS (else RAYON_NUM_THREADS). Training and generation already keep every
    // core busy with a whole micro-batch (or chunk of rows) each (ops/src/workers.rs); those
    // spinning threads then take the cores from them: measured, 2 threads trained a hybrid
    // model at 4,985 tokens/s with them and 11,457 without (6,463 on one thread). So one
    // thread, unless the user says otherwise; GEMMs still use rayon's threads.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY: the first thing the process does, before any other thread exists.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", "1") };
    }
    std::process::exit(nemo_dag::cli::main());
}
