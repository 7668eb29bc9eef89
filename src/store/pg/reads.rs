//! Operator decisions, reads, memory notes, purge and check on PostgreSQL. A decision runs in
//! one transaction that reads its task `FOR UPDATE`, through the same code as on redb (see
//! [`crate::store::ops`]).

use postgres::Transaction;
use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::pool::db_error;
use super::rows::{SAVE_SQL, TASK_COLUMNS, from_row, i64_of, saved, u64_of};
use crate::kernel::Span;
use crate::kernel::memory::Note;
use crate::model::RecordedReply;
use crate::store::CheckReport;
use crate::store::ops::{Decision, DecisionTx, Event};
use crate::store::{CallRecord, Error, QueueStatus, Result, TaskRecord, task_order};

const CALL_COLUMNS: &str =
    "key, task_id, step, tool, args, digest, intent_at_ms, result, result_at_ms";

fn call_of(r: &postgres::Row) -> Result<CallRecord> {
    let key: String = r.get(0);
    let args = match r.get::<_, Json<Value>>(4).0 {
        Value::Object(m) => m,
        _ => {
            return Err(Error::Corrupt(format!(
                "call {key}: its args are not an object"
            )));
        }
    };
    Ok(CallRecord {
        task_id: r.get(1),
        step: u32::try_from(r.get::<_, i32>(2)).unwrap_or(0),
        tool: r.get(3),
        args,
        digest: r.get(5),
        intent_at_ms: u64_of(r.get(6)),
        result: r.get::<_, Option<Json<Value>>>(7).map(|j| j.0),
        result_at_ms: r.get::<_, Option<i64>>(8).map(u64_of),
        key,
    })
}

fn event_of(r: &postgres::Row) -> Event {
    Event {
        seq: u64_of(r.get(0)),
        at_ms: u64_of(r.get(1)),
        task: r.get(2),
        verb: r.get(3),
        by: r.get(4),
        reason: r.get(5),
        detail: r.get::<_, Json<Value>>(6).0,
    }
}

fn json_value<T: serde::de::DeserializeOwned>(v: Value, what: &str) -> Result<T> {
    serde_json::from_value(v).map_err(|e| Error::Corrupt(format!("{what} cannot be read: {e}")))
}

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
        self.s.db_id()
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
        if let Some(why) = row.get::<_, Option<String>>(18) {
            return Err(Error::Corrupt(format!("task {id} is quarantined: {why}")));
        }
        from_row(&row)
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

impl PgStore {
    pub fn decide(&self, f: &mut dyn FnMut(&mut dyn DecisionTx) -> Result<()>) -> Result<()> {
        self.write(|tx| f(&mut PgTx { s: self, tx }))
    }

    pub fn task(&self, id: &str) -> Result<TaskRecord> {
        let sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE id = $1 AND damaged IS NULL"
        ));
        let row = self.read(|c| c.client.query_opt(&sql, &[&id]))?;
        from_row(&row.ok_or_else(|| Error::NoTask(id.to_string()))?)
    }

    pub fn tasks(&self) -> Result<Vec<TaskRecord>> {
        let sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE damaged IS NULL ORDER BY num"
        ));
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        Ok(rows.iter().filter_map(|r| from_row(r).ok()).collect())
    }

    pub fn damaged(&self) -> Result<Vec<(String, String)>> {
        let sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS}, damaged FROM {{s}}.tasks ORDER BY num"
        ));
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        let mut out = Vec::new();
        for r in &rows {
            let id: String = r.get(0);
            if let Some(why) = r.get::<_, Option<String>>(18) {
                out.push((id, why));
            } else if let Err(e) = from_row(r) {
                out.push((id, e.to_string()));
            }
        }
        Ok(out)
    }

    pub fn spans(&self, task_id: &str) -> Result<Vec<Span>> {
        let sql = self.sql("SELECT span FROM {s}.spans WHERE task_id = $1 ORDER BY id");
        let rows = self.read(|c| c.client.query(&sql, &[&task_id]))?;
        rows.iter()
            .map(|r| json_value(r.get::<_, Json<Value>>(0).0, "a span"))
            .collect()
    }

    pub fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>> {
        let sql = self.sql("SELECT reply FROM {s}.replies WHERE task_id = $1 ORDER BY step");
        let rows = self.read(|c| c.client.query(&sql, &[&task_id]))?;
        rows.iter()
            .map(|r| json_value(r.get::<_, Json<Value>>(0).0, "a recorded reply"))
            .collect()
    }

    pub fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>> {
        let sql = self.sql("SELECT reply FROM {s}.replies WHERE task_id = $1 AND step = $2");
        let step = step as i32;
        let rows = self.query(&sql, &[&task_id, &step])?;
        rows.first()
            .map(|r| json_value(r.get::<_, Json<Value>>(0).0, "a recorded reply"))
            .transpose()
    }

    pub fn call(&self, key: &str) -> Result<Option<CallRecord>> {
        let sql = self.sql(&format!(
            "SELECT {CALL_COLUMNS} FROM {{s}}.calls WHERE key = $1"
        ));
        let row = self.read(|c| c.client.query_opt(&sql, &[&key]))?;
        row.map(|r| call_of(&r)).transpose()
    }

    pub fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>> {
        let sql = self.sql(&format!(
            "SELECT {CALL_COLUMNS} FROM {{s}}.calls WHERE task_id = $1 ORDER BY key"
        ));
        let rows = self.read(|c| c.client.query(&sql, &[&task_id]))?;
        rows.iter().map(call_of).collect()
    }

    pub fn events(&self, task: Option<&str>) -> Result<Vec<Event>> {
        let sql = self.sql(
            "SELECT seq, at_ms, task_id, verb, by_name, reason, detail FROM {s}.events \
             WHERE $1::text IS NULL OR task_id = $1 ORDER BY seq",
        );
        let rows = self.read(|c| c.client.query(&sql, &[&task]))?;
        Ok(rows.iter().map(event_of).collect())
    }

    pub fn held_ids(&self) -> Result<Vec<String>> {
        let sql = self.sql("SELECT id FROM {s}.tasks WHERE held_at_ms IS NOT NULL ORDER BY num");
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        let mut ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        ids.sort_by_key(|id| task_order(id));
        Ok(ids)
    }

    pub fn due_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        // A final commit stamps the wait with the server's clock; it is compared with it.
        let sql = self.sql(&format!(
            "SELECT id FROM {{s}}.tasks WHERE wait_until_ms <= {} ORDER BY num",
            super::now_sql(1)
        ));
        let now = super::offset_of(now_ms);
        let rows = self.read(|c| c.client.query(&sql, &[&now]))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    pub fn add_note(
        &self,
        user: &str,
        text: &str,
        source: &str,
        ttl_s: u64,
        d: &Decision,
    ) -> Result<Note> {
        let note = crate::store::memory::admit_note(user, text, source, ttl_s, d)?;
        let sql = self.sql(
            "INSERT INTO {s}.notes (user_id, text, source, created_at_s, expires_at_s) \
             VALUES ($1, $2, $3, $4, $5)",
        );
        self.write(|tx| {
            tx.execute(
                &sql,
                &[
                    &note.user,
                    &note.text,
                    &note.source,
                    &i64_of(note.created_at_s),
                    &i64_of(note.expires_at_s),
                ],
            )
            .map_err(db_error)?;
            event(
                self,
                tx,
                None,
                "memory_add",
                d,
                serde_json::json!({"user": user, "source": source, "ttl_s": ttl_s}),
            )
        })?;
        Ok(note)
    }

    pub fn notes(&self, user: Option<&str>, now_ms: u64, all: bool) -> Result<Vec<Note>> {
        let sql = self.sql(
            "SELECT user_id, text, source, created_at_s, expires_at_s FROM {s}.notes \
             WHERE ($1::text IS NULL OR user_id = $1) AND ($2 OR expires_at_s > $3) ORDER BY seq",
        );
        let now_s = i64_of(now_ms / 1000);
        let rows = self.read(|c| c.client.query(&sql, &[&user, &all, &now_s]))?;
        Ok(rows
            .iter()
            .map(|r| Note {
                user: r.get(0),
                text: r.get(1),
                source: r.get(2),
                created_at_s: u64_of(r.get(3)),
                expires_at_s: u64_of(r.get(4)),
            })
            .collect())
    }

    pub fn forget(&self, user: &str, source: Option<&str>, d: &Decision) -> Result<usize> {
        let sql = self
            .sql("DELETE FROM {s}.notes WHERE user_id = $1 AND ($2::text IS NULL OR source = $2)");
        self.write(|tx| {
            let n = tx.execute(&sql, &[&user, &source]).map_err(db_error)? as usize;
            event(
                self,
                tx,
                None,
                "memory_forget",
                d,
                serde_json::json!({"user": user, "source": source, "deleted": n}),
            )?;
            Ok(n)
        })
    }

    /// Deletes finished tasks (not a cancelled one whose write is still held) in batches,
    /// each with everything recorded of it and one `purge` event.
    pub fn purge(&self, before_ms: u64, batch: usize, d: &Decision) -> Result<Vec<String>> {
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
    pub fn check(&self) -> Result<CheckReport> {
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
