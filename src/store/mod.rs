//! The worker's database: one redb file in `ConcurrencyMode::MultiWriter`, shared by daemons,
//! `worker enqueue` and the operator verbs, one write transaction at a time across them.
//!
//! This module owns the transactions: enqueue, claim with a lease, step commit (state, call-key
//! record, spans, recorded reply and lease renewal together), intent, release, recovery of
//! expired leases, and the reads of the CLI. No write transaction here stays open across a model
//! or tool call: callers hand in finished data. The records live in `records`, opening the
//! file in `open`, and the redb handles (read-only, reopened after an I/O error) in `handle`.

mod backend;
mod check;
pub mod codec;
mod embedded;
mod handle;
pub mod list;
mod memory;
mod open;
pub mod ops;
pub mod outbox;
pub mod pg;
mod records;
pub mod rows;
pub mod schema;
mod tasks;
mod writes;
use writes::legacy_bytes;
pub use writes::{WRITES, WriteStats};

pub use backend::{Access, Backend, HeldWrites, open_backend};
pub use check::CheckReport;
use handle::Handle;
pub use handle::{Opener, Reopening};
pub(crate) use handle::{create_private, open_redb};
pub(crate) use open::check_not_empty;
pub use open::random_u64;
pub use outbox::OutboxEntry;
pub use records::*;

use redb::{ReadTransaction, ReadableTable, ReadableTableMetadata, WriteTransaction};
use std::collections::BTreeMap;
use std::path::PathBuf;

use crate::kernel::memory::Note;
use crate::kernel::{Budget, Span, StopReason};
use crate::model::RecordedReply;
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
            let mut tables = tasks::Tables::open(&w)?;
            let mut ready = w.open_table(READY)?;
            let mut keys = w.open_table(ENQUEUE_KEYS)?;
            let notes = load_notes(&w.open_table(NOTES)?)?;
            let mut idx = list::Indexes::open(&w)?;
            for t in tasks {
                if let Some(k) = &t.key
                    && let Some(existing) = keys.get(k.as_str())?
                {
                    let id = existing.value().to_string();
                    drop(existing);
                    // A retried enqueue must be the same request; another one under a used key
                    // is a mistake that would otherwise vanish silently.
                    let rec = tables.get(&id)?.ok_or_else(|| Error::NoTask(id.clone()))?;
                    if let Some(field) = differs(&rec, t) {
                        return Err(Error::Conflict(format!(
                            "enqueue key {k:?} was used for task {id} with another {field}; a retry must repeat the same request (use a new key for a new task)"
                        )));
                    }
                    out.push(Enqueued { id, created: false });
                    continue;
                }
                let id = format!("t{}", next_seq(&mut meta, META_TASK_SEQ)?);
                let rec = new_record(&self.db_id, &id, t, &notes, now_ms);
                tables.insert_new(&rec)?;
                idx.added(&id, &rec.state.user_id, rec.status, rec.created_at_ms)?;
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
        let over = |rec: &rows::TaskRow| {
            lease_over(rec.status, rec.lease.as_ref(), now_ms, is_dead)
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
                // A record that cannot be decoded is quarantined below.
                let take =
                    tasks::read_row(&tasks, &id).map_or(true, |r| r.is_none_or(|r| over(&r)));
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
            let mut idx = list::Indexes::open(&w)?;
            for id in candidates {
                // Checked again inside the write: another process may have recovered it.
                if running.get(id.as_str())?.is_none() {
                    continue;
                }
                let mut rec = match tasks::read_row(&tasks, &id) {
                    Ok(Some(rec)) => rec,
                    Ok(None) => {
                        running.remove(id.as_str())?;
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                        running.remove(id.as_str())?;
                        w.open_table(DAMAGED)?
                            .insert(id.as_str(), e.to_string().as_str())?;
                        idx.removed(&id, QueueStatus::Running, None)?;
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
                tasks::save_row(&mut tasks, &rec)?;
                idx.moved(&id, QueueStatus::Running, QueueStatus::Queued)?;
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
        // The task row only: a step never reads or rewrites the spec or the shared blobs.
        let mut rec =
            tasks::read_row(&tasks, &c.task_id)?.ok_or_else(|| Error::NoTask(c.task_id.clone()))?;
        // Fencing: only the task's current claim may commit. An older claim of the same
        // process (a thread that kept running after its lease was taken over) is refused too.
        let held = rec.status == QueueStatus::Running
            && rec.lease.as_ref().is_some_and(|l| l.token == c.token);
        if !held {
            return Err(Error::LeaseLost(c.task_id.clone()));
        }
        let mut written = 0usize;
        if let Some(call) = &c.call {
            let v = encode(call)?;
            written += v.len();
            w.open_table(CALL_KEYS)?
                .insert(call.key.as_str(), v.as_slice())?;
        }
        if let Some(reply) = &c.reply {
            let v = encode(reply)?;
            written += v.len();
            w.open_table(REPLIES)?
                .insert((c.task_id.as_str(), reply.step), v.as_slice())?;
        }
        if !c.spans.is_empty() {
            let mut spans = w.open_table(SPANS)?;
            for s in &c.spans {
                let v = encode(s)?;
                written += v.len();
                spans.insert((c.task_id.as_str(), s.id), v.as_slice())?;
            }
            outbox::queue(w, c)?;
        }
        let mut outcome = CommitOutcome {
            cancel_requested: rec.cancel_requested.clone(),
            next: None,
        };
        if c.kind == CommitKind::Intent {
            WRITES.count(written, || legacy_bytes(w, c, false));
            return Ok(outcome);
        }
        rec.state = codec::Record::to_row(&c.state);
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
                        .saturating_add(remaining_ms(&rec.budget, c.state.elapsed_ms));
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
        if rec.status != QueueStatus::Running {
            list::Indexes::open(w)?.moved(&c.task_id, QueueStatus::Running, rec.status)?;
        }
        let row = rows::encode_task(&rec)?;
        written += row.len();
        tasks.insert(c.task_id.as_str(), row.as_slice())?;
        drop((tasks, running));
        WRITES.count(written, || legacy_bytes(w, c, true));
        if let (CommitKind::Final(_), Some(lease)) = (c.kind, &c.claim_next) {
            outcome.next = claim_in(w, lease, 1, c.now_ms)?.pop();
        }
        Ok(outcome)
    }

    pub fn task(&self, id: &str) -> Result<TaskRecord> {
        let r = self.db.begin_read()?;
        let (t, s, b) = read_tables(&r)?;
        tasks::Reader::new(&t, &s, &b)
            .get(id)?
            .ok_or_else(|| Error::NoTask(id.to_string()))
    }

    /// Every task whose record decodes, in id order; damaged ones are in [`Store::damaged`].
    pub fn tasks(&self) -> Result<Vec<TaskRecord>> {
        let r = self.db.begin_read()?;
        let (t, s, b) = read_tables(&r)?;
        let mut reader = tasks::Reader::new(&t, &s, &b);
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, _) = entry?;
            if let Ok(Some(rec)) = reader.get(k.value()) {
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
        let (t, s, b) = read_tables(&r)?;
        let mut reader = tasks::Reader::new(&t, &s, &b);
        for entry in t.iter()? {
            let (k, _) = entry?;
            if let Err(e) = reader.get(k.value()) {
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
    fn per_task<T: codec::Record + serde::de::DeserializeOwned>(
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

    /// Every call-key record of a task (keys are `NS:task_id:...`, in the task's namespace).
    pub fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>> {
        let r = self.db.begin_read()?;
        let ns = match r.open_table(TASK_SPECS)?.get(task_id)? {
            Some(g) if !codec::is_legacy(g.value()) => {
                rows::decode_spec(&format!("task {task_id} spec"), g.value())?.key_ns
            }
            _ => None,
        };
        let ns = ns.as_deref().unwrap_or(&self.db_id);
        let t = r.open_table(CALL_KEYS)?;
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
        let mut tables = tasks::Tables::open(w)?;
        let mut running = w.open_table(RUNNING)?;
        let mut taken = Vec::new();
        for entry in ready.iter()?.take(max) {
            let (k, v) = entry?;
            taken.push((k.value(), v.value().to_string()));
        }
        let mut damaged = w.open_table(DAMAGED)?;
        let mut idx = list::Indexes::open(w)?;
        for (k, id) in taken {
            ready.remove(k)?;
            let mut rec = match tables.get(&id) {
                Ok(Some(rec)) => rec,
                Ok(None) => continue,
                Err(e) => {
                    // Quarantined: listed as damaged, never run, never fatal for others.
                    tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                    damaged.insert(id.as_str(), e.to_string().as_str())?;
                    idx.removed(&id, QueueStatus::Queued, None)?;
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
                .saturating_add(remaining_ms(&rec.budget, rec.state.elapsed_ms));
            rec.runs = rec.runs.saturating_add(1);
            lease.token = u64::from(rec.runs);
            rec.lease = Some(lease);
            rec.updated_at_ms = now_ms;
            tables.save(&rec)?;
            idx.moved(&id, QueueStatus::Queued, QueueStatus::Running)?;
            running.insert(
                id.as_str(),
                rec.lease.as_ref().map_or(now_ms, |l| l.expires_at_ms),
            )?;
            out.push(rec);
        }
    }
    Ok(out)
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
pub(crate) fn remaining_ms(budget: &Budget, elapsed_ms: u64) -> u64 {
    budget.deadline_ms.saturating_sub(elapsed_ms)
}

/// A running task may be taken over when its lease expired or its owner is gone.
fn lease_over(
    status: QueueStatus,
    lease: Option<&Lease>,
    now_ms: u64,
    is_dead: &dyn Fn(&Lease) -> bool,
) -> bool {
    status != QueueStatus::Running || lease.is_none_or(|l| l.expires_at_ms <= now_ms || is_dead(l))
}

type ReadTable = redb::ReadOnlyTable<&'static str, &'static [u8]>;

/// The tables of tasks, open for reading.
fn read_tables(r: &ReadTransaction) -> Result<(ReadTable, ReadTable, ReadTable)> {
    Ok((
        r.open_table(TASKS)?,
        r.open_table(TASK_SPECS)?,
        r.open_table(BLOBS)?,
    ))
}

fn load_notes(t: &redb::Table<u64, &[u8]>) -> Result<Vec<Note>> {
    let mut out = Vec::new();
    for entry in t.iter()? {
        let (_, v) = entry?;
        out.push(decode("note", v.value())?);
    }
    Ok(out)
}
