//! The demo shop as an HTTP service (`worker demo-store`), with Stripe's idempotency
//! semantics and fault injection, for tests and for trying the worker against real HTTP.
//!
//! - `POST /tools/NAME` with `{"user_id", "args"}` and an `Idempotency-Key` header (required for
//!   writes). The same key with the same payload returns the stored response; the same key with
//!   a different payload is refused with 422; a request whose key is still in flight gets 409.
//! - `GET /lookup/NAME?key=K` answers `{"applied": true, "result": ...}` or `{"applied": false}`
//!   (409 while the key is in flight): what `worker reconcile --auto` asks.
//! - An approved call carries `Tether-Approval: t=..,d=..,v1=..`, signed by the worker with
//!   the approval secret this service shares with it (`--approval-secret-env`); it counts only
//!   if it verifies for this call's key and digest and has not expired
//!   ([`super::approval::verify`]). A digest alone, which anyone can compute, approves nothing.
//!   A `needs_approval` answer is never stored as the key's response, so the approved call
//!   that follows under the same key is decided afresh.
//! - Every write request is logged in the store's arrivals log, whatever was done with it.
//! - A replayed answer carries `Idempotent-Replayed: true`. Keys are printable ASCII of at
//!   most 255 bytes; bodies, heads, connections and read time are bounded by [`crate::httpd`].
//! - Faults: added latency, lost responses (the write is applied, then the connection gets a
//!   broken answer), and a rate of 503 answers given before anything is applied.

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::durable::DurableStore;
use crate::httpd::{Reply, Request};
use crate::tools::http::parse_tool_body;

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

/// How `worker demo-store` serves.
pub struct Options {
    pub faults: Faults,
    pub connections: usize,
    pub read_timeout: Duration,
    /// The secret approvals are signed with; `None`: no approval is ever accepted.
    pub approval_secret: Option<Vec<u8>>,
}

struct Service {
    store: DurableStore,
    faults: Faults,
    approval_secret: Option<Vec<u8>>,
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
/// At most `connections` are served at once; see [`crate::httpd`] for the other limits.
pub fn serve(
    store: DurableStore,
    listen: &str,
    opts: Options,
    stop: Arc<AtomicBool>,
    ready: impl FnOnce(String),
) -> Result<(), String> {
    let Options {
        faults,
        connections,
        read_timeout,
        approval_secret,
    } = opts;
    let svc = Arc::new(Service {
        store,
        rng: AtomicU64::new(faults.seed),
        faults,
        approval_secret,
        in_flight: Mutex::new(HashSet::new()),
    });
    let limits = crate::httpd::Limits {
        connections_max: connections.max(1),
        request_timeout: read_timeout,
        ..Default::default()
    };
    crate::httpd::serve(
        listen,
        limits,
        stop,
        ready,
        Arc::new(move |req| handle(&svc, req)),
    )
}

fn respond(status: u16, body: Value) -> Reply {
    Reply::json(status, &body)
}

/// Stripe refuses idempotency keys over 255 characters; so does this service, and keys that
/// are not printable ASCII.
fn check_key(raw: &[u8]) -> Result<String, String> {
    let limit = crate::limits::NAME_BYTES_MAX;
    if raw.len() > limit {
        return Err(format!(
            "Idempotency-Key is {} bytes, over the limit of {limit}",
            raw.len()
        ));
    }
    if !raw.iter().all(|b| b.is_ascii_graphic()) {
        return Err("Idempotency-Key must be printable ASCII without spaces".into());
    }
    Ok(String::from_utf8_lossy(raw).into_owned())
}

fn handle(svc: &Service, req: &Request) -> Reply {
    let path = req.path.as_str();
    if path == "/health" {
        return respond(200, json!({"ok": true}));
    }
    if let Some(name) = path.strip_prefix("/lookup/") {
        return lookup(svc, name, req);
    }
    let Some(name) = path.strip_prefix("/tools/") else {
        return respond(404, json!({"error": "unknown path"}));
    };
    if req.method != "POST" {
        return respond(405, json!({"error": "use POST"}));
    }
    if !TOOLS.contains(&name) {
        return respond(404, json!({"error": format!("unknown tool {name:?}")}));
    }
    let Ok(body) = std::str::from_utf8(&req.body) else {
        return respond(400, json!({"error": "the body is not UTF-8"}));
    };
    let (user, args) = match parse_tool_body(body) {
        Ok(x) => x,
        Err(e) => return respond(400, json!({"error": e})),
    };
    let write = WRITES.contains(&name);
    let key = match req.header("Idempotency-Key").map(check_key) {
        None => None,
        Some(Ok(k)) => Some(k),
        Some(Err(e)) => return respond(400, json!({"error": e})),
    };
    let Some(key) = key.filter(|k| !k.is_empty()) else {
        if write {
            return respond(
                400,
                json!({"error": "a write needs an Idempotency-Key header"}),
            );
        }
        return run(svc, name, &user, &args, "", false);
    };
    let call = Keyed {
        name,
        user: &user,
        args: &args,
        key: &key,
        write,
    };
    keyed(svc, req, &call)
}

/// `GET /lookup/TOOL?key=K`: whether the write under key K was applied, and its result.
fn lookup(svc: &Service, name: &str, req: &Request) -> Reply {
    let key = req.param("key").unwrap_or_default();
    if key.is_empty() || !TOOLS.contains(&name) {
        return respond(400, json!({"error": "GET /lookup/TOOL?key=CALL_KEY"}));
    }
    if let Err(e) = check_key(key.as_bytes()) {
        return respond(400, json!({"error": e}));
    }
    if svc.in_flight.lock().is_ok_and(|f| f.contains(&key)) {
        return respond(409, json!({"error": "the key is in flight"}));
    }
    match svc.store.lookup(&key, name) {
        Ok(Some(result)) => respond(200, json!({"applied": true, "result": result})),
        Ok(None) => respond(200, json!({"applied": false})),
        Err(e) => respond(500, json!({"error": e.to_string()})),
    }
}

/// A tool call under an idempotency key.
struct Keyed<'a> {
    name: &'a str,
    user: &'a str,
    args: &'a serde_json::Map<String, Value>,
    key: &'a str,
    write: bool,
}

/// A keyed call, as Stripe runs one: one request per key at a time, the stored response
/// for the same payload again, 422 for another payload under a used key; then the injected
/// faults.
fn keyed(svc: &Service, req: &Request, c: &Keyed) -> Reply {
    let (name, key) = (c.name, c.key);
    let digest = payload_digest(name, c.user, c.args);
    let call_digest = crate::kernel::state::digest(name, c.args);
    let approval = approval(svc, req, c).then(|| call_digest.clone());
    let arrive = |outcome: &str| {
        if c.write {
            let _ = svc.store.arrive(key, name, &call_digest, outcome);
        }
    };
    let done = || svc.in_flight.lock().map(|mut f| f.remove(key)).ok();
    {
        let Ok(mut f) = svc.in_flight.lock() else {
            return respond(500, json!({"error": "lock poisoned"}));
        };
        if !f.insert(key.to_string()) {
            drop(f);
            arrive("in_flight");
            return respond(
                409,
                json!({"error": "a request with this key is in flight"}),
            );
        }
    }
    // Stripe: the same key must carry the same payload.
    match svc.store.idempotent_response(key) {
        Ok(Some((d, resp))) => {
            done();
            if d == digest {
                arrive("replayed");
                return respond(200, resp).with_header("Idempotent-Replayed", "true");
            }
            arrive("conflict");
            return respond(
                422,
                json!({"error": "this Idempotency-Key was used with a different payload"}),
            );
        }
        Ok(None) => {}
        Err(e) => {
            done();
            return respond(500, json!({"error": e.to_string()}));
        }
    }
    if svc.faults.error_rate > 0.0 && svc.draw() < svc.faults.error_rate {
        done();
        arrive("refused");
        return respond(503, json!({"error": "injected fault: service unavailable"}));
    }
    let result = (svc.store).call_once("", c.user, name, c.args, key, c.write, approval.as_deref());
    let outcome = match result {
        Ok((res, _replayed)) => {
            // A call waiting for approval is not answered for good: the approved call that
            // follows under the same key must be decided afresh.
            if c.write && res["status"] != "needs_approval" {
                let _ = svc.store.remember_response(key, &digest, &res);
            }
            Ok(res)
        }
        Err(e) => Err(e.to_string()),
    };
    if svc.faults.latency_ms > 0 {
        std::thread::sleep(Duration::from_millis(svc.faults.latency_ms));
    }
    done();
    match outcome {
        Ok(_) if c.write && svc.faults.lose_rate > 0.0 && svc.draw() < svc.faults.lose_rate => {
            Reply::Lose
        }
        Ok(res) => respond(200, res),
        Err(e) => respond(500, json!({"error": e})),
    }
}

/// Whether the request carries an approval of this very call that verifies; only then
/// does the store see the call's digest as approved.
fn approval(svc: &Service, req: &Request, c: &Keyed) -> bool {
    let Some(v) = req.header(super::approval::HEADER) else {
        return false;
    };
    let header = String::from_utf8_lossy(v);
    let Some(secret) = &svc.approval_secret else {
        tracing::warn!(key = %c.key, "an approval arrived, but this service has no approval secret");
        return false;
    };
    let now_s = crate::clock::now_ms() / 1000;
    let hash = crate::kernel::state::call_hash(c.name, c.args);
    let call = super::approval::Call {
        key: c.key,
        user: c.user,
        hash: &hash,
    };
    match super::approval::verify(secret, &header, &call, now_s) {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(key = %c.key, error = %e, "approval refused");
            false
        }
    }
}

fn run(
    svc: &Service,
    name: &str,
    user: &str,
    args: &serde_json::Map<String, Value>,
    key: &str,
    write: bool,
) -> Reply {
    match svc.store.call_once("", user, name, args, key, write, None) {
        Ok((res, _)) => respond(200, res),
        Err(e) => respond(500, json!({"error": e.to_string()})),
    }
}
