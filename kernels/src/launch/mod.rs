//! Launching the `.cu` kernels on a device: one interface, two executors.
//!
//! A [`Launcher`] owns device memory and runs kernels by name with cuLaunchKernel's argument
//! model. [`Cuda`] runs them on a GPU (cudarc, the sources compiled by NVRTC for the device);
//! [`Shim`] runs the very same sources on the CPU through the SIMT shim. Code written against
//! the trait — the GPU trainer's step, `nemo-dag gpu-check` — is therefore exercised on every
//! machine, and its results on a GPU can be held to the shim's, launch for launch.
//!
//! Buffers are untyped bytes: a kernel's parameter says what they hold. [`Arg`] carries each
//! argument with its exact C type, because neither executor converts one.

mod cublaslt;
mod cuda;
mod nccl;
mod shim;

use std::fmt;

use crate::linear::{Gemm, Precision, gemm_geometry};
pub use cuda::Cuda;
pub use nccl::NAMES as NCCL_NAMES;
pub use shim::Shim;

/// A kernel launch or memory operation that failed: what was asked, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchError(pub String);

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for LaunchError {}

pub type Result<T> = std::result::Result<T, LaunchError>;

/// One kernel argument, with the C type the kernel declares.
#[derive(Debug)]
pub enum Arg<'a, B> {
    /// A pointer into `buffer`, `offset` bytes from its start.
    Ptr(&'a B, usize),
    /// A null pointer (an optional output the kernel skips).
    Null,
    I32(i32),
    U32(u32),
    I64(i64),
    /// `size_t`.
    Usize(usize),
    F32(f32),
    F64(f64),
}

// By hand: a derive would ask `B: Copy`, and an argument only borrows its buffer.
impl<B> Clone for Arg<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Arg<'_, B> {}

impl<B> Arg<'_, B> {
    /// The argument's value as the kernel reads it, in the low bytes of an 8-byte slot
    /// (little-endian, as both executors' hosts are); `pointer` resolves a buffer and offset.
    fn slot(&self, pointer: impl Fn(&B, usize) -> Result<u64>) -> Result<u64> {
        Ok(match *self {
            Arg::Ptr(buffer, offset) => pointer(buffer, offset)?,
            Arg::Null => 0,
            Arg::I32(v) => u64::from(v as u32),
            Arg::U32(v) => u64::from(v),
            Arg::I64(v) => v as u64,
            Arg::Usize(v) => v as u64,
            Arg::F32(v) => u64::from(v.to_bits()),
            Arg::F64(v) => v.to_bits(),
        })
    }
}

/// Grid and block, as `[x, y, z]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub grid: [u32; 3],
    pub block: [u32; 3],
}

impl Geometry {
    /// A one-dimensional launch.
    pub fn linear(grid: u32, block: u32) -> Geometry {
        Geometry {
            grid: [grid.max(1), 1, 1],
            block: [block, 1, 1],
        }
    }
}

/// The time one kernel (or one product shape) took over the launches since the last
/// [`Launcher::take_kernel_times`].
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    /// The kernel's name, or `cuBLASLt m×n×k` and its operands' layouts for a bf16 product
    /// (its two casts included, and linear.cu's kernel where cuBLASLt has no algorithm for the
    /// shape), with `, its first` for the first product of a shape (which asks cuBLASLt's
    /// heuristic).
    pub name: String,
    pub launches: u64,
    /// Wall time from its launch to the stream's end, added over its launches.
    pub seconds: f64,
}

/// The variable that makes [`Cuda`] time each launch (any value but empty or `0`).
pub const KERNEL_TIMES_VAR: &str = "NEMO_DAG_KERNEL_TIMES";

/// Device memory and kernel launches on one device, in issue order.
pub trait Launcher {
    /// A device allocation.
    type Buffer;

    /// What runs the kernels, for logs: `cuda:0 (NVIDIA H100 …, sm_90)` or `SIMT shim (CPU)`.
    fn describe(&self) -> String;

    /// `bytes` of zeroed device memory.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Copies `data` into `buffer` at `offset` bytes.
    fn write(&self, buffer: &mut Self::Buffer, offset: usize, data: &[u8]) -> Result<()>;

    /// Sets every byte of `buffer` to zero, in issue order with the launches.
    fn zero(&self, buffer: &mut Self::Buffer) -> Result<()> {
        let len = self.len(buffer);
        self.write(buffer, 0, &vec![0u8; len])
    }

    /// `len` bytes of `buffer` from `offset`, once every launch before has finished.
    fn read(&self, buffer: &Self::Buffer, offset: usize, len: usize) -> Result<Vec<u8>>;

    /// Runs kernel `name` over `geometry`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameters one for one, in type, and every buffer a
    /// kernel reaches through them must hold what the kernel indexes for this geometry.
    unsafe fn launch(
        &self,
        name: &str,
        geometry: Geometry,
        args: &[Arg<'_, Self::Buffer>],
    ) -> Result<()>;

    /// The size of `buffer` in bytes.
    fn len(&self, buffer: &Self::Buffer) -> usize;

    /// Sums the first `count` floats of `from` across this process's ranks into `into`
    /// through NCCL, and says which NCCL did it; `None` where there is no NCCL (the shim). The
    /// world is one rank, so `into` gets `from`'s values: what this checks is that NCCL loads,
    /// makes a communicator on the device and runs a collective on its stream (out of place,
    /// so that it has something to do: NCCL skips an in-place reduction over one rank).
    fn all_reduce_sum(
        &self,
        _from: &Self::Buffer,
        _into: &mut Self::Buffer,
        _count: usize,
    ) -> Result<Option<String>> {
        Ok(None)
    }

    /// What this executor lacks that training on it should have (a library it runs slower
    /// without), or `None`.
    fn lacks(&self) -> Option<&str> {
        None
    }

    /// The time each kernel took since the last call, longest first, where this executor
    /// times its launches ([`Cuda`] under [`KERNEL_TIMES_VAR`]); empty where it does not.
    fn take_kernel_times(&self) -> Vec<KernelTime> {
        Vec::new()
    }

    /// What runs a product at `precision`, for reports: a linear.cu kernel, or a library.
    fn gemm_backend(&self, precision: Precision) -> String {
        format!("linear.cu's {}", precision.kernel())
    }

    /// Runs `gemm` on the matrices `a`, `b` (f32, or bf16 where `gemm.bf16_inputs` says) and
    /// `c` (f32): linear.cu's kernel for it ([`Gemm::kernel`]), unless the executor has a
    /// faster way to the same arithmetic ([`Cuda`]: cuBLASLt for bf16).
    ///
    /// # Safety
    /// `a`, `b` and `c` must point at `m·k`, `k·n` and `m·n` values.
    unsafe fn gemm(
        &self,
        gemm: &Gemm,
        a: Arg<'_, Self::Buffer>,
        b: Arg<'_, Self::Buffer>,
        c: Arg<'_, Self::Buffer>,
    ) -> Result<()> {
        let geometry = gemm_geometry(gemm.m, gemm.n, 1);
        // SAFETY: passed on from the caller; the arguments are the kernel's, in order.
        unsafe { self.launch(gemm.kernel(), geometry, &gemm.args(a, b, c)) }
    }

    /// A device buffer holding `values`.
    fn upload_f32(&self, values: &[f32]) -> Result<Self::Buffer> {
        let mut buffer = self.alloc(values.len() * 4)?;
        self.write(&mut buffer, 0, &f32_bytes(values))?;
        Ok(buffer)
    }

    /// A device buffer holding `values`.
    fn upload_u32(&self, values: &[u32]) -> Result<Self::Buffer> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut buffer = self.alloc(bytes.len())?;
        self.write(&mut buffer, 0, &bytes)?;
        Ok(buffer)
    }

    /// `count` f32 values of `buffer` from value `first`.
    fn read_f32(&self, buffer: &Self::Buffer, first: usize, count: usize) -> Result<Vec<f32>> {
        let bytes = self.read(buffer, first * 4, count * 4)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// `count` f64 values of `buffer` from value `first`.
    fn read_f64(&self, buffer: &Self::Buffer, first: usize, count: usize) -> Result<Vec<f64>> {
        let bytes = self.read(buffer, first * 8, count * 8)?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect())
    }
}

/// `values` as the little-endian bytes a device buffer holds.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// The byte range `[offset, offset + len)` of a buffer of `size` bytes, or why not.
fn in_bounds(what: &str, offset: usize, len: usize, size: usize) -> Result<()> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(LaunchError(format!(
            "{what}: bytes {offset}..{} of a buffer of {size}",
            offset.saturating_add(len)
        ))),
    }
}
