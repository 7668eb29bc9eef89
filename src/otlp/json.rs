//! OTLP/JSON: one `ExportTraceServiceRequest` per line, as an OpenTelemetry collector's file
//! receiver reads it (ids in hex, 64-bit integers as strings, enums as numbers).

use serde_json::{Value, json};

use super::{Attr, OtlpSpan, hex};

fn value(v: &Attr) -> Value {
    match v {
        Attr::Str(s) => json!({"stringValue": s}),
        Attr::Int(i) => json!({"intValue": i.to_string()}),
        Attr::Double(d) => json!({"doubleValue": d}),
        Attr::Bool(b) => json!({"boolValue": b}),
        Attr::Strs(items) => {
            json!({"arrayValue": {"values": items.iter().map(|s| json!({"stringValue": s})).collect::<Vec<_>>()}})
        }
    }
}

fn attrs(a: &[(String, Attr)]) -> Vec<Value> {
    a.iter()
        .map(|(k, v)| json!({"key": k, "value": value(v)}))
        .collect()
}

/// The request for `spans` from a process with `resource` attributes.
pub fn request(resource: &[(String, Attr)], spans: &[OtlpSpan]) -> Value {
    let out: Vec<Value> = spans
        .iter()
        .map(|s| {
            let mut status = json!({"code": s.status_code});
            if !s.status_message.is_empty() {
                status["message"] = json!(s.status_message);
            }
            let mut span = json!({
                "traceId": hex(&s.trace_id),
                "spanId": hex(&s.span_id),
                "name": s.name,
                "kind": s.kind,
                "startTimeUnixNano": s.start_ns.to_string(),
                "endTimeUnixNano": s.end_ns.to_string(),
                "attributes": attrs(&s.attributes),
                "status": status,
            });
            if let Some(p) = &s.parent_span_id {
                span["parentSpanId"] = json!(hex(p));
            }
            span
        })
        .collect();
    json!({"resourceSpans": [{
        "resource": {"attributes": attrs(resource)},
        "scopeSpans": [{"scope": {"name": "tether", "version": env!("CARGO_PKG_VERSION")}, "spans": out}]
    }]})
}
