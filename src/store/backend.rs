//! The storage interface the daemon talks to: claiming with a lease and a fencing token,
//! recovering expired leases, expiring approval waits, committing a group of step commits in
//! one transaction, and the reads a task's driver needs.
//!
//! [`Store`] (redb, one file, MultiWriter) is the embedded backend. A backend for several hosts
//! implements the same contract; what each method must guarantee is written on it, and the
//! daemon relies on nothing else.

use super::{CallRecord, Commit, CommitOutcome, Error, Lease, Result, Store, TaskRecord};
use crate::model::RecordedReply;

/// What the daemon needs of a database.
pub trait Backend: Send + Sync {
    /// The id that prefixes every call key of this database.
    fn db_id(&self) -> &str;

    /// Takes up to `max` ready tasks, highest priority first, each under a new fencing token
    /// (its claim count); a task that cannot be read is quarantined, never returned.
    fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>>;

    /// How many tasks wait in the ready queue.
    fn ready_count(&self) -> Result<u64>;

    /// Puts back in the queue every running task whose lease expired or whose owner
    /// `is_dead`, except the claims `live` names. Returns the ids recovered.
    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>>;

    /// Stops every suspended task whose approval wait ran out, with its audit event.
    fn expire_approvals(&self, now_ms: u64) -> Result<Vec<String>>;

    /// Applies `commits` in one transaction, in order. A commit whose claim is no longer the
    /// task's current one is refused alone (`None`), with nothing of it written; any other
    /// failure aborts the whole transaction (`Err`, naming the task when one caused it), so
    /// either every accepted commit landed or none did.
    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String>;

    /// The call record under `key`: a write's intent and, once known, its result.
    fn call(&self, key: &str) -> Result<Option<CallRecord>>;

    /// The model reply recorded for step `step` of task `task_id`, if a run got that far.
    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>>;
}

impl Backend for Store {
    fn db_id(&self) -> &str {
        Store::db_id(self)
    }

    fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>> {
        Store::claim(self, lease, max, now_ms)
    }

    fn ready_count(&self) -> Result<u64> {
        Store::ready_count(self)
    }

    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>> {
        Store::recover(self, now_ms, is_dead, live)
    }

    fn expire_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        Store::expire_approvals(self, now_ms)
    }

    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String> {
        let applied = (|| {
            let w = self.begin_write().map_err(|e| (None, e))?;
            let mut results = Vec::with_capacity(commits.len());
            for c in commits {
                match Store::apply_commit(&w, c) {
                    Ok(o) => results.push(Some(o)),
                    Err(Error::LeaseLost(_) | Error::NoTask(_)) => results.push(None),
                    Err(e) => return Err((Some(c.task_id.clone()), e)),
                }
            }
            w.commit().map_err(|e| (None, Error::from(e)))?;
            Ok(results)
        })();
        applied.map_err(|(task, e): (Option<String>, Error)| {
            // A disk error leaves the handle unusable: open it again for the next commits.
            self.after_error(&e);
            match task {
                Some(t) => format!("task {t}: {e}"),
                None => e.to_string(),
            }
        })
    }

    fn call(&self, key: &str) -> Result<Option<CallRecord>> {
        Store::call(self, key)
    }

    fn reply(&self, task_id: &str, step: u32) -> Result<Option<RecordedReply>> {
        Store::reply(self, task_id, step)
    }
}
