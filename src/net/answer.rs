//! The answer side of the executor's HTTP client ([`super::h1`]): a connection being read,
//! its answer's head (`httparse`) and its body by `Content-Length`, the chunked coding or the
//! connection's end, within a limit. A waiting request holds no read buffer: one is made when
//! bytes arrive, and given back if they were only TLS's own records.

use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tokio::io::{AsyncRead, ReadBuf};

use super::route::Conn;

/// Why reading failed.
pub(super) enum Read {
    /// The connection ended before the first byte of what was read.
    Closed,
    Failed(String),
}

impl Read {
    pub(super) fn text(self, what: &str) -> String {
        match self {
            Read::Closed => format!("the connection closed before {what}"),
            Read::Failed(e) => e,
        }
    }
}

/// The largest answer head read.
const HEAD_MAX: usize = 64 * 1024;

/// A connection being read: what arrived and is not yet taken.
pub(super) struct Wire {
    conn: Conn,
    buf: Vec<u8>,
    at: usize,
    ended: bool,
    /// The connection may not carry another request after this answer (HTTP/1.0, or a
    /// framing that was accepted but is not to be trusted twice).
    spent: bool,
}

impl Wire {
    pub(super) fn new(conn: Conn) -> Wire {
        Wire {
            conn,
            buf: Vec::new(),
            at: 0,
            ended: false,
            spent: false,
        }
    }

    pub(super) fn into_conn(self) -> Conn {
        self.conn
    }

    /// Reads more; `false` at the connection's end. While nothing has arrived, the buffer
    /// is not kept: a request waiting for its answer holds its socket, not 4 KB.
    async fn fill(&mut self) -> Result<bool, Read> {
        if self.at > 0 && self.at == self.buf.len() {
            self.buf = Vec::new();
            self.at = 0;
        }
        // TLS may hold plaintext it read already: try it first. A plain socket is read once
        // it says it is readable.
        let mut readable = self.conn.is_tls();
        loop {
            if !readable {
                self.conn
                    .wait_readable()
                    .await
                    .map_err(|e| Read::Failed(format!("the connection failed: {e}")))?;
            }
            if self.buf.capacity() - self.buf.len() < 1024 {
                self.buf.reserve(4096);
            }
            match try_read(&mut self.conn, &mut self.buf) {
                Poll::Ready(Ok(n)) => {
                    self.ended |= n == 0;
                    return Ok(n > 0);
                }
                // A TLS peer that closes without its close_notify: the end, as for TCP.
                Poll::Ready(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                    self.ended = true;
                    return Ok(false);
                }
                Poll::Ready(Err(e)) if is_reset(&e) && self.buf.is_empty() => {
                    return Err(Read::Closed);
                }
                Poll::Ready(Err(e)) => {
                    return Err(Read::Failed(format!("the connection failed: {e}")));
                }
                Poll::Pending => {
                    if self.buf.is_empty() {
                        self.buf = Vec::new();
                    }
                    readable = false;
                }
            }
        }
    }

    fn unread(&self) -> &[u8] {
        &self.buf[self.at..]
    }

    /// An answer's head: its status and headers.
    pub(super) async fn head(&mut self) -> Result<(u16, http::HeaderMap), Read> {
        let began = self.unread().len();
        loop {
            let mut slots = [httparse::EMPTY_HEADER; 100];
            let mut r = httparse::Response::new(&mut slots);
            let parsed = match r.parse(&self.buf[self.at..]) {
                Ok(httparse::Status::Complete(n)) => n,
                Ok(httparse::Status::Partial) if self.unread().len() > HEAD_MAX => {
                    return Err(Read::Failed("the answer's head is over 64 KB".into()));
                }
                Ok(httparse::Status::Partial) => 0,
                Err(e) => {
                    return Err(Read::Failed(format!("the answer is not HTTP/1.1: {e}")));
                }
            };
            if parsed > 0 {
                let mut headers = http::HeaderMap::with_capacity(r.headers.len());
                for h in r.headers.iter() {
                    if let (Ok(name), Ok(value)) = (
                        http::HeaderName::from_bytes(h.name.as_bytes()),
                        http::HeaderValue::from_bytes(h.value),
                    ) {
                        headers.append(name, value);
                    }
                }
                let (status, http10) = (r.code.unwrap_or(0), r.version == Some(0));
                self.at += parsed;
                self.spent |= http10;
                return Ok((status, headers));
            }
            if !self.fill().await? {
                return Err(match self.unread().len() == began && began == 0 {
                    true => Read::Closed,
                    false => Read::Failed("the connection closed in the answer's head".into()),
                });
            }
        }
    }

    /// The answer's body, at most `max` bytes (none for `no_body`: a `HEAD`'s answer).
    pub(super) async fn body(
        &mut self,
        no_body: bool,
        status: u16,
        headers: &http::HeaderMap,
        max: usize,
    ) -> Result<Vec<u8>, String> {
        if no_body || matches!(status, 204 | 304) {
            return Ok(Vec::new());
        }
        let over = || format!("the response body is over the limit of {max} bytes");
        let length = content_length(headers)?;
        let chunked = headers.get_all("transfer-encoding").iter().any(|t| {
            t.to_str()
                .is_ok_and(|t| t.to_ascii_lowercase().contains("chunked"))
        });
        if chunked {
            // Both framings at once (RFC 9112, 6.3): the chunks tell, and the connection
            // carries nothing more.
            self.spent |= length.is_some();
            return self.chunked(max).await;
        }
        if let Some(len) = length {
            if len > max {
                return Err(over());
            }
            return self.exact(len).await.map_err(|e| e.text("the body's end"));
        }
        // Neither: the body ends with the connection.
        while !self.ended {
            if self.unread().len() > max {
                return Err(over());
            }
            self.fill().await.map_err(|e| e.text("the body's end"))?;
        }
        if self.unread().len() > max {
            return Err(over());
        }
        Ok(self.take(self.unread().len()))
    }

    /// The next `n` bytes.
    async fn exact(&mut self, n: usize) -> Result<Vec<u8>, Read> {
        while self.unread().len() < n {
            if !self.fill().await? {
                return Err(Read::Failed(
                    "the connection closed before the body's end".into(),
                ));
            }
        }
        Ok(self.take(n))
    }

    /// Drops what was taken from the buffer once it is large, so a body read in chunks is
    /// not held twice.
    fn compact(&mut self) {
        if self.at >= 16 * 1024 {
            self.buf.drain(..self.at);
            self.at = 0;
        }
    }

    fn take(&mut self, n: usize) -> Vec<u8> {
        let taken = self.unread()[..n].to_vec();
        self.at += n;
        taken
    }

    /// A line (without its CRLF), for the chunked coding's sizes and trailers.
    async fn line(&mut self) -> Result<String, String> {
        loop {
            if let Some(end) = self.unread().windows(2).position(|w| w == b"\r\n") {
                let line = String::from_utf8_lossy(&self.unread()[..end]).into_owned();
                self.at += end + 2;
                return Ok(line);
            }
            if self.unread().len() > 8 * 1024 {
                return Err("a chunk's size line is over 8 KB".into());
            }
            if !self.fill().await.map_err(|e| e.text("the body's end"))? {
                return Err("the connection closed before the body's end".into());
            }
        }
    }

    /// A body in the chunked coding (RFC 9112, section 7.1), trailers read and dropped.
    async fn chunked(&mut self, max: usize) -> Result<Vec<u8>, String> {
        let mut body = Vec::new();
        loop {
            let line = self.line().await?;
            let size = line.split(';').next().unwrap_or_default().trim();
            let size = (size.len() <= 16 && size.bytes().all(|b| b.is_ascii_hexdigit()))
                .then(|| usize::from_str_radix(size, 16).ok())
                .flatten()
                .ok_or_else(|| format!("a chunk's size {size:?} is not a hex number"))?;
            if size == 0 {
                while !self.line().await?.is_empty() {}
                return Ok(body);
            }
            if size > max.saturating_sub(body.len()) {
                return Err(format!(
                    "the response body is over the limit of {max} bytes"
                ));
            }
            let chunk = self
                .exact(size)
                .await
                .map_err(|e| e.text("a chunk's end"))?;
            body.extend_from_slice(&chunk);
            self.compact();
            if !self.line().await?.is_empty() {
                return Err("a chunk is longer than its size says".into());
            }
        }
    }

    /// Whether the connection may carry the next request: the answer read to its end,
    /// nothing after it, and neither side asked to close.
    pub(super) fn reusable(&self, headers: &http::HeaderMap) -> bool {
        let close = headers.get_all("connection").iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.to_ascii_lowercase().contains("close"))
        });
        !close && !self.spent && !self.ended && self.unread().is_empty()
    }
}

/// The answer's `Content-Length`, if it has one: digits only, the same in every copy.
fn content_length(headers: &http::HeaderMap) -> Result<Option<usize>, String> {
    let mut length = None;
    for value in headers.get_all("content-length") {
        for part in value.to_str().unwrap_or("?").split(',') {
            let part = part.trim();
            let n = (!part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
                .then(|| part.parse::<usize>().ok())
                .flatten()
                .ok_or_else(|| format!("the answer's Content-Length {part:?} is not a number"))?;
            if length.is_some_and(|l| l != n) {
                return Err("the answer gives two different Content-Lengths".into());
            }
            length = Some(n);
        }
    }
    Ok(length)
}

/// Reads what the connection has now into `buf`'s spare room, without waiting: `Pending`
/// when nothing is there (TLS's own records are consumed on the way).
pub(super) fn try_read(conn: &mut Conn, buf: &mut Vec<u8>) -> Poll<std::io::Result<usize>> {
    let len = buf.len();
    buf.resize(buf.capacity(), 0);
    let mut cx = Context::from_waker(Waker::noop());
    let mut room = ReadBuf::new(&mut buf[len..]);
    let polled = Pin::new(conn).poll_read(&mut cx, &mut room);
    let n = room.filled().len();
    buf.truncate(len + n);
    polled.map_ok(|()| n)
}

/// A connection reset or aborted by the peer.
fn is_reset(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(e.kind(), ConnectionReset | ConnectionAborted | BrokenPipe)
}
