//! The completion-callback outbox on PostgreSQL (migration 7; see `store::callbacks`): a final
//! commit inserts its task's callback in its own statement (`commit.rs`, `CALLBACK_CTE`), a
//! decision through [`queue`]. Senders on several hosts claim due rows with `FOR UPDATE SKIP
//! LOCKED` for a while, so each attempt is made by one of them; a claim of a sender that died
//! runs out and another takes the row. Times are the server's clock plus the caller's offset.

use postgres::Transaction;

use super::pool::db_error;
use super::rows::{i64_of, u64_of};
use super::{PgStore, now_sql, offset_of};
use crate::store::backend::Callbacks;
use crate::store::{Callback, Decision, Result};

const COLUMNS: &str =
    "seq, id, task_id, url, payload, created_at_ms, attempts, next_at_ms, last_error";

fn of(r: &postgres::Row) -> Callback {
    Callback {
        seq: u64_of(r.get(0)),
        id: r.get(1),
        task_id: r.get(2),
        url: r.get(3),
        payload: r.get(4),
        created_at_ms: u64_of(r.get(5)),
        attempts: u32::try_from(r.get::<_, i32>(6)).unwrap_or(0),
        next_at_ms: u64_of(r.get(7)),
        last_error: r.get(8),
    }
}

/// Adds `cb` inside a decision's transaction.
pub(super) fn queue(s: &PgStore, tx: &mut Transaction<'_>, cb: &Callback) -> Result<()> {
    let now = now_sql(6);
    let sql = s.sql(&format!(
        "INSERT INTO {{s}}.callbacks (id, task_id, url, payload, created_at_ms, next_at_ms) \
         VALUES ($1, $2, $3, $4, $5, {now})"
    ));
    tx.execute(
        &sql,
        &[
            &cb.id,
            &cb.task_id,
            &cb.url,
            &cb.payload,
            &i64_of(cb.created_at_ms),
            &offset_of(cb.next_at_ms),
        ],
    )
    .map_err(db_error)?;
    Ok(())
}

impl Callbacks for PgStore {
    fn callbacks_due(
        &self,
        me: u64,
        now_ms: u64,
        claim_ms: u64,
        max: usize,
    ) -> Result<Vec<Callback>> {
        let now = now_sql(2);
        let sql = self.sql(&format!(
            "WITH c AS (SELECT seq FROM {{s}}.callbacks WHERE next_at_ms <= {now} \
             AND (claimed_by IS NULL OR claimed_by = $1 OR claimed_until_ms < {now}) \
             ORDER BY seq LIMIT $3 FOR UPDATE SKIP LOCKED) \
             UPDATE {{s}}.callbacks b SET claimed_by = $1, claimed_until_ms = {now} + $4 FROM c \
             WHERE b.seq = c.seq RETURNING {}",
            COLUMNS
                .split(", ")
                .map(|c| format!("b.{c}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
        let me = (me >> 1) as i64;
        let rows = self.query(
            &sql,
            &[&me, &offset_of(now_ms), &(max as i64), &i64_of(claim_ms)],
        )?;
        let mut out: Vec<Callback> = rows.iter().map(of).collect();
        out.sort_by_key(|c| c.seq);
        Ok(out)
    }

    fn callback_sent(&self, seq: u64) -> Result<()> {
        let sql = self.sql("DELETE FROM {s}.callbacks WHERE seq = $1");
        self.query(&sql, &[&i64_of(seq)])?;
        Ok(())
    }

    fn callback_retry(&self, seq: u64, next_at_ms: u64, error: &str) -> Result<()> {
        let next = now_sql(2);
        let sql = self.sql(&format!(
            "UPDATE {{s}}.callbacks SET attempts = attempts + 1, next_at_ms = {next}, \
             last_error = $3, claimed_by = NULL, claimed_until_ms = NULL WHERE seq = $1"
        ));
        let error = crate::store::callbacks::clip(error);
        self.query(&sql, &[&i64_of(seq), &offset_of(next_at_ms), &error])?;
        Ok(())
    }

    fn callback_give_up(&self, cb: &Callback, why: &str, d: &Decision) -> Result<()> {
        let del = self.sql("DELETE FROM {s}.callbacks WHERE seq = $1");
        self.write(|tx| {
            let gone = tx.execute(&del, &[&i64_of(cb.seq)]).map_err(db_error)?;
            if gone > 0 {
                super::decide::event(
                    self,
                    tx,
                    Some(&cb.task_id),
                    "callback_failed",
                    d,
                    crate::store::callbacks::given_up_detail(cb, why),
                )?;
            }
            Ok(())
        })
    }

    fn callbacks_pending(&self) -> Result<u64> {
        let sql = self.sql("SELECT count(*) FROM {s}.callbacks");
        let rows = self.query(&sql, &[])?;
        Ok(rows.first().map_or(0, |r| u64_of(r.get(0))))
    }
}
