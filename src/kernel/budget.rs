//! A task's budget: its limits, each named with its unit, with the design reference's
//! defaults, and how an operator's `--budget` and `--extend` set them by name.

use serde::{Deserialize, Serialize};

/// Limits of one task. Names carry their unit; the defaults are the design reference's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Budget {
    /// Loop iterations (model calls).
    pub steps_max: u32,
    pub tool_calls_max: u32,
    /// Model input plus output tokens over the whole run.
    pub tokens_max: u64,
    /// Cap on one model reply.
    pub output_tokens_max: u32,
    /// Active time: model and tool latency, not time spent waiting for a person.
    pub deadline_ms: u64,
    /// Times the same (tool, args) may be proposed.
    pub repeat_max: u32,
    /// Consecutive steps that leave the progress signature unchanged.
    pub stalls_max: u32,
    pub plan_steps_max: u32,
    /// Times an accepted plan may be revised (the worker's tasks; the design reference's kernel
    /// accepts one plan only).
    pub replans_max: u32,
}

impl Default for Budget {
    fn default() -> Self {
        Budget {
            steps_max: 8,
            tool_calls_max: 6,
            tokens_max: 4000,
            output_tokens_max: 300,
            deadline_ms: 30_000,
            repeat_max: 2,
            stalls_max: 3,
            plan_steps_max: 6,
            replans_max: 2,
        }
    }
}

/// Names accepted by [`Budget::set`], in declaration order.
pub const BUDGET_FIELDS: [&str; 9] = [
    "steps_max",
    "tool_calls_max",
    "tokens_max",
    "output_tokens_max",
    "deadline_ms",
    "repeat_max",
    "stalls_max",
    "plan_steps_max",
    "replans_max",
];

impl Budget {
    /// One limit by its name (a [`BUDGET_FIELDS`] name); `None` for any other name.
    pub fn get(&self, name: &str) -> Option<u64> {
        Some(match name {
            "steps_max" => self.steps_max.into(),
            "tool_calls_max" => self.tool_calls_max.into(),
            "tokens_max" => self.tokens_max,
            "output_tokens_max" => self.output_tokens_max.into(),
            "deadline_ms" => self.deadline_ms,
            "repeat_max" => self.repeat_max.into(),
            "stalls_max" => self.stalls_max.into(),
            "plan_steps_max" => self.plan_steps_max.into(),
            "replans_max" => self.replans_max.into(),
            _ => return None,
        })
    }

    /// Sets one limit by name, as `worker enqueue --budget name=value` does.
    pub fn set(&mut self, name: &str, value: &str) -> Result<(), String> {
        let parsed: u64 = value
            .trim()
            .parse()
            .map_err(|_| format!("budget {name}: {value:?} is not a whole number"))?;
        if parsed == 0
            && let Some(why) = zero_cannot_work(name)
        {
            return Err(format!(
                "budget {name}: 0 cannot work ({why}); give at least 1"
            ));
        }
        let small =
            || u32::try_from(parsed).map_err(|_| format!("budget {name}: {parsed} is too large"));
        match name {
            "steps_max" => self.steps_max = small()?,
            "tool_calls_max" => self.tool_calls_max = small()?,
            "tokens_max" => self.tokens_max = parsed,
            "output_tokens_max" => self.output_tokens_max = small()?,
            "deadline_ms" => self.deadline_ms = parsed,
            "repeat_max" => self.repeat_max = small()?,
            "stalls_max" => self.stalls_max = small()?,
            "plan_steps_max" => self.plan_steps_max = small()?,
            "replans_max" => self.replans_max = small()?,
            _ => {
                return Err(format!(
                    "unknown budget {name:?}; known: {}",
                    BUDGET_FIELDS.join(", ")
                ));
            }
        }
        Ok(())
    }
}

/// Why a limit of 0 cannot work, for the limits where it cannot (`None`: 0 is a real choice,
/// as `replans_max = 0` for a task whose first plan must hold).
fn zero_cannot_work(name: &str) -> Option<&'static str> {
    Some(match name {
        "steps_max" | "tool_calls_max" => "the task would stop before its first model call",
        "tokens_max" => "no model call fits in no tokens",
        "output_tokens_max" => "the model could not answer anything",
        "deadline_ms" => "the task would have no time to work",
        "stalls_max" => "the task would stop as making no progress after any step",
        "repeat_max" => "every tool call would count as a repeat and stop the task",
        _ => return None,
    })
}
