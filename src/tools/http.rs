//! Tools called over HTTP with the call key in the `Idempotency-Key` header (and an approval,
//! signed with the tool's secret, in `Tether-Approval`: see [`super::approval`]), the lookup that `worker reconcile --auto` asks, and the body a tool
//! service receives. A request is bounded by the tool's timeout and the task's remaining time;
//! a write whose answer is lost, or that is answered with a redirect (never followed), is
//! reported `unknown`, never retried here.

use serde_json::{Map, Value, json};
use std::time::{Duration, Instant};

use crate::kernel::catalog::{Access, HttpSpec, ToolSpec};
use crate::kernel::{Catalog, ToolReply, ToolRequest};
use crate::limits;
use crate::net::{agent, clip, read_body};
use crate::tools::{Tools, approval};

/// Tools called over HTTP: `POST url` with `{"user_id", "args"}` and the call key in the
/// `Idempotency-Key` header. The user id comes from the task, never from the model.
pub struct HttpTools<'a> {
    pub catalog: &'a Catalog,
}

impl Tools for HttpTools<'_> {
    fn call(&mut self, req: &ToolRequest<'_>) -> ToolReply {
        let start = Instant::now();
        let write = req.access == Access::Write;
        let result = match self.catalog.get(&req.call.name) {
            Some(spec) => call_tool(spec, req, write),
            None => json!({"status": "error", "code": "unknown_tool"}),
        };
        ToolReply {
            result,
            latency_ms: start.elapsed().as_millis() as u64,
        }
    }
}

fn outcome_unknown(write: bool, code: &str, detail: String) -> Value {
    if write {
        json!({"status": "unknown", "code": code, "detail": detail})
    } else {
        json!({"status": "error", "code": code, "detail": detail})
    }
}

/// The `Tether-Approval` header for the approved `call`, signed with
/// the tool's approval secret; `Err` (nothing is sent) when the catalog names none or the
/// daemon's environment lacks it.
fn signed_approval(http: &HttpSpec, call: &approval::Call<'_>) -> Result<String, String> {
    let Some(var) = &http.approval_secret_env else {
        return Err("the call was approved, but its catalog entry names no approval_secret_env, so the service could not tell the approval from a forgery; nothing was sent (see docs/approvals.md)".into());
    };
    let secret = std::env::var(var).ok().filter(|s| !s.is_empty()).ok_or_else(|| {
        format!("the call was approved, but {var} (its approval_secret_env) is not set in this worker's environment; nothing was sent")
    })?;
    let expires_s = crate::clock::now_ms() / 1000 + approval::VALIDITY_S;
    Ok(approval::sign(secret.as_bytes(), call, expires_s))
}

fn call_tool(spec: &ToolSpec, req: &ToolRequest<'_>, write: bool) -> Value {
    let Some(http) = &spec.http else {
        return json!({"status": "error", "code": "not_http", "detail": "the tool has no URL"});
    };
    let timeout = Duration::from_millis(http.timeout_ms.min(req.timeout_ms).max(1));
    let body = json!({"user_id": req.user_id, "args": Value::Object(req.call.args.clone())});
    let a = agent(timeout);
    let r = if http.method == "PUT" {
        a.put(&http.url)
    } else {
        a.post(&http.url)
    };
    let mut r = r
        .header("Content-Type", "application/json")
        .header("Idempotency-Key", req.key);
    if req.approval.is_some() {
        // The approval recorded in the worker database travels with the call it covers,
        // signed so that the service can tell it from a digest anyone could compute.
        let hash = crate::kernel::state::call_hash(&req.call.name, &req.call.args);
        let call = approval::Call {
            key: req.key,
            user: req.user_id,
            hash: &hash,
        };
        match signed_approval(http, &call) {
            Ok(header) => r = r.header(approval::HEADER, &header),
            Err(e) => {
                tracing::error!(tool = %spec.name, key = req.key, error = %e, "approved call not sent");
                return json!({"status": "error", "code": "approval_not_signed", "detail": e});
            }
        }
    }
    match r.send(body.to_string()) {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            if (200..300).contains(&status) {
                tracing::debug!(tool = %spec.name, key = req.key, status, "tool answered");
            } else {
                tracing::warn!(tool = %spec.name, key = req.key, status, url = %http.url, "tool answered HTTP {status}");
            }
            let text = match read_body(&mut resp, limits::TOOL_RESULT_BYTES_MAX) {
                Ok(t) => t,
                Err(e) => return outcome_unknown(write, "invalid_result", e),
            };
            match status {
                200..=299 => match limits::parse_json_input(
                    &text,
                    "the result",
                    limits::TOOL_RESULT_BYTES_MAX,
                ) {
                    Ok(v) if v.get("status").is_some_and(Value::is_string) => v,
                    Err(e) => outcome_unknown(write, "invalid_result", e.0),
                    _ => outcome_unknown(
                        write,
                        "invalid_result",
                        format!("unexpected body: {}", clip(&text)),
                    ),
                },
                // A redirect is never followed (see `net::agent`): where the call went is not
                // known, so for a write its outcome is not either.
                300..=399 => outcome_unknown(
                    write,
                    &format!("http_{status}"),
                    format!(
                        "the tool answered a redirect to {:?}; tool calls never follow redirects",
                        clip(
                            resp.headers()
                                .get("location")
                                .and_then(|v| v.to_str().ok())
                                .unwrap_or("")
                        )
                    ),
                ),
                // The same key was sent with other arguments: nothing was done for this call.
                422 => {
                    json!({"status": "error", "code": "idempotency_mismatch", "detail": clip(&text)})
                }
                // The same key is still being processed elsewhere: its outcome is not known yet.
                409 => outcome_unknown(write, "in_flight", clip(&text)),
                400..=499 => {
                    json!({"status": "error", "code": format!("http_{status}"), "detail": clip(&text)})
                }
                _ => outcome_unknown(write, &format!("http_{status}"), clip(&text)),
            }
        }
        Err(ureq::Error::Timeout(_)) => {
            outcome_unknown(write, "timeout", "no answer within the timeout".into())
        }
        Err(e) => outcome_unknown(write, "transport", e.to_string()),
    }
}

/// What a lookup endpoint says of a call key.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    Applied(Value),
    NotApplied,
    /// No definite answer (unreachable, in flight, malformed): settle nothing.
    Unknown(String),
}

/// `GET {lookup_url}?key=K`, answered `{"applied": true, "result": {...}}` or
/// `{"applied": false}`.
pub fn lookup(url: &str, key: &str) -> Lookup {
    let r = agent(Duration::from_secs(5)).get(url).query("key", key);
    match r.call() {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            let text = match read_body(&mut resp, limits::TOOL_RESULT_BYTES_MAX) {
                Ok(t) => t,
                Err(e) => return Lookup::Unknown(e),
            };
            if status != 200 {
                return Lookup::Unknown(format!("HTTP {status}: {}", clip(&text)));
            }
            let v = match limits::parse_json_input(
                &text,
                "the answer",
                limits::TOOL_RESULT_BYTES_MAX,
            ) {
                Ok(v) => v,
                Err(e) => return Lookup::Unknown(e.0),
            };
            match v["applied"].as_bool() {
                Some(true) if v["result"].get("status").is_some_and(Value::is_string) => {
                    Lookup::Applied(v["result"].clone())
                }
                Some(false) => Lookup::NotApplied,
                _ => Lookup::Unknown(format!("no definite answer: {}", clip(&text))),
            }
        }
        Err(e) => Lookup::Unknown(e.to_string()),
    }
}

/// The body a tool service receives, parsed.
pub fn parse_tool_body(text: &str) -> Result<(String, Map<String, Value>), String> {
    let v: Value = limits::strict_json(text).map_err(|e| format!("body is not JSON: {e}"))?;
    let user = v["user_id"]
        .as_str()
        .ok_or("body needs a string user_id")?
        .to_string();
    let args = v["args"]
        .as_object()
        .cloned()
        .ok_or("body needs an object args")?;
    Ok((user, args))
}
