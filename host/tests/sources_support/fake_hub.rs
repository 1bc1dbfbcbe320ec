//! A fake Hugging Face hub on 127.0.0.1 that answers as the real one does, for the parts a
//! client uses: `GET /api/models/{org}/{name}/revision/{rev}?blobs=true` (the listing, with
//! sizes) and `GET /{org}/{name}/resolve/{rev}/{file}` (ranged downloads carrying `ETag` and
//! `X-Repo-Commit`), errors with the hub's `X-Error-Code` header (`RepoNotFound`,
//! `RevisionNotFound`, `EntryNotFound`, `GatedRepo`). It records every request, can break
//! off a download part-way to test resumption, and can stop answering (a hub that hangs).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use sha2::{Digest, Sha256};

/// The hub's ETag for a file: its SHA-256 (as for LFS files).
pub fn etag_of(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One model repo: revisions (name → commit) and each commit's files.
#[derive(Clone)]
pub struct FakeRepo {
    id: String,
    refs: HashMap<String, String>,
    commits: HashMap<String, Vec<(String, Vec<u8>)>>,
    /// Gated: only this token gets in.
    granted_token: Option<String>,
}

impl FakeRepo {
    pub fn new(id: &str) -> Self {
        Self {
            id: id.into(),
            refs: HashMap::new(),
            commits: HashMap::new(),
            granted_token: None,
        }
    }

    pub fn revision(mut self, name: &str, sha: &str, files: Vec<(String, Vec<u8>)>) -> Self {
        self.refs.insert(name.into(), sha.into());
        self.commits.insert(sha.into(), files);
        self
    }

    pub fn gated(mut self, token: &str) -> Self {
        self.granted_token = Some(token.into());
        self
    }

    fn commit(&self, rev: &str) -> Option<&str> {
        if self.commits.contains_key(rev) {
            return Some(self.commits.get_key_value(rev)?.0);
        }
        self.refs.get(rev).map(String::as_str)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Logged {
    Listing {
        repo: String,
    },
    File {
        repo: String,
        file: String,
        start: u64,
    },
}

#[derive(Default)]
struct Shared {
    repos: HashMap<String, FakeRepo>,
    log: Vec<Logged>,
    /// file name → byte count after which its next download breaks off.
    cut: HashMap<String, usize>,
    /// Requests for these files (`"*listing*"`: repo listings) never get an answer.
    silent: Vec<String>,
}

/// The `silent` entry that makes repo listings hang.
const LISTING: &str = "*listing*";

type AppState = Arc<Mutex<Shared>>;

pub struct FakeHub {
    addr: SocketAddr,
    state: AppState,
    _rt: tokio::runtime::Runtime,
}

impl FakeHub {
    pub fn start(repos: Vec<FakeRepo>) -> Self {
        let state: AppState = Arc::new(Mutex::new(Shared {
            repos: repos.into_iter().map(|r| (r.id.clone(), r)).collect(),
            ..Default::default()
        }));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let app = Router::new()
            .route("/api/models/{org}/{name}/revision/{rev}", get(listing))
            .route("/{org}/{name}/resolve/{rev}/{*file}", get(resolve))
            .with_state(state.clone());
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let addr = listener.local_addr().unwrap();
        rt.spawn(async move { axum::serve(listener, app).await });
        Self {
            addr,
            state,
            _rt: rt,
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next download of `file` (any repo) sends `after` bytes, then breaks the connection.
    pub fn cut_next_download(&self, file: &str, after: usize) {
        self.state.lock().unwrap().cut.insert(file.into(), after);
    }

    /// From now on, requests for `file` are accepted and never answered.
    pub fn never_answer_file(&self, file: &str) {
        self.state.lock().unwrap().silent.push(file.into());
    }

    /// From now on, repo listings are accepted and never answered.
    pub fn never_answer_listings(&self) {
        self.never_answer_file(LISTING);
    }

    pub fn all_requests(&self) -> usize {
        self.state.lock().unwrap().log.len()
    }

    pub fn file_requests(&self) -> usize {
        let s = self.state.lock().unwrap();
        s.log
            .iter()
            .filter(|l| matches!(l, Logged::File { .. }))
            .count()
    }

    /// Every file name requested at least once.
    pub fn downloaded_files(&self) -> Vec<String> {
        let s = self.state.lock().unwrap();
        let mut names: Vec<String> = s
            .log
            .iter()
            .filter_map(|l| match l {
                Logged::File { file, .. } => Some(file.clone()),
                Logged::Listing { .. } => None,
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The first byte asked for by each request for `file`, in order.
    pub fn range_starts(&self, name: &str) -> Vec<u64> {
        let s = self.state.lock().unwrap();
        s.log
            .iter()
            .filter_map(|l| match l {
                Logged::File { file, start, .. } if file == name => Some(*start),
                _ => None,
            })
            .collect()
    }
}

fn hub_error(status: StatusCode, code: &str, message: &str) -> Response {
    (
        status,
        [("x-error-code", code.to_string())],
        axum::Json(serde_json::json!({ "error": message })),
    )
        .into_response()
}

/// The repo, if it exists and the request may see it; else the hub's error answer.
fn admit(state: &Shared, repo: &str, headers: &HeaderMap) -> Result<FakeRepo, Box<Response>> {
    let Some(r) = state.repos.get(repo) else {
        // The hub does not tell a missing repo from a private one: 401.
        return Err(Box::new(hub_error(
            StatusCode::UNAUTHORIZED,
            "RepoNotFound",
            "Repository not found",
        )));
    };
    if let Some(granted) = &r.granted_token {
        let sent = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        match sent {
            None => {
                return Err(Box::new(hub_error(
                    StatusCode::UNAUTHORIZED,
                    "GatedRepo",
                    "Access to this model is restricted; you must be authenticated",
                )));
            }
            Some(t) if t != granted => {
                return Err(Box::new(hub_error(
                    StatusCode::FORBIDDEN,
                    "GatedRepo",
                    "Access to this model is restricted and you are not in the authorized list",
                )));
            }
            Some(_) => {}
        }
    }
    Ok(r.clone())
}

async fn listing(
    State(state): State<AppState>,
    Path((org, name, rev)): Path<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo_id = format!("{org}/{name}");
    if state.lock().unwrap().silent.iter().any(|f| f == LISTING) {
        std::future::pending::<()>().await;
    }
    let mut s = state.lock().unwrap();
    s.log.push(Logged::Listing {
        repo: repo_id.clone(),
    });
    let repo = match admit(&s, &repo_id, &headers) {
        Ok(r) => r,
        Err(resp) => return *resp,
    };
    let Some(sha) = repo.commit(&rev) else {
        return hub_error(
            StatusCode::NOT_FOUND,
            "RevisionNotFound",
            &format!("Invalid rev id: {rev}"),
        );
    };
    let siblings: Vec<serde_json::Value> = repo.commits[sha]
        .iter()
        .map(|(f, bytes)| serde_json::json!({ "rfilename": f, "size": bytes.len() }))
        .collect();
    axum::Json(serde_json::json!({
        "id": repo_id,
        "sha": sha,
        "siblings": siblings,
    }))
    .into_response()
}

/// `bytes=a-b` or `bytes=a-` → (a, inclusive end) within `len`.
fn parse_range(headers: &HeaderMap, len: usize) -> (usize, usize) {
    let last = len.saturating_sub(1);
    let Some(spec) = headers
        .get(header::RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes="))
    else {
        return (0, last);
    };
    let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
    let start = a.parse().unwrap_or(0);
    let end = b.parse().unwrap_or(last).min(last);
    (start, end)
}

async fn resolve(
    State(state): State<AppState>,
    Path((org, name, rev, file)): Path<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo_id = format!("{org}/{name}");
    let answer = {
        let mut s = state.lock().unwrap();
        let repo = match admit(&s, &repo_id, &headers) {
            Ok(r) => r,
            Err(resp) => return *resp,
        };
        let Some(sha) = repo.commit(&rev).map(str::to_string) else {
            return hub_error(StatusCode::NOT_FOUND, "RevisionNotFound", "Invalid rev id");
        };
        let Some((_, bytes)) = repo.commits[&sha].iter().find(|(f, _)| *f == file) else {
            return hub_error(StatusCode::NOT_FOUND, "EntryNotFound", "Entry not found");
        };
        let (start, end) = parse_range(&headers, bytes.len());
        let silent = s.silent.contains(&file);
        s.log.push(Logged::File {
            repo: repo_id.clone(),
            file: file.clone(),
            start: start as u64,
        });
        // A probe of one byte never trips the cut; the next real transfer does.
        let cut = if end > start {
            s.cut.remove(&file)
        } else {
            None
        };
        if silent {
            None
        } else {
            Some((bytes.clone(), sha, start, end, cut))
        }
    };
    let Some((bytes, sha, start, end, cut)) = answer else {
        std::future::pending::<()>().await;
        return StatusCode::GATEWAY_TIMEOUT.into_response();
    };
    if start > end || end >= bytes.len() {
        return StatusCode::RANGE_NOT_SATISFIABLE.into_response();
    }
    let body_bytes = bytes::Bytes::copy_from_slice(&bytes[start..=end]);
    let len = body_bytes.len();
    let body = match cut {
        Some(after) if after < len => {
            let first = body_bytes.slice(..after);
            let stream = futures_util::stream::unfold(0u8, move |step| {
                let first = first.clone();
                async move {
                    match step {
                        0 => Some((Ok(first), 1)),
                        1 => {
                            // Let the first part reach the client before the connection dies.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            Some((Err(std::io::Error::other("connection cut by the test")), 2))
                        }
                        _ => None,
                    }
                }
            });
            Body::from_stream(stream)
        }
        _ => Body::from(body_bytes),
    };
    Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header(header::CONTENT_LENGTH, len)
        .header(
            header::CONTENT_RANGE,
            format!("bytes {start}-{end}/{}", bytes.len()),
        )
        .header(header::ETAG, format!("\"{}\"", etag_of(&bytes)))
        .header("x-repo-commit", sha)
        .body(body)
        .unwrap()
}
