//! The tool half of a step: a write checked against the accepted plan, the tool span opened,
//! and the result folded into the state (facts from allow-listed fields, plan statuses, a held
//! write kept in `pending`, the repeat and progress checks), then the step ended.

use serde_json::{Map, Value, json};

use super::{Phase, Session};
use crate::kernel::catalog::Access;
use crate::kernel::io::ToolReply;
use crate::kernel::json::{py_repr, write_value};
use crate::kernel::state::{StepStatus, StopReason, ToolCall, est_tokens};
use crate::kernel::trace::SpanKind;

impl Session<'_> {
    /// Under strict keys, a call that names no plan step carries out the one open step of the
    /// accepted plan that uses its tool, when there is exactly one; and a write must name (or
    /// so be given) a step of the plan whose tool matches, so that its key is the plan's.
    /// A call of a plan step also waits for the step's prerequisites, and a write never
    /// carries out a failed step again (a revised plan gives the attempt a step, and a key, of
    /// its own). `Err` is the refusal's code and what the model is told.
    pub(super) fn check_plan_step(
        &self,
        call: &mut ToolCall,
    ) -> Result<(), (&'static str, String)> {
        if !self.keys.strict {
            return Ok(());
        }
        self.step_of(call).map_err(|d| ("invalid_plan_step", d))?;
        let Some(step) = call
            .plan_step
            .as_deref()
            .and_then(|p| self.state.plan.iter().find(|s| s.id == p))
        else {
            return Ok(());
        };
        let write = self
            .catalog
            .get(&call.name)
            .is_none_or(|s| s.access == Access::Write);
        if write && step.status == StepStatus::Failed {
            return Err((
                "step_failed",
                format!(
                    "plan step {} failed; to try {} again, revise the plan with a new step for it (done steps are kept)",
                    step.id, call.name
                ),
            ));
        }
        if write && step.status == StepStatus::Done {
            return Err((
                "step_done",
                format!(
                    "plan step {} is done; another {} is a step of its own: revise the plan with a new step for it",
                    step.id, call.name
                ),
            ));
        }
        let waiting: Vec<String> = step
            .depends_on
            .iter()
            .filter_map(|d| self.state.plan.iter().find(|s| &s.id == d))
            .filter(|d| d.status != StepStatus::Done)
            .map(|d| format!("{} ({})", d.id, d.status.as_str()))
            .collect();
        if !waiting.is_empty() {
            return Err((
                "prerequisite_not_done",
                format!(
                    "plan step {} depends on {}, not done yet: carry that out first (a failed prerequisite needs a revised plan)",
                    step.id,
                    waiting.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// Which plan step the call carries out (see [`Self::check_plan_step`]).
    fn step_of(&self, call: &mut ToolCall) -> Result<(), String> {
        let write = self
            .catalog
            .get(&call.name)
            .is_none_or(|s| s.access == Access::Write);
        if call.plan_step.as_deref().is_none_or(str::is_empty) {
            let open: Vec<&str> = self
                .state
                .plan
                .iter()
                .filter(|s| s.tool == call.name && s.status == StepStatus::Pending)
                .map(|s| s.id.as_str())
                .collect();
            match open.as_slice() {
                [one] => call.plan_step = Some(one.to_string()),
                [] if !write => {}
                [] => {
                    return Err(format!(
                        "a write must carry out a step of the accepted plan; no open step uses {} (name one in plan_step, or propose a plan first)",
                        call.name
                    ));
                }
                many if write => {
                    return Err(format!(
                        "open plan steps {} all use {}: name the one this call carries out in plan_step",
                        many.join(", "),
                        call.name
                    ));
                }
                _ => {}
            }
        }
        if !write {
            return Ok(());
        }
        let Some(p) = call.plan_step.as_deref() else {
            return Ok(());
        };
        match self.state.plan.iter().find(|s| s.id == p) {
            None => Err(format!("plan step {p:?} is not in the accepted plan")),
            Some(step) if step.tool != call.name => Err(format!(
                "plan step {p:?} is a {} step, not {}",
                step.tool, call.name
            )),
            Some(_) => Ok(()),
        }
    }

    /// A write that was refused or failed (the worker's tasks): it keeps the task from
    /// ending `completed` until a call of the same tool succeeds.
    pub(super) fn write_failed(&mut self, tool: &str) {
        let write = self
            .catalog
            .get(tool)
            .is_some_and(|s| s.access == Access::Write);
        if self.keys.strict && write && !self.state.failed_writes.iter().any(|t| t == tool) {
            self.state.failed_writes.push(tool.to_string());
        }
    }

    /// The writes that keep the task from ending `completed`: failed plan steps of writes,
    /// and writes refused or failed since their tool last succeeded.
    pub(super) fn writes_not_done(&self) -> Vec<String> {
        if !self.keys.strict {
            return Vec::new();
        }
        // Without a plan, the writes refused so far (a write needs a plan step); with one, its
        // steps say what was done.
        if self.state.plan.is_empty() {
            return self.state.failed_writes.clone();
        }
        self.state
            .plan
            .iter()
            .filter(|s| s.status == StepStatus::Failed)
            .filter(|s| {
                self.catalog
                    .get(&s.tool)
                    .is_some_and(|t| t.access == Access::Write)
            })
            .map(|s| format!("step {} ({})", s.id, s.tool))
            .collect()
    }

    pub(super) fn open_tool(&mut self, call: ToolCall, parent: u32, held: bool) {
        let key = (self.keys).key(&call, &self.state.key_scope(), self.state.step);
        let t = self.state.elapsed_ms;
        let span = self
            .trace
            .start(SpanKind::Tool, call.name.clone(), Some(parent), t);
        let s = self.trace.get_mut(span);
        s.args = Some(call.args.clone());
        s.key = Some(key.clone());
        let timeout_ms = self.remaining_ms();
        self.phase = Phase::AwaitTool {
            call,
            key,
            timeout_ms,
            span,
            held,
        };
    }

    /// A question to a person: nothing is sent and no tool call is counted; the step ends with
    /// the call held and the task suspended until a person's answer is folded in as its
    /// result (`Run::Settled`).
    pub(super) fn ask_person(&mut self, call: ToolCall) {
        self.open_tool(call, self.step_span, false);
        let waiting = json!({"status": "needs_answer", "detail": "waiting for a person's answer"});
        self.fold_tool(
            ToolReply {
                result: waiting,
                latency_ms: 0,
            },
            false,
        );
    }

    /// Folds in the tool's result to the request of [`Action::Tool`].
    pub fn on_tool(&mut self, reply: ToolReply) {
        self.fold_tool(reply, true);
    }

    /// Folds in a tool result; `sent` says whether a call went out (and so counts).
    pub(super) fn fold_tool(&mut self, reply: ToolReply, sent: bool) {
        let Phase::AwaitTool {
            call,
            key: _,
            timeout_ms,
            span,
            held,
        } = std::mem::replace(&mut self.phase, Phase::Top)
        else {
            debug_assert!(false, "on_tool without a tool request");
            return;
        };
        let write = self
            .catalog
            .get(&call.name)
            .is_none_or(|s| s.access == Access::Write);
        let (result, secs) = if reply.latency_ms > timeout_ms {
            // The call outlived the remaining time: a write may still have happened.
            let r = if write {
                json!({"status": "unknown", "code": "timeout"})
            } else {
                json!({"status": "error", "code": "timeout"})
            };
            (r, timeout_ms)
        } else {
            (checked_result(reply.result, write), reply.latency_ms)
        };
        self.state.elapsed_ms = self.state.elapsed_ms.saturating_add(secs);
        // A call the worker held by its approval rule went nowhere: it is counted when it is
        // sent, after the approval.
        let held_by_rule = result["status"] == "needs_approval"
            && result["code"] == crate::kernel::io::HELD_BY_RULE;
        if sent && !held_by_rule {
            self.state.tool_calls = self.state.tool_calls.saturating_add(1);
        }
        let status = result
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("error");
        let code = result.get("code").and_then(Value::as_str);
        let t = self.state.elapsed_ms;
        // The result's text is written once here: its length is the span's token figure, and
        // the next views show the same text.
        let w = &mut self.written;
        w.result.clear();
        write_value(&mut w.result, &result);
        let s = self.trace.get_mut(span);
        s.result_tokens = Some(est_tokens(self.written.result.len()));
        let shown = code.filter(|c| !c.is_empty()).unwrap_or(status);
        self.trace.end(span, span_status(shown), t);
        // A person's answer is progress: something new the task could not have found itself.
        if status == "ok" && self.catalog.get(&call.name).is_some_and(|s| s.asks_person) {
            self.state.stalls = 0;
        }
        let stop = self.apply_status(call, status, code, &result);
        self.state.last_result = Some(result);
        // `written.result` holds this result's text, written above (nothing in between writes it).
        self.written.result_ok = true;
        if held {
            self.held_call_done(stop);
        } else {
            self.end_step(stop);
        }
    }

    /// The held call was this turn's move: the model is shown what came of it now.
    fn held_call_done(&mut self, stop: Option<StopReason>) {
        self.answer_turn();
        let t = self.state.elapsed_ms;
        if let Some(rid) = self.resume_span {
            self.trace
                .end(rid, stop.map_or("ok", StopReason::as_str), t);
        }
        match stop {
            Some(stop) => self.finish(stop, None),
            None => {
                self.state.progress_text(&mut self.progress);
                self.phase = Phase::HeldDone;
            }
        }
    }

    /// Whether `call`, which succeeded, is a read the task had not made before (another tool,
    /// or other arguments), for a model that takes messages: the design reference's rule
    /// (progress is a new fact or a plan step moved) stays its models' (see `docs/models.md`).
    fn counts_as_new_read(&self, call: &ToolCall) -> bool {
        matches!(self.input, crate::kernel::io::InputStyle::Messages { .. })
            && self
                .catalog
                .get(&call.name)
                .is_some_and(|s| s.access == Access::Read)
            && self.state.seen.get(&call.digest()).copied() == Some(1)
    }

    /// What a tool's answer does to the plan, the facts and the held call; the stop it asks
    /// for, if any.
    fn apply_status(
        &mut self,
        call: ToolCall,
        status: &str,
        code: Option<&str>,
        result: &Value,
    ) -> Option<StopReason> {
        let step_idx = call
            .plan_step
            .as_deref()
            .and_then(|p| self.state.plan.iter().position(|s| s.id == p));
        match status {
            "ok" => {
                if let Some(i) = step_idx {
                    self.state.plan[i].status = StepStatus::Done;
                }
                self.state.failed_writes.retain(|t| *t != call.name);
                self.record_facts(&call, result);
                self.new_read |= self.counts_as_new_read(&call);
            }
            "needs_approval" => {
                self.state.pending = Some(call);
                return Some(StopReason::NeedsApproval);
            }
            // Only the kernel's own question says this (a tool's result saying it is refused
            // below as any unknown status is: an error).
            "needs_answer" if self.catalog.get(&call.name).is_some_and(|s| s.asks_person) => {
                self.state.pending = Some(call);
                return Some(StopReason::NeedsAnswer);
            }
            "unknown" => {
                // Held for reconcile: resuming re-sends it under the same call key.
                self.state.pending = Some(call);
                return Some(StopReason::UnknownOutcome);
            }
            "rejected" => {
                if let Some(i) = step_idx {
                    self.state.plan[i].status = StepStatus::Failed;
                }
                self.write_failed(&call.name);
            }
            _ => {
                self.write_failed(&call.name);
                // A service's refusal of a write (an HTTP 4xx, an MCP tool error; not the
                // worker's own refusals, which sent nothing) spends its key: a service
                // following the Idempotency-Key draft may keep the answer for it. On the
                // worker's tasks a new attempt is a step of its own, in a revised plan.
                let spent = self.keys.strict
                    && self.catalog.get(&call.name).is_some_and(|s| {
                        s.access == Access::Write
                            && ((s.http.is_some() && result.get("http_status").is_some())
                                || (s.mcp.is_some() && code == Some("tool_error")))
                    });
                if (spent || matches!(code, Some("not_found" | "invalid_state")))
                    && let Some(i) = step_idx
                {
                    self.state.plan[i].status = StepStatus::Failed;
                }
            }
        }
        None
    }

    /// The result's fact fields, named after the tool unless its catalog entry says which
    /// argument names them.
    fn record_facts(&mut self, call: &ToolCall, result: &Value) {
        let (Some(spec), Some(obj)) = (self.catalog.get(&call.name), result.as_object()) else {
            return;
        };
        let prefix: std::borrow::Cow<'_, str> = if spec.fact_prefix_arg.is_empty() {
            call.name.as_str().into()
        } else {
            python_str(call.args.get(&spec.fact_prefix_arg)).into()
        };
        let mut name = String::new();
        for (k, v) in obj {
            if !spec.fact_fields.iter().any(|f| f == k) {
                continue;
            }
            name.clear();
            name.push_str(&prefix);
            name.push('.');
            name.push_str(k);
            // A fact learned again with the same value changes nothing (and its text, kept
            // between steps, stays written).
            if self.state.facts.get(&name) != Some(v) {
                self.state.facts.insert(name.clone(), v.clone());
                self.written.facts_ok = false;
            }
        }
    }
}

/// A tool result must be an object with a string `status`. Anything else from a write means
/// the kernel cannot know whether it applied; from a read it is an error.
fn checked_result(result: Value, write: bool) -> Value {
    let ok = result
        .as_object()
        .is_some_and(|o| matches!(o.get("status"), Some(Value::String(_))));
    if ok {
        return result;
    }
    let status = if write { "unknown" } else { "error" };
    let mut m = Map::new();
    m.insert("status".into(), Value::String(status.into()));
    m.insert("code".into(), Value::String("invalid_result".into()));
    m.insert(
        "detail".into(),
        Value::String("tool result must be an object with a string `status`".into()),
    );
    Value::Object(m)
}

/// A tool span's status: the usual ones borrowed, any other a copy of what the tool said.
fn span_status(shown: &str) -> std::borrow::Cow<'static, str> {
    const KNOWN: [&str; 11] = [
        "ok",
        "needs_answer",
        "error",
        "unknown",
        "rejected",
        "needs_approval",
        "not_found",
        "invalid_state",
        "invalid_args",
        "timeout",
        "unknown_tool",
    ];
    match KNOWN.iter().find(|k| **k == shown) {
        Some(k) => std::borrow::Cow::Borrowed(k),
        None => std::borrow::Cow::Owned(shown.to_string()),
    }
}

/// Python's `str()` of an argument, as the design reference's f-string prefixes facts with it.
fn python_str(v: Option<&Value>) -> String {
    match v {
        None | Some(Value::Null) => "None".into(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => py_repr(other),
    }
}
