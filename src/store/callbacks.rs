//! The completion-callback outbox, as both engines keep it. When a task settles (finishes, or
//! starts waiting on a person) and it names a callback URL, the commit or decision that settles
//! it adds, in its own transaction, a [`Callback`]: the event's id and body, fixed then. The
//! daemon's sender claims due callbacks, POSTs them signed (Standard Webhooks), and removes
//! the ones a receiver accepted; a failed attempt is tried again later, under the same id and
//! with the same body, until its retry window ends (then an audit event says it was given
//! up). So a settled task's callback survives any crash until it is delivered, a receiver
//! deduplicating by id sees each event once, and a receiver that is down costs tasks nothing.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::result::result_json;
use super::{QueueStatus, TaskRecord, random_u64};
use crate::clock::rfc3339;

/// A callback waiting to be delivered.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Callback {
    /// Its place in the outbox (0 until stored).
    pub seq: u64,
    /// The `webhook-id`: the same on every attempt, so receivers deduplicate.
    pub id: String,
    pub task_id: String,
    pub url: String,
    /// The JSON body: `{"type", "timestamp", "data"}`, `data` the task's result then.
    pub payload: String,
    pub created_at_ms: u64,
    /// Attempts made so far.
    pub attempts: u32,
    /// Not sent before this time (ms since the epoch).
    pub next_at_ms: u64,
    pub last_error: Option<String>,
}

/// An error as a callback row keeps it: at most 500 characters.
pub fn clip(error: &str) -> String {
    error.chars().take(500).collect()
}

/// The detail of the audit event that records a callback given up.
pub fn given_up_detail(cb: &Callback, why: &str) -> serde_json::Value {
    json!({
        "webhook_id": cb.id,
        "url": cb.url,
        "attempts": cb.attempts,
        "created_at": rfc3339(cb.created_at_ms),
        "last_error": cb.last_error,
        "why": clip(why),
    })
}

/// A `callback_failed` event's detail as a task's submitter may read it: without the errors,
/// which would tell what answers (or not) at the addresses the callback allow-list admits. The
/// audit log keeps them for operators, and the daemon's log has every attempt's.
pub fn submitters_view(verb: &str, detail: &serde_json::Value) -> serde_json::Value {
    if verb != "callback_failed" {
        return detail.clone();
    }
    let mut d = detail.clone();
    if let Some(m) = d.as_object_mut() {
        m.insert("last_error".into(), serde_json::Value::Null);
        m.insert(
            "why".into(),
            json!("no receiver accepted it within the retry window (an operator can see why)"),
        );
    }
    d
}

/// The event type of a task that settled as `status`.
pub fn event_type(status: QueueStatus) -> Option<&'static str> {
    match status {
        QueueStatus::Finished => Some("task.finished"),
        QueueStatus::Suspended | QueueStatus::Held => Some("task.waiting"),
        QueueStatus::Queued | QueueStatus::Running => None,
    }
}

/// The callback of task `rec` (of the database `db_id`), which just settled at `now_ms`: none
/// when it names no callback URL or has not settled.
pub fn event(db_id: &str, rec: &TaskRecord, now_ms: u64) -> Option<Callback> {
    let url = rec.callback_url.clone()?;
    let kind = event_type(rec.status)?;
    // Who created the task travels in what is signed, so a receiver that several submitters
    // point at can tell whose task it is (a submit token's name; null for an operator's token
    // or `worker enqueue`).
    let payload = json!({
        "type": kind,
        "timestamp": rfc3339(now_ms),
        "submitted_by": rec.submitted_by,
        "data": result_json(db_id, rec),
    });
    Some(Callback {
        seq: 0,
        id: format!("msg_{:016x}{:016x}", random_u64(), random_u64()),
        task_id: rec.id.clone(),
        url,
        payload: payload.to_string(),
        created_at_ms: now_ms,
        attempts: 0,
        next_at_ms: now_ms,
        last_error: None,
    })
}
