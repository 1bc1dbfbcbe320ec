//! The `chimera-gpu-check` command line: runs the GPU suites, prints one table and exits
//! non-zero if any row failed. It takes the arguments `chimera gpu-check` took before the
//! suites left the host crate (`tests/gpu/run.sh` runs it on the GPU machine).

use clap::Parser;

use chimera::logging::LogFormat;
use chimera_gpu_check::GpuCheckArgs;

#[derive(Parser)]
#[command(
    name = "chimera-gpu-check",
    version,
    about = "Run chimera's GPU suites (kernels and models against the CPU, speed) and print one table"
)]
struct Cli {
    #[command(flatten)]
    args: GpuCheckArgs,
    /// Log line format on stderr: `text` (colours only on a terminal) or `json` (one object
    /// per line). The level comes from RUST_LOG (default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    chimera::logging::init(cli.log_format)?;
    let report = chimera_gpu_check::run(&cli.args)?;
    println!("{}", report.table());
    anyhow::ensure!(
        report.failures() == 0,
        "{} GPU checks failed",
        report.failures()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn every_argument_has_help_text() {
        let cli = Cli::command();
        cli.clone().debug_assert();
        let missing: Vec<&str> = cli
            .get_arguments()
            .filter(|a| !matches!(a.get_id().as_str(), "help" | "version"))
            .filter(|a| a.get_help().is_none() && a.get_long_help().is_none())
            .map(|a| a.get_id().as_str())
            .collect();
        assert!(
            missing.is_empty(),
            "arguments without help text: {missing:?}"
        );
    }

    /// The command line `tests/gpu/run.sh` gives it, as `chimera gpu-check` took it.
    #[test]
    fn parses_the_arguments_of_the_gpu_scripts() {
        let cli = Cli::try_parse_from([
            "chimera-gpu-check",
            "--suite",
            "kernels",
            "--json",
            "out/kernels.json",
            "--dump",
            "out/logits",
            "--seed",
            "7",
            "--log-format",
            "json",
        ])
        .expect("parses");
        assert_eq!(cli.args.suite, "kernels");
        assert_eq!(
            cli.args.json.as_deref(),
            Some(std::path::Path::new("out/kernels.json"))
        );
        assert_eq!(
            cli.args.dump.as_deref(),
            Some(std::path::Path::new("out/logits"))
        );
        assert_eq!(cli.args.seed, Some(7));
        assert_eq!(cli.log_format, LogFormat::Json);
        // The defaults the scripts rely on.
        let cli = Cli::try_parse_from(["chimera-gpu-check"]).expect("parses");
        assert_eq!(cli.args.suite, "all");
        assert_eq!(cli.args.steps, 1000);
        assert_eq!(
            cli.args.fixtures,
            std::path::Path::new("tests/fixtures/models")
        );
    }
}
