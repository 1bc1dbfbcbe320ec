//! Placeholder: entries of `attention.cu`.
use super::Entry;
pub const ENTRIES: &[Entry] = &[];
