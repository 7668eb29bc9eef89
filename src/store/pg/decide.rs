//! Operator decisions on PostgreSQL: each runs in one transaction that reads its task
//! `FOR UPDATE`, through [`PgTx`], the one place that keeps a task's indexed columns in step
//! with its status when a decision writes it. The policy is `operator`'s, the same as on redb.

use postgres::Transaction;
use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::pool::db_error;
use super::reads::{CALL_COLUMNS, call_of};
use super::rows::{SAVE_SQL, TASK_COLUMNS, from_row, i64_of, saved, u64_of};
use crate::store::backend::Decide;
use crate::store::{CallRecord, Error, QueueStatus, Result, TaskRecord};
use crate::store::{Decision, DecisionTx};

/// Appends an audit event inside `tx`.
pub(super) fn event(
    s: &PgStore,
    tx: &mut Transaction<'_>,
    task: Option<&str>,
    verb: &str,
    d: &Decision,
    detail: Value,
) -> Result<u64> {
    let sql = s.sql(
        "INSERT INTO {s}.events (at_ms, task_id, verb, by_name, reason, detail) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING seq",
    );
    let seq: i64 = tx
        .query_one(
            &sql,
            &[
                &i64_of(d.now_ms),
                &task,
                &verb,
                &d.by,
                &d.reason,
                &Json(detail),
            ],
        )
        .map_err(db_error)?
        .get(0);
    Ok(u64_of(seq))
}

/// An operator decision's view of one PostgreSQL transaction.
struct PgTx<'s, 'a, 'b> {
    s: &'s PgStore,
    tx: &'a mut Transaction<'b>,
}

impl DecisionTx for PgTx<'_, '_, '_> {
    fn db_id(&self) -> &str {
        &self.s.db_id
    }

    fn load(&mut self, id: &str) -> Result<TaskRecord> {
        let sql = self.s.sql(&format!(
            "SELECT {TASK_COLUMNS}, damaged FROM {{s}}.tasks WHERE id = $1 FOR UPDATE"
        ));
        let row = self
            .tx
            .query_opt(&sql, &[&id])
            .map_err(db_error)?
            .ok_or_else(|| Error::NoTask(id.to_string()))?;
        if let Some(why) = row.get::<_, Option<String>>(super::rows::TASK_COLUMNS_LEN) {
            return Err(Error::Corrupt(format!("task {id} is quarantined: {why}")));
        }
        from_row(&row)
    }

    fn queue_callback(&mut self, cb: &crate::store::Callback) -> Result<()> {
        super::callbacks::queue(self.s, self.tx, cb)
    }

    fn save(&mut self, rec: &TaskRecord, was: QueueStatus) -> Result<()> {
        let v = saved(rec, was)?;
        self.tx
            .execute(&self.s.sql(SAVE_SQL), &v.params(&rec.id))
            .map_err(db_error)?;
        if v.newly_queued {
            self.s.notify(self.tx)?;
        }
        Ok(())
    }

    fn event(
        &mut self,
        task: Option<&str>,
        verb: &str,
        d: &Decision,
        detail: Value,
    ) -> Result<u64> {
        event(self.s, self.tx, task, verb, d, detail)
    }

    fn call(&mut self, key: &str) -> Result<Option<std::result::Result<CallRecord, String>>> {
        let sql = self.s.sql(&format!(
            "SELECT {CALL_COLUMNS} FROM {{s}}.calls WHERE key = $1"
        ));
        Ok(self
            .tx
            .query_opt(&sql, &[&key])
            .map_err(db_error)?
            .map(|r| call_of(&r).map_err(|e| e.to_string())))
    }

    fn calls(
        &mut self,
        rec: &TaskRecord,
    ) -> Result<Vec<std::result::Result<CallRecord, (String, String)>>> {
        let sql = self.s.sql(&format!(
            "SELECT {CALL_COLUMNS} FROM {{s}}.calls WHERE task_id = $1 ORDER BY step, key"
        ));
        let rows = self.tx.query(&sql, &[&rec.id]).map_err(db_error)?;
        Ok(rows
            .iter()
            .map(|r| {
                call_of(r).map_err(|e| {
                    let key: String = r.try_get(0).unwrap_or_default();
                    (key, e.to_string())
                })
            })
            .collect())
    }

    fn put_call(&mut self, c: &CallRecord) -> Result<()> {
        let sql = self.s.sql(&format!(
            "INSERT INTO {{s}}.calls ({CALL_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
             ON CONFLICT (key) DO UPDATE SET result = EXCLUDED.result, result_at_ms = EXCLUDED.result_at_ms"
        ));
        self.tx
            .execute(
                &sql,
                &[
                    &c.key,
                    &c.task_id,
                    &(c.step as i32),
                    &c.tool,
                    &Json(Value::Object(c.args.clone())),
                    &c.digest,
                    &i64_of(c.intent_at_ms),
                    &c.result.clone().map(Json),
                    &c.result_at_ms.map(i64_of),
                ],
            )
            .map_err(db_error)?;
        Ok(())
    }

    fn queue_root(&mut self, id: &str) -> Result<()> {
        self.tx
            .execute(&self.s.sql(super::outbox::QUEUE_ROOT_SQL), &[&id])
            .map_err(db_error)?;
        Ok(())
    }
}

impl Decide for PgStore {
    fn decide(&self, f: &mut dyn FnMut(&mut dyn DecisionTx) -> Result<()>) -> Result<()> {
        self.write(|tx| f(&mut PgTx { s: self, tx }))?;
        self.woken.wake();
        Ok(())
    }
}
