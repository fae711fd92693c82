//! Independent pieces of work side by side, each whole on its own single-threaded worker.
//!
//! candle spreads every op over rayon's threads. For the small tensors of a `-c tiny` model
//! most ops are too small to split well, so a second core adds little (measured: 1.1–1.2× for
//! two threads). Work that falls apart into independent pieces (the micro-batches of a training
//! step, the rows being generated) runs better the other way round: each piece on its own
//! worker, a thread whose rayon pool holds only itself, so every candle op inside runs on that
//! one thread. Results come back in task order, and a piece is computed the same way
//! whichever worker runs it.

use std::sync::{Arc, Mutex, OnceLock};

/// The workers a process uses: candle's thread count (`RAYON_NUM_THREADS`, else the cores).
pub fn threads() -> usize {
    candle_core::utils::get_num_threads().max(1)
}

/// The first `n` single-threaded pools, started on first use and kept for the process.
fn pools(n: usize) -> std::io::Result<Vec<Arc<rayon::ThreadPool>>> {
    static POOLS: OnceLock<Mutex<Vec<Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let mut pools = POOLS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    while pools.len() < n {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .thread_name(|_| "nemo-dag-worker".into())
            .build()
            .map_err(std::io::Error::other)?;
        pools.push(Arc::new(pool));
    }
    Ok(pools[..n].to_vec())
}

/// `[f(0), f(1), …, f(n − 1)]` with up to `threads` tasks running at once: task `i` runs on
/// worker `i mod threads`. With one thread (or one task) everything runs on the calling
/// thread, where candle's ops keep their own threads; when the process has only one thread
/// anyway, on a single-threaded pool of the caller's own (see [`on_own_worker`]).
pub fn map<T: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(usize) -> T + Sync,
) -> std::io::Result<Vec<T>> {
    let threads = threads.min(n);
    if threads <= 1 {
        let all = || (0..n).map(&f).collect();
        return if self::threads() == 1 {
            on_own_worker(all)
        } else {
            Ok(all())
        };
    }
    let pools = pools(threads)?;
    let f = &f;
    let mut done: Vec<(usize, T)> = std::thread::scope(|scope| {
        let running: Vec<_> = pools
            .iter()
            .enumerate()
            .map(|(w, pool)| {
                scope.spawn(move || {
                    pool.install(|| {
                        (w..n)
                            .step_by(threads)
                            .map(|i| (i, f(i)))
                            .collect::<Vec<_>>()
                    })
                })
            })
            .collect();
        running
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    done.sort_by_key(|(i, _)| *i);
    Ok(done.into_iter().map(|(_, t)| t).collect())
}

/// Run `f` on a one-thread rayon pool kept for the calling thread. candle's element-wise ops
/// and our fused ops hand their work to rayon; called from outside a pool, each hand-over
/// parks the caller and wakes a pool thread (futex calls, context switches: ~3 % of a
/// one-thread training step in perf). From inside a one-thread pool they run inline. Each
/// calling thread gets its own pool, so callers on different threads (tests) never queue
/// behind each other.
fn on_own_worker<T: Send>(f: impl FnOnce() -> T + Send) -> std::io::Result<T> {
    if rayon::current_thread_index().is_some() && rayon::current_num_threads() == 1 {
        return Ok(f()); // already on a one-thread worker
    }
    thread_local! {
        static OWN: std::cell::OnceCell<Option<rayon::ThreadPool>> = const { std::cell::OnceCell::new() };
    }
    OWN.with(|own| {
        let pool = own.get_or_init(|| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .thread_name(|_| "nemo-dag-worker".into())
                .build()
                .ok()
        });
        match pool {
            Some(pool) => Ok(pool.install(f)),
            None => Err(std::io::Error::other("cannot start a worker thread")),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_worker_is_a_one_thread_pool_per_calling_thread() {
        let here = || {
            on_own_worker(|| {
                (
                    rayon::current_thread_index().is_some(),
                    rayon::current_num_threads(),
                    std::thread::current().id(),
                )
            })
            .unwrap()
        };
        let (a, b) = (here(), here());
        assert_eq!((a.0, a.1), (true, 1), "inside a pool of one thread");
        assert_eq!(a.2, b.2, "the same worker for the same caller");
        let other = std::thread::spawn(here).join().unwrap();
        assert_ne!(other.2, a.2, "another caller has a worker of its own");
        let nested = on_own_worker(|| here().2).unwrap();
        assert_eq!(nested, a.2, "called on a worker, it runs right there");
    }

    #[test]
    fn results_come_back_in_task_order_from_every_worker() {
        for threads in [1, 2, 3, 8] {
            let out = map(10, threads, |i| {
                (
                    i * i,
                    rayon::current_num_threads(),
                    std::thread::current().id(),
                )
            })
            .unwrap();
            let values: Vec<usize> = out.iter().map(|o| o.0).collect();
            assert_eq!(values, (0..10).map(|i| i * i).collect::<Vec<_>>());
            let distinct: std::collections::BTreeSet<String> =
                out.iter().map(|o| format!("{:?}", o.2)).collect();
            assert_eq!(distinct.len(), threads.min(10), "{threads} threads");
            if threads > 1 {
                assert!(
                    out.iter().all(|o| o.1 == 1),
                    "inside a worker, rayon (and so candle) sees one thread"
                );
            }
        }
    }
}
