//! The storage interface every part of Tether talks to, and every type it speaks: a
//! [`Backend`] is a database of tasks, with enqueue, claim under a lease and a fencing token,
//! step commits in groups, recovery of expired leases, one transaction per operator decision,
//! reads, memory notes, check and purge, and the span outbox of live export.
//!
//! Two engines implement it, file for file: `store::redb` (one file, the embedded default)
//! and `store::pg` (PostgreSQL, for daemons on several hosts sharing one queue). The interface
//! is split by concern into the traits below (`Queue`, `Commits`, `Decide`, `Reads`, `Lists`,
//! `Notes`, `Maintenance`, `Outbox`); each engine implements each of them in the file of the
//! same name, directly. [`Backend`] is all of them together; `use crate::store::prelude::*`
//! brings their methods into scope. What each method must guarantee is written on it, and
//! callers rely on nothing else. Policy (what an operator may decide, and with which
//! messages) is not here: it lives in `operator`, over a [`DecisionTx`].

use crossbeam_channel::Receiver;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::PathBuf;

use super::list::{ListQuery, Page};
use super::{CallRecord, Commit, CommitOutcome, Enqueued, Lease, NewTask, QueueStatus, TaskRecord};
use super::{Callback, OutboxEntry};
use crate::kernel::memory::Note;
use crate::kernel::{Span, ToolCall};
use crate::model::RecordedReply;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database error: {0}")]
    Db(#[from] ::redb::Error),
    #[error("the database is damaged: {0}")]
    Corrupt(String),
    #[error(
        "{what} was written by a newer version of Tether (version {found}; this build reads up to {supported})"
    )]
    NewerVersion {
        what: String,
        found: u64,
        supported: u64,
    },
    #[error("no database at {0}")]
    Missing(PathBuf),
    #[error("cannot open {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("no task {0:?}")]
    NoTask(String),
    /// The request itself is wrong (a usage error).
    #[error("{0}")]
    Invalid(String),
    /// The request is fine but the task is not in a state that allows it.
    #[error("{0}")]
    Conflict(String),
    #[error("the lease on task {0} is no longer held by this worker")]
    LeaseLost(String),
    /// The database cannot be reached (after retrying): nothing is known to have changed.
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    /// PostgreSQL refused a statement (SQLSTATE and message).
    #[error("PostgreSQL error {0}")]
    Postgres(String),
    /// A connection was refused for good: by the server (authentication, a role or database
    /// that does not exist) or by our check of its certificate. Trying again would not help.
    #[error("{0}")]
    Refused(String),
    /// Another process has the file open for writing in a mode that excludes this open: a
    /// daemon not started with `--shared` (the file's only writer while it runs), or, for
    /// such a daemon, processes that share the file for writing.
    #[error("{} is open for writing in another process, in a mode that excludes this one", .0.display())]
    InUse(PathBuf),
    /// The daemon that owns the file answered a request it was passed with this error.
    #[error("{0}")]
    Daemon(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// One line of the audit log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    pub at_ms: u64,
    pub task: Option<String>,
    pub verb: String,
    pub by: String,
    pub reason: Option<String>,
    pub detail: Value,
}

/// Who decides, why, and when.
#[derive(Clone, Debug)]
pub struct Decision {
    pub by: String,
    pub reason: Option<String>,
    pub now_ms: u64,
}

/// One transaction of a backend, as an operator decision sees it. Each backend implements
/// it over its own transaction; the decisions below are written once, against it, so both
/// backends check and apply every decision the same way.
pub trait DecisionTx {
    /// This database's id (a task's call keys are in its namespace: `TaskRecord::call_key`).
    fn db_id(&self) -> &str;
    /// The task `id`, read for update (a concurrent decision on it waits or is refused).
    fn load(&mut self, id: &str) -> Result<TaskRecord>;
    /// Writes the task. What it is indexed under follows from the record: queued tasks (new
    /// in the queue when `was` is not queued) in the ready queue, suspended ones by when their
    /// wait runs out, and a write with an unknown outcome (held, or cancelled while held) in
    /// the held list until it is settled.
    fn save(&mut self, rec: &TaskRecord, was: QueueStatus) -> Result<()>;
    /// Appends an audit event; returns its sequence number.
    fn event(&mut self, task: Option<&str>, verb: &str, d: &Decision, detail: Value)
    -> Result<u64>;
    /// The call record under `key`: `Some(Err)` when it exists but cannot be read.
    fn call(&mut self, key: &str) -> Result<Option<std::result::Result<CallRecord, String>>>;
    fn put_call(&mut self, c: &CallRecord) -> Result<()>;
    /// Every call record of task `rec`; one that cannot be read is `Err((key, why))`.
    fn calls(
        &mut self,
        rec: &TaskRecord,
    ) -> Result<Vec<std::result::Result<CallRecord, (String, String)>>>;
    /// Queues the root span of task `id`, which this decision finished, for live export: in
    /// the decision's transaction, and only if a daemon ever exported from this database.
    fn queue_root(&mut self, id: &str) -> Result<()>;
    /// Queues the completion callback of a task this decision settled, in its transaction.
    fn queue_callback(&mut self, cb: &Callback) -> Result<()>;
}

/// What a waiter waits for ([`Queue::changes`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Watched {
    /// Tasks settling: finishing, or starting to wait on a person (`worker wait`, long polls).
    Settled,
    /// Completion callbacks added to the outbox (the daemon's sender).
    Callbacks,
}

/// The wake-ups of [`Queue::changes`]: the receiver, and what keeps its source alive (a
/// watch's thread, a LISTEN session), stopped when this is dropped.
pub struct Changes {
    pub rx: Receiver<()>,
    pub guard: Box<dyn Send>,
}

/// What `worker check` found.
#[derive(Debug, Default)]
pub struct CheckReport {
    /// Records read, by table.
    pub records: BTreeMap<&'static str, u64>,
    /// One line per damaged record or table, naming it and what is wrong.
    pub damaged: Vec<String>,
}

impl CheckReport {
    pub fn ok(&self) -> bool {
        self.damaged.is_empty()
    }
}

/// A database of tasks, as every part of Tether sees it: all of the interface's parts.
pub trait Backend:
    Queue
    + Commits
    + Decide
    + Reads
    + Lists
    + Notes
    + Maintenance
    + Outbox
    + Callbacks
    + RateLimits
    + Schedules
    + Send
    + Sync
{
    /// The id that prefixes every call key of this database.
    fn db_id(&self) -> &str;

    /// What kind of database this is, for logs and errors ("the redb file x", "PostgreSQL at y").
    fn describe(&self) -> String;

    /// A task named by its id or by `key:KEY` (its enqueue key), as operators address it.
    fn resolve(&self, name: &str) -> Result<String> {
        match name.strip_prefix("key:") {
            Some(key) => self
                .task_by_key(key)?
                .ok_or_else(|| Error::NoTask(format!("key:{key} (no task was enqueued under it)"))),
            None => Ok(name.to_string()),
        }
    }

    /// The call key of `call` made at the current step of task `rec`, in its namespace.
    fn call_key(&self, rec: &TaskRecord, call: &ToolCall) -> String {
        rec.call_key(self.db_id(), call)
    }
}

/// The queue: enqueue, claims under leases and fencing tokens, daemons' liveness, recovery.
pub trait Queue {
    /// Whether a lease owner on this machine can be judged dead by its process id. True for
    /// a file on one host; false for a database shared by hosts, where owners prove they are
    /// alive by heartbeats instead (containers may share a host name and pid numbers).
    fn local_owners(&self) -> bool;

    /// Records that the daemon `owner` is alive until `until_ms`; a backend shared by hosts
    /// takes over the claims of an owner whose heartbeat ran out.
    fn heartbeat(&self, owner: &str, now_ms: u64, until_ms: u64) -> Result<()>;

    /// The daemon `owner` is stopping: its heartbeat is removed.
    fn sign_off(&self, owner: &str) -> Result<()>;

    /// The concurrency limits this process's claims apply (a daemon's `[concurrency]`); none
    /// until set.
    fn set_limits(&self, limits: crate::store::flow::ConcurrencyLimits);

    /// The earliest start time after `now_ms` of a queued task (a delayed start, or a task
    /// waiting for its model's capacity), so an idle daemon sleeps until then.
    fn next_start_ms(&self, now_ms: u64) -> Result<Option<u64>>;

    /// A channel that receives a message whenever a task may have become ready (PostgreSQL's
    /// LISTEN/NOTIFY), so an idle daemon starts it at once; `None` when the daemon must poll.
    fn wakeups(&self) -> Option<Receiver<()>>;

    /// Wake-ups from this process: a message after each enqueue or decision made through this
    /// store (a daemon's local API, socket and console), sent once it committed, so the
    /// daemon's dispatcher learns of it directly (no round trip through the file or the server).
    fn woken(&self) -> Receiver<()>;

    /// Wake-ups for whoever waits for what `of` names: a message arrives after each change
    /// that may have brought it (PostgreSQL's LISTEN on a trigger-fed channel; on the file, a
    /// watch on its writes), so a waiter reads again only then. `None`: no wake-ups here, the
    /// waiter must poll.
    fn changes(&self, of: Watched) -> Option<Changes>;

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
}

/// Step commits: the hot path.
pub trait Commits {
    /// Whether concurrent commits gain from sharing one transaction (a single-writer file:
    /// one fsync for many steps). A server with a connection per thread commits in parallel
    /// instead, and groups the flushes itself.
    fn groups_commits(&self) -> bool;

    /// Applies `commits` in one transaction, in order. A commit whose claim is no longer the
    /// task's current one is refused alone (`None`), with nothing of it written; any other
    /// failure aborts the whole transaction (`Err`, naming the task when one caused it), so
    /// either every accepted commit landed or none did. A commit whose acknowledgment was lost
    /// is not an error: the backend finds out whether it landed before it answers.
    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String>;
}

/// One transaction for an operator decision (the policy is in `operator`).
pub trait Decide {
    /// Runs one operator decision in one transaction: committed when `f` returns `Ok`, rolled
    /// back when it returns `Err`.
    fn decide(&self, f: &mut dyn FnMut(&mut dyn DecisionTx) -> Result<()>) -> Result<()>;
}

/// Reads of one task and of what was recorded of it.
pub trait Reads {
    /// The call record under `key`: a write's intent and, once known, its result.
    fn call(&self, key: &str) -> Result<Option<CallRecord>>;

    /// The model reply recorded for step `step` of task `task_id`, if a run got that far.
    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>>;

    fn task(&self, id: &str) -> Result<TaskRecord>;

    /// Every task that can be read, in id order; damaged ones are in [`Reads::damaged`].
    fn tasks(&self) -> Result<Vec<TaskRecord>>;

    /// Tasks that cannot be read, with why. Reads every task: for `check` and
    /// `list --status damaged`, never for a page.
    fn damaged(&self) -> Result<Vec<(String, String)>>;

    fn spans(&self, task_id: &str) -> Result<Vec<Span>>;

    fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>>;

    /// Every call-key record of a task.
    fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>>;

    /// The audit log, of one task when given, in order.
    fn events(&self, task: Option<&str>) -> Result<Vec<Event>>;

    /// The ids of the tasks whose write is held (see [`TaskRecord::is_held`]), in id order.
    fn held_ids(&self) -> Result<Vec<String>>;

    /// The suspended tasks whose approval wait ran out by `now_ms`.
    fn due_approvals(&self, now_ms: u64) -> Result<Vec<String>>;
}

/// Pages of tasks and counts, read through indexes.
pub trait Lists {
    /// One page of tasks, newest first, read through an index: never every task.
    fn list(&self, q: &ListQuery) -> Result<Page>;

    /// How many tasks are in each queue status, without counting them one by one.
    fn counts(&self) -> Result<Vec<(QueueStatus, u64)>>;

    /// When the oldest queued task was enqueued.
    fn oldest_queued_ms(&self) -> Result<Option<u64>>;

    /// The id of the task enqueued under `key`.
    fn task_by_key(&self, key: &str) -> Result<Option<String>>;
}

/// Long-term memory notes.
pub trait Notes {
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
}

/// Verifying every record, and deleting old finished tasks.
pub trait Maintenance {
    /// Verifies every record.
    fn check(&self) -> Result<CheckReport>;

    /// Deletes finished tasks last updated before `before_ms` (but a cancelled task whose
    /// write is still held), with everything recorded of them, at most `batch` per
    /// transaction, with one `purge` event per transaction. Returns the ids deleted.
    fn purge(&self, before_ms: u64, batch: usize, d: &Decision) -> Result<Vec<String>>;
}

/// The completion-callback outbox (see `store::callbacks`), written by the commits and
/// decisions that settle tasks.
pub trait Callbacks {
    /// Claims up to `max` callbacks due by `now_ms` (oldest first) for the sender `me`, for
    /// `claim_ms`: callbacks another sender holds are skipped, and a claim that ran out (its
    /// sender died) is taken over. A row that cannot be read is given up with an audit event.
    fn callbacks_due(
        &self,
        me: u64,
        now_ms: u64,
        claim_ms: u64,
        max: usize,
    ) -> Result<Vec<Callback>>;

    /// A receiver accepted callback `seq`: it is removed.
    fn callback_sent(&self, seq: u64) -> Result<()>;

    /// An attempt of callback `seq` failed with `error`: it counts the attempt and is due
    /// again at `next_at_ms`; its claim is given up.
    fn callback_retry(&self, seq: u64, next_at_ms: u64, error: &str) -> Result<()>;

    /// Callback `seq` is given up (its retry window ended, or its URL is not allowed): removed,
    /// with a `callback_failed` audit event of its task naming the URL, the attempts and why.
    fn callback_give_up(&self, cb: &Callback, why: &str, d: &Decision) -> Result<()>;

    /// How many callbacks wait to be delivered.
    fn callbacks_pending(&self) -> Result<u64>;
}

/// The span outbox of live OTLP export, written by the commits that end the spans.
pub trait Outbox {
    /// Spans committed for live export and not yet sent: at most `max` entries, oldest first.
    fn outbox(&self, max: usize) -> Result<Vec<OutboxEntry>>;

    /// Drops the oldest outbox entries while more than `keep` wait; returns the entries and
    /// spans dropped.
    fn outbox_trim(&self, keep: usize) -> Result<(u64, u64)>;

    /// Gives up the entries this process claimed to export and did not send (it stops).
    fn outbox_release(&self) -> Result<()>;

    /// Forgets outbox entries that were sent (or dropped).
    fn outbox_done(&self, seqs: &[u64]) -> Result<()>;
}

/// Model rate limits shared by every daemon on the database (the arithmetic is
/// `model::rate`'s). Times are the database's clock: the caller's `now_ms` on redb, the
/// server's (with the caller's offset) on PostgreSQL, as for delayed starts.
pub trait RateLimits {
    /// Reserves one request and `tokens` of `key`'s `limit` at `now_ms`, in one transaction
    /// with every other daemon's reservations: granted if the window has room and no
    /// slow-down holds the key, else the time to try again.
    fn reserve(
        &self,
        key: &str,
        limit: &crate::model::rate::RateLimit,
        tokens: u64,
        now_ms: u64,
    ) -> Result<crate::model::rate::Reserve>;
    /// The call of reservation `id` is over: it holds `tokens` (what the provider
    /// reported); `None`: it was never sent, and the reservation is dropped.
    fn settle_reservation(&self, key: &str, id: u64, tokens: Option<u64>) -> Result<()>;
    /// The provider asked `key` to slow down: no reservation of it is granted for `for_ms`
    /// from `now_ms`. Returns the time until which it holds.
    fn slow_down(&self, key: &str, now_ms: u64, for_ms: u64) -> Result<u64>;
}

/// The schedules of the database (`store::schedule`); each is changed in one transaction.
pub trait Schedules {
    /// Every schedule, by name.
    fn schedules(&self) -> Result<Vec<crate::store::schedule::Schedule>>;
    /// Adds `s`; a schedule of that name already there is a conflict.
    fn add_schedule(&self, s: &crate::store::schedule::Schedule) -> Result<()>;
    /// Changes the schedule `name` with `f` in one transaction; `Ok(false)`: there is none.
    fn update_schedule(
        &self,
        name: &str,
        f: &mut dyn FnMut(&mut crate::store::schedule::Schedule),
    ) -> Result<bool>;
    /// Removes the schedule `name` (its tasks stay); `Ok(false)`: there was none.
    fn remove_schedule(&self, name: &str) -> Result<bool>;
}

/// The wake-ups a store sends its own process ([`Queue::woken`]): coalesced (at most one
/// waits), never blocking the writer.
pub struct Woken {
    tx: crossbeam_channel::Sender<()>,
    rx: Receiver<()>,
}

impl Default for Woken {
    fn default() -> Woken {
        let (tx, rx) = crossbeam_channel::bounded(1);
        Woken { tx, rx }
    }
}

impl Woken {
    /// After a commit that may have made a task ready.
    pub fn wake(&self) {
        let _ = self.tx.try_send(());
    }

    pub fn receiver(&self) -> Receiver<()> {
        self.rx.clone()
    }
}
