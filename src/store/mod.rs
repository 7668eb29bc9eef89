//! The worker database: one interface ([`Backend`], in `backend`, with every type it speaks)
//! and two engines that implement it file for file: `redb` (one file, the embedded default)
//! and `pg` (PostgreSQL, for daemons on several hosts sharing one queue).
//!
//! Beside them sit what both engines share: the records (`records`), their checksummed
//! envelope (`codec`) and binary rows (`rows`), the list query (`list`) and the span outbox's
//! entries (`outbox`). Opening a backend by its URL or path is [`open_backend`]. Nothing in
//! this module decides policy: operator decisions are in `operator`.

mod backend;
pub mod callbacks;
pub mod codec;
pub mod flow;
pub mod list;
pub mod outbox;
pub mod pg;
mod records;
pub mod redb;
pub mod result;
pub mod rows;
pub mod schedule;
pub mod watch;

pub use backend::{
    Backend, Callbacks, Changes, CheckReport, Commits, Decide, Decision, DecisionTx, Error, Event,
    Lists, Maintenance, Notes, Outbox, Queue, RateLimits, Reads, Result, Schedules, Watched, Woken,
};
pub use callbacks::Callback;
pub use outbox::OutboxEntry;
pub use records::*;
pub use redb::{Opener, RedbStore, Reopening, Sharing, WriteStats, schema};
pub(crate) use redb::{check_not_empty, create_redb, open_redb};

/// Every part of the storage interface, to bring their methods into scope:
/// `use crate::store::prelude::*`.
pub mod prelude {
    pub use super::backend::{
        Backend, Callbacks as _, Commits as _, Decide as _, Lists as _, Maintenance as _,
        Notes as _, Outbox as _, Queue as _, RateLimits as _, Reads as _, Schedules as _,
    };
}

/// How a caller means to use the database it opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// A daemon or an enqueue: create the file or apply the migrations if needed; reconnect
    /// for longer when the server is away.
    Create,
    /// An operator decision: the database must exist.
    Write,
    /// A read verb: the database must exist; a redb file is opened read-only.
    Read,
}

/// Opens the database `db` names: a PostgreSQL URL (`postgres://...`) or a redb file path.
/// `connections` sizes a PostgreSQL pool (the daemon's threads and its own needs).
pub fn open_backend(
    db: &str,
    access: Access,
    connections: usize,
) -> Result<std::sync::Arc<dyn Backend>> {
    use std::sync::Arc;
    if pg::is_url(db) {
        let retry = match access {
            Access::Create => pg::DAEMON_RETRY,
            _ => pg::CLI_RETRY,
        };
        let s = pg::PgStore::open(db, access == Access::Create, connections, retry)?;
        return Ok(Arc::new(s));
    }
    let path = std::path::Path::new(db);
    Ok(match access {
        Access::Create => Arc::new(RedbStore::open(path, true)?),
        Access::Write => Arc::new(RedbStore::open(path, false)?),
        Access::Read => Arc::new(RedbStore::open_for_reading(path)?),
    })
}
