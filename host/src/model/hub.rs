//! Models named by Hugging Face hub id (`org/name`): resolved to a folder of the local hub
//! cache, downloading what is missing through the `hf-hub` client.
//!
//! The cache is the one `huggingface_hub` uses (`blobs/`, `refs/`, `snapshots/<commit>/`), so
//! models downloaded by Python tools are found here and the other way round. Settings come
//! from the usual environment variables: `HF_HUB_CACHE` (else `$HF_HOME/hub`, else
//! `~/.cache/huggingface/hub`), `HF_ENDPOINT`, `HF_TOKEN` (else `$HF_HOME/token`) and
//! `HF_HUB_OFFLINE`. Only the files serving reads are fetched: configs, tokenizer files and
//! the safetensors weights (the shards the index names, when there is an index). A download
//! that breaks off resumes from its `.part` file, in the same run or the next. Every size the
//! hub lists is checked after the download.
//!
//! The client under `hf-hub` has no read timeout, so a hub that stops answering would hold a
//! download forever: the resolution runs on its own thread, watched for progress (bytes landing
//! in the repo's cache folder); after `HF_HUB_DOWNLOAD_TIMEOUT` seconds (default 10, as
//! `huggingface_hub`) without any, it fails with an error that says so. Proxies come from
//! `HTTPS_PROXY`/`HTTP_PROXY`/`ALL_PROXY`; `NO_PROXY` is not read by that client.
//!
//! A repo that holds llama.cpp GGUF files instead (no `config.json` with safetensors), or a
//! name with a quant tag, `org/name:Q4_K_M` (as llama.cpp's `-hf` and Ollama spell it),
//! resolves to one `.gguf` file, and only that file is downloaded: the one the tag names, or
//! the only one there is (vision projectors, `mmproj*`, aside); several and no tag is an error
//! that lists them.
//!
//! This module owns name resolution and downloading; it knows nothing of model formats beyond
//! which file names a model folder needs.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hf_hub::api::sync::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use serde::Deserialize;

/// Files of a model repo that serving reads, besides the weights.
const MODEL_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "{repo}: the hub refused access ({status}): the repo is gated or private. Accept its \
         terms on the hub with your account, then set HF_TOKEN (or log in so that \
         $HF_HOME/token exists){token_note}"
    )]
    Gated {
        repo: String,
        status: u16,
        token_note: &'static str,
    },
    #[error(
        "{repo}: no such model repo on {endpoint} (check the name; a private repo needs HF_TOKEN)"
    )]
    RepoNotFound { repo: String, endpoint: String },
    #[error("{repo}: no revision `{revision}` (a branch, tag or commit hash) on {endpoint}")]
    RevisionNotFound {
        repo: String,
        revision: String,
        endpoint: String,
    },
    #[error("{repo}@{revision}: {file} is not in the repo")]
    FileNotFound {
        repo: String,
        revision: String,
        file: String,
    },
    #[error(
        "{repo}@{revision}: not in the hub cache {cache} and HF_HUB_OFFLINE is set (run once \
         online, or unset HF_HUB_OFFLINE){detail}"
    )]
    NotCached {
        repo: String,
        revision: String,
        cache: PathBuf,
        detail: String,
    },
    #[error(
        "{repo}@{revision}: the repo has no config.json with *.safetensors weights and no \
         .gguf file"
    )]
    NotAModel { repo: String, revision: String },
    #[error("{repo}@{revision}: {problem}; name one as `{repo}:QUANT` (GGUF files: {files})")]
    GgufChoice {
        repo: String,
        revision: String,
        problem: String,
        files: String,
    },
    #[error("{repo}: {file}: downloaded {got} bytes, the hub lists {expected}")]
    SizeMismatch {
        repo: String,
        file: String,
        got: u64,
        expected: u64,
    },
    #[error("{repo}: the hub answered HTTP {status} for {what}")]
    Http {
        repo: String,
        status: u16,
        what: String,
    },
    #[error(
        "{repo}: cannot reach the hub at {endpoint}: {message} (set HF_HUB_OFFLINE=1 to use \
         the local cache only)"
    )]
    Unreachable {
        repo: String,
        endpoint: String,
        message: String,
    },
    #[error(
        "{repo}: the hub at {endpoint} sent nothing for {secs} s while {doing}; giving up \
         (HF_HUB_DOWNLOAD_TIMEOUT sets the limit in seconds; HF_HUB_OFFLINE=1 uses the local \
         cache only)"
    )]
    Stalled {
        repo: String,
        endpoint: String,
        secs: f64,
        doing: &'static str,
    },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{repo}: {message}")]
    Other { repo: String, message: String },
}

/// Where and how to reach the hub; see the module docs for the environment variables.
#[derive(Debug, Clone)]
pub struct HubSettings {
    pub endpoint: String,
    /// The hub cache folder (holding `models--org--name/`).
    pub cache_dir: PathBuf,
    pub token: Option<String>,
    pub offline: bool,
    /// Draw a progress bar on stderr (only sensible on a terminal).
    pub progress: bool,
    /// Longest wait for any progress (`HF_HUB_DOWNLOAD_TIMEOUT`, seconds; default 10).
    pub download_timeout: Duration,
}

/// `HF_HUB_DOWNLOAD_TIMEOUT`'s default, as in `huggingface_hub`.
pub const DEFAULT_DOWNLOAD_TIMEOUT: Duration = Duration::from_secs(10);

impl HubSettings {
    /// Settings from the environment, as `huggingface_hub` reads them.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
    }

    /// Settings from a variable lookup (the environment, or a map in tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let cache = var("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| var("HOME").map(|h| Path::new(&h).join(".cache")))
                .unwrap_or_else(|| PathBuf::from(".cache"));
            cache.join("huggingface")
        });
        let cache_dir = var("HF_HUB_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let token = var("HF_TOKEN").or_else(|| {
            std::fs::read_to_string(hf_home.join("token"))
                .ok()
                .map(|t| t.trim().to_string())
                .filter(|t| !t.is_empty())
        });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(v.to_ascii_lowercase().as_str(), "1" | "on" | "yes" | "true")
        });
        let download_timeout = match var("HF_HUB_DOWNLOAD_TIMEOUT") {
            None => DEFAULT_DOWNLOAD_TIMEOUT,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(secs) if secs > 0.0 && secs.is_finite() => Duration::from_secs_f64(secs),
                _ => {
                    tracing::warn!(
                        value = %v,
                        "HF_HUB_DOWNLOAD_TIMEOUT is not a positive number of seconds; using 10"
                    );
                    DEFAULT_DOWNLOAD_TIMEOUT
                }
            },
        };
        Self {
            endpoint: var("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_string())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            cache_dir,
            token,
            offline,
            progress: std::io::stderr().is_terminal(),
            download_timeout,
        }
    }
}

/// Whether `name` has the shape of a hub model id, `org/name`: two parts of letters, digits,
/// `-`, `_` and `.`, neither starting with `.` or `-`. The caller decides first whether a
/// local path of that name exists (a local path wins).
pub fn is_repo_id(name: &str) -> bool {
    let part_ok = |p: &str| {
        !p.is_empty()
            && p.len() <= 96
            && !p.starts_with(['.', '-'])
            && !p.contains("..")
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    match name.split_once('/') {
        Some((org, rest)) => part_ok(org) && part_ok(rest),
        None => false,
    }
}

/// Splits `org/name:TAG` into the repo id and the GGUF quant tag (or file name); `None` when
/// `name` is not of that shape.
pub fn split_quant_tag(name: &str) -> Option<(&str, &str)> {
    let (repo, tag) = name.rsplit_once(':')?;
    (is_repo_id(repo) && !tag.is_empty() && !tag.contains('/')).then_some((repo, tag))
}

/// Whether `file` (a repo path) is the GGUF file `tag` names: the file name itself, or a quant
/// tag (`Q4_K_M`, any case) that ends the name or stands between separators, so `Q4_K` does
/// not pick `Q4_K_M`.
fn gguf_matches(file: &str, tag: &str) -> bool {
    let base = file.rsplit('/').next().unwrap_or(file).to_ascii_lowercase();
    let tag = tag.to_ascii_lowercase();
    if base == tag || file.eq_ignore_ascii_case(&tag) {
        return true;
    }
    let stem = base.strip_suffix(".gguf").unwrap_or(&base);
    let bytes = stem.as_bytes();
    stem.match_indices(&tag).any(|(at, _)| {
        let before = at == 0 || matches!(bytes[at - 1], b'.' | b'-' | b'_');
        let after = bytes
            .get(at + tag.len())
            .is_none_or(|c| matches!(c, b'.' | b'-'));
        before && after
    })
}

/// The GGUF file to use among a repo's `names`: the one `tag` names, or else the only one.
/// Vision projectors (`mmproj*`) are never picked without being named. Errors say what is
/// wrong, for [`HubError::GgufChoice`].
fn choose_gguf(names: &[&str], tag: Option<&str>) -> Result<String, String> {
    let ggufs: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    let is_projector = |n: &&str| {
        n.rsplit('/')
            .next()
            .is_some_and(|b| b.to_ascii_lowercase().starts_with("mmproj"))
    };
    let found: Vec<&str> = match tag {
        Some(tag) => ggufs
            .iter()
            .copied()
            .filter(|n| gguf_matches(n, tag) && (!is_projector(n) || n.ends_with(tag)))
            .collect(),
        None => ggufs.iter().copied().filter(|n| !is_projector(n)).collect(),
    };
    match (found.as_slice(), tag) {
        ([one], _) if is_split_part(one) => Err(format!(
            "{one} is one part of a split GGUF file, which does not load (merge the parts with \
             llama.cpp's `llama-gguf-split --merge`)"
        )),
        ([one], _) => Ok(one.to_string()),
        ([], Some(tag)) => Err(format!("no GGUF file matches `{tag}`")),
        ([], None) => Err("no GGUF file".into()),
        (_, Some(tag)) => Err(format!("several GGUF files match `{tag}`")),
        (_, None) => Err("the repo holds several GGUF files".into()),
    }
}

/// `name-00001-of-00003.gguf`: one part of a file llama.cpp's `gguf-split` cut up.
fn is_split_part(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let stem = lower.strip_suffix(".gguf").unwrap_or(&lower).as_bytes();
    let digits = |b: &[u8]| b.iter().all(u8::is_ascii_digit);
    stem.len() >= 15 && {
        let t = &stem[stem.len() - 15..];
        t[0] == b'-' && digits(&t[1..6]) && &t[6..10] == b"-of-" && digits(&t[10..])
    }
}

/// The repo listing the hub gives for a revision (`?blobs=true` adds sizes).
#[derive(Debug, Deserialize)]
struct RepoListing {
    sha: String,
    siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
}

/// The files of `listing` that a model folder needs (the weights are chosen later, from the
/// index when there is one).
fn wanted_files(names: &[&str]) -> (Vec<String>, bool) {
    let mut out: Vec<String> = MODEL_FILES
        .iter()
        .filter(|f| names.contains(f))
        .map(|f| f.to_string())
        .collect();
    let has_index = names.contains(&WEIGHTS_INDEX);
    if has_index {
        out.push(WEIGHTS_INDEX.into());
    }
    (out, has_index)
}

/// Top-level `*.safetensors` files (subfolders hold other variants, not this model).
fn top_level_safetensors(names: &[&str]) -> Vec<String> {
    names
        .iter()
        .filter(|n| !n.contains('/') && n.ends_with(".safetensors"))
        .map(|n| n.to_string())
        .collect()
}

/// The shard files a `model.safetensors.index.json` names.
fn shards_of_index(path: &Path) -> Result<Vec<String>, HubError> {
    let text = std::fs::read_to_string(path).map_err(|e| HubError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| HubError::Other {
        repo: path.display().to_string(),
        message: format!("the weights index is not valid JSON: {e}"),
    })?;
    let mut shards: Vec<String> = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| {
            m.values()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    Ok(shards)
}

/// Resolves `repo@revision` to a local snapshot folder, downloading the model's files that
/// the cache lacks (or, offline, only looking in the cache); for a repo of GGUF files, to the
/// one GGUF file it holds (see [`resolve_file`]).
pub fn resolve(repo: &str, revision: &str, settings: &HubSettings) -> Result<PathBuf, HubError> {
    resolve_file(repo, revision, None, settings)
}

/// As [`resolve`], choosing a GGUF file by `gguf` (a quant tag such as `Q4_K_M`, or a file
/// name) when given: the path returned is then that `.gguf` file in the snapshot folder, and
/// it is the only file downloaded. Without `gguf`, a repo with `config.json` and safetensors
/// weights resolves to its folder, and one with neither to its only GGUF file.
pub fn resolve_file(
    repo: &str,
    revision: &str,
    gguf: Option<&str>,
    settings: &HubSettings,
) -> Result<PathBuf, HubError> {
    if settings.offline {
        return resolve_offline(repo, revision, gguf, settings);
    }
    // The download runs on its own thread; this one watches the repo's cache folder grow. A
    // thread stuck on a silent socket is left behind (it holds nothing the caller needs).
    let dir = repo_dir(settings, repo);
    let mut seen = bytes_under(&dir);
    let (tx, rx) = mpsc::channel();
    let (r, rev, s) = (repo.to_string(), revision.to_string(), settings.clone());
    let quant = gguf.map(str::to_string);
    std::thread::Builder::new()
        .name("hub-download".into())
        .spawn(move || {
            let _ = tx.send(resolve_online(&r, &rev, quant.as_deref(), &s));
        })
        .map_err(|e| HubError::Other {
            repo: repo.into(),
            message: format!("cannot start the download thread: {e}"),
        })?;
    let mut moved = false;
    let mut last_progress = Instant::now();
    loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(result) => return result,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(HubError::Other {
                    repo: repo.into(),
                    message: "the download thread ended without an answer".into(),
                });
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let now = bytes_under(&dir);
                if now != seen {
                    seen = now;
                    moved = true;
                    last_progress = Instant::now();
                } else if last_progress.elapsed() >= settings.download_timeout {
                    return Err(HubError::Stalled {
                        repo: repo.into(),
                        endpoint: settings.endpoint.clone(),
                        secs: settings.download_timeout.as_secs_f64(),
                        doing: if moved {
                            "downloading"
                        } else {
                            "waiting for its first answer"
                        },
                    });
                }
            }
        }
    }
}

/// Bytes of every file under `dir` (partial downloads included): the watchdog's progress.
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(t) if t.is_file() => e.metadata().map_or(0, |m| m.len()),
            _ => 0,
        })
        .sum()
}

fn resolve_online(
    repo: &str,
    revision: &str,
    gguf: Option<&str>,
    settings: &HubSettings,
) -> Result<PathBuf, HubError> {
    let hub_repo = Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string());
    let api = ApiBuilder::from_cache(Cache::new(settings.cache_dir.clone()))
        .with_endpoint(settings.endpoint.clone())
        .with_token(settings.token.clone())
        .with_progress(settings.progress)
        .with_retries(3)
        .build()
        .map_err(|e| HubError::Other {
            repo: repo.into(),
            message: e.to_string(),
        })?;
    let api_repo = api.repo(hub_repo.clone());
    let listing: RepoListing = match api_repo.info_request().query("blobs", "true").call() {
        Ok(resp) => resp.into_json().map_err(|e| HubError::Other {
            repo: repo.into(),
            message: format!("the hub's repo listing did not parse: {e}"),
        })?,
        Err(e) => return Err(request_error(e, repo, revision, None, settings)),
    };
    let names: Vec<&str> = listing
        .siblings
        .iter()
        .map(|s| s.rfilename.as_str())
        .collect();
    let folder_model = names.contains(&"config.json")
        && (names.contains(&WEIGHTS_INDEX) || !top_level_safetensors(&names).is_empty());
    let has_gguf = names
        .iter()
        .any(|n| n.to_ascii_lowercase().ends_with(".gguf"));
    if !folder_model && !has_gguf {
        return Err(HubError::NotAModel {
            repo: repo.into(),
            revision: revision.into(),
        });
    }
    let snapshot = settings
        .cache_dir
        .join(format!("models--{}", repo.replace('/', "--")))
        .join("snapshots")
        .join(&listing.sha);
    let fetch = |file: &str| -> Result<(), HubError> {
        let target = snapshot.join(file);
        if target.exists() {
            return Ok(());
        }
        let path = api_repo.download(file).map_err(|e| match e {
            ApiError::RequestError(e) => request_error(*e, repo, revision, Some(file), settings),
            other => HubError::Other {
                repo: repo.into(),
                message: format!("downloading {file}: {other}"),
            },
        })?;
        let expected = listing
            .siblings
            .iter()
            .find(|s| s.rfilename == file)
            .and_then(|s| s.size);
        let got = std::fs::metadata(&path)
            .map_err(|e| HubError::Io {
                path: path.clone(),
                source: e,
            })?
            .len();
        if let Some(expected) = expected
            && got != expected
        {
            // A wrong file must not stay in the cache looking complete.
            let _ = std::fs::remove_file(&path);
            return Err(HubError::SizeMismatch {
                repo: repo.into(),
                file: file.into(),
                got,
                expected,
            });
        }
        // The hub names the commit in each download; a branch that moved in between leaves
        // the file under the newer commit: link it where this listing expects it.
        if path != target && !target.exists() {
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).map_err(|e| HubError::Io {
                    path: parent.to_path_buf(),
                    source: e,
                })?;
            }
            std::fs::copy(&path, &target).map_err(|e| HubError::Io {
                path: target.clone(),
                source: e,
            })?;
        }
        Ok(())
    };
    if gguf.is_some() || !folder_model {
        let file = choose_gguf(&names, gguf)
            .map_err(|problem| gguf_choice_error(repo, revision, problem, &names))?;
        fetch(&file)?;
        write_ref(settings, repo, revision, &listing.sha)?;
        return Ok(snapshot.join(file));
    }
    let (files, has_index) = wanted_files(&names);
    for f in &files {
        fetch(f)?;
    }
    let weights = if has_index {
        shards_of_index(&snapshot.join(WEIGHTS_INDEX))?
    } else {
        top_level_safetensors(&names)
    };
    if weights.is_empty() {
        return Err(HubError::NotAModel {
            repo: repo.into(),
            revision: revision.into(),
        });
    }
    for f in &weights {
        if !names.contains(&f.as_str()) {
            return Err(HubError::FileNotFound {
                repo: repo.into(),
                revision: revision.into(),
                file: f.clone(),
            });
        }
        fetch(f)?;
    }
    write_ref(settings, repo, revision, &listing.sha)?;
    Ok(snapshot)
}

fn gguf_choice_error(repo: &str, revision: &str, problem: String, names: &[&str]) -> HubError {
    let files: Vec<&str> = names
        .iter()
        .copied()
        .filter(|n| n.to_ascii_lowercase().ends_with(".gguf"))
        .collect();
    HubError::GgufChoice {
        repo: repo.into(),
        revision: revision.into(),
        problem,
        files: if files.is_empty() {
            "none".into()
        } else {
            files.join(", ")
        },
    }
}

/// The `.gguf` files under `dir`, as repo paths (`sub/x.gguf`).
fn cached_ggufs(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else if path
                .extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("gguf"))
                && let Ok(rel) = path.strip_prefix(dir)
            {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    out
}

/// Records `revision → commit` as `huggingface_hub` does (a commit hash needs no ref).
fn write_ref(
    settings: &HubSettings,
    repo: &str,
    revision: &str,
    sha: &str,
) -> Result<(), HubError> {
    if revision == sha {
        return Ok(());
    }
    let path = repo_dir(settings, repo).join("refs").join(revision);
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| HubError::Io {
            path: parent.to_path_buf(),
            source: e,
        })?;
    }
    std::fs::write(&path, sha).map_err(|e| HubError::Io { path, source: e })
}

fn repo_dir(settings: &HubSettings, repo: &str) -> PathBuf {
    settings
        .cache_dir
        .join(format!("models--{}", repo.replace('/', "--")))
}

/// The cached snapshot for `repo@revision`, with no network.
fn resolve_offline(
    repo: &str,
    revision: &str,
    gguf: Option<&str>,
    settings: &HubSettings,
) -> Result<PathBuf, HubError> {
    let dir = repo_dir(settings, repo);
    let not_cached = |detail: String| HubError::NotCached {
        repo: repo.into(),
        revision: revision.into(),
        cache: settings.cache_dir.clone(),
        detail,
    };
    let commit = match std::fs::read_to_string(dir.join("refs").join(revision)) {
        Ok(sha) => sha.trim().to_string(),
        // A commit hash is its own snapshot name.
        Err(_) if dir.join("snapshots").join(revision).is_dir() => revision.to_string(),
        Err(_) => return Err(not_cached(String::new())),
    };
    let snapshot = dir.join("snapshots").join(&commit);
    let cached = cached_ggufs(&snapshot);
    if gguf.is_some() || (!snapshot.join("config.json").is_file() && !cached.is_empty()) {
        let names: Vec<&str> = cached.iter().map(String::as_str).collect();
        return match choose_gguf(&names, gguf) {
            Ok(file) => Ok(snapshot.join(file)),
            Err(problem) => Err(not_cached(format!(
                "; among the cached GGUF files ({}): {problem}",
                if names.is_empty() {
                    "none".to_string()
                } else {
                    names.join(", ")
                }
            ))),
        };
    }
    if !snapshot.join("config.json").is_file() {
        return Err(not_cached(format!(
            "; {} has no config.json",
            snapshot.display()
        )));
    }
    if snapshot.join(WEIGHTS_INDEX).is_file() {
        for shard in shards_of_index(&snapshot.join(WEIGHTS_INDEX))? {
            if !snapshot.join(&shard).is_file() {
                return Err(not_cached(format!("; {shard} was never downloaded")));
            }
        }
    }
    Ok(snapshot)
}

/// Turns a failed request into the error a user can act on, from the status and the hub's
/// `X-Error-Code` header.
fn request_error(
    e: ureq::Error,
    repo: &str,
    revision: &str,
    file: Option<&str>,
    settings: &HubSettings,
) -> HubError {
    match e {
        ureq::Error::Status(status, resp) => {
            let code = resp.header("x-error-code").unwrap_or("").to_string();
            let token_note = if settings.token.is_some() {
                " (a token was sent: it has no access to this repo)"
            } else {
                " (no token was sent)"
            };
            match (status, code.as_str()) {
                (_, "GatedRepo") | (403, _) => HubError::Gated {
                    repo: repo.into(),
                    status,
                    token_note,
                },
                (_, "RepoNotFound") => HubError::RepoNotFound {
                    repo: repo.into(),
                    endpoint: settings.endpoint.clone(),
                },
                (_, "RevisionNotFound") => HubError::RevisionNotFound {
                    repo: repo.into(),
                    revision: revision.into(),
                    endpoint: settings.endpoint.clone(),
                },
                (404, "EntryNotFound") if file.is_some() => HubError::FileNotFound {
                    repo: repo.into(),
                    revision: revision.into(),
                    file: file.unwrap_or_default().into(),
                },
                (404, _) if file.is_none() => HubError::RepoNotFound {
                    repo: repo.into(),
                    endpoint: settings.endpoint.clone(),
                },
                // The hub answers 401 for a repo that does not exist or is private alike.
                (401, _) => HubError::Gated {
                    repo: repo.into(),
                    status,
                    token_note,
                },
                _ => HubError::Http {
                    repo: repo.into(),
                    status,
                    what: file.map_or_else(|| "the repo listing".into(), |f| f.to_string()),
                },
            }
        }
        ureq::Error::Transport(t) => HubError::Unreachable {
            repo: repo.into(),
            endpoint: settings.endpoint.clone(),
            message: t.to_string(),
        },
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn repo_ids_and_paths_are_told_apart() {
        for id in ["HuggingFaceTB/SmolLM2-135M", "org/model.v2", "a/b_c-d"] {
            assert!(is_repo_id(id), "{id}");
        }
        for not in [
            "model",
            "/abs/path",
            "./org/name",
            "org/name/extra",
            "../x",
            "org/",
            "/name",
            "org/.hidden",
            "org/a..b",
            "org/na me",
            "builtin:tiny-hybrid",
            "model.gguf",
        ] {
            assert!(!is_repo_id(not), "{not}");
        }
    }

    #[test]
    fn settings_follow_the_hub_environment_variables() {
        let vars = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            HubSettings::from_vars(move |k| map.get(k).cloned())
        };
        let s = vars(&[("HOME", "/home/u")]);
        assert_eq!(s.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(s.endpoint, "https://huggingface.co");
        assert!(!s.offline && s.token.is_none());
        let s = vars(&[("HOME", "/home/u"), ("HF_HOME", "/data/hf")]);
        assert_eq!(s.cache_dir, PathBuf::from("/data/hf/hub"));
        let s = vars(&[
            ("HF_HOME", "/data/hf"),
            ("HF_HUB_CACHE", "/fast/hub"),
            ("HF_ENDPOINT", "http://127.0.0.1:9/"),
            ("HF_TOKEN", "hf_abc"),
            ("HF_HUB_OFFLINE", "1"),
        ]);
        assert_eq!(s.cache_dir, PathBuf::from("/fast/hub"));
        assert_eq!(s.endpoint, "http://127.0.0.1:9");
        assert_eq!(s.token.as_deref(), Some("hf_abc"));
        assert!(s.offline);
        assert!(!vars(&[("HF_HUB_OFFLINE", "0")]).offline);
        assert_eq!(s.download_timeout, DEFAULT_DOWNLOAD_TIMEOUT);
        let t = vars(&[("HF_HUB_DOWNLOAD_TIMEOUT", "2.5")]).download_timeout;
        assert_eq!(t, Duration::from_millis(2500));
        let t = vars(&[("HF_HUB_DOWNLOAD_TIMEOUT", "soon")]).download_timeout;
        assert_eq!(t, DEFAULT_DOWNLOAD_TIMEOUT);
        // The token file under HF_HOME, when HF_TOKEN is unset.
        let home = std::env::temp_dir().join(format!("chimera-hf-home-{}", std::process::id()));
        std::fs::create_dir_all(&home).unwrap();
        std::fs::write(home.join("token"), "hf_from_file\n").unwrap();
        let s = vars(&[("HF_HOME", home.to_str().unwrap())]);
        std::fs::remove_dir_all(&home).unwrap();
        assert_eq!(s.token.as_deref(), Some("hf_from_file"));
    }

    #[test]
    fn only_the_files_a_model_needs_are_chosen() {
        let names = [
            "config.json",
            "README.md",
            "tokenizer.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
            "onnx/model.safetensors",
            "pytorch_model.bin",
            "generation_config.json",
        ];
        let (files, has_index) = wanted_files(&names);
        assert_eq!(
            files,
            ["config.json", "generation_config.json", "tokenizer.json"]
        );
        assert!(!has_index);
        assert_eq!(
            top_level_safetensors(&names),
            [
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "consolidated.safetensors"
            ]
        );
        let (files, has_index) = wanted_files(&["config.json", WEIGHTS_INDEX]);
        assert_eq!(files, ["config.json", WEIGHTS_INDEX]);
        assert!(has_index);
    }

    #[test]
    fn gguf_files_are_chosen_by_quant_tag() {
        let names = [
            "README.md",
            "Tiny-Q4_K.gguf",
            "Tiny-Q4_K_M.gguf",
            "tiny.q8_0.gguf",
            "mmproj-tiny-f16.gguf",
            "big/Big-Q6_K-00001-of-00002.gguf",
            "big/Big-Q6_K-00002-of-00002.gguf",
        ];
        assert_eq!(
            choose_gguf(&names, Some("Q4_K_M")).unwrap(),
            "Tiny-Q4_K_M.gguf"
        );
        // `Q4_K` is a tag of its own, not a prefix of `Q4_K_M`; tags ignore case.
        assert_eq!(choose_gguf(&names, Some("q4_k")).unwrap(), "Tiny-Q4_K.gguf");
        assert_eq!(choose_gguf(&names, Some("Q8_0")).unwrap(), "tiny.q8_0.gguf");
        assert_eq!(
            choose_gguf(&names, Some("tiny.q8_0.gguf")).unwrap(),
            "tiny.q8_0.gguf"
        );
        let e = choose_gguf(&names, None).unwrap_err();
        assert_eq!(e, "the repo holds several GGUF files");
        assert_eq!(
            choose_gguf(&names, Some("Q5_K_M")).unwrap_err(),
            "no GGUF file matches `Q5_K_M`"
        );
        assert_eq!(
            choose_gguf(&names, Some("Q6_K")).unwrap_err(),
            "several GGUF files match `Q6_K`"
        );
        // One file and a projector: the model file, untagged.
        assert_eq!(
            choose_gguf(&["a-F16.gguf", "mmproj-a-f16.gguf", "x.txt"], None).unwrap(),
            "a-F16.gguf"
        );
        let e = choose_gguf(&["m-00001-of-00002.gguf"], None).unwrap_err();
        assert!(e.contains("split GGUF"), "{e}");
        assert!(is_split_part("Big-Q6_K-00002-of-00002.gguf"));
        assert!(!is_split_part("Big-Q6_K.gguf"));
        assert_eq!(
            split_quant_tag("org/name:Q4_K_M"),
            Some(("org/name", "Q4_K_M"))
        );
        assert_eq!(split_quant_tag("org/name"), None);
        assert_eq!(split_quant_tag("builtin:tiny-hybrid"), None);
        assert_eq!(split_quant_tag("org/name:"), None);
    }
}
