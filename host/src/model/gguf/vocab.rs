//! The tokenizer a GGUF file describes in `tokenizer.ggml.*`, rebuilt as Hugging Face
//! `tokenizer.json` and `tokenizer_config.json` contents, the way transformers rebuilds it
//! when it loads a GGUF (so both tokenize alike).
//!
//! Supported:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE (the vocabulary, its merges, the GPT-2
//!   split, control tokens as special tokens), with the pre-tokenizer split regex chosen by
//!   `tokenizer.ggml.pre` where transformers knows a special one.
//! - `tokenizer.ggml.model = "llama"`: a SentencePiece BPE vocabulary (Llama 2, Mistral): the
//!   pieces as spelled (`▁` for a space, `<0x0A>` byte-fallback tokens), merges recovered from
//!   the pieces and their scores as transformers recovers them, a `Metaspace` pre-tokenizer that
//!   prefixes the first word with `▁`, byte fallback, and BOS added unless the file says not.
//!
//! Other vocabularies (`t5` unigram, `bert` word-piece, ...) are an error that says so.

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
    match model {
        "gpt2" => byte_level_files(file),
        "llama" => sentencepiece_files(file),
        other => Err(ModelError::Unsupported(format!(
            "{}: GGUF tokenizer `{other}` (rebuilt from GGUF metadata: `gpt2` byte-level BPE \
             and `llama` SentencePiece BPE; serve the model's Hugging Face folder instead)",
            file.path.display()
        ))),
    }
}

fn token_types(file: &GgufFile) -> Vec<i64> {
    file.get("tokenizer.ggml.token_type")
        .and_then(Value::as_array)
        .map(|a| a.iter().map(|v| v.as_i64().unwrap_or(1)).collect())
        .unwrap_or_default()
}

fn added_token(id: usize, content: &str, special: bool) -> Json {
    json!({
        "id": id, "content": content, "single_word": false, "lstrip": false,
        "rstrip": false, "normalized": false, "special": special,
    })
}

/// `tokenizer_config.json`: the special tokens by name, BOS handling and the chat template.
fn tokenizer_config(file: &GgufFile, tokens: &[String], add_bos: bool) -> Json {
    let token_of = |key: &str| {
        file.get(&format!("tokenizer.ggml.{key}"))
            .and_then(Value::as_u64)
            .and_then(|id| tokens.get(id as usize))
            .cloned()
    };
    let mut config = json!({ "add_bos_token": add_bos });
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
    config
}

fn byte_level_files(file: &GgufFile) -> Result<(Vec<u8>, Vec<u8>), ModelError> {
    let err = |message: String| ModelError::Config {
        path: file.path.clone(),
        message,
    };
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let merges = strings(file, "tokenizer.ggml.merges")?;
    let types = token_types(file);
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
            added.push(added_token(id, t, special));
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
    // transformers' byte-level tokenizer adds no BOS whatever the file says; chat templates
    // write their own markers.
    let config = tokenizer_config(file, &tokens, false);
    Ok((
        tokenizer.to_string().into_bytes(),
        config.to_string().into_bytes(),
    ))
}

/// A SentencePiece BPE vocabulary (`tokenizer.ggml.model = "llama"`) as transformers'
/// `LlamaTokenizer` holds it: BPE with byte fallback over the pieces as spelled, a `Metaspace`
/// pre-tokenizer (spaces become `▁`, the first word gets one), a decoder that turns `▁` back
/// into spaces, `<0xNN>` tokens into bytes and drops the leading space.
fn sentencepiece_files(file: &GgufFile) -> Result<(Vec<u8>, Vec<u8>), ModelError> {
    let tokens = strings(file, "tokenizer.ggml.tokens")?;
    let types = token_types(file);
    let scores: Option<Vec<f32>> = match file.get("tokenizer.ggml.scores") {
        None => None,
        Some(v) => Some(
            v.as_array()
                .ok_or(())
                .and_then(|a| {
                    a.iter()
                        .map(|s| s.as_f64().map(|f| f as f32).ok_or(()))
                        .collect::<Result<Vec<_>, _>>()
                })
                .ok()
                .filter(|s| s.len() == tokens.len())
                .ok_or_else(|| ModelError::Config {
                    path: file.path.clone(),
                    message: format!(
                        "GGUF metadata `tokenizer.ggml.scores` must hold one number per token \
                         ({} tokens)",
                        tokens.len()
                    ),
                })?,
        ),
    };
    let merges: Vec<Json> = match file.get("tokenizer.ggml.merges") {
        Some(_) => strings(file, "tokenizer.ggml.merges")?
            .iter()
            .map(|m| match m.split_once(' ') {
                Some((a, b)) => Ok(json!([a, b])),
                None => Err(ModelError::Config {
                    path: file.path.clone(),
                    message: format!("merge `{m}` is not two tokens"),
                }),
            })
            .collect::<Result<_, _>>()?,
        None => merges_from_pieces(&tokens, scores.as_deref())
            .into_iter()
            .map(|(a, b)| json!([a, b]))
            .collect(),
    };
    let mut vocab = serde_json::Map::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), json!(id));
    }
    // Special: every control token, and the tokens the config names (transformers adds its
    // bos/eos/unk/pad tokens as special ones). User-defined tokens match whole, not special.
    let named: Vec<u64> = [
        "bos_token_id",
        "eos_token_id",
        "unknown_token_id",
        "padding_token_id",
    ]
    .iter()
    .filter_map(|k| {
        file.get(&format!("tokenizer.ggml.{k}"))
            .and_then(Value::as_u64)
    })
    .collect();
    let mut added = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == CONTROL || named.contains(&(id as u64)) {
            added.push(added_token(id, t, true));
        } else if ty == USER_DEFINED {
            added.push(added_token(id, t, false));
        }
    }
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Metaspace", "replacement": SPACE_MARK, "prepend_scheme": "first", "split": false,
        },
        "post_processor": null,
        "decoder": {
            "type": "Sequence",
            "decoders": [
                { "type": "Replace", "pattern": { "String": SPACE_MARK }, "content": " " },
                { "type": "ByteFallback" },
                { "type": "Fuse" },
                { "type": "Strip", "content": " ", "start": 1, "stop": 0 },
            ],
        },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    });
    // llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(Value::as_bool)
        .unwrap_or(true);
    let config = tokenizer_config(file, &tokens, add_bos);
    Ok((
        tokenizer.to_string().into_bytes(),
        config.to_string().into_bytes(),
    ))
}

/// SentencePiece's space marker.
const SPACE_MARK: &str = "\u{2581}";

/// The BPE merges a SentencePiece vocabulary implies (a GGUF stores none): every split of a
/// piece into two pieces that are both in the vocabulary, best piece first. With scores, a
/// merge ranks by the score of the piece it makes (higher first); without, by that piece's id
/// (lower first); ties go to the longer left, then the longer right part, then the order
/// found. Splits of one piece are found in the order of their parts' ids. This is the order
/// transformers derives, so both tokenize alike.
pub fn merges_from_pieces(tokens: &[String], scores: Option<&[f32]>) -> Vec<(String, String)> {
    use std::collections::HashMap;
    // The last id of a piece spelled twice, as a dict built in order keeps it.
    let ids: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut found: Vec<(&str, &str, usize)> = Vec::new();
    for piece in tokens {
        if !seen.insert(piece.as_str()) {
            continue;
        }
        let mut local: Vec<(&str, &str, usize)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (l, r) = piece.split_at(at);
                (ids.contains_key(l) && ids.contains_key(r)).then_some((l, r, ids[piece.as_str()]))
            })
            .collect();
        local.sort_by_key(|(l, r, _)| (ids[l], ids[r]));
        found.extend(local);
    }
    let chars = |s: &str| s.chars().count();
    match scores {
        Some(scores) => found.sort_by(|a, b| {
            scores[b.2]
                .partial_cmp(&scores[a.2])
                .unwrap_or(std::cmp::Ordering::Equal)
                .then_with(|| chars(b.0).cmp(&chars(a.0)))
                .then_with(|| chars(b.1).cmp(&chars(a.1)))
        }),
        None => found.sort_by(|a, b| {
            a.2.cmp(&b.2)
                .then_with(|| chars(a.0).cmp(&chars(b.0)))
                .then_with(|| chars(a.1).cmp(&chars(b.1)))
        }),
    }
    found
        .into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
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

    #[test]
    fn sentencepiece_merges_follow_scores_then_lengths() {
        let tokens: Vec<String> = [
            "<unk>",
            "\u{2581}",
            "a",
            "b",
            "ab",
            "\u{2581}a",
            "\u{2581}ab",
        ]
        .iter()
        .map(|t| t.to_string())
        .collect();
        let pairs = |m: Vec<(String, String)>| -> Vec<String> {
            m.into_iter().map(|(l, r)| format!("{l}+{r}")).collect()
        };
        // `▁ab` splits two ways at one score: the longer left part ranks first.
        let scores = [0.0, -10.0, -10.0, -10.0, -1.0, -2.0, -3.0];
        assert_eq!(
            pairs(merges_from_pieces(&tokens, Some(&scores))),
            ["a+b", "\u{2581}+a", "\u{2581}a+b", "\u{2581}+ab"]
        );
        // Without scores the id ranks, lower first, and shorter parts first on a tie.
        assert_eq!(
            pairs(merges_from_pieces(&tokens, None)),
            ["a+b", "\u{2581}+a", "\u{2581}+ab", "\u{2581}a+b"]
        );
    }
}
