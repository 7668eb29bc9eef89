//! The redb file as a [`Backend`]: each method maps onto the [`Store`]'s transactions, and an
//! operator decision runs in one redb write transaction through [`RedbTx`], which keeps the
//! file's index tables (ready, running, waiting, held) in step with each task it writes.

use redb::{ReadableTable, WriteTransaction};
use serde_json::Value;

use super::backend::Backend;
use super::check::CheckReport;
use super::codec::{decode, encode};
use super::list::{self, ListQuery, Page};
use super::ops::{Decision, DecisionTx, Event, is_held};
use super::schema::*;
use super::{
    CallRecord, Commit, CommitOutcome, Enqueued, Error, Lease, NewTask, QueueStatus, Result, Store,
    TaskRecord, next_seq, task_order, tasks,
};
use crate::kernel::Span;
use crate::kernel::memory::Note;
use crate::model::RecordedReply;

/// Appends an audit event inside `w`.
pub(super) fn event(
    w: &WriteTransaction,
    task: Option<&str>,
    verb: &str,
    d: &Decision,
    detail: Value,
) -> Result<u64> {
    let seq = next_seq(&mut w.open_table(META)?, META_EVENT_SEQ)?;
    let ev = Event {
        seq,
        at_ms: d.now_ms,
        task: task.map(str::to_string),
        verb: verb.to_string(),
        by: d.by.clone(),
        reason: d.reason.clone(),
        detail,
    };
    w.open_table(EVENTS)?.insert(seq, encode(&ev)?.as_slice())?;
    Ok(seq)
}

/// An operator decision's view of one redb write transaction.
struct RedbTx<'a> {
    w: &'a WriteTransaction,
    db_id: &'a str,
}

impl DecisionTx for RedbTx<'_> {
    fn db_id(&self) -> &str {
        self.db_id
    }

    fn load(&mut self, id: &str) -> Result<TaskRecord> {
        tasks::load(self.w, id)?.ok_or_else(|| Error::NoTask(id.to_string()))
    }

    fn save(&mut self, rec: &TaskRecord, was: QueueStatus) -> Result<()> {
        let id = rec.id.as_str();
        let now = rec.updated_at_ms;
        let mut waiting = self.w.open_table(WAITING)?;
        match (rec.status, rec.suspended_at_ms) {
            (QueueStatus::Suspended, Some(at)) => {
                waiting.insert(id, at.saturating_add(rec.approval_wait_ms))?;
            }
            _ => {
                waiting.remove(id)?;
            }
        }
        let mut held = self.w.open_table(HELD)?;
        if !is_held(rec) {
            held.remove(id)?;
        } else if held.get(id)?.is_none() {
            held.insert(id, now)?;
        }
        if rec.status != QueueStatus::Running {
            self.w.open_table(RUNNING)?.remove(id)?;
        }
        if rec.status == QueueStatus::Queued && was != QueueStatus::Queued {
            let seq = next_seq(&mut self.w.open_table(META)?, META_READY_SEQ)?;
            self.w.open_table(READY)?.insert((-rec.priority, seq), id)?;
        }
        super::list::Indexes::open(self.w)?.moved(id, was, rec.status)?;
        tasks::save(self.w, rec)
    }

    fn event(
        &mut self,
        task: Option<&str>,
        verb: &str,
        d: &Decision,
        detail: Value,
    ) -> Result<u64> {
        event(self.w, task, verb, d, detail)
    }

    fn call(&mut self, key: &str) -> Result<Option<std::result::Result<CallRecord, String>>> {
        let t = self.w.open_table(CALL_KEYS)?;
        Ok(t.get(key)?
            .map(|g| decode("call key", g.value()).map_err(|e| e.to_string())))
    }

    fn put_call(&mut self, c: &CallRecord) -> Result<()> {
        self.w
            .open_table(CALL_KEYS)?
            .insert(c.key.as_str(), encode(c)?.as_slice())?;
        Ok(())
    }

    fn queue_root(&mut self, id: &str) -> Result<()> {
        super::outbox::queue_root(self.w, id)
    }
}

impl Backend for Store {
    fn db_id(&self) -> &str {
        Store::db_id(self)
    }

    fn describe(&self) -> String {
        format!("the redb file {}", self.path().display())
    }

    fn enqueue(&self, tasks: &[NewTask], now_ms: u64) -> Result<Vec<Enqueued>> {
        Store::enqueue(self, tasks, now_ms)
    }

    fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>> {
        Store::claim(self, lease, max, now_ms)
    }

    fn ready_count(&self) -> Result<u64> {
        Store::ready_count(self)
    }

    /// A claim's lease time left (processes on one host share its clock, and the caller's own
    /// process is alive). `None`: not the task's current claim.
    fn claim_left(&self, id: &str, token: u64, now_ms: u64) -> Result<Option<u64>> {
        let r = self.begin_read()?;
        let row = super::tasks::read_row(&r.open_table(TASKS)?, id)?;
        Ok(row.and_then(|row| {
            let lease = row
                .lease
                .filter(|l| row.status == QueueStatus::Running && l.token == token)?;
            Some(lease.expires_at_ms.saturating_sub(now_ms))
        }))
    }

    fn renew_claim(&self, id: &str, token: u64, now_ms: u64, lease_ms: u64) -> Result<bool> {
        let w = self.begin_write()?;
        let renewed = {
            let mut tables = super::tasks::Tables::open(&w)?;
            match tables.get(id)? {
                Some(mut rec)
                    if rec.status == QueueStatus::Running
                        && rec.lease.as_ref().is_some_and(|l| l.token == token) =>
                {
                    let left = rec.budget.deadline_ms.saturating_sub(rec.state.elapsed_ms);
                    if let Some(l) = rec.lease.as_mut() {
                        l.expires_at_ms = now_ms.saturating_add(lease_ms).saturating_add(left);
                    }
                    tables.save(&rec)?;
                    true
                }
                _ => false,
            }
        };
        w.commit()?;
        Ok(renewed)
    }

    fn running_count(&self) -> Result<u64> {
        use redb::ReadableTableMetadata;
        Ok(self.begin_read()?.open_table(RUNNING)?.len()?)
    }

    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>> {
        Store::recover(self, now_ms, is_dead, live)
    }

    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String> {
        let applied = (|| {
            let w = self.begin_write().map_err(|e| (None, e))?;
            let mut results = Vec::with_capacity(commits.len());
            for c in commits {
                match Store::apply_commit(&w, c) {
                    Ok(o) => results.push(Some(o)),
                    Err(Error::LeaseLost(_) | Error::NoTask(_)) => results.push(None),
                    Err(e) => return Err((Some(c.task_id.clone()), e)),
                }
            }
            w.commit().map_err(|e| (None, Error::from(e)))?;
            Ok(results)
        })();
        applied.map_err(|(task, e): (Option<String>, Error)| {
            // A disk error leaves the handle unusable: open it again for the next commits.
            self.after_error(&e);
            match task {
                Some(t) => format!("task {t}: {e}"),
                None => e.to_string(),
            }
        })
    }

    fn decide(&self, f: &mut dyn FnMut(&mut dyn DecisionTx) -> Result<()>) -> Result<()> {
        let w = self.begin_write()?;
        f(&mut RedbTx {
            w: &w,
            db_id: Store::db_id(self),
        })?;
        w.commit()?;
        Ok(())
    }

    fn call(&self, key: &str) -> Result<Option<CallRecord>> {
        Store::call(self, key)
    }

    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>> {
        Store::reply(self, task_id, step)
    }

    fn task(&self, id: &str) -> Result<TaskRecord> {
        Store::task(self, id)
    }

    fn tasks(&self) -> Result<Vec<TaskRecord>> {
        Store::tasks(self)
    }

    fn damaged(&self) -> Result<Vec<(String, String)>> {
        Store::damaged(self)
    }

    fn list(&self, q: &ListQuery) -> Result<Page> {
        list::list(&self.begin_read()?, q)
    }

    fn counts(&self) -> Result<Vec<(QueueStatus, u64)>> {
        list::counts(&self.begin_read()?)
    }

    fn oldest_queued_ms(&self) -> Result<Option<u64>> {
        list::oldest_queued_ms(&self.begin_read()?)
    }

    fn task_by_key(&self, key: &str) -> Result<Option<String>> {
        list::by_key(&self.begin_read()?, key)
    }

    fn spans(&self, task_id: &str) -> Result<Vec<Span>> {
        Store::spans(self, task_id)
    }

    fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>> {
        Store::replies(self, task_id)
    }

    fn outbox(&self, max: usize) -> Result<Vec<super::OutboxEntry>> {
        Store::outbox(self, max)
    }

    fn outbox_trim(&self, keep: usize) -> Result<(u64, u64)> {
        Store::outbox_trim(self, keep)
    }

    fn outbox_done(&self, seqs: &[u64]) -> Result<()> {
        Store::outbox_done(self, seqs)
    }

    fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>> {
        Store::calls(self, task_id)
    }

    fn events(&self, task: Option<&str>) -> Result<Vec<Event>> {
        let r = self.begin_read()?;
        let t = r.open_table(EVENTS)?;
        let mut out = Vec::new();
        for e in t.iter()? {
            let (_, v) = e?;
            let ev: Event = decode("event", v.value())?;
            if task.is_none_or(|id| ev.task.as_deref() == Some(id)) {
                out.push(ev);
            }
        }
        Ok(out)
    }

    fn held_ids(&self) -> Result<Vec<String>> {
        let r = self.begin_read()?;
        let held = r.open_table(HELD)?;
        let mut ids = Vec::new();
        for e in held.iter()? {
            ids.push(e?.0.value().to_string());
        }
        ids.sort_by_key(|id| task_order(id));
        Ok(ids)
    }

    fn due_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        let r = self.begin_read()?;
        let waiting = r.open_table(WAITING)?;
        let mut due = Vec::new();
        for e in waiting.iter()? {
            let (id, until) = e?;
            if until.value() <= now_ms {
                due.push(id.value().to_string());
            }
        }
        Ok(due)
    }

    fn add_note(
        &self,
        user: &str,
        text: &str,
        source: &str,
        ttl_s: u64,
        d: &Decision,
    ) -> Result<Note> {
        Store::add_note(self, user, text, source, ttl_s, d)
    }

    fn notes(&self, user: Option<&str>, now_ms: u64, all: bool) -> Result<Vec<Note>> {
        Store::notes(self, user, now_ms, all)
    }

    fn forget(&self, user: &str, source: Option<&str>, d: &Decision) -> Result<usize> {
        Store::forget(self, user, source, d)
    }

    fn check(&self) -> Result<CheckReport> {
        Store::check(self)
    }

    fn purge(&self, before_ms: u64, batch: usize, d: &Decision) -> Result<Vec<String>> {
        Store::purge(self, before_ms, batch, d)
    }
}
