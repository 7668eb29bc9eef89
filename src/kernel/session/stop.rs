//! How a run is stopped from outside the loop: an operator's cancel, a time limit the driver
//! saw pass, and, when a crashed run's write was in flight, that write held beside the stop.

use super::{Phase, Session};
use crate::kernel::state::{StopReason, ToolCall};
use crate::kernel::trace::SpanKind;

impl Session<'_> {
    /// Stops the run at this step boundary with `cancelled`. Refused while a model or tool
    /// call is outstanding, because its result must be folded in first.
    pub fn cancel(&mut self) -> bool {
        self.stop_with(StopReason::Cancelled)
    }

    /// Stops the run at its start with `stop` (a cancel, a time limit), holding `call`:
    /// a write an earlier run may have sent, whose outcome no run learned. It stays held for
    /// reconcile beside the stop (see [`TaskState::hold_in_flight`]); nothing is sent.
    pub fn stop_holding(&mut self, stop: StopReason, call: ToolCall) -> bool {
        if matches!(
            self.phase,
            Phase::AwaitModel | Phase::AwaitTool { .. } | Phase::Finished(_)
        ) {
            debug_assert!(
                false,
                "stop_holding while a call is outstanding or after the end"
            );
            return false;
        }
        self.state.hold_in_flight(call);
        self.stop_with(stop)
    }

    /// Stops the run with `stop` at a boundary (an operator's cancel, a time limit the
    /// driver saw pass), as [`Session::cancel`] does.
    pub fn stop_with(&mut self, stop: StopReason) -> bool {
        match self.phase {
            Phase::AwaitModel | Phase::AwaitTool { .. } => false,
            Phase::Finished(_) => true,
            _ => {
                if self.root.is_none() {
                    let t = self.state.elapsed_ms;
                    self.root =
                        Some(
                            self.trace
                                .start(SpanKind::Task, self.state.task_id.clone(), None, t),
                        );
                }
                self.finish(stop, None);
                true
            }
        }
    }
}
