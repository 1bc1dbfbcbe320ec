//! Placeholder: entries of `sample.cu`.
use super::Entry;
pub const ENTRIES: &[Entry] = &[];
