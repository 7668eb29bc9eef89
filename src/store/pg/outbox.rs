//! The span outbox of live OTLP export on PostgreSQL (migration 3): a commit made by an
//! exporting daemon inserts, in its own statement, the ids of the spans it ended; exporters read
//! the oldest entries and delete the ones they sent. See `crate::store::outbox`. Daemons on
//! several hosts each export: an exporter claims the entries it reads for [`CLAIM_MS`]
//! (migration 4), so two never send the same batch; a claim of an exporter that died runs out
//! and another takes its entries.

use super::PgStore;
use crate::store::backend::Outbox;
use crate::store::{OutboxEntry, Result};

/// The statement part a commit adds when the daemon exports: the spans of `$15` that ended and
/// `{root}` (the task's root span, -1, when a final commit finishes the task: see
/// [`root_when`]), queued only if the fenced update matched (`u`).
pub(super) const QUEUE_CTE: &str = ", ob AS (INSERT INTO {s}.otlp_outbox (task_id, spans) \
    SELECT $1, e.ids FROM u, (SELECT coalesce(array_agg((x->>'id')::int) \
    FILTER (WHERE x->>'t1_ms' IS NOT NULL), '{}'::int[]) || {root} AS ids \
    FROM json_array_elements($15::json) x) e WHERE cardinality(e.ids) > 0)";

/// The `{root}` of [`QUEUE_CTE`]: for a final commit (whose `$20` is the new status), the root
/// when the task is finished; for any other commit, none.
pub(super) fn root_when(is_final: bool) -> &'static str {
    if is_final {
        "CASE WHEN $20::text = 'finished' THEN ARRAY[-1] ELSE '{}'::int[] END"
    } else {
        "'{}'::int[]"
    }
}

/// Queues the root span of task `$1`, finished by a decision, if a daemon ever exported from
/// this database (the outbox's sequence was used).
pub(super) const QUEUE_ROOT_SQL: &str = "INSERT INTO {s}.otlp_outbox (task_id, spans) \
    SELECT $1, ARRAY[-1] FROM {s}.otlp_outbox_seq_seq WHERE is_called";

/// How long an exporter's claim on the entries it read lasts: longer than a send (10 s).
pub const CLAIM_MS: i64 = 60_000;

/// Claims the oldest `$1` entries that are free, this exporter's (`$2`) or whose claim ran out,
/// for `$3` ms; entries another exporter holds are skipped, not waited for. Claims are the
/// server's times, so exporters whose clocks disagree agree on when one runs out.
fn claim_sql() -> String {
    let now = super::SERVER_NOW_MS;
    format!(
        "WITH c AS (SELECT seq FROM {{s}}.otlp_outbox \
         WHERE claimed_by IS NULL OR claimed_by = $2 OR claimed_until_ms < {now} \
         ORDER BY seq LIMIT $1 FOR UPDATE SKIP LOCKED) \
         UPDATE {{s}}.otlp_outbox o SET claimed_by = $2, claimed_until_ms = {now} + $3 FROM c \
         WHERE o.seq = c.seq RETURNING o.seq, o.task_id, o.spans"
    )
}

impl Outbox for PgStore {
    fn outbox(&self, max: usize) -> Result<Vec<OutboxEntry>> {
        let sql = self.sql(&claim_sql());
        let limit = max as i64;
        let mut rows = self.query(&sql, &[&limit, &self.exporter, &CLAIM_MS])?;
        rows.sort_by_key(|r| r.get::<_, i64>(0));
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

    fn outbox_trim(&self, keep: usize) -> Result<(u64, u64)> {
        // Entries another exporter holds (it is sending them) are left to it, so that no span
        // is counted both as dropped and as sent.
        let sql = self.sql(&format!(
            "DELETE FROM {{s}}.otlp_outbox WHERE seq <= (SELECT max(seq) FROM {{s}}.otlp_outbox) - $1 \
             AND (claimed_by IS NULL OR claimed_by = $2 OR claimed_until_ms < {}) \
             RETURNING cardinality(spans)",
            super::SERVER_NOW_MS
        ));
        let keep = keep as i64;
        let rows = self.query(&sql, &[&keep, &self.exporter])?;
        let spans: i64 = rows.iter().map(|r| i64::from(r.get::<_, i32>(0))).sum();
        Ok((rows.len() as u64, spans.max(0) as u64))
    }

    /// Gives up this exporter's claims (it is stopping), so another exporter takes the
    /// entries at once rather than when the claims run out.
    fn outbox_release(&self) -> Result<()> {
        let sql = self.sql(
            "UPDATE {s}.otlp_outbox SET claimed_by = NULL, claimed_until_ms = NULL WHERE claimed_by = $1",
        );
        self.query(&sql, &[&self.exporter])?;
        Ok(())
    }

    fn outbox_done(&self, seqs: &[u64]) -> Result<()> {
        if seqs.is_empty() {
            return Ok(());
        }
        let sql = self.sql("DELETE FROM {s}.otlp_outbox WHERE seq = ANY($1)");
        let seqs: Vec<i64> = seqs.iter().map(|s| *s as i64).collect();
        self.query(&sql, &[&seqs])?;
        Ok(())
    }
}
