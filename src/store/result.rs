//! A task's result as a job or a service sees it: the one JSON shape that `worker wait
//! --json`, `worker enqueue --wait --json`, the HTTP API and the completion callbacks all
//! give, and how a task ended, as the exit code of `worker wait`; and a task's line in a
//! list, as `worker list --json` and the API's list give it.
//!
//! | exit code | how the task stands | stop reasons |
//! | --- | --- | --- |
//! | 0 | completed: the model's final answer completed the goal | done (completed) |
//! | 3 | cannot complete: the model gave up, saying why | done (cannot_complete) |
//! | 4 | stopped by a budget or a loop check, or by its model | max_steps, max_tool_calls, max_tokens, deadline, repeated_call, no_progress, model_failed |
//! | 5 | waiting on a person: an approval, an answer, or a held write to settle | needs_approval, needs_answer, unknown_outcome |
//! | 6 | cancelled by an operator, or its wait on a person ran out | cancelled, approval_expired, question_expired |
//! | 7 | still queued or running when the wait timed out | - |
//!
//! (1 and 2 are the CLI's operational and usage errors.)

use serde_json::{Value, json};

use super::list::TaskSummary;
use super::{QueueStatus, TaskRecord};
use crate::clock::rfc3339;
use crate::kernel::StopReason;

/// How a task that is no longer queued or running stands, by what its caller does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Completed,
    CannotComplete,
    /// A budget, a loop check or the model ended it.
    Stopped,
    /// It waits for an approval or for a held write to be settled.
    Waiting,
    Cancelled,
}

/// The exit code of a wait that timed out with the task still queued or running.
pub const EXIT_TIMED_OUT: i32 = 7;

impl Ending {
    /// How `rec` stands; `None` while it is queued or running.
    pub fn of(rec: &TaskRecord) -> Option<Ending> {
        match rec.status {
            QueueStatus::Queued | QueueStatus::Running => None,
            QueueStatus::Suspended | QueueStatus::Held => Some(Ending::Waiting),
            QueueStatus::Finished => Some(match rec.state.stop {
                Some(StopReason::Done)
                    if rec.state.outcome.as_deref() == Some("cannot_complete") =>
                {
                    Ending::CannotComplete
                }
                Some(StopReason::Done) => Ending::Completed,
                Some(
                    StopReason::Cancelled
                    | StopReason::ApprovalExpired
                    | StopReason::QuestionExpired
                    | StopReason::Expired,
                ) => Ending::Cancelled,
                _ => Ending::Stopped,
            }),
        }
    }

    pub fn exit_code(self) -> i32 {
        match self {
            Ending::Completed => 0,
            Ending::CannotComplete => 3,
            Ending::Stopped => 4,
            Ending::Waiting => 5,
            Ending::Cancelled => 6,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Ending::Completed => "completed",
            Ending::CannotComplete => "cannot_complete",
            Ending::Stopped => "stopped",
            Ending::Waiting => "waiting",
            Ending::Cancelled => "cancelled",
        }
    }
}

/// What a waiting task waits for: an approval or an answer (suspended), or a settlement
/// (held).
pub fn waiting_for(rec: &TaskRecord) -> Option<&'static str> {
    match rec.status {
        QueueStatus::Suspended if rec.state.stop == Some(StopReason::NeedsAnswer) => Some("answer"),
        QueueStatus::Suspended => Some("approval"),
        QueueStatus::Held => Some("reconcile"),
        _ => None,
    }
}

/// The task `rec` of the database `db_id` as its result: what it is, how it stands, its answer
/// and, while it waits on a person, the call it holds (with the key and digest a decision
/// names). The stop is shown only once the task is no longer queued or running.
pub fn result_json(db_id: &str, rec: &TaskRecord) -> Value {
    let st = &rec.state;
    let settled = rec.status.is_settled();
    let held = st.pending.as_ref().filter(|_| waiting_for(rec).is_some());
    json!({
        "id": rec.id,
        "key": rec.key,
        "status": rec.status.as_str(),
        "stop": st.stop.filter(|_| settled).map(StopReason::as_str),
        "outcome": st.outcome.as_ref().filter(|_| settled),
        "answer": st.answer.as_ref().filter(|_| settled),
        "cause": crate::kernel::report::why_stopped(st, &rec.budget).filter(|_| settled),
        "waiting_for": waiting_for(rec),
        "held_call": held.map(|p| json!({
            "tool": p.name,
            "args": p.args,
            "key": rec.call_key(db_id, p),
            "digest": p.digest(),
        })),
        "question": question_json(db_id, rec),
        "user": st.user_id,
        "goal": st.goal,
        "turn": st.turn(),
        "conversation": st.conversation,
        "model": rec.model.label(),
        "priority": rec.priority,
        "steps": st.step,
        "tool_calls": st.tool_calls,
        "tokens": st.tokens,
        "elapsed_s": st.elapsed_ms as f64 / 1000.0,
        "runs": rec.runs,
        "created_at": rfc3339(rec.created_at_ms),
        "updated_at": rfc3339(rec.updated_at_ms),
    })
}

/// The question a task waits to have answered (`ask_person`); `None` for any other wait.
pub fn question(rec: &TaskRecord) -> Option<crate::kernel::person::Question> {
    rec.state
        .pending
        .as_ref()
        .filter(|_| waiting_for(rec) == Some("answer"))
        .and_then(crate::kernel::person::Question::of)
}

/// The question a task waits to have answered, as the API and `worker show --json` give it:
/// its words, its choices, and the key and digest an answer may name.
pub fn question_json(db_id: &str, rec: &TaskRecord) -> Option<Value> {
    let q = question(rec)?;
    let p = rec.state.pending.as_ref()?;
    let mut v = q.to_json();
    v["key"] = json!(rec.call_key(db_id, p));
    v["digest"] = json!(p.digest());
    Some(v)
}

/// A task's line in a list, showing `stop` as its stop reason.
pub fn summary_json(t: &TaskSummary, stop: Option<StopReason>) -> Value {
    json!({
        "id": t.id,
        "status": t.status.as_str(),
        "stop": stop.map(StopReason::as_str),
        "outcome": t.outcome,
        "user": t.user,
        "goal": t.goal,
        "priority": t.priority,
        "key": t.key,
        "steps": t.steps,
        "tool_calls": t.tool_calls,
        "tokens": t.tokens,
        "elapsed_s": t.elapsed_ms as f64 / 1000.0,
        "runs": t.runs,
        "created_at": rfc3339(t.created_at_ms),
        "updated_at": rfc3339(t.updated_at_ms),
        "not_before": t.not_before_ms.map(rfc3339),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::state::STOP_REASONS;

    /// `docs/reference/stops.md` lists every stop reason once, with the status it leaves and
    /// the exit code `worker wait` gives it, and every status and outcome.
    #[test]
    fn the_stop_reference_matches_the_code() {
        let page = crate::testing::page("docs/reference/stops.md");
        let tables = crate::testing::tables(&page);
        let rows = |heading: &str| -> Vec<Vec<String>> {
            tables
                .iter()
                .find(|(h, _)| h == heading)
                .map(|(_, r)| r.clone())
                .unwrap_or_else(|| panic!("stops.md has no {heading:?}"))
        };
        let stops = rows("Stop reasons");
        assert_eq!(stops.len(), STOP_REASONS.len(), "one row per stop reason");
        for stop in STOP_REASONS {
            let row = stops
                .iter()
                .find(|r| crate::testing::code_names(&r[0]) == [stop.as_str()])
                .unwrap_or_else(|| panic!("stops.md has no row for {stop}"));
            let status = QueueStatus::after(stop);
            assert_eq!(row[1], status.as_str(), "{stop}'s status");
            let mut rec = crate::store::new_record("db", "t1", &crate::testing::task(), &[], 0);
            rec.status = status;
            rec.state.stop = Some(stop);
            let mut codes = vec![Ending::of(&rec).expect("ended").exit_code()];
            if stop == StopReason::Done {
                rec.state.outcome = Some("cannot_complete".into());
                codes.push(Ending::of(&rec).expect("ended").exit_code());
            }
            for code in codes {
                assert!(
                    row[4]
                        .split(|c: char| !c.is_ascii_digit())
                        .any(|n| n == code.to_string()),
                    "{stop}: exit {code} is not in {:?}",
                    row[4]
                );
            }
        }
        let statuses: Vec<String> = rows("Statuses")
            .iter()
            .flat_map(|r| crate::testing::code_names(&r[0]))
            .collect();
        let all: Vec<&str> = QueueStatus::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(statuses, all);
        let outcomes: Vec<String> = rows("Outcomes")
            .iter()
            .flat_map(|r| crate::testing::code_names(&r[0]))
            .collect();
        assert_eq!(outcomes, ["completed", "cannot_complete"]);
        let exits: Vec<String> = rows("Exit codes").iter().map(|r| r[0].clone()).collect();
        for code in [0, 3, 4, 5, 6, EXIT_TIMED_OUT] {
            assert!(exits.contains(&code.to_string()), "exit {code} is listed");
        }
    }
}
