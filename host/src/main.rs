//! The `chimera` command line.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::{Parser, Subcommand};

use chimera::backend::cpu::CpuBackend;
use chimera::model::{self, builtin};
use chimera::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "chimera",
    version,
    about = "Serving platform for hybrid Transformer/SSM language models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Continue a prompt (greedy) and print the continuation.
    Generate(GenerateArgs),
    /// Work with policy plugins.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Subcommand)]
enum PluginCommand {
    /// Load a plugin as the server would (kind, ABI version, exports, a dry call) and report.
    Check {
        /// The plugin's `.wasm` file (core module or component).
        file: PathBuf,
    },
}

#[derive(clap::Args)]
struct GenerateArgs {
    /// A Hugging Face model folder; the embedded tiny hybrid model when omitted.
    #[arg(long)]
    model: Option<PathBuf>,
    #[arg(long)]
    prompt: String,
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Print timing to stderr.
    #[arg(long)]
    verbose: bool,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Generate(args) => generate(args),
        Command::Plugin {
            command: PluginCommand::Check { file },
        } => {
            let report = chimera::plugins::check_plugin(&file)?;
            println!("{report}");
            anyhow::ensure!(
                report.ok(),
                "{} loads but is not usable as configured above",
                file.display()
            );
            Ok(())
        }
    }
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let backend = CpuBackend;
    let started = Instant::now();
    let (model, tokenizer) = match &args.model {
        Some(dir) if dir.as_os_str() != builtin::NAME => {
            let tokenizer = Tokenizer::from_dir(dir)?;
            let model = model::load(dir, &backend)
                .with_context(|| format!("loading the model in {}", dir.display()))?;
            (model, tokenizer)
        }
        _ => {
            let tokenizer = Tokenizer::embedded()?;
            let eos = tokenizer.eos_ids.first().copied().unwrap_or(0);
            let bos = tokenizer.bos_id.unwrap_or(0);
            (
                builtin::load(&backend, tokenizer.vocab_size(), eos, bos)?,
                tokenizer,
            )
        }
    };
    let loaded = started.elapsed();
    let prompt = tokenizer.encode(&args.prompt, true)?;
    let mut stop = model.info.eos_token_ids.clone();
    stop.extend(&tokenizer.eos_ids);
    let t0 = Instant::now();
    let out = model::greedy_generate(&model, &backend, &prompt, args.max_tokens, &stop, 512)?;
    let took = t0.elapsed();
    println!("{}", tokenizer.decode(&out, true)?);
    if args.verbose {
        eprintln!(
            "{}: loaded in {:.1?}; {} prompt + {} generated tokens in {:.1?} ({:.1} tok/s)",
            model.info.architecture,
            loaded,
            prompt.len(),
            out.len(),
            took,
            out.len() as f64 / took.as_secs_f64()
        );
    }
    Ok(())
}
