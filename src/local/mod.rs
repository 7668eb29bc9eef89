//! The daemon's local API: a Unix socket beside the redb file (`worker.redb.sock`, mode 0600)
//! through which `worker enqueue` hands its tasks to the running daemon, which commits them in
//! the database it already has open, and the operators' decisions (approve, reject, reconcile,
//! cancel) are handed to it to run through the same `operator` functions. The verb then
//! commits nothing itself. Without a daemon (no socket, or a socket nobody listens on, left by
//! a daemon that was killed) the verb opens the file as before.
//!
//! One daemon per file serves the socket: the one holding the lock on `worker.redb.lock`
//! (an exclusive `flock`, with its pid written in the file) for as long as it runs. The kernel
//! drops the lock when the process ends, however it ends, so a socket left by a killed daemon
//! is replaced by the next one to start. The lock file is never removed: two daemons must
//! never lock two different files of the same name. The socket is bound inside a private
//! directory and renamed into place, so it is never reachable with looser permissions.
//!
//! The protocol: one request per connection, in lines of JSON. A request is a header line
//! (`{"op": "enqueue", "protocol": 1, "tasks": N}`) and N lines, one task each, or
//! (`{"op": "decide", "protocol": 1}`) and one [`Decide`] line; the answer is one line,
//! `{"ok": ...}` (the enqueued tasks, the call decided on, or a cancelled task's status) or
//! `{"error": {"kind": ..., "message": ...}}`. Errors carry the store's kinds, so a verb prints and exits as it would have without
//! the daemon. A request whose answer never comes (the daemon paused, or killed after reading
//! it) is reported as such: the verb does not send it again on its own, except an enqueue whose
//! every task has a key, which is tried again when the connection was lost (through the next
//! daemon, or by the verb itself when none answers: the keys make a second try harmless).

mod client;
mod server;
#[cfg(test)]
mod tests;

pub use client::{decide, enqueue};
pub use server::{Claim, LocalApi, Served, claim, decide_here, serve, serve_claimed};

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::store::Error;

/// The protocol's version: a request of another version is refused, not guessed at.
pub const PROTOCOL: u32 = 1;
/// Requests handled at once; one more is answered "busy".
const CONNECTIONS_MAX: usize = 32;
/// How long a whole request may take to arrive (shorter in unit tests, which wait it out).
const REQUEST_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_secs(2)
} else {
    Duration::from_secs(30)
};
/// How long a verb waits for the daemon's answer, unless `WORKER_DAEMON_TIMEOUT_MS` says.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// One line of a request: a task with its script (at most 8 MiB as a file) and catalog.
const LINE_BYTES_MAX: usize = 16 << 20;
/// A whole request (a batch of tasks).
const REQUEST_BYTES_MAX: usize = 256 << 20;
/// How long a caller waits past its deadline for the answer of a request the daemon began
/// before it: a commit in progress.
const GRACE: Duration = Duration::from_secs(2);
/// The longest a Unix socket's path may be (`sun_path`, with its terminating zero).
const SOCKET_PATH_MAX: usize = 107;

/// `dir/worker.redb` -> `dir/worker.redb.sock`.
pub fn socket_path(db: &Path) -> PathBuf {
    suffixed(db, ".sock")
}

/// `dir/worker.redb` -> `dir/worker.redb.lock`: held by the daemon that serves the socket.
pub fn lock_path(db: &Path) -> PathBuf {
    suffixed(db, ".lock")
}

fn suffixed(db: &Path, suffix: &str) -> PathBuf {
    let mut s = linked(db).into_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// The file `db` names, its symbolic links followed (a relative target is beside its link),
/// so that the daemon and the verbs meet beside the file itself whichever name each was
/// given. The path stays as short as it was given (no canonical absolute path, which could
/// outgrow a socket's 107 bytes); a path that is no link, or that cannot be read, is kept.
fn linked(db: &Path) -> PathBuf {
    let mut path = db.to_path_buf();
    // As many links as the kernel follows before it gives up (ELOOP).
    for _ in 0..40 {
        match std::fs::read_link(&path) {
            Ok(target) if target.is_absolute() => path = target,
            Ok(target) => {
                path = match path.parent() {
                    Some(dir) => dir.join(target),
                    None => target,
                }
            }
            Err(_) => break,
        }
    }
    path
}

/// The pid the daemon serving `db` wrote in its lock file, if one did.
pub fn daemon_pid(db: &Path) -> Option<u32> {
    std::fs::read_to_string(lock_path(db))
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[derive(Serialize, Deserialize)]
struct Header {
    op: String,
    protocol: u32,
    #[serde(default)]
    tasks: usize,
    /// When the caller stops waiting (ms since the epoch): a daemon that comes to the request
    /// later (it was paused) refuses it instead of carrying it out for a caller who has gone.
    deadline_ms: u64,
}

/// The uid of the process at the other end of a Unix socket connection.
#[cfg(target_os = "linux")]
fn peer_uid(conn: &std::os::unix::net::UnixStream) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a `ucred` owned here, and
    // `conn` keeps the descriptor open for the call.
    let rc = unsafe {
        libc::getsockopt(
            conn.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(cred.uid)
}

#[cfg(not(target_os = "linux"))]
fn peer_uid(_conn: &std::os::unix::net::UnixStream) -> std::io::Result<u32> {
    Err(std::io::Error::new(
        std::io::ErrorKind::Unsupported,
        "peer credentials are read on Linux only",
    ))
}

/// This process's effective uid.
pub(crate) fn own_uid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}

#[derive(Debug, Serialize, Deserialize)]
struct Failure {
    kind: String,
    message: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Answer {
    Ok(serde_json::Value),
    Error(Failure),
}

/// An operator's decision, as `worker approve|reject|reconcile|cancel` hands it to the daemon:
/// the task (already resolved to its id), the held call the operator reviewed, the budget
/// granted, who and why. The daemon runs the same function of `operator` the verb would have.
/// `worker memory add|forget`, `purge` and the schedule verbs that write hand their request
/// to it the same way.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "verb", rename_all = "snake_case")]
pub enum Decide {
    Approve {
        task: String,
        key: Option<String>,
        digest: Option<String>,
        extend: Vec<(String, u64)>,
        by: String,
        reason: Option<String>,
    },
    Reject {
        task: String,
        key: Option<String>,
        digest: Option<String>,
        by: String,
        reason: Option<String>,
    },
    Reconcile {
        task: String,
        /// The write's result when it took effect; `None`: it did not.
        applied: Option<serde_json::Value>,
        key: Option<String>,
        digest: Option<String>,
        extend: Vec<(String, u64)>,
        by: String,
        reason: Option<String>,
    },
    Cancel {
        task: String,
        by: String,
        reason: Option<String>,
    },
    /// `worker answer`: a person's answer to the question a task waits on.
    Answer {
        task: String,
        text: String,
        /// The question answered, as `worker show` printed it (its key or digest).
        #[serde(default)]
        key: Option<String>,
        #[serde(default)]
        digest: Option<String>,
        by: String,
        reason: Option<String>,
    },
    /// `worker say`: a follow-up message that continues a finished task (`turn`: the turn the
    /// sender saw finish).
    Say {
        task: String,
        text: String,
        #[serde(default)]
        turn: Option<u32>,
        by: String,
        reason: Option<String>,
    },
    /// `worker memory add`: a note for a user, from a source, for `ttl_s` seconds.
    Note {
        user: String,
        text: String,
        source: String,
        ttl_s: u64,
        by: String,
    },
    /// `worker memory forget`: a user's notes (from one source when given).
    Forget {
        user: String,
        source: Option<String>,
        by: String,
    },
    /// `worker purge`: finished tasks last updated before `before_ms`, `batch` a transaction.
    Purge {
        before_ms: u64,
        batch: usize,
        by: String,
        reason: Option<String>,
    },
    /// `worker schedule add`: the schedule as the verb made it (checked again by the daemon).
    ScheduleAdd {
        schedule: crate::store::schedule::Schedule,
    },
    /// `worker schedule pause|resume`.
    SchedulePaused { name: String, paused: bool },
    /// `worker schedule remove`.
    ScheduleRemove { name: String },
}

impl Decide {
    /// A decision on a task (approve, reject, reconcile, cancel), which every release of the
    /// local API takes; the other requests came later.
    pub fn on_a_task(&self) -> bool {
        matches!(
            self,
            Decide::Approve { .. }
                | Decide::Reject { .. }
                | Decide::Reconcile { .. }
                | Decide::Cancel { .. }
        )
    }
}

fn failure(e: &Error) -> Failure {
    let (kind, message) = match e {
        Error::Invalid(m) => ("invalid", m.clone()),
        Error::Conflict(m) => ("conflict", m.clone()),
        Error::NoTask(id) => ("no_task", id.clone()),
        other => ("other", other.to_string()),
    };
    Failure {
        kind: kind.into(),
        message,
    }
}

fn error_of(f: Failure) -> Error {
    match f.kind.as_str() {
        "invalid" => Error::Invalid(f.message),
        "conflict" => Error::Conflict(f.message),
        "no_task" => Error::NoTask(f.message),
        _ => Error::Daemon(f.message),
    }
}
