//! A task's live events, as the HTTP API's Server-Sent Events stream
//! (`GET /api/v1/tasks/{id}/events` with `Accept: text/event-stream`) and `worker watch` show
//! them: each step once it is recorded (its model's move, its tool calls and their results), each
//! held call sent after a person's decision (a resume), each decision a person took on it, and
//! each change of its status, up to its end.
//!
//! Every event is read from what is durably recorded, never from a daemon's memory: the steps
//! from their spans (a step's spans are committed with the step, once it ends), the decisions
//! from the audit log, the status from the task's record. So any process that can read the
//! database serves the stream, and an event is sent only once it can no longer be taken back.
//!
//! An event's id is a cursor: how many step events came before it and with it, the audit
//! sequence number last sent, and the status last sent (`12.40.running`). A client that
//! reconnects with it (`Last-Event-ID`) gets exactly what it has not seen: the step events and
//! decisions after it, each once, and the status if it changed meanwhile. Statuses are
//! snapshots: one a task passed through while no client was reading is not replayed (the
//! decisions that moved it are).

use serde_json::{Value, json};
use std::time::{Duration, Instant};

use crate::kernel::{Span, SpanKind};
use crate::model::{RecordedOutcome, RecordedReply};
use crate::store::prelude::*;
use crate::store::result::result_json;
use crate::store::watch::Watch;
use crate::store::{QueueStatus, Result, TaskRecord};

/// Where a reader of a task's events stands: what it has seen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cursor {
    /// Step events seen (steps, model moves, tool calls), counted from the task's first.
    pub steps: u64,
    /// The audit sequence number of the last decision seen (0: none).
    pub audit: u64,
    /// The status last seen, as [`status_tag`] writes it ("" before the first).
    pub status: String,
}

impl Cursor {
    /// Reads an event id this stream sent (`STEPS.AUDIT.STATUS`: at most 19 digits, 19 digits,
    /// and at most 64 of `a-z0-9_:`).
    pub fn parse(id: &str) -> std::result::Result<Cursor, String> {
        let bad = || {
            format!(
                "`{}` is not an event id of this stream (they look like 12.40.running: the events seen, the last decision's number, the status seen)",
                crate::limits::printable(&clip(id, 64))
            )
        };
        let number = |p: Option<&str>| -> Option<u64> {
            let p = p?;
            let digits = !p.is_empty() && p.len() <= 19 && p.bytes().all(|b| b.is_ascii_digit());
            digits.then(|| p.parse().ok()).flatten()
        };
        let mut parts = id.splitn(3, '.');
        let steps = number(parts.next()).ok_or_else(bad)?;
        let audit = number(parts.next()).ok_or_else(bad)?;
        let status = parts.next().ok_or_else(bad)?;
        if status.len() > 64
            || !status
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b':')
        {
            return Err(bad());
        }
        Ok(Cursor {
            steps,
            audit,
            status: status.to_string(),
        })
    }

    /// The id of an event sent at this point.
    pub fn id(&self) -> String {
        format!("{}.{}.{}", self.steps, self.audit, self.status)
    }
}

/// One event: its id (the cursor just after it), its kind, and its data.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub id: String,
    /// `step`, `model`, `tool`, `resume`, `decision`, `status` or `finished`.
    pub kind: &'static str,
    pub data: Value,
}

/// What [`read`] found after a cursor.
pub struct Batch {
    pub events: Vec<Event>,
    /// Where the reader stands after these events.
    pub cursor: Cursor,
    /// The task has finished: nothing will follow these events.
    pub finished: bool,
}

/// The status as a cursor holds it: a wait on a person carries its step and run, so a second
/// wait is a change even when the status reads the same (a second hold at one step comes in
/// a later run); a later turn of a conversation carries its number, so the end of turn 2 is
/// news to a reader who saw turn 1 end.
pub fn status_tag(rec: &TaskRecord) -> String {
    match (rec.status, rec.state.turn()) {
        (QueueStatus::Suspended | QueueStatus::Held, _) => {
            format!("{}:{}:{}", rec.status.as_str(), rec.state.step, rec.runs)
        }
        (s, 1) => s.as_str().to_string(),
        (s, turn) => format!("{}:{turn}", s.as_str()),
    }
}

/// The events of task `id` after `after`, in order: new step events, then new decisions, then
/// the status if it changed. `submitter`: decisions are shown as a submit token sees them.
pub fn read(db: &dyn Backend, id: &str, after: &Cursor, submitter: bool) -> Result<Batch> {
    read_if(db, id, after, submitter, &|_| true).map(|(b, _)| b)
}

/// [`read`], reading the audit log (all of it, on redb) only when `audit` says so of the task
/// as it now stands, or once it has finished; also returns whether it was read.
fn read_if(
    db: &dyn Backend,
    id: &str,
    after: &Cursor,
    submitter: bool,
    audit: &dyn Fn(&TaskRecord) -> bool,
) -> Result<(Batch, Option<(String, u64)>)> {
    let rec = db.task(id)?;
    let mut cursor = after.clone();
    let mut events = Vec::new();
    step_events_after(db, id, &mut cursor, &mut events)?;
    let finished = rec.status == QueueStatus::Finished;
    let read_audit = finished || audit(&rec);
    if read_audit {
        decisions_after(db, id, submitter, &mut cursor, &mut events)?;
    }
    let tag = status_tag(&rec);
    let seen = read_audit.then(|| (tag.clone(), rec.updated_at_ms));
    if tag != after.status {
        cursor.status = tag;
        events.push(Event {
            id: cursor.id(),
            kind: if finished { "finished" } else { "status" },
            data: result_json(db.db_id(), &rec),
        });
    }
    Ok((
        Batch {
            events,
            cursor,
            finished,
        },
        seen,
    ))
}

/// Pushes the step events after `cursor` onto `events`, moving the cursor past each.
fn step_events_after(
    db: &dyn Backend,
    id: &str,
    cursor: &mut Cursor,
    events: &mut Vec<Event>,
) -> Result<()> {
    let spans = db.spans(id)?;
    let after = cursor.steps;
    let mut seen = 0u64;
    for (step, children) in ended_units(&spans) {
        let count = 1 + children.len() as u64;
        if seen + count <= after {
            seen += count;
            continue;
        }
        let number = step_number(step);
        let reply = match number {
            Some(n) => db.reply(id, n)?,
            None => None,
        };
        for (kind, data) in step_events(step, number, &children, reply.as_ref()) {
            seen += 1;
            if seen > after {
                cursor.steps = seen;
                events.push(Event {
                    id: cursor.id(),
                    kind,
                    data,
                });
            }
        }
    }
    Ok(())
}

/// Pushes the task's audit events after `cursor` onto `events` (as a submit token sees them,
/// for one), moving the cursor past each.
fn decisions_after(
    db: &dyn Backend,
    id: &str,
    submitter: bool,
    cursor: &mut Cursor,
    events: &mut Vec<Event>,
) -> Result<()> {
    for e in db.events(Some(id))? {
        if e.seq <= cursor.audit {
            continue;
        }
        cursor.audit = e.seq;
        let detail = if submitter {
            crate::store::callbacks::submitters_view(&e.verb, &e.detail)
        } else {
            e.detail.clone()
        };
        events.push(Event {
            id: cursor.id(),
            kind: "decision",
            data: json!({
                "seq": e.seq,
                "at": crate::clock::rfc3339(e.at_ms),
                "verb": e.verb,
                "by": e.by,
                "reason": e.reason,
                "detail": detail,
            }),
        });
    }
    Ok(())
}

/// The ended step spans and resumes (a held call sent after a person's decision), oldest
/// first, each with its ended model and tool spans. A unit's spans are committed with it, and
/// units end one after another, so this list only grows at its end.
fn ended_units(spans: &[Span]) -> Vec<(&Span, Vec<&Span>)> {
    let mut steps: Vec<&Span> = spans
        .iter()
        .filter(|s| matches!(s.kind, SpanKind::Step | SpanKind::Resume) && s.t1_ms.is_some())
        .collect();
    steps.sort_by_key(|s| s.id);
    steps
        .into_iter()
        .map(|step| {
            let mut children: Vec<&Span> = spans
                .iter()
                .filter(|c| {
                    c.parent == Some(step.id)
                        && c.t1_ms.is_some()
                        && matches!(c.kind, SpanKind::Model | SpanKind::Tool)
                })
                .collect();
            children.sort_by_key(|c| c.id);
            (step, children)
        })
        .collect()
}

/// A step span's number, from its name (`step 3`).
fn step_number(step: &Span) -> Option<u32> {
    step.name.strip_prefix("step ")?.parse().ok()
}

/// A step's events: the step, then its model's move and its tool calls in the order made; a
/// resume's: the resume, then the held call it sent.
fn step_events(
    step: &Span,
    number: Option<u32>,
    children: &[&Span],
    reply: Option<&RecordedReply>,
) -> Vec<(&'static str, Value)> {
    let secs = |ms: Option<u64>| ms.map(|ms| ms as f64 / 1000.0);
    let mut out = vec![if step.kind == SpanKind::Resume {
        (
            "resume",
            json!({
                "what": step.name,
                "status": step.status,
                "started_s": secs(Some(step.t0_ms)),
                "ended_s": secs(step.t1_ms),
            }),
        )
    } else {
        (
            "step",
            json!({
                "step": number,
                "status": step.status,
                "started_s": secs(Some(step.t0_ms)),
                "ended_s": secs(step.t1_ms),
            }),
        )
    }];
    for c in children {
        let data = match c.kind {
            SpanKind::Model => json!({
                "step": number,
                "move": reply.map_or(Value::Null, move_summary),
                "status": c.status,
                "tokens_in": c.tin,
                "tokens_out": c.tout,
                "seconds": c.duration_ms() as f64 / 1000.0,
            }),
            _ => json!({
                "step": number,
                "tool": c.name,
                "args": c.args,
                "key": c.key,
                "result": c.status,
                "result_tokens": c.result_tokens,
                "seconds": c.duration_ms() as f64 / 1000.0,
            }),
        };
        out.push((
            if c.kind == SpanKind::Model {
                "model"
            } else {
                "tool"
            },
            data,
        ));
    }
    out
}

/// What the model proposed at a step, in a line and a few fields.
fn move_summary(reply: &RecordedReply) -> Value {
    let text = |s: &str| crate::limits::printable(&clip(s, 400)).into_owned();
    match &reply.outcome {
        RecordedOutcome::Json(v) => match v.get("type").and_then(Value::as_str) {
            Some("final") => json!({
                "kind": "answer",
                "outcome": v.get("outcome"),
                "summary": format!("answers: {}", text(v.get("text").and_then(Value::as_str).unwrap_or(""))),
            }),
            Some("plan") => {
                let tools: Vec<&str> = v
                    .get("steps")
                    .and_then(Value::as_array)
                    .map(|s| s.iter().filter_map(|s| s.get("tool")?.as_str()).collect())
                    .unwrap_or_default();
                json!({
                    "kind": "plan",
                    "summary": format!("plans {} step(s): {}", tools.len(), tools.join(", ")),
                })
            }
            Some("tool") => {
                let name = v.get("name").and_then(Value::as_str).unwrap_or("?");
                let question = v.pointer("/args/question").and_then(Value::as_str);
                match question {
                    Some(q) if name == crate::kernel::person::ASK_PERSON => {
                        json!({"kind": "question", "summary": format!("asks a person: {}", text(q))})
                    }
                    _ => json!({"kind": "tool_call", "summary": format!("calls {}", text(name))}),
                }
            }
            _ => json!({"kind": "unusable", "summary": "a reply that is no move"}),
        },
        RecordedOutcome::Text(t) => {
            json!({"kind": "prose", "summary": format!("replies in prose: {}", text(t))})
        }
        RecordedOutcome::Timeout => {
            json!({"kind": "timeout", "summary": "the model did not answer in time"})
        }
        RecordedOutcome::Failed(e)
        | RecordedOutcome::Invalid(e)
        | RecordedOutcome::Refused(e)
        | RecordedOutcome::Fatal(e) => {
            json!({"kind": "failed", "summary": format!("no move: {}", text(e))})
        }
    }
}

/// At most `max` bytes of `s`, cut at a character boundary, with an ellipsis when cut.
fn clip(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// What [`follow`] hands its writer.
pub enum Out<'a> {
    Event(&'a Event),
    /// Nothing happened for a while: a keep-alive (and a check that the reader is still there).
    Idle,
}

/// How often a follower with nothing to send says it is still there.
pub const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The longest a follower goes without reading the audit log while its task's record stays
/// as it was.
const AUDIT_EVERY: Duration = Duration::from_secs(5);

/// The longest a follower sleeps before reading again: PostgreSQL wakes waiters when a task
/// settles, not at each step, so steps reach a follower there within this.
const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Sends the events of task `id` after `cursor` to `out` as they are recorded, until the task
/// finishes (its `finished` event sent), `stop` says so, or `out` fails (the reader went
/// away). Returns where the reader stands.
pub fn follow(
    db: &dyn Backend,
    watch: &Watch,
    id: &str,
    mut cursor: Cursor,
    submitter: bool,
    stop: &dyn Fn() -> bool,
    out: &mut dyn FnMut(Out<'_>) -> std::io::Result<()>,
) -> std::result::Result<Cursor, FollowError> {
    let mut said = Instant::now();
    // The audit log is read whole (on redb), so a follower reads it when the task's record
    // moved since it last did (a decision writes the record with its event), and at least
    // every AUDIT_EVERY in case one did not.
    let mut audited: Option<((String, u64), Instant)> = None;
    loop {
        let generation = watch.generation();
        let due = |rec: &TaskRecord| match &audited {
            None => true,
            Some(((tag, at), when)) => {
                *tag != status_tag(rec) || *at != rec.updated_at_ms || when.elapsed() >= AUDIT_EVERY
            }
        };
        let (batch, seen) =
            read_if(db, id, &cursor, submitter, &due).map_err(FollowError::Store)?;
        if let Some(seen) = seen {
            audited = Some((seen, Instant::now()));
        }
        for e in &batch.events {
            out(Out::Event(e)).map_err(FollowError::Gone)?;
            said = Instant::now();
        }
        cursor = batch.cursor;
        if batch.finished || stop() {
            return Ok(cursor);
        }
        if said.elapsed() >= KEEP_ALIVE {
            out(Out::Idle).map_err(FollowError::Gone)?;
            said = Instant::now();
        }
        watch.wait(generation, Instant::now() + LOOK_EVERY);
    }
}

/// Why [`follow`] stopped before the task's end.
#[derive(Debug)]
pub enum FollowError {
    /// A read of the database failed.
    Store(crate::store::Error),
    /// The reader went away.
    Gone(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_id_reads_back_as_its_cursor_and_bad_ones_say_what_they_look_like() {
        let c = Cursor {
            steps: 12,
            audit: 40,
            status: "suspended:3:2".into(),
        };
        assert_eq!(Cursor::parse(&c.id()), Ok(c));
        assert_eq!(Cursor::parse("0.0.").map(|c| c.steps), Ok(0));
        for bad in [
            "",
            "x.1.running",
            "1.x.running",
            "1.2",
            "1.2.Running",
            "1.2.a b",
        ] {
            let e = Cursor::parse(bad).expect_err(bad);
            assert!(e.contains("12.40.running"), "{e}");
        }
    }

    #[test]
    fn a_long_text_is_clipped_at_a_character() {
        assert_eq!(clip("héllo", 2), "h…");
        assert_eq!(clip("hi", 2), "hi");
    }
}
