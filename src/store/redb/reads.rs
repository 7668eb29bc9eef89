//! Reads of one task and of what was recorded of it, from the redb file: the task put
//! together from its row, spec and blobs, its spans, replies and call records, the audit log,
//! and the held and waiting indexes.

use redb::{ReadTransaction, ReadableTable};
use std::collections::BTreeMap;

use super::RedbStore;
use super::rows as tasks;
use super::schema::*;
use crate::kernel::Span;
use crate::model::RecordedReply;
use crate::store::backend::{Event, Reads};
use crate::store::codec::{self, decode};
use crate::store::{CallRecord, Error, Result, TaskRecord, rows, task_order};

impl Reads for RedbStore {
    fn task(&self, id: &str) -> Result<TaskRecord> {
        let r = self.db.begin_read()?;
        let (t, s, b) = read_tables(&r)?;
        tasks::Reader::new(&t, &s, &b)
            .get(id)?
            .ok_or_else(|| Error::NoTask(id.to_string()))
    }

    /// Every task whose record decodes, in id order; damaged ones are in [`RedbStore::damaged`].
    fn tasks(&self) -> Result<Vec<TaskRecord>> {
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
    fn damaged(&self) -> Result<Vec<(String, String)>> {
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

    fn spans(&self, task_id: &str) -> Result<Vec<Span>> {
        per_task(self, SPANS, "span", task_id)
    }

    fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>> {
        per_task(self, REPLIES, "reply", task_id)
    }

    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(REPLIES)?;
        match t.get((task_id, step))? {
            Some(g) => Ok(Some(decode("reply", g.value())?)),
            None => Ok(None),
        }
    }

    fn call(&self, key: &str) -> Result<Option<CallRecord>> {
        let r = self.db.begin_read()?;
        let t = r.open_table(CALL_KEYS)?;
        match t.get(key)? {
            Some(g) => Ok(Some(decode("call key", g.value())?)),
            None => Ok(None),
        }
    }

    /// Every call-key record of a task (keys are `NS:task_id:...`, in the task's namespace).
    fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>> {
        let r = self.db.begin_read()?;
        let ns = match r.open_table(TASK_SPECS)?.get(task_id)? {
            Some(g) if !codec::is_legacy(g.value()) => {
                rows::decode_spec(&format!("task {task_id} spec"), g.value())?.key_ns
            }
            _ => None,
        };
        let ns = ns.as_deref().unwrap_or(&self.db_id);
        let t = r.open_table(CALL_KEYS)?;
        let mut out = Vec::new();
        for (lo, hi) in super::call_key_ranges(ns, task_id) {
            for entry in t.range(lo.as_str()..hi.as_str())? {
                let (_, v) = entry?;
                out.push(decode::<CallRecord>("call key", v.value())?);
            }
        }
        out.sort_by_key(|c| c.step);
        Ok(out)
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

/// Every record of one task in a table keyed by (task id, number), in number order.
fn per_task<T: codec::Record + serde::de::DeserializeOwned>(
    s: &RedbStore,
    table: redb::TableDefinition<(&str, u32), &[u8]>,
    what: &str,
    task_id: &str,
) -> Result<Vec<T>> {
    let r = s.db.begin_read()?;
    let t = r.open_table(table)?;
    let mut out = Vec::new();
    for entry in t.range((task_id, 0u32)..=(task_id, u32::MAX))? {
        let (_, v) = entry?;
        out.push(decode(what, v.value())?);
    }
    Ok(out)
}
