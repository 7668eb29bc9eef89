//! Flow control in the redb file: tasks that wait for their start time (`DELAYED`, moved to
//! the ready queue by the claim that finds them due), the concurrency key of each task that
//! has one (`KEYS`), and the slots of the keys that have a limit (`SLOTS`: how many of the
//! key's tasks run; `HOLDS`: which running task holds one). A task takes a slot in the claim
//! that starts it and gives it back wherever it stops running ([`Flow::left_running`]), all
//! in the transaction that moves it, so the count is never out of step with the tasks.

use redb::{ReadableTable, Table, TableDefinition, WriteTransaction};

use super::schema::{META, META_READY_SEQ, READY, RUNNING};
use crate::store::Result;

/// (start time in ms, ready sequence) -> task id: queued tasks not to be claimed before then.
pub const DELAYED: TableDefinition<(u64, u64), &str> = TableDefinition::new("delayed");
/// task id -> concurrency key, for every task that has one.
pub const KEYS: TableDefinition<&str, &str> = TableDefinition::new("concurrency_keys");
/// concurrency key -> how many of its tasks hold a slot (run under its limit).
pub const SLOTS: TableDefinition<&str, u64> = TableDefinition::new("slots");
/// running task id -> the key whose slot it holds.
pub const HOLDS: TableDefinition<&str, &str> = TableDefinition::new("slot_holders");

/// The flow-control tables, open in one write transaction.
pub(super) struct Flow<'w> {
    pub delayed: Table<'w, (u64, u64), &'static str>,
    pub keys: Table<'w, &'static str, &'static str>,
    slots: Table<'w, &'static str, u64>,
    holds: Table<'w, &'static str, &'static str>,
}

impl<'w> Flow<'w> {
    pub fn open(w: &'w WriteTransaction) -> Result<Flow<'w>> {
        Ok(Flow {
            delayed: w.open_table(DELAYED)?,
            keys: w.open_table(KEYS)?,
            slots: w.open_table(SLOTS)?,
            holds: w.open_table(HOLDS)?,
        })
    }

    /// The concurrency key of task `id`, if it has one.
    pub fn key_of(&self, id: &str) -> Result<Option<String>> {
        Ok(self.keys.get(id)?.map(|g| g.value().to_string()))
    }

    /// How many tasks of `key` hold a slot.
    pub fn running(&self, key: &str) -> Result<u64> {
        Ok(self.slots.get(key)?.map_or(0, |g| g.value()))
    }

    /// Task `id` starts under `key`'s limit: it takes a slot.
    pub fn take_slot(&mut self, id: &str, key: &str) -> Result<()> {
        let n = self.running(key)?;
        self.slots.insert(key, n + 1)?;
        self.holds.insert(id, key)?;
        Ok(())
    }

    /// Task `id` no longer runs: its slot, if it held one, is given back.
    pub fn give_back(&mut self, id: &str) -> Result<()> {
        let Some(key) = self.holds.remove(id)?.map(|g| g.value().to_string()) else {
            return Ok(());
        };
        let n = self.running(&key)?;
        if n <= 1 {
            self.slots.remove(key.as_str())?;
        } else {
            self.slots.insert(key.as_str(), n - 1)?;
        }
        Ok(())
    }

    /// Task `id` joins the queue: ready, or delayed until `not_before_ms` if that is after
    /// `now_ms`.
    pub fn queue(
        w: &WriteTransaction,
        id: &str,
        priority: i64,
        not_before_ms: Option<u64>,
        now_ms: u64,
    ) -> Result<()> {
        let seq = super::next_seq(&mut w.open_table(META)?, META_READY_SEQ)?;
        match not_before_ms.filter(|&at| at > now_ms) {
            Some(at) => {
                w.open_table(DELAYED)?.insert((at, seq), id)?;
            }
            None => {
                w.open_table(READY)?.insert((-priority, seq), id)?;
            }
        }
        Ok(())
    }

    /// Task `id`, delayed until `at_ms`, leaves the queue before it came due (cancelled): its
    /// entry in the delayed index goes too, or the index would count it as work to come (a
    /// `worker run --drain` would wait for its start time) until that time.
    pub fn unqueue_delayed(w: &WriteTransaction, id: &str, at_ms: u64) -> Result<()> {
        let mut delayed = w.open_table(DELAYED)?;
        let found = delayed
            .range((at_ms, 0)..=(at_ms, u64::MAX))?
            .filter_map(|e| e.ok())
            .find(|(_, v)| v.value() == id)
            .map(|(k, _)| k.value());
        if let Some(k) = found {
            delayed.remove(k)?;
        }
        Ok(())
    }

    /// Task `id` stops running (finished, waiting, held, put back, quarantined): out of the
    /// running index, and its slot given back.
    pub fn left_running(w: &WriteTransaction, id: &str) -> Result<()> {
        w.open_table(RUNNING)?.remove(id)?;
        Flow::open(w)?.give_back(id)
    }
}
