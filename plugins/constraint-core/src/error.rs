//! Why a constraint call failed, as one enum with a stable kind string per variant.
//!
//! Owns [`ConstraintError`]. Across the Wasm ABI only the message travels (`Display`); the
//! native twin also has [`ConstraintError::kind`] for metrics labels. `open` failures are the
//! client's fault (the host answers 400); `next`/`rollback` failures end one response.

use thiserror::Error;

/// The longest message kept from llguidance; its errors can quote large grammar fragments.
pub const MAX_MESSAGE_BYTES: usize = 1024;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConstraintError {
    /// The vocabulary the plugin was given cannot be used (init only).
    #[error("unusable vocabulary: {0}")]
    Vocabulary(String),
    /// `open` with a kind other than json-schema, regex, choice or lark.
    #[error("unknown grammar kind `{0}` (expected json-schema, regex, choice or lark)")]
    UnknownKind(String),
    /// The grammar text is longer than `max_grammar_bytes`.
    #[error("grammar is {len} bytes, more than the limit of {limit}")]
    TooLarge { len: usize, limit: u32 },
    /// The grammar does not parse or compile (bad JSON, unsupported schema feature, a limit
    /// such as lexer states or grammar size exceeded while compiling).
    #[error("invalid {kind} grammar: {message}")]
    Invalid { kind: &'static str, message: String },
    /// `max_open` matchers are open already.
    #[error("too many open matchers (limit {0})")]
    TooManyOpen(u32),
    /// No open matcher has this id.
    #[error("no open matcher {0}")]
    UnknownMatcher(u32),
    /// A token id outside the vocabulary.
    #[error("token {token} is outside the vocabulary of {vocab} tokens")]
    TokenOutOfRange { token: u32, vocab: usize },
    /// The matcher refused a token, a rollback, or hit a per-step limit; it is dead now.
    #[error("constraint failed: {0}")]
    Matcher(String),
    /// The grammar allows no token at all at this position.
    #[error("the grammar allows no token here")]
    EmptyMask,
    /// The caller's mask buffer has the wrong length.
    #[error("mask buffer has {got} words, expected {expected}")]
    MaskLength { got: usize, expected: usize },
    /// llguidance panicked (natively; in Wasm a panic traps and the host recovers).
    #[error("internal error in the grammar engine: {0}")]
    Internal(String),
}

impl ConstraintError {
    /// A stable label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintError::Vocabulary(_) => "vocabulary",
            ConstraintError::UnknownKind(_) => "unknown_kind",
            ConstraintError::TooLarge { .. } => "too_large",
            ConstraintError::Invalid { .. } => "invalid_grammar",
            ConstraintError::TooManyOpen(_) => "too_many_open",
            ConstraintError::UnknownMatcher(_) => "unknown_matcher",
            ConstraintError::TokenOutOfRange { .. } => "token_out_of_range",
            ConstraintError::Matcher(_) => "matcher",
            ConstraintError::EmptyMask => "empty_mask",
            ConstraintError::MaskLength { .. } => "mask_length",
            ConstraintError::Internal(_) => "internal",
        }
    }
}

/// `message` cut to [`MAX_MESSAGE_BYTES`] at a character boundary, with a marker when cut.
/// llguidance's `<non-verbose/>` marker (errors without a state dump) is dropped.
pub fn clip(message: impl Into<String>) -> String {
    let mut message = message.into();
    if let Some(stripped) = message.trim_end().strip_suffix("<non-verbose/>") {
        message = stripped.trim_end().to_string();
    }
    if message.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES;
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        message.truncate(end);
        message.push_str(" […]");
    }
    message
}
