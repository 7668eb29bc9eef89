//! HTTP adapters on a blocking client (ureq), which fits the thread-per-task daemon: an
//! OpenAI-compatible Chat Completions model, tools called over HTTP with the call key in the
//! `Idempotency-Key` header, and the lookup that `worker reconcile --auto` asks.
//!
//! Every request is bounded: by the task's remaining active time (the kernel's timeout), by the
//! tool's own timeout, and by a retry cap with exponential backoff for 429 and 5xx.

use crate::limits;
use serde_json::{Map, Value, json};
use std::time::{Duration, Instant};

use crate::kernel::catalog::{Access, ToolSpec};
use crate::kernel::{
    Catalog, ModelError, ModelReply, ModelRequest, RawReply, ToolReply, ToolRequest, Usage,
};
use crate::model::Model;
use crate::tools::Tools;

/// Version of the system prompt in `data/`; recorded so a reply can be traced to its prompt.
pub const SYSTEM_PROMPT_VERSION: u32 = 1;
const SYSTEM_PROMPT: &str = include_str!("../data/system_prompt_v1.txt");

/// The system prompt for a catalog: the versioned text plus one line per tool.
pub fn system_prompt(catalog: &Catalog) -> String {
    let mut s = String::from(SYSTEM_PROMPT);
    for t in &catalog.tools {
        let args: Vec<String> = t
            .args
            .iter()
            .map(|(n, a)| {
                format!(
                    "{n}: {:?}{}",
                    a.kind,
                    if a.required { "" } else { " (optional)" }
                )
                .to_lowercase()
            })
            .collect();
        let kind = if t.access == Access::Write {
            "write"
        } else {
            "read"
        };
        s.push_str(&format!(
            "- {} ({kind}) args {{{}}}\n",
            t.name,
            args.join(", ")
        ));
    }
    s
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

/// Backoff before retry `n` (0-based): 100 ms, 200 ms, 400 ms, ... capped at 2 s.
fn backoff(n: u32) -> Duration {
    Duration::from_millis((100u64 << n.min(5)).min(2000))
}

/// An OpenAI-compatible Chat Completions model.
pub struct OpenAiModel {
    pub base_url: String,
    pub model: String,
    /// Read from the environment variable named in the profile, when the model is built.
    pub api_key: Option<String>,
    pub max_retries: u32,
    pub temperature: f64,
    pub system: String,
}

impl Model for OpenAiModel {
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        let start = Instant::now();
        let budget = Duration::from_millis(req.timeout_ms);
        let body = json!({
            "model": self.model,
            "messages": [
                {"role": "system", "content": self.system},
                {"role": "user", "content": req.view},
            ],
            "max_tokens": req.output_tokens_max,
            "temperature": self.temperature,
        });
        let url = format!("{}/chat/completions", self.base_url);
        let mut attempt = 0;
        let outcome = loop {
            let left = budget.saturating_sub(start.elapsed());
            if left.is_zero() {
                break Err(ModelError::Timeout);
            }
            let mut r = agent(left)
                .post(&url)
                .header("Content-Type", "application/json");
            if let Some(k) = &self.api_key {
                r = r.header("Authorization", &format!("Bearer {k}"));
            }
            match r.send(body.to_string()) {
                Ok(mut resp) => {
                    let status = resp.status().as_u16();
                    let text = match read_body(&mut resp, limits::REPLY_BYTES_MAX) {
                        Ok(t) => t,
                        Err(e) => break Err(ModelError::Failed(format!("HTTP {status}: {e}"))),
                    };
                    if status == 429 || status >= 500 {
                        let wait = backoff(attempt);
                        if attempt < self.max_retries && start.elapsed() + wait < budget {
                            std::thread::sleep(wait);
                            attempt += 1;
                            continue;
                        }
                        break Err(ModelError::Failed(format!(
                            "HTTP {status} after {} attempts",
                            attempt + 1
                        )));
                    }
                    if !(200..300).contains(&status) {
                        break Err(ModelError::Failed(format!(
                            "HTTP {status}: {}",
                            clip(&text)
                        )));
                    }
                    break parse_completion(&text);
                }
                Err(ureq::Error::Timeout(_)) => break Err(ModelError::Timeout),
                Err(e) => {
                    let wait = backoff(attempt);
                    if attempt < self.max_retries && start.elapsed() + wait < budget {
                        std::thread::sleep(wait);
                        attempt += 1;
                        continue;
                    }
                    break Err(ModelError::Failed(format!("request failed: {e}")));
                }
            }
        };
        let latency_ms = (start.elapsed().as_millis() as u64).min(req.timeout_ms.max(1));
        match outcome {
            Ok((raw, usage)) => ModelReply {
                outcome: Ok(raw),
                latency_ms,
                usage,
            },
            Err(e) => ModelReply {
                // A timeout used all the time that was left.
                latency_ms: if e == ModelError::Timeout {
                    req.timeout_ms
                } else {
                    latency_ms
                },
                outcome: Err(e),
                usage: None,
            },
        }
    }
}

/// A response body of at most `max_bytes`, as text.
fn read_body(
    resp: &mut ureq::http::Response<ureq::Body>,
    max_bytes: usize,
) -> Result<String, String> {
    resp.body_mut()
        .with_config()
        .limit(max_bytes as u64)
        .read_to_string()
        .map_err(|e| match e {
            ureq::Error::BodyExceedsLimit(_) => {
                format!("the response body is over the limit of {max_bytes} bytes")
            }
            e => format!("the response body could not be read: {e}"),
        })
}

fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}

/// Parses a Chat Completions response into the reply text and the provider's usage. A refusal
/// or a completion cut off at max_tokens is an error for the kernel, not a reply.
pub fn parse_completion(text: &str) -> Result<(RawReply, Option<Usage>), ModelError> {
    let v: Value = limits::parse_json_input(text, "the completion", limits::REPLY_BYTES_MAX)
        .map_err(|e| ModelError::Failed(e.0))?;
    let choice = &v["choices"][0];
    let msg = &choice["message"];
    if let Some(r) = msg["refusal"].as_str().filter(|r| !r.is_empty()) {
        return Err(ModelError::Failed(format!(
            "the model refused: {}",
            clip(r)
        )));
    }
    if choice["finish_reason"] == "length" {
        return Err(ModelError::Failed(
            "the completion was cut off at max_tokens".into(),
        ));
    }
    let content = msg["content"]
        .as_str()
        .ok_or_else(|| ModelError::Failed("completion has no choices[0].message.content".into()))?;
    let usage = match (
        v["usage"]["prompt_tokens"].as_u64(),
        v["usage"]["completion_tokens"].as_u64(),
    ) {
        (Some(i), Some(o)) => Some(Usage {
            input_tokens: i,
            output_tokens: o,
        }),
        _ => None,
    };
    Ok((RawReply::Text(strip_fences(content).to_string()), usage))
}

/// Models often wrap JSON in a Markdown fence; the kernel wants the JSON.
fn strip_fences(s: &str) -> &str {
    let t = s.trim();
    match t.strip_prefix("```") {
        Some(rest) => {
            let rest = rest.trim_start_matches("json");
            rest.strip_suffix("```").unwrap_or(rest).trim()
        }
        None => t,
    }
}

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
    if let Some(approval) = req.approval {
        // The approval recorded in the worker database travels with the call it covers.
        r = r.header("Tether-Approval", approval);
    }
    match r.send(body.to_string()) {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
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
    let v: Value = serde_json::from_str(text).map_err(|e| format!("body is not JSON: {e}"))?;
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
