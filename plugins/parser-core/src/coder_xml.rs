//! The body of a `qwen3_coder` call block: XML-like functions with unquoted parameter values.
//!
//! ```text
//! <function=NAME>
//! <parameter=P>
//! VALUE
//! </parameter>
//! </function>
//! ```
//! One block may hold several functions. A value loses one leading and one trailing newline
//! (the template writes them) and is read by its parameter's schema type; a missing
//! `</parameter>` ends at the next `<parameter=`, a missing `</function>` at the block's end.

use serde_json::{Map, Value};

use crate::calls::Call;
use crate::tools::Tools;

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// The calls in one block's body (between `<tool_call>` and `</tool_call>`).
pub(crate) fn parse_functions(body: &str, tools: &Tools) -> Result<Vec<Call>, String> {
    let mut calls = Vec::new();
    let mut rest = body.trim_start();
    while !rest.is_empty() {
        let (name, after) = open_tag(rest, FUNCTION)?;
        let (inside, next) = match after.find(FUNCTION_END) {
            Some(at) => (&after[..at], &after[at + FUNCTION_END.len()..]),
            None => (after, ""),
        };
        let arguments = parse_parameters(inside, name, tools)?;
        calls.push(Call::new(name, &arguments));
        rest = next.trim_start();
    }
    if calls.is_empty() {
        return Err("call block holds no <function=...>".into());
    }
    Ok(calls)
}

fn parse_parameters(inside: &str, function: &str, tools: &Tools) -> Result<Value, String> {
    let mut arguments = Map::new();
    let mut rest = inside.trim_start();
    while !rest.is_empty() {
        let (param, after) = open_tag(rest, PARAMETER)?;
        let end = [after.find(PARAMETER_END), after.find(PARAMETER)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(after.len());
        let raw = &after[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        arguments.insert(param.to_owned(), tools.convert(function, param, raw));
        let next = &after[end..];
        rest = next
            .strip_prefix(PARAMETER_END)
            .unwrap_or(next)
            .trim_start();
    }
    Ok(Value::Object(arguments))
}

/// `text` starts with `<tag=NAME>`: the name and the text after the tag.
fn open_tag<'a>(text: &'a str, tag: &str) -> Result<(&'a str, &'a str), String> {
    let what = tag.trim_end_matches('=');
    let Some(rest) = text.strip_prefix(tag) else {
        return Err(format!("expected {what}=NAME> in the call block"));
    };
    let Some(gt) = rest.find('>') else {
        return Err(format!("{what}= tag is not closed"));
    };
    let name = rest[..gt].trim();
    if name.is_empty() {
        return Err(format!("{what}= tag has no name"));
    }
    Ok((name, &rest[gt + 1..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Tools {
        Tools::parse(
            r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"},
            "days": {"type": "integer"}}}}}]"#,
        )
        .unwrap()
    }

    #[test]
    fn reads_typed_parameters_in_order() {
        let body = "\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n\
                    <parameter=city>\nSan Francisco\n</parameter>\n</function>\n";
        let calls = parse_functions(body, &tools()).unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"days":3,"city":"San Francisco"}"#);
    }

    #[test]
    fn tolerates_missing_closers_and_keeps_inner_newlines() {
        let body = "<function=get_weather>\n<parameter=city>\na\nb\n<parameter=days>\n2";
        let calls = parse_functions(body, &tools()).unwrap();
        assert_eq!(calls[0].arguments, r#"{"city":"a\nb","days":2}"#);
    }

    #[test]
    fn rejects_other_structure() {
        assert!(
            parse_functions("\n", &tools())
                .unwrap_err()
                .contains("no <function")
        );
        assert!(
            parse_functions("{\"name\": 1}", &tools())
                .unwrap_err()
                .contains("expected")
        );
        assert!(
            parse_functions("<function=>", &tools())
                .unwrap_err()
                .contains("no name")
        );
        let stray = "<function=f>\nhello\n</function>";
        assert!(
            parse_functions(stray, &tools())
                .unwrap_err()
                .contains("<parameter")
        );
    }
}
