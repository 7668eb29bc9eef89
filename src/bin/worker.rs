//! The `worker` binary: parses the command line, sets up logging to stderr (RUST_LOG, text or
//! `--log-format json`), runs the
//! verb and turns errors into `error:` / `hint:` lines and exit codes (1 operational, 2 usage).

use clap::Parser;
use tether::cli::{Cli, Command, LogFormat, run};

/// mimalloc for the verbs that run tasks or serve (a step makes dozens of small, short-lived
/// allocations, and with glibc's malloc they were a quarter of the kernel's time: `cargo
/// bench --bench kernel`, which runs on mimalloc too); the system allocator for the one-shot
/// verbs, where mimalloc's start and exit (its arena reserved, a huge page zeroed before it
/// was built with `no_thp`, its pages purged at exit) made a `worker enqueue` a quarter slower
/// (see [`allocator`], and the README's durable bench).
#[global_allocator]
static ALLOC: allocator::ByVerb = allocator::ByVerb;

// Elsewhere than Linux with glibc there is no pre-init hook here: every verb runs on mimalloc,
// and the verb lists serve only the tests.
#[cfg_attr(not(all(target_os = "linux", target_env = "gnu")), allow(dead_code))]
mod allocator {
    //! The allocator chosen once for the whole process, from its arguments, before its first
    //! allocation: nothing allocated by one is ever freed by the other.

    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};

    /// The verbs that run for long and allocate at every step: they get mimalloc.
    pub const LONG_RUNNING: [&str; 5] = ["run", "console", "serve", "demo", "demo-store"];
    /// The verbs that do one thing and exit: they get the system allocator.
    pub const ONE_SHOT: [&str; 23] = [
        "enqueue",
        "wait",
        "watch",
        "list",
        "show",
        "trace",
        "postmortem",
        "tools",
        "schedule",
        "store",
        "approve",
        "reject",
        "answer",
        "say",
        "reconcile",
        "cancel",
        "replay",
        "events",
        "memory",
        "check",
        "purge",
        "migrate",
        "help",
    ];

    // Only glibc runs an executable's `.preinit_array` with its arguments (musl ignores it):
    // elsewhere every verb keeps mimalloc.
    static MIMALLOC: AtomicBool = AtomicBool::new(!HOOKED);
    const HOOKED: bool = cfg!(all(target_os = "linux", target_env = "gnu"));

    /// The options before a verb whose value is the next argument (`--db list run` runs the
    /// daemon on a file named `list`).
    pub const GLOBAL_WITH_VALUE: [&str; 3] = ["--db", "--config", "--log-format"];

    /// Whether the first argument that names a verb names a long-running one. (A value of
    /// another option that happens to be a verb's name could mislead it: that would cost
    /// speed, never correctness.)
    pub fn long_running<'a>(args: impl IntoIterator<Item = &'a [u8]>) -> bool {
        let is = |a: &[u8], list: &[&str]| list.iter().any(|v| v.as_bytes() == a);
        let mut args = args.into_iter();
        while let Some(a) = args.next() {
            if is(a, &GLOBAL_WITH_VALUE) {
                args.next();
            } else if is(a, &LONG_RUNNING) || is(a, &ONE_SHOT) {
                return is(a, &LONG_RUNNING);
            }
        }
        false
    }

    /// Run by the C runtime before any constructor and before `main` (so before Rust's first
    /// allocation), with the process's arguments. It must not allocate.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    extern "C" fn choose(
        argc: libc::c_int,
        argv: *const *const libc::c_char,
        _: *const *const libc::c_char,
    ) {
        let args = (1..usize::try_from(argc).unwrap_or(0)).filter_map(|i| {
            // SAFETY: the C runtime passes `argc` valid, NUL-terminated arguments in `argv`.
            let p = unsafe { *argv.add(i) };
            (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes())
        });
        MIMALLOC.store(long_running(args), Relaxed);
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[used]
    #[unsafe(link_section = ".preinit_array")]
    static CHOOSE: extern "C" fn(
        libc::c_int,
        *const *const libc::c_char,
        *const *const libc::c_char,
    ) = choose;

    /// Whether this process allocates with mimalloc (tests check the choice).
    pub fn is_mimalloc() -> bool {
        MIMALLOC.load(Relaxed)
    }

    pub struct ByVerb;

    // SAFETY: each call goes to one allocator, the same for the whole process.
    unsafe impl GlobalAlloc for ByVerb {
        unsafe fn alloc(&self, l: Layout) -> *mut u8 {
            if is_mimalloc() {
                unsafe { mimalloc::MiMalloc.alloc(l) }
            } else {
                unsafe { System.alloc(l) }
            }
        }
        unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
            if is_mimalloc() {
                unsafe { mimalloc::MiMalloc.alloc_zeroed(l) }
            } else {
                unsafe { System.alloc_zeroed(l) }
            }
        }
        unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
            if is_mimalloc() {
                unsafe { mimalloc::MiMalloc.dealloc(p, l) }
            } else {
                unsafe { System.dealloc(p, l) }
            }
        }
        unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
            if is_mimalloc() {
                unsafe { mimalloc::MiMalloc.realloc(p, l, size) }
            } else {
                unsafe { System.realloc(p, l, size) }
            }
        }
    }
}

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
    tracing::debug!(
        allocator = if allocator::is_mimalloc() {
            "mimalloc"
        } else {
            "system"
        },
        "allocator chosen for this verb"
    );
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
        // The demo's scenarios fail tool calls on purpose (its table says how each ended).
        Command::Demo(_) => "error",
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

#[cfg(test)]
mod tests {
    use super::allocator::{GLOBAL_WITH_VALUE, LONG_RUNNING, ONE_SHOT, long_running};
    use clap::CommandFactory;

    /// Every verb is in one of the allocator's two lists, so a new verb cannot be missed.
    #[test]
    fn every_verb_has_an_allocator() {
        let mut names: Vec<String> = tether::cli::Cli::command()
            .get_subcommands()
            .flat_map(|c| {
                let mut n = vec![c.get_name().to_string()];
                n.extend(c.get_all_aliases().map(str::to_string));
                n
            })
            .collect();
        names.push("help".into());
        names.sort();
        let mut listed: Vec<String> = LONG_RUNNING
            .iter()
            .chain(&ONE_SHOT)
            .map(|s| s.to_string())
            .collect();
        listed.sort();
        assert_eq!(names, listed);
    }

    #[test]
    fn the_first_verb_decides() {
        let pick = |args: &[&str]| long_running(args.iter().map(|a| a.as_bytes()));
        assert!(pick(&["--db", "x.redb", "run", "--max-in-flight", "4"]));
        assert!(pick(&["serve", "--listen", "127.0.0.1:8080"]));
        assert!(!pick(&["enqueue", "--goal", "run"]));
        assert!(!pick(&["--version"]));
        assert!(!pick(&[]));
        // An option's value named like a verb is not the verb.
        assert!(pick(&["--db", "list", "run", "--drain"]));
        assert!(!pick(&["--config", "run", "list"]));
        assert!(!pick(&["--db=run", "list"]));
    }

    /// Every global option that takes a value is skipped with its value.
    #[test]
    fn every_global_option_with_a_value_is_known() {
        let mut with_value: Vec<String> = tether::cli::Cli::command()
            .get_arguments()
            .filter(|a| a.is_global_set() && a.get_action().takes_values())
            .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
            .collect();
        with_value.sort();
        let mut known: Vec<String> = GLOBAL_WITH_VALUE.iter().map(|s| s.to_string()).collect();
        known.sort();
        assert_eq!(with_value, known);
    }
}
