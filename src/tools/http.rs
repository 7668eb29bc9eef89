//! Tools called over HTTP with the call key in the `Idempotency-Key` header (and an approval,
//! signed with the tool's secret, in `Tether-Approval`: see [`super::approval`]), the lookup
//! that `worker reconcile --auto` asks, and the body a tool service receives. The result
//! contract is `docs/tools.md`: a 2xx JSON body is the result, another 4xx is an error the model
//! sees, and 408, 409, 425, 429, 5xx and a lost connection are transient: a read or an
//! idempotent write is tried again under the same key as the tool's `retry` policy says,
//! inside the task's remaining active time; any other write's outcome is then unknown. A
//! connection that could not be made sent nothing: any call, a write that is not idempotent
//! too, is tried again, and its last failure is an error (`not_sent`), never an unknown
//! outcome. A redirect is never followed.

use serde_json::{Map, Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::kernel::catalog::{Access, HttpSpec, RetryPolicy, ToolSpec};
use crate::kernel::{Catalog, ToolReply, ToolRequest};
use crate::limits;
use crate::net::{agent, clip, h1, read_body};
use crate::tools::approval;

/// Tools called over HTTP: `POST url` with `{"user_id", "args"}` and the call key in the
/// `Idempotency-Key` header. The user id comes from the task, never from the model.
pub struct HttpTools<'a> {
    pub catalog: &'a Catalog,
}

impl HttpTools<'_> {
    /// Makes the call (its waits hold no thread) and returns its result.
    pub async fn call(&self, req: &ToolRequest<'_>) -> ToolReply {
        let start = Instant::now();
        let write = req.access == Access::Write;
        let result = match self.catalog.get(&req.call.name) {
            Some(spec) => call_tool(spec, req, write).await,
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

async fn call_tool(spec: &ToolSpec, req: &ToolRequest<'_>, write: bool) -> Value {
    let Some(http) = &spec.http else {
        return json!({"status": "error", "code": "not_http", "detail": "the tool has no URL"});
    };
    let start = Instant::now();
    let built = match super::request::build(http, req.user_id, &req.call.args) {
        Ok(b) => b,
        Err((code, detail)) => {
            tracing::warn!(tool = %spec.name, key = req.key, code, detail = %detail, "call not sent");
            return json!({"status": "error", "code": code, "detail": detail});
        }
    };
    let approval = match req.approval {
        None => None,
        // The worker held the call by the catalog's rule and an operator approved it; a
        // service that names no secret verifies nothing, so nothing is signed for it.
        Some(_) if http.approval_secret_env.is_none() && spec.approval.needs(&req.call.args) => {
            None
        }
        Some(_) => {
            // The approval recorded in the worker database travels with the call it covers,
            // signed so that the service can tell it from a digest anyone could compute.
            let hash = crate::kernel::state::call_hash(&req.call.name, &req.call.args);
            let call = approval::Call {
                key: req.key,
                user: req.user_id,
                hash: &hash,
            };
            match signed_approval(http, &call) {
                Ok(header) => Some(header),
                Err(e) => {
                    tracing::error!(tool = %spec.name, key = req.key, error = %e, "approved call not sent");
                    return json!({"status": "error", "code": "approval_not_signed", "detail": e});
                }
            }
        }
    };
    // A read, or a write the service deduplicates by key, may be sent again after a transient
    // failure; a write that may not is held as unknown after its first one.
    let repeatable = !write || req.idempotent;
    let budget = Duration::from_millis(req.timeout_ms);
    let mut attempt = 1;
    loop {
        let left = budget.saturating_sub(start.elapsed());
        let timeout = Duration::from_millis(http.timeout_ms)
            .min(left)
            .max(Duration::from_millis(1));
        let (result, transient) =
            send(spec, http, req, &built, approval.as_deref(), write, timeout).await;
        let Some(t) =
            transient.filter(|t| (repeatable || t.unsent) && attempt < http.retry.attempts)
        else {
            return result;
        };
        let wait = Duration::from_millis(backoff_ms(&http.retry, attempt))
            .max(t.retry_after.unwrap_or_default())
            .min(Duration::from_millis(http.retry.max_backoff_ms));
        // A try needs time of its own after the wait: give up rather than run past the task's
        // active time.
        let left = budget.saturating_sub(start.elapsed());
        if wait + Duration::from_millis(50) >= left {
            tracing::warn!(tool = %spec.name, key = req.key, cause = %t.cause, "transient failure; no active time left to try again");
            return result;
        }
        tracing::info!(tool = %spec.name, key = req.key, cause = %t.cause, attempt, wait_ms = wait.as_millis() as u64, "transient failure; trying again under the same key");
        crate::metrics::global()
            .tool_retries
            .with_label_values(&[&spec.name, &t.cause])
            .inc();
        tokio::time::sleep(wait).await;
        attempt += 1;
    }
}

/// The wait before retry `n` (1 for the first retry): `backoff_ms` doubled for each next one,
/// at most `max_backoff_ms`, less up to a quarter at random.
fn backoff_ms(p: &RetryPolicy, n: u32) -> u64 {
    let base = p
        .backoff_ms
        .saturating_mul(1u64 << n.saturating_sub(1).min(16))
        .min(p.max_backoff_ms);
    base - crate::net::jitter(base / 4)
}

/// A request that got no answer: what the call's result is, and whether it is worth another
/// try.
fn not_answered(e: h1::Error, write: bool) -> (Value, Option<Transient>) {
    let transient = |cause: &str, unsent| {
        Some(Transient {
            cause: cause.into(),
            retry_after: None,
            unsent,
        })
    };
    match e {
        // The request could not be made, or the write's proof refused it before its first
        // byte: nothing of it left, nothing to retry.
        h1::Error::Invalid(detail) | h1::Error::Refused(detail) => (
            json!({"status": "error", "code": "not_sent", "detail": detail}),
            None,
        ),
        // No connection was made (refused, unreachable, a failed TLS handshake): nothing of
        // the request left, so it is tried again under its key whatever the call, and a write
        // is never held as unknown for it.
        h1::Error::Connect(e) => {
            let detail =
                format!("the connection to the tool could not be made, so nothing was sent: {e}");
            let result = json!({"status": "error", "code": "not_sent", "detail": detail});
            (result, transient("connect", true))
        }
        h1::Error::Timeout => {
            let detail = "no answer within the timeout".to_string();
            (
                outcome_unknown(write, "timeout", detail),
                transient("timeout", false),
            )
        }
        h1::Error::Lost(detail) => (
            outcome_unknown(write, "transport", detail),
            transient("transport", false),
        ),
    }
}

/// A failure worth another try: what failed, the wait the service asked for, and whether any
/// of the request may have left (a connection never made sent nothing: any call may be tried
/// again, a write that is not idempotent too).
struct Transient {
    cause: String,
    retry_after: Option<Duration>,
    unsent: bool,
}

/// The statuses a result may carry as it is (see `docs/tools.md`); any other `status` of a
/// success is the service's own and is kept as `service_status`.
const RESULT_STATUSES: [&str; 5] = ["ok", "error", "needs_approval", "rejected", "unknown"];

/// The request of one try: the built request with its timeout, the call key and the
/// approval. A tool made from an OpenAPI operation carries the key on writes only (a read's
/// `GET` is safe to repeat without one); a catalog tool's requests always carry it. A write
/// goes on a connection of its own, which asks the call's send gate once made.
fn request(
    req: &ToolRequest<'_>,
    built: &super::request::Built,
    approval: Option<&str>,
    (with_key, write): (bool, bool),
    timeout: Duration,
) -> Result<h1::Request, h1::Error> {
    let mut r = h1::Request::new(&built.method, &built.url, timeout)?;
    for (name, value) in &built.headers {
        r = r.header(name, value)?;
    }
    if with_key {
        r = r.header("Idempotency-Key", req.key)?;
    }
    if let Some(header) = approval {
        r = r.header(approval::HEADER, header)?;
    }
    if let Some(body) = &built.body {
        r = r
            .header("Content-Type", "application/json")?
            .body(body.clone().into());
    }
    if write || req.gate.is_some() {
        let gate = req.gate.map(|gate| {
            let gate = gate.clone();
            Arc::new(move || gate.ready()) as crate::net::Ready
        });
        r = r.write(gate);
    }
    Ok(r)
}

/// One try of a call: its result, and whether the failure (if it is one) is transient.
async fn send(
    spec: &ToolSpec,
    http: &HttpSpec,
    req: &ToolRequest<'_>,
    built: &super::request::Built,
    approval: Option<&str>,
    write: bool,
    timeout: Duration,
) -> (Value, Option<Transient>) {
    let with_key = http.api.is_none() || write;
    let sent = match request(req, built, approval, (with_key, write), timeout) {
        Ok(r) => h1::send(r, limits::TOOL_RESULT_BYTES_MAX).await,
        Err(e) => Err(e),
    };
    let resp = match sent {
        Ok(resp) => resp,
        Err(e) => return not_answered(e, write),
    };
    let status = resp.status;
    if (200..300).contains(&status) {
        tracing::debug!(tool = %spec.name, key = req.key, status, "tool answered");
    } else {
        tracing::warn!(tool = %spec.name, key = req.key, status, url = %built.url, "tool answered HTTP {status}");
    }
    let retry_after = crate::net::retry_after(&resp.headers);
    let location = resp
        .headers
        .get("location")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    // A body that cannot be read leaves a success unusable; an error answer is still told by
    // its status, with the reason in its detail.
    let text = match resp.body {
        Ok(t) => t,
        Err(e) if (200..300).contains(&status) => {
            return (outcome_unknown(write, "invalid_result", e), None);
        }
        Err(e) => e,
    };
    answer(status, &text, &location, retry_after, write)
}

/// What an HTTP answer means for the call: its result, and whether to try again later.
fn answer(
    status: u16,
    text: &str,
    location: &str,
    retry_after: Option<Duration>,
    write: bool,
) -> (Value, Option<Transient>) {
    match status {
        200..=299 => (success(text, write), None),
        // A redirect is never followed (see `net::agent`): where the call went is not known,
        // so for a write its outcome is not either.
        300..=399 => (
            outcome_unknown(
                write,
                &format!("http_{status}"),
                format!(
                    "the tool answered a redirect to {:?}; tool calls never follow redirects",
                    clip(location)
                ),
            ),
            None,
        ),
        // 409: the same key is still being processed (the Idempotency-Key draft's "request in
        // progress"); 408, 425, 429 and 5xx: try again later. Until then the outcome of a write
        // is not known.
        408 | 409 | 425 | 429 | 500..=599 => {
            let code = if status == 409 {
                "in_flight".to_string()
            } else {
                format!("http_{status}")
            };
            // The service's own code stays in the detail (a 409 may also be its conflict).
            let (theirs, detail) = error_of(text, status);
            let detail = if theirs.starts_with("http_") {
                detail
            } else {
                format!("{theirs}: {detail}")
            };
            (
                outcome_unknown(write, &code, detail),
                Some(Transient {
                    cause: code.clone(),
                    retry_after,
                    unsent: false,
                }),
            )
        }
        // Any other 4xx: the service refused the call, so nothing was done; the model sees why.
        400..=499 => {
            let (code, detail) = error_of(text, status);
            (
                json!({"status": "error", "code": code, "http_status": status, "detail": detail}),
                None,
            )
        }
        _ => (
            outcome_unknown(write, &format!("http_{status}"), clip(text)),
            None,
        ),
    }
}

/// The result of a 2xx answer: its JSON body. An object keeps its fields, with a `status` of
/// [`RESULT_STATUSES`] as it is (a service may still answer `needs_approval`), any other
/// `status` kept as `service_status` and `ok` put in its place; another JSON value is the
/// result's `value`; an empty body is `ok`; a body that is not JSON is an invalid result.
fn success(text: &str, write: bool) -> Value {
    if text.trim().is_empty() {
        return json!({"status": "ok"});
    }
    match limits::parse_json_input(text, "the result", limits::TOOL_RESULT_BYTES_MAX) {
        Ok(v) => as_result(v, write),
        Err(e) => outcome_unknown(
            write,
            "invalid_result",
            format!(
                "the tool answered 2xx, but the result needs a JSON body: {}",
                e.0
            ),
        ),
    }
}

/// A JSON value a service gave as a call's result, as the kernel reads results: an object
/// keeps its fields, with a `status` of [`RESULT_STATUSES`] as it is (for a read, only `ok`,
/// `error` and `needs_approval`: a read is never held as unknown, and its "rejected" is the
/// service's word), any other `status` kept as `service_status` and `ok` put in its place;
/// another value is the result's `value`.
pub fn as_result(v: Value, write: bool) -> Value {
    let Value::Object(mut m) = v else {
        return json!({"status": "ok", "value": v});
    };
    let own = m.get("status").and_then(Value::as_str).is_some_and(|s| {
        RESULT_STATUSES.contains(&s) && (write || matches!(s, "ok" | "error" | "needs_approval"))
    });
    if !own {
        if let Some(s) = m.remove("status") {
            m.insert("service_status".into(), s);
        }
        m.insert("status".into(), Value::String("ok".into()));
    }
    Value::Object(m)
}

/// The code and detail of an error answer: the body's `code` (or `error`, or an RFC 9457
/// problem's `type`), else `not_found` for a 404 and `http_STATUS` otherwise; its `detail`
/// (or `message`, an OAuth `error_description`, the first of `errors`, or `title`), else the
/// body itself, clipped.
fn error_of(text: &str, status: u16) -> (String, String) {
    let v = limits::parse_json(text, "an error body").unwrap_or(Value::Null);
    let e = v.get("error").filter(|e| e.is_object()).unwrap_or(&v);
    let word = |k: &str| {
        e.get(k)
            .and_then(Value::as_str)
            .filter(|s| !s.trim().is_empty())
    };
    let code = word("code")
        .or_else(|| v.get("error").and_then(Value::as_str))
        .or_else(|| {
            word("type")
                .filter(|t| *t != "about:blank")
                .and_then(|t| t.rsplit('/').find(|p| !p.is_empty()))
        })
        .map(|c| c.chars().take(64).collect::<String>())
        .unwrap_or_else(|| match status {
            404 => "not_found".into(),
            s => format!("http_{s}"),
        });
    // The first of a list of errors (JSON:API, GraphQL) says what went wrong.
    let first = e
        .get("errors")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(|f| {
            ["detail", "message", "title"]
                .iter()
                .find_map(|k| f.get(*k).and_then(Value::as_str))
        })
        .filter(|s| !s.trim().is_empty());
    let detail = word("detail")
        .or_else(|| word("message"))
        .or_else(|| word("error_description"))
        .or(first)
        .or_else(|| word("title"))
        .map(|d| limits::one_line(&clip(d)).into_owned())
        .unwrap_or_else(|| clip(text));
    (code, detail)
}

/// What a lookup endpoint says of a call key.
#[derive(Debug, Clone, PartialEq)]
pub enum Lookup {
    Applied(Value),
    NotApplied,
    /// No definite answer (unreachable, in flight, malformed): settle nothing.
    Unknown(String),
}

/// `GET {lookup_url}?key=K` (with the `headers` the tool's API asks of every request),
/// answered `{"applied": true, "result": {...}}` or `{"applied": false}`.
pub fn lookup(url: &str, key: &str, timeout: Duration, headers: &[(String, String)]) -> Lookup {
    let mut r = agent(timeout).get(url).query("key", key);
    for (name, value) in headers {
        r = r.header(name.as_str(), value.as_str());
    }
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
                // The result under the contract of a live answer (a write's): `status` is
                // optional, the service's own is kept as `service_status`.
                Some(true) => Lookup::Applied(match &v["result"] {
                    Value::Null => json!({"status": "ok"}),
                    r => as_result(r.clone(), true),
                }),
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

#[cfg(test)]
mod tests {
    use super::error_of;

    #[test]
    fn error_bodies_of_common_shapes_give_their_code_and_words() {
        let cases = [
            (
                r#"{"error": "invalid_grant", "error_description": "the code expired"}"#,
                ("invalid_grant", "the code expired"),
            ),
            (
                r#"{"errors": [{"code": "x", "detail": "title is too long"}]}"#,
                ("http_422", "title is too long"),
            ),
            (
                r#"{"errors": [{"message": "Field 'amount' is required"}]}"#,
                ("http_422", "Field 'amount' is required"),
            ),
            (
                r#"{"type": "https://e.x/problems/out-of-stock", "title": "Out of stock", "detail": "none left"}"#,
                ("out-of-stock", "none left"),
            ),
            (
                r#"{"error": {"code": "rate_limited", "message": "slow down"}}"#,
                ("rate_limited", "slow down"),
            ),
        ];
        for (body, (code, detail)) in cases {
            assert_eq!(
                error_of(body, 422),
                (code.to_string(), detail.to_string()),
                "{body}"
            );
        }
    }
}
