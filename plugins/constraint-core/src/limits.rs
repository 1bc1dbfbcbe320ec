//! The operator's bounds on what one grammar may cost, read from the plugin's config table.
//!
//! Owns [`Limits`] and its config keys. Every key is optional; an absent key takes the default
//! documented on its field (llguidance's own default for the parser knobs). A key outside
//! [`Limits::KEYS`], a wrong type or a value out of range is refused with a message naming the
//! key. This module only reads numbers: it neither compiles grammars nor holds matchers.

use chimera_policy_core::Config;
use llguidance::api::ParserLimits;

/// What one grammar and one plugin instance may cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `max_grammar_bytes`: the longest grammar text `open` accepts, in bytes (default
    /// 262144 = 256 KiB). Checked before any parsing.
    pub max_grammar_bytes: u32,
    /// `max_open`: matchers open at once (default 4096); `open` beyond it is refused.
    pub max_open: u32,
    /// `max_items_in_row`: Earley items in one parser row, about the grammar's branching
    /// factor (default 2000).
    pub max_items_in_row: u32,
    /// `initial_lexer_fuel`: fuel for building the lexer's regex nodes when a grammar is
    /// compiled (default 1000000, about 20 ms).
    pub initial_lexer_fuel: u32,
    /// `step_lexer_fuel`: lexer fuel for one token mask (default 200000, about 15 ms).
    pub step_lexer_fuel: u32,
    /// `step_max_items`: Earley items created for one token mask (default 50000, about
    /// 2.5 ms).
    pub step_max_items: u32,
    /// `max_lexer_states`: lexer DFA states one matcher may build, 1–2 kB each (default
    /// 250000).
    pub max_lexer_states: u32,
    /// `max_grammar_size`: symbols in the compiled grammar's productions (default 500000).
    pub max_grammar_size: u32,
    /// `json_whitespace_max`: the most whitespace characters a JSON schema's output may have
    /// between two of its tokens (default 16: room for a newline and indentation); 0 allows
    /// none. Bounded so that a model cannot pad a response with whitespace until it runs out
    /// of tokens. A schema that carries its own `x-guidance` options keeps them.
    pub json_whitespace_max: u32,
    /// `grammar_cache_entries`: compiled grammars one plugin instance keeps for requests that
    /// send the same grammar again (default 64; 0 compiles every request's). Each holds its
    /// compiled grammar and the lexer states its requests built (bounded by
    /// `max_lexer_states`); the least recently used goes first.
    pub grammar_cache_entries: u32,
}

impl Limits {
    /// The config keys this module reads.
    pub const KEYS: &'static [&'static str] = &[
        "max_grammar_bytes",
        "max_open",
        "max_items_in_row",
        "initial_lexer_fuel",
        "step_lexer_fuel",
        "step_max_items",
        "max_lexer_states",
        "max_grammar_size",
        "json_whitespace_max",
        "grammar_cache_entries",
    ];

    /// Reads the limits from `config`, refusing unknown keys.
    pub fn from_config(config: &Config) -> Result<Self, String> {
        config.expect_keys(Self::KEYS)?;
        let d = Self::default();
        Ok(Self {
            max_grammar_bytes: config.u32_in(
                "max_grammar_bytes",
                d.max_grammar_bytes,
                1,
                64 << 20,
            )?,
            max_open: config.u32_in("max_open", d.max_open, 1, 1 << 20)?,
            max_items_in_row: config.u32_in("max_items_in_row", d.max_items_in_row, 1, u32::MAX)?,
            initial_lexer_fuel: config.u32_in(
                "initial_lexer_fuel",
                d.initial_lexer_fuel,
                1,
                u32::MAX,
            )?,
            step_lexer_fuel: config.u32_in("step_lexer_fuel", d.step_lexer_fuel, 1, u32::MAX)?,
            step_max_items: config.u32_in("step_max_items", d.step_max_items, 1, u32::MAX)?,
            max_lexer_states: config.u32_in("max_lexer_states", d.max_lexer_states, 1, u32::MAX)?,
            max_grammar_size: config.u32_in("max_grammar_size", d.max_grammar_size, 1, u32::MAX)?,
            json_whitespace_max: config.u32_in(
                "json_whitespace_max",
                d.json_whitespace_max,
                0,
                1024,
            )?,
            grammar_cache_entries: config.u32_in(
                "grammar_cache_entries",
                d.grammar_cache_entries,
                0,
                4096,
            )?,
        })
    }

    /// llguidance's parser limits with these knobs. Errors stay short (no parser state or
    /// grammar dump): they go back to the client.
    pub fn parser_limits(&self) -> ParserLimits {
        ParserLimits {
            max_items_in_row: self.max_items_in_row as usize,
            initial_lexer_fuel: u64::from(self.initial_lexer_fuel),
            step_lexer_fuel: u64::from(self.step_lexer_fuel),
            step_max_items: self.step_max_items as usize,
            max_lexer_states: self.max_lexer_states as usize,
            max_grammar_size: self.max_grammar_size as usize,
            precompute_large_lexemes: true,
            verbose_errors: false,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        let llg = ParserLimits::default();
        // llguidance's defaults all fit in u32; saturate rather than trust that forever.
        let fit = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        Self {
            max_grammar_bytes: 256 << 10,
            max_open: 4096,
            max_items_in_row: fit(llg.max_items_in_row as u64),
            initial_lexer_fuel: fit(llg.initial_lexer_fuel),
            step_lexer_fuel: fit(llg.step_lexer_fuel),
            step_max_items: fit(llg.step_max_items as u64),
            max_lexer_states: fit(llg.max_lexer_states as u64),
            max_grammar_size: fit(llg.max_grammar_size as u64),
            json_whitespace_max: 16,
            grammar_cache_entries: 64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chimera_policy_core::ConfigValue;

    #[test]
    fn defaults_are_llguidances_and_keys_override() {
        let d = Limits::from_config(&Config::default()).unwrap();
        assert_eq!(d, Limits::default());
        assert_eq!(d.max_grammar_bytes, 262_144);
        assert_eq!(d.max_open, 4096);
        assert_eq!(d.max_items_in_row, 2000);
        assert_eq!(d.initial_lexer_fuel, 1_000_000);
        assert_eq!(d.step_lexer_fuel, 200_000);
        assert_eq!(d.step_max_items, 50_000);
        assert_eq!(d.max_lexer_states, 250_000);
        assert_eq!(d.max_grammar_size, 500_000);

        let c = Config::new(vec![
            ("max_open".into(), ConfigValue::Integer(7)),
            ("step_lexer_fuel".into(), ConfigValue::Integer(1234)),
        ]);
        let l = Limits::from_config(&c).unwrap();
        assert_eq!((l.max_open, l.step_lexer_fuel), (7, 1234));
        assert_eq!(l.parser_limits().step_lexer_fuel, 1234);
        assert!(!l.parser_limits().verbose_errors);
    }

    #[test]
    fn bad_keys_and_values_are_named() {
        let unknown = Config::new(vec![("max_opn".into(), ConfigValue::Integer(7))]);
        let err = Limits::from_config(&unknown).unwrap_err();
        assert!(
            err.contains("`max_opn`") && err.contains("max_open"),
            "{err}"
        );
        let zero = Config::new(vec![("max_open".into(), ConfigValue::Integer(0))]);
        let err = Limits::from_config(&zero).unwrap_err();
        assert!(err.contains("`max_open`") && err.contains("got 0"), "{err}");
        let text = Config::new(vec![(
            "step_max_items".into(),
            ConfigValue::Text("x".into()),
        )]);
        let err = Limits::from_config(&text).unwrap_err();
        assert!(err.contains("`step_max_items` must be an integer"), "{err}");
    }
}
