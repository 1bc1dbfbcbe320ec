//! FP8 checkpoints and online FP8 quantization on the CPU (the oracle): what loads as codes
//! and scales, what a broken or unsupported checkpoint says, and what quantizing a real model
//! costs in perplexity. The logits of the FP8 fixtures against PyTorch are checked with every
//! other fixture (`parity.rs`; the fixtures come from `tests/parity/make_fp8_fixtures.py`).

use std::path::{Path, PathBuf};

use chimera::app::LoadedModel;
use chimera::backend::StepPlan;
use chimera::backend::cpu::CpuBackend;
use chimera::backend::fp8::Fp8Scales;
use chimera::cache::KvCacheDtype;
use chimera::model::weights::WeightStore;
use chimera::model::{self, CacheDtypes, LoadOptions, LogitsMode, Model};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

fn temp_copy(name: &str, tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("chimera-fp8-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

#[test]
fn fp8_checkpoints_load_codes_with_their_scale_layout_and_keep_what_they_list() {
    // Without the checkpoint's block size (16 here) a block grid is read as 128 × 128 blocks,
    // which the [2, 2] scales do not fit: a clear error, not wrong values.
    let store = WeightStore::open(&fixture("llama-gqa-fp8-block")).unwrap();
    let e = store
        .fp8("model.layers.0.self_attn.q_proj.weight")
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("[2, 2] fits no layout") && e.contains("[128, 128]"),
        "{e}"
    );
    // The block size comes from quantization_config.
    let mut store = WeightStore::open(&fixture("llama-gqa-fp8-block")).unwrap();
    let config = model::config::HfConfig::load(&fixture("llama-gqa-fp8-block")).unwrap();
    store.set_quantization(model::quant::Quantization::from_config(&config, false).unwrap());
    let q = store
        .fp8("model.layers.0.self_attn.q_proj.weight")
        .unwrap()
        .expect("q_proj is FP8");
    assert_eq!(q.shape, [32, 32]);
    assert!(
        matches!(&q.scales, Fp8Scales::Blocks { block: [16, 16], scales } if scales.len() == 4)
    );
    let down = store
        .fp8("model.layers.0.mlp.down_proj.weight")
        .unwrap()
        .unwrap();
    match &down.scales {
        Fp8Scales::Blocks { block, scales } => {
            assert_eq!(*block, [16, 16]);
            assert_eq!(scales.len(), 2 * 4, "[32, 64] in 16 × 16 blocks");
        }
        s => panic!("block scales expected, got {s:?}"),
    }
    // modules_to_not_convert: stored in float, loaded as it is.
    assert!(
        store
            .fp8("model.layers.1.mlp.down_proj.weight")
            .unwrap()
            .is_none()
    );
    // compressed-tensors channel scales: one per output row.
    let store = WeightStore::open(&fixture("nemotronh-a-fp8-channel")).unwrap();
    let in_proj = store
        .fp8("backbone.layers.0.mixer.in_proj.weight")
        .unwrap()
        .unwrap();
    assert!(matches!(&in_proj.scales, Fp8Scales::Rows(s) if s.len() == 196));
    // The exact values are what the float reads give (regrouped and stacked weights).
    let values = in_proj.dequantize();
    let (read, shape) = store
        .read_f32("backbone.layers.0.mixer.in_proj.weight")
        .unwrap();
    assert_eq!(shape, [196, 32]);
    assert_eq!(read, values);
}

#[test]
fn broken_or_unsupported_quantized_checkpoints_say_what_is_wrong() {
    use safetensors::tensor::TensorView;
    let dir = temp_copy("llama-gqa-fp8-block", "broken");
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let rewrite = |drop: &str, replace: Option<(&str, Vec<u8>, Vec<usize>)>| {
        let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
        for (name, view) in st.tensors() {
            if name == drop {
                continue;
            }
            views.push((name, view));
        }
        let owned;
        if let Some((name, data, shape)) = &replace {
            owned = data.clone();
            views.push((
                name.to_string(),
                TensorView::new(safetensors::Dtype::F32, shape.clone(), &owned).unwrap(),
            ));
        }
        safetensors::serialize(views, None).unwrap()
    };
    let load_err = |dir: &Path| {
        model::load(dir, &CpuBackend::default())
            .err()
            .expect("the load fails")
            .to_string()
    };
    let scale = "model.layers.0.self_attn.k_proj.weight_scale_inv";
    std::fs::write(&file, rewrite(scale, None)).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("k_proj.weight") && e.contains("no scale"), "{e}");
    std::fs::write(
        &file,
        rewrite(scale, Some((scale, vec![0u8; 3 * 4], vec![3]))),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("fits no layout") && e.contains(scale), "{e}");
    // Another scheme in quantization_config: refused by name.
    std::fs::write(&file, &bytes).unwrap();
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "awq", "bits": 4});
    std::fs::write(&config_path, config.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("`awq`") && e.contains("not supported"), "{e}");
    config["quantization_config"] =
        serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4"});
    std::fs::write(&config_path, config.to_string()).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("modelopt NVFP4"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every-position logits of `tokens` as one sequence, K and V cached as `kv`.
fn all_logits(m: &Model<CpuBackend>, tokens: &[u32], kv: KvCacheDtype) -> Vec<f32> {
    let backend = CpuBackend::default();
    let blocks = tokens.len().div_ceil(16);
    let dtypes = CacheDtypes {
        kv,
        ..Default::default()
    };
    let mut caches = m.new_caches_with(&backend, blocks, 16, 1, dtypes).unwrap();
    let mut plan = StepPlan::new(16);
    plan.slot_ops
        .push(chimera::backend::SlotOp::Zero { slot: 0 });
    plan.push(tokens, 0, &(0..blocks as u32).collect::<Vec<_>>(), 0, true);
    m.forward_host(&backend, &mut plan, &mut caches, LogitsMode::All)
        .unwrap()
}

/// Σ −log p(next token) over the windows, the number of predictions, and each position's
/// argmax.
fn nll(
    m: &Model<CpuBackend>,
    windows: &[&[u32]],
    vocab: usize,
    kv: KvCacheDtype,
) -> (f64, usize, Vec<u32>) {
    let (mut total, mut count, mut argmax) = (0.0f64, 0usize, Vec::new());
    for w in windows {
        let logits = all_logits(m, w, kv);
        for (t, row) in logits.chunks_exact(vocab).enumerate() {
            argmax.push(model::argmax(row));
            let Some(&next) = w.get(t + 1) else { break };
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let lse = row
                .iter()
                .map(|&v| f64::from(v - max).exp())
                .sum::<f64>()
                .ln()
                + f64::from(max);
            total += lse - f64::from(row[next as usize]);
            count += 1;
        }
    }
    (total, count, argmax)
}

/// The fixed English text (`tests/fixtures/text/english.txt`, about 2,800 tokens) as `loaded`
/// tokenizes it.
fn english_tokens(loaded: &LoadedModel) -> Vec<u32> {
    let text = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/text/english.txt"),
    )
    .unwrap();
    loaded.codec.encode(&text, false).unwrap()
}

/// The perplexities of two [`nll`] runs over the same predictions, and the share of positions
/// where their argmax agree.
fn compare_runs(a: &(f64, usize, Vec<u32>), b: &(f64, usize, Vec<u32>)) -> (f64, f64, f64) {
    assert_eq!(a.1, b.1, "the runs made different numbers of predictions");
    let agree = a.2.iter().zip(&b.2).filter(|(x, y)| x == y).count() as f64 / a.2.len() as f64;
    let n = a.1 as f64;
    ((a.0 / n).exp(), (b.0 / n).exp(), agree)
}

/// The accuracy target for online quantization: SmolLM2-135M-Instruct with its
/// projections quantized to FP8 at load (one scale per output row) has a perplexity within 3 %
/// of the unquantized model's (the GGUF's weights dequantized to f32, at least as accurate as
/// bf16) on a fixed English text of about 2,800 tokens (`tests/fixtures/text/english.txt`),
/// and mostly the same greedy choices. The numbers are printed.
#[test]
fn online_fp8_keeps_smollm2_perplexity_within_three_percent() {
    let Some(path) = crate::model_sources::smollm2_gguf_or_skip(
        "online_fp8_keeps_smollm2_perplexity_within_three_percent",
    ) else {
        return;
    };
    let loaded = LoadedModel::open(path.to_str().unwrap(), "main").unwrap();
    let tokens = english_tokens(&loaded);
    assert!(tokens.len() > 2000, "{} tokens", tokens.len());
    let windows: Vec<&[u32]> = tokens.chunks(512).filter(|w| w.len() > 1).collect();
    let backend = CpuBackend::default();
    let plain = loaded.model(&backend, false).unwrap();
    let vocab = plain.info.vocab_size;
    let run_plain = nll(&plain, &windows, vocab, KvCacheDtype::Auto);
    drop(plain);
    let fp8 = loaded.model_with(&backend, false, fp8_options()).unwrap();
    let run_fp8 = nll(&fp8, &windows, vocab, KvCacheDtype::Auto);
    let (ppl_plain, ppl_fp8, agree) = compare_runs(&run_plain, &run_fp8);
    let n = run_plain.1;
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "smollm2 online fp8: {n} predictions over {} tokens in {} windows; perplexity \
             unquantized {ppl_plain:.4}, fp8 {ppl_fp8:.4} (ratio {:.4}); greedy argmax agreement \
             {:.1} %",
            tokens.len(),
            windows.len(),
            ppl_fp8 / ppl_plain,
            agree * 100.0
        );
    }
    assert!(
        ppl_plain.is_finite() && ppl_plain > 1.0 && ppl_plain < 200.0,
        "{ppl_plain}"
    );
    assert!(ppl_fp8 / ppl_plain <= 1.03, "fp8 {ppl_fp8} vs {ppl_plain}");
    assert!(
        ppl_fp8 != ppl_plain,
        "the quantized model computed the same values"
    );
    assert!(agree >= 0.8, "greedy agreement {agree}");
}

/// A checkpoint's FP8 KV-cache scales (`self_attn.k_scale` / `v_scale`, as vLLM reads them)
/// reach each attention layer's cache; a checkpoint with one of the pair, or a scale that is
/// not one positive number, is refused naming the tensor; and the scales change what an FP8
/// cache stores.
#[test]
fn checkpoint_kv_scales_reach_the_fp8_cache() {
    fn write_scales(dir: &Path, tensors: &[(String, Vec<f32>)]) {
        let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
            .iter()
            .map(|(n, v)| {
                let shape = if v.len() == 1 { vec![] } else { vec![v.len()] };
                (
                    n.clone(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                    shape,
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .map(|(n, b, s)| {
                let view =
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                        .unwrap();
                (n.clone(), view)
            })
            .collect();
        std::fs::write(
            dir.join("kv_scales.safetensors"),
            safetensors::serialize(views, None).unwrap(),
        )
        .unwrap();
    }
    let name = |layer: usize, which: &str| format!("model.layers.{layer}.self_attn.{which}_scale");
    let backend = CpuBackend::default();
    let dir = temp_copy("llama-gqa", "kv-scales");
    write_scales(
        &dir,
        &[
            (name(0, "k"), vec![0.5]),
            (name(0, "v"), vec![0.25]),
            (name(1, "k"), vec![2.0]),
            (name(1, "v"), vec![4.0]),
        ],
    );
    let m = model::load(&dir, &backend).unwrap();
    assert_eq!(
        m.kv_scales(),
        [
            chimera::backend::KvScales { k: 0.5, v: 0.25 },
            chimera::backend::KvScales { k: 2.0, v: 4.0 }
        ]
    );
    let fp8 = CacheDtypes {
        kv: KvCacheDtype::Fp8E4M3,
        ..Default::default()
    };
    let caches = m.new_caches_with(&backend, 4, 16, 1, fp8).unwrap();
    assert_eq!(
        caches.kv[1].fp8,
        Some(chimera::backend::KvScales { k: 2.0, v: 4.0 })
    );
    let plain = m.new_caches(&backend, 4, 16, 1).unwrap();
    assert_eq!(
        plain.kv[1].fp8, None,
        "the scales are used only by an FP8 cache"
    );
    // Scales change the rounding grid: the logits move against scale 1.0.
    let tokens: Vec<u32> = (5..45).collect();
    let scaled = all_logits(&m, &tokens, KvCacheDtype::Fp8E4M3);
    let unscaled = all_logits(
        &model::load(&fixture("llama-gqa"), &backend).unwrap(),
        &tokens,
        KvCacheDtype::Fp8E4M3,
    );
    assert_ne!(scaled, unscaled);
    // Half a pair, and a scale that is not one positive number.
    write_scales(&dir, &[(name(0, "k"), vec![0.5])]);
    let e = model::load(&dir, &backend).err().unwrap().to_string();
    assert!(e.contains(&name(0, "v")), "{e}");
    write_scales(
        &dir,
        &[(name(0, "k"), vec![0.5, 0.5]), (name(0, "v"), vec![1.0])],
    );
    let e = model::load(&dir, &backend).err().unwrap().to_string();
    assert!(
        e.contains(&name(0, "k")) && e.contains("one positive finite value"),
        "{e}"
    );
    write_scales(
        &dir,
        &[(name(0, "k"), vec![0.0]), (name(0, "v"), vec![1.0])],
    );
    assert!(model::load(&dir, &backend).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `cache.kv_dtype = "fp8_e4m3"` on the CPU oracle: every attention layer reads back K and V
/// rounded through e4m3 at scale 1.0 (SmolLM2 ships no KV scales). On the same English text
/// as above the perplexity moves by at most 2 % and most greedy choices stay; the numbers are
/// printed. The GPU's FP8 cache is checked against this rounding in the GPU suites.
#[test]
fn fp8_kv_cache_keeps_smollm2_perplexity_within_two_percent() {
    let Some(path) = crate::model_sources::smollm2_gguf_or_skip(
        "fp8_kv_cache_keeps_smollm2_perplexity_within_two_percent",
    ) else {
        return;
    };
    let loaded = LoadedModel::open(path.to_str().unwrap(), "main").unwrap();
    let tokens = english_tokens(&loaded);
    let windows: Vec<&[u32]> = tokens.chunks(512).filter(|w| w.len() > 1).collect();
    let backend = CpuBackend::default();
    let m = loaded.model(&backend, false).unwrap();
    let vocab = m.info.vocab_size;
    assert!(m.kv_scales().iter().all(|s| *s == Default::default()));
    let (ppl_plain, ppl_fp8, agree) = compare_runs(
        &nll(&m, &windows, vocab, KvCacheDtype::Auto),
        &nll(&m, &windows, vocab, KvCacheDtype::Fp8E4M3),
    );
    let n = windows.iter().map(|w| w.len() - 1).sum::<usize>();
    {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "smollm2 fp8 KV cache: {n} predictions; perplexity f32 cache {ppl_plain:.4}, fp8 \
             cache {ppl_fp8:.4} (ratio {:.4}); greedy argmax agreement {:.1} %",
            ppl_fp8 / ppl_plain,
            agree * 100.0
        );
    }
    assert!(ppl_plain.is_finite() && ppl_plain > 1.0, "{ppl_plain}");
    assert!(ppl_fp8 / ppl_plain <= 1.02, "fp8 {ppl_fp8} vs {ppl_plain}");
    assert!(
        ppl_fp8 != ppl_plain,
        "the FP8 cache computed the same values"
    );
    assert!(agree >= 0.9, "greedy agreement {agree}");
}

/// Online FP8 on the Gated DeltaNet hybrids: `q | k | v | z` become FP8 with row scales (the
/// values are the host quantization of the unquantized rows), the per-head gates `b | a` are a
/// separate projection left exactly as stored, and the model's logits move a little.
#[test]
fn online_fp8_quantizes_delta_net_projections_but_not_their_gates() {
    use chimera::backend::Backend;
    use chimera::backend::fp8::quantize_rows;
    use chimera::model::layers::{GatedDeltaNet, Mixer};
    fn first_gdn(m: &Model<CpuBackend>) -> &GatedDeltaNet<CpuBackend> {
        m.layers
            .iter()
            .find_map(|l| match &l.mixer {
                Mixer::GatedDeltaNet(g) => Some(g),
                _ => None,
            })
            .expect("a Gated DeltaNet layer")
    }
    let cpu = CpuBackend::default();
    for name in ["qwen35-a", "qwen3next-a"] {
        let plain = model::load(&fixture(name), &cpu).unwrap();
        let fp8 = model::load_with(&fixture(name), &cpu, fp8_options()).unwrap();
        let (p, q) = (first_gdn(&plain), first_gdn(&fp8));
        assert!(
            p.gates.is_none(),
            "{name}: unquantized keeps one projection"
        );
        let gates = q.gates.as_ref().expect("FP8 splits the gates off");
        let all = cpu.download(&p.in_proj.w).unwrap();
        let hidden = cpu.shape(&p.in_proj.w)[1];
        let main_rows = p.shape.conv_dim() + p.shape.value_dim();
        let (main, rest) = all.split_at(main_rows * hidden);
        assert_eq!(
            cpu.download(&gates.w).unwrap(),
            rest,
            "{name}: gates as stored"
        );
        let got = cpu.download(&q.in_proj.w).unwrap();
        assert_eq!(
            got,
            quantize_rows(main, &[main_rows, hidden]).dequantize(),
            "{name}"
        );
        assert_ne!(got, main, "{name}: quantization changed nothing");
        // The split forward (two projections, then the columns) computes what one projection
        // of the joined rows does: the same model with each layer's two joined again.
        let tokens: Vec<u32> = (0..40).map(|i| 5 + (i * 37) % 500).collect();
        let split = all_logits(&fp8, &tokens, KvCacheDtype::Auto);
        let mut joined = fp8;
        let mut layers = 0;
        for l in &mut joined.layers {
            if let Mixer::GatedDeltaNet(g) = &mut l.mixer {
                let mut rows = cpu.download(&g.in_proj.w).unwrap();
                let gates = g.gates.take().expect("split");
                rows.extend(cpu.download(&gates.w).unwrap());
                let n = rows.len() / hidden;
                g.in_proj.w = cpu
                    .upload(chimera::backend::HostTensor::f32(&rows, &[n, hidden]))
                    .unwrap();
                layers += 1;
            }
        }
        assert!(layers > 0);
        let one = all_logits(&joined, &tokens, KvCacheDtype::Auto);
        let scale = one.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let diff = one
            .iter()
            .zip(&split)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            diff <= 1e-5 * scale,
            "{name}: split vs joined {diff} of {scale}"
        );
        assert_ne!(
            split,
            all_logits(&plain, &tokens, KvCacheDtype::Auto),
            "{name}"
        );
    }
}

/// Online FP8 on the MoE hybrids: the stacked routed experts (gate, up, down) become FP8 with
/// one scale per expert row — their values are the host quantization of the float experts —
/// and the router stays as stored.
#[test]
fn online_fp8_quantizes_routed_experts_per_row_and_keeps_the_router() {
    use chimera::backend::Backend;
    use chimera::backend::fp8::quantize_rows;
    use chimera::model::layers::{Mixer, Moe};
    fn first_moe(m: &Model<CpuBackend>) -> &Moe<CpuBackend> {
        fn find(mixer: &Mixer<CpuBackend>) -> Option<&Moe<CpuBackend>> {
            match mixer {
                Mixer::Moe(m) => Some(m),
                Mixer::Parallel(ms) => ms.iter().find_map(find),
                _ => None,
            }
        }
        m.layers
            .iter()
            .find_map(|l| find(&l.mixer))
            .expect("a MoE layer")
    }
    let cpu = CpuBackend::default();
    for name in ["nemotronh-a", "qwen3next-a", "qwen35moe-a", "granite-moe"] {
        let plain = model::load(&fixture(name), &cpu).unwrap();
        let fp8 = model::load_with(&fixture(name), &cpu, fp8_options()).unwrap();
        let (p, q) = (first_moe(&plain), first_moe(&fp8));
        let pairs = [
            (Some(&p.experts.up), Some(&q.experts.up)),
            (Some(&p.experts.down), Some(&q.experts.down)),
            (p.experts.gate.as_ref(), q.experts.gate.as_ref()),
        ];
        for (a, b) in pairs {
            let (Some(a), Some(b)) = (a, b) else {
                assert!(a.is_none() && b.is_none(), "{name}");
                continue;
            };
            let shape = cpu.shape(a).to_vec();
            let want = quantize_rows(&cpu.download(a).unwrap(), &shape).dequantize();
            let got = cpu.download(b).unwrap();
            assert_eq!(got, want, "{name} {shape:?}");
            assert_ne!(got, cpu.download(a).unwrap(), "{name}: nothing quantized");
        }
        assert_eq!(
            cpu.download(&p.router).unwrap(),
            cpu.download(&q.router).unwrap(),
            "{name}: the router is kept"
        );
    }
}

/// Online FP8 quantization of the projections (`model.quantization = "fp8"`).
fn fp8_options() -> LoadOptions {
    LoadOptions {
        fp8: true,
        ..Default::default()
    }
}
