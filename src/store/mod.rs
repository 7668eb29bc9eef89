//! The worker's database: one redb file in `ConcurrencyMode::MultiWriter`, shared by daemons,
//! `worker enqueue` and the operator verbs, one write transaction at a time across them.
//!
//! This module owns the transactions: enqueue, claim with a lease, step commit (state, call-key
//! record, spans, recorded reply and lease renewal together), intent, release, recovery of
//! expired leases, and the reads of the CLI. No write transaction here stays open across a model
//! or tool call: callers hand in finished data.

pub mod codec;
pub mod ops;
pub mod schema;

use redb::{
    Database, ReadTransaction, ReadableDatabase, ReadableTable, ReadableTableMetadata,
    WriteTransaction,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::kernel::memory::{Note, select};
use crate::kernel::{Budget, Span, StopReason, TaskState};
use crate::model::{ModelProfile, RecordedReply};
use codec::{decode, encode};
use schema::*;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("database error: {0}")]
    Db(#[from] redb::Error),
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
}

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Error {
                Error::Db(redb::Error::from(e))
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

pub type Result<T> = std::result::Result<T, Error>;

/// Where a task is in the queue. `TaskState::status` says how the agent loop stands; this says
/// what the worker does with the task next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueStatus {
    /// Waiting in the ready queue.
    Queued,
    /// Leased by a worker.
    Running,
    /// Waiting for an approval (needs_approval).
    Suspended,
    /// A write's outcome is unknown: waiting for reconcile.
    Held,
    /// Ended with a stop reason; nothing more will run.
    Finished,
}

impl QueueStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueStatus::Queued => "queued",
            QueueStatus::Running => "running",
            QueueStatus::Suspended => "suspended",
            QueueStatus::Held => "held",
            QueueStatus::Finished => "finished",
        }
    }

    pub fn parse(s: &str) -> Option<QueueStatus> {
        [
            QueueStatus::Queued,
            QueueStatus::Running,
            QueueStatus::Suspended,
            QueueStatus::Held,
            QueueStatus::Finished,
        ]
        .into_iter()
        .find(|q| q.as_str() == s)
    }

    /// The queue status a run's end leads to.
    pub fn after(stop: StopReason) -> QueueStatus {
        match stop {
            StopReason::NeedsApproval => QueueStatus::Suspended,
            StopReason::UnknownOutcome => QueueStatus::Held,
            _ => QueueStatus::Finished,
        }
    }
}

/// A worker's claim on a task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// `host:pid:start` of the worker process.
    pub owner: String,
    pub host: String,
    pub pid: u32,
    /// Start time of the process in clock ticks since boot, so a reused pid is not taken
    /// for the original process.
    pub start_ticks: u64,
    pub expires_at_ms: u64,
    /// The fencing token of this claim: the task's claim count when it was taken. Every
    /// commit carries it and is applied only while it is the task's current token, so a
    /// superseded claim (a paused process, a stale thread) can never commit.
    #[serde(default)]
    pub token: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: String,
    pub status: QueueStatus,
    pub priority: i64,
    pub key: Option<String>,
    pub budget: Budget,
    pub model: ModelProfile,
    /// Latency overrides of the demo store's tools for this task (simulated milliseconds).
    #[serde(default)]
    pub tool_latency_ms: BTreeMap<String, u64>,
    /// The task's tool catalog (from the config file); `None` for the document's store.
    #[serde(default)]
    pub catalog: Option<crate::kernel::Catalog>,
    /// The demo store tenant this task's orders belong to (empty: the shared book).
    #[serde(default)]
    pub store_scope: String,
    pub state: TaskState,
    pub next_span_id: u32,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    #[serde(default)]
    pub lease: Option<Lease>,
    /// How many times a worker claimed it; also the fencing token of the current claim.
    #[serde(default)]
    pub runs: u32,
    /// An operator asked to cancel; the running worker stops at its next step boundary.
    #[serde(default)]
    pub cancel_requested: Option<String>,
    /// An operator's settlement of the held call (rejected, or applied with this result), to be
    /// folded in as that call's result when the task next runs.
    #[serde(default)]
    pub settle: Option<Value>,
    /// How long a suspended task may wait for an approval (its own limit, separate from the
    /// active-time deadline).
    #[serde(default = "default_approval_wait_ms")]
    pub approval_wait_ms: u64,
    #[serde(default)]
    pub suspended_at_ms: Option<u64>,
    /// The approval this task runs under: digest, who, when.
    #[serde(default)]
    pub approval: Option<Value>,
}

pub const DEFAULT_APPROVAL_WAIT_MS: u64 = 24 * 3600 * 1000;

fn default_approval_wait_ms() -> u64 {
    DEFAULT_APPROVAL_WAIT_MS
}

/// A task to enqueue.
#[derive(Clone, Debug, PartialEq)]
pub struct NewTask {
    pub user: String,
    pub goal: String,
    pub key: Option<String>,
    pub priority: i64,
    pub budget: Budget,
    pub model: ModelProfile,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<crate::kernel::Catalog>,
    pub store_scope: String,
    pub approval_wait_ms: u64,
}

/// A write's call key record: committed as an intent before the tool is called, then completed
/// with the result in the same transaction as the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    pub key: String,
    pub task_id: String,
    pub step: u32,
    pub tool: String,
    pub args: Map<String, Value>,
    /// The document's digest of tool name and args.
    pub digest: String,
    pub intent_at_ms: u64,
    /// None while the write is in flight (or its outcome was never learned).
    pub result: Option<Value>,
    pub result_at_ms: Option<u64>,
}

/// The data of one commit by a worker; see [`Store::apply_commit`].
#[derive(Clone, Debug)]
pub struct Commit {
    pub task_id: String,
    /// The fencing token of the claim this commit belongs to.
    pub token: u64,
    pub kind: CommitKind,
    pub state: TaskState,
    pub next_span_id: u32,
    pub spans: Vec<Span>,
    pub reply: Option<RecordedReply>,
    pub call: Option<CallRecord>,
    pub now_ms: u64,
    pub lease_ms: u64,
    /// The task's settlement was folded into `state`: forget it.
    pub clear_settle: bool,
    /// With a final commit: claim the next ready task for the same thread, in the same
    /// transaction (a thread that finishes a task is free at once, so the claim starts
    /// running at once, and one transaction serves both).
    pub claim_next: Option<Lease>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitKind {
    /// A write's intent (and the step's reply), before the tool is called.
    Intent,
    /// A step ended; the run goes on. Renews the lease.
    Step,
    /// The run ended with this stop reason.
    Final(StopReason),
    /// The worker is shutting down: the task goes back to the queue as committed.
    Release,
}

/// What a commit learned: an operator may have asked to cancel meanwhile.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommitOutcome {
    pub cancel_requested: Option<String>,
    /// The task claimed with `Commit::claim_next`, if one was ready.
    pub next: Option<TaskRecord>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Enqueued {
    pub id: String,
    pub created: bool,
}

/// The file as this handle opened it: for writing (daemons, decisions, enqueue), or read-only
/// (the read verbs), so a reader never waits for a writer.
enum Handle {
    Writer(Reopening),
    Reader(redb::ReadOnlyDatabase),
}

impl Handle {
    fn begin_read(&self) -> std::result::Result<ReadTransaction, redb::TransactionError> {
        match self {
            Handle::Writer(db) => db.get().begin_read(),
            Handle::Reader(db) => db.begin_read(),
        }
    }

    fn begin_write(&self) -> Result<WriteTransaction> {
        match self {
            Handle::Writer(db) => Ok(db.get().begin_write()?),
            Handle::Reader(_) => Err(Error::Invalid(
                "this database handle was opened read-only".into(),
            )),
        }
    }
}

pub struct Store {
    db: Handle,
    path: PathBuf,
    /// This database's id: made at random when the file is created, it prefixes every call
    /// key, so keys of two databases (or of a restored backup) never collide at a tool service.
    db_id: String,
}

fn next_seq(meta: &mut redb::Table<&str, u64>, name: &str) -> Result<u64> {
    let n = meta.get(name)?.map_or(1, |g| g.value());
    meta.insert(name, n + 1)?;
    Ok(n)
}

impl Store {
    /// Opens (and with `create`, creates with mode 0600) the database at `path`.
    pub fn open(path: &Path, create: bool) -> Result<Store> {
        if !path.exists() {
            if !create {
                return Err(Error::Missing(path.to_path_buf()));
            }
            create_private(path)?;
        } else if path.is_dir() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("it is a directory"),
            });
        }
        let p = path.to_path_buf();
        Store::open_with(path, std::sync::Arc::new(move || open_redb(&p, 32 << 20)))
    }

    /// Opens the database with `open`, which makes a fresh handle each time it is called
    /// (again after an I/O error); tests pass one over a storage backend that fails on demand.
    pub fn open_with(path: &Path, open: Opener) -> Result<Store> {
        let mut store = Store {
            db: Handle::Writer(Reopening::new(open)?),
            path: path.to_path_buf(),
            db_id: String::new(),
        };
        store.init()?;
        store.db_id = store.load_db_id()?;
        Ok(store)
    }

    /// Opens an existing database for reading: read-only when redb allows it, else (a file
    /// that needs recovery after a crash, or one that reads oddly) as a writer, which recovers
    /// it or reports the damage with the writer's full checks.
    pub fn open_for_reading(path: &Path) -> Result<Store> {
        match Store::open_read_only(path) {
            Ok(s) => Ok(s),
            Err(e @ (Error::Missing(_) | Error::NewerVersion { .. })) => Err(e),
            Err(_) => Store::open(path, false),
        }
    }

    /// Opens an existing database read-only, beside any writers: a read verb neither takes the
    /// writer lock nor waits for a process that holds a write transaction open.
    pub fn open_read_only(path: &Path) -> Result<Store> {
        if !path.exists() {
            return Err(Error::Missing(path.to_path_buf()));
        }
        if path.is_dir() {
            return Err(Error::Io {
                path: path.to_path_buf(),
                source: std::io::Error::other("it is a directory"),
            });
        }
        let p = path.to_path_buf();
        let opened = std::panic::catch_unwind(move || {
            redb::Builder::new()
                .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
                .set_cache_size(8 << 20)
                .open_read_only(&p)
        });
        let db = match opened {
            Ok(Ok(db)) => db,
            Ok(Err(e)) => return Err(open_error(path, e)),
            Err(_) => {
                return Err(Error::Corrupt(format!(
                    "{} could not be read as a redb database",
                    path.display()
                )));
            }
        };
        let mut store = Store {
            db: Handle::Reader(db),
            path: path.to_path_buf(),
            db_id: String::new(),
        };
        let (schema, id) = {
            let r = store.db.begin_read()?;
            match r.open_table(META) {
                Ok(t) => (
                    t.get(META_SCHEMA)?.map(|g| g.value()),
                    t.get(META_DB_ID)?.map(|g| g.value()),
                ),
                Err(redb::TableError::TableDoesNotExist(_)) => (None, None),
                Err(e) => return Err(e.into()),
            }
        };
        match schema {
            Some(v) if v > SCHEMA_VERSION => {
                return Err(Error::NewerVersion {
                    what: format!("database {}", path.display()),
                    found: v,
                    supported: SCHEMA_VERSION,
                });
            }
            Some(_) => {}
            None => {
                return Err(Error::Corrupt(format!(
                    "{} is not a Tether worker database (no schema version)",
                    path.display()
                )));
            }
        }
        store.db_id = id.map_or_else(String::new, |id| format!("{id:012x}"));
        Ok(store)
    }

    /// Called with an error a transaction of this store gave: after an I/O error the handle
    /// is opened again, so the next transaction can succeed once the disk is healthy.
    pub fn after_error(&self, e: &Error) -> bool {
        match &self.db {
            Handle::Writer(db) => db.after(e),
            Handle::Reader(_) => false,
        }
    }

    /// The database id that prefixes every call key of this database.
    pub fn db_id(&self) -> &str {
        &self.db_id
    }

    /// Reads the database id, making one if the file has none yet (a file from before ids).
    fn load_db_id(&self) -> Result<String> {
        let found = {
            let r = self.db.begin_read()?;
            r.open_table(META)?.get(META_DB_ID)?.map(|g| g.value())
        };
        let id = match found {
            Some(id) => id,
            None => {
                let w = self.db.begin_write()?;
                let id = {
                    let mut meta = w.open_table(META)?;
                    // Checked again inside the write: another process may have made it.
                    let existing = meta.get(META_DB_ID)?.map(|g| g.value());
                    match existing {
                        Some(id) => id,
                        None => {
                            let id = random_u64() & DB_ID_MASK;
                            meta.insert(META_DB_ID, id)?;
                            id
                        }
                    }
                };
                w.commit()?;
                id
            }
        };
        Ok(format!("{id:012x}"))
    }

    fn init(&self) -> Result<()> {
        let found = {
            let r = self.db.begin_read()?;
            match r.open_table(META) {
                Ok(t) => t.get(META_SCHEMA)?.map(|g| g.value()),
                Err(redb::TableError::TableDoesNotExist(_)) => None,
                Err(e) => return Err(e.into()),
            }
        };
        match found {
            Some(v) if v > SCHEMA_VERSION => Err(Error::NewerVersion {
                what: format!("database {}", self.path.display()),
                found: v,
                supported: SCHEMA_VERSION,
            }),
            Some(_)
                if self.has_table(WAITING)?
                    && self.has_table(HELD)?
                    && self.has_table(DAMAGED)? =>
            {
                Ok(())
            }
            _ => {
                // A new file, or one written before a table was added: create what is missing.
                let w = self.db.begin_write()?;
                {
                    let mut meta = w.open_table(META)?;
                    if meta.get(META_SCHEMA)?.is_none() {
                        meta.insert(META_SCHEMA, SCHEMA_VERSION)?;
                    }
                    w.open_table(TASKS)?;
                    w.open_table(READY)?;
                    w.open_table(RUNNING)?;
                    w.open_table(ENQUEUE_KEYS)?;
                    w.open_table(CALL_KEYS)?;
                    w.open_table(SPANS)?;
                    w.open_table(REPLIES)?;
                    w.open_table(EVENTS)?;
                    w.open_table(NOTES)?;
                    w.open_table(WAITING)?;
                    w.open_table(HELD)?;
                    w.open_table(DAMAGED)?;
                }
                w.commit()?;
                Ok(())
            }
        }
    }

    fn has_table<K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        t: redb::TableDefinition<K, V>,
    ) -> Result<bool> {
        let r = self.db.begin_read()?;
        match r.open_table(t) {
            Ok(_) => Ok(true),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }

    pub fn begin_write(&self) -> Result<WriteTransaction> {
        self.db.begin_write()
    }

    pub fn begin_read(&self) -> Result<ReadTransaction> {
        Ok(self.db.begin_read()?)
    }

    /// Enqueues tasks in one transaction. A task whose key was seen before is not created
    /// again; its existing id is returned with `created: false`.
    pub fn enqueue(&self, tasks: &[NewTask], now_ms: u64) -> Result<Vec<Enqueued>> {
        let w = self.db.begin_write()?;
        let mut out = Vec::with_capacity(tasks.len());
        {
            let mut meta = w.open_table(META)?;
            let mut tasks_t = w.open_table(TASKS)?;
            let mut ready = w.open_table(READY)?;
            let mut keys = w.open_table(ENQUEUE_KEYS)?;
            let notes = load_notes(&w.open_table(NOTES)?)?;
            for t in tasks {
                if let Some(k) = &t.key
                    && let Some(existing) = keys.get(k.as_str())?
                {
                    let id = existing.value().to_string();
                    drop(existing);
                    // A retried enqueue must be the same request; another one under a used key
                    // is a mistake that would otherwise vanish silently.
                    let bytes = tasks_t
                        .get(id.as_str())?
                        .map(|g| g.value().to_vec())
                        .ok_or_else(|| Error::NoTask(id.clone()))?;
                    let rec: TaskRecord = decode("task", &bytes)?;
                    if let Some(field) = differs(&rec, t) {
                        return Err(Error::Conflict(format!(
                            "enqueue key {k:?} was used for task {id} with another {field}; a retry must repeat the same request (use a new key for a new task)"
                        )));
                    }
                    out.push(Enqueued { id, created: false });
                    continue;
                }
                let id = format!("t{}", next_seq(&mut meta, META_TASK_SEQ)?);
                let mut state = TaskState::new(&id, &t.user, &t.goal);
                state.remembered = select(&notes, &t.user, &t.goal, now_ms / 1000, 3)
                    .into_iter()
                    .map(|n| n.text.clone())
                    .collect();
                let rec = TaskRecord {
                    id: id.clone(),
                    status: QueueStatus::Queued,
                    priority: t.priority,
                    key: t.key.clone(),
                    budget: t.budget,
                    model: t.model.clone(),
                    tool_latency_ms: t.tool_latency_ms.clone(),
                    store_scope: t.store_scope.clone(),
                    catalog: t.catalog.clone(),
                    state,
                    next_span_id: 0,
                    created_at_ms: now_ms,
                    updated_at_ms: now_ms,
                    lease: None,
                    runs: 0,
                    cancel_requested: None,
                    settle: None,
                    approval_wait_ms: t.approval_wait_ms,
                    suspended_at_ms: None,
                    approval: None,
                };
                tasks_t.insert(id.as_str(), encode(&rec)?.as_slice())?;
                let seq = next_seq(&mut meta, META_READY_SEQ)?;
                ready.insert((-t.priority, seq), id.as_str())?;
                if let Some(k) = &t.key {
                    keys.insert(k.as_str(), id.as_str())?;
                }
                out.push(Enqueued { id, created: true });
            }
        }
        w.commit()?;
        Ok(out)
    }

    /// Takes up to `max` tasks from the ready queue, highest priority first, and leases them.
    pub fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>> {
        if max == 0 || self.ready_count()? == 0 {
            return Ok(Vec::new());
        }
        let w = self.db.begin_write()?;
        let out = claim_in(&w, lease, max, now_ms)?;
        w.commit()?;
        Ok(out)
    }

    pub fn ready_count(&self) -> Result<u64> {
        let r = self.db.begin_read()?;
        Ok(r.open_table(READY)?.len()?)
    }

    /// Puts back in the queue every running task whose lease expired or whose owner `is_dead`,
    /// except the claims `live` names (a process never recovers its own live claims: its
    /// threads renew them, and fencing refuses a stale thread's commits anyway).
    /// Returns the ids recovered. Reads first, so an idle check writes nothing.
    pub fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>> {
        let over = |rec: &TaskRecord| {
            lease_over(rec, now_ms, is_dead)
                && !rec.lease.as_ref().is_some_and(|l| live(&rec.id, l))
        };
        let candidates: Vec<String> = {
            let r = self.db.begin_read()?;
            let running = r.open_table(RUNNING)?;
            let tasks = r.open_table(TASKS)?;
            let mut c = Vec::new();
            for entry in running.iter()? {
                let (id, _claimed_expiry) = entry?;
                let id = id.value().to_string();
                let take = match tasks.get(id.as_str())? {
                    // A record that cannot be decoded is quarantined below.
                    Some(g) => decode::<TaskRecord>("task", g.value()).map_or(true, |r| over(&r)),
                    None => true,
                };
                if take {
                    c.push(id);
                }
            }
            c
        };
        if candidates.is_empty() {
            return Ok(candidates);
        }
        let w = self.db.begin_write()?;
        let mut recovered = Vec::new();
        {
            let mut meta = w.open_table(META)?;
            let mut tasks = w.open_table(TASKS)?;
            let mut running = w.open_table(RUNNING)?;
            let mut ready = w.open_table(READY)?;
            for id in candidates {
                // Checked again inside the write: another process may have recovered it.
                if running.get(id.as_str())?.is_none() {
                    continue;
                }
                let Some(bytes) = tasks.get(id.as_str())?.map(|g| g.value().to_vec()) else {
                    running.remove(id.as_str())?;
                    continue;
                };
                let mut rec: TaskRecord = match decode("task", &bytes) {
                    Ok(rec) => rec,
                    Err(e) => {
                        tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                        running.remove(id.as_str())?;
                        w.open_table(DAMAGED)?
                            .insert(id.as_str(), e.to_string().as_str())?;
                        continue;
                    }
                };
                if !over(&rec) {
                    continue;
                }
                running.remove(id.as_str())?;
                rec.status = QueueStatus::Queued;
                rec.lease = None;
                rec.updated_at_ms = now_ms;
                tasks.insert(id.as_str(), encode(&rec)?.as_slice())?;
                let seq = next_seq(&mut meta, META_READY_SEQ)?;
                ready.insert((-rec.priority, seq), id.as_str())?;
                recovered.push(id);
            }
        }
        w.commit()?;
        Ok(recovered)
    }

    /// Applies one worker commit inside `w`. Checks first that the worker still holds the lease
    /// and writes nothing if not, so one failed commit never spoils the others of a group.
    pub fn apply_commit(w: &WriteTransaction, c: &Commit) -> Result<CommitOutcome> {
        let mut tasks = w.open_table(TASKS)?;
        let bytes = tasks
            .get(c.task_id.as_str())?
            .map(|g| g.value().to_vec())
            .ok_or_else(|| Error::NoTask(c.task_id.clone()))?;
        let mut rec: TaskRecord = decode("task", &bytes)?;
        // Fencing: only the task's current claim may commit. An older claim of the same
        // process (a thread that kept running after its lease was taken over) is refused too.
        let held = rec.status == QueueStatus::Running
            && rec.lease.as_ref().is_some_and(|l| l.token == c.token);
        if !held {
            return Err(Error::LeaseLost(c.task_id.clone()));
        }
        if let Some(call) = &c.call {
            w.open_table(CALL_KEYS)?
                .insert(call.key.as_str(), encode(call)?.as_slice())?;
        }
        if let Some(reply) = &c.reply {
            w.open_table(REPLIES)?
                .insert((c.task_id.as_str(), reply.step), encode(reply)?.as_slice())?;
        }
        if !c.spans.is_empty() {
            let mut spans = w.open_table(SPANS)?;
            for s in &c.spans {
                spans.insert((c.task_id.as_str(), s.id), encode(s)?.as_slice())?;
            }
        }
        let mut outcome = CommitOutcome {
            cancel_requested: rec.cancel_requested.clone(),
            next: None,
        };
        if c.kind == CommitKind::Intent {
            return Ok(outcome);
        }
        rec.state = c.state.clone();
        rec.next_span_id = c.next_span_id;
        if c.clear_settle {
            rec.settle = None;
        }
        rec.updated_at_ms = c.now_ms;
        let mut running = w.open_table(RUNNING)?;
        match c.kind {
            CommitKind::Intent => {}
            CommitKind::Step => {
                // The renewed expiry lives in the record; RUNNING keeps the claim-time expiry
                // as an index, and recovery reads the record before taking a task over.
                if let Some(l) = rec.lease.as_mut() {
                    l.expires_at_ms = c
                        .now_ms
                        .saturating_add(c.lease_ms)
                        .saturating_add(remaining_ms(&rec.budget, &c.state));
                }
            }
            CommitKind::Final(stop) => {
                rec.status = QueueStatus::after(stop);
                rec.suspended_at_ms = (stop == StopReason::NeedsApproval).then_some(c.now_ms);
                let mut waiting = w.open_table(WAITING)?;
                if stop == StopReason::NeedsApproval {
                    waiting.insert(
                        c.task_id.as_str(),
                        c.now_ms.saturating_add(rec.approval_wait_ms),
                    )?;
                } else {
                    waiting.remove(c.task_id.as_str())?;
                }
                let mut held = w.open_table(HELD)?;
                if stop == StopReason::UnknownOutcome {
                    held.insert(c.task_id.as_str(), c.now_ms)?;
                } else {
                    held.remove(c.task_id.as_str())?;
                }
                rec.lease = None;
                running.remove(c.task_id.as_str())?;
            }
            CommitKind::Release => {
                rec.status = QueueStatus::Queued;
                rec.lease = None;
                running.remove(c.task_id.as_str())?;
                let seq = next_seq(&mut w.open_table(META)?, META_READY_SEQ)?;
                w.open_table(READY)?
                    .insert((-rec.priority, seq), c.task_id.as_str())?;
            }
        }
        tasks.insert(c.task_id.as_str(), encode(&rec)?.as_slice())?;
        drop((tasks, running));
        if let (CommitKind::Final(_), Some(lease)) = (c.kind, &c.claim_next) {
            outcome.next = claim_in(w, lease, 1, c.now_ms)?.pop();
        }
        Ok(outcome)
    }

    pub fn task(&self, id: &str) -> Result<TaskRecord> {
        let r = self.db.begin_read()?;
        let t = r.open_table(TASKS)?;
        let g = t.get(id)?.ok_or_else(|| Error::NoTask(id.to_string()))?;
        decode("task", g.value())
    }

    /// Every task whose record decodes, in id order; damaged ones are in [`Store::damaged`].
    pub fn tasks(&self) -> Result<Vec<TaskRecord>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(TASKS)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (_, v) = entry?;
            if let Ok(rec) = decode("task", v.value()) {
                out.push(rec);
            }
        }
        out.sort_by_key(|r: &TaskRecord| task_order(&r.id));
        Ok(out)
    }

    /// Tasks whose record cannot be decoded, with why: quarantined (by a claim or a recovery
    /// that met them) or found by this scan.
    pub fn damaged(&self) -> Result<Vec<(String, String)>> {
        let r = self.db.begin_read()?;
        let mut out: BTreeMap<String, String> = BTreeMap::new();
        if let Ok(q) = r.open_table(DAMAGED) {
            for entry in q.iter()? {
                let (k, v) = entry?;
                out.insert(k.value().to_string(), v.value().to_string());
            }
        }
        let t = r.open_table(TASKS)?;
        for entry in t.iter()? {
            let (k, v) = entry?;
            if let Err(e) = decode::<TaskRecord>("task", v.value()) {
                out.entry(k.value().to_string()).or_insert(e.to_string());
            }
        }
        let mut out: Vec<(String, String)> = out.into_iter().collect();
        out.sort_by_key(|(id, _)| task_order(id));
        Ok(out)
    }

    pub fn spans(&self, task_id: &str) -> Result<Vec<Span>> {
        self.per_task(SPANS, "span", task_id)
    }

    pub fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>> {
        self.per_task(REPLIES, "reply", task_id)
    }

    /// Every record of one task in a table keyed by (task id, number), in number order.
    fn per_task<T: serde::de::DeserializeOwned>(
        &self,
        table: redb::TableDefinition<(&str, u32), &[u8]>,
        what: &str,
        task_id: &str,
    ) -> Result<Vec<T>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(table)?;
        let mut out = Vec::new();
        for entry in t.range((task_id, 0u32)..=(task_id, u32::MAX))? {
            let (_, v) = entry?;
            out.push(decode(what, v.value())?);
        }
        Ok(out)
    }

    pub fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(REPLIES)?;
        match t.get((task_id, step))? {
            Some(g) => Ok(Some(decode("reply", g.value())?)),
            None => Ok(None),
        }
    }

    pub fn call(&self, key: &str) -> Result<Option<CallRecord>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(CALL_KEYS)?;
        match t.get(key)? {
            Some(g) => Ok(Some(decode("call key", g.value())?)),
            None => Ok(None),
        }
    }

    /// The call key of `call` made at `step` of task `task_id`, in this database's namespace.
    pub fn call_key(&self, call: &crate::kernel::ToolCall, task_id: &str, step: u32) -> String {
        call.key_in(&self.db_id, task_id, step)
    }

    /// Every call-key record of a task (keys are `db_id:task_id:...`).
    pub fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(CALL_KEYS)?;
        let ns = &self.db_id;
        let (lo, hi) = (format!("{ns}:{task_id}:"), format!("{ns}:{task_id};"));
        let mut out = Vec::new();
        for entry in t.range(lo.as_str()..hi.as_str())? {
            let (_, v) = entry?;
            out.push(decode("call key", v.value())?);
        }
        Ok(out)
    }
}

/// Takes up to `max` tasks from the ready queue inside `w`, highest priority first, and leases
/// them, each under a new fencing token. A record that cannot be decoded is quarantined.
fn claim_in(
    w: &WriteTransaction,
    lease: &Lease,
    max: usize,
    now_ms: u64,
) -> Result<Vec<TaskRecord>> {
    let mut out = Vec::new();
    {
        let mut ready = w.open_table(READY)?;
        let mut tasks = w.open_table(TASKS)?;
        let mut running = w.open_table(RUNNING)?;
        let mut taken = Vec::new();
        for entry in ready.iter()?.take(max) {
            let (k, v) = entry?;
            taken.push((k.value(), v.value().to_string()));
        }
        let mut damaged = w.open_table(DAMAGED)?;
        for (k, id) in taken {
            ready.remove(k)?;
            let Some(bytes) = tasks.get(id.as_str())?.map(|g| g.value().to_vec()) else {
                continue;
            };
            let mut rec: TaskRecord = match decode("task", &bytes) {
                Ok(rec) => rec,
                Err(e) => {
                    // Quarantined: listed as damaged, never run, never fatal for others.
                    tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                    damaged.insert(id.as_str(), e.to_string().as_str())?;
                    continue;
                }
            };
            if rec.status != QueueStatus::Queued {
                continue; // stale entry
            }
            rec.status = QueueStatus::Running;
            let mut lease = lease.clone();
            // The claim's lease (now + lease_ms) plus the task's remaining active time: one
            // model or tool call may take all of it.
            lease.expires_at_ms = lease
                .expires_at_ms
                .max(now_ms)
                .saturating_add(remaining_ms(&rec.budget, &rec.state));
            rec.runs = rec.runs.saturating_add(1);
            lease.token = u64::from(rec.runs);
            rec.lease = Some(lease);
            rec.updated_at_ms = now_ms;
            tasks.insert(id.as_str(), encode(&rec)?.as_slice())?;
            running.insert(
                id.as_str(),
                rec.lease.as_ref().map_or(now_ms, |l| l.expires_at_ms),
            )?;
            out.push(rec);
        }
    }
    Ok(out)
}

/// The first field in which a new request differs from the task its key already made.
fn differs(rec: &TaskRecord, t: &NewTask) -> Option<&'static str> {
    if rec.state.user_id != t.user {
        Some("user")
    } else if rec.state.goal != t.goal {
        Some("goal")
    } else if rec.model != t.model {
        Some("model")
    } else if rec.budget != t.budget {
        Some("budget")
    } else if rec.priority != t.priority {
        Some("priority")
    } else if rec.catalog != t.catalog {
        Some("tool catalog")
    } else if rec.store_scope != t.store_scope || rec.tool_latency_ms != t.tool_latency_ms {
        Some("tool settings")
    } else {
        None
    }
}

/// Database ids are 48 bits: 12 hex digits in every call key.
const DB_ID_MASK: u64 = (1 << 48) - 1;

/// 64 random bits from the operating system, or (if it has none to give) from the standard
/// library's randomly seeded hasher mixed with the time and the process id.
pub(crate) fn random_u64() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}

/// Sort key of a task id: ids are t1, t2, ..., so t2 comes before t10.
pub(crate) fn task_order(id: &str) -> (u64, String) {
    let n = id.trim_start_matches('t').parse().unwrap_or(u64::MAX);
    (n, id.to_string())
}

/// The task's remaining active time. A lease covers it on top of the lease length: one model
/// or tool call can take up to all of it, and the lease must not run out under a worker that
/// is only waiting. Fencing makes a lease that runs out anyway harmless: the old claim can no
/// longer commit.
fn remaining_ms(budget: &Budget, state: &TaskState) -> u64 {
    budget.deadline_ms.saturating_sub(state.elapsed_ms)
}

/// A running task may be taken over when its lease expired or its owner is gone.
fn lease_over(rec: &TaskRecord, now_ms: u64, is_dead: &dyn Fn(&Lease) -> bool) -> bool {
    rec.status != QueueStatus::Running
        || rec
            .lease
            .as_ref()
            .is_none_or(|l| l.expires_at_ms <= now_ms || is_dead(l))
}

fn load_notes(t: &redb::Table<u64, &[u8]>) -> Result<Vec<Note>> {
    let mut out = Vec::new();
    for entry in t.iter()? {
        let (_, v) = entry?;
        out.push(decode("note", v.value())?);
    }
    Ok(out)
}

fn open_error(path: &Path, e: redb::DatabaseError) -> Error {
    match e {
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::InvalidData =>
        {
            Error::Corrupt(format!("{}: {io}", path.display()))
        }
        redb::DatabaseError::Storage(redb::StorageError::Io(io)) => Error::Io {
            path: path.to_path_buf(),
            source: io,
        },
        redb::DatabaseError::UpgradeRequired(v) => Error::NewerVersion {
            what: format!("database file {}", path.display()),
            found: v as u64,
            supported: 0,
        },
        redb::DatabaseError::Storage(redb::StorageError::Corrupted(msg)) => {
            Error::Corrupt(format!("{}: {msg}", path.display()))
        }
        other => Error::Corrupt(format!("{}: {other}", path.display())),
    }
}

/// Opens a database file: a fresh handle each call.
pub type Opener = std::sync::Arc<dyn Fn() -> Result<Database> + Send + Sync>;

/// A redb handle that is replaced after an I/O error. redb refuses every later operation of a
/// handle that saw one ("Previous I/O error"), so a full disk that is freed again would stop
/// the process for good; opening the file again recovers its last commit and goes on. What
/// was in flight when the error came is not retried here: its outcome is for the caller.
pub struct Reopening {
    current: std::sync::RwLock<std::sync::Arc<Database>>,
    open: Opener,
    /// The current handle saw an I/O error: open the file again before its next use.
    broken: std::sync::atomic::AtomicBool,
}

impl Reopening {
    pub fn new(open: Opener) -> Result<Reopening> {
        let db = open()?;
        Ok(Reopening {
            current: std::sync::RwLock::new(std::sync::Arc::new(db)),
            open,
            broken: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The current handle, opened again first if the last one saw an I/O error (while the
    /// disk still fails, that open fails too and the broken handle keeps reporting it).
    pub fn get(&self) -> std::sync::Arc<Database> {
        use std::sync::atomic::Ordering;
        if self.broken.load(Ordering::SeqCst) {
            match (self.open)() {
                Ok(db) => {
                    let db = std::sync::Arc::new(db);
                    match self.current.write() {
                        Ok(mut g) => *g = std::sync::Arc::clone(&db),
                        Err(poisoned) => *poisoned.into_inner() = std::sync::Arc::clone(&db),
                    }
                    self.broken.store(false, Ordering::SeqCst);
                    tracing::warn!("database handle reopened after an I/O error");
                    return db;
                }
                Err(e) => tracing::error!(error = %e, "reopening the database failed"),
            }
        }
        match self.current.read() {
            Ok(g) => std::sync::Arc::clone(&g),
            Err(poisoned) => std::sync::Arc::clone(&poisoned.into_inner()),
        }
    }

    /// Called with an error the handle gave: after an I/O error, the next use opens the file
    /// again. Returns whether the error was one.
    pub fn after(&self, e: &Error) -> bool {
        let io = is_io(e);
        if io {
            self.broken.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        io
    }
}

/// Whether an error came from the storage below (the disk), not from the data.
pub fn is_io(e: &Error) -> bool {
    matches!(
        e,
        Error::Db(redb::Error::Io(_) | redb::Error::PreviousIo) | Error::Io { .. }
    )
}

/// Opens a redb file in MultiWriter mode. redb documents that a plain open of an altered file
/// may panic; a damaged file must give an error, never take the process down.
pub(crate) fn open_redb(path: &Path, cache_bytes: usize) -> Result<Database> {
    let p = path.to_path_buf();
    let opened = std::panic::catch_unwind(move || {
        Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .set_cache_size(cache_bytes)
            .create(&p)
    });
    match opened {
        Ok(Ok(db)) => Ok(db),
        Ok(Err(e)) => Err(open_error(path, e)),
        Err(_) => Err(Error::Corrupt(format!(
            "{} could not be read as a redb database",
            path.display()
        ))),
    }
}

/// Creates an empty file readable and writable by its owner only (nothing if it exists).
pub(crate) fn create_private(path: &Path) -> Result<()> {
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    match opts.open(path) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(Error::Io {
            path: path.to_path_buf(),
            source: e,
        }),
    }
}
