//! Operator decisions, each one write transaction that checks the task's status, applies the
//! decision and records an audit event (who, what, when, why) together: approve, reject,
//! reconcile, cancel, and the expiry of approval waits. Memory notes are in `memory`.
//!
//! The decisions are written once, against [`DecisionTx`], a transaction of either backend:
//! redb's single writer or a PostgreSQL transaction that reads the task `FOR UPDATE`. Two
//! operators deciding the same task are serialized either way: the second finds the status
//! already changed and gets a `Conflict` naming what happened.

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::{CallRecord, Error, QueueStatus, Result, TaskRecord};
use crate::kernel::{Budget, Status, StopReason, ToolCall};

/// One line of the audit log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub seq: u64,
    pub at_ms: u64,
    pub task: Option<String>,
    pub verb: String,
    pub by: String,
    pub reason: Option<String>,
    pub detail: Value,
}

/// Who decides, why, and when.
#[derive(Clone, Debug)]
pub struct Decision {
    pub by: String,
    pub reason: Option<String>,
    pub now_ms: u64,
}

/// How an operator settles a held write.
#[derive(Clone, Debug, PartialEq)]
pub enum Settlement {
    /// The write took effect; `result` is what the service answered (or `{"status": "ok"}`).
    Applied(Value),
    /// The write did not take effect: the step runs again under the same call key.
    NotApplied,
}

fn not_in(rec: &TaskRecord, wanted: &str) -> Error {
    let stop = rec.state.stop.map_or(String::new(), |s| format!(" ({s})"));
    Error::Conflict(format!(
        "task {} is {}{stop}, not {wanted}; `worker events {}` shows what was decided",
        rec.id,
        rec.status.as_str(),
        rec.id
    ))
}

fn held_call(rec: &TaskRecord) -> Result<ToolCall> {
    rec.state
        .pending
        .clone()
        .ok_or_else(|| Error::Conflict(format!("task {} holds no call", rec.id)))
}

fn call_json(ns: &str, rec: &TaskRecord, call: &ToolCall) -> Value {
    json!({"tool": call.name, "args": call.args, "key": rec.call_key(ns, call), "digest": call.digest()})
}

fn approval_expired(rec: &TaskRecord, now_ms: u64) -> bool {
    rec.status == QueueStatus::Suspended
        && rec
            .suspended_at_ms
            .is_some_and(|t| now_ms >= t.saturating_add(rec.approval_wait_ms))
}

/// The held call an operator reviewed, as `worker show` printed it: its call key, its digest,
/// or both. A decision is applied only if it still names the call the task holds when the
/// decision's transaction runs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Reviewed {
    pub key: Option<String>,
    pub digest: Option<String>,
}

impl Reviewed {
    pub fn is_empty(&self) -> bool {
        self.key.is_none() && self.digest.is_none()
    }

    /// Refuses unless every given part equals the held call's.
    fn check(&self, id: &str, call: &ToolCall, key: &str) -> Result<()> {
        let digest = call.digest();
        let key_ok = self.key.as_deref().is_none_or(|k| k == key);
        let digest_ok = self.digest.as_deref().is_none_or(|d| d == digest);
        if key_ok && digest_ok {
            return Ok(());
        }
        Err(Error::Conflict(format!(
            "the decision does not match the held call: task {id} holds {} {} under key {key} with digest {digest}; the decision names {}",
            call.name,
            Value::Object(call.args.clone()),
            [
                self.key.as_ref().map(|k| format!("key {k}")),
                self.digest.as_ref().map(|d| format!("digest {d}")),
            ]
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .join(" and ")
        )))
    }
}

/// More budget an operator grants with a decision: each named limit grows by its amount.
/// Recorded in the decision's audit event.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Extension(pub Vec<(String, u64)>);

impl Extension {
    /// Parses `steps=2,deadline_ms=10000` (names as in `--budget`, or without `_max`).
    pub fn parse(text: &str) -> std::result::Result<Extension, String> {
        let mut out = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("--extend {part:?}: expected NAME=AMOUNT"))?;
            let name = name.trim();
            let full = if crate::kernel::state::BUDGET_FIELDS.contains(&name) {
                name.to_string()
            } else {
                format!("{name}_max")
            };
            if !crate::kernel::state::BUDGET_FIELDS.contains(&full.as_str()) {
                return Err(format!(
                    "--extend: unknown limit {name:?}; known: steps, tool_calls, tokens, deadline_ms, ..."
                ));
            }
            let amount: u64 = value
                .trim()
                .parse()
                .map_err(|_| format!("--extend {name}: {value:?} is not a whole number"))?;
            out.push((full, amount));
        }
        Ok(Extension(out))
    }

    /// The extension an audit event's `extend` detail records.
    pub fn from_json(v: &Value) -> Extension {
        Extension(
            v.as_object()
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, n)| n.as_u64().map(|n| (k.clone(), n)))
                        .collect()
                })
                .unwrap_or_default(),
        )
    }

    /// `b` as it was before this extension grew it (the replay starts from there).
    pub fn undo(&self, b: &mut Budget) {
        for (name, amount) in &self.0 {
            // A name this build does not know (a damaged event) undoes nothing.
            if let Some(now) = b.get(name) {
                let _ = b.set(name, &now.saturating_sub(*amount).to_string());
            }
        }
    }

    /// The budget with every limit grown (saturating: a limit never wraps around).
    pub fn apply(&self, b: &mut Budget) -> Result<()> {
        for (name, amount) in &self.0 {
            let now = b
                .get(name)
                .ok_or_else(|| Error::Invalid(format!("unknown budget limit {name:?}")))?;
            let grown = now.saturating_add(*amount);
            let text = match name.as_str() {
                "tokens_max" | "deadline_ms" => grown.to_string(),
                _ => grown.min(u64::from(u32::MAX)).to_string(),
            };
            b.set(name, &text).map_err(Error::Invalid)?;
        }
        Ok(())
    }

    fn to_json(&self) -> Value {
        Value::Object(
            self.0
                .iter()
                .map(|(k, v)| (k.clone(), Value::from(*v)))
                .collect(),
        )
    }
}

/// A decision that re-sends the held call promises a send: refuse it when the task's budget
/// would stop the re-sent call before it goes out, and say how to extend it.
fn check_can_send(rec: &TaskRecord, verb: &str) -> Result<()> {
    let (st, b) = (&rec.state, &rec.budget);
    // Every limit that would stop the re-send, named at once with the extension for each.
    let mut why = Vec::new();
    let mut extend = Vec::new();
    if st.tool_calls >= b.tool_calls_max {
        why.push(format!(
            "its tool calls are used up ({} / {})",
            st.tool_calls, b.tool_calls_max
        ));
        extend.push("tool_calls=1");
    }
    if st.elapsed_ms >= b.deadline_ms {
        why.push(format!(
            "its active time is used up ({} ms / {} ms)",
            st.elapsed_ms, b.deadline_ms
        ));
        extend.push("deadline_ms=10000");
    }
    if why.is_empty() {
        return Ok(());
    }
    Err(Error::Conflict(format!(
        "{verb} would re-send the held call of task {}, but {}; try --extend {}",
        rec.id,
        why.join(" and "),
        extend.join(",")
    )))
}

/// One transaction of a backend, as an operator decision sees it. Each backend implements
/// it over its own transaction; the decisions below are written once, against it, so both
/// backends check and apply every decision the same way.
pub trait DecisionTx {
    /// This database's id (a task's call keys are in its namespace: `TaskRecord::call_key`).
    fn db_id(&self) -> &str;
    /// The task `id`, read for update (a concurrent decision on it waits or is refused).
    fn load(&mut self, id: &str) -> Result<TaskRecord>;
    /// Writes the task. What it is indexed under follows from the record: queued tasks (new
    /// in the queue when `was` is not queued) in the ready queue, suspended ones by when their
    /// wait runs out, and a write with an unknown outcome (held, or cancelled while held) in
    /// the held list until it is settled.
    fn save(&mut self, rec: &TaskRecord, was: QueueStatus) -> Result<()>;
    /// Appends an audit event; returns its sequence number.
    fn event(&mut self, task: Option<&str>, verb: &str, d: &Decision, detail: Value)
    -> Result<u64>;
    /// The call record under `key`: `Some(Err)` when it exists but cannot be read.
    fn call(&mut self, key: &str) -> Result<Option<std::result::Result<CallRecord, String>>>;
    fn put_call(&mut self, c: &CallRecord) -> Result<()>;
    /// Queues the root span of task `id`, which this decision finished, for live export: in
    /// the decision's transaction, and only if a daemon ever exported from this database.
    fn queue_root(&mut self, id: &str) -> Result<()>;
}

/// A decision's result: `Err` of the inner result is an answer the transaction still commits
/// (an approval wait found expired is recorded, then refused).
pub type Decided<T> = Result<std::result::Result<T, Error>>;

fn requeue(tx: &mut dyn DecisionTx, rec: &mut TaskRecord, now_ms: u64) -> Result<()> {
    let was = rec.status;
    rec.status = QueueStatus::Queued;
    rec.updated_at_ms = now_ms;
    tx.save(rec, was)
}

fn finish(
    tx: &mut dyn DecisionTx,
    rec: &mut TaskRecord,
    stop: StopReason,
    now_ms: u64,
) -> Result<()> {
    let was = rec.status;
    rec.state.stop = Some(stop);
    rec.state.status = Status::Stopped;
    rec.status = QueueStatus::Finished;
    rec.updated_at_ms = now_ms;
    tx.save(rec, was)?;
    // The task's root span ends with it (live export; see `crate::otlp::root_of`).
    if was != QueueStatus::Finished {
        tx.queue_root(&rec.id)?;
    }
    Ok(())
}

/// Whether the task's write is listed by `held` (and so by `worker reconcile`): held, or
/// cancelled while held, until it is settled.
pub fn is_held(rec: &TaskRecord) -> bool {
    matches!(rec.status, QueueStatus::Held | QueueStatus::Finished)
        && rec.state.unknown_write().is_some()
}

/// Approves exactly the held call of a suspended task and requeues it; the held call then
/// runs under its original key, carrying the approval to the tool. The approval lives in the
/// task only, with its audit event, in one transaction. `reviewed` must name the held call
/// (its key or digest, from `worker show`); `extend` grants more budget first.
pub fn approve(
    tx: &mut dyn DecisionTx,
    id: &str,
    reviewed: &Reviewed,
    extend: &Extension,
    d: &Decision,
) -> Decided<ToolCall> {
    if reviewed.is_empty() {
        return Err(Error::Invalid(format!(
            "an approval must name the call it approves: pass --digest or --key as `worker show {id}` prints them"
        )));
    }
    let ns = tx.db_id().to_string();
    let mut rec = tx.load(id)?;
    if approval_expired(&rec, d.now_ms) {
        let call = held_call(&rec)?;
        let detail = call_json(&ns, &rec, &call);
        finish(tx, &mut rec, StopReason::ApprovalExpired, d.now_ms)?;
        tx.event(Some(id), "expire", &system(d.now_ms), detail)?;
        return Ok(Err(Error::Conflict(format!(
            "the approval wait of task {id} ran out ({} ms); the task stopped with approval_expired",
            rec.approval_wait_ms
        ))));
    }
    if rec.status != QueueStatus::Suspended || rec.state.stop != Some(StopReason::NeedsApproval) {
        return Err(not_in(&rec, "waiting for approval"));
    }
    let call = held_call(&rec)?;
    let key = rec.call_key(&ns, &call);
    reviewed.check(id, &call, &key)?;
    extend.apply(&mut rec.budget)?;
    check_can_send(&rec, "the approval")?;
    let digest = call.digest();
    rec.approval = Some(super::Approval {
        key,
        digest,
        by: d.by.clone(),
        at_ms: d.now_ms,
    });
    rec.suspended_at_ms = None;
    let mut detail = call_json(&ns, &rec, &call);
    if !extend.0.is_empty() {
        detail["extend"] = extend.to_json();
    }
    requeue(tx, &mut rec, d.now_ms)?;
    tx.event(Some(id), "approve", d, detail)?;
    Ok(Ok(call))
}

/// Rejects the held call: it is never sent; the task continues with a `rejected` result for
/// that step, under its budget. `reviewed`, when given, must name the held call.
pub fn reject(
    tx: &mut dyn DecisionTx,
    id: &str,
    reviewed: &Reviewed,
    d: &Decision,
) -> Decided<ToolCall> {
    let ns = tx.db_id().to_string();
    let mut rec = tx.load(id)?;
    if rec.status != QueueStatus::Suspended || rec.state.stop != Some(StopReason::NeedsApproval) {
        return Err(not_in(&rec, "waiting for approval"));
    }
    let call = held_call(&rec)?;
    reviewed.check(id, &call, &rec.call_key(&ns, &call))?;
    let result = json!({"status": "rejected", "code": "rejected",
        "detail": d.reason.clone().unwrap_or_else(|| "rejected by an operator".into())});
    rec.settle = Some(result.clone());
    rec.approval = None;
    rec.suspended_at_ms = None;
    let mut detail = call_json(&ns, &rec, &call);
    detail["result"] = result;
    requeue(tx, &mut rec, d.now_ms)?;
    tx.event(Some(id), "reject", d, detail)?;
    Ok(Ok(call))
}

/// Settles a held write. Applied: the result is folded in as the call's result. Not applied:
/// the call is sent again under the same call key (refused when the budget would stop it
/// before it goes out, unless `extend` grants more). A task cancelled while its write was held
/// is not requeued: the settlement is recorded and it leaves the held list.
pub fn reconcile(
    tx: &mut dyn DecisionTx,
    id: &str,
    s: &Settlement,
    reviewed: &Reviewed,
    extend: &Extension,
    d: &Decision,
) -> Decided<ToolCall> {
    let ns = tx.db_id().to_string();
    let mut rec = tx.load(id)?;
    let cancelled = rec.status == QueueStatus::Finished && rec.state.unknown_write().is_some();
    if rec.status != QueueStatus::Held && !cancelled {
        return Err(not_in(&rec, "held for reconcile"));
    }
    let call = held_call(&rec)?;
    let key = rec.call_key(&ns, &call);
    reviewed.check(id, &call, &key)?;
    let mut detail = call_json(&ns, &rec, &call);
    let (verb, recorded) = match s {
        Settlement::Applied(result) => {
            if !result.get("status").is_some_and(Value::is_string) {
                return Err(Error::Invalid(
                    "--result must be a JSON object with a string \"status\", e.g. {\"status\": \"ok\"}".into(),
                ));
            }
            // What an applied write returned cannot say it is still unknown, waits for an
            // approval, or was rejected: settled so, the task would hold it again.
            if let Some(st @ ("unknown" | "needs_approval" | "rejected")) =
                result["status"].as_str()
            {
                return Err(Error::Invalid(format!(
                    "an applied write's result cannot have status {st:?}: give what the write returned (status \"ok\" or \"error\"), or settle it as not applied"
                )));
            }
            ("reconcile_applied", result.clone())
        }
        Settlement::NotApplied => (
            "reconcile_not_applied",
            json!({"status": "not_applied", "by": d.by}),
        ),
    };
    if !cancelled {
        extend.apply(&mut rec.budget)?;
        if *s == Settlement::NotApplied {
            check_can_send(&rec, "--not-applied")?;
        }
        if let Settlement::Applied(result) = s {
            rec.settle = Some(result.clone());
        }
    }
    detail["result"] = recorded.clone();
    if !extend.0.is_empty() && !cancelled {
        detail["extend"] = extend.to_json();
    }
    if let Some(existing) = tx.call(&key)? {
        // A damaged record is replaced by one made from the held call: the operator's
        // settlement is what is known of it now.
        let mut c = existing.unwrap_or_else(|_| CallRecord {
            key: key.clone(),
            task_id: rec.id.clone(),
            step: rec.state.step,
            tool: call.name.clone(),
            args: call.args.clone(),
            digest: call.digest(),
            intent_at_ms: d.now_ms,
            result: None,
            result_at_ms: None,
        });
        c.result = Some(recorded.clone());
        c.result_at_ms = Some(d.now_ms);
        tx.put_call(&c)?;
    }
    if cancelled {
        // The task stays cancelled; the write is settled and leaves the held list.
        let applied_ok = matches!(s, Settlement::Applied(r) if r["status"] == "ok");
        if applied_ok
            && let Some(p) = call.plan_step.as_deref()
            && let Some(step) = rec.state.plan.iter_mut().find(|st| st.id == p)
        {
            step.status = crate::kernel::StepStatus::Done;
        }
        rec.state.pending = None;
        rec.state.cancelled_from = None;
        rec.state.last_result = Some(recorded);
        rec.updated_at_ms = d.now_ms;
        tx.save(&rec, rec.status)?;
    } else {
        requeue(tx, &mut rec, d.now_ms)?;
    }
    tx.event(Some(id), verb, d, detail)?;
    Ok(Ok(call))
}

/// Cancels a task: at once when it is queued, suspended or held; at the running worker's next
/// step boundary when it is running. A held write stays listed by `held` (and so by `worker
/// reconcile`) until it is settled: cancelling does not make its outcome known.
pub fn cancel(tx: &mut dyn DecisionTx, id: &str, d: &Decision) -> Decided<QueueStatus> {
    cancel_seen(tx, id, None, d)
}

/// [`cancel`], refused (nothing written) when `seen` is given and the task changed since: its
/// last change is no longer `seen` (the console's form carries it).
pub fn cancel_seen(
    tx: &mut dyn DecisionTx,
    id: &str,
    seen: Option<u64>,
    d: &Decision,
) -> Decided<QueueStatus> {
    let mut rec = tx.load(id)?;
    if seen.is_some_and(|s| s != rec.updated_at_ms) {
        return Err(Error::Conflict(format!(
            "task {id} changed since this page was rendered (it is {} now); reload and decide again",
            rec.status.as_str()
        )));
    }
    let was = rec.status;
    match rec.status {
        QueueStatus::Finished => {
            return Err(Error::Conflict(format!(
                "task {id} already finished ({}); there is nothing to cancel",
                rec.state.stop.map_or("-", |s| s.as_str())
            )));
        }
        QueueStatus::Running => {
            if rec.cancel_requested.is_some() {
                return Err(Error::Conflict(format!(
                    "cancelling task {id} was already requested"
                )));
            }
            rec.cancel_requested = Some(d.reason.clone().unwrap_or_default());
            tx.save(&rec, was)?;
        }
        QueueStatus::Held => {
            rec.state.cancelled_from = rec.state.stop;
            // Stays in the held list until reconciled (see `is_held`).
            finish(tx, &mut rec, StopReason::Cancelled, d.now_ms)?;
        }
        QueueStatus::Queued | QueueStatus::Suspended => {
            // A queued task's entry in the ready queue is dropped when it is next seen.
            finish(tx, &mut rec, StopReason::Cancelled, d.now_ms)?;
        }
    }
    tx.event(Some(id), "cancel", d, json!({"was": was.as_str()}))?;
    Ok(Ok(was))
}

/// Completes a cancel requested while task `id` ran, when its run ended waiting (for an
/// approval, or held for reconcile) instead of at a step boundary: it is cancelled now, as a
/// cancel of a suspended or held task is (a held write stays listed until it is settled).
/// The request's audit event is the cancel's; nothing else is recorded. Returns whether it
/// cancelled the task.
pub fn complete_requested_cancel(tx: &mut dyn DecisionTx, id: &str, now_ms: u64) -> Result<bool> {
    let mut rec = tx.load(id)?;
    if rec.cancel_requested.is_none()
        || !matches!(rec.status, QueueStatus::Suspended | QueueStatus::Held)
    {
        return Ok(false);
    }
    if rec.status == QueueStatus::Held {
        rec.state.cancelled_from = rec.state.stop;
    }
    rec.cancel_requested = None;
    rec.suspended_at_ms = None;
    rec.approval = None;
    finish(tx, &mut rec, StopReason::Cancelled, now_ms)?;
    Ok(true)
}

/// Ends each of the suspended tasks `due` whose approval wait ran out (checked again here),
/// with `approval_expired` and its audit event. Returns the ids ended.
pub fn expire(tx: &mut dyn DecisionTx, due: &[String], now_ms: u64) -> Result<Vec<String>> {
    let ns = tx.db_id().to_string();
    let mut done = Vec::new();
    for id in due {
        let mut rec = tx.load(id)?;
        if !approval_expired(&rec, now_ms) {
            continue;
        }
        let detail = match &rec.state.pending {
            Some(c) => call_json(&ns, &rec, c),
            None => Value::Null,
        };
        finish(tx, &mut rec, StopReason::ApprovalExpired, now_ms)?;
        tx.event(Some(id), "expire", &system(now_ms), detail)?;
        done.push(id.clone());
    }
    Ok(done)
}

fn system(now_ms: u64) -> Decision {
    Decision {
        by: "worker".into(),
        reason: Some("approval wait ran out".into()),
        now_ms,
    }
}
