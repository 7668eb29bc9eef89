//! Kernel behaviour beyond the design reference's tables: malformed model replies and tool results,
//! closing messages, held writes on resume, cancellation, and remembered notes.

use serde_json::{Value, json};
use tether::kernel::report::closing_message;
use tether::kernel::{Budget, Catalog, ModelReply, RawReply, StopReason, TaskState};
use tether::model::ModelProfile;
use tether::sim::{DemoStore, go, resume, scenarios};

fn script(replies: Vec<Value>) -> Box<dyn tether::model::Model> {
    ModelProfile::Script {
        replies,
        latency_ms: 1000,
    }
    .build()
}

/// Each malformed reply becomes an error in last_result, counts as a step, and the stall limit
/// ends the run.
#[test]
fn malformed_replies_are_errors_that_count_as_steps() {
    let long_text = "x".repeat(4000);
    let cases: Vec<(Value, &str)> = vec![
        (
            Value::String("this is not json".into()),
            "reply is not JSON",
        ),
        (json!({"name": "get_order"}), "no `type`"),
        (json!({"type": "dance"}), "unknown reply type"),
        (
            json!({"type": "plan", "steps": {"id": "s1"}}),
            "plan must be a non-empty list",
        ),
        (
            json!({"type": "plan", "steps": [{"tool": "get_order"}]}),
            "step 1: missing id",
        ),
        (
            json!({"type": "tool", "name": "get_order", "args": "ord_1001"}),
            "`args` must be an object",
        ),
        (
            json!({"type": "final", "outcome": "completed", "text": long_text}),
            "longer than the output cap",
        ),
    ];
    for (bad, want) in cases {
        let r = go(
            &mut script(vec![bad.clone(); 3]),
            Budget::default(),
            DemoStore::new(),
        );
        let st = &r.state;
        assert_eq!(st.stop, Some(StopReason::NoProgress), "{bad}");
        assert_eq!(st.step, 3, "{bad}");
        let detail = st
            .last_result
            .as_ref()
            .map(|v| v.to_string())
            .unwrap_or_default();
        assert!(detail.contains(want), "{bad}: {detail}");
        assert!(st.tokens <= Budget::default().tokens_max);
    }
}

#[test]
fn text_replies_from_a_real_model_are_parsed() {
    let text = r#"{"type": "final", "outcome": "cannot_complete", "text": "order not mine"}"#;
    let r = go(
        &mut script(vec![Value::String(text.into())]),
        Budget::default(),
        DemoStore::new(),
    );
    assert_eq!(r.state.stop, Some(StopReason::Done));
    assert_eq!(r.state.outcome.as_deref(), Some("cannot_complete"));
    assert_eq!(r.state.answer.as_deref(), Some("order not mine"));
    assert!(
        closing_message(&r.state, &Catalog::demo())
            .contains("without completing (cannot_complete)")
    );
}

#[test]
fn completed_claim_with_open_steps_is_plan_incomplete() {
    let plan = json!({"type": "plan", "steps": [{"id": "s1", "tool": "get_order"}]});
    let done = json!({"type": "final", "outcome": "completed", "text": "done"});
    let r = go(
        &mut script(vec![plan, done]),
        Budget {
            steps_max: 2,
            ..Budget::default()
        },
        DemoStore::new(),
    );
    assert_eq!(r.state.stop, Some(StopReason::MaxSteps));
    assert_eq!(
        r.state.last_result,
        Some(json!({"status": "error", "code": "plan_incomplete", "detail": ["s1"]}))
    );
}

#[test]
fn second_plan_is_rejected_with_a_reason() {
    let plan = json!({"type": "plan", "steps": [{"id": "s1", "tool": "get_order"}]});
    let r = go(
        &mut script(vec![plan.clone(), plan]),
        Budget {
            steps_max: 2,
            ..Budget::default()
        },
        DemoStore::new(),
    );
    assert_eq!(
        r.state.last_result,
        Some(
            json!({"status": "error", "code": "invalid_plan", "detail": ["a plan is already set"]})
        )
    );
}

#[test]
fn unknown_tool_and_allow_listed_facts() {
    let r = go(
        &mut script(vec![
            json!({"type": "tool", "name": "delete_order", "args": {"order_id": "ord_1001"}}),
            json!({"type": "tool", "name": "search_policy", "args": {"order_id": "ord_1001"}}),
            json!({"type": "tool", "name": "get_order", "args": {"order_id": "ord_1001"}}),
            json!({"type": "final", "text": "ok"}),
        ]),
        Budget::default(),
        DemoStore::new(),
    );
    assert_eq!(r.state.stop, Some(StopReason::Done));
    // The policy text is content, not a fact; the order's fields are facts.
    let keys: Vec<&String> = r.state.facts.keys().collect();
    assert_eq!(
        keys,
        [
            "ord_1001.order_status",
            "ord_1001.refunded_cents",
            "ord_1001.total_cents"
        ]
    );
    assert_eq!(r.state.tool_calls, 2, "the unknown tool was never called");
}

#[test]
fn malformed_tool_results_are_errors_or_unknown() {
    struct Bad;
    impl tether::tools::Tools for Bad {
        fn call(&mut self, _req: &tether::kernel::ToolRequest<'_>) -> tether::kernel::ToolReply {
            tether::kernel::ToolReply {
                result: json!(["not", "an", "object"]),
                latency_ms: 10,
            }
        }
    }
    let catalog = Catalog::demo();
    let read = json!({"type": "tool", "name": "get_order", "args": {"order_id": "ord_1001"}});
    let mut s = tether::kernel::Session::start(
        TaskState::new("t", "cu_ana", "g"),
        Budget::default(),
        &catalog,
        0,
    );
    let stop = tether::sim::drive(&mut s, &mut script(vec![read; 5]), &mut Bad);
    assert_eq!(
        stop,
        StopReason::RepeatedCall,
        "the third identical read is refused"
    );
    assert_eq!(
        s.state()
            .last_result
            .as_ref()
            .and_then(|v| v["code"].as_str()),
        Some("invalid_result")
    );

    let plan = json!({"type": "plan", "steps": [{"id": "s1", "tool": "get_order"}, {"id": "s2", "tool": "send_status_email", "depends_on": ["s1"]}]});
    let write = json!({"type": "tool", "name": "send_status_email", "args": {"order_id": "ord_1001"}, "plan_step": "s2"});
    let mut s = tether::kernel::Session::start(
        TaskState::new("t", "cu_ana", "g"),
        Budget::default(),
        &catalog,
        0,
    );
    let stop = tether::sim::drive(&mut s, &mut script(vec![plan, write]), &mut Bad);
    assert_eq!(
        stop,
        StopReason::UnknownOutcome,
        "a garbled answer to a write is not a success"
    );
    assert_eq!(
        s.state().pending.as_ref().map(|c| c.name.as_str()),
        Some("send_status_email")
    );
}

#[test]
fn closing_messages_from_plan_statuses() {
    let catalog = Catalog::demo();
    let all = scenarios();
    let e = all[4].run();
    assert_eq!(e.state.stop, Some(StopReason::Deadline));
    assert_eq!(
        closing_message(&e.state, &catalog),
        "The task stopped at its time limit. The order was read, the refund was issued, and the confirmation email was sent."
    );
    let f = all[5].run();
    assert_eq!(
        closing_message(&f.state, &catalog),
        "The task stopped at its step limit. The order was read, the refund was issued, and the confirmation email was not sent."
    );
    let h = all[7].run();
    let msg = closing_message(&h.state, &catalog);
    assert!(
        msg.contains("it is unknown whether the refund was issued"),
        "{msg}"
    );
    for sc in &all {
        let r = sc.run();
        assert!(!closing_message(&r.state, &catalog).is_empty());
    }
}

/// Issue 22: a catalog without phrases reads as sentences ("Lookup_customer was done" was
/// the tool's name capitalized), and counts agree with their nouns.
#[test]
fn closing_messages_read_well_for_any_catalog() {
    use tether::kernel::state::{PlanStep, StepStatus};
    let mut catalog = Catalog::demo();
    for t in &mut catalog.tools {
        t.done_phrase.clear();
        t.not_done_phrase.clear();
    }
    let mut st = TaskState::new("t1", "cu_ana", "g");
    st.stop = Some(StopReason::Done);
    st.tool_calls = 1;
    assert!(
        closing_message(&st, &catalog).ends_with("No plan was set; 1 tool call was made."),
        "{}",
        closing_message(&st, &catalog)
    );
    st.tool_calls = 0;
    assert!(closing_message(&st, &catalog).ends_with("no tool calls were made."));
    st.tool_calls = 2;
    assert!(closing_message(&st, &catalog).ends_with("2 tool calls were made."));
    let step = |id: &str, tool: &str, status| PlanStep {
        id: id.into(),
        tool: tool.into(),
        depends_on: vec![],
        status,
    };
    st.plan = vec![
        step("s1", "get_order", StepStatus::Done),
        step("s2", "issue_refund", StepStatus::Pending),
    ];
    let msg = closing_message(&st, &catalog);
    assert!(
        msg.ends_with("Step s1 (get_order) was done, and step s2 (issue_refund) was not done."),
        "{msg}"
    );
}

/// Scenario H holds the write whose outcome is unknown; resuming re-sends it under the same
/// call key, the store replays its stored result, and the refund exists once.
#[test]
fn held_unknown_write_resumes_under_its_original_key() {
    let h = scenarios()[7].run();
    assert_eq!(h.state.stop, Some(StopReason::UnknownOutcome));
    let held = h.state.pending.clone().expect("held write");
    assert_eq!(held.key(&h.state.task_id, h.state.step), "t1:s2");
    let mut store = h.store;
    store.latency_ms.clear();
    // With no active time left the held call is not sent at all; it stays held.
    let (again, _) = resume(
        &mut ModelProfile::policy().build(),
        Budget::default(),
        &mut store,
        h.state.clone(),
    );
    assert_eq!(again.stop, Some(StopReason::Deadline));
    assert_eq!(
        again.pending.as_ref().map(|c| c.name.as_str()),
        Some("issue_refund")
    );
    // With time (a larger deadline), it is re-sent under its key and the stored result returns.
    let budget = Budget {
        deadline_ms: 60_000,
        ..Budget::default()
    };
    let (st, spans) = resume(
        &mut ModelProfile::policy().build(),
        budget,
        &mut store,
        h.state,
    );
    assert_eq!(st.stop, Some(StopReason::Done));
    let refunds = store
        .effects
        .iter()
        .filter(|e| matches!(e, tether::tools::Effect::Refund { .. }))
        .count();
    assert_eq!(refunds, 1);
    assert_eq!(spans[1].key.as_deref(), Some("t1:s2"));
    assert_eq!(spans[1].status, "ok");
    assert_eq!(
        st.plan
            .iter()
            .filter(|s| s.status == tether::kernel::StepStatus::Done)
            .count(),
        3
    );
}

#[test]
fn cancel_at_a_step_boundary() {
    let catalog = Catalog::demo();
    let mut s = tether::kernel::Session::start(
        TaskState::new("t", "cu_ana", "g"),
        Budget::default(),
        &catalog,
        0,
    );
    let mut model = ModelProfile::policy().build();
    let reply = match s.poll() {
        tether::kernel::Action::Model(req) => model.next(&req),
        _ => panic!("first action is a model call"),
    };
    assert!(
        !s.cancel(),
        "a model call is outstanding: its reply must be folded in first"
    );
    s.on_model(reply);
    assert!(matches!(s.poll(), tether::kernel::Action::StepEnd));
    assert!(s.cancel());
    assert_eq!(s.state().stop, Some(StopReason::Cancelled));
    assert!(matches!(
        s.poll(),
        tether::kernel::Action::Finished(StopReason::Cancelled)
    ));
}

#[test]
fn usage_numbers_replace_the_estimate() {
    let catalog = Catalog::demo();
    let mut s = tether::kernel::Session::start(
        TaskState::new("t", "cu_ana", "g"),
        Budget::default(),
        &catalog,
        0,
    );
    assert!(matches!(s.poll(), tether::kernel::Action::Model(_)));
    s.on_model(ModelReply {
        outcome: Ok(RawReply::Text(r#"{"type": "final", "text": "hi"}"#.into())),
        latency_ms: 5,
        usage: Some(tether::kernel::Usage {
            input_tokens: 77,
            output_tokens: 9,
        }),
        response: None,
        turn: None,
    });
    assert_eq!(s.state().tokens, 86);
}

/// A provider that counts twice the estimated input: the pessimistic check learns the ratio and
/// stops before the provider's counts pass the token budget.
#[test]
fn provider_usage_larger_than_the_estimate_still_respects_the_budget() {
    struct Greedy;
    impl tether::model::Model for Greedy {
        fn next(&mut self, req: &tether::kernel::ModelRequest<'_>) -> ModelReply {
            let est = (req.view.len() as u64).div_ceil(4);
            ModelReply {
                outcome: Ok(RawReply::Text(
                    r#"{"type": "tool", "name": "search_policy", "args": {"q": "x"}}"#.into(),
                )),
                latency_ms: 10,
                usage: Some(tether::kernel::Usage {
                    input_tokens: 2 * est,
                    output_tokens: 20,
                }),
                response: None,
                turn: None,
            }
        }
    }
    let budget = Budget {
        tokens_max: 4000,
        stalls_max: 20,
        repeat_max: 20,
        tool_calls_max: 20,
        steps_max: 20,
        ..Budget::default()
    };
    let r = go(&mut Greedy, budget, DemoStore::new());
    assert_eq!(r.state.stop, Some(StopReason::MaxTokens));
    assert!(
        r.state.tokens <= budget.tokens_max,
        "{} > {}",
        r.state.tokens,
        budget.tokens_max
    );
}

/// An MCP tool's arguments are checked against its stored `inputSchema`, as they will be sent:
/// with the task's user id in `user_arg`, which the model may not set.
#[test]
fn mcp_arguments_are_checked_against_the_input_schema() {
    use tether::kernel::catalog::{Access, McpSpec, ToolSpec, args_as_sent, check_args};
    let spec = ToolSpec {
        name: "issue_refund".into(),
        description: String::new(),
        access: Access::Write,
        idempotent: false,
        fact_fields: vec![],
        fact_prefix_arg: String::new(),
        done_phrase: String::new(),
        not_done_phrase: String::new(),
        approval: Default::default(),
        requires: Default::default(),
        args: Default::default(),
        http: None,
        mcp: Some(McpSpec {
            server: "shop".into(),
            digest: "0123456789abcdef".into(),
            input_schema: json!({
                "type": "object",
                "properties": {
                    "order_id": {"type": "string"},
                    "amount_cents": {"type": "integer", "minimum": 1},
                    "customer_id": {"type": "string"}
                },
                "required": ["order_id", "amount_cents", "customer_id"],
                "additionalProperties": false
            }),
            needs_approval: true,
            user_arg: Some("customer_id".into()),
        }),
        asks_person: false,
    };
    let args = |v: Value| v.as_object().expect("object").clone();
    let good = args(json!({"order_id": "o1", "amount_cents": 700}));
    assert_eq!(check_args(&spec, &good, "cu_ana"), Ok(()));
    assert_eq!(
        args_as_sent(&spec, &good, "cu_ana")["customer_id"],
        "cu_ana"
    );
    for (bad, want) in [
        (
            json!({"order_id": "o1", "amount_cents": "lots"}),
            "/amount_cents",
        ),
        (json!({"order_id": "o1", "amount_cents": 0}), "minimum"),
        (json!({"order_id": "o1"}), "amount_cents"),
        (
            json!({"order_id": "o1", "amount_cents": 5, "note": "x"}),
            "note",
        ),
        (
            json!({"order_id": "o1", "amount_cents": 5, "customer_id": "cu_mallory"}),
            "comes from the task",
        ),
    ] {
        let err = check_args(&spec, &args(bad.clone()), "cu_ana").expect_err("refused");
        assert!(err.starts_with("issue_refund: "), "{bad}: {err}");
        assert!(err.contains(want), "{bad}: {err}");
    }
    // A schema the checker cannot use refuses every call, by name, instead of passing them.
    let mut broken = spec.clone();
    if let Some(m) = broken.mcp.as_mut() {
        m.input_schema = json!({"type": "no-such-type"});
    }
    let err = check_args(&broken, &good, "cu_ana").expect_err("refused");
    assert!(err.contains("input schema"), "{err}");
}
