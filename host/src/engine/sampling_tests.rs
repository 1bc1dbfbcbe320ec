use super::*;

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
        seed: 1,
    }
}

/// A sampler that answers with a fixed list.
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
    let mut out = Vec::new();
    st.sample(
        &mut l,
        &[info(&p, &[], &[])],
        &mut GreedySampler,
        &mut GreedySampler,
        &mut out,
    );
    assert_eq!(st.batch.k, 3);
    assert_eq!(st.batch.cand_tokens, vec![1, 0, 2]);
    assert_eq!(out[0].token, 1);
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
    let mut out = Vec::new();
    st.sample(
        &mut l,
        &[info(&p, &[1], &[])],
        &mut GreedySampler,
        &mut GreedySampler,
        &mut out,
    );
    assert_eq!(out[0].token, 2);
}

#[test]
fn logprobs_are_a_log_softmax_over_the_full_row() {
    let p = SamplingParams {
        logprobs: Some(3),
        ..Default::default()
    };
    let row = vec![1.0f32, 2.0, 0.5, -1.0, 3.0];
    let mut l = logits(&[row.clone()]);
    let mut st = SamplingStage::new(2);
    let mut out = Vec::new();
    st.sample(
        &mut l,
        &[info(&p, &[], &[])],
        &mut GreedySampler,
        &mut GreedySampler,
        &mut out,
    );
    let lp = out[0].logprob.clone().unwrap();
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
    let mut out = Vec::new();
    // Token 0 is not among row 0's two candidates (3, 2).
    let mut bad = Fixed(Decision::Use(vec![0, 0]));
    st.sample(
        &mut logits(&rows),
        &infos,
        &mut bad,
        &mut GreedySampler,
        &mut out,
    );
    assert_eq!(out.iter().map(|s| s.token).collect::<Vec<_>>(), vec![3, 0]);
    assert_eq!(st.fallbacks, 1);
    // A valid non-greedy answer is kept.
    let mut ok = Fixed(Decision::Use(vec![2, 1]));
    st.sample(
        &mut logits(&rows),
        &infos,
        &mut ok,
        &mut GreedySampler,
        &mut out,
    );
    assert_eq!(out.iter().map(|s| s.token).collect::<Vec<_>>(), vec![2, 1]);
    // Wrong length and UseDefault fall back; a broken fallback ends at the best candidate.
    let mut short = Fixed(Decision::Use(vec![3]));
    let mut broken = Fixed(Decision::UseDefault);
    st.sample(
        &mut logits(&rows),
        &infos,
        &mut short,
        &mut broken,
        &mut out,
    );
    assert_eq!(out.iter().map(|s| s.token).collect::<Vec<_>>(), vec![3, 0]);
    assert_eq!(st.fallbacks, 2);
}
