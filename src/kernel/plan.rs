//! Static validation of a model-proposed plan, with the design reference's rules and messages.
//!
//! Checks: a non-empty list, no longer than the budget, unique ids, known tools, dependencies
//! on earlier steps only, and each tool's `requires` (the demo shop: a prerequisite for
//! every write). A revision of an accepted plan keeps its done steps, never reuses a failed
//! step's id (a new attempt gets a new call key), and counts toward `replans_max`. Malformed steps (not an object,
//! no id, an id or dependency that is not a string) are reported the same way, never a panic.

use serde_json::Value;

use super::catalog::{Catalog, Requires};
use super::json::py_str_repr;
use super::state::{PlanStep, StepStatus};

/// Returns the accepted steps, or the list of problems.
pub fn validate_plan(
    steps: &Value,
    plan_steps_max: u32,
    catalog: &Catalog,
) -> Result<Vec<PlanStep>, Vec<String>> {
    let items = match steps.as_array() {
        Some(items) if !items.is_empty() => items,
        _ => return Err(vec!["plan must be a non-empty list".to_string()]),
    };
    let mut problems = Vec::new();
    if items.len() > plan_steps_max as usize {
        problems.push(format!(
            "too many steps ({} > {plan_steps_max})",
            items.len()
        ));
    }
    let mut seen: Vec<&str> = Vec::with_capacity(items.len());
    let mut accepted = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let n = i + 1;
        let Some(obj) = item.as_object() else {
            problems.push(format!("step {n}: must be an object"));
            continue;
        };
        let sid = match step_id(obj, n) {
            Ok(sid) => sid,
            Err(problem) => {
                problems.push(problem);
                continue;
            }
        };
        let tool = obj.get("tool").and_then(Value::as_str);
        let deps: &[Value] = match obj.get("depends_on") {
            None | Some(Value::Null) => &[],
            Some(Value::Array(d)) => d,
            Some(_) => {
                problems.push(format!("{sid}: depends_on must be a list"));
                &[]
            }
        };
        if seen.contains(&sid) {
            problems.push(format!("{sid}: duplicate id"));
        }
        let spec = tool.and_then(|t| catalog.get(t));
        if spec.is_none() {
            problems.push(format!("{sid}: unknown tool {}", shown(obj.get("tool"))));
        }
        let dep_ids = earlier_steps(sid, deps, &seen, &mut problems);
        match spec.map(|s| &s.requires) {
            Some(Requires::AnyStep) if deps.is_empty() => {
                problems.push(format!("{sid}: write step has no prerequisite"));
            }
            Some(Requires::Tools(tools)) => {
                let before = tools_before(&accepted, &dep_ids);
                if !tools.iter().any(|t| before.contains(&t.as_str())) {
                    problems.push(format!(
                        "{sid}: a step of {} must come after a step using {} (depends_on, directly or not)",
                        tool.unwrap_or_default(),
                        tools.join(" or ")
                    ));
                }
            }
            _ => {}
        }
        seen.push(sid);
        accepted.push(PlanStep {
            id: sid.to_string(),
            tool: tool.unwrap_or_default().to_string(),
            depends_on: dep_ids,
            status: StepStatus::Pending,
        });
    }
    if problems.is_empty() {
        Ok(accepted)
    } else {
        Err(problems)
    }
}

/// The ids in `deps` of steps `seen` earlier; a problem for each other one.
fn earlier_steps(
    sid: &str,
    deps: &[Value],
    seen: &[&str],
    problems: &mut Vec<String>,
) -> Vec<String> {
    let mut dep_ids = Vec::with_capacity(deps.len());
    for d in deps {
        match d.as_str() {
            Some(d) if seen.contains(&d) => dep_ids.push(d.to_string()),
            Some(d) => problems.push(format!(
                "{sid}: depends on {}, which is not an earlier step",
                py_str_repr(d)
            )),
            None => problems.push(format!(
                "{sid}: depends on {d}, which is not an earlier step"
            )),
        }
    }
    dep_ids
}

/// A step's `tool` as Python's message shows it.
fn shown(tool: Option<&Value>) -> String {
    match tool {
        Some(Value::String(t)) => py_str_repr(t),
        None | Some(Value::Null) => "None".to_string(),
        Some(other) => other.to_string(),
    }
}

/// A plan step's id, or the problem with it (step `n`, counted from 1).
fn step_id(obj: &serde_json::Map<String, Value>, n: usize) -> Result<&str, String> {
    match obj.get("id") {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.as_str()),
        Some(Value::String(_)) | None | Some(Value::Null) => Err(format!("step {n}: missing id")),
        Some(_) => Err(format!("step {n}: id must be a string")),
    }
}

/// The tools of the accepted steps among `deps` and their prerequisites, direct or not.
fn tools_before<'a>(accepted: &'a [PlanStep], deps: &'a [String]) -> Vec<&'a str> {
    let mut before: Vec<&str> = Vec::new();
    let mut todo: Vec<&str> = deps.iter().map(String::as_str).collect();
    while let Some(d) = todo.pop() {
        if let Some(p) = accepted.iter().find(|p| p.id == d) {
            before.push(p.tool.as_str());
            todo.extend(p.depends_on.iter().map(String::as_str));
        }
    }
    before
}

/// A revision of the accepted plan `current`, the `replans`-th so far: the new steps checked
/// as a plan, with every done step kept (same id and tool, still done), no failed step's id
/// reused (nor one of `spent`, failed steps earlier revisions dropped), and no step's id given
/// to another tool. Refused past `replans_max`.
pub fn revise_plan(
    current: &[PlanStep],
    spent: &[String],
    steps: &Value,
    budget: &super::state::Budget,
    replans: u32,
    catalog: &Catalog,
) -> Result<Vec<PlanStep>, Vec<String>> {
    if replans >= budget.replans_max {
        return Err(vec![format!(
            "the plan was revised {replans} times already, the most this task's budget allows (replans_max = {}): carry on with it, or end with outcome cannot_complete",
            budget.replans_max
        )]);
    }
    let mut revised = validate_plan(steps, budget.plan_steps_max, catalog)?;
    let mut problems = Vec::new();
    for s in revised.iter().filter(|s| spent.contains(&s.id)) {
        problems.push(format!(
            "{}: the id of a step that failed earlier; its call key is spent, so give the step a new id",
            s.id
        ));
    }
    for old in current {
        let new = revised.iter_mut().find(|s| s.id == old.id);
        match (old.status, new) {
            (StepStatus::Done, Some(n)) if n.tool == old.tool => n.status = StepStatus::Done,
            (StepStatus::Done, _) => problems.push(format!(
                "{}: done ({}), so the revised plan keeps it as it is",
                old.id, old.tool
            )),
            (StepStatus::Failed, Some(_)) => problems.push(format!(
                "{}: failed, so a new attempt needs a step with a new id (its write gets a new call key)",
                old.id
            )),
            (StepStatus::Pending, Some(n)) if n.tool != old.tool => problems.push(format!(
                "{}: a {} step of the current plan; give a {} step a new id",
                old.id, old.tool, n.tool
            )),
            _ => {}
        }
    }
    if problems.is_empty() {
        Ok(revised)
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(steps: Value) -> Vec<String> {
        validate_plan(&steps, 6, &Catalog::demo())
            .err()
            .unwrap_or_default()
    }

    #[test]
    fn malformed_steps_are_problems_not_panics() {
        assert_eq!(check(json!("x")), ["plan must be a non-empty list"]);
        assert_eq!(check(json!([])), ["plan must be a non-empty list"]);
        assert_eq!(check(json!([3])), ["step 1: must be an object"]);
        assert_eq!(
            check(json!([{"tool": "get_order"}])),
            ["step 1: missing id"]
        );
        assert_eq!(
            check(json!([{"id": 7, "tool": "get_order"}])),
            ["step 1: id must be a string"]
        );
        assert_eq!(
            check(json!([{"id": "s1", "tool": "get_order", "depends_on": "s0"}])),
            ["s1: depends_on must be a list"]
        );
        assert_eq!(
            check(json!([{"id": "s1", "tool": "get_order"}, {"id": "s1", "tool": "get_order"}])),
            ["s1: duplicate id"]
        );
        assert_eq!(check(json!([{"id": "s1"}])), ["s1: unknown tool None"]);
    }

    fn step(id: &str, tool: &str, status: StepStatus) -> PlanStep {
        PlanStep {
            id: id.into(),
            tool: tool.into(),
            depends_on: Vec::new(),
            status,
        }
    }

    #[test]
    fn a_revision_keeps_done_steps_gives_retries_new_ids_and_is_counted() {
        let current = [
            step("s1", "get_order", StepStatus::Done),
            step("s2", "issue_refund", StepStatus::Failed),
        ];
        let budget = crate::kernel::Budget::default();
        let revise = |steps: Value, replans: u32| {
            revise_plan(
                &current,
                &["s0".to_string()],
                &steps,
                &budget,
                replans,
                &Catalog::demo(),
            )
        };
        let ok = revise(
            json!([{"id": "s1", "tool": "get_order"},
                   {"id": "s3", "tool": "issue_refund", "depends_on": ["s1"]}]),
            0,
        )
        .expect("a revision");
        assert_eq!(ok[0].status, StepStatus::Done, "kept as done");
        assert_eq!(ok[1].status, StepStatus::Pending);
        assert_eq!(
            revise(
                json!([{"id": "s1", "tool": "get_order"},
                       {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]}]),
                0
            )
            .unwrap_err(),
            [
                "s2: failed, so a new attempt needs a step with a new id (its write gets a new call key)"
            ]
        );
        assert_eq!(
            revise(json!([{"id": "s4", "tool": "get_order"}]), 0).unwrap_err(),
            ["s1: done (get_order), so the revised plan keeps it as it is"]
        );
        // A failed step an earlier revision dropped stays spent.
        assert_eq!(
            revise(
                json!([{"id": "s1", "tool": "get_order"},
                          {"id": "s0", "tool": "issue_refund", "depends_on": ["s1"]}]),
                0
            )
            .unwrap_err(),
            [
                "s0: the id of a step that failed earlier; its call key is spent, so give the step a new id"
            ]
        );
        let over = revise(json!([{"id": "s1", "tool": "get_order"}]), 2).unwrap_err();
        assert!(over[0].contains("replans_max = 2"), "{over:?}");
    }

    #[test]
    fn requires_names_the_tools_a_step_must_come_after() {
        let mut catalog = Catalog::demo();
        for t in &mut catalog.tools {
            if t.name == "issue_refund" {
                t.requires = Requires::Tools(vec!["get_order".into()]);
            }
        }
        let check = |steps: Value| validate_plan(&steps, 6, &catalog).err().unwrap_or_default();
        assert!(
            check(json!([{"id": "s1", "tool": "get_order"},
            {"id": "s2", "tool": "search_policy", "depends_on": ["s1"]},
            {"id": "s3", "tool": "issue_refund", "depends_on": ["s2"]}]))
            .is_empty()
        );
        assert_eq!(
            check(json!([{"id": "s1", "tool": "search_policy"},
                {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]}])),
            [
                "s2: a step of issue_refund must come after a step using get_order (depends_on, directly or not)"
            ]
        );
        // Without a rule, a write may be a plan of its own.
        catalog
            .tools
            .iter_mut()
            .for_each(|t| t.requires = Requires::Nothing);
        assert!(validate_plan(&json!([{"id": "s1", "tool": "issue_refund"}]), 6, &catalog).is_ok());
    }
}
