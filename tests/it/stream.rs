//! Issue 53's live event stream, on both backends: `GET /api/v1/tasks/{id}/events` as
//! Server-Sent Events read by a client written by others (httpx-sse) that goes away mid-task
//! and comes back with `Last-Event-ID` while a daemon is killed and another finishes the task
//! through an approval: it misses nothing and sees nothing twice. `worker watch` follows a
//! task in a terminal and resumes with `--after`.

use crate::common;
use common::serve::serve;
use common::*;

use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const OPS: &str = "0123456789abcdef-ops";

fn daemon(d: &Path, extra: &[&str]) -> Child {
    command(d)
        .args([
            "run",
            "--shared",
            "--max-in-flight",
            "2",
            "--time-scale",
            "0.3",
        ])
        .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the daemon")
}

/// The httpx-sse peer's Python (tests/stream/client.py), in the venv `.ci/test` makes.
fn sse_client() -> Option<std::path::PathBuf> {
    common::mcp::python_with("httpx_sse", "httpx-sse")
}

/// An event as it is durable: (its place in its log, kind, data): a step event's place is
/// the step events up to it, a decision's its audit number. The two logs are each in order;
/// between them a live reader sees them as they came, one from the start steps first, and
/// the status part of an id says only what the reader had seen.
fn durable(e: &Value) -> Option<(u64, String, Value)> {
    let kind = e["event"].as_str()?.to_string();
    if kind == "status" || kind == "finished" {
        return None;
    }
    let mut id = e["id"].as_str()?.split('.');
    let steps = id.next()?.parse().ok()?;
    let audit = id.next()?.parse().ok()?;
    let place = if kind == "decision" { audit } else { steps };
    Some((place, kind, e["data"].clone()))
}

/// The durable events of `events`, step events first, then decisions, each log in its order.
fn by_log(events: &[Value]) -> Vec<(u64, String, Value)> {
    let all: Vec<_> = events.iter().filter_map(durable).collect();
    let (decisions, steps): (Vec<_>, Vec<_>) = all.into_iter().partition(|e| e.1 == "decision");
    [steps, decisions].concat()
}

/// `worker watch TASK --json ARGS`: its events, and its exit code.
fn watch(d: &Path, task: &str, args: &[&str]) -> (Vec<Value>, Option<i32>) {
    let out = worker(d, &[&["watch", task, "--json"], args].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    let events = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    (events, out.status.code())
}

conformance! {
    /// The client reads three events and goes away; meanwhile a daemon is killed mid-run, a
    /// second one runs the task to an approval; the client comes back with the last id it
    /// got and reads on through the approval to the end. What it got over both connections
    /// is exactly the task's recorded events (every step, model move, tool call and decision,
    /// once each, in order), and the statuses it saw include the wait on the person and the
    /// end. Asked again after the end, the stream answers 204.
    fn an_sse_client_that_reconnects_misses_nothing(d) {
        let Some(py) = sse_client() else { return };
        let tokens = d.join("tokens.txt");
        std::fs::write(&tokens, format!("ops {OPS} operator\n")).expect("tokens");
        let server = serve(d, &["--token-file", tokens.to_str().expect("path")]);
        enqueue(d, &["--model", "policy:ord_1004:8000"]);
        let (gap, out) = (d.join("gap"), d.join("events.jsonl"));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/stream/client.py");
        let mut client = Command::new(&py)
            .arg(&script)
            .args([&server.base, OPS, "t1", "3"])
            .args([&gap, &out])
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the SSE client");
        let mut first = daemon(d, &[]);
        std::thread::sleep(Duration::from_millis(1200));
        first.kill().expect("SIGKILL the daemon");
        first.wait().expect("reap it");
        ok(d, &["run", "--shared", "--drain", "--time-scale", "0.01", "--recover-every-ms", "200", "--heartbeat-ttl-ms", "3000"]);
        let shown = json(d, &["show", "t1", "--json"]);
        assert_eq!(shown["status"], "suspended", "{shown}");
        // The client comes back: what happened while it was away is recorded.
        std::fs::write(&gap, "").expect("the gap file");
        std::thread::sleep(Duration::from_millis(500));
        let digest = shown["held"]["digest"].as_str().expect("digest");
        ok(d, &["approve", "t1", "--digest", digest, "--by", "alice", "--reason", "checked"]);
        ok(d, &["run", "--shared", "--drain", "--time-scale", "0.01"]);
        let status = client.wait().expect("the client ends");
        let mut stderr = String::new();
        if let Some(mut e) = client.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        assert!(status.success(), "the SSE client failed: {stderr}");
        let lines: Vec<Value> = std::fs::read_to_string(&out)
            .expect("the client's events")
            .lines()
            .map(|l| serde_json::from_str(l).expect("JSON"))
            .collect();
        let (end, got) = lines.split_last().expect("lines");
        assert_eq!(end["after_end"], 204, "after the end: {end}");
        let by = |c: u64| got.iter().filter(|e| e["connection"] == c).collect::<Vec<_>>();
        assert_eq!(by(1).len(), 3, "three events before going away: {got:?}");
        assert!(!by(2).is_empty(), "{got:?}");

        // Everything recorded, once, in order: the same as a reader from the start after the
        // end (`worker watch`), compared on what is durable.
        let (all, code) = watch(d, "t1", &[]);
        assert_eq!(code, Some(0));
        let want = by_log(&all);
        let seen = by_log(got);
        assert_eq!(seen, want, "the client's events against the recorded ones");
        let kinds = |k: &str| want.iter().filter(|e| e.1 == k).count();
        assert!(kinds("step") >= 5 && kinds("model") >= 5 && kinds("tool") >= 3, "{want:?}");
        // Step events are numbered without a gap: 1, 2, 3, ... (and decisions keep theirs).
        let steps: Vec<u64> = want.iter().filter(|e| e.1 != "decision").map(|e| e.0).collect();
        assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
        // The approved refund sent by the next run: a resume, then the call with its result.
        let resume = want.iter().position(|e| e.1 == "resume").expect("the resume");
        let sent = &want[resume + 1];
        assert_eq!((sent.1.as_str(), sent.2["tool"].as_str(), sent.2["result"].as_str()), ("tool", Some("issue_refund"), Some("ok")), "{want:?}");
        assert!(sent.2["step"].is_null(), "{sent:?}");
        let decision = want.iter().find(|e| e.1 == "decision").expect("the approval");
        assert_eq!((decision.2["verb"].as_str(), decision.2["by"].as_str()), (Some("approve"), Some("alice")), "{decision:?}");
        // No id twice over the two connections.
        let mut ids: Vec<&str> = got.iter().filter_map(|e| e["id"].as_str()).collect();
        let n = ids.len();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), n, "an event sent twice: {got:?}");
        // The statuses the client saw: the wait on the person, then the end.
        let statuses: Vec<&str> = got
            .iter()
            .filter(|e| e["event"] == "status" || e["event"] == "finished")
            .filter_map(|e| e["data"]["status"].as_str())
            .collect();
        let at = |s: &str| statuses.iter().position(|x| *x == s);
        assert!(at("suspended").is_some() && at("suspended") < at("finished"), "{statuses:?}");
        let last = got.last().expect("an event");
        assert_eq!((last["event"].as_str(), last["data"]["outcome"].as_str()), (Some("finished"), Some("completed")), "{last}");
        let held = got.iter().find(|e| e["data"]["status"] == "suspended").expect("held");
        assert_eq!(held["data"]["held_call"]["tool"], "issue_refund", "{held}");
    }

    /// `worker watch` started before any daemon follows the task to its end and exits 0;
    /// `--after ID` prints exactly what came after that event; a task stopped by a budget
    /// exits 4, as `worker wait` does; a bad id is a usage error.
    fn worker_watch_follows_a_task_and_resumes_after_an_id(d) {
        enqueue(d, &[]);
        let watcher = command(d)
            .args(["watch", "t1"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start worker watch");
        std::thread::sleep(Duration::from_millis(300));
        let mut drain = daemon(d, &["--drain"]);
        let out = watcher.wait_with_output().expect("the watcher ends");
        assert!(drain.wait().expect("drain").success());
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("model: plans 3 step(s): get_order, issue_refund, send_status_email"), "{text}");
        assert!(text.contains("tool:  issue_refund"), "{text}");
        assert!(text.trim_end().ends_with("finished  done: Refund issued and confirmation sent."), "{text}");

        let (all, _) = watch(d, "t1", &[]);
        let fifth = all[4]["id"].as_str().expect("an id");
        let (rest, code) = watch(d, "t1", &["--after", fifth]);
        assert_eq!(code, Some(0));
        assert_eq!(rest, all[5..].to_vec(), "after {fifth}");

        enqueue(d, &["--budget", "steps_max=2"]);
        ok(d, &["run", "--drain", "--time-scale", "0.01"]);
        let (events, code) = watch(d, "t2", &[]);
        assert_eq!(code, Some(4), "a stopped task: {events:?}");
        assert_eq!(events.last().expect("an event")["data"]["stop"], "max_steps");
        let (code, stderr) = fails(d, &["watch", "t1", "--after", "12-running"]);
        assert_eq!(code, 2, "{stderr}");
        assert!(stderr.contains("--after") && stderr.contains("12.40.running"), "{stderr}");
    }
}

/// One request on a new connection: the status line and headers, and the body up to its
/// first event (a stream is left open: the connection is returned with what was read).
fn raw(base: &str, path: &str, headers: &[&str], max: usize) -> (String, std::net::TcpStream) {
    use std::io::{Read, Write};
    let addr = base.trim_start_matches("http://");
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for h in headers {
        req.push_str(&format!("{h}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("send");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.len() < max {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&got);
        if let Some(head_end) = text.find("\r\n\r\n")
            && (text.starts_with("HTTP/1.1 4") || text[head_end + 4..].contains("\n\n"))
        {
            break;
        }
    }
    (String::from_utf8_lossy(&got).into_owned(), s)
}

/// The stream's rules over HTTP: only with `Accept: text/event-stream` (the same path without
/// it answers the audit events as JSON); a bad `Last-Event-ID` is a 400 problem that says what
/// an id looks like; a submit token streams only the tasks it created (404 otherwise); streams
/// count as long polls, so a token's 17th open stream is refused with 429 and `Retry-After`,
/// and streams whose clients closed give their places back at once; an empty
/// `Last-Event-ID` is none.
#[test]
fn the_stream_answers_by_the_apis_rules() {
    let dir = TempDir::new("stream_rules");
    let d = dir.path();
    let tokens = d.join("tokens.txt");
    let job = "0123456789abcdef-job";
    std::fs::write(&tokens, format!("ops {OPS} operator\njob {job} submit\n")).expect("tokens");
    let server = serve(d, &["--token-file", tokens.to_str().expect("path")]);
    enqueue(d, &[]);
    let path = "/api/v1/tasks/t1/events";
    let ops = format!("Authorization: Bearer {OPS}");
    let sse = "Accept: text/event-stream";

    let (json, _) = raw(&server.base, path, &[&ops], 1 << 16);
    assert!(
        json.starts_with("HTTP/1.1 200")
            && json.contains("application/json")
            && json.trim_end().ends_with("[]"),
        "{json}"
    );
    let (bad, _) = raw(
        &server.base,
        path,
        &[&ops, sse, "Last-Event-ID: 12-running"],
        1 << 16,
    );
    assert!(
        bad.starts_with("HTTP/1.1 400") && bad.contains("12.40.running"),
        "{bad}"
    );
    let (theirs, _) = raw(
        &server.base,
        path,
        &[&format!("Authorization: Bearer {job}"), sse],
        1 << 16,
    );
    assert!(
        theirs.starts_with("HTTP/1.1 404"),
        "a task the submit token did not create: {theirs}"
    );

    let (first, open) = raw(&server.base, path, &[&ops, sse], 1 << 16);
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    assert!(
        first.contains("Content-Type: text/event-stream") && first.contains("Connection: close"),
        "{first}"
    );
    let mut streams = vec![open];
    for _ in 1..16 {
        let (head, s) = raw(&server.base, path, &[&ops, sse], 1 << 16);
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        streams.push(s);
    }
    let (refused, _) = raw(&server.base, path, &[&ops, sse], 1 << 16);
    assert!(
        refused.starts_with("HTTP/1.1 429") && refused.contains("Retry-After"),
        "{refused}"
    );
    // The queued task's stream said where it stands, and waits for more.
    assert!(
        first.contains("event: status") && first.contains("\"status\":\"queued\""),
        "{first}"
    );
    // Clients that close their end give their places back at once, not when a keep-alive
    // (every 15 s) fails to reach them: a new stream is admitted well before the first one.
    drop(streams);
    let since = std::time::Instant::now();
    loop {
        let (head, _) = raw(&server.base, path, &[&ops, sse], 1 << 16);
        if head.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(head.starts_with("HTTP/1.1 429 Too Many Requests"), "{head}");
        assert!(
            since.elapsed() < Duration::from_secs(14),
            "the places of closed streams were held: {head}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // An empty Last-Event-ID is none: the stream from the start.
    let (empty, _) = raw(&server.base, path, &[&ops, sse, "Last-Event-ID:"], 1 << 16);
    assert!(
        empty.starts_with("HTTP/1.1 200") && empty.contains("event: status"),
        "{empty}"
    );
}
