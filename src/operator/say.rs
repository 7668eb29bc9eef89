//! A person continues a finished task with a follow-up message: the next turn of its
//! conversation (see [`crate::kernel::conversation`]). The message is checked, joins the
//! task's state with the last answer, the turn's budget is set, and the task is queued, with
//! its audit event `say`, in one transaction. A message to a task that cannot take one (still
//! working, waiting on a person, a write to reconcile, cancelled, out of turns or past its
//! deadline) is refused saying why, and changes nothing.

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::decide::{Decided, decided, requeue};
use crate::kernel::conversation::{check_message, next_turn_budget};
use crate::store::prelude::*;
use crate::store::{Decision, DecisionTx, Error, Result};

/// What a message started.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Said {
    /// The turn the message opened (2 for the first follow-up).
    pub turn: u32,
    /// The message as the model reads it (line breaks as `\n`, spaces around dropped).
    pub text: String,
}

/// Sends `text` to finished task `id` as its next turn, and queues it. `turn`, when given,
/// is the turn the sender saw finish: the message is refused if the task has moved past it
/// (a message sent twice opens one turn, not two). `d.by` is who sent it.
pub fn say(
    db: &dyn Backend,
    id: &str,
    text: &str,
    turn: Option<u32>,
    d: &Decision,
) -> Result<Said> {
    let text = check_message(text).map_err(|e| Error::Invalid(format!("task {id}: {e}")))?;
    decided(db, id, "say", d, &mut |tx| say_in(tx, id, &text, turn, d))
}

fn say_in(
    tx: &mut dyn DecisionTx,
    id: &str,
    text: &str,
    turn: Option<u32>,
    d: &Decision,
) -> Decided<Said> {
    let mut rec = tx.load(id)?;
    let now = rec.state.turn();
    if let Some(seen) = turn.filter(|t| *t != now) {
        return Err(Error::Conflict(format!(
            "task {id} is on turn {now}, not turn {seen}: `worker show {id}` shows the conversation"
        )));
    }
    if let Some(why) = rec.why_no_message(d.now_ms) {
        return Err(Error::Conflict(format!(
            "task {id} cannot take a message now: {why}"
        )));
    }
    let from = rec.budget;
    let per_turn = rec.enqueued_budget.unwrap_or(rec.budget);
    rec.state
        .continue_with(text)
        .map_err(|e| Error::Conflict(format!("task {id} cannot take a message now: {e}")))?;
    rec.budget = next_turn_budget(&per_turn, &rec.state);
    rec.settle = None;
    rec.approval = None;
    rec.suspended_at_ms = None;
    rec.cancel_requested = None;
    let turn = rec.state.turn();
    requeue(tx, &mut rec, d.now_ms)?;
    let detail = json!({"text": text, "turn": turn, "budget": rec.budget, "from": from});
    tx.event(Some(id), "say", d, detail)?;
    Ok(Ok(Said {
        turn,
        text: text.to_string(),
    }))
}
