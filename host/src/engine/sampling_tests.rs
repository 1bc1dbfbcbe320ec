use super::*;
use crate::policy::native::DefaultSampler;

fn logits(rows: &[Vec<f32>]) -> Logits {
    let vocab = rows[0].len();
    Logits {
        data: rows.concat(),
        vocab,
    }
}

fn info<'a>(params: &'a SamplingParams, prompt: &'a [u32], output: &'a [u32]) -> RowInfo<'a> {
    RowInfo {
        params,
        prompt,
        output,
        drafts: &[],
        seed: 1,
        banned: &[],
    }
}

/// A sampler that answers with a fixed list.
/// What `st` samples from the one row of `l` with the default sampler.
fn sample_one(st: &mut SamplingStage, l: &mut Logits, info: RowInfo<'_>) -> Sampled {
    let mut out = Vec::new();
    let mut default = DefaultSampler::default();
    st.sample(
        l,
        &[info],
        &mut default,
        &mut DefaultSampler::default(),
        &mut out,
    );
    out.remove(0)
}

struct Fixed(Decision<Vec<u32>>);
impl Sampler for Fixed {
    fn sample(&mut self, _: &SamplerBatch) -> Decision<Vec<u32>> {
        self.0.clone()
    }
}

#[test]
fn top_k_matches_a_full_sort_with_ties_to_lower_id() {
    let mut x = 12345u64;
    let mut row: Vec<f32> = (0..500)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) % 50) as f32 // many ties
        })
        .collect();
    row[7] = 100.0;
    let mut st = SamplingStage::new(20);
    st.reset_batch(20);
    st.top_k(&row, 20);
    let mut want: Vec<(f32, u32)> = row
        .iter()
        .enumerate()
        .map(|(t, &v)| (v, t as u32))
        .collect();
    want.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let want_tokens: Vec<u32> = want[..20].iter().map(|c| c.1).collect();
    assert_eq!(st.batch.cand_tokens, want_tokens);
    assert_eq!(st.batch.cand_tokens[0], 7);
}

#[test]
fn k_larger_than_vocab_takes_the_whole_vocab() {
    let mut l = logits(&[vec![0.5, 2.0, -1.0]]);
    let p = SamplingParams::default();
    let mut st = SamplingStage::new(64);
    let sampled = sample_one(&mut st, &mut l, info(&p, &[], &[]));
    assert_eq!(st.batch.k, 3);
    assert_eq!(st.batch.cand_tokens, vec![1, 0, 2]);
    assert_eq!(sampled.token, 1);
}

#[test]
fn penalties_use_the_history() {
    let p = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        ..Default::default()
    };
    let mut row = vec![4.0, -4.0, 4.0, 4.0];
    let mut st = SamplingStage::new(4);
    // Token 0 in the prompt, token 1 in the prompt, token 2 generated twice.
    st.apply_penalties(&mut row, &info(&p, &[0, 1], &[2, 2]));
    assert_eq!(row, vec![2.0, -8.0, 2.0 - 0.5 - 0.5, 4.0]);
}

#[test]
fn greedy_picks_the_penalised_best() {
    let p = SamplingParams {
        repetition_penalty: 4.0,
        ..Default::default()
    };
    let mut l = logits(&[vec![1.0, 3.0, 2.0]]);
    let mut st = SamplingStage::new(2);
    assert_eq!(sample_one(&mut st, &mut l, info(&p, &[1], &[])).token, 2);
}

#[test]
fn logprobs_are_a_log_softmax_over_the_full_row() {
    let p = SamplingParams {
        logprobs: Some(3),
        ..Default::default()
    };
    let row = vec![1.0f32, 2.0, 0.5, -1.0, 3.0];
    let mut l = logits(std::slice::from_ref(&row));
    let mut st = SamplingStage::new(2);
    let lp = sample_one(&mut st, &mut l, info(&p, &[], &[]))
        .logprob
        .unwrap();
    let z: f32 = row.iter().map(|x| x.exp()).sum();
    assert_eq!(lp.token, 4);
    assert!((lp.logprob - (3.0f32.exp() / z).ln()).abs() < 1e-5);
    // N is capped at K = 2.
    assert_eq!(lp.top.len(), 2);
    assert_eq!(lp.top[1].0, 1);
    assert!((lp.top[1].1 - (2.0f32.exp() / z).ln()).abs() < 1e-5);
}

#[test]
fn invalid_answers_fall_back() {
    let p = SamplingParams::default();
    let rows = [vec![0.0, 1.0, 2.0, 3.0], vec![3.0, 2.0, 1.0, 0.0]];
    let infos = [info(&p, &[], &[]), info(&p, &[], &[])];
    let mut st = SamplingStage::new(2);
    let tokens = |st: &mut SamplingStage, sampler: &mut dyn Sampler, fallback: &mut dyn Sampler| {
        let mut out = Vec::new();
        st.sample(&mut logits(&rows), &infos, sampler, fallback, &mut out);
        out.iter().map(|s| s.token).collect::<Vec<_>>()
    };
    let mut default = DefaultSampler::default();
    // Token 0 is not among row 0's two candidates (3, 2).
    let mut bad = Fixed(Decision::Use(vec![0, 0]));
    assert_eq!(tokens(&mut st, &mut bad, &mut default), vec![3, 0]);
    assert_eq!(st.fallbacks, 1);
    // A valid non-greedy answer is kept.
    let mut ok = Fixed(Decision::Use(vec![2, 1]));
    assert_eq!(tokens(&mut st, &mut ok, &mut default), vec![2, 1]);
    // Wrong length and UseDefault fall back; a broken fallback ends at the best candidate.
    let mut short = Fixed(Decision::Use(vec![3]));
    let mut broken = Fixed(Decision::UseDefault);
    assert_eq!(tokens(&mut st, &mut short, &mut broken), vec![3, 0]);
    assert_eq!(st.fallbacks, 2);
}

#[test]
fn top_k_orders_negative_zero_and_nan_like_a_float_sort() {
    let row = vec![
        -1.5,
        0.0,
        f32::NAN,
        -0.0,
        2.5,
        -7.0,
        2.5,
        f32::NEG_INFINITY,
        1e-30,
        -1e-30,
    ];
    let mut st = SamplingStage::new(10);
    st.reset_batch(10);
    st.top_k(&row, 10);
    let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut want: Vec<(f32, u32)> = row
        .iter()
        .enumerate()
        .map(|(t, &x)| (clean(x), t as u32))
        .collect();
    want.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    assert_eq!(
        st.batch.cand_tokens,
        want.iter().map(|c| c.1).collect::<Vec<_>>()
    );
    assert_eq!(st.batch.cand_tokens[..2], [4, 6]);
    assert!(st.batch.cand_logits.iter().all(|x| !x.is_nan()));
    // With k smaller than the row the same prefix comes out.
    st.reset_batch(3);
    st.top_k(&row, 3);
    assert_eq!(
        st.batch.cand_tokens,
        want[..3].iter().map(|c| c.1).collect::<Vec<_>>()
    );
}

// ---- the backend's sampling tail + `sample_candidates` against `sample` over full rows ----

mod tail {
    use proptest::prelude::*;

    use super::*;
    use crate::backend::cpu::sample::sample_tail;
    use crate::backend::sample::{SampleOut, SampleRows};

    /// A sampler that records every batch it sees and answers by `mode`: 0 a valid non-greedy
    /// pick per row, 1 an invalid token, 2 `UseDefault`.
    struct Recording {
        mode: u8,
        seen: Vec<SamplerBatch>,
    }

    impl Sampler for Recording {
        fn sample(&mut self, b: &SamplerBatch) -> Decision<Vec<u32>> {
            self.seen.push(b.clone());
            let k = b.k as usize;
            match self.mode {
                0 => Decision::Use(
                    (0..b.len())
                        .map(|i| b.cand_tokens[i * k + (b.seed[i] as usize + i) % k])
                        .collect(),
                ),
                1 => Decision::Use(vec![u32::MAX; b.len()]),
                _ => Decision::UseDefault,
            }
        }
    }

    #[derive(Debug, Clone)]
    struct Row {
        logits: Vec<f32>,
        params: SamplingParams,
        prompt: Vec<u32>,
        output: Vec<u32>,
        seed: u64,
    }

    fn logit() -> impl Strategy<Value = f32> {
        prop_oneof![
            12 => (-6i8..6).prop_map(|v| f32::from(v) * 0.5),
            6 => -10.0f32..10.0,
            1 => proptest::sample::select(vec![
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                -0.0,
            ]),
        ]
    }

    fn params() -> impl Strategy<Value = SamplingParams> {
        use proptest::sample::select;
        (
            select(vec![1.0f32, 1.0, 0.0, -1.0, 0.5, 1.3, 2.0]),
            select(vec![0.0f32, 0.0, -0.0, 0.5, -0.3]),
            select(vec![0.0f32, 0.0, 0.25, -0.1]),
            proptest::option::of(0u32..60),
            (select(vec![0.0f32, 0.7, 1.0]), 0u32..5),
            (select(vec![1.0f32, 0.9]), select(vec![0.0f32, 0.05])),
        )
            .prop_map(
                |(rep, pres, freq, logprobs, (temperature, top_k), (top_p, min_p))| {
                    SamplingParams {
                        temperature,
                        top_p,
                        top_k,
                        min_p,
                        seed: None,
                        presence_penalty: pres,
                        frequency_penalty: freq,
                        repetition_penalty: rep,
                        logprobs,
                        min_tokens: 0,
                        // A logit bias on some rows (token 2 may lie outside the vocabulary:
                        // ignored by both paths).
                        logit_bias: if freq > 0.0 {
                            vec![(0, pres * 10.0), (2, -freq)]
                        } else {
                            Vec::new()
                        },
                    }
                },
            )
    }

    fn row(vocab: usize) -> impl Strategy<Value = Row> {
        let token = 0..vocab as u32 + 3; // a few ids outside the vocabulary
        (
            proptest::collection::vec(logit(), vocab),
            params(),
            proptest::collection::vec(token.clone(), 0..24),
            proptest::collection::vec(token, 0..12),
            any::<u64>(),
        )
            .prop_map(|(logits, params, prompt, output, seed)| Row {
                logits,
                params,
                prompt,
                output,
                seed,
            })
    }

    /// `(vocab, stage K, rows)`; K runs past the vocabulary.
    fn case() -> impl Strategy<Value = (usize, usize, Vec<Row>)> {
        (1usize..40, 1usize..48).prop_flat_map(|(vocab, k)| {
            (
                Just(vocab),
                Just(k),
                proptest::collection::vec(row(vocab), 1..5),
            )
        })
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Every column the sampler policy sees, one by one.
    fn assert_same_batch(a: &SamplerBatch, b: &SamplerBatch) {
        assert_eq!(a.k, b.k, "k");
        assert_eq!(bits(&a.temperature), bits(&b.temperature), "temperature");
        assert_eq!(a.top_k, b.top_k, "top_k");
        assert_eq!(bits(&a.top_p), bits(&b.top_p), "top_p");
        assert_eq!(bits(&a.min_p), bits(&b.min_p), "min_p");
        assert_eq!(a.seed, b.seed, "seed");
        assert_eq!(a.counter, b.counter, "counter");
        assert_eq!(a.cand_tokens, b.cand_tokens, "cand_tokens");
        assert_eq!(bits(&a.cand_logits), bits(&b.cand_logits), "cand_logits");
    }

    fn assert_same_sampled(a: &[Sampled], b: &[Sampled]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.token, y.token);
            match (&x.logprob, &y.logprob) {
                (None, None) => {}
                (Some(p), Some(q)) => {
                    assert_eq!(p.token, q.token);
                    assert_eq!(p.logprob.to_bits(), q.logprob.to_bits(), "{p:?} vs {q:?}");
                    assert_eq!(p.top.len(), q.top.len());
                    for (s, t) in p.top.iter().zip(&q.top) {
                        assert_eq!((s.0, s.1.to_bits()), (t.0, t.1.to_bits()), "{p:?} vs {q:?}");
                    }
                }
                _ => panic!("logprobs on one path only: {x:?} vs {y:?}"),
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn tail_and_candidates_equal_full_rows(
            (vocab, k, rows) in case(),
            mode in 0u8..3,
            fallback_mode in proptest::sample::select(vec![0u8, 2]),
        ) {
            let infos: Vec<RowInfo<'_>> = rows
                .iter()
                .map(|r| RowInfo {
                    params: &r.params,
                    prompt: &r.prompt,
                    output: &r.output,
                    drafts: &[],
                    seed: r.seed,
                    banned: &[],
                })
                .collect();
            let data: Vec<f32> = rows.iter().flat_map(|r| r.logits.clone()).collect();
            let sampler = || Recording { mode, seen: Vec::new() };
            let fallback = || Recording { mode: fallback_mode, seen: Vec::new() };

            // Today: full rows on the host.
            let mut full = Logits { data: data.clone(), vocab };
            let mut old = SamplingStage::new(k);
            let (mut s_old, mut f_old, mut out_old) = (sampler(), fallback(), Vec::new());
            old.sample(&mut full, &infos, &mut s_old, &mut f_old, &mut out_old);

            // The tail on the backend, candidates on the host.
            let mut new = SamplingStage::new(k);
            let mut sample_rows = SampleRows::default();
            new.sample_rows(&infos, &mut sample_rows);
            let mut tail_logits = data.clone();
            let mut cands = SampleOut::default();
            sample_tail(&mut tail_logits, vocab, &sample_rows, &mut cands).unwrap();
            let (mut s_new, mut f_new, mut out_new) = (sampler(), fallback(), Vec::new());
            new.sample_candidates(&mut cands, infos.iter().copied(), &mut s_new, &mut f_new, &mut out_new)
                .unwrap();

            prop_assert_eq!(bits(&tail_logits), bits(&full.data));
            prop_assert_eq!(s_old.seen.len(), 1);
            prop_assert_eq!(s_new.seen.len(), 1);
            assert_same_batch(&s_old.seen[0], &s_new.seen[0]);
            prop_assert_eq!(f_old.seen.len(), f_new.seen.len());
            for (a, b) in f_old.seen.iter().zip(&f_new.seen) {
                assert_same_batch(a, b);
            }
            prop_assert_eq!(old.fallbacks, new.fallbacks);
            assert_same_sampled(&out_old, &out_new);

            // The next step, as the engine runs it: the same stage, and the columns the
            // previous call handed back (its spare buffers) refilled by the tail. Taking the
            // columns instead of copying them changes nothing the sampler or the caller sees.
            let mut again = data.clone();
            sample_tail(&mut again, vocab, &sample_rows, &mut cands).unwrap();
            let (mut s_again, mut f_again, mut out_again) = (sampler(), fallback(), Vec::new());
            new.sample_candidates(&mut cands, infos.iter().copied(), &mut s_again, &mut f_again, &mut out_again)
                .unwrap();
            assert_same_batch(&s_old.seen[0], &s_again.seen[0]);
            prop_assert_eq!(f_old.seen.len(), f_again.seen.len());
            assert_same_sampled(&out_old, &out_again);
        }
    }

    #[test]
    fn candidates_that_do_not_fit_the_rows_are_an_error() {
        let p = SamplingParams::default();
        let infos = [info(&p, &[], &[]), info(&p, &[], &[])];
        let mut st = SamplingStage::new(2);
        let mut cands = SampleOut {
            k: 2,
            cand_tokens: vec![0, 1],
            cand_logits: vec![1.0, 0.0],
            lse: vec![0.0],
        };
        let mut out = Vec::new();
        let err = st
            .sample_candidates(
                &mut cands,
                infos.iter().copied(),
                &mut DefaultSampler::default(),
                &mut DefaultSampler::default(),
                &mut out,
            )
            .unwrap_err();
        assert_eq!((err.rows, err.k, err.tokens), (2, 2, 2));
        assert!(out.is_empty());
    }
}

/// The blocked NaN scan finds a NaN wherever it is (first, inside a block, in the short last
/// block) and reports none in finite or infinite logits.
#[test]
fn any_nan_finds_a_nan_anywhere() {
    let mut xs = vec![1.0f32; 1300];
    xs[7] = f32::NEG_INFINITY;
    xs[900] = f32::INFINITY;
    assert!(!super::any_nan(&xs));
    assert!(!super::any_nan(&[]));
    for at in [0, 511, 512, 777, 1299] {
        let mut ys = xs.clone();
        ys[at] = f32::NAN;
        assert!(super::any_nan(&ys), "NaN at {at}");
    }
}
