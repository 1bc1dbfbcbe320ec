//! Text ⇄ tokens for the server: the Hugging Face tokenizer and the chat template.
//!
//! Owns: a loaded [`crate::tokenizer::Tokenizer`] (BOS handling, EOS ids), the model's chat
//! template compiled once with
//! minijinja (Hugging Face helpers: `raise_exception`, Python string methods, `tojson`,
//! `bos_token` / `eos_token`, `add_generation_prompt`), and the EOS ids generation stops on.
//! Invariants: immutable after load and `Send + Sync`, so one `Arc<TextCodec>` is shared by the
//! blocking pool. Every method here is CPU work: callers run it off the async event loop
//! (`spawn_blocking`). It must not know about HTTP or engines.

use std::path::Path;

use crate::tokenizer::{Tokenizer, TokenizerError};
use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("cannot load {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    #[error(
        "the model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja)"
    )]
    NoChatTemplate,
    #[error("invalid chat template: {0}")]
    BadTemplate(String),
    #[error("chat template failed: {0}")]
    Render(String),
}

/// Tokenizer plus chat template of one model.
pub struct TextCodec {
    tokenizer: Tokenizer,
    env: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    eos_token_ids: Vec<u32>,
}

impl std::fmt::Debug for TextCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextCodec")
            .field("vocab", &self.vocab_size())
            .field("chat_template", &self.env.is_some())
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

fn load_err(e: TokenizerError) -> TextError {
    match e {
        TokenizerError::Load { path, message } => TextError::Load {
            path: path.display().to_string(),
            message,
        },
        TokenizerError::Codec(m) => TextError::Tokenizer(m),
    }
}

impl TextCodec {
    /// Wraps a loaded tokenizer and compiles its chat template.
    pub fn new(tokenizer: Tokenizer) -> Result<Self, TextError> {
        let env = match tokenizer.chat_template.clone() {
            Some(src) => Some(build_env(src)?),
            None => None,
        };
        Ok(Self {
            bos_token: tokenizer.bos_token.clone().unwrap_or_default(),
            eos_token: tokenizer.eos_token.clone().unwrap_or_default(),
            eos_token_ids: tokenizer.eos_ids.clone(),
            tokenizer,
            env,
        })
    }

    /// The embedded model's tokenizer and template.
    pub fn embedded() -> Result<Self, TextError> {
        Self::new(Tokenizer::embedded().map_err(load_err)?)
    }

    /// Loads a model folder's tokenizer files (see `tokenizer::Tokenizer::from_dir`) plus the
    /// extra EOS ids of `generation_config.json`, if any.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let mut codec = Self::new(Tokenizer::from_dir(dir).map_err(load_err)?)?;
        let gen_path = dir.join("generation_config.json");
        if let Ok(bytes) = std::fs::read(&gen_path) {
            let v: Value = serde_json::from_slice(&bytes).map_err(|e| TextError::Load {
                path: gen_path.display().to_string(),
                message: e.to_string(),
            })?;
            let ids: Vec<u32> = match v.get("eos_token_id") {
                Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Some(Value::Array(a)) => a
                    .iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect(),
                _ => Vec::new(),
            };
            for id in ids {
                if !codec.eos_token_ids.contains(&id) {
                    codec.eos_token_ids.push(id);
                }
            }
        }
        Ok(codec)
    }

    /// Builds a codec from file contents. `chat_template` overrides the config's template.
    pub fn from_parts(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
        chat_template: Option<String>,
    ) -> Result<Self, TextError> {
        let mut tok = Tokenizer::from_bytes(
            tokenizer_json,
            tokenizer_config_json.unwrap_or(b"{}"),
            Path::new("<tokenizer>"),
        )
        .map_err(load_err)?;
        if chat_template.is_some() {
            tok.chat_template = chat_template;
        }
        Self::new(tok)
    }

    pub fn vocab_size(&self) -> u32 {
        self.tokenizer.vocab_size() as u32
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.tokenizer.chat_template.as_deref()
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map_err(load_err)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(load_err)
    }

    /// Each token's raw bytes, when the tokenizer is byte-level (streaming uses them to cut
    /// UTF-8 exactly where a one-shot decode would).
    pub fn byte_table(&self) -> Option<&crate::tokenizer::ByteTable> {
        self.tokenizer.byte_table()
    }

    /// Renders the chat template over `messages` (a JSON list of `{role, content, ...}`).
    pub fn render_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        self.render_chat_with(messages, add_generation_prompt, &TemplateExtras::default())
    }

    /// [`Self::render_chat`] with the request's tools and extra template variables.
    pub fn render_chat_with(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        extras: &TemplateExtras,
    ) -> Result<String, TextError> {
        let env = self.env.as_ref().ok_or(TextError::NoChatTemplate)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| TextError::BadTemplate(e.to_string()))?;
        let fixed = context! {
            messages => minijinja::Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => extras.tools.as_ref().map(minijinja::Value::from_serialize),
        };
        // The request's own variables first: a kwarg never replaces `messages` or `tools`.
        let ctx = context! {
            ..fixed,
            ..minijinja::Value::from_serialize(&extras.kwargs)
        };
        tmpl.render(ctx)
            .map_err(|e| TextError::Render(describe(&e)))
    }
}

/// What a chat request gives its template besides the messages: the tool definitions (the
/// template's `tools`, absent when `None`) and `chat_template_kwargs`.
#[derive(Debug, Clone, Default)]
pub struct TemplateExtras {
    pub tools: Option<Value>,
    pub kwargs: serde_json::Map<String, Value>,
}

/// minijinja errors nest their cause; the innermost message is what a user needs.
fn describe(e: &JinjaError) -> String {
    match e.detail() {
        Some(d) => d.to_string(),
        None => e.to_string(),
    }
}

fn build_env(src: String) -> Result<Environment<'static>, TextError> {
    let mut env = Environment::new();
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> Result<String, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, msg))
        },
    );
    // Templates run over user-supplied messages: keep recursion shallow.
    env.set_recursion_limit(64);
    env.add_template_owned("chat", src)
        .map_err(|e| TextError::BadTemplate(e.to_string()))?;
    Ok(env)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::mock_tokenizer;
    use serde_json::json;

    fn codec() -> TextCodec {
        TextCodec::from_parts(
            mock_tokenizer::tokenizer_json().as_bytes(),
            Some(mock_tokenizer::tokenizer_config_json().as_bytes()),
            None,
        )
        .unwrap()
    }

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let c = codec();
        let msgs = json!([{"role": "system", "content": " be brief "}, {"role": "user", "content": "hello"}]);
        let out = c.render_chat(&msgs, true).unwrap();
        assert_eq!(
            out,
            "<|bos|><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_gen = c.render_chat(&msgs, false).unwrap();
        assert!(!no_gen.ends_with("assistant\n"));
        assert_eq!(c.eos_token_ids().len(), 1);
    }

    /// A template that shows what reaches it: the tools, a kwarg, each message's tool calls
    /// (name and the `x` of their arguments) and the call a tool message answers.
    const AGENT_TEMPLATE: &str = "{% if tools %}TOOLS {{ tools | map(attribute='function') \
        | map(attribute='name') | join(',') }};{% endif %}\
        {% if enable_thinking is defined and not enable_thinking %}NOTHINK;{% endif %}\
        {% for m in messages %}{{ m.role }}:{{ m.content }}\
        {% for c in m.tool_calls or [] %}[{{ c.function.name }} x={{ c.function.arguments.x }}]{% endfor %}\
        {% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %};{% endfor %}";

    #[test]
    fn tools_and_template_kwargs_reach_the_template_and_never_replace_its_variables() {
        let c = TextCodec::from_parts(
            mock_tokenizer::tokenizer_json().as_bytes(),
            Some(mock_tokenizer::tokenizer_config_json().as_bytes()),
            Some(AGENT_TEMPLATE.to_string()),
        )
        .unwrap();
        let msgs = json!([
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 3}}}]},
            {"role": "tool", "content": "42", "tool_call_id": "c1"}
        ]);
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), json!(false));
        // A kwarg named like one of the request's own variables does not replace it.
        kwargs.insert("messages".into(), json!([]));
        let extras = TemplateExtras {
            tools: Some(json!([{"type": "function", "function": {"name": "f"}},
                               {"type": "function", "function": {"name": "g"}}])),
            kwargs,
        };
        let out = c.render_chat_with(&msgs, false, &extras).unwrap();
        assert_eq!(
            out,
            "TOOLS f,g;NOTHINK;user:hi;assistant:[f x=3];tool:42<c1>;"
        );
        // Without extras: no tools, thinking left to the template's default.
        let plain = c.render_chat(&msgs, false).unwrap();
        assert_eq!(plain, "user:hi;assistant:[f x=3];tool:42<c1>;");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let c = codec();
        let err = c
            .render_chat(&json!([{"role": "wizard", "content": "x"}]), true)
            .unwrap_err();
        assert!(err.to_string().contains("unknown role: wizard"), "{err}");
    }

    #[test]
    fn python_string_methods_and_list_templates() {
        let cfg = json!({"chat_template": [
            {"name": "tool_use", "template": "nope"},
            {"name": "default", "template": "{% for m in messages %}{{ m.content.strip().upper() }}{% endfor %}"}
        ]});
        let c = TextCodec::from_parts(
            mock_tokenizer::tokenizer_json().as_bytes(),
            Some(cfg.to_string().as_bytes()),
            None,
        )
        .unwrap();
        assert_eq!(
            c.render_chat(&json!([{"role": "user", "content": " hi "}]), true)
                .unwrap(),
            "HI"
        );
    }

    #[test]
    fn embedded_tokenizer_renders_and_round_trips() {
        let c = TextCodec::embedded().unwrap();
        assert!(c.has_chat_template());
        assert!(!c.eos_token_ids().is_empty());
        let text = c
            .render_chat(&json!([{"role": "user", "content": "hello"}]), true)
            .unwrap();
        assert!(text.contains("hello"));
        let ids = c.encode(&text, false).unwrap();
        assert!(ids.iter().all(|t| *t < c.vocab_size()));
        assert_eq!(c.decode(&ids, false).unwrap(), text);
    }

    #[test]
    fn missing_template_is_reported() {
        let c =
            TextCodec::from_parts(mock_tokenizer::tokenizer_json().as_bytes(), None, None).unwrap();
        assert!(matches!(
            c.render_chat(&json!([]), true),
            Err(TextError::NoChatTemplate)
        ));
    }
}
