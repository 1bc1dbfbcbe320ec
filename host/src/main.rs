//! The `chimera` command line: `serve`, `generate`, `bench`, `plugin check`, `kernels build`.
//! The GPU suites are a binary of their own, `chimera-gpu-check` (`host/gpu-check`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};

use chimera::app::LoadedModel;
use chimera::backend::cpu::CpuBackend;
use chimera::config::{Config, Overrides};
use chimera::logging::LogFormat;
use chimera::model;

#[derive(Parser)]
#[command(
    name = "chimera",
    version,
    about = "Serving platform for hybrid Transformer/SSM language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log line format on stderr: `text` (colours only on a terminal) or `json` (one object
    /// per line). The level comes from RUST_LOG (default `info`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Command {
    /// Serve an OpenAI-compatible HTTP API (the embedded model; on a GPU where there is one).
    Serve(Box<ServeArgs>),
    /// Continue a prompt (greedy) and print the continuation.
    Generate(GenerateArgs),
    /// Drive an OpenAI-compatible server with a workload and report latencies.
    Bench(Box<chimera::bench::BenchArgs>),
    /// Work with policy plugins.
    #[command(subcommand)]
    Plugin(PluginCommand),
    /// The CUDA kernels: `chimera kernels build` compiles them for this machine's GPU (or
    /// `--arch`) into the on-disk cache.
    #[command(subcommand)]
    Kernels(KernelsCommand),
    /// Moved: the GPU suites are the `chimera-gpu-check` binary (crate `host/gpu-check`).
    /// Hidden; it takes any arguments and fails with that sentence.
    #[command(hide = true, disable_help_flag = true)]
    GpuCheck {
        /// The arguments, echoed in the error as a `chimera-gpu-check` command line.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        args: Vec<String>,
    },
}

#[derive(Subcommand)]
enum KernelsCommand {
    /// Compile every kernel into the cache ($CHIMERA_KERNEL_CACHE or ~/.cache/chimera/kernels).
    Build {
        /// Target architecture (e.g. sm_90a); default: the GPU's, through the driver.
        #[arg(long)]
        arch: Option<String>,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// A TOML configuration file (default: the built-in configs/default.toml).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Overrides `model.path`: `builtin:tiny-hybrid`, a Hugging Face model folder, a `.gguf`
    /// file, or a hub model id `org/name` (downloaded into the Hugging Face cache;
    /// `org/name:Q4_K_M` picks one file of a repo of GGUF files).
    #[arg(long)]
    model: Option<String>,
    /// Overrides `model.revision`: the hub branch, tag or commit of a hub model id.
    #[arg(long)]
    revision: Option<String>,
    /// Overrides `server.served_model_name`: the model ids the API accepts (the first is the
    /// one responses carry). Default: the `--model` value, then the model's short name.
    #[arg(long, num_args = 1..)]
    served_model_name: Option<Vec<String>>,
    /// Overrides `server.api_key`: every `/v1/*` request must send
    /// `Authorization: Bearer <key>`.
    #[arg(long)]
    api_key: Option<String>,
    /// Overrides `server.tool_call_parser`: the tool-call format of the model's responses
    /// (`hermes`, `qwen3_coder`, `llama3_json`, `granite`).
    #[arg(long)]
    tool_call_parser: Option<String>,
    /// Overrides `server.reasoning_parser`: the reasoning format (`qwen3`, `deepseek_r1`).
    #[arg(long)]
    reasoning_parser: Option<String>,
    /// Overrides `server.host`: the address to listen on.
    #[arg(long)]
    host: Option<String>,
    /// Overrides `server.port`.
    #[arg(long)]
    port: Option<u16>,
    /// Overrides `engine.replicas`.
    #[arg(long)]
    replicas: Option<usize>,
    /// Overrides `engine.backend`: cpu, cuda or auto.
    #[arg(long)]
    backend: Option<String>,
    /// Overrides `engine.devices` (comma-separated CUDA device ordinals).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// Overrides `model.dtype`: auto, bfloat16 or float32.
    #[arg(long)]
    dtype: Option<String>,
    /// Overrides `model.load_format`: auto or dummy (seeded random weights).
    #[arg(long)]
    load_format: Option<String>,
    /// Overrides `model.quantization`: none, or fp8 (quantize a bf16 checkpoint's projections
    /// to FP8 e4m3 at load, one scale per output row).
    #[arg(long)]
    quantization: Option<String>,
    /// Overrides `model.max_model_len`: the longest context (prompt + output tokens) a
    /// request may have. Default: the model's `max_position_embeddings`.
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Overrides `cache.gpu_memory_utilization`: the share of each GPU's memory this process
    /// may hold (weights, cache and activations), in (0, 1]; the cache gets what the weights
    /// leave of it (`cache.memory_budget = "auto"`, the default).
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// Overrides `speculative.method`: off, ngram (drafts looked up in the context) or
    /// draft_model (drafts from `--draft-model`).
    #[arg(long)]
    speculative_method: Option<String>,
    /// Overrides `speculative.draft_model`: a smaller model with the same tokenizer (a folder,
    /// a .gguf file or a hub id).
    #[arg(long)]
    draft_model: Option<String>,
    /// Overrides `speculative.num_tokens`: drafts verified per step.
    #[arg(long)]
    num_speculative_tokens: Option<usize>,
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A Hugging Face model folder, a `.gguf` file or a hub model id `org/name` (or
    /// `org/name:Q4_K_M`, one file of a GGUF repo); the embedded tiny hybrid model when omitted.
    #[arg(long)]
    model: Option<String>,
    /// The hub revision (branch, tag or commit) of a hub model id.
    #[arg(long, default_value = "main")]
    revision: String,
    /// The text to continue.
    #[arg(long)]
    prompt: String,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Print timing to stderr.
    #[arg(long)]
    verbose: bool,
    /// Keep generating through end-of-sequence tokens (always `--max-tokens` tokens).
    #[arg(long)]
    ignore_eos: bool,
    /// Measure prefill and decode separately and print one `timing: {json}` line to stderr:
    /// per repetition, the time to the first token (the prompt alone) and the time of the
    /// whole generation; decode per token is their difference over the tokens after the
    /// first. Also the bytes of weights the CPU backend holds and the process's RSS.
    #[arg(long)]
    timing: bool,
    /// Repetitions of the `--timing` measurement (after one warm-up generation).
    #[arg(long, default_value_t = 3)]
    timing_reps: usize,
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Dry-run a plugin: load it as the server would, call `init` with a config and each entry
    /// point on a synthetic input; report its kind, ABI version, imports, answers, timing and
    /// errors. Exits non-zero when the plugin is not usable with that config.
    Check {
        /// The plugin: a `.wasm` core module built with chimera-plugin-sdk, or a component.
        file: PathBuf,
        /// The plugin's `config` table, as in `[policy.<kind>] config = …`: a TOML file of
        /// `key = value` lines, or inline TOML (`'{ alpha = 0.5 }'` or `'alpha = 0.5'`).
        /// Default: an empty config.
        #[arg(long)]
        config: Option<String>,
    },
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    chimera::logging::init(cli.log_format)?;
    match cli.command {
        Command::Serve(args) => serve(*args),
        Command::Generate(args) => generate(args),
        Command::Bench(args) => {
            runtime()?.block_on(async { chimera::bench::run(*args).await.map(drop) })
        }
        Command::Kernels(KernelsCommand::Build { arch }) => kernels_build(arch),
        Command::GpuCheck { args } => Err(gpu_check_moved(&args)),
        Command::Plugin(PluginCommand::Check { file, config }) => plugin_check(&file, config),
    }
}

/// `chimera gpu-check …`: the suites are a binary of their own now (the host library cannot
/// depend on the crate built on it).
fn gpu_check_moved(args: &[String]) -> anyhow::Error {
    let mut line = String::from("chimera-gpu-check");
    for a in args {
        line.push(' ');
        line.push_str(a);
    }
    anyhow::anyhow!(
        "`chimera gpu-check` moved: the GPU suites are the `chimera-gpu-check` binary \
         (cargo run --release -p chimera-gpu-check, or tests/gpu/run.sh); run `{line}`"
    )
}

fn kernels_build(arch: Option<String>) -> anyhow::Result<()> {
    let arch = match arch {
        Some(a) => a,
        None => {
            let backend =
                chimera::backend::cuda::CudaBackend::new(chimera::backend::cuda::CudaOptions {
                    device: 0,
                    dtype: chimera::backend::DType::BF16,
                })?;
            // Opening the device already compiled everything into the cache.
            println!(
                "kernels ready for {} ({})",
                backend.device().name,
                backend.device().arch
            );
            return Ok(());
        }
    };
    let cache = chimera_kernels::KernelCache::from_env();
    let started = Instant::now();
    let compiled = chimera_kernels::compile_all(Some(&cache), &arch)?;
    let fresh = compiled.iter().filter(|c| !c.from_cache).count();
    println!(
        "{} kernel sources for {arch} in {} ({fresh} compiled, {} from the cache) in {:.1?}",
        compiled.len(),
        cache.dir.display(),
        compiled.len() - fresh,
        started.elapsed()
    );
    Ok(())
}

/// `chimera plugin check FILE [--config TOML]`.
fn plugin_check(file: &std::path::Path, config: Option<String>) -> anyhow::Result<()> {
    let config = match config {
        None => chimera_policy_core::Config::default(),
        Some(arg) => {
            let as_file = std::path::Path::new(&arg);
            let (text, origin) = if !arg.trim_start().starts_with('{') && as_file.is_file() {
                let text = std::fs::read_to_string(as_file)
                    .with_context(|| format!("reading --config {arg}"))?;
                (text, format!("--config {arg}"))
            } else {
                (arg, "--config".to_string())
            };
            chimera::plugins::parse_plugin_config(&text, &origin)?
        }
    };
    let report = chimera::plugins::check_plugin(file, &config)
        .with_context(|| format!("checking {}", file.display()))?;
    println!("{report}");
    anyhow::ensure!(
        report.ok(),
        "{} loads but is not usable as configured above",
        file.display()
    );
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let config = Config::load(args.config.as_deref())?.with_overrides(Overrides {
        model: args.model,
        revision: args.revision,
        served_model_name: args.served_model_name,
        api_key: args.api_key,
        tool_call_parser: args.tool_call_parser,
        reasoning_parser: args.reasoning_parser,
        host: args.host,
        port: args.port,
        replicas: args.replicas,
        backend: args.backend,
        devices: args.devices,
        dtype: args.dtype,
        load_format: args.load_format,
        quantization: args.quantization,
        max_model_len: args.max_model_len,
        gpu_memory_utilization: args.gpu_memory_utilization,
        speculative_method: args.speculative_method,
        num_speculative_tokens: args.num_speculative_tokens,
        draft_model: args.draft_model,
    })?;
    runtime()?.block_on(chimera::app::serve(config))
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let path = args
        .model
        .unwrap_or_else(|| chimera::model::builtin::NAME.to_string());
    let loaded = LoadedModel::open(&path, &args.revision)?;
    let backend = CpuBackend::default();
    let model = loaded.model(&backend, false)?;
    let codec = &loaded.codec;
    let load_time = started.elapsed();
    let prompt = codec.encode(&args.prompt, true)?;
    let mut stop = model.info.eos_token_ids.clone();
    stop.extend(codec.eos_token_ids());
    if args.ignore_eos {
        stop.clear();
    }
    if args.timing {
        let mut prefill_s = Vec::new();
        let mut decode_s = Vec::new();
        let mut generated = 0;
        model::greedy_generate(&model, &backend, &prompt, args.max_tokens, &stop, 512)?;
        for _ in 0..args.timing_reps {
            let t = Instant::now();
            model::greedy_generate(&model, &backend, &prompt, 1, &stop, 512)?;
            let first = t.elapsed().as_secs_f64();
            let t = Instant::now();
            let out =
                model::greedy_generate(&model, &backend, &prompt, args.max_tokens, &stop, 512)?;
            let all = t.elapsed().as_secs_f64();
            generated = out.len();
            prefill_s.push(first);
            decode_s.push((all - first) / (out.len().saturating_sub(1).max(1)) as f64);
        }
        let (rss, hwm) = chimera::model::weights::process_memory().unwrap_or_default();
        eprintln!(
            "timing: {}",
            serde_json::json!({
                "load_s": load_time.as_secs_f64(),
                "prefill_tokens": prompt.len(),
                "generated": generated,
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "weight_bytes": backend.weight_bytes(),
                "rss": rss,
                "hwm": hwm,
            })
        );
    }
    let t0 = Instant::now();
    let out = model::greedy_generate(&model, &backend, &prompt, args.max_tokens, &stop, 512)?;
    let took = t0.elapsed();
    println!("{}", codec.decode(&out, true)?);
    if args.verbose {
        eprintln!(
            "{}: loaded in {:.1?}; {} prompt + {} generated tokens in {:.1?} ({:.1} tok/s)",
            model.info.architecture,
            load_time,
            prompt.len(),
            out.len(),
            took,
            out.len() as f64 / took.as_secs_f64()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// `chimera <path> --help` for every (sub)command and argument without help text.
    fn undocumented(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
        let here = format!("{path} {}", cmd.get_name()).trim().to_string();
        if cmd.get_about().is_none() && !path.is_empty() {
            out.push(format!("{here} (the subcommand)"));
        }
        for arg in cmd.get_arguments() {
            // clap's own --help and --version carry their text.
            if arg.is_hide_set() || matches!(arg.get_id().as_str(), "help" | "version") {
                continue;
            }
            if arg.get_help().is_none() && arg.get_long_help().is_none() {
                out.push(format!("{here}: {}", arg.get_id()));
            }
        }
        for sub in cmd.get_subcommands() {
            if sub.get_name() == "help" {
                continue;
            }
            undocumented(sub, &here, out);
        }
    }

    #[test]
    fn every_flag_of_every_subcommand_has_help_text() {
        let cli = Cli::command();
        cli.clone().debug_assert();
        let mut missing = Vec::new();
        undocumented(&cli, "", &mut missing);
        assert!(
            missing.is_empty(),
            "arguments without help text:\n{}",
            missing.join("\n")
        );
        // The walk reaches the nested subcommands and the library-defined argument structs.
        let names: Vec<&str> = cli.get_subcommands().map(|c| c.get_name()).collect();
        for sub in ["serve", "bench", "plugin", "kernels"] {
            assert!(names.contains(&sub), "{names:?}");
        }
        let visible: Vec<&str> = cli
            .get_subcommands()
            .filter(|c| !c.is_hide_set())
            .map(|c| c.get_name())
            .collect();
        assert!(!visible.contains(&"gpu-check"), "{visible:?}");
        let check = cli
            .find_subcommand("plugin")
            .and_then(|p| p.find_subcommand("check"))
            .expect("plugin check");
        assert!(check.get_arguments().any(|a| a.get_id() == "config"));
    }

    /// `chimera gpu-check` with the arguments the GPU scripts gave it fails and names the
    /// binary the suites moved to, with the same arguments.
    #[test]
    fn gpu_check_says_where_the_suites_moved() {
        let cases: [&[&str]; 3] = [
            &["chimera", "gpu-check"],
            &[
                "chimera",
                "gpu-check",
                "--suite",
                "kernels",
                "--json",
                "k.json",
            ],
            &["chimera", "gpu-check", "--help"],
        ];
        for argv in cases {
            let cli = Cli::try_parse_from(argv).expect("parses");
            let Command::GpuCheck { args } = cli.command else {
                panic!("{argv:?} is not gpu-check");
            };
            assert_eq!(args, argv[2..]);
            let msg = gpu_check_moved(&args).to_string();
            assert!(msg.contains("`chimera-gpu-check` binary"), "{msg}");
            let line = ["chimera-gpu-check"]
                .iter()
                .chain(&argv[2..])
                .copied()
                .collect::<Vec<_>>()
                .join(" ");
            assert!(msg.ends_with(&format!("run `{line}`")), "{msg}");
        }
    }
}
