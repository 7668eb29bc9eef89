//! The prompt's unit tests: functions from the catalog, replies read as moves.

use super::*;

fn prompt(calling: ToolCalling) -> Prompt {
    Prompt::new(
        &Catalog::demo(),
        calling,
        FinalAnswer::Function,
        Some("You are a support agent."),
        None,
    )
}

#[test]
fn one_object_is_found_in_prose_and_fences() {
    let t = "Here is my next move:\n```json\n{\"type\": \"final\", \"text\": \"a {b}\"}\n```";
    assert_eq!(
        json_objects(t),
        vec![json!({"type": "final", "text": "a {b}"})]
    );
    assert_eq!(json_objects("no braces").len(), 0);
    assert_eq!(json_objects("{\"a\": 1} and {\"b\": 2}").len(), 2);
    assert_eq!(json_objects("{\"a\": 1, \"a\": 2}").len(), 0);
    assert_eq!(json_objects(&"{".repeat(100_000)).len(), 0);
}

/// Review finding: a `final_answer` without an outcome (or with another one) ended the
/// task done with its plan pending; it is an invalid reply, which the model is told.
#[test]
fn a_final_answer_needs_one_of_the_two_outcomes() {
    let p = prompt(ToolCalling::Native);
    let call = |args: Value| TurnCall {
        id: "c1".into(),
        name: FINAL_FN.into(),
        arguments: args,
    };
    for args in [
        json!({"text": "Refunded."}),
        json!({"outcome": "bogus", "text": "x"}),
        json!({"outcome": 7, "text": "x"}),
    ] {
        let RawReply::Invalid(why) = p.move_of_call(&call(args.clone())) else {
            panic!("{args} is not a final answer");
        };
        assert!(why.contains("needs \"outcome\""), "{why}");
    }
    for outcome in ["completed", "cannot_complete"] {
        assert_eq!(
            p.move_of_call(&call(json!({"outcome": outcome, "text": "t"}))),
            RawReply::Json(json!({"type": "final", "outcome": outcome, "text": "t"}))
        );
    }
}

#[test]
fn json_mode_wants_exactly_one_object() {
    let p = prompt(ToolCalling::Json);
    assert!(p.functions.is_empty());
    assert!(p.system.contains("- get_order:"), "{}", p.system);
    assert!(matches!(
        p.move_of_text("Sure! {\"type\": \"plan\", \"steps\": []}"),
        RawReply::Json(_)
    ));
    let RawReply::Invalid(why) = p.move_of_text("{\"a\": 1} {\"b\": 2}") else {
        panic!("two objects are not one move");
    };
    assert!(why.contains("2 JSON objects"), "{why}");
}

#[test]
fn a_tool_call_names_its_plan_step_by_argument() {
    let p = prompt(ToolCalling::Native);
    assert_eq!(p.functions[0].name, PLAN_FN);
    assert_eq!(p.functions.last().map(|f| f.name.as_str()), Some(FINAL_FN));
    assert!(p.id.starts_with("native-2+"), "{}", p.id);
    let call = TurnCall {
        id: "call_1".into(),
        name: "get_order".into(),
        arguments: json!({"order_id": "ord_1", "plan_step": "s1"}),
    };
    assert_eq!(
        p.move_of_call(&call),
        RawReply::Json(json!({"type": "tool", "name": "get_order",
            "args": {"order_id": "ord_1"}, "plan_step": "s1"}))
    );
    let bad = TurnCall {
        arguments: Value::String("{\"order_id\": ".into()),
        ..call
    };
    assert!(
        matches!(p.move_of_call(&bad), RawReply::Invalid(w) if w.contains("not a JSON object"))
    );
}

/// Thousands of tasks of one profile in flight hold one copy of its system prompt and
/// functions; other instructions make another prompt, and an entry no prompt holds is gone.
#[test]
fn prompts_of_the_same_catalog_and_instructions_share_one_copy() {
    // Instructions of this test's own: the other tests' prompts run beside it.
    let make = |instructions: &str| {
        Prompt::new(
            &Catalog::demo(),
            ToolCalling::Native,
            FinalAnswer::Function,
            Some(instructions),
            None,
        )
    };
    let (a, b) = (make("You share."), make("You share."));
    assert!(Arc::ptr_eq(&a.functions, &b.functions));
    assert!(Arc::ptr_eq(&a.system, &b.system));
    let other = make("You share nothing.");
    assert!(!Arc::ptr_eq(&a.system, &other.system));
    assert_ne!(a.system, other.system);
    let weak = Arc::downgrade(&a.system);
    drop(a);
    assert!(weak.upgrade().is_some(), "the second prompt still holds it");
    let c = make("You share.");
    assert!(
        Arc::ptr_eq(&b.system, &c.system),
        "shared while one holds it"
    );
    drop((b, c));
    assert!(weak.upgrade().is_none(), "no prompt holds it: it is freed");
}
