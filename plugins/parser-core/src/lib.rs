//! Parsers of model output: a response's streamed text becomes content, reasoning and tool
//! calls ([`ResponseParser`]), and grammars force a response to be tool calls
//! ([`call_grammar`]).
//!
//! Compiled into the `tool-parsers` Wasm plugin and into the host as its native twin, so it
//! does no I/O, reads no clock, keeps no global state and never panics on any input. Text may
//! arrive split at any char boundary; a parser holds back only what could still be the start
//! of a marker (and whitespace before it) and emits everything else at once, so the pieces
//! of a response merged in order are the same however it was split.
//!
//! Formats use vLLM's names: tool formats [`TOOL_FORMATS`], reasoning formats
//! [`REASONING_FORMATS`]. A call comes out when it closes, as a `call_begin` (index from 0 in
//! the response, and name) and its arguments as compact JSON. A malformed call is never lost:
//! its text comes back as content, followed by a failure piece saying why.

mod calls;
mod coder_xml;
mod grammar;
mod json_scan;
mod llama;
mod marker;
mod reasoning;
mod tagged;
mod tools;

pub use chimera_policy_core::Parsed;
pub use grammar::call_grammar;
pub use reasoning::REASONING_FORMATS;

use llama::LlamaParser;
use reasoning::ReasoningSplitter;
use tagged::TaggedParser;
use tools::Tools;

/// The tool-call formats [`ResponseParser::new`] and [`call_grammar`] know.
pub const TOOL_FORMATS: &[&str] = &["hermes", "qwen3_coder", "llama3_json", "granite"];

/// The tool-call side of a response.
#[derive(Debug)]
enum ToolParser {
    /// No tool format: the answer is content.
    None,
    Tagged(TaggedParser),
    Llama(LlamaParser),
}

/// Parses one response as it streams.
#[derive(Debug)]
pub struct ResponseParser {
    reasoning: ReasoningSplitter,
    tools: ToolParser,
}

impl ResponseParser {
    /// `tool_format`, `reasoning_format`: names from [`TOOL_FORMATS`] and
    /// [`REASONING_FORMATS`], empty for none. `reasoning_open`: the prompt already opened the
    /// reasoning section. `tools_json`: the request's `tools`, empty for none (the XML format
    /// reads parameter types from it). Errs on an unknown format (naming the known ones) or
    /// tools that are not a JSON list of functions.
    pub fn new(
        tool_format: &str,
        reasoning_format: &str,
        reasoning_open: bool,
        tools_json: &str,
    ) -> Result<Self, String> {
        let reasoning = ReasoningSplitter::new(reasoning_format, reasoning_open)?;
        let tools = match tool_format {
            "" => ToolParser::None,
            "hermes" => ToolParser::Tagged(TaggedParser::new(tagged::HERMES, Tools::default())),
            "granite" => ToolParser::Tagged(TaggedParser::new(tagged::GRANITE, Tools::default())),
            "qwen3_coder" => ToolParser::Tagged(TaggedParser::new(
                tagged::QWEN3_CODER,
                Tools::parse(tools_json)?,
            )),
            "llama3_json" => ToolParser::Llama(LlamaParser::new()),
            other => {
                return Err(format!(
                    "unknown tool format `{other}` (known: {})",
                    TOOL_FORMATS.join(", ")
                ));
            }
        };
        Ok(Self { reasoning, tools })
    }

    /// The next piece of the response's text.
    pub fn feed(&mut self, text: &str) -> Parsed {
        let mut out = Parsed::default();
        let answer = self.reasoning.feed(text, &mut out);
        self.answer(&answer, &mut out);
        out
    }

    /// The response ended: everything held back comes out. The parser is spent afterwards.
    pub fn finish(&mut self) -> Parsed {
        let mut out = Parsed::default();
        let answer = self.reasoning.finish(&mut out);
        self.answer(&answer, &mut out);
        match &mut self.tools {
            ToolParser::None => {}
            ToolParser::Tagged(p) => p.finish(&mut out),
            ToolParser::Llama(p) => p.finish(&mut out),
        }
        out
    }

    fn answer(&mut self, text: &str, out: &mut Parsed) {
        match &mut self.tools {
            ToolParser::None => out.content(text),
            ToolParser::Tagged(p) => p.feed(text, out),
            ToolParser::Llama(p) => p.feed(text, out),
        }
    }
}
