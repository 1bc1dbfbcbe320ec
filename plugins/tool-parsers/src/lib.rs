//! Built-in parser `tool-parsers`: reasoning and tool-call parsing of responses.
//!
//! Keeps one `chimera_parser_core::ResponseParser` per open response, by id; ids of finished
//! responses are reused. The parsing itself, shared with the host's native twin, lives in
//! `chimera_parser_core`; this crate only owns the table of open parsers.
//!
//! Config keys: `max_open` (integer, default 4096, 1..=1048576): how many responses may be
//! parsed at once; `open` errs beyond it.

use chimera_parser_core::{REASONING_FORMATS, ResponseParser, TOOL_FORMATS, call_grammar};
use chimera_plugin_sdk::{Config, ParseRequestView, Parsed, ParserPlugin};

const DEFAULT_MAX_OPEN: u32 = 4096;
const MAX_MAX_OPEN: u32 = 1 << 20;

pub struct ToolParsers {
    /// Slot `id` holds the parser of open response `id`.
    slots: Vec<Option<ResponseParser>>,
    /// Ids of empty slots, reused before the table grows.
    free: Vec<u32>,
    max_open: u32,
}

impl ToolParsers {
    fn open_count(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    fn slot(&mut self, parser: u32) -> Option<&mut ResponseParser> {
        self.slots.get_mut(parser as usize).and_then(Option::as_mut)
    }
}

/// What a call on an id that is not open returns: the text, and a failure saying so.
fn not_open(parser: u32, text: &str) -> Parsed {
    let mut out = Parsed::default();
    out.content(text);
    out.failure(&format!("parser {parser} is not open"));
    out
}

impl ParserPlugin for ToolParsers {
    fn init(config: &Config) -> Result<Self, String> {
        config.expect_keys(&["max_open"])?;
        let max_open = config.u32_in("max_open", DEFAULT_MAX_OPEN, 1, MAX_MAX_OPEN)?;
        Ok(Self {
            slots: Vec::new(),
            free: Vec::new(),
            max_open,
        })
    }

    fn formats(&self) -> (Vec<String>, Vec<String>) {
        let names = |list: &[&str]| list.iter().map(|s| s.to_string()).collect();
        (names(TOOL_FORMATS), names(REASONING_FORMATS))
    }

    fn open(&mut self, request: &ParseRequestView<'_>) -> Result<u32, String> {
        if self.open_count() >= self.max_open as usize {
            return Err(format!(
                "{} responses are being parsed already (max_open = {})",
                self.open_count(),
                self.max_open
            ));
        }
        let parser = ResponseParser::new(
            request.tool_format,
            request.reasoning_format,
            request.reasoning_open,
            request.tools,
        )?;
        if let Some(id) = self.free.pop()
            && let Some(slot) = self.slots.get_mut(id as usize)
        {
            *slot = Some(parser);
            return Ok(id);
        }
        let id = u32::try_from(self.slots.len()).map_err(|_| "parser ids exhausted")?;
        self.slots.push(Some(parser));
        Ok(id)
    }

    fn feed(&mut self, parser: u32, text: &str) -> Parsed {
        match self.slot(parser) {
            Some(p) => p.feed(text),
            None => not_open(parser, text),
        }
    }

    fn finish(&mut self, parser: u32) -> Parsed {
        let taken = self.slots.get_mut(parser as usize).and_then(Option::take);
        match taken {
            Some(mut p) => {
                self.free.push(parser);
                p.finish()
            }
            None => not_open(parser, ""),
        }
    }

    fn call_grammar(
        &self,
        format: &str,
        tools: &str,
        choice: &str,
        parallel: bool,
    ) -> Result<String, String> {
        call_grammar(format, tools, choice, parallel)
    }
}

chimera_plugin_sdk::export_parser!(ToolParsers);

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::{ConfigValue, parsed_kind};

    fn request<'a>(tool_format: &'a str, reasoning_format: &'a str) -> ParseRequestView<'a> {
        ParseRequestView {
            tool_format,
            reasoning_format,
            reasoning_open: false,
            tools: "",
        }
    }

    fn with_max_open(n: i64) -> ToolParsers {
        let config = Config::new(vec![("max_open".into(), ConfigValue::Integer(n))]);
        ToolParsers::init(&config).unwrap()
    }

    #[test]
    fn parses_a_response_by_id() {
        let mut p = ToolParsers::init(&Config::default()).unwrap();
        let id = p.open(&request("hermes", "qwen3")).unwrap();
        let mut out = p.feed(id, "<think>hm</think>\n\n<tool_call>\n{\"name\": \"f\", ");
        out.extend(p.feed(id, "\"arguments\": {\"x\": 1}}\n</tool_call>"));
        out.extend(p.finish(id));
        assert_eq!(
            out.kinds,
            [
                parsed_kind::REASONING,
                parsed_kind::CALL_BEGIN,
                parsed_kind::CALL_ARGUMENTS
            ]
        );
        assert_eq!(out.texts, ["hm", "f", "{\"x\":1}"]);
    }

    #[test]
    fn reuses_finished_ids_and_caps_open_parsers() {
        let mut p = with_max_open(2);
        let a = p.open(&request("", "")).unwrap();
        let b = p.open(&request("", "")).unwrap();
        assert_eq!((a, b), (0, 1));
        let err = p.open(&request("", "")).unwrap_err();
        assert!(err.contains("max_open = 2"), "{err}");
        p.finish(a);
        assert_eq!(p.open(&request("", "")), Ok(0));
    }

    #[test]
    fn unknown_ids_and_formats_are_reported() {
        let mut p = with_max_open(4);
        let out = p.feed(7, "text");
        assert_eq!(out.kinds, [parsed_kind::CONTENT, parsed_kind::FAILURE]);
        assert_eq!(out.texts[0], "text");
        let err = p.open(&request("pythonic", "")).unwrap_err();
        assert!(
            err.contains("hermes, qwen3_coder, llama3_json, granite"),
            "{err}"
        );
        // A failed open takes no slot.
        assert_eq!(p.open(&request("", "")), Ok(0));
        assert!(
            ToolParsers::init(&Config::new(vec![(
                "other".into(),
                ConfigValue::Integer(1)
            )]))
            .is_err()
        );
        assert!(
            ToolParsers::init(&Config::new(vec![(
                "max_open".into(),
                ConfigValue::Integer(0)
            )]))
            .is_err()
        );
    }

    #[test]
    fn lists_formats_and_delegates_grammars() {
        let p = with_max_open(4);
        let (tool, reasoning) = p.formats();
        assert_eq!(tool, ["hermes", "qwen3_coder", "llama3_json", "granite"]);
        assert_eq!(reasoning, ["qwen3", "deepseek_r1"]);
        let tools = r#"[{"type": "function", "function": {"name": "f"}}]"#;
        assert_eq!(
            p.call_grammar("hermes", tools, "f", false),
            call_grammar("hermes", tools, "f", false)
        );
    }
}
