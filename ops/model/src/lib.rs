//! The models behind `pretrain` and `sft`, in candle, readable top to bottom.
//!
//! - [`config`]: what a manifest declares (sizes, the `M*-E/…` layer pattern).
//! - [`params`]: named parameters and their seeded initialisation.
//! - [`layers`]: RMSNorm, rotary embeddings, attention and the MLP.
//! - [`mamba2`]: the Mamba-2 (SSD) mixer, with its sequential reference.
//! - [`moe`]: the mixture of experts with a sigmoid router and aux-loss-free balancing.
//! - [`net`]: the whole network (embedding, the pattern's blocks, MTP depths) and its loss.
//! - [`decode`]: cached decoding, one token per row and step (KV caches, Mamba states).
//! - [`sampling`]: temperature / top-k / top-p sampling, stop ids and strings, `generate`.
//! - [`size`]: parameters, FLOPs and training memory from the config alone, before building.
//! - [`checkpoint`]: model directories (`config.json`, `model.safetensors`) written and read.
//!
//! Everything is built from candle-core primitives and the kernels of the `nemo-dag-kernels`
//! crate (each a fused op with an explicit backward, beside its plain reference), so autograd
//! reaches every parameter (candle-nn's fused norms and softmax silently train without a
//! gradient).

pub mod checkpoint;
pub mod config;
pub mod decode;
pub mod layers;
pub mod mamba2;
pub mod moe;
pub mod net;
pub mod params;
pub mod sampling;
pub mod size;
