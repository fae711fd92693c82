//! Compiling a kernel source with NVRTC at run time, for one architecture, with the assembler's
//! resource report.
//!
//! This drives NVRTC through cudarc's low-level calls (create, compile, log, CUBIN/PTX) rather
//! than `compile_ptx_with_opts`, which returns the log only on failure: with
//! `-Xptxas=-v` the log of a successful compile is the per-kernel report of registers, spills,
//! shared memory and stack that the checks in `kernels/tests` hold each kernel to.
//! NVRTC's options: <https://docs.nvidia.com/cuda/nvrtc/index.html#supported-compile-options>.

use std::ffi::{CString, c_char, c_int};
use std::fmt;
use std::path::{Path, PathBuf};

use cudarc::nvrtc::result as nvrtc;
use cudarc::nvrtc::sys::{self, nvrtcProgram};

use super::cache::{CacheOutcome, KernelCache};
use super::library::{CudaLibrary, Searched};
use super::ptxas::{self, KernelResources};
use super::sources::KernelSource;

/// The environment variable naming a CUDA install (or a wheel's `nvidia/cu13` directory) whose
/// `include/` holds `cuda_bf16.h`.
pub const CUDA_HOME_VAR: &str = "NEMO_DAG_CUDA_HOME";

/// The environment variable of macros every kernel is compiled with, to time a kernel's
/// variants against each other on a GPU (`ATTN_ASYNC=0`): `NAME` or `NAME=VALUE` words, each
/// of ASCII letters, digits and `_`, apart by spaces. Being compile options, they are part of
/// a compile's cache key. The SIMT shim's kernels are built without them.
pub const DEFINES_VAR: &str = "NEMO_DAG_CUDA_DEFINES";

/// NVRTC, opened and with the CUDA headers found: ready to compile.
#[derive(Debug, Clone)]
pub struct Nvrtc {
    version: (i32, i32),
    include_dir: PathBuf,
    /// `-D` options from [`DEFINES_VAR`].
    defines: Vec<String>,
}

/// What one compile produced.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The architecture it was compiled for (`sm_90`, or `compute_90` for PTX).
    pub arch: String,
    /// A CUBIN for `sm_XX`, PTX text for `compute_XX`.
    pub image: Vec<u8>,
    pub image_kind: ImageKind,
    /// The assembler's report, one entry per kernel (empty for PTX: nothing was assembled).
    pub kernels: Vec<KernelResources>,
    /// NVRTC's program log: warnings and the `-Xptxas=-v` report.
    pub log: String,
    /// Whether this came from the disk cache, was stored there, or could not be stored.
    pub cache: CacheOutcome,
}

/// The kind of image NVRTC returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for one architecture, loaded as is (no JIT).
    Cubin,
    /// PTX, JIT-compiled by the driver when loaded.
    Ptx,
}

/// Why a kernel did not compile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompileError {
    /// libnvrtc could not be opened.
    MissingNvrtc { searched: Searched },
    /// No directory with `cuda_bf16.h` among those tried.
    MissingHeaders { tried: Vec<PathBuf> },
    /// The source holds a NUL byte, which NVRTC cannot be handed.
    NulInSource { name: String },
    /// NVRTC refused the source: its log, with file and line.
    Rejected {
        name: String,
        arch: String,
        log: String,
    },
    /// An NVRTC call failed for another reason.
    Nvrtc { call: &'static str, error: String },
    /// A word of [`DEFINES_VAR`] that is not `NAME` or `NAME=VALUE`.
    BadDefine { word: String },
}

impl fmt::Display for CompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CompileError::MissingNvrtc { searched } => write!(
                f,
                "{} was not found: {searched}",
                CudaLibrary::Nvrtc.describe()
            ),
            CompileError::MissingHeaders { tried } => {
                let tried: Vec<_> = tried.iter().map(|p| p.display().to_string()).collect();
                write!(
                    f,
                    "the CUDA headers (cuda_bf16.h) were not found: tried {}; set {CUDA_HOME_VAR} \
                     to a CUDA install or a wheel's nvidia/cu13 directory",
                    tried.join(", ")
                )
            }
            CompileError::NulInSource { name } => write!(f, "{name} holds a NUL byte"),
            CompileError::Rejected { name, arch, log } => {
                write!(f, "NVRTC could not compile {name} for {arch}:\n{log}")
            }
            CompileError::Nvrtc { call, error } => write!(f, "NVRTC failed {call}: {error}"),
            CompileError::BadDefine { word } => write!(
                f,
                "{DEFINES_VAR}: `{word}` is not NAME or NAME=VALUE (ASCII letters, digits and _)"
            ),
        }
    }
}

impl std::error::Error for CompileError {}

impl Nvrtc {
    /// Opens NVRTC (through the loader's search path) and finds the CUDA headers.
    pub fn load() -> Result<Nvrtc, CompileError> {
        if !CudaLibrary::Nvrtc.is_present() {
            return Err(CompileError::MissingNvrtc {
                searched: CudaLibrary::Nvrtc.searched(),
            });
        }
        let version = nvrtc_version()?;
        let include_dir = find_include_dir()?;
        let defines = parse_defines(&std::env::var(DEFINES_VAR).unwrap_or_default())?;
        Ok(Nvrtc {
            version,
            include_dir,
            defines,
        })
    }

    /// The same NVRTC compiling with the macros `words` defines, as [`DEFINES_VAR`] reads,
    /// in place of the environment's.
    pub fn with_defines(mut self, words: &str) -> Result<Nvrtc, CompileError> {
        self.defines = parse_defines(words)?;
        Ok(self)
    }

    /// NVRTC's `(major, minor)` version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    /// The directory passed as `-I`, the one holding `cuda_bf16.h`.
    pub fn include_dir(&self) -> &Path {
        &self.include_dir
    }

    /// The options every kernel is compiled with for `arch` (`sm_90` or `compute_90`).
    pub fn options(&self, arch: &str) -> Vec<String> {
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "-std=c++17".to_string(),
            "-Xptxas=-v".to_string(),
            format!("-I{}", self.include_dir.display()),
        ];
        options.extend(self.defines.iter().map(|d| format!("-D{d}")));
        options
    }

    /// Compiles `source` for `arch`: `sm_XX` gives a CUBIN and the assembler's report,
    /// `compute_XX` gives PTX. With a cache, an identical earlier compile is read back instead.
    pub fn compile(
        &self,
        source: &KernelSource,
        arch: &str,
        cache: Option<&KernelCache>,
    ) -> Result<Compiled, CompileError> {
        let options = self.options(arch);
        let image_kind = if arch.starts_with("sm_") {
            ImageKind::Cubin
        } else {
            ImageKind::Ptx
        };
        let key = KernelCache::key(source.text, arch, self.version, &options);
        if let Some(entry) = cache.and_then(|cache| cache.load(&key, image_kind)) {
            return Ok(compiled(
                arch,
                image_kind,
                entry.image,
                entry.log,
                CacheOutcome::Hit,
            ));
        }
        let (image, log) = run_nvrtc(source, arch, &options, image_kind)?;
        let outcome = match cache {
            Some(cache) => cache.store(&key, image_kind, &image, &log),
            None => CacheOutcome::Off,
        };
        Ok(compiled(arch, image_kind, image, log, outcome))
    }
}

fn compiled(
    arch: &str,
    image_kind: ImageKind,
    image: Vec<u8>,
    log: String,
    cache: CacheOutcome,
) -> Compiled {
    Compiled {
        arch: arch.to_string(),
        kernels: ptxas::parse(&log),
        image,
        image_kind,
        log,
        cache,
    }
}

/// One NVRTC program's life: create, compile, read the log and the image, destroy.
fn run_nvrtc(
    source: &KernelSource,
    arch: &str,
    options: &[String],
    image_kind: ImageKind,
) -> Result<(Vec<u8>, String), CompileError> {
    let nul = || CompileError::NulInSource {
        name: source.name.to_string(),
    };
    let text = CString::new(source.text).map_err(|_| nul())?;
    let name = CString::new(source.name).map_err(|_| nul())?;
    let program =
        nvrtc::create_program(&text, Some(&name)).map_err(failed("nvrtcCreateProgram"))?;
    let result = compile_program(program, source, arch, options, image_kind);
    // SAFETY: `program` came from nvrtcCreateProgram and is destroyed once, here.
    let destroyed =
        unsafe { nvrtc::destroy_program(program) }.map_err(failed("nvrtcDestroyProgram"));
    let output = result?;
    destroyed?;
    Ok(output)
}

fn compile_program(
    program: nvrtcProgram,
    source: &KernelSource,
    arch: &str,
    options: &[String],
    image_kind: ImageKind,
) -> Result<(Vec<u8>, String), CompileError> {
    // SAFETY (all calls below): `program` is live until `run_nvrtc` destroys it.
    let compiled = unsafe { nvrtc::compile_program(program, options) };
    let log = unsafe { nvrtc::get_program_log(program) }.map_err(failed("nvrtcGetProgramLog"))?;
    let log = c_chars_to_string(&log);
    match compiled {
        Ok(()) => {}
        Err(nvrtc::NvrtcError(sys::nvrtcResult::NVRTC_ERROR_COMPILATION)) => {
            return Err(CompileError::Rejected {
                name: source.name.to_string(),
                arch: arch.to_string(),
                log,
            });
        }
        Err(error) => return Err(failed("nvrtcCompileProgram")(error)),
    }
    let image = match image_kind {
        ImageKind::Cubin => unsafe { cubin(program) }?,
        ImageKind::Ptx => {
            let ptx = unsafe { nvrtc::get_ptx(program) }.map_err(failed("nvrtcGetPTX"))?;
            c_chars_to_string(&ptx).into_bytes()
        }
    };
    Ok((image, log))
}

/// The CUBIN of a program compiled for an `sm_XX` architecture.
///
/// # Safety
/// `program` must be live and compiled.
unsafe fn cubin(program: nvrtcProgram) -> Result<Vec<u8>, CompileError> {
    let mut size = 0usize;
    unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }
        .result()
        .map_err(failed("nvrtcGetCUBINSize"))?;
    let mut image = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(program, image.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(failed("nvrtcGetCUBIN"))?;
    Ok(image)
}

/// [`DEFINES_VAR`]'s words, each `NAME` or `NAME=VALUE` of ASCII letters, digits and `_`.
fn parse_defines(text: &str) -> Result<Vec<String>, CompileError> {
    let word = |w: &str| !w.is_empty() && w.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    text.split_whitespace()
        .map(|d| {
            let (name, value) = d.split_once('=').unwrap_or((d, "x"));
            let starts_well = name.chars().next().is_some_and(|c| !c.is_ascii_digit());
            if word(name) && starts_well && word(value) {
                Ok(d.to_string())
            } else {
                Err(CompileError::BadDefine {
                    word: d.to_string(),
                })
            }
        })
        .collect()
}

fn nvrtc_version() -> Result<(i32, i32), CompileError> {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two out-pointers to live integers; the library was checked to open.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(failed("nvrtcVersion"))?;
    Ok((major, minor))
}

/// The first of `$NEMO_DAG_CUDA_HOME/include`, `$CUDA_HOME/include`, `$CUDA_PATH/include` and
/// `/usr/local/cuda/include` that holds `cuda_bf16.h`.
fn find_include_dir() -> Result<PathBuf, CompileError> {
    let homes = [CUDA_HOME_VAR, "CUDA_HOME", "CUDA_PATH"]
        .into_iter()
        .filter_map(|var| std::env::var_os(var).filter(|v| !v.is_empty()))
        .map(PathBuf::from)
        .chain([PathBuf::from("/usr/local/cuda")]);
    let tried: Vec<PathBuf> = homes.map(|home| home.join("include")).collect();
    match tried.iter().find(|dir| dir.join("cuda_bf16.h").is_file()) {
        Some(dir) => Ok(dir.clone()),
        None => Err(CompileError::MissingHeaders { tried }),
    }
}

fn failed(call: &'static str) -> impl Fn(nvrtc::NvrtcError) -> CompileError {
    move |error| CompileError::Nvrtc {
        call,
        error: format!("{:?}", error.0),
    }
}

/// NVRTC's NUL-terminated `char` buffers as text.
fn c_chars_to_string(chars: &[c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_are_names_or_names_with_values_and_anything_else_is_named() {
        let ok = parse_defines("  ATTN_ASYNC=0 FAST\tX_2=abc ").unwrap();
        assert_eq!(ok, ["ATTN_ASYNC=0", "FAST", "X_2=abc"]);
        assert!(parse_defines("").unwrap().is_empty());
        for bad in ["A=", "=1", "1A", "A-B", "A=1;rm", "A=\"x\"", "-DA"] {
            let e = parse_defines(&format!("OK {bad}")).unwrap_err().to_string();
            assert!(
                e.contains(DEFINES_VAR) && e.contains(&format!("`{bad}`")),
                "{bad}: {e}"
            );
        }
    }
}
