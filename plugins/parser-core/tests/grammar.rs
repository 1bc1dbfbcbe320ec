//! The tool-call grammars compiled by llguidance itself, over a byte-level vocabulary: a
//! right call is accepted whole, a wrong name, a wrong argument type, a missing required
//! argument or a second call where one is allowed is rejected.

use chimera_parser_core::call_grammar;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::ApproximateTokEnv;
use llguidance::{Matcher, ParserFactory};

const TOOLS: &str = r#"[
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
   "properties": {"location": {"type": "string"},
     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
     "days": {"type": "integer"}},
   "required": ["location"]}}},
  {"type": "function", "function": {"name": "now"}}
]"#;

/// Whether llguidance accepts `text` as a whole response under `grammar` (every byte allowed
/// in turn, and the grammar may end after the last). Errs when the grammar does not compile.
fn accepts(grammar: &str, text: &str) -> Result<bool, String> {
    // 256 single-byte tokens plus a few special ones, the end of text among them.
    let env = ApproximateTokEnv::single_byte_env();
    let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
    factory.quiet();
    let parser = factory
        .create_parser(TopLevelGrammar::from_lark(grammar.to_owned()))
        .map_err(|e| format!("{e}\n{grammar}"))?;
    let mut matcher = Matcher::new(Ok(parser));
    let tokens: Vec<u32> = text.bytes().map(u32::from).collect();
    let taken = matcher
        .try_consume_tokens(&tokens)
        .map_err(|e| e.to_string())?;
    Ok(taken == tokens.len() && matcher.is_accepting().unwrap_or(false))
}

fn grammar(format: &str, choice: &str, parallel: bool) -> String {
    call_grammar(format, TOOLS, choice, parallel).expect("grammar")
}

fn assert_accepts(g: &str, text: &str) {
    assert_eq!(
        accepts(g, text),
        Ok(true),
        "should accept {text:?} under\n{g}"
    );
}

fn assert_rejects(g: &str, text: &str) {
    assert_eq!(
        accepts(g, text),
        Ok(false),
        "should reject {text:?} under\n{g}"
    );
}

const HERMES_OK: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\", \"unit\": \"celsius\", \"days\": 3}}\n</tool_call>";

#[test]
fn hermes_and_granite_force_a_valid_call() {
    for format in ["hermes", "granite"] {
        let g = grammar(format, "get_weather", false);
        assert_accepts(&g, HERMES_OK);
        assert_rejects(&g, &HERMES_OK.replace("get_weather", "get_wether"));
        assert_rejects(&g, &HERMES_OK.replace("3}", "\"three\"}"));
        assert_rejects(&g, &HERMES_OK.replace("\"celsius\"", "\"kelvin\""));
        assert_rejects(&g, &HERMES_OK.replace("\"location\": \"Paris\", ", ""));
        assert_rejects(&g, &format!("Sure! {HERMES_OK}"));
        // Not the chosen function.
        assert_rejects(
            &g,
            "<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        );
    }
}

#[test]
fn hermes_required_and_parallel() {
    let now = "<tool_call>\n{\"name\": \"now\", \"arguments\": {\"any\": [1]}}\n</tool_call>";
    let one = grammar("hermes", "required", false);
    assert_accepts(&one, now);
    assert_accepts(&one, HERMES_OK);
    assert_rejects(&one, &format!("{HERMES_OK}\n{now}"));
    let many = grammar("hermes", "required", true);
    assert_accepts(&many, &format!("{HERMES_OK}\n{now}"));
    assert_rejects(&many, "");
    // A tool without `parameters` still takes only an object.
    assert_rejects(&many, &now.replace("{\"any\": [1]}", "[1]"));
}

#[test]
fn llama3_json_forces_parameters_objects() {
    let call =
        "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris\", \"days\": 2}}";
    let g = grammar("llama3_json", "required", true);
    assert_accepts(&g, call);
    assert_accepts(
        &g,
        &format!("{call}; {{\"name\": \"now\", \"parameters\": {{}}}}"),
    );
    assert_rejects(&g, &call.replace("parameters", "arguments"));
    assert_rejects(&g, &call.replace("2}", "2.5}"));
    assert_rejects(&grammar("llama3_json", "now", false), call);
}

const CODER_OK: &str = "<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Francisco, \"CA\"\nsecond line\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>";

#[test]
fn qwen3_coder_forces_names_and_typed_values() {
    let g = grammar("qwen3_coder", "get_weather", false);
    assert_accepts(&g, CODER_OK);
    // Optional parameters may be left out; the required one may not.
    let minimal = "<tool_call>\n<function=get_weather>\n<parameter=location>\nOslo\n</parameter>\n</function>\n</tool_call>";
    assert_accepts(&g, minimal);
    assert_rejects(
        &g,
        &CODER_OK.replace("function=get_weather", "function=get_time"),
    );
    assert_rejects(&g, &CODER_OK.replace("\n5\n", "\nfive\n"));
    assert_rejects(&g, &CODER_OK.replace("fahrenheit", "kelvin"));
    assert_rejects(&g, &CODER_OK.replace("parameter=days", "parameter=weeks"));
    let no_location = "<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>";
    assert_rejects(&g, no_location);
    // What the grammar forces, the parser reads back as the same call.
    let any = grammar("qwen3_coder", "required", true);
    let now = "<tool_call>\n<function=now>\n</function>\n</tool_call>";
    assert_accepts(&any, &format!("{CODER_OK}\n{now}"));
}

#[test]
fn forced_calls_parse_back() {
    use chimera_parser_core::ResponseParser;
    for (format, text) in [("hermes", HERMES_OK), ("qwen3_coder", CODER_OK)] {
        let mut p = ResponseParser::new(format, "", false, TOOLS).expect("parser");
        let mut out = p.feed(text);
        out.extend(p.finish());
        assert_eq!(out.kinds, [2, 3], "{format}: {out:?}");
        assert_eq!(out.texts[0], "get_weather");
    }
}
