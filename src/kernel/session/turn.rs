//! A model reply in a provider's protocol: what the calls of the last turn are answered with
//! (the first with what came of the move, any others as not run), and a model call that gave
//! no move (its billed tokens counted, a refusal told apart, a fatal error stopping the run).

use serde_json::{Value, json};

use super::Session;
use crate::kernel::io::InputStyle;
use crate::kernel::io::{ModelError, Usage};
use crate::kernel::state::StopReason;
use crate::kernel::state::est_tokens;
use crate::kernel::view::{render_into, render_state_message};

impl Session<'_> {
    /// Renders the model's next input and estimates its tokens: the design reference's view, or the
    /// state message beside the goal, the last turn and what every request repeats.
    pub(super) fn render_view(&mut self) {
        match self.input {
            InputStyle::View => {
                render_into(&mut self.view, &self.state, &self.budget);
                self.view_tokens = est_tokens(self.view.len());
            }
            InputStyle::Messages { overhead_chars } => {
                render_state_message(&mut self.view, &self.state, &self.budget);
                let turn = self
                    .state
                    .last_turn
                    .as_ref()
                    .map_or(0, |t| serde_json::to_string(t).map_or(0, |s| s.len()));
                self.view_tokens =
                    est_tokens(self.view.len() + self.state.goal.len() + turn + overhead_chars);
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
        self.state.last_result =
            Some(json!({"status": "error", "code": code, "detail": e.detail()}));
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
