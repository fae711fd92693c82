//! Is there a GPU nemo-dag can use? [`Gpu::probe`] answers without ever panicking: it checks
//! that the driver and NVRTC libraries can be opened before the first CUDA call, then asks the
//! driver for the device.

use std::fmt;
use std::panic::{self, AssertUnwindSafe};

use cudarc::driver::result::{self as driver, DriverError};
use cudarc::driver::sys::{CUdevice_attribute, cudaError_enum};

use super::library::{CudaLibrary, Searched};

/// A CUDA device that answered the driver: what kernels are compiled for and sized by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The device's ordinal (`cuda:N`).
    pub ordinal: usize,
    /// The driver's name for it, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for Hopper.
    pub compute_capability: (u32, u32),
    /// Global memory, in bytes.
    pub memory_bytes: u64,
}

/// Why there is no usable GPU: what is missing, and where it was looked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuUnavailable {
    /// `dlopen` found no file of this library.
    MissingLibrary {
        library: CudaLibrary,
        searched: Searched,
    },
    /// The driver answered a call with an error (`cuInit` fails this way when the kernel
    /// module is not loaded, or the driver is older than CUDA 13.0).
    Driver { call: &'static str, error: String },
    /// The driver works and sees no CUDA device.
    NoDevice,
    /// `cuda:N` names a device past the last one.
    OutOfRange { ordinal: usize, count: usize },
    /// cudarc panicked (a symbol this driver lacks); the panic's message.
    Panicked(String),
}

impl fmt::Display for GpuUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuUnavailable::MissingLibrary { library, searched } => {
                write!(f, "{} was not found: {searched}", library.describe())
            }
            GpuUnavailable::Driver { call, error } => {
                write!(f, "the CUDA driver failed {call}: {error}")
            }
            GpuUnavailable::NoDevice => write!(f, "the CUDA driver sees no device"),
            GpuUnavailable::OutOfRange { ordinal, count } => write!(
                f,
                "there is no CUDA device {ordinal}: the driver sees {count} (cuda:0 to cuda:{})",
                count.saturating_sub(1)
            ),
            GpuUnavailable::Panicked(message) => write!(f, "cudarc panicked: {message}"),
        }
    }
}

impl std::error::Error for GpuUnavailable {}

impl Gpu {
    /// Device `ordinal`, if the driver, NVRTC and the device are all there.
    pub fn probe(ordinal: usize) -> Result<Gpu, GpuUnavailable> {
        for library in [CudaLibrary::Driver, CudaLibrary::Nvrtc] {
            if !library.is_present() {
                return Err(GpuUnavailable::MissingLibrary {
                    library,
                    searched: library.searched(),
                });
            }
        }
        // The libraries open; a symbol missing from an old driver still panics inside cudarc.
        panic::catch_unwind(AssertUnwindSafe(|| query_device(ordinal)))
            .unwrap_or_else(|payload| Err(GpuUnavailable::Panicked(panic_message(&payload))))
    }

    /// The architecture NVRTC compiles this device's kernels for, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        let (major, minor) = self.compute_capability;
        format!("sm_{major}{minor}")
    }
}

impl fmt::Display for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gib = self.memory_bytes as f64 / (1u64 << 30) as f64;
        write!(
            f,
            "cuda:{} ({}, {}, {gib:.1} GiB)",
            self.ordinal,
            self.name,
            self.arch()
        )
    }
}

/// The driver calls, in order: cuInit, the count, then the device's name, capability, memory.
fn query_device(ordinal: usize) -> Result<Gpu, GpuUnavailable> {
    match driver::init() {
        Err(DriverError(cudaError_enum::CUDA_ERROR_NO_DEVICE)) => {
            return Err(GpuUnavailable::NoDevice);
        }
        other => other.map_err(failed("cuInit"))?,
    }
    let count = driver::device::get_count().map_err(failed("cuDeviceGetCount"))?;
    let count = usize::try_from(count).unwrap_or(0);
    if count == 0 {
        return Err(GpuUnavailable::NoDevice);
    }
    if ordinal >= count {
        return Err(GpuUnavailable::OutOfRange { ordinal, count });
    }
    // `ordinal < count`, and the count came from a c_int.
    let device = driver::device::get(ordinal as i32).map_err(failed("cuDeviceGet"))?;
    let name = driver::device::get_name(device).map_err(failed("cuDeviceGetName"))?;
    let attribute = |which| {
        // SAFETY: `device` came from cuDeviceGet.
        unsafe { driver::device::get_attribute(device, which) }
            .map_err(failed("cuDeviceGetAttribute"))
    };
    let major = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    // SAFETY: `device` came from cuDeviceGet.
    let memory =
        unsafe { driver::device::total_mem(device) }.map_err(failed("cuDeviceTotalMem"))?;
    Ok(Gpu {
        ordinal,
        name,
        compute_capability: (major.max(0) as u32, minor.max(0) as u32),
        memory_bytes: memory as u64,
    })
}

fn failed(call: &'static str) -> impl Fn(DriverError) -> GpuUnavailable {
    move |error| GpuUnavailable::Driver {
        call,
        error: format!("{error:?}"),
    }
}

fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a machine without libcuda (CI, this project's build machine) the probe must say so,
    /// name the file it looked for, and not panic.
    #[test]
    fn the_probe_names_the_missing_driver_library_without_a_panic() {
        if CudaLibrary::Driver.is_present() {
            eprintln!("skipped: libcuda is present here, so the no-driver path cannot be taken");
            return;
        }
        let err = Gpu::probe(0).expect_err("no driver library, so no GPU");
        assert!(
            matches!(
                err,
                GpuUnavailable::MissingLibrary {
                    library: CudaLibrary::Driver,
                    ..
                }
            ),
            "{err:?}"
        );
        let message = err.to_string();
        assert!(message.contains("CUDA driver library"), "{message}");
        assert!(message.contains("libcuda.so.1"), "{message}");
        assert!(message.contains("LD_LIBRARY_PATH"), "{message}");
    }

    #[test]
    fn a_device_past_the_last_is_named_with_the_range_there_is() {
        let err = GpuUnavailable::OutOfRange {
            ordinal: 3,
            count: 1,
        };
        assert_eq!(
            err.to_string(),
            "there is no CUDA device 3: the driver sees 1 (cuda:0 to cuda:0)"
        );
    }

    #[test]
    fn the_arch_is_sm_and_the_compute_capability() {
        let gpu = Gpu {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            compute_capability: (9, 0),
            memory_bytes: 80 << 30,
        };
        assert_eq!(gpu.arch(), "sm_90");
        assert_eq!(
            gpu.to_string(),
            "cuda:0 (NVIDIA H100 80GB HBM3, sm_90, 80.0 GiB)"
        );
    }
}
