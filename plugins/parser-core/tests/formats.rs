//! Hand-written model outputs of each family, following its chat template, parsed whole and
//! split at every point: plain content, one call, two calls, content and a call, reasoning
//! and a call, malformed JSON, a call unterminated at the end.

mod common;

use chimera_parser_core::{Parsed, ResponseParser};
use common::*;

const WEATHER_TOOLS: &str = r#"[
  {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
   "parameters": {"type": "object", "properties": {
     "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
     "days": {"type": "integer"}, "detailed": {"type": "boolean"},
     "hours": {"type": "array", "items": {"type": "integer"}}},
   "required": ["location"]}}},
  {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
   "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
]"#;

const PARIS: &str = r#"{"location":"Paris, France","unit":"celsius"}"#;
const TOKYO: &str = r#"{"timezone":"Asia/Tokyo"}"#;

fn setup<'a>(tool_format: &'a str, reasoning: &'a str, open: bool) -> Setup<'a> {
    Setup {
        tool_format,
        reasoning,
        open,
        tools: WEATHER_TOOLS,
    }
}

// ---- Qwen3 (hermes tool format, qwen3 reasoning) ----

const HERMES_PARIS: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}\n</tool_call>";
const HERMES_TOKYO: &str = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"Asia/Tokyo\"}}\n</tool_call>";

#[test]
fn qwen3_hermes_plain_content() {
    let text = "The capital of France is **Paris**.\n\nIt has been the capital since 508 AD. <3";
    check(setup("hermes", "qwen3", false), text, &[c(text)]);
}

#[test]
fn qwen3_hermes_one_call() {
    check(
        setup("hermes", "qwen3", false),
        HERMES_PARIS,
        &[begin(0, "get_weather"), args(0, PARIS)],
    );
}

#[test]
fn qwen3_hermes_two_calls() {
    let text = format!("{HERMES_PARIS}\n{HERMES_TOKYO}");
    check(
        setup("hermes", "qwen3", false),
        &text,
        &[
            begin(0, "get_weather"),
            args(0, PARIS),
            begin(1, "get_time"),
            args(1, TOKYO),
        ],
    );
}

#[test]
fn qwen3_hermes_content_then_call_then_content() {
    let text = format!("Let me check the weather in Paris for you.\n\n{HERMES_PARIS}\nOne moment.");
    check(
        setup("hermes", "qwen3", false),
        &text,
        &[
            c("Let me check the weather in Paris for you."),
            begin(0, "get_weather"),
            args(0, PARIS),
            c("One moment."),
        ],
    );
}

#[test]
fn qwen3_hermes_reasoning_then_call() {
    let text = format!(
        "<think>\nThe user wants the weather in Paris. I'll call get_weather with celsius.\n</think>\n\n{HERMES_PARIS}"
    );
    check(
        setup("hermes", "qwen3", false),
        &text,
        &[
            r("\nThe user wants the weather in Paris. I'll call get_weather with celsius.\n"),
            begin(0, "get_weather"),
            args(0, PARIS),
        ],
    );
}

#[test]
fn qwen3_thinking_open_prompt_then_answer() {
    // Qwen3-2507 Thinking: the template ends with `<think>\n`, the response only closes it.
    let text = "Simple arithmetic: 2 + 2 = 4.\n</think>\n\nThe answer is 4.";
    check(
        setup("hermes", "qwen3", true),
        text,
        &[
            r("Simple arithmetic: 2 + 2 = 4.\n"),
            c("\n\nThe answer is 4."),
        ],
    );
}

#[test]
fn qwen3_hermes_malformed_json_comes_back_as_content() {
    // The arguments object is never closed before the closing marker.
    let text = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}\n</tool_call>\nDone.";
    check(
        setup("hermes", "qwen3", false),
        text,
        &[
            c(
                "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris\"}\n</tool_call>",
            ),
            fail("call closed before its JSON ended"),
            c("\nDone."),
        ],
    );
    // Complete braces, invalid JSON inside.
    let text = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": Paris}}\n</tool_call>";
    check(
        setup("hermes", "qwen3", false),
        text,
        &[c(text), fail("call is not JSON: ")],
    );
}

#[test]
fn qwen3_hermes_unterminated_call_at_finish() {
    let text = "<think>\nok\n</think>\n\nSure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Par";
    check(
        setup("hermes", "qwen3", false),
        text,
        &[
            r("\nok\n"),
            c(
                "\n\nSure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Par",
            ),
            fail("call not closed at the end of the response"),
        ],
    );
}

// ---- Qwen3-Coder / Qwen3.5 (qwen3_coder XML format) ----

const CODER_PARIS: &str = "<tool_call>\n<function=get_weather>\n<parameter=location>\nParis, France\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=detailed>\ntrue\n</parameter>\n<parameter=hours>\n[9, 12]\n</parameter>\n</function>\n</tool_call>";
const CODER_PARIS_ARGS: &str =
    r#"{"location":"Paris, France","unit":"celsius","days":3,"detailed":true,"hours":[9,12]}"#;
const CODER_TOKYO: &str = "<tool_call>\n<function=get_time>\n<parameter=timezone>\nAsia/Tokyo\n</parameter>\n</function>\n</tool_call>";

#[test]
fn qwen3_coder_plain_content() {
    let text = "Use `Vec<T>` here; a <b>tag</b> is fine too.";
    check(setup("qwen3_coder", "", false), text, &[c(text)]);
}

#[test]
fn qwen3_coder_one_call_typed_by_schema() {
    check(
        setup("qwen3_coder", "", false),
        CODER_PARIS,
        &[begin(0, "get_weather"), args(0, CODER_PARIS_ARGS)],
    );
}

#[test]
fn qwen3_coder_two_calls() {
    let text = format!("{CODER_PARIS}\n{CODER_TOKYO}");
    check(
        setup("qwen3_coder", "", false),
        &text,
        &[
            begin(0, "get_weather"),
            args(0, CODER_PARIS_ARGS),
            begin(1, "get_time"),
            args(1, TOKYO),
        ],
    );
}

#[test]
fn qwen3_coder_content_then_call() {
    let text = format!("I'll look up the forecast.\n{CODER_TOKYO}");
    check(
        setup("qwen3_coder", "", false),
        &text,
        &[
            c("I'll look up the forecast."),
            begin(0, "get_time"),
            args(0, TOKYO),
        ],
    );
}

#[test]
fn qwen35_reasoning_then_call() {
    // Qwen3.5 thinking: the template opened `<think>` already.
    let text = format!("The user is in Tokyo; get the time.\n</think>\n\n{CODER_TOKYO}");
    check(
        setup("qwen3_coder", "qwen3", true),
        &text,
        &[
            r("The user is in Tokyo; get the time.\n"),
            begin(0, "get_time"),
            args(0, TOKYO),
        ],
    );
}

#[test]
fn qwen3_coder_malformed_block_comes_back_as_content() {
    // A JSON body where the XML format is expected.
    let text = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    check(
        setup("qwen3_coder", "", false),
        text,
        &[c(text), fail("expected <function=NAME>")],
    );
}

#[test]
fn qwen3_coder_unterminated_call_at_finish() {
    let text = "<tool_call>\n<function=get_time>\n<parameter=timezone>\nAsia/To";
    check(
        setup("qwen3_coder", "", false),
        text,
        &[c(text), fail("call not closed")],
    );
}

// ---- Llama 3.1 (llama3_json) ----

const LLAMA_PARIS: &str = "{\"name\": \"get_weather\", \"parameters\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}";
const LLAMA_TOKYO: &str =
    "{\"name\": \"get_time\", \"parameters\": {\"timezone\": \"Asia/Tokyo\"}}";

#[test]
fn llama3_plain_content() {
    let text = "Paris is the capital of France. {braces} in text are fine.";
    check(setup("llama3_json", "", false), text, &[c(text)]);
}

#[test]
fn llama3_one_call_with_and_without_python_tag() {
    let expected = [begin(0, "get_weather"), args(0, PARIS)];
    check(setup("llama3_json", "", false), LLAMA_PARIS, &expected);
    let tagged = format!("<|python_tag|>{LLAMA_PARIS}");
    check(setup("llama3_json", "", false), &tagged, &expected);
}

#[test]
fn llama3_two_calls() {
    let text = format!("{LLAMA_PARIS}; {LLAMA_TOKYO}");
    check(
        setup("llama3_json", "", false),
        &text,
        &[
            begin(0, "get_weather"),
            args(0, PARIS),
            begin(1, "get_time"),
            args(1, TOKYO),
        ],
    );
}

#[test]
fn llama3_content_first_is_all_content_and_call_then_text() {
    // A call is recognised only at the start of the response.
    let text = format!("I will call a tool: {LLAMA_TOKYO}");
    check(setup("llama3_json", "", false), &text, &[c(&text)]);
    let text = format!("{LLAMA_TOKYO}\n\nThat is the call.");
    check(
        setup("llama3_json", "", false),
        &text,
        &[begin(0, "get_time"), args(0, TOKYO), c("That is the call.")],
    );
}

#[test]
fn r1_distill_llama_reasoning_then_call() {
    let text = format!("Okay, the user wants Paris weather.\n</think>\n\n{LLAMA_PARIS}");
    check(
        setup("llama3_json", "deepseek_r1", false),
        &text,
        &[
            r("Okay, the user wants Paris weather.\n"),
            begin(0, "get_weather"),
            args(0, PARIS),
        ],
    );
}

#[test]
fn llama3_malformed_json_comes_back_as_content() {
    let text = "{\"name\": \"get_weather\", \"parameters\": {\"location\": Paris}}";
    check(
        setup("llama3_json", "", false),
        text,
        &[c(text), fail("call is not JSON: ")],
    );
    // Valid JSON that is no call (a JSON answer): content, flagged.
    let text = "{\"city\": \"Paris\", \"country\": \"France\"}";
    check(
        setup("llama3_json", "", false),
        text,
        &[c(text), fail("call has no string `name`")],
    );
}

#[test]
fn llama3_unterminated_call_at_finish() {
    let text = format!("{LLAMA_TOKYO}; {{\"name\": \"get_weather\", \"parameters\": {{\"loc");
    check(
        setup("llama3_json", "", false),
        &text,
        &[
            begin(0, "get_time"),
            args(0, TOKYO),
            c("; {\"name\": \"get_weather\", \"parameters\": {\"loc"),
            fail("call not complete"),
        ],
    );
}

// ---- Granite 4 (hermes-like blocks) and Granite 3 (`<|tool_call|>` list) ----

const GRANITE_PARIS: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}\n</tool_call>";

#[test]
fn granite_plain_content() {
    let text = "I do not have the ability to book flights.";
    check(setup("granite", "", false), text, &[c(text)]);
}

#[test]
fn granite4_one_and_two_calls() {
    check(
        setup("granite", "", false),
        GRANITE_PARIS,
        &[begin(0, "get_weather"), args(0, PARIS)],
    );
    let text = format!("{GRANITE_PARIS}\n{HERMES_TOKYO}");
    check(
        setup("granite", "", false),
        &text,
        &[
            begin(0, "get_weather"),
            args(0, PARIS),
            begin(1, "get_time"),
            args(1, TOKYO),
        ],
    );
}

#[test]
fn granite4_content_then_call() {
    let text = format!("Sure, checking now.\n{GRANITE_PARIS}");
    check(
        setup("granite", "", false),
        &text,
        &[
            c("Sure, checking now."),
            begin(0, "get_weather"),
            args(0, PARIS),
        ],
    );
}

#[test]
fn granite_reasoning_then_call() {
    let text = format!("<think>Paris weather needed.</think>{GRANITE_PARIS}");
    check(
        setup("granite", "qwen3", false),
        &text,
        &[
            r("Paris weather needed."),
            begin(0, "get_weather"),
            args(0, PARIS),
        ],
    );
}

#[test]
fn granite3_tool_call_list() {
    let text = "<|tool_call|>[{\"name\": \"get_weather\", \"arguments\": {\"location\": \"Paris, France\", \"unit\": \"celsius\"}}, {\"name\": \"get_time\", \"arguments\": {\"timezone\": \"Asia/Tokyo\"}}]";
    check(
        setup("granite", "", false),
        text,
        &[
            begin(0, "get_weather"),
            args(0, PARIS),
            begin(1, "get_time"),
            args(1, TOKYO),
        ],
    );
}

#[test]
fn granite_malformed_and_unterminated() {
    let text = "<|tool_call|>[{\"name\": \"get_time\", \"arguments\": {\"timezone\": Asia/Tokyo}}]";
    check(
        setup("granite", "", false),
        text,
        &[c(text), fail("call is not JSON: ")],
    );
    // A `}` missing: the list never closes.
    let text = "<|tool_call|>[{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"UTC\"}]";
    check(
        setup("granite", "", false),
        text,
        &[c(text), fail("call not closed")],
    );
    let text = "Let me see.\n<tool_call>\n{\"name\": \"get_time\", \"argum";
    check(
        setup("granite", "", false),
        text,
        &[
            c("Let me see.\n<tool_call>\n{\"name\": \"get_time\", \"argum"),
            fail("call not closed"),
        ],
    );
}

// ---- The checks themselves ----

/// A parser that forgets everything between chunks: right on a whole response, wrong on
/// split ones. The checks must catch it.
struct Stateless(Setup<'static>, Parsed);

impl Stream for Stateless {
    fn feed(&mut self, text: &str) -> Parsed {
        let mut p = real(self.0)();
        let mut out = p.feed(text);
        out.extend(p.finish());
        out
    }
    fn finish(&mut self) -> Parsed {
        std::mem::take(&mut self.1)
    }
}

#[test]
fn checks_catch_a_wrong_expectation_and_a_chunk_dependent_parser() {
    let s = Setup {
        tool_format: "hermes",
        reasoning: "qwen3",
        open: false,
        tools: "",
    };
    let right = [begin(0, "get_weather"), args(0, PARIS)];
    // The real parser passes; a wrong argument text or a wrong call index is reported.
    assert_eq!(check_with(real(s), HERMES_PARIS, &right), Ok(()));
    let wrong_args = [begin(0, "get_weather"), args(0, TOKYO)];
    assert!(check_with(real(s), HERMES_PARIS, &wrong_args).is_err());
    let wrong_index = [begin(1, "get_weather"), args(1, PARIS)];
    assert!(check_with(real(s), HERMES_PARIS, &wrong_index).is_err());
    // The stateless parser is right on the whole text, and caught on a split.
    let stateless = || Stateless(s, Parsed::default());
    let whole = run(stateless(), &[HERMES_PARIS]);
    assert_eq!(
        compare(&whole, &right),
        Ok(()),
        "the broken parser passes unsplit"
    );
    let err = check_with(stateless, HERMES_PARIS, &right).unwrap_err();
    assert!(err.starts_with("split ["), "{err}");
}

#[test]
fn unknown_formats_are_refused_by_name() {
    let err = ResponseParser::new("pythonic", "", false, "").unwrap_err();
    assert!(
        err.contains("`pythonic`") && err.contains("hermes, qwen3_coder, llama3_json, granite")
    );
    let err = ResponseParser::new("hermes", "o1", false, "").unwrap_err();
    assert!(err.contains("`o1`") && err.contains("qwen3, deepseek_r1"));
    assert!(ResponseParser::new("qwen3_coder", "", false, "{").is_err());
}

/// Random responses built from marker fragments, for every pair of formats: no panic,
/// consistent columns, and the same merged pieces whole, one char at a time and in random
/// chunks.
#[test]
fn random_fragments_split_anyhow_parse_the_same() {
    const FRAGMENTS: &[&str] = &[
        "<tool_call>",
        "</tool_call>",
        "<|tool_call|>",
        "<think>",
        "</think>",
        "<|python_tag|>",
        "<function=get_time>",
        "</function>",
        "<parameter=timezone>",
        "</parameter>",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "\\",
        ";",
        ":",
        ",",
        "\"name\"",
        "\"arguments\"",
        "\"get_time\"",
        "<",
        "</",
        " ",
        "\n",
        "a",
        "é",
        "🔵",
    ];
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |n: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 33) % n as u64) as usize
    };
    for _ in 0..400 {
        let text: String = (0..next(40))
            .map(|_| FRAGMENTS[next(FRAGMENTS.len())])
            .collect();
        for tool_format in ["", "hermes", "qwen3_coder", "llama3_json", "granite"] {
            for (reasoning, open) in [
                ("", false),
                ("qwen3", false),
                ("qwen3", true),
                ("deepseek_r1", false),
            ] {
                let s = Setup {
                    tool_format,
                    reasoning,
                    open,
                    tools: WEATHER_TOOLS,
                };
                let whole = run(real(s)(), &[&text]);
                assert!(whole.is_consistent());
                let mut chunks = Vec::new();
                let mut from = 0;
                while from < text.len() {
                    let mut to = (from + 1 + next(12)).min(text.len());
                    while !text.is_char_boundary(to) {
                        to += 1;
                    }
                    chunks.push(&text[from..to]);
                    from = to;
                }
                let one_by_one: Vec<&str> = text
                    .char_indices()
                    .map(|(i, ch)| &text[i..i + ch.len_utf8()])
                    .collect();
                for split in [chunks, one_by_one] {
                    let got = run(real(s)(), &split);
                    assert_eq!(got, whole, "{tool_format}/{reasoning}/{open} on {split:?}");
                }
            }
        }
    }
}
