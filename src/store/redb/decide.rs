//! Operator decisions in the redb file: each runs in one write transaction through
//! [`RedbTx`], the one place that keeps the file's index tables (ready, running, waiting,
//! held, and the list indexes) in step with a task's status when a decision writes it.

use redb::{ReadableTable, WriteTransaction};
use serde_json::Value;

use super::rows as tasks;
use super::schema::*;
use super::{RedbStore, next_seq};
use crate::store::backend::{Decide, Decision, DecisionTx, Event};
use crate::store::codec::{decode, encode};
use crate::store::{CallRecord, Error, QueueStatus, Result, TaskRecord};

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
        if !rec.is_held() {
            held.remove(id)?;
        } else if held.get(id)?.is_none() {
            held.insert(id, now)?;
        }
        if rec.status != QueueStatus::Running {
            super::flow::Flow::left_running(self.w, id)?;
        }
        if rec.status == QueueStatus::Queued && was != QueueStatus::Queued {
            super::flow::Flow::queue(self.w, id, rec.priority, rec.not_before_ms, now)?;
        }
        if was == QueueStatus::Queued
            && rec.status != QueueStatus::Queued
            && let Some(at) = rec.not_before_ms
        {
            super::flow::Flow::unqueue_delayed(self.w, id, at)?;
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

    fn calls(
        &mut self,
        rec: &TaskRecord,
    ) -> Result<Vec<std::result::Result<CallRecord, (String, String)>>> {
        let ns = rec.key_namespace(self.db_id);
        let t = self.w.open_table(CALL_KEYS)?;
        let mut out = Vec::new();
        for (lo, hi) in super::call_key_ranges(ns, &rec.id) {
            for entry in t.range(lo.as_str()..hi.as_str())? {
                let (k, v) = entry?;
                out.push(
                    decode::<CallRecord>("call key", v.value())
                        .map_err(|e| (k.value().to_string(), e.to_string())),
                );
            }
        }
        Ok(out)
    }

    fn queue_root(&mut self, id: &str) -> Result<()> {
        super::outbox::queue_root(self.w, id)
    }

    fn queue_callback(&mut self, cb: &crate::store::Callback) -> Result<()> {
        super::callbacks::queue(self.w, cb)
    }
}

impl Decide for RedbStore {
    fn decide(&self, f: &mut dyn FnMut(&mut dyn DecisionTx) -> Result<()>) -> Result<()> {
        let w = self.begin_write()?;
        f(&mut RedbTx {
            w: &w,
            db_id: &self.db_id,
        })?;
        w.commit()?;
        self.woken.wake();
        Ok(())
    }
}
