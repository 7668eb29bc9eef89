//! A model behind a provider's HTTP API: the send loop every adapter shares. It bounds each
//! request by the task's remaining active time; retries a 408, 409, 429, 5xx or 529 answer
//! and a failed connection (honouring `Retry-After` and `retry-after-ms`, otherwise a
//! jittered exponential backoff) while the time and the profile's retry count allow; and
//! maps the answers that asking again cannot fix (a key refused, a model that does not exist,
//! a request longer than the context window, a parameter the model refuses) to
//! [`ModelError::Fatal`], naming the cause. The adapters ([`super::openai`],
//! [`super::anthropic`]) build the request body and read the response.

use serde_json::Value;
use std::time::{Duration, Instant};

use super::profile::{Api, HttpProfile};
use super::prompt::Prompt;
use crate::kernel::{
    Catalog, InputStyle, ModelError, ModelReply, ModelRequest, RawReply, ResponseInfo, Turn, Usage,
};
use crate::limits;
use crate::model::Model;
use crate::net::clip;
use crate::net::h1;

/// A provider's response, read by its adapter.
#[derive(Debug, PartialEq)]
pub struct Parsed {
    /// The move for the kernel, or why there is none.
    pub outcome: Result<RawReply, ModelError>,
    /// What the provider billed; it counts even when the reply is no move.
    pub usage: Option<Usage>,
    pub response: ResponseInfo,
    /// The reply in the provider's protocol, for the next request.
    pub turn: Option<Turn>,
}

impl Parsed {
    /// A response read: its turn is kept for the next request when it has text or calls.
    pub fn new(
        outcome: Result<RawReply, ModelError>,
        usage: Option<Usage>,
        response: ResponseInfo,
        turn: Turn,
    ) -> Parsed {
        let keep = !turn.calls.is_empty() || turn.text.is_some();
        Parsed {
            outcome,
            usage,
            response,
            turn: keep.then_some(turn),
        }
    }
}

/// The longest wait between two attempts, whatever a `Retry-After` asks.
const WAIT_MAX: Duration = Duration::from_secs(60);

/// How long a profile with a shared rate limit waits after a `429` without `Retry-After`.
const BUSY_WAIT: Duration = Duration::from_secs(1);

/// A model profile with what its task's model is told, ready to send.
pub struct HttpModel {
    pub profile: HttpProfile,
    pub prompt: Prompt,
    /// From the profile's variable when the model was built; `Err` says why there is none
    /// (every call then stops the task with that message, and nothing is sent).
    pub api_key: Result<Option<String>, String>,
    /// A `429` the provider answered, with how long it asked to wait in ms ([`NOT_BUSY`]:
    /// none), when the profile has a shared rate limit: the driver waits instead of this model.
    pub busy: std::sync::atomic::AtomicU64,
}

/// [`HttpModel::busy`] when the provider asked for no wait.
pub const NOT_BUSY: u64 = u64::MAX;

/// The model of a task whose tools are `catalog`, on `profile`, with the task's own
/// instructions.
pub fn build(
    profile: &HttpProfile,
    catalog: &Catalog,
    instructions: Option<&str>,
) -> Box<dyn Model> {
    let prompt = Prompt::new(
        catalog,
        profile.tool_calling,
        profile.final_answer,
        profile.instructions.as_deref(),
        instructions,
    );
    Box::new(HttpModel {
        profile: profile.clone(),
        prompt,
        api_key: profile.api_key(),
        busy: std::sync::atomic::AtomicU64::new(NOT_BUSY),
    })
}

impl HttpModel {
    fn url(&self) -> String {
        match self.profile.api {
            Api::OpenAi => format!("{}/chat/completions", self.profile.base_url),
            Api::Anthropic => format!("{}/messages", self.profile.base_url),
        }
    }

    /// The request body for `req`.
    pub fn body(&self, req: &ModelRequest<'_>) -> Value {
        match self.profile.api {
            Api::OpenAi => super::openai::request(&self.profile, &self.prompt, req),
            Api::Anthropic => super::anthropic::request(&self.profile, &self.prompt, req),
        }
    }

    /// The body as sent: one copy of its exact size, shared by every attempt (a waiting task
    /// holds it).
    fn body_bytes(&self, req: &ModelRequest<'_>) -> bytes::Bytes {
        bytes::Bytes::from(self.body(req).to_string().into_bytes().into_boxed_slice())
    }

    fn parse(&self, step: u32, text: &str) -> Result<Parsed, ModelError> {
        match self.profile.api {
            Api::OpenAi => super::openai::parse(&self.prompt, step, text),
            Api::Anthropic => super::anthropic::parse(&self.prompt, step, text),
        }
    }

    /// The exchange with the provider for `req`: the request sent, tried again as the
    /// module says, and its answer read. Waits (the request, the backoffs) do not hold a
    /// thread.
    async fn send(&self, req: &ModelRequest<'_>, key: Option<&str>) -> Result<Parsed, ModelError> {
        let start = Instant::now();
        let budget = Duration::from_millis(req.timeout_ms);
        let body = self.body_bytes(req);
        let url = self.url();
        let mut attempt = 0;
        loop {
            let left = budget.saturating_sub(start.elapsed());
            if left.is_zero() {
                return Err(ModelError::Timeout);
            }
            let sent = match self.request(&url, left, key) {
                Ok(r) => h1::send(r.body(body.clone()), limits::REPLY_BYTES_MAX).await,
                Err(e) => Err(e),
            };
            let (status, wait_asked, text) = match sent {
                Ok(resp) => answered(resp, start.elapsed() >= budget)?,
                Err(h1::Error::Timeout) => return Err(ModelError::Timeout),
                Err(h1::Error::Invalid(e)) => {
                    return Err(ModelError::Fatal(format!(
                        "the request to {url} cannot be sent: {e}"
                    )));
                }
                Err(e) => {
                    let wait = jittered(attempt);
                    if attempt < self.profile.max_retries && start.elapsed() + wait < budget {
                        tracing::warn!(model = %self.profile.model, error = %e, attempt = attempt + 1, wait_ms = wait.as_millis() as u64, "model request failed; retrying");
                        tokio::time::sleep(wait).await;
                        attempt += 1;
                        continue;
                    }
                    return Err(ModelError::Failed(format!(
                        "the request to {url} failed after {} attempts: {e}",
                        attempt + 1,
                    )));
                }
            };
            if (200..300).contains(&status) {
                return self.parse(req.step, &text);
            }
            let (message, code) = error_of(&text);
            if status == 429 && self.profile.rate_limit.is_some() {
                // The whole profile slows down: its driver records the wait for every
                // daemon and hands this task's place back meanwhile.
                let wait = wait_asked.unwrap_or(BUSY_WAIT).min(WAIT_MAX);
                self.busy
                    .store(wait.as_millis() as u64, std::sync::atomic::Ordering::SeqCst);
                return Err(gave_up(status, attempt + 1, None, message));
            }
            if matches!(status, 408 | 409 | 429 | 500..=599) {
                let wait = wait_asked
                    .unwrap_or_else(|| jittered(attempt))
                    .min(WAIT_MAX);
                let fits = start.elapsed() + wait < budget;
                if attempt < self.profile.max_retries && fits {
                    tracing::warn!(model = %self.profile.model, status, attempt = attempt + 1, wait_ms = wait.as_millis() as u64, "model answered HTTP {status}; retrying");
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                    continue;
                }
                let waited = (!fits).then_some(wait);
                return Err(gave_up(status, attempt + 1, waited, message));
            }
            let detail = message.unwrap_or_else(|| clip(&text));
            return Err(ModelError::Fatal(self.fatal(
                status,
                code.as_deref(),
                &detail,
            )));
        }
    }

    /// A POST of the provider's API to `url`, with its key and version headers.
    fn request(
        &self,
        url: &str,
        left: Duration,
        key: Option<&str>,
    ) -> Result<h1::Request, h1::Error> {
        let mut r =
            h1::Request::new("POST", url, left)?.header("Content-Type", "application/json")?;
        match (self.profile.api, key) {
            (Api::OpenAi, Some(k)) => r = r.header("Authorization", &format!("Bearer {k}"))?,
            (Api::Anthropic, Some(k)) => r = r.header("x-api-key", k)?,
            (_, None) => {}
        }
        if self.profile.api == Api::Anthropic {
            r = r.header("anthropic-version", super::anthropic::VERSION)?;
        }
        Ok(r)
    }

    /// The reply to `req`: the exchange, timed, or why nothing was sent.
    async fn reply(&self, req: &ModelRequest<'_>) -> ModelReply {
        let start = Instant::now();
        let sent = match &self.api_key {
            Err(why) => Err(ModelError::Fatal(format!(
                "{why}: the model profile's API key is missing, so nothing was sent"
            ))),
            Ok(key) => self.send(req, key.as_deref()).await,
        };
        let latency_ms = (start.elapsed().as_millis() as u64).min(req.timeout_ms.max(1));
        match sent {
            Ok(p) => ModelReply {
                outcome: p.outcome,
                latency_ms,
                usage: p.usage,
                response: Some(p.response),
                turn: p.turn,
            },
            // A timeout used all the time that was left.
            Err(ModelError::Timeout) => ModelReply::failed(ModelError::Timeout, req.timeout_ms),
            Err(e) => ModelReply::failed(e, latency_ms),
        }
    }

    /// What a 4xx answer that asking again cannot fix means, for a person.
    fn fatal(&self, status: u16, code: Option<&str>, detail: &str) -> String {
        let p = &self.profile;
        if status == 401 || status == 403 {
            return match &p.api_key_env {
                Some(var) => format!(
                    "HTTP {status}: the provider refused the API key from the variable {var} ({detail}); set {var} to a valid key for {}",
                    p.base_url
                ),
                None => format!(
                    "HTTP {status}: the provider wants an API key ({detail}); set api_key_env in the model profile to the variable that holds it"
                ),
            };
        }
        let lower = detail.to_ascii_lowercase();
        let context = code == Some("context_length_exceeded")
            || lower.contains("context length")
            || lower.contains("context window")
            || lower.contains("maximum context")
            || lower.contains("prompt is too long")
            || lower.contains("too many tokens");
        if context {
            return format!(
                "HTTP {status}: the request is longer than the context window of {} ({detail}); shorten what the model is given (the instructions, the goal, the catalog's descriptions), lower the task's budget of output tokens, or choose a model with a larger window",
                p.model
            );
        }
        if status == 404 {
            return format!(
                "HTTP 404 from {}: {detail} (check the profile's base_url and that model {:?} exists there)",
                self.url(),
                p.model
            );
        }
        format!(
            "HTTP {status}: the provider refused the request as configured ({detail}); check the model profile (see docs/models.md: max_tokens_param, temperature, tool_calling)"
        )
    }
}

impl Model for HttpModel {
    /// The exchange on a runtime of its own, for a caller outside the executor.
    fn next(&mut self, req: &ModelRequest<'_>) -> ModelReply {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(self.reply(req)),
            Err(e) => ModelReply::failed(
                ModelError::Failed(format!("cannot start an HTTP runtime: {e}")),
                0,
            ),
        }
    }

    fn ask<'a>(&'a mut self, req: &'a ModelRequest<'a>) -> super::Asking<'a> {
        Box::pin(self.reply(req))
    }

    fn input(&self) -> InputStyle {
        InputStyle::Messages {
            overhead_chars: self.prompt.overhead_chars(),
        }
    }

    fn prompt_id(&self) -> Option<String> {
        Some(self.prompt.id.clone())
    }

    fn busy(&mut self) -> Option<u64> {
        match self
            .busy
            .swap(NOT_BUSY, std::sync::atomic::Ordering::SeqCst)
        {
            NOT_BUSY => None,
            ms => Some(ms),
        }
    }
}

/// The backoff before retry `n` (0-based): 0.5 s doubled each time, at most 8 s, less up to a
/// quarter at random so that tasks that failed together do not retry together.
/// A retryable answer given up on after `attempts`; `waited` is the next wait when it
/// would have outlasted the task's remaining active time.
fn gave_up(
    status: u16,
    attempts: u32,
    waited: Option<Duration>,
    message: Option<String>,
) -> ModelError {
    let what = match status {
        429 => "rate limited",
        529 => "overloaded",
        408 => "request timeout",
        409 => "conflict",
        _ => "server error",
    };
    let why = match waited {
        None => format!("after {attempts} attempts"),
        Some(wait) => format!(
            "after {attempts} attempts; the next wait ({} ms) would outlast the task's remaining active time",
            wait.as_millis()
        ),
    };
    ModelError::Failed(format!(
        "HTTP {status} ({what}) {why}{}",
        message.map(|m| format!(": {m}")).unwrap_or_default()
    ))
}

pub fn jittered(n: u32) -> Duration {
    let base = (500u64 << n.min(4)).min(8_000);
    Duration::from_millis(base - crate::net::jitter(base / 4))
}

/// The message and code of a provider's error body: `{"error": {"message", "code" | "type"}}`
/// (OpenAI, Anthropic and the servers that copy them), clipped to one line.
pub fn error_of(text: &str) -> (Option<String>, Option<String>) {
    let Ok(v) = limits::parse_json(text, "an error body") else {
        return (None, None);
    };
    let e = &v["error"];
    let message = e["message"]
        .as_str()
        .or_else(|| e.as_str())
        .or_else(|| v["message"].as_str())
        .map(|m| limits::one_line(&clip(m)).into_owned());
    let code = e["code"]
        .as_str()
        .or_else(|| e["type"].as_str())
        .map(str::to_string);
    (message, code)
}

/// An answer's status, the wait it asks for and its body; a body that could not be read
/// fails the request (as a timeout when the request's time is used up).
fn answered(
    resp: h1::Response,
    timed_out: bool,
) -> Result<(u16, Option<Duration>, String), ModelError> {
    let wait = crate::net::retry_after(&resp.headers);
    match resp.body {
        Ok(text) => Ok((resp.status, wait, text)),
        Err(_) if timed_out => Err(ModelError::Timeout),
        Err(e) => Err(ModelError::Failed(format!("HTTP {}: {e}", resp.status))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backoff_grows_is_capped_and_jittered_downwards() {
        for n in 0..10 {
            let base = (500u64 << n.min(4)).min(8_000);
            let d = jittered(n).as_millis() as u64;
            assert!(d <= base && d >= base - base / 4, "{n}: {d}");
        }
    }

    #[test]
    fn an_error_body_gives_its_message_and_code() {
        let (m, c) = error_of(
            r#"{"error": {"message": "This model's maximum context length is 8192 tokens", "type": "invalid_request_error", "code": "context_length_exceeded"}}"#,
        );
        assert_eq!(
            m.as_deref(),
            Some("This model's maximum context length is 8192 tokens")
        );
        assert_eq!(c.as_deref(), Some("context_length_exceeded"));
        let (m, c) = error_of(
            r#"{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}"#,
        );
        assert_eq!(m.as_deref(), Some("Overloaded"));
        assert_eq!(c.as_deref(), Some("overloaded_error"));
        assert_eq!(error_of("<html>"), (None, None));
    }
}
