//! The durable step's commits: what each carries, and what the run does once it landed.

use super::{Ended, Machine, Phase, write::Pending};
use crate::kernel::{Span, StopReason, TaskState};
use crate::model::RecordedReply;
use crate::store::{CallRecord, CommitKind, CommitOutcome};

/// A commit as the machine makes it; the driver adds the claim's token, the time, the lease
/// and, for a final commit, the claim of the next task.
#[derive(Clone, Debug)]
pub struct Commit {
    pub kind: CommitKind,
    pub state: TaskState,
    pub next_span_id: u32,
    pub spans: Vec<Span>,
    pub reply: Option<RecordedReply>,
    pub call: Option<CallRecord>,
    pub clear_settle: bool,
    pub callback: Option<crate::store::Callback>,
    pub not_before_ms: Option<u64>,
}

/// What follows a commit once it landed.
pub(super) enum After {
    /// A write's intent: the write goes on.
    Intent(Pending),
    /// A step: the run goes on, unless a cancel was asked for or the wall-clock deadline
    /// passed meanwhile.
    Step,
    /// The run's last commit, with its stop.
    Final(StopReason),
    /// The run ends so.
    Ended(Ended),
}

impl<'c> Machine<'c> {
    /// Asks for `c`, to be followed by `after`.
    pub(super) fn commit(&mut self, c: Commit, after: After) {
        self.out = Some(c);
        self.phase = Phase::Committing(after);
    }

    /// A commit of the session as it stands, with `reply` and `call`, the spans changed
    /// since the last commit (and those an earlier run left open, once), and `callback`.
    pub(super) fn step_commit(
        &mut self,
        kind: CommitKind,
        reply: Option<RecordedReply>,
        call: Option<CallRecord>,
        callback: Option<crate::store::Callback>,
    ) -> Commit {
        let (state, next_span_id, mut spans) = match self.session.as_mut() {
            Some(s) => (
                s.state().clone(),
                s.trace().next_id(),
                s.trace_mut().take_changed(),
            ),
            None => (self.rec.state.clone(), self.rec.next_span_id, Vec::new()),
        };
        spans.append(&mut self.interrupted);
        Commit {
            kind,
            state,
            next_span_id,
            spans,
            reply,
            call,
            clear_settle: self.clear_settle,
            callback,
            not_before_ms: None,
        }
    }

    /// A step ended: its commit (or, at shutdown, the task handed back).
    pub(super) fn step_end(&mut self) {
        let (reply, call) = (self.step_reply.take(), self.step_call.take());
        if self.shutdown {
            let c = self.step_commit(CommitKind::Release, reply, call, None);
            return self.commit(c, After::Ended(Ended::Released));
        }
        let c = self.step_commit(CommitKind::Step, reply, call, None);
        self.commit(c, After::Step);
    }

    /// The run ended with `stop`: its last commit, with the callback it queues when the task
    /// names a callback URL (the task's result as this commit leaves it).
    pub(super) fn finished(&mut self, stop: StopReason, now_ms: u64) {
        let (reply, call) = (self.step_reply.take(), self.step_call.take());
        let callback = self.rec.callback_url.as_ref().and_then(|_| {
            let mut after = self.rec.clone();
            after.state = self.state().clone();
            after.status = crate::store::QueueStatus::after(stop);
            after.updated_at_ms = now_ms;
            after.lease = None;
            crate::store::callbacks::event(&self.db_id, &after, now_ms)
        });
        let c = self.step_commit(CommitKind::Final(stop), reply, call, callback);
        self.commit(c, After::Final(stop));
    }

    /// The commit asked for landed, with `outcome`, at `now_ms`.
    pub fn on_committed(&mut self, outcome: &CommitOutcome, now_ms: u64) {
        let Phase::Committing(_) = &self.phase else {
            return super::unexpected_answer("a commit's outcome");
        };
        let Phase::Committing(after) = std::mem::replace(&mut self.phase, Phase::Session) else {
            return;
        };
        let landed = self.out.take();
        match after {
            After::Intent(p) => self.after_intent(p, now_ms),
            After::Step => {
                // The state a yield to capacity gives back: this commit's.
                self.boundary = landed.map(|c| (c.state, c.next_span_id));
                let Some(session) = self.session.as_mut() else {
                    return;
                };
                if let Some(why) = &outcome.cancel_requested {
                    tracing::info!(task = %self.rec.id, reason = %why, "cancel requested");
                    session.cancel();
                } else if let Some(stop) = self.rec.time_limits.passed(true, now_ms) {
                    tracing::info!(task = %self.rec.id, stop = %stop, "the task's wall-clock deadline passed");
                    session.stop_with(stop);
                }
            }
            After::Final(stop) => {
                // A cancel asked for while the run went on, which ended waiting rather than at
                // a step boundary: it takes effect now, not when an operator next decides.
                let waiting = stop.suspends() || stop == StopReason::UnknownOutcome;
                self.phase = if waiting && outcome.cancel_requested.is_some() {
                    Phase::Cancelling(stop)
                } else {
                    Phase::Done(Ended::Stopped(stop))
                };
            }
            After::Ended(e) => self.phase = Phase::Done(e),
        }
    }

    /// The requested cancel was completed (`true`), or not (left requested: the task's next
    /// run stops before anything runs).
    pub fn on_cancel_completed(&mut self, done: bool) {
        let Phase::Cancelling(stop) = self.phase else {
            return super::unexpected_answer("a completed cancel");
        };
        self.phase = Phase::Done(Ended::Stopped(if done {
            tracing::info!(task = %self.rec.id, "cancel requested during the run; cancelled");
            StopReason::Cancelled
        } else {
            stop
        }));
    }
}
