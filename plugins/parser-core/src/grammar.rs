//! Grammars (llguidance's Lark dialect) that force a response to be tool calls.
//!
//! Used for `tool_choice` `required` or a named function: the response is one call (or, when
//! `parallel`, one or more) in the model's own format, of the chosen function or of any tool.
//! JSON formats constrain the whole call object with `%json` from each tool's `parameters`
//! schema; `qwen3_coder` constrains its tags, function and parameter names, and each value by
//! its schema (`%json` for non-strings, the enum for string enums, free text otherwise).
//! Parameters are forced into the schema's order, required ones present.
//!
//! Markers are written as text literals, not special tokens: `<tool_call>` is ordinary text in
//! the Qwen, Granite 4 and SmolLM3 vocabularies, and Llama's custom-tool calls need no
//! `<|python_tag|>`.

use serde_json::{Map, Value, json};

use crate::tools::{ParamType, Tool, Tools, schema_type};

/// A grammar that makes the response tool calls in `format`. `choice`: a function name, or
/// `required` for any of `tools_json`'s tools. Errs on an unknown format or function, or
/// when there is no tool to call.
pub fn call_grammar(
    format: &str,
    tools_json: &str,
    choice: &str,
    parallel: bool,
) -> Result<String, String> {
    let tools = Tools::parse(tools_json)?;
    let chosen: Vec<&Tool> = if choice == "required" {
        tools.all().iter().collect()
    } else {
        let tool = tools.get(choice).ok_or_else(|| {
            let names: Vec<&str> = tools.all().iter().map(|t| t.name.as_str()).collect();
            format!(
                "tool choice `{choice}` is not among the tools ({})",
                names.join(", ")
            )
        })?;
        vec![tool]
    };
    if chosen.is_empty() {
        return Err("tool choice `required` but the request has no tools".into());
    }
    let (separator, rules) = match format {
        "hermes" | "granite" => (
            "\"\\n\"",
            format!(
                "call: \"<tool_call>\\n\" args \"\\n</tool_call>\"\nargs: %json {}\n",
                laid_out(call_schema(&chosen, "arguments"))
            ),
        ),
        "llama3_json" => (
            "\"; \"",
            format!(
                "call: %json {}\n",
                laid_out(call_schema(&chosen, "parameters"))
            ),
        ),
        "qwen3_coder" => ("\"\\n\"", coder_rules(&chosen)),
        other => {
            return Err(format!(
                "no call grammar for tool format `{other}` (known: {})",
                crate::TOOL_FORMATS.join(", ")
            ));
        }
    };
    let start = if parallel {
        format!("start: call ({separator} call)*\n")
    } else {
        "start: call\n".to_owned()
    };
    Ok(start + &rules)
}

/// The JSON schema of one call object of any of `tools`, arguments under `key`.
fn call_schema(tools: &[&Tool], key: &str) -> Value {
    let mut each: Vec<Value> = tools
        .iter()
        .map(|t| {
            let mut properties = Map::new();
            properties.insert("name".into(), json!({ "const": t.name }));
            properties.insert(key.into(), arguments_schema(t));
            json!({
                "type": "object",
                "properties": properties,
                "required": ["name", key],
                "additionalProperties": false,
            })
        })
        .collect();
    if each.len() == 1 {
        each.remove(0)
    } else {
        json!({ "anyOf": each })
    }
}

/// `schema` with llguidance's layout options for the JSON it makes: a space after `,` and `:`
/// as models write calls (`{"name": "f", "arguments": {...}}`), and no other whitespace, so a
/// forced call cannot be padded until the response runs out of tokens. A schema that sets its
/// own `x-guidance` keeps it.
fn laid_out(schema: Value) -> Value {
    match schema {
        Value::Object(mut map) => {
            map.entry("x-guidance").or_insert_with(|| {
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
            });
            Value::Object(map)
        }
        other => other,
    }
}

/// A tool's `parameters`, or any object when it declares none.
fn arguments_schema(tool: &Tool) -> Value {
    tool.parameters
        .clone()
        .unwrap_or_else(|| json!({ "type": "object" }))
}

/// `call` and the rules below it for `qwen3_coder` blocks.
fn coder_rules(tools: &[&Tool]) -> String {
    let functions: Vec<String> = (0..tools.len()).map(|i| format!("fn_{i}")).collect();
    let mut rules = format!(
        "call: \"<tool_call>\\n\" function \"</tool_call>\"\nfunction: {}\n",
        functions.join(" | ")
    );
    rules += "text_value[lazy]: /(.|\\n)*\\n<\\/parameter>\\n/\n";
    for (i, tool) in tools.iter().enumerate() {
        let schema = arguments_schema(tool);
        let required: Vec<&str> = schema
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let empty = Map::new();
        let properties = schema
            .get("properties")
            .and_then(Value::as_object)
            .unwrap_or(&empty);
        let mut body = format!("\"<function={}>\\n\"", lark_escape(&tool.name));
        for (j, (param, prop)) in properties.iter().enumerate() {
            let rule = format!("p_{i}_{j}");
            body += &format!(
                " {rule}{}",
                if required.contains(&param.as_str()) {
                    ""
                } else {
                    "?"
                }
            );
            rules += &format!(
                "{rule}: \"<parameter={}>\\n\" {}\n",
                lark_escape(param),
                value_expansion(prop)
            );
        }
        rules += &format!("fn_{i}: {body} \"</function>\\n\"\n");
    }
    rules
}

/// How a parameter's value and its closing tag are written.
fn value_expansion(prop: &Value) -> String {
    const CLOSE: &str = "\"\\n</parameter>\\n\"";
    let strings: Option<Vec<&str>> = prop
        .get("enum")
        .and_then(Value::as_array)
        .and_then(|e| e.iter().map(Value::as_str).collect());
    match (schema_type(prop), strings) {
        (ParamType::String, Some(options)) if !options.is_empty() => {
            let options: Vec<String> = options.iter().map(|o| lark_string(o)).collect();
            format!("({}) {CLOSE}", options.join(" | "))
        }
        (ParamType::String, _) => "text_value".to_owned(),
        _ => format!("%json {} {CLOSE}", laid_out(prop.clone())),
    }
}

/// `text` as a Lark string literal (JSON string syntax, control characters escaped).
fn lark_string(text: &str) -> String {
    format!("\"{}\"", lark_escape(text))
}

/// `text` escaped for the inside of a Lark string literal.
fn lark_escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\u{:04x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOOLS: &str = r#"[{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
        "required": ["city"]}}}, {"type": "function", "function": {"name": "now"}}]"#;

    #[test]
    fn hermes_single_call_of_a_named_function() {
        let g = call_grammar("hermes", TOOLS, "now", false).unwrap();
        assert_eq!(
            g,
            "start: call\ncall: \"<tool_call>\\n\" args \"\\n</tool_call>\"\nargs: %json \
             {\"type\":\"object\",\"properties\":{\"name\":{\"const\":\"now\"},\"arguments\":\
             {\"type\":\"object\"}},\"required\":[\"name\",\"arguments\"],\
             \"additionalProperties\":false,\"x-guidance\":{\"whitespace_flexible\":false,\
             \"item_separator\":\", \",\"key_separator\":\": \"}}\n"
        );
    }

    #[test]
    fn errors_name_what_is_wrong() {
        let err = call_grammar("hermes", TOOLS, "nope", false).unwrap_err();
        assert!(
            err.contains("`nope`") && err.contains("get_weather, now"),
            "{err}"
        );
        assert!(
            call_grammar("hermes", "", "required", true)
                .unwrap_err()
                .contains("no tools")
        );
        assert!(
            call_grammar("xml", TOOLS, "required", true)
                .unwrap_err()
                .contains("`xml`")
        );
    }

    #[test]
    fn escapes_literals() {
        assert_eq!(lark_string("a\"b\\c\n\u{7f}"), "\"a\\\"b\\\\c\\n\\u007f\"");
    }
}
