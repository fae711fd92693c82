//! SFT data after the chat template: sequences packed into bins of a fixed length
//! ([`packing`]), and the packed Parquet shards the trainer reads ([`parquet`]).

pub mod packing;
pub mod parquet;
