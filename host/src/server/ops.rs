//! Operational endpoints: `/health`, `/metrics`, `/admin/*`, JSON fallbacks, error counting.
//!
//! Owns: `/version`, readiness (ready while not shutting down and every replica's engine thread is alive),
//! the Prometheus scrape, the admin endpoints (bearer token from `[server] admin_token`; with no
//! token configured they do not exist and answer 404; a failed plugin reload answers 400 or 500
//! with its reason and is logged), the `/v1` API-key check
//! (`[server] api_key`), and the middleware that counts error responses by kind. It must not
//! format OpenAI bodies.

use axum::body::Body;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::error::{AppError, ErrorKind};
use super::{AppState, ReloadError};
use crate::engine::api::Command;

/// `GET /version` (vLLM's endpoint): the server's version, and the plugin ABI versions it
/// accepts.
pub async fn version() -> Response {
    axum::Json(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "plugin_abi": crate::plugins::abi::ACCEPTED.to_string(),
    }))
    .into_response()
}

pub async fn health(State(state): State<AppState>) -> Response {
    let dead: Vec<usize> = state
        .router()
        .replicas()
        .iter()
        .enumerate()
        .filter(|(_, h)| h.stats_watch().has_changed().is_err())
        .map(|(i, _)| i)
        .collect();
    if state.is_shutting_down() {
        return AppError::ShuttingDown.into_response();
    }
    if !dead.is_empty() {
        let body = json!({"status": "unhealthy", "dead_replicas": dead});
        return (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response();
    }
    let body = json!({
        "status": "ok",
        "replicas": state.router().replicas().len(),
        "in_flight": state.metrics().in_flight(),
    });
    (StatusCode::OK, axum::Json(body)).into_response()
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    let stats = state.router().stats();
    let mut text = state
        .metrics()
        .render(state.model_id(), &stats, &state.cache_info());
    if state.config().metrics_names == super::metrics::MetricNames::Vllm {
        text = super::metrics::with_vllm_names(&text);
    }
    let mut r = Response::new(Body::from(text));
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}

/// Compares without early exit so the token cannot be guessed byte by byte from timing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token of an `Authorization: Bearer <token>` header ("" when there is none).
fn bearer(headers: &HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

fn authorize(state: &AppState, headers: &HeaderMap, path: &str) -> Result<(), AppError> {
    let Some(token) = state.config().admin_token.as_deref() else {
        return Err(AppError::NotFound(path.to_string()));
    };
    if constant_time_eq(bearer(headers).as_bytes(), token.as_bytes()) {
        Ok(())
    } else {
        Err(AppError::Unauthorized("admin token"))
    }
}

/// With `server.api_key` set, every `/v1/*` request must carry it as a bearer token (401
/// otherwise, as vLLM's `--api-key`); `/health`, `/metrics` and `/admin/*` are not affected.
pub async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(key) = state.config().api_key.as_deref()
        && (req.uri().path() == "/v1" || req.uri().path().starts_with("/v1/"))
        && !constant_time_eq(bearer(req.headers()).as_bytes(), key.as_bytes())
    {
        return AppError::Unauthorized("API key").into_response();
    }
    next.run(req).await
}

pub async fn reset_prefix_cache(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, AppError> {
    authorize(&state, &headers, "/admin/reset_prefix_cache")?;
    let handles = state.router().replicas().to_vec();
    let n = handles.len();
    tokio::task::spawn_blocking(move || {
        handles
            .iter()
            .try_for_each(|h| h.control(Command::ResetPrefixCache))
            .map_err(|_| AppError::ShuttingDown)
    })
    .await
    .map_err(|e| AppError::Internal(e.to_string()))??;
    Ok(axum::Json(json!({"status": "ok", "replicas": n})).into_response())
}

/// Query of `POST /admin/reload_plugins`: `?kind=router|evictor|sampler` reloads one plugin.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReloadQuery {
    kind: Option<String>,
}

pub async fn reload_plugins(
    State(state): State<AppState>,
    headers: HeaderMap,
    query: Result<Query<ReloadQuery>, QueryRejection>,
) -> Result<Response, AppError> {
    authorize(&state, &headers, "/admin/reload_plugins")?;
    let Query(query) = query.map_err(|e| AppError::invalid("kind", e.body_text()))?;
    let Some(hooks) = state.inner().admin_hooks.clone() else {
        return Err(AppError::Unsupported(
            "plugin reload is not configured in this server".into(),
        ));
    };
    let kind = query.kind.clone();
    let outcome = tokio::task::spawn_blocking(move || hooks.reload_plugins(kind.as_deref()))
        .await
        .unwrap_or_else(|e| {
            Err(ReloadError::Internal(format!(
                "the reload task failed: {e}"
            )))
        });
    match outcome {
        Ok(summary) => Ok(axum::Json(json!({"status": "ok", "summary": summary})).into_response()),
        Err(e) => {
            tracing::error!(kind = ?query.kind, error = %e, "plugin reload failed; the running plugins stay");
            let message = format!("plugin reload failed (the running plugins stay): {e}");
            Err(match e {
                ReloadError::BadRequest(_) => AppError::invalid("plugin", message),
                ReloadError::Internal(_) => AppError::Internal(message),
            })
        }
    }
}

pub async fn not_found(req: Request) -> AppError {
    AppError::NotFound(req.uri().path().chars().take(200).collect())
}

pub async fn method_not_allowed() -> AppError {
    AppError::MethodNotAllowed
}

/// Counts error responses by their stable kind.
pub async fn count_errors(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    if let Some(ErrorKind(kind)) = resp.extensions().get::<ErrorKind>() {
        state.metrics().error(kind);
    } else if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
        state.metrics().error("payload_too_large");
    }
    resp
}
