//! Tool calls as parsed out of a response, and the JSON call objects of the JSON formats.
//!
//! A call object is `{"name": "...", "arguments": {...}}` (Llama writes `parameters`);
//! arguments given as a JSON string holding an object are accepted, missing ones are `{}`.
//! Arguments come out as compact JSON in the model's key order.

use chimera_policy_core::Parsed;
use serde_json::Value;

use crate::tools::no_arguments;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Call {
    pub(crate) name: String,
    /// Compact JSON text of the arguments object.
    pub(crate) arguments: String,
}

impl Call {
    pub(crate) fn new(name: &str, arguments: &Value) -> Self {
        Self {
            name: name.to_owned(),
            arguments: arguments.to_string(),
        }
    }
}

/// Numbers a response's calls from 0 and writes them out.
#[derive(Debug, Default)]
pub(crate) struct CallCounter(u32);

impl CallCounter {
    pub(crate) fn emit(&mut self, calls: &[Call], out: &mut Parsed) {
        for call in calls {
            out.call_begin(self.0, &call.name);
            out.call_arguments(self.0, &call.arguments);
            self.0 = self.0.saturating_add(1);
        }
    }
}

/// One call object, or a non-empty list of them, as JSON text.
pub(crate) fn calls_from_json(text: &str) -> Result<Vec<Call>, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("call is not JSON: {e}"))?;
    match value {
        Value::Array(items) if items.is_empty() => Err("empty list of calls".into()),
        Value::Array(items) => items.iter().map(call_from_value).collect(),
        other => Ok(vec![call_from_value(&other)?]),
    }
}

/// One call object as JSON text (not a list).
pub(crate) fn call_from_json(text: &str) -> Result<Call, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("call is not JSON: {e}"))?;
    call_from_value(&value)
}

fn call_from_value(value: &Value) -> Result<Call, String> {
    let Value::Object(fields) = value else {
        return Err("call is not a JSON object".into());
    };
    let Some(name) = fields.get("name").and_then(Value::as_str) else {
        return Err("call has no string `name`".into());
    };
    let arguments = fields.get("arguments").or_else(|| fields.get("parameters"));
    match arguments {
        None | Some(Value::Null) => Ok(Call::new(name, &no_arguments())),
        Some(args @ Value::Object(_)) => Ok(Call::new(name, args)),
        Some(Value::String(text)) => match serde_json::from_str::<Value>(text) {
            Ok(args @ Value::Object(_)) => Ok(Call::new(name, &args)),
            _ => Err("call arguments are a string that holds no JSON object".into()),
        },
        Some(_) => Err("call arguments are not a JSON object".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_call_objects_and_lists() {
        let one = calls_from_json(r#"{"name": "f", "arguments": {"b": 1, "a": [true]}}"#);
        assert_eq!(
            one,
            Ok(vec![Call::new(
                "f",
                &serde_json::json!({"b": 1, "a": [true]})
            )])
        );
        // The model's key order is kept.
        assert_eq!(one.unwrap()[0].arguments, r#"{"b":1,"a":[true]}"#);
        let two = calls_from_json(r#"[{"name": "f", "parameters": {}}, {"name": "g"}]"#).unwrap();
        assert_eq!(
            two.iter()
                .map(|c| (&*c.name, &*c.arguments))
                .collect::<Vec<_>>(),
            [("f", "{}"), ("g", "{}")]
        );
        let stringly = call_from_json(r#"{"name": "f", "arguments": "{\"x\": 1}"}"#).unwrap();
        assert_eq!(stringly.arguments, r#"{"x":1}"#);
    }

    #[test]
    fn says_why_a_call_is_malformed() {
        assert!(calls_from_json("{").unwrap_err().contains("not JSON"));
        assert!(calls_from_json("[]").unwrap_err().contains("empty"));
        assert!(
            calls_from_json(r#"{"arguments": {}}"#)
                .unwrap_err()
                .contains("name")
        );
        assert!(
            call_from_json(r#"[{"name": "f"}]"#)
                .unwrap_err()
                .contains("object")
        );
        let bad = r#"{"name": "f", "arguments": 3}"#;
        assert!(call_from_json(bad).unwrap_err().contains("arguments"));
    }
}
