//! Operator decisions: approve, reject, reconcile (settle a held write) and cancel, and the
//! daemon's expiry of approval waits. Each is one function here, called by the CLI, the web
//! console and the daemon alike, and each runs as one transaction of the backend
//! ([`DecisionTx`]) that checks the task's status, applies the decision and records its audit
//! event (who, what, when, why) together. The rules and the messages that name CLI flags live
//! here, not in storage.
//!
//! Two operators deciding the same task are serialized by the backend (redb's single writer,
//! or PostgreSQL's `FOR UPDATE`): the second finds the status already changed and gets a
//! `Conflict` naming what happened.

use serde_json::{Value, json};

use super::review::{Extension, Reviewed, Settlement};
use crate::kernel::{Status, StopReason, ToolCall};
use crate::store::prelude::*;
use crate::store::{CallRecord, Decision, DecisionTx, Error, QueueStatus, Result, TaskRecord};

/// Approves exactly the held call of a suspended task and requeues it; the held call then
/// runs under its original key, carrying the approval to the tool. `reviewed` must name the
/// held call (its key or digest, from `worker show`); `extend` grants more budget first.
pub fn approve(
    db: &dyn Backend,
    id: &str,
    reviewed: &Reviewed,
    extend: &Extension,
    d: &Decision,
) -> Result<ToolCall> {
    decided(db, id, "approve", d, &mut |tx| {
        approve_in(tx, id, reviewed, extend, d)
    })
}

/// Rejects the held call of a suspended task: the model is told, and the task goes on.
pub fn reject(db: &dyn Backend, id: &str, reviewed: &Reviewed, d: &Decision) -> Result<ToolCall> {
    decided(db, id, "reject", d, &mut |tx| {
        reject_in(tx, id, reviewed, d)
    })
}

/// Settles a held write: applied (with the service's result) or not applied (sent again
/// under the same call key).
pub fn reconcile(
    db: &dyn Backend,
    id: &str,
    s: &Settlement,
    reviewed: &Reviewed,
    extend: &Extension,
    d: &Decision,
) -> Result<ToolCall> {
    decided(db, id, "reconcile", d, &mut |tx| {
        reconcile_in(tx, id, s, reviewed, extend, d)
    })
}

/// Cancels a task: at once when it is queued, suspended or held; at the running worker
/// thread's next step boundary when it is running. A held write stays listed (and so in
/// `worker reconcile`) until it is settled: cancelling does not make its outcome known.
/// With `seen` (the task's last change when the operator looked, as the console's form
/// carries it), refused when the task changed since.
pub fn cancel(db: &dyn Backend, id: &str, seen: Option<u64>, d: &Decision) -> Result<QueueStatus> {
    decided(db, id, "cancel", d, &mut |tx| {
        cancel_seen_in(tx, id, seen, d)
    })
}

/// Cancels task `id` if a cancel was requested while it ran and its run ended waiting;
/// returns whether it did. Called by the daemon.
pub fn complete_requested_cancel(db: &dyn Backend, id: &str, now_ms: u64) -> Result<bool> {
    let mut done = false;
    db.decide(&mut |tx| {
        done = complete_requested_cancel_in(tx, id, now_ms)?;
        Ok(())
    })?;
    Ok(done)
}

/// Stops every suspended task whose approval wait ran out, with its audit event. Called by
/// the daemon.
pub fn expire_approvals(db: &dyn Backend, now_ms: u64) -> Result<Vec<String>> {
    let due = db.due_approvals(now_ms)?;
    if due.is_empty() {
        return Ok(due);
    }
    let mut done = Vec::new();
    db.decide(&mut |tx| {
        done = expire_in(tx, &due, now_ms)?;
        Ok(())
    })?;
    Ok(done)
}

/// The held writes: tasks stopped with `unknown_outcome` (or cancelled while held), each
/// with its call record (`Err` names a damaged one). A write stays listed until it is settled.
pub fn held(db: &dyn Backend) -> Result<HeldWrites> {
    let mut out = Vec::new();
    for id in db.held_ids()? {
        let rec = db.task(&id)?;
        let Some(c) = rec.state.unknown_write() else {
            continue;
        };
        if !rec.is_held() {
            continue;
        }
        let call = db.call(&db.call_key(&rec, c)).map_err(|e| e.to_string());
        out.push((rec, call));
    }
    Ok(out)
}

/// The held writes, each with its call record (`Err` names a damaged one).
pub type HeldWrites = Vec<(TaskRecord, std::result::Result<Option<CallRecord>, String>)>;

/// Runs a decision: commits when it decided (even when its answer is a refusal it records),
/// and logs it once it committed.
pub(super) fn decided<T>(
    db: &dyn Backend,
    task: &str,
    verb: &str,
    d: &Decision,
    f: &mut dyn FnMut(&mut dyn DecisionTx) -> Decided<T>,
) -> Result<T> {
    let mut answer = None;
    db.decide(&mut |tx| {
        answer = Some(f(tx)?);
        Ok(())
    })?;
    let answer = answer.unwrap_or_else(|| Err(Error::Conflict("the decision was not run".into())));
    match &answer {
        Ok(_) => tracing::info!(task, verb, by = %d.by, reason = ?d.reason, "decision recorded"),
        Err(e) => tracing::info!(task, verb, by = %d.by, error = %e, "decision refused"),
    }
    answer
}

pub(super) fn not_in(rec: &TaskRecord, wanted: &str) -> Error {
    let stop = rec.state.stop.map_or(String::new(), |s| format!(" ({s})"));
    Error::Conflict(format!(
        "task {} is {}{stop}, not {wanted}; `worker events {}` shows what was decided",
        rec.id,
        rec.status.as_str(),
        rec.id
    ))
}

pub(super) fn held_call(rec: &TaskRecord) -> Result<ToolCall> {
    rec.state
        .pending
        .clone()
        .ok_or_else(|| Error::Conflict(format!("task {} holds no call", rec.id)))
}

pub(super) fn call_json(ns: &str, rec: &TaskRecord, call: &ToolCall) -> Value {
    json!({"tool": call.name, "args": call.args, "key": rec.call_key(ns, call), "digest": call.digest()})
}

/// How a suspended task's wait on a person ends when it runs out: the stop, and why.
pub(super) fn ran_out(rec: &TaskRecord) -> (StopReason, &'static str) {
    if rec.state.stop == Some(StopReason::NeedsAnswer) {
        (
            StopReason::QuestionExpired,
            "the wait for an answer ran out",
        )
    } else {
        (StopReason::ApprovalExpired, "approval wait ran out")
    }
}

/// A decision on a suspended task whose wait ran out records the expiry (with its audit
/// event) and is refused, saying so; `None` while the wait goes on.
pub(super) fn expired_now(
    tx: &mut dyn DecisionTx,
    rec: &mut TaskRecord,
    now_ms: u64,
) -> Result<Option<Error>> {
    if !approval_expired(rec, now_ms) {
        return Ok(None);
    }
    let ns = tx.db_id().to_string();
    let call = held_call(rec)?;
    let detail = call_json(&ns, rec, &call);
    let (stop, why) = ran_out(rec);
    finish(tx, rec, stop, now_ms)?;
    tx.event(Some(&rec.id), "expire", &system(now_ms, why), detail)?;
    let what = if stop == StopReason::QuestionExpired {
        "wait for an answer"
    } else {
        "approval wait"
    };
    Ok(Some(Error::Conflict(format!(
        "the {what} of task {} ran out ({} ms); the task stopped with {stop}",
        rec.id, rec.approval_wait_ms
    ))))
}

fn approval_expired(rec: &TaskRecord, now_ms: u64) -> bool {
    rec.status == QueueStatus::Suspended
        && rec
            .suspended_at_ms
            .is_some_and(|t| now_ms >= t.saturating_add(rec.approval_wait_ms))
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

/// A decision's result: `Err` of the inner result is an answer the transaction still commits
/// (an approval wait found expired is recorded, then refused).
pub(super) type Decided<T> = Result<std::result::Result<T, Error>>;

pub(super) fn requeue(tx: &mut dyn DecisionTx, rec: &mut TaskRecord, now_ms: u64) -> Result<()> {
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
    if was != QueueStatus::Finished {
        // The task's root span ends with it (live export; see `crate::otlp::root_of`).
        tx.queue_root(&rec.id)?;
        // And its caller learns that it finished (a completion callback), in this transaction.
        if let Some(cb) = crate::store::callbacks::event(tx.db_id(), rec, now_ms) {
            tx.queue_callback(&cb)?;
        }
    }
    Ok(())
}

/// Approves exactly the held call of a suspended task and requeues it; the held call then
/// runs under its original key, carrying the approval to the tool. The approval lives in the
/// task only, with its audit event, in one transaction. `reviewed` must name the held call
/// (its key or digest, from `worker show`); `extend` grants more budget first.
fn approve_in(
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
    if let Some(refused) = expired_now(tx, &mut rec, d.now_ms)? {
        return Ok(Err(refused));
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
    rec.approval = Some(crate::store::Approval {
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
fn reject_in(
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
fn reconcile_in(
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
    let (verb, recorded) = settled_as(s, &d.by)?;
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
    settle_call(tx, &key, &rec, &call, &recorded, d.now_ms)?;
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

/// The audit verb of a settlement and the result recorded for the write, or why the given
/// result cannot be an applied write's.
fn settled_as(s: &Settlement, by: &str) -> Result<(&'static str, Value)> {
    Ok(match s {
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
            json!({"status": "not_applied", "by": by}),
        ),
    })
}

/// The held write's call record, if it has one, settled with `recorded`. A damaged record is
/// replaced by one made from the held call: the operator's settlement is what is known of it
/// now.
fn settle_call(
    tx: &mut dyn DecisionTx,
    key: &str,
    rec: &TaskRecord,
    call: &ToolCall,
    recorded: &Value,
    now_ms: u64,
) -> Result<()> {
    if let Some(existing) = tx.call(key)? {
        let mut c = existing.unwrap_or_else(|_| CallRecord {
            key: key.to_string(),
            task_id: rec.id.clone(),
            step: rec.state.step,
            tool: call.name.clone(),
            args: call.args.clone(),
            digest: call.digest(),
            intent_at_ms: now_ms,
            result: None,
            result_at_ms: None,
        });
        c.result = Some(recorded.clone());
        c.result_at_ms = Some(now_ms);
        tx.put_call(&c)?;
    }
    Ok(())
}

/// A cancel, refused (nothing written) when `seen` is given and the task changed since: its
/// last change is no longer `seen` (the console's form carries it).
fn cancel_seen_in(
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
        QueueStatus::Queued => {
            hold_in_flight(tx, &mut rec)?;
            // A queued task's entry in the ready queue is dropped when it is next seen.
            finish(tx, &mut rec, StopReason::Cancelled, d.now_ms)?;
        }
        QueueStatus::Suspended => {
            finish(tx, &mut rec, StopReason::Cancelled, d.now_ms)?;
        }
    }
    tx.event(Some(id), "cancel", d, json!({"was": was.as_str()}))?;
    Ok(Ok(was))
}

/// A queued task may hold a write a crashed run sent (the task was put back in the queue after
/// its daemon died, a re-send of its held call included): that write stays held beside
/// whatever ends the task now, since ending it does not make its outcome known. A call record
/// that cannot be read and may be such a write (its plan step is not done) refuses the
/// decision: its outcome cannot be told, and a daemon's next run of the task holds it.
fn hold_in_flight(tx: &mut dyn DecisionTx, rec: &mut TaskRecord) -> Result<()> {
    let mut readable = Vec::new();
    // An earlier turn of a conversation ended with no write in flight (or it could not have
    // taken a message): only this turn's records can hold one.
    let this_turn = format!(
        "{}:{}:",
        rec.key_namespace(tx.db_id()),
        rec.state.key_scope()
    );
    for c in tx.calls(rec)? {
        match c {
            Ok(c) => readable.push(c),
            Err((key, _)) if !key.starts_with(&this_turn) => {}
            Err((key, why)) => {
                let step = key.rsplit(':').next().unwrap_or_default();
                let done = rec
                    .state
                    .plan
                    .iter()
                    .any(|s| s.id == step && s.status == crate::kernel::StepStatus::Done);
                if !done {
                    return Err(Error::Conflict(format!(
                        "task {} has a call record that cannot be read ({key}: {why}); it may be a write whose outcome is unknown, so the task is not ended here: a daemon's next run of it holds that write for reconcile (then cancel it), and `worker check` reports the damage",
                        rec.id
                    )));
                }
            }
        }
    }
    if let Some(call) = rec.in_flight(tx.db_id(), &readable) {
        rec.state.hold_in_flight(call);
    }
    Ok(())
}

/// Completes a cancel requested while task `id` ran, when its run ended waiting (for an
/// approval, or held for reconcile) instead of at a step boundary: it is cancelled now, as a
/// cancel of a suspended or held task is (a held write stays listed until it is settled).
/// The request's audit event is the cancel's; nothing else is recorded. Returns whether it
/// cancelled the task.
fn complete_requested_cancel_in(tx: &mut dyn DecisionTx, id: &str, now_ms: u64) -> Result<bool> {
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
fn expire_in(tx: &mut dyn DecisionTx, due: &[String], now_ms: u64) -> Result<Vec<String>> {
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
        let (stop, why) = ran_out(&rec);
        finish(tx, &mut rec, stop, now_ms)?;
        tx.event(Some(id), "expire", &system(now_ms, why), detail)?;
        done.push(id.clone());
    }
    Ok(done)
}

fn system(now_ms: u64, why: &str) -> Decision {
    Decision {
        by: "worker".into(),
        reason: Some(why.into()),
        now_ms,
    }
}
