//! Model loading and architectures.

pub mod batch;

pub use batch::{BatchInputs, CacheSpec, SeqChunk, SsmSnapshot};
