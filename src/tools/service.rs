//! The document's store as an HTTP service (`worker demo-store`), with Stripe's idempotency
//! semantics and fault injection, for tests and for trying the worker against real HTTP.
//!
//! - `POST /tools/NAME` with `{"user_id", "args"}` and an `Idempotency-Key` header (required for
//!   writes). The same key with the same payload returns the stored response; the same key with
//!   a different payload is refused with 422; a request whose key is still in flight gets 409.
//! - `GET /lookup/NAME?key=K` answers `{"applied": true, "result": ...}` or `{"applied": false}`
//!   (409 while the key is in flight): what `worker reconcile --auto` asks.
//! - An approved call carries `Tether-Approval: DIGEST` (the digest of tool and args the
//!   operator approved, from the worker database); it counts only if it is this call's digest.
//!   A `needs_approval` answer is never stored as the key's response, so the approved call
//!   that follows under the same key is decided afresh.
//! - Every write request is logged in the store's arrivals log, whatever was done with it.
//! - Faults: added latency, lost responses (the write is applied, then the connection gets a
//!   broken answer), and a rate of 503 answers given before anything is applied.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::durable::DurableStore;
use crate::http::parse_tool_body;

#[derive(Clone, Debug, Default)]
pub struct Faults {
    pub latency_ms: u64,
    /// Fraction of write calls whose response is lost after the write was applied.
    pub lose_rate: f64,
    /// Fraction of calls answered 503 before anything is applied.
    pub error_rate: f64,
    pub seed: u64,
}

const WRITES: [&str; 2] = ["issue_refund", "send_status_email"];
const TOOLS: [&str; 4] = [
    "get_order",
    "search_policy",
    "issue_refund",
    "send_status_email",
];

struct Service {
    store: DurableStore,
    faults: Faults,
    in_flight: Mutex<HashSet<String>>,
    rng: AtomicU64,
}

impl Service {
    /// A draw in [0, 1) from a shared splitmix64 stream.
    fn draw(&self) -> f64 {
        let mut z = self
            .rng
            .fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed)
            .wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn payload_digest(name: &str, user: &str, args: &serde_json::Map<String, Value>) -> String {
    let text = json!([name, user, args]).to_string();
    crate::kernel::state::hex_prefix(&Sha256::digest(text.as_bytes()), 32)
}

/// Runs the service on `listen` until `stop` is set. Calls `ready` with the bound address.
pub fn serve(
    store: DurableStore,
    listen: &str,
    faults: Faults,
    threads: usize,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(String),
) -> Result<(), String> {
    let server =
        tiny_http::Server::http(listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
    let addr = server.server_addr().to_string();
    ready(addr);
    let server = Arc::new(server);
    let svc = Arc::new(Service {
        store,
        rng: AtomicU64::new(faults.seed),
        faults,
        in_flight: Mutex::new(HashSet::new()),
    });
    let mut handles = Vec::new();
    for _ in 0..threads.max(1) {
        let (server, svc, stop) = (Arc::clone(&server), Arc::clone(&svc), Arc::clone(&stop));
        handles.push(std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                match server.recv_timeout(Duration::from_millis(200)) {
                    Ok(Some(req)) => handle(&svc, req),
                    Ok(None) => {}
                    Err(_) => break,
                }
            }
        }));
    }
    for h in handles {
        let _ = h.join();
    }
    Ok(())
}

fn respond(req: tiny_http::Request, status: u16, body: Value) {
    let header = tiny_http::Header::from_bytes(&b"Content-Type"[..], &b"application/json"[..]);
    let mut resp = tiny_http::Response::from_string(body.to_string()).with_status_code(status);
    if let Ok(h) = header {
        resp = resp.with_header(h);
    }
    let _ = req.respond(resp);
}

/// A response that never arrives whole: the client sees a broken connection.
fn lose(req: tiny_http::Request) {
    let mut w = req.into_writer();
    // A status line no client can parse: the answer is lost on the wire, at once.
    let _ = w.write_all(b"HTTP/1.1 2\r\n\r\n");
    let _ = w.flush();
}

fn handle(svc: &Service, mut req: tiny_http::Request) {
    let url = req.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((url.as_str(), ""));
    let method = req.method().as_str().to_string();
    if path == "/health" {
        return respond(req, 200, json!({"ok": true}));
    }
    if let Some(name) = path.strip_prefix("/lookup/") {
        let key = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("key="))
            .unwrap_or("");
        let key = percent_decode(key);
        if key.is_empty() || !TOOLS.contains(&name) {
            return respond(req, 400, json!({"error": "GET /lookup/TOOL?key=CALL_KEY"}));
        }
        if svc.in_flight.lock().is_ok_and(|f| f.contains(&key)) {
            return respond(req, 409, json!({"error": "the key is in flight"}));
        }
        return match svc.store.lookup(&key, name) {
            Ok(Some(result)) => respond(req, 200, json!({"applied": true, "result": result})),
            Ok(None) => respond(req, 200, json!({"applied": false})),
            Err(e) => respond(req, 500, json!({"error": e.to_string()})),
        };
    }
    let Some(name) = path.strip_prefix("/tools/").map(str::to_string) else {
        return respond(req, 404, json!({"error": "unknown path"}));
    };
    if method != "POST" {
        return respond(req, 405, json!({"error": "use POST"}));
    }
    if !TOOLS.contains(&name.as_str()) {
        return respond(req, 404, json!({"error": format!("unknown tool {name:?}")}));
    }
    let mut body = String::new();
    if req.as_reader().read_to_string(&mut body).is_err() {
        return respond(req, 400, json!({"error": "unreadable body"}));
    }
    let (user, args) = match parse_tool_body(&body) {
        Ok(x) => x,
        Err(e) => return respond(req, 400, json!({"error": e})),
    };
    let write = WRITES.contains(&name.as_str());
    let key = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Idempotency-Key"))
        .map(|h| h.value.as_str().to_string());
    let Some(key) = key.filter(|k| !k.is_empty()) else {
        if write {
            return respond(
                req,
                400,
                json!({"error": "a write needs an Idempotency-Key header"}),
            );
        }
        return run(svc, req, &name, &user, &args, "", false);
    };
    let digest = payload_digest(&name, &user, &args);
    let call_digest = crate::kernel::state::digest(&name, &args);
    let approval = req
        .headers()
        .iter()
        .find(|h| h.field.equiv("Tether-Approval"))
        .map(|h| h.value.as_str().to_string());
    let arrive = |outcome: &str| {
        if write {
            let _ = svc.store.arrive(&key, &name, &call_digest, outcome);
        }
    };
    {
        let Ok(mut f) = svc.in_flight.lock() else {
            return respond(req, 500, json!({"error": "lock poisoned"}));
        };
        if !f.insert(key.clone()) {
            drop(f);
            arrive("in_flight");
            return respond(
                req,
                409,
                json!({"error": "a request with this key is in flight"}),
            );
        }
    }
    // Stripe: the same key must carry the same payload.
    match svc.store.idempotent_response(&key) {
        Ok(Some((d, resp))) => {
            svc.in_flight.lock().map(|mut f| f.remove(&key)).ok();
            if d == digest {
                arrive("replayed");
                return respond(req, 200, resp);
            }
            arrive("conflict");
            return respond(
                req,
                422,
                json!({"error": "this Idempotency-Key was used with a different payload"}),
            );
        }
        Ok(None) => {}
        Err(e) => {
            svc.in_flight.lock().map(|mut f| f.remove(&key)).ok();
            return respond(req, 500, json!({"error": e.to_string()}));
        }
    }
    if svc.faults.error_rate > 0.0 && svc.draw() < svc.faults.error_rate {
        svc.in_flight.lock().map(|mut f| f.remove(&key)).ok();
        arrive("refused");
        return respond(
            req,
            503,
            json!({"error": "injected fault: service unavailable"}),
        );
    }
    let result = svc
        .store
        .call_once("", &user, &name, &args, &key, write, approval.as_deref());
    let outcome = match result {
        Ok((res, _replayed)) => {
            // A call waiting for approval is not answered for good: the approved call that
            // follows under the same key must be decided afresh.
            if write && res["status"] != "needs_approval" {
                let _ = svc.store.remember_response(&key, &digest, &res);
            }
            Ok(res)
        }
        Err(e) => Err(e.to_string()),
    };
    if svc.faults.latency_ms > 0 {
        std::thread::sleep(Duration::from_millis(svc.faults.latency_ms));
    }
    svc.in_flight.lock().map(|mut f| f.remove(&key)).ok();
    match outcome {
        Ok(_) if write && svc.faults.lose_rate > 0.0 && svc.draw() < svc.faults.lose_rate => {
            lose(req)
        }
        Ok(res) => respond(req, 200, res),
        Err(e) => respond(req, 500, json!({"error": e})),
    }
}

fn run(
    svc: &Service,
    req: tiny_http::Request,
    name: &str,
    user: &str,
    args: &serde_json::Map<String, Value>,
    key: &str,
    write: bool,
) {
    match svc.store.call_once("", user, name, args, key, write, None) {
        Ok((res, _)) => respond(req, 200, res),
        Err(e) => respond(req, 500, json!({"error": e.to_string()})),
    }
}

fn percent_decode(s: &str) -> String {
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
