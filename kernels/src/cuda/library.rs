//! The CUDA libraries loaded at run time, and where the dynamic loader looks for them.
//!
//! cudarc (`dynamic-loading`) opens a library on its first call and panics when it cannot, so
//! every path into cudarc asks [`CudaLibrary::is_present`] first and turns absence into an
//! error that says which files were looked for and where.

use std::fmt;

/// A CUDA library nemo-dag opens with `dlopen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaLibrary {
    /// The driver API, `libcuda.so.1`: installed with the NVIDIA driver, never by a wheel.
    Driver,
    /// The run-time compiler, `libnvrtc.so.13`: the CUDA toolkit, or the `nvidia-cuda-nvrtc`
    /// wheel.
    Nvrtc,
    /// cuBLASLt, `libcublasLt.so.13`: the CUDA toolkit, or the `nvidia-cublas` wheel. Only
    /// bf16 GEMMs need it; without it they run on linear.cu's kernel, slower.
    CublasLt,
}

impl CudaLibrary {
    /// The stem cudarc builds its candidate file names from.
    fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::CublasLt => "cublasLt",
        }
    }

    /// What the library is, as a user reads it in an error.
    pub fn describe(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "the CUDA driver library (installed with the NVIDIA driver)",
            CudaLibrary::Nvrtc => {
                "the NVRTC library (CUDA toolkit, or the nvidia-cuda-nvrtc wheel)"
            }
            CudaLibrary::CublasLt => "cuBLASLt (CUDA toolkit, or the nvidia-cublas wheel)",
        }
    }

    /// Whether `dlopen` finds the library under one of cudarc's candidate names. This only
    /// opens and closes the file: no CUDA call is made.
    pub fn is_present(self) -> bool {
        // SAFETY: both only try `dlopen` on a list of names and close what they open.
        unsafe {
            match self {
                CudaLibrary::Driver => cudarc::driver::sys::is_culib_present(),
                CudaLibrary::Nvrtc => cudarc::nvrtc::sys::is_culib_present(),
                CudaLibrary::CublasLt => cudarc::cublaslt::sys::is_culib_present(),
            }
        }
    }

    /// The file names tried and the search path they were tried on, for an error message.
    pub fn searched(self) -> Searched {
        let prefix = format!("lib{}.so", self.stem());
        let names = cudarc::get_lib_name_candidates(self.stem())
            .into_iter()
            .filter(|name| name.starts_with(&prefix))
            .collect();
        Searched {
            names,
            ld_library_path: std::env::var("LD_LIBRARY_PATH")
                .ok()
                .filter(|p| !p.is_empty()),
        }
    }
}

/// Where a library was looked for: these names, through the dynamic loader's search path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searched {
    /// The file names `dlopen` was asked for, in order.
    pub names: Vec<String>,
    /// `LD_LIBRARY_PATH` as this process saw it at start, if set.
    pub ld_library_path: Option<String>,
}

impl fmt::Display for Searched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "looked for {} in ", self.names.join(", "))?;
        match &self.ld_library_path {
            Some(path) => write!(f, "LD_LIBRARY_PATH ({path}), ")?,
            None => write!(f, "LD_LIBRARY_PATH (not set), ")?,
        }
        write!(f, "the ld.so cache and the system library directories")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_search_names_the_versioned_files_the_loader_was_asked_for() {
        let searched = CudaLibrary::Nvrtc.searched();
        assert!(
            searched.names.iter().any(|n| n == "libnvrtc.so.13"),
            "{searched:?}"
        );
        assert!(
            searched.names.iter().all(|n| n.starts_with("libnvrtc.so")),
            "{searched:?}"
        );
        let searched = CudaLibrary::CublasLt.searched();
        assert!(
            searched.names.iter().any(|n| n == "libcublasLt.so.13"),
            "{searched:?}"
        );
        let searched = CudaLibrary::Driver.searched();
        assert!(
            searched.names.iter().any(|n| n == "libcuda.so.1"),
            "{searched:?}"
        );
        assert!(searched.to_string().contains("LD_LIBRARY_PATH"));
    }
}
