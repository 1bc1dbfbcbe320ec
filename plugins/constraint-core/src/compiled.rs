//! Compiled grammars kept for the next request that sends the same one.
//!
//! Owns [`Compiled`]: up to `capacity` matchers fresh from compilation, keyed by grammar kind
//! and text, the least recently used dropped first. llguidance builds a grammar's lexer states
//! lazily, as masks reach them, and a matcher cloned from another shares its lexer (so those
//! states) while keeping a parse of its own. A request whose grammar was seen before starts
//! from a clone: no compilation, and no first-reach cost for the states earlier requests of
//! that grammar built. Agents send the same tools and response schemas on every turn, so this
//! is the common case. A template whose matchers failed is forgotten (see
//! [`Compiled::forget`]), so a lexer that hit a limit is not handed on.

use std::hash::{DefaultHasher, Hash, Hasher};

use llguidance::Matcher;

use crate::grammar::GrammarKind;

/// Identifies one (kind, grammar text) pair among the cached ones.
pub type Key = u64;

pub struct Compiled {
    capacity: usize,
    /// Most recently used last.
    entries: Vec<Entry>,
}

struct Entry {
    key: Key,
    kind: GrammarKind,
    grammar: Box<str>,
    template: Matcher,
}

impl Compiled {
    /// Keeps up to `capacity` grammars; 0 keeps none (every `open` compiles).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity,
            entries: Vec::new(),
        }
    }

    pub fn key(kind: GrammarKind, grammar: &str) -> Key {
        let mut h = DefaultHasher::new();
        kind.name().hash(&mut h);
        grammar.hash(&mut h);
        h.finish()
    }

    /// A matcher for `grammar` cloned from its template, if it is kept; marks it used.
    pub fn get(&mut self, key: Key, kind: GrammarKind, grammar: &str) -> Option<Matcher> {
        let i = self
            .entries
            .iter()
            .position(|e| e.key == key && e.kind == kind && *e.grammar == *grammar)?;
        let entry = self.entries.remove(i);
        let matcher = entry.template.clone();
        self.entries.push(entry);
        Some(matcher)
    }

    /// Keeps a clone of `fresh` (a matcher just compiled, before any token) as the template
    /// of `grammar`, dropping the least recently used template when full.
    pub fn insert(&mut self, key: Key, kind: GrammarKind, grammar: &str, fresh: &Matcher) {
        if self.capacity == 0 {
            return;
        }
        self.forget(key);
        if self.entries.len() >= self.capacity {
            self.entries.remove(0);
        }
        self.entries.push(Entry {
            key,
            kind,
            grammar: grammar.into(),
            template: fresh.clone(),
        });
    }

    /// Drops the template under `key` (its lexer is shared with a matcher that failed).
    pub fn forget(&mut self, key: Key) {
        self.entries.retain(|e| e.key != key);
    }

    /// Templates kept now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}
