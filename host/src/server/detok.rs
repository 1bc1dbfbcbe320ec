//! Incremental detokenization and stop-string matching for one output stream.
//!
//! Owns: [`IncrementalDetokenizer`] (prefix/read offsets, as vLLM and TGI do: text is released
//! only when the decoded window grows and does not end in an incomplete UTF-8 character, so a
//! stream never splits a character) and [`StopMatcher`] (holds back any tail that could still
//! become a stop string; matches across token boundaries; the stop string is not released).
//! Invariants: the concatenation of everything released equals what a one-shot decode and
//! match would give. Pure CPU work with no I/O: callers run it on the blocking pool.

use super::text::{TextCodec, TextError};

/// Turns a growing token sequence into text deltas.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl IncrementalDetokenizer {
    /// `context`: the last few prompt tokens, so the first generated token decodes with the
    /// right leading space; they are never part of the output.
    pub fn new(context: &[u32], skip_special: bool) -> Self {
        Self {
            tokens: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special,
        }
    }

    /// Adds one token and returns the newly complete text (possibly empty).
    pub fn push(&mut self, codec: &TextCodec, token: u32) -> Result<String, TextError> {
        self.tokens.push(token);
        let prefix = codec.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = codec.decode(&self.tokens[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{fffd}') {
            let delta = full.get(prefix.len()..).unwrap_or("").to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.tokens.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Releases whatever is still held (an incomplete character becomes U+FFFD).
    pub fn flush(&mut self, codec: &TextCodec) -> Result<String, TextError> {
        let prefix = codec.decode(
            &self.tokens[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = codec.decode(&self.tokens[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.tokens.len();
        Ok(if full.len() > prefix.len() {
            full.get(prefix.len()..).unwrap_or("").to_string()
        } else {
            String::new()
        })
    }
}

/// What the matcher says about newly added text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Released {
    /// Text that can be sent now.
    pub text: String,
    /// The stop string that matched; the stream is over.
    pub stopped: Option<String>,
}

/// Finds stop strings in streamed text, holding back possible stop-string prefixes.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
    done: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
            done: false,
        }
    }

    pub fn is_done(&self) -> bool {
        self.done
    }

    pub fn push(&mut self, text: &str) -> Released {
        if self.done {
            return Released {
                text: String::new(),
                stopped: None,
            };
        }
        if self.stops.is_empty() {
            return Released {
                text: text.to_string(),
                stopped: None,
            };
        }
        self.held.push_str(text);
        // Earliest full match wins (all earlier text is released, the stop string is not).
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = first {
            let stop = s.clone();
            let text = self.held[..at].to_string();
            self.held.clear();
            self.done = true;
            return Released {
                text,
                stopped: Some(stop),
            };
        }
        // Hold back the longest tail that is a proper prefix of some stop string.
        let keep_from = self
            .held
            .char_indices()
            .map(|(i, _)| i)
            .find(|&i| {
                let tail = &self.held[i..];
                self.stops.iter().any(|s| s.starts_with(tail))
            })
            .unwrap_or(self.held.len());
        let text = self.held[..keep_from].to_string();
        self.held.drain(..keep_from);
        Released {
            text,
            stopped: None,
        }
    }

    /// End of stream: whatever is held is not a stop string, release it.
    pub fn finish(&mut self) -> String {
        self.done = true;
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::mock_tokenizer;

    fn codec() -> TextCodec {
        TextCodec::from_parts(mock_tokenizer::tokenizer_json().as_bytes(), None, None).unwrap()
    }

    #[test]
    fn never_splits_a_character_and_matches_one_shot_decode() {
        let c = codec();
        let text = "hello 😀 world é€ the cat";
        // Byte-level BPE without merges for these characters: each byte is its own token.
        let split = c.encode(text, false).unwrap();
        let partial = split
            .iter()
            .filter(|t| c.decode(&[**t], false).unwrap().contains('\u{fffd}'))
            .count();
        assert!(
            partial >= 9,
            "the test needs characters split across tokens"
        );
        let mut d = IncrementalDetokenizer::new(&[], true);
        let mut out = String::new();
        for t in &split {
            let delta = d.push(&c, *t).unwrap();
            assert!(!delta.contains('\u{fffd}'), "split character in {delta:?}");
            out.push_str(&delta);
        }
        out.push_str(&d.flush(&c).unwrap());
        assert_eq!(out, c.decode(&split, true).unwrap());
    }

    #[test]
    fn stop_strings_across_pieces() {
        let mut m = StopMatcher::new(vec!["END".into(), "xyz".into()]);
        let mut out = String::new();
        for piece in ["abc E", "N", "x", "D tail"] {
            let r = m.push(piece);
            assert_eq!(r.stopped, None);
            out.push_str(&r.text);
        }
        out.push_str(&m.finish());
        // "ENx" cannot become "END", so "EN" is released once "x" arrives.
        assert_eq!(out, "abc ENxD tail");
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("abc E").text, "abc ");
        let r = m.push("ND more");
        assert_eq!((r.text.as_str(), r.stopped.as_deref()), ("", Some("END")));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("xx EN").text, "xx ");
        assert_eq!(m.finish(), "EN");
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_tails_are_safe() {
        let mut m = StopMatcher::new(vec!["cd".into(), "b".into(), "é!".into()]);
        let r = m.push("abcd");
        assert_eq!((r.text.as_str(), r.stopped.as_deref()), ("a", Some("b")));
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("xé").text, "x");
        assert_eq!(m.push("?").text, "é?");
    }
}
