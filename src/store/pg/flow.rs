//! Claims under concurrency limits on PostgreSQL, in one statement: the due tasks in order
//! (those of keys whose slots were all taken when last counted passed over), ranked within
//! their key; each limited key's share taken from `slots` (migration 9) by one conditional
//! upsert whose row lock makes claimers on several hosts take turns on a key, so together
//! they never exceed its limit; and exactly the tasks the upsert granted claimed. The trigger
//! of migration 9 gives a slot back in whatever statement moves its task out of `running`.

use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::pool::db_error;
use super::queue::{claim_update, decode_claimed, lease_len, returning};
use super::rows::{i64_of, lease_of, random_i64};
use crate::store::flow::ConcurrencyLimits;
use crate::store::{Lease, Result, TaskRecord};

/// How many candidates past `max` a limited claim looks at (tasks of keys at their limit are
/// passed over; they keep their place).
const LOOK_AHEAD: i64 = 64;

/// The claim under limits. Parameters: those of `queue::claim_sql` (`$1` the candidates to
/// look at, `$2`..`$6` the lease, its owner and length, the clock offset, the marker), `$7`
/// the most to take, `$8`/`$9` the keys with a limit of their own and those limits, `$10`/`$11`
/// the key prefixes (longest first) and theirs.
///
/// `granted` is what the upsert gave this claim: the key's share, cut to what its limit has
/// left by the row as it is when the claim holds its lock (not as the statement's snapshot
/// saw it). A key's chosen tasks are the first of its candidates in queue order, so its
/// `rn <= granted` are exactly the ones that got a slot.
fn claim_limited_sql() -> String {
    let now = super::now_sql(5);
    format!(
        "WITH locked AS (SELECT id, concurrency_key AS k, priority, ready_seq FROM {{s}}.tasks t \
           WHERE status = 'queued' AND (not_before_ms IS NULL OR not_before_ms <= {now}) \
           AND (concurrency_key IS NULL OR NOT EXISTS (SELECT 1 FROM {{s}}.slots s \
                WHERE s.key = t.concurrency_key AND s.running >= s.cap)) \
           ORDER BY priority DESC, ready_seq LIMIT $1::bigint FOR UPDATE SKIP LOCKED), \
         capped AS (SELECT l.*, CASE WHEN l.k IS NULL THEN NULL ELSE COALESCE( \
             (SELECT e.c FROM unnest($8::text[], $9::int[]) AS e(k, c) WHERE e.k = l.k), \
             (SELECT p.c FROM unnest($10::text[], $11::int[]) WITH ORDINALITY AS p(k, c, o) \
              WHERE starts_with(l.k, p.k) ORDER BY p.o LIMIT 1)) END AS cap FROM locked l), \
         ranked AS (SELECT c.*, row_number() OVER (PARTITION BY c.k ORDER BY c.priority DESC, c.ready_seq) AS rn, \
             COALESCE((SELECT s.running FROM {{s}}.slots s WHERE s.key = c.k), 0) AS used FROM capped c), \
         chosen AS (SELECT id, k, cap, rn FROM ranked WHERE cap IS NULL OR rn <= cap - used \
             ORDER BY priority DESC, ready_seq LIMIT $7::bigint), \
         took AS (INSERT INTO {{s}}.slots AS s (key, running, cap, granted) \
             SELECT k, LEAST(count(*), min(cap)), min(cap), LEAST(count(*), min(cap)) FROM chosen \
             WHERE cap IS NOT NULL GROUP BY k \
             ON CONFLICT (key) DO UPDATE SET running = LEAST(s.running + EXCLUDED.granted, EXCLUDED.cap), \
               granted = LEAST(s.running + EXCLUDED.granted, EXCLUDED.cap) - s.running, cap = EXCLUDED.cap \
             WHERE s.running < EXCLUDED.cap RETURNING s.key, s.granted), \
         c AS (SELECT ch.id, tk.key AS slot FROM chosen ch LEFT JOIN took tk ON tk.key = ch.k \
             WHERE ch.cap IS NULL OR ch.rn <= tk.granted) \
         {}{}",
        claim_update("c").replacen(" FROM c ", ", slot = c.slot FROM c ", 1),
        returning("t.")
    )
}

impl PgStore {
    /// The concurrency limits its claims apply (see `Queue::set_limits`).
    pub(super) fn limits(&self) -> std::sync::Arc<ConcurrencyLimits> {
        std::sync::Arc::clone(&self.limits.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// A claim under `limits`: due tasks in order, passing over those whose key is at its
    /// limit; a task of a limited key is taken only with one of its key's slots.
    pub(super) fn claim_limited(
        &self,
        lease: &Lease,
        max: usize,
        now_ms: u64,
        limits: &ConcurrencyLimits,
    ) -> Result<Vec<TaskRecord>> {
        let claim = self.sql(&claim_limited_sql());
        let lease_json = Json(lease_of(&Some(lease.clone())).unwrap_or(Value::Null));
        let (len, off) = (lease_len(lease, now_ms), super::offset_of(now_ms));
        let cap = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
        let (keys, key_caps): (Vec<&str>, Vec<i32>) =
            limits.exact().map(|(k, n)| (k, cap(n))).unzip();
        let (prefixes, prefix_caps): (Vec<&str>, Vec<i32>) =
            limits.prefixes().map(|(k, n)| (k, cap(n))).unzip();
        let max = i64_of(max as u64);
        let look = max.saturating_add(LOOK_AHEAD);
        let rows = self.write(|tx| {
            let marker = random_i64();
            tx.query(
                &claim,
                &[
                    &look,
                    &lease_json,
                    &lease.owner,
                    &len,
                    &off,
                    &marker,
                    &max,
                    &keys,
                    &key_caps,
                    &prefixes,
                    &prefix_caps,
                ],
            )
            .map_err(db_error)
        })?;
        let quarantine =
            self.sql("UPDATE {s}.tasks SET status = 'damaged', damaged = $2 WHERE id = $1");
        Ok(decode_claimed(self, &rows, &mut |id, why| {
            let _ = self.read(|c| c.client.execute(&quarantine, &[&id, &why]));
        }))
    }
}
