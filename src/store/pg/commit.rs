//! Step commits on PostgreSQL: each kind of commit as one statement (data-modifying CTEs behind
//! the `UPDATE` fenced by the claim's token), a group in one transaction, and the read-back
//! that turns a lost acknowledgment into a known outcome before the worker goes on.

use crate::store::backend::Commits;
use postgres::types::{Json, ToSql};
use postgres::{Row, Transaction};
use serde_json::Value;
use std::time::Instant;

use super::pool::{db_error, is_connection_error};
use super::queue::{claim_sql, decode_claimed, lease_len, returning};
use super::rows::{TASK_COLUMNS, from_row, from_row_at, i64_of, lease_of, ms_col};
use super::{PgStore, random_i64};
use crate::store::{Commit, CommitKind, CommitOutcome, Error, QueueStatus, Result, TaskRecord};

type Param<'a> = &'a (dyn ToSql + Sync);

/// The common part of a step commit: the fenced update (its `SET` per kind), then the commit's
/// marker, the call record, the reply and the spans, each written only if the update matched.
const COMMIT_SQL: &str = "WITH u AS (UPDATE {s}.tasks SET {set} \
        WHERE id = $1::text AND status = 'running' AND token = $2::bigint RETURNING cancel_requested), \
    m AS (INSERT INTO {s}.commits (id, at_ms) SELECT $3::bigint, $4::bigint FROM u), \
    c AS (INSERT INTO {s}.calls (key, task_id, step, tool, args, digest, intent_at_ms, result, result_at_ms) \
        SELECT $5::text, $1, $6::int, $7::text, $8::json, $9::text, $10::bigint, $11::json, $12::bigint \
        FROM u WHERE $5::text IS NOT NULL ON CONFLICT (key) DO UPDATE SET task_id = EXCLUDED.task_id, \
        step = EXCLUDED.step, tool = EXCLUDED.tool, args = EXCLUDED.args, digest = EXCLUDED.digest, \
        intent_at_ms = EXCLUDED.intent_at_ms, result = EXCLUDED.result, result_at_ms = EXCLUDED.result_at_ms), \
    r AS (INSERT INTO {s}.replies (task_id, step, reply) SELECT $1, $13::int, $14::json FROM u \
        WHERE $14::json IS NOT NULL ON CONFLICT (task_id, step) DO UPDATE SET reply = EXCLUDED.reply), \
    sp AS (INSERT INTO {s}.spans (task_id, id, span) SELECT $1, (x->>'id')::int, x \
        FROM u, json_array_elements($15::json) x ON CONFLICT (task_id, id) DO UPDATE SET span = EXCLUDED.span)\
    {cb}{ob} SELECT cancel_requested FROM u";

/// The statement part of a final commit that queues the task's completion callback (`$23`
/// its id, `$24` its URL, `$25` its body; all null when the task names no callback), only if
/// the fenced update matched.
const CALLBACK_CTE: &str = ", cb AS (INSERT INTO {s}.callbacks (id, task_id, url, payload, created_at_ms, next_at_ms) \
    SELECT $23::text, $1, $24::text, $25::text, $4::bigint, $4::bigint FROM u WHERE $23::text IS NOT NULL)";

/// What a step writes into the task row (`$16..`): state, span counter, settlement, elapsed.
/// (In every commit statement `$4::bigint` stands for "now", the server's clock plus the
/// caller's offset, which `$4` carries: see [`super::offset_of`].)
const STEP_SET: &str = "state = $16::json, next_span_id = $17::int, \
    settle = CASE WHEN $18::bool THEN NULL ELSE settle END, elapsed_ms = $19::bigint, updated_at_ms = $4::bigint";

/// The statement of each kind of commit, in [`kind_index`] order, and last the final commit
/// that also claims the thread's next task.
/// The statement of each kind of commit, in [`kind_index`] order, and last the final commit
/// that also claims the thread's next task; then the same five for a daemon that exports spans
/// live (each also queues the spans it ends in the outbox).
pub(super) fn commit_statements(s: &str, t: &str) -> [String; 10] {
    use crate::kernel::StopReason::Done;
    let five = |ob: &str| {
        let final_sql = commit_sql(CommitKind::Final(Done), ob);
        let claiming = final_sql.replace(
            " SELECT cancel_requested FROM u",
            &format!(", {}", final_and_claim()),
        );
        debug_assert_ne!(claiming, final_sql);
        [
            commit_sql(CommitKind::Intent, ob),
            commit_sql(CommitKind::Step, ob),
            final_sql,
            commit_sql(CommitKind::Release, ob),
            claiming,
        ]
    };
    let [a, b, c, d, e] = five("");
    let [f, g, h, i, j] = five(super::outbox::QUEUE_CTE);
    [a, b, c, d, e, f, g, h, i, j].map(|q| super::schema::sql(&q, s, t))
}

/// The end of a final commit that claims the thread's next task in the same statement (one
/// round trip, one flush): a queued task without a concurrency key (the head of the queue, by
/// `ready_head`: none when the update matched no row) is taken only if the final commit was accepted, under
/// the lease `$26`/`$27` for `$28` ms plus the task's remaining active time from now, marked
/// with the commit's marker `$3`.
fn final_and_claim() -> String {
    format!(
        "nx AS (SELECT r.id FROM {{s}}.ready_head($4::bigint, (SELECT count(*) FROM u), true) AS r(id)), \
         cl AS (UPDATE {{s}}.tasks t SET status = 'running', token = t.token + 1, lease = $26::jsonb, \
         lease_owner = $27::text, \
         lease_expires_ms = $4::bigint + $28::bigint + GREATEST(t.deadline_ms - t.elapsed_ms, 0), \
         updated_at_ms = $4::bigint, claim_commit = $3::bigint, ready_seq = NULL \
         FROM nx WHERE t.id = nx.id RETURNING {}) \
         SELECT u.cancel_requested, cl.* FROM u LEFT JOIN cl ON true",
        returning("t.")
    )
    // Appended to a statement whose `$4::bigint` already became "now": here too, `$4` is
    // the caller's clock offset, and "now" is the server's clock plus it.
    .replace("$4::bigint", &super::now_sql(4))
}

fn kind_index(kind: CommitKind) -> usize {
    match kind {
        CommitKind::Intent => 0,
        CommitKind::Step => 1,
        CommitKind::Final(_) => 2,
        CommitKind::Release => 3,
    }
}

fn commit_sql(kind: CommitKind, ob: &str) -> String {
    let set = match kind {
        CommitKind::Intent => "updated_at_ms = GREATEST(updated_at_ms, $4::bigint)".to_string(),
        CommitKind::Step => format!(
            "{STEP_SET}, lease_expires_ms = $4::bigint + $20::bigint + GREATEST(deadline_ms - $19::bigint, 0)"
        ),
        CommitKind::Final(_) => format!(
            "{STEP_SET}, status = $20::text, \
             suspended_at_ms = CASE WHEN $21::bool THEN $4::bigint ELSE NULL END, \
             wait_until_ms = CASE WHEN $21::bool THEN $4::bigint + LEAST(approval_wait_ms, {max}) ELSE NULL END, \
             held_at_ms = CASE WHEN $22::bool THEN $4::bigint ELSE NULL END, \
             lease = NULL, lease_owner = NULL, lease_expires_ms = NULL",
            max = super::rows::MS_MAX
        ),
        CommitKind::Release => format!(
            "{STEP_SET}, status = 'queued', ready_seq = nextval('{{s}}.ready_seq'), \
             lease = NULL, lease_owner = NULL, lease_expires_ms = NULL, \
             not_before_ms = COALESCE($20::bigint, not_before_ms)"
        ),
    };
    let ob = ob.replace(
        "{root}",
        super::outbox::root_when(matches!(kind, CommitKind::Final(_))),
    );
    // "Now" is the server's clock plus the offset `$4` carries.
    let cb = if matches!(kind, CommitKind::Final(_)) {
        CALLBACK_CTE
    } else {
        ""
    };
    COMMIT_SQL
        .replace("{set}", &set)
        .replace("{cb}", cb)
        .replace("{ob}", &ob)
        .replace("$4::bigint", &super::now_sql(4))
}

/// The parameters of one commit, its JSON values serialized straight from the commit.
struct CommitParams<'c> {
    marker: i64,
    now: i64,
    key: Option<String>,
    step: Option<i32>,
    tool: Option<String>,
    args: Option<Json<&'c serde_json::Map<String, Value>>>,
    digest: Option<String>,
    intent_at: Option<i64>,
    result: Option<Json<&'c Value>>,
    result_at: Option<i64>,
    reply_step: Option<i32>,
    reply: Option<Json<&'c crate::model::RecordedReply>>,
    spans: Json<&'c [crate::kernel::Span]>,
    state: Json<&'c crate::kernel::TaskState>,
    next_span_id: i32,
    clear_settle: bool,
    elapsed: i64,
    lease_ms: i64,
    status: String,
    suspends: bool,
    holds: bool,
    token: i64,
    cb_id: Option<String>,
    cb_url: Option<String>,
    cb_payload: Option<String>,
    not_before: Option<i64>,
}

impl<'c> CommitParams<'c> {
    fn of(c: &'c Commit, marker: i64) -> Result<CommitParams<'c>> {
        let call = c.call.as_ref();
        let stop = match c.kind {
            CommitKind::Final(s) => Some(s),
            _ => None,
        };
        Ok(CommitParams {
            marker,
            now: super::offset_of(c.now_ms),
            key: call.map(|k| k.key.clone()),
            step: call.map(|k| k.step as i32),
            tool: call.map(|k| k.tool.clone()),
            args: call.map(|k| Json(&k.args)),
            digest: call.map(|k| k.digest.clone()),
            intent_at: call.map(|k| i64_of(k.intent_at_ms)),
            result: call.and_then(|k| k.result.as_ref()).map(Json),
            result_at: call.and_then(|k| k.result_at_ms).map(i64_of),
            reply_step: c.reply.as_ref().map(|r| r.step as i32),
            reply: c.reply.as_ref().map(Json),
            spans: Json(c.spans.as_slice()),
            state: Json(&c.state),
            next_span_id: i32::try_from(c.next_span_id).unwrap_or(i32::MAX),
            clear_settle: c.clear_settle,
            elapsed: ms_col(c.state.elapsed_ms),
            lease_ms: ms_col(c.lease_ms),
            status: stop
                .map_or("", |s| QueueStatus::after(s).as_str())
                .to_string(),
            suspends: stop.is_some_and(crate::kernel::StopReason::suspends),
            holds: c.holds(),
            token: i64_of(c.token),
            cb_id: c.callback.as_ref().map(|cb| cb.id.clone()),
            cb_url: c.callback.as_ref().map(|cb| cb.url.clone()),
            cb_payload: c.callback.as_ref().map(|cb| cb.payload.clone()),
            not_before: c.not_before_ms.map(i64_of),
        })
    }

    fn params<'a>(&'a self, c: &'a Commit) -> Vec<Param<'a>> {
        let mut p: Vec<Param<'a>> = vec![
            &c.task_id,
            &self.token,
            &self.marker,
            &self.now,
            &self.key,
            &self.step,
            &self.tool,
            &self.args,
            &self.digest,
            &self.intent_at,
            &self.result,
            &self.result_at,
            &self.reply_step,
            &self.reply,
            &self.spans,
        ];
        match c.kind {
            CommitKind::Intent => {}
            CommitKind::Step => p.extend([
                &self.state as Param,
                &self.next_span_id,
                &self.clear_settle,
                &self.elapsed,
                &self.lease_ms,
            ]),
            CommitKind::Final(_) => p.extend([
                &self.state as Param,
                &self.next_span_id,
                &self.clear_settle,
                &self.elapsed,
                &self.status,
                &self.suspends,
                &self.holds,
                &self.cb_id,
                &self.cb_url,
                &self.cb_payload,
            ]),
            CommitKind::Release => p.extend([
                &self.state as Param,
                &self.next_span_id,
                &self.clear_settle,
                &self.elapsed,
                &self.not_before,
            ]),
        }
        p
    }
}

impl Commits for PgStore {
    /// Applies `commits`: a single commit as one statement; several, or a final commit that
    /// claims the next task, in one transaction. A lost acknowledgment is resolved by the
    /// commit markers before answering.
    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String> {
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            let params: Vec<CommitParams> = commits
                .iter()
                .map(|c| CommitParams::of(c, random_i64()))
                .collect::<Result<_>>()
                .map_err(|e| e.to_string())?;
            let fault = match commits {
                [c] if c.claim_next.is_none() => self.next_commit_fault(),
                _ => super::CommitFault::None,
            };
            if fault != super::CommitFault::None {
                match self.commit_with_fault(commits[0], &params[0], fault) {
                    Ok(()) => {}
                    Err(e) => return Err(e.to_string()),
                }
                tracing::warn!(db = %self.display(), ?fault, "injected: the commit's acknowledgment is lost; reading back whether it landed");
                match self.read_back(commits, &params) {
                    Ok(Some(out)) => return Ok(out),
                    Ok(None) => {
                        attempt += 1;
                        continue;
                    }
                    Err(e) => return Err(e.to_string()),
                }
            }
            let mut c = self.conn().map_err(|e| e.to_string())?;
            let tried = if commits.len() == 1 {
                self.commit_one(&mut c, commits[0], &params[0])
                    .map(|o| vec![o])
            } else {
                self.commit_many(&mut c, commits, &params)
            };
            match tried {
                Ok(out) => return Ok(out),
                Err(Tried::Failed(e)) => return Err(e.to_string()),
                Err(Tried::Lost(e, sent)) => {
                    c.broken = true;
                    drop(c);
                    if sent {
                        tracing::warn!(db = %self.display(), error = %e, "the connection was lost during a commit; reading back whether it landed");
                        match self.read_back(commits, &params) {
                            Ok(Some(out)) => {
                                tracing::info!("the commit had landed");
                                return Ok(out);
                            }
                            Ok(None) => {
                                tracing::info!("the commit had not landed; committing again")
                            }
                            Err(e) => return Err(e.to_string()),
                        }
                    }
                    attempt += 1;
                    if !self.pool.backoff(started, attempt) {
                        return Err(format!(
                            "PostgreSQL at {} stayed unreachable: {e}",
                            self.display()
                        ));
                    }
                }
            }
        }
    }

    /// A connection per thread commits in parallel; the server groups the flushes.
    fn groups_commits(&self) -> bool {
        false
    }
}

impl PgStore {
    /// A commit under an injected fault, on a connection of its own: committed at once
    /// (its answer then "lost"), or left in progress and resolved `resolve_after` later by a
    /// thread of its own.
    fn commit_with_fault(
        &self,
        commit: &Commit,
        p: &CommitParams,
        fault: super::CommitFault,
    ) -> Result<()> {
        let mut client = self.pool.settings.connect().map_err(super::db_error)?;
        let export = if commit.export { 5 } else { 0 };
        let sql = &self.commit_sql[kind_index(commit.kind) + export];
        client.batch_execute("BEGIN").map_err(super::db_error)?;
        client
            .query(sql.as_str(), &p.params(commit))
            .map_err(super::db_error)?;
        match fault {
            super::CommitFault::InProgress {
                lands,
                resolve_after,
            } => {
                std::thread::spawn(move || {
                    std::thread::sleep(resolve_after);
                    let _ = client.batch_execute(if lands { "COMMIT" } else { "ROLLBACK" });
                });
            }
            _ => client.batch_execute("COMMIT").map_err(super::db_error)?,
        }
        Ok(())
    }

    fn commit_one(
        &self,
        c: &mut super::Conn,
        commit: &Commit,
        p: &CommitParams,
    ) -> std::result::Result<Option<CommitOutcome>, Tried> {
        let claiming = match (commit.kind, &commit.claim_next) {
            (CommitKind::Final(_), Some(lease)) => Some(lease),
            _ => None,
        };
        let export = if commit.export { 5 } else { 0 };
        let sql = match claiming {
            Some(_) => &self.commit_sql[4 + export],
            None => &self.commit_sql[kind_index(commit.kind) + export],
        };
        let st = c.prepared(sql).map_err(|e| Tried::of(e, false))?;
        let mut params = p.params(commit);
        let claim = claiming.map(|l| {
            (
                Json(lease_of(&Some(l.clone())).unwrap_or(Value::Null)),
                l.owner.clone(),
                lease_len(l, commit.now_ms),
            )
        });
        if let Some((lease, owner, expires)) = &claim {
            params.extend([lease as Param, owner, expires]);
        }
        let rows = c
            .client
            .query(&st, &params)
            .map_err(|e| Tried::of(e, true))?;
        if commit.kind == CommitKind::Release && !rows.is_empty() {
            let _ = c
                .client
                .execute("SELECT pg_notify($1, '')", &[&self.channel]);
        }
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let next = match claiming {
            Some(_) if r.get::<_, Option<String>>(1).is_some() => match from_row_at(r, 1) {
                Ok(rec) => Some(rec),
                Err(e) => {
                    let id: String = r.get(1);
                    tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                    let q = self
                        .sql("UPDATE {s}.tasks SET status = 'damaged', damaged = $2 WHERE id = $1");
                    let _ = c.client.execute(&q, &[&id, &e.to_string()]);
                    None
                }
            },
            _ => None,
        };
        Ok(Some(CommitOutcome {
            cancel_requested: r.get(0),
            next,
        }))
    }

    fn commit_many(
        &self,
        c: &mut super::Conn,
        commits: &[&Commit],
        params: &[CommitParams],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, Tried> {
        let claim = self.sql(&format!("{}{}", claim_sql(true), returning("t.")));
        let mut statements = Vec::new();
        for cm in commits {
            statements.push(
                c.prepared(&self.commit_sql[kind_index(cm.kind) + if cm.export { 5 } else { 0 }])
                    .map_err(|e| Tried::of(e, false))?,
            );
        }
        let claim_st = c.prepared(&claim).map_err(|e| Tried::of(e, false))?;
        let mut tx = c.client.transaction().map_err(|e| Tried::of(e, false))?;
        let mut out = Vec::with_capacity(commits.len());
        let mut notify = false;
        for ((cm, p), st) in commits.iter().zip(params).zip(&statements) {
            let rows = tx
                .query(st, &p.params(cm))
                .map_err(|e| Tried::of(e, false))?;
            let Some(r) = rows.first() else {
                out.push(None);
                continue;
            };
            notify |= cm.kind == CommitKind::Release;
            let mut o = CommitOutcome {
                cancel_requested: r.get(0),
                next: None,
            };
            if let (CommitKind::Final(_), Some(lease)) = (cm.kind, &cm.claim_next) {
                let lease_json = Json(lease_of(&Some(lease.clone())).unwrap_or(Value::Null));
                let rows = tx
                    .query(
                        &claim_st,
                        &[
                            &1i64,
                            &lease_json,
                            &lease.owner,
                            &lease_len(lease, cm.now_ms),
                            &p.now,
                            &p.marker,
                        ],
                    )
                    .map_err(|e| Tried::of(e, false))?;
                o.next = self.first_claimed(&mut tx, &rows)?;
            }
            out.push(Some(o));
        }
        if notify {
            self.notify(&mut tx).map_err(Tried::Failed)?;
        }
        tx.commit().map_err(|e| Tried::of(e, true))?;
        Ok(out)
    }

    fn first_claimed(
        &self,
        tx: &mut Transaction<'_>,
        rows: &[Row],
    ) -> std::result::Result<Option<TaskRecord>, Tried> {
        let quarantine =
            self.sql("UPDATE {s}.tasks SET status = 'damaged', damaged = $2 WHERE id = $1");
        let mut failed = None;
        let got = decode_claimed(self, rows, &mut |id, why| {
            if let Err(e) = tx.execute(&quarantine, &[&id, &why]) {
                failed = Some(e);
            }
        });
        if let Some(e) = failed {
            return Err(Tried::of(e, false));
        }
        Ok(got.into_iter().next())
    }

    /// After a lost acknowledgment: a commit landed if its marker is in `commits`, which
    /// [`PgStore::landed`] settles exactly (it waits for a transaction still in progress, and
    /// makes sure one that did not land never will). A refused commit never wrote one, and
    /// refusing it again gives the same answer. `None`: nothing of the batch landed, so it is
    /// committed again (under new markers).
    fn read_back(
        &self,
        commits: &[&Commit],
        params: &[CommitParams],
    ) -> Result<Option<Vec<Option<CommitOutcome>>>> {
        let row_sql = self.sql("SELECT cancel_requested FROM {s}.tasks WHERE id = $1");
        let next_sql = self.sql(&format!(
            "SELECT {TASK_COLUMNS} FROM {{s}}.tasks WHERE claim_commit = $1 AND status = 'running'"
        ));
        let mut out = Vec::with_capacity(commits.len());
        for (cm, p) in commits.iter().zip(params) {
            if !self.landed(p.marker)? {
                out.push(None);
                continue;
            }
            let row = self.query(&row_sql, &[&cm.task_id])?;
            let next = if cm.claim_next.is_some() {
                let rows = self.query(&next_sql, &[&p.marker])?;
                rows.first().map(from_row).transpose()?
            } else {
                None
            };
            out.push(Some(CommitOutcome {
                cancel_requested: row.first().and_then(|r| r.get(0)),
                next,
            }));
        }
        if out.iter().all(Option::is_none) {
            return Ok(None);
        }
        Ok(Some(out))
    }
}

/// How a commit attempt failed: the server answered (nothing landed), or the connection was
/// lost, before the commit was sent (nothing landed) or after (unknown).
enum Tried {
    Failed(Error),
    Lost(postgres::Error, bool),
}

impl Tried {
    fn of(e: postgres::Error, sent: bool) -> Tried {
        if is_connection_error(&e) {
            Tried::Lost(e, sent)
        } else {
            Tried::Failed(db_error(e))
        }
    }
}
