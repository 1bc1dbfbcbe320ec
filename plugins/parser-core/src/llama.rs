//! `llama3_json`: a response that is one or more JSON calls, or else plain content.
//!
//! Llama 3.1/3.2 write `{"name": ..., "parameters": {...}}` (optionally after
//! `<|python_tag|>`), several separated by `;`. Only a response that starts (after whitespace)
//! with `{` or `<|python_tag|>` is read as calls; any other response is content as it streams.
//! After the calls, text that is not another `;`-separated call is content. A value that is not
//! a call comes back as content (with what preceded it since the last call) and a failure.

use chimera_policy_core::Parsed;

use crate::calls::{CallCounter, call_from_json};
use crate::json_scan::{JsonScan, Scan};
use crate::marker::could_become;

const PYTHON_TAG: &str = "<|python_tag|>";

#[derive(Debug)]
enum State {
    /// Nothing but whitespace or a part of `<|python_tag|>` yet.
    Start,
    /// Reading a call value; `lead` is the text consumed before it since the last call.
    Value {
        lead: String,
        scan: JsonScan,
    },
    /// After a call: `;` and another call, or the end.
    AfterCall,
    Content,
}

#[derive(Debug)]
pub(crate) struct LlamaParser {
    state: State,
    buf: String,
    calls: CallCounter,
}

impl LlamaParser {
    pub(crate) fn new() -> Self {
        Self {
            state: State::Start,
            buf: String::new(),
            calls: CallCounter::default(),
        }
    }

    pub(crate) fn feed(&mut self, text: &str, out: &mut Parsed) {
        self.buf.push_str(text);
        self.run(out, false);
    }

    pub(crate) fn finish(&mut self, out: &mut Parsed) {
        self.run(out, true);
    }

    fn run(&mut self, out: &mut Parsed, finishing: bool) {
        loop {
            let next = match &mut self.state {
                State::Start => self.start(finishing),
                State::Value { lead, scan } => match scan.advance(&self.buf, None) {
                    Scan::NeedMore if !finishing => None,
                    scanned => {
                        let lead = std::mem::take(lead);
                        self.value(scanned, lead, out)
                    }
                },
                State::AfterCall => self.after_call(finishing),
                State::Content => {
                    out.content(&self.buf);
                    self.buf.clear();
                    None
                }
            };
            match next {
                Some(state) => self.state = state,
                None => return,
            }
        }
    }

    fn start(&mut self, finishing: bool) -> Option<State> {
        let trimmed = self.buf.trim_start();
        let spaces = self.buf.len() - trimmed.len();
        if trimmed.starts_with(PYTHON_TAG) {
            let lead = self.buf.drain(..spaces + PYTHON_TAG.len()).collect();
            Some(value_state(lead))
        } else if trimmed.starts_with('{') {
            let lead = self.buf.drain(..spaces).collect();
            Some(value_state(lead))
        } else if could_become(trimmed, PYTHON_TAG) && !finishing {
            None
        } else {
            Some(State::Content)
        }
    }

    /// The call value ended (or the response did): emit it or give it back.
    fn value(&mut self, scanned: Scan, lead: String, out: &mut Parsed) -> Option<State> {
        match scanned {
            Scan::NeedMore | Scan::Closer(_) => {
                out.content(&lead);
                out.content(&self.buf);
                out.failure("call not complete at the end of the response");
                self.buf.clear();
                Some(State::Content)
            }
            Scan::NotJson(_) => {
                out.content(&lead);
                out.failure("call marker not followed by a JSON object");
                Some(State::Content)
            }
            Scan::Complete { start, end } => {
                match call_from_json(&self.buf[start..end]) {
                    Ok(call) => self.calls.emit(&[call], out),
                    Err(why) => {
                        out.content(&lead);
                        out.content(&self.buf[..end]);
                        out.failure(&why);
                        self.buf.drain(..end);
                        return Some(State::Content);
                    }
                }
                self.buf.drain(..end);
                Some(State::AfterCall)
            }
        }
    }

    fn after_call(&mut self, finishing: bool) -> Option<State> {
        let trimmed = self.buf.trim_start();
        let spaces = self.buf.len() - trimmed.len();
        if trimmed.starts_with(';') {
            let lead = self.buf.drain(..spaces + 1).collect();
            return Some(value_state(lead));
        }
        if trimmed.is_empty() {
            if finishing {
                self.buf.clear();
            }
            return None;
        }
        self.buf.drain(..spaces);
        Some(State::Content)
    }
}

fn value_state(lead: String) -> State {
    State::Value {
        lead,
        scan: JsonScan::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(chunks: &[&str]) -> Vec<(u8, String)> {
        let mut p = LlamaParser::new();
        let mut out = Parsed::default();
        for c in chunks {
            p.feed(c, &mut out);
        }
        p.finish(&mut out);
        out.kinds.into_iter().zip(out.texts).collect()
    }

    #[test]
    fn content_unless_the_response_opens_with_a_call() {
        assert_eq!(
            texts(&["Sure: {\"name\": \"f\"}"]),
            [(0, "Sure: {\"name\": \"f\"}".into())]
        );
        assert_eq!(texts(&[" <|pyt", "hon"]), [(0, " <|python".into())]);
    }

    #[test]
    fn python_tag_then_calls_separated_by_semicolons() {
        let t = "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}";
        assert_eq!(
            texts(&[t]),
            [
                (2, "a".into()),
                (3, "{\"x\":1}".into()),
                (2, "b".into()),
                (3, "{}".into())
            ]
        );
    }
}
