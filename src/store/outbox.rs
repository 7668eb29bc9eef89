//! The span outbox of live OTLP export, as both engines keep it. A commit made by a daemon
//! that exports adds, in its own transaction, an entry naming the spans it ended; the exporter reads entries oldest
//! first, sends those spans, and removes the entries it sent. So a step that was not committed
//! is never exported, a committed one survives a crash until it is sent, and memory holds a
//! batch, never the backlog (a receiver that is down makes the table grow on disk instead).

use super::{Commit, CommitKind, QueueStatus};

/// The number standing for a task's root span in an outbox entry (`crate::otlp::root_of`): no
/// stored span has it (-1 in PostgreSQL's `int[]`).
pub const ROOT: u32 = u32::MAX;

/// Spans of one commit waiting to be exported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutboxEntry {
    pub seq: u64,
    pub task_id: String,
    pub spans: Vec<u32>,
}

/// The ids of the spans `c` ends (an open span is exported once it ends, by a later commit),
/// and [`ROOT`] when it finishes the task (the root span ends with the task).
pub fn ended(c: &Commit) -> Vec<u32> {
    let mut ids: Vec<u32> = c
        .spans
        .iter()
        .filter(|s| s.t1_ms.is_some())
        .map(|s| s.id)
        .collect();
    if let CommitKind::Final(stop) = c.kind
        && QueueStatus::after(stop) == QueueStatus::Finished
    {
        ids.push(ROOT);
    }
    ids
}
