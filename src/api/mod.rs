//! The HTTP JSON API, `/api/v1`, for services and jobs: create a task (its `Idempotency-Key`
//! is the enqueue key), read one, wait for one (a long poll on the database's wake-ups), list
//! them, decide on what they hold (approve, reject, reconcile, cancel: the operators' own
//! functions, so the same audit events as the CLI and the console), and read the audit log.
//! It is served by the console's listener (`worker serve`, alias `worker console`), with the
//! same limits on bodies, headers and connections.
//!
//! The OpenAPI 3.1 document (`docs/openapi.json`) is the contract: it is compiled in and served
//! at `/api/v1/openapi.json`, request bodies are checked against its schemas before anything
//! else (so the server refuses exactly what the document says is invalid), and [`ROUTES`] is
//! checked against its operations by a test. Errors are RFC 9457 problem details.
//!
//! Who may do what: a caller is an `operator` (everything; its name is recorded in the audit
//! log) or a `submit` caller (creates tasks and reads the tasks it created; any other task is
//! "not found" to it). Without a token file the console's loopback rule applies: every caller
//! on this machine is the console's operator.

mod decide;
mod polls;
mod problem;
mod stream;
mod tasks;

pub use polls::{LONG_POLLS_MAX, LONG_POLLS_PER_CALLER_MAX};

pub use problem::problem;

use serde_json::Value;
use std::sync::{Arc, OnceLock};

use crate::httpd::{Reply, Request, percent_decode};
use crate::store::watch::Watch;
use crate::store::{Backend, Watched};
use stream::wants_stream;

/// The OpenAPI document, as committed.
pub const DOCUMENT: &str = include_str!("../../docs/openapi.json");

/// Every operation: method, path template, the document's `operationId`.
pub const ROUTES: &[(&str, &str, &str)] = &[
    ("GET", "/api/v1/openapi.json", "getOpenApi"),
    ("POST", "/api/v1/tasks", "createTask"),
    ("GET", "/api/v1/tasks", "listTasks"),
    ("GET", "/api/v1/tasks/{task}", "getTask"),
    ("GET", "/api/v1/tasks/{task}/events", "listTaskEvents"),
    ("POST", "/api/v1/tasks/{task}/approve", "approveTask"),
    ("POST", "/api/v1/tasks/{task}/reject", "rejectTask"),
    ("POST", "/api/v1/tasks/{task}/reconcile", "reconcileTask"),
    ("POST", "/api/v1/tasks/{task}/answer", "answerTask"),
    ("POST", "/api/v1/tasks/{task}/messages", "sendMessage"),
    ("POST", "/api/v1/tasks/{task}/cancel", "cancelTask"),
    ("GET", "/api/v1/events", "listEvents"),
];

/// What a caller may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// Everything: decisions, every task, the audit log, the console.
    Operator,
    /// Create tasks, and read the tasks it created.
    Submit,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "operator" => Some(Role::Operator),
            "submit" => Some(Role::Submit),
            _ => None,
        }
    }
}

/// Who makes a request: a token's name and role, and for a `submit` token, the users its
/// tasks may act for (`None`: any).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    pub name: String,
    pub role: Role,
    pub users: Option<UserPattern>,
}

/// Which users a token's tasks may act for: a pattern where `*` stands for any run of
/// characters (`cu_*`, `*@acme.example`, `billing-bot`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UserPattern(String);

impl UserPattern {
    /// The pattern `text`: printable ASCII without spaces, at most 255 bytes.
    pub fn parse(text: &str) -> Result<UserPattern, String> {
        if text.is_empty()
            || text.len() > crate::limits::NAME_BYTES_MAX
            || !text.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(format!(
                "users={} must be a pattern of printable characters (`*` for any run of them), up to {} bytes",
                crate::limits::printable(text),
                crate::limits::NAME_BYTES_MAX
            ));
        }
        Ok(UserPattern(text.to_string()))
    }

    /// Whether `user` matches: the parts between `*`s appear in order, the first at the start
    /// and the last at the end.
    pub fn admits(&self, user: &str) -> bool {
        let parts: Vec<&str> = self.0.split('*').collect();
        let (first, rest) = parts.split_first().unwrap_or((&"", &[]));
        let Some(mut left) = user.strip_prefix(first) else {
            return false;
        };
        let Some((last, middle)) = rest.split_last() else {
            return left.is_empty();
        };
        for part in middle {
            match left.find(part) {
                Some(i) => left = &left[i + part.len()..],
                None => return false,
            }
        }
        left.len() >= last.len() && left.ends_with(last)
    }
}

impl std::fmt::Display for UserPattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// The API over one database.
pub struct Api {
    db: Arc<dyn Backend>,
    /// The server's config: model profiles, tool catalog, callbacks (what a task's names
    /// mean, and which callback URLs are allowed).
    config: Arc<crate::config::Config>,
    /// The config with its MCP servers' tools in the catalog (listed once, at the first
    /// create that needs them).
    enqueue_config: OnceLock<Arc<crate::config::Config>>,
    /// The demo shop, for a settlement's lookup of a demo task.
    tools_target: String,
    watch: OnceLock<Watch>,
    /// The long polls open now (bounded: see `polls`).
    polls: Arc<polls::LongPolls>,
}

/// The schemas of the document's components, compiled once.
fn document() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| serde_json::from_str(DOCUMENT).unwrap_or(Value::Null))
}

impl Api {
    pub fn new(
        db: Arc<dyn Backend>,
        config: Arc<crate::config::Config>,
        tools_target: String,
    ) -> Api {
        Api {
            db,
            config,
            enqueue_config: OnceLock::new(),
            tools_target,
            watch: OnceLock::new(),
            polls: Arc::default(),
        }
    }

    fn watch(&self) -> &Watch {
        self.watch
            .get_or_init(|| Watch::new(self.db.as_ref(), Watched::Settled))
    }

    /// Answers a request under `/api/v1`; `caller` is `None` without a valid token.
    pub fn handle(&self, req: &Request, caller: Option<&Caller>) -> Reply {
        let segments: Vec<String> = req
            .path
            .trim_end_matches('/')
            .split('/')
            // A path keeps its '+' (only a query's means a space).
            .map(|s| percent_decode(&s.replace('+', "%2B")))
            .collect();
        let Some((op, params)) = route(&req.method, &segments) else {
            let allowed: Vec<&str> = ROUTES
                .iter()
                .filter(|(_, p, _)| matches(p, &segments).is_some())
                .map(|(m, _, _)| *m)
                .collect();
            if allowed.is_empty() {
                return problem(
                    404,
                    "not_found",
                    &format!(
                        "there is no {} in this API (its operations: GET /api/v1/openapi.json)",
                        crate::limits::printable(&req.path)
                    ),
                );
            }
            return problem(
                405,
                "method_not_allowed",
                &format!("{} is not an operation of {}", req.method, req.path),
            )
            .with_header("Allow", &allowed.join(", "));
        };
        if op == "getOpenApi" {
            return Reply::Response {
                status: 200,
                headers: vec![("Content-Type", "application/json".into())],
                body: DOCUMENT.as_bytes().to_vec(),
            };
        }
        let Some(caller) = caller else {
            return problem(
                401,
                "unauthorized",
                "no valid token: send Authorization: Bearer TOKEN, a token of the server's token file",
            )
            .with_header("WWW-Authenticate", "Bearer");
        };
        let task = params.first().map(String::as_str).unwrap_or_default();
        let reply = match op {
            "createTask" => self.create(req, caller),
            "listTasks" => self.list(req, caller),
            "getTask" => self.get(req, caller, task),
            "listTaskEvents" if wants_stream(req) => self.task_stream(req, caller, task),
            "listTaskEvents" => self.task_events(caller, task),
            "listEvents" => self.events(req, caller),
            "answerTask" => self.answer(req, caller, task),
            "sendMessage" => self.say(req, caller, task),
            verb => self.decide(req, caller, task, verb),
        };
        reply.with_header("Cache-Control", "no-store")
    }

    /// Refuses what only operators may do.
    fn operator_only(caller: &Caller, what: &str) -> Option<Reply> {
        (caller.role != Role::Operator).then(|| {
            problem(
                403,
                "forbidden",
                &format!("{what} is for operator tokens; this token ({}) may create tasks and read its own", caller.name),
            )
        })
    }
}

/// The operation of `method` on `segments`, and the path's parameters.
fn route(method: &str, segments: &[String]) -> Option<(&'static str, Vec<String>)> {
    ROUTES.iter().find_map(|(m, p, op)| {
        let params = matches(p, segments)?;
        (*m == method).then_some((*op, params))
    })
}

/// The parameters of path template `template` in `segments`, if it matches.
fn matches(template: &str, segments: &[String]) -> Option<Vec<String>> {
    let parts: Vec<&str> = template.split('/').collect();
    if parts.len() != segments.len() {
        return None;
    }
    let mut params = Vec::new();
    for (t, s) in parts.iter().zip(segments) {
        if t.starts_with('{') {
            if s.is_empty() {
                return None;
            }
            params.push(s.clone());
        } else if t != s {
            return None;
        }
    }
    Some(params)
}

/// A request's JSON body, checked against the document's schema `component`: `Err` is the
/// problem to answer (415 not JSON, 400 not the documented shape).
fn body(req: &Request, component: &str, optional: bool) -> Result<Value, Reply> {
    if req.body.is_empty() && optional {
        return Ok(Value::Object(Default::default()));
    }
    let json_type = req
        .header("content-type")
        .and_then(|v| std::str::from_utf8(v).ok())
        .map(|v| {
            v.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .is_some_and(|t| {
            t == "application/json" || (t.starts_with("application/") && t.ends_with("+json"))
        });
    if !json_type {
        return Err(problem(
            415,
            "unsupported_media_type",
            "send the body as JSON, with Content-Type: application/json",
        ));
    }
    let text = std::str::from_utf8(&req.body)
        .map_err(|_| problem(400, "invalid_body", "the body is not UTF-8"))?;
    let v = crate::limits::parse_json_input(text, "the body", crate::limits::HTTP_BODY_BYTES_MAX)
        .map_err(|e| problem(400, "invalid_body", &e.0))?;
    let schema = &document()["components"]["schemas"][component];
    let validator = jsonschema::options()
        .should_validate_formats(true)
        .build(schema)
        .map_err(|e| {
            problem(
                500,
                "document",
                &format!("the API's own schema {component} is invalid: {e}"),
            )
        })?;
    let errors = crate::kernel::catalog::schema_errors(&validator, &v);
    if !errors.is_empty() {
        return Err(problem(
            400,
            "invalid_body",
            &format!(
                "the body is not {} {component} as the API document describes it: {}",
                if component.starts_with(['A', 'E', 'I', 'O', 'U']) {
                    "an"
                } else {
                    "a"
                },
                errors.join("; ")
            ),
        ));
    }
    Ok(integral(v))
}

/// `v` with every number that is a whole number written with a fraction (`3.0`, which JSON
/// Schema counts as an integer) as that integer, so that what the schema admits, the typed
/// fields read.
fn integral(v: Value) -> Value {
    match v {
        Value::Number(n) if !n.is_i64() && !n.is_u64() => match n.as_f64() {
            Some(f) if f.fract() == 0.0 && f >= 0.0 && f < u64::MAX as f64 => Value::from(f as u64),
            Some(f) if f.fract() == 0.0 && f < 0.0 && f >= i64::MIN as f64 => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(a) => Value::Array(a.into_iter().map(integral).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, integral(v))).collect()),
        other => other,
    }
}

/// A query parameter given more than once, or not as UTF-8, is refused.
fn param(req: &Request, name: &str) -> Result<Option<String>, Reply> {
    let mut found = None;
    for kv in req.query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        if percent_decode(k) == name {
            if found.is_some() {
                return Err(problem(
                    400,
                    "invalid_query",
                    &format!("the query parameter {name} is given more than once"),
                ));
            }
            found = Some(percent_decode(v));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The router and the document describe the same operations.
    #[test]
    fn every_route_is_in_the_document_and_every_operation_is_routed() {
        let doc: Value = serde_json::from_str(DOCUMENT).expect("the document is JSON");
        assert_eq!(doc["openapi"], "3.1.0");
        let mut documented = Vec::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("a path item") {
                documented.push((
                    method.to_ascii_uppercase(),
                    path.clone(),
                    op["operationId"]
                        .as_str()
                        .expect("an operationId")
                        .to_string(),
                ));
            }
        }
        documented.sort();
        let mut routed: Vec<(String, String, String)> = ROUTES
            .iter()
            .map(|(m, p, o)| (m.to_string(), p.to_string(), o.to_string()))
            .collect();
        routed.sort();
        assert_eq!(routed, documented);
    }

    fn properties(component: &str) -> Vec<String> {
        let schema = &document()["components"]["schemas"][component];
        assert_eq!(
            schema["additionalProperties"],
            Value::Bool(false),
            "{component} must refuse fields it does not list"
        );
        let mut v: Vec<String> = schema["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("{component} has properties"))
            .keys()
            .cloned()
            .collect();
        v.sort_unstable();
        v
    }

    /// Review 48, hole 2: the document listed `start_in`, `ttl`, `concurrency_key`, ... and
    /// the server's request struct had no such fields, so a caller's delay, time to live and
    /// tenant limit were dropped unread. Every request schema's properties are exactly what
    /// the server reads (the decisions share one body: the union of their schemas).
    #[test]
    fn the_request_schemas_list_exactly_what_the_server_reads() {
        use crate::testing::fields_of;
        assert_eq!(
            fields_of::<tasks::TaskCreate>(),
            properties("TaskCreate"),
            "TaskCreate"
        );
        let mut decisions: Vec<String> = ["Approve", "Reject", "Reconcile", "Cancel"]
            .iter()
            .flat_map(|c| properties(c))
            .collect();
        decisions.sort_unstable();
        decisions.dedup();
        assert_eq!(fields_of::<decide::DecisionBody>(), decisions, "decisions");
        assert_eq!(
            fields_of::<decide::AnswerBody>(),
            properties("Answer"),
            "Answer"
        );
    }

    /// The document's enums of a task's stop, outcome and status are the code's lists
    /// (`docs/reference/stops.md` is held to the same lists by `store::result`'s test).
    #[test]
    fn the_documents_enums_are_the_codes_lists() {
        use crate::kernel::state::STOP_REASONS;
        use crate::store::QueueStatus;
        let strings = |v: &Value| -> Vec<String> {
            let mut out: Vec<String> = v
                .as_array()
                .unwrap_or_else(|| panic!("an enum: {v}"))
                .iter()
                .filter_map(|s| s.as_str().map(str::to_string))
                .collect();
            out.sort_unstable();
            out
        };
        let sorted = |v: Vec<&str>| -> Vec<String> {
            let mut v: Vec<String> = v.into_iter().map(str::to_string).collect();
            v.sort_unstable();
            v
        };
        let stops = sorted(STOP_REASONS.iter().map(|s| s.as_str()).collect());
        let outcomes = sorted(vec!["completed", "cannot_complete"]);
        let statuses = sorted(QueueStatus::ALL.iter().map(|s| s.as_str()).collect());
        let schemas = &document()["components"]["schemas"];
        for schema in ["Task", "TaskSummary"] {
            let p = &schemas[schema]["properties"];
            assert_eq!(strings(&p["stop"]["enum"]), stops, "{schema}.stop");
            assert_eq!(strings(&p["outcome"]["enum"]), outcomes, "{schema}.outcome");
        }
        assert_eq!(
            strings(&schemas["Task"]["properties"]["status"]["enum"]),
            statuses
        );
        let mut listed = statuses.clone();
        listed.push("damaged".into());
        listed.sort_unstable();
        assert_eq!(
            strings(&schemas["TaskSummary"]["properties"]["status"]["enum"]),
            listed,
            "a list shows damaged tasks too"
        );
    }

    #[test]
    fn user_patterns_match_by_their_stars() {
        let p = |t: &str| UserPattern::parse(t).expect("a pattern");
        assert!(p("cu_*").admits("cu_ana") && p("cu_*").admits("cu_"));
        assert!(!p("cu_*").admits("ops") && !p("cu_*").admits("xcu_ana"));
        assert!(p("*@acme.example").admits("ana@acme.example"));
        assert!(!p("*@acme.example").admits("ana@acme.example.evil"));
        assert!(p("a*b*c").admits("abc") && p("a*b*c").admits("a-b-b-c"));
        assert!(!p("a*b*c").admits("acb") && !p("ab*ba").admits("aba"));
        assert!(p("bot").admits("bot") && !p("bot").admits("bots"));
        assert!(p("*").admits("anyone"));
        assert!(UserPattern::parse("cu ana").is_err() && UserPattern::parse("").is_err());
    }

    /// Every request schema compiles, with formats checked.
    #[test]
    fn the_request_schemas_compile() {
        for c in [
            "TaskCreate",
            "Approve",
            "Reject",
            "Reconcile",
            "Answer",
            "Cancel",
        ] {
            let schema = &document()["components"]["schemas"][c];
            assert!(schema.is_object(), "{c}");
            jsonschema::options()
                .should_validate_formats(true)
                .build(schema)
                .unwrap_or_else(|e| panic!("{c}: {e}"));
        }
    }
}
