//! Prompt text of an exact token length, measured with the served model's own tokenizer.
//!
//! Owns the benchmark's view of a tokenizer: a pool of "safe words" (vocabulary entries that
//! are one token on their own, written with a leading space, and are plain lowercase ASCII),
//! random prompts drawn from that pool, and the check-and-adjust loop that makes a prompt
//! tokenize to exactly the requested number of tokens.
//!
//! Invariants: a [`Prompt`]'s `ids` are the pool ids of its words in order and `ids.len()` is
//! its token count; text returned by [`PromptTokenizer::extend_exact`] re-encodes (appended to
//! the given head) to exactly the requested count, or an error is returned. Counts never
//! include special tokens (BOS, chat template) that a server adds. Must not talk to a server.
//!
//! A whitespace "words" tokenizer is available when no tokenizer file exists (one word = one
//! token); its counts are only an approximation of a real model's.

use std::path::Path;

use super::BenchError;
use super::rng::Rng;

/// At most this many pool words are kept (lowest ids first: the most common words).
const MAX_POOL: usize = 8192;
/// At most this many add/remove steps when fitting a prompt to an exact length.
const MAX_ADJUST: usize = 64;

/// Prompt text with the token ids it was built from.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
}

impl Prompt {
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// Concatenation (text and ids).
    pub fn concat(&self, other: &Prompt) -> Prompt {
        let mut text = self.text.clone();
        text.push_str(&other.text);
        let mut ids = self.ids.clone();
        ids.extend_from_slice(&other.ids);
        Prompt { text, ids }
    }
}

enum Kind {
    Hf(Box<tokenizers::Tokenizer>),
    Words,
}

/// One pool entry: its token id and its text with the leading space.
struct Word {
    id: u32,
    text: String,
}

/// The tokenizer used to size prompts.
pub struct PromptTokenizer {
    kind: Kind,
    pool: Vec<Word>,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("real", &self.is_real())
            .field("pool", &self.pool.len())
            .finish()
    }
}

fn is_plain_word(s: &str) -> bool {
    (2..=12).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_lowercase())
}

impl PromptTokenizer {
    /// `"words"` selects the whitespace fallback; anything else is a `tokenizer.json` path.
    pub fn load(spec: &str) -> Result<Self, BenchError> {
        if spec == "words" {
            return Ok(Self::words());
        }
        Self::from_file(Path::new(spec))
    }

    /// Loads a Hugging Face `tokenizer.json` and builds the word pool from its vocabulary.
    pub fn from_file(path: &Path) -> Result<Self, BenchError> {
        if !path.exists() {
            return Err(BenchError::Tokenizer(format!(
                "{} does not exist; pass --tokenizer PATH/tokenizer.json of the served model, \
                 or --tokenizer words for approximate whitespace counting",
                path.display()
            )));
        }
        let tok = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| BenchError::Tokenizer(format!("{}: {e}", path.display())))?;
        Self::from_tokenizer(tok)
    }

    /// Wraps an already built tokenizer (used by tests that construct one in memory).
    pub fn from_tokenizer(tok: tokenizers::Tokenizer) -> Result<Self, BenchError> {
        let vocab = tok.get_vocab_size(false) as u32;
        let mut pool = Vec::new();
        for id in 0..vocab {
            if pool.len() >= MAX_POOL {
                break;
            }
            let Ok(s) = tok.decode(&[id], true) else {
                continue;
            };
            let bare = s.strip_prefix(' ').unwrap_or(&s);
            if !is_plain_word(bare) {
                continue;
            }
            let text = format!(" {bare}");
            match tok.encode(text.as_str(), false) {
                Ok(enc) if enc.get_ids() == [id] => pool.push(Word { id, text }),
                _ => {}
            }
        }
        if pool.is_empty() {
            return Err(BenchError::Tokenizer(
                "the tokenizer has no plain lowercase words that encode to one token; \
                 use --tokenizer words"
                    .into(),
            ));
        }
        Ok(Self {
            kind: Kind::Hf(Box::new(tok)),
            pool,
        })
    }

    /// The whitespace fallback: one word is one token.
    pub fn words() -> Self {
        const ONSETS: [&str; 16] = [
            "b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "h",
        ];
        const VOWELS: [&str; 5] = ["a", "e", "i", "o", "u"];
        let syllables: Vec<String> = ONSETS
            .iter()
            .flat_map(|o| VOWELS.iter().map(move |v| format!("{o}{v}")))
            .collect();
        let mut pool = Vec::new();
        for a in &syllables {
            for b in &syllables {
                pool.push(Word {
                    id: pool.len() as u32,
                    text: format!(" {a}{b}"),
                });
            }
        }
        Self {
            kind: Kind::Words,
            pool,
        }
    }

    /// True for a model tokenizer, false for the whitespace fallback.
    pub fn is_real(&self) -> bool {
        matches!(self.kind, Kind::Hf(_))
    }

    /// Number of pool words prompts are drawn from.
    pub fn pool_size(&self) -> usize {
        self.pool.len()
    }

    /// Token count of `text`, without special tokens.
    pub fn count(&self, text: &str) -> Result<usize, BenchError> {
        match &self.kind {
            Kind::Hf(tok) => tok
                .encode(text, false)
                .map(|e| e.get_ids().len())
                .map_err(|e| BenchError::Tokenizer(format!("encode failed: {e}"))),
            Kind::Words => Ok(text.split_whitespace().count()),
        }
    }

    /// A prompt for user-supplied text: its ids are the text's encoding (placeholders for the
    /// whitespace fallback, which only counts).
    pub fn prompt_from_text(&self, text: &str) -> Result<Prompt, BenchError> {
        let ids = match &self.kind {
            Kind::Hf(tok) => tok
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| BenchError::Tokenizer(format!("encode failed: {e}")))?,
            Kind::Words => vec![0; text.split_whitespace().count()],
        };
        Ok(Prompt {
            text: text.to_string(),
            ids,
        })
    }

    fn random_word(&self, rng: &mut Rng) -> &Word {
        &self.pool[rng.below(self.pool.len() as u64) as usize]
    }

    /// `n` random pool words; exact in ids, and in text as long as words stay separate tokens.
    pub fn random(&self, rng: &mut Rng, n: usize) -> Prompt {
        let mut p = Prompt {
            text: String::with_capacity(n * 6),
            ids: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let w = self.random_word(rng);
            p.text.push_str(&w.text);
            p.ids.push(w.id);
        }
        p
    }

    /// Random text of `n` tokens such that `head_text + result.text` encodes to exactly
    /// `head_tokens + result.tokens()` tokens and `result.tokens() == n` counts what was added.
    /// When word boundaries merge (rare, tokenizer dependent), words are added or removed at
    /// the end until the total is exact; `ids` then follow the final words.
    pub fn extend_exact(
        &self,
        head_text: &str,
        head_tokens: usize,
        rng: &mut Rng,
        n: usize,
    ) -> Result<Prompt, BenchError> {
        let mut words: Vec<usize> = (0..n)
            .map(|_| rng.below(self.pool.len() as u64) as usize)
            .collect();
        let want = head_tokens + n;
        for _ in 0..MAX_ADJUST {
            let tail = self.render(&words);
            let mut full = String::with_capacity(head_text.len() + tail.text.len());
            full.push_str(head_text);
            full.push_str(&tail.text);
            let got = self.count(&full)?;
            if got == want {
                return Ok(Prompt {
                    text: tail.text,
                    ids: tail.ids,
                });
            }
            if got > want {
                if words.pop().is_none() {
                    break;
                }
            } else {
                words.push(rng.below(self.pool.len() as u64) as usize);
            }
        }
        Err(BenchError::Tokenizer(format!(
            "could not build a prompt of exactly {want} tokens with this tokenizer"
        )))
    }

    fn render(&self, words: &[usize]) -> Prompt {
        let mut p = Prompt::default();
        for &w in words {
            p.text.push_str(&self.pool[w].text);
            p.ids.push(self.pool[w].id);
        }
        p
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use std::collections::HashMap;
    use tokenizers::models::TrainerWrapper;
    use tokenizers::models::bpe::{BPE, BpeTrainer};
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::{AddedToken, Tokenizer};

    /// A word-level tokenizer over `words` plus `<unk>`; one whitespace word = one token.
    pub(crate) fn word_level(words: &[&str]) -> Tokenizer {
        let mut vocab: HashMap<String, u32> = HashMap::new();
        vocab.insert("<unk>".into(), 0);
        for w in words {
            let id = vocab.len() as u32;
            vocab.insert((*w).to_string(), id);
        }
        let model = WordLevel::builder()
            .vocab(vocab.into_iter().collect())
            .unk_token("<unk>".into())
            .build()
            .unwrap();
        let mut tok = Tokenizer::new(model);
        tok.with_pre_tokenizer(Some(WhitespaceSplit));
        tok.with_decoder(Some(tokenizers::decoders::wordpiece::WordPiece::default()));
        tok
    }

    /// A byte-level BPE trained on a small corpus: the shape of GPT-2 / Llama-3 / Qwen
    /// tokenizers, where neighbouring words could in principle merge.
    fn byte_level_bpe() -> Tokenizer {
        let corpus: String = (0..400)
            .map(|i| {
                [
                    "the cache holds blocks of tokens",
                    "a request reuses the prefix of another",
                    "state space layers keep a running state",
                    "routers pick a replica for every request",
                ][i % 4]
            })
            .collect::<Vec<_>>()
            .join(" ");
        let dir = std::env::temp_dir().join(format!("chimera-bpe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("corpus.txt");
        std::fs::write(&file, corpus).unwrap();
        let mut trainer: TrainerWrapper = BpeTrainer::builder()
            .vocab_size(300)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from("<s>", true)])
            .build()
            .into();
        let mut tok = Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(ByteLevel::default()));
        tok.with_decoder(Some(ByteLevel::default()));
        tok.train_from_files(&mut trainer, vec![file.to_string_lossy().into_owned()])
            .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        tok
    }

    #[test]
    fn word_level_pool_and_exact_lengths() {
        let tok =
            PromptTokenizer::from_tokenizer(word_level(&["alpha", "beta", "gamma", "x"])).unwrap();
        // "x" is too short and "<unk>" is not a plain word.
        assert_eq!(tok.pool_size(), 3);
        let mut rng = Rng::new(5);
        let head = tok.extend_exact("", 0, &mut rng, 40).unwrap();
        assert_eq!(tok.count(&head.text).unwrap(), 40);
        let tail = tok.extend_exact(&head.text, 40, &mut rng, 7).unwrap();
        assert_eq!(tail.tokens(), 7);
        assert_eq!(tok.count(&head.concat(&tail).text).unwrap(), 47);
    }

    #[test]
    fn byte_level_bpe_prompts_are_exact() {
        let tok = PromptTokenizer::from_tokenizer(byte_level_bpe()).unwrap();
        assert!(tok.pool_size() >= 5, "pool {}", tok.pool_size());
        let mut rng = Rng::new(11);
        for n in [1usize, 2, 17, 128, 500] {
            let p = tok.extend_exact("", 0, &mut rng, n).unwrap();
            assert_eq!(tok.count(&p.text).unwrap(), n);
            let q = tok.extend_exact(&p.text, n, &mut rng, 9).unwrap();
            assert_eq!(tok.count(&p.concat(&q).text).unwrap(), n + 9);
            // The ids are what the text encodes to.
            if let Kind::Hf(t) = &tok.kind {
                let ids = t.encode(p.text.as_str(), false).unwrap().get_ids().to_vec();
                assert_eq!(ids, p.ids);
            }
        }
    }

    #[test]
    fn repository_tokenizer_gives_exact_lengths() {
        // The tokenizer the tiny built-in models use (byte-level BPE).
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../assets/tokenizer/tokenizer.json"
        );
        let tok = PromptTokenizer::from_file(Path::new(path)).unwrap();
        assert!(tok.is_real());
        assert!(tok.pool_size() >= 10, "pool {}", tok.pool_size());
        let mut rng = Rng::new(3);
        for n in [1usize, 64, 300, 2048] {
            let head = tok.extend_exact("", 0, &mut rng, n).unwrap();
            assert_eq!(tok.count(&head.text).unwrap(), n);
            let q = tok.extend_exact(&head.text, n, &mut rng, 128).unwrap();
            assert_eq!(tok.count(&head.concat(&q).text).unwrap(), n + 128);
        }
    }

    #[test]
    fn words_fallback_counts_whitespace_words() {
        let tok = PromptTokenizer::words();
        assert!(!tok.is_real());
        assert_eq!(tok.pool_size(), 80 * 80);
        let mut rng = Rng::new(1);
        let p = tok.random(&mut rng, 33);
        assert_eq!(tok.count(&p.text).unwrap(), 33);
        assert_eq!(p.tokens(), 33);
    }

    #[test]
    fn missing_file_is_a_clear_error() {
        let err = PromptTokenizer::load("/nonexistent/tokenizer.json").unwrap_err();
        assert!(err.to_string().contains("--tokenizer words"), "{err}");
    }
}
