//! The kernels' tests on a GPU. With `NEMO_DAG_KERNEL_TESTS_ON=cuda` (or `cuda:N`), every
//! launch the tests make through [`crate::simt::launch`] runs on that GPU instead of the SIMT
//! shim, unchanged: the buffers a launch points into are copied to the device, the kernel runs
//! there, and the buffers it may write are copied back. The tests' references and tolerances
//! stay as they are, so the same assertions hold the GPU's results (as llm.c's `dev/cuda`
//! checks each kernel against its CPU reference). Unset, nothing changes: the shim runs them.
//! Only the kernels' own unit tests are built with this module.
//!
//! A test's buffers are found by their address. This test binary's global allocator records
//! every live heap allocation (only when the variable is set), and each pointer parameter,
//! known as one from the kernel's declaration in its `.cu` source, resolves to the allocation
//! that holds it. A pointer to anything else (the stack, a static) is refused with its name.
//!
//! The shim's own checks (`cuda/checks`: kernels the GPU never compiles, and the tests of the
//! shim's barriers, shuffles and schedules) go on running on the shim.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::ffi::c_void;
use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::cuda::SOURCES;
use crate::cuda::kernel_names::{kernel_names, kernel_params};
use crate::launch::{Cuda, Geometry, Launcher};

/// The variable that sends the kernels' test launches to a GPU: `cuda` or `cuda:N`.
pub const VAR: &str = "NEMO_DAG_KERNEL_TESTS_ON";

// 1. Every live heap allocation, by address -------------------------------------------------

struct Tracking;

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

/// Whether allocations are recorded: 0 not decided yet, 1 no, 2 yes.
static STATE: AtomicU8 = AtomicU8::new(0);
/// Start address → size of each live allocation.
static LIVE: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

thread_local! {
    /// Set while this thread is inside the tracker, whose own allocations are not recorded.
    static BUSY: Cell<bool> = const { Cell::new(false) };
}

/// `f()` with this thread marked busy, or `None` when it already was (a nested allocation).
fn busy<T>(f: impl FnOnce() -> T) -> Option<T> {
    let entered = BUSY.try_with(|b| !b.replace(true)).unwrap_or(false);
    if !entered {
        return None;
    }
    let out = f();
    let _ = BUSY.try_with(|b| b.set(false));
    Some(out)
}

fn tracking() -> bool {
    match STATE.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => {
            let on = std::env::var_os(VAR).is_some_and(|v| !v.is_empty());
            STATE.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
    }
}

fn record(at: *mut u8, size: usize) {
    busy(|| {
        if tracking()
            && let Ok(mut live) = LIVE.lock()
        {
            live.insert(at as usize, size);
        }
    });
}

fn forget(at: *mut u8) {
    busy(|| {
        if tracking()
            && let Ok(mut live) = LIVE.lock()
        {
            live.remove(&(at as usize));
        }
    });
}

// SAFETY: every call is passed to `System` as it came; the map only watches. `realloc` is the
// trait's own (alloc, copy, dealloc through these), so a block is forgotten before it is freed
// and no other thread can be handed its address while the map still holds it.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: passed on.
        let at = unsafe { System.alloc(layout) };
        if !at.is_null() {
            record(at, layout.size());
        }
        at
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: passed on.
        let at = unsafe { System.alloc_zeroed(layout) };
        if !at.is_null() {
            record(at, layout.size());
        }
        at
    }

    unsafe fn dealloc(&self, at: *mut u8, layout: Layout) {
        forget(at);
        // SAFETY: passed on.
        unsafe { System.dealloc(at, layout) }
    }
}

/// The live allocation `(start, size)` that holds `address` (or ends at it).
fn allocation_of(address: usize) -> Option<(usize, usize)> {
    busy(|| {
        let live = LIVE.lock().ok()?;
        let (&start, &size) = live.range(..=address).next_back()?;
        (address <= start + size).then_some((start, size))
    })
    .flatten()
}

// 2. Launches on the GPU --------------------------------------------------------------------

/// The GPU the tests' launches run on, one launch at a time.
pub struct Mirror {
    cuda: Mutex<Cuda>,
    /// Every kernel the GPU compiles, with its parameter declarations.
    kernels: HashMap<String, Vec<String>>,
}

static MIRROR: OnceLock<Option<Mirror>> = OnceLock::new();

/// The GPU named by [`VAR`], or `None` when it is unset. A GPU that was asked for and cannot
/// be used panics with the reason: the tests were meant to run on it.
pub fn active() -> Option<&'static Mirror> {
    MIRROR
        .get_or_init(|| {
            let spec = std::env::var(VAR).ok().filter(|v| !v.is_empty())?;
            let ordinal = match spec.as_str() {
                "cuda" => 0,
                other => other
                    .strip_prefix("cuda:")
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("{VAR}={spec}: expected `cuda` or `cuda:N`")),
            };
            let cuda = Cuda::new(ordinal).unwrap_or_else(|e| panic!("{VAR}={spec}: {e}"));
            // Straight to the stream: the test harness captures eprintln! of passing tests.
            let _ = writeln!(
                std::io::stderr(),
                "kernel tests: every launch runs on {}",
                cuda.describe()
            );
            let kernels = SOURCES
                .iter()
                .flat_map(|s| {
                    kernel_names(s.text)
                        .into_iter()
                        .filter_map(|n| Some((n.clone(), kernel_params(s.text, &n)?)))
                })
                .collect();
            Some(Mirror {
                cuda: Mutex::new(cuda),
                kernels,
            })
        })
        .as_ref()
}

/// The bytes a by-value parameter of declaration `decl` (`int n`, `const long long s`) takes.
fn scalar_size(decl: &str) -> Option<usize> {
    let words: Vec<&str> = decl.split_whitespace().filter(|w| *w != "const").collect();
    let (_name, ty) = words.split_last()?;
    match ty.join(" ").as_str() {
        "int" | "unsigned" | "unsigned int" | "float" | "int32_t" | "uint32_t" => Some(4),
        "long long" | "unsigned long long" | "size_t" | "double" | "int64_t" | "uint64_t" => {
            Some(8)
        }
        _ => None,
    }
}

impl Mirror {
    /// Whether `name` is a kernel of the sources the GPU compiles (not one of the shim's checks).
    pub fn compiles(&self, name: &str) -> bool {
        self.kernels.contains_key(name)
    }

    /// [`crate::simt::launch`] on the GPU.
    ///
    /// # Safety
    /// As [`crate::simt::launch`]: `params` point at values of the kernel's parameter types,
    /// and the allocations they reach hold what the kernel indexes.
    pub unsafe fn launch(
        &self,
        name: &str,
        grid: [u32; 3],
        block: [u32; 3],
        params: &[*mut c_void],
    ) -> Result<(), String> {
        let decls = self
            .kernels
            .get(name)
            .ok_or_else(|| format!("{name}: no kernel of that name in the GPU's sources"))?;
        if grid.contains(&0) || block.contains(&0) {
            return Err(format!("{name}: an empty grid {grid:?} or block {block:?}"));
        }
        if decls.len() != params.len() {
            return Err(format!(
                "{name}: {} parameters declared, {} passed",
                decls.len(),
                params.len()
            ));
        }
        // Each allocation the pointers reach, once; whether any pointer into it may write.
        let mut regions: Vec<(usize, usize, bool)> = Vec::new();
        let mut slots = vec![0u64; params.len()];
        let mut pointers: Vec<(usize, usize, usize)> = Vec::new(); // (slot, region, offset)
        for (i, (decl, &param)) in decls.iter().zip(params).enumerate() {
            if decl.contains('*') {
                // SAFETY: the caller vouches that a pointer parameter points at a pointer.
                let address = unsafe { *(param as *const usize) };
                if address == 0 {
                    continue;
                }
                let (start, size) = allocation_of(address).ok_or_else(|| {
                    format!("{name}: `{decl}` = {address:#x} is in no live heap allocation")
                })?;
                let writes = !decl.starts_with("const ");
                let region = match regions.iter().position(|r| r.0 == start) {
                    Some(r) => {
                        regions[r].2 |= writes;
                        r
                    }
                    None => {
                        regions.push((start, size, writes));
                        regions.len() - 1
                    }
                };
                pointers.push((i, region, address - start));
            } else {
                let size = scalar_size(decl)
                    .ok_or_else(|| format!("{name}: no size known for the parameter `{decl}`"))?;
                let mut bytes = [0u8; 8];
                // SAFETY: the parameter holds a value of its declared type, `size` bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(param as *const u8, bytes.as_mut_ptr(), size)
                };
                slots[i] = u64::from_le_bytes(bytes);
            }
        }
        let cuda = self
            .cuda
            .lock()
            .map_err(|_| "the GPU's lock was poisoned")?;
        let err = |e: crate::launch::LaunchError| format!("{name}: {e}");
        let mut buffers = Vec::with_capacity(regions.len());
        for &(start, size, _) in &regions {
            let mut buffer = cuda.alloc(size).map_err(err)?;
            // SAFETY: a live allocation of `size` bytes, which the test owns during the launch.
            let host = unsafe { std::slice::from_raw_parts(start as *const u8, size) };
            cuda.write(&mut buffer, 0, host).map_err(err)?;
            buffers.push(buffer);
        }
        for &(slot, region, offset) in &pointers {
            slots[slot] = cuda.address(&buffers[region]) + offset as u64;
        }
        let geometry = Geometry { grid, block };
        // SAFETY: the slots are the caller's values, with device copies for the pointers.
        unsafe { cuda.launch_slots(name, geometry, &slots) }.map_err(err)?;
        for (&(start, size, writes), buffer) in regions.iter().zip(&buffers) {
            if writes {
                let bytes = cuda.read(buffer, 0, size).map_err(err)?;
                // SAFETY: the test passed a writable pointer into this allocation for the
                // kernel to write through, as the shim would have.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), start as *mut u8, size) };
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_value_parameters_have_their_c_sizes() {
        assert_eq!(scalar_size("int n"), Some(4));
        assert_eq!(scalar_size("const float eps"), Some(4));
        assert_eq!(scalar_size("long long stride_a"), Some(8));
        assert_eq!(scalar_size("size_t n"), Some(8));
        assert_eq!(scalar_size("double max_norm"), Some(8));
        assert_eq!(scalar_size("__nv_bfloat16 x"), None);
    }

    #[test]
    fn a_kernels_parameters_are_read_from_its_declaration() {
        let linear = SOURCES.iter().find(|s| s.name == "linear.cu").unwrap();
        let params = kernel_params(linear.text, "gemm_f32").unwrap();
        assert_eq!(params.len(), 13);
        assert_eq!(params[0], "const float* a");
        assert_eq!(params[2], "float* c");
        assert_eq!(params[12], "long long stride_c");
        assert!(kernel_params(linear.text, "gemm").is_none());
    }
}
