//! Listing tasks without decoding every one. A page is at most `limit` tasks, newest first,
//! read from an index chosen by the query: all tasks by number (with their creation time), by
//! status, by user, or the enqueue key. Filters the index cannot answer (a stop reason, a time
//! range under a status or user index) are checked on the task rows the index yields, never on
//! the script or catalog blobs. A cursor is the number of the last task listed.
//!
//! On the redb file the indexes are tables written in the transaction that changes what they
//! index ([`Indexes`]); the per-status counts are kept beside them, so the console and
//! `/metrics` never count by scanning. On PostgreSQL they are B-tree indexes on the columns.

use redb::{ReadTransaction, ReadableTable, Table, TableDefinition, WriteTransaction};
use serde::Serialize;

use super::codec::is_legacy;
use super::rows::{SpecRow, TaskRow};
use super::schema::TASKS;
use super::{QueueStatus, Result, tasks};
use crate::kernel::StopReason;

/// (status, task number) -> (): the tasks in each queue status.
pub const BY_STATUS: TableDefinition<(u8, u64), ()> = TableDefinition::new("by_status");
/// (user id, task number) -> (): each user's tasks.
pub const BY_USER: TableDefinition<(&str, u64), ()> = TableDefinition::new("by_user");
/// task number -> creation time (ms): every task, in enqueue order.
pub const CREATED: TableDefinition<u64, u64> = TableDefinition::new("created");
/// status -> how many tasks have it.
pub const STATUS_COUNTS: TableDefinition<u8, u64> = TableDefinition::new("status_counts");

/// The largest page `list` returns.
pub const LIMIT_MAX: usize = 10_000;

/// What `worker list`, the console and the library ask for.
#[derive(Clone, Debug, Default)]
pub struct ListQuery {
    pub status: Option<QueueStatus>,
    pub stop: Option<StopReason>,
    /// A finished task's outcome (`completed`, `cannot_complete`).
    pub outcome: Option<String>,
    pub user: Option<String>,
    /// The task enqueued under this key (at most one).
    pub key: Option<String>,
    /// Created at or after (ms since the epoch).
    pub since_ms: Option<u64>,
    /// Created before.
    pub until_ms: Option<u64>,
    /// The cursor: only tasks numbered below this one.
    pub before: Option<u64>,
    pub limit: usize,
}

/// One line of a list: what the task is and how far it got, from its row and spec alone.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TaskSummary {
    pub id: String,
    pub num: u64,
    pub status: QueueStatus,
    pub stop: Option<StopReason>,
    /// The final answer's outcome, once there is one (`completed`, `cannot_complete`).
    pub outcome: Option<String>,
    pub user: String,
    pub goal: String,
    pub priority: i64,
    pub key: Option<String>,
    pub steps: u32,
    pub tool_calls: u32,
    pub tokens: u64,
    pub elapsed_ms: u64,
    pub runs: u32,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
}

/// A listed task, or one whose record cannot be decoded (listed, never hidden).
#[derive(Clone, Debug, PartialEq)]
pub enum Listed {
    Task(TaskSummary),
    Damaged { id: String, error: String },
}

impl Listed {
    pub fn id(&self) -> &str {
        match self {
            Listed::Task(t) => &t.id,
            Listed::Damaged { id, .. } => id,
        }
    }
}

/// A page of tasks and the cursor of the next one (`None`: this was the last).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Page {
    pub tasks: Vec<Listed>,
    pub next: Option<u64>,
}

impl ListQuery {
    /// Whether a summary passes the filters (those an index already applied pass again).
    pub fn admits(&self, s: &TaskSummary) -> bool {
        self.status.is_none_or(|x| s.status == x)
            && self.stop.is_none_or(|x| s.stop == Some(x))
            && self
                .outcome
                .as_ref()
                .is_none_or(|o| s.outcome.as_ref() == Some(o))
            && self.user.as_ref().is_none_or(|u| &s.user == u)
            && self.key.as_ref().is_none_or(|k| s.key.as_ref() == Some(k))
            && self.since_ms.is_none_or(|t| s.created_at_ms >= t)
            && self.until_ms.is_none_or(|t| s.created_at_ms < t)
            && self.before.is_none_or(|b| s.num < b)
    }

    pub fn limit(&self) -> usize {
        self.limit.clamp(1, LIMIT_MAX)
    }
}

/// The number of task `t42`: 42. Ids are made `t{n}` by both backends.
pub fn task_num(id: &str) -> Option<u64> {
    id.strip_prefix('t')?.parse().ok()
}

pub fn status_code(s: QueueStatus) -> u8 {
    match s {
        QueueStatus::Queued => 0,
        QueueStatus::Running => 1,
        QueueStatus::Suspended => 2,
        QueueStatus::Held => 3,
        QueueStatus::Finished => 4,
    }
}

pub const STATUSES: [QueueStatus; 5] = [
    QueueStatus::Queued,
    QueueStatus::Running,
    QueueStatus::Suspended,
    QueueStatus::Held,
    QueueStatus::Finished,
];

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

/// A task's stop reason as a list shows it: none while it is queued or running again (its
/// state keeps the stop it resumes from, `needs_approval` after an approval).
pub fn shown_stop(status: QueueStatus, stop: Option<StopReason>) -> Option<StopReason> {
    stop.filter(|_| !matches!(status, QueueStatus::Queued | QueueStatus::Running))
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
    }
}

/// A task's summary read from its row and spec.
fn read_summary<T, S>(tasks: &T, specs: &S, id: &str) -> Result<TaskSummary>
where
    T: ReadableTable<&'static str, &'static [u8]>,
    S: ReadableTable<&'static str, &'static [u8]>,
{
    let row: TaskRow =
        tasks::read_row(tasks, id)?.ok_or_else(|| super::Error::NoTask(id.to_string()))?;
    let spec: SpecRow = match specs.get(id)? {
        Some(g) if !is_legacy(g.value()) => {
            super::rows::decode_spec(&format!("task {id} spec"), g.value())?
        }
        _ => {
            return Err(super::Error::Corrupt(format!(
                "task {id}: its spec record is missing"
            )));
        }
    };
    Ok(summary(&row, &spec))
}

/// One page of the redb file's tasks.
pub(super) fn list(r: &ReadTransaction, q: &ListQuery) -> Result<Page> {
    let tasks = r.open_table(TASKS)?;
    let specs = r.open_table(super::schema::TASK_SPECS)?;
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
        let keys = r.open_table(super::schema::ENQUEUE_KEYS)?;
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
            if q.since_ms.is_some_and(|s| created < s) || q.until_ms.is_some_and(|u| created >= u) {
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
pub(super) fn counts(r: &ReadTransaction) -> Result<Vec<(QueueStatus, u64)>> {
    let t = r.open_table(STATUS_COUNTS)?;
    let mut out = Vec::new();
    for s in STATUSES {
        out.push((s, t.get(status_code(s))?.map_or(0, |g| g.value())));
    }
    Ok(out)
}

/// The creation time of the oldest queued task.
pub(super) fn oldest_queued_ms(r: &ReadTransaction) -> Result<Option<u64>> {
    let t = r.open_table(BY_STATUS)?;
    let c = status_code(QueueStatus::Queued);
    let first = t.range((c, 0)..(c, u64::MAX))?.next();
    let Some(first) = first else { return Ok(None) };
    let n = first?.0.value().1;
    Ok(r.open_table(CREATED)?.get(n)?.map(|g| g.value()))
}

/// The id of the task enqueued under `key`.
pub(super) fn by_key(r: &ReadTransaction, key: &str) -> Result<Option<String>> {
    let keys = r.open_table(super::schema::ENQUEUE_KEYS)?;
    Ok(keys.get(key)?.map(|g| g.value().to_string()))
}
