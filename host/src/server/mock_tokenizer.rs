//! A small byte-level BPE tokenizer, built in code, for tests and the mock executor.
//!
//! Owns: the `tokenizer.json` / `tokenizer_config.json` text of a GPT-2-style byte-level BPE
//! with the 256 byte tokens (ids 0..256, in byte order), a handful of merged English words and
//! four special tokens, plus a ChatML chat template. Byte tokens let tests split a multi-byte
//! UTF-8 character across tokens. It must not be used as a real model's tokenizer.

use std::collections::BTreeMap;

use serde_json::{Value, json};

/// Words that get merged tokens (with and without a leading space).
const WORDS: &[&str] = &[
    "the", "cat", "sat", "on", "mat", "hello", "world", "stop", "here", "a", "dog", "ran", "and",
    "END",
];

pub const BOS: &str = "<|bos|>";
pub const EOS: &str = "<|eos|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// GPT-2's reversible byte → printable character mapping.
pub fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    if printable(b) {
        return char::from(b);
    }
    let offset = (0..=b).filter(|x| !printable(*x)).count() as u32 - 1;
    char::from_u32(256 + offset).unwrap_or('?')
}

fn bytes_to_token(s: &str) -> String {
    s.bytes().map(byte_to_char).collect()
}

/// The `tokenizer.json` text.
pub fn tokenizer_json() -> String {
    let mut vocab: BTreeMap<String, u32> = BTreeMap::new();
    let mut order: Vec<String> = Vec::new();
    for b in 0..=255u8 {
        let t = byte_to_char(b).to_string();
        vocab.insert(t.clone(), u32::from(b));
        order.push(t);
    }
    let mut merges: Vec<String> = Vec::new();
    for word in WORDS {
        for form in [word.to_string(), format!(" {word}")] {
            let chars: Vec<String> = bytes_to_token(&form).chars().map(String::from).collect();
            let mut acc = chars[0].clone();
            for c in &chars[1..] {
                let merged = format!("{acc}{c}");
                if !vocab.contains_key(&merged) {
                    vocab.insert(merged.clone(), order.len() as u32);
                    order.push(merged.clone());
                    merges.push(format!("{acc} {c}"));
                }
                acc = merged;
            }
        }
    }
    let next = order.len() as u32;
    let added: Vec<Value> = [BOS, EOS, IM_START, IM_END]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": next + i as u32, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                            "use_regex": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges}
    })
    .to_string()
}

/// A ChatML template in the Hugging Face style.
pub const CHAT_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}\
{% if message['role'] not in ['system', 'user', 'assistant', 'tool', 'developer'] %}\
{{ raise_exception('unknown role: ' ~ message['role']) }}{% endif %}\
{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] | trim + '<|im_end|>\\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// The `tokenizer_config.json` text (chat template, BOS/EOS).
pub fn tokenizer_config_json() -> String {
    json!({
        "bos_token": BOS,
        "eos_token": {"content": EOS, "special": true},
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 4096
    })
    .to_string()
}

/// Output units (`engine::MockConfig::units`) over this tokenizer's ids: the merged words (one
/// token each) and multi-byte characters split into their byte tokens (é: 2, €: 3, 😀: 4).
pub fn mock_units(tokenizer: &tokenizers::Tokenizer) -> Vec<Vec<u32>> {
    let mut units = Vec::new();
    for word in WORDS {
        if let Some(id) = tokenizer.token_to_id(&bytes_to_token(&format!(" {word}"))) {
            units.push(vec![id]);
        }
    }
    for s in ["é", "€", "😀", ",", "."] {
        units.push(s.bytes().map(u32::from).collect());
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_and_round_trips() {
        let tok = tokenizers::Tokenizer::from_bytes(tokenizer_json().as_bytes()).unwrap();
        let text = "hello world, the cat sat on the mat é€😀";
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert!(ids.len() < text.len(), "merges should shorten the sequence");
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        let eos = tok.token_to_id(EOS).unwrap();
        assert_eq!(tok.decode(&[eos], true).unwrap(), "");
        for u in mock_units(&tok) {
            assert!(!tok.decode(&u, false).unwrap().contains('\u{fffd}'));
        }
    }
}
