//! CUDA at run time: the GPU probe, the kernel sources embedded in the binary, and NVRTC.

pub mod cache;
pub mod kernel_names;
pub mod library;
pub mod nvrtc;
pub mod probe;
pub mod ptxas;
pub mod sources;

pub use cache::{CacheOutcome, KernelCache};
pub use library::{CudaLibrary, Searched};
pub use nvrtc::{CompileError, Compiled, ImageKind, Nvrtc};
pub use probe::{Gpu, GpuUnavailable};
pub use ptxas::KernelResources;
pub use sources::{KernelSource, SOURCES};
