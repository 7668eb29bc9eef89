//! The list indexes of the redb file: tables written in the transaction that changes what they
//! index ([`Indexes`]), with the per-status counts kept beside them, so the console and
//! `/metrics` never count by scanning, and the reads of `Lists` through them.

use redb::{ReadableTable, Table, TableDefinition, WriteTransaction};

use super::RedbStore;
use super::rows as tasks;
use super::schema::*;
use crate::store::backend::Lists;
use crate::store::codec::is_legacy;
use crate::store::list::*;
use crate::store::rows::{SpecRow, TaskRow};
use crate::store::{Error, QueueStatus, Result};

/// (status, task number) -> (): the tasks in each queue status.
pub const BY_STATUS: TableDefinition<(u8, u64), ()> = TableDefinition::new("by_status");
/// (user id, task number) -> (): each user's tasks.
pub const BY_USER: TableDefinition<(&str, u64), ()> = TableDefinition::new("by_user");
/// task number -> creation time (ms): every task, in enqueue order.
pub const CREATED: TableDefinition<u64, u64> = TableDefinition::new("created");
/// status -> how many tasks have it.
pub const STATUS_COUNTS: TableDefinition<u8, u64> = TableDefinition::new("status_counts");

/// The list indexes of the redb file, open in one write transaction.
pub(super) struct Indexes<'w> {
    by_status: Table<'w, (u8, u64), ()>,
    by_user: Table<'w, (&'static str, u64), ()>,
    created: Table<'w, u64, u64>,
    counts: Table<'w, u8, u64>,
}

impl<'w> Indexes<'w> {
    pub fn open(w: &'w WriteTransaction) -> Result<Indexes<'w>> {
        Ok(Indexes {
            by_status: w.open_table(BY_STATUS)?,
            by_user: w.open_table(BY_USER)?,
            created: w.open_table(CREATED)?,
            counts: w.open_table(STATUS_COUNTS)?,
        })
    }

    fn count(&mut self, s: QueueStatus, up: bool) -> Result<()> {
        let c = status_code(s);
        let n = self.counts.get(c)?.map_or(0, |g| g.value());
        let n = if up { n + 1 } else { n.saturating_sub(1) };
        self.counts.insert(c, n)?;
        Ok(())
    }

    /// A new task.
    pub fn added(&mut self, id: &str, user: &str, status: QueueStatus, created: u64) -> Result<()> {
        let Some(n) = task_num(id) else { return Ok(()) };
        self.created.insert(n, created)?;
        self.by_user.insert((user, n), ())?;
        self.by_status.insert((status_code(status), n), ())?;
        self.count(status, true)
    }

    /// A task's status changed (the same status is no change).
    pub fn moved(&mut self, id: &str, from: QueueStatus, to: QueueStatus) -> Result<()> {
        let Some(n) = task_num(id) else { return Ok(()) };
        if from == to {
            return Ok(());
        }
        if self.by_status.remove((status_code(from), n))?.is_some() {
            self.count(from, false)?;
        }
        self.by_status.insert((status_code(to), n), ())?;
        self.count(to, true)
    }

    /// A task deleted (purge), or its status no longer known (quarantined).
    pub fn removed(&mut self, id: &str, status: QueueStatus, user: Option<&str>) -> Result<()> {
        let Some(n) = task_num(id) else { return Ok(()) };
        if self.by_status.remove((status_code(status), n))?.is_some() {
            self.count(status, false)?;
        }
        if let Some(u) = user {
            self.by_user.remove((u, n))?;
            self.created.remove(n)?;
        }
        Ok(())
    }

    /// Rebuilds every index from the task rows (a file from before the indexes).
    pub fn rebuild(&mut self, w: &WriteTransaction) -> Result<u64> {
        self.by_status.retain(|_, _| false)?;
        self.by_user.retain(|_, _| false)?;
        self.created.retain(|_, _| false)?;
        self.counts.retain(|_, _| false)?;
        let tasks = w.open_table(TASKS)?;
        let specs = w.open_table(super::schema::TASK_SPECS)?;
        let mut n = 0;
        for entry in tasks.iter()? {
            let (k, _) = entry?;
            // A record that cannot be decoded stays out of the indexes; `list` and `check`
            // report it through the damaged scan.
            if let Ok(s) = read_summary(&tasks, &specs, k.value()) {
                self.added(&s.id, &s.user, s.status, s.created_at_ms)?;
                n += 1;
            }
        }
        Ok(n)
    }
}

/// A task's summary from its row and spec.
pub(super) fn summary(row: &TaskRow, spec: &SpecRow) -> TaskSummary {
    TaskSummary {
        id: row.id.clone(),
        num: task_num(&row.id).unwrap_or(0),
        status: row.status,
        stop: shown_stop(row.status, row.state.stop),
        outcome: row.state.outcome().map(str::to_string),
        user: row.state.user_id.clone(),
        goal: row.state.goal.clone(),
        priority: row.priority,
        key: spec.key.clone(),
        steps: row.state.step,
        tool_calls: row.state.tool_calls,
        tokens: row.state.tokens,
        elapsed_ms: row.state.elapsed_ms,
        runs: row.runs,
        created_at_ms: spec.created_at_ms,
        updated_at_ms: row.updated_at_ms,
        not_before_ms: row.not_before_ms,
    }
}

/// A task's summary read from its row and spec.
fn read_summary<T, S>(tasks: &T, specs: &S, id: &str) -> Result<TaskSummary>
where
    T: ReadableTable<&'static str, &'static [u8]>,
    S: ReadableTable<&'static str, &'static [u8]>,
{
    let row: TaskRow = tasks::read_row(tasks, id)?.ok_or_else(|| Error::NoTask(id.to_string()))?;
    let spec: SpecRow = match specs.get(id)? {
        Some(g) if !is_legacy(g.value()) => {
            crate::store::rows::decode_spec(&format!("task {id} spec"), g.value())?
        }
        _ => {
            return Err(Error::Corrupt(format!(
                "task {id}: its spec record is missing"
            )));
        }
    };
    Ok(summary(&row, &spec))
}

impl Lists for RedbStore {
    /// One page of the redb file's tasks.
    fn list(&self, q: &ListQuery) -> Result<Page> {
        let r = &self.begin_read()?;
        let tasks = r.open_table(TASKS)?;
        let specs = r.open_table(TASK_SPECS)?;
        let limit = q.limit();
        let below = q.before.unwrap_or(u64::MAX);
        let mut page = Page::default();
        let take = |n: u64, page: &mut Page| -> Result<bool> {
            let id = format!("t{n}");
            match read_summary(&tasks, &specs, &id) {
                Ok(s) if q.admits(&s) => page.tasks.push(Listed::Task(s)),
                Ok(_) => return Ok(false),
                Err(super::Error::NoTask(_)) => return Ok(false),
                Err(e) => page.tasks.push(Listed::Damaged {
                    id,
                    error: e.to_string(),
                }),
            }
            if page.tasks.len() == limit {
                page.next = Some(n);
                return Ok(true);
            }
            Ok(false)
        };
        if let Some(key) = &q.key {
            let keys = r.open_table(ENQUEUE_KEYS)?;
            let n = keys.get(key.as_str())?.and_then(|g| task_num(g.value()));
            if let Some(n) = n.filter(|n| *n < below) {
                take(n, &mut page)?;
            }
            page.next = None;
            return Ok(page);
        }
        if let Some(s) = q.status {
            let t = r.open_table(BY_STATUS)?;
            let c = status_code(s);
            for e in t.range((c, 0)..(c, below))?.rev() {
                if take(e?.0.value().1, &mut page)? {
                    break;
                }
            }
        } else if let Some(u) = &q.user {
            let t = r.open_table(BY_USER)?;
            for e in t.range((u.as_str(), 0)..(u.as_str(), below))?.rev() {
                if take(e?.0.value().1, &mut page)? {
                    break;
                }
            }
        } else {
            let t = r.open_table(CREATED)?;
            for e in t.range(0..below)?.rev() {
                let (n, created) = e?;
                let created = created.value();
                // The time filters are answered by the index itself.
                if q.since_ms.is_some_and(|s| created < s)
                    || q.until_ms.is_some_and(|u| created >= u)
                {
                    continue;
                }
                if take(n.value(), &mut page)? {
                    break;
                }
            }
        }
        Ok(page)
    }

    /// How many tasks are in each status, from the counts kept beside the index.
    fn counts(&self) -> Result<Vec<(QueueStatus, u64)>> {
        let r = &self.begin_read()?;
        let t = r.open_table(STATUS_COUNTS)?;
        let mut out = Vec::new();
        for s in STATUSES {
            out.push((s, t.get(status_code(s))?.map_or(0, |g| g.value())));
        }
        Ok(out)
    }

    /// The creation time of the oldest queued task.
    fn oldest_queued_ms(&self) -> Result<Option<u64>> {
        let r = &self.begin_read()?;
        let t = r.open_table(BY_STATUS)?;
        let c = status_code(QueueStatus::Queued);
        let first = t.range((c, 0)..(c, u64::MAX))?.next();
        let Some(first) = first else { return Ok(None) };
        let n = first?.0.value().1;
        Ok(r.open_table(CREATED)?.get(n)?.map(|g| g.value()))
    }

    /// The id of the task enqueued under `key`.
    fn task_by_key(&self, key: &str) -> Result<Option<String>> {
        let r = &self.begin_read()?;
        let keys = r.open_table(ENQUEUE_KEYS)?;
        Ok(keys.get(key)?.map(|g| g.value().to_string()))
    }
}
