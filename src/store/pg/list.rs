//! Listing tasks on PostgreSQL: one indexed query per page (`num` descending, by status or by
//! user through the B-tree indexes of migration 2), selecting the queue columns and the few
//! state fields a list shows, never the spec (a script may be megabytes) or the whole state.

use crate::store::backend::Lists;
use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::rows::{i64_of, u64_of};
use crate::store::list::{ListQuery, Listed, Page, TaskSummary};
use crate::store::{QueueStatus, Result};

const LIST_SQL: &str = "SELECT id, num, status, state->'stop', user_id, state->>'goal', priority, \
    enqueue_key, (state->>'step')::bigint, (state->>'tool_calls')::bigint, \
    (state->>'tokens')::bigint, elapsed_ms, token, created_at_ms, updated_at_ms, damaged, \
    state->>'outcome', not_before_ms \
    FROM {s}.tasks \
    WHERE ($1::text IS NULL OR status = $1) AND ($2::text IS NULL OR user_id = $2) \
      AND ($3::text IS NULL OR enqueue_key = $3) AND ($4::bigint IS NULL OR created_at_ms >= $4) \
      AND ($5::bigint IS NULL OR created_at_ms < $5) AND num < $6 \
      AND ($7::text IS NULL OR (state->>'stop' = $7 AND status NOT IN ('queued', 'running'))) \
      AND ($9::text IS NULL OR state->>'outcome' = $9) \
    ORDER BY num DESC LIMIT $8";

impl Lists for PgStore {
    fn list(&self, q: &ListQuery) -> Result<Page> {
        let limit = q.limit();
        let rows = self.query(
            &self.sql(LIST_SQL),
            &[
                &q.status.map(QueueStatus::as_str),
                &q.user,
                &q.key,
                &q.since_ms.map(i64_of),
                &q.until_ms.map(i64_of),
                &q.before.map_or(i64::MAX, i64_of),
                &q.stop.map(|s| s.as_str()),
                &(limit as i64),
                &q.outcome,
            ],
        )?;
        let mut page = Page::default();
        for r in &rows {
            let id: String = r.get(0);
            if let Some(error) = r.get::<_, Option<String>>(15) {
                page.tasks.push(Listed::Damaged { id, error });
                continue;
            }
            let status: String = r.get(2);
            let status = QueueStatus::parse(&status).unwrap_or(QueueStatus::Finished);
            let stop = crate::store::list::shown_stop(
                status,
                r.get::<_, Option<Json<Value>>>(3)
                    .and_then(|Json(v)| serde_json::from_value(v).ok()),
            );
            let n = |i: usize| r.get::<_, Option<i64>>(i).map_or(0, u64_of);
            page.tasks.push(Listed::Task(TaskSummary {
                num: u64_of(r.get(1)),
                status,
                stop,
                outcome: r.get(16),
                user: r.get(4),
                goal: r.get::<_, Option<String>>(5).unwrap_or_default(),
                priority: r.get(6),
                key: r.get(7),
                steps: n(8) as u32,
                tool_calls: n(9) as u32,
                tokens: n(10),
                elapsed_ms: n(11),
                runs: n(12) as u32,
                created_at_ms: n(13),
                updated_at_ms: n(14),
                not_before_ms: r.get::<_, Option<i64>>(17).map(u64_of),
                id,
            }));
        }
        if page.tasks.len() == limit {
            page.next = rows.last().map(|r| u64_of(r.get(1)));
        }
        if q.key.is_some() {
            page.next = None;
        }
        Ok(page)
    }

    fn counts(&self) -> Result<Vec<(QueueStatus, u64)>> {
        let rows = self.query(
            &self.sql(
                "SELECT status, count(*) FROM {s}.tasks WHERE damaged IS NULL GROUP BY status",
            ),
            &[],
        )?;
        let mut out: Vec<(QueueStatus, u64)> = crate::store::list::STATUSES
            .iter()
            .map(|s| (*s, 0))
            .collect();
        for r in &rows {
            let s: String = r.get(0);
            if let Some(slot) = out.iter_mut().find(|(q, _)| q.as_str() == s) {
                slot.1 = u64_of(r.get(1));
            }
        }
        Ok(out)
    }

    fn oldest_queued_ms(&self) -> Result<Option<u64>> {
        let rows = self.query(
            &self.sql("SELECT min(created_at_ms) FROM {s}.tasks WHERE status = 'queued'"),
            &[],
        )?;
        Ok(rows
            .first()
            .and_then(|r| r.get::<_, Option<i64>>(0))
            .map(u64_of))
    }

    fn task_by_key(&self, key: &str) -> Result<Option<String>> {
        let rows = self.query(
            &self.sql("SELECT id FROM {s}.tasks WHERE enqueue_key = $1"),
            &[&key],
        )?;
        Ok(rows.first().map(|r| r.get(0)))
    }
}
