//! The HTTP API (`/api/v1`) against peers written by others: Schemathesis fuzzes it against
//! its own OpenAPI document on both backends; a client generated from the served document by
//! openapi-python-client runs the README's script as written; and the API's own rules
//! (tokens and roles, the Idempotency-Key, problem details, the long-poll) hold.

use crate::common;
use common::serve::{Served, agent, serve};
use common::*;

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const OPS: &str = "0123456789abcdef-ops";
const JOB: &str = "0123456789abcdef-job";
const OTHER: &str = "0123456789abcdef-other";

/// A token file: an operator (`ops`) and two submitters (`job`, `other`).
fn tokens(d: &Path) -> PathBuf {
    let path = d.join("tokens.txt");
    std::fs::write(
        &path,
        format!("ops {OPS} operator\njob {JOB} submit\nother {OTHER} submit\n"),
    )
    .expect("write the token file");
    path
}

fn served(d: &Path) -> Served {
    let t = tokens(d);
    serve(d, &["--token-file", t.to_str().expect("a UTF-8 path")])
}

/// A Python program of the test venv (`.ci/test` makes it), if it has `module`.
fn venv_tool(name: &str, module: &str) -> Option<PathBuf> {
    let bin = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/mcp-venv/bin");
    let ok = Command::new(bin.join("python"))
        .args(["-c", &format!("import {module}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        missing(
            &format!("the Python package {module} in {}", bin.display()),
            ".ci/test installs it in target/mcp-venv",
        );
        return None;
    }
    Some(bin.join(name))
}

/// A POST of the JSON `body` with `token`.
fn post(url: &str, token: &str, body: &Value) -> (u16, ureq::http::HeaderMap, Value) {
    call("POST", url, Some(token), &[], Some(body))
}

/// One request: (status, headers wanted, body as JSON or Null).
fn call(
    method: &str,
    url: &str,
    token: Option<&str>,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, ureq::http::HeaderMap, Value) {
    let mut req = ureq::http::Request::builder().method(method).uri(url);
    if let Some(t) = token {
        req = req.header("Authorization", format!("Bearer {t}"));
    }
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let text = body.map(|b| b.to_string()).unwrap_or_default();
    if body.is_some() {
        req = req.header("Content-Type", "application/json");
    }
    let mut resp = agent()
        .run(req.body(text).expect("a request"))
        .expect("an answer");
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    (
        status,
        headers,
        serde_json::from_str(&text).unwrap_or(Value::Null),
    )
}

fn header(h: &ureq::http::HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// A refund over the approval threshold: the task suspends until someone approves it.
fn refund(user: &str) -> Value {
    json!({"user": user, "goal": GOAL, "model": "policy:ord_1004:8000"})
}

conformance! {
    /// Schemathesis generates requests from the served document (every operation, the
    /// document's links for the stateful phase) and checks every answer against it: no 5xx,
    /// no status, header or body the document does not declare. The database holds a finished
    /// task and one waiting on an approval, so reads and decisions meet real tasks.
    fn schemathesis_finds_nothing_the_document_does_not_say(d) {
        let Some(st) = venv_tool("schemathesis", "schemathesis") else {
            return;
        };
        enqueue(d, &["--key", "done-1"]);
        enqueue(d, &["--model", "policy:ord_1004:8000", "--key", "held-1"]);
        ok(d, &["run", "--shared", "--drain"]);
        let server = served(d);
        // A daemon runs what Schemathesis creates, so a long poll on a new task answers when
        // it settles, not after the whole wait.
        let mut daemon = command(d)
            .args(["run", "--max-in-flight", "2", "--time-scale", "0", "--shared"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the daemon");
        let seed = seed("schemathesis") % 1_000_000;
        let config = format!("{}/tests/api/schemathesis.toml", env!("CARGO_MANIFEST_DIR"));
        let out = Command::new(st)
            .args(["--config-file", &config, "run"])
            .arg(format!("{}/api/v1/openapi.json", server.base))
            .args(["--checks", "all", "--max-examples", "25", "--no-color"])
            // A long poll may last the whole `wait` the document allows (60 s): a task that
            // never settles meanwhile (its profile's key is not set) is answered then.
            .args(["--request-timeout", "65"])
            .args(["--seed", &seed.to_string()])
            .args(["--header", &format!("Authorization: Bearer {OPS}")])
            .current_dir(d)
            .stdin(Stdio::null())
            .output()
            .expect("run schemathesis");
        let _ = daemon.kill();
        let _ = daemon.wait();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "schemathesis found problems:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // It ran the operations, not nothing.
        assert!(stdout.contains("createTask") || stdout.contains("POST /api/v1/tasks"), "{stdout}");
        assert!(!stdout.contains("No operations"), "{stdout}");
    }

    /// The same request under the same Idempotency-Key is the same task (200, replayed);
    /// another request under it is refused 409; the header is the task's enqueue key.
    fn the_idempotency_key_is_the_enqueue_key(d) {
        let server = served(d);
        let url = format!("{}/api/v1/tasks", server.base);
        let key = [("Idempotency-Key", "\"refund-1004\"")];
        let (s1, h1, t1) = call("POST", &url, Some(JOB), &key, Some(&refund("cu_ana")));
        assert_eq!(s1, 201, "{t1}");
        assert_eq!(header(&h1, "location"), format!("/api/v1/tasks/{}", t1["id"].as_str().unwrap()));
        assert_eq!(t1["key"], "refund-1004");
        let (s2, h2, t2) = call("POST", &url, Some(JOB), &key, Some(&refund("cu_ana")));
        assert_eq!(s2, 200, "{t2}");
        assert_eq!(header(&h2, "idempotent-replayed"), "true");
        assert_eq!(t2["id"], t1["id"]);
        let mut waits_longer = refund("cu_ana");
        waits_longer["approval_wait_ms"] = json!(999_999);
        let (s, _, p) = call("POST", &url, Some(JOB), &key, Some(&waits_longer));
        assert_eq!(s, 409, "another approval wait is another request: {p}");
        let (s3, h3, p) = call("POST", &url, Some(JOB), &key, Some(&refund("cu_bo")));
        assert_eq!(s3, 409, "{p}");
        assert_eq!(header(&h3, "content-type"), "application/problem+json");
        assert_eq!(p["status"], 409);
        assert_eq!(p["title"], "Conflict");
        // The CLI sees the same task under the same key, and one task in all.
        let shown = json(d, &["show", "key:refund-1004", "--json"]);
        assert_eq!(shown["id"], t1["id"]);
        assert_eq!(json_list(d, &["list", "--json"]).len(), 1);
    }
}

/// Tokens and roles: no token is 401; a `submit` token creates tasks and reads only its own
/// (another's is 404, as if it did not exist), and may not list, read the audit log or
/// decide (403); an operator decides, and the audit log names it. Errors are problem details.
#[test]
fn roles_bound_what_a_token_may_do() {
    let dir = TempDir::new("api_roles");
    let d = dir.path();
    let server = served(d);
    let api = format!("{}/api/v1", server.base);
    let (s, h, p) = call("GET", &format!("{api}/tasks/t1"), None, &[], None);
    assert_eq!(s, 401, "{p}");
    assert_eq!(header(&h, "content-type"), "application/problem+json");
    assert_eq!(p["status"], 401);
    assert!(
        header(&h, "www-authenticate").starts_with("Bearer"),
        "{h:?}"
    );
    let (s, _, p) = call(
        "GET",
        &format!("{api}/tasks/t1"),
        Some("x".repeat(20).as_str()),
        &[],
        None,
    );
    assert_eq!(s, 401, "an unknown token: {p}");

    let (s, _, mine) = call(
        "POST",
        &format!("{api}/tasks"),
        Some(JOB),
        &[],
        Some(&refund("cu_ana")),
    );
    assert_eq!(s, 201, "{mine}");
    let (s, _, theirs) = post(&format!("{api}/tasks"), OTHER, &refund("cu_bo"));
    assert_eq!(s, 201, "{theirs}");
    let id = mine["id"].as_str().expect("an id").to_string();
    let (s, _, got) = call("GET", &format!("{api}/tasks/{id}"), Some(JOB), &[], None);
    assert_eq!((s, got["id"].as_str()), (200, Some(id.as_str())), "{got}");
    let (s, _, p) = call("GET", &format!("{api}/tasks/{id}"), Some(OTHER), &[], None);
    assert_eq!(
        s, 404,
        "another submitter's task does not exist for it: {p}"
    );
    for path in ["tasks", "events"] {
        let (s, _, p) = call("GET", &format!("{api}/{path}"), Some(JOB), &[], None);
        assert_eq!(s, 403, "{path}: {p}");
    }
    let (s, _, p) = call(
        "GET",
        &format!("{api}/tasks/{id}/events"),
        Some(JOB),
        &[],
        None,
    );
    assert_eq!(s, 200, "its own task's events: {p}");
    // Another caller's Idempotency-Key: refused, telling nothing of the task (not its id,
    // nor which field differs), even for the very same request.
    for body in [refund("cu_ana"), refund("cu_x")] {
        call(
            "POST",
            &format!("{api}/tasks"),
            Some(JOB),
            &[("Idempotency-Key", "mine")],
            Some(&refund("cu_ana")),
        );
        let (s, _, p) = call(
            "POST",
            &format!("{api}/tasks"),
            Some(OTHER),
            &[("Idempotency-Key", "mine")],
            Some(&body),
        );
        assert_eq!(s, 409, "{p}");
        let detail = p["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("another caller"), "{p}");
        let names_a_task = detail
            .split(|c: char| !c.is_ascii_alphanumeric())
            .any(|w| w.len() > 1 && w.starts_with('t') && w[1..].parse::<u64>().is_ok());
        assert!(!names_a_task, "{p}");
        assert!(!detail.contains("user") && !detail.contains("goal"), "{p}");
    }
    // A submit token lowers its model's limits, never raises them.
    let mut lifted = refund("cu_ana");
    lifted["budget"] = json!({"steps_max": 4_000_000_000u64});
    let (s, _, p) = call(
        "POST",
        &format!("{api}/tasks"),
        Some(JOB),
        &[],
        Some(&lifted),
    );
    assert_eq!(s, 422, "{p}");
    assert!(
        p["detail"]
            .as_str()
            .is_some_and(|d| d.contains("steps_max")),
        "{p}"
    );
    lifted["budget"] = json!({"steps_max": 5});
    let (s, _, p) = post(&format!("{api}/tasks"), JOB, &lifted);
    assert_eq!(s, 201, "{p}");
    let (s, _, p) = post(
        &format!("{api}/tasks"),
        OPS,
        &json!({"user": "cu_ana", "goal": GOAL, "model": "policy", "budget": {"steps_max": 1000}}),
    );
    assert_eq!(s, 201, "an operator may raise them: {p}");

    ok(d, &["run", "--shared", "--drain"]);
    let (_, _, held) = call("GET", &format!("{api}/tasks/{id}"), Some(JOB), &[], None);
    assert_eq!(held["status"], "suspended", "{held}");
    assert_eq!(held["waiting_for"], "approval", "{held}");
    let digest = held["held_call"]["digest"]
        .as_str()
        .expect("a held call")
        .to_string();
    let approve = json!({"reason": "damage confirmed", "digest": digest});
    let (s, _, p) = post(&format!("{api}/tasks/{id}/approve"), JOB, &approve);
    assert_eq!(s, 403, "a submitter does not decide: {p}");
    let wrong = json!({"reason": "r", "digest": "00000000"});
    let (s, _, p) = post(&format!("{api}/tasks/{id}/approve"), OPS, &wrong);
    assert_eq!(s, 409, "a digest of another call: {p}");
    let (s, _, t) = post(&format!("{api}/tasks/{id}/approve"), OPS, &approve);
    assert_eq!(s, 200, "{t}");
    let events = json(d, &["events", &id, "--json"]);
    assert_eq!(events[0]["verb"], "approve", "{events}");
    assert_eq!(events[0]["by"], "ops", "{events}");
    assert_eq!(events[0]["reason"], "damage confirmed", "{events}");
    ok(d, &["run", "--shared", "--drain"]);
    let (_, _, done) = call("GET", &format!("{api}/tasks/{id}"), Some(JOB), &[], None);
    assert_eq!(
        (done["stop"].as_str(), done["outcome"].as_str()),
        (Some("done"), Some("completed")),
        "{done}"
    );
    assert!(
        done["answer"].as_str().is_some_and(|a| !a.is_empty()),
        "{done}"
    );
}

/// Bad requests are problem details that say what was wrong: a body that breaks the
/// document's schema (400, naming the field), a well-formed request the server refuses (422:
/// a script model, a callback URL its config does not allow), a body that is not JSON (400),
/// another media type (415), a body over the limit (413), a wait that is too long (400).
#[test]
fn bad_requests_are_problem_details_that_say_what_was_wrong() {
    let dir = TempDir::new("api_bad");
    let d = dir.path();
    let server = served(d);
    let url = format!("{}/api/v1/tasks", server.base);
    let cases: Vec<(Value, u16, &str)> = vec![
        (json!({"user": "cu_ana"}), 400, "goal"),
        (
            json!({"user": "cu_ana", "goal": "g", "priority": "high"}),
            400,
            "high",
        ),
        (
            json!({"user": "cu_ana", "goal": "g", "colour": 1}),
            400,
            "colour",
        ),
        (
            json!({"user": "cu_ana", "goal": "g", "model": "script:/etc/passwd"}),
            422,
            "script",
        ),
        (
            json!({"user": "cu_ana", "goal": "g", "model": "policy", "callback_url": "http://example.com/"}),
            422,
            "callback",
        ),
    ];
    for (body, status, says) in cases {
        let (s, h, p) = post(&url, OPS, &body);
        assert_eq!(s, status, "{body}: {p}");
        assert_eq!(
            header(&h, "content-type"),
            "application/problem+json",
            "{body}"
        );
        let detail = p["detail"].as_str().unwrap_or_default();
        assert!(
            detail.contains(says),
            "{body}: the detail should name {says}: {p}"
        );
    }
    let raw = |ctype: &str, body: String| {
        let req = ureq::http::Request::builder()
            .method("POST")
            .uri(&url)
            .header("Authorization", format!("Bearer {OPS}"))
            .header("Content-Type", ctype)
            .body(body)
            .expect("a request");
        let mut r = agent().run(req).expect("an answer");
        let text = r.body_mut().read_to_string().unwrap_or_default();
        (r.status().as_u16(), text)
    };
    assert_eq!(raw("application/json", "{not json".into()).0, 400);
    assert_eq!(raw("text/plain", "{}".into()).0, 415);
    let big = format!(
        "{{\"user\":\"cu_ana\",\"goal\":\"{}\"}}",
        "x".repeat(2 << 20)
    );
    assert_eq!(raw("application/json", big).0, 413);
    let (s, _, p) = call("GET", &format!("{url}/t1?wait=10m"), Some(OPS), &[], None);
    assert_eq!(s, 400, "{p}");
    let (s, _, p) = post(&url, OPS, &json!({"user": "cu_ana", "goal": "g"}));
    assert_eq!(s, 422, "{p}");
    assert!(
        p["detail"]
            .as_str()
            .is_some_and(|d| d.contains("name a `model`")),
        "{p}"
    );
    // The key of a schedule's tick is no caller's to take (review 48, hole 3).
    let (s, _, p) = call(
        "POST",
        &url,
        Some(JOB),
        &[(
            "Idempotency-Key",
            "schedule:nightly:2030-01-01T00:00:00.000Z",
        )],
        Some(&json!({"user": "cu_ana", "goal": "g", "model": "policy"})),
    );
    assert_eq!(s, 422, "{p}");
    assert!(
        p["detail"].as_str().is_some_and(|d| d.contains("reserved")),
        "{p}"
    );
    // Nothing of all that made a task.
    assert!(json_list(d, &["list", "--json"]).is_empty());
}

/// Review 48, hole 2: `start_in`, `not_before`, `ttl`, `finish_within` and `concurrency_key`
/// were answered 201 and dropped, so a delayed refund went out at once. Each is now stored as
/// `worker enqueue` stores it, and a time to live that ran out stops the task `expired` with
/// nothing sent.
#[test]
fn every_field_of_a_create_is_applied() {
    let dir = TempDir::new("api_fields");
    let d = dir.path();
    let server = served(d);
    let url = format!("{}/api/v1/tasks", server.base);
    let before = tether::clock::now_ms();
    let mut body = json!({"user": "cu_ana", "goal": GOAL, "model": "policy",
        "start_in": "1h", "ttl": "2h", "finish_within": "3h", "concurrency_key": "tenant:acme"});
    let (s, _, t1) = post(&url, JOB, &body);
    assert_eq!(s, 201, "{t1}");
    body = json!({"user": "cu_ana", "goal": GOAL, "model": "policy",
        "not_before": "2099-01-01T00:00:00Z"});
    let (s, _, t2) = post(&url, JOB, &body);
    assert_eq!(s, 201, "{t2}");
    let (s, _, t3) = post(
        &url,
        JOB,
        &json!({"user": "cu_ana", "goal": GOAL, "model": "policy", "ttl": "1s"}),
    );
    assert_eq!(s, 201, "{t3}");
    let store = tether::store::RedbStore::open_for_reading(&d.join("worker.redb")).expect("open");
    use tether::store::prelude::*;
    let hour = 3_600_000;
    let r1 = store.task(t1["id"].as_str().expect("an id")).expect("t1");
    let start = r1.not_before_ms.expect("start_in is stored");
    assert!(
        (before + hour..before + hour + 60_000).contains(&start),
        "{start}"
    );
    let ttl = r1.time_limits.expires_at_ms.expect("ttl is stored");
    assert!(
        (before + 2 * hour..before + 2 * hour + 60_000).contains(&ttl),
        "{ttl}"
    );
    let finish = r1
        .time_limits
        .deadline_at_ms
        .expect("finish_within is stored");
    assert!(
        (before + 3 * hour..before + 3 * hour + 60_000).contains(&finish),
        "{finish}"
    );
    assert_eq!(r1.concurrency_key.as_deref(), Some("tenant:acme"));
    let r2 = store.task(t2["id"].as_str().expect("an id")).expect("t2");
    assert_eq!(
        r2.not_before_ms,
        Some(tether::clock::parse_rfc3339("2099-01-01T00:00:00Z").expect("a time"))
    );
    drop(store);
    // The time to live runs out before a daemon picks the task up: nothing is sent.
    std::thread::sleep(std::time::Duration::from_millis(1_200));
    ok(d, &["cancel", t1["id"].as_str().expect("an id")]);
    ok(d, &["cancel", t2["id"].as_str().expect("an id")]);
    ok(d, &["run", "--shared", "--drain"]);
    let t = json(d, &["show", t3["id"].as_str().expect("an id"), "--json"]);
    assert_eq!(t["stop"], "expired", "{t}");
    assert!(
        json(d, &["store", "arrivals", "--json"])
            .as_array()
            .is_none_or(Vec::is_empty),
        "nothing was sent"
    );
}

/// Review 48, design hole: a submit token could name any `user`, so its tasks acted for that
/// user (with the user's remembered notes and the tools' per-user checks). A token line's
/// `users=PATTERN` limits the users its tasks may act for.
#[test]
fn a_submit_token_acts_only_for_its_users() {
    let dir = TempDir::new("api_users");
    let d = dir.path();
    let t = d.join("tokens.txt");
    std::fs::write(
        &t,
        format!(
            "ops {OPS} operator
job {JOB} submit users=cu_*
other {OTHER} submit
"
        ),
    )
    .expect("tokens");
    let server = serve(d, &["--token-file", t.to_str().expect("a UTF-8 path")]);
    let url = format!("{}/api/v1/tasks", server.base);
    let task = |user: &str| json!({"user": user, "goal": GOAL, "model": "policy"});
    let (s, _, p) = post(&url, JOB, &task("cu_ana"));
    assert_eq!(s, 201, "{p}");
    let (s, h, p) = post(&url, JOB, &task("ops"));
    assert_eq!(s, 403, "{p}");
    assert_eq!(header(&h, "content-type"), "application/problem+json");
    assert!(
        p["detail"].as_str().is_some_and(|d| d.contains("cu_*")),
        "{p}"
    );
    // A token without a pattern, and an operator's, act for anyone.
    assert_eq!(post(&url, OTHER, &task("ops")).0, 201);
    assert_eq!(post(&url, OPS, &task("ops")).0, 201);
    assert_eq!(json_list(d, &["list", "--json"]).len(), 3);
}

/// A client that sends a body over the limit whole before it reads the answer gets the 413,
/// not "connection reset": the server reads and drops the rest of the body after answering
/// (a socket closed with unread bytes resets the connection, and the reset can overtake the
/// answer).
#[test]
fn a_body_too_large_sent_whole_still_gets_its_answer() {
    use std::io::{Read, Write};
    let dir = TempDir::new("api_too_large");
    let server = served(dir.path());
    let addr = server.base.trim_start_matches("http://").to_string();
    for round in 0..3 {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        let len = 16usize << 20;
        let head = format!(
            "POST /api/v1/tasks HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {OPS}\r\n\
             Content-Type: application/json\r\nContent-Length: {len}\r\n\r\n"
        );
        s.write_all(head.as_bytes()).expect("the head");
        let chunk = vec![b' '; 64 << 10];
        let mut sent = 0;
        while sent < len {
            match s.write(&chunk) {
                Ok(n) => sent += n,
                Err(e) => panic!("round {round}: the body was cut off after {sent} bytes: {e}"),
            }
        }
        let mut answer = Vec::new();
        let read = s.read_to_end(&mut answer);
        let text = String::from_utf8_lossy(&answer);
        assert!(
            read.is_ok() && text.starts_with("HTTP/1.1 413"),
            "round {round}: {read:?} {text}"
        );
        assert!(text.contains("application/problem+json"), "{text}");
    }
}

/// `GET /tasks/{id}?wait=` returns as soon as the task finishes (here: when a daemon started
/// after the request ran it), and after the wait with the task as it is when it does not.
#[test]
fn a_long_poll_returns_when_the_task_finishes() {
    let dir = TempDir::new("api_wait");
    let d = dir.path();
    let server = served(d);
    let api = format!("{}/api/v1", server.base);
    let (_, _, t) = post(
        &format!("{api}/tasks"),
        OPS,
        &json!({"user": "cu_ana", "goal": GOAL, "model": "policy"}),
    );
    let id = t["id"].as_str().expect("an id").to_string();
    let (s, _, still) = call(
        "GET",
        &format!("{api}/tasks/{id}?wait=1s"),
        Some(OPS),
        &[],
        None,
    );
    assert_eq!(
        (s, still["status"].as_str()),
        (200, Some("queued")),
        "{still}"
    );
    let url = format!("{api}/tasks/{id}?wait=60s");
    let poll = std::thread::spawn(move || call("GET", &url, Some(OPS), &[], None));
    std::thread::sleep(std::time::Duration::from_millis(500));
    ok(d, &["run", "--shared", "--drain", "--time-scale", "0.1"]);
    let (s, _, done) = poll.join().expect("the poll answers");
    assert_eq!(s, 200, "{done}");
    assert_eq!(
        done["status"], "finished",
        "the long poll saw the finish: {done}"
    );
    assert_eq!(done["outcome"], "completed", "{done}");
}

/// Issue 53: `?wait=&until=finished` waits through a wait on a person: a long poll on a task
/// suspended for an approval returns once an operator approved it and a daemon finished it,
/// where the default returns at once with the task waiting; an unknown `until` is a 400.
#[test]
fn a_long_poll_until_finished_goes_through_an_approval() {
    let dir = TempDir::new("api_wait_through");
    let d = dir.path();
    let server = served(d);
    let api = format!("{}/api/v1", server.base);
    let (_, _, t) = post(
        &format!("{api}/tasks"),
        OPS,
        &json!({"user": "cu_ana", "goal": GOAL, "model": "policy:ord_1004:8000"}),
    );
    let id = t["id"].as_str().expect("an id").to_string();
    ok(d, &["run", "--shared", "--drain", "--time-scale", "0.01"]);
    let (s, _, now) = call(
        "GET",
        &format!("{api}/tasks/{id}?wait=5s"),
        Some(OPS),
        &[],
        None,
    );
    assert_eq!(
        (s, now["status"].as_str()),
        (200, Some("suspended")),
        "{now}"
    );
    let (s, _, p) = call(
        "GET",
        &format!("{api}/tasks/{id}?wait=5s&until=later"),
        Some(OPS),
        &[],
        None,
    );
    assert_eq!(s, 400, "{p}");
    let url = format!("{api}/tasks/{id}?wait=60s&until=finished");
    let poll = std::thread::spawn(move || call("GET", &url, Some(OPS), &[], None));
    let shown = json(d, &["show", &id, "--json"]);
    let digest = shown["held"]["digest"]
        .as_str()
        .expect("digest")
        .to_string();
    std::thread::sleep(std::time::Duration::from_millis(300));
    ok(d, &["approve", &id, "--digest", &digest, "--by", "alice"]);
    ok(d, &["run", "--shared", "--drain", "--time-scale", "0.01"]);
    let (s, _, done) = poll.join().expect("the poll answers");
    assert_eq!(s, 200, "{done}");
    assert_eq!(
        done["status"], "finished",
        "the poll waited through the approval: {done}"
    );
    assert_eq!(done["outcome"], "completed", "{done}");
}

/// Review 48, hole 4: a submit token holding 128 long polls made every operator request,
/// decision, console page, `/healthz` and `/metrics` get 503: a long poll is inside its
/// handler, where the server cannot make room. Long polls are bounded per token and in total
/// now: the token's polls past its bound are answered 429 at once, and the operator's
/// requests are served while the rest wait.
#[test]
fn long_polls_never_lock_operators_out() {
    use std::io::{Read, Write};
    let dir = TempDir::new("api_polls");
    let d = dir.path();
    let server = served(d);
    let (_, _, t) = post(
        &format!("{}/api/v1/tasks", server.base),
        JOB,
        &json!({"user": "cu_ana", "goal": GOAL, "model": "policy"}),
    );
    let id = t["id"].as_str().expect("an id").to_string();
    let addr = server.base.trim_start_matches("http://").to_string();
    // 128 long polls of one submit token, each on a connection of its own (no daemon runs:
    // the task stays queued, so an admitted poll waits its whole minute).
    let mut polls = Vec::new();
    for _ in 0..128 {
        let mut s = std::net::TcpStream::connect(&addr).expect("connect");
        let req = format!(
            "GET /api/v1/tasks/{id}?wait=60s HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {JOB}\r\n\r\n"
        );
        s.write_all(req.as_bytes()).expect("send");
        polls.push(s);
    }
    let mut refused = 0;
    let mut waiting = 0;
    // Every refusal comes at once; what has not answered within 3 s is held.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(3);
    for s in &mut polls {
        let left = until.saturating_duration_since(std::time::Instant::now());
        s.set_read_timeout(Some(left.max(std::time::Duration::from_millis(1))))
            .expect("timeout");
        let mut head = [0u8; 12];
        match s.read_exact(&mut head) {
            Ok(()) if head.starts_with(b"HTTP/1.1 429") => refused += 1,
            Ok(()) => panic!("a long poll answered {}", String::from_utf8_lossy(&head)),
            Err(_) => waiting += 1,
        }
    }
    assert_eq!(waiting, 16, "one token's long polls held at once");
    assert_eq!(refused, 112);
    for path in ["/api/v1/tasks", "/healthz", "/metrics", "/"] {
        let (s, _, body) = call(
            "GET",
            &format!("{}{path}", server.base),
            Some(OPS),
            &[],
            None,
        );
        assert_eq!(s, 200, "{path}: {body}");
    }
    let (s, _, body) = post(
        &format!("{}/api/v1/tasks/{id}/cancel", server.base),
        OPS,
        &json!({"reason": "done testing"}),
    );
    assert_eq!(s, 200, "a decision: {body}");
}

/// The document served at `/api/v1/openapi.json` is the committed `docs/openapi.json`.
#[test]
fn the_served_document_is_the_committed_one() {
    let dir = TempDir::new("api_doc");
    let server = served(dir.path());
    let (s, _, served_doc) = call(
        "GET",
        &format!("{}/api/v1/openapi.json", server.base),
        None,
        &[],
        None,
    );
    assert_eq!(s, 200);
    let path = format!("{}/docs/openapi.json", env!("CARGO_MANIFEST_DIR"));
    let committed: Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("the document")).expect("JSON");
    assert_eq!(served_doc, committed);
    assert_eq!(
        committed["openapi"].as_str().map(|v| v.starts_with("3.1")),
        Some(true)
    );
}

/// The README's "Call it from a job or a service" client, as written: the generation command
/// and the Python script are read from the README, the client is generated from the served
/// document, and the script creates a task under an idempotency key, waits for it, approves
/// its held write and prints the result, with the API served by the daemon (`run --console`).
#[test]
fn the_guides_generated_client_script_runs_as_written() {
    let Some(generator) = venv_tool("openapi-python-client", "openapi_python_client") else {
        return;
    };
    let dir = TempDir::new("api_client");
    let d = dir.path();
    // As the guide runs it: the daemon serves the API itself.
    let t = tokens(d);
    let server = common::serve::spawn(
        d,
        &[
            "run",
            "--max-in-flight",
            "2",
            "--time-scale",
            "0.1",
            "--console",
            "127.0.0.1:0",
            "--console-token-file",
            t.to_str().expect("a UTF-8 path"),
        ],
    );
    let readme = std::fs::read_to_string(format!(
        "{}/docs/guides/jobs-and-api.md",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("the guide");
    let generate = block_after(&readme, "<!-- client: generate -->");
    let script = block_after(&readme, "<!-- client: script -->");
    let command_line = generate
        .lines()
        .find(|l| l.starts_with("openapi-python-client generate"))
        .expect("the guide's generate command")
        .replace("http://127.0.0.1:8080", &server.base);
    let args: Vec<&str> = command_line.split_whitespace().skip(1).collect();
    let out = Command::new(&generator)
        .args(&args)
        .current_dir(d)
        .output()
        .expect("run openapi-python-client");
    assert!(
        out.status.success(),
        "generate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::write(d.join("refund.py"), script).expect("write the script");
    let python = generator.with_file_name("python");
    let run = |env: &[(&str, &str)]| {
        Command::new(&python)
            .arg("refund.py")
            .env("TETHER_URL", &server.base)
            .env("TETHER_TOKEN", OPS)
            .envs(env.iter().copied())
            .current_dir(d)
            .output()
            .expect("run the script")
    };
    let out = run(&[]);
    // Issue 52: with another agent, a task that ends without an answer prints why, not
    // "None: None".
    let other = run(&[
        ("TETHER_MODEL", "new_ids"),
        ("TETHER_GOAL", "look up a new order every step"),
        ("TETHER_KEY", "new-ids-1"),
    ]);
    drop(server);
    let said = String::from_utf8_lossy(&other.stdout);
    assert!(
        other.status.success(),
        "{said}\n{}",
        String::from_utf8_lossy(&other.stderr)
    );
    assert!(
        said.contains("no_progress: The task stopped because its last steps made no progress."),
        "{said}"
    );
    assert!(!said.contains("None"), "{said}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the script failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("waiting for approval"), "{stdout}");
    assert!(stdout.contains("completed: Refund issued"), "{stdout}");
    let t = json(d, &["show", "key:refund-ord_1004", "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(
        json(d, &["events", "key:refund-ord_1004", "--json"])[0]["by"],
        "ops"
    );
    assert_eq!(refund_amounts(&ledger(d)), vec![8000], "one refund, once");
}

/// The first fenced block after `marker` in `text`.
fn block_after(text: &str, marker: &str) -> String {
    let rest = &text[text
        .find(marker)
        .unwrap_or_else(|| panic!("the guide has no {marker}"))..];
    let start = rest.find("```").expect("a fenced block");
    let body = &rest[start..];
    let body = &body[body.find('\n').expect("a fence line") + 1..];
    body[..body.find("```").expect("the block ends")].to_string()
}
