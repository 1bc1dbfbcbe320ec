use super::*;

const OFF: Penalties = Penalties {
    repetition: 1.0,
    presence: 0.0,
    frequency: 0.0,
};

fn pen(repetition: f32, presence: f32, frequency: f32) -> Penalties {
    Penalties {
        repetition,
        presence,
        frequency,
    }
}

fn one_row(p: Penalties, want_lse: bool, prompt: &[u32], output: &[u32], k: usize) -> SampleRows {
    let mut rows = SampleRows::default();
    rows.clear(k);
    rows.push_row(p, want_lse, prompt, output);
    rows
}

#[test]
fn push_row_stores_distinct_tokens_with_output_counts() {
    let (prompt, output) = ([5, 1, 5, 9, 3], [9, 3, 9, 9, 7]);
    let mut rows = SampleRows::default();
    rows.clear(4);
    rows.push_row(pen(1.3, 0.5, 0.0), true, &prompt, &output);
    rows.push_row(pen(1.0, 0.0, 0.1), false, &prompt, &output);
    rows.push_row(OFF, true, &prompt, &output);
    rows.push_row(pen(0.0, 0.0, 0.0), true, &prompt, &output);
    rows.push_row(pen(2.0, 0.0, 0.0), false, &[], &[]);
    assert_eq!(rows.len(), 5);
    assert_eq!(rows.want_lse, [true, false, true, true, false]);
    // Output tokens with their counts, then prompt-only tokens with count 0.
    assert_eq!(
        rows.history(0),
        (&[3, 7, 9, 1, 5][..], &[1, 1, 3, 0, 0][..])
    );
    // Without the repetition penalty the prompt is not needed.
    assert_eq!(rows.history(1), (&[3, 7, 9][..], &[1, 1, 3][..]));
    // No active penalty (a repetition penalty ≤ 0 is off), or no history: nothing.
    assert_eq!(rows.history(2), (&[][..], &[][..]));
    assert_eq!(rows.history(3), (&[][..], &[][..]));
    assert_eq!(rows.history(4), (&[][..], &[][..]));
    assert_eq!(rows.hist_offsets, [0, 5, 8, 8, 8, 8]);
    // Clearing keeps nothing of the previous step.
    rows.clear(2);
    assert_eq!(rows.hist_offsets, [0]);
    assert!(rows.is_empty() && rows.hist_tokens.is_empty() && rows.hist_counts.is_empty());
}

#[test]
fn penalties_use_the_history() {
    // Token 0 in the prompt, token 1 in the prompt, token 2 generated twice; token 9 is
    // outside the vocabulary and ignored.
    let rows = one_row(pen(2.0, 0.5, 0.25), false, &[0, 1, 9], &[2, 2, 9], 4);
    let mut logits = vec![4.0, -4.0, 4.0, 4.0];
    let mut out = SampleOut::default();
    sample_tail(&mut logits, 4, &rows, &mut out).unwrap();
    assert_eq!(logits, [2.0, -8.0, 2.0 - 0.5 - 0.5, 4.0]);
    assert_eq!(out.cand_tokens, [3, 0, 2, 1]);
    assert_eq!(out.cand_logits, [4.0, 2.0, 1.0, -8.0]);
    assert_eq!(out.lse, [0.0]);
}

#[test]
fn biases_follow_the_penalties_and_bans_mask_tokens_out() {
    // Penalties on: token 2 was generated twice, token 0 is in the prompt. Bias token 2 (in
    // the history: penalised, then biased), token 3 (not in it: bias only, no penalty) and
    // ban token 0.
    let mut rows = one_row(pen(2.0, 0.5, 0.25), true, &[0], &[2, 2], 4);
    rows.bias_last_row(&[(2, 1.5), (3, -0.75)], &[0]);
    assert_eq!(rows.history(0).0, &[0, 2, 3]);
    assert_eq!(
        rows.history(0).1,
        &[0, 2, crate::backend::sample::BIAS_ONLY]
    );
    assert_eq!(rows.bias(0), &[f32::NEG_INFINITY, 1.5, -0.75]);
    let mut logits = vec![4.0, 1.0, 4.0, 4.0];
    let mut out = SampleOut::default();
    sample_tail(&mut logits, 4, &rows, &mut out).unwrap();
    assert_eq!(
        logits,
        [f32::NEG_INFINITY, 1.0, 2.0 - 0.5 - 0.5 + 1.5, 3.25]
    );
    assert_eq!(out.cand_tokens, [3, 2, 1, 0]);

    // Penalties off: only the biased entries exist.
    let mut rows = one_row(OFF, false, &[0, 1], &[1], 2);
    assert!(rows.history(0).0.is_empty());
    rows.bias_last_row(&[(1, 100.0)], &[]);
    let mut logits = vec![5.0, -5.0, 0.0];
    sample_tail(&mut logits, 3, &rows, &mut out).unwrap();
    assert_eq!(out.cand_tokens, [1, 0]);
    assert_eq!(out.cand_logits, [95.0, 5.0]);
}

#[test]
fn candidates_sort_like_a_float_sort_with_ties_to_the_lower_id() {
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
        0.0,
    ];
    let clean = |x: f32| if x.is_nan() { f32::NEG_INFINITY } else { x };
    let mut want: Vec<(f32, u32)> = row
        .iter()
        .enumerate()
        .map(|(t, &x)| (clean(x), t as u32))
        .collect();
    want.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for k in [1, 3, 11, 64] {
        let mut logits = row.clone();
        let mut out = SampleOut::default();
        sample_tail(
            &mut logits,
            row.len(),
            &one_row(OFF, false, &[], &[], k),
            &mut out,
        )
        .unwrap();
        let n = k.min(row.len());
        assert_eq!(out.k, n);
        let tokens: Vec<u32> = want[..n].iter().map(|c| c.1).collect();
        assert_eq!(out.cand_tokens, tokens);
        // Candidate logits are the row's values as they are (NaN included).
        for (&t, &x) in out.cand_tokens.iter().zip(&out.cand_logits) {
            assert_eq!(x.to_bits(), row[t as usize].to_bits());
        }
    }
}

#[test]
fn every_output_is_written_and_lse_only_where_wanted() {
    let (vocab, n) = (37, 4);
    let mut seed = 99u64;
    let logits: Vec<f32> = (0..vocab * n)
        .map(|_| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 40) % 9) as f32 - 4.0
        })
        .collect();
    let mut rows = SampleRows::default();
    rows.clear(5);
    for i in 0..n {
        rows.push_row(pen(1.2, 0.3, 0.1), i % 2 == 0, &[1, 2, 3], &[3, 4]);
    }
    let mut out = SampleOut::default();
    out.reshape(n, 5);
    out.cand_tokens.fill(u32::MAX);
    out.cand_logits.fill(f32::NAN);
    out.lse.fill(f32::NAN);
    let mut penalised = logits.clone();
    sample_tail(&mut penalised, vocab, &rows, &mut out).unwrap();
    assert!(out.cand_tokens.iter().all(|&t| (t as usize) < vocab));
    assert!(out.cand_logits.iter().all(|x| x.is_finite()));
    for (i, row) in penalised.chunks(vocab).enumerate() {
        let want = if i % 2 == 0 { log_sum_exp(row) } else { 0.0 };
        assert_eq!(out.lse[i].to_bits(), want.to_bits());
        assert_eq!(
            out.cand_logits[i * 5],
            row.iter().copied().fold(f32::MIN, f32::max)
        );
    }
    assert_ne!(penalised, logits);
}

#[test]
fn malformed_inputs_are_errors() {
    let rows = one_row(pen(2.0, 0.0, 0.0), true, &[1], &[], 2);
    let mut out = SampleOut::default();
    assert!(sample_tail(&mut [0.0; 5], 4, &rows, &mut out).is_err());
    assert!(sample_tail(&mut [], 0, &rows, &mut out).is_err());
    let mut bad = rows.clone();
    bad.want_lse.push(true);
    assert!(sample_tail(&mut [0.0; 4], 4, &bad, &mut out).is_err());
    let mut bad = rows.clone();
    bad.hist_offsets[1] = 2;
    assert!(sample_tail(&mut [0.0; 4], 4, &bad, &mut out).is_err());
    let mut bad = rows;
    bad.hist_counts.clear();
    assert!(sample_tail(&mut [0.0; 4], 4, &bad, &mut out).is_err());
}
