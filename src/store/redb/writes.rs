//! A write meter for the storage benchmark: what the step commits of one database wrote, in
//! this format and, when asked, in format 1 (JSON records, the whole task record rewritten by
//! every step). Off unless the benchmark switches it on (`RedbStore::meter_writes`); then it reads
//! back, inside each commit group's transaction and after the commits are applied, what they
//! wrote. The commit code itself counts nothing.

use redb::{ReadableTable, WriteTransaction};

use super::rows as tasks;
use super::schema::TASKS;
use crate::store::{Commit, CommitKind, Result, codec::encode};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

/// What step commits wrote: bytes of records in this format and, when `measure_legacy` is
/// set, what format 1 would have written for the same commits.
#[derive(Debug, Default)]
pub struct WriteStats {
    pub commits: AtomicU64,
    pub bytes: AtomicU64,
    pub legacy_bytes: AtomicU64,
    pub measure_legacy: AtomicBool,
}

impl WriteStats {
    /// Counts commit `c`, already applied inside `w`.
    pub(super) fn count(&self, w: &WriteTransaction, c: &Commit) -> Result<()> {
        let whole_record = c.kind != CommitKind::Intent;
        let mut n = 0;
        if let Some(call) = &c.call {
            n += encode(call)?.len();
        }
        if let Some(reply) = &c.reply {
            n += encode(reply)?.len();
        }
        for s in &c.spans {
            n += encode(s)?.len();
        }
        if whole_record && let Some(row) = w.open_table(TASKS)?.get(c.task_id.as_str())? {
            n += row.value().len();
        }
        self.commits.fetch_add(1, Relaxed);
        self.bytes.fetch_add(n as u64, Relaxed);
        // What format 1 would have written is an estimate: one that cannot be made is left
        // out, never a reason to fail the commit.
        if self.measure_legacy.load(Relaxed)
            && let Ok(legacy) = legacy_bytes(w, c, whole_record)
        {
            self.legacy_bytes.fetch_add(legacy as u64, Relaxed);
        }
        Ok(())
    }
}

/// What format 1 wrote for commit `c`: each record as JSON with its `"v"` tag, and (but for
/// an intent) the whole task record.
fn legacy_bytes(w: &WriteTransaction, c: &Commit, whole_record: bool) -> Result<usize> {
    let json = |v: serde_json::Result<Vec<u8>>| v.map_or(0, |b| b.len() + 6);
    let mut n = 0;
    if let Some(call) = &c.call {
        n += json(serde_json::to_vec(call));
    }
    if let Some(reply) = &c.reply {
        n += json(serde_json::to_vec(reply));
    }
    for s in &c.spans {
        n += json(serde_json::to_vec(s));
    }
    if whole_record && let Some(rec) = tasks::load(w, &c.task_id)? {
        n += json(serde_json::to_vec(&rec));
    }
    Ok(n)
}
