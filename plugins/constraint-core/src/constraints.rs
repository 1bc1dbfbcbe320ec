//! The constraint engine of one plugin instance: the compiled vocabulary, the grammar factory
//! and the open matchers, addressed by `u32` ids.
//!
//! Owns [`Constraints`]. Invariants: at most `max_open` matchers are open; an id names one
//! open matcher until `close`, then may be handed out again; every mask has
//! [`Constraints::mask_words`] words with no bit set at or past the vocabulary size. A matcher
//! that refused a token (or hit a step limit) stays open but answers every later call with
//! the same error until closed. No I/O, no global state: llguidance's logging is off.
//! Panics inside llguidance are caught natively (they become `Internal` errors); a Wasm build
//! aborts on panic, which traps, and the host recovers.

use std::panic::{AssertUnwindSafe, catch_unwind};

use chimera_policy_core::{Config, VocabularyView};
use llguidance::earley::SlicedBiasComputer;
use llguidance::{Matcher, ParserFactory};
use toktrie::InferenceCapabilities;

use crate::compiled::{Compiled, Key};
use crate::error::{ConstraintError, clip};
use crate::grammar::{GrammarKind, check_size, describe};
use crate::limits::Limits;
use crate::vocabulary;

/// Grammar-constrained decoding for one model vocabulary.
pub struct Constraints {
    limits: Limits,
    factory: ParserFactory,
    compiled: Compiled,
    vocab_size: usize,
    /// Slot `id` holds matcher `id` while it is open.
    slots: Vec<Option<Open>>,
    /// Closed slots, reused before the vector grows.
    free: Vec<u32>,
    open: u32,
}

/// An open matcher and the key of its grammar's kept template (it was cloned from it or kept
/// as it).
struct Open {
    matcher: Matcher,
    template: Key,
}

impl Constraints {
    /// Reads the limits from `config`, builds the token trie and the grammar factory (the
    /// slow part: the factory runs its token-class regexes over the whole trie once).
    pub fn new(config: &Config, vocabulary: &VocabularyView<'_>) -> Result<Self, String> {
        let limits = Limits::from_config(config)?;
        Self::with_limits(limits, vocabulary).map_err(|e| e.to_string())
    }

    pub fn with_limits(
        limits: Limits,
        vocabulary: &VocabularyView<'_>,
    ) -> Result<Self, ConstraintError> {
        let tok_env = vocabulary::tok_env(vocabulary)?;
        let vocab_size = vocabulary.len();
        let factory = guard(|| {
            let mut factory = ParserFactory::new(
                &tok_env,
                InferenceCapabilities::default(),
                &SlicedBiasComputer::general_slices(),
            )
            .map_err(|e| ConstraintError::Vocabulary(clip(e.to_string())))?;
            factory.quiet();
            *factory.limits_mut() = limits.parser_limits();
            Ok(factory)
        })?;
        Ok(Self {
            compiled: Compiled::new(limits.grammar_cache_entries as usize),
            limits,
            factory,
            vocab_size,
            slots: Vec::new(),
            free: Vec::new(),
            open: 0,
        })
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Words in a mask: `ceil(vocab_size / 32)`.
    pub fn mask_words(&self) -> usize {
        self.vocab_size.div_ceil(32)
    }

    /// Matchers open now.
    pub fn open_count(&self) -> u32 {
        self.open
    }

    /// Compiled grammars kept for reuse now (at most the `grammar_cache_entries` limit).
    pub fn cached_grammars(&self) -> usize {
        self.compiled.len()
    }

    /// Compiles `grammar` as `kind` (`json-schema`, `regex`, `choice`, `lark`) and opens a
    /// matcher for it; a grammar compiled before (same kind and text) is cloned from its kept
    /// template instead (see [`crate::compiled`]). Errors say what was wrong with the grammar,
    /// fit for the client.
    pub fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
        let kind = GrammarKind::parse(kind)?;
        if self.open >= self.limits.max_open {
            return Err(ConstraintError::TooManyOpen(self.limits.max_open));
        }
        // Before the text is hashed (`describe` checks it again when compiling).
        check_size(grammar, self.limits.max_grammar_bytes)?;
        let key = Compiled::key(kind, grammar);
        let matcher = match self.compiled.get(key, kind, grammar) {
            Some(matcher) => matcher,
            None => {
                let matcher = self.compile(kind, grammar)?;
                self.compiled.insert(key, kind, grammar, &matcher);
                matcher
            }
        };
        let open = Open {
            matcher,
            template: key,
        };
        let id = match self.free.pop() {
            Some(id) => {
                self.slots[id as usize] = Some(open);
                id
            }
            None => {
                // `open < max_open ≤ 2^20` slots, so the index fits.
                let id = self.slots.len() as u32;
                self.slots.push(Some(open));
                id
            }
        };
        self.open += 1;
        Ok(id)
    }

    fn compile(&self, kind: GrammarKind, grammar: &str) -> Result<Matcher, ConstraintError> {
        let description = describe(
            kind,
            grammar,
            self.limits.max_grammar_bytes,
            self.limits.json_whitespace_max,
        )?;
        let factory = &self.factory;
        guard(|| {
            let matcher = Matcher::new(factory.create_parser(description));
            match matcher.get_error() {
                Some(message) => Err(ConstraintError::Invalid {
                    kind: kind.name(),
                    message: clip(message),
                }),
                None => Ok(matcher),
            }
        })
    }

    /// Advances matcher `id` by `tokens` and returns the next position's mask.
    pub fn next(&mut self, id: u32, tokens: &[u32]) -> Result<Vec<u32>, ConstraintError> {
        let mut mask = vec![0u32; self.mask_words()];
        self.next_into(id, tokens, &mut mask)?;
        Ok(mask)
    }

    /// [`Constraints::next`] writing the mask into `mask`, which must have
    /// [`Constraints::mask_words`] words. On error `mask` is all zeros.
    pub fn next_into(
        &mut self,
        id: u32,
        tokens: &[u32],
        mask: &mut [u32],
    ) -> Result<(), ConstraintError> {
        mask.fill(0);
        let expected = self.mask_words();
        if mask.len() != expected {
            return Err(ConstraintError::MaskLength {
                got: mask.len(),
                expected,
            });
        }
        let vocab = self.vocab_size;
        if let Some(&token) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ConstraintError::TokenOutOfRange { token, vocab });
        }
        let matcher = self.matcher(id)?;
        let set = (|| {
            if !tokens.is_empty() {
                matcher.consume_tokens(tokens)?;
            }
            matcher.compute_mask_or_eos()
        })();
        let set = match set {
            Ok(set) => set,
            Err(e) => {
                self.failed(id);
                return Err(ConstraintError::Matcher(clip(e.to_string())));
            }
        };
        let words = set.as_slice();
        let n = words.len().min(expected);
        mask[..n].copy_from_slice(&words[..n]);
        if !vocab.is_multiple_of(32) {
            // Bits past the vocabulary are never tokens.
            mask[expected - 1] &= (1u32 << (vocab % 32)) - 1;
        }
        if mask.iter().all(|&w| w == 0) {
            return Err(ConstraintError::EmptyMask);
        }
        Ok(())
    }

    /// Takes back the last `count` tokens matcher `id` consumed.
    pub fn rollback(&mut self, id: u32, count: u32) -> Result<(), ConstraintError> {
        let result = self.matcher(id)?.rollback(count as usize);
        result.map_err(|e| {
            self.failed(id);
            ConstraintError::Matcher(clip(e.to_string()))
        })
    }

    /// Matcher `id` failed: the template it shares a lexer with is not handed on.
    fn failed(&mut self, id: u32) {
        if let Some(key) = self
            .slots
            .get(id as usize)
            .and_then(Option::as_ref)
            .map(|o| o.template)
        {
            self.compiled.forget(key);
        }
    }

    /// Closes matcher `id`; its id may be handed out again. Closing an id that is not open
    /// does nothing.
    pub fn close(&mut self, id: u32) {
        if let Some(slot) = self.slots.get_mut(id as usize)
            && slot.take().is_some()
        {
            self.free.push(id);
            self.open -= 1;
        }
    }

    fn matcher(&mut self, id: u32) -> Result<&mut Matcher, ConstraintError> {
        self.slots
            .get_mut(id as usize)
            .and_then(Option::as_mut)
            .map(|o| &mut o.matcher)
            .ok_or(ConstraintError::UnknownMatcher(id))
    }
}

/// Runs `f`, turning a panic into [`ConstraintError::Internal`] (natively; Wasm aborts).
fn guard<T>(f: impl FnOnce() -> Result<T, ConstraintError>) -> Result<T, ConstraintError> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        Err(ConstraintError::Internal(clip(message)))
    })
}
