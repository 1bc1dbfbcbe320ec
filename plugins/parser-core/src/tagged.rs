//! Tool calls wrapped in markers inside free text: `hermes`, `granite` and `qwen3_coder`.
//!
//! Text outside calls is content and streams at once, except a possible start of an opening
//! marker and the whitespace just before it. A call region runs from an opening marker to:
//! its closing marker after a complete JSON value (a closing marker inside a JSON string is
//! data); the end of a JSON list where no closer is needed; or, for the XML body, the first
//! closing marker. Whitespace touching a parsed call is a separator and is dropped. A region
//! that does not parse, or is still open at the end, comes back as content (with the
//! whitespace before it) followed by a failure piece.

use chimera_policy_core::Parsed;

use crate::calls::{CallCounter, calls_from_json};
use crate::coder_xml::parse_functions;
use crate::json_scan::{JsonScan, Scan};
use crate::marker::{could_become, find_first, partial_start};
use crate::tools::Tools;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Body {
    /// A call object or a list of them.
    Json,
    /// `qwen3_coder`'s `<function=...>` blocks.
    Xml,
}

/// A marker that opens a call region, and how the region reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Opener {
    pub(crate) marker: &'static str,
    /// Ends the region; `None`: the region ends with its JSON value. A JSON list needs no
    /// closer even where one is given (Granite 3.1 wrote `<tool_call>[...]`).
    pub(crate) closer: Option<&'static str>,
    pub(crate) body: Body,
}

const TOOL_CALL: &str = "<tool_call>";
const TOOL_CALL_END: &str = "</tool_call>";

/// Qwen2.5/Qwen3/SmolLM3: `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`.
pub(crate) const HERMES: &[Opener] = &[Opener {
    marker: TOOL_CALL,
    closer: Some(TOOL_CALL_END),
    body: Body::Json,
}];

/// Granite 4 writes hermes blocks; Granite 3 wrote `<|tool_call|>[{...}, ...]` to the end.
pub(crate) const GRANITE: &[Opener] = &[
    Opener {
        marker: TOOL_CALL,
        closer: Some(TOOL_CALL_END),
        body: Body::Json,
    },
    Opener {
        marker: "<|tool_call|>",
        closer: None,
        body: Body::Json,
    },
];

/// Qwen3-Coder / Qwen3.5: `<tool_call>\n<function=NAME>...</function>\n</tool_call>`.
pub(crate) const QWEN3_CODER: &[Opener] = &[Opener {
    marker: TOOL_CALL,
    closer: Some(TOOL_CALL_END),
    body: Body::Xml,
}];

#[derive(Debug)]
enum State {
    /// Free text; `after_call`: leading whitespace is a separator to drop.
    Text { after_call: bool },
    /// Inside a call region opened by `openers[opener]`; `lead` is the whitespace before the
    /// marker and the marker (given back as content if the region fails).
    Region {
        opener: usize,
        lead: String,
        scan: JsonScan,
    },
}

/// Where a region ended, decided from its body text.
enum RegionEnd {
    Wait,
    /// The calls are `parse(body[..parse_end])`; the region is `body[..raw_end]`.
    Parse {
        parse_from: usize,
        parse_end: usize,
        raw_end: usize,
    },
    /// The region `body[..raw_end]` is malformed.
    Fail {
        raw_end: usize,
        why: &'static str,
    },
}

#[derive(Debug)]
pub(crate) struct TaggedParser {
    openers: &'static [Opener],
    markers: Vec<&'static str>,
    tools: Tools,
    state: State,
    /// Text not yet decided: pending free text, or the region's body after its marker.
    buf: String,
    calls: CallCounter,
}

impl TaggedParser {
    pub(crate) fn new(openers: &'static [Opener], tools: Tools) -> Self {
        Self {
            openers,
            markers: openers.iter().map(|o| o.marker).collect(),
            tools,
            state: State::Text { after_call: false },
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
            let progressed = match self.state {
                State::Text { after_call } => self.text(after_call, out, finishing),
                State::Region { .. } => self.region(out, finishing),
            };
            if !progressed {
                return;
            }
        }
    }

    /// Free text: content up to an opening marker. Returns whether a region opened.
    fn text(&mut self, after_call: bool, out: &mut Parsed, finishing: bool) -> bool {
        if after_call {
            let spaces = self.buf.len() - self.buf.trim_start().len();
            self.buf.drain(..spaces);
            if self.buf.is_empty() {
                return false;
            }
        }
        if let Some((at, opener)) = find_first(&self.buf, &self.markers) {
            let content = self.buf[..at].trim_end();
            out.content(content);
            let marker_end = at + self.openers[opener].marker.len();
            let lead = self.buf[content.len()..marker_end].to_owned();
            self.buf.drain(..marker_end);
            self.state = State::Region {
                opener,
                lead,
                scan: JsonScan::default(),
            };
            return true;
        }
        let keep = if finishing {
            self.buf.len()
        } else {
            let hold = partial_start(&self.buf, &self.markers);
            self.buf[..hold].trim_end().len()
        };
        out.content(&self.buf[..keep]);
        self.buf.drain(..keep);
        // Text other than whitespace came after the call (and is out or held).
        self.state = State::Text { after_call: false };
        false
    }

    /// Inside a region: waits for its end, then emits its calls or gives it back.
    fn region(&mut self, out: &mut Parsed, finishing: bool) -> bool {
        let State::Region {
            opener, scan, lead, ..
        } = &mut self.state
        else {
            return false;
        };
        let spec = self.openers[*opener];
        let end = match spec.body {
            Body::Xml => xml_end(&self.buf, spec),
            Body::Json => json_end(&self.buf, spec, scan, finishing),
        };
        if matches!(end, RegionEnd::Wait) && !finishing {
            return false;
        }
        let lead = std::mem::take(lead);
        match end {
            RegionEnd::Wait => {
                let raw_end = self.buf.len();
                self.fail(
                    &lead,
                    raw_end,
                    "call not closed at the end of the response",
                    out,
                );
            }
            RegionEnd::Fail { raw_end, why } => self.fail(&lead, raw_end, why, out),
            RegionEnd::Parse {
                parse_from,
                parse_end,
                raw_end,
            } => {
                let body = &self.buf[parse_from..parse_end];
                let parsed = match spec.body {
                    Body::Json => calls_from_json(body),
                    Body::Xml => parse_functions(body, &self.tools),
                };
                match parsed {
                    Ok(calls) => {
                        self.calls.emit(&calls, out);
                        self.buf.drain(..raw_end);
                        self.state = State::Text { after_call: true };
                    }
                    Err(why) => self.fail(&lead, raw_end, &why, out),
                }
            }
        }
        true
    }

    /// Gives `lead` and `buf[..raw_end]` back as content, with a failure saying `why`.
    fn fail(&mut self, lead: &str, raw_end: usize, why: &str, out: &mut Parsed) {
        out.content(lead);
        out.content(&self.buf[..raw_end]);
        out.failure(why);
        self.buf.drain(..raw_end);
        self.state = State::Text { after_call: false };
    }
}

fn xml_end(body: &str, spec: Opener) -> RegionEnd {
    let Some(closer) = spec.closer else {
        return RegionEnd::Wait;
    };
    match body.find(closer) {
        Some(at) => RegionEnd::Parse {
            parse_from: 0,
            parse_end: at,
            raw_end: at + closer.len(),
        },
        None => RegionEnd::Wait,
    }
}

fn json_end(body: &str, spec: Opener, scan: &mut JsonScan, finishing: bool) -> RegionEnd {
    let closer_after = |from: usize, why| match spec
        .closer
        .and_then(|c| body[from..].find(c).map(|at| from + at + c.len()))
    {
        Some(raw_end) => RegionEnd::Fail { raw_end, why },
        None => RegionEnd::Wait,
    };
    match scan.advance(body, spec.closer) {
        Scan::NeedMore => RegionEnd::Wait,
        Scan::NotJson(at) => match spec.closer {
            Some(_) => closer_after(at, "call body is not a JSON object or list"),
            // Without a closer only the marker belongs to the call; the rest is text.
            None => RegionEnd::Fail {
                raw_end: 0,
                why: "call marker not followed by a JSON list",
            },
        },
        Scan::Closer(at) => RegionEnd::Fail {
            raw_end: at + spec.closer.map_or(0, str::len),
            why: "call closed before its JSON ended",
        },
        Scan::Complete { start, end } => {
            let is_list = body.as_bytes()[start] == b'[';
            let parse = |raw_end| RegionEnd::Parse {
                parse_from: start,
                parse_end: end,
                raw_end,
            };
            let Some(closer) = spec.closer else {
                return parse(end);
            };
            let rest = &body[end..];
            let after = rest.trim_start();
            let spaces = rest.len() - after.len();
            if after.starts_with(closer) {
                parse(end + spaces + closer.len())
            } else if could_become(after, closer) && !finishing {
                RegionEnd::Wait
            } else if is_list {
                parse(end)
            } else {
                closer_after(end, "text between the call's JSON and its closing marker")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_policy_core::columns::parsed_kind::{CALL_ARGUMENTS, CALL_BEGIN, CONTENT, FAILURE};

    fn run(openers: &'static [Opener], chunks: &[&str]) -> Vec<(u8, u32, String)> {
        let mut p = TaggedParser::new(openers, Tools::default());
        let mut out = Parsed::default();
        for c in chunks {
            p.feed(c, &mut out);
        }
        p.finish(&mut out);
        out.kinds
            .into_iter()
            .zip(out.calls)
            .zip(out.texts)
            .map(|((k, c), t)| (k, c, t))
            .collect()
    }

    fn piece(kind: u8, call: u32, text: &str) -> (u8, u32, String) {
        (kind, call, text.to_owned())
    }

    #[test]
    fn content_streams_except_a_possible_marker() {
        let mut p = TaggedParser::new(HERMES, Tools::default());
        let mut out = Parsed::default();
        p.feed("Hello <tool", &mut out);
        assert_eq!(out.texts, ["Hello"]);
        p.feed("box> ok", &mut out);
        assert_eq!(out.texts, ["Hello <toolbox> ok"]);
    }

    #[test]
    fn closer_inside_a_string_is_data() {
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"s\": \"</tool_call>\"}}\n</tool_call>";
        assert_eq!(
            run(HERMES, &[text]),
            [
                piece(CALL_BEGIN, 0, "f"),
                piece(CALL_ARGUMENTS, 0, r#"{"s":"</tool_call>"}"#)
            ]
        );
    }

    #[test]
    fn granite3_list_without_closer_then_text() {
        let text = "<|tool_call|>[{\"name\": \"a\", \"arguments\": {}}, {\"name\": \"b\"}] done";
        assert_eq!(
            run(GRANITE, &[text]),
            [
                piece(CALL_BEGIN, 0, "a"),
                piece(CALL_ARGUMENTS, 0, "{}"),
                piece(CALL_BEGIN, 1, "b"),
                piece(CALL_ARGUMENTS, 1, "{}"),
                piece(CONTENT, 0, "done"),
            ]
        );
    }

    #[test]
    fn extra_brace_fails_at_the_closer() {
        let text = "x\n<tool_call>\n{\"name\": \"f\"}}\n</tool_call>\ny";
        assert_eq!(
            run(HERMES, &[text]),
            [
                piece(
                    CONTENT,
                    0,
                    "x\n<tool_call>\n{\"name\": \"f\"}}\n</tool_call>"
                ),
                piece(
                    FAILURE,
                    0,
                    "text between the call's JSON and its closing marker"
                ),
                piece(CONTENT, 0, "\ny"),
            ]
        );
    }
}
