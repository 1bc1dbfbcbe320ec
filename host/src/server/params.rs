//! Request validation: OpenAI fields → checked generation parameters.
//!
//! Owns: every range and cross-field rule on request parameters (temperature, top_p, top_k,
//! min_p, penalties, n, stop, logprobs, stream options, vLLM's extensions — `min_tokens`,
//! `logit_bias`, `prompt_logprobs`, `truncate_prompt_tokens`, `priority` — and unsupported
//! features). The output,
//! [`GenParams`], is what the pipeline trusts without further checks. It must not tokenize or
//! look at the model beyond the limits it is given.

use super::error::AppError;
use super::protocol::{CommonFields, StopInput};
use crate::engine::api::SamplingParams;

/// Limits from the server configuration that bound a single request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_n: u32,
    pub max_stop_strings: usize,
    pub max_stop_len: usize,
    pub max_logprobs: u32,
    pub vocab_size: u32,
    /// The longest context (`model.max_model_len`): what `truncate_prompt_tokens = -1` keeps.
    pub max_model_len: u32,
    /// `engine.scheduling_policy = "priority"`: a nonzero `priority` is honoured (else refused).
    pub priority_scheduling: bool,
}

/// Most `logit_bias` entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 1024;

/// Checked parameters for one request (shared by all its choices).
#[derive(Debug, Clone)]
pub struct GenParams {
    pub sampling: SamplingParams,
    /// `None`: `default_max_tokens`, capped by the context.
    pub max_tokens: Option<u32>,
    /// Without `max_tokens`: at most this many (`None`: as many as the context allows). The
    /// endpoint sets it: 16 on `/v1/completions`, as OpenAI and vLLM.
    pub default_max_tokens: Option<u32>,
    /// The request field that holds the prompt, named by context-length errors: `messages`
    /// unless the endpoint says otherwise (`prompt` on `/v1/completions`).
    pub prompt_param: &'static str,
    pub n: u32,
    pub stream: bool,
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats` with `include_usage` (vLLM's rule): every chunk
    /// carries the running usage.
    pub continuous_usage: bool,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special_tokens: bool,
    /// Top alternatives per token when logprobs were asked for.
    pub logprobs: Option<u32>,
    /// Return prompt and output token ids (vLLM's `return_token_ids`).
    pub return_token_ids: bool,
    /// vLLM's `include_stop_str_in_output`.
    pub include_stop_str_in_output: bool,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    pub prompt_logprobs: Option<u32>,
    /// vLLM's `truncate_prompt_tokens`, resolved: keep at most the last this many tokens.
    pub truncate_prompt_tokens: Option<usize>,
    /// vLLM's `priority` (lower first under the priority scheduling policy).
    pub priority: i32,
    /// Whether the engine may decode this request speculatively.
    pub speculative: bool,
}

fn finite(param: &'static str, v: Option<f64>) -> Result<Option<f64>, AppError> {
    match v {
        Some(x) if !x.is_finite() => {
            Err(AppError::invalid(param, format!("{param} must be finite")))
        }
        other => Ok(other),
    }
}

fn in_range(
    param: &'static str,
    v: Option<f64>,
    lo: f64,
    hi: f64,
    default: f64,
) -> Result<f32, AppError> {
    let x = finite(param, v)?.unwrap_or(default);
    if x < lo || x > hi {
        return Err(AppError::invalid(
            param,
            format!("{param} must be in [{lo}, {hi}], got {x}"),
        ));
    }
    Ok(x as f32)
}

/// Validates the fields both endpoints share. `logprobs` is the endpoint's own logprobs ask.
/// The checks run in a fixed order (sampling ranges, `n`, `max_tokens`, streaming, stops,
/// logprobs, `logit_bias`, `min_tokens`, vLLM's prompt options, `priority`): the first that
/// fails is the error.
pub fn validate_common(
    c: &CommonFields,
    max_tokens: Option<u32>,
    logprobs: Option<u32>,
    limits: &Limits,
) -> Result<GenParams, AppError> {
    let ranges = sampling_ranges(c)?;
    let n = choices(c.n, limits)?;
    if max_tokens == Some(0) {
        return Err(AppError::invalid(
            "max_tokens",
            "max_tokens must be at least 1",
        ));
    }
    let streaming = streaming(c)?;
    let stop = stop_strings(c.stop.as_ref(), limits)?;
    let stop_token_ids = stop_token_ids(c.stop_token_ids.as_deref(), limits)?;
    if let Some(lp) = logprobs
        && lp > limits.max_logprobs
    {
        return Err(AppError::invalid(
            "logprobs",
            format!(
                "at most {} logprobs per token are allowed",
                limits.max_logprobs
            ),
        ));
    }
    let logit_bias = logit_bias(c.logit_bias.as_ref(), limits.vocab_size)?;
    let min_tokens = min_tokens(c.min_tokens, max_tokens)?;
    let prompt_logprobs = prompt_logprobs(c.prompt_logprobs, streaming.stream, limits)?;
    let truncate_prompt_tokens = truncate_prompt_tokens(c.truncate_prompt_tokens, limits)?;
    let priority = priority(c.priority, limits)?;
    Ok(GenParams {
        sampling: SamplingParams {
            logprobs,
            min_tokens,
            logit_bias,
            ..ranges
        },
        max_tokens,
        default_max_tokens: None,
        prompt_param: "messages",
        n,
        stream: streaming.stream,
        include_usage: streaming.include_usage,
        continuous_usage: streaming.continuous_usage,
        stop,
        stop_token_ids,
        ignore_eos: c.ignore_eos.unwrap_or(false),
        skip_special_tokens: c.skip_special_tokens.unwrap_or(true),
        return_token_ids: c.return_token_ids.unwrap_or(false),
        logprobs,
        include_stop_str_in_output: c.include_stop_str_in_output.unwrap_or(false),
        prompt_logprobs,
        truncate_prompt_tokens,
        priority,
        speculative: c.speculative.unwrap_or(true),
    })
}

/// The sampling knobs with a range (temperature, top_p, top_k, min_p, the three penalties) and
/// the seed, checked in that order; `logprobs`, `min_tokens` and `logit_bias` are left empty
/// for the caller.
fn sampling_ranges(c: &CommonFields) -> Result<SamplingParams, AppError> {
    let temperature = in_range("temperature", c.temperature, 0.0, 2.0, 1.0)?;
    let top_p = in_range("top_p", c.top_p, 0.0, 1.0, 1.0)?;
    if top_p <= 0.0 {
        return Err(AppError::invalid("top_p", "top_p must be in (0, 1]"));
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 && k <= i64::from(u32::MAX) => k as u32,
        Some(k) => {
            return Err(AppError::invalid(
                "top_k",
                format!("top_k must be -1, 0 or positive, got {k}"),
            ));
        }
    };
    let min_p = in_range("min_p", c.min_p, 0.0, 1.0, 0.0)?;
    let presence_penalty = in_range("presence_penalty", c.presence_penalty, -2.0, 2.0, 0.0)?;
    let frequency_penalty = in_range("frequency_penalty", c.frequency_penalty, -2.0, 2.0, 0.0)?;
    let repetition_penalty = in_range("repetition_penalty", c.repetition_penalty, 0.0, 10.0, 1.0)?;
    if repetition_penalty <= 0.0 {
        return Err(AppError::invalid(
            "repetition_penalty",
            "repetition_penalty must be > 0",
        ));
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k,
        min_p,
        seed: c.seed.map(|s| s as u64),
        presence_penalty,
        frequency_penalty,
        repetition_penalty,
        logprobs: None,
        min_tokens: 0,
        logit_bias: Vec::new(),
    })
}

/// `n`: choices per prompt, 1 unless asked, at most `max_n`.
fn choices(n: Option<u32>, limits: &Limits) -> Result<u32, AppError> {
    let n = n.unwrap_or(1);
    if n == 0 || n > limits.max_n {
        return Err(AppError::invalid(
            "n",
            format!("n must be in [1, {}], got {n}", limits.max_n),
        ));
    }
    Ok(n)
}

/// `stream` and its `stream_options`.
struct Streaming {
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
}

/// `stream_options` only with `stream`; `continuous_usage_stats` counts only with
/// `include_usage` (vLLM's rule).
fn streaming(c: &CommonFields) -> Result<Streaming, AppError> {
    let stream = c.stream.unwrap_or(false);
    if c.stream_options.is_some() && !stream {
        return Err(AppError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    let include_usage = c
        .stream_options
        .as_ref()
        .and_then(|o| o.include_usage)
        .unwrap_or(false);
    let continuous_usage = include_usage
        && c.stream_options
            .as_ref()
            .and_then(|o| o.continuous_usage_stats)
            .unwrap_or(false);
    Ok(Streaming {
        stream,
        include_usage,
        continuous_usage,
    })
}

/// `stop`: at most `max_stop_strings`, none empty, none longer than `max_stop_len` characters.
fn stop_strings(stop: Option<&StopInput>, limits: &Limits) -> Result<Vec<String>, AppError> {
    let stop = match stop {
        None => Vec::new(),
        Some(StopInput::One(s)) => vec![s.clone()],
        Some(StopInput::Many(v)) => v.clone(),
    };
    if stop.len() > limits.max_stop_strings {
        return Err(AppError::invalid(
            "stop",
            format!(
                "at most {} stop strings are allowed",
                limits.max_stop_strings
            ),
        ));
    }
    for s in &stop {
        if s.is_empty() {
            return Err(AppError::invalid("stop", "stop strings must not be empty"));
        }
        if s.chars().count() > limits.max_stop_len {
            return Err(AppError::invalid(
                "stop",
                format!(
                    "stop strings are limited to {} characters",
                    limits.max_stop_len
                ),
            ));
        }
    }
    Ok(stop)
}

/// `stop_token_ids`: at most 256, each inside the vocabulary.
fn stop_token_ids(ids: Option<&[u32]>, limits: &Limits) -> Result<Vec<u32>, AppError> {
    let ids = ids.map(<[u32]>::to_vec).unwrap_or_default();
    if ids.len() > 256 {
        return Err(AppError::invalid(
            "stop_token_ids",
            "at most 256 stop token ids are allowed",
        ));
    }
    if let Some(bad) = ids.iter().find(|t| **t >= limits.vocab_size) {
        return Err(AppError::invalid(
            "stop_token_ids",
            format!("token id {bad} is outside the vocabulary"),
        ));
    }
    Ok(ids)
}

/// vLLM's `min_tokens` (0 unless asked), at most `max_tokens`.
fn min_tokens(min_tokens: Option<u32>, max_tokens: Option<u32>) -> Result<u32, AppError> {
    let min_tokens = min_tokens.unwrap_or(0);
    if let Some(m) = max_tokens
        && min_tokens > m
    {
        return Err(AppError::invalid(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must not exceed max_tokens ({m})"),
        ));
    }
    Ok(min_tokens)
}

/// vLLM's `prompt_logprobs`: not streamed, in `[0, max_logprobs]`.
fn prompt_logprobs(k: Option<i64>, stream: bool, limits: &Limits) -> Result<Option<u32>, AppError> {
    match k {
        None => Ok(None),
        Some(_) if stream => Err(AppError::invalid(
            "prompt_logprobs",
            "prompt_logprobs are not available when stream is true",
        )),
        Some(k) if (0..=i64::from(limits.max_logprobs)).contains(&k) => Ok(Some(k as u32)),
        Some(k) => Err(AppError::invalid(
            "prompt_logprobs",
            format!(
                "prompt_logprobs must be in [0, {}], got {k}",
                limits.max_logprobs
            ),
        )),
    }
}

/// vLLM's `truncate_prompt_tokens`: -1 (the longest context) or at least 1.
fn truncate_prompt_tokens(k: Option<i64>, limits: &Limits) -> Result<Option<usize>, AppError> {
    match k {
        None => Ok(None),
        Some(-1) => Ok(Some(limits.max_model_len as usize)),
        Some(k) if k >= 1 => Ok(Some(usize::try_from(k).unwrap_or(usize::MAX))),
        Some(k) => Err(AppError::invalid(
            "truncate_prompt_tokens",
            format!("truncate_prompt_tokens must be -1 or at least 1, got {k}"),
        )),
    }
}

/// vLLM's `priority`: nonzero only under the priority scheduling policy, and an `i32`.
fn priority(p: Option<i64>, limits: &Limits) -> Result<i32, AppError> {
    match p.unwrap_or(0) {
        0 => Ok(0),
        p if !limits.priority_scheduling => Err(AppError::invalid(
            "priority",
            format!(
                "priority {p} needs engine.scheduling_policy = \"priority\" (this server schedules first come, first served)"
            ),
        )),
        p => i32::try_from(p)
            .map_err(|_| AppError::invalid("priority", format!("priority {p} is out of range"))),
    }
}

/// OpenAI's `logit_bias`: token ids (as strings) to biases in [-100, 100], sorted by id.
fn logit_bias(
    map: Option<&serde_json::Map<String, serde_json::Value>>,
    vocab: u32,
) -> Result<Vec<(u32, f32)>, AppError> {
    let Some(map) = map else {
        return Ok(Vec::new());
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(AppError::invalid(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} logit_bias entries are allowed"),
        ));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let token: u32 = k.trim().parse().map_err(|_| {
            AppError::invalid(
                "logit_bias",
                format!("logit_bias key {k:?} is not a token id"),
            )
        })?;
        if token >= vocab {
            return Err(AppError::invalid(
                "logit_bias",
                format!("logit_bias token id {token} is outside the vocabulary (size {vocab})"),
            ));
        }
        let bias = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                AppError::invalid(
                    "logit_bias",
                    format!("logit_bias of token {token} must be a number in [-100, 100], got {v}"),
                )
            })?;
        out.push((token, bias as f32));
    }
    out.sort_unstable_by_key(|e| e.0);
    if out.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(AppError::invalid(
            "logit_bias",
            "logit_bias names a token id twice",
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Limits {
        Limits {
            max_n: 8,
            max_stop_strings: 4,
            max_stop_len: 16,
            max_logprobs: 20,
            vocab_size: 100,
            max_model_len: 64,
            priority_scheduling: false,
        }
    }

    #[test]
    fn defaults_and_ranges() {
        let p = validate_common(&CommonFields::default(), None, None, &limits()).unwrap();
        assert_eq!(p.sampling.temperature, 1.0);
        assert_eq!(p.n, 1);
        assert!(p.skip_special_tokens);
        let bad = [
            CommonFields {
                temperature: Some(2.5),
                ..Default::default()
            },
            CommonFields {
                top_p: Some(0.0),
                ..Default::default()
            },
            CommonFields {
                top_k: Some(-2),
                ..Default::default()
            },
            CommonFields {
                n: Some(9),
                ..Default::default()
            },
            CommonFields {
                stop: Some(StopInput::One(String::new())),
                ..Default::default()
            },
            CommonFields {
                stop_token_ids: Some(vec![100]),
                ..Default::default()
            },
            CommonFields {
                repetition_penalty: Some(0.0),
                ..Default::default()
            },
        ];
        for c in bad {
            assert!(validate_common(&c, None, None, &limits()).is_err(), "{c:?}");
        }
        assert!(validate_common(&CommonFields::default(), Some(0), None, &limits()).is_err());
        assert!(validate_common(&CommonFields::default(), None, Some(21), &limits()).is_err());
        let k = CommonFields {
            top_k: Some(-1),
            seed: Some(-1),
            ..Default::default()
        };
        let p = validate_common(&k, Some(3), Some(2), &limits()).unwrap();
        assert_eq!(
            (p.sampling.top_k, p.sampling.seed, p.logprobs),
            (0, Some(u64::MAX), Some(2))
        );
    }
}
