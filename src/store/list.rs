//! Listing tasks without decoding every one. A page is at most `limit` tasks, newest first,
//! read from an index chosen by the query: all tasks by number (with their creation time), by
//! status, by user, or the enqueue key. Filters the index cannot answer (a stop reason, a time
//! range under a status or user index) are checked on the task rows the index yields, never on
//! the script or catalog blobs. A cursor is the number of the last task listed.
//!
//! This module holds what both engines share: the query, the page and the summary. On the redb
//! file the indexes are tables (`store::redb::list`); on PostgreSQL, B-tree indexes.

use serde::Serialize;

use super::QueueStatus;
use crate::kernel::StopReason;

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
    /// Not started before this time: a delayed start, or a wait for its model's capacity.
    pub not_before_ms: Option<u64>,
}

impl TaskSummary {
    /// Its status as a list shows it: `scheduled` while it is queued before its start time.
    pub fn shown_status(&self, now_ms: u64) -> &'static str {
        match self.not_before_ms {
            Some(at) if self.status == QueueStatus::Queued && at > now_ms => "scheduled",
            _ => self.status.as_str(),
        }
    }
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

/// A task's stop reason as a list shows it: none while it is queued or running again (its
/// state keeps the stop it resumes from, `needs_approval` after an approval).
pub fn shown_stop(status: QueueStatus, stop: Option<StopReason>) -> Option<StopReason> {
    stop.filter(|_| status.is_settled())
}
