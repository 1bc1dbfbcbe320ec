//! The tokenizer a GGUF file describes in `tokenizer.ggml.*`, rebuilt as Hugging Face
//! `tokenizer.json` and `tokenizer_config.json` contents, the way transformers rebuilds it
//! when it loads a GGUF (so both tokenize alike).
//!
//! Supported: `tokenizer.ggml.model = "gpt2"` (byte-level BPE: the vocabulary, its merges, the
//! GPT-2 split, control tokens as special tokens), with the pre-tokenizer split regex chosen by
//! `tokenizer.ggml.pre` where transformers knows a special one. SentencePiece vocabularies
//! (`llama`) are an error that says so.

use serde_json::{Value as Json, json};

use super::file::{GgufFile, Value};
use crate::model::ModelError;

/// llama.cpp's token types.
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// The split regex of pre-tokenizer kinds that differ from GPT-2's (as transformers maps
/// them). Others use GPT-2's split, built into the byte-level pre-tokenizer.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split_for(pre: &str) -> Option<&'static str> {
    match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "dbrx"
        | "smaug-bpe" | "lfm2" => Some(LLAMA3_SPLIT),
        "qwen2" | "deepseek-r1-qwen" | "megrez" => Some(QWEN2_SPLIT),
        _ => None,
    }
}

/// GPT-2's reversible byte → printable character table.
pub fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('?')
        };
    }
    table
}

fn strings(file: &GgufFile, key: &str) -> Result<Vec<String>, ModelError> {
    let bad = || ModelError::Config {
        path: file.path.clone(),
        message: format!("GGUF metadata `{key}` is missing or not a list of strings"),
    };
    file.get(key)
        .and_then(Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|v| v.as_str().map(str::to_string).ok_or_else(bad))
        .collect()
}

/// `(tokenizer.json, tokenizer_config.json)` contents for the file's tokenizer.
pub fn tokenizer_files(file: &GgufFile) -> Result<(Vec<u8>, Vec<u8>), ModelError> {
    let err = |message: String| ModelError::Config {
        path: file.path.clone(),
        message,
    };
    let model = file
        .get("tokenizer.ggml.model")
        .and_then(Value::as_str)
        .ok_or_else(|| err("GGUF metadata lacks `tokenizer.ggml.model`".into()))?;
    if model != "gpt2" {
        return Err(ModelError::Unsupported(format!(
            "{}: GGUF tokenizer `{model}` (only byte-level BPE, `gpt2`, is rebuilt from GGUF \
             metadata; serve the model's Hugging Face folder instead)",
            file.path.display()
        )));
    }
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = file
        .get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_i64().unwrap_or(1)).collect())
        .unwrap_or_default();
    let table = bytes_to_unicode();
    let alphabet: std::collections::HashSet<char> = table.iter().copied().collect();
    let spell = |t: &str| -> String {
        if t.chars().all(|c| alphabet.contains(&c)) {
            t.to_string()
        } else {
            t.bytes().map(|b| table[b as usize]).collect()
        }
    };
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(spell(t), json!(id));
    }
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match m.split_once(' ') {
            Some((a, b)) => Ok(json!([a, b])),
            None => Err(err(format!("merge `{m}` is not two tokens"))),
        })
        .collect::<Result<_, _>>()?;
    let mut added = Vec::new();
    for (id, (t, ty)) in tokens.iter().zip(&types).enumerate() {
        // A control token spelled outside the byte alphabet is a converter mislabel
        // (transformers skips those too).
        let special = *ty == CONTROL && t.chars().all(|c| alphabet.contains(&c));
        if special || *ty == USER_DEFINED {
            added.push(json!({
                "id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            }));
        }
    }
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true,
    });
    let pre = file
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let pre_tokenizer = match split_for(pre) {
        Some(regex) => json!({
            "type": "Sequence",
            "pretokenizers": [
                { "type": "Split", "pattern": { "Regex": regex }, "behavior": "Isolated", "invert": false },
                { "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false },
            ],
        }),
        None => byte_level.clone(),
    };
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    });
    let token_of = |key: &str| {
        file.get(&format!("tokenizer.ggml.{key}"))
            .and_then(Value::as_u64)
            .and_then(|id| tokens.get(id as usize))
            .cloned()
    };
    let mut config = json!({
        // transformers' byte-level tokenizer adds no BOS whatever the file says; chat
        // templates write their own markers.
        "add_bos_token": false,
    });
    for (name, key) in [
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ] {
        if let Some(t) = token_of(key) {
            config[name] = json!(t);
        }
    }
    if let Some(template) = file.get("tokenizer.chat_template").and_then(Value::as_str) {
        config["chat_template"] = json!(template);
    }
    Ok((
        tokenizer.to_string().into_bytes(),
        config.to_string().into_bytes(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_table_is_gpt2s() {
        let t = bytes_to_unicode();
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
