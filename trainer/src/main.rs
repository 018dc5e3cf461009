//! The `trainer` command line: train, sample, eval and inspect GPT models on Candle.

#[macro_use]
mod term;
mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    trainer::runtime::init();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(term::Stderr)
        // Colour codes only on a terminal: a log file or a pipe gets plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = cli::Cli::parse();
    match cli::run(args) {
        Ok(cli::Outcome::Done) => ExitCode::SUCCESS,
        Ok(cli::Outcome::Interrupted) => ExitCode::from(cli::Outcome::INTERRUPTED),
        Err(e) => {
            errln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
