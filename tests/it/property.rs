//! Property test: 10,000 random model scripts against random budgets and a store with random
//! latencies and approvals. Scripts hold nonexistent tools, malformed plans and replies, text
//! that is not JSON, repeated calls and slow writes; suspended runs are approved (or not) and
//! resumed. Every run must end with a stop reason and stay within every bound, and no order may
//! be refunded beyond its total.
//!
//! The seed is printed; `TETHER_SEED=<seed> cargo test --test property` replays a failure.

use crate::common;
use common::Rng;
use serde_json::{Value, json};

use tether::kernel::{
    Budget, Catalog, ModelReply, ModelRequest, RawReply, Session, Status, StopReason, TaskState,
};
use tether::model::Model;
use tether::sim::{DemoStore, drive};

fn random_reply(rng: &mut Rng, earlier: &[(Value, u64)]) -> Value {
    if !earlier.is_empty() && rng.chance(20) {
        return rng.pick(earlier).0.clone(); // a repeated call
    }
    let order = *rng.pick(&["ord_1001", "ord_1004", "ord_9999"]);
    let amount = rng
        .pick(&[
            json!(100),
            json!(3000),
            json!(8000),
            json!(99999),
            json!("lots"),
            json!(-5),
        ])
        .clone();
    match rng.below(12) {
        0 => {
            json!({"type": "final", "outcome": *rng.pick(&["completed", "cannot_complete"]), "text": "done"})
        }
        1 => json!({"type": "final"}),
        2 => json!({"type": "plan", "steps": [
            {"id": "s1", "tool": "get_order"},
            {"id": "s2", "tool": *rng.pick(&["issue_refund", "nope"]), "depends_on": ["s1"]},
            {"id": "s3", "tool": "send_status_email", "depends_on": *rng.pick(&[json!(["s2"]), json!(["s9"]), json!("s2")])}]}),
        3 => rng
            .pick(&[
                json!({"type": "plan", "steps": "s1"}),
                json!({"type": "plan"}),
                json!({"type": "plan", "steps": [{"tool": "get_order"}]}),
            ])
            .clone(),
        4 => Value::String(
            rng.pick(&["not json {", "", "null", "[1, 2]", "{\"type\": 5}"])
                .to_string(),
        ),
        5 => json!({"type": rng.pick(&["dance", "tool"]).to_string(), "name": 7, "args": "x"}),
        _ => {
            let tool = *rng.pick(&[
                "get_order",
                "issue_refund",
                "send_status_email",
                "search_policy",
                "delete_order",
            ]);
            let step = rng
                .pick(&[Value::Null, json!("s1"), json!("s2"), json!("s3")])
                .clone();
            json!({"type": "tool", "name": tool, "args": {"order_id": order, "amount_cents": amount}, "plan_step": step})
        }
    }
}

/// A script with its own latency per reply; reply n answers model call n of the task.
struct Scripted {
    replies: Vec<(Value, u64)>,
    next: usize,
}

impl Model for Scripted {
    fn next(&mut self, _req: &ModelRequest<'_>) -> ModelReply {
        let (v, latency_ms) = self.replies[self.next % self.replies.len()].clone();
        self.next += 1;
        let outcome = match v {
            Value::String(t) => Ok(RawReply::Text(t)),
            v => Ok(RawReply::Json(v)),
        };
        ModelReply {
            outcome,
            latency_ms,
            usage: None,
            response: None,
            turn: None,
        }
    }
}

fn check(seed: u64, case: u64, st: &TaskState, b: &Budget, store: &DemoStore) {
    let ctx = format!("TETHER_SEED={seed} case {case}: {}", st.to_json());
    assert!(st.stop.is_some(), "no stop reason: {ctx}");
    assert!(st.step <= b.steps_max, "steps: {ctx}");
    assert!(st.tool_calls <= b.tool_calls_max, "tool calls: {ctx}");
    assert!(st.tokens <= b.tokens_max, "tokens: {ctx}");
    assert!(st.elapsed_ms <= b.deadline_ms, "deadline: {ctx}");
    assert_eq!(
        st.status == Status::Suspended,
        st.stop == Some(StopReason::NeedsApproval),
        "status: {ctx}"
    );
    assert!(
        store.refunds_within_totals(),
        "refunded beyond a total: {ctx}"
    );
}

#[test]
fn random_scripts_never_break_a_bound() {
    let seed = common::seed("property");
    let catalog = Catalog::demo();
    let mut rng = Rng(seed);
    let mut stops = std::collections::BTreeMap::new();
    for case in 0..10_000u64 {
        let budget = Budget {
            steps_max: 1 + rng.below(10) as u32,
            tool_calls_max: rng.below(8) as u32,
            tokens_max: 200 + rng.below(5000),
            output_tokens_max: 50 + rng.below(350) as u32,
            deadline_ms: rng.below(40_000),
            repeat_max: rng.below(4) as u32,
            stalls_max: 1 + rng.below(4) as u32,
            plan_steps_max: 1 + rng.below(6) as u32,
            replans_max: 2,
        };
        let mut replies = Vec::new();
        for _ in 0..1 + rng.below(12) {
            let v = random_reply(&mut rng, &replies);
            replies.push((v, *rng.pick(&[0, 300, 1500, 4000, 9000, 31_000])));
        }
        let mut store = DemoStore::new();
        for tool in [
            "get_order",
            "issue_refund",
            "send_status_email",
            "search_policy",
        ] {
            if rng.chance(15) {
                store = store.with_latency(tool, *rng.pick(&[5000, 20_000, 45_000]));
            }
        }
        let mut model = Scripted { replies, next: 0 };
        let mut session =
            Session::start(TaskState::new("t", "cu_ana", "refund"), budget, &catalog, 0);
        drive(&mut session, &mut model, &mut store);
        let (mut st, _) = session.into_parts();
        check(seed, case, &st, &budget, &store);
        *stops
            .entry(st.stop.map_or("none", |s| s.as_str()))
            .or_insert(0u32) += 1;
        // Suspended or held runs: an operator approves (or not), and the task resumes, twice.
        for _ in 0..2 {
            if !matches!(
                st.stop,
                Some(StopReason::NeedsApproval | StopReason::UnknownOutcome)
            ) {
                break;
            }
            if let Some(call) = &st.pending
                && rng.chance(70)
            {
                store.approve(&call.name, &call.digest());
            }
            let mut session = Session::resume(st, budget, &catalog, 0);
            drive(&mut session, &mut model, &mut store);
            st = session.into_parts().0;
            check(seed, case, &st, &budget, &store);
            *stops
                .entry(st.stop.map_or("none", |s| s.as_str()))
                .or_insert(0u32) += 1;
        }
    }
    println!("stops over 10,000 scripts and their resumes: {stops:?}");
    // The generator must reach every kind of ending, or the test proves less than it claims.
    for reason in [
        "done",
        "max_steps",
        "max_tool_calls",
        "max_tokens",
        "deadline",
        "repeated_call",
        "no_progress",
        "needs_approval",
        "unknown_outcome",
    ] {
        assert!(
            stops.contains_key(reason),
            "no script ended with {reason}: {stops:?} (TETHER_SEED={seed})"
        );
    }
}
