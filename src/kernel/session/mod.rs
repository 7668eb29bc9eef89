//! The step machine: one task's agent loop as a sans-IO state machine.
//!
//! A driver calls [`Session::poll`] and gets an [`Action`]: call the model with this view, call
//! this tool with this key, a step has ended (commit now), or the run has finished. It feeds the
//! model's reply back with [`Session::on_model`] and the tool's result with
//! [`Session::on_tool`]. Time enters only as the latency a driver reports, so the same replies
//! and latencies always give the same state, spans and figures, in memory or on redb.
//!
//! The transitions are the design reference's `run`, `execute` and `resume`: budgets are checked before
//! every model call (the token check is pessimistic: next view plus output cap), the remaining
//! active time is the timeout of every call, a repeated (tool, args) and a flat progress
//! signature end the run, and every end is a [`StopReason`].

use serde_json::{Value, json};

use crate::kernel::catalog::{Access, Catalog, check_args};
use crate::kernel::json::dumped_len;
use crate::kernel::reply::{RawReply, Reply, parse_owned};
use crate::kernel::state::{Budget, LastTurn, Status, StopReason, TaskState, ToolCall, est_tokens};
use crate::kernel::trace::{SpanKind, Trace};

mod plan;
mod stop;
mod tool;
mod turn;

pub use super::io::{
    Action, InputStyle, Keys, ModelError, ModelReply, ModelRequest, ResponseInfo, ToolReply,
    ToolRequest, Turn, TurnCall, Usage,
};

/// Where a session stands between polls.
enum Phase {
    /// Start of `run`: open the task span.
    Begin,
    /// Top of the loop: render the view and check the budgets.
    Top,
    /// A step ended: check the budgets, then report the boundary (or the end).
    StepClosed,
    /// The held call of a resumed task ran and the run goes on: report the boundary.
    HeldDone,
    /// View rendered, budgets fine: open the step and ask the model.
    Ready,
    AwaitModel,
    AwaitTool {
        call: ToolCall,
        key: String,
        timeout_ms: u64,
        span: u32,
        held: bool,
    },
    Finished(StopReason),
}

/// How a run begins.
#[derive(Clone, Debug, PartialEq)]
pub enum Run {
    /// A new run (or one continuing after a crash): the loop from the top.
    Start,
    /// A suspended or held task goes on: its held call is sent first, under its own key.
    Resume,
    /// An operator settled the held call (rejected, or recorded as applied): this result is
    /// folded in as its answer; nothing is sent and no tool call is counted.
    Settled(Value),
}

/// One run (or resumed run) of one task.
pub struct Session<'c> {
    keys: Keys,
    state: TaskState,
    budget: Budget,
    catalog: &'c Catalog,
    trace: Trace,
    phase: Phase,
    view: String,
    view_tokens: u64,
    /// JSON texts of the last result and the facts, kept between views (see [`turn::Written`]).
    written: turn::Written,
    /// How much more input a provider has counted than the 4-characters estimate, at most, in
    /// this run (1.0 until a provider reports usage). The pessimistic check scales the next
    /// view's estimate by it, so provider counts do not slip past the token budget.
    input_scale: f64,
    root: Option<u32>,
    step_span: u32,
    model_span: u32,
    resume_span: Option<u32>,
    /// What counts as progress (see [`TaskState::progress_text`]) at the start of the current
    /// step, and so at the end of the previous one.
    progress: String,
    /// The same at the end of this step, written into a buffer kept between steps.
    progress_now: String,
    /// How the model takes its input (set by the driver from the model).
    input: InputStyle,
    /// What the first call of this step's turn is answered with, when that is not the last
    /// result (an accepted plan).
    turn_answer: Option<Value>,
    /// Consecutive steps of this run whose model call failed.
    model_failures: u32,
    /// This step's read was one the task had not made before and it succeeded: progress for
    /// a model that takes messages (a real agent reading one customer after another), though
    /// no fact or plan step changed. The design reference's models keep its rule.
    new_read: bool,
}

impl<'c> Session<'c> {
    /// Starts (or continues) the loop on `state` with the design reference's keys. Spans are numbered
    /// from `first_span_id`.
    pub fn start(
        state: TaskState,
        budget: Budget,
        catalog: &'c Catalog,
        first_span_id: u32,
    ) -> Self {
        Session::begin(
            Run::Start,
            state,
            budget,
            catalog,
            first_span_id,
            Keys::document(),
        )
    }

    /// Continues a suspended (or held) task: its held call runs first under its original call
    /// key, then the loop continues. With no held call this is [`Session::start`].
    pub fn resume(
        state: TaskState,
        budget: Budget,
        catalog: &'c Catalog,
        first_span_id: u32,
    ) -> Self {
        Session::begin(
            Run::Resume,
            state,
            budget,
            catalog,
            first_span_id,
            Keys::document(),
        )
    }

    /// Continues a task whose held call an operator settled without running it (rejected, or
    /// recorded as applied): `result` is folded in as that call's result, then the loop goes on.
    pub fn resume_settled(
        state: TaskState,
        budget: Budget,
        catalog: &'c Catalog,
        first_span_id: u32,
        result: Value,
    ) -> Self {
        Session::begin(
            Run::Settled(result),
            state,
            budget,
            catalog,
            first_span_id,
            Keys::document(),
        )
    }

    /// A run of any kind under a key policy.
    pub fn begin(
        run: Run,
        mut state: TaskState,
        budget: Budget,
        catalog: &'c Catalog,
        first_span_id: u32,
        keys: Keys,
    ) -> Self {
        let held = match run {
            Run::Start => None,
            Run::Resume | Run::Settled(_) => state.pending.take(),
        };
        let mut s = Session::new(state, budget, catalog, first_span_id, Phase::Begin, keys);
        let Some(call) = held else {
            return s;
        };
        let t = s.state.elapsed_ms;
        match run {
            Run::Start => {}
            Run::Resume => {
                let rid = s
                    .trace
                    .start(SpanKind::Resume, "execute held call", None, t);
                s.resume_span = Some(rid);
                // The held call is a tool call like any other: it may not break the budget.
                let spent = if s.state.tool_calls >= s.budget.tool_calls_max {
                    Some(StopReason::MaxToolCalls)
                } else if s.state.elapsed_ms >= s.budget.deadline_ms {
                    Some(StopReason::Deadline)
                } else {
                    None
                };
                if let Some(stop) = spent {
                    s.trace.end(rid, stop.as_str(), t);
                    s.state.pending = Some(call); // still held: it was not sent
                    s.finish(stop, None);
                } else {
                    s.open_tool(call, rid, true);
                }
            }
            Run::Settled(result) => {
                let rid = s
                    .trace
                    .start(SpanKind::Resume, "settled held call", None, t);
                s.resume_span = Some(rid);
                s.open_tool(call, rid, true);
                // Nothing is sent: the result is the operator's decision, taking no active
                // time and no tool call (the call was counted when it was sent, if it was).
                s.fold_tool(
                    ToolReply {
                        result,
                        latency_ms: 0,
                    },
                    false,
                );
            }
        }
        s
    }

    fn new(
        state: TaskState,
        budget: Budget,
        catalog: &'c Catalog,
        first_span_id: u32,
        phase: Phase,
        keys: Keys,
    ) -> Self {
        let mut progress = String::with_capacity(128);
        state.progress_text(&mut progress);
        Session {
            keys,
            state,
            budget,
            catalog,
            trace: Trace::new(first_span_id),
            phase,
            view: String::with_capacity(512),
            view_tokens: 0,
            written: turn::Written::default(),
            input_scale: 1.0,
            root: None,
            step_span: 0,
            model_span: 0,
            resume_span: None,
            progress_now: String::with_capacity(progress.capacity()),
            progress,
            input: InputStyle::View,
            turn_answer: None,
            model_failures: 0,
            new_read: false,
        }
    }

    /// Tells the session how its model takes its input: the design reference's view, or messages
    /// (see [`InputStyle`]); the token check then counts what the messages add.
    pub fn set_input(&mut self, style: InputStyle) {
        self.input = style;
    }

    pub fn state(&self) -> &TaskState {
        &self.state
    }

    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    pub fn trace_mut(&mut self) -> &mut Trace {
        &mut self.trace
    }

    pub fn into_parts(self) -> (TaskState, Trace) {
        (self.state, self.trace)
    }

    /// The next thing the driver must do. Calling it again without feeding a result returns
    /// the same request.
    pub fn poll(&mut self) -> Action<'_> {
        loop {
            match self.phase {
                Phase::Begin => self.open_run(),
                Phase::Top => {
                    if let Some(stop) = self.check_budget() {
                        self.finish(stop, None);
                    } else {
                        self.phase = Phase::Ready;
                    }
                }
                Phase::StepClosed => {
                    if let Some(stop) = self.check_budget() {
                        self.finish(stop, None);
                    } else {
                        self.phase = Phase::Ready;
                        return Action::StepEnd;
                    }
                }
                Phase::HeldDone => {
                    self.phase = Phase::Begin;
                    return Action::StepEnd;
                }
                Phase::Ready => self.open_step(),
                Phase::AwaitModel => {
                    return Action::Model(ModelRequest {
                        view: &self.view,
                        goal: &self.state.goal,
                        conversation: self.state.conversation_tail(),
                        last_turn: self.state.last_turn.as_ref(),
                        step: self.state.step,
                        output_tokens_max: self.budget.output_tokens_max,
                        expected_tokens: self
                            .expected_input()
                            .saturating_add(u64::from(self.budget.output_tokens_max)),
                        timeout_ms: self.remaining_ms(),
                    });
                }
                Phase::AwaitTool {
                    ref call,
                    ref key,
                    timeout_ms,
                    held,
                    ..
                } => {
                    let spec = self.catalog.get(&call.name);
                    return Action::Tool(ToolRequest {
                        call,
                        key,
                        user_id: &self.state.user_id,
                        timeout_ms,
                        access: spec.map_or(Access::Write, |s| s.access),
                        idempotent: spec.is_some_and(|s| s.idempotent),
                        held,
                        approval: None,
                        gate: None,
                    });
                }
                Phase::Finished(stop) => return Action::Finished(stop),
            }
        }
    }

    /// A run begins: the task is running again, under a new task span.
    fn open_run(&mut self) {
        self.state.status = Status::Running;
        self.state.stop = None;
        let t = self.state.elapsed_ms;
        let task = self.state.task_id.clone();
        self.root = Some(self.trace.start(SpanKind::Task, task, None, t));
        self.phase = Phase::Top;
    }

    /// A step begins with its model call.
    fn open_step(&mut self) {
        self.state.step += 1;
        let t = self.state.elapsed_ms;
        let name = crate::kernel::trace::step_name(self.state.step);
        self.step_span = self.trace.start(SpanKind::Step, name, self.root, t);
        let model = "model.next";
        self.model_span = (self.trace).start(SpanKind::Model, model, Some(self.step_span), t);
        self.phase = Phase::AwaitModel;
    }

    /// Renders the next view and checks the budgets: `None` means another step may run.
    fn check_budget(&mut self) -> Option<StopReason> {
        self.render_view();
        let (st, b) = (&self.state, &self.budget);
        if st.step >= b.steps_max {
            Some(StopReason::MaxSteps)
        } else if st.tool_calls >= b.tool_calls_max {
            Some(StopReason::MaxToolCalls)
        } else if st.elapsed_ms >= b.deadline_ms {
            Some(StopReason::Deadline)
        } else if st
            .tokens
            .saturating_add(self.expected_input())
            .saturating_add(u64::from(b.output_tokens_max))
            > b.tokens_max
        {
            Some(StopReason::MaxTokens)
        } else {
            None
        }
    }

    fn expected_input(&self) -> u64 {
        (self.view_tokens as f64 * self.input_scale).ceil() as u64
    }

    fn remaining_ms(&self) -> u64 {
        self.budget
            .deadline_ms
            .saturating_sub(self.state.elapsed_ms)
    }

    /// Folds in the model's reply to the request of [`Action::Model`].
    pub fn on_model(&mut self, reply: ModelReply) {
        if !matches!(self.phase, Phase::AwaitModel) {
            debug_assert!(false, "on_model without a model request");
            return;
        }
        let remaining = self.remaining_ms();
        let step = self.state.step;
        self.turn_answer = None;
        self.state.last_turn = reply.turn.map(|turn| LastTurn {
            step,
            turn,
            results: Vec::new(),
        });
        let raw = match reply.outcome {
            Err(ModelError::Timeout) => None,
            _ if reply.latency_ms > remaining => None,
            Ok(raw) => Some(raw),
            Err(e) => {
                self.on_model_error(e, reply.latency_ms, reply.usage);
                return;
            }
        };
        let Some(raw) = raw else {
            // The model call would outlive the deadline: stop at the deadline exactly.
            self.state.elapsed_ms = self.budget.deadline_ms.max(self.state.elapsed_ms);
            let t = self.state.elapsed_ms;
            self.trace.end(self.model_span, "deadline", t);
            self.trace.end(self.step_span, "deadline", t);
            self.finish(StopReason::Deadline, None);
            return;
        };
        self.model_failures = 0;
        let too_long = self.charge_model(&raw, reply.usage, reply.latency_ms);
        let parsed = if too_long {
            Err(format!(
                "reply is longer than the output cap of {} tokens",
                self.budget.output_tokens_max
            ))
        } else {
            parse_owned(raw)
        };
        let stop = match parsed {
            Err(detail) => {
                // The call answered, but with nothing the task could use: an error span.
                self.trace.get_mut(self.model_span).status = "invalid_reply".into();
                self.set_result(
                    json!({"status": "error", "code": "invalid_reply", "detail": detail}),
                );
                None
            }
            Ok(Reply::Final { outcome, text }) => match self.completion_refused(&outcome) {
                Some(refusal) => {
                    self.set_result(refusal);
                    None
                }
                None => {
                    let t = self.state.elapsed_ms;
                    self.trace.end(self.step_span, "ok", t);
                    self.state.outcome = outcome;
                    self.finish(StopReason::Done, Some(text));
                    return;
                }
            },
            Ok(Reply::Plan { steps }) => {
                self.on_plan(&steps);
                None
            }
            Ok(Reply::Tool(call)) => match self.propose(call) {
                Ok(()) => return,
                Err(stop) => stop,
            },
        };
        self.end_step(stop);
    }

    /// Charges a model reply's time and tokens (the provider's count, else an estimate, at
    /// most the output cap) and ends its span; whether the reply was over the cap.
    fn charge_model(&mut self, raw: &RawReply, usage: Option<Usage>, latency_ms: u64) -> bool {
        let tin = usage.map_or(self.view_tokens, |u| u.input_tokens);
        if self.view_tokens > 0 && tin > self.view_tokens {
            self.input_scale = self.input_scale.max(tin as f64 / self.view_tokens as f64);
        }
        let estimated_out = match raw {
            RawReply::Json(v) => est_tokens(dumped_len(v)),
            RawReply::Move(m) => est_tokens(m.json_len()),
            RawReply::Text(t) | RawReply::Invalid(t) => est_tokens(t.chars().count()),
        };
        let mut tout = usage.map_or(estimated_out, |u| u.output_tokens);
        let cap = self.budget.output_tokens_max as u64;
        // A reply longer than the output cap is what a provider would have cut off: it counts
        // as the cap and is rejected, so the token bound holds for any model.
        let too_long = tout > cap;
        if too_long {
            tout = cap;
        }
        // Saturating: a provider may report any number, and a wrapped count would let a task
        // run on past its token budget.
        self.state.elapsed_ms = self.state.elapsed_ms.saturating_add(latency_ms);
        self.state.tokens = self.state.tokens.saturating_add(tin.saturating_add(tout));
        let t = self.state.elapsed_ms;
        let span = self.trace.get_mut(self.model_span);
        span.tin = Some(tin);
        span.tout = Some(tout);
        self.trace.end(self.model_span, "ok", t);
        too_long
    }

    /// A tool call the model proposed: sent to its tool (`Ok`), or refused before anything
    /// is sent, with the stop the step ends in, if any.
    fn propose(&mut self, mut call: ToolCall) -> Result<(), Option<StopReason>> {
        let fp = call.digest();
        let n = self.state.seen.entry(fp).or_insert(0);
        *n += 1;
        if *n > self.budget.repeat_max {
            return Err(Some(StopReason::RepeatedCall));
        }
        let Some(spec) = self.catalog.get(&call.name) else {
            self.set_result(json!({"status": "error", "code": "unknown_tool"}));
            return Err(None);
        };
        // Refused before any call: nothing is sent, so no tool call is counted.
        let refusal = match check_args(spec, &call.args, &self.state.user_id) {
            Err(detail) => json!({"status": "error", "code": "invalid_args", "detail": detail}),
            // The key of a write is the plan step's: a write that names no step of the plan
            // (or one of another tool) would get a key the model chose.
            Ok(()) => match self.check_plan_step(&mut call) {
                Err((code, detail)) => json!({"status": "error", "code": code, "detail": detail}),
                Ok(()) if spec.asks_person => match super::person::check_asked(&call.args) {
                    Err(detail) => {
                        json!({"status": "error", "code": "invalid_args", "detail": detail})
                    }
                    Ok(()) => {
                        self.ask_person(call);
                        return Ok(());
                    }
                },
                Ok(()) => {
                    self.open_tool(call, self.step_span, false);
                    return Ok(());
                }
            },
        };
        self.set_result(refusal);
        self.write_failed(&call.name);
        Err(None)
    }

    fn end_step(&mut self, mut stop: Option<StopReason>) {
        self.answer_turn();
        self.progress_now_text();
        let new_read = std::mem::take(&mut self.new_read);
        if self.progress_now != self.progress {
            self.state.stalls = 0;
            std::mem::swap(&mut self.progress, &mut self.progress_now);
        } else if new_read {
            self.state.stalls = 0;
        } else if stop != Some(StopReason::NeedsAnswer) {
            // (A step that asks a person waits for something new; it is no stall.)
            self.state.stalls += 1;
        }
        if stop.is_none() && self.state.stalls >= self.budget.stalls_max {
            // Steps that failed at the model made no progress because there was no move:
            // the stop says so when every stalled step of this run was one.
            stop = Some(if self.model_failures >= self.state.stalls {
                StopReason::ModelFailed
            } else {
                StopReason::NoProgress
            });
        }
        let t = self.state.elapsed_ms;
        self.trace
            .end(self.step_span, stop.map_or("ok", StopReason::as_str), t);
        match stop {
            Some(stop) => self.finish(stop, None),
            None => self.phase = Phase::StepClosed,
        }
    }

    fn finish(&mut self, stop: StopReason, answer: Option<String>) {
        self.state.stop = Some(stop);
        self.state.answer = answer;
        self.state.status = if stop.suspends() {
            Status::Suspended
        } else {
            Status::Stopped
        };
        if let Some(root) = self.root {
            let t = self.state.elapsed_ms;
            self.trace.end(root, stop.as_str(), t);
        }
        self.phase = Phase::Finished(stop);
    }
}
