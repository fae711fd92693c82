//! nemo-dag's kernels: the math the models are made of, each kernel in a file of its own that
//! reads, in this order, as
//!
//! 1. **reference**: the plain composition of candle ops, which is the kernel's spec;
//! 2. **CPU**: the fused version, one graph node with its own backward pass;
//! 3. **the kernel**: the function model code calls, which picks the fused version for f32 on
//!    the CPU and the reference elsewhere, so a model never branches on the device;
//! 4. **tests**: the fused version against the reference, values and gradients, at the
//!    tolerance the file's doc states.
//!
//! The kernels take plain shapes and flags, never a model's types. See `kernels/README.md` for
//! how to add one.
//!
//! | kernel | what |
//! | --- | --- |
//! | [`linear`] | `x · wᵀ` |
//! | [`rms_norm`] | RMSNorm |
//! | [`rope`] | rotary position embedding |
//! | [`softmax`] | softmax, and the attention scores' masked softmax |
//! | [`attention`] | grouped-query causal self-attention over packed rows |
//! | [`swiglu`], [`relu2`] | the MLP activations |
//! | [`cross_entropy`] | cross-entropy fused with the softmax over the vocabulary |
//! | [`embedding`] | the token embedding's lookup (a reference and its CUDA kernels) |
//! | [`causal_conv_silu`], [`gated_rms_norm`] | Mamba-2's convolution and gated norm |
//! | [`moe`] | a mixture-of-experts layer's routing on a device: its [`moe::Permutation`] and its `.cu` kernels |
//!
//! Kernels that exist only as CUDA (`.cu`), each with its references and tests beside it in a
//! test-only module: `accumulate`, `adamw`, `decode` (one token against an attention block's
//! key/value cache or a Mamba-2 block's window and state), `grad_norm`, `mamba2` (Mamba-2's
//! step size, decay and skip) and `ssd` (its chunked scan).
//!
//! Shared pieces: [`simd`] (vectorised row math, the same bytes at every SIMD level),
//! [`rows`] (a storage's values in place; rows in parallel), [`workers`] (independent pieces
//! of work side by side, one thread each) and [`rng`] (the seeded generator of initialisations
//! and tests).

mod accumulate;
#[cfg(test)]
mod adamw;
pub mod attention;
pub mod causal_conv_silu;
pub mod cross_entropy;
pub mod cuda;
#[cfg(test)]
mod decode;
pub mod embedding;
pub mod gated_rms_norm;
#[cfg(test)]
mod grad_norm;
pub mod launch;
pub mod linear;
#[cfg(test)]
mod mamba2;
#[cfg(test)]
mod mirror;
pub mod moe;
pub mod relu2;
pub mod rms_norm;
pub mod rng;
pub mod rope;
pub mod rows;
pub mod simd;
pub mod simt;
pub mod softmax;
#[cfg(test)]
mod ssd;
pub mod swiglu;
#[cfg(test)]
mod testing;
pub mod workers;

pub use attention::{attention, attention_plain, split_heads};
pub use causal_conv_silu::{causal_conv_silu, causal_conv_silu_plain};
pub use cross_entropy::{cross_entropy, cross_entropy_plain};
pub use embedding::embedding_plain;
pub use gated_rms_norm::{gated_rms_norm, gated_rms_norm_plain};
pub use linear::{linear, linear_plain};
pub use relu2::{relu2, relu2_plain};
pub use rms_norm::{rms_norm, rms_norm_plain};
pub use rope::{RopeTables, rope, rope_angles, rope_plain};
pub use softmax::{masked_softmax, softmax};
pub use swiglu::{swiglu, swiglu_plain};

use candle_core::{DType, Tensor};

/// Whether the fused CPU version of a kernel runs for `x`: f32 on the CPU. Elsewhere the
/// reference composition runs (until a device has kernels of its own).
fn fused_here(x: &Tensor) -> bool {
    x.device().is_cpu() && x.dtype() == DType::F32
}
