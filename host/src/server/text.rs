//! Text ⇄ tokens for the server: the Hugging Face tokenizer and the chat template.
//!
//! Owns: a loaded `tokenizers::Tokenizer`, the model's chat template compiled once with
//! minijinja (Hugging Face helpers: `raise_exception`, Python string methods, `tojson`,
//! `bos_token` / `eos_token`, `add_generation_prompt`), and the EOS ids generation stops on.
//! Invariants: immutable after load and `Send + Sync`, so one `Arc<TextCodec>` is shared by the
//! blocking pool. Every method here is CPU work: callers run it off the async event loop
//! (`spawn_blocking`). It must not know about HTTP or engines.

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, context};
use serde_json::Value;
use tokenizers::Tokenizer;

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

/// `bos_token` / `eos_token` in tokenizer_config.json are a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `chat_template` is a string or a list of `{name, template}` (the one named "default" wins).
fn template_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Array(items) => {
            let pick = |want: Option<&str>| {
                items.iter().find_map(|it| {
                    let name = it.get("name").and_then(Value::as_str);
                    if want.is_none() || name == want {
                        it.get("template")
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    } else {
                        None
                    }
                })
            };
            pick(Some("default")).or_else(|| pick(None))
        }
        _ => None,
    }
}

fn read(path: &Path) -> Result<Option<Vec<u8>>, TextError> {
    match std::fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TextError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        }),
    }
}

impl TextCodec {
    /// Loads `tokenizer.json`, `tokenizer_config.json`, and optionally `chat_template.jinja`
    /// and `generation_config.json` (extra EOS ids) from a model folder.
    pub fn from_dir(dir: &Path) -> Result<Self, TextError> {
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = read(&tok_path)?.ok_or_else(|| TextError::Load {
            path: tok_path.display().to_string(),
            message: "not found".into(),
        })?;
        let config = read(&dir.join("tokenizer_config.json"))?;
        let jinja = read(&dir.join("chat_template.jinja"))?
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        let mut codec = Self::from_parts(&tokenizer, config.as_deref(), jinja)?;
        if let Some(gen_cfg) = read(&dir.join("generation_config.json"))? {
            let v: Value = serde_json::from_slice(&gen_cfg).map_err(|e| TextError::Load {
                path: dir.join("generation_config.json").display().to_string(),
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
        let tokenizer = Tokenizer::from_bytes(tokenizer_json).map_err(|e| TextError::Load {
            path: "tokenizer.json".into(),
            message: e.to_string(),
        })?;
        let config: Value = match tokenizer_config_json {
            Some(b) => serde_json::from_slice(b).map_err(|e| TextError::Load {
                path: "tokenizer_config.json".into(),
                message: e.to_string(),
            })?,
            None => Value::Null,
        };
        let bos_token = token_text(config.get("bos_token")).unwrap_or_default();
        let eos_token = token_text(config.get("eos_token")).unwrap_or_default();
        let eos_token_ids = tokenizer.token_to_id(&eos_token).into_iter().collect();
        let template = chat_template.or_else(|| template_text(config.get("chat_template")));
        let env = match template {
            Some(src) => Some(build_env(src)?),
            None => None,
        };
        Ok(Self {
            tokenizer,
            env,
            bos_token,
            eos_token,
            eos_token_ids,
        })
    }

    pub fn vocab_size(&self) -> u32 {
        self.tokenizer.get_vocab_size(true) as u32
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn has_chat_template(&self) -> bool {
        self.env.is_some()
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TextError> {
        self.tokenizer
            .decode(ids, skip_special_tokens)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// Renders the chat template over `messages` (a JSON list of `{role, content, ...}`).
    pub fn render_chat(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let env = self.env.as_ref().ok_or(TextError::NoChatTemplate)?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| TextError::BadTemplate(e.to_string()))?;
        tmpl.render(context! {
            messages => minijinja::Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        })
        .map_err(|e| TextError::Render(describe(&e)))
    }
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
    fn missing_template_is_reported() {
        let c =
            TextCodec::from_parts(mock_tokenizer::tokenizer_json().as_bytes(), None, None).unwrap();
        assert!(matches!(
            c.render_chat(&json!([]), true),
            Err(TextError::NoChatTemplate)
        ));
    }
}
