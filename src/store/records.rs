//! The records the worker database stores and the data its transactions take: a task's
//! queue status, lease and record, a new task, a write's call record, and a worker's commit.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

use crate::kernel::memory::{Note, select};
use crate::kernel::{Budget, Span, StopReason, TaskState};
use crate::model::{ModelProfile, RecordedReply};

/// Where a task is in the queue. `TaskState::status` says how the agent loop stands; this says
/// what the worker does with the task next.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueStatus {
    /// Waiting in the ready queue.
    Queued,
    /// Leased by a worker.
    Running,
    /// Waiting on a person: an approval (needs_approval) or an answer (needs_answer).
    Suspended,
    /// A write's outcome is unknown: waiting for reconcile.
    Held,
    /// Ended with a stop reason; nothing more will run.
    Finished,
}

impl QueueStatus {
    /// Neither queued nor running: the task finished, or waits on a person. What a task
    /// shows of its end (stop, outcome, answer, cause) is shown only then.
    pub fn is_settled(self) -> bool {
        !matches!(self, QueueStatus::Queued | QueueStatus::Running)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            QueueStatus::Queued => "queued",
            QueueStatus::Running => "running",
            QueueStatus::Suspended => "suspended",
            QueueStatus::Held => "held",
            QueueStatus::Finished => "finished",
        }
    }

    /// Every status, in a task's life order.
    pub const ALL: [QueueStatus; 5] = [
        QueueStatus::Queued,
        QueueStatus::Running,
        QueueStatus::Suspended,
        QueueStatus::Held,
        QueueStatus::Finished,
    ];

    pub fn parse(s: &str) -> Option<QueueStatus> {
        QueueStatus::ALL.into_iter().find(|q| q.as_str() == s)
    }

    /// The queue status a run's end leads to.
    pub fn after(stop: StopReason) -> QueueStatus {
        match stop {
            StopReason::NeedsApproval | StopReason::NeedsAnswer => QueueStatus::Suspended,
            StopReason::UnknownOutcome => QueueStatus::Held,
            _ => QueueStatus::Finished,
        }
    }
}

/// A worker's claim on a task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lease {
    /// `host:pid:start` of the worker process.
    pub owner: String,
    pub host: String,
    pub pid: u32,
    /// Start time of the process in clock ticks since boot, so a reused pid is not taken
    /// for the original process.
    pub start_ticks: u64,
    pub expires_at_ms: u64,
    /// The fencing token of this claim: the task's claim count when it was taken. Every
    /// commit carries it and is applied only while it is the task's current token, so a
    /// superseded claim (a paused process, a stale thread) can never commit.
    #[serde(default)]
    pub token: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: String,
    pub status: QueueStatus,
    pub priority: i64,
    pub key: Option<String>,
    pub budget: Budget,
    pub model: ModelProfile,
    /// Latency overrides of the demo store's tools for this task (simulated milliseconds).
    #[serde(default)]
    pub tool_latency_ms: BTreeMap<String, u64>,
    /// The task's tool catalog (from the config file); `None` for the demo shop. Shared: the
    /// tasks of one catalog read from the database hold one copy ([`super::rows::shared_catalog`]).
    #[serde(default)]
    pub catalog: Option<std::sync::Arc<crate::kernel::Catalog>>,
    /// The demo store tenant this task's orders belong to (empty: the shared book).
    #[serde(default)]
    pub store_scope: String,
    pub state: TaskState,
    pub next_span_id: u32,
    pub created_at_ms: u64,
    pub updated_at_ms: u64,
    #[serde(default)]
    pub lease: Option<Lease>,
    /// How many times a worker claimed it; also the fencing token of the current claim.
    #[serde(default)]
    pub runs: u32,
    /// An operator asked to cancel; the running worker stops at its next step boundary.
    #[serde(default)]
    pub cancel_requested: Option<String>,
    /// An operator's settlement of the held call (rejected, or applied with this result), to be
    /// folded in as that call's result when the task next runs.
    #[serde(default)]
    pub settle: Option<Value>,
    /// How long a suspended task may wait for an approval (its own limit, separate from the
    /// active-time deadline).
    #[serde(default = "default_approval_wait_ms")]
    pub approval_wait_ms: u64,
    #[serde(default)]
    pub suspended_at_ms: Option<u64>,
    /// The approval this task runs under. It lives here only; the re-sent call carries it.
    #[serde(default)]
    pub approval: Option<Approval>,
    /// The namespace of this task's call keys (`NS:task:step`): the database id and 48 random
    /// bits made at enqueue, so that a task made after a backup was restored (or in a copy of
    /// the file) never reuses the keys of a task the tool services saw from the lost
    /// timeline. `None`: a task from before, whose keys use the database id alone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_ns: Option<String>,
    /// The budget the enqueue asked for (an operator's `--extend` changes `budget`, never
    /// this): what a retried enqueue under the same key is compared with. `None`: a task from
    /// before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enqueued_budget: Option<Budget>,
    /// The task's own agent instructions (`enqueue --instructions`), after the profile's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instructions: Option<String>,
    /// Where its result is POSTed when it settles (a completion callback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callback_url: Option<String>,
    /// Who created it through the HTTP API (a `submit` token's name): such a caller reads
    /// only its own tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submitted_by: Option<String>,
    /// Not claimed before this time (ms since the epoch): a delayed start, or a task that
    /// gave its thread back until its model has capacity again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before_ms: Option<u64>,
    /// The key whose concurrency limit (in the daemon's config) bounds how many of its tasks
    /// run at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency_key: Option<String>,
    /// When it expires unless started, and when it must have finished (wall clock).
    #[serde(default)]
    pub time_limits: TimeLimits,
}

/// A caller's time limits of a task, fixed at enqueue (ms since the epoch). Stored in binary
/// rows too, so every field is always written (no `skip_serializing_if`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimeLimits {
    /// Not started by then (its queue time to live ran out): it stops with `expired`.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    /// Not finished by then (its wall-clock deadline): it stops with `timed_out` at the next
    /// step boundary, or when it is next picked up.
    #[serde(default)]
    pub deadline_at_ms: Option<u64>,
}

impl TimeLimits {
    /// The stop reason a run that is `started` (it took a step before) meets at `now_ms`.
    pub fn passed(&self, started: bool, now_ms: u64) -> Option<crate::kernel::StopReason> {
        use crate::kernel::StopReason;
        if !started && self.expires_at_ms.is_some_and(|t| t <= now_ms) {
            Some(StopReason::Expired)
        } else if self.deadline_at_ms.is_some_and(|t| t <= now_ms) {
            Some(StopReason::TimedOut)
        } else {
            None
        }
    }
}

impl TaskRecord {
    /// Whether the task waits for its start time (queued, not yet due at `now_ms`).
    pub fn is_scheduled(&self, now_ms: u64) -> bool {
        self.status == QueueStatus::Queued && self.not_before_ms.is_some_and(|t| t > now_ms)
    }

    /// The namespace of this task's call keys, in the database whose id is `db_id`.
    pub fn key_namespace<'a>(&'a self, db_id: &'a str) -> &'a str {
        self.key_ns.as_deref().unwrap_or(db_id)
    }

    /// Whether the task's write is held (and so listed by `worker reconcile`): held, or
    /// cancelled while held, until it is settled.
    pub fn is_held(&self) -> bool {
        matches!(self.status, QueueStatus::Held | QueueStatus::Finished)
            && self.state.unknown_write().is_some()
    }

    /// Why the task cannot take a follow-up message at `now_ms` (`worker say`), if it cannot:
    /// the state's reasons, and the record's (not finished, past its deadline, or a turn
    /// after the first of a task whose enqueued budget an older release did not keep).
    pub fn why_no_message(&self, now_ms: u64) -> Option<String> {
        if let Some(why) = self.state.why_not_continued() {
            return Some(why);
        }
        if self.status != QueueStatus::Finished {
            return Some(format!("it is {}", self.status.as_str()));
        }
        if self.time_limits.deadline_at_ms.is_some_and(|t| t <= now_ms) {
            return Some("its deadline (--finish-within) has passed; enqueue a new task".into());
        }
        if self.enqueued_budget.is_none() && self.state.turn() > 1 {
            return Some(
                "an older release enqueued it without keeping the budget each turn gets; enqueue a new task"
                    .into(),
            );
        }
        None
    }

    /// The call key of `call` made at this task's current step.
    pub fn call_key(&self, db_id: &str, call: &crate::kernel::ToolCall) -> String {
        call.key_in(
            self.key_namespace(db_id),
            &self.state.key_scope(),
            self.state.step,
        )
    }
}

impl TaskRecord {
    /// The write an earlier run of this task may have sent and whose outcome no run learned:
    /// among `calls` (the task's call records), one whose intent has no result, of the step in
    /// progress (or of the held call being sent again). Such a write stays held for reconcile
    /// whatever ends the task (see [`crate::kernel::TaskState::hold_in_flight`]).
    pub fn in_flight(&self, db_id: &str, calls: &[CallRecord]) -> Option<crate::kernel::ToolCall> {
        let c = calls
            .iter()
            .filter(|c| c.result.is_none() && c.step >= self.state.step)
            .max_by_key(|c| c.step)?;
        if let Some(p) = self.state.pending.as_ref()
            && self.call_key(db_id, p) == c.key
        {
            return Some(p.clone());
        }
        Some(c.as_call(self.key_namespace(db_id), &self.state.key_scope()))
    }
}

impl CallRecord {
    /// The call this record is of, made in the turn whose keys are under `scope` (see
    /// [`crate::kernel::TaskState::key_scope`]). Its plan step is the key's last part, so that
    /// the call's key in the namespace `ns` is this record's key again, whatever the task's step.
    pub fn as_call(&self, ns: &str, scope: &str) -> crate::kernel::ToolCall {
        let prefix = format!("{ns}:{scope}:");
        let plan_step = self
            .key
            .strip_prefix(prefix.as_str())
            .filter(|p| !p.is_empty())
            .map(str::to_string);
        crate::kernel::ToolCall {
            name: self.tool.clone(),
            args: self.args.clone(),
            plan_step,
        }
    }
}

impl Commit {
    /// Whether this commit ends the run with a write held for reconcile: an `unknown_outcome`
    /// stop, or another stop over a write whose outcome is unknown.
    pub fn holds(&self) -> bool {
        matches!(self.kind, CommitKind::Final(_)) && self.state.unknown_write().is_some()
    }
}

/// A new task's key namespace in the database `db_id`: the id and 48 random bits.
pub(crate) fn new_key_ns(db_id: &str) -> String {
    format!("{db_id}-{:012x}", random_u64() & ((1 << 48) - 1))
}

/// An operator's approval of exactly one held call: its call key and digest, who and when.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Approval {
    pub key: String,
    pub digest: String,
    pub by: String,
    pub at_ms: u64,
}

impl Approval {
    /// The approved digest, if this approval covers the call under `key` with `digest`.
    pub fn covering(&self, key: &str, digest: &str) -> Option<&str> {
        (self.key == key && self.digest == digest).then_some(self.digest.as_str())
    }
}

pub const DEFAULT_APPROVAL_WAIT_MS: u64 = 24 * 3600 * 1000;

fn default_approval_wait_ms() -> u64 {
    DEFAULT_APPROVAL_WAIT_MS
}

/// A task to enqueue (also what `worker enqueue` sends a running daemon over its local
/// socket, as JSON).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NewTask {
    pub user: String,
    pub goal: String,
    pub key: Option<String>,
    pub priority: i64,
    pub budget: Budget,
    pub model: ModelProfile,
    pub tool_latency_ms: BTreeMap<String, u64>,
    pub catalog: Option<crate::kernel::Catalog>,
    pub store_scope: String,
    pub approval_wait_ms: u64,
    /// The task's own agent instructions (see [`TaskRecord::instructions`]).
    pub instructions: Option<String>,
    /// See [`TaskRecord::callback_url`].
    pub callback_url: Option<String>,
    /// See [`TaskRecord::submitted_by`].
    pub submitted_by: Option<String>,
    /// See [`TaskRecord::not_before_ms`].
    pub not_before_ms: Option<u64>,
    /// See [`TaskRecord::concurrency_key`].
    pub concurrency_key: Option<String>,
    /// See [`TaskRecord::time_limits`].
    pub time_limits: TimeLimits,
}

impl NewTask {
    /// A task of `user` toward `goal` on `model`, with the default budget and nothing else:
    /// no key, no catalog (the demo shop's tools), no time limits.
    pub fn of(user: &str, goal: &str, model: ModelProfile) -> NewTask {
        NewTask {
            user: user.to_string(),
            goal: goal.to_string(),
            key: None,
            priority: 0,
            budget: Budget::default(),
            model,
            tool_latency_ms: BTreeMap::new(),
            catalog: None,
            store_scope: String::new(),
            approval_wait_ms: super::DEFAULT_APPROVAL_WAIT_MS,
            instructions: None,
            callback_url: None,
            submitted_by: None,
            not_before_ms: None,
            concurrency_key: None,
            time_limits: TimeLimits::default(),
        }
    }
}

/// A write's call key record: committed as an intent before the tool is called, then completed
/// with the result in the same transaction as the step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    pub key: String,
    pub task_id: String,
    pub step: u32,
    pub tool: String,
    pub args: Map<String, Value>,
    /// The design reference's digest of tool name and args.
    pub digest: String,
    pub intent_at_ms: u64,
    /// None while the write is in flight (or its outcome was never learned).
    pub result: Option<Value>,
    pub result_at_ms: Option<u64>,
}

/// The data of one commit by a worker; see [`Store::apply_commit`].
#[derive(Clone, Debug)]
pub struct Commit {
    pub task_id: String,
    /// The fencing token of the claim this commit belongs to.
    pub token: u64,
    pub kind: CommitKind,
    pub state: TaskState,
    pub next_span_id: u32,
    pub spans: Vec<Span>,
    pub reply: Option<RecordedReply>,
    pub call: Option<CallRecord>,
    pub now_ms: u64,
    pub lease_ms: u64,
    /// The task's settlement was folded into `state`: forget it.
    pub clear_settle: bool,
    /// With a final commit: claim the next ready task for the same thread, in the same
    /// transaction (a thread that finishes a task is free at once, so the claim starts
    /// running at once, and one transaction serves both).
    pub claim_next: Option<Lease>,
    /// The daemon exports spans live: queue the spans this commit ends in the outbox, in the
    /// same transaction.
    pub export: bool,
    /// With a final commit of a task that names a callback URL: the callback its settling
    /// makes, queued in the same transaction.
    pub callback: Option<super::Callback>,
    /// With a release: the task is not claimed again before this time (it waits for its
    /// model's capacity); `None` keeps its start time as it was.
    pub not_before_ms: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CommitKind {
    /// A write's intent (and the step's reply), before the tool is called.
    Intent,
    /// A step ended; the run goes on. Renews the lease.
    Step,
    /// The run ended with this stop reason.
    Final(StopReason),
    /// The worker is shutting down: the task goes back to the queue as committed.
    Release,
}

/// What a commit learned: an operator may have asked to cancel meanwhile.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CommitOutcome {
    pub cancel_requested: Option<String>,
    /// The task claimed with `Commit::claim_next`, if one was ready.
    pub next: Option<TaskRecord>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Enqueued {
    pub id: String,
    pub created: bool,
}

/// A new task's record in the database `db_id`, queued, with the notes of its user that its
/// goal recalls.
pub(crate) fn new_record(
    db_id: &str,
    id: &str,
    t: &NewTask,
    notes: &[Note],
    now_ms: u64,
) -> TaskRecord {
    let mut state = TaskState::new(id, &t.user, &t.goal);
    state.remembered = select(notes, &t.user, &t.goal, now_ms / 1000, 3)
        .into_iter()
        .map(|n| n.text.clone())
        .collect();
    TaskRecord {
        id: id.to_string(),
        status: QueueStatus::Queued,
        priority: t.priority,
        key: t.key.clone(),
        budget: t.budget,
        model: t.model.clone(),
        tool_latency_ms: t.tool_latency_ms.clone(),
        store_scope: t.store_scope.clone(),
        catalog: t.catalog.clone().map(std::sync::Arc::new),
        state,
        next_span_id: 0,
        created_at_ms: now_ms,
        updated_at_ms: now_ms,
        lease: None,
        runs: 0,
        cancel_requested: None,
        settle: None,
        approval_wait_ms: t.approval_wait_ms,
        suspended_at_ms: None,
        approval: None,
        key_ns: Some(new_key_ns(db_id)),
        enqueued_budget: Some(t.budget),
        instructions: t.instructions.clone(),
        callback_url: t.callback_url.clone(),
        submitted_by: t.submitted_by.clone(),
        not_before_ms: t.not_before_ms,
        concurrency_key: t.concurrency_key.clone(),
        time_limits: t.time_limits,
    }
}

/// A retried enqueue under key `key`, which made task `rec`: the same request is answered
/// with that task; another request under a used key is a mistake that would otherwise vanish
/// silently, refused with the first field that differs.
pub(crate) fn same_request(rec: &TaskRecord, t: &NewTask, key: &str) -> super::Result<()> {
    // Another submitter's task: nothing of it is told (not its id, nor which field differs,
    // which would let a caller test guesses of another's request field by field).
    if rec.submitted_by != t.submitted_by {
        return Err(super::Error::Conflict(format!(
            "enqueue key {key:?} is already used by another caller; use a key of your own"
        )));
    }
    match differs(rec, t) {
        None => Ok(()),
        Some(field) => Err(super::Error::Conflict(format!(
            "enqueue key {key:?} was used for task {} with another {field}; a retry must repeat the same request (use a new key for a new task)",
            rec.id
        ))),
    }
}

/// The first field in which a new request differs from the task its key already made.
fn differs(rec: &TaskRecord, t: &NewTask) -> Option<&'static str> {
    if rec.state.user_id != t.user {
        Some("user")
    } else if rec.state.goal != t.goal {
        Some("goal")
    } else if rec.model != t.model {
        Some("model")
    } else if rec.enqueued_budget.unwrap_or(rec.budget) != t.budget {
        // The request's budget, not the task's: an operator may have extended it since.
        Some("budget")
    } else if rec.priority != t.priority {
        Some("priority")
    } else if rec.concurrency_key != t.concurrency_key {
        Some("concurrency key")
    } else if rec.instructions != t.instructions {
        Some("instructions")
    } else if rec.catalog.as_deref() != t.catalog.as_ref() {
        Some("tool catalog")
    } else if rec.store_scope != t.store_scope || rec.tool_latency_ms != t.tool_latency_ms {
        Some("tool settings")
    } else if rec.callback_url != t.callback_url {
        Some("callback URL")
    } else if rec.approval_wait_ms != t.approval_wait_ms {
        // Time limits are not compared: `--ttl 1h` retried a minute later is the same request.
        Some("approval wait")
    } else {
        None
    }
}

/// Sort key of a task id: ids are t1, t2, ..., so t2 comes before t10.
pub(crate) fn task_order(id: &str) -> (u64, String) {
    let n = id.trim_start_matches('t').parse().unwrap_or(u64::MAX);
    (n, id.to_string())
}

/// The task's remaining active time. A lease covers it on top of the lease length: one model
/// or tool call can take up to all of it, and the lease must not run out under a worker that
/// is only waiting. Fencing makes a lease that runs out anyway harmless: the old claim can no
/// longer commit.
pub(crate) fn remaining_ms(budget: &Budget, elapsed_ms: u64) -> u64 {
    budget.deadline_ms.saturating_sub(elapsed_ms)
}

/// A note the memory policy admits (trusted source, non-empty), within its limits; the same
/// check on both backends.
pub(crate) fn admit_note(
    user: &str,
    text: &str,
    source: &str,
    ttl_s: u64,
    d: &super::Decision,
) -> super::Result<Note> {
    let note = crate::kernel::memory::admit(user, text, source, d.now_ms / 1000, ttl_s)
        .map_err(|e| super::Error::Invalid(e.to_string()))?;
    crate::limits::check_text(text, "the note", crate::limits::NOTE_BYTES_MAX)
        .map_err(|e| super::Error::Invalid(e.0))?;
    crate::limits::check_name(user, "--user").map_err(|e| super::Error::Invalid(e.0))?;
    Ok(note)
}

/// 64 random bits from the operating system, or (if it has none to give) from the standard
/// library's randomly seeded hasher mixed with the time and the process id.
pub fn random_u64() -> u64 {
    use std::io::Read;
    let mut b = [0u8; 8];
    if std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .is_ok()
    {
        return u64::from_le_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.write_u32(std::process::id());
    h.finish()
}
