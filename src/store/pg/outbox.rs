//! The span outbox of live OTLP export on PostgreSQL (migration 3): a commit made by an
//! exporting daemon inserts, in its own statement, the ids of the spans it ended; exporters read
//! the oldest entries and delete the ones they sent. See `crate::store::outbox`.

use super::PgStore;
use crate::store::{OutboxEntry, Result};

/// The statement part a commit adds when the daemon exports: the spans of `$15` that ended,
/// queued only if the fenced update matched (`u`).
pub(super) const QUEUE_CTE: &str = ", ob AS (INSERT INTO {s}.otlp_outbox (task_id, spans) \
    SELECT $1, array_agg((x->>'id')::int) FROM u, json_array_elements($15::json) x \
    WHERE x->>'t1_ms' IS NOT NULL HAVING count(*) > 0)";

impl PgStore {
    pub fn outbox(&self, max: usize) -> Result<Vec<OutboxEntry>> {
        let sql = self.sql("SELECT seq, task_id, spans FROM {s}.otlp_outbox ORDER BY seq LIMIT $1");
        let limit = max as i64;
        let rows = self.query(&sql, &[&limit])?;
        Ok(rows
            .iter()
            .map(|r| OutboxEntry {
                seq: r.get::<_, i64>(0) as u64,
                task_id: r.get(1),
                spans: r
                    .get::<_, Vec<i32>>(2)
                    .into_iter()
                    .map(|i| i as u32)
                    .collect(),
            })
            .collect())
    }

    pub fn outbox_done(&self, seqs: &[u64]) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        let sql = self.sql("DELETE FROM {s}.otlp_outbox WHERE seq = ANY($1)");
        let seqs: Vec<i64> = seqs.iter().map(|s| *s as i64).collect();
        self.query(&sql, &[&seqs])?;
        Ok(())
    }
}
