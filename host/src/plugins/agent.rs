//! Adapters of the two agent-request kinds (ABI 0.2.0): [`WasmConstrainer`] and [`WasmParser`].
//!
//! Unlike the policies, these keep per-response state inside the plugin (a matcher, a parser),
//! so a lost instance (trap, timeout, memory, reload) loses it. The adapters keep what is
//! needed to carry on: a constraint adapter remembers each matcher's grammar and the tokens it
//! consumed and replays them into the next instance, so one response's failure ends only that
//! response; a parser adapter passes the rest of a response whose parser was lost through as
//! content, with a counted failure, so no text is ever dropped. Must not panic on any plugin
//! behaviour.

use std::sync::Arc;

use chimera_policy_core::Parsed;
use chimera_policy_core::columns::parsed_kind;

use super::abi::{WitParseRequest, WitParsed};
use super::adapters::{Guard, timed};
use super::instance::CallError;
use super::metrics::{FallbackReason, PluginCounters};
use super::slot::PluginHandle;
use crate::policy::{Constrainer, ConstraintError, OutputParser, ParseRequest};
use crate::slab::Slab;

/// Counts instances: a matcher or parser id of the plugin is valid only in the instance that
/// gave it.
#[derive(Default)]
struct Generation(u64);

impl Generation {
    /// Notes whether the instance about to be called was just created.
    fn saw(&mut self, fresh: bool) -> u64 {
        if fresh {
            self.0 += 1;
        }
        self.0
    }
}

// ---------------------------------------------------------------------------------------------
// Constraint
// ---------------------------------------------------------------------------------------------

struct Matcher {
    kind: String,
    grammar: String,
    /// Every token consumed so far, to replay into a new instance.
    consumed: Vec<u32>,
    /// The plugin's id for it, and the instance generation that gave it.
    plugin: Option<(u64, u32)>,
}

/// A constraint plugin as a [`Constrainer`] (one per engine).
pub struct WasmConstrainer {
    guard: Guard,
    generation: Generation,
    matchers: Slab<Matcher>,
    words: usize,
}

impl WasmConstrainer {
    /// `words`: mask words per position (`ceil(vocab / 32)`).
    pub fn new(handle: Arc<PluginHandle>, counters: Arc<PluginCounters>, words: usize) -> Self {
        Self {
            guard: Guard::new(handle, counters),
            generation: Generation::default(),
            matchers: Slab::new(),
            words,
        }
    }

    /// The plugin's id for matcher `id` in the current instance, opening it there and
    /// replaying its tokens when the instance is new.
    fn live(&mut self, id: u32) -> Result<u32, String> {
        let counters = self.guard.counters.clone();
        let ready = self.guard.slot.ready().map_err(|e| e.to_string())?;
        let generation = self.generation.saw(ready.fresh);
        let Some(m) = self.matchers.get_mut(id) else {
            return Err(format!("no matcher {id}"));
        };
        if let Some((g, pid)) = m.plugin
            && g == generation
        {
            return Ok(pid);
        }
        let opened = timed(&counters, || ready.instance.open(&m.kind, &m.grammar));
        let pid = match opened {
            Ok(Ok(pid)) => pid,
            Ok(Err(message)) => return Err(format!("reopening the grammar failed: {message}")),
            Err(e) => {
                self.guard.failed(&e);
                return Err(e.to_string());
            }
        };
        m.plugin = Some((generation, pid));
        if !m.consumed.is_empty() {
            let replay = timed(&counters, || ready.instance.next(pid, &m.consumed));
            match replay {
                Ok(Ok(_)) => {}
                Ok(Err(message)) => {
                    return Err(format!("replaying the response failed: {message}"));
                }
                Err(e) => {
                    self.guard.failed(&e);
                    return Err(e.to_string());
                }
            }
        }
        Ok(pid)
    }
}

impl Constrainer for WasmConstrainer {
    fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, ConstraintError> {
        self.guard.counters.record_call();
        let counters = self.guard.counters.clone();
        let ready = self
            .guard
            .slot
            .ready()
            .map_err(|e| ConstraintError::Failed(format!("the constraint plugin: {e}")))?;
        let generation = self.generation.saw(ready.fresh);
        match timed(&counters, || ready.instance.open(kind, grammar)) {
            Ok(Ok(pid)) => {
                self.guard.ok();
                Ok(self.matchers.insert(Matcher {
                    kind: kind.to_string(),
                    grammar: grammar.to_string(),
                    consumed: Vec::new(),
                    plugin: Some((generation, pid)),
                }))
            }
            Ok(Err(message)) => {
                self.guard.ok();
                Err(ConstraintError::Grammar(message))
            }
            Err(e) => {
                // The grammar made the plugin fail: that is this grammar's answer. The instance
                // may be poisoned, but the failure is the client's: it must not count towards
                // quarantining the plugin for everyone.
                self.guard.counters.record_fallback(e.reason, &e.detail);
                self.guard.slot.poison();
                let why = match e.reason {
                    FallbackReason::Timeout => "compiling it ran past the plugin deadline".into(),
                    FallbackReason::Memory => {
                        "compiling it needed more than the plugin memory limit".into()
                    }
                    _ => format!("the constraint plugin failed on it ({})", e.reason),
                };
                Err(ConstraintError::Grammar(format!(
                    "the grammar was refused: {why}"
                )))
            }
        }
    }

    fn next(&mut self, matcher: u32, tokens: &[u32], mask: &mut [u32]) -> Result<(), String> {
        self.guard.counters.record_call();
        let pid = self.live(matcher)?;
        let counters = self.guard.counters.clone();
        let ready = self.guard.slot.ready().map_err(|e| e.to_string())?;
        let answer = timed(&counters, || ready.instance.next(pid, tokens));
        let words = match answer {
            Ok(Ok(words)) => words,
            Ok(Err(message)) => {
                self.guard.ok();
                return Err(message);
            }
            Err(e) => {
                self.guard.failed(&e);
                return Err(format!("the constraint plugin failed: {e}"));
            }
        };
        if words.len() != self.words || mask.len() != self.words {
            let why = format!(
                "a mask of {} words for a vocabulary of {}",
                words.len(),
                self.words
            );
            self.guard.rejected(FallbackReason::Invalid, &why);
            return Err(format!("the constraint plugin answered {why}"));
        }
        if words.iter().all(|&w| w == 0) {
            self.guard
                .rejected(FallbackReason::Invalid, &"a mask that allows no token");
            return Err("the constraint allows no token at this position".into());
        }
        self.guard.ok();
        mask.copy_from_slice(&words);
        if let Some(m) = self.matchers.get_mut(matcher) {
            m.consumed.extend_from_slice(tokens);
        }
        Ok(())
    }

    fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String> {
        let pid = self.live(matcher)?;
        let counters = self.guard.counters.clone();
        let ready = self.guard.slot.ready().map_err(|e| e.to_string())?;
        match timed(&counters, || ready.instance.rollback(pid, count)) {
            Ok(Ok(())) => {
                self.guard.ok();
                if let Some(m) = self.matchers.get_mut(matcher) {
                    let keep = m.consumed.len().saturating_sub(count as usize);
                    m.consumed.truncate(keep);
                }
                Ok(())
            }
            Ok(Err(message)) => Err(message),
            Err(e) => {
                self.guard.failed(&e);
                Err(e.to_string())
            }
        }
    }

    fn close(&mut self, matcher: u32) {
        let Some(m) = self.matchers.remove(matcher) else {
            return;
        };
        let Some((g, pid)) = m.plugin else { return };
        if let Ok(ready) = self.guard.slot.ready() {
            // A new instance never knew the matcher.
            if self.generation.saw(ready.fresh) == g
                && let Err(e) = ready.instance.close(pid)
            {
                self.guard.failed(&e);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parser
// ---------------------------------------------------------------------------------------------

struct ParserState {
    /// The plugin's id and its instance generation; `None` once the parser was lost: the rest
    /// of the response passes through as content.
    plugin: Option<(u64, u32)>,
}

/// A parser plugin as an [`OutputParser`] (one per output pass).
pub struct WasmParser {
    guard: Guard,
    generation: Generation,
    parsers: Slab<ParserState>,
}

impl WasmParser {
    pub fn new(handle: Arc<PluginHandle>, counters: Arc<PluginCounters>) -> Self {
        Self {
            guard: Guard::new(handle, counters),
            generation: Generation::default(),
            parsers: Slab::new(),
        }
    }

    /// Calls `f` on the instance for parser `id`, or says why it cannot (lost parser, failed
    /// call), in which case the caller passes the text through.
    fn call(
        &mut self,
        id: u32,
        f: impl FnOnce(&mut super::instance::Instance, u32) -> Result<WitParsed, CallError>,
    ) -> Result<Parsed, String> {
        self.guard.counters.record_call();
        let Some(state) = self.parsers.get_mut(id) else {
            return Err(format!("no parser {id}"));
        };
        let Some((g, pid)) = state.plugin else {
            return Err(String::new());
        };
        let counters = self.guard.counters.clone();
        let ready = match self.guard.slot.ready() {
            Ok(r) => r,
            Err(e) => {
                state.plugin = None;
                return Err(e.to_string());
            }
        };
        if self.generation.saw(ready.fresh) != g {
            state.plugin = None;
            return Err(
                "the parser plugin was restarted; its state for this response is gone".into(),
            );
        }
        match timed(&counters, || f(ready.instance, pid)) {
            Ok(p) => {
                let parsed = Parsed {
                    kinds: p.kinds,
                    calls: p.calls,
                    texts: p.texts,
                };
                if parsed.is_consistent() {
                    self.guard.ok();
                    Ok(parsed)
                } else {
                    state.plugin = None;
                    self.guard.rejected(
                        FallbackReason::Invalid,
                        &"columns of different lengths or unknown kinds",
                    );
                    Err("the parser answered malformed columns".into())
                }
            }
            Err(e) => {
                state.plugin = None;
                self.guard.failed(&e);
                Err(format!("the parser plugin failed: {e}"))
            }
        }
    }
}

/// `text` as content, with the failure said once (an empty `why` was said before).
fn passed_through(text: &str, why: &str) -> Parsed {
    let mut out = Parsed::default();
    if !why.is_empty() {
        out.failure(why);
    }
    out.content(text);
    out
}

impl OutputParser for WasmParser {
    fn formats(&mut self) -> (Vec<String>, Vec<String>) {
        let counters = self.guard.counters.clone();
        let Ok(ready) = self.guard.slot.ready() else {
            return Default::default();
        };
        self.generation.saw(ready.fresh);
        match timed(&counters, || ready.instance.formats()) {
            Ok(f) => f,
            Err(e) => {
                self.guard.failed(&e);
                Default::default()
            }
        }
    }

    fn open(&mut self, request: &ParseRequest) -> Result<u32, String> {
        self.guard.counters.record_call();
        let counters = self.guard.counters.clone();
        let ready = self
            .guard
            .slot
            .ready()
            .map_err(|e| format!("the parser plugin: {e}"))?;
        let generation = self.generation.saw(ready.fresh);
        let arg = WitParseRequest {
            tool_format: &request.tool_format,
            reasoning_format: &request.reasoning_format,
            reasoning_open: request.reasoning_open,
            tools: &request.tools,
        };
        match timed(&counters, || ready.instance.open_parser(arg)) {
            Ok(Ok(pid)) => {
                self.guard.ok();
                Ok(self.parsers.insert(ParserState {
                    plugin: Some((generation, pid)),
                }))
            }
            Ok(Err(message)) => {
                self.guard.ok();
                Err(message)
            }
            Err(e) => {
                self.guard.failed(&e);
                Err(format!("the parser plugin failed: {e}"))
            }
        }
    }

    fn feed(&mut self, parser: u32, text: &str) -> Parsed {
        match self.call(parser, |i, pid| i.feed(pid, text)) {
            Ok(p) => p,
            Err(why) => passed_through(text, &why),
        }
    }

    fn finish(&mut self, parser: u32) -> Parsed {
        let out = match self.call(parser, |i, pid| i.finish(pid)) {
            Ok(p) => p,
            // What the lost parser held back is gone with it; the failure says so.
            Err(why) => passed_through("", &why),
        };
        self.parsers.remove(parser);
        out
    }

    fn call_grammar(
        &mut self,
        format: &str,
        tools: &str,
        choice: &str,
        parallel: bool,
    ) -> Result<String, String> {
        let counters = self.guard.counters.clone();
        let ready = self
            .guard
            .slot
            .ready()
            .map_err(|e| format!("the parser plugin: {e}"))?;
        self.generation.saw(ready.fresh);
        match timed(&counters, || {
            ready.instance.call_grammar(format, tools, choice, parallel)
        }) {
            Ok(answer) => {
                self.guard.ok();
                answer
            }
            Err(e) => {
                self.guard.failed(&e);
                Err(format!("the parser plugin failed: {e}"))
            }
        }
    }
}

/// Whether `parsed` holds a failure piece (counted by the caller).
pub fn failures(parsed: &Parsed) -> usize {
    parsed
        .kinds
        .iter()
        .filter(|&&k| k == parsed_kind::FAILURE)
        .count()
}
