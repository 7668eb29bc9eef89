//! The durable driver: runs one claimed task's kernel session against its model and the durable
//! store, committing at each boundary the kernel reports.
//!
//! - Every commit carries the claim's fencing token; the store applies it only while that claim
//!   is the task's current one.
//! - Before a write is sent, its intent (call key, tool, args, digest) and the step's model reply
//!   are committed.
//! - At each step end, the state, the spans changed, the reply, the call-key result and the
//!   lease renewal are committed in one transaction.
//! - A step interrupted by a crash is re-run from the last committed state; if its reply was
//!   recorded with an intent, the same reply is folded in again instead of asking the model, so
//!   the step proposes the same call under the same key. A write whose intent has no result is
//!   re-sent only if the tool is idempotent, whether or not it was a held call being resumed;
//!   otherwise its outcome is unknown and the task is held for reconcile.
//! - A read of the database that fails is never taken for "nothing recorded": the run stops
//!   here (nothing is sent) and the task is recovered later.

use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::{CommitFail, Committer, Stats, now_ms};
use crate::http::HttpTools;
use crate::kernel::{Access, Action, Catalog, Keys, Run, Session, StopReason, ToolReply};
use crate::model::RecordedReply;
use crate::store::{CallRecord, Commit, CommitKind, Store, TaskRecord};
use crate::tools::Tools;
use crate::tools::durable::{DurableStore, DurableTools};

pub struct Context {
    pub store: Arc<Store>,
    pub tools: Arc<DurableStore>,
    pub committer: Committer,
    pub lease_ms: u64,
    pub time_scale: f64,
    pub shutdown: Arc<AtomicBool>,
    pub stats: Arc<Stats>,
}

/// Runs the task until it ends, suspends, is released at shutdown, or its claim is superseded.
pub fn run_task(ctx: &Context, rec: TaskRecord) {
    let id = rec.id.clone();
    match drive(ctx, rec) {
        Ok(Some(stop)) => {
            ctx.stats.tasks_ended.fetch_add(1, Ordering::Relaxed);
            tracing::info!(task = %id, stop = %stop, "task ended");
        }
        Ok(None) => tracing::info!(task = %id, "task released at shutdown"),
        Err(CommitFail::LeaseLost) => {
            ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(task = %id, "claim superseded (lease taken over); abandoning the task here");
        }
        Err(CommitFail::Failed(e)) => {
            ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::error!(task = %id, error = %e, "commit failed; the task will be recovered when its lease expires");
        }
    }
}

/// The approval digest that covers the held call under `key` with `digest`, if the task's
/// record holds one for exactly that call.
fn approval_for<'r>(rec: &'r TaskRecord, key: &str, digest: &str) -> Option<&'r str> {
    let a = rec.approval.as_ref()?;
    let approved = a.get("digest")?.as_str()?;
    (approved == digest && a.get("key").and_then(|k| k.as_str()) == Some(key)).then_some(approved)
}

fn drive(ctx: &Context, rec: TaskRecord) -> Result<Option<StopReason>, CommitFail> {
    let token = rec.lease.as_ref().map_or(0, |l| l.token);
    if ctx.shutdown.load(Ordering::SeqCst) {
        // Claimed but not started: hand it back untouched.
        ctx.committer.commit(Commit {
            task_id: rec.id.clone(),
            token,
            kind: CommitKind::Release,
            state: rec.state.clone(),
            next_span_id: rec.next_span_id,
            spans: Vec::new(),
            reply: None,
            call: None,
            now_ms: now_ms(),
            lease_ms: ctx.lease_ms,
            clear_settle: false,
        })?;
        return Ok(None);
    }
    let catalog = rec.catalog.clone().unwrap_or_else(Catalog::demo);
    let mut model = rec.model.build_for(&catalog);
    let mut demo_tools = DurableTools {
        store: &ctx.tools,
        scope: &rec.store_scope,
        latency_ms: &rec.tool_latency_ms,
    };
    let mut http_tools = HttpTools { catalog: &catalog };
    let tools: &mut dyn Tools = if catalog.tools.iter().any(|t| t.http.is_some()) {
        &mut http_tools
    } else {
        &mut demo_tools
    };
    let resuming = rec.state.pending.is_some()
        && matches!(
            rec.state.stop,
            Some(StopReason::NeedsApproval | StopReason::UnknownOutcome)
        );
    let settled = rec
        .settle
        .clone()
        .filter(|_| resuming && rec.cancel_requested.is_none());
    let clear_settle = settled.is_some();
    let run = if let Some(result) = settled {
        // An operator settled the held call: fold the decision in, send nothing.
        Run::Settled(result)
    } else if resuming && rec.cancel_requested.is_none() {
        Run::Resume
    } else {
        Run::Start
    };
    let mut session = Session::begin(
        run,
        rec.state.clone(),
        rec.budget,
        &catalog,
        rec.next_span_id,
        Keys::durable(ctx.store.db_id()),
    );
    if rec.cancel_requested.is_some() {
        // Cancelled while its worker was gone: stop before anything runs.
        session.cancel();
    }
    let mut first_model_call = true;
    let mut step_reply: Option<RecordedReply> = None;
    let mut step_call: Option<CallRecord> = None;
    let failed = |what: &str, e: crate::store::Error| {
        CommitFail::Failed(format!("cannot read the {what} of task {}: {e}", rec.id))
    };
    let commit = |session: &mut Session<'_>,
                  kind,
                  reply: Option<RecordedReply>,
                  call: Option<CallRecord>| {
        let c = Commit {
            task_id: rec.id.clone(),
            token,
            kind,
            state: session.state().clone(),
            next_span_id: session.trace().next_id(),
            spans: session.trace_mut().take_changed().to_vec(),
            reply,
            call,
            now_ms: now_ms(),
            lease_ms: ctx.lease_ms,
            clear_settle,
        };
        ctx.committer.commit(c)
    };
    // A kernel step takes a handful of actions; the cap turns a kernel bug into an error.
    let cap = 16 * (rec.budget.steps_max as usize + 2);
    for _ in 0..cap {
        match session.poll() {
            Action::Model(req) => {
                ctx.stats.steps.fetch_add(1, Ordering::Relaxed);
                let step = req.step;
                // A reply recorded for this step means a run before a crash got this far. Only
                // the first step of a run can be such a step: later ones are this run's own.
                let recorded = if first_model_call {
                    first_model_call = false;
                    ctx.store
                        .reply(&rec.id, step)
                        .map_err(|e| failed("recorded reply", e))?
                } else {
                    None
                };
                let reply = match recorded {
                    Some(recorded) => recorded.to_reply(),
                    None => model.next(&req),
                };
                pause(ctx.time_scale, reply.latency_ms);
                step_reply = Some(RecordedReply::of(step, &reply));
                session.on_model(reply);
            }
            Action::Tool(req) => {
                let key = req.key.to_string();
                let (write, idempotent) = (req.access == Access::Write, req.idempotent);
                let (tool, args, digest) = (
                    req.call.name.clone(),
                    req.call.args.clone(),
                    req.call.digest(),
                );
                if write {
                    let existing = ctx.store.call(&key).map_err(|e| failed("call key", e))?;
                    let in_flight = existing.as_ref().is_some_and(|c| c.result.is_none());
                    if in_flight && !idempotent {
                        // Sent before a crash (a fresh call or a resumed held one), outcome
                        // never learned, and not safe to re-send: hold it for reconcile.
                        step_call = existing;
                        session.on_tool(ToolReply {
                            result: json!({"status": "unknown", "code": "interrupted",
                                "detail": "the worker stopped while this write was in flight; reconcile it"}),
                            latency_ms: 0,
                        });
                        continue;
                    }
                    let call = CallRecord {
                        key: key.clone(),
                        task_id: rec.id.clone(),
                        step: session.state().step,
                        tool,
                        args,
                        digest: digest.clone(),
                        intent_at_ms: now_ms(),
                        result: None,
                        result_at_ms: None,
                    };
                    commit(
                        &mut session,
                        CommitKind::Intent,
                        step_reply.clone(),
                        Some(call.clone()),
                    )?;
                    step_call = Some(call);
                }
                let reply = match session.poll() {
                    Action::Tool(req) => {
                        let approval = if req.held {
                            approval_for(&rec, &key, &digest)
                        } else {
                            None
                        };
                        tools.call(&crate::kernel::ToolRequest { approval, ..req })
                    }
                    _ => unreachable!("the tool request is repeated until it is answered"),
                };
                pause(ctx.time_scale, reply.latency_ms);
                session.on_tool(reply);
                if let Some(c) = step_call.as_mut()
                    && c.key == key
                {
                    c.result = session.state().last_result.clone();
                    c.result_at_ms = Some(now_ms());
                }
            }
            Action::StepEnd => {
                if ctx.shutdown.load(Ordering::SeqCst) {
                    commit(
                        &mut session,
                        CommitKind::Release,
                        step_reply.take(),
                        step_call.take(),
                    )?;
                    return Ok(None);
                }
                let outcome = commit(
                    &mut session,
                    CommitKind::Step,
                    step_reply.take(),
                    step_call.take(),
                )?;
                if let Some(why) = outcome.cancel_requested {
                    tracing::info!(task = %rec.id, reason = %why, "cancel requested");
                    session.cancel();
                }
            }
            Action::Finished(stop) => {
                commit(
                    &mut session,
                    CommitKind::Final(stop),
                    step_reply.take(),
                    step_call.take(),
                )?;
                return Ok(Some(stop));
            }
        }
    }
    Err(CommitFail::Failed(format!(
        "task {} took more than {cap} kernel actions",
        rec.id
    )))
}

/// Sleeps `latency_ms * scale` of real time (at most a second per call).
fn pause(scale: f64, latency_ms: u64) {
    if scale > 0.0 {
        let ms = (latency_ms as f64 * scale).min(1000.0);
        std::thread::sleep(std::time::Duration::from_micros((ms * 1000.0) as u64));
    }
}
