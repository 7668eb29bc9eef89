//! `worker check` and `worker purge`: verifying every record of the file, and deleting
//! finished tasks in bounded transactions.
//!
//! The check decodes every record of every table (magic, version, checksum, row, JSON text),
//! puts every task together from its row, spec and blobs, checks each blob against its digest
//! and reference count, and lists the quarantined tasks. A panic of the storage engine on a
//! damaged page is caught per table and reported as damage of that table.

use redb::ReadableTable;
use std::collections::BTreeMap;

use super::RedbStore;
use super::rows as tasks;
use super::schema::*;
use crate::kernel::Span;
use crate::kernel::memory::Note;
use crate::model::RecordedReply;
use crate::store::backend::{CheckReport, Decision, Event, Maintenance};
use crate::store::codec::{decode, decode_row};
use crate::store::rows::{self, Blob, ModelRow};
use crate::store::{CallRecord, Error, QueueStatus, Result};

/// Runs `f`, turning a panic of the storage engine into an error.
fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            Err(Error::Corrupt(format!(
                "{what}: the storage engine stopped on an inconsistency ({msg})"
            )))
        }
    }
}

/// Every task put together from its row, spec and blobs, and the quarantined tasks: how many
/// tasks there are, and what is damaged.
fn check_tasks(r: &redb::ReadTransaction) -> Result<(u64, Vec<String>)> {
    let (t, s, b) = (
        r.open_table(TASKS)?,
        r.open_table(TASK_SPECS)?,
        r.open_table(BLOBS)?,
    );
    let refs = r.open_table(BLOB_REFS)?;
    let mut reader = tasks::Reader::new(&t, &s, &b);
    let mut n = 0u64;
    let mut bad = Vec::new();
    let mut uses: BTreeMap<String, u64> = BTreeMap::new();
    for entry in t.iter()? {
        let (k, _) = entry?;
        n += 1;
        if let Err(e) = reader.get(k.value()) {
            bad.push(e.to_string());
        }
    }
    for entry in s.iter()? {
        let (k, v) = entry?;
        if t.get(k.value())?.is_none() {
            bad.push(format!("task {}: a spec without its task", k.value()));
        }
        if let Ok(spec) = rows::decode_spec("spec", v.value()) {
            if let ModelRow::Script { replies, .. } = &spec.model {
                *uses.entry(replies.clone()).or_default() += 1;
            }
            if let Some(c) = spec.catalog {
                *uses.entry(c).or_default() += 1;
            }
        }
    }
    check_blobs(&b, &refs, &uses, &mut bad)?;
    let q = r.open_table(DAMAGED)?;
    for entry in q.iter()? {
        let (k, v) = entry?;
        bad.push(format!("task {} (quarantined): {}", k.value(), v.value()));
    }
    Ok((n, bad))
}

/// Each blob against its digest and its reference count (`uses`: how many specs name it).
fn check_blobs(
    b: &redb::ReadOnlyTable<&str, &[u8]>,
    refs: &redb::ReadOnlyTable<&str, u64>,
    uses: &BTreeMap<String, u64>,
    bad: &mut Vec<String>,
) -> Result<()> {
    for entry in b.iter()? {
        let (k, v) = entry?;
        let d = k.value();
        match decode_row::<Blob>(&format!("blob {d}"), v.value()) {
            Err(e) => bad.push(e.to_string()),
            Ok(blob) if blob.digest() != d => {
                bad.push(format!("blob {d}: its content does not match its digest"))
            }
            Ok(_) => {}
        }
        let counted = refs.get(d)?.map_or(0, |g| g.value());
        let used = uses.get(d).copied().unwrap_or(0);
        if counted != used {
            bad.push(format!(
                "blob {d}: counted {counted} references, {used} task(s) use it"
            ));
        }
    }
    Ok(())
}

impl Maintenance for RedbStore {
    /// Verifies every record of the database; see the module docs.
    fn check(&self) -> Result<CheckReport> {
        let mut rep = CheckReport::default();
        let r = self.begin_read()?;
        macro_rules! scan {
            ($name:expr, $table:expr, $ty:ty, $key:expr) => {{
                let res = guarded($name, || {
                    let t = r.open_table($table)?;
                    let mut n = 0u64;
                    let mut bad = Vec::new();
                    for entry in t.iter()? {
                        let (k, v) = entry?;
                        n += 1;
                        if let Err(e) = decode::<$ty>($name, v.value()) {
                            bad.push(format!("{} {}: {e}", $name, $key(k.value())));
                        }
                    }
                    Ok((n, bad))
                });
                match res {
                    Ok((n, bad)) => {
                        rep.records.insert($name, n);
                        rep.damaged.extend(bad);
                    }
                    Err(e) => rep.damaged.push(e.to_string()),
                }
            }};
        }
        scan!("call key", CALL_KEYS, CallRecord, |k: &str| k.to_string());
        scan!("span", SPANS, Span, |k: (&str, u32)| format!(
            "{}/{}",
            k.0, k.1
        ));
        scan!("reply", REPLIES, RecordedReply, |k: (&str, u32)| format!(
            "{}/{}",
            k.0, k.1
        ));
        scan!("event", EVENTS, Event, |k: u64| k.to_string());
        scan!("note", NOTES, Note, |k: u64| k.to_string());
        let res = guarded("tasks", || check_tasks(&r));
        match res {
            Ok((n, bad)) => {
                rep.records.insert("task", n);
                rep.damaged.extend(bad);
            }
            Err(e) => rep.damaged.push(e.to_string()),
        }
        rep.damaged.sort();
        rep.damaged.dedup();
        Ok(rep)
    }

    /// Deletes finished tasks last updated before `before_ms` (but a cancelled task whose write
    /// is still held), with their spans, replies, call records, audit events and enqueue keys, at most `batch` tasks per transaction, and
    /// records one `purge` event per transaction. Returns the ids deleted.
    fn purge(&self, before_ms: u64, batch: usize, d: &Decision) -> Result<Vec<String>> {
        let batch = batch.clamp(1, 10_000);
        let mut purged = Vec::new();
        loop {
            let ids = self.doomed(before_ms, batch)?;
            if ids.is_empty() {
                return Ok(purged);
            }
            let done = self.purge_batch(&ids, before_ms, d)?;
            let progress = !done.is_empty();
            purged.extend(done);
            if !progress {
                return Ok(purged);
            }
        }
    }
}

fn remove_range(t: &mut redb::Table<(&str, u32), &[u8]>, id: &str) -> Result<()> {
    t.retain_in((id, 0u32)..=(id, u32::MAX), |_, _| false)?;
    Ok(())
}

/// (id, enqueue key, call-key namespace) of a task to delete.
type Doomed = (String, Option<String>, Option<String>);

impl RedbStore {
    /// Up to `batch` finished tasks last updated before `before_ms`, but a cancelled task
    /// whose write is still held.
    fn doomed(&self, before_ms: u64, batch: usize) -> Result<Vec<Doomed>> {
        let r = self.begin_read()?;
        let t = r.open_table(TASKS)?;
        let s = r.open_table(TASK_SPECS)?;
        let held = r.open_table(HELD)?;
        let mut out = Vec::new();
        for entry in t.iter()? {
            let (k, _) = entry?;
            let id = k.value();
            let Ok(Some(row)) = tasks::read_row(&t, id) else {
                continue;
            };
            // A cancelled task whose write is still held stays until it is settled.
            if row.status == QueueStatus::Finished
                && row.updated_at_ms < before_ms
                && held.get(id)?.is_none()
            {
                let spec = s
                    .get(id)?
                    .and_then(|g| rows::decode_spec("spec", g.value()).ok());
                let (key, ns) = spec.map_or((None, None), |sp| (sp.key, sp.key_ns));
                out.push((id.to_string(), key, ns));
                if out.len() == batch {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Deletes `ids` (each checked again) with everything of theirs, in one transaction with
    /// its `purge` audit event; the ids deleted.
    fn purge_batch(&self, ids: &[Doomed], before_ms: u64, d: &Decision) -> Result<Vec<String>> {
        let w = self.begin_write()?;
        let mut done = Vec::new();
        {
            let mut tables = tasks::Tables::open(&w)?;
            let mut spans = w.open_table(SPANS)?;
            let mut replies = w.open_table(REPLIES)?;
            let mut calls = w.open_table(CALL_KEYS)?;
            let mut keys = w.open_table(ENQUEUE_KEYS)?;
            let held = w.open_table(HELD)?;
            let mut idx = super::list::Indexes::open(&w)?;
            let mut flow = super::flow::Flow::open(&w)?;
            for (id, key, ns) in ids {
                // Checked again inside the write: an operator may have acted meanwhile.
                let user = match tasks::read_row(&tables.tasks, id) {
                    Ok(Some(row))
                        if row.status == QueueStatus::Finished
                            && row.updated_at_ms < before_ms
                            && held.get(id.as_str())?.is_none() =>
                    {
                        row.state.user_id
                    }
                    _ => continue,
                };
                tables.delete(id)?;
                idx.removed(id, QueueStatus::Finished, Some(&user))?;
                remove_range(&mut spans, id)?;
                remove_range(&mut replies, id)?;
                // Its call keys are `NS:id:...` (and `NS:id#N:...` in later turns), in its
                // own namespace (or the database id's).
                let ns = ns.as_deref().unwrap_or(self.db_id());
                for (lo, hi) in super::call_key_ranges(ns, id) {
                    calls.retain_in(lo.as_str()..hi.as_str(), |_, _| false)?;
                }
                if let Some(k) = key {
                    keys.remove(k.as_str())?;
                }
                flow.keys.remove(id.as_str())?;
                done.push(id.clone());
            }
            let set: std::collections::BTreeSet<&str> = done.iter().map(String::as_str).collect();
            let mut events = w.open_table(EVENTS)?;
            events.retain(|_, v| {
                decode::<Event>("event", v).map_or(true, |e| {
                    !e.task.as_deref().is_some_and(|t| set.contains(t))
                })
            })?;
        }
        if !done.is_empty() {
            super::decide::event(
                &w,
                None,
                "purge",
                d,
                serde_json::json!({"tasks": done.len(), "first": done[0], "last": done[done.len() - 1], "finished_before_ms": before_ms}),
            )?;
        }
        w.commit()?;
        Ok(done)
    }
}
