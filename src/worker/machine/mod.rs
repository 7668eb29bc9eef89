//! The durable step as a machine of its own: one run of one claimed task, the kernel's
//! session inside, as a sans-IO state machine (the shape of quinn-proto, which the kernel
//! already follows). It does no I/O and reads no clock: [`Machine::poll`] returns the next
//! thing the run needs ([`Need`]: read what an earlier run recorded, ask the model, commit an
//! intent, send a call, commit a step, complete a cancel, end), and the `on_*` methods feed the
//! answers back. Time enters as the `now_ms` each poll and answer is given. Every decision of
//! the exactly-once protocol is made here, once, for every driver (the daemon, the simulation,
//! the tests):
//!
//! - **Stop at the start** when the task was cancelled while its worker was gone, or a time
//!   limit passed while it waited; a write a crashed run may have sent (its intent without a
//!   result) stays held beside that stop, never sent; a run that stops sends nothing.
//! - **Resume from a recorded reply**: the first step of a rerun folds in the reply a crashed
//!   run recorded for it instead of asking the model again, so the step proposes the same call
//!   under the same key.
//! - **Intent before a write** (`write.rs`); a write whose intent has no result is sent again
//!   only when its tool is idempotent, otherwise held (`unknown_outcome`); a damaged call
//!   record holds its call; on a route without an idempotency key (MCP) a write already
//!   answered under its key is answered from its record, never sent.
//! - **Approval rules for every route in one place**: a call the catalog's rule or an MCP
//!   tool's covers is held before anything is sent, until an operator approves exactly it; an
//!   approved call carries its approval.
//! - **A write is sent only under a proof of the claim** ([`Send::proof`]): the driver proves
//!   the claim as the last step before the request's first byte (`driver::Proof`).
//! - **Commits** (`commit.rs`): a step's state, spans, reply and call record together; the
//!   last with its stop and the callback it queues; a release at shutdown or to wait for the
//!   model's capacity; a cancel asked for while the run went on completed when it ends waiting.
//!
//! The call is hashed once (its digest, which approvals and call records bind to).

mod commit;
mod write;

use crate::kernel::{
    Action, Catalog, InputStyle, Keys, ModelReply, ModelRequest, Run, Session, Span, StopReason,
    TaskState,
};
use crate::model::RecordedReply;
use crate::store::{CallRecord, CommitKind, TaskRecord};

pub use commit::Commit;
pub use write::Send;

/// What the run needs next.
pub enum Need<'a> {
    /// The task's call records (`on_calls`): the run stops at its start, and a write in
    /// flight must be found first.
    Calls,
    /// The spans an earlier run left open (`on_spans`), which this run ends as interrupted.
    Spans,
    /// The reply recorded for step `step`, if a run got that far (`on_reply`): for the first
    /// step of a rerun (`first_step`), or for the held call's step of a resumed run.
    Reply { step: u32, first_step: bool },
    /// The model's reply (`on_model`; `on_model_deferred` when its rate limit says wait).
    Model(ModelRequest<'a>),
    /// The call record under `key` (`on_call`), before a write's intent.
    Call { key: &'a str },
    /// A commit (`on_committed`); the driver adds the claim's token, the time, the lease and,
    /// for a final commit, the claim of its next task.
    Commit(&'a Commit),
    /// A tool call to send (`on_sent`).
    Send(Send<'a>),
    /// A cancel asked for while the run went on, which ended waiting, to complete now
    /// (`on_cancel_completed`).
    CompleteCancel,
    /// The run is over.
    Ended(Ended),
}

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// With a stop reason (finished, suspended or held); `cancelled` when a cancel asked for
    /// during the run was completed after it ended waiting.
    Stopped(StopReason),
    /// Handed back at shutdown.
    Released,
    /// Handed back to wait for its model's capacity.
    Yielded,
}

/// A record that exists but cannot be read: why.
#[derive(Clone, Debug)]
pub struct Damaged(pub String);

/// Where the run stands between polls.
enum Phase {
    /// Not started: whether it stops at once is decided first.
    Start,
    /// The call records are read, for a run that stops at its start.
    Calls(StopReason),
    /// The spans an earlier run left open are read.
    Spans,
    /// The reply of the held call's step is read, for a resumed run.
    StepReply,
    /// The session drives.
    Session,
    /// The first model request of a rerun: its recorded reply is read.
    Recorded,
    /// The model is asked.
    Model,
    /// A tool call in progress (see `write::Call`).
    Tool(write::Call),
    /// A commit is out; what follows it.
    Committing(commit::After),
    /// A requested cancel is completed.
    Cancelling(StopReason),
    Done(Ended),
}

/// One run of one claimed task.
pub struct Machine<'c> {
    rec: TaskRecord,
    db_id: String,
    catalog: &'c Catalog,
    input: InputStyle,
    /// Made once the run knows whether it stops at its start.
    session: Option<Session<'c>>,
    phase: Phase,
    shutdown: bool,
    /// The run's first model call may find its reply recorded by a crashed run.
    first_model_call: bool,
    /// Spans a crashed run left open, ended as "interrupted" by this run's first commit.
    interrupted: Vec<Span>,
    /// The call record of the step in progress (its write's intent, then its result).
    step_call: Option<CallRecord>,
    /// The reply of the step in progress, with what its tools answered.
    step_reply: Option<RecordedReply>,
    /// The commits of this run clear the operator's settlement it folded in.
    clear_settle: bool,
    /// The run resumes the held call (its step's recorded reply is read first).
    resumed: bool,
    /// The state and span counter of the last step commit (`None`: as claimed), which a
    /// yield to capacity commits back: the step in progress is not taken.
    boundary: Option<(TaskState, u32)>,
    /// The commit being asked for.
    out: Option<Commit>,
    /// Polls left: a kernel bug becomes the end of the run, not a loop.
    polls_left: usize,
}

impl<'c> Machine<'c> {
    /// A run of the claimed task `rec` in the database `db_id`, with its catalog as the
    /// daemon's config resolved it and its model's input style.
    pub fn new(rec: TaskRecord, db_id: &str, catalog: &'c Catalog, input: InputStyle) -> Self {
        let polls_left = 64 * (rec.budget.steps_max as usize + 4);
        Machine {
            rec,
            db_id: db_id.to_string(),
            catalog,
            input,
            session: None,
            phase: Phase::Start,
            shutdown: false,
            first_model_call: true,
            interrupted: Vec::new(),
            step_call: None,
            step_reply: None,
            clear_settle: false,
            resumed: false,
            boundary: None,
            out: None,
            polls_left,
        }
    }

    /// The task as claimed.
    pub fn record(&self) -> &TaskRecord {
        &self.rec
    }

    /// The run's state now (as claimed, before the run begins).
    pub fn state(&self) -> &TaskState {
        self.session.as_ref().map_or(&self.rec.state, |s| s.state())
    }

    /// The daemon is stopping: the run hands the task back at its next boundary (at once,
    /// before it started).
    pub fn shut_down(&mut self) {
        self.shutdown = true;
    }

    /// What the run needs next, at `now_ms`. Polling again without an answer asks again.
    pub fn poll(&mut self, now_ms: u64) -> Need<'_> {
        self.polls_left = self.polls_left.saturating_sub(1);
        if self.polls_left == 0 && !matches!(self.phase, Phase::Done(_)) {
            debug_assert!(false, "a run polled more often than its budget allows");
            tracing::error!(task = %self.rec.id, "the run took more actions than its budget allows; it stops here");
            self.phase = Phase::Done(Ended::Released);
        }
        // Each turn moves the run on without I/O, until it needs an answer.
        for _ in 0..64 {
            let moved = match &self.phase {
                Phase::Start => self.start(now_ms),
                Phase::Session => self.advance(now_ms),
                _ => false,
            };
            if !moved {
                break;
            }
        }
        self.need()
    }

    /// The need of the phase the run is in.
    fn need(&mut self) -> Need<'_> {
        match &self.phase {
            Phase::Start | Phase::Session => {
                debug_assert!(false, "a phase that moves on by itself");
                Need::Ended(Ended::Released)
            }
            Phase::Calls(_) => Need::Calls,
            Phase::Spans => Need::Spans,
            Phase::StepReply => Need::Reply {
                step: self.rec.state.step,
                first_step: false,
            },
            Phase::Recorded | Phase::Model => {
                let recorded = matches!(self.phase, Phase::Recorded);
                match self.session.as_mut().map(Session::poll) {
                    Some(Action::Model(req)) if recorded => Need::Reply {
                        step: req.step,
                        first_step: true,
                    },
                    Some(Action::Model(req)) => Need::Model(req),
                    _ => unexpected("a model phase without a model request"),
                }
            }
            Phase::Tool(_) => self.tool_need(),
            Phase::Committing(_) => match &self.out {
                Some(c) => Need::Commit(c),
                None => unexpected("a commit phase without its commit"),
            },
            Phase::Cancelling(_) => Need::CompleteCancel,
            Phase::Done(e) => Need::Ended(*e),
        }
    }

    /// The run begins: released at once at shutdown; otherwise, when it must stop at once
    /// (cancelled, a time limit), the call records are read first.
    fn start(&mut self, now_ms: u64) -> bool {
        if self.shutdown {
            let state = self.rec.state.clone();
            let next = self.rec.next_span_id;
            self.commit(
                Commit::release(state, next, None),
                commit::After::Ended(Ended::Released),
            );
            return false;
        }
        let limits = &self.rec.time_limits;
        let stop = if self.rec.cancel_requested.is_some() {
            Some(StopReason::Cancelled)
        } else {
            limits.passed(false, now_ms)
        };
        match stop {
            Some(stop) => {
                self.phase = Phase::Calls(stop);
                false
            }
            None => {
                self.begin(None);
                true
            }
        }
    }

    /// The task's call records, for a run that stops at its start: a write in flight stays
    /// held beside the stop. Damaged records: the run goes on instead, and holds that write
    /// when its recorded reply proposes it again (a damaged record is held, never sent); the
    /// stop comes at its next boundary.
    pub fn on_calls(&mut self, calls: Result<Vec<CallRecord>, Damaged>, now_ms: u64) {
        let Phase::Calls(asked) = self.phase else {
            return unexpected_answer("calls");
        };
        let calls = match calls {
            Ok(c) => c,
            Err(Damaged(why)) => {
                tracing::error!(task = %self.rec.id, error = %why, "a call record of the task cannot be read; the task runs on to hold its write before it stops");
                self.begin(None);
                return;
            }
        };
        let in_flight = self.rec.in_flight(&self.db_id, &calls);
        let started =
            self.rec.state.step > 0 || self.rec.state.pending.is_some() || in_flight.is_some();
        let stop = match asked {
            StopReason::Cancelled => Some(asked),
            _ => self.rec.time_limits.passed(started, now_ms),
        };
        match stop {
            Some(stop) => {
                tracing::info!(task = %self.rec.id, stop = %stop, "the task was cancelled or a time limit passed before it was picked up");
                self.begin(Some((stop, in_flight)));
            }
            None => self.begin(None),
        }
    }

    /// The session is made, stopped at once when `stopping` says so.
    fn begin(&mut self, stopping: Option<(StopReason, Option<crate::kernel::ToolCall>)>) {
        let resuming = self.rec.state.pending.is_some()
            && matches!(
                self.rec.state.stop,
                Some(
                    StopReason::NeedsApproval
                        | StopReason::NeedsAnswer
                        | StopReason::UnknownOutcome
                )
            );
        let run = match self.rec.settle.clone() {
            _ if !resuming => Run::Start,
            // An operator settled the held call: the decision is folded in, nothing sent.
            Some(result) => Run::Settled(result),
            // A run that stops at once sends nothing, not even its held call.
            None if stopping.is_some() => Run::Start,
            None => Run::Resume,
        };
        self.clear_settle = matches!(run, Run::Settled(_));
        self.resumed = run == Run::Resume;
        let keys = Keys::durable(self.rec.key_namespace(&self.db_id));
        let mut session = Session::begin(
            run,
            self.rec.state.clone(),
            self.rec.budget,
            self.catalog,
            self.rec.next_span_id,
            keys,
        );
        session.set_input(self.input);
        match stopping {
            Some((stop, Some(call))) => {
                tracing::warn!(task = %self.rec.id, stop = %stop, tool = %call.name, "a write was in flight when an earlier run stopped; it stays held for reconcile beside the stop");
                session.stop_holding(stop, call);
            }
            Some((stop, None)) => {
                session.stop_with(stop);
            }
            None => {}
        }
        self.session = Some(session);
        self.phase = if self.rec.runs > 1 {
            Phase::Spans
        } else if self.resumed {
            Phase::StepReply
        } else {
            Phase::Session
        };
    }

    /// The spans an earlier run left open are ended as "interrupted" (at the task's last
    /// committed active time) by this run's first commit, so a trace is a finished tree.
    pub fn on_spans(&mut self, spans: Vec<Span>) {
        if !matches!(self.phase, Phase::Spans) {
            return unexpected_answer("spans");
        }
        let at = self.rec.state.elapsed_ms;
        let next = self.rec.next_span_id;
        self.interrupted = spans
            .into_iter()
            .filter(|s| s.t1_ms.is_none() && s.id < next)
            .map(|mut s| {
                s.t1_ms = Some(at.max(s.t0_ms));
                s.status = "interrupted".into();
                s
            })
            .collect();
        self.phase = if self.resumed {
            Phase::StepReply
        } else {
            Phase::Session
        };
    }

    /// A reply recorded for the step the run needed one for: the held call's step (a resumed
    /// run joins its answer to it), or the first step of a rerun (folded in instead of asking
    /// the model). Returns, when a recorded reply was folded in as the step's model reply, the
    /// latency it took (for a driver that plays scripted time).
    pub fn on_reply(&mut self, reply: Option<RecordedReply>) -> Option<u64> {
        match self.phase {
            Phase::StepReply => {
                self.step_reply = reply;
                self.phase = Phase::Session;
                None
            }
            Phase::Recorded => match reply {
                Some(mut recorded) => {
                    let latency = recorded.latency_ms;
                    let model_reply = recorded.to_reply();
                    recorded.tools = Some(recorded.tools.take().unwrap_or_default());
                    self.step_reply = Some(recorded);
                    self.fold_model(model_reply);
                    Some(latency)
                }
                None => {
                    self.phase = Phase::Model;
                    None
                }
            },
            _ => {
                unexpected_answer("a recorded reply");
                None
            }
        }
    }

    /// The model's reply (`prompt`: the version of what it was told). Returns its latency.
    pub fn on_model(&mut self, reply: ModelReply, prompt: Option<String>) -> u64 {
        if !matches!(self.phase, Phase::Model) {
            unexpected_answer("a model reply");
            return 0;
        }
        let step = self.state().step;
        let latency = reply.latency_ms;
        let mut recorded = RecordedReply::of(step, &reply, prompt);
        recorded.tools = Some(Vec::new());
        self.step_reply = Some(recorded);
        self.fold_model(reply);
        latency
    }

    fn fold_model(&mut self, reply: ModelReply) {
        if let Some(s) = self.session.as_mut() {
            s.on_model(reply);
        }
        self.phase = Phase::Session;
    }

    /// The model must wait for capacity until `until_ms`: the task goes back to the queue as
    /// its last step commit left it, and the run ends.
    pub fn on_model_deferred(&mut self, until_ms: u64) {
        if !matches!(self.phase, Phase::Model) {
            return unexpected_answer("a deferral");
        }
        tracing::info!(task = %self.rec.id, until_ms, "waiting for the model's capacity; the task yields its worker");
        self.hand_back(Some(until_ms), Ended::Yielded);
    }

    /// The daemon is stopping while the model is asked: the wait holds nothing durable, so the
    /// task goes back to the queue as its last step commit left it (its next run asks again),
    /// and the run ends released.
    pub fn on_model_dropped(&mut self) {
        if !matches!(self.phase, Phase::Model) {
            return unexpected_answer("a dropped model call");
        }
        tracing::info!(task = %self.rec.id, "stopping: the model call is dropped and the task goes back to the queue");
        self.hand_back(None, Ended::Released);
    }

    /// The task back in the queue as its last step commit left it.
    fn hand_back(&mut self, until_ms: Option<u64>, ended: Ended) {
        let (state, next) = self
            .boundary
            .take()
            .unwrap_or_else(|| (self.rec.state.clone(), self.rec.next_span_id));
        self.commit(
            Commit::release(state, next, until_ms),
            commit::After::Ended(ended),
        );
    }

    /// One turn of the session: what it asks for next. Returns whether the run moved on by
    /// itself (and can be turned again).
    fn advance(&mut self, now_ms: u64) -> bool {
        let Some(session) = self.session.as_mut() else {
            return false;
        };
        match session.poll() {
            Action::Model(_) => {
                let rerun = std::mem::take(&mut self.first_model_call) && self.rec.runs > 1;
                self.phase = if rerun { Phase::Recorded } else { Phase::Model };
                false
            }
            Action::Tool(req) => {
                let pending = write::Pending::of(&req);
                self.on_tool(pending, now_ms)
            }
            Action::StepEnd => {
                self.step_end();
                false
            }
            Action::Finished(stop) => {
                self.finished(stop, now_ms);
                false
            }
        }
    }
}

/// A phase the machine's own bookkeeping rules out: in debug builds an assertion; in release
/// the run ends (it is recovered from its last commit, as after a crash).
fn unexpected(why: &str) -> Need<'static> {
    debug_assert!(false, "{why}");
    tracing::error!(
        reason = why,
        "the run's machine is in a phase it cannot be in; the run stops here"
    );
    Need::Ended(Ended::Released)
}

/// An answer the run did not ask for: ignored (a driver bug), noted in debug builds.
fn unexpected_answer(what: &str) {
    debug_assert!(false, "{what} the run did not ask for");
}

impl Commit {
    /// A release: the task back in the queue as `state` left it (not before `not_before_ms`).
    fn release(state: TaskState, next_span_id: u32, not_before_ms: Option<u64>) -> Commit {
        Commit {
            kind: CommitKind::Release,
            state,
            next_span_id,
            spans: Vec::new(),
            reply: None,
            call: None,
            clear_settle: false,
            callback: None,
            not_before_ms,
        }
    }
}
