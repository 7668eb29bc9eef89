//! One run of one claimed task, as a task of the executor: the durable step's machine
//! (`machine`) asks, and this file does the I/O it asks for (the database, the model under its
//! rate limit, the tool routes with a write's proof of its claim, the committer), feeding each
//! answer back. Waits on a model, a tool, the committer or a scripted latency hold no thread; a
//! read of a database behind a blocking client runs off the executor's threads
//! ([`super::blocking`]), one on a local file in place. The hook points of tests are passed
//! on the way (`driver::Point`).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::CommitFail;
use super::driver::{Context, Point, Proof, observe_model, pass, pause};
use super::machine::{Commit, Damaged, Ended, Machine, Need};
use super::rate::{Capacity, Gate};
use super::routes::{Routed, observe_tool};
use crate::kernel::{ModelReply, ToolReply};
use crate::model::{Model, RecordedReply};
use crate::store::{CallRecord, CommitOutcome, TaskRecord};

/// What a run has to do its I/O with, beside the machine.
pub(super) struct Io<'a> {
    pub ctx: &'a Context,
    pub token: u64,
    pub model: Box<dyn Model>,
    pub routes: Routed<'a>,
    pub capacity: Option<Capacity>,
    /// The task's model as metrics and logs name it.
    pub model_label: String,
    /// The task the last commit claimed for this thread, if it claimed one.
    pub next: Option<TaskRecord>,
}

/// An answer to feed the machine, made while its need was borrowed.
enum Answer {
    Calls(Result<Vec<CallRecord>, Damaged>),
    Spans(Vec<crate::kernel::Span>),
    Reply(Option<RecordedReply>),
    Model(ModelReply, Option<String>),
    Deferred(u64),
    /// The daemon began stopping while the model was asked.
    Dropped,
    Call(Result<Option<CallRecord>, Damaged>),
    Committed(Box<CommitOutcome>),
    Sent(ToolReply),
    Cancelled(bool),
    Ended(Ended),
}

impl Io<'_> {
    /// Runs `m` to its end, doing what it asks.
    pub async fn run(&mut self, m: &mut Machine<'_>) -> Result<Ended, CommitFail> {
        loop {
            if self.ctx.shutdown.load(Ordering::SeqCst) {
                m.shut_down();
            }
            let now = (self.ctx.clock)();
            let id = m.record().id.clone();
            let answer = match m.poll(now) {
                Need::Calls => Answer::Calls(self.calls(&id)?),
                Need::Spans => Answer::Spans(self.read("spans", &id, |s| s.spans(&id))?),
                Need::Reply { step, first_step } => {
                    if first_step {
                        pass(self.ctx, Point::Model)?;
                    }
                    Answer::Reply(self.read("recorded reply", &id, |s| s.reply(&id, step))?)
                }
                Need::Model(req) => {
                    pass(self.ctx, Point::Model)?;
                    Box::pin(self.model_call(&id, &req)).await?
                }
                Need::Call { key } => Answer::Call(self.call_record(&id, key)?),
                Need::Commit(c) => {
                    pass(self.ctx, Point::Commit)?;
                    Answer::Committed(Box::new(Box::pin(self.commit(&id, c, now)).await?))
                }
                Need::Send(send) => {
                    pass(self.ctx, Point::Send)?;
                    Answer::Sent(Box::pin(self.send(&id, send)).await?)
                }
                Need::CompleteCancel => Answer::Cancelled(self.complete_cancel(&id, now)),
                Need::Ended(e) => Answer::Ended(e),
            };
            let now = (self.ctx.clock)();
            match answer {
                Answer::Calls(c) => m.on_calls(c, now),
                Answer::Spans(s) => m.on_spans(s),
                Answer::Reply(r) => {
                    let first = m.on_reply(r);
                    if first.is_some() {
                        self.ctx.stats.steps.fetch_add(1, Ordering::Relaxed);
                        crate::metrics::global().steps.inc();
                    }
                    pause(self.ctx.time_scale, first.unwrap_or(0)).await;
                }
                Answer::Model(reply, prompt) => {
                    self.ctx.stats.steps.fetch_add(1, Ordering::Relaxed);
                    crate::metrics::global().steps.inc();
                    let latency = m.on_model(reply, prompt);
                    pause(self.ctx.time_scale, latency).await;
                }
                Answer::Deferred(until) => m.on_model_deferred(until),
                Answer::Dropped => m.on_model_dropped(),
                Answer::Call(c) => m.on_call(c, now),
                Answer::Committed(o) => m.on_committed(&o, now),
                Answer::Sent(reply) => m.on_sent(reply, now),
                Answer::Cancelled(done) => m.on_cancel_completed(done),
                Answer::Ended(e) => return Ok(e),
            }
        }
    }

    fn failed(what: &str, id: &str, e: crate::store::Error) -> CommitFail {
        CommitFail::Failed(format!("cannot read the {what} of task {id}: {e}"))
    }

    /// A read of the database; a read that fails is never taken for "nothing recorded": the
    /// run stops here (nothing is sent) and the task is recovered later.
    fn read<T>(
        &self,
        what: &str,
        id: &str,
        f: impl FnOnce(&dyn crate::store::Backend) -> crate::store::Result<T>,
    ) -> Result<T, CommitFail> {
        self.io(|| f(&*self.ctx.store))
            .map_err(|e| Io::failed(what, id, e))
    }

    fn io<T>(&self, f: impl FnOnce() -> T) -> T {
        store_io(&*self.ctx.store, f)
    }

    /// The task's call records; damaged ones are the machine's to weigh.
    fn calls(&self, id: &str) -> Result<Result<Vec<CallRecord>, Damaged>, CommitFail> {
        match self.io(|| self.ctx.store.calls(id)) {
            Ok(c) => Ok(Ok(c)),
            Err(
                e @ (crate::store::Error::Corrupt(_) | crate::store::Error::NewerVersion { .. }),
            ) => Ok(Err(Damaged(e.to_string()))),
            Err(e) => Err(Io::failed("call records", id, e)),
        }
    }

    fn call_record(
        &self,
        id: &str,
        key: &str,
    ) -> Result<Result<Option<CallRecord>, Damaged>, CommitFail> {
        match self.io(|| self.ctx.store.call(key)) {
            Ok(c) => Ok(Ok(c)),
            Err(
                e @ (crate::store::Error::Corrupt(_) | crate::store::Error::NewerVersion { .. }),
            ) => Ok(Err(Damaged(e.to_string()))),
            Err(e) => Err(Io::failed("call key", id, e)),
        }
    }

    /// The model's reply, under its shared rate limit when its profile has one: a call the
    /// limit has no room for (before it, or a provider's 429 after it) is deferred.
    async fn model_call(
        &mut self,
        id: &str,
        req: &crate::kernel::ModelRequest<'_>,
    ) -> Result<Answer, CommitFail> {
        let (ctx, now) = (self.ctx, (self.ctx.clock)());
        if let Some(cap) = self.capacity.as_mut() {
            let store = &*ctx.store;
            match store_io(store, || cap.before(store, req, now)) {
                Ok(Gate::Go) => {}
                Ok(Gate::Wait(t)) => return Ok(Answer::Deferred(t)),
                Err(e) => return Err(Io::failed("model's rate limit", id, e)),
            }
        }
        pass(ctx, Point::ModelCall)?;
        let Some(reply) = unless_stopping(ctx, self.model.ask(req)).await else {
            return Ok(Answer::Dropped);
        };
        observe_model(id, req.step, &self.model_label, &reply);
        let busy = self.model.busy();
        if let Some(cap) = self.capacity.as_mut() {
            let (store, now) = (&*ctx.store, (ctx.clock)());
            match store_io(store, || cap.after(store, &reply, busy, now)) {
                Ok(Gate::Go) => {}
                Ok(Gate::Wait(t)) => return Ok(Answer::Deferred(t)),
                Err(e) => return Err(Io::failed("model's rate limit", id, e)),
            }
        }
        Ok(Answer::Model(reply, self.model.prompt_id()))
    }

    /// Commits `c` under this run's claim; a final commit claims this thread's next task in
    /// the same transaction, unless the daemon is shutting down.
    async fn commit(
        &mut self,
        id: &str,
        c: &Commit,
        now: u64,
    ) -> Result<CommitOutcome, CommitFail> {
        let ctx = self.ctx;
        // A claim folded into a final commit takes the queue's head as it is: not made while
        // the daemon passes over a profile's tasks (its key is missing).
        let claim_next = (matches!(c.kind, crate::store::CommitKind::Final(_))
            && !ctx.shutdown.load(Ordering::SeqCst)
            && ctx.trusted.missing_keys().is_empty())
        .then(|| ctx.identity.lease(now, ctx.lease_ms));
        let commit = crate::store::Commit {
            task_id: id.to_string(),
            token: self.token,
            kind: c.kind,
            state: c.state.clone(),
            next_span_id: c.next_span_id,
            spans: c.spans.clone(),
            reply: c.reply.clone(),
            call: c.call.clone(),
            now_ms: now,
            lease_ms: ctx.lease_ms,
            clear_settle: c.clear_settle,
            claim_next,
            export: ctx.export,
            callback: c.callback.clone(),
            not_before_ms: c.not_before_ms,
        };
        let mut outcome = ctx.committer.commit_async(commit).await?;
        if let Some(next) = outcome.next.take() {
            self.next = Some(next);
        }
        Ok(outcome)
    }

    /// Sends a call on its route: a write only through its proof of the claim, which the
    /// route asks as the last step before the request's first byte.
    async fn send(
        &mut self,
        id: &str,
        send: super::machine::Send<'_>,
    ) -> Result<ToolReply, CommitFail> {
        let ctx = self.ctx;
        let proof = send
            .proof
            .then(|| Arc::new(Proof::new(ctx, id, self.token)));
        let gate = proof.clone().map(|p| -> crate::kernel::io::Gate { p });
        let mut req = send.request;
        req.gate = gate.as_ref();
        let reply = self.routes.call(&req).await;
        if let Some(e) = proof.and_then(|p| p.refusal()) {
            tracing::warn!(task = %id, key = %req.key, "the claim could not be proved; the write was not sent and the run stops");
            return Err(e);
        }
        observe_tool(id, req.key, &req.call.name, &reply);
        pause(ctx.time_scale, reply.latency_ms).await;
        pass(ctx, Point::Sent)?;
        Ok(reply)
    }

    /// Completes a cancel asked for while the run went on; one that cannot be completed now
    /// is left requested (the task's next run stops before anything runs).
    fn complete_cancel(&self, id: &str, now: u64) -> bool {
        match self.io(|| crate::operator::complete_requested_cancel(&*self.ctx.store, id, now)) {
            Ok(done) => done,
            Err(e) => {
                tracing::warn!(task = %id, error = %e, "cannot complete the requested cancel now");
                false
            }
        }
    }
}

/// Runs `f`, which uses `store`: in place on a local file, whose reads take microseconds; off
/// the executor's threads with a database server's blocking client.
fn store_io<T>(store: &dyn crate::store::Backend, f: impl FnOnce() -> T) -> T {
    if store.local_owners() {
        f()
    } else {
        super::blocking(f)
    }
}

/// `work`, unless the daemon begins stopping first (`None`). For waits that hold nothing
/// durable (a model call, its retries' backoffs): at shutdown they are dropped, not waited for.
async fn unless_stopping<T>(
    ctx: &Context,
    work: impl std::future::Future<Output = T>,
) -> Option<T> {
    let mut stopping = std::pin::pin!(ctx.stopping.notified());
    // Registered before the flag is read: a stop signalled in between is not missed.
    stopping.as_mut().enable();
    if ctx.shutdown.load(Ordering::SeqCst) {
        return None;
    }
    let mut work = std::pin::pin!(work);
    std::future::poll_fn(|cx| {
        if let std::task::Poll::Ready(v) = work.as_mut().poll(cx) {
            return std::task::Poll::Ready(Some(v));
        }
        stopping.as_mut().poll(cx).map(|()| None)
    })
    .await
}
