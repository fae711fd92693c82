//! The `.cu` sources embedded in the binary.

/// One kernel source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file's path under `kernels/src`, e.g. `rms_norm.cu`: NVRTC's name for the program,
    /// so its errors read `rms_norm.cu(12): error: …`.
    pub name: &'static str,
    pub text: &'static str,
}

pub const SOURCES: &[KernelSource] = &[];
