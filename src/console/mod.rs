//! `worker console`: a web console served by the project, over the same operator API as the
//! CLI. Server-rendered HTML (askama templates, no JavaScript), on the blocking HTTP edge of
//! [`crate::httpd`].
//!
//! Pages: the tasks (counts by status, filters, pages), a task (plan, budgets as bars, the
//! closing message, facts, the trace as a waterfall, recorded replies, audit events), the held
//! writes and suspended calls (with a look-up by call key), and a user's memory notes; and
//! `/metrics` and `/healthz`. Actions (approve, reject, reconcile, settle by lookup, cancel) are forms that
//! write the same audit events as the CLI, through the same backend decisions.
//!
//! Safety: loopback only unless a token file names who may sign in (each token names its
//! operator, who is recorded in the audit log); every form carries a CSRF token bound to the
//! operator; a decision form carries the call key and digest it was rendered with, so a task
//! that moved on refuses it, in the decision's own transaction; a cancel form carries the
//! task's last change and is refused if the task changed since.

mod access;
mod actions;

use access::token_caller;
pub use access::{Access, check_listen, is_loopback, read_tokens};
mod guard;
mod pages;

use askama::Template;
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::api::{Api, Caller, Role};
use crate::clock::{now_ms, parse_when, rfc3339};
use crate::httpd::{Reply, Request, percent_decode};

/// Connections the console (and the API it serves) holds open at once.
const CONNECTIONS_MAX: usize = 128;
use crate::kernel::StopReason;
use crate::operator::{self, held_writes};
use crate::store::list::{ListQuery, task_num};
use crate::store::{Backend, Error, QueueStatus};
use pages::{
    Filters, Frame, HeldPage, HeldRow, LoginPage, MemoryPage, MessagePage, TaskPage, TasksPage,
};

pub struct Console {
    db: Arc<dyn Backend>,
    tools_target: String,
    /// The console's config: its catalog has the tools' lookup URLs.
    config: Arc<crate::config::Config>,
    access: Access,
    /// With tokens: whether `/metrics` and `/healthz` are served without one.
    public_metrics: bool,
    /// Per-process secret the CSRF tokens are derived from.
    secret: String,
    /// The HTTP API under `/api/v1`, on the same listener.
    api: Api,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A form's fields.
fn form(req: &Request) -> BTreeMap<String, String> {
    String::from_utf8_lossy(&req.body)
        .split('&')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((percent_decode(k), percent_decode(v)))
        })
        .collect()
}

fn query_of(pairs: &[(&str, &str)]) -> String {
    pairs
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", url_encode(v)))
        .collect::<Vec<_>>()
        .join("&")
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' | b':' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn render(t: &impl Template, status: u16) -> Reply {
    match t.render() {
        Ok(html) => Reply::html(status, html),
        Err(e) => Reply::html(500, format!("<p>cannot render the page: {e}</p>")),
    }
}

impl Console {
    /// `public_metrics`: with tokens, serve `/metrics` and `/healthz` without one.
    pub fn new(
        db: Arc<dyn Backend>,
        tools_target: String,
        config: crate::config::Config,
        access: Access,
        public_metrics: bool,
    ) -> Console {
        let mut seed = [0u8; 16];
        seed[..8].copy_from_slice(&crate::store::random_u64().to_le_bytes());
        seed[8..].copy_from_slice(&crate::store::random_u64().to_le_bytes());
        let config = Arc::new(config);
        let api = Api::new(Arc::clone(&db), Arc::clone(&config), tools_target.clone());
        Console {
            db,
            tools_target,
            config,
            access,
            public_metrics,
            secret: hex(&seed),
            api,
        }
    }

    /// Serves until `stop` is set; calls `ready` with the bound address.
    pub fn serve(
        self,
        listen: &str,
        stop: Arc<AtomicBool>,
        ready: impl FnOnce(String),
    ) -> Result<(), String> {
        let me = Arc::new(self);
        // Room for the API's long polls beside the operators' pages: they hold at most
        // `api::LONG_POLLS_MAX` of these connections, so the rest serve everything else.
        const _: () = assert!(crate::api::LONG_POLLS_MAX * 2 < CONNECTIONS_MAX);
        let limits = crate::httpd::Limits {
            connections_max: CONNECTIONS_MAX,
            body_bytes_max: 64 << 10,
            ..Default::default()
        };
        crate::httpd::serve(
            listen,
            limits,
            stop,
            ready,
            Arc::new(move |req| me.handle(req)),
        )
    }

    fn csrf(&self, operator: &str) -> String {
        hex(&Sha256::digest(format!("{}\0{operator}", self.secret).as_bytes())[..16])
    }

    /// The bearer token of a request, if it sends one.
    fn bearer(req: &Request) -> Option<String> {
        req.header("authorization")
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| {
                let (scheme, token) = v.split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
            })
            .map(str::to_string)
    }

    /// Who makes a request to the API: the bearer token's holder (never a cookie: a browser
    /// sends cookies with requests other sites make), or on loopback, the console's operator.
    fn api_caller(&self, req: &Request) -> Option<Caller> {
        match &self.access {
            Access::Loopback { operator } => Some(Caller {
                name: operator.clone(),
                role: Role::Operator,
                users: None,
            }),
            Access::Tokens(tokens) => {
                Console::bearer(req).and_then(|t| token_caller(tokens, &t).cloned())
            }
        }
    }

    /// The operator a console request is made by, or `None` if it must sign in (a `submit`
    /// token does not open the console).
    fn operator(&self, req: &Request) -> Option<String> {
        match &self.access {
            Access::Loopback { operator } => Some(operator.clone()),
            Access::Tokens(tokens) => {
                let cookie = req
                    .header("cookie")
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|c| {
                        c.split(';')
                            .find_map(|kv| kv.trim().strip_prefix("tether_token="))
                    })
                    .map(percent_decode);
                Console::bearer(req)
                    .or(cookie)
                    .and_then(|t| token_caller(tokens, &t))
                    .filter(|c| c.role == Role::Operator)
                    .map(|c| c.name.clone())
            }
        }
    }

    fn frame(&self, operator: &str) -> Frame {
        Frame {
            operator: operator.to_string(),
            db: self.db.describe(),
        }
    }

    fn message(
        &self,
        operator: &str,
        status: u16,
        heading: &str,
        message: String,
        back: Option<String>,
    ) -> Reply {
        let f = self.frame(operator);
        render(
            &MessagePage {
                operator: f.operator,
                db: f.db,
                heading: heading.into(),
                message,
                back,
            },
            status,
        )
    }

    fn handle(&self, req: &Request) -> Reply {
        let loopback = matches!(self.access, Access::Loopback { .. });
        if let Some(why) = guard::refused(req, loopback) {
            tracing::warn!(path = %req.path, reason = %why, "console: request refused");
            return Reply::html(403, format!("<p>{}</p>", guard::escape(&why)));
        }
        if req.path == "/metrics" || req.path == "/healthz" {
            if loopback || self.public_metrics || self.operator(req).is_some() {
                if let Some(r) = crate::metrics::handle(self.db.as_ref(), req) {
                    return r;
                }
            } else {
                return Reply::json(
                    401,
                    &json!({"error": "a token is needed (Authorization: Bearer TOKEN), or start the console with --public-metrics"}),
                )
                .with_header("WWW-Authenticate", "Bearer");
            }
        }
        if req.path == "/login" {
            return self.login(req);
        }
        if req.path == "/api" || req.path.starts_with("/api/") {
            return self.api.handle(req, self.api_caller(req).as_ref());
        }
        let Some(op) = self.operator(req) else {
            return if req.method == "GET" {
                Reply::see_other("/login")
            } else {
                Reply::json(401, &json!({"error": "sign in first: no valid token"}))
            };
        };
        let segments: Vec<&str> = req.path.trim_matches('/').split('/').collect();
        let result = match (req.method.as_str(), segments.as_slice()) {
            ("GET", [""]) => self.tasks(&op, req),
            ("GET", ["tasks", id]) => self.task(&op, id, req.param("event")),
            ("GET", ["held"]) => self.held(&op, req),
            ("GET", ["memory"]) => self.memory(&op, req),
            ("POST", ["tasks", id, verb]) => return self.act(&op, id, verb, req),
            ("GET", _) => {
                return self.message(
                    &op,
                    404,
                    "Not found",
                    format!("There is no page {}.", req.path),
                    Some("/".into()),
                );
            }
            _ => return Reply::json(405, &json!({"error": "method not allowed"})),
        };
        result.unwrap_or_else(|e| {
            let status = if matches!(e, Error::NoTask(_)) {
                404
            } else {
                500
            };
            self.message(
                &op,
                status,
                "Cannot show this",
                e.to_string(),
                Some("/".into()),
            )
        })
    }

    fn login(&self, req: &Request) -> Reply {
        let Access::Tokens(tokens) = &self.access else {
            return Reply::see_other("/");
        };
        if req.method != "POST" {
            return render(&LoginPage { failed: false }, 200);
        }
        let token = form(req).remove("token").unwrap_or_default();
        if token_caller(tokens, &token).is_none_or(|c| c.role != Role::Operator) {
            tracing::warn!("console: a sign-in with an unknown token");
            return render(&LoginPage { failed: true }, 401);
        }
        Reply::see_other("/").with_header(
            "Set-Cookie",
            &format!(
                "tether_token={}; HttpOnly; SameSite=Strict; Path=/",
                url_encode(&token)
            ),
        )
    }

    fn tasks(&self, op: &str, req: &Request) -> crate::store::Result<Reply> {
        let p = |k: &str| req.param(k).unwrap_or_default().trim().to_string();
        let f = Filters {
            status: p("status"),
            stop: p("stop"),
            outcome: p("outcome"),
            user: p("user"),
            key: p("key"),
            since: p("since"),
            until: p("until"),
        };
        let now = now_ms();
        let mut errors = Vec::new();
        let mut when = |name: &str, v: &str| {
            (!v.is_empty())
                .then(|| {
                    parse_when(v, now)
                        .map_err(|e| errors.push(format!("{name}: {e}")))
                        .ok()
                })
                .flatten()
        };
        let (since_ms, until_ms) = (when("since", &f.since), when("until", &f.until));
        let status = (!f.status.is_empty())
            .then(|| QueueStatus::parse(&f.status))
            .flatten();
        if !f.status.is_empty() && status.is_none() {
            errors.push(format!("{:?} is not a status", f.status));
        }
        let stop = (!f.stop.is_empty())
            .then(|| StopReason::parse(&f.stop))
            .flatten();
        if !f.stop.is_empty() && stop.is_none() {
            errors.push(format!("{:?} is not a stop reason", f.stop));
        }
        let outcome = match f.outcome.as_str() {
            "" => None,
            o @ ("completed" | "cannot_complete") => Some(o.to_string()),
            o => {
                errors.push(format!(
                    "{o:?} is not an outcome (completed or cannot_complete)"
                ));
                None
            }
        };
        let before = req.param("before").and_then(|b| task_num(&b));
        let q = ListQuery {
            status,
            stop,
            outcome,
            user: (!f.user.is_empty()).then(|| f.user.clone()),
            key: (!f.key.is_empty()).then(|| f.key.clone()),
            since_ms,
            until_ms,
            before,
            limit: 50,
        };
        let page = self.db.list(&q)?;
        let next = page.next.map(|n| {
            let before = format!("t{n}");
            query_of(&[
                ("status", &f.status),
                ("stop", &f.stop),
                ("outcome", &f.outcome),
                ("user", &f.user),
                ("key", &f.key),
                ("since", &f.since),
                ("until", &f.until),
                ("before", &before),
            ])
        });
        let counts = self.db.counts()?;
        let error = (!errors.is_empty()).then(|| errors.join("; "));
        Ok(render(
            &TasksPage::new(self.frame(op), &counts, f, &page, next, error),
            200,
        ))
    }

    fn task(&self, op: &str, id: &str, event: Option<String>) -> crate::store::Result<Reply> {
        let id = self.db.resolve(&percent_decode(id))?;
        let d = operator::detail(self.db.as_ref(), &id)?;
        // A decision redirects here with its audit event's number; the message is made from
        // that event of this task's audit log, so no link can announce what did not happen.
        let flash = event
            .and_then(|n| n.parse::<u64>().ok())
            .and_then(|n| d.events.iter().find(|e| e.seq == n))
            .and_then(|e| {
                actions::done_message(&e.verb)
                    .map(|m| format!("Recorded: {m} (by {}, {}).", e.by, rfc3339(e.at_ms)))
            });
        Ok(render(
            &TaskPage::new(self.frame(op), &d, self.csrf(op), flash),
            200,
        ))
    }

    fn held(&self, op: &str, req: &Request) -> crate::store::Result<Reply> {
        let held = held_writes(self.db.as_ref())?;
        let page = self.db.list(&ListQuery {
            status: Some(QueueStatus::Suspended),
            limit: 200,
            ..Default::default()
        })?;
        let mut suspended = Vec::new();
        let mut questions = Vec::new();
        for l in &page.tasks {
            let Ok(r) = self.db.task(l.id()) else {
                continue;
            };
            let since_ms = r.suspended_at_ms.unwrap_or(r.updated_at_ms);
            if let Some(q) = crate::store::result::question(&r) {
                questions.push((r.id.clone(), q.text, crate::clock::rfc3339(since_ms)));
            } else if let Some(p) = &r.state.pending {
                suspended.push(HeldRow::of(&operator::HeldWrite {
                    task: r.id.clone(),
                    status: r.status,
                    tool: p.name.clone(),
                    args: serde_json::Value::Object(p.args.clone()),
                    key: self.db.call_key(&r, p),
                    digest: p.digest(),
                    since_ms,
                    known: None,
                    call_record_error: None,
                }));
            }
        }
        let lookup_key = req.param("key").unwrap_or_default().trim().to_string();
        let lookup = (!lookup_key.is_empty()).then(|| self.look_up(&lookup_key));
        let f = self.frame(op);
        Ok(render(
            &HeldPage {
                operator: f.operator,
                db: f.db,
                csrf: self.csrf(op),
                held: held.iter().map(HeldRow::of).collect(),
                suspended,
                questions,
                lookup_key,
                lookup,
            },
            200,
        ))
    }

    /// What the worker database recorded under a call key, and what the tool says of it.
    fn look_up(&self, key: &str) -> String {
        let c = match self.db.call(key) {
            Ok(Some(c)) => c,
            Ok(None) => return format!("No call was recorded under the key {key}."),
            Err(e) => return format!("Cannot read the call record: {e}"),
        };
        let recorded = serde_json::to_string_pretty(&c).unwrap_or_default();
        let target = self.tools_target.clone();
        let mut open = || {
            Ok(Arc::new(crate::tools::durable::DurableStore::open_target(
                &target,
            )?))
        };
        let tool = match self.db.task(&c.task_id) {
            Ok(rec) => match operator::ask_tool(&rec, &c.tool, key, &self.config, &mut open) {
                Ok(crate::tools::http::Lookup::Applied(v)) => format!("applied, with result {v}"),
                Ok(crate::tools::http::Lookup::NotApplied) => "not applied".into(),
                Ok(crate::tools::http::Lookup::Unknown(why)) => {
                    format!("no definite answer ({why})")
                }
                Err(e) => format!("cannot ask it ({e})"),
            },
            Err(e) => format!("cannot read task {} ({e})", c.task_id),
        };
        format!("recorded by the worker:\n{recorded}\n\nthe tool says: {tool}")
    }

    fn memory(&self, op: &str, req: &Request) -> crate::store::Result<Reply> {
        let user = req.param("user").unwrap_or_default().trim().to_string();
        let notes = if user.is_empty() {
            Vec::new()
        } else {
            self.db.notes(Some(&user), now_ms(), false)?
        };
        let f = self.frame(op);
        Ok(render(
            &MemoryPage {
                operator: f.operator,
                db: f.db,
                notes: notes
                    .iter()
                    .map(|n| {
                        (
                            n.text.clone(),
                            n.source.clone(),
                            rfc3339(n.created_at_s.saturating_mul(1000)),
                            rfc3339(n.expires_at_s.saturating_mul(1000)),
                        )
                    })
                    .collect(),
                user,
            },
            200,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_keep_only_the_set_filters() {
        assert_eq!(
            query_of(&[("user", "cu ana"), ("stop", ""), ("before", "t5")]),
            "user=cu%20ana&before=t5"
        );
    }
}
