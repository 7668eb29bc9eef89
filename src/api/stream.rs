//! A task's events as Server-Sent Events: `GET /api/v1/tasks/{id}/events` asked with
//! `Accept: text/event-stream` (without it, the same path answers the task's audit events as a
//! JSON list). Each event carries an `id`; a client that reconnects with `Last-Event-ID` (as
//! `EventSource` does on its own) resumes after it and misses nothing (see
//! `operator::stream`). The stream ends after the task's `finished` event; asked again after
//! that with the last id, it answers 204, which tells an `EventSource` to stop reconnecting. A
//! stream counts as a long poll against the caller's bounds.

use std::io::Write;
use std::sync::Arc;

use super::{Api, Caller, Role, problem};
use crate::httpd::{Reply, Request};
use crate::operator::stream::{self, Cursor, FollowError, Out};

/// Whether the request asks for the event stream (its `Accept` names `text/event-stream`).
pub(super) fn wants_stream(req: &Request) -> bool {
    req.header("Accept")
        .and_then(|a| std::str::from_utf8(a).ok())
        .is_some_and(|a| {
            a.split(',').any(|m| {
                m.split(';')
                    .next()
                    .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
            })
        })
}

/// The request's `Last-Event-ID`, if it sent one; a 400 when it is not an id of the stream.
/// (The JSON answer has no use for it and reads none.)
fn last_event_id(req: &Request) -> Result<Option<Cursor>, Reply> {
    // An empty one means none (a client that has seen no event yet may send it so).
    let Some(id) = req.header("Last-Event-ID").filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    std::str::from_utf8(id)
        .map_err(|_| "Last-Event-ID is not UTF-8".to_string())
        .and_then(Cursor::parse)
        .map(Some)
        .map_err(|e| problem(400, "invalid_header", &format!("Last-Event-ID: {e}")))
}

impl Api {
    /// The task's events, from `Last-Event-ID` on, as they are recorded.
    pub(super) fn task_stream(&self, req: &Request, caller: &Caller, name: &str) -> Reply {
        let rec = match self.readable(caller, name) {
            Ok(r) => r,
            Err(r) => return r,
        };
        let cursor = match last_event_id(req) {
            Ok(c) => c.unwrap_or_default(),
            Err(r) => return r,
        };
        let submitter = caller.role == Role::Submit;
        // Nothing after the client's last event, and nothing will come: done (an EventSource
        // stops reconnecting on 204).
        match stream::read(self.db.as_ref(), &rec.id, &cursor, submitter) {
            Ok(b) if b.finished && b.events.is_empty() => {
                return Reply::Response {
                    status: 204,
                    headers: Vec::new(),
                    body: Vec::new(),
                };
            }
            Ok(_) => {}
            Err(e) => return super::problem::of_store(&e),
        }
        let held = match self
            .polls
            .enter(&caller.name, caller.role == Role::Operator)
        {
            Ok(h) => h,
            Err(r) => return r,
        };
        let (db, watch, id) = (Arc::clone(&self.db), self.watch().clone(), rec.id);
        Reply::Stream {
            headers: vec![
                ("Content-Type", "text/event-stream".into()),
                // Proxies that buffer answers (nginx) pass this one through as it comes.
                ("X-Accel-Buffering", "no".into()),
            ],
            body: Box::new(move |w: &mut dyn Write, stop: &dyn Fn() -> bool| {
                let _held = held;
                // A client that reconnects waits a second, not the default three (said with
                // the first event: a block of `retry` alone is an empty event to some clients).
                let mut retry = Some("retry: 1000\n");
                let ended = stream::follow(
                    db.as_ref(),
                    &watch,
                    &id,
                    cursor,
                    submitter,
                    stop,
                    &mut |out| {
                        if let (Some(r), Out::Event(_)) = (retry, &out) {
                            w.write_all(r.as_bytes())?;
                            retry = None;
                        }
                        write_event(w, out)
                    },
                );
                match ended {
                    Ok(_) => Ok(()),
                    Err(FollowError::Gone(e)) => Err(e),
                    // The client reconnects and resumes where it was.
                    Err(FollowError::Store(e)) => {
                        tracing::warn!(task = %id, error = %e, "event stream: cannot read the task");
                        write_event(w, Out::Idle)
                    }
                }
            }),
        }
    }
}

/// One event in the stream's format (its data is one line of JSON), or a keep-alive comment.
fn write_event(w: &mut dyn Write, out: Out<'_>) -> std::io::Result<()> {
    match out {
        Out::Event(e) => write!(w, "id: {}\nevent: {}\ndata: {}\n\n", e.id, e.kind, e.data)?,
        Out::Idle => w.write_all(b": keep-alive\n\n")?,
    }
    w.flush()
}
