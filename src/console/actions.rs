//! The console's actions: a form's decision (approve, reject, reconcile, settle by the tool's
//! lookup, answer a task's question, send a follow-up message, cancel) checked for
//! its CSRF token and bound to the call (key and digest) or the task state (its last change)
//! the page was rendered with, then made through the same backend decisions as the CLI's.

use super::{Console, form, url_encode};
use crate::httpd::{Reply, Request, percent_decode};
use crate::operator;
use crate::operator::{Extension, Reviewed, Settlement};
use crate::store::{Decision, Error};
use std::collections::BTreeMap;

/// What the task page says of a decision's audit event, by its verb.
pub(super) fn done_message(verb: &str) -> Option<&'static str> {
    Some(match verb {
        "approve" => "the held call was approved; it is sent when the task runs again",
        "reject" => "the held call was rejected; it is never sent",
        "reconcile_applied" => "the held write was settled as applied",
        "reconcile_not_applied" => {
            "the held write was settled as not applied; it is sent again when the task runs"
        }
        "cancel" => "the task was cancelled",
        "answer" => {
            "the question was answered; the task goes on with the answer when it runs again"
        }
        "say" => "the message was sent; the task's next turn runs on it",
        _ => return None,
    })
}

/// A form's field, trimmed; none when it is empty.
fn field(f: &BTreeMap<String, String>, k: &str) -> Option<String> {
    f.get(k)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

impl Console {
    /// What the tool's lookup says of task `id`'s held write, as a settlement; `Err` when it
    /// gives no definite answer (or there is no held write).
    fn looked_up(&self, id: &str) -> Result<Settlement, Error> {
        operator::settlement_by_lookup(&*self.db, id, &self.config, &self.tools_target)
    }

    /// A decision from a form: CSRF checked, the reviewed call (key and digest) bound, the
    /// same backend decision as the CLI's; then back to the task's page.
    pub(super) fn act(&self, op: &str, id: &str, verb: &str, req: &Request) -> Reply {
        let f = form(req);
        let id = percent_decode(id);
        let back = Some(format!("/tasks/{}", url_encode(&id)));
        let csrf_ok = field(&f, "csrf").is_some_and(|t| {
            let want = self.csrf(op);
            t.len() == want.len()
                && t.bytes().zip(want.bytes()).fold(0, |a, (x, y)| a | (x ^ y)) == 0
        });
        if !csrf_ok {
            return self.message(op, 403, "Refused", "This form's CSRF token is missing or not this session's; reload the page and try again.".into(), back);
        }
        let d = match operator::decision(op, field(&f, "reason").as_deref()) {
            Ok(d) => d,
            Err(e) => return self.message(op, 400, "Refused", e, back),
        };
        let reviewed = Reviewed {
            key: field(&f, "key"),
            digest: field(&f, "digest"),
        };
        let extend = match field(&f, "extend")
            .map(|t| Extension::parse(&t))
            .transpose()
        {
            Ok(e) => e.unwrap_or_default(),
            Err(e) => return self.message(op, 400, "Refused", format!("extend: {e}"), back),
        };
        let Some(outcome) = self.decide(verb, &id, &f, &reviewed, &extend, &d) else {
            return self.message(
                op,
                404,
                "Not found",
                format!("There is no action {verb:?}."),
                back,
            );
        };
        match outcome {
            // Back to the task, naming the audit event the decision wrote.
            Ok(()) => self.after_decision(&id),
            Err(e) => {
                let status = match e {
                    Error::NoTask(_) => 404,
                    Error::Invalid(_) => 400,
                    _ => 409,
                };
                self.message(op, status, "Refused", e.to_string(), back)
            }
        }
    }

    /// The decision a form's `verb` asks for, made; `None` for a verb that is none.
    fn decide(
        &self,
        verb: &str,
        id: &str,
        f: &BTreeMap<String, String>,
        reviewed: &Reviewed,
        extend: &Extension,
        d: &Decision,
    ) -> Option<Result<(), Error>> {
        Some(match verb {
            "approve" | "reject" | "reconcile" | "settle"
                if reviewed.key.is_none() || reviewed.digest.is_none() =>
            {
                Err(Error::Invalid(
                    "the form does not name the call it was rendered with (key and digest)".into(),
                ))
            }
            "approve" => operator::approve(&*self.db, id, reviewed, extend, d).map(|_| ()),
            // Bound to the question the page showed (its digest): a task that asks another one
            // now refuses the answer.
            "answer" => match (&reviewed.key, &reviewed.digest, f.get("text")) {
                (Some(_), Some(_), Some(text)) => {
                    operator::answer(&*self.db, id, text, reviewed, d).map(|_| ())
                }
                _ => Err(Error::Invalid(
                    "the form does not carry the question it was rendered with (key and digest), or an answer"
                        .into(),
                )),
            },
            // Bound to the turn the page showed: a task that moved past it refuses the message.
            "say" => match (field(f, "turn").and_then(|t| t.parse().ok()), f.get("text")) {
                (Some(turn), Some(text)) => {
                    operator::say(&*self.db, id, text, Some(turn), d).map(|_| ())
                }
                _ => Err(Error::Invalid(
                    "the form does not carry the turn it was rendered with, or a message".into(),
                )),
            },
            "reject" => operator::reject(&*self.db, id, reviewed, d).map(|_| ()),
            "reconcile" => {
                let settlement = self.settlement(id, field(f, "outcome"), field(f, "result"));
                settlement.and_then(|s| {
                    operator::reconcile(&*self.db, id, &s, reviewed, extend, d).map(|_| ())
                })
            }
            // The held-writes page's "Look up and settle": whatever the lookup answers
            // definitely, decided by this operator.
            "settle" => self.looked_up(id).and_then(|s| {
                operator::reconcile(&*self.db, id, &s, reviewed, extend, d).map(|_| ())
            }),
            // Checked in the decision's transaction: refused if the task changed since.
            "cancel" => match field(f, "seen").and_then(|s| s.parse::<u64>().ok()) {
                Some(seen) => operator::cancel(&*self.db, id, Some(seen), d).map(|_| ()),
                None => Err(Error::Invalid(
                    "the form does not say when the task was last seen".into(),
                )),
            },
            _ => return None,
        })
    }

    /// What the reconcile form says became of the write: applied (with the result pasted,
    /// else the tool's lookup's), or not applied.
    fn settlement(
        &self,
        id: &str,
        outcome: Option<String>,
        result: Option<String>,
    ) -> Result<Settlement, Error> {
        match outcome.as_deref() {
            // Without a result, the tool's lookup gives it (never a bare `ok` the model would
            // take for the result).
            Some("applied") => match result {
                None => match self.looked_up(id) {
                    Ok(s @ Settlement::Applied(_)) => Ok(s),
                    Ok(Settlement::NotApplied) => Err(Error::Conflict(
                        "the tool's lookup says this write was not applied: settle it as not applied, or give the result if you know it was".into(),
                    )),
                    Err(e) => Err(Error::Invalid(format!(
                        "\"It was applied\" needs the write's result, and {e}: paste what the write returned"
                    ))),
                },
                Some(text) => match crate::limits::parse_json_input(
                    &text,
                    "the result",
                    crate::limits::OPERATOR_RESULT_BYTES_MAX,
                ) {
                    Ok(v) => Ok(Settlement::Applied(v)),
                    Err(e) => Err(Error::Invalid(e.0)),
                },
            },
            Some("not_applied") => Ok(Settlement::NotApplied),
            _ => Err(Error::Invalid("say whether the write was applied".into())),
        }
    }

    /// Back to the task, naming the audit event the decision wrote.
    fn after_decision(&self, id: &str) -> Reply {
        let event = (self.db.events(Some(id)).ok()).and_then(|e| e.last().map(|e| e.seq));
        Reply::see_other(&match event {
            Some(n) => format!("/tasks/{}?event={n}", url_encode(id)),
            None => format!("/tasks/{}", url_encode(id)),
        })
    }
}
