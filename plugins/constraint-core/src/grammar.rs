//! Grammar text of one `open` call, turned into llguidance's grammar description.
//!
//! Owns [`GrammarKind`] and the size check. Nothing is compiled here (the factory compiles),
//! so this module is cheap and never runs user-controlled loops beyond JSON parsing, whose
//! nesting serde_json bounds.

use llguidance::api::TopLevelGrammar;

use crate::error::{ConstraintError, clip};

/// The grammar kinds of the ABI's `open`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarKind {
    /// A JSON Schema document (`{"type":"object"}` for any JSON object).
    JsonSchema,
    /// A regular expression (Rust `regex` syntax) the whole response matches.
    Regex,
    /// A JSON list of strings; the response is exactly one of them.
    Choice,
    /// A Lark grammar as llguidance reads it, possibly embedding `%json { ... }`.
    Lark,
}

impl GrammarKind {
    pub fn parse(kind: &str) -> Result<Self, ConstraintError> {
        match kind {
            "json-schema" => Ok(GrammarKind::JsonSchema),
            "regex" => Ok(GrammarKind::Regex),
            "choice" => Ok(GrammarKind::Choice),
            "lark" => Ok(GrammarKind::Lark),
            other => Err(ConstraintError::UnknownKind(clip(other))),
        }
    }

    /// The ABI's name of this kind.
    pub fn name(self) -> &'static str {
        match self {
            GrammarKind::JsonSchema => "json-schema",
            GrammarKind::Regex => "regex",
            GrammarKind::Choice => "choice",
            GrammarKind::Lark => "lark",
        }
    }

    fn invalid(self, message: impl Into<String>) -> ConstraintError {
        ConstraintError::Invalid {
            kind: self.name(),
            message: clip(message),
        }
    }
}

/// Refuses a grammar text longer than `max_bytes`.
pub fn check_size(grammar: &str, max_bytes: u32) -> Result<(), ConstraintError> {
    if grammar.len() > max_bytes as usize {
        return Err(ConstraintError::TooLarge {
            len: grammar.len(),
            limit: max_bytes,
        });
    }
    Ok(())
}

/// Checks `grammar`'s size and reads it as `kind`.
/// A JSON schema's output gets at most `json_whitespace_max` whitespace characters between
/// two tokens (see [`crate::Limits::json_whitespace_max`]).
pub fn describe(
    kind: GrammarKind,
    grammar: &str,
    max_bytes: u32,
    json_whitespace_max: u32,
) -> Result<TopLevelGrammar, ConstraintError> {
    check_size(grammar, max_bytes)?;
    match kind {
        GrammarKind::JsonSchema => {
            let schema: serde_json::Value = serde_json::from_str(grammar)
                .map_err(|e| kind.invalid(format!("not JSON: {e}")))?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(kind.invalid("a schema is a JSON object or a boolean"));
            }
            Ok(TopLevelGrammar::from_json_schema(bounded_whitespace(
                schema,
                json_whitespace_max,
            )))
        }
        GrammarKind::Regex => Ok(TopLevelGrammar::from_regex(grammar)),
        GrammarKind::Choice => choice_lark(grammar)
            .map(TopLevelGrammar::from_lark)
            .map_err(|m| kind.invalid(m)),
        GrammarKind::Lark => {
            if grammar.trim().is_empty() {
                return Err(kind.invalid("empty grammar"));
            }
            Ok(TopLevelGrammar::from_lark(grammar.to_string()))
        }
    }
}

/// `schema` with llguidance's whitespace option bounding the whitespace between tokens,
/// unless it sets its own `x-guidance` options.
fn bounded_whitespace(schema: serde_json::Value, max: u32) -> serde_json::Value {
    let serde_json::Value::Object(mut map) = schema else {
        // `true` / `false`: any JSON value, or none; written out so the option applies.
        let any = schema.as_bool() == Some(true);
        let mut map = serde_json::Map::new();
        if !any {
            map.insert("not".into(), serde_json::json!({}));
        }
        return bounded_whitespace(serde_json::Value::Object(map), max);
    };
    if !map.contains_key("x-guidance") {
        let options = if max == 0 {
            serde_json::json!({"whitespace_flexible": false})
        } else {
            serde_json::json!({"whitespace_pattern": format!("[\\x20\\x0A\\x0D\\x09]{{1,{max}}}")})
        };
        map.insert("x-guidance".into(), options);
    }
    serde_json::Value::Object(map)
}

/// `["a", "b"]` as the Lark grammar `start: "a" | "b"` (Lark string literals are JSON strings).
fn choice_lark(grammar: &str) -> Result<String, String> {
    let choices: Vec<String> = serde_json::from_str(grammar)
        .map_err(|e| format!("expected a JSON list of strings: {e}"))?;
    if choices.is_empty() {
        return Err("the list of choices is empty".into());
    }
    let mut lark = String::with_capacity(grammar.len() + 16);
    lark.push_str("start: ");
    for (i, choice) in choices.iter().enumerate() {
        if choice.is_empty() {
            return Err(format!("choice {i} is the empty string"));
        }
        if i > 0 {
            lark.push_str(" | ");
        }
        // Serialising a `String` cannot fail.
        lark.push_str(&serde_json::to_string(choice).unwrap_or_default());
    }
    lark.push('\n');
    Ok(lark)
}
