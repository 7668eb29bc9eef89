//! One run of one claimed task, as a struct with one method per kernel action: `on_model`
//! asks the model (or takes the reply a crashed run recorded), `on_tool` commits a write's
//! intent and sends the call on its route, `on_step_end` and `on_finished` commit. The
//! session is polled once per action: a tool request is copied out of the session before
//! anything is committed, so it is never asked for twice. `driver` holds the rules this file
//! follows (fencing, intents, recovery, the claim proved before a send).

use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::CommitFail;
use super::driver::{Context, Ended, Proof, observe_model, pass, pause};
use super::routes::{Routed, answer_tool, answered_from_record, keyless, observe_tool};
use crate::kernel::{
    Access, Action, Catalog, ModelReply, ModelRequest, Session, Span, StopReason, ToolCall,
    ToolReply, ToolRequest,
};
use crate::model::{Model, RecordedReply};
use crate::store::{CallRecord, Commit, CommitKind, CommitOutcome, TaskRecord};
use crate::tools::Tools;

/// What a run of one task carries from action to action (the session is beside it, so that
/// a request borrowed from the session and this struct can be used together).
pub(super) struct Drive<'a> {
    pub ctx: &'a Context,
    pub rec: &'a TaskRecord,
    /// The claim's fencing token, carried by every commit.
    pub token: u64,
    pub catalog: &'a Catalog,
    pub model: Box<dyn Model>,
    pub routes: Routed<'a>,
    /// Spans a crashed run left open, ended as "interrupted" by this run's first commit.
    pub interrupted: Vec<Span>,
    /// The step's model reply is taken from the record once, for the first step of a rerun.
    pub first_model_call: bool,
    /// The call record of the step in progress (its write's intent, then its result).
    pub step_call: Option<CallRecord>,
    /// The reply of the step in progress, with what its tools answered.
    pub step_reply: Option<RecordedReply>,
    /// The commits of this run clear the operator's settlement it folded in.
    pub clear_settle: bool,
    /// The model's shared rate limit, if its profile has one.
    pub capacity: Option<super::rate::Capacity>,
}

/// A tool request copied out of the session, so the session can be committed before the
/// call is sent.
struct Pending {
    call: ToolCall,
    key: String,
    user_id: String,
    timeout_ms: u64,
    access: Access,
    idempotent: bool,
    held: bool,
}

impl Pending {
    fn of(r: &ToolRequest<'_>) -> Pending {
        Pending {
            call: r.call.clone(),
            key: r.key.to_string(),
            user_id: r.user_id.to_string(),
            timeout_ms: r.timeout_ms,
            access: r.access,
            idempotent: r.idempotent,
            held: r.held,
        }
    }

    fn request<'r>(
        &'r self,
        approval: Option<&'r str>,
        gate: Option<&'r crate::kernel::io::Gate>,
    ) -> ToolRequest<'r> {
        ToolRequest {
            call: &self.call,
            key: &self.key,
            user_id: &self.user_id,
            timeout_ms: self.timeout_ms,
            access: self.access,
            idempotent: self.idempotent,
            held: self.held,
            approval,
            gate,
        }
    }
}

impl<'a> Drive<'a> {
    /// Runs the session to its end, one action at a time. A kernel step takes a handful of
    /// actions; the cap turns a kernel bug into an error.
    pub fn run(mut self, session: &mut Session<'a>) -> Result<Ended, CommitFail> {
        let cap = 16 * (self.rec.budget.steps_max as usize + 2);
        for _ in 0..cap {
            match session.poll() {
                Action::Model(req) => match self.on_model(&req)? {
                    Some(reply) => session.on_model(reply),
                    None => return Ok(Ended::Yielded),
                },
                Action::Tool(req) => {
                    let pending = Pending::of(&req);
                    self.on_tool(session, pending)?;
                }
                Action::StepEnd => {
                    if let Some(ended) = self.on_step_end(session)? {
                        return Ok(ended);
                    }
                }
                Action::Finished(stop) => return self.on_finished(session, stop),
            }
        }
        Err(CommitFail::Failed(format!(
            "task {} took more than {cap} kernel actions",
            self.rec.id
        )))
    }

    fn now_ms(&self) -> u64 {
        (self.ctx.clock)()
    }

    fn failed(&self, what: &str, e: crate::store::Error) -> CommitFail {
        CommitFail::Failed(format!(
            "cannot read the {what} of task {}: {e}",
            self.rec.id
        ))
    }

    /// Commits the session's state with `reply` and `call`, the fencing token, the spans
    /// changed since the last commit and (for a final commit) the claim of the next task.
    fn commit(
        &mut self,
        session: &mut Session<'_>,
        kind: CommitKind,
        reply: Option<RecordedReply>,
        call: Option<CallRecord>,
    ) -> Result<CommitOutcome, CommitFail> {
        let ctx = self.ctx;
        let now = self.now_ms();
        // A thread that ends a task is free: it claims its next task in the same transaction,
        // unless the daemon is shutting down.
        let claim_next = (matches!(kind, CommitKind::Final(_))
            && !ctx.shutdown.load(Ordering::SeqCst))
        .then(|| ctx.identity.lease(now, ctx.lease_ms));
        pass(ctx, super::driver::Point::Commit)?;
        let mut spans = session.trace_mut().take_changed();
        spans.append(&mut self.interrupted);
        let callback = match kind {
            CommitKind::Final(stop) => self.callback(session, stop, now),
            _ => None,
        };
        if let (Some(cap), CommitKind::Step) = (self.capacity.as_mut(), kind) {
            cap.boundary = Some((session.state().clone(), session.trace().next_id()));
        }
        ctx.committer.commit(Commit {
            task_id: self.rec.id.clone(),
            token: self.token,
            kind,
            state: session.state().clone(),
            next_span_id: session.trace().next_id(),
            spans,
            reply,
            call,
            now_ms: now,
            lease_ms: ctx.lease_ms,
            clear_settle: self.clear_settle,
            claim_next,
            export: ctx.export,
            callback,
            not_before_ms: None,
        })
    }

    /// The callback a final commit queues when the task names a callback URL: the task's
    /// result as this commit leaves it.
    fn callback(
        &self,
        session: &Session<'_>,
        stop: crate::kernel::StopReason,
        now: u64,
    ) -> Option<crate::store::Callback> {
        self.rec.callback_url.as_ref()?;
        let mut after = self.rec.clone();
        after.state = session.state().clone();
        after.status = crate::store::QueueStatus::after(stop);
        after.updated_at_ms = now;
        after.lease = None;
        crate::store::callbacks::event(self.ctx.store.db_id(), &after, now)
    }

    /// The model's reply for the step: the one a run before a crash recorded, or a new one.
    fn on_model(&mut self, req: &ModelRequest<'_>) -> Result<Option<ModelReply>, CommitFail> {
        let (ctx, rec) = (self.ctx, self.rec);
        ctx.stats.steps.fetch_add(1, Ordering::Relaxed);
        let step = req.step;
        // A reply recorded for this step means a run before a crash got this far. Only the
        // first step of a run can be such a step (later ones are this run's own), and only if
        // an earlier claim ran the task (`runs` counts the claims).
        let recorded = if std::mem::take(&mut self.first_model_call) && rec.runs > 1 {
            ctx.store
                .reply(&rec.id, step)
                .map_err(|e| self.failed("recorded reply", e))?
        } else {
            None
        };
        pass(ctx, super::driver::Point::Model)?;
        let (reply, prompt, tools) = match recorded {
            Some(recorded) => (recorded.to_reply(), recorded.prompt, recorded.tools),
            None => {
                if let Some(until) = self.gate(|cap, store, now| cap.before(store, req, now))? {
                    return self.yield_until(until).map(|()| None);
                }
                pass(ctx, super::driver::Point::ModelCall)?;
                let reply = self.model.next(req);
                observe_model(&rec.id, step, rec.model.label(), &reply);
                let busy = self.model.busy();
                if let Some(until) =
                    self.gate(|cap, store, now| cap.after(store, &reply, busy, now))?
                {
                    return self.yield_until(until).map(|()| None);
                }
                (reply, self.model.prompt_id(), None)
            }
        };
        crate::metrics::global().steps.inc();
        pause(ctx.time_scale, reply.latency_ms);
        let mut recorded = RecordedReply::of(step, &reply, prompt);
        recorded.tools = Some(tools.unwrap_or_default());
        self.step_reply = Some(recorded);
        Ok(Some(reply))
    }

    /// Asks the rate limit, if the model has one, whether to go on; `Some(t)`: wait until t.
    fn gate(
        &mut self,
        f: impl FnOnce(
            &mut super::rate::Capacity,
            &dyn crate::store::Backend,
            u64,
        ) -> crate::store::Result<super::rate::Gate>,
    ) -> Result<Option<u64>, CommitFail> {
        let now = self.now_ms();
        let Some(cap) = self.capacity.as_mut() else {
            return Ok(None);
        };
        match f(cap, &*self.ctx.store, now) {
            Ok(super::rate::Gate::Go) => Ok(None),
            Ok(super::rate::Gate::Wait(t)) => Ok(Some(t)),
            Err(e) => Err(self.failed("model's rate limit", e)),
        }
    }

    /// The model must wait for capacity: the task goes back to the queue as its last step
    /// left it, not before `until`, and this thread is free.
    fn yield_until(&mut self, until: u64) -> Result<(), CommitFail> {
        let ctx = self.ctx;
        let rec = self.rec;
        let (state, next_span_id) = self
            .capacity
            .as_mut()
            .and_then(|c| c.boundary.take())
            .unwrap_or_else(|| (rec.state.clone(), rec.next_span_id));
        tracing::info!(task = %rec.id, until_ms = until, "waiting for the model's capacity; the task yields its thread");
        pass(ctx, super::driver::Point::Commit)?;
        ctx.committer.commit(Commit {
            task_id: rec.id.clone(),
            token: self.token,
            kind: CommitKind::Release,
            state,
            next_span_id,
            spans: Vec::new(),
            reply: None,
            call: None,
            now_ms: self.now_ms(),
            lease_ms: ctx.lease_ms,
            clear_settle: false,
            claim_next: None,
            export: ctx.export,
            callback: None,
            not_before_ms: Some(until),
        })?;
        Ok(())
    }

    /// One tool call: a write is answered from its record, held, or has its intent committed
    /// first; then the call is sent on its route and its answer folded in.
    fn on_tool(&mut self, session: &mut Session<'_>, req: Pending) -> Result<(), CommitFail> {
        let (ctx, rec) = (self.ctx, self.rec);
        let digest = req.call.digest();
        if req.access == Access::Write
            && let Some(answer) = self.before_write(session, &req, &digest)?
        {
            answer_tool(
                session,
                &mut self.step_reply,
                &req.call.name,
                &digest,
                answer,
            );
            return Ok(());
        }
        pass(ctx, super::driver::Point::Send)?;
        // This run may wait (paused, descheduled) anywhere before the bytes leave: a write is
        // sent only under a claim proved its own right before (see `driver::Proof`).
        let proof =
            (req.access == Access::Write).then(|| Arc::new(Proof::new(ctx, &rec.id, self.token)));
        let gate = proof.clone().map(|p| -> crate::kernel::io::Gate { p });
        let approval = rec
            .approval
            .as_ref()
            .filter(|_| req.held)
            .and_then(|a| a.covering(&req.key, &digest));
        let reply = self.routes.call(&req.request(approval, gate.as_ref()));
        if let Some(e) = proof.and_then(|p| p.refusal()) {
            tracing::warn!(task = %rec.id, key = %req.key, "the claim could not be proved; the write was not sent and the run stops");
            return Err(e);
        }
        observe_tool(&rec.id, &req.key, &req.call.name, &reply);
        pause(ctx.time_scale, reply.latency_ms);
        pass(ctx, super::driver::Point::Sent)?;
        answer_tool(
            session,
            &mut self.step_reply,
            &req.call.name,
            &digest,
            reply,
        );
        if let Some(c) = self.step_call.as_mut()
            && c.key == req.key
        {
            c.result = session.state().last_result.clone();
            c.result_at_ms = Some((self.ctx.clock)());
        }
        Ok(())
    }

    /// Before a write is sent: the answer it gets without being sent (applied already under
    /// its key on a keyless route; in flight before a crash and not safe to re-send), or
    /// `None` once its intent is committed and it may be sent.
    fn before_write(
        &mut self,
        session: &mut Session<'_>,
        req: &Pending,
        digest: &str,
    ) -> Result<Option<ToolReply>, CommitFail> {
        let rec = self.rec;
        let key = &req.key;
        let (existing, damaged) = match self.ctx.store.call(key) {
            Ok(c) => (c, false),
            // A record that cannot be decoded says nothing about what was sent: the outcome
            // is unknown, so the call is held, never sent blind.
            Err(
                e @ (crate::store::Error::Corrupt(_) | crate::store::Error::NewerVersion { .. }),
            ) => {
                tracing::error!(task = %rec.id, key = %key, error = %e, "call record damaged; holding the call");
                (None, true)
            }
            Err(e) => return Err(self.failed("call key", e)),
        };
        let in_flight = existing.as_ref().is_some_and(|c| c.result.is_none());
        // A route without an idempotency key of its own (MCP): this worker is the idempotency
        // layer. A write already applied under this key is answered from its call record,
        // never sent again.
        if let Some(answer) = existing
            .as_ref()
            .filter(|_| keyless(self.catalog, &req.call.name))
            .and_then(|c| answered_from_record(c, digest))
        {
            tracing::info!(task = %rec.id, key = %key, tool = %req.call.name, "write already applied under this key; answered from its call record, not sent");
            return Ok(Some(ToolReply {
                result: answer,
                latency_ms: 0,
            }));
        }
        if damaged || (in_flight && !req.idempotent) {
            // Sent before a crash (a fresh call or a resumed held one), outcome never
            // learned, and not safe to re-send: hold it for reconcile.
            self.step_call = existing;
            return Ok(Some(ToolReply {
                result: json!({"status": "unknown", "code": "interrupted",
                    "detail": "the worker stopped while this write was in flight; reconcile it"}),
                latency_ms: 0,
            }));
        }
        let call = CallRecord {
            key: key.clone(),
            task_id: rec.id.clone(),
            step: session.state().step,
            tool: req.call.name.clone(),
            args: req.call.args.clone(),
            digest: digest.to_string(),
            intent_at_ms: self.now_ms(),
            result: None,
            result_at_ms: None,
        };
        let reply = self.step_reply.clone();
        self.commit(session, CommitKind::Intent, reply, Some(call.clone()))?;
        self.step_call = Some(call);
        Ok(None)
    }

    /// A step ended: its commit (or, at shutdown, the task handed back). A cancel requested
    /// meanwhile stops the session at this boundary.
    fn on_step_end(&mut self, session: &mut Session<'_>) -> Result<Option<Ended>, CommitFail> {
        let (reply, call) = (self.step_reply.take(), self.step_call.take());
        if self.ctx.shutdown.load(Ordering::SeqCst) {
            self.commit(session, CommitKind::Release, reply, call)?;
            return Ok(Some(Ended::Released));
        }
        let outcome = self.commit(session, CommitKind::Step, reply, call)?;
        if let Some(why) = outcome.cancel_requested {
            tracing::info!(task = %self.rec.id, reason = %why, "cancel requested");
            session.cancel();
        } else if let Some(stop) = self.rec.time_limits.passed(true, self.now_ms()) {
            tracing::info!(task = %self.rec.id, stop = %stop, "the task's wall-clock deadline passed");
            session.stop_with(stop);
        }
        Ok(None)
    }

    /// The run ended: its final commit, and a cancel requested while it went on completed.
    fn on_finished(
        &mut self,
        session: &mut Session<'_>,
        stop: StopReason,
    ) -> Result<Ended, CommitFail> {
        let (reply, call) = (self.step_reply.take(), self.step_call.take());
        let outcome = self.commit(session, CommitKind::Final(stop), reply, call)?;
        let next = outcome.next.map(Box::new);
        // A cancel asked for while this run went on, which ended waiting rather than at a
        // step boundary: it takes effect now, not when an operator next decides.
        let waiting = matches!(stop, StopReason::NeedsApproval | StopReason::UnknownOutcome);
        if waiting && outcome.cancel_requested.is_some() {
            let id = &self.rec.id;
            match crate::operator::complete_requested_cancel(&*self.ctx.store, id, self.now_ms()) {
                Ok(true) => {
                    tracing::info!(task = %id, "cancel requested during the run; cancelled");
                    return Ok(Ended::Stopped(StopReason::Cancelled, next));
                }
                Ok(false) => {}
                // Left requested: the task's next run stops before anything runs.
                Err(e) => {
                    tracing::warn!(task = %id, error = %e, "cannot complete the requested cancel now")
                }
            }
        }
        Ok(Ended::Stopped(stop, next))
    }
}
