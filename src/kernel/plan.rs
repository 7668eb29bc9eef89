//! Static validation of a model-proposed plan, with the document's rules and messages.
//!
//! Checks: a non-empty list, no longer than the budget, unique ids, known tools, dependencies
//! on earlier steps only, and a prerequisite for every write. Malformed steps (not an object,
//! no id, an id or dependency that is not a string) are reported the same way, never a panic.

use serde_json::Value;

use super::catalog::{Access, Catalog};
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
        let sid = match obj.get("id") {
            Some(Value::String(s)) if !s.is_empty() => s.as_str(),
            Some(Value::String(_)) | None | Some(Value::Null) => {
                problems.push(format!("step {n}: missing id"));
                continue;
            }
            Some(_) => {
                problems.push(format!("step {n}: id must be a string"));
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
            let shown = match obj.get("tool") {
                Some(Value::String(t)) => py_str_repr(t),
                None | Some(Value::Null) => "None".to_string(),
                Some(other) => other.to_string(),
            };
            problems.push(format!("{sid}: unknown tool {shown}"));
        }
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
        if spec.is_some_and(|s| s.access == Access::Write) && deps.is_empty() {
            problems.push(format!("{sid}: write step has no prerequisite"));
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
}
