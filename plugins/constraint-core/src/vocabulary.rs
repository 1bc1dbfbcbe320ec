//! The model's vocabulary as llguidance reads it: a token trie inside a `TokEnv`.
//!
//! Owns the translation from chimera's column view to toktrie's token list. A special
//! (control) token's bytes are its name behind toktrie's marker byte `0xFF`, so no text the
//! grammar admits ever spells it; the end-of-sequence token is always treated as special.
//! Invariant: the view is checked before toktrie sees it, because toktrie asserts (panics) on
//! sizes it cannot store. Built once per plugin instance; holds no matcher state.

use std::sync::Arc;

use chimera_policy_core::VocabularyView;
use toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};

use crate::error::ConstraintError;

/// The most tokens toktrie's trie stores comfortably (its node index has 22 bits for subtree
/// sizes, about 4M nodes; this leaves room for multi-byte tokens).
pub const MAX_TOKENS: usize = 1 << 21;
/// The longest token, in bytes with the special marker: toktrie stores a node's depth chain in
/// 10 bits.
pub const MAX_TOKEN_BYTES: usize = 1000;
/// The most trie nodes toktrie can index (every byte of every token, at worst, plus the root).
const MAX_TRIE_BYTES: usize = (1 << 22) - 2;

/// Builds the tokenizer environment llguidance compiles grammars against.
pub fn tok_env(vocabulary: &VocabularyView<'_>) -> Result<TokEnv, ConstraintError> {
    let n = vocabulary.len();
    if !vocabulary.is_consistent() {
        return Err(ConstraintError::Vocabulary(
            "its columns disagree (special flags, offsets or eos out of range)".into(),
        ));
    }
    if n == 0 || n > MAX_TOKENS {
        return Err(ConstraintError::Vocabulary(format!(
            "{n} tokens (must be 1..={MAX_TOKENS})"
        )));
    }
    let eos = vocabulary.eos as usize;
    let mut words = Vec::with_capacity(n);
    let mut trie_bytes = 0usize;
    for i in 0..n {
        let bytes = vocabulary.token(i);
        let special = vocabulary.special[i] != 0 || i == eos;
        let mut word = Vec::with_capacity(bytes.len() + usize::from(special));
        if special {
            word.push(TokTrie::SPECIAL_TOKEN_MARKER);
        }
        word.extend_from_slice(bytes);
        if word.len() > MAX_TOKEN_BYTES {
            return Err(ConstraintError::Vocabulary(format!(
                "token {i} is {} bytes long (at most {MAX_TOKEN_BYTES})",
                word.len()
            )));
        }
        trie_bytes += word.len();
        words.push(word);
    }
    if trie_bytes > MAX_TRIE_BYTES {
        return Err(ConstraintError::Vocabulary(format!(
            "{trie_bytes} bytes of tokens (at most {MAX_TRIE_BYTES})"
        )));
    }
    // `n` ≤ MAX_TOKENS, so it fits.
    let info = TokRxInfo::new(n as u32, vocabulary.eos);
    let trie = TokTrie::from(&info, &words);
    Ok(Arc::new(ApproximateTokEnv::new(trie)))
}
