//! Tokenizers: Hugging Face `tokenizer.json` plus `tokenizer_config.json` (special tokens,
//! BOS handling, chat template). The embedded model's tokenizer is compiled into the binary.
//!
//! Encoding and decoding are CPU work: the server calls them on a blocking pool, never on the
//! async event loop.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// The tokenizer shipped with the embedded model.
pub const EMBEDDED_TOKENIZER: &[u8] = include_bytes!("../assets/tokenizer/tokenizer.json");
pub const EMBEDDED_TOKENIZER_CONFIG: &[u8] =
    include_bytes!("../assets/tokenizer/tokenizer_config.json");

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{path}: {message}")]
    Load { path: PathBuf, message: String },
    #[error("tokenizer: {0}")]
    Codec(String),
}

/// A tokenizer with the special-token facts serving needs.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Each token's raw bytes, when the decoder is byte-level (see [`ByteTable`]).
    bytes: Option<ByteTable>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub bos_id: Option<u32>,
    pub eos_ids: Vec<u32>,
    /// Prepend BOS when encoding a prompt (from `add_bos_token`; default: when a BOS exists
    /// and the tokenizer's post-processor does not add it itself).
    pub add_bos: bool,
    pub chat_template: Option<String>,
}

fn token_str(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json`, `tokenizer_config.json` and (if present) `chat_template.jinja`
    /// from a model folder.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let tok_path = dir.join("tokenizer.json");
        let json = std::fs::read(&tok_path).map_err(|e| TokenizerError::Load {
            path: tok_path.clone(),
            message: e.to_string(),
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = std::fs::read(&cfg_path).unwrap_or_else(|_| b"{}".to_vec());
        let mut t = Self::from_bytes(&json, &cfg, &tok_path)?;
        if let Ok(template) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
            t.chat_template = Some(template);
        }
        Ok(t)
    }

    /// The embedded model's tokenizer.
    pub fn embedded() -> Result<Self, TokenizerError> {
        Self::from_bytes(
            EMBEDDED_TOKENIZER,
            EMBEDDED_TOKENIZER_CONFIG,
            Path::new("<embedded tokenizer>"),
        )
    }

    pub fn from_bytes(json: &[u8], config: &[u8], origin: &Path) -> Result<Self, TokenizerError> {
        let load_err = |message: String| TokenizerError::Load {
            path: origin.to_path_buf(),
            message,
        };
        let inner = tokenizers::Tokenizer::from_bytes(json).map_err(|e| load_err(e.to_string()))?;
        let cfg: Value = serde_json::from_slice(config)
            .map_err(|e| load_err(format!("tokenizer_config.json is not valid JSON: {e}")))?;
        let bos_token = token_str(cfg.get("bos_token"));
        let eos_token = token_str(cfg.get("eos_token"));
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));
        let eos_ids = eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .collect();
        let add_bos = cfg
            .get("add_bos_token")
            .and_then(|v| v.as_bool())
            .unwrap_or(false)
            && bos_id.is_some();
        let chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            _ => None,
        };
        let bytes = ByteTable::build(&inner);
        Ok(Self {
            inner,
            bytes,
            bos_token,
            eos_token,
            bos_id,
            eos_ids,
            add_bos,
            chat_template,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes a prompt; `add_special` applies BOS handling.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode(text, add_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special
            && self.add_bos
            && let Some(bos) = self.bos_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| TokenizerError::Codec(e.to_string()))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The raw bytes of every token, when this tokenizer's decoder is GPT-2-style byte-level
    /// (then `decode` is the lossy UTF-8 reading of the tokens' concatenated bytes).
    pub fn byte_table(&self) -> Option<&ByteTable> {
        self.bytes.as_ref()
    }
}

/// GPT-2's reversible byte ↔ printable-character alphabet: bytes that are printable Latin-1
/// stand for themselves; the other 68 (controls, space, DEL, NBSP, soft hyphen) map in order
/// to U+0100 onwards.
pub fn byte_level_char(b: u8) -> char {
    let printable = |x: u8| matches!(x, 33..=126 | 161..=172 | 174..=255);
    if printable(b) {
        return char::from(b);
    }
    let rank = (0..b).filter(|x| !printable(*x)).count() as u32;
    char::from_u32(256 + rank).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// Per-token raw bytes of a byte-level tokenizer, so streaming can cut UTF-8 exactly where the
/// one-shot decode would: `decode(ids)` equals `String::from_utf8_lossy` of the concatenated
/// [`ByteTable::bytes`] of the ids that are kept (special tokens are dropped when skipping
/// them). Mirrors `tokenizers`' byte-level decoder: a token whose every character is in the
/// alphabet stands for those bytes, any other token (an added token with a space, say) for
/// its own UTF-8 text.
#[derive(Debug, Clone)]
pub struct ByteTable {
    pieces: Vec<Box<[u8]>>,
    special: Vec<bool>,
}

impl ByteTable {
    /// `None` unless the decoder is exactly `ByteLevel`.
    fn build(tok: &tokenizers::Tokenizer) -> Option<Self> {
        if !matches!(
            tok.get_decoder(),
            Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_))
        ) {
            return None;
        }
        let mut from_char = std::collections::HashMap::with_capacity(256);
        for b in 0..=255u8 {
            from_char.insert(byte_level_char(b), b);
        }
        // `decode` drops a token whose *text* is a special added token's.
        let added = tok.get_added_tokens_decoder();
        let special_text: std::collections::HashSet<&str> = added
            .values()
            .filter(|t| t.special)
            .map(|t| t.content.as_str())
            .collect();
        let n = added
            .keys()
            .map(|id| *id as usize + 1)
            .max()
            .unwrap_or(0)
            .max(tok.get_vocab_size(true));
        let mut pieces = Vec::with_capacity(n);
        let mut special = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let text = tok.id_to_token(id);
            special.push(text.as_deref().is_some_and(|t| special_text.contains(t)));
            let piece = match text {
                None => Vec::new(),
                Some(t) => t
                    .chars()
                    .map(|c| from_char.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| t.into_bytes()),
            };
            pieces.push(piece.into_boxed_slice());
        }
        Some(Self { pieces, special })
    }

    /// The token's bytes (empty for an id outside the vocabulary, as `decode` skips those).
    pub fn bytes(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], |p| p)
    }

    /// Whether `decode(.., skip_special_tokens = true)` drops this id.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }
}
