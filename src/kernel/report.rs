//! What a finished run tells people: the closing message built from the plan statuses (no
//! model call, so it exists for every stop reason, even past a deadline), and the design reference's
//! post-mortem computed from the spans.

use serde::Serialize;
use serde_json::{Map, Value};

use super::budget::Budget;
use super::catalog::Catalog;
use super::json::{dumps, py_repr, py_str_repr};
use super::person::Question;
use super::state::{StepStatus, StopReason, TaskState};
use super::trace::{Span, SpanKind};

/// A closing message for the customer or operator, from state alone.
pub fn closing_message(state: &TaskState, catalog: &Catalog) -> String {
    closing(lead(state), state, catalog)
}

/// The closing message with the cause of the stop in plain words after its first sentence
/// ([`cause`]): what `worker show` and the console print.
pub fn closing_explained(state: &TaskState, budget: &Budget, catalog: &Catalog) -> String {
    let lead = match cause(state, budget) {
        Some(why) => format!("{} {why}", lead(state)),
        None => lead(state),
    };
    closing(lead, state, catalog)
}

/// Why the run stopped, in plain words: the closing message's first sentence and, where it
/// does not say it all, the [`cause`]. `None` while it runs and once it completed: what an API
/// result, `worker show --json` and the post-mortem give as `cause`.
pub fn why_stopped(state: &TaskState, budget: &Budget) -> Option<String> {
    match (state.stop?, state.outcome.as_deref()) {
        (StopReason::Done, Some("completed") | None) => None,
        _ => Some(match cause(state, budget) {
            Some(why) => format!("{} {why}", lead(state)),
            None => lead(state),
        }),
    }
}

/// Why the run stopped, in plain words, where the stop reason alone does not say: the budget
/// that ran out and by how much, the model's last reply that could not be used, the error the
/// last call came back with. `None` when the message's first sentence says it all.
pub fn cause(state: &TaskState, budget: &Budget) -> Option<String> {
    let b = budget;
    Some(match state.stop? {
        StopReason::MaxSteps => format!(
            "It took {} steps, all that its budget allows (steps_max {}).",
            state.step, b.steps_max
        ),
        StopReason::MaxToolCalls => format!(
            "It made {} tool calls, all that its budget allows (tool_calls_max {}).",
            state.tool_calls, b.tool_calls_max
        ),
        StopReason::MaxTokens => format!(
            "It used {} of its {} tokens (tokens_max); the {} left would not hold another model call: its input (the task so far) and up to {} output tokens (output_tokens_max).",
            state.tokens,
            b.tokens_max,
            b.tokens_max.saturating_sub(state.tokens),
            b.output_tokens_max
        ),
        StopReason::Deadline => format!(
            "It spent {} working, and its limit is {} (deadline_ms {}).",
            duration(state.elapsed_ms),
            duration(b.deadline_ms),
            b.deadline_ms
        ),
        StopReason::RepeatedCall => format!(
            "The model asked for one tool call with the same arguments more than {} times (repeat_max); the answer would not change.",
            b.repeat_max
        ),
        StopReason::NoProgress => no_progress(state, b),
        _ => return None,
    })
}

/// Milliseconds as people read them: `850 ms` below ten seconds' precision matters, else
/// seconds with one decimal.
fn duration(ms: u64) -> String {
    if ms < 1_000 {
        format!("{ms} ms")
    } else {
        format!("{:.1} s", ms as f64 / 1000.0)
    }
}

/// What the steps that made no progress were: the last result the task got says why.
fn no_progress(state: &TaskState, b: &Budget) -> String {
    let steps = format!(
        "In its last {} steps (stalls_max {}) it learned no new fact and finished no plan step",
        state.stalls, b.stalls_max
    );
    let last = state.last_result.as_ref();
    let text = |k: &str| last.and_then(|r| r.get(k)).and_then(Value::as_str);
    // A detail is a sentence, or a list of problems (a refused plan's).
    let listed = last
        .and_then(|r| r.get("detail"))
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("; ")
        })
        .filter(|s| !s.is_empty());
    let detail = text("detail").map(str::to_string).or(listed);
    match (text("code"), detail.as_deref()) {
        (Some("invalid_reply"), Some(d)) => {
            format!("{steps}; the model's last reply could not be used: {d}.")
        }
        (Some("unknown_tool"), _) => {
            format!(
                "{steps}; the model's last call named a tool that is not in the task's catalog."
            )
        }
        (Some(code), Some(d)) => format!("{steps}; the last result was an error ({code}): {d}."),
        (Some(code), None) => format!("{steps}; the last result was an error ({code})."),
        _ => format!("{steps}."),
    }
}

fn closing(lead: String, state: &TaskState, catalog: &Catalog) -> String {
    if state.plan.is_empty() {
        let calls = match state.tool_calls {
            0 => "no tool calls were made".to_string(),
            1 => "1 tool call was made".to_string(),
            n => format!("{n} tool calls were made"),
        };
        if state.turn() > 1 {
            // A later turn of a conversation: its own plan, the whole conversation's calls.
            return format!("{lead} This turn set no plan; {calls} in the conversation so far.");
        }
        return format!("{lead} No plan was set; {calls}.");
    }
    let parts = join_and(&plan_parts(state, catalog));
    match state.turn() {
        1 => format!("{lead} {}.", capitalize(&parts)),
        // A later turn's plan is its own: what earlier turns did is not in it.
        n => format!("{lead} In turn {n}, {parts}."),
    }
}

/// The message's first sentence: why the run ended, and what it waits on.
fn lead(state: &TaskState) -> String {
    let args = |call: &super::state::ToolCall| dumps(&Value::Object(call.args.clone()));
    match state.stop {
        None => "The task is still running.".to_string(),
        Some(StopReason::Done) => done_lead(state),
        Some(StopReason::MaxSteps) => "The task stopped at its step limit.".into(),
        Some(StopReason::MaxToolCalls) => "The task stopped at its tool-call limit.".into(),
        Some(StopReason::MaxTokens) => "The task stopped at its token budget.".into(),
        Some(StopReason::Deadline) => "The task stopped at its time limit.".into(),
        Some(StopReason::RepeatedCall) => {
            "The task stopped because the same call was proposed again and again.".into()
        }
        Some(StopReason::NoProgress) => {
            "The task stopped because its last steps made no progress.".into()
        }
        Some(StopReason::NeedsApproval) => match &state.pending {
            Some(call) => format!(
                "The task is waiting for approval of {} with {}.",
                call.name,
                args(call)
            ),
            None => "The task is waiting for approval.".into(),
        },
        Some(StopReason::NeedsAnswer) => question_lead(state, false),
        Some(StopReason::QuestionExpired) => question_lead(state, true),
        Some(StopReason::UnknownOutcome) => match &state.pending {
            Some(call) => format!(
                "The task stopped because it is not known whether {} with {} took effect; it must be reconciled before any retry.",
                call.name,
                args(call)
            ),
            None => "The task stopped because a write's outcome is unknown.".into(),
        },
        Some(StopReason::Cancelled) => match state.unknown_write() {
            Some(call) => format!(
                "The task was cancelled by an operator while it is not known whether {} with {} took effect; it must be reconciled.",
                call.name,
                args(call)
            ),
            None => "The task was cancelled by an operator.".into(),
        },
        Some(StopReason::ModelFailed) => match state
            .last_result
            .as_ref()
            .and_then(|r| r.get("detail"))
            .and_then(Value::as_str)
        {
            Some(why) => format!("The task stopped because the model could not be used: {why}."),
            None => "The task stopped because the model could not be used.".into(),
        },
        Some(StopReason::ApprovalExpired) => match &state.pending {
            Some(call) => format!(
                "The task stopped because the approval of {} with {} did not come in time; nothing was sent.",
                call.name,
                args(call)
            ),
            None => "The task stopped because an approval did not come in time.".into(),
        },
        Some(StopReason::Expired) => {
            "The task expired: it was not started before its time to live ran out; nothing ran."
                .into()
        }
        Some(StopReason::TimedOut) => match state.unknown_write() {
            Some(call) => format!(
                "The task stopped because its wall-clock deadline passed, while it is not known whether {} with {} took effect; it must be reconciled.",
                call.name,
                args(call)
            ),
            None => {
                "The task stopped because its wall-clock deadline passed before it finished.".into()
            }
        },
    }
}

/// A task's question to a person: waiting for the answer, or no answer came in time.
fn question_lead(state: &TaskState, expired: bool) -> String {
    let q = state.pending.as_ref().and_then(Question::of);
    match (q, expired) {
        (Some(q), false) => format!("The task is waiting for a person to answer: {}", q.text),
        (None, false) => "The task is waiting for a person's answer.".into(),
        (Some(q), true) => format!(
            "The task stopped because no one answered its question in time: {}",
            q.text
        ),
        (None, true) => "The task stopped because no one answered its question in time.".into(),
    }
}

/// How a task that gave its final answer ended: complete, or not and why (the model's words
/// end their sentence before the message's next one begins).
fn done_lead(state: &TaskState) -> String {
    match state.outcome.as_deref() {
        Some("completed") | None => "The task is complete.".to_string(),
        Some(other) => {
            let why = state
                .answer
                .as_deref()
                .unwrap_or("no reason given")
                .trim_end();
            let stop = if why.ends_with(['.', '!', '?']) {
                ""
            } else {
                "."
            };
            format!("The task ended without completing ({other}): {why}{stop}")
        }
    }
}

/// One phrase per plan step: done, not done, failed, or unknown (the held write's step).
fn plan_parts(state: &TaskState, catalog: &Catalog) -> Vec<String> {
    let held = state.unknown_write().and_then(|c| c.plan_step.clone());
    state
        .plan
        .iter()
        .map(|s| {
            let spec = catalog.get(&s.tool);
            // A catalog without phrases: the step by its id and tool, which reads as a sentence
            // for any tool name (and is not capitalized into another word).
            let done = spec
                .map(|t| t.done_phrase.clone())
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| format!("step {} ({}) was done", s.id, s.tool));
            let not_done = spec
                .map(|t| t.not_done_phrase.clone())
                .filter(|p| !p.is_empty())
                .unwrap_or_else(|| format!("step {} ({}) was not done", s.id, s.tool));
            match s.status {
                StepStatus::Done => done,
                StepStatus::Failed => format!("{not_done} (it failed)"),
                StepStatus::Pending if held.as_deref() == Some(s.id.as_str()) => {
                    format!("it is unknown whether {done}")
                }
                StepStatus::Pending => not_done,
            }
        })
        .collect()
}

fn join_and(parts: &[String]) -> String {
    match parts {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{}, and {last}", init.join(", ")),
    }
}

fn capitalize(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) => f.to_uppercase().collect::<String>() + c.as_str(),
        None => String::new(),
    }
}

/// The design reference's post-mortem of one run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Postmortem {
    pub stop: Option<StopReason>,
    pub steps: u32,
    /// (tool, status) of the first tool span that did not end ok.
    pub first_error: Option<(String, String)>,
    /// ((tool, args as sorted JSON), times executed) of the most executed call.
    pub most_repeated: Option<((String, String), u32)>,
    pub model_ms: u64,
    pub tool_ms: u64,
    pub tokens_in_view_by_step: Vec<u64>,
    /// (step, what was wrong) of the first model call that gave no usable move: an error, a
    /// refusal, or a reply that was not a valid move. Shown only when there was one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_model_error: Option<(u32, String)>,
}

/// The design reference's post-mortem of one run.
pub fn postmortem(state: &TaskState, spans: &[Span]) -> Postmortem {
    postmortem_with(state, spans, None)
}

/// The post-mortem, with the first model call that gave no usable move (from the recorded
/// replies, which the spans do not carry).
pub fn postmortem_with(
    state: &TaskState,
    spans: &[Span],
    first_model_error: Option<(u32, String)>,
) -> Postmortem {
    let tools: Vec<&Span> = spans.iter().filter(|s| s.kind == SpanKind::Tool).collect();
    let first_error = tools
        .iter()
        // A question waiting for a person is no error.
        .find(|s| s.status != "ok" && s.status != "needs_answer")
        .map(|s| (s.name.to_string(), s.status.to_string()));
    // Counter.most_common(1): highest count, first seen among equals.
    let mut counts: Vec<((String, String), u32)> = Vec::new();
    for s in &tools {
        let args = dumps(&Value::Object(s.args.clone().unwrap_or_else(Map::new)));
        let k = (s.name.to_string(), args);
        match counts.iter_mut().find(|(c, _)| *c == k) {
            Some((_, n)) => *n += 1,
            None => counts.push((k, 1)),
        }
    }
    let mut most_repeated: Option<((String, String), u32)> = None;
    for (k, n) in counts {
        if most_repeated.as_ref().is_none_or(|(_, m)| n > *m) {
            most_repeated = Some((k, n));
        }
    }
    let sum = |kind| {
        spans
            .iter()
            .filter(|s| s.kind == kind)
            .map(Span::duration_ms)
            .sum()
    };
    Postmortem {
        stop: state.stop,
        steps: state.step,
        first_error,
        most_repeated,
        model_ms: sum(SpanKind::Model),
        tool_ms: sum(SpanKind::Tool),
        tokens_in_view_by_step: spans
            .iter()
            .filter(|s| s.kind == SpanKind::Model)
            .filter_map(|s| s.tin)
            .collect(),
        first_model_error,
    }
}

impl Postmortem {
    /// The design reference's printed form: a Python dict literal.
    pub fn to_python(&self) -> String {
        let opt_pair = |p: &Option<(String, String)>| match p {
            Some((a, b)) => format!("({}, {})", py_str_repr(a), py_str_repr(b)),
            None => "None".into(),
        };
        let most = match &self.most_repeated {
            Some(((name, args), n)) => {
                format!("(({}, {}), {n})", py_str_repr(name), py_str_repr(args))
            }
            None => "None".into(),
        };
        let tins: Vec<Value> = self
            .tokens_in_view_by_step
            .iter()
            .map(|t| Value::from(*t))
            .collect();
        let model_error = match &self.first_model_error {
            Some((step, why)) => format!(", 'first_model_error': ({step}, {})", py_str_repr(why)),
            None => String::new(),
        };
        format!(
            "{{'stop': {}, 'steps': {}, 'first_error': {}, 'most_repeated': {}, 'model_s': {}, 'tool_s': {}, 'tokens_in_view_by_step': {}{model_error}}}",
            self.stop.map_or("None".into(), |s| py_str_repr(s.as_str())),
            self.steps,
            opt_pair(&self.first_error),
            most,
            secs_1(self.model_ms),
            secs_1(self.tool_ms),
            py_repr(&Value::Array(tins)),
        )
    }
}

/// Milliseconds as seconds with one decimal, printed as Python prints `round(x, 1)`.
pub fn secs_1(ms: u64) -> String {
    format!("{:.1}", ms as f64 / 1000.0)
}

/// The design reference's span table.
pub fn span_table(spans: &[Span]) -> String {
    let mut out = format!(
        "{:>2} {:>6} {:6} {:18} {:>5} {:>5}  status  details\n",
        "id", "parent", "kind", "name", "t0", "t1"
    );
    for s in spans {
        let details = match s.kind {
            SpanKind::Model => {
                let mut parts = Vec::new();
                if let Some(t) = s.tin {
                    parts.push(format!("'tin': {t}"));
                }
                if let Some(t) = s.tout {
                    parts.push(format!("'tout': {t}"));
                }
                if parts.is_empty() {
                    String::new()
                } else {
                    format!("{{{}}}", parts.join(", "))
                }
            }
            SpanKind::Tool => match &s.args {
                Some(a) => format!("{{'args': {}}}", py_repr(&Value::Object(a.clone()))),
                None => String::new(),
            },
            _ => String::new(),
        };
        let parent = s.parent.map_or("None".to_string(), |p| p.to_string());
        let t1 = s.t1_ms.map_or("open".to_string(), secs_1);
        out.push_str(&format!(
            "{:2} {:>6} {:6} {:18} {:>5} {:>5}  {:6}  {}\n",
            s.id,
            parent,
            s.kind.as_str(),
            s.name,
            secs_1(s.t0_ms),
            t1,
            s.status,
            details
        ));
    }
    out
}
