//! nemo-dag's data layer: the file formats its ops read and write, and the reproductions of
//! Python code whose exact output the recipes depend on. No ML code and no candle: every
//! function here is a plain transformation that can be checked against its original.
//!
//! - [`text`]: documents from `.jsonl`, `.parquet` and text files.
//! - [`chat`]: chat templates, role chunks and loss masks for SFT data.
//! - [`tokenizer`]: a fast byte-level BPE encoder that gives `tokenizers`' ids.
//! - [`megatron`]: Megatron's `.bin`/`.idx` datasets, and its `GPTDataset` and blending indices.
//! - [`sft`]: packing chat sequences into bins, and the packed Parquet files SFT reads.
//! - [`preference`]: the preference pairs DPO reads.
//! - [`reward`]: verifiable-answer scoring of generated math responses.
//! - [`random`]: the Mersenne Twister, seeded as CPython's `random` and numpy's `RandomState`.
//!
//! Every fallible function returns [`Error`]: a message naming the file and place, and help
//! where there is some. (An op's `RunError` takes it with `?`.)

pub mod chat;
mod error;
pub mod megatron;
pub mod preference;
pub mod random;
pub mod reward;
pub mod sft;
pub mod text;
pub mod tokenizer;

pub use error::{Error, Result};
