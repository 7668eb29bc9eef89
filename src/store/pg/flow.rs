//! Claims under concurrency limits on PostgreSQL: the slots of the keys that have a limit
//! (migration 9's `slots`) are taken in the claim's transaction, each by a conditional
//! upsert whose row lock makes claimers on several hosts take turns on a key, so together
//! they never exceed its limit; the trigger of migration 9 gives a slot back in whatever
//! statement moves its task out of `running`.

use postgres::types::Json;
use serde_json::Value;
use std::collections::BTreeMap;

use super::PgStore;
use super::pool::db_error;
use super::queue::{claim_update, decode_claimed, lease_len, returning};
use super::rows::{i64_of, lease_of, random_i64};
use crate::store::flow::ConcurrencyLimits;
use crate::store::{Lease, Result, TaskRecord};

/// How many candidates past `max` a limited claim looks at (tasks of keys at their limit are
/// passed over; they keep their place).
const LOOK_AHEAD: i64 = 64;

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
        let now = super::now_sql(1);
        let full_sql = self.sql("SELECT key, running FROM {s}.slots WHERE running > 0");
        let candidates_sql = self.sql(&format!(
            "SELECT id, concurrency_key FROM {{s}}.tasks WHERE status = 'queued' \
             AND (not_before_ms IS NULL OR not_before_ms <= {now}) \
             AND (concurrency_key IS NULL OR NOT concurrency_key = ANY($2::text[])) \
             ORDER BY priority DESC, ready_seq LIMIT $3 FOR UPDATE SKIP LOCKED"
        ));
        let take_sql = self.sql(
            "INSERT INTO {s}.slots (key, running) VALUES ($1, 1) ON CONFLICT (key) DO UPDATE \
             SET running = {s}.slots.running + 1 WHERE {s}.slots.running < $2 RETURNING running",
        );
        let claim = self.sql(&format!(
            "WITH c AS (SELECT unnest($1::text[]) AS id) {}{}",
            claim_update("c"),
            returning("t.")
        ));
        // The claimed tasks that took a slot name it.
        let name_slots =
            self.sql("UPDATE {s}.tasks SET slot = concurrency_key WHERE id = ANY($1::text[])");
        let lease_json = Json(lease_of(&Some(lease.clone())).unwrap_or(Value::Null));
        let (len, off) = (lease_len(lease, now_ms), super::offset_of(now_ms));
        let rows = self.write(|tx| {
            let full: Vec<String> = tx
                .query(&full_sql, &[])
                .map_err(db_error)?
                .iter()
                .filter(|r| {
                    let key: String = r.get(0);
                    let n: i32 = r.get(1);
                    limits
                        .limit_of(&key)
                        .is_some_and(|l| i64::from(n) >= i64::from(l))
                })
                .map(|r| r.get(0))
                .collect();
            let look = i64_of(max as u64).saturating_add(LOOK_AHEAD);
            let candidates = tx
                .query(&candidates_sql, &[&off, &full, &look])
                .map_err(db_error)?;
            let (take, slotted) = take_slots(tx, &candidates, max, limits, &take_sql)?;
            if take.is_empty() {
                return Ok(Vec::new());
            }
            let marker = random_i64();
            let rows = tx
                .query(
                    &claim,
                    &[&take, &lease_json, &lease.owner, &len, &off, &marker],
                )
                .map_err(db_error)?;
            if !slotted.is_empty() {
                tx.execute(&name_slots, &[&slotted]).map_err(db_error)?;
            }
            Ok(rows)
        })?;
        let quarantine =
            self.sql("UPDATE {s}.tasks SET status = 'damaged', damaged = $2 WHERE id = $1");
        Ok(decode_claimed(self, &rows, &mut |id, why| {
            let _ = self.read(|c| c.client.execute(&quarantine, &[&id, &why]));
        }))
    }
}

/// Of the `candidates` (id, key) in order, the ids a claim of `max` takes, and those of them
/// that took a slot of their key (by `take_sql`, a conditional upsert); a key whose slot
/// could not be had is passed over for the rest of the claim.
fn take_slots(
    tx: &mut postgres::Transaction<'_>,
    candidates: &[postgres::Row],
    max: usize,
    limits: &ConcurrencyLimits,
    take_sql: &str,
) -> Result<(Vec<String>, Vec<String>)> {
    let (mut take, mut slotted) = (Vec::new(), Vec::new());
    let mut full: BTreeMap<String, ()> = BTreeMap::new();
    for r in candidates {
        if take.len() >= max {
            break;
        }
        let id: String = r.get(0);
        let key: Option<String> = r.get(1);
        match key.and_then(|k| limits.limit_of(&k).map(|l| (k, l))) {
            None => take.push(id),
            Some((k, _)) if full.contains_key(&k) => {}
            Some((k, l)) => {
                let cap = i32::try_from(l).unwrap_or(i32::MAX);
                if tx
                    .query_opt(take_sql, &[&k, &cap])
                    .map_err(db_error)?
                    .is_some()
                {
                    slotted.push(id.clone());
                    take.push(id);
                } else {
                    full.insert(k, ());
                }
            }
        }
    }
    Ok((take, slotted))
}
