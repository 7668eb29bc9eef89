//! The asynchronous HTTP client of the daemon's executor (reqwest, on the executor's runtime):
//! model requests and tool calls wait here without holding a thread. Two clients, made once:
//!
//! - [`pooled`] keeps connections alive between requests (a model provider is asked again and
//!   again, by thousands of tasks at once);
//! - [`gated`] keeps none idle: a write's request opens a connection of its own, and once that
//!   connection is made (DNS, TCP, a proxy, TLS) its last connector layer ([`GateLayer`]) asks
//!   the request's send gate ([`SEND_GATE`], a task-local), so that a write's proof of its claim
//!   is the last thing before its first byte (see `worker::driver::Proof`). A request without a
//!   gate passes through.
//!
//! Neither follows a redirect (see [`super::agent`] for why).

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use super::Ready;

tokio::task_local! {
    /// The gate of the request this task is sending, if it has one.
    pub static SEND_GATE: Ready;
}

/// The client for requests that reuse connections: model calls and tool reads.
pub fn pooled() -> Result<&'static reqwest::Client, String> {
    static CLIENT: OnceLock<Result<reqwest::Client, String>> = OnceLock::new();
    CLIENT
        .get_or_init(|| builder().build().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| format!("cannot make the HTTP client: {e}"))
}

/// The client for writes: a connection per request, asking its gate once made.
pub fn gated() -> Result<&'static reqwest::Client, String> {
    static CLIENT: OnceLock<Result<reqwest::Client, String>> = OnceLock::new();
    CLIENT
        .get_or_init(|| {
            builder()
                .pool_max_idle_per_host(0)
                .connector_layer(GateLayer)
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| format!("cannot make the HTTP client: {e}"))
}

fn builder() -> reqwest::ClientBuilder {
    // reqwest's TLS asks for the process's rustls provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().redirect(reqwest::redirect::Policy::none())
}

/// Sends `request`; with a gate, the gate is asked once its connection is made, and nothing
/// is sent when it refuses (the error then says why).
pub async fn send(
    request: reqwest::RequestBuilder,
    gate: Option<Ready>,
) -> Result<reqwest::Response, reqwest::Error> {
    match gate {
        Some(gate) => SEND_GATE.scope(gate, request.send()).await,
        None => request.send().await,
    }
}

/// A transport error with its causes (reqwest's own message names only the outermost).
pub fn error_text(e: &reqwest::Error) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// A response body of at most `max_bytes`, as text.
pub async fn read_body(mut resp: reqwest::Response, max_bytes: usize) -> Result<String, String> {
    let mut body = Vec::new();
    while let Some(chunk) = resp
        .chunk()
        .await
        .map_err(|e| format!("the response body could not be read: {e}"))?
    {
        if body.len() + chunk.len() > max_bytes {
            return Err(format!(
                "the response body is over the limit of {max_bytes} bytes"
            ));
        }
        body.extend_from_slice(&chunk);
    }
    String::from_utf8(body).map_err(|_| "the response body is not UTF-8 text".to_string())
}

/// The connector's last layer: a connection made for a request with a gate asks it once made.
#[derive(Clone)]
pub struct GateLayer;

impl<S> tower_layer::Layer<S> for GateLayer {
    type Service = GateService<S>;

    fn layer(&self, inner: S) -> GateService<S> {
        GateService(inner)
    }
}

#[derive(Clone)]
pub struct GateService<S>(S);

type Pinned<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, R> tower_service::Service<R> for GateService<S>
where
    S: tower_service::Service<R>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: From<String> + Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pinned<Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        let connecting = self.0.call(req);
        Box::pin(async move {
            let gate = SEND_GATE.try_with(Arc::clone).ok();
            let conn = connecting.await?;
            if let Some(gate) = gate {
                // The gate may read the database (a blocking client): off the runtime's thread.
                let ready = tokio::task::spawn_blocking(move || gate())
                    .await
                    .unwrap_or_else(|e| Err(format!("the send gate failed: {e}")));
                ready.map_err(S::Error::from)?;
            }
            Ok(conn)
        })
    }
}
