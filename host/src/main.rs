//! The `chimera` command line: `serve`, `generate`, `bench`, `plugin check`, `kernels build`.
//! The GPU suites are a binary of their own, `chimera-gpu-check` (`host/gpu-check`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};

use chimera::app::LoadedModel;
use chimera::backend::cpu::CpuBackend;
use chimera::cli::EngineArgs;
use chimera::config::Config;
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
    #[command(flatten)]
    engine: EngineArgs,
    /// Overrides `server.api_key`: every `/v1/*` request must send
    /// `Authorization: Bearer <key>`.
    #[arg(long)]
    api_key: Option<String>,
    /// Overrides `server.host`: the address to listen on.
    #[arg(long)]
    host: Option<String>,
    /// Overrides `server.port`.
    #[arg(long)]
    port: Option<u16>,
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
    let mut overrides = args.engine.overrides();
    overrides.api_key = args.api_key;
    overrides.host = args.host;
    overrides.port = args.port;
    let config = Config::load(args.engine.config.as_deref())?.with_overrides(overrides)?;
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
