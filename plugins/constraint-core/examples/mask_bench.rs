//! Per-token cost of a constrained tool call over a real vocabulary.
//!
//! Reads the vocabulary of a GGUF model (GPT-2 byte-level tokens, e.g. SmolLM2's 49152),
//! compiles `tool_schema.json` (a 2.7 KB calendar-tool schema: nested objects, enums, arrays,
//! formats, anyOf) and drives a matcher through `tool_call.json` the way a model would: each
//! step takes the longest *allowed* token that continues the document (reopening when it
//! ends), until `--tokens` tokens. Prints init and compile time and the time of each `next`
//! (consume the token + compute the mask): mean, p50, p99, max.
//!
//! ```text
//! cargo run --release -p chimera-constraint-core --example mask_bench -- MODEL.gguf [--tokens 200]
//! ```

use std::collections::HashMap;
use std::time::Instant;

use chimera_constraint_core::{Constraints, Limits};
use chimera_policy_core::VocabularyView;

const SCHEMA: &str = include_str!("tool_schema.json");
const DOCUMENT: &str = include_str!("tool_call.json");

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let path = args
        .first()
        .ok_or("usage: mask_bench MODEL.gguf [--tokens N]")?;
    let steps: usize = match args.iter().position(|a| a == "--tokens") {
        Some(i) => args
            .get(i + 1)
            .and_then(|s| s.parse().ok())
            .ok_or("--tokens N")?,
        None => 200,
    };
    let data = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    let vocab = gguf_vocabulary(&data)?;
    let view = vocab.view();
    println!(
        "vocabulary: {} tokens, {} special, eos {}",
        view.len(),
        vocab.special.iter().filter(|&&s| s != 0).count(),
        view.eos
    );

    let t0 = Instant::now();
    let mut c = Constraints::with_limits(Limits::default(), &view).map_err(|e| e.to_string())?;
    println!("init (trie + factory): {:.1} ms", ms(t0));

    let mut times = Vec::with_capacity(steps);
    let mut opens = Vec::new();
    let mut mask = vec![0u32; c.mask_words()];
    let mut allowed_sum = 0usize;
    while times.len() < steps {
        let t0 = Instant::now();
        let id = c.open("json-schema", SCHEMA).map_err(|e| e.to_string())?;
        opens.push(ms(t0));
        let mut rest = DOCUMENT.trim_end().as_bytes();
        let mut fed: Vec<u32> = Vec::new();
        loop {
            let t0 = Instant::now();
            c.next_into(id, &fed, &mut mask)
                .map_err(|e| e.to_string())?;
            if !fed.is_empty() {
                times.push(ms(t0));
            }
            if rest.is_empty() || times.len() >= steps {
                break;
            }
            let (best, n) = longest_allowed(&vocab, &mask, rest)
                .ok_or_else(|| format!("stuck at {:?}", String::from_utf8_lossy(rest)))?;
            allowed_sum += n;
            rest = &rest[vocab.token(best).len()..];
            fed = vec![best];
        }
        c.close(id);
    }
    println!(
        "open (compile the schema): {:.2} ms first, {:.2} ms mean of {}",
        opens[0],
        opens.iter().sum::<f64>() / opens.len() as f64,
        opens.len()
    );
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    times.sort_by(f64::total_cmp);
    let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
    println!(
        "next (consume + mask) over {} tokens: mean {:.1} us, p50 {:.1} us, p99 {:.1} us, max {:.1} us; {:.0} allowed tokens per step on average",
        times.len(),
        mean * 1e3,
        pct(0.5) * 1e3,
        pct(0.99) * 1e3,
        times[times.len() - 1] * 1e3,
        allowed_sum as f64 / times.len() as f64
    );
    Ok(())
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e3
}

/// The longest allowed token that `rest` starts with, and how many tokens were allowed.
fn longest_allowed(vocab: &Vocab, mask: &[u32], rest: &[u8]) -> Option<(u32, usize)> {
    let mut best: Option<u32> = None;
    let mut allowed = 0;
    for (w, &word) in mask.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let t = (w * 32) as u32 + bits.trailing_zeros();
            bits &= bits - 1;
            allowed += 1;
            let bytes = vocab.token(t);
            if vocab.special[t as usize] == 0
                && !bytes.is_empty()
                && rest.starts_with(bytes)
                && best.is_none_or(|b| vocab.token(b).len() < bytes.len())
            {
                best = Some(t);
            }
        }
    }
    best.map(|b| (b, allowed))
}

struct Vocab {
    bytes: Vec<u8>,
    ends: Vec<u32>,
    special: Vec<u8>,
    eos: u32,
}

impl Vocab {
    fn view(&self) -> VocabularyView<'_> {
        VocabularyView {
            bytes: &self.bytes,
            ends: &self.ends,
            special: &self.special,
            eos: self.eos,
        }
    }

    fn token(&self, t: u32) -> &[u8] {
        self.view().token(t as usize)
    }
}

/// The GGUF metadata values this reader needs.
enum Meta {
    Strings(Vec<String>),
    Ints(Vec<i64>),
    Int(i64),
    Other,
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.data.len());
        let end = end.ok_or("truncated GGUF metadata")?;
        let s = &self.data[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().map_err(|_| "u32")?,
        ))
    }

    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().map_err(|_| "u64")?,
        ))
    }

    fn string(&mut self) -> Result<String, String> {
        let n = self.u64()? as usize;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }

    /// A scalar of GGUF type `ty` as an integer (None for floats, strings and bools).
    fn scalar(&mut self, ty: u32) -> Result<Option<i64>, String> {
        let size = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => {
                self.string()?;
                return Ok(None);
            }
            _ => return Err(format!("unknown GGUF type {ty}")),
        };
        let b = self.take(size)?;
        let mut v = [0u8; 8];
        v[..size].copy_from_slice(b);
        let u = u64::from_le_bytes(v);
        Ok(match ty {
            1 => Some(b[0] as i8 as i64),
            3 => Some(u as u16 as i16 as i64),
            5 => Some(u as u32 as i32 as i64),
            0 | 2 | 4 | 10 | 11 => Some(u as i64),
            _ => None,
        })
    }

    fn value(&mut self, ty: u32) -> Result<Meta, String> {
        if ty != 9 {
            return Ok(self.scalar(ty)?.map_or(Meta::Other, Meta::Int));
        }
        let ety = self.u32()?;
        let n = self.u64()? as usize;
        if ety == 8 {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(self.string()?);
            }
            return Ok(Meta::Strings(v));
        }
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            v.push(self.scalar(ety)?.unwrap_or(0));
        }
        Ok(Meta::Ints(v))
    }
}

/// The token list of a GGUF file with a GPT-2 byte-level vocabulary: control tokens (type 3)
/// are special and keep their names; other tokens are mapped back to bytes.
fn gguf_vocabulary(data: &[u8]) -> Result<Vocab, String> {
    let mut r = Reader { data, at: 0 };
    if r.take(4)? != b"GGUF" {
        return Err("not a GGUF file".into());
    }
    let _version = r.u32()?;
    let _tensors = r.u64()?;
    let count = r.u64()?;
    let mut meta = HashMap::new();
    for _ in 0..count {
        let key = r.string()?;
        let ty = r.u32()?;
        let value = r.value(ty)?;
        if key.starts_with("tokenizer.ggml.") {
            meta.insert(key, value);
        }
    }
    let Some(Meta::Strings(tokens)) = meta.remove("tokenizer.ggml.tokens") else {
        return Err("no tokenizer.ggml.tokens".into());
    };
    let types = match meta.remove("tokenizer.ggml.token_type") {
        Some(Meta::Ints(t)) => t,
        _ => vec![1; tokens.len()],
    };
    let Some(Meta::Int(eos)) = meta.remove("tokenizer.ggml.eos_token_id") else {
        return Err("no tokenizer.ggml.eos_token_id".into());
    };
    let unicode_to_byte = gpt2_byte_decoder();
    let mut vocab = Vocab {
        bytes: Vec::new(),
        ends: Vec::new(),
        special: Vec::new(),
        eos: eos as u32,
    };
    for (token, &ty) in tokens.iter().zip(&types) {
        let control = ty == 3;
        if control {
            vocab.bytes.extend_from_slice(token.as_bytes());
        } else {
            for ch in token.chars() {
                match unicode_to_byte.get(&ch) {
                    Some(&b) => vocab.bytes.push(b),
                    None => vocab.bytes.extend_from_slice(ch.to_string().as_bytes()),
                }
            }
        }
        vocab.ends.push(vocab.bytes.len() as u32);
        vocab.special.push(u8::from(control));
    }
    Ok(vocab)
}

/// GPT-2's printable stand-ins for bytes, inverted.
fn gpt2_byte_decoder() -> HashMap<char, u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let mut map = HashMap::new();
    let mut extra = 0;
    for b in 0..=255u32 {
        let ch = if printable(b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        if let Some(ch) = char::from_u32(ch) {
            map.insert(ch, b as u8);
        }
    }
    map
}
