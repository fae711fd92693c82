//! `resources.device`: where a stage asks to run, and the probe a binary offers to check it.

use std::fmt;

/// A stage's `resources.device`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    /// A GPU when one is usable, else the CPU; which, is said on stderr.
    Auto,
    Cpu,
    /// `cuda` (device 0) or `cuda:N`: the stage fails before it starts when it is not usable.
    Cuda(usize),
}

/// The forms `resources.device` takes, for error messages.
pub const DEVICE_FORMS: &str = "`auto`, `cpu`, `cuda` or `cuda:N`";

impl Device {
    /// `auto`, `cpu`, `cuda` or `cuda:N`.
    pub fn parse(text: &str) -> Result<Device, String> {
        match text.trim() {
            "auto" => Ok(Device::Auto),
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("`{other}` is not a device: write {DEVICE_FORMS}")),
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Auto => write!(f, "auto"),
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// Asks the machine for CUDA device `N`: a one-line description of it, or why it cannot be
/// used (what is missing, and where it was looked for). The binary supplies it from the
/// kernels crate; the engine never loads CUDA itself.
pub type GpuProbe = fn(usize) -> Result<String, String>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_parses_and_prints_back() {
        for (text, device) in [
            ("auto", Device::Auto),
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(Device::parse(text), Ok(device));
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA"] {
            let err = Device::parse(bad).expect_err(bad);
            assert!(
                err.contains(&format!("`{bad}`")) && err.contains("cuda:N"),
                "{err}"
            );
        }
    }
}
