//! Accounting of what step commits write, for the storage benchmark: the bytes of the records
//! in this format and, when asked, what format 1 (JSON records, the whole task record
//! rewritten by every step) would have written for the same commits.

use redb::WriteTransaction;

use super::rows as tasks;
use crate::store::{Commit, Result};

/// What step commits wrote, for the storage benchmark: bytes of records in this format and,
/// when `measure_legacy` is set, what format 1 (JSON, the whole task record rewritten by every
/// step) would have written for the same commits.
#[derive(Debug, Default)]
pub struct WriteStats {
    pub commits: std::sync::atomic::AtomicU64,
    pub bytes: std::sync::atomic::AtomicU64,
    pub legacy_bytes: std::sync::atomic::AtomicU64,
    pub measure_legacy: std::sync::atomic::AtomicBool,
}

impl WriteStats {
    pub(super) fn count(&self, bytes: usize, legacy: impl FnOnce() -> Result<usize>) {
        use std::sync::atomic::Ordering::Relaxed;
        self.commits.fetch_add(1, Relaxed);
        self.bytes.fetch_add(bytes as u64, Relaxed);
        if self.measure_legacy.load(Relaxed)
            && let Ok(n) = legacy()
        {
            self.legacy_bytes.fetch_add(n as u64, Relaxed);
        }
    }

    pub fn reset(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.commits.store(0, Relaxed);
        self.bytes.store(0, Relaxed);
        self.legacy_bytes.store(0, Relaxed);
    }
}

/// Bytes written by the step commits of this process.
pub static WRITES: WriteStats = WriteStats {
    commits: std::sync::atomic::AtomicU64::new(0),
    bytes: std::sync::atomic::AtomicU64::new(0),
    legacy_bytes: std::sync::atomic::AtomicU64::new(0),
    measure_legacy: std::sync::atomic::AtomicBool::new(false),
};

/// What format 1 wrote for commit `c`: each record as JSON with its `"v"` tag, and (but for
/// an intent) the whole task record.
pub(super) fn legacy_bytes(w: &WriteTransaction, c: &Commit, whole_record: bool) -> Result<usize> {
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
