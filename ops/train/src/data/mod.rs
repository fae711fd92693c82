//! Where training batches come from: a pure function of the step number, so a resumed run reads
//! what an uninterrupted one would.
//!
//! - [`pretrain`]: Megatron's blended GPT samples of tokenized datasets (`pretrain`'s batches).
//! - [`sft`]: packed chat rows, collated and padded (`sft`'s batches).

pub mod pretrain;
pub mod sft;
