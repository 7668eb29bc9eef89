//! The API's task operations: create (the `Idempotency-Key` header is the enqueue key), get
//! (with a long poll), list, and the audit log of one task or of all.

use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Api, Caller, Role, body, param, problem};
use crate::clock::{now_ms, parse_rfc3339_from_epoch, rfc3339};
use crate::httpd::{Reply, Request};
use crate::operator::submit::{Origin, TaskRequest, new_task};
use crate::store::list::shown_stop;
use crate::store::list::{ListQuery, Listed, task_num};
use crate::store::result::{result_json, summary_json};
use crate::store::{Event, QueueStatus, TaskRecord};

/// The longest long poll.
const WAIT_MAX: Duration = Duration::from_secs(60);

/// `TaskCreate`, already checked against its schema. Every property the document lists is a
/// field here, and nothing else is (a test compares them), so no field a caller sends is
/// dropped unread.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TaskCreate {
    user: String,
    goal: String,
    model: Option<String>,
    #[serde(default)]
    priority: i64,
    #[serde(default)]
    budget: BTreeMap<String, u64>,
    instructions: Option<String>,
    callback_url: Option<String>,
    approval_wait_ms: Option<u64>,
    not_before: Option<String>,
    start_in: Option<String>,
    concurrency_key: Option<String>,
    ttl: Option<String>,
    finish_within: Option<String>,
}

/// A JSON reply.
fn json_reply(status: u16, v: &Value) -> Reply {
    Reply::json(status, v)
}

/// The Idempotency-Key header: a Structured Fields string (`"abc"`) or the bare key.
fn idempotency_key(req: &Request) -> Result<Option<String>, Reply> {
    let Some(raw) = req.header("idempotency-key") else {
        return Ok(None);
    };
    let given = req
        .headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("idempotency-key"))
        .count();
    if given > 1 {
        return Err(problem(
            400,
            "invalid_header",
            "Idempotency-Key is given more than once: send one key",
        ));
    }
    let text = std::str::from_utf8(raw)
        .map_err(|_| problem(400, "invalid_header", "Idempotency-Key is not ASCII"))?
        .trim();
    let key = match text.strip_prefix('"') {
        Some(rest) => rest.strip_suffix('"').ok_or_else(|| {
            problem(
                400,
                "invalid_header",
                "Idempotency-Key starts a quoted string it does not end",
            )
        })?,
        None => text,
    };
    if key.contains(['"', '\\']) {
        return Err(problem(
            400,
            "invalid_header",
            "Idempotency-Key holds a `\"` or `\\`: send a key without them, bare or as \"KEY\"",
        ));
    }
    crate::limits::check_name(key, "Idempotency-Key")
        .map_err(|e| problem(400, "invalid_header", &e.0))?;
    Ok(Some(key.to_string()))
}

impl Api {
    /// The config a new task is resolved in: with MCP servers, their tools join the catalog
    /// the task keeps (listed once, at the first create).
    fn enqueue_config(&self) -> Result<Arc<crate::config::Config>, Reply> {
        if self.config.mcp.servers.is_empty() {
            return Ok(Arc::clone(&self.config));
        }
        if let Some(c) = self.enqueue_config.get() {
            return Ok(Arc::clone(c));
        }
        let with_mcp = crate::operator::submit::with_mcp_tools(&self.config)
            .map_err(|e| problem(503, "mcp_unavailable", &e))?;
        Ok(Arc::clone(
            self.enqueue_config.get_or_init(|| Arc::new(with_mcp)),
        ))
    }

    pub(super) fn create(&self, req: &Request, caller: &Caller) -> Reply {
        let key = match idempotency_key(req) {
            Ok(k) => k,
            Err(r) => return r,
        };
        let v = match body(req, "TaskCreate", false) {
            Ok(v) => v,
            Err(r) => return r,
        };
        let t: TaskCreate = match serde_json::from_value(v) {
            Ok(t) => t,
            Err(e) => return problem(400, "invalid_body", &e.to_string()),
        };
        if let Some(users) = &caller.users
            && !users.admits(&t.user)
        {
            return problem(
                403,
                "user_not_allowed",
                &format!(
                    "this token ({}) may create tasks only for users matching {users}; {:?} is not one",
                    caller.name,
                    crate::limits::printable(&t.user)
                ),
            );
        }
        let cfg = match self.enqueue_config() {
            Ok(c) => c,
            Err(r) => return r,
        };
        let asked = TaskRequest {
            user: t.user,
            goal: t.goal,
            key,
            priority: t.priority,
            budget: t.budget.into_iter().map(|(k, v)| (k, json!(v))).collect(),
            model: t.model,
            instructions: t.instructions,
            callback_url: t.callback_url,
            approval_wait_ms: t.approval_wait_ms,
            not_before: t.not_before,
            start_in: t.start_in,
            concurrency_key: t.concurrency_key,
            ttl: t.ttl,
            finish_within: t.finish_within,
            ..TaskRequest::default()
        };
        let submitter = (caller.role == Role::Submit).then(|| caller.name.clone());
        let task = match new_task(asked, Some(&cfg), Origin::Api { submitter }) {
            Ok(t) => t,
            Err(e) => return problem(422, "invalid_task", &e),
        };
        let made = match self.db.enqueue(&[task], now_ms()) {
            Ok(mut m) => m.pop(),
            Err(e) => return super::problem::of_store(&e),
        };
        let Some(made) = made else {
            return problem(500, "database", "the enqueue returned no task");
        };
        let rec = match self.db.task(&made.id) {
            Ok(r) => r,
            Err(e) => return super::problem::of_store(&e),
        };
        let location = format!("/api/v1/tasks/{}", made.id);
        let reply = json_reply(
            if made.created { 201 } else { 200 },
            &result_json(self.db.db_id(), &rec),
        )
        .with_header("Location", &location);
        if made.created {
            tracing::info!(task = %made.id, by = %caller.name, "api: task created");
            reply
        } else {
            reply.with_header("Idempotent-Replayed", "true")
        }
    }

    /// Task `name` (an id or `key:KEY`) if `caller` may read it; else the problem (404 for a
    /// task another submitter created: it is not theirs to know of).
    pub(super) fn readable(&self, caller: &Caller, name: &str) -> Result<TaskRecord, Reply> {
        let not_found = || {
            problem(
                404,
                "not_found",
                &format!(
                    "no task {} (ids look like t12; key:KEY names the task created under that Idempotency-Key)",
                    crate::limits::printable(name)
                ),
            )
        };
        let id = match self.db.resolve(name) {
            Ok(id) => id,
            Err(crate::store::Error::NoTask(_)) => return Err(not_found()),
            Err(e) => return Err(super::problem::of_store(&e)),
        };
        if crate::limits::check_name(&id, "the task").is_err() {
            return Err(not_found());
        }
        let rec = match self.db.task(&id) {
            Ok(r) => r,
            Err(crate::store::Error::NoTask(_)) => return Err(not_found()),
            Err(e) => return Err(super::problem::of_store(&e)),
        };
        match caller.role {
            Role::Operator => Ok(rec),
            Role::Submit if rec.submitted_by.as_deref() == Some(caller.name.as_str()) => Ok(rec),
            Role::Submit => Err(not_found()),
        }
    }

    pub(super) fn get(&self, req: &Request, caller: &Caller, name: &str) -> Reply {
        let wait = match param(req, "wait") {
            Ok(w) => w,
            Err(r) => return r,
        };
        let wait = match wait.as_deref().map(parse_wait) {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(e)) => return problem(400, "invalid_query", &e),
        };
        let how = match param(req, "until") {
            Ok(None) => crate::operator::Until::Settled,
            Ok(Some(u)) if u == "settled" => crate::operator::Until::Settled,
            Ok(Some(u)) if u == "finished" => crate::operator::Until::Finished,
            Ok(Some(u)) => {
                return problem(
                    400,
                    "invalid_query",
                    &format!(
                        "until={:?}: settled (the default) or finished",
                        crate::limits::printable(&u)
                    ),
                );
            }
            Err(r) => return r,
        };
        let rec = match self.readable(caller, name) {
            Ok(r) => r,
            Err(r) => return r,
        };
        let waits = match how {
            crate::operator::Until::Settled => !rec.status.is_settled(),
            crate::operator::Until::Finished => rec.status != QueueStatus::Finished,
        };
        let rec = match wait {
            Some(d) if waits => {
                let _held = match self
                    .polls
                    .enter(&caller.name, caller.role == Role::Operator)
                {
                    Ok(h) => h,
                    Err(r) => return r,
                };
                match crate::operator::wait(
                    self.db.as_ref(),
                    self.watch(),
                    &rec.id,
                    Some(Instant::now() + d),
                    how,
                    &mut |_| {},
                ) {
                    Ok(
                        crate::operator::Waited::Settled(r, _)
                        | crate::operator::Waited::TimedOut(r),
                    ) => r,
                    Err(e) => return super::problem::of_store(&e),
                }
            }
            _ => rec,
        };
        json_reply(200, &result_json(self.db.db_id(), &rec))
    }

    pub(super) fn list(&self, req: &Request, caller: &Caller) -> Reply {
        if let Some(r) = Api::operator_only(caller, "listing tasks") {
            return r;
        }
        let q = match list_query(req) {
            Ok(q) => q,
            Err(r) => return r,
        };
        let page = match self.db.list(&q) {
            Ok(p) => p,
            Err(e) => return super::problem::of_store(&e),
        };
        let tasks: Vec<Value> = page
            .tasks
            .iter()
            .map(|t| match t {
                Listed::Task(s) => summary_json(s, shown_stop(s.status, s.stop)),
                Listed::Damaged { id, error } => {
                    json!({"id": id, "status": "damaged", "error": error})
                }
            })
            .collect();
        json_reply(
            200,
            &json!({"tasks": tasks, "next_cursor": page.next.map(|n| format!("t{n}"))}),
        )
    }

    pub(super) fn task_events(&self, caller: &Caller, name: &str) -> Reply {
        let rec = match self.readable(caller, name) {
            Ok(r) => r,
            Err(r) => return r,
        };
        match self.db.events(Some(&rec.id)) {
            Ok(events) => {
                let shown = events.iter().map(|e| {
                    let mut v = event_json(e);
                    if caller.role == Role::Submit {
                        v["detail"] = crate::store::callbacks::submitters_view(&e.verb, &e.detail);
                    }
                    v
                });
                json_reply(200, &Value::Array(shown.collect()))
            }
            Err(e) => super::problem::of_store(&e),
        }
    }

    pub(super) fn events(&self, req: &Request, caller: &Caller) -> Reply {
        if let Some(r) = Api::operator_only(caller, "the audit log") {
            return r;
        }
        let number = |name: &str, min: u64, max: u64| -> Result<Option<u64>, Reply> {
            match param(req, name)? {
                None => Ok(None),
                Some(v) => v
                    .parse::<u64>()
                    .ok()
                    .filter(|n| (min..=max).contains(n))
                    .map(Some)
                    .ok_or_else(|| {
                        problem(
                            400,
                            "invalid_query",
                            &format!("{name} must be a whole number from {min} to {max}"),
                        )
                    }),
            }
        };
        let (after, limit) = match (
            number("after", 0, i64::MAX as u64),
            number("limit", 1, 1000),
        ) {
            (Ok(a), Ok(l)) => (a.unwrap_or(0), l.unwrap_or(100) as usize),
            (Err(r), _) | (_, Err(r)) => return r,
        };
        match self.db.events(None) {
            Ok(events) => json_reply(
                200,
                &Value::Array(
                    events
                        .iter()
                        .filter(|e| e.seq > after)
                        .take(limit)
                        .map(event_json)
                        .collect(),
                ),
            ),
            Err(e) => super::problem::of_store(&e),
        }
    }
}

/// `30s`, `2m`: at most [`WAIT_MAX`].
fn parse_wait(s: &str) -> Result<Duration, String> {
    let bad = || {
        format!(
            "wait={} is not a duration like 30s or 1m (at most 60s)",
            crate::limits::printable(s)
        )
    };
    if !(2..=4).contains(&s.len()) || !s.is_ascii() {
        return Err(bad());
    }
    let (n, unit) = s.split_at(s.len() - 1);
    let n: u64 = n.parse().map_err(|_| bad())?;
    let d = match unit {
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n * 60),
        _ => return Err(bad()),
    };
    if d > WAIT_MAX {
        return Err(bad());
    }
    Ok(d)
}

fn list_query(req: &Request) -> Result<ListQuery, Reply> {
    let bad = |m: String| problem(400, "invalid_query", &m);
    let mut q = ListQuery {
        limit: 50,
        ..ListQuery::default()
    };
    if let Some(s) = param(req, "status")? {
        q.status = Some(QueueStatus::parse(&s).ok_or_else(|| {
            bad(format!(
                "status {s:?} is not one of queued, running, suspended, held, finished"
            ))
        })?);
    }
    if let Some(s) = param(req, "stop")? {
        q.stop = Some(
            crate::kernel::StopReason::parse(&s)
                .ok_or_else(|| bad(format!("stop {s:?} is not a stop reason")))?,
        );
    }
    if let Some(o) = param(req, "outcome")? {
        if o != "completed" && o != "cannot_complete" {
            return Err(bad(format!(
                "outcome {o:?} is not completed or cannot_complete"
            )));
        }
        q.outcome = Some(o);
    }
    for (name, slot) in [("user", &mut q.user), ("key", &mut q.key)] {
        if let Some(v) = param(req, name)? {
            crate::limits::check_name(&v, name).map_err(|e| bad(e.0))?;
            *slot = Some(v);
        }
    }
    for (name, slot) in [("since", &mut q.since_ms), ("until", &mut q.until_ms)] {
        if let Some(v) = param(req, name)? {
            *slot = Some(parse_rfc3339_from_epoch(&v).map_err(|e| bad(format!("{name}: {e}")))?);
        }
    }
    if let Some(v) = param(req, "limit")? {
        q.limit = v
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| bad("limit must be a whole number from 1 to 1000".into()))?;
    }
    if let Some(c) = param(req, "cursor")? {
        q.before = Some(
            task_num(&c)
                .filter(|_| c.len() <= 20 && c[1..].bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| {
                    bad(format!(
                        "cursor {c:?} is not a next_cursor of this API (like t950)"
                    ))
                })?,
        );
    }
    Ok(q)
}

fn event_json(e: &Event) -> Value {
    json!({
        "seq": e.seq,
        "at": rfc3339(e.at_ms),
        "task": e.task,
        "verb": e.verb,
        "by": e.by,
        "reason": e.reason,
        "detail": e.detail,
    })
}
