//! Incremental detokenization and stop-string matching for one output stream.
//!
//! Owns: [`IncrementalDetokenizer`] and [`StopMatcher`] (holds back any tail that could still
//! become a stop string; matches across token boundaries; the stop string is not released).
//!
//! The detokenizer's contract: the concatenation of everything it releases (pushes, then
//! `flush`) equals the tokenizer's one-shot decode of the output ids, and text is released as
//! soon as no later token can change it. For a byte-level tokenizer (GPT-2 style: Llama 3,
//! Qwen, the embedded model) it works on the tokens' raw bytes: it holds back only a trailing
//! sequence that can still become a valid UTF-8 character (at most 3 bytes), and releases
//! U+FFFD as soon as a sequence can no longer become valid — exactly where the one-shot lossy
//! decode puts it. For other decoders (SentencePiece and the like) it decodes a sliding window
//! of ids with a few prompt tokens as context (so the first word keeps its leading space),
//! releases all but a trailing run of (at most three) U+FFFD, and never drops text when a window's decode is not an
//! extension of what was sent. Pure CPU work with no I/O: callers run it on the blocking pool.

use super::text::{TextCodec, TextError};

/// A window that has not become clean text after this many ids releases its trailing U+FFFD
/// anyway (bounds the re-decoding cost of a long run of invalid bytes).
const MAX_WINDOW: usize = 32;

/// Turns a growing token sequence into text deltas.
#[derive(Debug, Clone)]
pub struct IncrementalDetokenizer {
    skip_special: bool,
    mode: Mode,
}

#[derive(Debug, Clone)]
enum Mode {
    /// Byte-level tokenizer: the bytes not yet released (an incomplete UTF-8 sequence).
    Bytes { pending: Vec<u8> },
    /// Any other decoder: ids decoded as a sliding window.
    Window {
        tokens: Vec<u32>,
        /// The window: `tokens[prefix_offset..]`.
        prefix_offset: usize,
        /// Where the window's unreleased ids start (the ids before it are there for context).
        read_offset: usize,
        /// The window's text that was already released (or is context); `None` until the
        /// first id arrives (decoding is left to the blocking pool).
        sent: Option<String>,
    },
}

impl IncrementalDetokenizer {
    /// `context`: the last few prompt tokens, so that with a non-byte-level decoder the first
    /// generated token decodes with the right leading space; they are never part of the
    /// output (a byte-level decoder needs no context: its tokens carry their spaces).
    pub fn new(codec: &TextCodec, context: &[u32], skip_special: bool) -> Self {
        let mode = if codec.byte_table().is_some() {
            Mode::Bytes {
                pending: Vec::new(),
            }
        } else {
            Mode::Window {
                tokens: context.to_vec(),
                prefix_offset: 0,
                read_offset: context.len(),
                sent: None,
            }
        };
        Self { skip_special, mode }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, codec: &TextCodec, token: u32) -> Result<String, TextError> {
        let skip_special = self.skip_special;
        match &mut self.mode {
            Mode::Bytes { pending } => {
                let table = codec.byte_table().ok_or_else(|| {
                    TextError::Tokenizer("the tokenizer lost its byte table".into())
                })?;
                if !(skip_special && table.is_special(token)) {
                    pending.extend_from_slice(table.bytes(token));
                }
                Ok(release_utf8(pending, false))
            }
            Mode::Window { tokens, .. } => {
                tokens.push(token);
                self.release_window(codec, false)
            }
        }
    }

    /// End of output: releases whatever is held (an incomplete character becomes U+FFFD).
    pub fn flush(&mut self, codec: &TextCodec) -> Result<String, TextError> {
        match &mut self.mode {
            Mode::Bytes { pending } => Ok(release_utf8(pending, true)),
            Mode::Window { .. } => self.release_window(codec, true),
        }
    }

    fn release_window(&mut self, codec: &TextCodec, all: bool) -> Result<String, TextError> {
        let skip = self.skip_special;
        let Mode::Window {
            tokens,
            prefix_offset,
            read_offset,
            sent,
        } = &mut self.mode
        else {
            return Ok(String::new());
        };
        let sent = match sent {
            Some(s) => s,
            None => {
                // A context that ends inside a character would merge with the output's bytes.
                let context = &tokens[..*read_offset];
                let mut keep = context.len();
                let mut text = codec.decode(context, skip)?;
                while keep > 0 && text.ends_with(char::REPLACEMENT_CHARACTER) {
                    keep -= 1;
                    text = codec.decode(&context[..keep], skip)?;
                }
                tokens.drain(keep..*read_offset);
                *read_offset = keep;
                sent.insert(text)
            }
        };
        let full = codec.decode(&tokens[*prefix_offset..], skip)?;
        // Normally the window's text extends what was sent; if the decoder rewrote earlier
        // text, resend from where they agree (duplicating a little rather than losing any).
        let agree = if full.starts_with(sent.as_str()) {
            sent.len()
        } else {
            common_prefix_len(sent, &full)
        };
        // A trailing U+FFFD may be an incomplete character that a later id completes (a
        // byte-fallback decoder writes one per byte, so up to three of them).
        let trailing = full
            .chars()
            .rev()
            .take(3)
            .take_while(|c| *c == char::REPLACEMENT_CHARACTER)
            .count();
        let held_back = !all && trailing > 0 && tokens.len() - *prefix_offset <= MAX_WINDOW;
        let end = if held_back {
            full.len() - trailing * char::REPLACEMENT_CHARACTER.len_utf8()
        } else {
            full.len()
        }
        .max(agree);
        let delta = full[agree..end].to_string();
        if held_back {
            full[..end].clone_into(sent);
        } else {
            *prefix_offset = *read_offset;
            *read_offset = tokens.len();
            *sent = codec.decode(&tokens[*prefix_offset..*read_offset], skip)?;
        }
        Ok(delta)
    }
}

/// Releases the longest prefix of `pending` whose lossy UTF-8 reading no later byte can
/// change: valid characters, and U+FFFD for every sequence that can no longer become valid.
/// Keeps a trailing incomplete sequence unless `all`.
fn release_utf8(pending: &mut Vec<u8>, all: bool) -> String {
    let mut out = String::new();
    let mut at = 0;
    while at < pending.len() {
        match std::str::from_utf8(&pending[at..]) {
            Ok(s) => {
                out.push_str(s);
                at = pending.len();
            }
            Err(e) => {
                let valid = e.valid_up_to();
                out.push_str(std::str::from_utf8(&pending[at..at + valid]).unwrap_or_default());
                at += valid;
                match e.error_len() {
                    Some(bad) => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        at += bad;
                    }
                    None if all => {
                        out.push(char::REPLACEMENT_CHARACTER);
                        at = pending.len();
                    }
                    None => break,
                }
            }
        }
    }
    pending.drain(..at);
    out
}

/// Length of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or_else(|| a.len().min(b.len()), |((i, _), _)| i)
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
    /// Release the matched stop string with the text before it (vLLM's
    /// `include_stop_str_in_output`).
    include_stop: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            held: String::new(),
            done: false,
            include_stop: false,
        }
    }

    /// A matcher that releases the stop string itself too.
    pub fn including_stop(mut self, include: bool) -> Self {
        self.include_stop = include;
        self
    }

    /// Adds text without looking for stop strings (an output still shorter than
    /// `min_tokens`): what was held back and `text` are released as they are.
    pub fn push_unmatched(&mut self, text: &str) -> String {
        if self.done {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        out.push_str(text);
        out
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
            let end = if self.include_stop { at + s.len() } else { at };
            let text = self.held[..end].to_string();
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
#[path = "detok_tests.rs"]
mod tests;
