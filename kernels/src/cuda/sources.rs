//! The `.cu` sources embedded in the binary.

/// One kernel source file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// The file's path under `kernels/src`, e.g. `rms_norm.cu`: NVRTC's name for the program,
    /// so its errors read `rms_norm.cu(12): error: …`.
    pub name: &'static str,
    pub text: &'static str,
}

pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "accumulate.cu",
        text: include_str!("../accumulate.cu"),
    },
    KernelSource {
        name: "adamw.cu",
        text: include_str!("../adamw.cu"),
    },
    KernelSource {
        name: "attention/attention.cu",
        text: include_str!("../attention/attention.cu"),
    },
    KernelSource {
        name: "causal_conv_silu.cu",
        text: include_str!("../causal_conv_silu.cu"),
    },
    KernelSource {
        name: "cross_entropy.cu",
        text: include_str!("../cross_entropy.cu"),
    },
    KernelSource {
        name: "decode.cu",
        text: include_str!("../decode.cu"),
    },
    KernelSource {
        name: "embedding.cu",
        text: include_str!("../embedding.cu"),
    },
    KernelSource {
        name: "gated_rms_norm.cu",
        text: include_str!("../gated_rms_norm.cu"),
    },
    KernelSource {
        name: "grad_norm.cu",
        text: include_str!("../grad_norm.cu"),
    },
    KernelSource {
        name: "linear.cu",
        text: include_str!("../linear.cu"),
    },
    KernelSource {
        name: "mamba2.cu",
        text: include_str!("../mamba2.cu"),
    },
    KernelSource {
        name: "moe.cu",
        text: include_str!("../moe.cu"),
    },
    KernelSource {
        name: "relu2.cu",
        text: include_str!("../relu2.cu"),
    },
    KernelSource {
        name: "rms_norm.cu",
        text: include_str!("../rms_norm.cu"),
    },
    KernelSource {
        name: "rope.cu",
        text: include_str!("../rope.cu"),
    },
    KernelSource {
        name: "ssd.cu",
        text: include_str!("../ssd.cu"),
    },
    KernelSource {
        name: "swiglu.cu",
        text: include_str!("../swiglu.cu"),
    },
];
