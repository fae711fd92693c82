//! bf16 products on cuBLASLt: a [`Gemm`] of [`Precision::Bf16`] with its operands rounded to
//! bf16 (linear.cu's `cast_bf16`), multiplied on the tensor cores with f32 accumulation
//! (`CUBLAS_COMPUTE_32F`, never TF32) into an f32 `c` — the arithmetic of linear.cu's
//! `gemm_bf16_f32`, which is what these products are held to.
//!
//! cuBLASLt is column-major and our matrices are row-major, so it is asked for `cᵀ = op(b)ᵀ ·
//! op(a)ᵀ`: a row-major matrix read column-major is its own transpose, so `b` goes first with
//! `trans_b` as its transpose, and `a` second with `trans_a` (cuBLASLt's documentation,
//! "cublasLtMatmul", <https://docs.nvidia.com/cuda/cublas/#cublasltmatmul>).
//!
//! [`Precision::Bf16`]: crate::linear::Precision::Bf16

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::{result, sys};
use cudarc::driver::CudaSlice;

use super::{Arg, Cuda, Geometry, LaunchError, Launcher, Result};
use crate::linear::Gemm;

/// cuBLASLt's workspace on Hopper, as NVIDIA recommends (32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

/// Where the second bf16 operand starts in the operand buffer: cuBLASLt's fastest kernels ask
/// for 16-byte alignment, and the heuristic assumes 256 unless told less.
const OPERAND_ALIGN: usize = 256;

fn blas(call: &str) -> impl Fn(result::CublasError) -> LaunchError + '_ {
    move |e| LaunchError(format!("{call}: {e}"))
}

/// A cuBLASLt handle, its workspace, and the buffer the operands' bf16 copies are cast into.
pub(super) struct CublasLt {
    handle: Handle,
    workspace: CudaSlice<u8>,
    /// Grown to the largest product asked for; one product at a time uses it (the stream
    /// orders a cast after the matmul before it).
    operands: Mutex<CudaSlice<u8>>,
    /// The heuristic's algorithm for each shape asked so far (`None`: it had none).
    algos: Mutex<HashMap<Shape, Option<sys::cublasLtMatmulAlgo_t>>>,
}

struct Handle(sys::cublasLtHandle_t);

// SAFETY: a cuBLASLt handle may be used from any thread (NVIDIA's "Thread Safety": the
// library is thread safe, its functions may be called from several host threads); nemo-dag
// calls it from one thread at a time, behind the locks of `algos` and `operands`.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by `create_handle` and destroyed only here.
        let _ = unsafe { result::destroy_handle(self.0) };
    }
}

/// A descriptor destroyed when it goes out of scope, however the product ends.
struct Owned<T: Copy>(
    T,
    unsafe fn(T) -> std::result::Result<(), result::CublasError>,
);

impl<T: Copy> Drop for Owned<T> {
    fn drop(&mut self) {
        // SAFETY: each was created by its `create_*` and is destroyed once, here.
        let _ = unsafe { (self.1)(self.0) };
    }
}

impl CublasLt {
    /// A handle on the current context (the caller has bound it), with its workspace.
    pub(super) fn new(cuda: &Cuda) -> Result<CublasLt> {
        let handle = Handle(result::create_handle().map_err(blas("cublasLtCreate"))?);
        Ok(CublasLt {
            handle,
            workspace: cuda.alloc(WORKSPACE_BYTES)?,
            operands: Mutex::new(cuda.alloc(OPERAND_ALIGN)?),
            algos: Mutex::new(HashMap::new()),
        })
    }

    /// `gemm` on the matrices at device addresses `a`, `b` (f32, or bf16 where
    /// `gemm.bf16_inputs` says) and `c` (f32); says whether its shape was new (cuBLASLt's
    /// heuristic was asked for it now).
    ///
    /// # Safety
    /// `a`, `b` and `c` must be the addresses of `m·k`, `k·n` and `m·n` values on `cuda`.
    pub(super) unsafe fn matmul(
        &self,
        cuda: &Cuda,
        g: &Gemm,
        (a, b, c): (u64, u64, u64),
    ) -> Result<bool> {
        let (m, n, k) = (g.m, g.n, g.k);
        // cuBLASLt runs on the calling thread's current context.
        cuda.bind()?;
        let b_at = (2 * m * k).next_multiple_of(OPERAND_ALIGN);
        // cᵀ (n × m, column-major, leading dimension n) = op(b)ᵀ · op(a)ᵀ.
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let f32 = sys::cudaDataType_t::CUDA_R_32F;
        let layout = |data, rows: usize, cols: usize| {
            result::create_matrix_layout(data, rows as u64, cols as u64, rows as i64)
                .map(|l| Owned(l, result::destroy_matrix_layout))
                .map_err(blas("cublasLtMatrixLayoutCreate"))
        };
        // b stored n × k (trans_b) reads column-major as k × n, to be transposed; stored k × n,
        // it reads as n × k, already op(b)ᵀ. Likewise a.
        let first = if g.trans_b {
            layout(bf16, k, n)?
        } else {
            layout(bf16, n, k)?
        };
        let second = if g.trans_a {
            layout(bf16, m, k)?
        } else {
            layout(bf16, k, m)?
        };
        let out = layout(f32, n, m)?;
        let desc = result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, f32)
            .map(|d| Owned(d, result::destroy_matmul_desc))
            .map_err(blas("cublasLtMatmulDescCreate"))?;
        for (attr, transpose) in [
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                g.trans_b,
            ),
            (
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                g.trans_a,
            ),
        ] {
            let op = i32::from(transpose); // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
            // SAFETY: the attribute is an int32 cublasOperation_t, read from `op`.
            unsafe { result::set_matmul_desc_attribute(desc.0, attr, ptr(&op), 4) }
                .map_err(blas("cublasLtMatmulDescSetAttribute"))?;
        }
        // c is anywhere in a buffer (a parameter's gradient slot): say how aligned it is.
        let c_align = (1u32 << c.trailing_zeros().min(8)).max(4);
        let shape = (m, n, k, g.trans_a, g.trans_b, c_align);
        let (algo, new) = self.algorithm(shape, desc.0, [first.0, second.0, out.0])?;
        let Some(algo) = algo else {
            // No cuBLASLt kernel for this shape and alignment, or for this GPU: the same
            // arithmetic on linear.cu's kernel, from the f32 operands.
            // SAFETY: passed on from the caller.
            return unsafe { kernel(cuda, g, (a, b, c)) }.map(|()| new);
        };
        let mut operands = self
            .operands
            .lock()
            .map_err(|_| LaunchError("cuBLASLt's operand buffer: a panic held its lock".into()))?;
        if cuda.len(&operands) < b_at + 2 * k * n {
            *operands = cuda.alloc(b_at + 2 * k * n)?;
        }
        // Operands stored as bf16 are read where they are; the others are cast first.
        let scratch = cuda.address(&operands);
        let (a16, b16) = match g.bf16_inputs {
            (true, true) => (a, b),
            (true, false) => (a, scratch + b_at as u64),
            (false, true) => (scratch, b),
            (false, false) => (scratch, scratch + b_at as u64),
        };
        // SAFETY: `a` and `b` hold m·k and k·n values (the caller), and the operand buffer
        // 2·m·k bytes from `scratch` and 2·k·n from `scratch + b_at`.
        unsafe {
            if !g.bf16_inputs.0 {
                cast_bf16(cuda, a, a16, m * k)?;
            }
            if !g.bf16_inputs.1 {
                cast_bf16(cuda, b, b16, k * n)?;
            }
        }
        let workspace = cuda.address(&self.workspace);
        // SAFETY: the operands were cast above, on this stream; c holds m·n floats (the
        // caller); alpha and beta are host f32s, cuBLASLt's default pointer mode.
        unsafe {
            result::matmul(
                self.handle.0,
                desc.0,
                ptr(&g.alpha),
                ptr(&g.beta),
                b16 as *const c_void,
                first.0,
                a16 as *const c_void,
                second.0,
                c as *const c_void,
                out.0,
                c as *mut c_void,
                out.0,
                &algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                cuda.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(blas("cublasLtMatmul"))?;
        Ok(new)
    }
}

impl CublasLt {
    /// The algorithm cuBLASLt's heuristic picks for `shape` with these descriptors (its
    /// operands' and result's layouts), or `None` where it has none, and whether it was asked
    /// now: asked once per shape and remembered, so a step of shapes seen before asks nothing,
    /// and a shape always runs the same algorithm.
    fn algorithm(
        &self,
        shape: Shape,
        desc: sys::cublasLtMatmulDesc_t,
        [first, second, out]: [sys::cublasLtMatrixLayout_t; 3],
    ) -> Result<(Option<sys::cublasLtMatmulAlgo_t>, bool)> {
        let mut algos = self
            .algos
            .lock()
            .map_err(|_| LaunchError("cuBLASLt's algorithms: a panic held their lock".into()))?;
        if let Some(known) = algos.get(&shape) {
            return Ok((*known, false));
        }
        let pref = result::create_matmul_pref()
            .map(|p| Owned(p, result::destroy_matmul_pref))
            .map_err(blas("cublasLtMatmulPreferenceCreate"))?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let c_align = shape.5;
        // SAFETY: each attribute's value has the type cuBLASLt documents (uint64, uint32s).
        unsafe {
            let size = WORKSPACE_BYTES as u64;
            result::set_matmul_pref_attribute(
                pref.0,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                ptr(&size),
                8,
            )
            .map_err(blas("cublasLtMatmulPreferenceSetAttribute"))?;
            for attr in [
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
            ] {
                result::set_matmul_pref_attribute(pref.0, attr, ptr(&c_align), 4)
                    .map_err(blas("cublasLtMatmulPreferenceSetAttribute"))?;
            }
        }
        // SAFETY: the descriptors are alive; the heuristic reads only them.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(self.handle.0, desc, first, second, out, out, pref.0)
        };
        let algo = match heuristic {
            Ok(heuristic) => Some(heuristic.algo),
            Err(result::CublasError(
                sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                | sys::cublasStatus_t::CUBLAS_STATUS_ARCH_MISMATCH,
            )) => None,
            Err(e) => return Err(blas("cublasLtMatmulAlgoGetHeuristic")(e)),
        };
        algos.insert(shape, algo);
        Ok((algo, true))
    }
}

/// A product as cuBLASLt's heuristic sees it: `(m, n, k, trans_a, trans_b, c's alignment)`.
type Shape = (usize, usize, usize, bool, bool, u32);

fn ptr<T>(value: &T) -> *const c_void {
    value as *const T as *const c_void
}

/// linear.cu's `cast_bf16`: `n` floats at `from` rounded into `n` bf16 values at `to`.
///
/// # Safety
/// `from` must hold `n` floats and `to` room for `n` bf16 values.
unsafe fn cast_bf16(cuda: &Cuda, from: u64, to: u64, n: usize) -> Result<()> {
    let grid = n.div_ceil(256).clamp(1, 1024) as u32;
    // SAFETY: the slots are the kernel's (const float*, __nv_bfloat16*, size_t).
    unsafe {
        cuda.launch_slots(
            "cast_bf16",
            Geometry::linear(grid, 256),
            &[from, to, n as u64],
        )
    }
}

/// `g` on linear.cu's kernel for its precision, at device addresses.
///
/// # Safety
/// As [`CublasLt::matmul`].
unsafe fn kernel(cuda: &Cuda, g: &Gemm, (a, b, c): (u64, u64, u64)) -> Result<()> {
    let geometry = crate::linear::gemm_geometry(g.m, g.n, 1);
    let args = g.args::<CudaSlice<u8>>(Arg::Null, Arg::Null, Arg::Null);
    let mut slots = args
        .iter()
        .map(|arg| arg.slot(|_, _| Ok(0)))
        .collect::<Result<Vec<u64>>>()?;
    slots[..3].copy_from_slice(&[a, b, c]);
    // SAFETY: the slots are the kernel's parameters, the pointers the caller's.
    unsafe { cuda.launch_slots(g.kernel(), geometry, &slots) }
}
