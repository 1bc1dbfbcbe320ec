//! The request's `tools` (OpenAI's JSON): function names and parameter schemas.
//!
//! Accepts `[{"type": "function", "function": {"name", "parameters"}}]` and the bare
//! `[{"name", "parameters"}]`. Owns how a parameter's schema type turns a raw text value (the
//! XML formats write values unquoted) into JSON; it never validates a call against a schema.

use serde_json::{Map, Value};

/// One function a response may call.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Tool {
    pub(crate) name: String,
    /// The `parameters` JSON schema; `None` when the tool declares none.
    pub(crate) parameters: Option<Value>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Tools(Vec<Tool>);

/// How a raw parameter value is read, from its schema's `type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ParamType {
    /// Kept as the raw text (also for parameters without a known type).
    String,
    Integer,
    Number,
    Boolean,
    /// Objects, arrays, null: parsed as JSON.
    Json,
}

impl Tools {
    /// `json` empty means no tools.
    pub(crate) fn parse(json: &str) -> Result<Self, String> {
        if json.trim().is_empty() {
            return Ok(Self::default());
        }
        let value: Value =
            serde_json::from_str(json).map_err(|e| format!("tools: not JSON: {e}"))?;
        let Value::Array(items) = value else {
            return Err("tools: expected a JSON array".into());
        };
        let mut tools = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let function = item.get("function").unwrap_or(item);
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                return Err(format!("tools[{i}]: no function name"));
            };
            let parameters = function.get("parameters").filter(|p| !p.is_null()).cloned();
            tools.push(Tool {
                name: name.to_owned(),
                parameters,
            });
        }
        Ok(Self(tools))
    }

    pub(crate) fn all(&self) -> &[Tool] {
        &self.0
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Tool> {
        self.0.iter().find(|t| t.name == name)
    }

    /// The type of `function`'s parameter `param`: `String` when the function, the parameter
    /// or its type is unknown.
    pub(crate) fn param_type(&self, function: &str, param: &str) -> ParamType {
        self.get(function)
            .and_then(|t| t.parameters.as_ref())
            .and_then(|p| p.get("properties"))
            .and_then(|props| props.get(param))
            .map_or(ParamType::String, schema_type)
    }

    /// `raw` as the JSON value of `function`'s parameter `param`; the raw string when it
    /// does not read as its type.
    pub(crate) fn convert(&self, function: &str, param: &str, raw: &str) -> Value {
        convert(self.param_type(function, param), raw)
    }
}

/// The type a property schema declares (the first non-null one of a list).
pub(crate) fn schema_type(schema: &Value) -> ParamType {
    let declared = match schema.get("type") {
        Some(Value::String(t)) => Some(t.as_str()),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).find(|t| *t != "null"),
        _ => None,
    };
    match declared {
        Some("integer" | "int" | "uint" | "long" | "short" | "unsigned") => ParamType::Integer,
        Some("number" | "float" | "double" | "num") => ParamType::Number,
        Some("boolean" | "bool") => ParamType::Boolean,
        Some("object" | "array" | "dict" | "list" | "null") => ParamType::Json,
        _ => ParamType::String,
    }
}

fn convert(ty: ParamType, raw: &str) -> Value {
    let text = raw.trim();
    let parsed = match ty {
        ParamType::String => None,
        ParamType::Boolean => match text.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        ParamType::Integer | ParamType::Number => serde_json::from_str::<Value>(text)
            .ok()
            .filter(|v| v.is_number() || v.is_null()),
        ParamType::Json => serde_json::from_str::<Value>(text).ok(),
    };
    parsed.unwrap_or_else(|| Value::String(raw.to_owned()))
}

/// An empty JSON object, the arguments of a call without any.
pub(crate) fn no_arguments() -> Value {
    Value::Object(Map::new())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TOOLS: &str = r#"[{"type": "function", "function": {"name": "f", "parameters":
        {"type": "object", "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
        "n": {"type": ["number", "null"]}, "b": {"type": "boolean"}, "o": {"type": "object"},
        "a": {"type": "array"}, "e": {"enum": ["x", "y"]}}}}},
        {"name": "bare"}]"#;

    #[test]
    fn parses_both_shapes_and_rejects_nameless() {
        let tools = Tools::parse(TOOLS).unwrap();
        assert_eq!(tools.all().len(), 2);
        assert_eq!(tools.get("bare").unwrap().parameters, None);
        assert_eq!(Tools::parse("").unwrap(), Tools::default());
        assert!(
            Tools::parse(r#"[{"function": {}}]"#)
                .unwrap_err()
                .contains("tools[0]")
        );
        assert!(Tools::parse("{").unwrap_err().contains("not JSON"));
    }

    #[test]
    fn converts_by_declared_type_with_raw_fallback() {
        let t = Tools::parse(TOOLS).unwrap();
        assert_eq!(t.convert("f", "s", " 42 "), json!(" 42 "));
        assert_eq!(t.convert("f", "i", "42"), json!(42));
        assert_eq!(t.convert("f", "i", "forty"), json!("forty"));
        assert_eq!(t.convert("f", "n", "2.5"), json!(2.5));
        assert_eq!(t.convert("f", "n", "null"), Value::Null);
        assert_eq!(t.convert("f", "b", "True"), json!(true));
        assert_eq!(t.convert("f", "o", "{\"k\": [1]}"), json!({"k": [1]}));
        assert_eq!(t.convert("f", "a", "[1, 2"), json!("[1, 2"));
        assert_eq!(t.convert("f", "e", "true"), json!("true"));
        assert_eq!(t.convert("f", "missing", "1"), json!("1"));
        assert_eq!(t.convert("nope", "i", "1"), json!("1"));
    }
}
