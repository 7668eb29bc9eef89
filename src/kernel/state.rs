//! The task state, stop reasons and the progress signature (the budget is `budget.rs`).
//!
//! `TaskState` carries every field of the design reference's TaskState. Time is whole
//! milliseconds of active time (`elapsed_ms`, what the reference's `round(t + s, 3)` amounts to),
//! written to JSON as float seconds (`"elapsed": 10.0`) so a state reads the same as the
//! reference's. Two additions, omitted from JSON while empty: `outcome` (the final reply's, e.g.
//! `cannot_complete`) and `remembered` (memory notes selected for the task when it was created).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::fmt::{self, Write as _};

pub use super::json::hex_prefix;
use super::json::{self, Sink};

pub use super::budget::{BUDGET_FIELDS, Budget};

/// The design reference's rough 4-characters-per-token estimate; not a tokenizer.
pub fn est_tokens(len_chars: usize) -> u64 {
    (len_chars as u64).div_ceil(4)
}

/// How a run ended. A closed list: each reason implies a different next action.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// A final answer passed the plan check.
    Done,
    MaxSteps,
    MaxToolCalls,
    MaxTokens,
    Deadline,
    /// The same (tool, args) was proposed more than `repeat_max` times.
    RepeatedCall,
    /// `stalls_max` consecutive steps left the progress signature unchanged.
    NoProgress,
    /// A call is held for a person's decision; the task is suspended, not stopped.
    NeedsApproval,
    /// A write may or may not have happened; reconcile before any retry.
    UnknownOutcome,
    /// An operator stopped the task.
    Cancelled,
    /// The task waited for an approval longer than its approval wait allows.
    ApprovalExpired,
    /// The model could not be used: its provider refused the request as configured (an API
    /// key, a model name, a request longer than its context window), or every step that made
    /// no progress failed at the model. Fix the model profile, then enqueue again.
    ModelFailed,
    /// The task was not started before its queue time-to-live ran out (`--ttl`).
    Expired,
    /// Its wall-clock deadline (`--finish-within`) passed before it finished.
    TimedOut,
    /// The model asked a person a question (`ask_person`); the task is suspended until
    /// someone answers it. (Appended: stored states number the variants in this order.)
    NeedsAnswer,
    /// The task waited for an answer to its question longer than its wait allows.
    QuestionExpired,
}

pub const STOP_REASONS: [StopReason; 16] = [
    StopReason::Done,
    StopReason::MaxSteps,
    StopReason::MaxToolCalls,
    StopReason::MaxTokens,
    StopReason::Deadline,
    StopReason::RepeatedCall,
    StopReason::NoProgress,
    StopReason::NeedsApproval,
    StopReason::UnknownOutcome,
    StopReason::Cancelled,
    StopReason::ApprovalExpired,
    StopReason::ModelFailed,
    StopReason::Expired,
    StopReason::TimedOut,
    StopReason::NeedsAnswer,
    StopReason::QuestionExpired,
];

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Done => "done",
            StopReason::MaxSteps => "max_steps",
            StopReason::MaxToolCalls => "max_tool_calls",
            StopReason::MaxTokens => "max_tokens",
            StopReason::Deadline => "deadline",
            StopReason::RepeatedCall => "repeated_call",
            StopReason::NoProgress => "no_progress",
            StopReason::NeedsApproval => "needs_approval",
            StopReason::UnknownOutcome => "unknown_outcome",
            StopReason::Cancelled => "cancelled",
            StopReason::ApprovalExpired => "approval_expired",
            StopReason::ModelFailed => "model_failed",
            StopReason::Expired => "expired",
            StopReason::TimedOut => "timed_out",
            StopReason::NeedsAnswer => "needs_answer",
            StopReason::QuestionExpired => "question_expired",
        }
    }

    pub fn parse(s: &str) -> Option<StopReason> {
        STOP_REASONS.into_iter().find(|r| r.as_str() == s)
    }

    /// A suspended task can continue, once a person decided or answered; a stopped one cannot.
    pub fn suspends(self) -> bool {
        matches!(self, StopReason::NeedsApproval | StopReason::NeedsAnswer)
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Running,
    Suspended,
    Stopped,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Running => "running",
            Status::Suspended => "suspended",
            Status::Stopped => "stopped",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepStatus {
    Pending,
    Done,
    Failed,
}

impl StepStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            StepStatus::Pending => "pending",
            StepStatus::Done => "done",
            StepStatus::Failed => "failed",
        }
    }
}

/// One step of an accepted plan. Keys the model sent beyond these are dropped.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanStep {
    pub id: String,
    pub tool: String,
    pub depends_on: Vec<String>,
    pub status: StepStatus,
}

/// A tool call as the model proposed it; stored in `pending` while it is held.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename = "tool")]
pub struct ToolCall {
    pub name: String,
    pub args: Map<String, Value>,
    pub plan_step: Option<String>,
}

impl ToolCall {
    /// The call key: one key per logical write, `task_id:plan_step` or `task_id:adhoc<step>`.
    pub fn key(&self, task_id: &str, step: u32) -> String {
        self.key_in("", task_id, step)
    }

    /// The call key under a namespace (a database id): `namespace:task_id:plan_step`.
    pub fn key_in(&self, namespace: &str, task_id: &str, step: u32) -> String {
        let mut key = String::with_capacity(namespace.len() + task_id.len() + 24);
        if !namespace.is_empty() {
            key.push_str(namespace);
            key.push(':');
        }
        key.push_str(task_id);
        key.push(':');
        match &self.plan_step {
            Some(p) if !p.is_empty() => key.push_str(p),
            _ => {
                let _ = write!(key, "adhoc{step}");
            }
        }
        key
    }

    /// The design reference's fingerprint of (tool, args): first 10 hex digits of the SHA-256 of
    /// `json.dumps([name, args], sort_keys=True)`. Approvals bind to it.
    pub fn digest(&self) -> String {
        digest(&self.name, &self.args)
    }
}

pub fn digest(name: &str, args: &Map<String, Value>) -> String {
    hex_prefix(call_sha256(name, args).as_ref(), 10)
}

/// The whole SHA-256 of `json.dumps([name, args], sort_keys=True)`, in hex: what a signed
/// approval covers (the 10-digit digest is for people to compare; 40 bits are too few to sign).
pub fn call_hash(name: &str, args: &Map<String, Value>) -> String {
    hex_prefix(call_sha256(name, args).as_ref(), 64)
}

fn call_sha256(name: &str, args: &Map<String, Value>) -> impl AsRef<[u8]> {
    // Written straight into the hash: the text is never built.
    let mut h = json::Hashing(Sha256::new());
    h.put("[");
    json::write_str(&mut h, name);
    h.put(", ");
    json::write_map(&mut h, args);
    h.put("]");
    h.0.finalize()
}

/// The model's last reply in its provider's protocol (see [`super::io::Turn`]) and what came of
/// each of its calls: the first call is the move the kernel took, any others were not run.
/// The next request shows the model this, and nothing older: the input stays bounded.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LastTurn {
    /// The step the reply was for.
    pub step: u32,
    pub turn: super::io::Turn,
    /// One result per call, in order, once the step has an answer for them.
    #[serde(default)]
    pub results: Vec<Value>,
}

/// The design reference's TaskState.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TaskState {
    pub task_id: String,
    /// Set by the application, never by the model.
    pub user_id: String,
    pub goal: String,
    #[serde(default)]
    pub plan: Vec<PlanStep>,
    /// Validated values copied out of tool results by allow-list.
    #[serde(default)]
    pub facts: Map<String, Value>,
    #[serde(default)]
    pub last_result: Option<Value>,
    #[serde(default)]
    pub step: u32,
    #[serde(default)]
    pub tool_calls: u32,
    #[serde(default)]
    pub tokens: u64,
    #[serde(
        rename = "elapsed",
        default,
        serialize_with = "ser_secs",
        deserialize_with = "de_secs"
    )]
    pub elapsed_ms: u64,
    /// Call fingerprint -> times proposed.
    #[serde(default)]
    pub seen: BTreeMap<String, u32>,
    #[serde(default)]
    pub stalls: u32,
    pub status: Status,
    #[serde(default)]
    pub stop: Option<StopReason>,
    #[serde(default)]
    pub answer: Option<String>,
    /// A call held for approval, or a write whose outcome is unknown.
    #[serde(default)]
    pub pending: Option<ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub remembered: Vec<String>,
    /// The stop the task had when something else ended it (an operator's cancel, a time
    /// limit): with `unknown_outcome`, `pending` is a write whose outcome is still unknown and
    /// must be reconciled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancelled_from: Option<StopReason>,
    /// The model's last reply and its calls' results, when its adapter speaks a protocol of
    /// function calls (never for the design reference's models, so their state reads as the
    /// document's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_turn: Option<LastTurn>,
    /// Times the accepted plan was revised (counted against `replans_max`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub replans: u32,
    /// Writes (tool names) that were refused or failed and have not succeeded since: they
    /// keep a worker's task from ending `completed`, with a plan or without.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub failed_writes: Vec<String>,
    /// Ids of failed steps a revision dropped: their call keys are spent, so no later step
    /// may take the id again.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spent_steps: Vec<String>,
    /// The conversation after the goal, once a person sent a follow-up message: the agent's
    /// answers and the person's messages, in turn (see [`super::conversation`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conversation: Vec<super::conversation::Message>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

fn ser_secs<S: Serializer>(ms: &u64, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(ms_to_secs(*ms))
}

fn de_secs<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    let secs = f64::deserialize(d)?;
    if !secs.is_finite() || secs < 0.0 {
        return Err(serde::de::Error::custom(format!(
            "elapsed must be a non-negative number of seconds, got {secs}"
        )));
    }
    Ok(secs_to_ms(secs))
}

pub fn ms_to_secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

/// Seconds to whole milliseconds, the design reference's `round(x, 3)`.
pub fn secs_to_ms(secs: f64) -> u64 {
    if secs.is_finite() && secs > 0.0 {
        (secs * 1000.0).round() as u64
    } else {
        0
    }
}

impl TaskState {
    pub fn new(task_id: &str, user_id: &str, goal: &str) -> TaskState {
        TaskState {
            task_id: task_id.to_string(),
            user_id: user_id.to_string(),
            goal: goal.to_string(),
            plan: Vec::new(),
            facts: Map::new(),
            last_result: None,
            step: 0,
            tool_calls: 0,
            tokens: 0,
            elapsed_ms: 0,
            seen: BTreeMap::new(),
            stalls: 0,
            status: Status::Running,
            stop: None,
            answer: None,
            pending: None,
            outcome: None,
            remembered: Vec::new(),
            cancelled_from: None,
            last_turn: None,
            replans: 0,
            failed_writes: Vec::new(),
            spent_steps: Vec::new(),
            conversation: Vec::new(),
        }
    }

    /// `json.dumps(asdict(state), sort_keys=True)`.
    pub fn to_json(&self) -> String {
        match serde_json::to_value(self) {
            Ok(v) => json::dumps(&v),
            // Every field serializes to JSON; a failure here is a programming error.
            Err(e) => unreachable!("TaskState serializes: {e}"),
        }
    }

    pub fn from_json(text: &str) -> Result<TaskState, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// Hash of what counts as progress, facts and plan statuses: the reference's `signature`.
    pub fn signature(&self) -> String {
        let mut text = String::with_capacity(128);
        self.progress_text(&mut text);
        hex_prefix(&Sha256::digest(text.as_bytes()), 12)
    }

    /// The text [`TaskState::signature`] hashes, into `out` (cleared first). Equal texts, same
    /// progress: a session compares them instead of hashing each step.
    pub fn progress_text(&self, out: &mut String) {
        out.clear();
        out.push_str("{\"facts\": ");
        json::write_map(out, &self.facts);
        self.progress_plan(out);
    }

    /// The rest of [`TaskState::progress_text`] after the facts' JSON text.
    pub fn progress_plan(&self, out: &mut String) {
        out.push_str(", \"plan\": [");
        for (i, s) in self.plan.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            out.push('[');
            json::write_str(out, &s.id);
            out.push_str(", ");
            json::write_str(out, s.status.as_str());
            out.push(']');
        }
        out.push_str("]}");
    }

    /// The held write whose outcome is unknown, if any: the held call of an `unknown_outcome`
    /// stop, also after an operator cancelled the task.
    pub fn unknown_write(&self) -> Option<&ToolCall> {
        let held = self.stop == Some(StopReason::UnknownOutcome)
            || self.cancelled_from == Some(StopReason::UnknownOutcome);
        self.pending.as_ref().filter(|_| held)
    }

    /// Holds `call`, a write a crashed run may have sent (its intent has no result), as a
    /// write of unknown outcome while something else ends the task: it stays listed for
    /// reconcile whatever the task's stop. The call counts as made.
    pub fn hold_in_flight(&mut self, call: ToolCall) {
        self.pending = Some(call);
        self.cancelled_from = Some(StopReason::UnknownOutcome);
        self.tool_calls = self.tool_calls.saturating_add(1);
        self.last_result = Some(
            serde_json::json!({"status": "unknown", "code": "interrupted",
            "detail": "the worker stopped while this write was in flight; reconcile it"}),
        );
    }

    pub fn open_steps(&self) -> Vec<String> {
        self.plan
            .iter()
            .filter(|s| s.status == StepStatus::Pending)
            .map(|s| s.id.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn state_json_round_trips() {
        let mut st = TaskState::new("t1", "cu_ana", "refund ü");
        st.elapsed_ms = 11_200;
        st.facts.insert("ord_1.total_cents".into(), json!(4200));
        st.plan.push(PlanStep {
            id: "s1".into(),
            tool: "get_order".into(),
            depends_on: vec![],
            status: StepStatus::Done,
        });
        st.pending = Some(ToolCall {
            name: "issue_refund".into(),
            args: json!({"order_id": "ord_1004", "amount_cents": 8000})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            plan_step: Some("s2".into()),
        });
        let text = st.to_json();
        assert!(text.contains("\"elapsed\": 11.2"), "{text}");
        assert!(text.contains("\"type\": \"tool\""), "{text}");
        assert!(text.contains("refund \\u00fc"), "{text}");
        let back = TaskState::from_json(&text).expect("parses");
        assert_eq!(back, st);
        assert_eq!(back.to_json(), text);
    }

    #[test]
    fn fresh_state_json_equals_python() {
        // json.dumps(asdict(TaskState("t1", "cu_ana", "g")), sort_keys=True) in the reference.
        let want = r#"{"answer": null, "elapsed": 0.0, "facts": {}, "goal": "g", "last_result": null, "pending": null, "plan": [], "seen": {}, "stalls": 0, "status": "running", "step": 0, "stop": null, "task_id": "t1", "tokens": 0, "tool_calls": 0, "user_id": "cu_ana"}"#;
        assert_eq!(TaskState::new("t1", "cu_ana", "g").to_json(), want);
    }

    #[test]
    fn signature_and_digest_equal_python() {
        // Python: TaskState("t1","u","g").signature() and Tools.digest("get_order", {"order_id": "ord_9999"}).
        assert_eq!(TaskState::new("t1", "u", "g").signature(), "bba42167e749");
        let args = json!({"order_id": "ord_9999"})
            .as_object()
            .cloned()
            .unwrap_or_default();
        assert_eq!(digest("get_order", &args), "d40389f1eb");
    }

    #[test]
    fn every_budget_field_is_read_and_set_by_its_name() {
        let mut b = Budget::default();
        for (i, name) in BUDGET_FIELDS.iter().enumerate() {
            b.set(name, &(100 + i).to_string()).expect("settable");
            assert_eq!(b.get(name), Some(100 + i as u64), "{name}");
        }
        assert_eq!(b.get("plan_steps"), None);
    }

    #[test]
    fn budget_set_names_the_problem() {
        let mut b = Budget::default();
        b.set("steps_max", "3").expect("valid");
        assert_eq!(b.steps_max, 3);
        assert!(
            b.set("max_steps", "3")
                .unwrap_err()
                .contains("unknown budget")
        );
        assert!(
            b.set("steps_max", "x")
                .unwrap_err()
                .contains("not a whole number")
        );
        assert!(
            b.set("steps_max", "99999999999")
                .unwrap_err()
                .contains("too large")
        );
    }
}
