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
//! - Right before a write is sent, the claim is proved current and held for at least
//!   [`SEND_MARGIN_MS`] more (renewed if it would run out sooner); a run whose claim was
//!   taken over while it waited (a paused process) stops there and sends nothing.

use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::routes::{Routed, answer_tool, answered_from_record, keyless, observe_tool};
use super::{CommitFail, Committer, Stats};
use crate::kernel::{Access, Action, Keys, Run, Session, StopReason, ToolReply};
use crate::mcp::McpTools;
use crate::model::RecordedReply;
use crate::store::{Backend, CallRecord, Commit, CommitKind, TaskRecord};
use crate::tools::Tools;
use crate::tools::durable::DemoShop;
use crate::tools::http::HttpTools;

/// Where a driver stops to let a simulation run other work first, or crash it: before a model
/// call, before a tool call is sent, after its answer came back, and before each commit. A
/// hook that returns false crashes the worker there: it abandons the task at once, as a killed
/// process would, leaving only what it had committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    Model,
    Send,
    Sent,
    Commit,
}

pub type Hook = Arc<dyn Fn(Point) -> bool + Send + Sync>;
/// Wall-clock milliseconds since the epoch (simulated in a simulation).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// How long, at the least, a claim must be certain to stay this run's when a write is sent
/// (or a third of the heartbeat TTL when that is shorter: a healthy heartbeat thread keeps
/// two thirds of it left): a takeover needs the lease or the heartbeat to run out first, so
/// only a pause of longer than this between the check and the request leaving the process
/// can let a new owner send the same write too.
pub const SEND_MARGIN_MS: u64 = 5_000;

pub struct Context {
    pub clock: Clock,
    /// None in the daemon.
    pub hook: Option<Hook>,
    /// The daemon's MCP sessions, if its config names servers.
    pub mcp: Option<Arc<crate::mcp::Mcp>>,
    /// The daemon's config: a task's model profile and tools are resolved in it.
    pub trusted: Arc<crate::config::Config>,
    /// Spans are exported live: each commit queues the spans it ends in the outbox.
    pub export: bool,
    /// This process as a lease owner, for the claim made with a task's final commit.
    pub identity: super::Identity,
    pub store: Arc<dyn Backend>,
    /// The demo shop, for tasks whose catalog routes a tool to it; `None`: this daemon has none.
    pub demo: Option<Arc<DemoShop>>,
    pub committer: Committer,
    pub lease_ms: u64,
    /// How long this daemon's heartbeat vouches for its claims (a shared backend).
    pub heartbeat_ttl_ms: u64,
    pub time_scale: f64,
    pub shutdown: Arc<AtomicBool>,
    pub stats: Arc<Stats>,
}

/// Runs the task until it ends, suspends, is released at shutdown, or its claim is superseded.
/// Returns the next task, claimed for this thread in the transaction of the final commit.
pub fn run_task(ctx: &Context, rec: TaskRecord) -> Option<TaskRecord> {
    let id = rec.id.clone();
    // Every log line of the run (the HTTP adapters' retries too) carries the task id.
    let _span = tracing::info_span!("task", task = %id, run = rec.runs).entered();
    match drive(ctx, rec) {
        Ok(Ended::Stopped(stop, next)) => {
            ctx.stats.tasks_ended.fetch_add(1, Ordering::Relaxed);
            crate::metrics::global()
                .tasks_ended
                .with_label_values(&[stop.as_str()])
                .inc();
            tracing::info!(task = %id, stop = %stop, "task ended");
            return next.map(|b| *b);
        }
        Ok(Ended::Released) => tracing::info!(task = %id, "task released at shutdown"),
        Err(CommitFail::LeaseLost) => {
            ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(task = %id, "claim superseded (lease taken over); abandoning the task here");
        }
        Err(CommitFail::Failed(e)) => {
            ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::error!(task = %id, error = %e, "the run stopped (a commit or a read of the database failed); the task will be recovered when its lease expires");
        }
    }
    None
}

/// Counts a model call and logs its failure, with the task and step.
fn observe_model(task: &str, step: u32, model: &str, reply: &crate::kernel::ModelReply) {
    let m = crate::metrics::global();
    let outcome = match &reply.outcome {
        Ok(_) => "ok",
        Err(crate::kernel::ModelError::Timeout) => "timeout",
        Err(_) => "error",
    };
    m.model_calls.with_label_values(&[model, outcome]).inc();
    m.model_seconds
        .with_label_values(&[model])
        .observe(reply.latency_ms as f64 / 1000.0);
    if let Err(e) = &reply.outcome {
        tracing::warn!(task, step, model, error = ?e, "model call failed");
    }
}

/// How a run on this thread ended.
enum Ended {
    /// With a stop reason (finished, suspended or held), and the next task if one was claimed.
    Stopped(StopReason, Option<Box<TaskRecord>>),
    /// Handed back at shutdown.
    Released,
}

/// Proves the claim `token` of task `id` current and held for [`SEND_MARGIN_MS`] (or a third of
/// the heartbeat TTL) more before a
/// write goes out: renews the lease and the heartbeat when less is left. `LeaseLost` when the
/// claim was taken over (nothing may be sent), or is still short after renewing.
fn hold_claim(ctx: &Context, id: &str, token: u64) -> Result<(), CommitFail> {
    let failed = |e: crate::store::Error| {
        CommitFail::Failed(format!("cannot check the claim of task {id}: {e}"))
    };
    let margin = SEND_MARGIN_MS.min(ctx.heartbeat_ttl_ms / 3);
    for renewed in [false, true] {
        let now = (ctx.clock)();
        match ctx.store.claim_left(id, token, now).map_err(failed)? {
            None => return Err(CommitFail::LeaseLost),
            Some(left) if left >= margin => return Ok(()),
            Some(_) if renewed => break,
            Some(left) => {
                tracing::info!(task = %id, left_ms = left, "the claim runs out soon; renewing it before a write");
                if !ctx
                    .store
                    .renew_claim(id, token, now, ctx.lease_ms)
                    .map_err(failed)?
                {
                    return Err(CommitFail::LeaseLost);
                }
                ctx.store
                    .heartbeat(
                        &ctx.identity.owner(),
                        now,
                        now.saturating_add(ctx.heartbeat_ttl_ms),
                    )
                    .map_err(failed)?;
            }
        }
    }
    Err(CommitFail::LeaseLost)
}

/// Passes `point`, or crashes here if the hook says so.
fn pass(ctx: &Context, point: Point) -> Result<(), CommitFail> {
    match &ctx.hook {
        Some(hook) if !hook(point) => Err(CommitFail::Failed(format!("crashed at {point:?}"))),
        _ => Ok(()),
    }
}

fn drive(ctx: &Context, rec: TaskRecord) -> Result<Ended, CommitFail> {
    let now_ms = || (ctx.clock)();
    let token = rec.lease.as_ref().map_or(0, |l| l.token);
    if ctx.shutdown.load(Ordering::SeqCst) {
        // Claimed but not started: hand it back untouched.
        pass(ctx, Point::Commit)?;
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
            claim_next: None,
            export: ctx.export,
        })?;
        return Ok(Ended::Released);
    }
    // What the task's tools and model mean here is the daemon's config's to say.
    let crate::config::Resolved {
        catalog,
        unavailable,
    } = ctx.trusted.catalog_for(rec.catalog.as_ref());
    for (tool, why) in &unavailable {
        tracing::warn!(task = %rec.id, tool = %tool, reason = %why, "tool unavailable to this worker");
    }
    let mut model: Box<dyn crate::model::Model> = match ctx.trusted.model_for(&rec.model) {
        Ok(m) => m.build(&catalog, rec.instructions.as_deref()),
        Err(why) => {
            tracing::error!(task = %rec.id, reason = %why, "model unavailable to this worker");
            Box::new(crate::model::Unavailable(why))
        }
    };
    let mut routed = Routed {
        catalog: &catalog,
        unavailable: &unavailable,
        demo: super::routes::DemoRoute {
            shop: ctx.demo.as_deref(),
            scope: &rec.store_scope,
            latency_ms: &rec.tool_latency_ms,
        },
        http: HttpTools { catalog: &catalog },
        mcp: McpTools {
            mcp: ctx.mcp.as_deref(),
            catalog: &catalog,
        },
    };
    let tools: &mut dyn Tools = &mut routed;
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
    let resumed = run == Run::Resume;
    let mut session = Session::begin(
        run,
        rec.state.clone(),
        rec.budget,
        &catalog,
        rec.next_span_id,
        Keys::durable(rec.key_namespace(ctx.store.db_id())),
    );
    session.set_input(model.input());
    if rec.cancel_requested.is_some() {
        // Cancelled while its worker was gone: stop before anything runs.
        session.cancel();
    }
    // Spans a crashed run left open never end by themselves: this run ends them
    // ("interrupted", at the task's last committed active time) in its first commit, so a
    // trace is a finished tree and a live exporter sends them.
    let interrupted = std::cell::RefCell::new(if rec.runs > 1 {
        interrupted_spans(ctx, &rec)?
    } else {
        Vec::new()
    });
    let mut first_model_call = true;
    let mut step_call: Option<CallRecord> = None;
    let failed = |what: &str, e: crate::store::Error| {
        CommitFail::Failed(format!("cannot read the {what} of task {}: {e}", rec.id))
    };
    // The reply of the step in progress, with what its tools answered: a resumed held call
    // belongs to the step that proposed it, so its answer joins that step's recorded reply.
    let mut step_reply: Option<RecordedReply> = if resumed {
        ctx.store
            .reply(&rec.id, rec.state.step)
            .map_err(|e| failed("recorded reply", e))?
    } else {
        None
    };
    let commit = |session: &mut Session<'_>,
                  kind,
                  reply: Option<RecordedReply>,
                  call: Option<CallRecord>| {
        let now = now_ms();
        // A thread that ends a task is free: it claims its next task in the same transaction,
        // unless the daemon is shutting down.
        let claim_next = (matches!(kind, CommitKind::Final(_))
            && !ctx.shutdown.load(Ordering::SeqCst))
        .then(|| ctx.identity.lease(now, ctx.lease_ms));
        pass(ctx, Point::Commit)?;
        let c = Commit {
            task_id: rec.id.clone(),
            token,
            kind,
            state: session.state().clone(),
            next_span_id: session.trace().next_id(),
            spans: {
                let mut spans = session.trace_mut().take_changed();
                spans.append(&mut interrupted.borrow_mut());
                spans
            },
            reply,
            call,
            now_ms: now,
            lease_ms: ctx.lease_ms,
            clear_settle,
            claim_next,
            export: ctx.export,
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
                // the first step of a run can be such a step (later ones are this run's own),
                // and only if an earlier claim ran the task (`runs` counts the claims).
                let recorded = if first_model_call && rec.runs > 1 {
                    first_model_call = false;
                    ctx.store
                        .reply(&rec.id, step)
                        .map_err(|e| failed("recorded reply", e))?
                } else {
                    first_model_call = false;
                    None
                };
                pass(ctx, Point::Model)?;
                let (reply, prompt, tools) = match recorded {
                    Some(recorded) => (recorded.to_reply(), recorded.prompt, recorded.tools),
                    None => {
                        let reply = model.next(&req);
                        observe_model(&rec.id, step, rec.model.label(), &reply);
                        (reply, model.prompt_id(), None)
                    }
                };
                crate::metrics::global().steps.inc();
                pause(ctx.time_scale, reply.latency_ms);
                let mut recorded = RecordedReply::of(step, &reply, prompt);
                recorded.tools = Some(tools.unwrap_or_default());
                step_reply = Some(recorded);
                session.on_model(reply);
            }
            Action::Tool(req) => {
                let key = req.key.to_string();
                let (write, idempotent) = (req.access == Access::Write, req.idempotent);
                let tool_name = req.call.name.clone();
                let (tool, args, digest) = (
                    req.call.name.clone(),
                    req.call.args.clone(),
                    req.call.digest(),
                );
                if write {
                    let (existing, damaged) = match ctx.store.call(&key) {
                        Ok(c) => (c, false),
                        // A record that cannot be decoded says nothing about what was sent:
                        // the outcome is unknown, so the call is held, never sent blind.
                        Err(
                            e @ (crate::store::Error::Corrupt(_)
                            | crate::store::Error::NewerVersion { .. }),
                        ) => {
                            tracing::error!(task = %rec.id, key = %key, error = %e, "call record damaged; holding the call");
                            (None, true)
                        }
                        Err(e) => return Err(failed("call key", e)),
                    };
                    let in_flight = existing.as_ref().is_some_and(|c| c.result.is_none());
                    // A route without an idempotency key of its own (MCP): this worker is the
                    // idempotency layer. A write already applied under this key is answered
                    // from its call record, never sent again.
                    if let Some(answer) = existing
                        .as_ref()
                        .filter(|_| keyless(&catalog, &tool_name))
                        .and_then(|c| answered_from_record(c, &digest))
                    {
                        tracing::info!(task = %rec.id, key = %key, tool = %tool_name, "write already applied under this key; answered from its call record, not sent");
                        answer_tool(
                            &mut session,
                            &mut step_reply,
                            &tool_name,
                            &digest,
                            ToolReply {
                                result: answer,
                                latency_ms: 0,
                            },
                        );
                        continue;
                    }
                    if damaged || (in_flight && !idempotent) {
                        // Sent before a crash (a fresh call or a resumed held one), outcome
                        // never learned, and not safe to re-send: hold it for reconcile.
                        step_call = existing;
                        answer_tool(
                            &mut session,
                            &mut step_reply,
                            &tool_name,
                            &digest,
                            ToolReply {
                                result: json!({"status": "unknown", "code": "interrupted",
                                    "detail": "the worker stopped while this write was in flight; reconcile it"}),
                                latency_ms: 0,
                            },
                        );
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
                pass(ctx, Point::Send)?;
                if write {
                    // This run may have waited (paused, descheduled) since its intent: send
                    // only under a claim that is still its own, for a while yet.
                    if let Err(e) = hold_claim(ctx, &rec.id, token) {
                        tracing::warn!(task = %rec.id, key = %key, "the claim is not held any more; the write is not sent");
                        return Err(e);
                    }
                }
                let req_name = tool_name.clone();
                let reply = match session.poll() {
                    Action::Tool(req) => {
                        let approval = rec
                            .approval
                            .as_ref()
                            .filter(|_| req.held)
                            .and_then(|a| a.covering(&key, &digest));
                        tools.call(&crate::kernel::ToolRequest { approval, ..req })
                    }
                    _ => unreachable!("the tool request is repeated until it is answered"),
                };
                observe_tool(&rec.id, &key, &req_name, &reply);
                pause(ctx.time_scale, reply.latency_ms);
                pass(ctx, Point::Sent)?;
                answer_tool(&mut session, &mut step_reply, &req_name, &digest, reply);
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
                    return Ok(Ended::Released);
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
                let outcome = commit(
                    &mut session,
                    CommitKind::Final(stop),
                    step_reply.take(),
                    step_call.take(),
                )?;
                // A cancel asked for while this run went on, which ended waiting rather than
                // at a step boundary: it takes effect now, not when an operator next decides.
                let waiting =
                    matches!(stop, StopReason::NeedsApproval | StopReason::UnknownOutcome);
                if waiting && outcome.cancel_requested.is_some() {
                    match crate::operator::complete_requested_cancel(&*ctx.store, &rec.id, now_ms())
                    {
                        Ok(true) => {
                            tracing::info!(task = %rec.id, "cancel requested during the run; cancelled");
                            return Ok(Ended::Stopped(
                                StopReason::Cancelled,
                                outcome.next.map(Box::new),
                            ));
                        }
                        Ok(false) => {}
                        // Left requested: the task's next run stops before anything runs.
                        Err(e) => {
                            tracing::warn!(task = %rec.id, error = %e, "cannot complete the requested cancel now")
                        }
                    }
                }
                return Ok(Ended::Stopped(stop, outcome.next.map(Box::new)));
            }
        }
    }
    Err(CommitFail::Failed(format!(
        "task {} took more than {cap} kernel actions",
        rec.id
    )))
}

/// The spans of `rec` that an earlier run left open (it crashed), ended as "interrupted".
fn interrupted_spans(
    ctx: &Context,
    rec: &TaskRecord,
) -> Result<Vec<crate::kernel::Span>, CommitFail> {
    let spans = ctx.store.spans(&rec.id).map_err(|e| {
        CommitFail::Failed(format!("cannot read the spans of task {}: {e}", rec.id))
    })?;
    let at = rec.state.elapsed_ms;
    Ok(spans
        .into_iter()
        .filter(|s| s.t1_ms.is_none() && s.id < rec.next_span_id)
        .map(|mut s| {
            s.t1_ms = Some(at.max(s.t0_ms));
            s.status = "interrupted".into();
            s
        })
        .collect())
}

/// Sleeps `latency_ms * scale` of real time (at most a second per call).
fn pause(scale: f64, latency_ms: u64) {
    if scale > 0.0 {
        let ms = (latency_ms as f64 * scale).min(1000.0);
        std::thread::sleep(std::time::Duration::from_micros((ms * 1000.0) as u64));
    }
}
