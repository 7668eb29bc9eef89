//! Model rate limits in the redb file (see `model::rate`): the reservations of each limited
//! profile in its current window, and the time until which a provider's `429` holds it. A
//! reservation is one write transaction, so the daemons sharing the file take turns on it.

use redb::{ReadableTable, TableDefinition};

use super::{RedbStore, next_seq, schema::META};
use crate::model::rate::{Held, RateLimit, Reserve};
use crate::store::Result;
use crate::store::backend::RateLimits;

/// (rate key, reservation id) -> (made at ms, tokens held).
pub const RATE_LOG: TableDefinition<(&str, u64), (u64, u64)> = TableDefinition::new("rate_log");
/// rate key -> no reservation before this time (a provider's `429` with its `Retry-After`).
pub const RATE_HOLD: TableDefinition<&str, u64> = TableDefinition::new("rate_hold");
const META_RATE_SEQ: &str = "rate_seq";

impl RateLimits for RedbStore {
    fn reserve(&self, key: &str, limit: &RateLimit, tokens: u64, now_ms: u64) -> Result<Reserve> {
        let w = self.begin_write()?;
        let got = {
            let mut log = w.open_table(RATE_LOG)?;
            let blocked = w.open_table(RATE_HOLD)?.get(key)?.map_or(0, |g| g.value());
            let mut held = Vec::new();
            let mut gone = Vec::new();
            for e in log.range((key, 0)..=(key, u64::MAX))? {
                let (k, v) = e?;
                let (at_ms, tokens) = v.value();
                if limit.expired(at_ms, now_ms) {
                    gone.push(k.value().1);
                } else {
                    held.push(Held { at_ms, tokens });
                }
            }
            for id in gone {
                log.remove((key, id))?;
            }
            held.sort_by_key(|h| h.at_ms);
            match limit.wait_until(&held, blocked, tokens, now_ms) {
                Some(t) => Reserve::WaitUntil(t),
                None => {
                    let id = next_seq(&mut w.open_table(META)?, META_RATE_SEQ)?;
                    log.insert((key, id), (now_ms, limit.reserved(tokens)))?;
                    Reserve::Granted(id)
                }
            }
        };
        w.commit()?;
        Ok(got)
    }

    fn settle_reservation(&self, key: &str, id: u64, tokens: Option<u64>) -> Result<()> {
        let w = self.begin_write()?;
        {
            let mut log = w.open_table(RATE_LOG)?;
            let at = log.get((key, id))?.map(|g| g.value().0);
            match (at, tokens) {
                (None, _) => {}
                (Some(_), None) => {
                    log.remove((key, id))?;
                }
                (Some(at), Some(t)) => {
                    log.insert((key, id), (at, t))?;
                }
            }
        }
        w.commit()?;
        Ok(())
    }

    fn slow_down(&self, key: &str, now_ms: u64, for_ms: u64) -> Result<u64> {
        let w = self.begin_write()?;
        let until = {
            let mut hold = w.open_table(RATE_HOLD)?;
            let was = hold.get(key)?.map_or(0, |g| g.value());
            let until = was.max(now_ms.saturating_add(for_ms));
            hold.insert(key, until)?;
            until
        };
        w.commit()?;
        Ok(until)
    }
}
