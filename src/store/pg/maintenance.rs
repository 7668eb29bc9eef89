//! `worker check` and `worker purge` on PostgreSQL: verifying every record, and deleting
//! finished tasks in bounded transactions.

use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::decide::event;
use super::pool::db_error;
use super::reads::{CALL_COLUMNS, call_of, json_value};
use super::rows::{i64_of, u64_of};
use crate::kernel::Span;
use crate::model::RecordedReply;
use crate::store::CheckReport;
use crate::store::Decision;
use crate::store::backend::{Maintenance, Reads};
use crate::store::{Result, task_order};

impl Maintenance for PgStore {
    /// Deletes finished tasks (not a cancelled one whose write is still held) in batches,
    /// each with everything recorded of it and one `purge` event.
    fn purge(&self, before_ms: u64, batch: usize, d: &Decision) -> Result<Vec<String>> {
        let batch = batch.clamp(1, 10_000) as i64;
        let before = i64_of(before_ms);
        let pick = self.sql(
            "DELETE FROM {s}.tasks WHERE id IN (SELECT id FROM {s}.tasks WHERE status = 'finished' \
             AND updated_at_ms < $1 AND held_at_ms IS NULL ORDER BY num LIMIT $2 \
             FOR UPDATE SKIP LOCKED) RETURNING id",
        );
        let rest = [
            self.sql("DELETE FROM {s}.spans WHERE task_id = ANY($1)"),
            self.sql("DELETE FROM {s}.replies WHERE task_id = ANY($1)"),
            self.sql("DELETE FROM {s}.calls WHERE task_id = ANY($1)"),
            self.sql("DELETE FROM {s}.events WHERE task_id = ANY($1)"),
        ];
        let mut purged = Vec::new();
        loop {
            let done = self.write(|tx| {
                let mut ids: Vec<String> = tx
                    .query(&pick, &[&before, &batch])
                    .map_err(db_error)?
                    .iter()
                    .map(|r| r.get(0))
                    .collect();
                if ids.is_empty() {
                    return Ok(ids);
                }
                ids.sort_by_key(|id| task_order(id));
                for sql in &rest {
                    tx.execute(sql, &[&ids]).map_err(db_error)?;
                }
                event(
                    self,
                    tx,
                    None,
                    "purge",
                    d,
                    serde_json::json!({"tasks": ids.len(), "first": ids[0], "last": ids[ids.len() - 1], "finished_before_ms": before_ms}),
                )?;
                Ok(ids)
            })?;
            if done.is_empty() {
                return Ok(purged);
            }
            purged.extend(done);
        }
    }

    /// Reads every record back: each task, span, reply, call record and event must decode.
    fn check(&self) -> Result<CheckReport> {
        let mut rep = CheckReport::default();
        for (id, why) in self.damaged()? {
            rep.damaged.push(format!("task {id}: {why}"));
        }
        let count = |sql: &str| -> Result<u64> {
            let sql = self.sql(sql);
            let n: i64 = self.read(|c| Ok(c.client.query_one(&sql, &[])?.get(0)))?;
            Ok(u64_of(n))
        };
        rep.records
            .insert("task", count("SELECT count(*) FROM {s}.tasks")?);
        rep.records
            .insert("event", count("SELECT count(*) FROM {s}.events")?);
        rep.records
            .insert("note", count("SELECT count(*) FROM {s}.notes")?);
        let spans = self.sql("SELECT task_id, id, span FROM {s}.spans");
        let rows = self.read(|c| c.client.query(&spans, &[]))?;
        rep.records.insert("span", rows.len() as u64);
        for r in &rows {
            if let Err(e) = json_value::<Span>(r.get::<_, Json<Value>>(2).0, "span") {
                rep.damaged.push(format!(
                    "span {}/{}: {e}",
                    r.get::<_, String>(0),
                    r.get::<_, i32>(1)
                ));
            }
        }
        let replies = self.sql("SELECT task_id, step, reply FROM {s}.replies");
        let rows = self.read(|c| c.client.query(&replies, &[]))?;
        rep.records.insert("reply", rows.len() as u64);
        for r in &rows {
            if let Err(e) = json_value::<RecordedReply>(r.get::<_, Json<Value>>(2).0, "reply") {
                rep.damaged.push(format!(
                    "reply {}/{}: {e}",
                    r.get::<_, String>(0),
                    r.get::<_, i32>(1)
                ));
            }
        }
        let calls = self.sql(&format!("SELECT {CALL_COLUMNS} FROM {{s}}.calls"));
        let rows = self.read(|c| c.client.query(&calls, &[]))?;
        rep.records.insert("call key", rows.len() as u64);
        for r in &rows {
            if let Err(e) = call_of(r) {
                rep.damaged.push(e.to_string());
            }
        }
        rep.damaged.sort();
        rep.damaged.dedup();
        Ok(rep)
    }
}
