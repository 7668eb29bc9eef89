//! A task's spans as OTLP/JSON (one `ExportTraceServiceRequest` per line, the format of an
//! OpenTelemetry collector's file receiver), with the GenAI semantic conventions: model spans
//! are `chat {model}` with `gen_ai.operation.name`, `gen_ai.request.model` and
//! `gen_ai.usage.input_tokens` / `output_tokens`; tool spans are `execute_tool {name}` with
//! `gen_ai.tool.name`, `gen_ai.tool.call.id` (the call key) and `gen_ai.tool.type`, and an MCP
//! tool's also `mcp.method.name` (`tools/call`) and `tether.mcp.server`.
//!
//! Span times are the task's creation time plus the active time at which each span started and
//! ended: the kernel's clock is active time, so waits (for a person, for a worker) are not shown.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::kernel::state::hex_prefix;
use crate::kernel::{Span, SpanKind};
use crate::model::ModelProfile;
use crate::store::TaskRecord;

fn attr(key: &str, v: Value) -> Value {
    let value = match v {
        Value::String(s) => json!({"stringValue": s}),
        Value::Number(n) if n.is_i64() || n.is_u64() => json!({"intValue": n.to_string()}),
        Value::Number(n) => json!({"doubleValue": n}),
        Value::Bool(b) => json!({"boolValue": b}),
        other => json!({"stringValue": other.to_string()}),
    };
    json!({"key": key, "value": value})
}

fn id(text: &str, hex_len: usize) -> String {
    hex_prefix(&Sha256::digest(text.as_bytes()), hex_len)
}

fn model_name(p: &ModelProfile) -> (String, &'static str) {
    match p {
        ModelProfile::OpenAi { model, .. } => (model.clone(), "openai"),
        ModelProfile::Policy { .. } => ("policy".into(), "tether.scripted"),
        ModelProfile::SameCall { .. } => ("same_call".into(), "tether.scripted"),
        ModelProfile::NewIds { .. } => ("new_ids".into(), "tether.scripted"),
        ModelProfile::SearchLoop { .. } => ("search_loop".into(), "tether.scripted"),
        ModelProfile::Script { .. } => ("script".into(), "tether.scripted"),
    }
}

/// The OTLP/JSON document for one task.
pub fn export(rec: &TaskRecord, spans: &[Span]) -> Value {
    let trace_id = id(&format!("tether-trace:{}", rec.id), 32);
    let base_ns = u128::from(rec.created_at_ms) * 1_000_000;
    let (model, provider) = model_name(&rec.model);
    let out: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut attrs = vec![
                attr("tether.task_id", json!(rec.id)),
                attr("tether.span.kind", json!(s.kind.as_str())),
                attr("tether.status", json!(s.status)),
            ];
            let name = match s.kind {
                SpanKind::Model => {
                    attrs.push(attr("gen_ai.operation.name", json!("chat")));
                    attrs.push(attr("gen_ai.provider.name", json!(provider)));
                    attrs.push(attr("gen_ai.request.model", json!(model)));
                    if let Some(t) = s.tin {
                        attrs.push(attr("gen_ai.usage.input_tokens", json!(t)));
                    }
                    if let Some(t) = s.tout {
                        attrs.push(attr("gen_ai.usage.output_tokens", json!(t)));
                    }
                    format!("chat {model}")
                }
                SpanKind::Tool => {
                    attrs.push(attr("gen_ai.operation.name", json!("execute_tool")));
                    attrs.push(attr("gen_ai.tool.name", json!(s.name)));
                    if let Some(k) = &s.key {
                        attrs.push(attr("gen_ai.tool.call.id", json!(k)));
                        attrs.push(attr("tether.call_key", json!(k)));
                    }
                    let mcp = rec
                        .catalog
                        .as_ref()
                        .and_then(|c| c.get(&s.name))
                        .and_then(|t| t.mcp.as_ref());
                    if let Some(m) = mcp {
                        // An MCP tool: the MCP semantic conventions' method, and the server.
                        attrs.push(attr("gen_ai.tool.type", json!("extension")));
                        attrs.push(attr("mcp.method.name", json!("tools/call")));
                        attrs.push(attr("tether.mcp.server", json!(m.server)));
                    } else {
                        attrs.push(attr("gen_ai.tool.type", json!("function")));
                    }
                    if let Some(r) = s.result_tokens {
                        attrs.push(attr("tether.result_tokens", json!(r)));
                    }
                    format!("execute_tool {}", s.name)
                }
                _ => s.name.clone(),
            };
            let ok = matches!(s.status.as_str(), "ok" | "done");
            let status = if ok {
                json!({"code": 1})
            } else {
                json!({"code": 2, "message": s.status})
            };
            let mut span = json!({
                "traceId": trace_id,
                "spanId": id(&format!("tether-span:{}:{}", rec.id, s.id), 16),
                "name": name,
                "kind": if matches!(s.kind, SpanKind::Model | SpanKind::Tool) { 3 } else { 1 },
                "startTimeUnixNano": (base_ns + u128::from(s.t0_ms) * 1_000_000).to_string(),
                "endTimeUnixNano": (base_ns + u128::from(s.t1_ms.unwrap_or(s.t0_ms)) * 1_000_000).to_string(),
                "attributes": attrs,
                "status": status,
            });
            if let Some(p) = s.parent {
                span["parentSpanId"] = json!(id(&format!("tether-span:{}:{p}", rec.id), 16));
            }
            span
        })
        .collect();
    json!({"resourceSpans": [{
        "resource": {"attributes": [attr("service.name", json!("tether-worker"))]},
        "scopeSpans": [{"scope": {"name": "tether", "version": env!("CARGO_PKG_VERSION")}, "spans": out}]
    }]})
}
