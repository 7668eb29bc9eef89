//! Offline replay of a stored task: its recorded model replies and tool answers are fed to the
//! kernel again, with the operators' decisions from the audit log applied where they
//! happened; the final state is compared with the stored one, and every call the replay makes
//! with the call the run made at that point (a different call is a divergence: the kernel, or
//! its catalog, no longer takes the path it took). Replies recorded before tool answers were
//! kept are replayed against a fresh copy of the document's store instead, and its effects
//! compared with the ones the run left. Neither needs a model provider or a tool service.

use std::collections::VecDeque;

use serde_json::{Value, json};

use crate::kernel::session::Run;
use crate::kernel::{
    Access, Budget, Catalog, InputStyle, Keys, Session, StopReason, TaskState, ToolReply,
    ToolRequest,
};
use crate::model::{RecordedReply, RecordedTool, Replay};
use crate::sim::drive;
use crate::store::TaskRecord;
use crate::store::ops::Event;
use crate::tools::{DemoStore, Effect, Tools, effects_to_python};

/// What a replay found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    pub state: TaskState,
    /// Where the tool answers came from.
    pub answers: Answers,
    /// The writes of the replay and of the run, as the document prints effects: with recorded
    /// answers, each write call as `(tool, digest of its arguments)`; against the document's
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
    /// A fresh copy of the document's store (replies recorded before answers were kept).
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
/// `stored_effects` are the document store's effects of the run (used only when the replies
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
    let catalog = rec.catalog.clone().unwrap_or_else(Catalog::demo);
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
            .map(|a| (a.name.clone(), a.digest.clone()))
            .collect();
    }
    let mut initial = TaskState::new(&rec.id, &rec.state.user_id, &rec.state.goal);
    initial.remembered = rec.state.remembered.clone();
    let mut model = Replay::new(replies);
    let budget: Budget = rec.budget;
    // The run as the daemon made it: its key policy (which infers a call's plan step) and its
    // model's input style (which the token check counts).
    let session = |run: Run, state: TaskState| {
        let mut s = Session::begin(run, state, budget, &catalog, 0, keys.clone());
        s.set_input(input);
        s
    };
    let mut state = run(session(Run::Start, initial), &mut model, &mut tools);
    for ev in events {
        let result = ev.detail.get("result").cloned().unwrap_or(Value::Null);
        state = match ev.verb.as_str() {
            "approve" => {
                if let (Some(p), Source::Document(store)) = (&state.pending, &mut tools) {
                    store.approve(&p.name, &p.digest());
                }
                run(session(Run::Resume, state), &mut model, &mut tools)
            }
            "reject" | "reconcile_applied" => {
                let result = if result.is_null() {
                    json!({"status": "rejected", "code": "rejected"})
                } else {
                    result
                };
                run(session(Run::Settled(result), state), &mut model, &mut tools)
            }
            "reconcile_not_applied" => run(session(Run::Resume, state), &mut model, &mut tools),
            "cancel" => {
                let mut s = state;
                if s.stop.is_none_or(|r| r != StopReason::Done) {
                    s.stop = Some(StopReason::Cancelled);
                    s.status = crate::kernel::Status::Stopped;
                }
                s
            }
            "expire" => {
                let mut s = state;
                s.stop = Some(StopReason::ApprovalExpired);
                s.status = crate::kernel::Status::Stopped;
                s
            }
            _ => state,
        };
    }
    let same_state = state.to_json() == rec.state.to_json();
    let differences = if same_state {
        Vec::new()
    } else {
        let v = |s: &TaskState| serde_json::to_value(s).unwrap_or(Value::Null);
        differences(&v(&rec.state), &v(&state), 5)
    };
    let (answers, effects, stored, same_effects, divergence) = match tools {
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
                let parts: Vec<String> = w.iter().map(|(n, d)| format!("('{n}', '{d}')")).collect();
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
    };
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

/// The tools of a replay.
enum Source {
    Recorded(RecordedTools),
    Document(DemoStore),
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
        if req.access == Access::Write {
            self.writes.push((name.clone(), digest.clone()));
        }
        let detail = match self.answers.pop_front() {
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

fn run(mut session: Session<'_>, model: &mut Replay, tools: &mut Source) -> TaskState {
    drive(&mut session, model, tools);
    session.into_parts().0
}
