//! The `worker` binary: parses the command line, sets up logging to stderr (RUST_LOG, text or
//! `--log-format json`), runs the
//! verb and turns errors into `error:` / `hint:` lines and exit codes (1 operational, 2 usage).

use clap::Parser;
use tether::cli::{Cli, Command, LogFormat, run};

/// mimalloc rather than the system allocator: a step makes dozens of small, short-lived
/// allocations (JSON values, strings, spans), and with glibc's malloc they were a quarter of
/// the kernel's time (`cargo bench --bench kernel`, which runs on the same allocator).
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                // `worker`, `worker store`, `worker memory` alone: the help, then what is wrong.
                eprint!("{e}");
                eprintln!("\nerror: a command is required; pick one of the commands above");
                std::process::exit(2);
            }
            // clap prints help and version to stdout with code 0, usage errors with code 2.
            let _ = e.print();
            std::process::exit(e.exit_code());
        }
    };
    init_logs(&cli);
    install_panic_hook();
    let db = cli.db.clone();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(cli))) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            eprint!("{}", e.render());
            std::process::exit(e.code);
        }
        Err(_) => {
            let (msg, at) = PANIC
                .lock()
                .ok()
                .and_then(|mut p| p.take())
                .unwrap_or_else(|| ("unknown".into(), String::new()));
            if at.contains("redb") {
                eprintln!(
                    "error: the database is damaged: the storage engine stopped on an inconsistency ({msg})\nhint: `worker check --db {}` reports what is damaged; restore the file from a backup",
                    db
                );
            } else {
                eprintln!(
                    "error: internal error: {msg} (at {at})\nhint: please report this with the command that caused it"
                );
            }
            std::process::exit(1);
        }
    }
}

/// Logs on stderr: daemons log their work by default, one-shot verbs only warnings.
fn init_logs(cli: &Cli) {
    // RUST_LOG overrides both.
    let default = match cli.command {
        Command::Run(_) | Command::DemoStore(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    use std::io::IsTerminal;
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match cli.log_format {
        // One JSON object per line, with the task id, call key and the other fields as
        // fields, and the span (task) they happened in.
        LogFormat::Json => logs.json().with_current_span(true).init(),
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
    }
}

/// No panic reaches the user as a panic: redb panics on some damaged files, and a bug of
/// ours must still end in an `error:` line. The hook keeps the message for that line
/// instead of printing a backtrace first.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown".into());
        let at = info
            .location()
            .map_or(String::new(), |l| format!("{}:{}", l.file(), l.line()));
        let thread = std::thread::current();
        if thread.name() != Some("main") {
            // A worker thread: the daemon goes on or stops on its own terms; say what happened.
            tracing::error!(thread = thread.name().unwrap_or("?"), at, "panic: {msg}");
            return;
        }
        if let Ok(mut last) = PANIC.lock() {
            *last = Some((msg, at));
        }
    }));
}

static PANIC: std::sync::Mutex<Option<(String, String)>> = std::sync::Mutex::new(None);
