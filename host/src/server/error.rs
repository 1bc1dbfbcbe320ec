//! The server's error type and its one mapping to HTTP.
//!
//! Owns: [`AppError`], every failure a request can meet between the socket and the engine, and
//! its `IntoResponse` (status, OpenAI error JSON `{"error": {message, type, param, code}}`, and
//! `Retry-After` for overload). Invariants: each variant has a stable [`AppError::kind`] string,
//! used as the `code` field and as the `kind` label of the error metric (an engine failure keeps
//! its [`FailureKind`] string); no other module chooses an HTTP status for an error, and every
//! engine [`FailureKind`] is mapped here, exhaustively.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::text::TextError;
use crate::engine::api::{FailureKind, SubmitError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum AppError {
    #[error("invalid JSON body: {0}")]
    InvalidJson(String),
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<&'static str>,
    },
    /// The prompt, or the prompt and `max_tokens`, exceed the context window; `param` is the
    /// field that holds the prompt (`messages` on chat, `prompt` on completions).
    #[error("{message}")]
    ContextLength {
        message: String,
        param: &'static str,
    },
    #[error(
        "the model `{model}` does not exist; this server serves {}",
        quoted(served)
    )]
    ModelNotFound { model: String, served: Vec<String> },
    #[error("no route for {0}")]
    NotFound(String),
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("request body larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// A missing or wrong bearer token; says which one (`admin` or `API key`).
    #[error("missing or invalid {0} (send `Authorization: Bearer <token>`)")]
    Unauthorized(&'static str),
    #[error("the server is at capacity; retry later")]
    Overloaded { retry_after_secs: u32 },
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The engine failed the request (`EngineEvent::Failed`).
    #[error("engine error ({kind}): {message}")]
    Engine {
        kind: FailureKind,
        message: String,
        /// `Retry-After` when the kind is worth retrying (a full queue).
        retry_after_secs: u32,
    },
    #[error("internal error: {0}")]
    Internal(String),
}

impl AppError {
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param),
        }
    }

    /// Stable kind string: the error `code` and the metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::InvalidJson(_) => "invalid_json",
            Self::InvalidRequest { .. } => "invalid_request",
            Self::ContextLength { .. } => "context_length_exceeded",
            Self::ModelNotFound { .. } => "model_not_found",
            Self::NotFound(_) => "not_found",
            Self::MethodNotAllowed => "method_not_allowed",
            Self::PayloadTooLarge(_) => "payload_too_large",
            Self::Unauthorized(_) => "unauthorized",
            Self::Overloaded { .. } => "overloaded",
            Self::ShuttingDown => "shutting_down",
            Self::ChatTemplate(_) => "chat_template_error",
            Self::Unsupported(_) => "unsupported",
            Self::Engine { kind, .. } => kind.as_str(),
            Self::Internal(_) => "internal_error",
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidJson(_)
            | Self::InvalidRequest { .. }
            | Self::ContextLength { .. }
            | Self::ChatTemplate(_)
            | Self::Unsupported(_) => StatusCode::BAD_REQUEST,
            Self::ModelNotFound { .. } | Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::Overloaded { .. } | Self::ShuttingDown => StatusCode::SERVICE_UNAVAILABLE,
            Self::Engine { kind, .. } => match kind {
                FailureKind::InvalidRequest | FailureKind::PromptTooLong => StatusCode::BAD_REQUEST,
                FailureKind::QueueFull => StatusCode::SERVICE_UNAVAILABLE,
                FailureKind::Executor | FailureKind::Cache | FailureKind::Constraint => {
                    StatusCode::INTERNAL_SERVER_ERROR
                }
            },
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Seconds for the `Retry-After` header of an error a client may retry.
    pub fn retry_after(&self) -> Option<u32> {
        match self {
            Self::Overloaded { retry_after_secs }
            | Self::Engine {
                kind: FailureKind::QueueFull,
                retry_after_secs,
                ..
            } => Some(*retry_after_secs),
            Self::ShuttingDown => Some(5),
            _ => None,
        }
    }

    fn error_type(&self) -> &'static str {
        match self.status().as_u16() {
            401 => "authentication_error",
            404 => "not_found_error",
            503 => "service_unavailable",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    fn param(&self) -> Option<&'static str> {
        match self {
            Self::InvalidRequest { param, .. } => *param,
            Self::ContextLength { param, .. } => Some(param),
            Self::ModelNotFound { .. } => Some("model"),
            _ => None,
        }
    }

    /// Logs a request that ended in this error, with its reason: at `error` level when the
    /// server failed (5xx), else at `warn` (refused input, overload); `request_id` when the
    /// response had one (a stream that failed midway).
    pub fn log(&self, request_id: Option<&str>) {
        let status = self.status().as_u16();
        if status >= 500 && status != 503 {
            tracing::error!(
                request_id,
                status,
                code = self.kind(),
                "request failed: {self}"
            );
        } else {
            tracing::warn!(
                request_id,
                status,
                code = self.kind(),
                "request refused: {self}"
            );
        }
    }

    /// The OpenAI error object (also sent as an SSE event when a stream fails).
    pub fn to_json(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.to_string(),
            "type": self.error_type(),
            "param": self.param(),
            "code": self.kind(),
        }})
    }
}

impl IntoResponse for AppError {
    fn into_response(self) -> Response {
        self.log(None);
        let status = self.status();
        let mut resp = (status, axum::Json(self.to_json())).into_response();
        if let Some(secs) = self.retry_after() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if let Self::Unauthorized(_) = self {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        // Handlers store the error so middleware can count it by kind.
        resp.extensions_mut().insert(ErrorKind(self.kind()));
        resp
    }
}

/// Response extension carrying the error kind, read by the metrics middleware.
#[derive(Debug, Clone, Copy)]
pub struct ErrorKind(pub &'static str);

/// `a`, `b` and `c` in backticks.
fn quoted(names: &[String]) -> String {
    let q: Vec<String> = names.iter().map(|n| format!("`{n}`")).collect();
    match q.as_slice() {
        [] => "no model".into(),
        [one] => one.clone(),
        [rest @ .., last] => format!("{} and {last}", rest.join(", ")),
    }
}

impl From<TextError> for AppError {
    fn from(e: TextError) -> Self {
        match e {
            TextError::Render(m) => Self::ChatTemplate(m),
            TextError::NoChatTemplate => Self::ChatTemplate(e.to_string()),
            TextError::Tokenizer(m) => Self::InvalidRequest {
                message: m,
                param: None,
            },
            other => Self::Internal(other.to_string()),
        }
    }
}

impl AppError {
    pub fn from_submit(e: SubmitError, retry_after_secs: u32) -> Self {
        match e {
            SubmitError::QueueFull => Self::Overloaded { retry_after_secs },
            SubmitError::ShuttingDown => Self::ShuttingDown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_kinds_are_stable() {
        let e = AppError::Overloaded {
            retry_after_secs: 2,
        };
        let r = e.clone().into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(r.headers().get(header::RETRY_AFTER).unwrap(), "2");
        assert_eq!(e.kind(), "overloaded");
        let j = AppError::invalid("n", "n must be >= 1").to_json();
        assert_eq!(j["error"]["param"], "n");
        assert_eq!(j["error"]["code"], "invalid_request");
        assert_eq!(j["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn every_engine_failure_kind_has_its_status() {
        for kind in FailureKind::ALL {
            let e = AppError::Engine {
                kind,
                message: "x".into(),
                retry_after_secs: 7,
            };
            let (status, retry) = match kind {
                FailureKind::InvalidRequest | FailureKind::PromptTooLong => (400, None),
                FailureKind::QueueFull => (503, Some("7")),
                FailureKind::Executor | FailureKind::Cache | FailureKind::Constraint => (500, None),
            };
            let r = e.clone().into_response();
            assert_eq!(r.status().as_u16(), status, "{kind}");
            assert_eq!(
                r.headers()
                    .get(header::RETRY_AFTER)
                    .map(|v| v.to_str().unwrap()),
                retry,
                "{kind}"
            );
            assert_eq!(e.kind(), kind.as_str());
            assert_eq!(e.to_json()["error"]["code"], kind.as_str());
        }
    }
}
