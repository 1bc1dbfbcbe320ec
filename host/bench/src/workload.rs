//! Benchmark workloads: the sessions (one or more turns) a run sends, built reproducibly.
//!
//! Owns the four workload shapes — shared-prefix groups, random lengths, multi-turn
//! conversations, and prompts from a user JSON/JSONL file — and turns each into an ordered
//! list of [`Session`]s. A session is the unit a client works through: its turns are sent one
//! after another, each extending the conversation so far.
//!
//! Invariants: the same spec, tokenizer and seed give the same sessions; every generated
//! piece's token count is exact for the tokenizer in use (see [`super::tokens`]); each prefix,
//! question, conversation and random prompt draws from its own RNG stream, so changing one
//! count never changes another group's text and generation can run in parallel (rayon) with
//! the same result on any number of threads. Must not send requests or measure time.

use std::path::PathBuf;
use std::str::FromStr;

use rayon::prelude::*;
use serde::Deserialize;

use super::BenchError;
use super::rng::Rng;
use super::tokens::{Prompt, PromptTokenizer};

/// A token length: a fixed `N` or a uniform inclusive range `MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct LenRange {
    pub min: usize,
    pub max: usize,
}

impl LenRange {
    pub const fn fixed(n: usize) -> Self {
        Self { min: n, max: n }
    }

    pub fn sample(&self, rng: &mut Rng) -> usize {
        rng.range_inclusive(self.min as u64, self.max as u64) as usize
    }
}

impl FromStr for LenRange {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let parse = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{s}` is not a length: use N or MIN:MAX (tokens)"))
        };
        let r = match s.split_once(':') {
            Some((a, b)) => Self {
                min: parse(a)?,
                max: parse(b)?,
            },
            None => Self::fixed(parse(s)?),
        };
        if r.min > r.max {
            return Err(format!("`{s}`: MIN must not exceed MAX"));
        }
        Ok(r)
    }
}

impl std::fmt::Display for LenRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}:{}", self.min, self.max)
        }
    }
}

/// RNG stream (under the workload seed) of the shared-prefix questions.
const QUESTION_STREAM: u64 = 0x5155_4553_5449_4F4E;

/// What to generate.
#[derive(Debug, Clone)]
pub enum WorkloadSpec {
    /// `groups` distinct shared prefixes, each followed by `prompts_per_group` distinct
    /// questions. Sessions are shuffled unless `shuffle` is false (then group by group).
    SharedPrefix {
        groups: usize,
        prompts_per_group: usize,
        prefix_len: LenRange,
        question_len: LenRange,
        output_len: LenRange,
        shuffle: bool,
    },
    /// `requests` independent prompts with random input and output lengths.
    Random {
        requests: usize,
        input_len: LenRange,
        output_len: LenRange,
    },
    /// `conversations` of `turns` turns: an optional system prefix, then per turn a new user
    /// message appended after the previous turns and the server's answers to them.
    MultiTurn {
        conversations: usize,
        turns: usize,
        prefix_len: LenRange,
        question_len: LenRange,
        output_len: LenRange,
    },
    /// Prompts from a JSON array or JSONL file (see the module docs of `bench`).
    File { path: PathBuf, output_len: LenRange },
}

/// One user turn and how many tokens to ask for.
#[derive(Debug, Clone)]
pub struct Turn {
    pub user: Prompt,
    pub output_len: u32,
}

/// A unit of work: turns sent in order by one client.
#[derive(Debug, Clone)]
pub struct Session {
    pub id: usize,
    /// Shared-prefix group (None for other workloads).
    pub group: Option<usize>,
    /// Text every turn starts with (shared prefix or system prompt).
    pub system: Option<Prompt>,
    pub turns: Vec<Turn>,
}

/// The generated sessions, in dispatch order.
#[derive(Debug, Clone)]
pub struct Workload {
    pub kind: &'static str,
    pub sessions: Vec<Session>,
}

impl Workload {
    /// Requests in one pass over all sessions.
    pub fn total_requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    pub fn is_multi_turn(&self) -> bool {
        self.sessions.iter().any(|s| s.turns.len() > 1)
    }
}

/// Builds the sessions. `joined` says the endpoint concatenates the pieces into one prompt
/// (completions): each question is then fitted so that prefix + question is exact as a whole;
/// otherwise (chat) each piece is exact on its own.
pub fn build(
    spec: &WorkloadSpec,
    tok: &PromptTokenizer,
    seed: u64,
    joined: bool,
) -> Result<Workload, BenchError> {
    match spec {
        WorkloadSpec::SharedPrefix {
            groups,
            prompts_per_group,
            prefix_len,
            question_len,
            output_len,
            shuffle,
        } => {
            // Prefixes, then questions, each in parallel; every prefix and every question has
            // its own RNG stream, so the result does not depend on the thread count.
            let prefixes: Vec<Prompt> = (0..*groups)
                .into_par_iter()
                .map(|g| {
                    let mut rng = Rng::fork(seed, g as u64);
                    let n = prefix_len.sample(&mut rng);
                    tok.extend_exact("", 0, &mut rng, n)
                })
                .collect::<Result<_, _>>()?;
            let question_seed = Rng::fork(seed, QUESTION_STREAM).next_u64();
            let mut sessions: Vec<Session> = (0..groups * prompts_per_group)
                .into_par_iter()
                .map(|i| {
                    let g = i / prompts_per_group;
                    let prefix = &prefixes[g];
                    let mut rng = Rng::fork(question_seed, i as u64);
                    let (head, head_tokens) = if joined {
                        (prefix.text.as_str(), prefix.tokens())
                    } else {
                        ("", 0)
                    };
                    let q = question_len.sample(&mut rng);
                    let user = tok.extend_exact(head, head_tokens, &mut rng, q)?;
                    let output_len = output_len.sample(&mut rng) as u32;
                    Ok(Session {
                        id: i,
                        group: Some(g),
                        system: Some(prefix.clone()),
                        turns: vec![Turn { user, output_len }],
                    })
                })
                .collect::<Result<_, BenchError>>()?;
            if *shuffle {
                Rng::fork(seed, u64::MAX).shuffle(&mut sessions);
            }
            Ok(Workload {
                kind: "shared-prefix",
                sessions,
            })
        }
        WorkloadSpec::Random {
            requests,
            input_len,
            output_len,
        } => {
            let sessions: Vec<Session> = (0..*requests)
                .into_par_iter()
                .map(|i| {
                    let mut rng = Rng::fork(seed, i as u64);
                    let n = input_len.sample(&mut rng);
                    let user = tok.extend_exact("", 0, &mut rng, n)?;
                    let output_len = output_len.sample(&mut rng) as u32;
                    Ok(Session {
                        id: i,
                        group: None,
                        system: None,
                        turns: vec![Turn { user, output_len }],
                    })
                })
                .collect::<Result<_, BenchError>>()?;
            Ok(Workload {
                kind: "random",
                sessions,
            })
        }
        WorkloadSpec::MultiTurn {
            conversations,
            turns,
            prefix_len,
            question_len,
            output_len,
        } => {
            let sessions: Vec<Session> = (0..*conversations)
                .into_par_iter()
                .map(|c| {
                    let mut rng = Rng::fork(seed, c as u64);
                    let n = prefix_len.sample(&mut rng);
                    let system = if n > 0 {
                        Some(tok.extend_exact("", 0, &mut rng, n)?)
                    } else {
                        None
                    };
                    let mut ts = Vec::with_capacity(*turns);
                    for _ in 0..*turns {
                        let q = question_len.sample(&mut rng);
                        let user = tok.extend_exact("", 0, &mut rng, q)?;
                        let output_len = output_len.sample(&mut rng) as u32;
                        ts.push(Turn { user, output_len });
                    }
                    Ok(Session {
                        id: c,
                        group: None,
                        system,
                        turns: ts,
                    })
                })
                .collect::<Result<_, BenchError>>()?;
            Ok(Workload {
                kind: "multi-turn",
                sessions,
            })
        }
        WorkloadSpec::File { path, output_len } => from_file(path, *output_len, tok, seed),
    }
}

/// One entry of a prompts file: a bare string, or an object.
#[derive(Deserialize)]
#[serde(untagged)]
enum FileEntry {
    Text(String),
    Object(FileObject),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileObject {
    prompt: Option<String>,
    system: Option<String>,
    turns: Option<Vec<String>>,
    output_len: Option<u32>,
}

fn from_file(
    path: &PathBuf,
    output_len: LenRange,
    tok: &PromptTokenizer,
    seed: u64,
) -> Result<Workload, BenchError> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::Io {
        path: path.clone(),
        source: e,
    })?;
    let bad = |where_: String, msg: String| {
        BenchError::Workload(format!("{}: {where_}: {msg}", path.display()))
    };
    let entries: Vec<(String, FileEntry)> = if text.trim_start().starts_with('[') {
        let v: Vec<FileEntry> = serde_json::from_str(&text)
            .map_err(|e| bad("JSON array".into(), format!("{e}; {ENTRY_HELP}")))?;
        v.into_iter()
            .enumerate()
            .map(|(i, e)| (format!("entry {i}"), e))
            .collect()
    } else {
        let mut v = Vec::new();
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let e: FileEntry = serde_json::from_str(line)
                .map_err(|e| bad(format!("line {}", i + 1), format!("{e}; {ENTRY_HELP}")))?;
            v.push((format!("line {}", i + 1), e));
        }
        v
    };
    if entries.is_empty() {
        return Err(bad("file".into(), "has no prompts".into()));
    }
    let mut sessions = Vec::with_capacity(entries.len());
    for (i, (where_, entry)) in entries.into_iter().enumerate() {
        let mut rng = Rng::fork(seed, i as u64);
        let (system, user_texts, out) = match entry {
            FileEntry::Text(t) => (None, vec![t], None),
            FileEntry::Object(o) => match (o.prompt, o.turns) {
                (Some(p), None) => (o.system, vec![p], o.output_len),
                (None, Some(ts)) if !ts.is_empty() => (o.system, ts, o.output_len),
                _ => {
                    return Err(bad(
                        where_,
                        "give exactly one of `prompt` or a non-empty `turns`".into(),
                    ));
                }
            },
        };
        let system = system.map(|s| tok.prompt_from_text(&s)).transpose()?;
        let mut turns = Vec::with_capacity(user_texts.len());
        for t in user_texts {
            let user = tok.prompt_from_text(&t)?;
            let output_len = out.unwrap_or_else(|| output_len.sample(&mut rng) as u32);
            turns.push(Turn { user, output_len });
        }
        sessions.push(Session {
            id: i,
            group: None,
            system,
            turns,
        });
    }
    Ok(Workload {
        kind: "file",
        sessions,
    })
}

const ENTRY_HELP: &str = "each entry is a string or an object with `prompt` (string) or \
    `turns` (list of strings), and optional `system` (string) and `output_len` (integer)";

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn tok() -> PromptTokenizer {
        PromptTokenizer::words()
    }

    #[test]
    fn len_range_parses_and_rejects() {
        assert_eq!("128".parse::<LenRange>().unwrap(), LenRange::fixed(128));
        assert_eq!(
            "10:20".parse::<LenRange>().unwrap(),
            LenRange { min: 10, max: 20 }
        );
        assert!("20:10".parse::<LenRange>().is_err());
        assert!("ten".parse::<LenRange>().is_err());
        assert_eq!(LenRange { min: 1, max: 3 }.to_string(), "1:3");
    }

    #[test]
    fn shared_prefix_groups_share_exact_prefixes() {
        let spec = WorkloadSpec::SharedPrefix {
            groups: 3,
            prompts_per_group: 4,
            prefix_len: LenRange::fixed(50),
            question_len: LenRange { min: 5, max: 9 },
            output_len: LenRange::fixed(7),
            shuffle: true,
        };
        let t = tok();
        let w = build(&spec, &t, 9, true).unwrap();
        assert_eq!(w.sessions.len(), 12);
        assert_eq!(w.total_requests(), 12);
        let mut per_group = [0usize; 3];
        for s in &w.sessions {
            let g = s.group.unwrap();
            per_group[g] += 1;
            let sys = s.system.as_ref().unwrap();
            assert_eq!(sys.tokens(), 50);
            let same: Vec<_> = w.sessions.iter().filter(|o| o.group == Some(g)).collect();
            assert!(same.iter().all(|o| o.system.as_ref().unwrap() == sys));
            let q = &s.turns[0].user;
            assert!((5..=9).contains(&q.tokens()));
            assert_eq!(t.count(&sys.concat(q).text).unwrap(), 50 + q.tokens());
            assert_eq!(s.turns[0].output_len, 7);
        }
        assert_eq!(per_group, [4, 4, 4]);
        // Shuffled: not in group order; different groups have different prefixes.
        let groups: Vec<_> = w.sessions.iter().map(|s| s.group.unwrap()).collect();
        assert_ne!(groups, vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]);
        let p0 = &w
            .sessions
            .iter()
            .find(|s| s.group == Some(0))
            .unwrap()
            .system;
        let p1 = &w
            .sessions
            .iter()
            .find(|s| s.group == Some(1))
            .unwrap()
            .system;
        assert_ne!(p0, p1);
        // Reproducible.
        let w2 = build(&spec, &t, 9, true).unwrap();
        let texts = |w: &Workload| -> Vec<String> {
            w.sessions
                .iter()
                .map(|s| s.turns[0].user.text.clone())
                .collect()
        };
        assert_eq!(texts(&w), texts(&w2));
        assert_ne!(texts(&w), texts(&build(&spec, &t, 10, true).unwrap()));
        // The same on one thread as on many.
        let one = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let w1 = one.install(|| build(&spec, &t, 9, true).unwrap());
        assert_eq!(texts(&w), texts(&w1));
    }

    #[test]
    fn random_and_multi_turn_respect_ranges() {
        let t = tok();
        let w = build(
            &WorkloadSpec::Random {
                requests: 40,
                input_len: LenRange { min: 3, max: 30 },
                output_len: LenRange { min: 1, max: 4 },
            },
            &t,
            1,
            true,
        )
        .unwrap();
        assert_eq!(w.total_requests(), 40);
        let lens: Vec<usize> = w
            .sessions
            .iter()
            .map(|s| s.turns[0].user.tokens())
            .collect();
        assert!(lens.iter().all(|l| (3..=30).contains(l)));
        assert!(lens.iter().any(|&l| l != lens[0]));
        let w = build(
            &WorkloadSpec::MultiTurn {
                conversations: 2,
                turns: 3,
                prefix_len: LenRange::fixed(0),
                question_len: LenRange::fixed(4),
                output_len: LenRange::fixed(2),
            },
            &t,
            1,
            false,
        )
        .unwrap();
        assert_eq!(w.total_requests(), 6);
        assert!(w.is_multi_turn());
        assert!(w.sessions.iter().all(|s| s.system.is_none()));
    }

    #[test]
    fn file_entries_in_json_and_jsonl() {
        let dir = std::env::temp_dir().join(format!("chimera-wl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let jsonl = dir.join("p.jsonl");
        std::fs::write(
            &jsonl,
            "\"one two three\"\n\n{\"prompt\": \"a b\", \"output_len\": 9}\n\
             {\"system\": \"s s\", \"turns\": [\"x\", \"y z\"]}\n",
        )
        .unwrap();
        let w = build(
            &WorkloadSpec::File {
                path: jsonl.clone(),
                output_len: LenRange::fixed(5),
            },
            &tok(),
            0,
            true,
        )
        .unwrap();
        assert_eq!(w.sessions.len(), 3);
        assert_eq!(w.total_requests(), 4);
        assert_eq!(w.sessions[0].turns[0].user.tokens(), 3);
        assert_eq!(w.sessions[0].turns[0].output_len, 5);
        assert_eq!(w.sessions[1].turns[0].output_len, 9);
        assert_eq!(w.sessions[2].system.as_ref().unwrap().text, "s s");
        let json = dir.join("p.json");
        std::fs::write(&json, "[\"a\", {\"promt\": \"typo\"}]").unwrap();
        let err = build(
            &WorkloadSpec::File {
                path: json,
                output_len: LenRange::fixed(5),
            },
            &tok(),
            0,
            true,
        )
        .unwrap_err();
        assert!(err.to_string().contains("p.json"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
