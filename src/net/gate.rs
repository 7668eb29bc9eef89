//! The send gate of a write over MCP's streamable HTTP: the SDK's client (reqwest) asks it
//! once a connection is made, in the last layer of its connector ([`GateLayer`]), so that a
//! write's proof of its claim is the last thing before its first byte (see
//! `worker::driver::Proof`). The request's gate is a task-local ([`SEND_GATE`]) the MCP client
//! sets while it sends; a request without one passes through. (The executor's own client,
//! [`super::h1`], asks a write's gate itself.)

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use super::Ready;

tokio::task_local! {
    /// The gate of the request this task is sending, if it has one.
    pub static SEND_GATE: Ready;
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
