//! Offline replay of a stored task: its recorded model replies are fed to the kernel again
//! against a fresh copy of the document's store, with the operators' decisions from the audit
//! log applied where they happened; the final state and effects are compared with the stored
//! ones. The model is out of the loop, so this costs nothing and needs no provider.

use serde_json::{Value, json};

use crate::kernel::session::Run;
use crate::kernel::{Budget, Catalog, InputStyle, Keys, Session, StopReason, TaskState};
use crate::model::{RecordedReply, Replay};
use crate::sim::drive;
use crate::store::TaskRecord;
use crate::store::ops::Event;
use crate::tools::{DemoStore, Effect};

/// What a replay found.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayReport {
    pub state: TaskState,
    pub effects: Vec<Effect>,
    pub same_state: bool,
    pub same_effects: bool,
}

/// Replays `rec` from its `replies`, applying the decisions among `events` in order.
pub fn replay(
    rec: &TaskRecord,
    replies: Vec<RecordedReply>,
    events: &[Event],
    stored_effects: &[Effect],
    input: InputStyle,
    keys: Keys,
) -> ReplayReport {
    // The task's own catalog (its schema and fact fields), against the document's store.
    let catalog = rec.catalog.clone().unwrap_or_else(Catalog::demo);
    let mut store = DemoStore::new();
    for (tool, ms) in &rec.tool_latency_ms {
        store = store.with_latency(tool, *ms);
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
    let mut state = run(session(Run::Start, initial), &mut model, &mut store);
    for ev in events {
        let result = ev.detail.get("result").cloned().unwrap_or(Value::Null);
        state = match ev.verb.as_str() {
            "approve" => {
                if let Some(p) = &state.pending {
                    store.approve(&p.name, &p.digest());
                }
                run(session(Run::Resume, state), &mut model, &mut store)
            }
            "reject" | "reconcile_applied" => {
                let result = if result.is_null() {
                    json!({"status": "rejected", "code": "rejected"})
                } else {
                    result
                };
                run(session(Run::Settled(result), state), &mut model, &mut store)
            }
            "reconcile_not_applied" => run(session(Run::Resume, state), &mut model, &mut store),
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
    let same_effects = store.effects == stored_effects;
    ReplayReport {
        state,
        effects: store.effects,
        same_state,
        same_effects,
    }
}

fn run(mut session: Session<'_>, model: &mut Replay, store: &mut DemoStore) -> TaskState {
    drive(&mut session, model, store);
    session.into_parts().0
}
