//! Shared helpers: run a response through a parser whole and split every way, and compare
//! the merged pieces with the expected sequence.

#![allow(dead_code)]

use chimera_parser_core::{Parsed, ResponseParser};
use chimera_policy_core::columns::parsed_kind::{
    CALL_ARGUMENTS, CALL_BEGIN, CONTENT, FAILURE, REASONING,
};

/// One expected piece: kind, call index, text. A failure's text is matched as a prefix (the
/// wording after it comes from `serde_json`).
pub type Piece = (u8, u32, String);

pub fn c(text: &str) -> Piece {
    (CONTENT, 0, text.into())
}
pub fn r(text: &str) -> Piece {
    (REASONING, 0, text.into())
}
pub fn begin(call: u32, name: &str) -> Piece {
    (CALL_BEGIN, call, name.into())
}
pub fn args(call: u32, json: &str) -> Piece {
    (CALL_ARGUMENTS, call, json.into())
}
pub fn fail(why_prefix: &str) -> Piece {
    (FAILURE, 0, why_prefix.into())
}

/// What is parsed: the request's side of `ResponseParser::new`.
#[derive(Clone, Copy)]
pub struct Setup<'a> {
    pub tool_format: &'a str,
    pub reasoning: &'a str,
    pub open: bool,
    pub tools: &'a str,
}

/// Something fed a response piece by piece (the real parser, or a broken one in a test of
/// these checks).
pub trait Stream {
    fn feed(&mut self, text: &str) -> Parsed;
    fn finish(&mut self) -> Parsed;
}

impl Stream for ResponseParser {
    fn feed(&mut self, text: &str) -> Parsed {
        ResponseParser::feed(self, text)
    }
    fn finish(&mut self) -> Parsed {
        ResponseParser::finish(self)
    }
}

pub fn real(setup: Setup<'_>) -> impl Fn() -> ResponseParser + '_ {
    move || {
        ResponseParser::new(setup.tool_format, setup.reasoning, setup.open, setup.tools)
            .expect("known formats")
    }
}

/// The merged pieces of `chunks` fed in order, then `finish`.
pub fn run<S: Stream>(mut stream: S, chunks: &[&str]) -> Parsed {
    let mut out = Parsed::default();
    for chunk in chunks {
        out.extend(stream.feed(chunk));
    }
    out.extend(stream.finish());
    out
}

/// Whether `got` is exactly the `expected` pieces (failures by prefix).
pub fn compare(got: &Parsed, expected: &[Piece]) -> Result<(), String> {
    if !got.is_consistent() {
        return Err(format!("inconsistent columns: {got:?}"));
    }
    let pieces: Vec<Piece> = got
        .kinds
        .iter()
        .zip(&got.calls)
        .zip(&got.texts)
        .map(|((&k, &c), t)| (k, c, t.clone()))
        .collect();
    let same = pieces.len() == expected.len()
        && pieces.iter().zip(expected).all(|(g, e)| {
            g.0 == e.0
                && g.1 == e.1
                && if e.0 == FAILURE {
                    g.2.starts_with(&e.2)
                } else {
                    g.2 == e.2
                }
        });
    if same {
        Ok(())
    } else {
        Err(format!("got {pieces:?}\nexpected {expected:?}"))
    }
}

/// Splits of `text` to try: whole, at every char boundary in two, one char at a time, and
/// in runs of 3 and 7 bytes (rounded to char boundaries).
pub fn splits(text: &str) -> Vec<Vec<&str>> {
    let bounds: Vec<usize> = (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .collect();
    let mut all = vec![vec![text]];
    for &i in &bounds {
        all.push(vec![&text[..i], &text[i..]]);
    }
    all.push(bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect());
    for stride in [3, 7] {
        let mut chunks = Vec::new();
        let mut from = 0;
        for &b in &bounds {
            if b - from >= stride || b == text.len() {
                chunks.push(&text[from..b]);
                from = b;
            }
        }
        all.push(chunks);
    }
    all
}

/// Runs `text` through fresh streams from `make`, whole and split every way in [`splits`];
/// errs with the first split whose merged pieces differ from `expected`.
pub fn check_with<S: Stream>(
    make: impl Fn() -> S,
    text: &str,
    expected: &[Piece],
) -> Result<(), String> {
    for chunks in splits(text) {
        let got = run(make(), &chunks);
        compare(&got, expected).map_err(|e| format!("split {chunks:?}:\n{e}"))?;
    }
    Ok(())
}

/// [`check_with`] on the real parser; panics with the mismatch.
pub fn check(setup: Setup<'_>, text: &str, expected: &[Piece]) {
    if let Err(e) = check_with(real(setup), text, expected) {
        panic!("{e}");
    }
}
