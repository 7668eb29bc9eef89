//! A model reply in a provider's protocol: what the calls of the last turn are answered with
//! (the first with what came of the move, any others as not run), and a model call that gave
//! no move (its billed tokens counted, a refusal told apart, a fatal error stopping the run).

use serde_json::{Value, json};

use super::Session;
use crate::kernel::io::InputStyle;
use crate::kernel::io::{ModelError, Usage};
use crate::kernel::json::{write_map, write_value};
use crate::kernel::state::StopReason;
use crate::kernel::state::est_tokens;
use crate::kernel::view::{render_state_message, render_with};

impl Session<'_> {
    /// Sets the last result; its text is written when the next view needs it.
    pub(super) fn set_result(&mut self, v: Value) {
        self.state.last_result = Some(v);
        self.written.result_ok = false;
    }

    /// Writes the JSON texts of the last result and the facts that changed since last written.
    fn write_texts(&mut self) {
        let w = &mut self.written;
        if !w.result_ok {
            w.result.clear();
            match &self.state.last_result {
                Some(v) => write_value(&mut w.result, v),
                None => w.result.push_str("null"),
            }
            w.result_ok = true;
        }
        if !w.facts_ok {
            w.facts.clear();
            write_map(&mut w.facts, &self.state.facts);
            w.facts_ok = true;
        }
    }

    /// This step's progress text (see [`crate::kernel::TaskState::progress_text`]) into
    /// `progress_now`, with the facts' text kept between steps.
    pub(super) fn progress_now_text(&mut self) {
        self.write_texts();
        let out = &mut self.progress_now;
        out.clear();
        out.push_str("{\"facts\": ");
        out.push_str(&self.written.facts);
        self.state.progress_plan(out);
    }

    /// Renders the model's next input and estimates its tokens: the design reference's view, or the
    /// state message beside the goal, the last turn and what every request repeats.
    pub(super) fn render_view(&mut self) {
        match self.input {
            InputStyle::View => {
                self.write_texts();
                let w = &self.written;
                render_with(
                    &mut self.view,
                    &self.state,
                    &self.budget,
                    &w.facts,
                    &w.result,
                );
                self.view_tokens = est_tokens(self.view.len());
            }
            InputStyle::Messages { overhead_chars } => {
                self.write_texts();
                let w = &self.written;
                render_state_message(
                    &mut self.view,
                    &self.state,
                    &self.budget,
                    &w.facts,
                    &w.result,
                );
                let turn = self
                    .state
                    .last_turn
                    .as_ref()
                    .map_or(0, |t| serde_json::to_string(t).map_or(0, |s| s.len()));
                // Each message of the conversation, with its role and quotes.
                let said: usize = (self.state.conversation_tail().iter())
                    .map(|m| m.text.len() + 32)
                    .sum();
                self.view_tokens = est_tokens(
                    self.view.len() + self.state.goal.len() + said + turn + overhead_chars,
                );
            }
        }
    }

    /// A model call that gave no move: the time spent counts, so do the tokens a provider
    /// billed for it, and the step counts.
    pub(super) fn on_model_error(&mut self, e: ModelError, latency_ms: u64, usage: Option<Usage>) {
        self.state.elapsed_ms = self.state.elapsed_ms.saturating_add(latency_ms);
        if let Some(u) = usage {
            let tout = u
                .output_tokens
                .min(u64::from(self.budget.output_tokens_max));
            self.state.tokens = self
                .state
                .tokens
                .saturating_add(u.input_tokens.saturating_add(tout));
            let span = self.trace.get_mut(self.model_span);
            span.tin = Some(u.input_tokens);
            span.tout = Some(tout);
        }
        let t = self.state.elapsed_ms;
        let (code, status) = match &e {
            ModelError::Refused(_) => ("model_refused", "refused"),
            _ => ("model_error", "error"),
        };
        self.trace.end(self.model_span, status, t);
        self.set_result(json!({"status": "error", "code": code, "detail": e.detail()}));
        if matches!(e, ModelError::Fatal(_)) {
            self.answer_turn();
            self.trace
                .end(self.step_span, StopReason::ModelFailed.as_str(), t);
            self.finish(StopReason::ModelFailed, None);
            return;
        }
        self.model_failures += 1;
        self.end_step(None);
    }

    /// Answers the calls of this step's turn: the first with what came of the move, the
    /// others as not run (one move per reply).
    pub(super) fn answer_turn(&mut self) {
        let step = self.state.step;
        let answer = self.turn_answer.take();
        if self.state.last_turn.as_ref().is_none_or(|t| t.step != step) {
            return;
        }
        let first = answer
            .or_else(|| self.state.last_result.clone())
            .unwrap_or(Value::Null);
        let Some(t) = self.state.last_turn.as_mut() else {
            return;
        };
        t.results = (0..t.turn.calls.len())
            .map(|i| {
                if i == 0 {
                    first.clone()
                } else {
                    json!({"status": "error", "code": "not_run",
                           "detail": "one call per reply: only the first call of a reply runs; send this one again if it is still needed"})
                }
            })
            .collect();
    }
}

/// JSON texts of parts of the state that views show at every step, each written again only
/// after it changed: a long tool result is escaped once, not once per view.
#[derive(Default)]
pub(super) struct Written {
    pub result: String,
    pub result_ok: bool,
    pub facts: String,
    pub facts_ok: bool,
}
