//! Splits a response's reasoning section off the front of its text.
//!
//! Formats (vLLM's names): `qwen3` reasons between `<think>` and `</think>` when the response
//! opens with `<think>` (or the prompt already opened it); a response without `<think>` is all
//! answer. `deepseek_r1` starts inside the reasoning with or without `<think>`, until
//! `</think>`. In both, a response that never closes the section was all reasoning (it was
//! already streamed as such). A response has at most one section, at its start; the markers
//! themselves are dropped, the text between them is kept byte for byte.

use chimera_policy_core::Parsed;

use crate::marker::{could_become, partial_start};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// The reasoning formats [`ReasoningSplitter::new`] knows, as requests name them.
pub const REASONING_FORMATS: &[&str] = &["qwen3", "deepseek_r1"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before the first non-space text: `<think>` opens the section, anything else is answer.
    MayOpen,
    /// Inside the section before its first text: a leading `<think>` is dropped.
    Opened,
    Inside,
    Answer,
}

#[derive(Debug)]
pub(crate) struct ReasoningSplitter {
    state: State,
    held: String,
}

impl ReasoningSplitter {
    /// `format` empty means no reasoning section. Errs naming the known formats.
    pub(crate) fn new(format: &str, open: bool) -> Result<Self, String> {
        let state = match format {
            "" => State::Answer,
            "qwen3" if open => State::Opened,
            "qwen3" => State::MayOpen,
            "deepseek_r1" => State::Opened,
            other => {
                return Err(format!(
                    "unknown reasoning format `{other}` (known: {})",
                    REASONING_FORMATS.join(", ")
                ));
            }
        };
        Ok(Self {
            state,
            held: String::new(),
        })
    }

    /// Reasoning in `text` goes to `out`; the answer text decided so far is returned.
    pub(crate) fn feed(&mut self, text: &str, out: &mut Parsed) -> String {
        self.held.push_str(text);
        self.run(out, false)
    }

    /// The response ended: what was held back comes out.
    pub(crate) fn finish(&mut self, out: &mut Parsed) -> String {
        self.run(out, true)
    }

    fn run(&mut self, out: &mut Parsed, finishing: bool) -> String {
        loop {
            match self.state {
                State::Answer => return std::mem::take(&mut self.held),
                State::MayOpen | State::Opened => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.held = rest.to_owned();
                        self.state = State::Inside;
                    } else if could_become(trimmed, OPEN) && !finishing {
                        return String::new();
                    } else if self.state == State::MayOpen {
                        self.state = State::Answer;
                    } else {
                        self.state = State::Inside;
                    }
                }
                State::Inside => {
                    if let Some(at) = self.held.find(CLOSE) {
                        out.reasoning(&self.held[..at]);
                        self.held.drain(..at + CLOSE.len());
                        self.state = State::Answer;
                    } else {
                        let keep = if finishing {
                            self.held.len()
                        } else {
                            partial_start(&self.held, &[CLOSE])
                        };
                        out.reasoning(&self.held[..keep]);
                        self.held.drain(..keep);
                        return String::new();
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_policy_core::columns::parsed_kind::{CONTENT, REASONING};

    fn split(format: &str, open: bool, chunks: &[&str]) -> (Parsed, String) {
        let mut s = ReasoningSplitter::new(format, open).unwrap();
        let mut out = Parsed::default();
        let mut answer = String::new();
        for c in chunks {
            answer += &s.feed(c, &mut out);
        }
        answer += &s.finish(&mut out);
        (out, answer)
    }

    fn reasoning_of(p: &Parsed) -> String {
        assert!(p.kinds.iter().all(|&k| k == REASONING && k != CONTENT));
        p.texts.concat()
    }

    #[test]
    fn qwen3_sections() {
        let (p, a) = split("qwen3", false, &["<th", "ink>\nhm</th", "ink>\n\nHi"]);
        assert_eq!((reasoning_of(&p).as_str(), a.as_str()), ("\nhm", "\n\nHi"));
        let (p, a) = split("qwen3", false, &["Hi <think>x</think>"]);
        assert_eq!(
            (reasoning_of(&p).as_str(), a.as_str()),
            ("", "Hi <think>x</think>")
        );
        let (p, a) = split("qwen3", true, &["x</think>y"]);
        assert_eq!((reasoning_of(&p).as_str(), a.as_str()), ("x", "y"));
        // Only a possible start is held: "<thi" at the end of a short answer comes out.
        let (p, a) = split("qwen3", false, &["<thi"]);
        assert_eq!((reasoning_of(&p).as_str(), a.as_str()), ("", "<thi"));
    }

    #[test]
    fn deepseek_r1_starts_inside_and_unclosed_is_reasoning() {
        let (p, a) = split("deepseek_r1", false, &["a", "b</", "think>c"]);
        assert_eq!((reasoning_of(&p).as_str(), a.as_str()), ("ab", "c"));
        let (p, a) = split("deepseek_r1", false, &["<think>ab </th"]);
        assert_eq!((reasoning_of(&p).as_str(), a.as_str()), ("ab </th", ""));
    }

    #[test]
    fn unknown_format_names_the_known_ones() {
        let err = ReasoningSplitter::new("r2", false).unwrap_err();
        assert!(
            err.contains("`r2`") && err.contains("qwen3, deepseek_r1"),
            "{err}"
        );
    }
}
