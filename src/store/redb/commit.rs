//! Step commits in the redb file: a group of commits in one write transaction (one fsync for
//! many steps), each checked against its claim's fencing token before anything of it is
//! written, so one refused commit never spoils the others of the group.

use redb::WriteTransaction;

use super::RedbStore;
use super::queue::claim_in;
use super::rows as tasks;
use super::schema::*;
use crate::kernel::StopReason;
use crate::store::backend::Commits;
use crate::store::codec::{self, encode};
use crate::store::{
    Commit, CommitKind, CommitOutcome, Error, QueueStatus, Result, remaining_ms, rows,
};

impl Commits for RedbStore {
    /// A single writer: commits gain from sharing one transaction.
    fn groups_commits(&self) -> bool {
        true
    }

    fn commit_batch(
        &self,
        commits: &[&Commit],
    ) -> std::result::Result<Vec<Option<CommitOutcome>>, String> {
        let limits = self.limits();
        let applied = (|| {
            let w = self.begin_write().map_err(|e| (None, e))?;
            let mut results = Vec::with_capacity(commits.len());
            for c in commits {
                match apply_commit(&w, c, &limits) {
                    Ok(o) => results.push(Some(o)),
                    Err(Error::LeaseLost(_) | Error::NoTask(_)) => results.push(None),
                    Err(e) => return Err((Some(c.task_id.clone()), e)),
                }
            }
            if let Some(meter) = self.meter.get() {
                let applied = commits.iter().zip(&results).filter(|(_, r)| r.is_some());
                // A meter that cannot read back what was written misses a count; the
                // commits stand.
                for (c, _) in applied {
                    let _ = meter.count(&w, c);
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
}

/// A run ends: the task leaves the running index for the status its stop gives it, with
/// its approval wait (suspended) or its held write (held) indexed.
fn end_run(
    w: &WriteTransaction,
    rec: &mut crate::store::rows::TaskRow,
    c: &Commit,
    stop: StopReason,
) -> Result<()> {
    rec.status = QueueStatus::after(stop);
    rec.suspended_at_ms = stop.suspends().then_some(c.now_ms);
    let mut waiting = w.open_table(WAITING)?;
    if stop.suspends() {
        waiting.insert(
            c.task_id.as_str(),
            c.now_ms.saturating_add(rec.approval_wait_ms),
        )?;
    } else {
        waiting.remove(c.task_id.as_str())?;
    }
    let mut held = w.open_table(HELD)?;
    if c.holds() {
        held.insert(c.task_id.as_str(), c.now_ms)?;
    } else {
        held.remove(c.task_id.as_str())?;
    }
    rec.lease = None;
    super::flow::Flow::left_running(w, &c.task_id)?;
    Ok(())
}

/// The task goes back to the queue (at shutdown, or to wait for its model's capacity until
/// the commit's `not_before_ms`).
fn release(w: &WriteTransaction, rec: &mut crate::store::rows::TaskRow, c: &Commit) -> Result<()> {
    rec.status = QueueStatus::Queued;
    rec.lease = None;
    if c.not_before_ms.is_some() {
        rec.not_before_ms = c.not_before_ms;
    }
    super::flow::Flow::left_running(w, &c.task_id)?;
    super::flow::Flow::queue(w, &c.task_id, rec.priority, rec.not_before_ms, c.now_ms)
}

/// Applies one worker commit inside `w`. Checks first that the worker still holds the lease
/// and writes nothing if not, so one failed commit never spoils the others of a group.
fn apply_commit(
    w: &WriteTransaction,
    c: &Commit,
    limits: &crate::store::flow::ConcurrencyLimits,
) -> Result<CommitOutcome> {
    let mut tasks = w.open_table(TASKS)?;
    // The task row only: a step never reads or rewrites the spec or the shared blobs.
    let mut rec =
        tasks::read_row(&tasks, &c.task_id)?.ok_or_else(|| Error::NoTask(c.task_id.clone()))?;
    // Fencing: only the task's current claim may commit. An older claim of the same
    // process (a thread that kept running after its lease was taken over) is refused too.
    let held = rec.status == QueueStatus::Running
        && rec.lease.as_ref().is_some_and(|l| l.token == c.token);
    if !held {
        return Err(Error::LeaseLost(c.task_id.clone()));
    }
    if let Some(call) = &c.call {
        w.open_table(CALL_KEYS)?
            .insert(call.key.as_str(), encode(call)?.as_slice())?;
    }
    if let Some(reply) = &c.reply {
        w.open_table(REPLIES)?
            .insert((c.task_id.as_str(), reply.step), encode(reply)?.as_slice())?;
    }
    if !c.spans.is_empty() {
        let mut spans = w.open_table(SPANS)?;
        for s in &c.spans {
            spans.insert((c.task_id.as_str(), s.id), encode(s)?.as_slice())?;
        }
        super::outbox::queue(w, c)?;
    }
    let mut outcome = CommitOutcome {
        cancel_requested: rec.cancel_requested.clone(),
        next: None,
    };
    if c.kind == CommitKind::Intent {
        return Ok(outcome);
    }
    rec.state = codec::Record::to_row(&c.state);
    rec.next_span_id = c.next_span_id;
    if c.clear_settle {
        rec.settle = None;
    }
    rec.updated_at_ms = c.now_ms;
    match c.kind {
        CommitKind::Intent => {}
        CommitKind::Step => {
            // The renewed expiry lives in the record; RUNNING keeps the claim-time expiry
            // as an index, and recovery reads the record before taking a task over.
            if let Some(l) = rec.lease.as_mut() {
                l.expires_at_ms = c
                    .now_ms
                    .saturating_add(c.lease_ms)
                    .saturating_add(remaining_ms(&rec.budget, c.state.elapsed_ms));
            }
        }
        CommitKind::Final(stop) => {
            end_run(w, &mut rec, c, stop)?;
            if let Some(cb) = &c.callback {
                super::callbacks::queue(w, cb)?;
            }
        }
        CommitKind::Release => release(w, &mut rec, c)?,
    }
    if rec.status != QueueStatus::Running {
        super::list::Indexes::open(w)?.moved(&c.task_id, QueueStatus::Running, rec.status)?;
    }
    tasks.insert(c.task_id.as_str(), rows::encode_task(&rec)?.as_slice())?;
    drop(tasks);
    if let (CommitKind::Final(_), Some(lease)) = (c.kind, &c.claim_next) {
        outcome.next = claim_in(w, lease, 1, c.now_ms, limits)?.0.pop();
    }
    Ok(outcome)
}
