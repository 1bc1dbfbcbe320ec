use super::*;
use crate::server::mock_tokenizer;

fn codec() -> TextCodec {
    TextCodec::from_parts(mock_tokenizer::tokenizer_json().as_bytes(), None, None).unwrap()
}

#[test]
fn never_splits_a_character_and_matches_one_shot_decode() {
    let c = codec();
    let text = "hello 😀 world é€ the cat";
    // Byte-level BPE without merges for these characters: each byte is its own token.
    let split = c.encode(text, false).unwrap();
    let partial = split
        .iter()
        .filter(|t| c.decode(&[**t], false).unwrap().contains('\u{fffd}'))
        .count();
    assert!(
        partial >= 9,
        "the test needs characters split across tokens"
    );
    let mut d = IncrementalDetokenizer::new(&c, &[], true);
    let mut out = String::new();
    for t in &split {
        let delta = d.push(&c, *t).unwrap();
        assert!(!delta.contains('\u{fffd}'), "split character in {delta:?}");
        out.push_str(&delta);
    }
    out.push_str(&d.flush(&c).unwrap());
    assert_eq!(out, c.decode(&split, true).unwrap());
}

#[test]
fn stop_strings_across_pieces() {
    let mut m = StopMatcher::new(vec!["END".into(), "xyz".into()]);
    let mut out = String::new();
    for piece in ["abc E", "N", "x", "D tail"] {
        let r = m.push(piece);
        assert_eq!(r.stopped, None);
        out.push_str(&r.text);
    }
    out.push_str(&m.finish());
    // "ENx" cannot become "END", so "EN" is released once "x" arrives.
    assert_eq!(out, "abc ENxD tail");
    let mut m = StopMatcher::new(vec!["END".into()]);
    assert_eq!(m.push("abc E").text, "abc ");
    let r = m.push("ND more");
    assert_eq!((r.text.as_str(), r.stopped.as_deref()), ("", Some("END")));
    let mut m = StopMatcher::new(vec!["END".into()]);
    assert_eq!(m.push("xx EN").text, "xx ");
    assert_eq!(m.finish(), "EN");
}

#[test]
fn earliest_stop_wins_and_multibyte_tails_are_safe() {
    let mut m = StopMatcher::new(vec!["cd".into(), "b".into(), "é!".into()]);
    let r = m.push("abcd");
    assert_eq!((r.text.as_str(), r.stopped.as_deref()), ("a", Some("b")));
    let mut m = StopMatcher::new(vec!["é!".into()]);
    assert_eq!(m.push("xé").text, "x");
    assert_eq!(m.push("?").text, "é?");
}

/// Streams `ids` through a fresh detokenizer; returns each push's delta and the flush.
fn stream(c: &TextCodec, context: &[u32], ids: &[u32], skip: bool) -> (Vec<String>, String) {
    let mut d = IncrementalDetokenizer::new(c, context, skip);
    let deltas = ids.iter().map(|t| d.push(c, *t).unwrap()).collect();
    (deltas, d.flush(c).unwrap())
}

/// Ids of the embedded tokenizer's single-byte tokens, indexed by byte.
fn byte_ids(c: &TextCodec) -> Vec<u32> {
    let table = c
        .byte_table()
        .expect("the embedded tokenizer is byte-level");
    (0..=255u8)
        .map(|b| {
            (0..c.vocab_size())
                .find(|id| table.bytes(*id) == [b] && !table.is_special(*id))
                .expect("every byte has a token")
        })
        .collect()
}

/// Whether some continuation byte appended to `ids` changes the text `ids` decode to
/// (other than by adding one U+FFFD of its own): then the last U+FFFD of that text is an
/// incomplete character, which a stream must hold back. Asks only the tokenizer's decode.
fn ends_incomplete(c: &TextCodec, ids: &[u32], skip: bool, bytes: &[u32]) -> bool {
    let text = c.decode(ids, skip).unwrap();
    if !text.ends_with('\u{fffd}') {
        return false;
    }
    (0x80..=0xBFu8).any(|b| {
        let mut more = ids.to_vec();
        more.push(bytes[b as usize]);
        c.decode(&more, skip).unwrap() != format!("{text}\u{fffd}")
    })
}

#[test]
fn invalid_bytes_are_released_at_once_and_nothing_is_lost() {
    let c = TextCodec::embedded().unwrap();
    let bytes = byte_ids(&c);
    // 32 lone continuation bytes: each can never become valid, so each is one U+FFFD at once.
    let ids = vec![bytes[0x80]; 32];
    let (deltas, tail) = stream(&c, &[], &ids, true);
    assert!(deltas.iter().all(|d| d == "\u{fffd}"), "{deltas:?}");
    assert_eq!(tail, "");
    assert_eq!(deltas.concat(), c.decode(&ids, true).unwrap());
    // A prompt that ends inside a character (its tail is the context) changes nothing.
    let context = [bytes[b'a' as usize], bytes[0xE2]];
    let ids = [bytes[0xA9], bytes[0x82], bytes[0xAC], bytes[b'x' as usize]];
    let (deltas, tail) = stream(&c, &context, &ids, true);
    assert_eq!(deltas.concat() + &tail, c.decode(&ids, true).unwrap());
    assert_eq!(deltas.concat() + &tail, "\u{fffd}\u{fffd}\u{fffd}x");
    // "€" split over three tokens: held while it can still complete, released whole.
    let ids = [bytes[0xE2], bytes[0x82], bytes[0xAC]];
    let (deltas, _) = stream(&c, &[], &ids, true);
    assert_eq!(deltas, ["", "", "€"]);
    // An incomplete sequence cut short by a byte that cannot continue it: U+FFFD right away.
    let ids = [bytes[0xE2], bytes[0x82], bytes[b'!' as usize]];
    let (deltas, _) = stream(&c, &[], &ids, true);
    assert_eq!(deltas, ["", "", "\u{fffd}!"]);
    // A lone 0xFF can never start a character.
    let (deltas, _) = stream(&c, &[], &[bytes[0xFF]], true);
    assert_eq!(deltas, ["\u{fffd}"]);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// Over random ids of the embedded byte-level tokenizer (bytes, merges and special
    /// tokens): the stream equals the one-shot decode, and after every token it has released
    /// exactly the text no later token can change.
    #[test]
    fn stream_equals_decode_and_holds_back_only_incomplete_characters(
        ids in proptest::collection::vec(0u32..600, 0..40),
        bias in proptest::collection::vec(0x80u8..=0xFF, 0..40),
        skip in proptest::bool::ANY,
    ) {
        let c = embedded();
        let bytes = byte_ids(c);
        // Mix in high bytes, so multi-byte sequences (valid, cut short, invalid) are common.
        let ids: Vec<u32> = ids
            .iter()
            .zip(bias.iter().chain(std::iter::repeat(&0)))
            .map(|(id, b)| if id % 3 == 0 && *b != 0 { bytes[*b as usize] } else { *id })
            .collect();
        let mut d = IncrementalDetokenizer::new(c, &[], skip);
        let mut sent = String::new();
        for i in 0..ids.len() {
            sent.push_str(&d.push(c, ids[i]).unwrap());
            let text = c.decode(&ids[..=i], skip).unwrap();
            let expected = if ends_incomplete(c, &ids[..=i], skip, &bytes) {
                &text[..text.len() - '\u{fffd}'.len_utf8()]
            } else {
                &text[..]
            };
            proptest::prop_assert_eq!(&sent, expected, "after {} ids {:?}", i + 1, &ids[..=i]);
        }
        sent.push_str(&d.flush(c).unwrap());
        proptest::prop_assert_eq!(sent, c.decode(&ids, skip).unwrap());
    }
}

fn embedded() -> &'static TextCodec {
    static CODEC: std::sync::OnceLock<TextCodec> = std::sync::OnceLock::new();
    CODEC.get_or_init(|| TextCodec::embedded().unwrap())
}

/// A SentencePiece-style tokenizer (metaspace words, no byte tokens): not byte-level, so the
/// detokenizer decodes windows of ids.
fn metaspace_codec() -> TextCodec {
    let words = [
        "<unk>",
        "▁hello",
        "▁world",
        "▁the",
        "s",
        ",",
        "▁",
        "é",
        "▁naïve",
        "<eos>",
    ];
    let vocab: serde_json::Map<String, serde_json::Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 9, "content": "<eos>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "post_processor": null,
        "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": false},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    let codec = TextCodec::from_parts(json.to_string().as_bytes(), None, None).unwrap();
    assert!(codec.byte_table().is_none());
    codec
}

#[test]
fn window_decoding_keeps_leading_spaces_and_loses_nothing() {
    let c = metaspace_codec();
    // With the prompt's tail as context, the first word keeps its space.
    let (deltas, tail) = stream(&c, &[1], &[2, 4, 5, 3, 8, 9, 7], true);
    assert_eq!(deltas.concat() + &tail, " worlds, the naïveé");
    assert_eq!(deltas[0], " world");
    // Without context the stream is the one-shot decode.
    let ids = [2, 4, 5, 6, 3, 7, 9, 1];
    let (deltas, tail) = stream(&c, &[], &ids, false);
    assert_eq!(deltas.concat() + &tail, c.decode(&ids, false).unwrap());
}
