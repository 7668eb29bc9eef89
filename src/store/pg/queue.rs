//! The queue on PostgreSQL: enqueue, claims with `FOR UPDATE SKIP LOCKED`, recovery of
//! expired leases and of owners whose heartbeat ran out, heartbeats. Commits are in `commit`.

use crate::store::backend::Queue;
use postgres::Row;
use postgres::types::Json;
use serde_json::Value;

use super::pool::{db_error, is_connection_error};
use super::rows::{TASK_COLUMNS, from_row, i64_of, lease_at, lease_of, ms_col, spec_of};
use super::{PgStore, random_i64};
use crate::kernel::memory::Note;
use crate::store::{
    Changes, Enqueued, Error, Lease, NewTask, Result, TaskRecord, Watched, new_record, same_request,
};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

/// Takes up to `$1` ready tasks under the lease `$2`/`$3` (owner), for `$4` ms (a lease's
/// length) plus each task's remaining active time from now by the server's clock (`$5`: the
/// caller's clock offset); `$6` marks the claim. A task is due when its start time has come;
/// `keyless`: only tasks without a concurrency key (a claim folded into a final commit, which
/// takes no slot; keyed tasks are claimed by `Queue::claim`). The queue's head comes from
/// `ready_head` (migration 13), whose plan reads it in the ready index's order. The function's
/// query sees tasks committed after this statement began, which the `UPDATE` does not: such
/// a task is locked and not claimed (the claim comes back short; the lock ends with the
/// statement, and the task's enqueue `NOTIFY` wakes a daemon to claim it).
pub(super) fn claim_sql(keyless: bool) -> String {
    let now = super::now_sql(5);
    format!(
        "WITH c AS (SELECT r.id FROM {{s}}.ready_head({now}, $1::bigint, {keyless}) AS r(id)) {}",
        claim_update("c")
    )
}

/// The `UPDATE` that claims the tasks of the CTE `from` (a column `id`), with the parameters
/// of [`claim_sql`]; `RETURNING` follows.
pub(super) fn claim_update(from: &str) -> String {
    let now = super::now_sql(5);
    format!(
        "UPDATE {{s}}.tasks t SET status = 'running', token = t.token + 1, lease = $2::jsonb, \
         lease_owner = $3::text, \
         lease_expires_ms = {now} + $4::bigint + GREATEST(t.deadline_ms - t.elapsed_ms, 0), \
         updated_at_ms = {now}, claim_commit = $6::bigint, ready_seq = NULL \
         FROM {from} WHERE t.id = {from}.id RETURNING "
    )
}

/// The length of `lease`, taken at `now_ms`.
pub(super) fn lease_len(lease: &Lease, now_ms: u64) -> i64 {
    i64_of(lease.expires_at_ms.saturating_sub(now_ms))
}

fn to_json<T: serde::Serialize>(v: &T) -> Result<Value> {
    serde_json::to_value(v).map_err(|e| Error::Invalid(format!("cannot encode a commit: {e}")))
}

/// Rows of claimed tasks as records; a row that cannot be read is quarantined (status
/// `damaged`, with why), never returned.
pub(super) fn decode_claimed(
    s: &PgStore,
    rows: &[Row],
    tx: &mut dyn FnMut(&str, &str),
) -> Vec<TaskRecord> {
    let mut out = Vec::new();
    for r in rows {
        match from_row(r) {
            Ok(rec) => out.push(rec),
            Err(e) => {
                let id: String = r.get(0);
                tracing::error!(task = %id, error = %e, db = %s.display(), "task record damaged; quarantined");
                tx(&id, &e.to_string());
            }
        }
    }
    out
}

/// Whether a statement failed because it waited on others' locks (a deadlock, the
/// `lock_timeout`, the `statement_timeout`, a serialization failure): undone, worth trying again.
fn gave_way(e: &postgres::Error) -> bool {
    matches!(
        e.code().map(|c| c.code()),
        Some("40P01" | "40001" | "55P03" | "57014")
    )
}

impl PgStore {
    /// Ends the server process `pid` (started at `started`) of a lost connection and waits
    /// until it is gone, so that what it was running has either committed or been undone.
    /// Without the right to end it, waits for it to end on its own (its statement timeout).
    fn end_session(&self, pid: i32, started: &str) -> Result<()> {
        let end = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                   WHERE pid = $1 AND backend_start::text = $2";
        let alive =
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND backend_start::text = $2";
        if let Err(e) = self.read(|c| c.client.execute(end, &[&pid, &started])) {
            tracing::warn!(error = %e, pid, "cannot end the server process of a lost connection; waiting for it");
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let n: i64 = self.read(|c| Ok(c.client.query_one(alive, &[&pid, &started])?.get(0)))?;
            if n == 0 {
                return Ok(());
            }
            if std::time::Instant::now() > deadline {
                return Err(Error::Unavailable(format!(
                    "the server process {pid} of a lost connection is still running after 60 s"
                )));
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    /// Runs claim statement `sql` (marked `marker`, its `$6`) on its own, one round trip with
    /// no transaction around it; if the connection is lost on the way, what the claim took is
    /// read back by its marker. A claim that gave way to others' locks took nothing and says
    /// so (an empty claim), so a daemon keeps running. A claimed row that cannot be read is
    /// quarantined.
    pub(super) fn run_claim(
        &self,
        sql: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
        marker: i64,
    ) -> Result<Vec<TaskRecord>> {
        let mut c = self.conn()?;
        let rows = match c.prepared(sql).and_then(|st| c.client.query(&st, params)) {
            Ok(rows) => rows,
            Err(e) if is_connection_error(&e) => {
                // The claim may have landed, or may still be running on a server process that
                // has not noticed its client is gone (waiting on a lock, say): end that
                // process first, then take what the claim took, found by its marker.
                c.broken = true;
                let session = c.session.take();
                drop(c);
                tracing::warn!(error = %e, "the connection was lost during a claim; reading back what it claimed");
                if let Some((pid, started)) = session {
                    self.end_session(pid, &started)?;
                }
                let by_marker = self.sql(&format!(
                    "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE claim_commit = $1 AND status = 'running'"
                ));
                self.read(|c| c.client.query(&by_marker, &[&marker]))?
            }
            Err(e) if gave_way(&e) => {
                // The statement was undone whole: nothing was claimed. The next turn claims.
                tracing::warn!(error = %db_error(e), "a claim gave way to another; claiming again next turn");
                return Ok(Vec::new());
            }
            Err(e) => return Err(db_error(e)),
        };
        let quarantine =
            self.sql("UPDATE {s}.tasks SET status = 'damaged', damaged = $2 WHERE id = $1");
        Ok(decode_claimed(self, &rows, &mut |id, why| {
            let _ = self.read(|c| c.client.execute(&quarantine, &[&id, &why]));
        }))
    }
}

impl Queue for PgStore {
    fn enqueue(&self, tasks: &[NewTask], now_ms: u64) -> Result<Vec<Enqueued>> {
        let by_key = self.sql(&format!(
            "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE enqueue_key = $1"
        ));
        let insert = self.sql(
            "INSERT INTO {s}.tasks (id, num, status, priority, ready_seq, enqueue_key, user_id, \
             approval_wait_ms, created_at_ms, updated_at_ms, budget, spec, state, deadline_ms, \
             not_before_ms, concurrency_key) \
             VALUES ($1, $2, 'queued', $3, nextval('{s}.ready_seq'), $4, $5, $6, $7, $7, $8, $9, $10, $11, $12, $13)",
        );
        let notes_sql =
            self.sql("SELECT user_id, text, source, created_at_s, expires_at_s FROM {s}.notes");
        let seq = self.sql("SELECT nextval('{s}.task_seq')");
        // Two enqueuers racing on one key: the second's insert fails on the unique key, and
        // its transaction runs again, finding the first's task.
        let mut tries = 0;
        loop {
            let r = self.write(|tx| {
                let notes: Vec<Note> = tx
                    .query(&notes_sql, &[])
                    .map_err(db_error)?
                    .iter()
                    .map(|r| Note {
                        user: r.get(0),
                        text: r.get(1),
                        source: r.get(2),
                        created_at_s: super::rows::u64_of(r.get(3)),
                        expires_at_s: super::rows::u64_of(r.get(4)),
                    })
                    .collect();
                let mut out = Vec::with_capacity(tasks.len());
                for t in tasks {
                    if let Some(k) = &t.key
                        && let Some(row) = tx.query_opt(&by_key, &[k]).map_err(db_error)?
                    {
                        let rec = from_row(&row)?;
                        same_request(&rec, t, k)?;
                        out.push(Enqueued {
                            id: rec.id,
                            created: false,
                        });
                        continue;
                    }
                    let num: i64 = tx.query_one(&seq, &[]).map_err(db_error)?.get(0);
                    let id = format!("t{num}");
                    let rec = new_record(&self.db_id, &id, t, &notes, now_ms);
                    tx.execute(
                        &insert,
                        &[
                            &id,
                            &num,
                            &rec.priority,
                            &rec.key,
                            &rec.state.user_id,
                            &i64_of(rec.approval_wait_ms),
                            &i64_of(now_ms),
                            &Json(to_json(&rec.budget)?),
                            &Json(spec_of(&rec)?),
                            &Json(to_json(&rec.state)?),
                            &ms_col(rec.budget.deadline_ms),
                            &rec.not_before_ms.map(ms_col),
                            &rec.concurrency_key,
                        ],
                    )
                    .map_err(db_error)?;
                    out.push(Enqueued { id, created: true });
                }
                self.notify(tx)?;
                Ok(out)
            });
            match r {
                Err(Error::Postgres(m)) if m.starts_with("23505") && tries < 3 => tries += 1,
                r => return r.inspect(|_| self.woken.wake()),
            }
        }
    }

    fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let limits = self.limits();
        if !limits.is_empty() {
            return self.claim_limited(lease, max, now_ms, &limits);
        }
        let marker = random_i64();
        let sql = self.sql(&format!("{}{}", claim_sql(false), returning("t.")));
        let lease_json = Json(lease_of(&Some(lease.clone())).unwrap_or(Value::Null));
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let (expires, now) = (lease_len(lease, now_ms), super::offset_of(now_ms));
        self.run_claim(
            &sql,
            &[&limit, &lease_json, &lease.owner, &expires, &now, &marker],
            marker,
        )
    }

    /// How long claim `token` of task `id` is held, by the server's clock: the least of its
    /// lease and its owner's heartbeat. `None`: not current.
    fn claim_left(&self, id: &str, token: u64, now_ms: u64) -> Result<Option<u64>> {
        let now = super::now_sql(3);
        let sql = self.sql(&format!(
            "SELECT LEAST(t.lease_expires_ms, coalesce((SELECT w.expires_at_ms FROM {{s}}.workers w \
             WHERE w.owner = t.lease_owner), 0)) - {now} FROM {{s}}.tasks t \
             WHERE t.id = $1 AND t.status = 'running' AND t.token = $2"
        ));
        let (token, off) = (i64_of(token), super::offset_of(now_ms));
        let rows = self.query(&sql, &[&id, &token, &off])?;
        Ok(rows
            .first()
            .map(|r| super::rows::u64_of(r.get::<_, Option<i64>>(0).unwrap_or(0))))
    }

    /// Renews the lease of claim `token` of task `id`, by the server's clock.
    fn renew_claim(&self, id: &str, token: u64, now_ms: u64, lease_ms: u64) -> Result<bool> {
        let now = super::now_sql(3);
        let sql = self.sql(&format!(
            "UPDATE {{s}}.tasks SET lease_expires_ms = {now} + $4 + GREATEST(deadline_ms - elapsed_ms, 0) \
             WHERE id = $1 AND status = 'running' AND token = $2"
        ));
        let (token, off, len) = (i64_of(token), super::offset_of(now_ms), i64_of(lease_ms));
        let n = self.read(|c| c.client.execute(&sql, &[&id, &token, &off, &len]))?;
        Ok(n == 1)
    }

    fn ready_count(&self) -> Result<u64> {
        let sql = self.sql("SELECT count(*) FROM {s}.tasks WHERE status = 'queued'");
        let n: i64 = self.read(|c| Ok(c.client.query_one(&sql, &[])?.get(0)))?;
        Ok(super::rows::u64_of(n))
    }

    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>> {
        // Expiries are the server's times, compared with the server's clock.
        let off = super::offset_of(now_ms);
        let now = super::now_sql(1);
        // Only what the decision needs: never the state, spec or script of a running task.
        let candidates = self.sql(&format!(
            "SELECT id, token, lease, lease_expires_ms, NOT EXISTS (SELECT 1 FROM {{s}}.workers w \
             WHERE w.owner = t.lease_owner AND w.expires_at_ms > {now}), \
             coalesce(lease_expires_ms <= {now}, true) FROM {{s}}.tasks t WHERE status = 'running'"
        ));
        let rows = self.read(|c| c.client.query(&candidates, &[&off]))?;
        let mut take: Vec<(String, i64)> = Vec::new();
        for r in &rows {
            let id: String = r.get(0);
            let token: i64 = r.get(1);
            let owner_gone: bool = r.get(4);
            let expired: bool = r.get(5);
            // A lease that cannot be read, or none, leaves nobody running the task.
            let over = match lease_at(r, 1, &id) {
                Ok(Some(l)) => (expired || owner_gone || is_dead(&l)) && !live(&id, &l),
                _ => true,
            };
            if over {
                take.push((id, token));
            }
        }
        let requeue = self.sql(&format!(
            "UPDATE {{s}}.tasks SET status = 'queued', ready_seq = nextval('{{s}}.ready_seq'), \
             lease = NULL, lease_owner = NULL, lease_expires_ms = NULL, updated_at_ms = {} \
             WHERE id = $1 AND status = 'running' AND token = $2",
            super::now_sql(3)
        ));
        let tidy_commits = self.sql(&format!(
            "DELETE FROM {{s}}.commits WHERE at_ms < {now} - 3600000"
        ));
        let tidy_workers = self.sql(&format!(
            "DELETE FROM {{s}}.workers WHERE expires_at_ms < {now} - 86400000"
        ));
        if take.is_empty() {
            let _ = self.read(|c| {
                c.client.execute(&tidy_commits, &[&off])?;
                c.client.execute(&tidy_workers, &[&off])
            });
            return Ok(Vec::new());
        }
        self.write(|tx| {
            let mut done = Vec::new();
            for (id, token) in &take {
                if tx.execute(&requeue, &[id, token, &off]).map_err(db_error)? == 1 {
                    done.push(id.clone());
                }
            }
            if !done.is_empty() {
                self.notify(tx)?;
            }
            Ok(done)
        })
    }

    /// Vouches for `owner`'s claims until `until_ms - now_ms` from now, by the server's clock.
    fn heartbeat(&self, owner: &str, now_ms: u64, until_ms: u64) -> Result<()> {
        let now = super::now_sql(2);
        let sql = self.sql(&format!(
            "INSERT INTO {{s}}.workers (owner, beat_at_ms, expires_at_ms) VALUES ($1, {now}, {now} + $3) \
             ON CONFLICT (owner) DO UPDATE SET beat_at_ms = EXCLUDED.beat_at_ms, expires_at_ms = EXCLUDED.expires_at_ms"
        ));
        let (off, ttl) = (
            super::offset_of(now_ms),
            i64_of(until_ms.saturating_sub(now_ms)),
        );
        self.read(|c| c.client.execute(&sql, &[&owner, &off, &ttl]))?;
        Ok(())
    }

    fn sign_off(&self, owner: &str) -> Result<()> {
        let sql = self.sql("DELETE FROM {s}.workers WHERE owner = $1");
        self.read(|c| c.client.execute(&sql, &[&owner]))?;
        Ok(())
    }

    /// Hosts share the database: owners prove they are alive by heartbeats.
    fn local_owners(&self) -> bool {
        false
    }

    /// LISTEN on the settled channel (registered in `waiters`, so that settles notify: the
    /// trigger of migrations 6 and 8) or on the callbacks channel; the listening thread stops
    /// when the guard is dropped.
    fn changes(&self, of: Watched) -> Option<Changes> {
        let stop = Arc::new(AtomicBool::new(false));
        let (channel, then) = match of {
            Watched::Settled => (
                format!("{}_settled", self.schema),
                Some(self.sql(super::schema::REGISTER_WAITER)),
            ),
            Watched::Callbacks => (format!("{}_callbacks", self.schema), None),
        };
        let rx = self.listen_on(channel, then, Arc::clone(&stop))?;
        Some(Changes {
            rx,
            guard: Box::new(super::listen::StopOnDrop(stop)),
        })
    }

    fn set_limits(&self, limits: crate::store::flow::ConcurrencyLimits) {
        *self.limits.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(limits);
    }

    fn next_start_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        let now = super::now_sql(1);
        let sql = self.sql(&format!(
            "SELECT min(not_before_ms) - {now} FROM {{s}}.tasks WHERE status = 'queued' \
             AND not_before_ms > {now}"
        ));
        let off = super::offset_of(now_ms);
        let left: Option<i64> = self.read(|c| Ok(c.client.query_one(&sql, &[&off])?.get(0)))?;
        // In the caller's clock: the server's time left, from the caller's now.
        Ok(left.map(|l| now_ms.saturating_add(super::rows::u64_of(l))))
    }

    fn woken(&self) -> crossbeam_channel::Receiver<()> {
        self.woken.receiver()
    }

    /// LISTEN/NOTIFY on the queue's channel.
    fn wakeups(&self) -> Option<crossbeam_channel::Receiver<()>> {
        self.listen()
    }

    fn running_count(&self) -> Result<u64> {
        let sql = self.sql("SELECT count(*) FROM {s}.tasks WHERE status = 'running'");
        let n: i64 = self.read(|c| Ok(c.client.query_one(&sql, &[])?.get(0)))?;
        Ok(super::rows::u64_of(n))
    }
}

/// `RETURNING` the task columns, qualified with `prefix`.
pub(super) fn returning(prefix: &str) -> String {
    TASK_COLUMNS
        .split(", ")
        .map(|c| format!("{prefix}{}", c.trim()))
        .collect::<Vec<_>>()
        .join(", ")
}
