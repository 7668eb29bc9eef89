//! A person answers a task's question (`ask_person`): the answer is checked against the
//! question (some text, at most `ANSWER_MAX_CHARS`, one of its choices when it offers some),
//! recorded as the held call's result with its audit event in one transaction, and the task is
//! queued to go on with the person's words. A wait that already ran out is recorded as
//! expired and the answer refused; an answer to a task that is not waiting for one is refused
//! naming what the task is doing.

use serde_json::json;

use super::decide::{decided, expired_now, held_call, not_in, requeue};
use crate::kernel::StopReason;
use crate::kernel::person::{Question, answer_result};
use crate::store::prelude::*;
use crate::store::{Decision, DecisionTx, Error, QueueStatus, Result};

use super::decide::Decided;
use super::review::Reviewed;

/// Answers the question task `id` waits on with `text`, and queues the task; returns the
/// question answered. `d.by` is who answered, recorded in the audit log (never shown to the
/// model). `seen`, the question the person read (its key, which names the step that asked, or
/// its digest, as `worker show` and the API give them), refuses the answer when the task asks
/// another question now, or the same one again at a later step (by key). Line breaks are
/// kept as `\n`, and spaces around the answer dropped.
pub fn answer(
    db: &dyn Backend,
    id: &str,
    text: &str,
    seen: &Reviewed,
    d: &Decision,
) -> Result<Question> {
    let text = text.replace("\r\n", "\n");
    let text = text.trim();
    decided(db, id, "answer", d, &mut |tx| {
        answer_in(tx, id, text, seen, d)
    })
}

fn answer_in(
    tx: &mut dyn DecisionTx,
    id: &str,
    text: &str,
    seen: &Reviewed,
    d: &Decision,
) -> Decided<Question> {
    let mut rec = tx.load(id)?;
    if rec.status == QueueStatus::Suspended
        && let Some(refused) = expired_now(tx, &mut rec, d.now_ms)?
    {
        return Ok(Err(refused));
    }
    let answered = rec.settle.is_some() && rec.state.stop == Some(StopReason::NeedsAnswer);
    if answered && matches!(rec.status, QueueStatus::Queued | QueueStatus::Running) {
        return Err(Error::Conflict(format!(
            "task {id}'s question was answered already; `worker events {id}` shows the answer"
        )));
    }
    if rec.status != QueueStatus::Suspended || rec.state.stop != Some(StopReason::NeedsAnswer) {
        return Err(not_in(&rec, "waiting for an answer"));
    }
    let call = held_call(&rec)?;
    let Some(question) = Question::of(&call) else {
        return Err(Error::Conflict(format!(
            "task {id} holds {}, not a question",
            call.name
        )));
    };
    let key = rec.call_key(tx.db_id(), &call);
    if seen.check(id, &call, &key).is_err() {
        return Err(Error::Conflict(format!(
            "task {id} now asks {:?} (key {key}, digest {}), not the question you answered; read it before answering",
            question.text,
            call.digest()
        )));
    }
    question
        .check(text)
        .map_err(|e| Error::Invalid(format!("task {id} asked {:?}; {e}", question.text)))?;
    rec.settle = Some(answer_result(text));
    rec.suspended_at_ms = None;
    let detail = json!({"question": question.text, "choices": question.choices, "answer": text,
        "key": key, "digest": call.digest()});
    requeue(tx, &mut rec, d.now_ms)?;
    tx.event(Some(id), "answer", d, detail)?;
    Ok(Ok(question))
}
