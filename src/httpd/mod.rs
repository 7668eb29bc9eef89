//! A small blocking HTTP/1.1 server with a limit on everything: the project's HTTP edge
//! (`worker demo-store`, `worker console`, and `/metrics` of `worker run`).
//!
//! One thread per connection, at most `connections_max` at once. When all are open, a new
//! connection takes the place of the one that has waited longest for a request (idle, or
//! sending its request slowly): that one is closed. So idle or slow connections, from one
//! address or many, never keep a client with a request to make out; only when every
//! connection is inside a handler is the next one answered 503. A new connection must send
//! its first byte within `first_byte_timeout`. httparse (the parser hyper uses) reads the request head, which may be at most
//! `head_bytes_max` (431 beyond) with at most 64 headers; a body needs a `Content-Length` of
//! at most `body_bytes_max` (413 beyond, before a byte of it is read; chunked bodies get 411,
//! two `Content-Length` headers 400; after such an answer what the client still sends is read
//! and dropped for up to 2 s, so a reset does not lose the answer);
//! every request must arrive whole within `request_timeout` of its first byte (408 after), so
//! a client sending a few bytes at a time holds one connection for a bounded time and never a
//! handler that others wait for. An idle keep-alive connection is closed after
//! `idle_timeout`. A streamed answer (`Reply::Stream`, the API's Server-Sent Events) keeps its
//! connection's thread until its body ends, then closes the connection.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The limits of a server.
#[derive(Clone, Debug)]
pub struct Limits {
    pub connections_max: usize,
    /// How long a new connection may wait before sending its first byte.
    pub first_byte_timeout: Duration,
    pub head_bytes_max: usize,
    pub body_bytes_max: usize,
    pub request_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connections_max: 64,
            first_byte_timeout: Duration::from_secs(5),
            head_bytes_max: 16 << 10,
            body_bytes_max: crate::limits::HTTP_BODY_BYTES_MAX,
            request_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

const HEADERS_MAX: usize = 64;

mod reply;
pub use reply::{Reply, StreamBody};
use reply::{stream_reply, write_reply};

/// A request, read whole.
#[derive(Debug)]
pub struct Request {
    pub method: String,
    /// The path, without the query.
    pub path: String,
    pub query: String,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first header of this name (case-insensitive), as bytes.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// A query parameter, percent-decoded.
    pub fn param(&self, name: &str) -> Option<String> {
        self.query.split('&').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k == name).then(|| percent_decode(v))
        })
    }
}

pub type Handler = dyn Fn(&Request) -> Reply + Send + Sync;

/// Serves on `listen` until `stop` is set; calls `ready` with the bound address first.
pub fn serve(
    listen: &str,
    limits: Limits,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(String),
    handler: Arc<Handler>,
) -> Result<(), String> {
    let listener =
        TcpListener::bind(listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    listener
        .set_nonblocking(true)
        .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    ready(addr.to_string());
    let live: Arc<Mutex<Live>> = Arc::default();
    let epoch = Instant::now();
    let limits = Arc::new(limits);
    while !stop.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let now = stamp(epoch);
        let admitted = live
            .lock()
            .map(|mut l| l.admit(&stream, limits.connections_max, now))
            .unwrap_or(None);
        let Some((id, waiting)) = admitted else {
            let mut s = stream;
            let _ = s.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = write_reply(&mut s, Reply::problem(503, "too many connections"), false);
            continue;
        };
        // Given back when the connection's thread ends, or at once if it cannot start.
        let slot = Slot {
            live: Arc::clone(&live),
            id,
        };
        let (limits, handler, stop) =
            (Arc::clone(&limits), Arc::clone(&handler), Arc::clone(&stop));
        let spawned = std::thread::Builder::new()
            .name("http-conn".into())
            .spawn(move || {
                let _slot = slot;
                let waits = Waits {
                    since: waiting,
                    epoch,
                };
                connection(stream, &limits, &*handler, &stop, &waits);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a connection thread");
        }
    }
    Ok(())
}

/// The open connections: for each, a handle to close it and since when it waits for a
/// request (ms since the server started, plus one; 0 while inside a handler).
#[derive(Default)]
struct Live {
    next_id: u64,
    conns: Vec<(u64, TcpStream, Arc<AtomicU64>)>,
}

impl Live {
    /// Admits `stream` under a new id, waiting since `now`, closing the connection that has
    /// waited longest for a request when `max` are open; `None` when every open connection is
    /// inside a handler.
    fn admit(&mut self, stream: &TcpStream, max: usize, now: u64) -> Option<(u64, Arc<AtomicU64>)> {
        if self.conns.len() >= max {
            let oldest = self
                .conns
                .iter()
                .enumerate()
                .filter(|(_, (_, _, w))| w.load(Ordering::SeqCst) > 0)
                .min_by_key(|(_, (_, _, w))| w.load(Ordering::SeqCst))
                .map(|(i, _)| i)?;
            let (_, evicted, _) = self.conns.swap_remove(oldest);
            let _ = evicted.shutdown(std::net::Shutdown::Both);
        }
        let handle = stream.try_clone().ok()?;
        self.next_id += 1;
        let waiting = Arc::new(AtomicU64::new(now));
        self.conns
            .push((self.next_id, handle, Arc::clone(&waiting)));
        Some((self.next_id, waiting))
    }
}

/// A connection's place among the open ones, given back when it is dropped.
struct Slot {
    live: Arc<Mutex<Live>>,
    id: u64,
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Ok(mut l) = self.live.lock() {
            l.conns.retain(|(id, _, _)| *id != self.id);
        }
    }
}

/// Where a connection says since when it waits for a request.
struct Waits {
    since: Arc<AtomicU64>,
    epoch: Instant,
}

/// Now as a wait's start: ms since `epoch`, plus one (0 means "inside a handler").
fn stamp(epoch: Instant) -> u64 {
    (epoch.elapsed().as_millis() as u64).saturating_add(1)
}

impl Waits {
    fn waiting(&self) {
        self.since.store(stamp(self.epoch), Ordering::SeqCst);
    }
    fn busy(&self) {
        self.since.store(0, Ordering::SeqCst);
    }
}

/// Why a request could not be read.
enum ReadError {
    /// The connection closed or went idle between requests: close quietly.
    Closed,
    /// Answer with this status and close.
    Status(u16, &'static str),
}

fn connection(
    mut s: TcpStream,
    limits: &Limits,
    handler: &Handler,
    stop: &AtomicBool,
    waits: &Waits,
) {
    let _ = s.set_write_timeout(Some(limits.request_timeout));
    let mut buf: Vec<u8> = Vec::new();
    // A new connection gets `first_byte_timeout` to start; one kept alive after a request
    // waits up to `idle_timeout` for the next.
    let mut idle = limits.first_byte_timeout.min(limits.idle_timeout);
    loop {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let read = read_request(&mut s, &mut buf, limits, idle);
        idle = limits.idle_timeout;
        match read {
            Ok((req, keep_alive)) => {
                waits.busy();
                let reply = handler(&req);
                match reply {
                    Reply::Lose => {
                        let _ = s.write_all(b"HTTP/1.1 2\r\n\r\n");
                        return;
                    }
                    Reply::Stream { headers, body } => {
                        let _ = stream_reply(&mut s, &headers, body, stop);
                        return;
                    }
                    Reply::Response { .. } => {}
                }
                if write_reply(&mut s, reply, keep_alive).is_err() || !keep_alive {
                    return;
                }
                waits.waiting();
            }
            Err(ReadError::Closed) => return,
            Err(ReadError::Status(status, why)) => {
                let _ = write_reply(&mut s, Reply::problem(status, why), false);
                linger(&mut s);
                return;
            }
        }
    }
}

/// Closes a connection whose request was refused unread: the answer is sent, then what the
/// client still sends (the rest of a body too large) is read and dropped for up to two
/// seconds. Closing a socket with unread bytes makes the kernel reset the connection, and a
/// reset can reach the client before it reads the answer: it saw "connection reset" instead of
/// the 413 (a lingering close, as web servers do).
fn linger(s: &mut TcpStream) {
    let _ = s.shutdown(std::net::Shutdown::Write);
    let until = Instant::now() + Duration::from_secs(2);
    let mut sink = Vec::with_capacity(8192);
    while read_some(s, &mut sink, until).is_ok_and(|n| n > 0) {
        sink.clear();
    }
}

/// Reads one request. `buf` keeps bytes of the next request that arrived with this one.
fn read_request(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    limits: &Limits,
    idle: Duration,
) -> Result<(Request, bool), ReadError> {
    let (head_len, deadline) = read_head(s, buf, limits, idle)?;
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut parsed = httparse::Request::new(&mut headers);
    if parsed.parse(buf).is_err() {
        return Err(ReadError::Status(400, "not an HTTP/1.1 request"));
    }
    let method = parsed.method.unwrap_or("").to_string();
    let target = parsed.path.unwrap_or("/").to_string();
    let http10 = parsed.version == Some(0);
    let headers: Vec<(String, Vec<u8>)> = parsed
        .headers
        .iter()
        .map(|h| (h.name.to_string(), h.value.to_vec()))
        .collect();
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    };
    let body_len = body_length(&headers, limits)?;
    let keep_alive = match header("Connection") {
        Some(v) if v.eq_ignore_ascii_case(b"close") => false,
        Some(v) if v.eq_ignore_ascii_case(b"keep-alive") => true,
        _ => !http10,
    };
    let total = head_len + body_len as usize;
    while buf.len() < total {
        match read_some(s, buf, deadline) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(_) => {}
            Err(_) => return Err(ReadError::Status(408, "the request did not arrive in time")),
        }
    }
    let body = buf[head_len..total].to_vec();
    buf.drain(..total);
    let (path, query) = target.split_once('?').unwrap_or((target.as_str(), ""));
    Ok((
        Request {
            method,
            path: path.to_string(),
            query: query.to_string(),
            headers,
            body,
        },
        keep_alive,
    ))
}

/// Reads until `buf` holds a whole request head: waits up to `idle` for a first byte, then
/// the request timeout; the head's length, and the deadline for the rest of the request.
fn read_head(
    s: &mut TcpStream,
    buf: &mut Vec<u8>,
    limits: &Limits,
    idle: Duration,
) -> Result<(usize, Instant), ReadError> {
    // The head: wait up to `idle` for a first byte, then the request timeout.
    let mut deadline: Option<Instant> =
        (!buf.is_empty()).then(|| Instant::now() + limits.request_timeout);
    let idle_until = Instant::now() + idle;
    let head_len = loop {
        let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(buf) {
            Ok(httparse::Status::Complete(n)) => break n,
            Ok(httparse::Status::Partial) => {}
            Err(httparse::Error::TooManyHeaders) => {
                return Err(ReadError::Status(431, "more than 64 headers"));
            }
            Err(_) => return Err(ReadError::Status(400, "not an HTTP/1.1 request")),
        }
        if buf.len() > limits.head_bytes_max {
            return Err(ReadError::Status(431, "the request head is too large"));
        }
        let until = deadline.unwrap_or(idle_until);
        match read_some(s, buf, until) {
            Ok(0) => return Err(ReadError::Closed),
            Ok(_) => {
                deadline.get_or_insert_with(|| Instant::now() + limits.request_timeout);
            }
            Err(_) if deadline.is_none() => return Err(ReadError::Closed),
            Err(_) => return Err(ReadError::Status(408, "the request did not arrive in time")),
        }
    };
    if head_len > limits.head_bytes_max {
        return Err(ReadError::Status(431, "the request head is too large"));
    }
    Ok((
        head_len,
        deadline.unwrap_or_else(|| Instant::now() + limits.request_timeout),
    ))
}

/// The body's length from the head's headers, refused unless it is one plain
/// Content-Length within the limit (no chunked bodies, no second length or host).
fn body_length(headers: &[(String, Vec<u8>)], limits: &Limits) -> Result<u64, ReadError> {
    let header = |name: &str| {
        headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    };
    if header("Transfer-Encoding").is_some() {
        return Err(ReadError::Status(
            411,
            "send the body with a Content-Length",
        ));
    }
    let lengths = headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("Content-Length"))
        .count();
    if lengths > 1 {
        // Two lengths: which one a proxy in front of us believed is anyone's guess.
        return Err(ReadError::Status(
            400,
            "more than one Content-Length header",
        ));
    }
    if headers
        .iter()
        .filter(|(n, _)| n.eq_ignore_ascii_case("Host"))
        .count()
        > 1
    {
        return Err(ReadError::Status(400, "more than one Host header"));
    }
    let body_len = match header("Content-Length") {
        None => 0,
        Some(v) => std::str::from_utf8(v)
            .ok()
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .ok_or(ReadError::Status(400, "Content-Length is not a number"))?,
    };
    if body_len > limits.body_bytes_max as u64 {
        return Err(ReadError::Status(413, "the body is too large"));
    }
    Ok(body_len)
}

/// Reads what is there, waiting at most until `until`. `Err` on a timeout or an error.
fn read_some(s: &mut TcpStream, buf: &mut Vec<u8>, until: Instant) -> std::io::Result<usize> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    s.set_read_timeout(Some(left))?;
    let mut chunk = [0u8; 8192];
    let n = s.read(&mut chunk)?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n)
}

/// `%XX` and `+` decoded; invalid sequences kept as they are.
pub fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(b) => {
                        out.push(b);
                        i += 3;
                    }
                    None => {
                        out.push(b'%');
                        i += 1;
                    }
                }
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
