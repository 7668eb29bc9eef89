//! Waiting for a task's result: until it finishes or starts waiting on a person (or, with
//! [`Until::Finished`], through any wait on a person to its end), woken by the database's own
//! wake-ups ([`Watch`]) rather than by polling. The CLI's `worker wait` and
//! `enqueue --wait` and the HTTP API's long poll are callers.

use std::time::Instant;

use crate::store::prelude::*;
use crate::store::result::Ending;
use crate::store::watch::Watch;
use crate::store::{QueueStatus, Result, TaskRecord};

/// How a wait ended.
pub enum Waited {
    /// The task settled: it finished, or it waits on a person.
    Settled(TaskRecord, Ending),
    /// `until` came first; the task as it stood then (queued or running).
    TimedOut(TaskRecord),
}

/// How far a wait goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    /// Until the task finishes or starts waiting on a person (an approval, a held write).
    Settled,
    /// Until the task finishes: its waits on a person are waited through.
    Finished,
}

/// Waits until task `id` settles (as `how` says) or `until` comes (never, when `None`).
/// Reads the task once, then once per wake-up of `watch` (or per poll where the backend has
/// none). With [`Until::Finished`], `on_person` is told of each wait on a person the task
/// starts (once per held call), and the wait goes on.
pub fn wait(
    db: &dyn Backend,
    watch: &Watch,
    id: &str,
    until: Option<Instant>,
    how: Until,
    on_person: &mut dyn FnMut(&TaskRecord),
) -> Result<Waited> {
    let mut reads = 0u64;
    let mut told: Option<(QueueStatus, Option<String>)> = None;
    loop {
        let seen = watch.generation();
        let rec = db.task(id)?;
        reads += 1;
        tracing::debug!(task = %id, reads, status = rec.status.as_str(), "wait: read the task");
        match Ending::of(&rec) {
            Some(Ending::Waiting) if how == Until::Finished => {
                // Each held call once: its call key (a second hold of the same arguments at
                // a later step is another call, with a key of its own).
                let now = (
                    rec.status,
                    rec.state.pending.as_ref().map(|p| db.call_key(&rec, p)),
                );
                if told.as_ref() != Some(&now) {
                    on_person(&rec);
                    told = Some(now);
                }
            }
            Some(ending) => return Ok(Waited::Settled(rec, ending)),
            None => {}
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
