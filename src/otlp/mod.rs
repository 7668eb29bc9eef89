//! A task's spans for OpenTelemetry: one trace per task, with the GenAI semantic conventions.
//! [`spans_of`] turns stored spans into [`OtlpSpan`]s; `json` writes them as OTLP/JSON (the
//! form of `worker trace --otlp`, for a collector's file receiver), `proto` as OTLP protobuf
//! (what `export` sends to an OTLP/HTTP endpoint while the daemon runs).
//!
//! - **Ids** are derived from the database id and the task (trace) and the span's number (span),
//!   so `t1` of two databases never share a trace, and a span exported twice keeps its ids.
//! - **One root** per task, `invoke_agent tether` ([`root_of`]): it spans the whole task, from
//!   its creation to its last span, with the task's final status, budget figures and stop
//!   reason. Each run's own `task` span (a resumed run adds a `resume` span and a new `task`
//!   span) is its child, so a resumed task is one tree. Like any SDK's root span it is exported
//!   when it ends: when the task finishes; until then a receiver shows the runs without it.
//! - **Kinds**: model calls are `chat {model}` CLIENT spans (`gen_ai.operation.name = chat`,
//!   the provider from the profile's endpoint, the requested model, `max_tokens`,
//!   `temperature`, token usage); tool calls are `execute_tool {tool}` INTERNAL spans
//!   (`gen_ai.tool.name`, `gen_ai.tool.call.id` = the call key, `gen_ai.tool.type`, and for MCP
//!   tools `mcp.method.name` and the server); the provider's response id, model and finish
//!   reasons when it answered. OpenInference's span kinds
//!   are set beside them, for receivers (Phoenix) that read those.
//! - **Errors**: status ERROR with `error.type` and a message (a failed model call's message
//!   comes from its recorded reply).
//!
//! Span times are the task's creation time plus the active time at which each span started and
//! ended: the kernel's clock is active time, so waits (for a person, for a worker) are not shown.

pub mod export;
pub mod json;
pub mod proto;

use sha2::{Digest, Sha256};

use crate::kernel::{Span, SpanKind};
use crate::model::HttpProfile;
use crate::model::{ModelProfile, RecordedOutcome, RecordedReply};
use crate::store::TaskRecord;

/// An attribute value.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Str(String),
    Int(i64),
    Double(f64),
    Bool(bool),
    Strs(Vec<String>),
}

/// OTLP span kinds used here.
pub const KIND_INTERNAL: i32 = 1;
pub const KIND_CLIENT: i32 = 3;
/// OTLP status codes.
pub const STATUS_UNSET: i32 = 0;
pub const STATUS_OK: i32 = 1;
pub const STATUS_ERROR: i32 = 2;

/// One span, ready for either encoding.
#[derive(Clone, Debug, PartialEq)]
pub struct OtlpSpan {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub parent_span_id: Option<[u8; 8]>,
    pub name: String,
    pub kind: i32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub attributes: Vec<(String, Attr)>,
    pub status_code: i32,
    pub status_message: String,
}

fn digest_bytes<const N: usize>(text: &str) -> [u8; N] {
    let d = Sha256::digest(text.as_bytes());
    let mut out = [0u8; N];
    out.copy_from_slice(&d[..N]);
    out
}

/// The trace id of `task` of database `db_id`.
pub fn trace_id(db_id: &str, task: &str) -> [u8; 16] {
    digest_bytes(&format!("tether-trace:{db_id}:{task}"))
}

pub use crate::store::outbox::ROOT;

/// The span id of span `span` of `task` of database `db_id` ([`ROOT`]: the task's root).
pub fn span_id(db_id: &str, task: &str, span: u32) -> [u8; 8] {
    digest_bytes(&format!("tether-span:{db_id}:{task}:{span}"))
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The model's name and the GenAI provider name: from the profile, and for an
/// OpenAI-compatible endpoint, from its host (a local server is not OpenAI).
fn model_of(p: &ModelProfile, http: Option<&HttpProfile>) -> (String, String) {
    if let Some(h) = http {
        let provider = match h.api {
            crate::model::profile::Api::Anthropic => "anthropic".to_string(),
            crate::model::profile::Api::OpenAi => provider_of(&h.base_url),
        };
        return (h.model.clone(), provider);
    }
    match p {
        ModelProfile::OpenAi {
            model, base_url, ..
        } => (model.clone(), provider_of(base_url)),
        ModelProfile::Policy { .. } => ("policy".into(), "tether.scripted".into()),
        ModelProfile::SameCall { .. } => ("same_call".into(), "tether.scripted".into()),
        ModelProfile::NewIds { .. } => ("new_ids".into(), "tether.scripted".into()),
        ModelProfile::SearchLoop { .. } => ("search_loop".into(), "tether.scripted".into()),
        ModelProfile::Script { .. } => ("script".into(), "tether.scripted".into()),
        // A profile the reader's config did not resolve: its name, the provider unknown.
        ModelProfile::Profile { name } => (name.clone(), "unknown".into()),
    }
}

/// The GenAI semantic conventions' provider name for an OpenAI-compatible base URL.
pub fn provider_of(base_url: &str) -> String {
    let host = base_url
        .split("://")
        .nth(1)
        .unwrap_or(base_url)
        .split(['/', '?'])
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    let name = host.split(':').next().unwrap_or("");
    let known = [
        ("api.openai.com", "openai"),
        (".openai.azure.com", "azure.ai.openai"),
        ("api.anthropic.com", "anthropic"),
        ("api.groq.com", "groq"),
        ("api.mistral.ai", "mistral_ai"),
        ("api.deepseek.com", "deepseek"),
        ("api.x.ai", "x_ai"),
        ("generativelanguage.googleapis.com", "gcp.gemini"),
        ("api.perplexity.ai", "perplexity"),
    ];
    for (suffix, provider) in known {
        if name == suffix.trim_start_matches('.') || name.ends_with(suffix) {
            return provider.into();
        }
    }
    if host.ends_with(":11434") {
        return "ollama".into();
    }
    // Anything else speaks OpenAI's API without being OpenAI: say which server it is.
    format!("openai_compatible:{host}")
}

fn s(v: impl Into<String>) -> Attr {
    Attr::Str(v.into())
}

/// Whether a span's status is a success, a pause, or an error.
fn status_of(status: &str) -> i32 {
    match status {
        "ok" | "done" => STATUS_OK,
        "open" | "needs_approval" | "needs_answer" => STATUS_UNSET,
        _ => STATUS_ERROR,
    }
}

/// The OTLP spans of task `rec` of database `db_id` whose ids `keep` selects, from its stored
/// spans and recorded replies (the provider's response and the messages of failed model
/// calls).
pub fn spans_of(
    db_id: &str,
    rec: &TaskRecord,
    spans: &[Span],
    replies: &[RecordedReply],
    http: Option<&HttpProfile>,
    keep: impl Fn(u32) -> bool,
) -> Vec<OtlpSpan> {
    // A task's ids are in its call-key namespace (the database id for older tasks), so a
    // task made in a restored copy never shares a trace with one of the lost timeline.
    let db_id = rec.key_namespace(db_id);
    let trace = trace_id(db_id, &rec.id);
    let base_ns = rec.created_at_ms.saturating_mul(1_000_000);
    let (model, provider) = model_of(&rec.model, http);
    let temperature = match (http, &rec.model) {
        (Some(h), _) => h.temperature,
        (None, ModelProfile::OpenAi { temperature, .. }) => Some(*temperature),
        _ => None,
    };
    let run = Run {
        rec,
        replies,
        model,
        provider,
        temperature,
        // The step number of each `step N` span, for its model call's recorded reply.
        steps: spans
            .iter()
            .filter_map(|p| Some((p.id, p.name.strip_prefix("step ")?.parse().ok()?)))
            .collect(),
    };
    spans
        .iter()
        .filter(|sp| keep(sp.id))
        .map(|sp| {
            let mut a: Vec<(String, Attr)> = vec![
                ("tether.task_id".into(), s(&rec.id)),
                ("tether.span.kind".into(), s(sp.kind.as_str())),
                ("tether.status".into(), s(&*sp.status)),
            ];
            let (name, kind, message) = match sp.kind {
                SpanKind::Model => run.model_span(sp, &mut a),
                SpanKind::Tool => run.tool_span(sp, &mut a),
                _ => {
                    a.push(("openinference.span.kind".into(), s("CHAIN")));
                    let message = format!("{} ended {}", sp.name, sp.status);
                    (sp.name.to_string(), KIND_INTERNAL, message)
                }
            };
            let status_code = status_of(&sp.status);
            if status_code == STATUS_ERROR {
                a.push(("error.type".into(), s(&*sp.status)));
            }
            // Each run's task span hangs under the task's root.
            let parent = sp.parent.unwrap_or(ROOT);
            OtlpSpan {
                trace_id: trace,
                span_id: span_id(db_id, &rec.id, sp.id),
                parent_span_id: Some(span_id(db_id, &rec.id, parent)),
                name,
                kind,
                start_ns: base_ns.saturating_add(sp.t0_ms.saturating_mul(1_000_000)),
                end_ns: base_ns
                    .saturating_add(sp.t1_ms.unwrap_or(sp.t0_ms).saturating_mul(1_000_000)),
                attributes: a,
                status_code,
                status_message: if status_code == STATUS_ERROR {
                    message
                } else {
                    String::new()
                },
            }
        })
        .collect()
}

/// What every span of one task's export shares: the task, its recorded replies and the
/// model it ran on.
struct Run<'a> {
    rec: &'a TaskRecord,
    replies: &'a [RecordedReply],
    model: String,
    provider: String,
    temperature: Option<f64>,
    steps: std::collections::HashMap<u32, u32>,
}

impl Run<'_> {
    /// A model call's attributes (GenAI and OpenInference conventions); its name, kind and
    /// the message shown if it failed.
    fn model_span(&self, sp: &Span, a: &mut Vec<(String, Attr)>) -> (String, i32, String) {
        let model = &self.model;
        a.push(("gen_ai.operation.name".into(), s("chat")));
        a.push(("gen_ai.provider.name".into(), s(&self.provider)));
        a.push(("gen_ai.request.model".into(), s(model)));
        a.push((
            "gen_ai.request.max_tokens".into(),
            Attr::Int(i64::from(self.rec.budget.output_tokens_max)),
        ));
        if let Some(t) = self.temperature {
            a.push(("gen_ai.request.temperature".into(), Attr::Double(t)));
        }
        if let Some(t) = sp.tin {
            a.push(("gen_ai.usage.input_tokens".into(), Attr::Int(t as i64)));
        }
        if let Some(t) = sp.tout {
            a.push(("gen_ai.usage.output_tokens".into(), Attr::Int(t as i64)));
        }
        a.push(("openinference.span.kind".into(), s("LLM")));
        a.push(("llm.model_name".into(), s(model)));
        let step = sp.parent.and_then(|p| self.steps.get(&p).copied());
        let reply = step.and_then(|n| self.replies.iter().find(|r| r.step == n));
        if let Some(r) = reply.and_then(|r| r.response.as_ref()) {
            if let Some(id) = &r.id {
                a.push(("gen_ai.response.id".into(), s(id)));
            }
            if let Some(m) = &r.model {
                a.push(("gen_ai.response.model".into(), s(m)));
            }
            if !r.finish_reasons.is_empty() {
                a.push((
                    "gen_ai.response.finish_reasons".into(),
                    Attr::Strs(r.finish_reasons.clone()),
                ));
            }
        }
        let message = match reply.map(|r| &r.outcome) {
            Some(
                RecordedOutcome::Failed(m)
                | RecordedOutcome::Refused(m)
                | RecordedOutcome::Fatal(m),
            ) => m.clone(),
            Some(RecordedOutcome::Timeout) => "no answer within the remaining active time".into(),
            _ => format!("model call: {}", sp.status),
        };
        (format!("chat {model}"), KIND_CLIENT, message)
    }

    /// A tool call's attributes; its name, kind and the message shown if it failed.
    fn tool_span(&self, sp: &Span, a: &mut Vec<(String, Attr)>) -> (String, i32, String) {
        a.push(("gen_ai.operation.name".into(), s("execute_tool")));
        a.push(("gen_ai.tool.name".into(), s(&*sp.name)));
        if let Some(k) = &sp.key {
            a.push(("gen_ai.tool.call.id".into(), s(k)));
            a.push(("tether.call_key".into(), s(k)));
        }
        if let Some(r) = sp.result_tokens {
            a.push(("tether.result_tokens".into(), Attr::Int(r as i64)));
        }
        let mcp = (self.rec.catalog.as_ref())
            .and_then(|c| c.get(&sp.name))
            .and_then(|t| t.mcp.as_ref());
        if let Some(m) = mcp {
            a.push(("gen_ai.tool.type".into(), s("extension")));
            a.push(("mcp.method.name".into(), s("tools/call")));
            a.push(("tether.mcp.server".into(), s(&m.server)));
        } else {
            a.push(("gen_ai.tool.type".into(), s("function")));
        }
        a.push(("openinference.span.kind".into(), s("TOOL")));
        a.push(("tool.name".into(), s(&*sp.name)));
        let message = format!("the tool call ended {}", sp.status);
        (format!("execute_tool {}", sp.name), KIND_INTERNAL, message)
    }
}

/// The task's root span, `invoke_agent tether`: from the task's creation to the end of its last
/// span, with its budget figures, stop reason and runs. Its status is the task's: OK when it
/// finished `done`, an error named by the stop reason when it finished otherwise, unset while
/// it waits (suspended, held) or runs.
pub fn root_of(db_id: &str, rec: &TaskRecord, spans: &[Span]) -> OtlpSpan {
    let db_id = rec.key_namespace(db_id);
    let base_ns = rec.created_at_ms.saturating_mul(1_000_000);
    let end_ms = spans
        .iter()
        .map(|sp| sp.t1_ms.unwrap_or(sp.t0_ms))
        .max()
        .unwrap_or(0);
    let mut a: Vec<(String, Attr)> = vec![
        ("tether.task_id".into(), s(&rec.id)),
        ("tether.span.kind".into(), s("task")),
        ("tether.status".into(), s(rec.status.as_str())),
        ("tether.runs".into(), Attr::Int(i64::from(rec.runs))),
        ("gen_ai.operation.name".into(), s("invoke_agent")),
        ("gen_ai.agent.name".into(), s("tether")),
        ("openinference.span.kind".into(), s("AGENT")),
    ];
    let b = &rec.budget;
    let st = &rec.state;
    for (k, used, limit) in [
        ("steps", u64::from(st.step), u64::from(b.steps_max)),
        (
            "tool_calls",
            u64::from(st.tool_calls),
            u64::from(b.tool_calls_max),
        ),
        ("tokens", st.tokens, b.tokens_max),
        ("active_ms", st.elapsed_ms, b.deadline_ms),
    ] {
        a.push((format!("tether.budget.{k}.used"), Attr::Int(used as i64)));
        a.push((format!("tether.budget.{k}.limit"), Attr::Int(limit as i64)));
    }
    let finished = rec.status == crate::store::QueueStatus::Finished;
    let (status_code, status_message) = match st.stop {
        Some(stop) => {
            a.push(("tether.stop_reason".into(), s(stop.as_str())));
            if !finished {
                (STATUS_UNSET, String::new())
            } else if stop == crate::kernel::StopReason::Done {
                (STATUS_OK, String::new())
            } else {
                a.push(("error.type".into(), s(stop.as_str())));
                (STATUS_ERROR, format!("the task stopped: {}", stop.as_str()))
            }
        }
        None => (STATUS_UNSET, String::new()),
    };
    OtlpSpan {
        trace_id: trace_id(db_id, &rec.id),
        span_id: span_id(db_id, &rec.id, ROOT),
        parent_span_id: None,
        name: "invoke_agent tether".into(),
        kind: KIND_INTERNAL,
        start_ns: base_ns,
        end_ns: base_ns.saturating_add(end_ms.saturating_mul(1_000_000)),
        attributes: a,
        status_code,
        status_message,
    }
}

/// A task's whole trace: its root, then its stored spans (what `worker trace --otlp` writes).
pub fn trace_of(
    db_id: &str,
    rec: &TaskRecord,
    spans: &[Span],
    replies: &[RecordedReply],
    http: Option<&HttpProfile>,
) -> Vec<OtlpSpan> {
    let mut out = vec![root_of(db_id, rec, spans)];
    out.extend(spans_of(db_id, rec, spans, replies, http, |_| true));
    out
}

/// The resource attributes of everything this process exports.
pub fn resource(db_id: &str) -> Vec<(String, Attr)> {
    vec![
        ("service.name".into(), s("tether-worker")),
        ("service.version".into(), s(env!("CARGO_PKG_VERSION"))),
        ("tether.db_id".into(), s(db_id)),
    ]
}
