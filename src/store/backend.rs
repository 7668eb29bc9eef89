//! The storage interface the daemon, the operator verbs and the tests talk to: enqueue, claim
//! with a lease and a fencing token, step commits in groups, recovery of expired leases,
//! operator decisions with their audit events, reads, memory notes, check and purge.
//!
//! Two backends implement it: [`Store`] (redb, one file, MultiWriter), the embedded default,
//! and [`super::pg::PgStore`] (PostgreSQL), for daemons on several hosts sharing one queue.
//! What each method must guarantee is written on it, and callers rely on nothing else. The
//! operator decisions are written once (in `ops`), over a [`DecisionTx`] of either backend.

use crossbeam_channel::Receiver;

use super::check::CheckReport;
use super::list::{ListQuery, Page};
use super::ops::{self, Decision, DecisionTx, Event, Extension, Reviewed, Settlement};
use super::{
    CallRecord, Commit, CommitOutcome, Enqueued, Error, Lease, NewTask, QueueStatus, Result,
    TaskRecord,
};
use crate::kernel::memory::Note;
use crate::kernel::{Span, ToolCall};
use crate::model::RecordedReply;

/// The held writes, each with its call record (`Err` names a damaged one).
pub type HeldWrites = Vec<(TaskRecord, std::result::Result<Option<CallRecord>, String>)>;

/// A database of tasks, as every part of Tether sees it.
pub trait Backend: Send + Sync {
    /// The id that prefixes every call key of this database.
    fn db_id(&self) -> &str;

    /// What kind of database this is, for logs and errors ("redb file x", "PostgreSQL at y").
    fn describe(&self) -> String;

    /// Whether a lease owner on this machine can be judged dead by its process id. True for
    /// a file on one host; false for a database shared by hosts, where owners prove they are
    /// alive by heartbeats instead (containers may share a host name and pid numbers).
    fn local_owners(&self) -> bool {
        true
    }

    /// Whether concurrent commits gain from sharing one transaction (a single-writer file:
    /// one fsync for many steps). A server with a connection per thread commits in parallel
    /// instead, and groups the flushes itself.
    fn groups_commits(&self) -> bool {
        true
    }

    /// Records that the daemon `owner` is alive until `until_ms`; a backend shared by hosts
    /// takes over the claims of an owner whose heartbeat ran out.
    fn heartbeat(&self, _owner: &str, _now_ms: u64, _until_ms: u64) -> Result<()> {
        Ok(())
    }

    /// The daemon `owner` is stopping: its heartbeat is removed.
    fn sign_off(&self, _owner: &str) -> Result<()> {
        Ok(())
    }

    /// A channel that receives a message whenever a task may have become ready (PostgreSQL's
    /// LISTEN/NOTIFY), so an idle daemon starts it at once; `None` when the daemon must poll.
    fn wakeups(&self) -> Option<Receiver<()>> {
        None
    }

    /// Enqueues tasks in one transaction. A task whose key was seen before is not created
    /// again (its id is returned with `created: false`); a key reused for another request is
    /// a `Conflict`.
    fn enqueue(&self, tasks: &[NewTask], now_ms: u64) -> Result<Vec<Enqueued>>;

    /// Takes up to `max` ready tasks, highest priority first, each under a new fencing token
    /// (its claim count); a task that cannot be read is quarantined, never returned.
    fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>>;

    /// How long the claim `token` of task `id` is certain to stay the caller's, in ms by the
    /// database's clock: the least of its lease and (on a shared backend) its owner's
    /// heartbeat. `None` when it is not the task's current claim any more (taken over,
    /// requeued, superseded): nothing may be sent under it. A daemon asks right before a
    /// write goes out.
    fn claim_left(&self, id: &str, token: u64, now_ms: u64) -> Result<Option<u64>>;

    /// Renews the lease of claim `token` of task `id` to `lease_ms` plus the task's remaining
    /// active time from now; `false` when it is not the task's current claim.
    fn renew_claim(&self, id: &str, token: u64, now_ms: u64, lease_ms: u64) -> Result<bool>;

    /// How many tasks wait in the ready queue.
    fn ready_count(&self) -> Result<u64>;

    /// How many tasks some worker is running.
    fn running_count(&self) -> Result<u64>;

    /// Puts back in the queue every running task whose lease expired or whose owner
    /// `is_dead` (or, on a shared backend, whose owner's heartbeat ran out), except the claims
    /// `live` names. Returns the ids recovered.
    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>>;

    /// Applies `commits` in one transaction, in order. A commit whose claim is no longer the
    /// task's current one is refused alone (`None`), with nothing of it written; any other
    /// failure aborts the whole transaction (`Err`, naming the task when one caused it), so
    /// either every accepted commit landed or none did. A commit whose acknowledgment was lost
    /// is not an error: the backend finds out whether it landed before it answers.
    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String>;

    /// Runs one operator decision in one transaction: committed when `f` returns `Ok`, rolled
    /// back when it returns `Err`.
    fn decide(&self, f: &mut dyn FnMut(&mut dyn DecisionTx) -> Result<()>) -> Result<()>;

    /// The call record under `key`: a write's intent and, once known, its result.
    fn call(&self, key: &str) -> Result<Option<CallRecord>>;

    /// The model reply recorded for step `step` of task `task_id`, if a run got that far.
    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>>;

    fn task(&self, id: &str) -> Result<TaskRecord>;

    /// Every task that can be read, in id order; damaged ones are in [`Backend::damaged`].
    fn tasks(&self) -> Result<Vec<TaskRecord>>;

    /// Tasks that cannot be read, with why. Reads every task: for `check` and
    /// `list --status damaged`, never for a page.
    fn damaged(&self) -> Result<Vec<(String, String)>>;

    /// One page of tasks, newest first, read through an index: never every task.
    fn list(&self, q: &ListQuery) -> Result<Page>;

    /// How many tasks are in each queue status, without counting them one by one.
    fn counts(&self) -> Result<Vec<(QueueStatus, u64)>>;

    /// When the oldest queued task was enqueued.
    fn oldest_queued_ms(&self) -> Result<Option<u64>>;

    /// The id of the task enqueued under `key`.
    fn task_by_key(&self, key: &str) -> Result<Option<String>>;

    /// A task named by its id or by `key:KEY` (its enqueue key), as operators address it.
    fn resolve(&self, name: &str) -> Result<String> {
        match name.strip_prefix("key:") {
            Some(key) => self
                .task_by_key(key)?
                .ok_or_else(|| Error::NoTask(format!("key:{key} (no task was enqueued under it)"))),
            None => Ok(name.to_string()),
        }
    }

    fn spans(&self, task_id: &str) -> Result<Vec<Span>>;

    /// Spans committed for live export and not yet sent: at most `max` entries, oldest first.
    fn outbox(&self, max: usize) -> Result<Vec<super::OutboxEntry>>;

    /// Drops the oldest outbox entries while more than `keep` wait; returns the entries and
    /// spans dropped.
    fn outbox_trim(&self, keep: usize) -> Result<(u64, u64)>;

    /// Gives up the entries this process claimed to export and did not send (it stops).
    fn outbox_release(&self) -> Result<()> {
        Ok(())
    }

    /// Forgets outbox entries that were sent (or dropped).
    fn outbox_done(&self, seqs: &[u64]) -> Result<()>;

    fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>>;

    /// Every call-key record of a task.
    fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>>;

    /// The audit log, of one task when given, in order.
    fn events(&self, task: Option<&str>) -> Result<Vec<Event>>;

    /// The ids of the tasks whose write is held (see [`ops::is_held`]), in id order.
    fn held_ids(&self) -> Result<Vec<String>>;

    /// The suspended tasks whose approval wait ran out by `now_ms`.
    fn due_approvals(&self, now_ms: u64) -> Result<Vec<String>>;

    /// Stores a long-term memory note if the policy admits it, with its audit event.
    fn add_note(
        &self,
        user: &str,
        text: &str,
        source: &str,
        ttl_s: u64,
        d: &Decision,
    ) -> Result<Note>;

    /// Notes, of one user when given; expired ones only with `all`.
    fn notes(&self, user: Option<&str>, now_ms: u64, all: bool) -> Result<Vec<Note>>;

    /// Deletes a user's notes, only those from `source` when given. Returns how many.
    fn forget(&self, user: &str, source: Option<&str>, d: &Decision) -> Result<usize>;

    /// Verifies every record.
    fn check(&self) -> Result<CheckReport>;

    /// Deletes finished tasks last updated before `before_ms` (but a cancelled task whose
    /// write is still held), with everything recorded of them, at most `batch` per
    /// transaction, with one `purge` event per transaction. Returns the ids deleted.
    fn purge(&self, before_ms: u64, batch: usize, d: &Decision) -> Result<Vec<String>>;

    /// The call key of `call` made at the current step of task `rec`, in its namespace.
    fn call_key(&self, rec: &TaskRecord, call: &ToolCall) -> String {
        rec.call_key(self.db_id(), call)
    }

    /// Stops every suspended task whose approval wait ran out, with its audit event.
    fn expire_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        let due = self.due_approvals(now_ms)?;
        if due.is_empty() {
            return Ok(due);
        }
        let mut done = Vec::new();
        self.decide(&mut |tx| {
            done = ops::expire(tx, &due, now_ms)?;
            Ok(())
        })?;
        Ok(done)
    }

    /// The held writes: tasks stopped with `unknown_outcome` (or cancelled while held), each
    /// with its call record. A write stays listed until it is settled.
    fn held(&self) -> Result<HeldWrites> {
        let mut out = Vec::new();
        for id in self.held_ids()? {
            let rec = self.task(&id)?;
            let Some(c) = rec.state.unknown_write() else {
                continue;
            };
            if !ops::is_held(&rec) {
                continue;
            }
            let call = self
                .call(&self.call_key(&rec, c))
                .map_err(|e| e.to_string());
            out.push((rec, call));
        }
        Ok(out)
    }

    /// Approves exactly the held call of a suspended task; see [`ops::approve`].
    fn approve(
        &self,
        id: &str,
        reviewed: &Reviewed,
        extend: &Extension,
        d: &Decision,
    ) -> Result<ToolCall> {
        decided(self, id, "approve", d, &mut |tx| {
            ops::approve(tx, id, reviewed, extend, d)
        })
    }

    /// Rejects the held call; see [`ops::reject`].
    fn reject(&self, id: &str, reviewed: &Reviewed, d: &Decision) -> Result<ToolCall> {
        decided(self, id, "reject", d, &mut |tx| {
            ops::reject(tx, id, reviewed, d)
        })
    }

    /// Settles a held write; see [`ops::reconcile`].
    fn reconcile(
        &self,
        id: &str,
        s: &Settlement,
        reviewed: &Reviewed,
        extend: &Extension,
        d: &Decision,
    ) -> Result<ToolCall> {
        decided(self, id, "reconcile", d, &mut |tx| {
            ops::reconcile(tx, id, s, reviewed, extend, d)
        })
    }

    /// Cancels task `id` if a cancel was requested while it ran and its run ended waiting;
    /// see [`ops::complete_requested_cancel`].
    fn complete_requested_cancel(&self, id: &str, now_ms: u64) -> Result<bool> {
        let mut done = false;
        self.decide(&mut |tx| {
            done = ops::complete_requested_cancel(tx, id, now_ms)?;
            Ok(())
        })?;
        Ok(done)
    }

    /// Cancels a task; see [`ops::cancel`].
    fn cancel(&self, id: &str, d: &Decision) -> Result<QueueStatus> {
        decided(self, id, "cancel", d, &mut |tx| ops::cancel(tx, id, d))
    }

    /// Cancels a task unless it changed since `seen` (its last change when the operator
    /// looked); see [`ops::cancel_seen`].
    fn cancel_seen(&self, id: &str, seen: u64, d: &Decision) -> Result<QueueStatus> {
        decided(self, id, "cancel", d, &mut |tx| {
            ops::cancel_seen(tx, id, Some(seen), d)
        })
    }
}

/// Runs a decision: commits when it decided (even when its answer is a refusal it records),
/// and logs it once it committed.
fn decided<B: Backend + ?Sized, T>(
    b: &B,
    task: &str,
    verb: &str,
    d: &Decision,
    f: &mut dyn FnMut(&mut dyn DecisionTx) -> ops::Decided<T>,
) -> Result<T> {
    let mut answer = None;
    b.decide(&mut |tx| {
        answer = Some(f(tx)?);
        Ok(())
    })?;
    let answer = answer.unwrap_or_else(|| Err(Error::Conflict("the decision was not run".into())));
    match &answer {
        Ok(_) => tracing::info!(task, verb, by = %d.by, reason = ?d.reason, "decision recorded"),
        Err(e) => tracing::info!(task, verb, by = %d.by, error = %e, "decision refused"),
    }
    answer
}

/// How a caller means to use the database it opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A daemon or an enqueue: create the file or apply the migrations if needed; reconnect
    /// for longer when the server is away.
    Create,
    /// An operator decision: the database must exist.
    Write,
    /// A read verb: the database must exist; a redb file is opened read-only.
    Read,
}

/// Opens the database `db` names: a PostgreSQL URL (`postgres://...`) or a redb file path.
/// `connections` sizes a PostgreSQL pool (the daemon's threads and its own needs).
pub fn open_backend(
    db: &str,
    access: Access,
    connections: usize,
) -> Result<std::sync::Arc<dyn Backend>> {
    use std::sync::Arc;
    if super::pg::is_url(db) {
        let retry = match access {
            Access::Create => super::pg::DAEMON_RETRY,
            _ => super::pg::CLI_RETRY,
        };
        let s = super::pg::PgStore::open(db, access == Access::Create, connections, retry)?;
        return Ok(Arc::new(s));
    }
    let path = std::path::Path::new(db);
    Ok(match access {
        Access::Create => Arc::new(super::Store::open(path, true)?),
        Access::Write => Arc::new(super::Store::open(path, false)?),
        Access::Read => Arc::new(super::Store::open_for_reading(path)?),
    })
}
