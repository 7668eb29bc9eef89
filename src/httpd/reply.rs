//! What a handler answers ([`Reply`]: a whole answer, a streamed one, or a broken one for fault
//! injection) and how an answer is written on the connection.

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};

/// What a handler answers.
pub enum Reply {
    Response {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    },
    /// A broken answer, then the connection closes: the client cannot tell whether the request
    /// took effect (fault injection).
    Lose,
    /// A 200 whose body is written as it comes (Server-Sent Events): the head, then `body`
    /// writes until it returns (or the client goes away), then the connection closes (the
    /// body's end is the connection's end). `body` is told when the server stops or the
    /// client closed its end.
    Stream {
        headers: Vec<(&'static str, String)>,
        body: Box<StreamBody>,
    },
}

/// What writes a [`Reply::Stream`]'s body: the connection, and a check that says when to stop
/// (the server stops, or the client closed its end).
pub type StreamBody = dyn FnOnce(&mut dyn Write, &dyn Fn() -> bool) -> std::io::Result<()> + Send;

impl Reply {
    /// An HTML page.
    pub fn html(status: u16, body: String) -> Reply {
        Reply::Response {
            status,
            headers: vec![
                ("Content-Type", "text/html; charset=utf-8".into()),
                // The console's pages: no framing by other sites, no inline script.
                ("X-Frame-Options", "DENY".into()),
                (
                    "Content-Security-Policy",
                    "default-src 'self'; style-src 'self' 'unsafe-inline'; script-src 'none'; form-action 'self'; frame-ancestors 'none'".into(),
                ),
                ("Cache-Control", "no-store".into()),
            ],
            body: body.into_bytes(),
        }
    }

    /// A redirect after a form (303: the browser follows it with a GET).
    pub fn see_other(location: &str) -> Reply {
        Reply::Response {
            status: 303,
            headers: vec![("Location", location.to_string())],
            body: Vec::new(),
        }
    }

    /// An error of the server itself (a request it could not read, too many connections):
    /// RFC 9457 problem details, with the detail also under `error`.
    pub fn problem(status: u16, detail: &str) -> Reply {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": reason(status),
            "status": status,
            "detail": detail,
            "error": detail,
        });
        Reply::Response {
            status,
            headers: vec![("Content-Type", "application/problem+json".into())],
            body: body.to_string().into_bytes(),
        }
    }

    pub fn json(status: u16, body: &serde_json::Value) -> Reply {
        Reply::Response {
            status,
            headers: vec![("Content-Type", "application/json".into())],
            body: body.to_string().into_bytes(),
        }
    }

    pub fn with_header(mut self, name: &'static str, value: &str) -> Reply {
        if let Reply::Response { headers, .. } | Reply::Stream { headers, .. } = &mut self {
            headers.push((name, value.to_string()));
        }
        self
    }
}

pub(super) fn write_reply(
    s: &mut TcpStream,
    reply: Reply,
    keep_alive: bool,
) -> std::io::Result<()> {
    let Reply::Response {
        status,
        headers,
        body,
    } = reply
    else {
        return Ok(());
    };
    let mut out = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    for (n, v) in &headers {
        out.push_str(&format!("{n}: {v}\r\n"));
    }
    // A 204 or 304 has no body and says no length (RFC 9110).
    if status != 204 && status != 304 {
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    if !keep_alive {
        out.push_str("Connection: close\r\n");
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    bytes.extend_from_slice(&body);
    s.write_all(&bytes)?;
    s.flush()
}

/// A 200 whose body `body` writes as it comes; the connection closes after it.
pub(super) fn stream_reply(
    s: &mut TcpStream,
    headers: &[(&'static str, String)],
    body: Box<StreamBody>,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    let mut out = String::from("HTTP/1.1 200 OK\r\n");
    for (n, v) in headers {
        out.push_str(&format!("{n}: {v}\r\n"));
    }
    out.push_str("Connection: close\r\n\r\n");
    s.write_all(out.as_bytes())?;
    s.flush()?;
    // A client that went away is seen at once (its end closed), not at the next write that
    // fails: a stream holds a connection and a place among the long polls until then.
    let peer = s.try_clone()?;
    let _ = peer.set_read_timeout(Some(std::time::Duration::from_millis(1)));
    let over = || stop.load(Ordering::SeqCst) || closed(&peer);
    body(s, &over)?;
    s.flush()
}

/// Whether the client closed its end (or the connection failed): a peek that reads nothing.
fn closed(peer: &TcpStream) -> bool {
    let mut one = [0u8; 1];
    match peer.peek(&mut one) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock
                | std::io::ErrorKind::TimedOut
                | std::io::ErrorKind::Interrupted
        ),
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        303 => "See Other",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "",
    }
}
