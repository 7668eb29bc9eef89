//! Offline replay of a stored task: its recorded model replies and tool answers are fed to the
//! kernel again, with the operators' decisions from the audit log applied where they
//! happened; the final state is compared with the stored one, and every call the replay makes
//! with the call the run made at that point (a different call is a divergence: the kernel, or
//! its catalog, no longer takes the path it took). Replies recorded before tool answers were
//! kept are replayed against a fresh copy of the demo shop instead, and its effects
//! compared with the ones the run left. Neither needs a model provider or a tool service.

use std::collections::VecDeque;

use serde_json::{Value, json};

use crate::kernel::session::Run;
use crate::kernel::{
    Access, Action, Budget, Catalog, InputStyle, Keys, Session, StopReason, TaskState, ToolReply,
    ToolRequest,
};
use crate::model::{Model, RecordedReply, RecordedTool, Replay};
use crate::store::Event;
use crate::store::TaskRecord;
use crate::tools::{DemoStore, Effect, Tools, effects_to_python};

/// What a replay found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    pub state: TaskState,
    /// Where the tool answers came from.
    pub answers: Answers,
    /// The writes of the replay and of the run, as the design reference prints effects: with recorded
    /// answers, each write call as `(tool, digest of its arguments)`; against the design reference's
    /// store, the store's effects.
    pub effects: String,
    pub stored_effects: String,
    pub same_state: bool,
    pub same_effects: bool,
    /// The first call the replay made that the run did not make at that point, if any.
    pub divergence: Option<String>,
    /// Where the replayed state departs from the stored one: up to five JSON paths, each
    /// with the stored and the replayed value.
    pub differences: Vec<Difference>,
}

/// Where a replay's tool answers come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answers {
    /// The answers the run recorded with its replies.
    Recorded,
    /// A fresh copy of the demo shop (replies recorded before answers were kept).
    DocumentStore,
}

impl Answers {
    pub fn as_str(self) -> &'static str {
        match self {
            Answers::Recorded => "recorded",
            Answers::DocumentStore => "document_store",
        }
    }
}

/// One place where a replayed state differs from the stored one.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Difference {
    pub path: String,
    pub stored: Value,
    pub replayed: Value,
}

/// Up to `max` paths where `a` (stored) and `b` (replayed) differ, depth first.
pub fn differences(a: &Value, b: &Value, max: usize) -> Vec<Difference> {
    fn walk(path: &str, a: &Value, b: &Value, out: &mut Vec<Difference>, max: usize) {
        if out.len() >= max || a == b {
            return;
        }
        match (a, b) {
            (Value::Object(x), Value::Object(y)) => {
                let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
                keys.sort();
                keys.dedup();
                for k in keys {
                    let (va, vb) = (
                        x.get(k).unwrap_or(&Value::Null),
                        y.get(k).unwrap_or(&Value::Null),
                    );
                    walk(&format!("{path}.{k}"), va, vb, out, max);
                }
            }
            (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
                for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                    walk(&format!("{path}[{i}]"), va, vb, out, max);
                }
            }
            _ => out.push(Difference {
                path: if path.is_empty() {
                    ".".into()
                } else {
                    path.into()
                },
                stored: a.clone(),
                replayed: b.clone(),
            }),
        }
    }
    let mut out = Vec::new();
    walk("", a, b, &mut out, max);
    out
}

/// Replays `rec` from its `replies`, applying the decisions among `events` in order.
/// `stored_effects` are the demo shop's effects of the run (used only when the replies
/// carry no tool answers).
pub fn replay(
    rec: &TaskRecord,
    replies: Vec<RecordedReply>,
    events: &[Event],
    stored_effects: &[Effect],
    input: InputStyle,
    keys: Keys,
) -> ReplayReport {
    // The task's own catalog (its schema and fact fields).
    let catalog = rec
        .catalog
        .as_deref()
        .cloned()
        .unwrap_or_else(Catalog::demo);
    let mut tools = Source::of(rec, &replies, &catalog);
    let mut initial = TaskState::new(&rec.id, &rec.state.user_id, &rec.state.goal);
    initial.remembered = rec.state.remembered.clone();
    let mut model = Replay::new(replies);
    // The budget the task started with: the stored one less every extension an operator's
    // decision granted, back to the first turn's limits before any follow-up message; each
    // granted back (or set for its turn) when its event is replayed.
    let mut budget: Budget = rec.budget;
    for e in events.iter().rev() {
        match turn_budget(e, "from") {
            Some(from) => budget = from,
            None => extension(e).undo(&mut budget),
        }
    }
    let d = Decisions {
        events,
        catalog: &catalog,
        keys,
        input,
    };
    // A task cancelled while queued before it ever ran is as it was enqueued; one cancelled
    // while queued after a crash stopped at its last recorded step.
    let mut state = if d.queued_cancel(0) && model.is_done() {
        initial
    } else {
        let cancel = d.running_cancel(0) || d.queued_cancel(0);
        run_to_end(
            d.session(Run::Start, initial, budget),
            &mut model,
            &mut tools,
            cancel,
        )
    };
    for (i, ev) in events.iter().enumerate() {
        match turn_budget(ev, "budget") {
            Some(limits) => budget = limits,
            None => {
                let _ = extension(ev).apply(&mut budget);
            }
        }
        state = d.apply(i, state, budget, &mut model, &mut tools);
    }
    let same_state = state.to_json() == rec.state.to_json();
    let differences = if same_state {
        Vec::new()
    } else {
        let v = |s: &TaskState| serde_json::to_value(s).unwrap_or(Value::Null);
        differences(&v(&rec.state), &v(&state), 5)
    };
    let (answers, effects, stored, same_effects, divergence) = tools.verdict(stored_effects);
    ReplayReport {
        state,
        answers,
        effects,
        stored_effects: stored,
        same_state,
        same_effects,
        divergence,
        differences,
    }
}

/// The limits a follow-up message (`say`) set for its turn (`budget`), or those the turn
/// before it had (`from`).
fn turn_budget(e: &Event, which: &str) -> Option<Budget> {
    (e.verb == "say")
        .then(|| serde_json::from_value(e.detail[which].clone()).ok())
        .flatten()
}

/// The budget extension an operator's decision granted, if any.
fn extension(e: &Event) -> crate::operator::Extension {
    crate::operator::Extension::from_json(&e.detail["extend"])
}

/// The operators' decisions of one task, replayed where they happened, with the run as the
/// daemon made it: its key policy (which infers a call's plan step) and its model's input
/// style (which the token check counts).
struct Decisions<'a> {
    events: &'a [Event],
    catalog: &'a Catalog,
    keys: Keys,
    input: InputStyle,
}

impl<'a> Decisions<'a> {
    fn session(&self, run: Run, state: TaskState, budget: Budget) -> Session<'a> {
        let mut s = Session::begin(run, state, budget, self.catalog, 0, self.keys.clone());
        s.set_input(self.input);
        s
    }

    /// A cancel asked for while a run went on took effect at the step boundary where that
    /// run's recorded replies end; a decision that reached a task already stopped (cancelled,
    /// or queued again and then cancelled) changed nothing in it.
    fn running_cancel(&self, i: usize) -> bool {
        (self.events.get(i)).is_some_and(|e| e.verb == "cancel" && e.detail["was"] == "running")
    }

    /// Whether decision `i` came right after a follow-up message (its turn not yet run).
    fn said(&self, i: usize) -> bool {
        i > 0 && self.events.get(i - 1).is_some_and(|e| e.verb == "say")
    }

    fn queued_cancel(&self, i: usize) -> bool {
        (self.events.get(i)).is_some_and(|e| e.verb == "cancel" && e.detail["was"] == "queued")
    }

    /// The task's state after decision `i`, and after the run that decision started.
    fn apply(
        &self,
        i: usize,
        state: TaskState,
        budget: Budget,
        model: &mut Replay,
        tools: &mut Source,
    ) -> TaskState {
        let ev = &self.events[i];
        let result = ev.detail.get("result").cloned().unwrap_or(Value::Null);
        let held = state.stop == Some(StopReason::UnknownOutcome);
        let suspended = state.stop == Some(StopReason::NeedsApproval);
        let asking = state.stop == Some(StopReason::NeedsAnswer);
        // Queued again by this decision, then cancelled before a worker ran it.
        let runs = !self.queued_cancel(i + 1);
        let cancel_next = self.running_cancel(i + 1);
        let mut go = |run: Run, state: TaskState, tools: &mut Source| {
            run_to_end(self.session(run, state, budget), model, tools, cancel_next)
        };
        match ev.verb.as_str() {
            "approve" if suspended && runs => {
                if let (Some(p), Source::Document(store)) = (&state.pending, &mut *tools) {
                    store.approve(&p.name, &p.digest());
                }
                go(Run::Resume, state, tools)
            }
            "reject" if suspended && runs => {
                let result = if result.is_null() {
                    json!({"status": "rejected", "code": "rejected"})
                } else {
                    result
                };
                go(Run::Settled(result), state, tools)
            }
            "answer" if asking && runs => {
                let text = ev.detail["answer"].as_str().unwrap_or_default();
                let answer = crate::kernel::person::answer_result(text);
                go(Run::Settled(answer), state, tools)
            }
            // The message joins the state; the turn runs unless a cancel came first.
            "say" if state.status == crate::kernel::Status::Stopped => {
                let mut s = state;
                let text = ev.detail["text"].as_str().unwrap_or_default();
                if s.continue_with(text).is_err() || !runs {
                    return s;
                }
                go(Run::Start, s, tools)
            }
            "reconcile_applied" if held && runs => go(Run::Settled(result), state, tools),
            "reconcile_not_applied" if held && runs => go(Run::Resume, state, tools),
            // A write held when its task was cancelled, settled afterwards: recorded, not run.
            "reconcile_applied" | "reconcile_not_applied"
                if state.stop == Some(StopReason::Cancelled) && state.unknown_write().is_some() =>
            {
                settled_after_cancel(state, ev.verb == "reconcile_applied", result)
            }
            "cancel"
                if held
                    || suspended
                    || asking
                    || (ev.detail["was"] == "queued" && (i == 0 || self.said(i))) =>
            {
                let mut s = state;
                if held && ev.detail["was"] != "queued" {
                    s.cancelled_from = s.stop;
                }
                stopped(s, StopReason::Cancelled)
            }
            "expire" if suspended => stopped(state, StopReason::ApprovalExpired),
            "expire" if asking => stopped(state, StopReason::QuestionExpired),
            _ => state,
        }
    }
}

/// A cancelled task's held write, settled by an operator: its step done if it applied.
fn settled_after_cancel(mut s: TaskState, applied: bool, result: Value) -> TaskState {
    if applied
        && result["status"] == "ok"
        && let Some(step) = s.pending.as_ref().and_then(|c| c.plan_step.clone())
        && let Some(st) = s.plan.iter_mut().find(|st| st.id == step)
    {
        st.status = crate::kernel::StepStatus::Done;
    }
    s.pending = None;
    s.cancelled_from = None;
    s.last_result = Some(result);
    s
}

fn stopped(mut s: TaskState, why: StopReason) -> TaskState {
    s.stop = Some(why);
    s.status = crate::kernel::Status::Stopped;
    s
}

/// Whether the recorded answer only said the call needs an approval first.
fn asked_approval(a: &RecordedTool) -> bool {
    a.result["status"] == "needs_approval"
}

/// The tools of a replay.
enum Source {
    Recorded(RecordedTools),
    Document(DemoStore),
}

impl Source {
    /// The recorded answers of `replies`, or (none recorded) a fresh copy of the design reference's
    /// store with the task's simulated latencies.
    fn of(rec: &TaskRecord, replies: &[RecordedReply], catalog: &Catalog) -> Source {
        let recorded: Option<Vec<RecordedTool>> =
            replies.iter().any(|r| r.tools.is_some()).then(|| {
                replies
                    .iter()
                    .flat_map(|r| r.tools.clone().unwrap_or_default())
                    .collect()
            });
        let mut tools = match recorded {
            Some(answers) => Source::Recorded(RecordedTools {
                answers: answers.into(),
                writes: Vec::new(),
                stored_writes: Vec::new(),
                divergence: None,
            }),
            None => {
                let mut store = DemoStore::new();
                for (tool, ms) in &rec.tool_latency_ms {
                    store = store.with_latency(tool, *ms);
                }
                Source::Document(store)
            }
        };
        if let Source::Recorded(t) = &mut tools {
            t.stored_writes = t
                .answers
                .iter()
                .filter(|a| {
                    catalog
                        .get(&a.name)
                        .is_none_or(|s| s.access == Access::Write)
                })
                .filter(|a| !asked_approval(a))
                .map(|a| (a.name.clone(), a.digest.clone()))
                .collect();
        }
        tools
    }

    /// How the replay's writes compare with the run's: (where the answers came from, the
    /// replay's writes, the run's, whether they are the same, the first divergence).
    fn verdict(self, stored_effects: &[Effect]) -> (Answers, String, String, bool, Option<String>) {
        match self {
            Source::Document(store) => (
                Answers::DocumentStore,
                effects_to_python(&store.effects),
                effects_to_python(stored_effects),
                store.effects == stored_effects,
                None,
            ),
            Source::Recorded(mut t) => {
                if t.divergence.is_none() && !t.answers.is_empty() {
                    t.divergence = Some(format!(
                        "the run's tools answered {} more call(s) than the replay made, the next \
                         one {}",
                        t.answers.len(),
                        t.answers[0].name
                    ));
                }
                let py = |w: &[(String, String)]| {
                    let parts: Vec<String> =
                        w.iter().map(|(n, d)| format!("('{n}', '{d}')")).collect();
                    format!("[{}]", parts.join(", "))
                };
                (
                    Answers::Recorded,
                    py(&t.writes),
                    py(&t.stored_writes),
                    t.divergence.is_none() && t.writes == t.stored_writes,
                    t.divergence,
                )
            }
        }
    }
}

impl Tools for Source {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply {
        match self {
            Source::Recorded(t) => t.call(req),
            Source::Document(s) => s.call(req),
        }
    }
}

/// Answers each call with the run's recorded answer to it, in order, and notes the first call
/// the run did not make at that point.
struct RecordedTools {
    answers: VecDeque<RecordedTool>,
    /// The write calls the replay made, and the ones the run made: (tool, digest).
    writes: Vec<(String, String)>,
    stored_writes: Vec<(String, String)>,
    divergence: Option<String>,
}

impl Tools for RecordedTools {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply {
        let (name, digest) = (&req.call.name, req.call.digest());
        let next = self.answers.pop_front();
        // A write answered "needs approval" was asked about, not made: it is not listed.
        if req.access == Access::Write && next.as_ref().is_none_or(|a| !asked_approval(a)) {
            self.writes.push((name.clone(), digest.clone()));
        }
        let detail = match next {
            Some(a) if a.name == *name && a.digest == digest => {
                return ToolReply {
                    result: a.result,
                    latency_ms: a.latency_ms,
                };
            }
            Some(a) => format!(
                "the replay called {name} (arguments {digest}) where the run called {} \
                 (arguments {})",
                a.name, a.digest
            ),
            None => format!(
                "the replay called {name} (arguments {digest}) after the run's last tool call"
            ),
        };
        self.divergence.get_or_insert(detail.clone());
        ToolReply {
            result: json!({"status": "error", "code": "replay_diverged", "detail": detail}),
            latency_ms: 0,
        }
    }
}

/// Drives `session` to its end; with `cancel_at_end`, a cancel takes effect at the first step
/// boundary after the last recorded reply, as the daemon's did.
fn run_to_end(
    mut session: Session<'_>,
    model: &mut Replay,
    tools: &mut Source,
    cancel_at_end: bool,
) -> TaskState {
    let cap = 16 * (session.budget().steps_max as usize + 2);
    for _ in 0..cap {
        match session.poll() {
            Action::Model(req) => {
                let reply = model.next(&req);
                session.on_model(reply);
            }
            Action::Tool(req) => {
                let reply = tools.call(&req);
                session.on_tool(reply);
            }
            Action::StepEnd => {
                if cancel_at_end && model.is_done() {
                    session.cancel();
                }
            }
            Action::Finished(_) => break,
        }
    }
    session.into_parts().0
}
