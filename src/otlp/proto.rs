//! OTLP protobuf: the messages of `opentelemetry/proto/collector/trace/v1` that an export
//! needs, declared with prost's derive at the official field numbers (the generated crate,
//! `opentelemetry-proto`, brings the OpenTelemetry SDK along). The tests decode what this
//! writes with the official schema (Python `opentelemetry-proto`).

use prost::Message;

use super::{Attr, OtlpSpan};

#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceRequest {
    #[prost(message, repeated, tag = "1")]
    pub resource_spans: Vec<ResourceSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExportTraceServiceResponse {
    #[prost(message, optional, tag = "1")]
    pub partial_success: Option<ExportTracePartialSuccess>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ExportTracePartialSuccess {
    #[prost(int64, tag = "1")]
    pub rejected_spans: i64,
    #[prost(string, tag = "2")]
    pub error_message: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct ResourceSpans {
    #[prost(message, optional, tag = "1")]
    pub resource: Option<Resource>,
    #[prost(message, repeated, tag = "2")]
    pub scope_spans: Vec<ScopeSpans>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Resource {
    #[prost(message, repeated, tag = "1")]
    pub attributes: Vec<KeyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ScopeSpans {
    #[prost(message, optional, tag = "1")]
    pub scope: Option<InstrumentationScope>,
    #[prost(message, repeated, tag = "2")]
    pub spans: Vec<Span>,
}

#[derive(Clone, PartialEq, Message)]
pub struct InstrumentationScope {
    #[prost(string, tag = "1")]
    pub name: String,
    #[prost(string, tag = "2")]
    pub version: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Span {
    #[prost(bytes = "vec", tag = "1")]
    pub trace_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub span_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "4")]
    pub parent_span_id: Vec<u8>,
    #[prost(string, tag = "5")]
    pub name: String,
    #[prost(int32, tag = "6")]
    pub kind: i32,
    #[prost(fixed64, tag = "7")]
    pub start_time_unix_nano: u64,
    #[prost(fixed64, tag = "8")]
    pub end_time_unix_nano: u64,
    #[prost(message, repeated, tag = "9")]
    pub attributes: Vec<KeyValue>,
    #[prost(message, optional, tag = "15")]
    pub status: Option<Status>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Status {
    #[prost(string, tag = "2")]
    pub message: String,
    #[prost(int32, tag = "3")]
    pub code: i32,
}

#[derive(Clone, PartialEq, Message)]
pub struct KeyValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(message, optional, tag = "2")]
    pub value: Option<AnyValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct AnyValue {
    #[prost(oneof = "any_value::Value", tags = "1, 2, 3, 4, 5")]
    pub value: Option<any_value::Value>,
}

pub mod any_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(string, tag = "1")]
        StringValue(String),
        #[prost(bool, tag = "2")]
        BoolValue(bool),
        #[prost(int64, tag = "3")]
        IntValue(i64),
        #[prost(double, tag = "4")]
        DoubleValue(f64),
        #[prost(message, tag = "5")]
        ArrayValue(super::ArrayValue),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct ArrayValue {
    #[prost(message, repeated, tag = "1")]
    pub values: Vec<AnyValue>,
}

fn any(v: &Attr) -> AnyValue {
    use any_value::Value as V;
    let value = match v {
        Attr::Str(s) => V::StringValue(s.clone()),
        Attr::Int(i) => V::IntValue(*i),
        Attr::Double(d) => V::DoubleValue(*d),
        Attr::Bool(b) => V::BoolValue(*b),
        Attr::Strs(items) => V::ArrayValue(ArrayValue {
            values: items.iter().map(|s| any(&Attr::Str(s.clone()))).collect(),
        }),
    };
    AnyValue { value: Some(value) }
}

fn key_values(a: &[(String, Attr)]) -> Vec<KeyValue> {
    a.iter()
        .map(|(k, v)| KeyValue {
            key: k.clone(),
            value: Some(any(v)),
        })
        .collect()
}

/// The encoded request for `spans` from a process with `resource` attributes.
pub fn request(resource: &[(String, Attr)], spans: &[OtlpSpan]) -> Vec<u8> {
    let spans = spans
        .iter()
        .map(|s| Span {
            trace_id: s.trace_id.to_vec(),
            span_id: s.span_id.to_vec(),
            parent_span_id: s.parent_span_id.map(|p| p.to_vec()).unwrap_or_default(),
            name: s.name.clone(),
            kind: s.kind,
            start_time_unix_nano: s.start_ns,
            end_time_unix_nano: s.end_ns,
            attributes: key_values(&s.attributes),
            status: Some(Status {
                message: s.status_message.clone(),
                code: s.status_code,
            }),
        })
        .collect();
    ExportTraceServiceRequest {
        resource_spans: vec![ResourceSpans {
            resource: Some(Resource {
                attributes: key_values(resource),
            }),
            scope_spans: vec![ScopeSpans {
                scope: Some(InstrumentationScope {
                    name: "tether".into(),
                    version: env!("CARGO_PKG_VERSION").into(),
                }),
                spans,
            }],
        }],
    }
    .encode_to_vec()
}

/// How many spans a receiver's answer says it rejected, and why (a partial success).
pub fn rejected(body: &[u8]) -> Option<(i64, String)> {
    let r = ExportTraceServiceResponse::decode(body).ok()?;
    r.partial_success
        .filter(|p| p.rejected_spans > 0)
        .map(|p| (p.rejected_spans, p.error_message))
}
