//! Megatron-LM's pretraining data: the indexed `.bin`/`.idx` token datasets ([`indexed`]) and
//! the sample, shuffle and blending indices its `GPTDataset` builds over them ([`gpt_dataset`]).

pub mod gpt_dataset;
pub mod indexed;

pub use indexed::*;
