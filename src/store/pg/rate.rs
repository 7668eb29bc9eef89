//! Model rate limits on PostgreSQL (see `model::rate`): migration 10's `rate_log` (the
//! reservations of each limited profile in its window) and `rate_keys` (one row per key,
//! holding the time until which a provider's `429` holds it). A reservation locks its key's
//! row first, so daemons on every host take turns on a key; times are the server's clock.

use super::PgStore;
use super::pool::db_error;
use super::rows::i64_of;
use crate::model::rate::{Held, RateLimit, Reserve};
use crate::store::Result;
use crate::store::backend::RateLimits;

impl RateLimits for PgStore {
    fn reserve(&self, key: &str, limit: &RateLimit, tokens: u64, now_ms: u64) -> Result<Reserve> {
        let lock = self.sql(&format!(
            "INSERT INTO {{s}}.rate_keys (key) VALUES ($1) ON CONFLICT (key) DO UPDATE \
             SET key = EXCLUDED.key RETURNING blocked_until_ms, {}",
            super::now_sql(2)
        ));
        let held_sql = self.sql(
            "WITH d AS (DELETE FROM {s}.rate_log WHERE key = $1::text AND at_ms <= $2::bigint - $3::bigint) \
             SELECT at_ms, tokens FROM {s}.rate_log WHERE key = $1::text AND at_ms > $2::bigint - $3::bigint \
             ORDER BY at_ms, id",
        );
        let insert = self
            .sql("INSERT INTO {s}.rate_log (key, at_ms, tokens) VALUES ($1, $2, $3) RETURNING id");
        let (off, per) = (super::offset_of(now_ms), i64_of(limit.per_ms));
        self.write(|tx| {
            let row = tx.query_one(&lock, &[&key, &off]).map_err(db_error)?;
            let (blocked, now): (i64, i64) = (row.get(0), row.get(1));
            let held: Vec<Held> = tx
                .query(&held_sql, &[&key, &now, &per])
                .map_err(db_error)?
                .iter()
                .map(|r| Held {
                    at_ms: r.get::<_, i64>(0).max(0) as u64,
                    tokens: r.get::<_, i64>(1).max(0) as u64,
                })
                .collect();
            let now_u = now.max(0) as u64;
            Ok(
                match limit.wait_until(&held, blocked.max(0) as u64, tokens, now_u) {
                    Some(t) => Reserve::WaitUntil(t),
                    None => {
                        let t = i64_of(limit.reserved(tokens));
                        let id: i64 = tx
                            .query_one(&insert, &[&key, &now, &t])
                            .map_err(db_error)?
                            .get(0);
                        Reserve::Granted(id as u64)
                    }
                },
            )
        })
    }

    fn settle_reservation(&self, key: &str, id: u64, tokens: Option<u64>) -> Result<()> {
        let id = i64_of(id);
        match tokens {
            None => {
                let sql = self.sql("DELETE FROM {s}.rate_log WHERE key = $1 AND id = $2");
                self.read(|c| c.client.execute(&sql, &[&key, &id]))?;
            }
            Some(t) => {
                let sql =
                    self.sql("UPDATE {s}.rate_log SET tokens = $3 WHERE key = $1 AND id = $2");
                let t = i64_of(t);
                self.read(|c| c.client.execute(&sql, &[&key, &id, &t]))?;
            }
        }
        Ok(())
    }

    fn slow_down(&self, key: &str, now_ms: u64, for_ms: u64) -> Result<u64> {
        let sql = self.sql(&format!(
            "INSERT INTO {{s}}.rate_keys (key, blocked_until_ms) VALUES ($1, {now} + $3) \
             ON CONFLICT (key) DO UPDATE SET blocked_until_ms = \
             GREATEST({{s}}.rate_keys.blocked_until_ms, EXCLUDED.blocked_until_ms) \
             RETURNING blocked_until_ms",
            now = super::now_sql(2)
        ));
        let (off, f) = (super::offset_of(now_ms), i64_of(for_ms));
        let until: i64 = self
            .read(|c| c.client.query_one(&sql, &[&key, &off, &f]))?
            .get(0);
        Ok(until.max(0) as u64)
    }
}
