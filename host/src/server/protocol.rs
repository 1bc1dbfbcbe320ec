//! OpenAI wire shapes: request bodies as parsed and response bodies as sent.
//!
//! Owns: the serde structs of `/v1/completions`, `/v1/chat/completions` and `/v1/models`
//! (requests and responses, streaming chunks included). Only shapes live here: ranges and
//! cross-field rules are checked in `params`. Unknown request fields are collected (the
//! handlers log them as a warning, as vLLM does, so `"max_token": 5` does not pass silently)
//! and otherwise ignored, as OpenAI's SDKs send fields newer than any server (`service_tier`,
//! `metadata`, …); fields this server
//! knows but does not implement (`tools`, `suffix`, …) are parsed so that `params` can reject
//! them instead of silently ignoring them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A completions prompt: text, token ids, or a batch of either.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Tokens(Vec<u32>),
    TextBatch(Vec<String>),
    TokenBatch(Vec<Vec<u32>>),
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM's extension: with `include_usage`, every chunk carries the running usage.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Sampling and output fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StopInput>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub user: Option<String>,
    /// vLLM's extension: also return the prompt's token ids (`prompt_token_ids`) and each
    /// choice's generated ids (`token_ids`), so a conversation can continue in token space.
    pub return_token_ids: Option<bool>,
    /// vLLM's: tokens generated before a stop token, EOS or stop string may end the output.
    pub min_tokens: Option<u32>,
    /// vLLM's: keep the matched stop string at the end of the text.
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: logprobs of every prompt token with this many alternatives each.
    pub prompt_logprobs: Option<i64>,
    /// vLLM's: keep only the last this many prompt tokens (-1: the last `max_model_len`).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: admission order under `engine.scheduling_policy = "priority"` (lower first).
    pub priority: Option<i64>,
    /// chimera's: `false` keeps this request out of speculative decoding (`[speculative]`);
    /// the output is the same either way.
    pub speculative: Option<bool>,
    /// OpenAI's `json_schema` / `json_object` / `text`.
    pub response_format: Option<Value>,
    /// vLLM's structured outputs: one of `json`, `regex`, `choice`, `grammar`.
    pub structured_outputs: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    #[serde(flatten)]
    pub common: CommonFields,
    /// Number of top alternatives per token (legacy completions shape).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub best_of: Option<u32>,
    pub suffix: Option<String>,
    /// chimera's extension: prompt token offsets (each in `1 ..= prompt length`) where the
    /// SSM state should be kept as a snapshot, budget permitting (rounded down to a block).
    pub cache_checkpoints: Option<Vec<u32>>,
    /// Fields this server does not know (logged as a warning, then ignored).
    #[serde(flatten)]
    pub unknown: serde_json::Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    /// An assistant turn's tool calls (`[{id, type: "function", function: {name,
    /// arguments}}]`, arguments a JSON string), rendered by the chat template.
    pub tool_calls: Option<Value>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(flatten)]
    pub common: CommonFields,
    pub max_completion_tokens: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    /// Extra variables for the chat template (vLLM's field; e.g. `enable_thinking: false` for
    /// the Qwen3 family). The request's own variables (`messages`, `tools`, …) win over them.
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// chimera's extension: indices into `messages` whose end (as the chat template renders
    /// it) should be kept as an SSM snapshot, budget permitting.
    pub cache_checkpoints: Option<Vec<u32>>,
    /// Fields this server does not know (logged as a warning, then ignored).
    #[serde(flatten)]
    pub unknown: serde_json::Map<String, Value>,
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
    /// chimera's extension: the prompt tokens the cache could have served (whole blocks,
    /// leaving at least two tokens to compute), summed over prompts.
    pub cacheable_tokens: u32,
    /// chimera's extension: why `cached_tokens` fell short of `cacheable_tokens` (the first
    /// prompt that fell short); absent when nothing was missed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_miss_reason: Option<&'static str>,
}

#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct UsageBody {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Legacy completions logprobs: parallel lists.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    pub text_offset: Vec<u32>,
}

#[derive(Debug, Clone, Serialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// vLLM's `prompt_logprobs`: per prompt token `null` or `{id: {logprob, rank,
    /// decoded_token}}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
    pub finish_reason: Option<&'static str>,
    /// The stop string or stop token that ended the choice (vLLM's extension).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Value>,
    /// With `return_token_ids` (vLLM's extension): the prompt's ids (on a stream, in the
    /// choice's first chunk only) and the ids generated (on a stream, this chunk's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

/// The body every completion and chat response and stream chunk shares: identity, the choices
/// (`C`, one shape per endpoint and framing) and the usage (`U`: always present in a whole chat
/// response; elsewhere `Option<Option<_>>`, present as `null` on stream chunks only when
/// `include_usage` was asked, filled on the last chunk, or on every chunk with the running counts
/// when `continuous_usage_stats` was asked too).
#[derive(Debug, Clone, Serialize)]
pub struct Envelope<C, U: UsageField> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "UsageField::absent")]
    pub usage: U,
    /// With `return_token_ids`: the rendered prompt's ids (chat; on a stream, the first chunk
    /// only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
    /// vLLM's `prompt_logprobs` of the rendered prompt (a whole chat response).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Value>,
}

/// The usage member of an [`Envelope`]: whether it is left out of the body.
pub trait UsageField {
    fn absent(&self) -> bool;
}

impl UsageField for UsageBody {
    fn absent(&self) -> bool {
        false
    }
}

impl UsageField for Option<Option<UsageBody>> {
    fn absent(&self) -> bool {
        self.is_none()
    }
}

/// A `text_completion` body: a whole response or one chunk of a stream.
pub type CompletionResponse = Envelope<CompletionChoice, Option<Option<UsageBody>>>;
/// A `chat.completion` body.
pub type ChatResponse = Envelope<ChatChoice, UsageBody>;
/// A `chat.completion.chunk` body.
pub type ChatChunk = Envelope<ChatChunkChoice, Option<Option<UsageBody>>>;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    /// `null` when the message is only tool calls (as OpenAI sends it).
    pub content: Option<String>,
    /// Reasoning the parser split out (vLLM's field), when the model reasoned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// One tool call of a message, or one piece of it in a stream (`index` set there).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCallOut {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// JSON text (OpenAI sends arguments as a string).
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Value>,
    /// With `return_token_ids`: the ids generated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<Value>,
    /// With `return_token_ids`: the ids this chunk adds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelCard {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub max_model_len: u32,
}

#[derive(Debug, Clone, Serialize)]
pub struct ModelList {
    pub object: &'static str,
    pub data: Vec<ModelCard>,
}
