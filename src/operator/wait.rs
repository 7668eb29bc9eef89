//! Waiting for a task's result: until it finishes or starts waiting on a person, woken by the
//! database's own wake-ups ([`Watch`]) rather than by polling. The CLI's `worker wait` and
//! `enqueue --wait` and the HTTP API's long poll are callers.

use std::time::Instant;

use crate::store::prelude::*;
use crate::store::result::Ending;
use crate::store::watch::Watch;
use crate::store::{Result, TaskRecord};

/// How a wait ended.
pub enum Waited {
    /// The task settled: it finished, or it waits on a person.
    Settled(TaskRecord, Ending),
    /// `until` came first; the task as it stood then (queued or running).
    TimedOut(TaskRecord),
}

/// Waits until task `id` settles or `until` comes (never, when `None`). Reads the task once,
/// then once per wake-up of `watch` (or per poll where the backend has none).
pub fn wait(db: &dyn Backend, watch: &Watch, id: &str, until: Option<Instant>) -> Result<Waited> {
    let mut reads = 0u64;
    loop {
        let seen = watch.generation();
        let rec = db.task(id)?;
        reads += 1;
        tracing::debug!(task = %id, reads, status = rec.status.as_str(), "wait: read the task");
        if let Some(ending) = Ending::of(&rec) {
            return Ok(Waited::Settled(rec, ending));
        }
        // Long enough for any wait a person asks for; Instant cannot hold "forever".
        let far = Instant::now() + std::time::Duration::from_secs(365 * 24 * 3600);
        let until = until.unwrap_or(far);
        if Instant::now() >= until {
            return Ok(Waited::TimedOut(rec));
        }
        watch.wait(seen, until);
    }
}
