//! MCP over streamable HTTP with a write's send gate asked after its connection is made.
//!
//! A `tools/call` POST opens a connection of its own (the SDK's client keeps none idle), so
//! DNS, TCP, a proxy's CONNECT and TLS all come after the gate `Mcp::call_gated` asks before
//! handing the call to the SDK: a process paused there could send a write whose claim another
//! daemon took over meanwhile. So the call's gate travels with its message (an id under
//! [`GATE_META_KEY`] in its `_meta`, taken out before it is sent), [`GatedClient`] makes it the
//! request's task-local gate, and [`GateLayer`], the last layer of the client's connector,
//! asks it again once the connection is made: the request's bytes follow at once, or nothing
//! is sent. Requests without a gate (the session's own, reads) pass through.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use http::{HeaderName, HeaderValue};
use rmcp::model::{ClientJsonRpcMessage, ClientRequest, JsonRpcMessage};
use rmcp::transport::streamable_http_client::{
    SseError, StreamableHttpClient, StreamableHttpError, StreamableHttpPostResponse,
    StreamableHttpResponseLimits,
};

use crate::net::Ready;
use crate::net::gate::{GateLayer, SEND_GATE};

/// The `_meta` key that carries a call's gate id from `Mcp::call_gated` to the client.
pub(super) const GATE_META_KEY: &str = "tether.dev/send-gate";

/// The gates of the calls in flight, by id.
pub(super) type Gates = Arc<Mutex<HashMap<String, Ready>>>;

/// The SDK's reqwest client, with the gate of each `tools/call` in scope while it is sent.
#[derive(Clone)]
pub(super) struct GatedClient {
    inner: reqwest::Client,
    gates: Gates,
}

impl GatedClient {
    /// A client like the SDK's own (no idle connections; same-origin 307 and 308 redirects
    /// only, at most ten), whose connections ask their request's gate once made.
    pub(super) fn new(gates: Gates) -> Result<GatedClient, String> {
        let inner = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .redirect(same_origin_redirects())
            .connector_layer(GateLayer)
            .build()
            .map_err(|e| format!("cannot build the MCP HTTP client: {e}"))?;
        Ok(GatedClient { inner, gates })
    }

    /// `message` without its gate id, and the gate it named.
    fn take_gate(
        &self,
        mut message: ClientJsonRpcMessage,
    ) -> (ClientJsonRpcMessage, Option<Ready>) {
        let JsonRpcMessage::Request(r) = &mut message else {
            return (message, None);
        };
        let ClientRequest::CallToolRequest(call) = &mut r.request else {
            return (message, None);
        };
        let Some(meta) = call.params.meta.as_mut() else {
            return (message, None);
        };
        let id = meta.0.0.remove(GATE_META_KEY);
        if meta.0.0.is_empty() {
            call.params.meta = None;
        }
        let gate = id
            .as_ref()
            .and_then(|v| v.as_str())
            .and_then(|id| self.gates.lock().ok()?.get(id).cloned());
        (message, gate)
    }
}

/// Same-origin 307 and 308 redirects (which keep the method and body), at most ten, as the
/// SDK's own client follows; any other redirect is the answer.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let keeps_body = matches!(
            attempt.status(),
            reqwest::StatusCode::TEMPORARY_REDIRECT | reqwest::StatusCode::PERMANENT_REDIRECT
        );
        let same_origin = attempt
            .previous()
            .first()
            .is_some_and(|first| first.origin() == attempt.url().origin());
        if !keeps_body || !same_origin {
            attempt.stop()
        } else if attempt.previous().len() > 10 {
            attempt.error("more than 10 redirects")
        } else {
            attempt.follow()
        }
    })
}

type Error = StreamableHttpError<reqwest::Error>;
type SseStream =
    Pin<Box<dyn futures_core::Stream<Item = Result<sse_stream::Sse, SseError>> + Send + 'static>>;

impl StreamableHttpClient for GatedClient {
    type Error = reqwest::Error;

    fn post_message(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, Error>> + Send + '_ {
        self.post_message_with_response_limits(
            uri,
            message,
            session_id,
            auth_header,
            custom_headers,
            StreamableHttpResponseLimits::default(),
        )
    }

    fn post_message_with_response_limits(
        &self,
        uri: Arc<str>,
        message: ClientJsonRpcMessage,
        session_id: Option<Arc<str>>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        limits: StreamableHttpResponseLimits,
    ) -> impl Future<Output = Result<StreamableHttpPostResponse, Error>> + Send + '_ {
        let (message, gate) = self.take_gate(message);
        async move {
            let sent = self.inner.post_message_with_response_limits(
                uri,
                message,
                session_id,
                auth_header,
                custom_headers,
                limits,
            );
            match gate {
                Some(gate) => SEND_GATE.scope(gate, sent).await,
                None => sent.await,
            }
        }
    }

    fn delete_session(
        &self,
        uri: Arc<str>,
        session_id: Arc<str>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<(), Error>> + Send + '_ {
        self.inner
            .delete_session(uri, session_id, auth_header, custom_headers)
    }

    fn get_stream(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
    ) -> impl Future<Output = Result<SseStream, Error>> + Send + '_ {
        self.inner
            .get_stream(uri, session_id, last_event_id, auth_header, custom_headers)
    }

    fn get_stream_with_max_sse_event_size(
        &self,
        uri: Arc<str>,
        session_id: Option<Arc<str>>,
        last_event_id: Option<String>,
        auth_header: Option<String>,
        custom_headers: HashMap<HeaderName, HeaderValue>,
        max_sse_event_size: usize,
    ) -> impl Future<Output = Result<SseStream, Error>> + Send + '_ {
        self.inner.get_stream_with_max_sse_event_size(
            uri,
            session_id,
            last_event_id,
            auth_header,
            custom_headers,
            max_sse_event_size,
        )
    }
}
