//! Built-in constraint `llguidance`: grammar-constrained decoding (JSON Schema, regex,
//! choice, Lark) over `chimera_constraint_core`, shared with the host's native twin.
//!
//! This crate only adapts [`Constraints`] to the SDK trait and, in the Wasm build, defines
//! the clock llguidance reads. Config keys: those of `chimera_constraint_core::Limits`
//! (`max_grammar_bytes`, `max_open`, `max_items_in_row`, `initial_lexer_fuel`,
//! `step_lexer_fuel`, `step_max_items`, `max_lexer_states`, `max_grammar_size`,
//! `json_whitespace_max`, `grammar_cache_entries`).

use chimera_constraint_core::Constraints;
use chimera_plugin_sdk::{Config, ConstraintPlugin, VocabularyView};

pub struct Llguidance(Constraints);

impl ConstraintPlugin for Llguidance {
    fn init(config: &Config, vocabulary: &VocabularyView<'_>) -> Result<Self, String> {
        Constraints::new(config, vocabulary).map(Self)
    }

    fn open(&mut self, kind: &str, grammar: &str) -> Result<u32, String> {
        self.0.open(kind, grammar).map_err(|e| e.to_string())
    }

    fn next(&mut self, matcher: u32, tokens: &[u32]) -> Result<Vec<u32>, String> {
        self.0.next(matcher, tokens).map_err(|e| e.to_string())
    }

    fn rollback(&mut self, matcher: u32, count: u32) -> Result<(), String> {
        self.0.rollback(matcher, count).map_err(|e| e.to_string())
    }

    fn close(&mut self, matcher: u32) {
        self.0.close(matcher);
    }
}

chimera_plugin_sdk::export_constraint!(Llguidance);

/// The clock of the `instant` crate, which llguidance's `wasm` feature reads instead of
/// `std::time::Instant` (whose `now` panics on wasm32-unknown-unknown). Left undefined it
/// would become an import (`env.now`); the plugin imports nothing, so it is defined here.
/// llguidance only reads the clock for statistics (compute-time counters), never for
/// limits, so a clock that stands still is enough: every duration reads as zero.
#[cfg(target_arch = "wasm32")]
#[unsafe(no_mangle)]
pub extern "C" fn now() -> f64 {
    0.0
}

/// getrandom's custom source (`--cfg getrandom_backend="custom"`), which ahash reads once to
/// seed llguidance's hashers: a plugin has no randomness, so the bytes are a fixed sequence.
/// Hashing with a known seed changes no mask; hostile inputs are bounded by the grammar limits
/// and the plugin's deadline, not by the seed.
///
/// # Safety
/// getrandom calls it with `dest` valid for `len` bytes.
#[cfg(target_arch = "wasm32")]
#[unsafe(no_mangle)]
pub unsafe extern "Rust" fn __getrandom_v03_custom(
    dest: *mut u8,
    len: usize,
) -> Result<(), getrandom::Error> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for i in 0..len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        // SAFETY: `i < len`, and getrandom passes `len` writable bytes at `dest`.
        unsafe { dest.add(i).write((z ^ (z >> 31)) as u8) };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_plugin_sdk::ConfigValue;

    #[test]
    fn trait_calls_reach_the_engine() {
        // Bytes 0..=255 and an end-of-sequence token.
        let mut bytes: Vec<u8> = (0..=255u8).collect();
        bytes.extend_from_slice(b"</s>");
        let mut ends: Vec<u32> = (1..=256).collect();
        ends.push(260);
        let mut special = vec![0u8; 257];
        special[256] = 1;
        let vocabulary = VocabularyView {
            bytes: &bytes,
            ends: &ends,
            special: &special,
            eos: 256,
        };
        let config = Config::new(vec![("max_open".into(), ConfigValue::Integer(1))]);
        let mut plugin = Llguidance::init(&config, &vocabulary).unwrap();
        let id = plugin.open("choice", r#"["ok"]"#).unwrap();
        assert_eq!(
            plugin.open("regex", "x").unwrap_err(),
            "too many open matchers (limit 1)"
        );
        let mask = plugin.next(id, &[]).unwrap();
        assert_eq!(mask.len(), 9);
        assert_eq!(mask[(b'o' / 32) as usize], 1 << (b'o' % 32));
        let mask = plugin
            .next(id, &[u32::from(b'o'), u32::from(b'k')])
            .unwrap();
        assert_eq!(mask[8], 1, "only EOS (token 256) after the whole choice");
        plugin.rollback(id, 1).unwrap();
        let mask = plugin.next(id, &[]).unwrap();
        assert_eq!(mask[(b'k' / 32) as usize], 1 << (b'k' % 32));
        plugin.close(id);
        assert_eq!(
            plugin.next(id, &[]).unwrap_err(),
            format!("no open matcher {id}")
        );
        let bad = Config::new(vec![("max_opn".into(), ConfigValue::Integer(1))]);
        assert!(Llguidance::init(&bad, &vocabulary).is_err());
    }
}
