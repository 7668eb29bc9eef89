//! The verbs' side of the local API: one request per connection to the daemon serving the
//! file, `None` when no daemon of this user answers (the verb then opens the file), and an
//! answer that does not come reported as such rather than sent again.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use super::*;
use crate::store::{Enqueued, NewTask, Result};

/// How long a verb waits for the daemon, from `WORKER_DAEMON_TIMEOUT_MS` (default 60 s).
fn answer_timeout() -> Result<Duration> {
    match std::env::var("WORKER_DAEMON_TIMEOUT_MS") {
        Err(_) => Ok(ANSWER_TIMEOUT),
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(ms) if ms > 0 => Ok(Duration::from_millis(ms)),
            _ => Err(Error::Invalid(format!(
                "WORKER_DAEMON_TIMEOUT_MS={v:?}: give a whole number of milliseconds, at least 1"
            ))),
        },
    }
}

/// Enqueues `tasks` through the daemon serving the file `db`, in one transaction of its own.
/// `Ok(None)`: no daemon answers on the socket, nothing was sent (open the file instead).
pub fn enqueue(db: &Path, tasks: &[NewTask]) -> Result<Option<Vec<Enqueued>>> {
    let keyed = tasks.iter().all(|t| t.key.is_some());
    let again = if keyed {
        "running the same enqueue again is safe: its keys are not enqueued twice"
    } else {
        "tasks without --key would be enqueued twice by running it again"
    };
    let body = |w: &mut dyn Write| {
        for t in tasks {
            serde_json::to_writer(&mut *w, t)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    };
    let asked = Asked {
        op: "enqueue",
        tasks: tasks.len(),
        what: "the tasks",
        unknown: "the tasks may or may not be enqueued",
        seen_with: "`worker list` shows them",
        again,
        retry_lost: keyed,
    };
    exchange(db, &asked, &body)?
        .map(|v| {
            serde_json::from_value(v).map_err(|e| {
                Error::Daemon(format!("the daemon's answer is not a list of tasks: {e}"))
            })
        })
        .transpose()
}

/// Carries out an operator's decision through the daemon serving the file `db`; the answer
/// is what the operator function returned (the call decided on, or a cancelled task's status
/// before). `Ok(None)`: no daemon answers, nothing was sent.
pub fn decide(db: &Path, d: &Decide) -> Result<Option<serde_json::Value>> {
    let body = |w: &mut dyn Write| {
        serde_json::to_writer(&mut *w, d)?;
        w.write_all(b"\n")
    };
    let asked = asked_of(d);
    match exchange(db, &asked, &body) {
        // A daemon of an earlier release, which takes decisions but not notes or maintenance:
        // it read the request, did nothing, and the verb writes the file itself.
        Err(Error::Invalid(m)) if !d.on_a_task() && m.contains("unknown variant") => {
            tracing::debug!(answer = %m, "the daemon takes no notes; writing the file");
            Ok(None)
        }
        other => other,
    }
}

/// What a decision sent to the daemon is called in what the operator is told if it fails.
fn asked_of(d: &Decide) -> Asked<'static> {
    match d {
        Decide::Note { .. } | Decide::Forget { .. } => Asked {
            op: "decide",
            tasks: 0,
            what: "the memory note",
            unknown: "the note may or may not be added (or forgotten)",
            seen_with: "`worker memory list` shows the notes",
            again: "adding it again without looking would store it twice",
            retry_lost: false,
        },
        Decide::Purge { .. } => Asked {
            op: "decide",
            tasks: 0,
            what: "the purge",
            unknown: "some finished tasks may have been purged",
            seen_with: "`worker list` and `worker events` show what is left",
            again: "running it again is safe: it purges what is left",
            retry_lost: false,
        },
        Decide::ScheduleAdd { .. }
        | Decide::SchedulePaused { .. }
        | Decide::ScheduleRemove { .. } => Asked {
            op: "decide",
            tasks: 0,
            what: "the schedule's change",
            unknown: "the schedule may or may not be changed",
            seen_with: "`worker schedule list` shows it",
            again: "running it again is safe: an added schedule is refused the second time",
            retry_lost: false,
        },
        Decide::Say { .. } => Asked {
            op: "decide",
            tasks: 0,
            what: "the message",
            unknown: "the message may or may not have started the task's next turn",
            seen_with: "`worker show` shows the task's turn and conversation",
            again: "sending it again with --turn (the turn you saw finish) is safe: it is refused once the task moved past that turn",
            retry_lost: false,
        },
        _ => Asked {
            op: "decide",
            tasks: 0,
            what: "the decision",
            unknown: "the decision may or may not be recorded",
            seen_with: "`worker show` and `worker events` show it",
            again: "taking it again is safe: a decision already taken is refused",
            // Taken twice, a decision would report the refusal of what was done.
            retry_lost: false,
        },
    }
}

/// A request as the caller describes it, for the header and for what it is told on failure.
struct Asked<'a> {
    op: &'a str,
    tasks: usize,
    what: &'a str,
    unknown: &'a str,
    seen_with: &'a str,
    again: &'a str,
    /// Doing it twice does not do it twice: a request whose connection was lost is sent again.
    retry_lost: bool,
}

type Body<'a> = dyn Fn(&mut dyn Write) -> std::io::Result<()> + 'a;

/// How one try of a request ended.
enum Tried {
    /// No daemon of this user answers on the socket: nothing was sent.
    NoDaemon,
    Answered(serde_json::Value),
    Refused(Error),
    /// The connection ended without an answer (the daemon killed or gone): done or not.
    Lost(Error),
    /// No answer in time (the daemon paused): done, not done, or refused when it resumes.
    Silent(Error),
}

/// One request to the daemon serving `db`: `Ok(None)` if none answers on the socket (or it
/// is busy: nothing was done). A request that `retry_lost` allows is sent again when its
/// connection was lost, through the next daemon or, if none answers, by the verb itself.
fn exchange(db: &Path, asked: &Asked, body: &Body) -> Result<Option<serde_json::Value>> {
    let timeout = answer_timeout()?;
    let deadline = Instant::now() + timeout;
    let deadline_ms = crate::clock::now_ms().saturating_add(timeout.as_millis() as u64);
    let mut pause = Duration::from_millis(10);
    loop {
        match exchange_once(db, asked, body, deadline, deadline_ms, timeout) {
            Tried::NoDaemon => return Ok(None),
            Tried::Answered(v) => return Ok(Some(v)),
            Tried::Refused(e) | Tried::Silent(e) => return Err(e),
            Tried::Lost(e) if !asked.retry_lost || Instant::now() + pause >= deadline => {
                return Err(e);
            }
            Tried::Lost(e) => {
                tracing::debug!(error = %e, "the daemon went away before answering; trying again");
            }
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Connects within `left`: a daemon that is paused with its queue of connections full would
/// hold a plain `connect` forever. (A connection still waiting when the verb gives up is
/// dropped with the process; the daemon reads nothing from it.)
fn connect(socket: &Path, left: Duration) -> std::io::Result<UnixStream> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = socket.to_path_buf();
    std::thread::Builder::new()
        .name("local-connect".into())
        .spawn(move || {
            let _ = tx.send(UnixStream::connect(path));
        })?;
    rx.recv_timeout(left).unwrap_or_else(|_| {
        Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "the daemon did not accept the connection in time",
        ))
    })
}

fn exchange_once(
    db: &Path,
    asked: &Asked,
    body: &Body,
    deadline: Instant,
    deadline_ms: u64,
    timeout: Duration,
) -> Tried {
    let socket = socket_path(db);
    let left = deadline.saturating_duration_since(Instant::now());
    let conn = match connect(&socket, left.max(Duration::from_millis(1))) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(socket = %socket.display(), error = %e, "no daemon answers; opening the file");
            return Tried::NoDaemon;
        }
    };
    // Only a daemon of this user is trusted with the request (another user could have put a
    // socket of their own at this path).
    match peer_uid(&conn) {
        Ok(uid) if uid == own_uid() => {}
        Ok(uid) => {
            tracing::warn!(socket = %socket.display(), uid, "the socket is served by another user; ignored, opening the file");
            return Tried::NoDaemon;
        }
        Err(e) => {
            tracing::debug!(socket = %socket.display(), error = %e, "cannot tell who serves the socket; opening the file");
            return Tried::NoDaemon;
        }
    }
    // A commit the daemon began before the deadline is waited for a little longer.
    let wait = left + GRACE;
    let _ = conn.set_read_timeout(Some(wait));
    let _ = conn.set_write_timeout(Some(wait));
    let header = Header {
        op: asked.op.into(),
        protocol: PROTOCOL,
        tasks: asked.tasks,
        deadline_ms,
    };
    let sent = send(&conn, &header, body);
    // An answer may have come even when sending failed (a refusal of the header).
    let answer = read_answer(&conn);
    // Named (its pid read from the lock file) only when something went wrong.
    let daemon = || match daemon_pid(db) {
        Some(pid) => format!("the daemon serving {} (pid {pid})", db.display()),
        None => format!("the daemon serving {}", db.display()),
    };
    let lost = |what: String| {
        Error::Daemon(format!(
            "{} {what}: {}; {} ({})",
            daemon(),
            asked.unknown,
            asked.seen_with,
            asked.again
        ))
    };
    let silent = || {
        Error::Daemon(format!(
            "{} did not answer within {} ms (is it paused?): when it resumes it refuses {}, as the deadline passed, unless it had already begun to carry it out; {} ({})",
            daemon(),
            timeout.as_millis(),
            asked.what,
            asked.seen_with,
            asked.again
        ))
    };
    match (sent, answer) {
        (_, Ok(Answer::Ok(out))) => Tried::Answered(out),
        // Nothing was done: the verb does it itself.
        (_, Ok(Answer::Error(f))) if f.kind == "busy" => Tried::NoDaemon,
        (_, Ok(Answer::Error(f))) => Tried::Refused(error_of(f)),
        (Err(e), _) | (Ok(()), Err(e)) if is_timeout(&e) => Tried::Silent(silent()),
        (Err(e), Err(_)) => Tried::Lost(lost(format!("stopped reading the request ({e})"))),
        (Ok(()), Err(e)) => Tried::Lost(lost(format!("did not answer ({e})"))),
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn send(conn: &UnixStream, header: &Header, body: &Body) -> std::io::Result<()> {
    let mut w = BufWriter::new(conn);
    serde_json::to_writer(&mut w, header)?;
    w.write_all(b"\n")?;
    body(&mut w)?;
    w.flush()
}

pub(super) fn read_answer(conn: &UnixStream) -> std::io::Result<Answer> {
    let mut line = Vec::new();
    BufReader::new(conn)
        .take(LINE_BYTES_MAX as u64)
        .read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the connection closed without an answer",
        ));
    }
    serde_json::from_slice(&line).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("its answer is not one this release reads: {e}"),
        )
    })
}
