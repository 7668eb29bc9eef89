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
        // Keys whose slots were all taken when last counted are passed over at once; the
        // upsert in `take_slots` is what decides.
        let candidates_sql = self.sql(&format!(
            "SELECT id, concurrency_key FROM {{s}}.tasks t WHERE status = 'queued' \
             AND (not_before_ms IS NULL OR not_before_ms <= {now}) \
             AND (concurrency_key IS NULL OR NOT EXISTS (SELECT 1 FROM {{s}}.slots s \
                  WHERE s.key = t.concurrency_key AND s.running >= s.cap)) \
             ORDER BY priority DESC, ready_seq LIMIT $2 FOR UPDATE SKIP LOCKED"
        ));
        let take_sql = self.sql(
            "INSERT INTO {s}.slots (key, running, cap) SELECT k, 1, c \
             FROM unnest($1::text[], $2::int[]) AS u(k, c) \
             ON CONFLICT (key) DO UPDATE SET running = {s}.slots.running + 1, cap = EXCLUDED.cap \
             WHERE {s}.slots.running < EXCLUDED.cap RETURNING key",
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
            let look = i64_of(max as u64).saturating_add(LOOK_AHEAD);
            let candidates = tx
                .query(&candidates_sql, &[&off, &look])
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
/// that took a slot of their key. Slots are taken by `take_sql` (one upsert for a set of
/// distinct keys, each taking one slot if its key has one free), in rounds: a key's second
/// candidate waits for the next round, and a key refused a slot is passed over from then on.
fn take_slots(
    tx: &mut postgres::Transaction<'_>,
    candidates: &[postgres::Row],
    max: usize,
    limits: &ConcurrencyLimits,
    take_sql: &str,
) -> Result<(Vec<String>, Vec<String>)> {
    // (id, the limited key and its limit), in queue order.
    let mut left: Vec<(String, Option<(String, u32)>)> = candidates
        .iter()
        .map(|r| {
            let key: Option<String> = r.get(1);
            (
                r.get(0),
                key.and_then(|k| limits.limit_of(&k).map(|l| (k, l))),
            )
        })
        .collect();
    let mut granted: BTreeMap<String, ()> = BTreeMap::new();
    let mut taken: BTreeMap<String, bool> = BTreeMap::new();
    loop {
        // Up to `max` candidates still undecided, at most one per key this round.
        let mut round: BTreeMap<String, u32> = BTreeMap::new();
        let mut count = taken.len();
        for (id, limited) in &left {
            if count >= max {
                break;
            }
            match limited {
                None => {
                    taken.insert(id.clone(), false);
                    count += 1;
                }
                Some((k, l)) if !round.contains_key(k) => {
                    round.insert(k.clone(), *l);
                    count += 1;
                }
                Some(_) => {}
            }
        }
        left.retain(|(id, _)| !taken.contains_key(id));
        if round.is_empty() {
            break;
        }
        let keys: Vec<&String> = round.keys().collect();
        let caps: Vec<i32> = round
            .values()
            .map(|l| i32::try_from(*l).unwrap_or(i32::MAX))
            .collect();
        granted.clear();
        for r in tx.query(take_sql, &[&keys, &caps]).map_err(db_error)? {
            granted.insert(r.get(0), ());
        }
        // The first candidate of each key of the round takes its slot, or the key is full.
        let mut seen: BTreeMap<String, ()> = BTreeMap::new();
        left.retain(|(id, limited)| match limited {
            Some((k, _)) if round.contains_key(k) && !seen.contains_key(k) => {
                seen.insert(k.clone(), ());
                if granted.contains_key(k) {
                    taken.insert(id.clone(), true);
                }
                false
            }
            Some((k, _)) if round.contains_key(k) && !granted.contains_key(k) => false,
            _ => true,
        });
    }
    // In queue order, as the candidates came.
    let order: Vec<String> = candidates.iter().map(|r| r.get(0)).collect();
    let take: Vec<String> = order
        .iter()
        .filter(|id| taken.contains_key(*id))
        .cloned()
        .collect();
    let slotted = take.iter().filter(|id| taken[*id]).cloned().collect();
    Ok((take, slotted))
}
