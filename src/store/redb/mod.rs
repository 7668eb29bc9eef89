//! The redb engine: the worker database as one redb file in `ConcurrencyMode::MultiWriter`,
//! shared by daemons, `worker enqueue` and the operator verbs, one write transaction at a
//! time across them.
//!
//! It mirrors `store::pg` file for file: each part of the interface (`store::backend`) is
//! implemented in the file of its name (`queue`, `commit`, `decide`, `reads`, `list`, `notes`,
//! `maintenance`, `outbox`), over the tables of `schema` and the task rows of `rows`. Opening
//! and migrating the file is in `open`, the redb handles (read-only, reopened after an I/O
//! error) in `handle`. No write transaction here stays open across a model or tool call:
//! callers hand in finished data.

mod callbacks;
mod commit;
mod decide;
mod flow;
mod handle;
mod list;
mod maintenance;
mod notes;
mod open;
mod outbox;
mod queue;
mod rate;
mod reads;
mod rows;
mod schedules;
pub mod schema;
mod writes;

pub use handle::{Opener, Reopening, Sharing};
pub(crate) use handle::{create_redb, open_redb};
pub(crate) use open::check_not_empty;
pub use writes::WriteStats;

use redb::{ReadTransaction, ReadableTable, WriteTransaction};
use std::path::PathBuf;

use super::{Backend, Error, Result};
use handle::Handle;

macro_rules! from_redb {
    ($($t:ty),*) => {$(
        impl From<$t> for Error {
            fn from(e: $t) -> Error {
                Error::Db(redb::Error::from(e))
            }
        }
    )*};
}
from_redb!(
    redb::DatabaseError,
    redb::TransactionError,
    redb::TableError,
    redb::StorageError,
    redb::CommitError
);

pub struct RedbStore {
    db: Handle,
    path: PathBuf,
    /// This database's id: made at random when the file is created, it prefixes every call
    /// key, so keys of two databases (or of a restored backup) never collide at a tool service.
    db_id: String,
    /// The benchmark's write meter, when it switched one on.
    meter: std::sync::OnceLock<std::sync::Arc<WriteStats>>,
    /// The concurrency limits its claims apply.
    limits: std::sync::RwLock<std::sync::Arc<crate::store::flow::ConcurrencyLimits>>,
    /// The watch on the file that wakes an idle daemon, made on first use (`Queue::wakeups`).
    wake: std::sync::Mutex<Option<crate::filewatch::FileWatch>>,
    /// Wake-ups of this process's dispatcher after an enqueue or a decision made here.
    woken: crate::store::Woken,
}

/// The ranges of task `id`'s call keys in the namespace `ns`: its first turn's (`NS:id:...`),
/// then those of later turns of its conversation (`NS:id#N:...`). A reader that lists them
/// sorts by step (`#10` sorts before `#2` as text).
pub(super) fn call_key_ranges(ns: &str, id: &str) -> [(String, String); 2] {
    [
        (format!("{ns}:{id}:"), format!("{ns}:{id};")),
        (format!("{ns}:{id}#"), format!("{ns}:{id}$")),
    ]
}

fn next_seq(meta: &mut redb::Table<&str, u64>, name: &str) -> Result<u64> {
    let n = meta.get(name)?.map_or(1, |g| g.value());
    meta.insert(name, n + 1)?;
    Ok(n)
}

impl RedbStore {
    /// Switches on this database's write meter (for the storage benchmark) and returns it.
    pub fn meter_writes(&self) -> std::sync::Arc<WriteStats> {
        std::sync::Arc::clone(self.meter.get_or_init(Default::default))
    }

    /// The concurrency limits its claims apply (see `Queue::set_limits`).
    fn limits(&self) -> std::sync::Arc<crate::store::flow::ConcurrencyLimits> {
        std::sync::Arc::clone(&self.limits.read().unwrap_or_else(|p| p.into_inner()))
    }

    pub fn begin_write(&self) -> Result<WriteTransaction> {
        self.db.begin_write()
    }

    pub fn begin_read(&self) -> Result<ReadTransaction> {
        Ok(self.db.begin_read()?)
    }
}

impl Backend for RedbStore {
    fn db_id(&self) -> &str {
        &self.db_id
    }

    fn describe(&self) -> String {
        format!("the redb file {}", self.path().display())
    }
}
