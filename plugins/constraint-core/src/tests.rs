//! Tests of the whole engine over a small hand-made vocabulary: every byte as a token, some
//! multi-byte tokens, a special chat token and an end-of-sequence token.

use std::time::Instant;

use chimera_policy_core::{Config, ConfigValue, VocabularyView};
use serde_json::Value;

use crate::{ConstraintError, Constraints, Limits};

const MULTI: &[&str] = &[
    "{\"", "\":", "\": ", "\",", ", \"", "name", "kind", "age", "tags", "ok", "true", "false",
    "null", "cat", "dog", "yes", "no", "maybe", "abc", "ab", "12", "  ", "\n", "}", "]", "[\"",
    "Answer: ",
];
const IM_END: &str = "<|im_end|>";
const EOS_TEXT: &str = "<|endoftext|>";

/// Columns of the test vocabulary: 256 bytes, `MULTI`, then `<|im_end|>` and eos (special).
struct Vocab {
    bytes: Vec<u8>,
    ends: Vec<u32>,
    special: Vec<u8>,
    eos: u32,
    texts: Vec<Vec<u8>>,
}

impl Vocab {
    fn new() -> Self {
        let mut texts: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        texts.extend(MULTI.iter().map(|s| s.as_bytes().to_vec()));
        texts.push(IM_END.as_bytes().to_vec());
        texts.push(EOS_TEXT.as_bytes().to_vec());
        let n = texts.len();
        let mut bytes = Vec::new();
        let mut ends = Vec::new();
        for t in &texts {
            bytes.extend_from_slice(t);
            ends.push(bytes.len() as u32);
        }
        let mut special = vec![0u8; n];
        special[n - 2] = 1;
        special[n - 1] = 1;
        Self {
            bytes,
            ends,
            special,
            eos: (n - 1) as u32,
            texts,
        }
    }

    fn view(&self) -> VocabularyView<'_> {
        VocabularyView {
            bytes: &self.bytes,
            ends: &self.ends,
            special: &self.special,
            eos: self.eos,
        }
    }

    fn id(&self, text: &str) -> u32 {
        self.texts
            .iter()
            .rposition(|t| t == text.as_bytes())
            .expect("token in the test vocabulary") as u32
    }

    fn im_end(&self) -> u32 {
        self.eos - 1
    }
}

fn engine(vocab: &Vocab) -> Constraints {
    Constraints::new(&Config::default(), &vocab.view()).expect("engine builds")
}

fn allowed(mask: &[u32], t: u32) -> bool {
    mask[t as usize / 32] >> (t % 32) & 1 == 1
}

fn allowed_tokens(mask: &[u32], n: usize) -> Vec<u32> {
    (0..n as u32).filter(|&t| allowed(mask, t)).collect()
}

/// What the mask after a driven text must be.
#[derive(Clone, Copy, PartialEq)]
enum End {
    /// Exactly EOS: the grammar is finished.
    EosOnly,
    /// EOS among others: the text is complete but could go on.
    Accepting,
    /// Not complete: EOS refused.
    Open,
}

/// Drives matcher `id` to produce `text`, at each step taking the longest allowed token that
/// is a prefix of what remains; asserts each chosen token was allowed and the final mask is
/// as `end` says. Returns the tokens.
fn drive(c: &mut Constraints, v: &Vocab, id: u32, text: &str, end: End) -> Vec<u32> {
    let mut rest = text.as_bytes();
    let mut tokens = Vec::new();
    let mut mask = c.next(id, &[]).expect("first mask");
    while !rest.is_empty() {
        let best = allowed_tokens(&mask, v.texts.len())
            .into_iter()
            .filter(|&t| t != v.eos && !v.texts[t as usize].is_empty())
            .filter(|&t| rest.starts_with(&v.texts[t as usize]))
            .max_by_key(|&t| v.texts[t as usize].len())
            .unwrap_or_else(|| {
                panic!(
                    "no allowed token continues {:?} after {:?}",
                    String::from_utf8_lossy(rest),
                    String::from_utf8_lossy(&text.as_bytes()[..text.len() - rest.len()])
                )
            });
        rest = &rest[v.texts[best as usize].len()..];
        tokens.push(best);
        mask = c.next(id, &[best]).expect("token accepted");
    }
    match end {
        End::EosOnly => assert_eq!(allowed_tokens(&mask, v.texts.len()), vec![v.eos], "{text}"),
        End::Accepting => assert!(allowed(&mask, v.eos), "EOS allowed after {text:?}"),
        End::Open => assert!(!allowed(&mask, v.eos), "EOS refused after {text:?}"),
    }
    tokens
}

/// A seeded random walk through allowed tokens: EOS as soon as it is allowed, whitespace-only
/// tokens only when nothing else is. Returns the text produced before EOS.
fn random_walk(c: &mut Constraints, v: &Vocab, id: u32, seed: u64) -> String {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = Vec::new();
    let mut mask = c.next(id, &[]).expect("first mask");
    for _ in 0..2000 {
        if allowed(&mask, v.eos) {
            return String::from_utf8(out).expect("UTF-8 output");
        }
        let all = allowed_tokens(&mask, v.texts.len());
        assert!(!allowed(&mask, v.im_end()), "a special token is never text");
        let solid: Vec<u32> = all
            .iter()
            .copied()
            .filter(|&t| !v.texts[t as usize].iter().all(u8::is_ascii_whitespace))
            .collect();
        let pool = if solid.is_empty() { &all } else { &solid };
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let t = pool[(state >> 33) as usize % pool.len()];
        out.extend_from_slice(&v.texts[t as usize]);
        mask = c.next(id, &[t]).expect("allowed token accepted");
    }
    panic!(
        "walk {seed} did not finish: {}",
        String::from_utf8_lossy(&out)
    );
}

const PET_SCHEMA: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 30},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    "ok": {"type": "boolean"}
  },
  "required": ["name", "kind"],
  "additionalProperties": false
}"#;

/// Checks `value` against `PET_SCHEMA` by hand.
fn check_pet(value: &Value) {
    let obj = value.as_object().expect("an object");
    for key in obj.keys() {
        assert!(
            ["name", "kind", "age", "tags", "ok"].contains(&key.as_str()),
            "{key}"
        );
    }
    let name = obj["name"].as_str().expect("name is a string");
    assert!(name.chars().count() <= 6, "{name}");
    assert!(["cat", "dog"].contains(&obj["kind"].as_str().expect("kind")));
    if let Some(age) = obj.get("age") {
        let age = age.as_i64().expect("age is an integer");
        assert!((0..=30).contains(&age), "{age}");
    }
    if let Some(tags) = obj.get("tags") {
        let tags = tags.as_array().expect("tags is an array");
        assert!(tags.len() <= 2);
        for t in tags {
            assert!(t.as_str().expect("tag is a string").chars().count() <= 3);
        }
    }
    if let Some(ok) = obj.get("ok") {
        assert!(ok.is_boolean());
    }
}

#[test]
fn json_schema_walks_produce_valid_objects() {
    let v = Vocab::new();
    let mut c = engine(&v);
    for seed in 0..12 {
        let id = c.open("json-schema", PET_SCHEMA).expect("schema compiles");
        let text = random_walk(&mut c, &v, id, seed);
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        check_pet(&value);
        c.close(id);
    }
    assert_eq!(c.open_count(), 0);
}

#[test]
fn json_schema_allows_a_given_object_and_refuses_others() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let id = c.open("json-schema", PET_SCHEMA).expect("compiles");
    let first = c.next(id, &[]).expect("mask");
    assert!(allowed(&first, v.id("{")) && allowed(&first, v.id("{\"")));
    for refused in ["[", "1", "\"", "t", "}"] {
        assert!(!allowed(&first, v.id(refused)), "{refused} refused first");
    }
    assert!(!allowed(&first, v.eos) && !allowed(&first, v.im_end()));
    let text = r#"{"name": "Rex", "kind": "dog", "age": 12, "tags": ["a", "b"], "ok": true}"#;
    drive(&mut c, &v, id, text, End::EosOnly);

    // A wrong enum value is refused: after `"kind": "` only c or d may follow.
    let id = c.open("json-schema", PET_SCHEMA).expect("compiles");
    drive(&mut c, &v, id, r#"{"name": "a", "kind": ""#, End::Open);
    let mask = c.next(id, &[]).expect("mask");
    let letters: Vec<u8> = (b'a'..=b'z')
        .filter(|&b| allowed(&mask, b as u32))
        .collect();
    assert_eq!(letters, b"cd");
}

#[test]
fn json_object_schema_is_any_object() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let id = c
        .open("json-schema", r#"{"type":"object"}"#)
        .expect("compiles");
    let first = c.next(id, &[]).expect("mask");
    assert!(allowed(&first, v.id("{")));
    assert!(!allowed(&first, v.id("[")) && !allowed(&first, v.id("1")));
    drive(
        &mut c,
        &v,
        id,
        r#"{"x": [1, {"y": null}], "z": "w"}"#,
        End::EosOnly,
    );
}

#[test]
fn regex_constrains_and_finishes() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let id = c.open("regex", "[0-9]{3}-[a-z]+").expect("compiles");
    let first = c.next(id, &[]).expect("mask");
    let singles: Vec<u32> = allowed_tokens(&first, 256);
    assert_eq!(singles, (b'0' as u32..=b'9' as u32).collect::<Vec<_>>());
    assert!(allowed(&first, v.id("12")) && !allowed(&first, v.eos));
    drive(&mut c, &v, id, "123-abc", End::Accepting);

    // A bounded regex ends in EOS only.
    let id = c.open("regex", "(yes|no)!").expect("compiles");
    drive(&mut c, &v, id, "no!", End::EosOnly);
}

#[test]
fn special_tokens_are_never_text() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let id = c.open("regex", "(?s:.*)").expect("compiles");
    let mask = c.next(id, &[]).expect("mask");
    assert!(allowed(&mask, v.eos) && allowed(&mask, v.id("abc")));
    assert!(!allowed(&mask, v.im_end()), "<|im_end|> is special");
}

#[test]
fn choice_is_exactly_one_string() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let grammar = r#"["yes", "no", "maybe so", "a\"b\\c"]"#;
    let id = c.open("choice", grammar).expect("compiles");
    let first = c.next(id, &[]).expect("mask");
    let singles: Vec<u8> = (0..=255u8).filter(|&b| allowed(&first, b as u32)).collect();
    assert_eq!(singles, b"amny");
    assert!(allowed(&first, v.id("yes")) && allowed(&first, v.id("maybe")));
    assert!(
        !allowed(&first, v.id("ab")),
        "\"ab\" would need `ab` to follow a"
    );
    drive(&mut c, &v, id, "yes", End::EosOnly);
    for text in ["maybe so", "a\"b\\c", "no"] {
        let id = c.open("choice", grammar).expect("compiles");
        drive(&mut c, &v, id, text, End::EosOnly);
    }

    // One choice a prefix of another: after "ab" both EOS and "c" are allowed.
    let id = c.open("choice", r#"["ab", "abc"]"#).expect("compiles");
    drive(&mut c, &v, id, "ab", End::Accepting);
    let mask = c.next(id, &[]).expect("mask");
    assert_eq!(
        allowed_tokens(&mask, v.texts.len()),
        vec![b'c' as u32, v.eos]
    );

    for bad in ["[]", r#"["a", 1]"#, "\"a\"", r#"["a", ""]"#] {
        let err = c.open("choice", bad).unwrap_err();
        assert_eq!(err.kind(), "invalid_grammar", "{bad}: {err}");
    }
}

#[test]
fn lark_embeds_json() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let grammar = r#"start: "Answer: " obj
obj: %json {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
"#;
    let id = c.open("lark", grammar).expect("compiles");
    let first = c.next(id, &[]).expect("mask");
    assert!(allowed(&first, v.id("Answer: ")) && allowed(&first, b'A' as u32));
    assert_eq!(allowed_tokens(&first, 256), vec![b'A' as u32]);
    drive(&mut c, &v, id, r#"Answer: {"x": 12}"#, End::EosOnly);

    let err = c.open("lark", "start: foo").unwrap_err();
    assert_eq!(err.kind(), "invalid_grammar");
    assert!(err.to_string().contains("foo"), "{err}");
}

#[test]
fn rollback_restores_the_mask() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let id = c.open("json-schema", PET_SCHEMA).expect("compiles");
    let tokens = drive(&mut c, &v, id, r#"{"name": "R"#, End::Open);
    let before = c.next(id, &[]).expect("mask");
    // Speculate two tokens, then take them back.
    let drafted = [b'e' as u32, b'x' as u32];
    c.next(id, &drafted).expect("drafts accepted");
    c.rollback(id, 2).expect("rollback");
    assert_eq!(c.next(id, &[]).expect("mask"), before);
    // Back to the very start, then EOS-finished text again.
    c.rollback(id, tokens.len() as u32)
        .expect("rollback to start");
    let start = c.open("json-schema", PET_SCHEMA).expect("compiles");
    assert_eq!(
        c.next(id, &[]).expect("mask"),
        c.next(start, &[]).expect("mask")
    );
    let err = c.rollback(id, 1).unwrap_err();
    assert_eq!(err.kind(), "matcher", "nothing left to roll back: {err}");
}

#[test]
fn refused_tokens_and_bad_ids_are_errors() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let id = c.open("regex", "[0-9]+").expect("compiles");
    let err = c.next(id, &[b'x' as u32]).unwrap_err();
    assert_eq!(err.kind(), "matcher", "{err}");
    // A dead matcher keeps failing until it is closed.
    assert_eq!(c.next(id, &[]).unwrap_err().kind(), "matcher");
    c.close(id);
    assert_eq!(
        c.next(id, &[]).unwrap_err(),
        ConstraintError::UnknownMatcher(id)
    );
    assert_eq!(
        c.rollback(77, 1).unwrap_err(),
        ConstraintError::UnknownMatcher(77)
    );
    c.close(77);

    let id = c.open("regex", "[0-9]+").expect("compiles");
    assert_eq!(id, 0, "a closed id is reused");
    let n = v.texts.len() as u32;
    assert_eq!(
        c.next(id, &[n]).unwrap_err(),
        ConstraintError::TokenOutOfRange {
            token: n,
            vocab: n as usize
        }
    );
    let mut short = vec![0u32; c.mask_words() - 1];
    assert_eq!(
        c.next_into(id, &[], &mut short).unwrap_err().kind(),
        "mask_length"
    );
    let mut mask = vec![u32::MAX; c.mask_words()];
    c.next_into(id, &[b'1' as u32], &mut mask).expect("mask");
    assert!(allowed(&mask, v.eos) && allowed(&mask, b'7' as u32));
    assert_eq!(
        mask[mask.len() - 1] >> (v.texts.len() % 32),
        0,
        "no bit past the vocabulary"
    );

    assert_eq!(c.open("yaml", "a: b").unwrap_err().kind(), "unknown_kind");
    let err = c.open("json-schema", "{not json").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("invalid json-schema grammar: not JSON"),
        "{err}"
    );
    let err = c.open("regex", "(unclosed").unwrap_err();
    assert_eq!(err.kind(), "invalid_grammar", "{err}");
    let err = c
        .open("json-schema", r#"{"type": "object", "$ref": "http://x/y"}"#)
        .unwrap_err();
    assert_eq!(err.kind(), "invalid_grammar", "{err}");
}

#[test]
fn a_grammar_sent_again_starts_from_its_compiled_template() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let text = r#"{"name": "Rex", "kind": "dog", "age": 3}"#;
    let first = c.open("json-schema", PET_SCHEMA).expect("compiles");
    let tokens = drive(&mut c, &v, first, text, End::EosOnly);
    assert_eq!(c.cached_grammars(), 1);
    // The same text again: a clone of the template, walking the same masks, and independent
    // of the first (still finished) and of a third one (still at its start).
    let second = c
        .open("json-schema", PET_SCHEMA)
        .expect("from the template");
    let third = c
        .open("json-schema", PET_SCHEMA)
        .expect("from the template");
    assert_eq!(c.cached_grammars(), 1);
    assert_eq!(drive(&mut c, &v, second, text, End::EosOnly), tokens);
    assert_eq!(
        allowed_tokens(&c.next(first, &[]).expect("mask"), v.texts.len()),
        vec![v.eos]
    );
    let mut fresh =
        Constraints::new(&config(&[("grammar_cache_entries", 0)]), &v.view()).expect("builds");
    let cold = fresh.open("json-schema", PET_SCHEMA).expect("compiles");
    assert_eq!(fresh.cached_grammars(), 0, "a cache of 0 keeps nothing");
    assert_eq!(
        c.next(third, &[]).expect("mask"),
        fresh.next(cold, &[]).expect("mask"),
        "a clone starts where a fresh compilation does"
    );
    // The same text as another kind is another grammar: `true` is any JSON value as a schema,
    // the word "true" as a regex.
    let any = c.open("json-schema", "true").expect("compiles");
    let word = c.open("regex", "true").expect("compiles");
    assert_eq!(c.cached_grammars(), 3);
    let (any, word) = (
        c.next(any, &[]).expect("mask"),
        c.next(word, &[]).expect("mask"),
    );
    assert!(allowed(&any, b'{' as u32) && !allowed(&word, b'{' as u32));
}

#[test]
fn the_grammar_cache_drops_the_least_recently_used_and_forgets_failed_templates() {
    let v = Vocab::new();
    let mut c =
        Constraints::new(&config(&[("grammar_cache_entries", 2)]), &v.view()).expect("builds");
    let a = c.open("regex", "[0-9]+").expect("a");
    c.open("regex", "[a-z]+").expect("b");
    // `a` used again, then a third grammar: `b` is the least recently used and goes.
    c.open("regex", "[0-9]+").expect("a again");
    c.open("regex", "x+").expect("c");
    assert_eq!(c.cached_grammars(), 2);
    // A matcher that fails (a refused token) takes its template with it.
    assert_eq!(c.next(a, &[b'x' as u32]).unwrap_err().kind(), "matcher");
    assert_eq!(c.cached_grammars(), 1);
    // Compiled again on the next open, and kept again.
    let a2 = c.open("regex", "[0-9]+").expect("recompiled");
    assert!(allowed(&c.next(a2, &[]).expect("mask"), b'7' as u32));
    assert_eq!(c.cached_grammars(), 2);
    // A grammar that does not compile is not kept.
    assert!(c.open("regex", "(unclosed").is_err());
    assert_eq!(c.cached_grammars(), 2);
}

fn config(entries: &[(&str, i64)]) -> Config {
    Config::new(
        entries
            .iter()
            .map(|(k, v)| (k.to_string(), ConfigValue::Integer(*v)))
            .collect(),
    )
}

#[test]
fn grammar_size_and_open_count_are_bounded() {
    let v = Vocab::new();
    let mut c = Constraints::new(
        &config(&[("max_open", 2), ("max_grammar_bytes", 64)]),
        &v.view(),
    )
    .expect("builds");
    let long = format!("[\"{}\"]", "a".repeat(100));
    assert_eq!(
        c.open("choice", &long).unwrap_err(),
        ConstraintError::TooLarge {
            len: long.len(),
            limit: 64
        }
    );
    let a = c.open("regex", "a").expect("first");
    let _b = c.open("regex", "b").expect("second");
    assert_eq!(
        c.open("regex", "c").unwrap_err(),
        ConstraintError::TooManyOpen(2)
    );
    c.close(a);
    assert_eq!(c.open("regex", "c"), Ok(a));

    // The default limit: 256 KiB.
    let mut c = engine(&v);
    let huge = format!("[{}\"x\"]", "\"aaaaaaaa\", ".repeat(30_000));
    let err = c.open("choice", &huge).unwrap_err();
    assert_eq!(err.kind(), "too_large", "{err}");
}

#[test]
fn pathological_grammars_fail_or_stay_bounded() {
    let v = Vocab::new();
    let mut c = engine(&v);
    // Ambiguous regex, repeated: a DFA lexer makes it linear; print what it costs.
    let rx = "(a|aa)*b".repeat(200);
    let t0 = Instant::now();
    let r = c.open("regex", &rx);
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let id = r.expect("(a|aa)*b ×200 compiles");
    let t0 = Instant::now();
    let mut steps = 0;
    let mut last = Ok(());
    for _ in 0..300 {
        steps += 1;
        let mut mask = vec![0; c.mask_words()];
        last = c.next_into(id, &[b'a' as u32], &mut mask);
        if last.is_err() {
            break;
        }
    }
    let walk_ms = t0.elapsed().as_secs_f64() * 1e3;
    eprintln!("(a|aa)*b x200: open {open_ms:.1} ms, {steps} tokens {walk_ms:.1} ms ({last:?})");
    assert!(last.is_ok(), "a run of a is always allowed: {last:?}");

    // A lexer that needs many DFA states (a{n} choices) against a tiny state limit.
    let mut tight = Constraints::new(&config(&[("max_lexer_states", 50)]), &v.view()).expect("ok");
    let t0 = Instant::now();
    let r = tight
        .open("regex", "[a-z]{0,30}x[a-z]{20}")
        .and_then(|id| drive_steps(&mut tight, id, b'a', 40));
    eprintln!(
        "lexer states capped at 50: {:?} after {:.1} ms",
        r.as_ref().map_err(ToString::to_string),
        t0.elapsed().as_secs_f64() * 1e3
    );
    let err = r.unwrap_err();
    assert!(
        err.kind() == "matcher" || err.kind() == "invalid_grammar",
        "{err}"
    );

    // A schema nested 50 deep compiles and walks; 100 deep is past serde_json's recursion
    // limit (128), which keeps every later recursive pass over the schema bounded too.
    let nested = |depth: usize| {
        let mut schema = String::from(r#"{"type":"integer"}"#);
        for _ in 0..depth {
            schema =
                format!(r#"{{"type":"object","properties":{{"a":{schema}}},"required":["a"]}}"#);
        }
        schema
    };
    let err = c.open("json-schema", &nested(100)).unwrap_err();
    assert!(err.to_string().contains("recursion limit"), "{err}");
    let t0 = Instant::now();
    let id = c
        .open("json-schema", &nested(50))
        .expect("50 deep compiles");
    let open_ms = t0.elapsed().as_secs_f64() * 1e3;
    let t0 = Instant::now();
    let text = format!("{}1{}", r#"{"a":"#.repeat(50), "}".repeat(50));
    drive(&mut c, &v, id, &text, End::EosOnly);
    eprintln!(
        "schema nested 50 deep: open {open_ms:.1} ms, walk {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );

    // Deep nesting in regex and Lark is refused by a nesting limit, not a stack overflow.
    let deep_rx = format!("{}a{}", "(".repeat(5000), ")".repeat(5000));
    let err = c.open("regex", &deep_rx).unwrap_err();
    eprintln!("regex nested 5000 deep: {err}");
    assert_eq!(err.kind(), "invalid_grammar");
    let deep_lark = format!("start: {}\"a\"{}", "(".repeat(5000), ")".repeat(5000));
    let t0 = Instant::now();
    let r = c.open("lark", &deep_lark);
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let err = r.unwrap_err();
    eprintln!("lark nested 5000 deep: refused in {ms:.1} ms");
    assert!(err.to_string().contains("too deeply nested"), "{err}");
}

/// Feeds `byte` `steps` times, stopping at the first error.
fn drive_steps(
    c: &mut Constraints,
    id: u32,
    byte: u8,
    steps: usize,
) -> Result<u32, ConstraintError> {
    c.next(id, &[])?;
    for _ in 0..steps {
        c.next(id, &[byte as u32])?;
    }
    Ok(id)
}

#[test]
fn unusable_vocabularies_are_refused() {
    let v = Vocab::new();
    let mut bad = v.view();
    bad.eos = v.texts.len() as u32;
    let err = Constraints::new(&Config::default(), &bad)
        .err()
        .expect("refused");
    assert!(err.starts_with("unusable vocabulary"), "{err}");

    let long = vec![b'x'; 2000];
    let ends = [1u32, 2001];
    let view = VocabularyView {
        bytes: &[b"a".as_slice(), &long].concat(),
        ends: &ends,
        special: &[0, 0],
        eos: 0,
    };
    let err = Constraints::new(&Config::default(), &view)
        .err()
        .expect("refused");
    assert!(err.contains("token 1 is 2000 bytes"), "{err}");

    let err = Constraints::new(&config(&[("max_open", 0)]), &v.view())
        .err()
        .expect("refused");
    assert!(err.contains("`max_open`"), "{err}");
    assert!(Limits::KEYS.contains(&"max_open"));
}

#[test]
fn engine_can_move_to_another_thread() {
    fn send<T: Send>() {}
    send::<Constraints>();
}

#[test]
fn local_refs_resolve_and_remote_refs_are_refused() {
    let v = Vocab::new();
    let mut c = engine(&v);
    let schema = r##"{"$defs": {"pet": {"enum": ["cat", "dog"]}},
        "type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2}"##;
    let id = c.open("json-schema", schema).expect("compiles");
    drive(&mut c, &v, id, r#"["dog", "cat"]"#, End::EosOnly);
    let err = c
        .open("json-schema", r#"{"$ref": "https://example.com/s.json"}"#)
        .unwrap_err();
    assert!(err.to_string().contains("$ref"), "{err}");
    let err = c
        .open("json-schema", r#"{"type": "array", "uniqueItems": true}"#)
        .unwrap_err();
    assert!(
        err.to_string().contains("uniqueItems"),
        "unsupported keys are named: {err}"
    );
}

/// Grammar-like garbage for every kind: each `open` (and a few steps of a matcher that
/// opened) answers Ok or a client error, never a caught panic (`internal`, or a matcher
/// error that llguidance's own catch turned into "panic: ...").
#[test]
fn garbage_grammars_never_panic() {
    const PIECES: &[&str] = &[
        "{",
        "}",
        "[",
        "]",
        "\"",
        ":",
        ",",
        "type",
        "object",
        "string",
        "properties",
        "$ref",
        "#/",
        "enum",
        "null",
        "1e309",
        "-0",
        "start",
        ":",
        "|",
        "(",
        ")",
        "*",
        "+",
        "?",
        "{2,}",
        "/",
        "\\",
        "%json",
        "%ignore",
        "<[",
        "]>",
        "\n",
        "a",
        "é",
        "\u{0}",
        "..",
        "~",
        "^",
        "$",
        "anyOf",
        "pattern",
        "minLength",
        "99999999999",
        "items",
        "required",
        "%import",
        "@",
    ];
    let v = Vocab::new();
    let mut c = engine(&v);
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut rand = move |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut counts = [0usize; 2];
    for round in 0..1200 {
        let kind = ["json-schema", "regex", "choice", "lark"][round % 4];
        let grammar: String = (0..1 + rand(24))
            .map(|_| PIECES[rand(PIECES.len())])
            .collect();
        match c.open(kind, &grammar) {
            Ok(id) => {
                counts[0] += 1;
                for _ in 0..4 {
                    let token = rand(v.texts.len()) as u32;
                    match c.next(id, &[token]) {
                        Ok(_) => {}
                        Err(e) => {
                            assert_ne!(e.kind(), "internal", "{kind} {grammar:?}: {e}");
                            assert!(!e.to_string().contains("panic"), "{grammar:?}: {e}");
                            break;
                        }
                    }
                }
                c.close(id);
            }
            Err(e) => {
                counts[1] += 1;
                assert_ne!(e.kind(), "internal", "{kind} {grammar:?}: {e}");
                assert!(!e.to_string().contains("panic"), "{grammar:?}: {e}");
            }
        }
    }
    eprintln!(
        "garbage grammars: {} opened, {} refused",
        counts[0], counts[1]
    );
    assert!(counts[0] > 0 && counts[1] > 0);
}

/// A walk that takes a whitespace token whenever one is allowed: with the whitespace bound it
/// still reaches the end of a small object, and each gap holds at most the bound; with the
/// bound at 0 no whitespace is allowed at all.
#[test]
fn json_whitespace_is_bounded_between_tokens() {
    let v = Vocab::new();
    let schema = r#"{"type":"object","properties":{"a":{"type":"boolean"}},"required":["a"],"additionalProperties":false}"#;
    for max in [0i64, 3] {
        let mut c = Constraints::new(&config(&[("json_whitespace_max", max)]), &v.view())
            .expect("engine builds");
        let id = c.open("json-schema", schema).expect("schema compiles");
        let space = v.id(" ");
        let mut mask = c.next(id, &[]).expect("first mask");
        let mut text = Vec::new();
        for _ in 0..200 {
            if allowed(&mask, v.eos) {
                break;
            }
            // Whitespace first; else the first allowed non-special token.
            let t = if allowed(&mask, space) {
                space
            } else {
                *allowed_tokens(&mask, v.texts.len())
                    .iter()
                    .find(|&&t| v.special[t as usize] == 0)
                    .expect("a text token is allowed")
            };
            text.extend_from_slice(&v.texts[t as usize]);
            mask = c.next(id, &[t]).expect("token accepted");
        }
        let text = String::from_utf8(text).expect("utf-8");
        assert!(allowed(&mask, v.eos), "no end within 200 tokens: {text:?}");
        let longest_gap = text
            .split(|ch: char| !ch.is_whitespace())
            .map(str::len)
            .max()
            .unwrap_or(0);
        assert!(longest_gap <= max as usize, "max {max}: {text:?}");
        let value: Value = serde_json::from_str(text.trim()).expect("valid JSON");
        assert!(value["a"].is_boolean(), "{text}");
    }
}
