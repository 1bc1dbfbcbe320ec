//! Agent requests on the server side: what a chat request's `tools`, `tool_choice`,
//! `response_format` and `structured_outputs` ask of the engine (a grammar for the constraint
//! plugin) and of the output pass (a parse request for the parser plugin), and the tool-call
//! deltas the parser's pieces become.
//!
//! Owns the OpenAI / vLLM request rules: which `tool_choice` forces calls, how a
//! `response_format` becomes a grammar, which tool-call and reasoning formats apply (the
//! configured ones, else inferred from the chat template). Must not parse model output itself:
//! that is the parser plugin's job (`plugins/parser-core` for the built-ins).

use serde_json::Value;

use super::error::AppError;
use crate::engine::api::Grammar;
use crate::policy::ParseRequest;

/// One tool call's piece of a response, as OpenAI streams it: the first piece of a call has its
/// id and name, later ones only more of its arguments (JSON text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallDelta {
    pub index: u32,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

/// What the agent fields of one chat request ask for.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AgentPlan {
    /// The grammar the engine constrains the response with.
    pub grammar: Option<Grammar>,
    /// What the output pass parses the response for; `None` leaves the text as it is.
    pub parse: Option<ParseRequest>,
    /// Whether the tool definitions go to the chat template.
    pub tools_in_template: bool,
}

/// The server's formats (`--tool-call-parser`, `--reasoning-parser`, or inferred).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Formats {
    pub tool: Option<String>,
    pub reasoning: Option<String>,
}

impl Formats {
    /// The configured formats, each inferred from the chat template where not configured:
    /// Qwen3-Coder XML (`<function=`), Hermes JSON (`<tool_call>`), Llama 3 JSON
    /// (`<|python_tag|>` or `"parameters"` in an ipython template), Granite (`<|tool_call|>`);
    /// reasoning with `<think>` (Qwen3 style).
    pub fn resolve(tool: Option<&str>, reasoning: Option<&str>, template: Option<&str>) -> Self {
        let t = template.unwrap_or("");
        let inferred_tool = if t.contains("<function=") {
            Some("qwen3_coder")
        } else if t.contains("<|tool_call|>") {
            Some("granite")
        } else if t.contains("<tool_call>") {
            Some("hermes")
        } else if t.contains("<|python_tag|>") || t.contains("Environment: ipython") {
            Some("llama3_json")
        } else {
            None
        };
        let inferred_reasoning = t.contains("<think>").then_some("qwen3");
        Self {
            tool: tool.or(inferred_tool).map(str::to_string),
            reasoning: reasoning.or(inferred_reasoning).map(str::to_string),
        }
    }
}

/// How the request's `tool_choice` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, AppError> {
    let bad = || {
        AppError::invalid(
            "tool_choice",
            "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            _ => Err(bad()),
        },
        Some(obj) => obj
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(|n| ToolChoice::Named(n.to_string()))
            .ok_or_else(bad),
    }
}

/// The names of `tools` (each `{"type": "function", "function": {"name": ...}}`).
fn tool_names(tools: &[Value]) -> Result<Vec<String>, AppError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            t.pointer("/function/name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .map(str::to_string)
                .ok_or_else(|| {
                    AppError::invalid("tools", format!("tools[{i}] has no function.name"))
                })
        })
        .collect()
}

/// The grammar of a `response_format` (`text`: none).
fn response_format_grammar(rf: &Value) -> Result<Option<Grammar>, AppError> {
    let kind = rf.get("type").and_then(Value::as_str).unwrap_or("text");
    let schema = |text: String| Grammar {
        kind: "json-schema".into(),
        text,
    };
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(schema(r#"{"type":"object"}"#.into()))),
        "json_schema" => {
            let s = rf
                .pointer("/json_schema/schema")
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| {
                    AppError::invalid(
                        "response_format",
                        "json_schema needs json_schema.schema (a JSON Schema object)",
                    )
                })?;
            Ok(Some(schema(s.to_string())))
        }
        other => Err(AppError::invalid(
            "response_format",
            format!("unknown type `{other}`: use text, json_object or json_schema"),
        )),
    }
}

/// The grammar of vLLM's `structured_outputs` (one of json, regex, choice, grammar).
fn structured_outputs_grammar(so: &Value) -> Result<Option<Grammar>, AppError> {
    let Some(obj) = so.as_object() else {
        return Err(AppError::invalid("structured_outputs", "must be an object"));
    };
    let mut found = Vec::new();
    for (key, v) in obj {
        if v.is_null() {
            continue;
        }
        let g = match key.as_str() {
            "json" => Grammar {
                kind: "json-schema".into(),
                text: match v {
                    Value::String(s) => s.clone(),
                    other => other.to_string(),
                },
            },
            "json_object" if v.as_bool() == Some(true) => Grammar {
                kind: "json-schema".into(),
                text: r#"{"type":"object"}"#.into(),
            },
            "regex" | "grammar" => Grammar {
                kind: if key == "regex" { "regex" } else { "lark" }.into(),
                text: v
                    .as_str()
                    .ok_or_else(|| {
                        AppError::invalid("structured_outputs", format!("{key} must be a string"))
                    })?
                    .to_string(),
            },
            "choice" => {
                let ok = v
                    .as_array()
                    .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_string));
                if !ok {
                    return Err(AppError::invalid(
                        "structured_outputs.choice",
                        "must be a non-empty list of strings",
                    ));
                }
                Grammar {
                    kind: "choice".into(),
                    text: v.to_string(),
                }
            }
            "json_object"
            | "disable_any_whitespace"
            | "disable_fallback"
            | "disable_additional_properties"
            | "whitespace_pattern" => continue,
            other => {
                return Err(AppError::invalid(
                    "structured_outputs",
                    format!(
                        "unknown or unsupported key `{other}` (json, regex, choice and grammar are served)"
                    ),
                ));
            }
        };
        found.push(g);
    }
    if found.len() > 1 {
        return Err(AppError::invalid(
            "structured_outputs",
            "give exactly one of json, regex, choice or grammar",
        ));
    }
    Ok(found.pop())
}

/// The fields of a chat request that concern agents.
pub struct AgentFields<'a> {
    pub tools: Option<&'a Value>,
    pub tool_choice: Option<&'a Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<&'a Value>,
    pub structured_outputs: Option<&'a Value>,
}

/// Asks the parser plugin for the grammar that forces tool calls: (format, tools JSON, choice,
/// parallel) to a Lark grammar.
pub type CallGrammar<'a> = dyn FnMut(&str, &str, &str, bool) -> Result<String, String> + 'a;

/// Works out what a chat request asks for.
pub fn plan(
    f: &AgentFields<'_>,
    formats: &Formats,
    call_grammar: &mut CallGrammar<'_>,
) -> Result<AgentPlan, AppError> {
    let mut plan = AgentPlan::default();
    let tools: &[Value] = match f.tools {
        None | Some(Value::Null) => &[],
        Some(Value::Array(a)) => a,
        Some(_) => return Err(AppError::invalid("tools", "tools must be a list")),
    };
    let names = tool_names(tools)?;
    let choice = tool_choice(f.tool_choice)?;
    let tools_json = if tools.is_empty() {
        String::new()
    } else {
        Value::Array(tools.to_vec()).to_string()
    };
    let mut grammar = output_grammar(f)?;
    let mut tool_format = String::new();
    if !tools.is_empty() {
        plan.tools_in_template = true;
        if choice != ToolChoice::None {
            let Some(format) = formats.tool.clone() else {
                return Err(AppError::Unsupported(
                    "tool calls with this model: its chat template shows no known tool-call \
                     format; start the server with --tool-call-parser (hermes, qwen3_coder, \
                     llama3_json, granite), or send tool_choice \"none\""
                        .into(),
                ));
            };
            if let Some(c) = forced_call(&choice, &names)? {
                if grammar.is_some() {
                    return Err(AppError::invalid(
                        "tool_choice",
                        "a forced tool call cannot be combined with response_format or structured_outputs",
                    ));
                }
                let parallel = f.parallel_tool_calls.unwrap_or(true) && c == "required";
                let text = call_grammar(&format, &tools_json, &c, parallel)
                    .map_err(|e| AppError::invalid("tools", e))?;
                grammar = Some(Grammar {
                    kind: "lark".into(),
                    text,
                });
            }
            tool_format = format;
        }
    } else if matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(AppError::invalid(
            "tool_choice",
            "tool_choice requires tools",
        ));
    }
    let reasoning = formats.reasoning.clone().unwrap_or_default();
    if !tool_format.is_empty() || !reasoning.is_empty() {
        plan.parse = Some(ParseRequest {
            tool_format,
            reasoning_format: reasoning,
            reasoning_open: false,
            tools: tools_json,
        });
    }
    plan.grammar = grammar;
    Ok(plan)
}

/// The grammar `response_format` or `structured_outputs` asks for (not both).
fn output_grammar(f: &AgentFields<'_>) -> Result<Option<Grammar>, AppError> {
    let grammar = match f.response_format.filter(|v| !v.is_null()) {
        Some(rf) => response_format_grammar(rf)?,
        None => None,
    };
    let Some(so) = f.structured_outputs.filter(|v| !v.is_null()) else {
        return Ok(grammar);
    };
    let g = structured_outputs_grammar(so)?;
    if g.is_some() && grammar.is_some() {
        return Err(AppError::invalid(
            "structured_outputs",
            "give either response_format or structured_outputs, not both",
        ));
    }
    Ok(grammar.or(g))
}

/// The call a `tool_choice` forces: `required` (any tool) or a named tool that `names` holds.
fn forced_call(choice: &ToolChoice, names: &[String]) -> Result<Option<String>, AppError> {
    Ok(match choice {
        ToolChoice::Required => Some("required".to_string()),
        ToolChoice::Named(n) => {
            if !names.contains(n) {
                return Err(AppError::invalid(
                    "tool_choice",
                    format!("no tool named `{n}` in tools"),
                ));
            }
            Some(n.clone())
        }
        _ => None,
    })
}

/// Whether the response starts inside its reasoning section: the rendered prompt ends by
/// opening it (`<think>`, a thinking model's generation prompt) and the server parses
/// reasoning. Not when a grammar constrains the response: a constrained answer (JSON, forced
/// tool calls) has no room for reasoning, so it is parsed as the answer from its first
/// character (otherwise the whole answer would come back as reasoning).
pub fn starts_in_reasoning(plan: &AgentPlan, rendered: &str) -> bool {
    plan.grammar.is_none()
        && plan
            .parse
            .as_ref()
            .is_some_and(|p| !p.reasoning_format.is_empty())
        && rendered.trim_end().ends_with("<think>")
}

/// The most a grammar may cost to compile (with its first mask) on the request path: an
/// engine compiles it again when the request arrives, on its own thread, and must not stall
/// the other requests' steps for longer.
pub const MAX_COMPILE: std::time::Duration = std::time::Duration::from_millis(200);

/// Compiles `grammar` and computes its first mask with `check` (a constraint plugin instance
/// of the request path), within [`MAX_COMPILE`]: a grammar the plugin refuses, or one that costs
/// more, is the client's error (400). Blocking: run it off the async threads.
pub fn check(
    check: &std::sync::Mutex<Box<dyn crate::policy::Constrainer>>,
    grammar: &Grammar,
    mask_words: usize,
) -> Result<(), AppError> {
    let field = "response_format / structured_outputs / tools";
    let mut c = check.lock().unwrap_or_else(|p| p.into_inner());
    let start = std::time::Instant::now();
    let matcher = c.open(&grammar.kind, &grammar.text).map_err(|e| match e {
        crate::policy::ConstraintError::Grammar(m) => AppError::invalid(field, m),
        crate::policy::ConstraintError::Failed(m) => AppError::Internal(m),
    })?;
    let mut mask = vec![0u32; mask_words];
    let first = c.next(matcher, &[], &mut mask);
    c.close(matcher);
    first.map_err(|m| AppError::invalid(field, format!("the grammar allows no answer: {m}")))?;
    let took = start.elapsed();
    if took > MAX_COMPILE {
        return Err(AppError::invalid(
            field,
            format!(
                "the grammar took {} ms to compile, more than the {} ms allowed",
                took.as_millis(),
                MAX_COMPILE.as_millis()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn fields<'a>(tools: &'a Value, choice: &'a Value) -> AgentFields<'a> {
        AgentFields {
            tools: Some(tools),
            tool_choice: Some(choice),
            parallel_tool_calls: None,
            response_format: None,
            structured_outputs: None,
        }
    }

    fn hermes() -> Formats {
        Formats {
            tool: Some("hermes".into()),
            reasoning: None,
        }
    }

    #[test]
    fn forced_choices_ask_the_parser_for_a_call_grammar() {
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]);
        let asked = std::cell::RefCell::new(Vec::new());
        let mut grammar = |f: &str, _t: &str, c: &str, p: bool| {
            asked.borrow_mut().push((f.to_string(), c.to_string(), p));
            Ok("start: \"x\"".to_string())
        };
        let p = plan(&fields(&tools, &json!("required")), &hermes(), &mut grammar).unwrap();
        assert_eq!(p.grammar.as_ref().map(|g| g.kind.as_str()), Some("lark"));
        assert_eq!(
            p.parse.as_ref().map(|r| r.tool_format.as_str()),
            Some("hermes")
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        plan(&fields(&tools, &named), &hermes(), &mut grammar).unwrap();
        assert_eq!(
            *asked.borrow(),
            vec![
                ("hermes".into(), "required".into(), true),
                ("hermes".into(), "get_weather".into(), false)
            ]
        );
        // auto parses without a grammar; none neither parses nor constrains.
        let auto = plan(&fields(&tools, &json!("auto")), &hermes(), &mut grammar).unwrap();
        assert!(auto.grammar.is_none() && auto.parse.is_some());
        let none = plan(&fields(&tools, &json!("none")), &hermes(), &mut grammar).unwrap();
        assert!(none.grammar.is_none() && none.parse.is_none() && none.tools_in_template);
        // Unknown names, and tools without a format, are refused.
        let other = json!({"type": "function", "function": {"name": "nope"}});
        assert!(plan(&fields(&tools, &other), &hermes(), &mut grammar).is_err());
        assert!(
            plan(
                &fields(&tools, &json!("auto")),
                &Formats::default(),
                &mut grammar
            )
            .is_err()
        );
    }

    #[test]
    fn response_formats_and_structured_outputs_become_grammars() {
        let none = json!(null);
        let mut no_grammar = |_: &str, _: &str, _: &str, _: bool| Err("unused".to_string());
        let cases = [
            (json!({"type": "json_object"}), None, "json-schema"),
            (
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
                None,
                "json-schema",
            ),
            (none.clone(), Some(json!({"regex": "[0-9]+"})), "regex"),
            (
                none.clone(),
                Some(json!({"choice": ["yes", "no"]})),
                "choice",
            ),
            (
                none.clone(),
                Some(json!({"grammar": "start: \"a\""})),
                "lark",
            ),
        ];
        for (rf, so, kind) in cases {
            let f = AgentFields {
                tools: None,
                tool_choice: None,
                parallel_tool_calls: None,
                response_format: Some(&rf),
                structured_outputs: so.as_ref(),
            };
            let p = plan(&f, &Formats::default(), &mut no_grammar).unwrap();
            assert_eq!(
                p.grammar.map(|g| g.kind),
                Some(kind.to_string()),
                "{rf} {so:?}"
            );
        }
        let bad = json!({"type": "json_schema"});
        let f = AgentFields {
            tools: None,
            tool_choice: None,
            parallel_tool_calls: None,
            response_format: Some(&bad),
            structured_outputs: None,
        };
        assert!(plan(&f, &Formats::default(), &mut no_grammar).is_err());
    }

    #[test]
    fn a_constrained_answer_never_starts_inside_reasoning() {
        let thinking = AgentPlan {
            parse: Some(ParseRequest {
                reasoning_format: "qwen3".into(),
                ..ParseRequest::default()
            }),
            ..AgentPlan::default()
        };
        let prompt = "<|im_start|>assistant\n<think>\n";
        assert!(starts_in_reasoning(&thinking, prompt));
        assert!(!starts_in_reasoning(&thinking, "<|im_start|>assistant\n"));
        let constrained = AgentPlan {
            grammar: Some(Grammar {
                kind: "json-schema".into(),
                text: "{}".into(),
            }),
            ..thinking.clone()
        };
        assert!(!starts_in_reasoning(&constrained, prompt));
        assert!(!starts_in_reasoning(&AgentPlan::default(), prompt));
    }

    #[test]
    fn formats_are_inferred_from_the_chat_template() {
        let f = Formats::resolve(None, None, Some("{{ '<tool_call>' }} <think>"));
        assert_eq!(f.tool.as_deref(), Some("hermes"));
        assert_eq!(f.reasoning.as_deref(), Some("qwen3"));
        let f = Formats::resolve(Some("granite"), None, Some("<function=x>"));
        assert_eq!(f.tool.as_deref(), Some("granite"));
        assert_eq!(Formats::resolve(None, None, None), Formats::default());
    }
}
