//! The verbs' side of the local API: one request per connection to the daemon serving the
//! file, `None` when no daemon answers (the verb then opens the file), and an answer that does
//! not come reported as such rather than sent again.

use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::*;
use crate::store::{Enqueued, NewTask, Result};

/// How long a verb waits for the daemon's answer.
fn answer_timeout() -> Duration {
    std::env::var("WORKER_DAEMON_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(ANSWER_TIMEOUT, Duration::from_millis)
}

/// Enqueues `tasks` through the daemon serving the file `db`, in one transaction of its own.
/// `Ok(None)`: no daemon answers on the socket, nothing was sent (open the file instead).
pub fn enqueue(db: &Path, tasks: &[NewTask]) -> Result<Option<Vec<Enqueued>>> {
    let header = Header {
        op: "enqueue".into(),
        protocol: PROTOCOL,
        tasks: tasks.len(),
    };
    let keyed = tasks.iter().all(|t| t.key.is_some());
    let again = if keyed {
        "the tasks may or may not be enqueued; `worker list` shows them (running the same enqueue again is safe: its keys are not enqueued twice)"
    } else {
        "the tasks may or may not be enqueued; `worker list` shows them (tasks without --key would be enqueued twice by running it again)"
    };
    let body = |w: &mut dyn Write| {
        for t in tasks {
            serde_json::to_writer(&mut *w, t)?;
            w.write_all(b"\n")?;
        }
        Ok(())
    };
    exchange(db, &header, &body, again, keyed)?
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
    let header = Header {
        op: "decide".into(),
        protocol: PROTOCOL,
        tasks: 0,
    };
    let body = |w: &mut dyn Write| {
        serde_json::to_writer(&mut *w, d)?;
        w.write_all(b"\n")
    };
    exchange(
        db,
        &header,
        &body,
        "the decision may or may not be recorded; `worker show` and `worker events` show it (taking it again is safe: a decision already taken is refused)",
        false,
    )
}

type Body<'a> = dyn Fn(&mut dyn Write) -> std::io::Result<()> + 'a;

/// How one try of a request ended.
enum Tried {
    /// Nobody listens on the socket: nothing was sent.
    NoDaemon,
    Answered(serde_json::Value),
    Refused(Error),
    /// The daemon is answering as many requests as it takes: nothing was done.
    Busy,
    /// The connection ended without an answer (the daemon killed or gone): done or not.
    Lost(Error),
    /// No answer within the timeout (the daemon paused): done or not, or later.
    Silent(Error),
}

/// One request to the daemon serving `db`: `Ok(None)` if none answers on the socket. With
/// `retry_lost` (a request that doing twice cannot do twice: an enqueue whose every task has a
/// key), a connection lost before the answer is tried again, through the next daemon or, if
/// none answers, by the verb itself.
fn exchange(
    db: &Path,
    header: &Header,
    body: &Body,
    unknown_outcome: &str,
    retry_lost: bool,
) -> Result<Option<serde_json::Value>> {
    let mut pause = Duration::from_millis(10);
    for attempt in 1.. {
        match exchange_once(db, header, body, unknown_outcome) {
            Tried::NoDaemon => return Ok(None),
            Tried::Answered(v) => return Ok(Some(v)),
            Tried::Refused(e) | Tried::Silent(e) => return Err(e),
            Tried::Lost(e) if !retry_lost || attempt >= 10 => return Err(e),
            Tried::Busy if attempt >= 100 => {
                return Err(Error::Daemon(format!(
                    "the daemon serving {} stayed busy with other requests; nothing was done: try again",
                    db.display()
                )));
            }
            Tried::Lost(e) => {
                tracing::debug!(error = %e, "the daemon went away before answering; trying again");
            }
            Tried::Busy => {}
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(200));
    }
    unreachable!("the loop returns")
}

fn exchange_once(db: &Path, header: &Header, body: &Body, unknown_outcome: &str) -> Tried {
    let socket = socket_path(db);
    let conn = match UnixStream::connect(&socket) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(socket = %socket.display(), error = %e, "no daemon answers; opening the file");
            return Tried::NoDaemon;
        }
    };
    let timeout = answer_timeout();
    let _ = conn.set_read_timeout(Some(timeout));
    let _ = conn.set_write_timeout(Some(timeout));
    let sent = send(&conn, header, body);
    // An answer may have come even when sending failed (a refusal of the header).
    let answer = read_answer(&conn);
    let daemon = match daemon_pid(db) {
        Some(pid) => format!("the daemon serving {} (pid {pid})", db.display()),
        None => format!("the daemon serving {}", db.display()),
    };
    let unknown = |what: String| Error::Daemon(format!("{daemon} {what}: {unknown_outcome}"));
    match (sent, answer) {
        (_, Ok(Answer::Ok(out))) => Tried::Answered(out),
        (_, Ok(Answer::Error(f))) if f.kind == "busy" => Tried::Busy,
        (_, Ok(Answer::Error(f))) => Tried::Refused(error_of(f)),
        (Err(e), Err(_)) => Tried::Lost(unknown(format!("stopped reading the request ({e})"))),
        (Ok(()), Err(e)) if is_timeout(&e) => Tried::Silent(unknown(format!(
            "did not answer within {} ms (is it paused?)",
            timeout.as_millis()
        ))),
        (Ok(()), Err(e)) => Tried::Lost(unknown(format!("did not answer ({e})"))),
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
