//! A plugin's configuration as flat typed key/values, and checked accessors for it.
//!
//! The host flattens the TOML `config` table of `[policy.<kind>]` into entries: nested tables
//! become dotted keys (`guard.kv_usage`), array items get their index (`weights.0`). The same
//! entries reach a Wasm plugin's `init` and the native twin's constructor, and both parse them
//! with the accessors here, so both reject the same bad configs with the same message.

use alloc::format;
use alloc::string::{String, ToString};
use alloc::vec::Vec;

/// One configuration value.
#[derive(Debug, Clone, PartialEq)]
pub enum ConfigValue {
    Boolean(bool),
    Integer(i64),
    Float(f64),
    Text(String),
}

impl ConfigValue {
    fn type_name(&self) -> &'static str {
        match self {
            ConfigValue::Boolean(_) => "a boolean",
            ConfigValue::Integer(_) => "an integer",
            ConfigValue::Float(_) => "a float",
            ConfigValue::Text(_) => "a string",
        }
    }
}

/// A plugin's configuration: keys in the order given.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Config {
    pub entries: Vec<(String, ConfigValue)>,
}

impl Config {
    pub fn new(entries: Vec<(String, ConfigValue)>) -> Self {
        Self { entries }
    }

    pub fn get(&self, key: &str) -> Option<&ConfigValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Rejects any key not in `allowed`, naming it and the allowed set.
    pub fn expect_keys(&self, allowed: &[&str]) -> Result<(), String> {
        for (key, _) in &self.entries {
            if !allowed.contains(&key.as_str()) {
                let allowed = if allowed.is_empty() {
                    "none".to_string()
                } else {
                    allowed.join(", ")
                };
                return Err(format!("unknown key `{key}` (allowed: {allowed})"));
            }
        }
        Ok(())
    }

    /// A number in `[min, max]`; integers are accepted as floats.
    pub fn f64_in(&self, key: &str, default: f64, min: f64, max: f64) -> Result<f64, String> {
        let value = match self.get(key) {
            None => return Ok(default),
            Some(ConfigValue::Float(f)) => *f,
            Some(ConfigValue::Integer(i)) => *i as f64,
            Some(other) => {
                return Err(format!(
                    "`{key}` must be a number, got {}",
                    other.type_name()
                ));
            }
        };
        // Written so that NaN fails the check.
        if value >= min && value <= max {
            Ok(value)
        } else {
            Err(format!("`{key}` must be in [{min}, {max}], got {value}"))
        }
    }

    /// An integer in `[min, max]`.
    pub fn u32_in(&self, key: &str, default: u32, min: u32, max: u32) -> Result<u32, String> {
        let value = match self.get(key) {
            None => return Ok(default),
            Some(ConfigValue::Integer(i)) => *i,
            Some(other) => {
                return Err(format!(
                    "`{key}` must be an integer, got {}",
                    other.type_name()
                ));
            }
        };
        if value >= min as i64 && value <= max as i64 {
            Ok(value as u32)
        } else {
            Err(format!("`{key}` must be in [{min}, {max}], got {value}"))
        }
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool, String> {
        match self.get(key) {
            None => Ok(default),
            Some(ConfigValue::Boolean(b)) => Ok(*b),
            Some(other) => Err(format!(
                "`{key}` must be a boolean, got {}",
                other.type_name()
            )),
        }
    }

    pub fn text(&self, key: &str) -> Result<Option<&str>, String> {
        match self.get(key) {
            None => Ok(None),
            Some(ConfigValue::Text(s)) => Ok(Some(s)),
            Some(other) => Err(format!(
                "`{key}` must be a string, got {}",
                other.type_name()
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    fn cfg(entries: &[(&str, ConfigValue)]) -> Config {
        Config::new(
            entries
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
        )
    }

    #[test]
    fn numbers_default_convert_and_range_check() {
        let c = cfg(&[
            ("alpha", ConfigValue::Integer(1)),
            ("beta", ConfigValue::Float(2.5)),
        ]);
        assert_eq!(c.f64_in("alpha", 0.5, 0.0, 1.0), Ok(1.0));
        assert_eq!(c.f64_in("gamma", 0.5, 0.0, 1.0), Ok(0.5));
        let err = c.f64_in("beta", 0.5, 0.0, 1.0).unwrap_err();
        assert!(err.contains("`beta`") && err.contains("2.5"), "{err}");
        let nan = cfg(&[("x", ConfigValue::Float(f64::NAN))]);
        assert!(nan.f64_in("x", 0.0, 0.0, 1.0).is_err());
    }

    #[test]
    fn type_mismatch_and_unknown_keys_are_named() {
        let c = cfg(&[("alpha", ConfigValue::Text("high".into()))]);
        let err = c.f64_in("alpha", 0.5, 0.0, 1.0).unwrap_err();
        assert!(
            err.contains("must be a number") && err.contains("a string"),
            "{err}"
        );
        let err = c.expect_keys(&["beta", "gamma"]).unwrap_err();
        assert!(
            err.contains("`alpha`") && err.contains("beta, gamma"),
            "{err}"
        );
        assert!(Config::new(vec![]).expect_keys(&[]).is_ok());
        assert!(c.u32_in("alpha", 1, 0, 4).is_err());
        assert_eq!(c.text("alpha"), Ok(Some("high")));
        assert!(c.bool_or("alpha", true).is_err());
    }
}
