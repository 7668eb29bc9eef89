//! The `worker` binary: parses the command line, sets up logging to stderr (RUST_LOG), runs the
//! verb and turns errors into `error:` / `hint:` lines and exit codes (1 operational, 2 usage).

use clap::Parser;
use tether::cli::{Cli, Command, run};

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints help and version to stdout with code 0, usage errors with code 2.
            let _ = e.print();
            std::process::exit(e.exit_code());
        }
    };
    // Daemons log their work by default; one-shot verbs only warnings. RUST_LOG overrides both.
    let default = match cli.command {
        Command::Run(_) | Command::DemoStore(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    if let Err(e) = run(cli) {
        eprint!("{}", e.render());
        std::process::exit(e.code);
    }
}
