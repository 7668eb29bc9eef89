//! The task row (format 6): queue status, lease, budget and the state a step or an operator
//! changes, with the state row inside it; and formats 2 to 5, which are still read.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

use super::{BudgetRowV1, R, ToolCallRow};
use crate::kernel::conversation::Message;
use crate::kernel::{Budget, PlanStep, Status, StopReason, TaskState, ToolCall};
use crate::store::codec::{Json, Record};
use crate::store::{Approval, Lease, QueueStatus};

#[derive(Serialize, Deserialize)]
pub struct StateRow {
    task_id: String,
    pub(in crate::store) user_id: String,
    pub(in crate::store) goal: String,
    plan: Vec<PlanStep>,
    facts: Json,
    last_result: Option<Json>,
    pub(in crate::store) step: u32,
    pub(in crate::store) tool_calls: u32,
    pub(in crate::store) tokens: u64,
    pub(in crate::store) elapsed_ms: u64,
    seen: BTreeMap<String, u32>,
    stalls: u32,
    status: Status,
    pub(in crate::store) stop: Option<StopReason>,
    answer: Option<String>,
    pending: Option<ToolCallRow>,
    outcome: Option<String>,
    remembered: Vec<String>,
    cancelled_from: Option<StopReason>,
    last_turn: Option<Json>,
    replans: u32,
    failed_writes: Vec<String>,
    spent_steps: Vec<String>,
    /// The conversation after the goal (task format 6).
    conversation: Vec<Message>,
}

/// A state row of task formats 4 and 5 (before conversations).
#[derive(Serialize, Deserialize)]
pub struct StateRowV4 {
    task_id: String,
    user_id: String,
    goal: String,
    plan: Vec<PlanStep>,
    facts: Json,
    last_result: Option<Json>,
    step: u32,
    tool_calls: u32,
    tokens: u64,
    elapsed_ms: u64,
    seen: BTreeMap<String, u32>,
    stalls: u32,
    status: Status,
    stop: Option<StopReason>,
    answer: Option<String>,
    pending: Option<ToolCallRow>,
    outcome: Option<String>,
    remembered: Vec<String>,
    cancelled_from: Option<StopReason>,
    /// The model's last turn, as JSON (task format 3).
    last_turn: Option<Json>,
    /// Plan revisions, and writes refused or failed since their last success (format 4).
    replans: u32,
    failed_writes: Vec<String>,
    spent_steps: Vec<String>,
}

/// A state row of task format 3 (before plan revisions were counted).
#[derive(Serialize, Deserialize)]
pub struct StateRowV3 {
    task_id: String,
    user_id: String,
    goal: String,
    plan: Vec<PlanStep>,
    facts: Json,
    last_result: Option<Json>,
    step: u32,
    tool_calls: u32,
    tokens: u64,
    elapsed_ms: u64,
    seen: BTreeMap<String, u32>,
    stalls: u32,
    status: Status,
    stop: Option<StopReason>,
    answer: Option<String>,
    pending: Option<ToolCallRow>,
    outcome: Option<String>,
    remembered: Vec<String>,
    cancelled_from: Option<StopReason>,
    last_turn: Option<Json>,
}

impl From<StateRowV4> for StateRow {
    fn from(o: StateRowV4) -> StateRow {
        StateRow {
            task_id: o.task_id,
            user_id: o.user_id,
            goal: o.goal,
            plan: o.plan,
            facts: o.facts,
            last_result: o.last_result,
            step: o.step,
            tool_calls: o.tool_calls,
            tokens: o.tokens,
            elapsed_ms: o.elapsed_ms,
            seen: o.seen,
            stalls: o.stalls,
            status: o.status,
            stop: o.stop,
            answer: o.answer,
            pending: o.pending,
            outcome: o.outcome,
            remembered: o.remembered,
            cancelled_from: o.cancelled_from,
            last_turn: o.last_turn,
            replans: o.replans,
            failed_writes: o.failed_writes,
            spent_steps: o.spent_steps,
            conversation: Vec::new(),
        }
    }
}

impl From<StateRowV3> for StateRow {
    fn from(o: StateRowV3) -> StateRow {
        StateRow {
            task_id: o.task_id,
            user_id: o.user_id,
            goal: o.goal,
            plan: o.plan,
            facts: o.facts,
            last_result: o.last_result,
            step: o.step,
            tool_calls: o.tool_calls,
            tokens: o.tokens,
            elapsed_ms: o.elapsed_ms,
            seen: o.seen,
            stalls: o.stalls,
            status: o.status,
            stop: o.stop,
            answer: o.answer,
            pending: o.pending,
            outcome: o.outcome,
            remembered: o.remembered,
            cancelled_from: o.cancelled_from,
            last_turn: o.last_turn,
            replans: 0,
            failed_writes: Vec::new(),
            spent_steps: Vec::new(),
            conversation: Vec::new(),
        }
    }
}

/// A state row of task format 2 (before a model's last turn was kept).
#[derive(Serialize, Deserialize)]
pub struct StateRowV2 {
    task_id: String,
    user_id: String,
    goal: String,
    plan: Vec<PlanStep>,
    facts: Json,
    last_result: Option<Json>,
    step: u32,
    tool_calls: u32,
    tokens: u64,
    elapsed_ms: u64,
    seen: BTreeMap<String, u32>,
    stalls: u32,
    status: Status,
    stop: Option<StopReason>,
    answer: Option<String>,
    pending: Option<ToolCallRow>,
    outcome: Option<String>,
    remembered: Vec<String>,
    cancelled_from: Option<StopReason>,
}

impl StateRow {
    /// The final answer's outcome, once there is one.
    pub fn outcome(&self) -> Option<&str> {
        self.outcome.as_deref()
    }
}

impl From<StateRowV2> for StateRowV3 {
    fn from(o: StateRowV2) -> StateRowV3 {
        StateRowV3 {
            task_id: o.task_id,
            user_id: o.user_id,
            goal: o.goal,
            plan: o.plan,
            facts: o.facts,
            last_result: o.last_result,
            step: o.step,
            tool_calls: o.tool_calls,
            tokens: o.tokens,
            elapsed_ms: o.elapsed_ms,
            seen: o.seen,
            stalls: o.stalls,
            status: o.status,
            stop: o.stop,
            answer: o.answer,
            pending: o.pending,
            outcome: o.outcome,
            remembered: o.remembered,
            cancelled_from: o.cancelled_from,
            last_turn: None,
        }
    }
}

impl Record for TaskState {
    type Row = StateRow;
    fn to_row(&self) -> StateRow {
        StateRow {
            task_id: self.task_id.clone(),
            user_id: self.user_id.clone(),
            goal: self.goal.clone(),
            plan: self.plan.clone(),
            facts: Json::of_map(&self.facts),
            last_result: self.last_result.as_ref().map(Json::of),
            step: self.step,
            tool_calls: self.tool_calls,
            tokens: self.tokens,
            elapsed_ms: self.elapsed_ms,
            seen: self.seen.clone(),
            stalls: self.stalls,
            status: self.status,
            stop: self.stop,
            answer: self.answer.clone(),
            pending: self.pending.as_ref().map(Record::to_row),
            outcome: self.outcome.clone(),
            remembered: self.remembered.clone(),
            cancelled_from: self.cancelled_from,
            last_turn: self
                .last_turn
                .as_ref()
                .and_then(|t| serde_json::to_value(t).ok())
                .map(|v| Json::of(&v)),
            replans: self.replans,
            failed_writes: self.failed_writes.clone(),
            spent_steps: self.spent_steps.clone(),
            conversation: self.conversation.clone(),
        }
    }
    fn from_row(r: StateRow) -> R<TaskState> {
        Ok(TaskState {
            task_id: r.task_id,
            user_id: r.user_id,
            goal: r.goal,
            plan: r.plan,
            facts: r.facts.map()?,
            last_result: r.last_result.map(|j| j.value()).transpose()?,
            step: r.step,
            tool_calls: r.tool_calls,
            tokens: r.tokens,
            elapsed_ms: r.elapsed_ms,
            seen: r.seen,
            stalls: r.stalls,
            status: r.status,
            stop: r.stop,
            answer: r.answer,
            pending: r.pending.map(ToolCall::from_row).transpose()?,
            outcome: r.outcome,
            remembered: r.remembered,
            cancelled_from: r.cancelled_from,
            last_turn: match r.last_turn {
                None => None,
                Some(j) => Some(
                    serde_json::from_value(j.value()?)
                        .map_err(|e| format!("the model's last turn: {e}"))?,
                ),
            },
            replans: r.replans,
            failed_writes: r.failed_writes,
            spent_steps: r.spent_steps,
            conversation: r.conversation,
        })
    }
}

/// What a step or an operator changes: written by every commit.
#[derive(Serialize, Deserialize)]
pub struct TaskRow {
    pub id: String,
    pub status: QueueStatus,
    pub priority: i64,
    pub budget: Budget,
    pub state: StateRow,
    pub next_span_id: u32,
    pub updated_at_ms: u64,
    pub lease: Option<Lease>,
    pub runs: u32,
    pub cancel_requested: Option<String>,
    pub settle: Option<Json>,
    pub approval_wait_ms: u64,
    pub suspended_at_ms: Option<u64>,
    pub approval: Option<Approval>,
    pub not_before_ms: Option<u64>,
}

/// The format a task row is written in: 3 adds the model's last turn to the state, 4 the
/// budget's `replans_max` and the state's plan revisions and failed writes, 5 the time
/// before which it is not claimed, 6 the state's conversation.
pub const TASK_FORMAT: u8 = 6;

/// A task row of format 5 (before conversations).
#[derive(Serialize, Deserialize)]
pub struct TaskRowV5 {
    id: String,
    status: QueueStatus,
    priority: i64,
    budget: Budget,
    state: StateRowV4,
    next_span_id: u32,
    updated_at_ms: u64,
    lease: Option<Lease>,
    runs: u32,
    cancel_requested: Option<String>,
    settle: Option<Json>,
    approval_wait_ms: u64,
    suspended_at_ms: Option<u64>,
    approval: Option<Approval>,
    not_before_ms: Option<u64>,
}

impl From<TaskRowV5> for TaskRow {
    fn from(o: TaskRowV5) -> TaskRow {
        TaskRow {
            id: o.id,
            status: o.status,
            priority: o.priority,
            budget: o.budget,
            state: o.state.into(),
            next_span_id: o.next_span_id,
            updated_at_ms: o.updated_at_ms,
            lease: o.lease,
            runs: o.runs,
            cancel_requested: o.cancel_requested,
            settle: o.settle,
            approval_wait_ms: o.approval_wait_ms,
            suspended_at_ms: o.suspended_at_ms,
            approval: o.approval,
            not_before_ms: o.not_before_ms,
        }
    }
}

impl From<TaskRowV4> for TaskRowV5 {
    fn from(o: TaskRowV4) -> TaskRowV5 {
        TaskRowV5 {
            id: o.id,
            status: o.status,
            priority: o.priority,
            budget: o.budget,
            state: o.state,
            next_span_id: o.next_span_id,
            updated_at_ms: o.updated_at_ms,
            lease: o.lease,
            runs: o.runs,
            cancel_requested: o.cancel_requested,
            settle: o.settle,
            approval_wait_ms: o.approval_wait_ms,
            suspended_at_ms: o.suspended_at_ms,
            approval: o.approval,
            not_before_ms: None,
        }
    }
}

/// A task row of format 4 (before delayed starts).
#[derive(Serialize, Deserialize)]
pub struct TaskRowV4 {
    id: String,
    status: QueueStatus,
    priority: i64,
    budget: Budget,
    state: StateRowV4,
    next_span_id: u32,
    updated_at_ms: u64,
    lease: Option<Lease>,
    runs: u32,
    cancel_requested: Option<String>,
    settle: Option<Json>,
    approval_wait_ms: u64,
    suspended_at_ms: Option<u64>,
    approval: Option<Approval>,
}

/// A task row of format 3, or (with a format-2 state) of format 2.
#[derive(Serialize, Deserialize)]
pub struct TaskRowOld<S> {
    id: String,
    status: QueueStatus,
    priority: i64,
    budget: BudgetRowV1,
    state: S,
    next_span_id: u32,
    updated_at_ms: u64,
    lease: Option<Lease>,
    runs: u32,
    cancel_requested: Option<String>,
    settle: Option<Json>,
    approval_wait_ms: u64,
    suspended_at_ms: Option<u64>,
    approval: Option<Approval>,
}

/// A task row as stored.
pub fn encode_task(row: &TaskRow) -> std::result::Result<Vec<u8>, crate::store::Error> {
    crate::store::codec::encode_row_as(TASK_FORMAT, row)
}

/// A stored task row of format 6, or of an older format read as one: format 5 without a
/// conversation, format 4 also without a start time, format 3 also with the default replan
/// budget and no revisions, format 2 also without a last turn.
pub fn decode_task(what: &str, bytes: &[u8]) -> std::result::Result<TaskRow, crate::store::Error> {
    crate::store::codec::decode_row_versioned(what, bytes, TASK_FORMAT, |version, payload| {
        match version {
            5 => {
                return Ok(crate::store::codec::decode_payload::<TaskRowV5>(what, payload)?.into());
            }
            4 => {
                let o: TaskRowV4 = crate::store::codec::decode_payload(what, payload)?;
                return Ok(TaskRowV5::from(o).into());
            }
            _ => {}
        }
        let o: TaskRowOld<StateRowV3> = match version {
            3 => crate::store::codec::decode_payload(what, payload)?,
            2 => {
                let o: TaskRowOld<StateRowV2> = crate::store::codec::decode_payload(what, payload)?;
                TaskRowOld {
                    id: o.id,
                    status: o.status,
                    priority: o.priority,
                    budget: o.budget,
                    state: o.state.into(),
                    next_span_id: o.next_span_id,
                    updated_at_ms: o.updated_at_ms,
                    lease: o.lease,
                    runs: o.runs,
                    cancel_requested: o.cancel_requested,
                    settle: o.settle,
                    approval_wait_ms: o.approval_wait_ms,
                    suspended_at_ms: o.suspended_at_ms,
                    approval: o.approval,
                }
            }
            _ => {
                return Err(crate::store::Error::Corrupt(format!(
                    "{what} record: unknown record format {version}"
                )));
            }
        };
        Ok(TaskRow {
            id: o.id,
            status: o.status,
            priority: o.priority,
            budget: o.budget.into(),
            state: o.state.into(),
            next_span_id: o.next_span_id,
            updated_at_ms: o.updated_at_ms,
            lease: o.lease,
            runs: o.runs,
            cancel_requested: o.cancel_requested,
            settle: o.settle,
            approval_wait_ms: o.approval_wait_ms,
            suspended_at_ms: o.suspended_at_ms,
            approval: o.approval,
            not_before_ms: None,
        })
    })
}
