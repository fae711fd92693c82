//! [`Launcher`] on a GPU: every embedded `.cu` source compiled by NVRTC for the device's
//! architecture (through the on-disk kernel cache), loaded as a module, launched on one stream.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::cublaslt::CublasLt;
use super::{
    Arg, Geometry, KERNEL_TIMES_VAR, KernelTime, LaunchError, Launcher, Result, in_bounds,
};
use crate::cuda::kernel_names::kernel_names;
use crate::cuda::{CudaLibrary, Gpu, KernelCache, Nvrtc, SOURCES};
use crate::linear::{Gemm, Precision};

/// One GPU, its compiled kernels and a stream.
pub struct Cuda {
    gpu: Gpu,
    stream: Arc<CudaStream>,
    /// Every kernel of every source, by name, looked up in the module that defines it (asking
    /// each module in turn would make a failed driver call per miss).
    functions: HashMap<String, CudaFunction>,
    /// bf16 products' tensor cores, or why they run on linear.cu's kernel instead.
    cublaslt: std::result::Result<CublasLt, String>,
    /// Launches and seconds by kernel, when launches are timed ([`KERNEL_TIMES_VAR`]).
    times: Option<Mutex<HashMap<String, (u64, f64)>>>,
}

fn driver(call: &str) -> impl Fn(cudarc::driver::DriverError) -> LaunchError + '_ {
    move |e| LaunchError(format!("{call}: {e}"))
}

impl Cuda {
    /// Device `ordinal` with every kernel compiled and loaded; an error says what is missing
    /// (driver, NVRTC, headers, device) or which source did not compile.
    pub fn new(ordinal: usize) -> Result<Cuda> {
        let gpu = Gpu::probe(ordinal).map_err(|e| LaunchError(e.to_string()))?;
        let nvrtc = Nvrtc::load().map_err(|e| LaunchError(e.to_string()))?;
        let cache = KernelCache::user();
        let context = CudaContext::new(ordinal).map_err(driver("cuCtxCreate"))?;
        // One stream, in issue order: no cross-stream events to track.
        // SAFETY: no other stream of this context is ever used.
        unsafe { context.disable_event_tracking() };
        let arch = gpu.arch();
        let mut functions = HashMap::new();
        for source in SOURCES {
            let compiled = nvrtc
                .compile(source, &arch, cache.as_ref())
                .map_err(|e| LaunchError(e.to_string()))?;
            let module = context
                .load_module(Ptx::from_binary(compiled.image))
                .map_err(|e| LaunchError(format!("cuModuleLoadData({}): {e}", source.name)))?;
            for name in kernel_names(source.text) {
                let function = module.load_function(&name).map_err(|e| {
                    LaunchError(format!("cuModuleGetFunction({}: {name}): {e}", source.name))
                })?;
                functions.insert(name, function);
            }
        }
        let mut cuda = Cuda {
            gpu,
            stream: context.default_stream(),
            functions,
            cublaslt: Err(String::new()),
            times: std::env::var(KERNEL_TIMES_VAR)
                .is_ok_and(|v| !v.is_empty() && v != "0")
                .then(Mutex::default),
        };
        cuda.cublaslt = if CudaLibrary::CublasLt.is_present() {
            context
                .bind_to_thread()
                .map_err(driver("cuCtxSetCurrent"))?;
            // Present but unusable (a driver too old for it): the kernels still run.
            CublasLt::new(&cuda).map_err(|e| format!("cuBLASLt cannot be used: {e}"))
        } else {
            Err(format!(
                "{} is missing: {}",
                CudaLibrary::CublasLt.describe(),
                CudaLibrary::CublasLt.searched()
            ))
        };
        Ok(cuda)
    }

    /// Why bf16 products run on linear.cu's kernel rather than cuBLASLt, if they do.
    pub fn without_cublaslt(&self) -> Option<&str> {
        self.cublaslt.as_ref().err().map(String::as_str)
    }

    /// Makes this GPU's context the calling thread's current one.
    pub(super) fn bind(&self) -> Result<()> {
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver("cuCtxSetCurrent"))
    }

    /// The stream every launch and product is issued on.
    pub(super) fn cu_stream(&self) -> cudarc::driver::sys::CUstream {
        self.stream.cu_stream()
    }

    /// The device this launcher runs on.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// Waits for every launch issued so far.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver("cuStreamSynchronize"))
    }

    /// The device address of `buffer`'s first byte.
    pub fn address(&self, buffer: &CudaSlice<u8>) -> u64 {
        buffer.device_ptr(&self.stream).0
    }

    /// Runs kernel `name` with its parameters' values, each in the low bytes of a slot (device
    /// addresses for pointers): [`Launcher::launch`] after it has resolved its arguments.
    ///
    /// # Safety
    /// As [`Launcher::launch`]: one slot for each parameter, of the value the kernel expects.
    pub unsafe fn launch_slots(&self, name: &str, geometry: Geometry, slots: &[u64]) -> Result<()> {
        let function = self.function(name)?;
        let mut builder = self.stream.launch_builder(function);
        for slot in slots {
            // Each slot holds the argument's bytes in its low end; the driver reads as many
            // as the kernel's parameter takes.
            builder.arg(slot);
        }
        let config = LaunchConfig {
            grid_dim: (geometry.grid[0], geometry.grid[1], geometry.grid[2]),
            block_dim: (geometry.block[0], geometry.block[1], geometry.block[2]),
            shared_mem_bytes: 0,
        };
        // SAFETY: the caller vouches for the arguments' types and the buffers' sizes.
        unsafe { builder.launch(config) }
            .map(|_| ())
            .map_err(|e| LaunchError(format!("launching {name}: {e}")))
    }

    /// Issues `launch`; when launches are timed, waits for the stream before and after it and
    /// adds the time between to `name`'s: the kernel's time on the device and one launch's
    /// latency. Waiting at every launch makes a step slower: timed figures are for shares, not
    /// for rates.
    fn timed(
        &self,
        name: impl FnOnce() -> String,
        launch: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let Some(times) = &self.times else {
            return launch();
        };
        self.synchronize()?;
        let clock = Instant::now();
        launch()?;
        self.synchronize()?;
        let seconds = clock.elapsed().as_secs_f64();
        let mut times = times
            .lock()
            .map_err(|_| LaunchError("kernel times: a thread panicked holding them".into()))?;
        let entry = times.entry(name()).or_default();
        entry.0 += 1;
        entry.1 += seconds;
        Ok(())
    }

    fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| LaunchError(format!("no kernel named `{name}` in the sources")))
    }
}

impl Launcher for Cuda {
    type Buffer = CudaSlice<u8>;

    fn describe(&self) -> String {
        match self.without_cublaslt() {
            None => self.gpu.to_string(),
            Some(why) => format!("{}; bf16 GEMMs on linear.cu ({why})", self.gpu),
        }
    }

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        // cuMemAlloc refuses 0 bytes; an empty buffer is one byte nobody reads.
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| LaunchError(format!("cuMemAlloc({bytes} bytes): {e}")))
    }

    fn write(&self, buffer: &mut CudaSlice<u8>, offset: usize, data: &[u8]) -> Result<()> {
        in_bounds("write", offset, data.len(), buffer.len())?;
        if data.is_empty() {
            return Ok(());
        }
        let mut view = buffer.slice_mut(offset..offset + data.len());
        self.stream
            .memcpy_htod(data, &mut view)
            .map_err(driver("cuMemcpyHtoD"))
    }

    /// On the device (cuMemsetD8Async), not by copying zeros from the host: the trainer zeroes
    /// its gradients every step, and a pageable copy of them is as big as the model.
    fn zero(&self, buffer: &mut CudaSlice<u8>) -> Result<()> {
        self.stream
            .memset_zeros(buffer)
            .map_err(driver("cuMemsetD8Async"))
    }

    fn read(&self, buffer: &CudaSlice<u8>, offset: usize, len: usize) -> Result<Vec<u8>> {
        in_bounds("read", offset, len, buffer.len())?;
        let mut out = vec![0u8; len];
        if len > 0 {
            let view = buffer.slice(offset..offset + len);
            self.stream
                .memcpy_dtoh(&view, &mut out)
                .map_err(driver("cuMemcpyDtoH"))?;
        }
        self.synchronize()?;
        Ok(out)
    }

    unsafe fn launch(
        &self,
        name: &str,
        geometry: Geometry,
        args: &[Arg<'_, CudaSlice<u8>>],
    ) -> Result<()> {
        let pointer = |buffer: &CudaSlice<u8>, offset: usize| {
            in_bounds(name, offset, 0, buffer.len())?;
            Ok(self.address(buffer) + offset as u64)
        };
        let slots = args
            .iter()
            .map(|a| a.slot(pointer))
            .collect::<Result<Vec<u64>>>()?;
        // SAFETY: passed on from the caller.
        self.timed(
            || name.to_string(),
            || unsafe { self.launch_slots(name, geometry, &slots) },
        )
    }

    fn len(&self, buffer: &CudaSlice<u8>) -> usize {
        buffer.len()
    }

    fn all_reduce_sum(
        &self,
        from: &CudaSlice<u8>,
        into: &mut CudaSlice<u8>,
        count: usize,
    ) -> Result<Option<String>> {
        in_bounds("all_reduce_sum", 0, count * 4, from.len())?;
        in_bounds("all_reduce_sum", 0, count * 4, into.len())?;
        let nccl = super::nccl::Nccl::get()?;
        let version = nccl.version()?;
        let (from, into) = (self.address(from), self.address(into));
        // SAFETY: both buffers hold `count` floats (checked above).
        unsafe { nccl.all_reduce_one_rank(self, (from, into), count)? };
        Ok(Some(format!("NCCL {version}")))
    }

    fn lacks(&self) -> Option<&str> {
        self.without_cublaslt()
    }

    fn take_kernel_times(&self) -> Vec<KernelTime> {
        let Some(Ok(mut times)) = self.times.as_ref().map(Mutex::lock) else {
            return Vec::new();
        };
        let mut taken: Vec<KernelTime> = times
            .drain()
            .map(|(name, (launches, seconds))| KernelTime {
                name,
                launches,
                seconds,
            })
            .collect();
        taken.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.name.cmp(&b.name)));
        taken
    }

    fn gemm_backend(&self, precision: Precision) -> String {
        match (&self.cublaslt, precision) {
            (Ok(_), Precision::Bf16) => "cuBLASLt".to_string(),
            (Err(why), Precision::Bf16) => format!("linear.cu's {} ({why})", precision.kernel()),
            (_, Precision::F32) => format!("linear.cu's {}", precision.kernel()),
        }
    }

    unsafe fn gemm(
        &self,
        gemm: &Gemm,
        a: Arg<'_, CudaSlice<u8>>,
        b: Arg<'_, CudaSlice<u8>>,
        c: Arg<'_, CudaSlice<u8>>,
    ) -> Result<()> {
        let geometry = crate::linear::gemm_geometry(gemm.m, gemm.n, 1);
        match &self.cublaslt {
            // An empty product is beta · c, or nothing: the kernel's business.
            Ok(blas) if gemm.is_bf16() && gemm.m * gemm.n * gemm.k > 0 => {
                let pointer = |buffer: &CudaSlice<u8>, offset: usize| {
                    in_bounds("gemm", offset, 0, buffer.len())?;
                    Ok(self.address(buffer) + offset as u64)
                };
                let [a, b, c] = [a, b, c].map(|arg| arg.slot(pointer));
                let (a, b, c) = (a?, b?, c?);
                let layout = |t| if t { 'T' } else { 'N' };
                // A shape's first product, which asks cuBLASLt's heuristic (and may load the
                // kernel it picks), is timed apart from the shape's later ones.
                let first = std::cell::Cell::new(false);
                let name = || {
                    let (ta, tb) = (layout(gemm.trans_a), layout(gemm.trans_b));
                    let new = if first.get() { ", its first" } else { "" };
                    format!("cuBLASLt {}x{}x{} {ta}{tb}{new}", gemm.m, gemm.n, gemm.k)
                };
                self.timed(name, || {
                    // SAFETY: passed on from the caller.
                    first.set(unsafe { blas.matmul(self, gemm, (a, b, c)) }?);
                    Ok(())
                })
            }
            // SAFETY: passed on from the caller; the arguments are the kernel's, in order.
            _ => unsafe { self.launch(gemm.kernel(), geometry, &gemm.args(a, b, c)) },
        }
    }
}
