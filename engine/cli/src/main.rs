//! `nemo-dag`: parse the command line, run one command, print, and exit with
//! 0 (done), 1 (a stage or the engine failed), 2 (bad input: nothing was run or written) or
//! 130 (interrupted).
//!
//! This crate is the only one that sees both the engine and the ops: it hands the engine the
//! ops crate's registry. Each file under `commands/` is one subcommand's arguments and the
//! one engine call it makes, then what it prints.

mod commands;

use clap::{Parser, Subcommand};
use nemo_dag_engine::cache::Transfer;
use nemo_dag_engine::diag::Failure;
use nemo_dag_op::Registry;

// mimalloc: the tokenizer's many small allocations made glibc's malloc/free about a third of
// `tokenize`'s time (perf); see docs/performance.md.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_purge_delay` in mimalloc.h (the same slot in mimalloc v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[derive(Parser, Debug)]
#[command(
    name = "nemo-dag",
    version,
    about = "Declarative, content-hashed DAG pipelines for LLM training recipes",
    after_help = "Examples:\n  nemo-dag run manifests/super3.yaml -c tiny\n  nemo-dag status manifests/super3.yaml\n  nemo-dag graph manifests/super3.yaml --format mermaid\n  nemo-dag lineage sft --manifest manifests/super3.yaml"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run every stale stage of a manifest (cached stages are not rerun)
    Run(commands::run::Args),
    /// Show which stages are up to date, stale or waiting on upstream, and why
    Status(commands::status::Args),
    /// Print the stage graph with each stage's state
    Graph(commands::graph::Args),
    /// Show a published artifact's metadata (by stage name or key)
    Show(commands::show::Args),
    /// Show every ancestor of an artifact: op, key, params and input digests
    Lineage(commands::lineage::Args),
    /// Show what differs between two artifacts: params, inputs, metrics with deltas
    Diff(commands::diff::Args),
    /// Overlay one metric of several artifacts' training curves in an SVG chart
    Plot(commands::plot::Args),
    /// List the recorded runs as a table: overrides, the params that differ, final metrics
    Runs(commands::runs::Args),
    /// Write the manifest's state as one self-contained HTML file: graph, stages, curves
    Report(commands::report::Args),
    /// Re-read published artifacts and report any that changed after publication
    Verify(commands::verify::Args),
    /// Check a manifest without running anything
    Validate(commands::ManifestArgs),
    /// Cancel the manifest's queued and running cluster jobs
    Cancel(commands::ManifestArgs),
    /// Push the manifest's artifacts built here to the shared cache ([cache] in env.toml)
    Push(commands::cache::Args),
    /// Pull the manifest's artifacts from the shared cache, without running anything
    Pull(commands::cache::Args),
    /// The shared cache: `status` says, per stage, where its artifact is
    #[command(subcommand)]
    Cache(commands::cache::CacheCommand),
    /// Remove artifacts that no recorded run or pin references
    Gc(commands::gc::Args),
    /// Keep an artifact through `gc` under a name (or `--remove` the name)
    Pin(commands::pin::Args),
    /// List the built-in ops
    Ops,
    /// Check that the GPU trainer on this machine's GPU trains as the CPU trainer does
    GpuCheck(commands::gpu_check::Args),
    /// Build one stage from a job spec (used by executors; not for people)
    #[command(hide = true)]
    Exec(commands::exec::Args),
}

fn main() {
    // Keep freed memory instead of returning it to the OS: training frees and reallocates
    // multi-megabyte tensors every step, and each fresh mapping costs the kernel a page
    // fault and zeroing (perf: ~15% of a CPU training step). A CLI process can hold its peak.
    // SAFETY: sets one integer option; mimalloc reads options at purge time.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    // candle splits large element-wise ops over its own pool of spinning threads, sized by
    // CANDLE_NUM_THREADS (else RAYON_NUM_THREADS). Training and generation already keep every
    // core busy with a whole micro-batch (or chunk of rows) each (the train crate's workers);
    // those spinning threads then take the cores from them: measured, 2 threads trained a
    // hybrid model at 4,985 tokens/s with them and 11,457 without (6,463 on one thread). So
    // one thread, unless the user says otherwise; GEMMs still use rayon's threads.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        // SAFETY: the first thing the process does, before any other thread exists.
        unsafe { std::env::set_var("CANDLE_NUM_THREADS", "1") };
    }
    std::process::exit(run(nemo_dag_ops::registry()));
}

/// Parse the command line, run the command with the ops of `ops`, and return the exit code.
fn run(ops: Registry) -> i32 {
    let argv: Vec<String> = std::env::args().collect();
    let cli = Cli::parse();
    // Messages are not re-wrapped: a path or a command in one must survive copy and paste.
    let _ = miette::set_hook(Box::new(|_| {
        Box::new(miette::MietteHandlerOpts::new().wrap_lines(false).build())
    }));
    if matches!(
        cli.command,
        Command::Status(_)
            | Command::Graph(_)
            | Command::Show(_)
            | Command::Lineage(_)
            | Command::Diff(_)
            | Command::Plot(_)
            | Command::Runs(_)
            | Command::Verify(_)
            | Command::Cache(_)
            | Command::Validate(_)
            | Command::Ops
    ) {
        // Commands that only print end quietly when the reader goes away
        // (`nemo-dag status --json | head`), as Unix tools do. Commands that drive child
        // processes keep Rust's default (a write to a dead child is an error, not a kill).
        // SAFETY: restores the default action of one signal before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let result = match cli.command {
        Command::Run(a) => commands::run::exec(a, argv, ops),
        Command::Status(a) => commands::status::exec(a, ops),
        Command::Graph(a) => commands::graph::exec(a, ops),
        Command::Show(a) => commands::show::exec(a),
        Command::Lineage(a) => commands::lineage::exec(a),
        Command::Diff(a) => commands::diff::exec(a),
        Command::Plot(a) => commands::plot::exec(a),
        Command::Runs(a) => commands::runs::exec(a),
        Command::Report(a) => commands::report::exec(a, ops),
        Command::Verify(a) => commands::verify::exec(a),
        Command::Validate(a) => commands::validate::exec(a, ops),
        Command::Cancel(a) => commands::cancel::exec(a, ops),
        Command::Push(a) => commands::cache::exec(a, Transfer::Push, ops),
        Command::Pull(a) => commands::cache::exec(a, Transfer::Pull, ops),
        Command::Cache(commands::cache::CacheCommand::Status(a)) => {
            commands::cache::exec(a, Transfer::Status, ops)
        }
        Command::Gc(a) => commands::gc::exec(a),
        Command::Pin(a) => commands::pin::exec(a),
        Command::Ops => commands::ops::exec(ops),
        Command::GpuCheck(a) => commands::gpu_check::exec(a),
        Command::Exec(a) => return commands::exec::exec(a, ops),
    };
    match result {
        Ok(()) => 0,
        Err(Failure::Input(e)) => {
            eprintln!("{:?}", miette::Report::new(*e));
            2
        }
        Err(Failure::Stage(msg)) => {
            eprintln!("error: {msg}");
            1
        }
        Err(Failure::Interrupted) => 130,
        Err(Failure::Other(report)) => {
            eprintln!("{report:?}");
            1
        }
    }
}
