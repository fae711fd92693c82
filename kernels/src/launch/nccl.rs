//! NCCL on a GPU, opened at run time: the all-reduce behind [`Launcher::all_reduce_sum`].
//!
//! cudarc's NCCL bindings look for `libnccl.so` and `libnccl.so.<CUDA major>`, never
//! `libnccl.so.2`, the only file the `nvidia-nccl-cu13` wheel ships, and panic when nothing
//! loads. NCCL's C API is stable and small, so the few calls nemo-dag makes are bound here, by
//! the names NCCL is installed under, and a missing library is an error that says where it was
//! looked for. Signatures: NCCL's `nccl.h` (<https://github.com/NVIDIA/nccl>, `src/nccl.h.in`).
//!
//! [`Launcher::all_reduce_sum`]: super::Launcher::all_reduce_sum

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use libloading::Library;

use super::{Cuda, LaunchError, Result};

/// The names NCCL is opened under, in order: its ABI version's (every NCCL 2 install has it),
/// then the development link a toolkit install adds.
pub const NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// `ncclUniqueId`: 128 opaque bytes.
#[repr(C)]
struct UniqueId([c_char; 128]);

/// `ncclComm_t`.
type Comm = *mut c_void;

const SUCCESS: c_int = 0; // ncclSuccess
const FLOAT32: c_int = 7; // ncclFloat32
const SUM: c_int = 0; // ncclSum

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type CommDestroy = unsafe extern "C" fn(Comm) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The opened library.
pub(super) struct Nccl {
    lib: Library,
}

impl Nccl {
    /// NCCL, opened on first use and kept loaded for the life of the process (its bootstrap
    /// threads may outlive a communicator; unloading it under them would crash).
    pub(super) fn get() -> Result<&'static Nccl> {
        static NCCL: OnceLock<std::result::Result<Nccl, String>> = OnceLock::new();
        NCCL.get_or_init(|| Nccl::open().map_err(|e| e.0))
            .as_ref()
            .map_err(|e| LaunchError(e.clone()))
    }

    /// NCCL under one of [`NAMES`], or an error naming them and the search path.
    fn open() -> Result<Nccl> {
        for name in NAMES {
            // SAFETY: loading NCCL runs only its own initialisers.
            if let Ok(lib) = unsafe { Library::new(name) } {
                return Ok(Nccl { lib });
            }
        }
        let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
        Err(LaunchError(format!(
            "NCCL is missing (the nvidia-nccl-cu13 wheel, or a CUDA install): looked for {} in \
             LD_LIBRARY_PATH ({}), the ld.so cache and the system library directories",
            NAMES.join(", "),
            if path.is_empty() { "not set" } else { &path }
        )))
    }

    /// The function `name` of NCCL, of type `F`.
    ///
    /// # Safety
    /// `F` must be the function's C signature.
    unsafe fn function<F: Copy>(&self, name: &str) -> Result<F> {
        // SAFETY: the caller vouches for the signature.
        unsafe { self.lib.get::<F>(name.as_bytes()) }
            .map(|symbol| *symbol)
            .map_err(|e| LaunchError(format!("NCCL has no {name}: {e}")))
    }

    /// `status` of `call` as a result, with NCCL's own words for a failure.
    fn check(&self, call: &str, status: c_int) -> Result<()> {
        if status == SUCCESS {
            return Ok(());
        }
        // SAFETY: the signature is nccl.h's; the string is static in NCCL.
        let words = unsafe { self.function::<GetErrorString>("ncclGetErrorString") }
            .ok()
            .map(|f| unsafe { f(status) })
            .filter(|p| !p.is_null())
            .map(|p| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
            .unwrap_or_default();
        Err(LaunchError(format!("{call}: NCCL error {status} {words}")))
    }

    /// NCCL's version, `2.27.3`.
    pub(super) fn version(&self) -> Result<String> {
        let mut code: c_int = 0;
        // SAFETY: the signature is nccl.h's; it writes one int.
        let status = unsafe { self.function::<GetVersion>("ncclGetVersion")?(&mut code) };
        self.check("ncclGetVersion", status)?;
        // NCCL ≥ 2.9 codes its version as major·10000 + minor·100 + patch.
        Ok(format!(
            "{}.{}.{}",
            code / 10000,
            code / 100 % 100,
            code % 100
        ))
    }

    /// Sums `count` floats at device address `from` into `into` over a communicator of this
    /// one rank, on `cuda`'s stream, and waits for it.
    ///
    /// # Safety
    /// `from` and `into` must each hold `count` floats on `cuda`.
    pub(super) unsafe fn all_reduce_one_rank(
        &self,
        cuda: &Cuda,
        (from, into): (u64, u64),
        count: usize,
    ) -> Result<()> {
        // SAFETY (each `function`): the signatures are nccl.h's.
        let (unique_id, init, all_reduce, destroy) = unsafe {
            (
                self.function::<GetUniqueId>("ncclGetUniqueId")?,
                self.function::<CommInitRank>("ncclCommInitRank")?,
                self.function::<AllReduce>("ncclAllReduce")?,
                self.function::<CommDestroy>("ncclCommDestroy")?,
            )
        };
        // NCCL uses the calling thread's current context (the runtime's view of it).
        cuda.bind()?;
        let mut id = UniqueId([0; 128]);
        // SAFETY: writes the 128 bytes of `id`.
        self.check("ncclGetUniqueId", unsafe { unique_id(&mut id) })?;
        let mut comm: Comm = std::ptr::null_mut();
        // SAFETY: one rank of one, with the id just made; writes `comm`.
        self.check("ncclCommInitRank", unsafe { init(&mut comm, 1, id, 0) })?;
        let stream = cuda.cu_stream() as *mut c_void;
        let (send, receive) = (from as *const c_void, into as *mut c_void);
        // SAFETY: `count` floats at each (the caller), on our stream.
        let reduced = unsafe { all_reduce(send, receive, count, FLOAT32, SUM, comm, stream) };
        let waited = cuda.synchronize();
        // SAFETY: `comm` was initialised above and is destroyed once, after its work is done.
        let destroyed = unsafe { destroy(comm) };
        self.check("ncclAllReduce", reduced)?;
        waited?;
        self.check("ncclCommDestroy", destroyed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where NCCL is installed it opens and reports an NCCL 2 version; where it is not (this
    /// project's CI), the error names every file looked for and the search path, and nothing
    /// panics.
    #[test]
    fn nccl_opens_by_its_shipped_names_or_says_where_it_looked() {
        match Nccl::get() {
            Ok(nccl) => {
                let version = nccl.version().unwrap();
                eprintln!("NCCL {version} found");
                assert!(version.starts_with("2."), "{version}");
            }
            Err(LaunchError(message)) => {
                eprintln!("{message}");
                for name in NAMES {
                    assert!(message.contains(name), "{message}");
                }
                assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
            }
        }
    }
}
