//! A task as a PostgreSQL row and back: typed columns for what queries filter on, `jsonb` and
//! `json` for the rest, and the row a decision writes with the indexes that follow from it.

use postgres::Row;
use postgres::types::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;

use crate::kernel::Catalog;
use crate::model::ModelProfile;
use crate::store::{Error, Lease, QueueStatus, Result, TaskRecord};

/// The columns a task is read from, in the order [`from_row`] expects.
pub const TASK_COLUMNS: &str = "id, status, priority, enqueue_key, token, lease, lease_expires_ms, \
    suspended_at_ms, approval_wait_ms, cancel_requested, created_at_ms, updated_at_ms, \
    next_span_id, budget, spec, state, settle, approval, not_before_ms, concurrency_key";

/// How many columns [`TASK_COLUMNS`] names: a column selected after them is at this index.
pub const TASK_COLUMNS_LEN: usize = 20;

/// What enqueue fixed: written once, never rewritten by a step.
#[derive(Serialize, Deserialize)]
pub struct Spec {
    pub model: ModelProfile,
    #[serde(default)]
    pub tool_latency_ms: BTreeMap<String, u64>,
    #[serde(default)]
    pub catalog: Option<Catalog>,
    #[serde(default)]
    pub store_scope: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_ns: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enqueued_budget: Option<crate::kernel::Budget>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_by: Option<String>,
    #[serde(default)]
    pub time_limits: crate::store::TimeLimits,
}

/// A lease as stored: the owner's identity and the token; the expiry is its own column.
#[derive(Serialize, Deserialize)]
struct LeaseCol {
    owner: String,
    host: String,
    pid: u32,
    start_ticks: u64,
}

/// Now, as a `bigint` column holds it.
pub(crate) fn now_i64() -> i64 {
    i64_of(crate::clock::now_ms())
}

/// A random non-negative `bigint` (commit markers).
pub(crate) fn random_i64() -> i64 {
    (crate::store::random_u64() >> 1) as i64
}

pub fn i64_of(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

pub fn u64_of(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

fn json_of<T: Serialize>(v: &T, what: &str) -> Result<Value> {
    serde_json::to_value(v).map_err(|e| Error::Invalid(format!("cannot encode {what}: {e}")))
}

fn parse<T: serde::de::DeserializeOwned>(v: Value, what: &str, id: &str) -> Result<T> {
    serde_json::from_value(v)
        .map_err(|e| Error::Corrupt(format!("task {id}: its {what} cannot be read: {e}")))
}

/// The task of a row selected with [`TASK_COLUMNS`].
pub fn from_row(r: &Row) -> Result<TaskRecord> {
    from_row_at(r, 0)
}

/// The lease of a row whose columns `token, lease, lease_expires_ms` start at column `o`.
pub fn lease_at(r: &Row, o: usize, id: &str) -> Result<Option<Lease>> {
    let Some(Json(v)) = r.get::<_, Option<Json<Value>>>(o + 1) else {
        return Ok(None);
    };
    let l: LeaseCol = parse(v, "lease", id)?;
    Ok(Some(Lease {
        owner: l.owner,
        host: l.host,
        pid: l.pid,
        start_ticks: l.start_ticks,
        expires_at_ms: r.get::<_, Option<i64>>(o + 2).map_or(0, u64_of),
        token: u64_of(r.get(o)),
    }))
}

/// The task of a row whose [`TASK_COLUMNS`] start at column `o`.
pub fn from_row_at(r: &Row, o: usize) -> Result<TaskRecord> {
    let id: String = r.get(o);
    let status: String = r.get(1 + o);
    let status = QueueStatus::parse(&status)
        .ok_or_else(|| Error::Corrupt(format!("task {id}: unknown status {status:?}")))?;
    let spec: Spec = parse(r.get::<_, Json<Value>>(14 + o).0, "spec", &id)?;
    let lease = lease_at(r, o + 4, &id)?;
    Ok(TaskRecord {
        status,
        priority: r.get(2 + o),
        key: r.get(3 + o),
        lease,
        suspended_at_ms: r.get::<_, Option<i64>>(7 + o).map(u64_of),
        approval_wait_ms: u64_of(r.get(8 + o)),
        cancel_requested: r.get(9 + o),
        created_at_ms: u64_of(r.get(10 + o)),
        updated_at_ms: u64_of(r.get(11 + o)),
        next_span_id: u32::try_from(r.get::<_, i32>(12 + o)).unwrap_or(0),
        budget: parse(r.get::<_, Json<Value>>(13 + o).0, "budget", &id)?,
        state: parse(r.get::<_, Json<Value>>(15 + o).0, "state", &id)?,
        settle: r.get::<_, Option<Json<Value>>>(16 + o).map(|j| j.0),
        approval: match r.get::<_, Option<Json<Value>>>(17 + o) {
            Some(Json(v)) => Some(parse(v, "approval", &id)?),
            None => None,
        },
        runs: u32::try_from(r.get::<_, i64>(4 + o)).unwrap_or(u32::MAX),
        model: spec.model,
        tool_latency_ms: spec.tool_latency_ms,
        // One copy in memory for the tasks of one catalog (see `shared_catalog`).
        catalog: match spec.catalog {
            Some(c) => Some(
                crate::store::rows::shared_catalog(&crate::store::rows::catalog_digest(&c), || {
                    Ok(c)
                })
                .map_err(Error::Corrupt)?,
            ),
            None => None,
        },
        store_scope: spec.store_scope,
        key_ns: spec.key_ns,
        enqueued_budget: spec.enqueued_budget,
        instructions: spec.instructions,
        callback_url: spec.callback_url,
        submitted_by: spec.submitted_by,
        not_before_ms: r.get::<_, Option<i64>>(18 + o).map(u64_of),
        concurrency_key: r.get(19 + o),
        time_limits: spec.time_limits,
        id,
    })
}

pub fn spec_of(rec: &TaskRecord) -> Result<Value> {
    json_of(
        &Spec {
            model: rec.model.clone(),
            tool_latency_ms: rec.tool_latency_ms.clone(),
            catalog: rec.catalog.as_deref().cloned(),
            store_scope: rec.store_scope.clone(),
            key_ns: rec.key_ns.clone(),
            enqueued_budget: rec.enqueued_budget,
            instructions: rec.instructions.clone(),
            callback_url: rec.callback_url.clone(),
            submitted_by: rec.submitted_by.clone(),
            time_limits: rec.time_limits,
        },
        "the task's spec",
    )
}

pub fn lease_of(l: &Option<Lease>) -> Option<Value> {
    l.as_ref().map(|l| {
        serde_json::json!({"owner": l.owner, "host": l.host, "pid": l.pid, "start_ticks": l.start_ticks})
    })
}

/// The values of the columns a decision (or a claim) rewrites, in the order of
/// [`SAVE_SQL`]'s parameters `$2..`.
pub struct Saved {
    pub status: &'static str,
    pub token: i64,
    pub lease: Option<Json<Value>>,
    pub lease_owner: Option<String>,
    pub lease_expires_ms: Option<i64>,
    pub wait_until_ms: Option<i64>,
    pub held: bool,
    pub newly_queued: bool,
    pub suspended_at_ms: Option<i64>,
    pub cancel_requested: Option<String>,
    pub updated_at_ms: i64,
    pub next_span_id: i32,
    pub budget: Json<Value>,
    pub state: Json<Value>,
    pub settle: Option<Json<Value>>,
    pub approval: Option<Json<Value>>,
    pub deadline_ms: i64,
    pub elapsed_ms: i64,
    pub not_before_ms: Option<i64>,
}

/// A time in milliseconds as a column that sums with now without overflow.
pub fn ms_col(v: u64) -> i64 {
    i64_of(v.min(MS_MAX))
}

/// The largest span of milliseconds a column holds (far beyond any budget: 126 million years).
pub const MS_MAX: u64 = 4_000_000_000_000_000;

/// Rewrites a task's changeable columns; the indexes (ready sequence, approval wait, held
/// list) follow from the record. `$1` is the id.
pub const SAVE_SQL: &str = "UPDATE {s}.tasks SET status = $2, token = $3, lease = $4, \
    lease_owner = $5, lease_expires_ms = $6, wait_until_ms = $7, \
    held_at_ms = CASE WHEN $8 THEN coalesce(held_at_ms, $12) ELSE NULL END, \
    ready_seq = CASE WHEN $9 THEN nextval('{s}.ready_seq') ELSE ready_seq END, \
    suspended_at_ms = $10, cancel_requested = $11, updated_at_ms = $12, next_span_id = $13, \
    budget = $14, state = $15, settle = $16, approval = $17, deadline_ms = $18, \
    elapsed_ms = $19, not_before_ms = $20 WHERE id = $1";

pub fn saved(rec: &TaskRecord, was: QueueStatus) -> Result<Saved> {
    Ok(Saved {
        status: rec.status.as_str(),
        token: i64::from(rec.runs),
        lease: lease_of(&rec.lease).map(Json),
        lease_owner: rec.lease.as_ref().map(|l| l.owner.clone()),
        lease_expires_ms: rec.lease.as_ref().map(|l| i64_of(l.expires_at_ms)),
        wait_until_ms: match (rec.status, rec.suspended_at_ms) {
            (QueueStatus::Suspended, Some(at)) => {
                Some(i64_of(at.saturating_add(rec.approval_wait_ms)))
            }
            _ => None,
        },
        held: rec.is_held(),
        newly_queued: rec.status == QueueStatus::Queued && was != QueueStatus::Queued,
        suspended_at_ms: rec.suspended_at_ms.map(i64_of),
        cancel_requested: rec.cancel_requested.clone(),
        updated_at_ms: i64_of(rec.updated_at_ms),
        next_span_id: i32::try_from(rec.next_span_id).unwrap_or(i32::MAX),
        budget: Json(json_of(&rec.budget, "the budget")?),
        state: Json(json_of(&rec.state, "the task state")?),
        settle: rec.settle.clone().map(Json),
        approval: match &rec.approval {
            Some(a) => Some(Json(json_of(a, "the approval")?)),
            None => None,
        },
        deadline_ms: ms_col(rec.budget.deadline_ms),
        elapsed_ms: ms_col(rec.state.elapsed_ms),
        not_before_ms: rec.not_before_ms.map(ms_col),
    })
}

impl Saved {
    pub fn params<'a>(&'a self, id: &'a String) -> [&'a (dyn postgres::types::ToSql + Sync); 20] {
        [
            id,
            &self.status,
            &self.token,
            &self.lease,
            &self.lease_owner,
            &self.lease_expires_ms,
            &self.wait_until_ms,
            &self.held,
            &self.newly_queued,
            &self.suspended_at_ms,
            &self.cancel_requested,
            &self.updated_at_ms,
            &self.next_span_id,
            &self.budget,
            &self.state,
            &self.settle,
            &self.approval,
            &self.deadline_ms,
            &self.elapsed_ms,
            &self.not_before_ms,
        ]
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_column_count_is_that_of_the_list() {
        assert_eq!(
            super::TASK_COLUMNS.split(',').count(),
            super::TASK_COLUMNS_LEN
        );
    }
}
