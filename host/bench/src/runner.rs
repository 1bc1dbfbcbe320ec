//! Drives one load point: dispatches sessions to the server and collects their records.
//!
//! Owns the two dispatch loops — closed-loop workers (`Concurrency`) and open-loop arrivals
//! (`Rate`, optionally capped by a semaphore) — the request budget and the deadline, and the
//! progress bar. A session's turns are always sent in order by one task, each turn after the
//! previous one completed, continuing the conversation with the server's answer.
//!
//! Invariants: the request budget is reserved per session before its first turn, so a run of
//! `N` requests sends at most `N` (exactly `N` when nothing fails and no deadline passes);
//! turns not sent because an earlier turn failed are counted as skipped, and every request
//! sent yields exactly one record. No new request starts after the deadline; requests in
//! flight then are awaited (up to the request timeout). Must not compute statistics.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use indicatif::ProgressBar;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::arrivals::{Arrivals, Bounds, LoadPoint};
use super::client::{HttpClient, PromptFormat, RequestOptions, build_body};
use super::stats::{Failure, RequestRecord};
use super::tokens::PromptTokenizer;
use super::workload::Workload;

/// Everything the tasks of one point share.
pub struct PointContext {
    pub client: HttpClient,
    pub path: String,
    pub opts: RequestOptions,
    pub workload: Workload,
    pub tokenizer: Arc<PromptTokenizer>,
    pub timeout: Duration,
    pub progress: ProgressBar,
    /// Set on interruption: no new request starts; requests in flight finish.
    pub stop: Arc<AtomicBool>,
}

/// What one load point produced.
#[derive(Debug, Default)]
pub struct PointRun {
    /// Ordered by send time.
    pub records: Vec<RequestRecord>,
    pub duration_s: f64,
    pub skipped_turns: usize,
}

/// Requests left to send; `usize::MAX` when unbounded.
struct Budget(AtomicUsize);

impl Budget {
    /// Takes up to `want` requests; returns how many were granted.
    fn take(&self, want: usize) -> usize {
        let mut granted = 0;
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                granted = left.min(want);
                (granted > 0).then_some(left - granted)
            });
        granted
    }
}

struct Clock {
    start: Instant,
    deadline: Option<Instant>,
    stop: Arc<AtomicBool>,
}

impl Clock {
    /// True once the deadline passed or the run was interrupted.
    fn expired(&self) -> bool {
        self.stop.load(Ordering::Relaxed) || self.deadline.is_some_and(|d| Instant::now() >= d)
    }
}

/// Runs one load point to completion.
pub async fn run_point(
    ctx: Arc<PointContext>,
    point: LoadPoint,
    bounds: Bounds,
    seed: u64,
) -> PointRun {
    let start = Instant::now();
    let clock = Arc::new(Clock {
        start,
        deadline: bounds.duration.map(|d| start + d),
        stop: ctx.stop.clone(),
    });
    let budget = Arc::new(Budget(AtomicUsize::new(
        bounds.max_requests.unwrap_or(usize::MAX),
    )));
    let n_sessions = ctx.workload.sessions.len().max(1);
    let mut tasks: JoinSet<(Vec<RequestRecord>, usize)> = JoinSet::new();
    match point {
        LoadPoint::Concurrency(clients) => {
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..clients.max(1) {
                let (ctx, clock, budget, next) =
                    (ctx.clone(), clock.clone(), budget.clone(), next.clone());
                tasks.spawn(async move {
                    let mut records = Vec::new();
                    let mut skipped = 0;
                    while !clock.expired() {
                        let idx = next.fetch_add(1, Ordering::SeqCst) % n_sessions;
                        let turns = ctx.workload.sessions.get(idx).map_or(0, |s| s.turns.len());
                        let granted = budget.take(turns);
                        if granted == 0 {
                            break;
                        }
                        let (r, s) = run_session(&ctx, &clock, idx, granted, None).await;
                        records.extend(r);
                        skipped += s;
                    }
                    (records, skipped)
                });
            }
        }
        LoadPoint::Rate {
            rate,
            burstiness,
            max_concurrency,
        } => {
            let sem = max_concurrency.map(|m| Arc::new(Semaphore::new(m.max(1))));
            let mut arrivals = Arrivals::new(rate, burstiness, seed);
            let mut idx = 0usize;
            loop {
                let at = start + Duration::from_secs_f64(arrivals.next_offset());
                if clock.deadline.is_some_and(|d| at >= d) {
                    break;
                }
                tokio::time::sleep_until(at).await;
                if clock.expired() {
                    break;
                }
                let session = idx % n_sessions;
                let turns = ctx
                    .workload
                    .sessions
                    .get(session)
                    .map_or(0, |s| s.turns.len());
                let granted = budget.take(turns);
                if granted == 0 {
                    break;
                }
                let (ctx, clock, sem) = (ctx.clone(), clock.clone(), sem.clone());
                tasks.spawn(async move { run_session(&ctx, &clock, session, granted, sem).await });
                idx += 1;
                if idx.is_multiple_of(64) {
                    tokio::task::yield_now().await;
                }
            }
        }
    }
    let mut out = PointRun::default();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok((records, skipped)) => {
                out.records.extend(records);
                out.skipped_turns += skipped;
            }
            Err(e) => out.records.push(RequestRecord {
                error: Some(Failure {
                    kind: "internal".into(),
                    message: e.to_string(),
                }),
                ..Default::default()
            }),
        }
    }
    out.duration_s = start.elapsed().as_secs_f64();
    out.records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    out
}

/// Sends up to `turns` turns of session `idx`; returns the records and the turns skipped
/// because one failed.
async fn run_session(
    ctx: &PointContext,
    clock: &Clock,
    idx: usize,
    turns: usize,
    sem: Option<Arc<Semaphore>>,
) -> (Vec<RequestRecord>, usize) {
    let Some(session) = ctx.workload.sessions.get(idx) else {
        return (Vec::new(), 0);
    };
    let mut records = Vec::with_capacity(turns);
    let mut answers: Vec<String> = Vec::new();
    let mut known_tokens = session.system.as_ref().map_or(0, |s| s.tokens());
    for k in 0..turns {
        if clock.expired() {
            break;
        }
        let Some(turn) = session.turns.get(k) else {
            break;
        };
        let _permit = match &sem {
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        };
        let body = build_body(&ctx.opts, session, k, &answers);
        known_tokens += turn.user.tokens();
        let send_at = Instant::now();
        let ex = ctx.client.stream(&ctx.path, &body, ctx.timeout).await;
        let failed = ex.error.is_some();
        let rec = RequestRecord {
            session: session.id,
            turn: k,
            group: session.group,
            start_s: (send_at - clock.start).as_secs_f64(),
            ttft_s: ex.ttft,
            e2e_s: ex.e2e,
            itl_s: ex.itl,
            sent_prompt_tokens: known_tokens,
            requested_output_tokens: turn.output_len,
            output_chunks: ex.chunks,
            prompt_tokens: ex.prompt_tokens,
            completion_tokens: ex.completion_tokens,
            cached_tokens: ex.cached_tokens,
            error: ex.error,
        };
        records.push(rec);
        ctx.progress.inc(1);
        if failed {
            return (records, turns - k - 1);
        }
        if k + 1 < turns {
            if ctx.opts.prompt_format == PromptFormat::Text {
                known_tokens += ctx.tokenizer.count(&ex.text).unwrap_or(0);
            }
            answers.push(ex.text);
        }
    }
    (records, 0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_interrupted_point_sends_nothing_new() {
        let tok = PromptTokenizer::words();
        let spec = crate::workload::WorkloadSpec::Random {
            requests: 3,
            input_len: crate::workload::LenRange::fixed(4),
            output_len: crate::workload::LenRange::fixed(2),
        };
        let workload = crate::workload::build(&spec, &tok, 0, true).unwrap();
        let ctx = Arc::new(PointContext {
            client: HttpClient::new("http://127.0.0.1:9", None).unwrap(),
            path: "/v1/completions".into(),
            opts: RequestOptions {
                endpoint: crate::client::Endpoint::Completions,
                model: "m".into(),
                prompt_format: PromptFormat::Text,
                temperature: 0.0,
                ignore_eos: false,
                extra_body: serde_json::Map::new(),
            },
            workload,
            tokenizer: Arc::new(tok),
            timeout: Duration::from_secs(5),
            progress: ProgressBar::hidden(),
            stop: Arc::new(AtomicBool::new(true)),
        });
        let bounds = Bounds {
            max_requests: Some(3),
            duration: None,
        };
        let rate = LoadPoint::Rate {
            rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: None,
        };
        for point in [LoadPoint::Concurrency(2), rate] {
            let out = run_point(ctx.clone(), point, bounds, 0).await;
            assert!(out.records.is_empty(), "{point:?}");
        }
        // Not stopped: the same point sends all three (connection refused, counted).
        ctx.stop.store(false, Ordering::Relaxed);
        let out = run_point(ctx, LoadPoint::Concurrency(2), bounds, 0).await;
        assert_eq!(out.records.len(), 3);
        assert!(
            out.records
                .iter()
                .all(|r| r.error.as_ref().unwrap().kind == "connect")
        );
    }

    #[test]
    fn budget_grants_until_empty() {
        let b = Budget(AtomicUsize::new(5));
        assert_eq!(b.take(3), 3);
        assert_eq!(b.take(3), 2);
        assert_eq!(b.take(1), 0);
        let unbounded = Budget(AtomicUsize::new(usize::MAX));
        assert_eq!(unbounded.take(4), 4);
    }
}
