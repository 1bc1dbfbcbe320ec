//! Reading Hugging Face `config.json` files as they are found in the wild.
//!
//! The file is parsed leniently (older checkpoints contain bare `Infinity`/`NaN`, which is not
//! JSON; transformers 5 writes `{"__float__": "Infinity"}`), then read key by key: every
//! missing or ill-typed key is an error that names the key and the file.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::ModelError;

/// A parsed `config.json` with typed, error-reporting accessors.
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub path: PathBuf,
    pub json: Value,
}

/// Replaces bare `Infinity`, `-Infinity` and `NaN` tokens outside strings with tagged objects.
fn sanitize_non_finite(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_str = false;
    let mut escaped = false;
    let mut rest = text;
    while let Some(ch) = rest.chars().next() {
        if in_str {
            out.push(ch);
            if escaped {
                escaped = false;
            } else if ch == '\\' {
                escaped = true;
            } else if ch == '"' {
                in_str = false;
            }
            rest = &rest[ch.len_utf8()..];
            continue;
        }
        if ch == '"' {
            in_str = true;
        }
        let mut matched = false;
        for (token, value) in [
            ("-Infinity", "-Infinity"),
            ("Infinity", "Infinity"),
            ("NaN", "NaN"),
        ] {
            if rest.starts_with(token) {
                out.push_str(&format!("{{\"__float__\": \"{value}\"}}"));
                rest = &rest[token.len()..];
                matched = true;
                break;
            }
        }
        if !matched {
            out.push(ch);
            rest = &rest[ch.len_utf8()..];
        }
    }
    out
}

fn as_f64(v: &Value) -> Option<f64> {
    if let Some(f) = v.as_f64() {
        return Some(f);
    }
    match v.get("__float__")?.as_str()? {
        "Infinity" => Some(f64::INFINITY),
        "-Infinity" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => None,
    }
}

impl HfConfig {
    pub fn load(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::Io {
            path: path.clone(),
            source: e,
        })?;
        Self::parse(&text, path)
    }

    pub fn parse(text: &str, path: PathBuf) -> Result<Self, ModelError> {
        let json: Value =
            serde_json::from_str(&sanitize_non_finite(text)).map_err(|e| ModelError::Config {
                path: path.clone(),
                message: format!("not valid JSON: {e}"),
            })?;
        if !json.is_object() {
            return Err(ModelError::Config {
                path,
                message: "the top level is not an object".into(),
            });
        }
        Ok(Self { path, json })
    }

    fn err(&self, message: String) -> ModelError {
        ModelError::Config {
            path: self.path.clone(),
            message,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    /// The first entry of `architectures`.
    pub fn architecture(&self) -> Result<String, ModelError> {
        self.get("architectures")
            .and_then(|v| v.as_array())
            .and_then(|a| a.first())
            .and_then(|v| v.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                self.err("missing `architectures` (a list naming the model class)".into())
            })
    }

    pub fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing required key `{key}`")))
    }

    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|u| Some(u as usize)).ok_or_else(|| {
                self.err(format!("`{key}` must be a non-negative integer, got {v}"))
            }),
        }
    }

    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize, ModelError> {
        Ok(self.opt_usize(key)?.unwrap_or(default))
    }

    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => as_f64(v)
                .map(Some)
                .ok_or_else(|| self.err(format!("`{key}` must be a number, got {v}"))),
        }
    }

    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64, ModelError> {
        Ok(self.opt_f64(key)?.unwrap_or(default))
    }

    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(format!("`{key}` must be true or false, got {v}"))),
        }
    }

    pub fn str_or<'a>(&'a self, key: &str, default: &'a str) -> Result<&'a str, ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.err(format!("`{key}` must be a string, got {v}"))),
        }
    }

    /// A pair of numbers such as `time_step_limit` (either element may be a tagged infinity).
    pub fn f64_pair_or(&self, key: &str, default: (f64, f64)) -> Result<(f64, f64), ModelError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Array(a)) if a.len() == 2 => match (as_f64(&a[0]), as_f64(&a[1])) {
                (Some(x), Some(y)) => Ok((x, y)),
                _ => Err(self.err(format!("`{key}` must hold two numbers"))),
            },
            Some(v) => Err(self.err(format!("`{key}` must be a pair of numbers, got {v}"))),
        }
    }

    /// Token ids given as one integer or a list (`eos_token_id`).
    pub fn token_ids(&self, key: &str) -> Vec<u32> {
        match self.get(key) {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64())
                .map(|v| v as u32)
                .collect(),
            _ => Vec::new(),
        }
    }

    /// RoPE settings, from `rope_parameters` (transformers 5) or the older top-level keys.
    pub fn rope_settings(&self) -> Result<RopeSettings, ModelError> {
        let params = self
            .get("rope_parameters")
            .or_else(|| self.get("rope_scaling"));
        let pick = |key: &str| -> Option<f64> {
            params
                .and_then(|p| p.get(key))
                .and_then(as_f64)
                .or_else(|| self.get(key).and_then(as_f64))
        };
        let rope_type = params
            .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
            .and_then(|v| v.as_str())
            .unwrap_or("default")
            .to_string();
        Ok(RopeSettings {
            theta: pick("rope_theta").unwrap_or(10000.0),
            partial_rotary_factor: pick("partial_rotary_factor").unwrap_or(1.0),
            rope_type,
            factor: pick("factor"),
            low_freq_factor: pick("low_freq_factor"),
            high_freq_factor: pick("high_freq_factor"),
            original_max_position_embeddings: pick("original_max_position_embeddings"),
            freq_factors: match params.and_then(|p| p.get("freq_factors")) {
                None => None,
                Some(v) => Some(
                    v.as_array()
                        .and_then(|a| a.iter().map(as_f64).collect::<Option<Vec<f64>>>())
                        .ok_or_else(|| {
                            self.err(
                                "`rope_parameters.freq_factors` must be a list of numbers".into(),
                            )
                        })?,
                ),
            },
        })
    }

    pub fn error(&self, message: impl Into<String>) -> ModelError {
        self.err(message.into())
    }
}

/// RoPE parameters as written in the config; turned into tables by `layers::rope`.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeSettings {
    pub theta: f64,
    pub partial_rotary_factor: f64,
    pub rope_type: String,
    pub factor: Option<f64>,
    pub low_freq_factor: Option<f64>,
    pub high_freq_factor: Option<f64>,
    pub original_max_position_embeddings: Option<f64>,
    /// Per-frequency divisors applied after the scaling above (llama.cpp's `rope_freqs`
    /// tensor, e.g. Llama 3.1 scaling in a GGUF file; not a transformers key).
    pub freq_factors: Option<Vec<f64>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bare_and_tagged_infinity_both_parse() {
        let old = r#"{"time_step_limit": [0.0, Infinity], "name": "NaN Infinity"}"#;
        let new = r#"{"time_step_limit": [0.0, {"__float__": "Infinity"}]}"#;
        for text in [old, new] {
            let c = HfConfig::parse(text, "config.json".into()).unwrap();
            let (lo, hi) = c.f64_pair_or("time_step_limit", (1.0, 2.0)).unwrap();
            assert_eq!(lo, 0.0);
            assert!(hi.is_infinite() && hi > 0.0);
        }
        let c = HfConfig::parse(old, "config.json".into()).unwrap();
        assert_eq!(c.str_or("name", "").unwrap(), "NaN Infinity");
    }

    #[test]
    fn type_errors_name_the_key() {
        let c = HfConfig::parse(r#"{"hidden_size": "big"}"#, "x/config.json".into()).unwrap();
        let e = c.usize("hidden_size").unwrap_err().to_string();
        assert!(
            e.contains("hidden_size") && e.contains("x/config.json"),
            "{e}"
        );
        let e = c.usize("num_heads").unwrap_err().to_string();
        assert!(e.contains("num_heads"), "{e}");
    }
}
