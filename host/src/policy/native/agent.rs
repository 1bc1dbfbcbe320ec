//! Native twins of the built-in constraint (`llguidance`) and parser (`tool-parsers`)
//! plugins: the same core crates the Wasm builds compile (`chimera-constraint-core`,
//! `chimera-parser-core`), chosen with `plugin = "native:llguidance"` /
//! `"native:tool-parsers"`. They run without the Wasm sandbox's deadline and memory limit, so
//! only llguidance's own fuel bounds a hostile grammar; the Wasm builds are the default.

use std::sync::Arc;

use chimera_constraint_core::{ConstraintError as CoreError, Constraints};
use chimera_parser_core::{Parsed, REASONING_FORMATS, ResponseParser, TOOL_FORMATS, call_grammar};
use chimera_policy_core::Config;

use crate::plugins::Vocabulary;
use crate::policy::{Constrainer, ConstraintError, OutputParser, ParseRequest};

pub fn check_constraint(name: &str, config: &Config) -> Result<(), String> {
    if name != "llguidance" {
        return Err(format!(
            "no native constraint `{name}` (there is `llguidance`)"
        ));
    }
    Constraints::new(config, &Vocabulary::sample().view()).map(drop)
}

pub fn check_parser(name: &str, config: &Config) -> Result<(), String> {
    if name != "tool-parsers" {
        return Err(format!(
            "no native parser `{name}` (there is `tool-parsers`)"
        ));
    }
    config.expect_keys(&["max_open"])
}

/// The native `llguidance` constraint over `vocabulary`; a config or vocabulary it refuses
/// (checked at start, so only a changed vocabulary gets here) gives a constraint that refuses
/// every grammar, saying why.
pub fn constrainer(config: &Config, vocabulary: &Arc<Vocabulary>) -> Box<dyn Constrainer> {
    match Constraints::new(config, &vocabulary.view()) {
        Ok(c) => Box::new(NativeConstrainer(c)),
        Err(why) => Box::new(Refusing(why)),
    }
}

pub fn parser(_config: &Config) -> Box<dyn OutputParser> {
    Box::new(NativeParser {
        parsers: Vec::new(),
        free: Vec::new(),
    })
}

struct NativeConstrainer(Constraints);

/// Whether an error is about the grammar (the client's) rather than the matcher's state.
fn grammar_error(e: CoreError) -> ConstraintError {
    match e {
        CoreError::UnknownMatcher(_) | CoreError::Internal(_) | CoreError::TooManyOpen(_) => {
            ConstraintError::Failed(e.to_string())
        }
        other => ConstraintError::Grammar(other.to_string()),
    }
}

impl Constrainer for NativeConstrainer {
    fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
        self.0.open(kind, grammar).map_err(grammar_error)
    }

    fn next(&mut self, matcher: u32, tokens: &[u32], mask: &mut [u32]) -> Result<(), String> {
        self.0
            .next_into(matcher, tokens, mask)
            .map_err(|e| e.to_string())
    }

    fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String> {
        self.0.rollback(matcher, count).map_err(|e| e.to_string())
    }

    fn close(&mut self, matcher: u32) {
        self.0.close(matcher);
    }
}

struct Refusing(String);

impl Constrainer for Refusing {
    fn open(&mut self, _kind: &str, _grammar: &str) -> Result<u32, ConstraintError> {
        Err(ConstraintError::Failed(format!(
            "the constraint could not start: {}",
            self.0
        )))
    }
    fn next(&mut self, _: u32, _: &[u32], _: &mut [u32]) -> Result<(), String> {
        Err(self.0.clone())
    }
    fn rollback(&mut self, _: u32, _: u32) -> Result<(), String> {
        Err(self.0.clone())
    }
    fn close(&mut self, _: u32) {}
}

struct NativeParser {
    parsers: Vec<Option<ResponseParser>>,
    free: Vec<u32>,
}

impl OutputParser for NativeParser {
    fn formats(&mut self) -> (Vec<String>, Vec<String>) {
        let names = |l: &[&str]| l.iter().map(|s| s.to_string()).collect();
        (names(TOOL_FORMATS), names(REASONING_FORMATS))
    }

    fn open(&mut self, r: &ParseRequest) -> Result<u32, String> {
        let p = ResponseParser::new(
            &r.tool_format,
            &r.reasoning_format,
            r.reasoning_open,
            &r.tools,
        )?;
        Ok(match self.free.pop() {
            Some(id) => {
                self.parsers[id as usize] = Some(p);
                id
            }
            None => {
                self.parsers.push(Some(p));
                (self.parsers.len() - 1) as u32
            }
        })
    }

    fn feed(&mut self, parser: u32, text: &str) -> Parsed {
        match self
            .parsers
            .get_mut(parser as usize)
            .and_then(Option::as_mut)
        {
            Some(p) => p.feed(text),
            None => {
                let mut out = Parsed::default();
                out.content(text);
                out
            }
        }
    }

    fn finish(&mut self, parser: u32) -> Parsed {
        let Some(mut p) = self.parsers.get_mut(parser as usize).and_then(Option::take) else {
            return Parsed::default();
        };
        self.free.push(parser);
        p.finish()
    }

    fn call_grammar(
        &mut self,
        format: &str,
        tools: &str,
        choice: &str,
        parallel: bool,
    ) -> Result<String, String> {
        call_grammar(format, tools, choice, parallel)
    }
}
