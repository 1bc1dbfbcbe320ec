//! Grammar-constrained decoding over llguidance, shared by the `llguidance` constraint plugin
//! (Wasm) and the host's native twin.
//!
//! [`Constraints`] is built once from the plugin config ([`Limits`]) and the model's
//! vocabulary; per response it opens a matcher from a grammar (JSON Schema, regex, choice,
//! Lark), advances it by sampled tokens and answers the allowed-token bitmask for the next
//! position (`ceil(n / 32)` words, bit `t % 32` of word `t / 32`). Modules: [`limits`]
//! (config), [`vocabulary`] (token trie), [`grammar`] (grammar kinds), [`compiled`] (grammars
//! kept for the next request that sends them), [`constraints`] (the matchers), [`error`].
//!
//! This crate does no I/O and keeps no global state of its own.

pub mod compiled;
pub mod constraints;
pub mod error;
pub mod grammar;
pub mod limits;
pub mod vocabulary;

pub use constraints::Constraints;
pub use error::ConstraintError;
pub use grammar::GrammarKind;
pub use limits::Limits;

#[cfg(test)]
mod tests;
