//! The queue in the redb file: enqueue, claims under a lease and a fencing token (the claim
//! count), lease renewal, and recovery of the running tasks whose lease ran out or whose
//! owner died. A record that cannot be read is quarantined, never fatal for the others.

use redb::{ReadableTable, ReadableTableMetadata, WriteTransaction};

use super::flow::{DELAYED, Flow};
use super::list::Indexes;
use super::rows as tasks;
use super::schema::*;
use super::{RedbStore, next_seq};
use crate::kernel::memory::Note;
use crate::store::backend::Queue;
use crate::store::codec::decode;
use crate::store::flow::ConcurrencyLimits;
use crate::store::records::{new_record, same_request};
use crate::store::{
    Enqueued, Error, Lease, NewTask, QueueStatus, Result, TaskRecord, remaining_ms,
};

impl Queue for RedbStore {
    /// One host: an owner is judged dead by its process id.
    fn local_owners(&self) -> bool {
        true
    }

    /// Nothing to record: owners on one host are judged by their process ids.
    fn heartbeat(&self, _owner: &str, _now_ms: u64, _until_ms: u64) -> Result<()> {
        Ok(())
    }

    fn sign_off(&self, _owner: &str) -> Result<()> {
        Ok(())
    }

    fn woken(&self) -> crossbeam_channel::Receiver<()> {
        self.woken.receiver()
    }

    /// A watch on the file: an enqueue, a decision that requeues, any commit of any process
    /// writes it, and the dispatcher then looks for due tasks (a read, before it writes).
    /// One watch per store, made on first use; none where the system has no file watch.
    fn wakeups(&self) -> Option<crossbeam_channel::Receiver<()>> {
        let mut guard = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(w) = guard.as_ref() {
            return Some(w.changes.clone());
        }
        match crate::filewatch::watch(self.path()) {
            Ok(w) => {
                let rx = w.changes.clone();
                *guard = Some(w);
                Some(rx)
            }
            Err(e) => {
                tracing::warn!(error = %e, "no watch on the file; an idle daemon polls it");
                None
            }
        }
    }

    /// A watch on the file: every commit of any process writes it.
    /// Any write to the file may have brought what either kind of waiter waits for.
    fn changes(&self, _of: crate::store::Watched) -> Option<crate::store::Changes> {
        match crate::filewatch::watch(self.path()) {
            Ok(w) => Some(crate::store::Changes {
                rx: w.changes.clone(),
                guard: Box::new(w),
            }),
            Err(e) => {
                tracing::debug!(error = %e, "no watch on the file; waiters poll");
                None
            }
        }
    }

    /// Enqueues tasks in one transaction. A task whose key was seen before is not created
    /// again; its existing id is returned with `created: false`.
    fn enqueue(&self, tasks: &[NewTask], now_ms: u64) -> Result<Vec<Enqueued>> {
        let w = self.db.begin_write()?;
        let mut out = Vec::with_capacity(tasks.len());
        {
            let mut meta = w.open_table(META)?;
            let mut tables = tasks::Tables::open(&w)?;
            let mut ready = w.open_table(READY)?;
            let mut keys = w.open_table(ENQUEUE_KEYS)?;
            let notes = load_notes(&w.open_table(NOTES)?)?;
            let mut idx = Indexes::open(&w)?;
            let mut flow = Flow::open(&w)?;
            for t in tasks {
                if let Some(k) = &t.key
                    && let Some(existing) = keys.get(k.as_str())?
                {
                    let id = existing.value().to_string();
                    drop(existing);
                    let rec = tables.get(&id)?.ok_or_else(|| Error::NoTask(id.clone()))?;
                    same_request(&rec, t, k)?;
                    out.push(Enqueued { id, created: false });
                    continue;
                }
                let id = format!("t{}", next_seq(&mut meta, META_TASK_SEQ)?);
                let rec = new_record(&self.db_id, &id, t, &notes, now_ms);
                tables.insert_new(&rec)?;
                idx.added(&id, &rec.state.user_id, rec.status, rec.created_at_ms)?;
                let seq = next_seq(&mut meta, META_READY_SEQ)?;
                match rec.not_before_ms.filter(|&at| at > now_ms) {
                    Some(at) => flow.delayed.insert((at, seq), id.as_str())?,
                    None => ready.insert((-t.priority, seq), id.as_str())?,
                };
                if let Some(k) = &rec.concurrency_key {
                    flow.keys.insert(id.as_str(), k.as_str())?;
                }
                if let Some(k) = &t.key {
                    keys.insert(k.as_str(), id.as_str())?;
                }
                out.push(Enqueued { id, created: true });
            }
        }
        w.commit()?;
        self.woken.wake();
        Ok(out)
    }

    /// Takes up to `max` tasks from the ready queue, highest priority first, and leases them.
    /// Takes up to `max` ready tasks; a claim that finds none writes nothing.
    fn claim(&self, lease: &Lease, max: usize, now_ms: u64) -> Result<Vec<TaskRecord>> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let due = {
            let r = self.db.begin_read()?;
            let delayed = match r.open_table(DELAYED) {
                Ok(t) => t.first()?.is_some_and(|(k, _)| k.value().0 <= now_ms),
                Err(redb::TableError::TableDoesNotExist(_)) => false,
                Err(e) => return Err(e.into()),
            };
            delayed || !r.open_table(READY)?.is_empty()?
        };
        if !due {
            return Ok(Vec::new());
        }
        let limits = self.limits();
        let w = self.db.begin_write()?;
        let (out, changed) = claim_in(&w, lease, max, now_ms, &limits)?;
        if out.is_empty() && !changed {
            w.abort()?;
        } else {
            w.commit()?;
        }
        Ok(out)
    }

    /// Queued tasks, due or not.
    fn ready_count(&self) -> Result<u64> {
        let r = self.db.begin_read()?;
        let delayed = match r.open_table(DELAYED) {
            Ok(t) => t.len()?,
            Err(redb::TableError::TableDoesNotExist(_)) => 0,
            Err(e) => return Err(e.into()),
        };
        Ok(r.open_table(READY)?.len()? + delayed)
    }

    fn set_limits(&self, limits: crate::store::flow::ConcurrencyLimits) {
        *self.limits.write().unwrap_or_else(|p| p.into_inner()) = std::sync::Arc::new(limits);
    }

    fn next_start_ms(&self, now_ms: u64) -> Result<Option<u64>> {
        let r = self.db.begin_read()?;
        let first = match r.open_table(DELAYED) {
            Ok(t) => t.first()?.map(|(k, _)| k.value().0),
            Err(redb::TableError::TableDoesNotExist(_)) => None,
            Err(e) => return Err(e.into()),
        };
        Ok(first.filter(|&at| at > now_ms))
    }

    fn running_count(&self) -> Result<u64> {
        Ok(self.begin_read()?.open_table(RUNNING)?.len()?)
    }

    /// A claim's lease time left (processes on one host share its clock, and the caller's own
    /// process is alive). `None`: not the task's current claim.
    fn claim_left(&self, id: &str, token: u64, now_ms: u64) -> Result<Option<u64>> {
        let r = self.begin_read()?;
        let row = tasks::read_row(&r.open_table(TASKS)?, id)?;
        Ok(row.and_then(|row| {
            let lease = row
                .lease
                .filter(|l| row.status == QueueStatus::Running && l.token == token)?;
            Some(lease.expires_at_ms.saturating_sub(now_ms))
        }))
    }

    fn renew_claim(&self, id: &str, token: u64, now_ms: u64, lease_ms: u64) -> Result<bool> {
        let w = self.begin_write()?;
        let renewed = {
            let mut tables = tasks::Tables::open(&w)?;
            match tables.get(id)? {
                Some(mut rec)
                    if rec.status == QueueStatus::Running
                        && rec.lease.as_ref().is_some_and(|l| l.token == token) =>
                {
                    let left = remaining_ms(&rec.budget, rec.state.elapsed_ms);
                    if let Some(l) = rec.lease.as_mut() {
                        l.expires_at_ms = now_ms.saturating_add(lease_ms).saturating_add(left);
                    }
                    tables.save(&rec)?;
                    true
                }
                _ => false,
            }
        };
        w.commit()?;
        Ok(renewed)
    }

    /// Puts back in the queue every running task whose lease expired or whose owner `is_dead`,
    /// except the claims `live` names (a process never recovers its own live claims: its
    /// threads renew them, and fencing refuses a stale thread's commits anyway).
    /// Returns the ids recovered. Reads first, so an idle check writes nothing.
    fn recover(
        &self,
        now_ms: u64,
        is_dead: &dyn Fn(&Lease) -> bool,
        live: &dyn Fn(&str, &Lease) -> bool,
    ) -> Result<Vec<String>> {
        let over = |rec: &crate::store::rows::TaskRow| {
            lease_over(rec.status, rec.lease.as_ref(), now_ms, is_dead)
                && !rec.lease.as_ref().is_some_and(|l| live(&rec.id, l))
        };
        let candidates: Vec<String> = {
            let r = self.db.begin_read()?;
            let running = r.open_table(RUNNING)?;
            let tasks = r.open_table(TASKS)?;
            let mut c = Vec::new();
            for entry in running.iter()? {
                let (id, _claimed_expiry) = entry?;
                let id = id.value().to_string();
                // A record that cannot be decoded is quarantined below.
                let take =
                    tasks::read_row(&tasks, &id).map_or(true, |r| r.is_none_or(|r| over(&r)));
                if take {
                    c.push(id);
                }
            }
            c
        };
        if candidates.is_empty() {
            return Ok(candidates);
        }
        let w = self.db.begin_write()?;
        let mut recovered = Vec::new();
        {
            let mut meta = w.open_table(META)?;
            let mut tasks = w.open_table(TASKS)?;
            let mut running = w.open_table(RUNNING)?;
            let mut ready = w.open_table(READY)?;
            let mut idx = Indexes::open(&w)?;
            let mut flow = Flow::open(&w)?;
            for id in candidates {
                // Checked again inside the write: another process may have recovered it.
                if running.get(id.as_str())?.is_none() {
                    continue;
                }
                let mut rec = match tasks::read_row(&tasks, &id) {
                    Ok(Some(rec)) => rec,
                    Ok(None) => {
                        running.remove(id.as_str())?;
                        flow.give_back(&id)?;
                        continue;
                    }
                    Err(e) => {
                        tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                        running.remove(id.as_str())?;
                        flow.give_back(&id)?;
                        w.open_table(DAMAGED)?
                            .insert(id.as_str(), e.to_string().as_str())?;
                        idx.removed(&id, QueueStatus::Running, None)?;
                        continue;
                    }
                };
                if !over(&rec) {
                    continue;
                }
                running.remove(id.as_str())?;
                flow.give_back(&id)?;
                rec.status = QueueStatus::Queued;
                rec.lease = None;
                rec.updated_at_ms = now_ms;
                tasks::save_row(&mut tasks, &rec)?;
                idx.moved(&id, QueueStatus::Running, QueueStatus::Queued)?;
                let seq = next_seq(&mut meta, META_READY_SEQ)?;
                ready.insert((-rec.priority, seq), id.as_str())?;
                recovered.push(id);
            }
        }
        w.commit()?;
        Ok(recovered)
    }
}

/// Takes up to `max` tasks from the ready queue inside `w`, highest priority first, and leases
/// them, each under a new fencing token; first, the delayed tasks that are due join the ready
/// queue. A task whose concurrency key is at its limit is passed over (it keeps its place),
/// so a key at its limit never holds back another's tasks. A record that cannot be decoded
/// is quarantined. Returns the tasks, and whether anything was written (due tasks moved,
/// stale entries removed).
pub(super) fn claim_in(
    w: &WriteTransaction,
    lease: &Lease,
    max: usize,
    now_ms: u64,
    limits: &ConcurrencyLimits,
) -> Result<(Vec<TaskRecord>, bool)> {
    let mut out = Vec::new();
    let mut ready = w.open_table(READY)?;
    let mut tables = tasks::Tables::open(w)?;
    let mut flow = Flow::open(w)?;
    let moved = due_to_ready(&mut flow, &mut ready, &mut tables, now_ms)?;
    let mut running = w.open_table(RUNNING)?;
    let mut damaged = w.open_table(DAMAGED)?;
    let mut idx = Indexes::open(w)?;
    let taken = pick(&ready, &flow, &tables, max, limits)?;
    // Entries taken and found stale (the task was cancelled while queued) are removed too.
    let changed = moved || !taken.is_empty();
    for (k, id, slot) in taken {
        ready.remove(k)?;
        let mut rec = match tables.get(&id) {
            Ok(Some(rec)) => rec,
            Ok(None) => continue,
            Err(e) => {
                // Quarantined: listed as damaged, never run, never fatal for others.
                tracing::error!(task = %id, error = %e, "task record damaged; quarantined");
                damaged.insert(id.as_str(), e.to_string().as_str())?;
                idx.removed(&id, QueueStatus::Queued, None)?;
                continue;
            }
        };
        if rec.status != QueueStatus::Queued {
            continue; // stale entry
        }
        if let Some(key) = &slot {
            flow.take_slot(&id, key)?;
        }
        rec.status = QueueStatus::Running;
        let mut lease = lease.clone();
        // The claim's lease (now + lease_ms) plus the task's remaining active time: one
        // model or tool call may take all of it.
        lease.expires_at_ms = lease
            .expires_at_ms
            .max(now_ms)
            .saturating_add(remaining_ms(&rec.budget, rec.state.elapsed_ms));
        rec.runs = rec.runs.saturating_add(1);
        lease.token = u64::from(rec.runs);
        rec.lease = Some(lease);
        rec.updated_at_ms = now_ms;
        tables.save(&rec)?;
        idx.moved(&id, QueueStatus::Queued, QueueStatus::Running)?;
        running.insert(
            id.as_str(),
            rec.lease.as_ref().map_or(now_ms, |l| l.expires_at_ms),
        )?;
        out.push(rec);
    }
    Ok((out, changed))
}

/// A ready task a claim takes: its ready-queue key, its id, and the key whose slot it takes.
type Picked = ((i64, u64), String, Option<String>);

/// The ready tasks a claim of `max` takes, in queue order: `(ready key, id, the key whose slot
/// it takes)`, passing over those whose concurrency key is at its limit and those of a model
/// profile the limits pass over (a record that cannot be read is taken, to be quarantined).
fn pick(
    ready: &redb::Table<(i64, u64), &str>,
    flow: &Flow,
    tables: &tasks::Tables,
    max: usize,
    limits: &ConcurrencyLimits,
) -> Result<Vec<Picked>> {
    let mut taken = Vec::new();
    let mut running: std::collections::BTreeMap<String, u64> = Default::default();
    for entry in ready.iter()? {
        if taken.len() >= max {
            break;
        }
        let (k, v) = entry?;
        let id = v.value().to_string();
        if !limits.passed_over().is_empty()
            && let Ok(Some(rec)) = tables.get(&id)
            && limits.passes_over(&rec.model)
        {
            continue;
        }
        let limited = match flow.key_of(&id)? {
            Some(key) => limits.limit_of(&key).map(|l| (key, u64::from(l))),
            None => None,
        };
        let slot = match limited {
            Some((key, limit)) => {
                let n = match running.get(&key) {
                    Some(n) => *n,
                    None => flow.running(&key)?,
                };
                if n >= limit {
                    continue;
                }
                running.insert(key.clone(), n + 1);
                Some(key)
            }
            None => None,
        };
        taken.push((k.value(), id, slot));
    }
    Ok(taken)
}

/// Moves the delayed tasks due at `now_ms` to the ready queue (each keeps its sequence, so it
/// takes the place its enqueue gave it among tasks of its priority). Whether any moved.
fn due_to_ready(
    flow: &mut Flow,
    ready: &mut redb::Table<(i64, u64), &str>,
    tables: &mut tasks::Tables,
    now_ms: u64,
) -> Result<bool> {
    let due: Vec<((u64, u64), String)> = flow
        .delayed
        .range(..(now_ms.saturating_add(1), 0))?
        .map(|e| e.map(|(k, v)| (k.value(), v.value().to_string())))
        .collect::<std::result::Result<_, _>>()?;
    for ((at, seq), id) in &due {
        flow.delayed.remove((*at, *seq))?;
        // A record that cannot be read joins the queue too: the claim quarantines it.
        let priority = tables.get(id).ok().flatten().map_or(0, |r| r.priority);
        ready.insert((-priority, *seq), id.as_str())?;
    }
    Ok(!due.is_empty())
}

/// A running task may be taken over when its lease expired or its owner is gone.
fn lease_over(
    status: QueueStatus,
    lease: Option<&Lease>,
    now_ms: u64,
    is_dead: &dyn Fn(&Lease) -> bool,
) -> bool {
    status != QueueStatus::Running || lease.is_none_or(|l| l.expires_at_ms <= now_ms || is_dead(l))
}

fn load_notes(t: &redb::Table<u64, &[u8]>) -> Result<Vec<Note>> {
    let mut out = Vec::new();
    for entry in t.iter()? {
        let (_, v) = entry?;
        out.push(decode("note", v.value())?);
    }
    Ok(out)
}
