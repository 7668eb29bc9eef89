//! Operator decisions, each one write transaction that checks the task's status, applies the
//! decision and records an audit event (who, what, when, why) together: approve, reject,
//! reconcile, cancel, and the expiry of approval waits. Memory notes are in `memory`.
//!
//! Two operators deciding the same task are serialized by redb's single writer: the second
//! finds the status already changed and gets a `Conflict` naming what happened.

use redb::{ReadableTable, WriteTransaction};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::codec::{decode, encode};
use super::schema::*;
use super::{CallRecord, Error, QueueStatus, Result, Store, TaskRecord, next_seq};
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

fn load(w: &WriteTransaction, id: &str) -> Result<TaskRecord> {
    super::tasks::load(w, id)?.ok_or_else(|| Error::NoTask(id.to_string()))
}

fn save(w: &WriteTransaction, rec: &TaskRecord) -> Result<()> {
    super::tasks::save(w, rec)
}

/// The task leaves the suspended and held indexes.
fn unindex(w: &WriteTransaction, id: &str) -> Result<()> {
    w.open_table(WAITING)?.remove(id)?;
    w.open_table(HELD)?.remove(id)?;
    Ok(())
}

fn requeue(w: &WriteTransaction, rec: &mut TaskRecord, now_ms: u64) -> Result<()> {
    unindex(w, &rec.id)?;
    rec.status = QueueStatus::Queued;
    rec.updated_at_ms = now_ms;
    let seq = next_seq(&mut w.open_table(META)?, META_READY_SEQ)?;
    w.open_table(READY)?
        .insert((-rec.priority, seq), rec.id.as_str())?;
    save(w, rec)
}

fn finish(w: &WriteTransaction, rec: &mut TaskRecord, stop: StopReason, now_ms: u64) -> Result<()> {
    unindex(w, &rec.id)?;
    rec.state.stop = Some(stop);
    rec.state.status = Status::Stopped;
    rec.status = QueueStatus::Finished;
    rec.updated_at_ms = now_ms;
    save(w, rec)
}

pub(super) fn event(
    w: &WriteTransaction,
    task: Option<&str>,
    verb: &str,
    d: &Decision,
    detail: Value,
) -> Result<u64> {
    let seq = next_seq(&mut w.open_table(META)?, META_EVENT_SEQ)?;
    let ev = Event {
        seq,
        at_ms: d.now_ms,
        task: task.map(str::to_string),
        verb: verb.to_string(),
        by: d.by.clone(),
        reason: d.reason.clone(),
        detail,
    };
    w.open_table(EVENTS)?.insert(seq, encode(&ev)?.as_slice())?;
    Ok(seq)
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
    json!({"tool": call.name, "args": call.args, "key": call.key_in(ns, &rec.id, rec.state.step), "digest": call.digest()})
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

    /// The budget with every limit grown (saturating: a limit never wraps around).
    fn apply(&self, b: &mut Budget) -> Result<()> {
        for (name, amount) in &self.0 {
            let now = budget_value(b, name);
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

fn budget_value(b: &Budget, name: &str) -> u64 {
    match name {
        "steps_max" => b.steps_max.into(),
        "tool_calls_max" => b.tool_calls_max.into(),
        "tokens_max" => b.tokens_max,
        "output_tokens_max" => b.output_tokens_max.into(),
        "deadline_ms" => b.deadline_ms,
        "repeat_max" => b.repeat_max.into(),
        "stalls_max" => b.stalls_max.into(),
        _ => b.plan_steps_max.into(),
    }
}

/// A decision that re-sends the held call promises a send: refuse it when the task's budget
/// would stop the re-sent call before it goes out, and say how to extend it.
fn check_can_send(rec: &TaskRecord, verb: &str) -> Result<()> {
    let (st, b) = (&rec.state, &rec.budget);
    let short = if st.tool_calls >= b.tool_calls_max {
        Some(format!(
            "its tool calls are used up ({} / {}); try --extend tool_calls=1",
            st.tool_calls, b.tool_calls_max
        ))
    } else if st.elapsed_ms >= b.deadline_ms {
        Some(format!(
            "its active time is used up ({} ms / {} ms); try --extend deadline_ms=10000",
            st.elapsed_ms, b.deadline_ms
        ))
    } else {
        None
    };
    match short {
        Some(why) => Err(Error::Conflict(format!(
            "{verb} would re-send the held call of task {}, but {why}",
            rec.id
        ))),
        None => Ok(()),
    }
}

impl Store {
    /// Approves exactly the held call of a suspended task and requeues it; the held call then
    /// runs under its original key, carrying the approval to the tool. The approval lives
    /// here only, with its audit event, in one transaction. `reviewed` must name the held call
    /// (its key or digest, from `worker show`); `extend` grants more budget first.
    pub fn approve(
        &self,
        id: &str,
        reviewed: &Reviewed,
        extend: &Extension,
        d: &Decision,
    ) -> Result<ToolCall> {
        if reviewed.is_empty() {
            return Err(Error::Invalid(format!(
                "an approval must name the call it approves: pass --digest or --key as `worker show {id}` prints them"
            )));
        }
        let ns = self.db_id();
        let w = self.begin_write()?;
        let mut rec = load(&w, id)?;
        if approval_expired(&rec, d.now_ms) {
            let call = held_call(&rec)?;
            let detail = call_json(ns, &rec, &call);
            finish(&w, &mut rec, StopReason::ApprovalExpired, d.now_ms)?;
            event(&w, Some(id), "expire", &system(d.now_ms), detail)?;
            w.commit()?;
            return Err(Error::Conflict(format!(
                "the approval wait of task {id} ran out ({} ms); the task stopped with approval_expired",
                rec.approval_wait_ms
            )));
        }
        if rec.status != QueueStatus::Suspended || rec.state.stop != Some(StopReason::NeedsApproval)
        {
            return Err(not_in(&rec, "waiting for approval"));
        }
        let call = held_call(&rec)?;
        let key = call.key_in(ns, &rec.id, rec.state.step);
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
        let mut detail = call_json(ns, &rec, &call);
        if !extend.0.is_empty() {
            detail["extend"] = extend.to_json();
        }
        requeue(&w, &mut rec, d.now_ms)?;
        event(&w, Some(id), "approve", d, detail)?;
        w.commit()?;
        Ok(call)
    }

    /// Rejects the held call: it is never sent; the task continues with a `rejected` result
    /// for that step, under its budget. `reviewed`, when given, must name the held call.
    pub fn reject(&self, id: &str, reviewed: &Reviewed, d: &Decision) -> Result<ToolCall> {
        let ns = self.db_id();
        let w = self.begin_write()?;
        let mut rec = load(&w, id)?;
        if rec.status != QueueStatus::Suspended || rec.state.stop != Some(StopReason::NeedsApproval)
        {
            return Err(not_in(&rec, "waiting for approval"));
        }
        let call = held_call(&rec)?;
        reviewed.check(id, &call, &call.key_in(ns, &rec.id, rec.state.step))?;
        let result = json!({"status": "rejected", "code": "rejected",
            "detail": d.reason.clone().unwrap_or_else(|| "rejected by an operator".into())});
        rec.settle = Some(result.clone());
        rec.approval = None;
        rec.suspended_at_ms = None;
        let mut detail = call_json(ns, &rec, &call);
        detail["result"] = result;
        requeue(&w, &mut rec, d.now_ms)?;
        event(&w, Some(id), "reject", d, detail)?;
        w.commit()?;
        Ok(call)
    }

    /// Held writes: every task in the held index (stopped with `unknown_outcome`, or cancelled
    /// while its write was held), with its call-key record. A write stays listed until it is
    /// settled.
    /// The held writes, each with its call record: `Err` names a damaged one (the write stays
    /// held either way; what it says is not known).
    #[allow(clippy::type_complexity)]
    pub fn held(
        &self,
    ) -> Result<Vec<(TaskRecord, std::result::Result<Option<CallRecord>, String>)>> {
        let ids: Vec<String> = {
            let r = self.begin_read()?;
            let held = r.open_table(HELD)?;
            let mut ids = Vec::new();
            for e in held.iter()? {
                ids.push(e?.0.value().to_string());
            }
            ids.sort_by_key(|id| super::task_order(id));
            ids
        };
        let mut out = Vec::new();
        for id in ids {
            let rec = self.task(&id)?;
            let Some(c) = rec.state.unknown_write() else {
                continue;
            };
            if !matches!(rec.status, QueueStatus::Held | QueueStatus::Finished) {
                continue;
            }
            let call = self
                .call(&self.call_key(c, &rec.id, rec.state.step))
                .map_err(|e| e.to_string());
            out.push((rec, call));
        }
        Ok(out)
    }

    /// Settles a held write. Applied: the result is folded in as the call's result. Not
    /// applied: the call is sent again under the same call key (refused when the budget would
    /// stop it before it goes out, unless `extend` grants more). A task cancelled while its
    /// write was held is not requeued: the settlement is recorded and it leaves the held list.
    pub fn reconcile(
        &self,
        id: &str,
        s: &Settlement,
        reviewed: &Reviewed,
        extend: &Extension,
        d: &Decision,
    ) -> Result<ToolCall> {
        let ns = self.db_id();
        let w = self.begin_write()?;
        let mut rec = load(&w, id)?;
        let cancelled = rec.status == QueueStatus::Finished && rec.state.unknown_write().is_some();
        if rec.status != QueueStatus::Held && !cancelled {
            return Err(not_in(&rec, "held for reconcile"));
        }
        let call = held_call(&rec)?;
        let key = call.key_in(ns, &rec.id, rec.state.step);
        reviewed.check(id, &call, &key)?;
        let mut detail = call_json(ns, &rec, &call);
        let (verb, recorded) = match s {
            Settlement::Applied(result) => {
                if !result.get("status").is_some_and(Value::is_string) {
                    return Err(Error::Invalid(
                        "--result must be a JSON object with a string \"status\", e.g. {\"status\": \"ok\"}".into(),
                    ));
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
        let mut calls = w.open_table(CALL_KEYS)?;
        let existing = calls.get(key.as_str())?.map(|g| g.value().to_vec());
        if let Some(bytes) = existing {
            // A damaged record is replaced by one made from the held call: the operator's
            // settlement is what is known of it now.
            let mut c: CallRecord = decode("call key", &bytes).unwrap_or_else(|_| CallRecord {
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
            calls.insert(key.as_str(), encode(&c)?.as_slice())?;
        }
        drop(calls);
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
            unindex(&w, &rec.id)?;
            save(&w, &rec)?;
        } else {
            requeue(&w, &mut rec, d.now_ms)?;
        }
        event(&w, Some(id), verb, d, detail)?;
        w.commit()?;
        Ok(call)
    }

    /// Cancels a task: at once when it is queued, suspended or held; at the running worker's
    /// next step boundary when it is running. A held write stays listed by `held` (and so by
    /// `worker reconcile`) until it is settled: cancelling does not make its outcome known.
    pub fn cancel(&self, id: &str, d: &Decision) -> Result<QueueStatus> {
        let w = self.begin_write()?;
        let mut rec = load(&w, id)?;
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
                save(&w, &rec)?;
            }
            QueueStatus::Held => {
                rec.state.cancelled_from = rec.state.stop;
                w.open_table(WAITING)?.remove(id)?;
                rec.state.stop = Some(StopReason::Cancelled);
                rec.state.status = Status::Stopped;
                rec.status = QueueStatus::Finished;
                rec.updated_at_ms = d.now_ms;
                save(&w, &rec)?; // stays in the held index until reconciled
            }
            QueueStatus::Queued | QueueStatus::Suspended => {
                // A queued task's entry in the ready queue is dropped when it is next seen.
                finish(&w, &mut rec, StopReason::Cancelled, d.now_ms)?;
            }
        }
        event(&w, Some(id), "cancel", d, json!({"was": was.as_str()}))?;
        w.commit()?;
        Ok(was)
    }

    /// Ends every suspended task whose approval wait ran out, with `approval_expired`.
    pub fn expire_approvals(&self, now_ms: u64) -> Result<Vec<String>> {
        let due: Vec<String> = {
            let r = self.begin_read()?;
            let waiting = r.open_table(WAITING)?;
            let mut due = Vec::new();
            for e in waiting.iter()? {
                let (id, until) = e?;
                if until.value() <= now_ms {
                    due.push(id.value().to_string());
                }
            }
            due
        };
        if due.is_empty() {
            return Ok(due);
        }
        let w = self.begin_write()?;
        let mut done = Vec::new();
        for id in due {
            let mut rec = load(&w, &id)?;
            if !approval_expired(&rec, now_ms) {
                continue;
            }
            let detail = match &rec.state.pending {
                Some(c) => call_json(self.db_id(), &rec, c),
                None => Value::Null,
            };
            finish(&w, &mut rec, StopReason::ApprovalExpired, now_ms)?;
            event(&w, Some(&id), "expire", &system(now_ms), detail)?;
            done.push(id);
        }
        w.commit()?;
        Ok(done)
    }

    pub fn events(&self, task: Option<&str>) -> Result<Vec<Event>> {
        let r = self.begin_read()?;
        let t = r.open_table(EVENTS)?;
        let mut out = Vec::new();
        for e in t.iter()? {
            let (_, v) = e?;
            let ev: Event = decode("event", v.value())?;
            if task.is_none_or(|id| ev.task.as_deref() == Some(id)) {
                out.push(ev);
            }
        }
        Ok(out)
    }
}

fn system(now_ms: u64) -> Decision {
    Decision {
        by: "worker".into(),
        reason: Some("approval wait ran out".into()),
        now_ms,
    }
}
