//! The completion-callback outbox in the redb file (see `store::callbacks`): a table of rows,
//! each added by the transaction that settled its task. Daemons on one file claim the rows
//! they send (a claim runs out, so a killed daemon's claims pass to another), and remove a
//! row when its receiver accepted it.

use redb::{ReadableTable, ReadableTableMetadata, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};

use super::{RedbStore, next_seq, schema::META};
use crate::store::backend::Callbacks;
use crate::store::codec::{decode_row, encode_row};
use crate::store::{Callback, Decision, Result};

/// seq -> callback row.
pub const CALLBACKS: TableDefinition<u64, &[u8]> = TableDefinition::new("callbacks");
const META_CALLBACK_SEQ: &str = "callback_seq";

/// A callback as stored, with the claim of the daemon sending it.
#[derive(Serialize, Deserialize)]
struct CallbackRow {
    id: String,
    task_id: String,
    url: String,
    /// JSON text, sent byte for byte as stored.
    payload: String,
    created_at_ms: u64,
    attempts: u32,
    next_at_ms: u64,
    last_error: Option<String>,
    claimed_by: u64,
    claimed_until_ms: u64,
}

impl CallbackRow {
    fn of(cb: &Callback) -> CallbackRow {
        CallbackRow {
            id: cb.id.clone(),
            task_id: cb.task_id.clone(),
            url: cb.url.clone(),
            payload: cb.payload.clone(),
            created_at_ms: cb.created_at_ms,
            attempts: cb.attempts,
            next_at_ms: cb.next_at_ms,
            last_error: cb.last_error.clone(),
            claimed_by: 0,
            claimed_until_ms: 0,
        }
    }

    fn callback(&self, seq: u64) -> Callback {
        Callback {
            seq,
            id: self.id.clone(),
            task_id: self.task_id.clone(),
            url: self.url.clone(),
            payload: self.payload.clone(),
            created_at_ms: self.created_at_ms,
            attempts: self.attempts,
            next_at_ms: self.next_at_ms,
            last_error: self.last_error.clone(),
        }
    }
}

/// Adds `cb` to the outbox, inside the transaction that settled its task.
pub(super) fn queue(w: &WriteTransaction, cb: &Callback) -> Result<()> {
    let seq = next_seq(&mut w.open_table(META)?, META_CALLBACK_SEQ)?;
    w.open_table(CALLBACKS)?
        .insert(seq, encode_row(&CallbackRow::of(cb))?.as_slice())?;
    Ok(())
}

/// The row `seq` as stored, or `None` when it is gone (sent, or given up by another daemon).
fn row(w: &WriteTransaction, seq: u64) -> Result<Option<CallbackRow>> {
    let t = w.open_table(CALLBACKS)?;
    let Some(v) = t.get(seq)? else {
        return Ok(None);
    };
    Ok(Some(decode_row("callback", v.value())?))
}

fn put(w: &WriteTransaction, seq: u64, r: &CallbackRow) -> Result<()> {
    w.open_table(CALLBACKS)?
        .insert(seq, encode_row(r)?.as_slice())?;
    Ok(())
}

impl Callbacks for RedbStore {
    fn callbacks_due(
        &self,
        me: u64,
        now_ms: u64,
        claim_ms: u64,
        max: usize,
    ) -> Result<Vec<Callback>> {
        // A read first: an idle sender writes nothing.
        let due: Vec<u64> = {
            let r = self.db.begin_read()?;
            let t = match r.open_table(CALLBACKS) {
                Ok(t) => t,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(e) => return Err(e.into()),
            };
            let mut due = Vec::new();
            for item in t.iter()? {
                let (k, v) = item?;
                let free = match decode_row::<CallbackRow>("callback", v.value()) {
                    Ok(row) => {
                        row.next_at_ms <= now_ms
                            && (row.claimed_by == 0
                                || row.claimed_by == me
                                || row.claimed_until_ms < now_ms)
                    }
                    // Given up below, with its audit event.
                    Err(_) => true,
                };
                if free {
                    due.push(k.value());
                    if due.len() == max {
                        break;
                    }
                }
            }
            due
        };
        if due.is_empty() {
            return Ok(Vec::new());
        }
        let w = self.begin_write()?;
        let mut out = Vec::new();
        for seq in due {
            match row(&w, seq) {
                Ok(None) => {}
                Ok(Some(mut r)) => {
                    // Checked again inside the write: another daemon may have claimed it.
                    if r.next_at_ms > now_ms
                        || (r.claimed_by != 0 && r.claimed_by != me && r.claimed_until_ms >= now_ms)
                    {
                        continue;
                    }
                    r.claimed_by = me;
                    r.claimed_until_ms = now_ms.saturating_add(claim_ms);
                    put(&w, seq, &r)?;
                    out.push(r.callback(seq));
                }
                Err(e) => {
                    tracing::error!(seq, error = %e, "a callback row cannot be read; dropped");
                    w.open_table(CALLBACKS)?.remove(seq)?;
                    let d = Decision {
                        by: "daemon".into(),
                        reason: Some("a damaged callback row".into()),
                        now_ms,
                    };
                    super::decide::event(
                        &w,
                        None,
                        "callback_failed",
                        &d,
                        serde_json::json!({"seq": seq, "error": e.to_string()}),
                    )?;
                }
            }
        }
        w.commit()?;
        Ok(out)
    }

    fn callback_sent(&self, seq: u64) -> Result<()> {
        let w = self.begin_write()?;
        w.open_table(CALLBACKS)?.remove(seq)?;
        w.commit()?;
        Ok(())
    }

    fn callback_retry(&self, seq: u64, next_at_ms: u64, error: &str) -> Result<()> {
        let w = self.begin_write()?;
        if let Some(mut r) = row(&w, seq)? {
            r.attempts = r.attempts.saturating_add(1);
            r.next_at_ms = next_at_ms;
            r.last_error = Some(crate::store::callbacks::clip(error));
            r.claimed_by = 0;
            r.claimed_until_ms = 0;
            put(&w, seq, &r)?;
        }
        w.commit()?;
        Ok(())
    }

    fn callback_give_up(&self, cb: &Callback, why: &str, d: &Decision) -> Result<()> {
        let w = self.begin_write()?;
        if w.open_table(CALLBACKS)?.remove(cb.seq)?.is_some() {
            super::decide::event(
                &w,
                Some(&cb.task_id),
                "callback_failed",
                d,
                crate::store::callbacks::given_up_detail(cb, why),
            )?;
        }
        w.commit()?;
        Ok(())
    }

    fn callbacks_pending(&self) -> Result<u64> {
        let r = self.db.begin_read()?;
        match r.open_table(CALLBACKS) {
            Ok(t) => Ok(t.len()?),
            Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }
}
