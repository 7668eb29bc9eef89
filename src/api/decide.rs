//! The API's decisions: approve, reject, reconcile, answer (a task's question to a person) and
//! cancel, and a follow-up message that continues a finished task, each the operators' own
//! function
//! (`crate::operator`), so each writes the same audit event as the CLI and the console, by the
//! token's name. The answer is the task as the decision left it.

use serde::Deserialize;
use std::collections::BTreeMap;

use super::{Api, Caller, body, problem};
use crate::httpd::{Reply, Request};
use crate::operator::{self, Extension, Reviewed, Settlement};
use crate::store::result::result_json;

/// Any decision's body, already checked against its verb's schema (which admits only the
/// fields of its verb). Its fields are every property the verbs' schemas list, and nothing
/// else (a test compares them).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct DecisionBody {
    reason: Option<String>,
    digest: Option<String>,
    key: Option<String>,
    #[serde(default)]
    extend: BTreeMap<String, u64>,
    applied: Option<bool>,
    result: Option<serde_json::Value>,
}

/// An answer's body, checked against the `Answer` schema.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct AnswerBody {
    text: String,
    reason: Option<String>,
    key: Option<String>,
    digest: Option<String>,
}

/// A follow-up message's body, checked against the `Message` schema.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct MessageBody {
    text: String,
    turn: Option<u32>,
}

impl Api {
    /// What every decision reads first: its body (checked against the document's `component`),
    /// the task the caller may read, and who decides and why.
    fn read_decision<B: serde::de::DeserializeOwned>(
        &self,
        req: &Request,
        caller: &Caller,
        name: &str,
        component: &str,
        optional: bool,
        reason: impl Fn(&B) -> Option<&str>,
    ) -> Result<(B, crate::store::TaskRecord, crate::store::Decision), Reply> {
        let b: B = match body(req, component, optional).map(serde_json::from_value) {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => return Err(problem(400, "invalid_body", &e.to_string())),
            Err(r) => return Err(r),
        };
        let rec = self.readable(caller, name)?;
        let d = operator::decision(&caller.name, reason(&b))
            .map_err(|e| problem(422, "invalid_decision", &e))?;
        Ok((b, rec, d))
    }

    /// `POST /tasks/{task}/answer`: a person's answer to the task's question, by the token's
    /// name; the answer is the task as it stands then (queued).
    pub(super) fn answer(&self, req: &Request, caller: &Caller, name: &str) -> Reply {
        if let Some(r) = Api::operator_only(caller, "an answer") {
            return r;
        }
        let (b, rec, d) =
            match self.read_decision::<AnswerBody>(req, caller, name, "Answer", false, |b| {
                b.reason.as_deref()
            }) {
                Ok(read) => read,
                Err(r) => return r,
            };
        let seen = Reviewed {
            key: b.key,
            digest: b.digest,
        };
        if let Err(e) = operator::answer(self.db.as_ref(), &rec.id, &b.text, &seen, &d) {
            return super::problem::of_store(&e);
        }
        match self.db.task(&rec.id) {
            Ok(rec) => Reply::json(200, &result_json(self.db.db_id(), &rec)),
            Err(e) => super::problem::of_store(&e),
        }
    }

    /// `POST /tasks/{task}/messages`: a follow-up message that continues the caller's finished
    /// task (a submit token's own, or any for an operator) as its next turn; the answer is
    /// the task as it stands then (queued), 202.
    pub(super) fn say(&self, req: &Request, caller: &Caller, name: &str) -> Reply {
        let (b, rec, d) = match self.read_decision::<MessageBody>(
            req,
            caller,
            name,
            "Message",
            false,
            |_| None,
        ) {
            Ok(read) => read,
            Err(r) => return r,
        };
        if let Err(e) = operator::say(self.db.as_ref(), &rec.id, &b.text, b.turn, &d) {
            return super::problem::of_store(&e);
        }
        match self.db.task(&rec.id) {
            Ok(rec) => Reply::json(202, &result_json(self.db.db_id(), &rec)),
            Err(e) => super::problem::of_store(&e),
        }
    }

    pub(super) fn decide(&self, req: &Request, caller: &Caller, name: &str, op: &str) -> Reply {
        if let Some(r) = Api::operator_only(caller, "a decision") {
            return r;
        }
        let (component, optional) = match op {
            "approveTask" => ("Approve", false),
            "rejectTask" => ("Reject", false),
            "reconcileTask" => ("Reconcile", false),
            _ => ("Cancel", true),
        };
        let (b, rec, d) =
            match self.read_decision::<DecisionBody>(req, caller, name, component, optional, |b| {
                b.reason.as_deref()
            }) {
                Ok(read) => read,
                Err(r) => return r,
            };
        let id = rec.id.clone();
        let reviewed = Reviewed {
            key: b.key,
            digest: b.digest,
        };
        let extend = Extension(b.extend.into_iter().collect());
        let db = self.db.as_ref();
        let decided = match op {
            "approveTask" if reviewed.is_empty() => {
                return problem(
                    422,
                    "unreviewed",
                    &format!(
                        "an approval names the held call you reviewed: give its digest or key (GET /api/v1/tasks/{id}: held_call)"
                    ),
                );
            }
            "approveTask" => operator::approve(db, &id, &reviewed, &extend, &d).map(|_| ()),
            "rejectTask" => operator::reject(db, &id, &reviewed, &d).map(|_| ()),
            "reconcileTask" => {
                let settlement = match self.settlement(&id, b.applied, b.result) {
                    Ok(s) => s,
                    Err(r) => return r,
                };
                operator::reconcile(db, &id, &settlement, &reviewed, &extend, &d).map(|_| ())
            }
            _ => operator::cancel(db, &id, None, &d).map(|_| ()),
        };
        if let Err(e) = decided {
            return super::problem::of_store(&e);
        }
        match self.db.task(&id) {
            Ok(rec) => Reply::json(200, &result_json(self.db.db_id(), &rec)),
            Err(e) => super::problem::of_store(&e),
        }
    }

    /// What a reconcile settles: not applied, applied with the given result, or applied with
    /// the result the tool's lookup gives (never a bare `ok` the model would take for the
    /// write's result).
    fn settlement(
        &self,
        id: &str,
        applied: Option<bool>,
        result: Option<serde_json::Value>,
    ) -> Result<Settlement, Reply> {
        match (applied, result) {
            (Some(false), _) => Ok(Settlement::NotApplied),
            (_, Some(result)) => Ok(Settlement::Applied(result)),
            (_, None) => match operator::settlement_by_lookup(
                self.db.as_ref(),
                id,
                &self.config,
                &self.tools_target,
            ) {
                Ok(Settlement::Applied(v)) => Ok(Settlement::Applied(v)),
                Ok(Settlement::NotApplied) => Err(problem(
                    409,
                    "lookup_disagrees",
                    "the tool's lookup says this write was not applied: settle it with applied=false, or give the result if you know it was applied",
                )),
                Err(e) => Err(problem(
                    422,
                    "no_result",
                    &format!(
                        "applied=true needs the write's result, and the tool's lookup could not give it ({e}): give `result`"
                    ),
                )),
            },
        }
    }
}
