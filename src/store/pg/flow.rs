//! Claims under concurrency limits on PostgreSQL, in one statement: the due tasks in order
//! (those of keys whose slots were all taken when last counted passed over), ranked within
//! their key; each limited key's share taken from `slots` (migration 9) by one conditional
//! upsert whose row lock makes claimers on several hosts take turns on a key, so together
//! they never exceed its limit; and exactly the tasks the upsert granted claimed. The trigger
//! of migration 9 gives a slot back in whatever statement moves its task out of `running`.
//! It runs on its own, one round trip with no transaction around it, as the keyless claim does.

use postgres::types::Json;
use serde_json::Value;

use super::PgStore;
use super::queue::{claim_update, lease_len, returning};
use super::rows::{i64_of, lease_of, random_i64};
use crate::store::flow::ConcurrencyLimits;
use crate::store::{Lease, Result, TaskRecord};

/// How many candidates past `max` a limited claim looks at (tasks of keys at their limit are
/// passed over; they keep their place).
const LOOK_AHEAD: usize = 16;

/// The claim under limits, looking at `look` candidates. Parameters: `$1` the most to take,
/// `$2`..`$6` those of `queue::claim_sql` (the lease, its owner and length, the clock offset,
/// the marker), `$7`/`$8` the keys with a limit of their own and those limits, `$9`/`$10` the
/// key prefixes (longest first) and theirs.
///
/// The candidates' count is written into the text, not passed: a prepared statement's plan
/// for a parameter `LIMIT` assumes a tenth of the table and joins `slots` by scanning it. Each
/// candidate's limit is the one the daemon has now (not one stored by an earlier claim), and
/// its key's slot row is probed by its primary key: keys whose slots were all taken when last
/// counted are passed over, so they do not fill the look at the queue. `granted` is what the
/// upsert gave this claim: the key's share, cut to what its limit has left by the row as it is
/// when the claim holds its lock (not as the statement's snapshot saw it). The upsert takes
/// its rows in key order, so two claims that share keys lock them in the same order. A key's
/// chosen tasks are the first of its candidates in queue order, so its `rn <= granted` are
/// exactly the ones that got a slot.
fn claim_limited_sql(look: usize) -> String {
    let now = super::now_sql(5);
    format!(
        "WITH locked AS (SELECT t.id, t.concurrency_key AS k, t.priority, t.ready_seq, lim.cap, \
             COALESCE((SELECT s.running FROM {{s}}.slots s WHERE s.key = t.concurrency_key), 0) AS used \
           FROM {{s}}.tasks t, LATERAL (SELECT CASE WHEN t.concurrency_key IS NULL THEN NULL ELSE COALESCE( \
             (SELECT e.c FROM unnest($7::text[], $8::int[]) AS e(k, c) WHERE e.k = t.concurrency_key), \
             (SELECT p.c FROM unnest($9::text[], $10::int[]) WITH ORDINALITY AS p(k, c, o) \
              WHERE starts_with(t.concurrency_key, p.k) ORDER BY p.o LIMIT 1)) END AS cap) lim \
           WHERE t.status = 'queued' AND (t.not_before_ms IS NULL OR t.not_before_ms <= {now}) \
           AND NOT (t.spec -> 'model' ->> 'kind' = 'profile' \
                AND t.spec -> 'model' ->> 'name' = ANY($11::text[])) \
           AND (lim.cap IS NULL OR COALESCE((SELECT s.running FROM {{s}}.slots s \
                WHERE s.key = t.concurrency_key), 0) < lim.cap) \
           ORDER BY t.priority DESC, t.ready_seq LIMIT {look} FOR UPDATE OF t SKIP LOCKED), \
         ranked AS (SELECT l.*, \
             row_number() OVER (PARTITION BY l.k ORDER BY l.priority DESC, l.ready_seq) AS rn \
             FROM locked l), \
         chosen AS (SELECT id, k, cap, rn FROM ranked WHERE cap IS NULL OR rn <= cap - used \
             ORDER BY priority DESC, ready_seq LIMIT $1::bigint), \
         took AS (INSERT INTO {{s}}.slots AS s (key, running, cap, granted) \
             SELECT k, LEAST(count(*), min(cap)), min(cap), LEAST(count(*), min(cap)) FROM chosen \
             WHERE cap IS NOT NULL GROUP BY k ORDER BY k \
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

    /// A claim under `limits`: due tasks in order, passing over those of a model profile the
    /// limits pass over, and those whose key is at its
    /// limit; a task of a limited key is taken only with one of its key's slots.
    pub(super) fn claim_limited(
        &self,
        lease: &Lease,
        max: usize,
        now_ms: u64,
        limits: &ConcurrencyLimits,
    ) -> Result<Vec<TaskRecord>> {
        let claim = self.sql(&claim_limited_sql(max.saturating_add(LOOK_AHEAD)));
        let lease_json = Json(lease_of(&Some(lease.clone())).unwrap_or(Value::Null));
        let (len, off) = (lease_len(lease, now_ms), super::offset_of(now_ms));
        let cap = |n: u32| i32::try_from(n).unwrap_or(i32::MAX);
        let (keys, key_caps): (Vec<&str>, Vec<i32>) =
            limits.exact().map(|(k, n)| (k, cap(n))).unzip();
        let (prefixes, prefix_caps): (Vec<&str>, Vec<i32>) =
            limits.prefixes().map(|(k, n)| (k, cap(n))).unzip();
        let passed_over: Vec<&str> = limits.passed_over().iter().map(String::as_str).collect();
        let (max, marker) = (i64_of(max as u64), random_i64());
        self.run_claim(
            &claim,
            &[
                &max,
                &lease_json,
                &lease.owner,
                &len,
                &off,
                &marker,
                &keys,
                &key_caps,
                &prefixes,
                &prefix_caps,
                &passed_over,
            ],
            marker,
        )
    }
}
