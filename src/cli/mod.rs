//! The `worker` command line: one function per verb. Read verbs take `--json`. Exit codes: 0 ok,
//! 1 operational error, 2 usage error; every error says what was wrong and, where it helps, what
//! to do (`error:` / `caused by:` / `hint:`).
//!
//! This file holds the errors, the dispatch and the helpers every verb family shares; the
//! arguments are in `args`, and each family of verbs has a file: `daemon` (run, demo,
//! demo-store), `enqueue`, `read` (list, show, trace, postmortem, replay, events), `decide`
//! (approve, reject, reconcile, answer, cancel) and `stores` (the demo shop, memory notes).

/// `println!` for verbs: control characters in the text (stored goals, notes, model text,
/// operator names) are shown escaped, so nothing printed can drive the terminal; a closed
/// stdout (`worker list | head -2`) ends the verb quietly with the status a shell shows for
/// SIGPIPE, instead of a panic. JSON output goes through it unchanged: JSON escapes control
/// characters itself.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let text = format!($($t)*);
        if let Err(e) = writeln!(std::io::stdout().lock(), "{}", $crate::limits::printable(&text)) {
            return Err($crate::cli::CliError::from_stdout(e));
        }
    }};
}

/// `print!` for verbs; see [`outln`].
macro_rules! out {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let text = format!($($t)*);
        if let Err(e) = write!(std::io::stdout().lock(), "{}", $crate::limits::printable(&text)) {
            return Err($crate::cli::CliError::from_stdout(e));
        }
    }};
}

mod args;
mod args_decide;
mod args_demo;
mod daemon;
mod decide;
mod enqueue;
mod inflight;
mod progress;
mod read;
pub mod reference;
mod replay;
mod schedule;
mod sole;
mod stores;
mod wait;
mod watch;
pub use wait::UntilArg;

pub use args::*;
pub use args_decide::*;
pub use args_demo::*;
use daemon::{cmd_console, cmd_demo, cmd_demo_store, cmd_run};
use decide::{cmd_answer, cmd_approve, cmd_cancel, cmd_reconcile, cmd_reject, cmd_say};
use enqueue::cmd_enqueue;
pub use enqueue::parse_batch_line;
use read::{cmd_events, cmd_list, cmd_postmortem, cmd_show, cmd_trace};
use replay::cmd_replay;
use stores::{cmd_check, cmd_memory, cmd_purge, cmd_store};

use clap::{Args, Parser, Subcommand};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::kernel::report::{closing_explained, span_table};
use crate::kernel::{Catalog, StopReason};
use crate::operator::task_effects;
use crate::operator::{Extension, Settlement};
use crate::sim::{SCENARIO_HEADER, scenario_row, scenarios};
use crate::store::Decision;
use crate::store::{self, Access, Backend, NewTask, QueueStatus, RedbStore, TaskRecord};
use crate::tools::durable::{DemoShop, DurableStore};
use crate::tools::{Order, effects_to_python};
use crate::worker::{self, Config, now_ms};

/// An error for the user: what was wrong, why, and what to do; exit code 1 or 2.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub cause: Option<String>,
    pub hint: Option<String>,
    pub code: i32,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            cause: None,
            hint: None,
            code: 2,
        }
    }

    pub fn op(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            cause: None,
            hint: None,
            code: 1,
        }
    }

    /// Writing to stdout failed: a closed pipe ends the command quietly (status 141, as if
    /// killed by SIGPIPE, which is what `head` expects); any other error is reported.
    pub fn from_stdout(e: std::io::Error) -> CliError {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            CliError {
                message: String::new(),
                cause: None,
                hint: None,
                code: 141,
            }
        } else {
            CliError::op(format!("cannot write the output: {e}"))
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> CliError {
        self.hint = Some(hint.into());
        self
    }

    pub fn render(&self) -> String {
        if self.message.is_empty() {
            return String::new();
        }
        let mut s = format!("error: {}\n", self.message);
        if let Some(c) = &self.cause {
            s.push_str(&format!("caused by: {c}\n"));
        }
        if let Some(h) = &self.hint {
            s.push_str(&format!("hint: {h}\n"));
        }
        s
    }
}

impl From<store::Error> for CliError {
    fn from(e: store::Error) -> CliError {
        let code = match e {
            store::Error::Invalid(_) => 2,
            _ => 1,
        };
        let hint = match &e {
            store::Error::Missing(_) => Some(
                "run `worker enqueue ...` or `worker run` to create it, or pass --db PATH"
                    .to_string(),
            ),
            store::Error::NoTask(_) => Some("`worker list` shows the task ids".to_string()),
            store::Error::Unavailable(_) => Some(
                "check that the server is up and that --db (or WORKER_DB) names it".to_string(),
            ),
            store::Error::NewerVersion { .. } => {
                Some("use the Tether release that wrote this file, or a newer one".to_string())
            }
            store::Error::InUse(path) => {
                let (daemon, socket) = (
                    crate::local::daemon_pid(path).map_or_else(
                        || "a daemon".to_string(),
                        |p| format!("the daemon with pid {p}"),
                    ),
                    crate::local::socket_path(path),
                );
                Some(format!(
                    "{daemon} is the file's only writer while it runs (daemons are, unless started with --shared): `worker enqueue` and the decisions reach the file through its socket ({}), and so do `worker memory add|forget`, `purge` and `schedule add|pause|resume|remove`; `check`, `migrate`, `console`, `reconcile --auto` and `schedule tick` need the file itself and can run once it stops (the daemon fires the schedules itself, and settles held writes by their lookups unless started with --no-auto-settle)",
                    socket.display()
                ))
            }
            store::Error::Corrupt(_) => Some(
                "restore the file from a backup; this build will not guess at its contents"
                    .to_string(),
            ),
            _ => None,
        };
        CliError {
            message: e.to_string(),
            cause: None,
            hint,
            code,
        }
    }
}

type CliResult = Result<(), CliError>;

/// Where the demo shop is: `--store`, else beside a file `--db` or in the same
/// PostgreSQL database.
fn store_target(cli: &Cli, shop: &ShopArg) -> String {
    shop.store.clone().unwrap_or_else(|| {
        if store::pg::is_url(&cli.db) {
            cli.db.clone()
        } else {
            sibling_store(Path::new(&cli.db)).display().to_string()
        }
    })
}

fn open_tools(cli: &Cli, shop: &ShopArg) -> Result<DurableStore, CliError> {
    Ok(DurableStore::open_target(&store_target(cli, shop))?)
}

/// `dir/worker.redb` -> `dir/worker.store.redb`.
pub fn sibling_store(db: &Path) -> PathBuf {
    let stem = db.file_stem().and_then(|s| s.to_str()).unwrap_or("worker");
    db.with_file_name(format!("{stem}.store.redb"))
}

pub fn run(cli: Cli) -> CliResult {
    match &cli.command {
        Command::Run(a) => cmd_run(&cli, a),
        Command::Enqueue(a) => cmd_enqueue(&cli, a),
        Command::Wait(a) => wait::cmd_wait(&cli, a),
        Command::List(a) => cmd_list(&cli, a),
        Command::Show(a) => cmd_show(&cli, a),
        Command::Trace(a) => cmd_trace(&cli, a),
        Command::Postmortem(a) => cmd_postmortem(&cli, a),
        Command::Demo(a) => cmd_demo(&cli, a),
        Command::DemoStore(a) => cmd_demo_store(&cli, a),
        Command::Console(a) => cmd_console(&cli, a),
        Command::Tools(c) => stores::cmd_tools(&cli, c),
        Command::Schedule(c) => schedule::cmd_schedule(&cli, c),
        Command::Store(c) => cmd_store(&cli, &c.shop(), &c.command),
        Command::Approve(a) => cmd_approve(&cli, a),
        Command::Reject(a) => cmd_reject(&cli, a),
        Command::Reconcile(a) => cmd_reconcile(&cli, a),
        Command::Answer(a) => cmd_answer(&cli, a),
        Command::Say(a) => cmd_say(&cli, a),
        Command::Cancel(a) => cmd_cancel(&cli, a),
        Command::Replay(a) => cmd_replay(&cli, a),
        Command::Events(a) => cmd_events(&cli, a),
        Command::Watch(a) => watch::cmd_watch(&cli, a),
        Command::Memory(c) => cmd_memory(&cli, c),
        Command::Check(a) => cmd_check(&cli, a),
        Command::Purge(a) => cmd_purge(&cli, a),
        Command::Migrate(a) => {
            let db = open_created(&cli, 1)?;
            open_tools(&cli, &a.shop)?;
            if a.json {
                return print_json(&json!({"database": db.describe(), "db_id": db.db_id()}));
            }
            outln!("{} is ready (database id {})", db.describe(), db.db_id());
            Ok(())
        }
    }
}

type Db = Arc<dyn Backend>;

fn open_existing(cli: &Cli) -> Result<Db, CliError> {
    Ok(store::open_backend(&cli.db, Access::Write, 2)?)
}

/// For the read verbs: a redb file read-only, so they never wait for a process inside a write.
fn open_reader(cli: &Cli) -> Result<Db, CliError> {
    Ok(store::open_backend(&cli.db, Access::Read, 2)?)
}

/// For enqueue and the daemon: the file is created, the migrations applied.
fn open_created(cli: &Cli, connections: usize) -> Result<Db, CliError> {
    Ok(store::open_backend(&cli.db, Access::Create, connections)?)
}

/// A writing verb on a redb file: handed to the daemon that serves the file's socket when one
/// answers (`daemon` gives `None` when none does), else carried out on the file itself
/// (`file`). A daemon that is the file's only writer (without `--shared`) keeps the verb off the
/// file: one that started after `daemon` found no socket, or that was too busy to take the
/// request, is asked again through its socket, for up to 10 s.
fn through_daemon<T>(
    daemon: impl Fn() -> store::Result<Option<T>>,
    file: impl Fn() -> store::Result<T>,
) -> store::Result<T> {
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        if let Some(out) = daemon()? {
            return Ok(out);
        }
        match file() {
            Err(store::Error::InUse(path)) if let Some(uid) = other_users_socket(&path) => {
                return Err(store::Error::Daemon(format!(
                    "{} is written by a daemon of another user (uid {uid}), which takes requests from its own user only: run this as that user",
                    path.display()
                )));
            }
            Err(store::Error::InUse(_)) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(store::Error::InUse(path)) => {
                let pid = crate::local::daemon_pid(&path)
                    .map_or_else(String::new, |p| format!(" (pid {p})"));
                return Err(store::Error::Daemon(format!(
                    "the daemon that is {}'s only writer{pid} did not take the request within 10 s: it is busy with other requests, or cannot be reached at {}; nothing was done",
                    path.display(),
                    crate::local::socket_path(&path).display()
                )));
            }
            done => return done,
        }
    }
}

/// An operator's write (a decision, a memory note): through the daemon that serves the file
/// if one runs, else here, by the same function the daemon runs: on PostgreSQL with `opened`
/// (the handle the verb read with) when given, on a file opened for writing (with `access`)
/// only then.
fn operator_write<T: serde::de::DeserializeOwned>(
    cli: &Cli,
    asked: &crate::local::Decide,
    access: Access,
    opened: Option<&dyn Backend>,
) -> Result<T, CliError> {
    let here = || match opened {
        Some(db) if store::pg::is_url(&cli.db) => crate::local::decide_here(asked, db),
        _ => {
            let db = store::open_backend(&cli.db, access, 2)?;
            crate::local::decide_here(asked, db.as_ref())
        }
    };
    let out = if store::pg::is_url(&cli.db) {
        here()?
    } else {
        through_daemon(|| crate::local::decide(Path::new(&cli.db), asked), here)?
    };
    serde_json::from_value(out)
        .map_err(|e| CliError::op(format!("the answer is not one this release reads: {e}")))
}

/// The uid that owns the daemon's socket beside `db`, when it is not this process's user.
fn other_users_socket(db: &Path) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let uid = std::fs::metadata(crate::local::socket_path(db)).ok()?.uid();
    (uid != crate::local::own_uid()).then_some(uid)
}

fn print_json(v: &Value) -> CliResult {
    outln!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
    Ok(())
}

fn decision(by: &str, reason: &Option<String>) -> Result<Decision, CliError> {
    crate::operator::decision(by, reason.as_deref()).map_err(CliError::usage)
}

fn extension(text: &Option<String>) -> Result<Extension, CliError> {
    match text {
        Some(t) => Extension::parse(t).map_err(CliError::usage),
        None => Ok(Extension::default()),
    }
}
