//! The plan half of a step: a proposed plan accepted, revised (the worker's tasks; the
//! document's kernel accepts one plan) or refused; and the check a `completed` answer must
//! pass: no step pending and, for the worker's tasks, no write failed or refused since.

use serde_json::{Value, json};

use super::Session;
use crate::kernel::plan::{revise_plan, validate_plan};
use crate::kernel::state::StepStatus;

impl Session<'_> {
    pub(super) fn on_plan(&mut self, steps: &Value) {
        let first = self.state.plan.is_empty();
        let verdict = if first {
            validate_plan(steps, self.budget.plan_steps_max, self.catalog)
        } else if self.keys.strict {
            revise_plan(
                &self.state.plan,
                &self.state.spent_steps,
                steps,
                &self.budget,
                self.state.replans,
                self.catalog,
            )
        } else {
            Err(vec!["a plan is already set".to_string()])
        };
        match verdict {
            Ok(plan) => {
                // The failed steps this revision drops keep their ids spent.
                for old in &self.state.plan {
                    if old.status == StepStatus::Failed && !self.state.spent_steps.contains(&old.id)
                    {
                        self.state.spent_steps.push(old.id.clone());
                    }
                }
                self.state.plan = plan;
                self.turn_answer = Some(if first {
                    json!({"status": "ok", "code": "plan_accepted"})
                } else {
                    self.state.replans += 1;
                    json!({"status": "ok", "code": "plan_revised",
                        "detail": format!("revision {} of at most {} (replans_max); done steps kept", self.state.replans, self.budget.replans_max)})
                });
            }
            Err(problems) => {
                self.set_result(
                    json!({"status": "error", "code": "invalid_plan", "detail": problems}),
                );
            }
        }
    }

    /// Why a final answer with `outcome` is refused, as the result the model is shown.
    pub(super) fn completion_refused(&self, outcome: &Option<String>) -> Option<Value> {
        if outcome.as_deref() != Some("completed") {
            return None;
        }
        let open = self.state.open_steps();
        if !open.is_empty() {
            return Some(json!({"status": "error", "code": "plan_incomplete", "detail": open}));
        }
        let not_done = self.writes_not_done();
        (!not_done.is_empty()).then(|| {
            json!({"status": "error", "code": "writes_not_done",
                "detail": format!("completed needs every write done, and {} failed or was refused and has not succeeded since: try it again (a failed plan step in a revised plan, with a new step id), or end with outcome cannot_complete", not_done.join(", "))})
        })
    }
}
