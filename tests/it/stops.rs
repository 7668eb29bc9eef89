//! Every stop explains itself (issue 52): for each stop reason, the closing message that
//! `worker show` and the console print names its cause in words a user who has not read the
//! design reference understands: the budget that ran out and by how much, the model's last
//! reply that could not be used and why, the call that is held and what to do about it. And
//! through the binary: a model that keeps answering prose ends `no_progress`, and `worker
//! show`, `worker show --json` and the task's result (`cause`) and `worker postmortem` (text,
//! with the next action) say why.

use crate::common::*;

use serde_json::{Map, Value, json};
use tether::kernel::report::closing_explained;
use tether::kernel::state::{STOP_REASONS, StopReason, TaskState, ToolCall};
use tether::kernel::{Budget, Catalog};

fn stopped(stop: StopReason) -> TaskState {
    let mut st = TaskState::new("t1", "cu_ana", "refund the damaged item");
    st.stop = Some(stop);
    st
}

fn refund() -> ToolCall {
    let mut args = Map::new();
    args.insert("order_id".into(), json!("ord_1001"));
    args.insert("amount_cents".into(), json!(2500));
    ToolCall {
        name: "issue_refund".into(),
        args,
        plan_step: Some("s2".into()),
    }
}

/// One row per stop reason: the state it stops in, and a sentence its message must hold.
fn cases() -> Vec<(StopReason, TaskState, &'static str)> {
    use StopReason as S;
    let b = Budget::default();
    let mut v = Vec::new();
    let mut st = stopped(S::Done);
    st.outcome = Some("completed".into());
    v.push((S::Done, st, "The task is complete."));
    let mut st = stopped(S::Done);
    st.outcome = Some("cannot_complete".into());
    st.answer = Some("the order belongs to another customer".into());
    v.push((
        S::Done,
        st,
        "ended without completing (cannot_complete): the order belongs to another customer",
    ));
    let mut st = stopped(S::MaxSteps);
    st.step = b.steps_max;
    v.push((
        S::MaxSteps,
        st,
        "It took 8 steps, all that its budget allows (steps_max 8).",
    ));
    let mut st = stopped(S::MaxToolCalls);
    st.tool_calls = b.tool_calls_max;
    v.push((
        S::MaxToolCalls,
        st,
        "It made 6 tool calls, all that its budget allows (tool_calls_max 6).",
    ));
    let mut st = stopped(S::MaxTokens);
    st.tokens = 3_700;
    v.push((S::MaxTokens, st, "It used 3700 of its 4000 tokens (tokens_max); the 300 left would not hold another model call"));
    let mut st = stopped(S::Deadline);
    st.elapsed_ms = 31_200;
    v.push((
        S::Deadline,
        st,
        "It spent 31.2 s working, and its limit is 30.0 s (deadline_ms 30000).",
    ));
    v.push((
        S::RepeatedCall,
        stopped(S::RepeatedCall),
        "asked for one tool call with the same arguments more than 2 times (repeat_max)",
    ));
    let mut st = stopped(S::NoProgress);
    st.stalls = b.stalls_max;
    st.last_result = Some(json!({"status": "error", "code": "invalid_reply",
        "detail": "the reply was text without a function call"}));
    v.push((S::NoProgress, st, "In its last 3 steps (stalls_max 3) it learned no new fact and finished no plan step; the model's last reply could not be used: the reply was text without a function call."));
    let mut st = stopped(S::NoProgress);
    st.stalls = b.stalls_max;
    st.last_result = Some(json!({"status": "error", "code": "unknown_tool"}));
    v.push((
        S::NoProgress,
        st,
        "the model's last call named a tool that is not in the task's catalog.",
    ));
    let mut st = stopped(S::NeedsApproval);
    st.pending = Some(refund());
    v.push((
        S::NeedsApproval,
        st,
        "waiting for approval of issue_refund with",
    ));
    let mut st = stopped(S::UnknownOutcome);
    st.pending = Some(refund());
    v.push((S::UnknownOutcome, st, "not known whether issue_refund with"));
    v.push((
        S::Cancelled,
        stopped(S::Cancelled),
        "The task was cancelled by an operator.",
    ));
    let mut st = stopped(S::ModelFailed);
    st.last_result = Some(json!({"status": "error", "code": "model_failed",
        "detail": "the provider refused the API key (401)"}));
    v.push((
        S::ModelFailed,
        st,
        "the model could not be used: the provider refused the API key (401).",
    ));
    let mut st = stopped(S::ApprovalExpired);
    st.pending = Some(refund());
    v.push((
        S::ApprovalExpired,
        st,
        "did not come in time; nothing was sent",
    ));
    v.push((
        S::Expired,
        stopped(S::Expired),
        "it was not started before its time to live ran out; nothing ran",
    ));
    v.push((
        S::TimedOut,
        stopped(S::TimedOut),
        "its wall-clock deadline passed before it finished",
    ));
    let ask = ToolCall {
        name: "ask_person".into(),
        args: json!({"question": "Which address?"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        plan_step: None,
    };
    let mut st = stopped(S::NeedsAnswer);
    st.pending = Some(ask.clone());
    v.push((
        S::NeedsAnswer,
        st,
        "The task is waiting for a person to answer: Which address?",
    ));
    let mut st = stopped(S::QuestionExpired);
    st.pending = Some(ask);
    v.push((
        S::QuestionExpired,
        st,
        "no one answered its question in time: Which address?",
    ));
    v
}

#[test]
fn every_stop_reason_names_its_cause_in_plain_words() {
    let (b, catalog) = (Budget::default(), Catalog::demo());
    let cases = cases();
    for stop in &STOP_REASONS {
        assert!(
            cases.iter().any(|(s, _, _)| s == stop),
            "no case for {stop:?}: every stop reason needs its sentence here"
        );
    }
    for (stop, st, want) in &cases {
        let msg = closing_explained(st, &b, &catalog);
        assert!(msg.contains(want), "{stop:?}: {msg:?} lacks {want:?}");
        for internal in ["stalls ", "progress signature", "last_result", "Some("] {
            assert!(
                !msg.contains(internal),
                "{stop:?}: {msg:?} says {internal:?}"
            );
        }
    }
}

/// A model that answers prose instead of a move: the task ends `no_progress`, and every place
/// a user looks says the model's replies could not be used, and why.
#[test]
fn a_task_stopped_by_unusable_replies_says_why_everywhere() {
    let dir = TempDir::new("stops-prose");
    let d = dir.path();
    let prose = Value::String("I will look into the order for you.".into()).to_string();
    std::fs::write(d.join("prose.jsonl"), [prose.as_str(); 4].join("\n")).expect("script");
    ok(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "refund",
            "--model",
            "script:prose.jsonl",
        ],
    );
    ok(d, &["run", "--drain"]);
    let t = json(d, &["show", "t1", "--json"]);
    assert_eq!(t["stop"], "no_progress", "{t}");
    let cause = t["cause"].as_str().expect("a cause");
    assert!(
        cause.contains("the model's last reply could not be used: "),
        "{cause}"
    );
    let show = ok(d, &["show", "t1"]);
    assert!(show.contains(cause), "{show}");
    let pm = ok(d, &["postmortem", "t1"]);
    assert!(
        pm.starts_with("task t1: no_progress after 3 step(s)\n"),
        "{pm}"
    );
    assert!(pm.contains(&format!("{:18} {cause}", "why")), "{pm}");
    assert!(
        pm.contains(&format!("{:18} look at what the model answered", "next")),
        "{pm}"
    );
    assert!(!pm.contains("{'stop'"), "text, not a Python dict: {pm}");
    let machine = json(d, &["postmortem", "t1", "--json"]);
    assert_eq!(machine["stop"], "no_progress", "{machine}");
    // The trace marks the model calls whose replies could not be used.
    let spans = json(d, &["trace", "t1", "--json"]);
    let models: Vec<&Value> = spans
        .as_array()
        .expect("spans")
        .iter()
        .filter(|s| s["kind"] == "model")
        .collect();
    assert_eq!(models.len(), 3, "{spans}");
    assert!(
        models.iter().all(|s| s["status"] == "invalid_reply"),
        "{spans}"
    );
    // The task's result (the API's, callbacks', `worker wait --json`'s) carries it too.
    let out = worker(d, &["wait", "t1", "--json"]);
    assert_eq!(out.status.code(), Some(4), "{out:?}");
    let result: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(result["cause"], cause, "{result}");
}

/// From the review: the next action is one that works (an approval names the held call's
/// digest), and once a decision put the task back in the queue its old stop is no longer
/// given as its cause.
#[test]
fn the_next_action_follows_the_tasks_status() {
    let dir = TempDir::new("stops-next");
    let d = dir.path();
    ok(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "refund",
            "--model",
            "policy:ord_1004:8000",
        ],
    );
    ok(d, &["run", "--drain"]);
    let digest = held_digest(d, "t1");
    let pm = ok(d, &["postmortem", "t1"]);
    assert!(
        pm.contains(&format!("`worker approve t1 --digest {digest}`")),
        "{pm}"
    );
    ok(d, &["approve", "t1", "--digest", &digest]);
    let t = json(d, &["show", "t1", "--json"]);
    assert_eq!(t["status"], "queued", "{t}");
    assert!(
        t["cause"].is_null(),
        "a queued task's old stop is not its cause: {t}"
    );
    let pm = ok(d, &["postmortem", "t1"]);
    assert!(
        pm.contains("nothing yet: it is queued (`worker wait t1`)"),
        "{pm}"
    );
    assert!(!pm.contains("waiting for approval"), "{pm}");
}
