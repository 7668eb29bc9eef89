//! The asynchronous HTTP/1.1 client of the daemon's executor: model requests and tool calls
//! wait here without holding a thread, and without holding much memory either. Ten thousand
//! tasks waiting on a model are ten thousand requests in flight, each on a connection of its
//! own; a general client's connection carries about 25 KB of buffers and channels while it
//! waits, this one a socket and the request's state (the read buffer is made when the answer
//! begins). Everything else it needs is small: a request written once, an answer's head read
//! with `httparse`, its body by `Content-Length`, chunks or the connection's end, within a
//! limit and the request's timeout.
//!
//! - A request that may be repeated (a model request, a tool's read) goes on an idle
//!   connection to its origin when one is kept, and is sent again on a new one if that
//!   connection turns out closed before any answer; its connection is kept afterwards.
//! - A write opens a connection of its own, kept by no one, and asks its send gate once the
//!   connection is made (TCP, a proxy's tunnel, TLS), so that the proof of its claim is the
//!   last thing before its first byte (see `worker::driver::Proof`).
//!
//! Redirects are answers, never followed (see [`super::agent`] for why). Where requests go
//! (proxies, TLS, idle connections) is [`super::route`].

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use super::Ready;
use super::answer::{Read, Wire};
use super::route::{self, Conn, Origin};

/// Why a request got no answer. What of it may have left decides what its caller may do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// The request cannot be made as given (a header, the URL, a proxy setting): nothing sent.
    Invalid(String),
    /// No connection was made (name, TCP, proxy, TLS): nothing of the request was sent.
    Connect(String),
    /// The write's send gate refused once connected: nothing sent.
    Refused(String),
    /// No answer within the request's timeout: some of it may have been sent.
    Timeout,
    /// The connection failed or closed after the request began: it may have arrived.
    Lost(String),
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::Invalid(e) | Error::Connect(e) | Error::Refused(e) | Error::Lost(e) => {
                f.write_str(e)
            }
            Error::Timeout => f.write_str("no answer within the timeout"),
        }
    }
}

/// A request: its method, URL and headers, written once; its body, shared by the tries.
pub struct Request {
    method: String,
    uri: http::Uri,
    headers: String,
    /// The caller named what it accepts (else `Accept: */*`, as clients send).
    accept: bool,
    body: Option<bytes::Bytes>,
    timeout: Duration,
    /// A write: a connection of its own, never kept nor reused.
    write: bool,
    /// A write's send gate, asked once its connection is made.
    gate: Option<Ready>,
}

impl Request {
    /// A `method` request to the absolute `url`, to be answered within `timeout`.
    pub fn new(method: &str, url: &str, timeout: Duration) -> Result<Request, Error> {
        if method.is_empty() || !method.bytes().all(|b| b.is_ascii_alphabetic()) {
            return Err(Error::Invalid(format!("{method:?} is not an HTTP method")));
        }
        super::check_url(url).map_err(Error::Invalid)?;
        let uri: http::Uri = url
            .parse()
            .map_err(|e| Error::Invalid(format!("{url:?} is not a URL: {e}")))?;
        Ok(Request {
            method: method.to_ascii_uppercase(),
            uri,
            headers: String::new(),
            accept: false,
            body: None,
            timeout,
            write: false,
            gate: None,
        })
    }

    /// Adds a header; `Err` when it cannot be sent as given.
    pub fn header(mut self, name: &str, value: &str) -> Result<Request, Error> {
        http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| Error::Invalid(format!("{name:?} is not a header name")))?;
        http::HeaderValue::from_str(value).map_err(|_| {
            Error::Invalid(format!(
                "the value of the header {name} cannot be sent in a header"
            ))
        })?;
        self.accept |= name.eq_ignore_ascii_case("accept");
        for part in [name, ": ", value, "\r\n"] {
            self.headers.push_str(part);
        }
        Ok(self)
    }

    /// The request's body.
    pub fn body(mut self, body: bytes::Bytes) -> Request {
        self.body = Some(body);
        self
    }

    /// Marks the request a write: a connection of its own, never kept nor reused, and
    /// `gate` (if any) asked once it is made.
    pub fn write(mut self, gate: Option<Ready>) -> Request {
        self.write = true;
        self.gate = gate;
        self
    }

    /// The head as sent on `origin`'s connection (through `proxy` for plain HTTP: the
    /// absolute URL as the target, and the proxy's credentials).
    fn head(&self, origin: &Origin, proxy: Option<&route::Proxy>) -> Vec<u8> {
        let path = self.uri.path_and_query().map_or("/", |p| p.as_str());
        let via_proxy = proxy.filter(|_| !origin.tls);
        let target = match via_proxy {
            Some(_) => format!(
                "{}://{}{path}",
                if origin.tls { "https" } else { "http" },
                origin.authority()
            ),
            None => path.to_string(),
        };
        let mut head = format!(
            "{} {target} HTTP/1.1\r\nHost: {}\r\n",
            self.method,
            origin.authority()
        );
        if let Some(auth) = via_proxy.and_then(|p| p.auth.as_deref()) {
            head.push_str(&format!("Proxy-Authorization: {auth}\r\n"));
        }
        head.push_str(&self.headers);
        if !self.accept {
            head.push_str("Accept: */*\r\n");
        }
        let len = self.body.as_ref().map_or(0, |b| b.len());
        if len > 0 || matches!(self.method.as_str(), "POST" | "PUT" | "PATCH") {
            head.push_str(&format!("Content-Length: {len}\r\n"));
        }
        if self.write {
            head.push_str("Connection: close\r\n");
        }
        head.push_str("\r\n");
        head.into_bytes()
    }
}

/// Reads the environment's proxies and this machine's TLS roots now rather than at the
/// first request.
pub fn prepare() {
    route::proxies();
    let _ = route::tls();
}

/// An answer: its status, its headers and its body as text (or why the body could not be
/// read: over `max_body`, cut off, past the timeout, not UTF-8).
pub struct Response {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Result<String, String>,
}

/// Sends `req` and reads its answer, the body at most `max_body` bytes.
pub async fn send(req: Request, max_body: usize) -> Result<Response, Error> {
    send_via(req, max_body, route::proxies()).await
}

/// [`send`], through the proxies `proxies` names.
async fn send_via(
    req: Request,
    max_body: usize,
    proxies: &route::Proxies,
) -> Result<Response, Error> {
    let deadline = Instant::now() + req.timeout;
    let origin = Origin::of(&req.uri).map_err(Error::Invalid)?;
    let proxy = proxies.route(&origin).map_err(Error::Invalid)?;
    let head = req.head(&origin, proxy);
    let exchange = async {
        // A kept connection that closed under the request may have delivered it: a new
        // connection that then cannot be made is not "nothing sent".
        let mut tried_kept = false;
        if !req.write
            && let Some(conn) = route::take_idle(&origin)
        {
            match exchange(conn, &head, &req, true).await {
                Err(Tried::Stale) => tried_kept = true,
                done => return done.map_err(Tried::into_error),
            }
        }
        let conn = connect(&req, &origin, proxy, deadline)
            .await
            .map_err(|e| match e {
                Error::Connect(e) if tried_kept => Error::Lost(format!(
                    "the kept connection closed under the request, and a new one failed: {e}"
                )),
                e => e,
            })?;
        exchange(conn, &head, &req, false)
            .await
            .map_err(Tried::into_error)
    };
    let (mut wire, status, headers) = tokio::time::timeout_at(deadline, exchange)
        .await
        .map_err(|_| Error::Timeout)??;
    let no_body = req.method == "HEAD";
    let body =
        match tokio::time::timeout_at(deadline, wire.body(no_body, status, &headers, max_body))
            .await
        {
            Ok(body) => body,
            Err(_) => Err("the response body did not arrive within the timeout".into()),
        };
    let body = body.and_then(|b| {
        String::from_utf8(b).map_err(|_| "the response body is not UTF-8 text".to_string())
    });
    if body.is_ok() && !req.write && wire.reusable(&headers) {
        route::keep_idle(&origin, wire.into_conn());
    }
    Ok(Response {
        status,
        headers,
        body,
    })
}

/// A new connection for `req`, its gate (if any) asked once it is made. Until the gate lets
/// the request go nothing of it has left: running out of time here is a connection not made,
/// not a request without an answer.
async fn connect(
    req: &Request,
    origin: &Origin,
    proxy: Option<&route::Proxy>,
    deadline: Instant,
) -> Result<Conn, Error> {
    let connected = async {
        let conn = route::open(origin, proxy).await.map_err(Error::Connect)?;
        if let Some(gate) = &req.gate {
            let gate = gate.clone();
            tokio::task::spawn_blocking(move || gate())
                .await
                .unwrap_or_else(|e| Err(format!("the send gate failed: {e}")))
                .map_err(Error::Refused)?;
        }
        Ok(conn)
    };
    tokio::time::timeout_at(deadline, connected)
        .await
        .unwrap_or_else(|_| {
            Err(Error::Connect(format!(
                "no connection to {} within the timeout, so nothing was sent",
                origin.authority()
            )))
        })
}

/// How one try on a connection failed.
enum Tried {
    /// A kept connection was closed before any of the answer: try a new one.
    Stale,
    Lost(String),
}

impl Tried {
    fn into_error(self) -> Error {
        match self {
            Tried::Stale => Error::Lost("the connection closed before an answer".into()),
            Tried::Lost(e) => Error::Lost(e),
        }
    }
}

/// Writes the request on `conn` and reads the head of its answer (after any `1xx`). A
/// `reused` connection that turns out closed before any answer is [`Tried::Stale`].
async fn exchange(
    mut conn: Conn,
    head: &[u8],
    req: &Request,
    reused: bool,
) -> Result<(Wire, u16, http::HeaderMap), Tried> {
    let failed = |e: std::io::Error| {
        if reused {
            Tried::Stale
        } else {
            Tried::Lost(format!(
                "the connection failed while the request was sent: {e}"
            ))
        }
    };
    let written = async {
        conn.write_all(head).await?;
        if let Some(body) = &req.body {
            conn.write_all(body).await?;
        }
        conn.flush().await
    };
    written.await.map_err(failed)?;
    let mut wire = Wire::new(conn);
    loop {
        let (status, headers) = wire.head().await.map_err(|e| match e {
            Read::Closed if reused => Tried::Stale,
            e => Tried::Lost(e.text("the answer's head")),
        })?;
        if !(100..200).contains(&status) || status == 101 {
            return Ok((wire, status, headers));
        }
    }
}

#[cfg(test)]
#[path = "h1_tests.rs"]
mod tests;
