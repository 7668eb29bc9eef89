//! An OpenAI-compatible Chat Completions model over HTTP: the versioned system prompt, retries
//! with backoff for 429 and 5xx within the task's remaining active time, the provider's usage.
//! Every request is bounded by the kernel's timeout and a retry cap.

use serde_json::{Value, json};
use std::time::{Duration, Instant};

use crate::kernel::catalog::Access;
use crate::kernel::{Catalog, ModelError, ModelReply, ModelRequest, RawReply, ResponseInfo, Usage};
use crate::limits;
use crate::model::Model;
use crate::net::{agent, backoff, clip, read_body};

/// Version of the system prompt in `data/`; recorded so a reply can be traced to its prompt.
pub const SYSTEM_PROMPT_VERSION: u32 = 1;
const SYSTEM_PROMPT: &str = include_str!("../../data/system_prompt_v1.txt");

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
                            tracing::warn!(model = %self.model, status, attempt = attempt + 1, wait_ms = wait.as_millis() as u64, "model answered HTTP {status}; retrying");
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
                        tracing::warn!(model = %self.model, error = %e, attempt = attempt + 1, wait_ms = wait.as_millis() as u64, "model request failed; retrying");
                        std::thread::sleep(wait);
                        attempt += 1;
                        continue;
                    }
                    break Err(ModelError::Failed(format!("request failed: {e}")));
                }
            }
        };
        let latency_ms = (start.elapsed().as_millis() as u64).min(req.timeout_ms.max(1));
        let (outcome, usage, response) = match outcome {
            Ok(c) => (c.outcome, c.usage, Some(c.response)),
            Err(e) => (Err(e), None, None),
        };
        ModelReply {
            // A timeout used all the time that was left.
            latency_ms: if outcome == Err(ModelError::Timeout) {
                req.timeout_ms
            } else {
                latency_ms
            },
            outcome,
            usage,
            response,
        }
    }
}

/// A Chat Completions response, read: the reply for the kernel (or why there is none), the
/// provider's usage, and what it said of the response (id, model, finish reasons), kept for
/// traces even when the reply is refused.
#[derive(Debug, PartialEq)]
pub struct Completion {
    pub outcome: Result<RawReply, ModelError>,
    pub usage: Option<Usage>,
    pub response: ResponseInfo,
}

/// Parses a Chat Completions response. A refusal or a completion cut off at max_tokens is an
/// error for the kernel, not a reply; a body that is not a completion is an error.
pub fn parse_completion(text: &str) -> Result<Completion, ModelError> {
    let v: Value = limits::parse_json_input(text, "the completion", limits::REPLY_BYTES_MAX)
        .map_err(|e| ModelError::Failed(e.0))?;
    let text_of = |x: &Value| x.as_str().map(|s| clip(s).to_string());
    let response = ResponseInfo {
        id: text_of(&v["id"]),
        model: text_of(&v["model"]),
        finish_reasons: v["choices"]
            .as_array()
            .map(|cs| {
                cs.iter()
                    .filter_map(|c| text_of(&c["finish_reason"]))
                    .collect()
            })
            .unwrap_or_default(),
    };
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
    let choice = &v["choices"][0];
    let msg = &choice["message"];
    let outcome = if let Some(r) = msg["refusal"].as_str().filter(|r| !r.is_empty()) {
        Err(ModelError::Failed(format!(
            "the model refused: {}",
            clip(r)
        )))
    } else if choice["finish_reason"] == "length" {
        Err(ModelError::Failed(
            "the completion was cut off at max_tokens".into(),
        ))
    } else {
        match msg["content"].as_str() {
            Some(content) => Ok(RawReply::Text(strip_fences(content).to_string())),
            None => Err(ModelError::Failed(
                "completion has no choices[0].message.content".into(),
            )),
        }
    };
    Ok(Completion {
        outcome,
        usage,
        response,
    })
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
