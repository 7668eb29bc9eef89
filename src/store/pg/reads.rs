//! Reads of one task and of what was recorded of it, on PostgreSQL: the task, its spans,
//! replies and call records, the audit log, and the held and waiting tasks.

use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::rows::{TASK_COLUMNS, from_row, u64_of};
use crate::kernel::Span;
use crate::model::RecordedReply;
use crate::store::Event;
use crate::store::backend::Reads;
use crate::store::{CallRecord, Error, Result, TaskRecord, task_order};

pub(super) const CALL_COLUMNS: &str =
    "key, task_id, step, tool, args, digest, intent_at_ms, result, result_at_ms";

pub(super) fn call_of(r: &postgres::Row) -> Result<CallRecord> {
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

pub(super) fn json_value<T: serde::de::DeserializeOwned>(v: Value, what: &str) -> Result<T> {
    serde_json::from_value(v).map_err(|e| Error::Corrupt(format!("{what} cannot be read: {e}")))
}

impl Reads for PgStore {
    fn task(&self, id: &str) -> Result<TaskRecord> {
        let sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE id = $1 AND damaged IS NULL"
        ));
        let row = self.read(|c| c.client.query_opt(&sql, &[&id]))?;
        from_row(&row.ok_or_else(|| Error::NoTask(id.to_string()))?)
    }

    fn tasks(&self) -> Result<Vec<TaskRecord>> {
        let sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE damaged IS NULL ORDER BY num"
        ));
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        Ok(rows.iter().filter_map(|r| from_row(r).ok()).collect())
    }

    fn damaged(&self) -> Result<Vec<(String, String)>> {
        let sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS}, damaged FROM {{s}}.tasks ORDER BY num"
        ));
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        let mut out = Vec::new();
        for r in &rows {
            let id: String = r.get(0);
            if let Some(why) = r.get::<_, Option<String>>(super::rows::TASK_COLUMNS_LEN) {
                out.push((id, why));
            } else if let Err(e) = from_row(r) {
                out.push((id, e.to_string()));
            }
        }
        Ok(out)
    }

    fn spans(&self, task_id: &str) -> Result<Vec<Span>> {
        let sql = self.sql("SELECT span FROM {s}.spans WHERE task_id = $1 ORDER BY id");
        let rows = self.read(|c| c.client.query(&sql, &[&task_id]))?;
        rows.iter()
            .map(|r| json_value(r.get::<_, Json<Value>>(0).0, "a span"))
            .collect()
    }

    fn replies(&self, task_id: &str) -> Result<Vec<RecordedReply>> {
        let sql = self.sql("SELECT reply FROM {s}.replies WHERE task_id = $1 ORDER BY step");
        let rows = self.read(|c| c.client.query(&sql, &[&task_id]))?;
        rows.iter()
            .map(|r| json_value(r.get::<_, Json<Value>>(0).0, "a recorded reply"))
            .collect()
    }

    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>> {
        let sql = self.sql("SELECT reply FROM {s}.replies WHERE task_id = $1 AND step = $2");
        let step = step as i32;
        let rows = self.query(&sql, &[&task_id, &step])?;
        rows.first()
            .map(|r| json_value(r.get::<_, Json<Value>>(0).0, "a recorded reply"))
            .transpose()
    }

    fn call(&self, key: &str) -> Result<Option<CallRecord>> {
        let sql = self.sql(&format!(
            "SELECT {CALL_COLUMNS} FROM {{s}}.calls WHERE key = $1"
        ));
        let row = self.read(|c| c.client.query_opt(&sql, &[&key]))?;
        row.map(|r| call_of(&r)).transpose()
    }

    fn calls(&self, task_id: &str) -> Result<Vec<CallRecord>> {
        let sql = self.sql(&format!(
            "SELECT {CALL_COLUMNS} FROM {{s}}.calls WHERE task_id = $1 ORDER BY step, key"
        ));
        let rows = self.read(|c| c.client.query(&sql, &[&task_id]))?;
        rows.iter().map(call_of).collect()
    }

    fn events(&self, task: Option<&str>) -> Result<Vec<Event>> {
        let sql = self.sql(
            "SELECT seq, at_ms, task_id, verb, by_name, reason, detail FROM {s}.events \
             WHERE $1::text IS NULL OR task_id = $1 ORDER BY seq",
        );
        let rows = self.read(|c| c.client.query(&sql, &[&task]))?;
        Ok(rows.iter().map(event_of).collect())
    }

    fn held_ids(&self) -> Result<Vec<String>> {
        let sql = self.sql("SELECT id FROM {s}.tasks WHERE held_at_ms IS NOT NULL ORDER BY num");
        let rows = self.read(|c| c.client.query(&sql, &[]))?;
        let mut ids: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
        ids.sort_by_key(|id| task_order(id));
        Ok(ids)
    }

    fn due_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        // A final commit stamps the wait with the server's clock; it is compared with it.
        let sql = self.sql(&format!(
            "SELECT id FROM {{s}}.tasks WHERE wait_until_ms <= {} ORDER BY num",
            super::now_sql(1)
        ));
        let now = super::offset_of(now_ms);
        let rows = self.read(|c| c.client.query(&sql, &[&now]))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }
}
