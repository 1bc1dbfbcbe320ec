//! The sampling tail's kernels (`sample.cu`): entry table and launch planner.
//!
//! Owns the device side of `SampleRows → SampleOut` (the columns are described in the host's
//! `backend/sample.rs`): per sampled logits row, penalties applied in place, the K best
//! candidates by `order_key` (descending logit, ties to the lower id, NaN as −∞) and the
//! log-sum-exp of the penalised row. In f32 the candidates are bit-identical to the CPU
//! reference (`backend/cpu/sample.rs`); the log-sum-exp differs from its sequential sum by
//! rounding only.
//!
//! [`launches`] returns the kernels of one step shape `(n, vocab, k)` in order; the backend
//! maps each [`SampleArg`] to a pointer or value and launches them as given, on one stream,
//! with [`scratch_bytes`] worth of uninitialised scratch. The plan depends only on the shape,
//! so it can be captured once per bucket in a CUDA graph. Every launch stays within 48 KiB of
//! shared memory, so no function attribute has to be raised.
//!
//! Contract the backend keeps (the kernels cannot check it): `sample_rows` are distinct rows
//! below the logits' row count (penalties are applied in place, once per listed row); the
//! history CSR satisfies `SampleRows`' invariants; `vocab` is at least 1 and below 2³¹;
//! scratch buffers are 8-byte aligned.

use super::Param::{Ptr, U32};
use super::{Entry, Launch, Param};

const CHUNK_TOPK: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, U32, Ptr, Ptr,
];
const MERGE: &[Param] = &[Ptr, Ptr, Ptr, U32, U32, U32, U32, Ptr, Ptr, Ptr, Ptr, Ptr];
const ROW_TOPK: &[Param] = &[
    Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, Ptr, U32, U32, U32, Ptr, Ptr, Ptr,
];
const APPLY_MASKS: &[Param] = &[Ptr, Ptr, Ptr, Ptr, U32, U32];

pub const ENTRIES: &[Entry] = &[
    Entry {
        name: "sample_chunk_topk",
        params: CHUNK_TOPK,
    },
    Entry {
        name: "sample_merge",
        params: MERGE,
    },
    Entry {
        name: "sample_row_topk",
        params: ROW_TOPK,
    },
    Entry {
        name: "sample_apply_masks",
        params: APPLY_MASKS,
    },
];

/// A symbolic kernel argument; the backend maps it to a device pointer or a value. Per-row
/// columns have one entry per *sampled* row (`n`), in `sample_rows` order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SampleArg {
    /// The logits, f32 `[rows, vocab]` (f32 in bf16 mode too). The sampled rows are penalised
    /// in place.
    Logits,
    /// u32 `[n]`: the logits row of each sampled row (`plan.sample_rows`).
    SampleRows,
    /// f32 `[n]`: repetition penalty (1, or any value ≤ 0, disables it).
    Repetition,
    /// f32 `[n]`: presence penalty.
    Presence,
    /// f32 `[n]`: frequency penalty.
    Frequency,
    /// u32 `[n]`: 1 where the row wants its log-sum-exp, else 0.
    WantLse,
    /// u32 `[n + 1]`: row `i`'s history is entries `hist_offsets[i]..hist_offsets[i + 1]`.
    HistOffsets,
    /// u32 `[entries]`: distinct history tokens per row (ids ≥ vocab are ignored).
    HistTokens,
    /// u32 `[entries]`: each history token's count in the row's output (0: prompt only;
    /// `u32::MAX`: in neither prompt nor output, the entry only carries a bias).
    HistCounts,
    /// f32 `[entries]`: added to the entry token's logit after its penalties (a request's
    /// `logit_bias`; negative infinity masks a token out).
    HistBias,
    /// u32 `[n, k]` out: candidate ids, best first.
    CandTokens,
    /// f32 `[n, k]` out: the candidates' penalised logits as they are in the row (NaN kept).
    CandLogits,
    /// f32 `[n]` out: the penalised row's log-sum-exp where wanted, else 0.
    Lse,
    /// Scratch buffer `i`, of `scratch_bytes(..)[i]` bytes, uninitialised, 8-byte aligned.
    Scratch(usize),
    /// u32 `[n]`: the mask of each sampled row, as an index into `Masks`, or `u32::MAX` for
    /// none (`SampleRows::mask_of`).
    MaskOf,
    /// u32 `[masks, ceil(vocab / 32)]`: allowed-token bits (`SampleRows::masks`).
    Masks,
    /// A value passed as it is.
    U32(u32),
}

/// Largest K that the split path takes; larger K runs one block per row.
pub const SPLIT_K_MAX: usize = 1024;
/// Dynamic shared memory a launch may ask for: 48 KiB (the limit without raising the
/// function's attribute) less room for the kernels' 1168 static bytes.
pub const SMEM_LIMIT: usize = 48 * 1024 - 2048;
/// Threads per block of each kernel (the sources assume these).
const CHUNK_THREADS: u32 = 256;
const MERGE_THREADS: u32 = 512;
const ROW_THREADS: u32 = 1024;

/// Candidates per row: `k` capped at the vocabulary, at least 1 (as the CPU produces).
pub fn candidates(vocab: usize, k: usize) -> usize {
    k.min(vocab).max(1)
}

/// Which kernels run, with their shape-derived parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// `sample_chunk_topk` over `parts` chunks of `chunk` ids per row (the last may be
    /// shorter), then `sample_merge`; `cache`: the merge copies the row's `parts · k` part
    /// keys to shared memory.
    Split {
        chunk: usize,
        parts: usize,
        cache: bool,
    },
    /// `sample_row_topk`; `sort_in_smem`: the K keys are sorted in shared memory, else in
    /// place in the output columns.
    Row { sort_in_smem: bool },
}

/// The tail's plan for `n` sampled rows of `vocab` logits and `k` wanted candidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub n: usize,
    pub vocab: usize,
    /// Candidates per row, as [`candidates`].
    pub k: usize,
    pub path: Path,
}

impl Geometry {
    pub fn new(n: usize, vocab: usize, k: usize) -> Self {
        let k = candidates(vocab, k);
        let path = if k <= SPLIT_K_MAX {
            // Small batches take smaller chunks, so a row spreads over more blocks.
            let chunk = if n <= 16 { 4096 } else { 8192 }.min(vocab.max(1));
            let parts = vocab.div_ceil(chunk).max(1);
            let cache = (parts + 1) * k * 8 <= SMEM_LIMIT;
            Path::Split {
                chunk,
                parts,
                cache,
            }
        } else {
            Path::Row {
                sort_in_smem: k * 8 <= SMEM_LIMIT,
            }
        };
        Geometry { n, vocab, k, path }
    }

    /// Bytes of each scratch buffer ([`SampleArg::Scratch`] indexes this).
    pub fn scratch_bytes(&self) -> Vec<usize> {
        match self.path {
            _ if self.n == 0 || self.vocab == 0 => Vec::new(),
            // Part keys (u64 [n, parts, k]) and part statistics (f32 [n, parts, 2]).
            Path::Split { parts, .. } => vec![self.n * parts * self.k * 8, self.n * parts * 8],
            Path::Row { .. } => Vec::new(),
        }
    }

    /// The kernels to launch, in order (none for an empty batch or vocabulary).
    pub fn launches(&self) -> Vec<Launch<SampleArg>> {
        use SampleArg::*;
        if self.n == 0 || self.vocab == 0 {
            return Vec::new();
        }
        let (n, vocab, k) = (to_u32(self.n), to_u32(self.vocab), to_u32(self.k));
        let penalties = [
            Logits,
            SampleRows,
            Repetition,
            Presence,
            Frequency,
            WantLse,
            HistOffsets,
            HistTokens,
            HistCounts,
            HistBias,
        ];
        match self.path {
            Path::Split {
                chunk,
                parts,
                cache,
            } => {
                let mut chunk_args = penalties.to_vec();
                chunk_args.extend([
                    U32(vocab),
                    U32(to_u32(chunk)),
                    U32(to_u32(parts)),
                    U32(k),
                    Scratch(0),
                    Scratch(1),
                ]);
                let merge_smem = if cache { parts + 1 } else { 1 } * self.k * 8;
                vec![
                    Launch {
                        entry: "sample_chunk_topk",
                        grid: (to_u32(self.n * parts), 1, 1),
                        block: (CHUNK_THREADS, 1, 1),
                        smem: to_u32(chunk * 4),
                        args: chunk_args,
                    },
                    Launch {
                        entry: "sample_merge",
                        grid: (n, 1, 1),
                        block: (MERGE_THREADS, 1, 1),
                        smem: to_u32(merge_smem),
                        args: vec![
                            Logits,
                            SampleRows,
                            WantLse,
                            U32(vocab),
                            U32(to_u32(parts)),
                            U32(k),
                            U32(u32::from(cache)),
                            Scratch(0),
                            Scratch(1),
                            CandTokens,
                            CandLogits,
                            Lse,
                        ],
                    },
                ]
            }
            Path::Row { sort_in_smem } => {
                let mut args = penalties.to_vec();
                args.extend([
                    U32(vocab),
                    U32(k),
                    U32(u32::from(sort_in_smem)),
                    CandTokens,
                    CandLogits,
                    Lse,
                ]);
                vec![Launch {
                    entry: "sample_row_topk",
                    grid: (n, 1, 1),
                    block: (ROW_THREADS, 1, 1),
                    smem: if sort_in_smem { to_u32(self.k * 8) } else { 0 },
                    args,
                }]
            }
        }
    }
}

/// The kernels of the sampling tail for `n` sampled rows, in launch order.
pub fn launches(n: usize, vocab: usize, k: usize) -> Vec<Launch<SampleArg>> {
    Geometry::new(n, vocab, k).launches()
}

/// The launch that applies the token masks of constrained rows (`n` sampled rows of `vocab`
/// logits), to go before [`launches`]' kernels when the step has masks; a step without any
/// launches nothing for them (`None` for an empty batch or vocabulary too).
pub fn mask_launch(n: usize, vocab: usize) -> Option<Launch<SampleArg>> {
    const THREADS: u32 = 256;
    if n == 0 || vocab == 0 {
        return None;
    }
    let words = to_u32(vocab.div_ceil(32));
    Some(Launch {
        entry: "sample_apply_masks",
        grid: (words.div_ceil(THREADS), to_u32(n), 1),
        block: (THREADS, 1, 1),
        smem: 0,
        args: vec![
            SampleArg::Logits,
            SampleArg::SampleRows,
            SampleArg::MaskOf,
            SampleArg::Masks,
            SampleArg::U32(to_u32(vocab)),
            SampleArg::U32(words),
        ],
    })
}

/// The scratch buffers [`launches`] refers to as `Scratch(i)`, in bytes.
pub fn scratch_bytes(n: usize, vocab: usize, k: usize) -> Vec<usize> {
    Geometry::new(n, vocab, k).scratch_bytes()
}

/// Shapes are bounded by the contract (vocab < 2³¹); saturate rather than wrap beyond it.
fn to_u32(x: usize) -> u32 {
    u32::try_from(x).unwrap_or(u32::MAX)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn kinds_match(arg: &SampleArg, param: Param) -> bool {
        match arg {
            SampleArg::U32(_) => param == Param::U32,
            _ => param == Param::Ptr,
        }
    }

    fn u32_args(l: &Launch<SampleArg>) -> Vec<u32> {
        l.args
            .iter()
            .filter_map(|a| match a {
                SampleArg::U32(v) => Some(*v),
                _ => None,
            })
            .collect()
    }

    /// Every property of one plan that the kernels rely on.
    fn check_plan(n: usize, vocab: usize, k: usize) {
        let g = Geometry::new(n, vocab, k);
        let kk = candidates(vocab, k);
        assert_eq!(g.k, kk);
        let ls = g.launches();
        let scratch = g.scratch_bytes();
        let ctx = format!("n={n} vocab={vocab} k={k}: {g:?}");
        for l in &ls {
            let e = ENTRIES
                .iter()
                .find(|e| e.name == l.entry)
                .unwrap_or_else(|| panic!("{ctx}: unknown entry {}", l.entry));
            assert_eq!(l.args.len(), e.params.len(), "{ctx}: {}", l.entry);
            for (a, p) in l.args.iter().zip(e.params) {
                assert!(
                    kinds_match(a, *p),
                    "{ctx}: {} arg {a:?} is not {p:?}",
                    l.entry
                );
                if let SampleArg::Scratch(i) = a {
                    assert!(*i < scratch.len(), "{ctx}: scratch {i} not sized");
                }
            }
            assert_eq!(
                (l.grid.1, l.grid.2, l.block.1, l.block.2),
                (1, 1, 1, 1),
                "{ctx}"
            );
            assert!(l.grid.0 >= 1 && l.grid.0 <= i32::MAX as u32, "{ctx}");
            let threads = match l.entry {
                "sample_chunk_topk" => CHUNK_THREADS,
                "sample_merge" => MERGE_THREADS,
                _ => ROW_THREADS,
            };
            assert_eq!(l.block.0, threads, "{ctx}: {}", l.entry);
            assert!(
                l.smem as usize <= SMEM_LIMIT,
                "{ctx}: {} smem {}",
                l.entry,
                l.smem
            );
        }
        match g.path {
            Path::Split {
                chunk,
                parts,
                cache,
            } => {
                assert!(kk <= SPLIT_K_MAX, "{ctx}");
                assert!((1..=8192).contains(&chunk), "{ctx}");
                assert!(
                    parts * chunk >= vocab && (parts - 1) * chunk < vocab,
                    "{ctx}"
                );
                assert_eq!(scratch, vec![n * parts * kk * 8, n * parts * 8], "{ctx}");
                assert_eq!(ls.len(), 2, "{ctx}");
                let (c, m) = (&ls[0], &ls[1]);
                assert_eq!((c.entry, m.entry), ("sample_chunk_topk", "sample_merge"));
                assert_eq!(c.grid.0 as usize, n * parts, "{ctx}");
                assert_eq!(c.smem as usize, chunk * 4, "{ctx}");
                let (v, ch, p, kv) = (vocab as u32, chunk as u32, parts as u32, kk as u32);
                assert_eq!(u32_args(c), vec![v, ch, p, kv], "{ctx}");
                assert_eq!(m.grid.0 as usize, n, "{ctx}");
                assert_eq!(u32_args(m), vec![v, p, kv, u32::from(cache)], "{ctx}");
                let keys = if cache { (parts + 1) * kk } else { kk };
                assert_eq!(m.smem as usize, keys * 8, "{ctx}");
                // The cache is used whenever it fits.
                assert_eq!(cache, (parts + 1) * kk * 8 <= SMEM_LIMIT, "{ctx}");
            }
            Path::Row { sort_in_smem } => {
                assert!(kk > SPLIT_K_MAX, "{ctx}");
                assert!(scratch.is_empty(), "{ctx}");
                assert_eq!(ls.len(), 1, "{ctx}");
                let r = &ls[0];
                assert_eq!(
                    (r.entry, r.grid.0 as usize),
                    ("sample_row_topk", n),
                    "{ctx}"
                );
                let smem = if sort_in_smem { kk * 8 } else { 0 };
                assert_eq!(r.smem as usize, smem, "{ctx}");
                assert_eq!(sort_in_smem, kk * 8 <= SMEM_LIMIT, "{ctx}");
                let want = vec![vocab as u32, kk as u32, u32::from(sort_in_smem)];
                assert_eq!(u32_args(r), want, "{ctx}");
            }
        }
    }

    #[test]
    fn plans_are_sane_for_every_shape() {
        let ns = [1, 2, 7, 16, 17, 64, 255, 256, 1000, 1024];
        // 92 parts of K = 64 just fill the shared-memory limit; 93 would not.
        let vocabs: [usize; 16] = [
            1,
            2,
            100,
            512,
            1000,
            4095,
            4096,
            4097,
            8193,
            32000,
            50257,
            131072,
            151936,
            262144,
            92 * 4096,
            92 * 8192,
        ];
        for &n in &ns {
            for &vocab in &vocabs {
                let ks = [
                    0,
                    1,
                    2,
                    63,
                    64,
                    100,
                    1023,
                    1024,
                    1025,
                    5000,
                    5887,
                    5888,
                    5889,
                    vocab / 2,
                    vocab.saturating_sub(1),
                    vocab,
                    vocab + 7,
                ];
                for &k in &ks {
                    check_plan(n, vocab, k);
                }
            }
        }
    }

    #[test]
    fn k_is_capped_at_the_vocabulary_and_at_least_one() {
        assert_eq!(candidates(100, 500), 100);
        assert_eq!(candidates(100, 0), 1);
        assert_eq!(candidates(131072, 64), 64);
        // The capped K reaches the kernels and sizes the scratch.
        let l = launches(3, 100, 500);
        assert_eq!(u32_args(&l[0]), vec![100, 100, 1, 100]);
        assert_eq!(scratch_bytes(3, 100, 500), vec![3 * 100 * 8, 3 * 8]);
        let l = launches(3, 5000, 1 << 20);
        assert_eq!(l[0].entry, "sample_row_topk");
        assert_eq!(u32_args(&l[0]), vec![5000, 5000, 1]);
    }

    /// The mask launch covers every word of every sampled row with one thread, passes the
    /// declared argument kinds, and launches nothing for an empty batch or vocabulary.
    #[test]
    fn the_mask_launch_covers_every_word_of_every_row() {
        for (n, vocab) in [(1, 1), (3, 33), (64, 49152), (256, 248320), (5, 8191)] {
            let l = mask_launch(n, vocab).unwrap();
            let e = ENTRIES.iter().find(|e| e.name == l.entry).unwrap();
            assert_eq!(l.args.len(), e.params.len());
            assert!(l.args.iter().zip(e.params).all(|(a, p)| kinds_match(a, *p)));
            let words = vocab.div_ceil(32);
            assert_eq!(u32_args(&l), vec![vocab as u32, words as u32]);
            assert!(
                l.grid.0 as usize * l.block.0 as usize >= words,
                "{n} {vocab}"
            );
            assert!(
                (l.grid.0 as usize - 1) * (l.block.0 as usize) < words,
                "no idle block"
            );
            assert_eq!(
                (l.grid.1 as usize, l.grid.2, l.block.1, l.block.2),
                (n, 1, 1, 1)
            );
            assert_eq!(
                &l.args[..4],
                &[
                    SampleArg::Logits,
                    SampleArg::SampleRows,
                    SampleArg::MaskOf,
                    SampleArg::Masks
                ]
            );
        }
        assert!(mask_launch(0, 100).is_none() && mask_launch(4, 0).is_none());
    }

    #[test]
    fn an_empty_batch_launches_nothing() {
        assert!(launches(0, 131072, 64).is_empty());
        assert!(scratch_bytes(0, 131072, 64).is_empty());
        assert!(launches(4, 0, 64).is_empty());
    }

    #[test]
    fn the_common_shapes_take_the_split_path() {
        let bs1 = Geometry::new(1, 131072, 64);
        let split = |chunk, parts| Path::Split {
            chunk,
            parts,
            cache: true,
        };
        assert_eq!(bs1.path, split(4096, 32));
        assert_eq!(Geometry::new(256, 131072, 64).path, split(8192, 16));
        assert_eq!(Geometry::new(256, 151936, 64).path, split(8192, 19));
        let big_k = Geometry::new(8, 131072, 1024).path;
        assert_eq!(
            big_k,
            Path::Split {
                chunk: 4096,
                parts: 32,
                cache: false
            }
        );
    }

    // A sequential model of the device algorithm (radix select with early stop, the
    // selection predicate, collection, the one-direction bitonic network without padding,
    // the split into parts with sentinels), checked against a full sort of `order_key`s.

    const SENTINEL: u64 = u64::MAX;

    /// The CPU's `order_key`, written as the host writes it.
    fn order_key(x: f32, t: u32) -> u64 {
        let x = if x.is_nan() { f32::NEG_INFINITY } else { x };
        let b = x.to_bits();
        let ascending = if b >> 31 == 1 { !b } else { b | 0x8000_0000 };
        (u64::from(!ascending) << 32) | u64::from(t)
    }

    /// `desc_key` and `key_value` as `sample.cu` writes them.
    fn desc_key(x: f32) -> u32 {
        let b = if x.is_nan() { 0xff80_0000 } else { x.to_bits() };
        let ascending = if b >> 31 != 0 { !b } else { b | 0x8000_0000 };
        !ascending
    }
    fn key_value(dk: u32) -> f32 {
        let a = !dk;
        f32::from_bits(if a >> 31 != 0 { a & 0x7fff_ffff } else { !a })
    }

    fn radix_select(keys: &[u64], mut need: u32) -> (u64, u32) {
        let mut prefix = 0u64;
        for d in (0..8).rev().map(|i| i * 8) {
            let mut hist = [0u32; 256];
            for &key in keys {
                if d == 56 || (key >> (d + 8)) == prefix {
                    hist[((key >> d) & 255) as usize] += 1;
                }
            }
            let mut below = 0;
            let mut bin = 0;
            while below + hist[bin] < need {
                below += hist[bin];
                bin += 1;
            }
            need -= below;
            prefix = (prefix << 8) | bin as u64;
            if hist[bin] == need {
                return (prefix, d);
            }
        }
        (prefix, 0)
    }

    fn select_and_collect(keys: &[u64], need: usize) -> Vec<u64> {
        let (prefix, shift) = radix_select(keys, need as u32);
        let out: Vec<u64> = keys
            .iter()
            .copied()
            .filter(|&k| (k >> shift) <= prefix)
            .collect();
        assert_eq!(out.len(), need, "selection is not exactly K keys");
        out
    }

    fn bitonic_sort(buf: &mut [u64]) {
        let n = buf.len();
        let p = n.next_power_of_two();
        let mut size = 2;
        while size <= p {
            let mut stride = size / 2;
            while stride > 0 {
                for t in 0..p / 2 {
                    let i = ((t & !(stride - 1)) << 1) | (t & (stride - 1));
                    let l = if stride == size / 2 {
                        i ^ (size - 1)
                    } else {
                        i + stride
                    };
                    if l < n && buf[l] < buf[i] {
                        buf.swap(i, l);
                    }
                }
                stride /= 2;
            }
            size *= 2;
        }
    }

    /// The split path: chunks' top keys padded with sentinels, then the merge.
    fn model_split(row: &[f32], k: usize, chunk: usize) -> Vec<u64> {
        let mut parts = Vec::new();
        for (c, xs) in row.chunks(chunk).enumerate() {
            let keys: Vec<u64> = xs
                .iter()
                .enumerate()
                .map(|(j, &x)| (u64::from(desc_key(x)) << 32) | (c * chunk + j) as u64)
                .collect();
            let mut top = select_and_collect(&keys, k.min(xs.len()));
            top.resize(k, SENTINEL);
            parts.extend(top);
        }
        let mut out = select_and_collect(&parts, k);
        bitonic_sort(&mut out);
        out
    }

    /// The row path: select over the whole row, then sort.
    fn model_row(row: &[f32], k: usize) -> Vec<u64> {
        let keys: Vec<u64> = (0..row.len())
            .map(|t| (u64::from(desc_key(row[t])) << 32) | t as u64)
            .collect();
        let mut out = select_and_collect(&keys, k);
        bitonic_sort(&mut out);
        out
    }

    fn reference(row: &[f32], k: usize) -> Vec<u64> {
        let mut keys: Vec<u64> = (0..row.len())
            .map(|t| order_key(row[t], t as u32))
            .collect();
        keys.sort_unstable();
        keys.truncate(k);
        keys
    }

    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Rows that stress the order: continuous values, heavy ties, specials, constant rows.
    fn row(rng: &mut Rng, kind: u64, len: usize) -> Vec<f32> {
        let specials = [
            f32::NAN,
            -f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            -f32::MAX,
        ];
        (0..len)
            .map(|_| match kind {
                0 => (rng.next() >> 40) as f32 / (1u64 << 20) as f32 - 8.0,
                1 => (rng.below(5) as f32) - 2.0,
                2 => {
                    if rng.below(4) == 0 {
                        specials[rng.below(specials.len() as u64) as usize]
                    } else {
                        rng.below(7) as f32 * 0.5 - 1.5
                    }
                }
                3 => 1.25,
                4 => f32::NAN,
                _ => f32::NEG_INFINITY,
            })
            .collect()
    }

    #[test]
    fn the_device_algorithm_matches_a_full_sort() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for &len in &[1usize, 2, 5, 64, 300, 1000] {
            for kind in 0..6 {
                let xs = row(&mut rng, kind, len);
                let mut ks = vec![1, 2, 3, 10, 64, len / 2, len - 1, len];
                ks.retain(|&k| (1..=len).contains(&k));
                for &k in &ks {
                    let want = reference(&xs, k);
                    assert_eq!(
                        model_row(&xs, k),
                        want,
                        "row path len={len} kind={kind} k={k}"
                    );
                    for &chunk in &[1usize, 7, 64, 256, 4096] {
                        let got = model_split(&xs, k, chunk);
                        assert_eq!(got, want, "split len={len} kind={kind} k={k} chunk={chunk}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_bitonic_network_sorts_every_length() {
        let mut rng = Rng(12345);
        for n in 1..=200usize {
            let mut v: Vec<u64> = (0..n as u64).map(|i| i * 0x1_0000_0001).collect();
            for i in (1..n).rev() {
                v.swap(i, rng.below(i as u64 + 1) as usize);
            }
            bitonic_sort(&mut v);
            assert!(v.windows(2).all(|w| w[0] < w[1]), "n={n}");
        }
    }

    #[test]
    fn descending_keys_invert_and_order_like_the_cpu() {
        let xs = [
            0.0,
            -0.0,
            1.0,
            -1.0,
            f32::MAX,
            -f32::MAX,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            1e-45,
            -1e-45,
            3.5,
        ];
        for &x in &xs {
            assert_eq!(key_value(desc_key(x)).to_bits(), x.to_bits(), "{x}");
            assert_eq!(u64::from(desc_key(x)) << 32, order_key(x, 0));
        }
        assert_eq!(key_value(desc_key(f32::NAN)), f32::NEG_INFINITY);
        // Nothing a row can hold reaches the sentinel.
        assert!(order_key(f32::NAN, u32::MAX) < SENTINEL);
    }
}
