//! `worker console`: a real browser (headless chromium through chromedriver) lists, filters,
//! approves, settles and cancels; console actions write the same audit events as the CLI's;
//! a form rendered before the task moved on is refused; tokens and CSRF are enforced.

use crate::common;
use crate::common::webdriver;
use common::serve::{Served, agent, serve};
use common::*;

use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// The console on a free loopback port.
fn console(d: &Path, extra: &[&str]) -> Served {
    serve(d, extra)
}

fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let mut r = agent().get(url);
    if let Some(t) = token {
        r = r.header("Authorization", &format!("Bearer {t}"));
    }
    let mut resp = r.call().expect("an answer");
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

fn post(url: &str, fields: &[(&str, &str)], token: Option<&str>) -> (u16, String) {
    let mut r = agent().post(url);
    if let Some(t) = token {
        r = r.header("Authorization", &format!("Bearer {t}"));
    }
    let mut resp = r.send_form(fields.iter().copied()).expect("an answer");
    let status = resp.status().as_u16();
    (status, resp.body_mut().read_to_string().unwrap_or_default())
}

/// The value of the first `name="NAME" value="..."` in a page.
fn field(html: &str, name: &str) -> String {
    let at = html
        .find(&format!("name=\"{name}\" value=\""))
        .unwrap_or_else(|| panic!("no field {name} in the page"));
    let rest = &html[at + name.len() + 15..];
    rest[..rest.find('"').expect("a closing quote")].to_string()
}

/// A task waiting for approval of a refund of 8000 on ord_1004 (under a key and in a store
/// scope of its own).
fn suspended(d: &Path, key: &str, user: &str) {
    ok(
        d,
        &[
            "enqueue",
            "--user",
            user,
            "--goal",
            GOAL,
            "--model",
            "policy:ord_1004:8000",
            "--key",
            key,
            "--store-scope",
            key,
        ],
    );
}

/// A task whose refund times out: held with an unknown outcome.
fn held(d: &Path, key: &str) {
    ok(
        d,
        &[
            "enqueue",
            "--model",
            "policy",
            "--user",
            "cu_ana",
            "--goal",
            GOAL,
            "--key",
            key,
            "--tool-latency",
            "issue_refund=40000",
            "--store-scope",
            key,
        ],
    );
}

fn refunds_of(d: &Path, order: &str) -> usize {
    ledger(d)
        .iter()
        .filter(|e| e.to_string().contains("refund") && e.to_string().contains(order))
        .count()
}

#[test]
fn a_browser_drives_the_console() {
    let dir = TempDir::new("console-browser");
    let d = dir.path();
    enqueue(d, &["--key", "done-1"]); // t1: done
    suspended(d, "approve-me", "cu_ana"); // t2: suspended
    held(d, "held-3"); // t3: held
    suspended(d, "stale-4", "cu_ana"); // t4: suspended, decided elsewhere while its page is open
    ok(d, &["run", "--drain", "--shared"]);
    let c = console(d, &["--by", "alice"]);
    let Some(b) = webdriver::Browser::start() else {
        return;
    };
    let shots = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/screenshots");

    // The task list, with counts by status.
    b.open(&format!("{}/", c.base));
    assert_eq!(b.count("tr.task-row"), 4);
    assert!(
        b.text("#count-suspended").starts_with('2'),
        "{}",
        b.text("#count-suspended")
    );
    b.screenshot(&shots.join("console-tasks.png"));
    // Filter: suspended tasks of cu_ana, then of nobody.
    b.click("#f-status option[value=suspended]");
    b.type_in("#f-user", "cu_ana");
    b.click("#filter");
    b.wait_for_url("user=cu_ana");
    assert_eq!(b.count("tr.task-row"), 2);
    assert!(b.url().contains("status=suspended"), "{}", b.url());
    b.type_in("#f-user", "cu_nobody");
    b.click("#filter");
    b.wait_for_url("user=cu_nobody");
    assert_eq!(b.count("tr.task-row"), 0);

    // Open the suspended task, approve it with a reason; it runs and finishes with one refund.
    b.open(&format!("{}/?status=suspended", c.base));
    b.click("tr.task-row a[href='/tasks/t2']");
    assert!(b.text("#held-call").contains("issue_refund"));
    b.type_in("#approve-reason", "damage confirmed by photo");
    b.click("#approve");
    assert!(
        b.text("#flash").contains("held call was approved"),
        "{}",
        b.text("#flash")
    );
    assert_eq!(b.text("#task-status"), "queued");
    ok(d, &["run", "--drain", "--shared"]);
    b.open(&format!("{}/tasks/t2", c.base));
    assert_eq!(b.text("#task-stop"), "done");
    assert_eq!(refunds_of(d, "ord_1004"), 1);
    assert!(b.count("#waterfall tr.span-row") >= 8);
    assert!(b.text("#events").contains("damage confirmed by photo"));
    b.resize(1360, 2150);
    b.screenshot(&shots.join("console-task.png"));
    b.resize(1360, 1000);

    // Settle the held write from the held-writes page.
    b.open(&format!("{}/held", c.base));
    assert_eq!(b.count("tr.held-row"), 1);
    b.type_in(
        "#lookup-key",
        json(d, &["show", "t3", "--json"])["held"]["key"]
            .as_str()
            .expect("key"),
    );
    b.click("#lookup");
    assert!(
        b.text("#lookup-result").contains("the tool says: applied"),
        "{}",
        b.text("#lookup-result")
    );
    b.screenshot(&shots.join("console-held.png"));
    // "Look up and settle": the lookup's answer settles it, with the store's own result.
    b.click("tr.held-row button.settle");
    assert!(
        b.text("#flash").contains("settled as applied"),
        "{}",
        b.text("#flash")
    );
    let t3 = json(d, &["show", "t3", "--json"]);
    let result = &t3["calls"][0]["result"];
    assert!(
        result["refunded_cents"].is_number(),
        "the store's result, not a bare ok: {t3}"
    );
    ok(d, &["run", "--drain", "--shared"]);
    b.open(&format!("{}/tasks/t3", c.base));
    // Settled as applied, the task goes on from the refund (its active time is spent).
    assert_eq!(b.text("#task-status"), "finished");
    assert_ne!(b.text("#task-stop"), "unknown_outcome");
    assert!(b.text("#events").contains("settled from the tool's lookup"));

    // Cancel a queued task.
    ok(
        d,
        &[
            "enqueue", "--model", "policy", "--user", "cu_dee", "--goal", GOAL, "--key", "queued-5",
        ],
    ); // t5: queued
    b.open(&format!("{}/tasks/key:queued-5", c.base));
    b.type_in("#cancel-reason", "customer withdrew");
    b.click("#cancel");
    assert!(b.text("#flash").contains("cancelled"));
    assert_eq!(json(d, &["show", "t5", "--json"])["stop"], "cancelled");

    // A page rendered before the task moved on: its form is refused.
    b.open(&format!("{}/tasks/t4", c.base));
    let digest = held_digest(d, "t4");
    ok(
        d,
        &[
            "reject",
            "t4",
            "--digest",
            &digest,
            "--by",
            "bob",
            "--reason",
            "above policy",
        ],
    );
    b.type_in("#approve-reason", "too late");
    b.click("#approve");
    let refusal = b.text("#message");
    assert!(refusal.contains("t4"), "{refusal}");
    assert_eq!(refunds_of(d, "ord_1004"), 1);
    let events = json(d, &["events", "t4", "--json"]);
    assert!(
        events
            .as_array()
            .expect("events")
            .iter()
            .all(|e| e["verb"] != "approve"),
        "{events}"
    );
}

/// The audit event of a decision, without what differs between two tasks.
fn event_shape(d: &Path, task: &str) -> Value {
    let events = json(d, &["events", task, "--json"]);
    let mut e = events
        .as_array()
        .expect("events")
        .last()
        .expect("an event")
        .clone();
    for k in ["seq", "at_ms", "task"] {
        e.as_object_mut().expect("an event").remove(k);
    }
    // A call key is `NS:task:step`, and each task has a namespace of its own.
    if let Some(key) = e["detail"]["key"].as_str() {
        let step = key.rsplit(':').next().unwrap_or("").to_string();
        e["detail"]["key"] = Value::String(format!("NS:TASK:{step}"));
    }
    e
}

conformance! {
    fn console_and_cli_decisions_write_identical_audit_events(d) {
        for i in 1..=2 { suspended(d, &format!("a{i}"), "cu_ana"); } // t1, t2: approve
        for i in 1..=2 { suspended(d, &format!("r{i}"), "cu_ana"); } // t3, t4: reject
        held(d, "h1"); held(d, "h2"); // t5, t6: reconcile applied
        held(d, "n1"); held(d, "n2"); // t7, t8: reconcile not applied
        ok(d, &["run", "--drain", "--shared"]);
        ok(d, &["enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL, "--key", "c1"]); // t9
        ok(d, &["enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL, "--key", "c2"]); // t10
        let c = console(d, &["--by", "alice"]);
        let page = |t: &str| get(&format!("{}/tasks/{t}", c.base), None).1;
        let form = |t: &str, verb: &str, extra: &[(&str, &str)]| {
            let html = page(t);
            let (csrf, key, digest) = (field(&html, "csrf"), field(&html, "key"), field(&html, "digest"));
            let mut fields = vec![("csrf", csrf.as_str()), ("key", key.as_str()), ("digest", digest.as_str()), ("reason", "checked")];
            fields.extend_from_slice(extra);
            let (status, body) = post(&format!("{}/tasks/{t}/{verb}", c.base), &fields, None);
            assert_eq!(status, 303, "{verb} {t}: {body}");
        };
        let cli = |t: &str, args: &[&str]| {
            let show = json(d, &["show", t, "--json"]);
            let (key, digest) = (show["held"]["key"].as_str().expect("key").to_string(), show["held"]["digest"].as_str().expect("digest").to_string());
            let mut all = args.to_vec();
            all.extend_from_slice(&[t, "--key", &key, "--digest", &digest, "--by", "alice", "--reason", "checked"]);
            ok(d, &all);
        };
        cli("t1", &["approve"]);
        form("t2", "approve", &[]);
        cli("t3", &["reject"]);
        form("t4", "reject", &[]);
        cli("t5", &["reconcile", "--applied", "--result", r#"{"status": "ok"}"#]);
        form("t6", "reconcile", &[("outcome", "applied"), ("result", r#"{"status": "ok"}"#)]);
        cli("t7", &["reconcile", "--not-applied", "--extend", "deadline_ms=10000"]);
        form("t8", "reconcile", &[("outcome", "not_applied"), ("extend", "deadline_ms=10000")]);
        ok(d, &["cancel", "t9", "--by", "alice", "--reason", "checked"]);
        let html = page("t10");
        let (status, body) = post(&format!("{}/tasks/t10/cancel", c.base),
            &[("csrf", &field(&html, "csrf")), ("seen", &field(&html, "seen")), ("reason", "checked")], None);
        assert_eq!(status, 303, "{body}");
        for (a, b) in [("t1", "t2"), ("t3", "t4"), ("t5", "t6"), ("t7", "t8"), ("t9", "t10")] {
            let (ea, eb) = (event_shape(d, a), event_shape(d, b));
            assert_eq!(ea, eb, "the CLI's event for {a} and the console's for {b}");
            assert_eq!(ea["by"], "alice");
        }
        // The re-sent and approved calls went out once each; nothing else was sent.
        ok(d, &["run", "--drain", "--shared"]);
        assert_sent_at_most_once(d, &[], 0);
    }

    fn stale_and_forged_forms_are_refused(d) {
        suspended(d, "s1", "cu_ana");
        ok(d, &["run", "--drain", "--shared"]);
        ok(d, &["enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL, "--key", "q1"]); // t2
        let c = console(d, &["--by", "alice"]);
        let html = get(&format!("{}/tasks/t1", c.base), None).1;
        let (csrf, key, digest) = (field(&html, "csrf"), field(&html, "key"), field(&html, "digest"));
        // A forged form (no CSRF token, or another one) is refused, nothing recorded.
        let (status, _) = post(&format!("{}/tasks/t1/approve", c.base), &[("key", &key), ("digest", &digest), ("reason", "x")], None);
        assert_eq!(status, 403);
        let (status, _) = post(&format!("{}/tasks/t1/approve", c.base), &[("csrf", "0000"), ("key", &key), ("digest", &digest), ("reason", "x")], None);
        assert_eq!(status, 403);
        // A form without the call it was rendered with is refused.
        let (status, body) = post(&format!("{}/tasks/t1/approve", c.base), &[("csrf", &csrf), ("reason", "x")], None);
        assert_eq!(status, 400, "{body}");
        // Another call's digest (the task moved on) is refused in the decision's transaction.
        let (status, body) = post(&format!("{}/tasks/t1/approve", c.base), &[("csrf", &csrf), ("key", &key), ("digest", "0000000000"), ("reason", "x")], None);
        assert_eq!(status, 409, "{body}");
        assert_eq!(json(d, &["events", "t1", "--json"]), serde_json::json!([]));
        // A cancel form of a task that changed since it was rendered is refused.
        let page = get(&format!("{}/tasks/t2", c.base), None).1;
        ok(d, &["run", "--drain", "--shared"]);
        let (status, body) = post(&format!("{}/tasks/t2/cancel", c.base),
            &[("csrf", &field(&page, "csrf")), ("seen", &field(&page, "seen")), ("reason", "x")], None);
        assert_eq!(status, 409, "{body}");
        assert!(body.contains("changed since this page was rendered"), "{body}");
        assert_ne!(json(d, &["show", "t2", "--json"])["stop"], "cancelled");
    }

    fn tokens_name_the_operator(d) {
        suspended(d, "s1", "cu_ana");
        ok(d, &["run", "--drain", "--shared"]);
        let (code, err) = fails(d, &["console", "--listen", "0.0.0.0:0"]);
        assert_eq!(code, 2);
        assert!(err.contains("needs --token-file"), "{err}");
        std::fs::write(d.join("tokens.txt"), "dana 5f1b7c0a9e3d4c2b8a6f\n").expect("token file");
        std::fs::write(d.join("bad.txt"), "dana short\n").expect("token file");
        let (code, err) = fails(d, &["console", "--token-file", "bad.txt"]);
        assert_eq!(code, 2);
        assert!(err.contains("at least 16"), "{err}");
        let c = console(d, &["--token-file", "tokens.txt"]);
        let (status, _) = get(&format!("{}/", c.base), None);
        assert_eq!(status, 303, "a browser without a token is sent to sign in");
        let (status, _) = get(&format!("{}/", c.base), Some("not-a-listed-token-at-all"));
        assert_eq!(status, 303);
        let (status, _) = post(&format!("{}/tasks/t1/cancel", c.base), &[("reason", "x")], None);
        assert_eq!(status, 401);
        let token = Some("5f1b7c0a9e3d4c2b8a6f");
        let (status, html) = get(&format!("{}/tasks/t1", c.base), token);
        assert_eq!(status, 200);
        let (status, body) = post(&format!("{}/tasks/t1/reject", c.base),
            &[("csrf", &field(&html, "csrf")), ("key", &field(&html, "key")), ("digest", &field(&html, "digest")), ("reason", "no")], token);
        assert_eq!(status, 303, "{body}");
        assert_eq!(json(d, &["events", "t1", "--json"])[0]["by"], "dana");
        let (status, login) = post(&format!("{}/login", c.base), &[("token", "wrong")], None);
        assert_eq!(status, 401, "{login}");
    }
}

/// `worker console`'s address (`host:port`) from its base URL.
fn addr_of(c: &Served) -> String {
    c.base.trim_start_matches("http://").to_string()
}

/// A request for `path` to the console at `addr` with these headers (a Host of our choosing).
fn raw(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    head.push_str(body);
    raw_http(addr, head.as_bytes(), Duration::from_secs(10), false)
}

fn form_body(fields: &[(&str, &str)]) -> String {
    fields
        .iter()
        .map(|(k, v)| {
            let enc: String = v
                .bytes()
                .map(|b| {
                    if b.is_ascii_alphanumeric() {
                        (b as char).to_string()
                    } else {
                        format!("%{b:02X}")
                    }
                })
                .collect();
            format!("{k}={enc}")
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// Review item 2: a page on attacker.example whose name was rebound to 127.0.0.1 read a task
/// page with its CSRF token, key and digest, and posted the approval (303, an `approve` event
/// by the console's operator). Now the loopback console answers only requests addressed to a
/// loopback name, and refuses a form sent from another site (Origin, Sec-Fetch-Site).
#[test]
fn hole_2_a_rebound_page_can_neither_read_nor_approve() {
    let dir = TempDir::new("console-rebinding");
    let d = dir.path();
    suspended(d, "s1", "cu_ana");
    ok(d, &["run", "--drain", "--shared"]);
    let c = console(d, &["--by", "alice"]);
    let addr = addr_of(&c);
    let port = addr.rsplit(':').next().expect("port").to_string();
    let evil = format!("attacker.example:{port}");
    let (status, body) = raw(&addr, "GET", "/tasks/t1", &[("Host", &evil)], "");
    assert_eq!(status, 403, "{body}");
    assert!(!body.contains("csrf"), "{body}");
    // What the page would have given away, read the honest way.
    let html = get(&format!("{}/tasks/t1", c.base), None).1;
    let fields = [
        ("csrf", field(&html, "csrf")),
        ("key", field(&html, "key")),
        ("digest", field(&html, "digest")),
        ("reason", "rebound".to_string()),
    ];
    let fields: Vec<(&str, &str)> = fields.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let body = form_body(&fields);
    let form = ("Content-Type", "application/x-www-form-urlencoded");
    let own = addr.as_str();
    for headers in [
        vec![("Host", evil.as_str()), form],
        vec![("Host", own), form, ("Origin", "http://attacker.example")],
        vec![("Host", own), form, ("Origin", "null")],
        vec![("Host", own), form, ("Sec-Fetch-Site", "cross-site")],
    ] {
        let (status, answer) = raw(&addr, "POST", "/tasks/t1/approve", &headers, &body);
        assert_eq!(status, 403, "{headers:?}: {answer}");
    }
    assert_eq!(json(d, &["events", "t1", "--json"]), serde_json::json!([]));
    let origin = format!("http://{addr}");
    let (status, answer) = raw(
        &addr,
        "POST",
        "/tasks/t1/approve",
        &[
            ("Host", own),
            form,
            ("Origin", &origin),
            ("Sec-Fetch-Site", "same-origin"),
        ],
        &body,
    );
    assert_eq!(status, 303, "the console's own form is taken: {answer}");
    assert_eq!(json(d, &["events", "t1", "--json"])[0]["verb"], "approve");
}

/// A TCP connection to `to` from the local address `from` (another loopback address: Linux
/// routes all of 127.0.0.0/8 to the loopback interface).
fn connect_from(from: [u8; 4], to: &str) -> std::net::TcpStream {
    use std::os::fd::FromRawFd;
    let to: std::net::SocketAddrV4 = to.parse().expect("an IPv4 address");
    let sockaddr = |ip: [u8; 4], port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from_ne_bytes(ip),
        },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: a fresh socket, bound and connected with well-formed addresses; its descriptor
    // is handed to a TcpStream that owns it from then on.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
        assert!(fd >= 0, "socket");
        let local = sockaddr(from, 0);
        assert_eq!(libc::bind(fd, (&raw const local).cast(), len), 0, "bind");
        let remote = sockaddr(to.ip().octets(), to.port());
        assert_eq!(
            libc::connect(fd, (&raw const remote).cast(), len),
            0,
            "connect"
        );
        std::net::TcpStream::from_raw_fd(fd)
    }
}

/// Review item 8: 64 idle connections locked every operator out of the token console (503
/// "too many connections") for as long as they were reopened. Now, when every connection is
/// open, a new one takes the place of the one that has waited longest for a request: idle
/// sockets, from the operator's own address or from many, never keep an operator out; and a
/// connection that sends nothing is closed after a few seconds.
#[test]
fn hole_8_idle_connections_do_not_lock_the_operators_out() {
    use std::io::Read;
    let dir = TempDir::new("console-idle");
    let d = dir.path();
    suspended(d, "s1", "cu_ana");
    ok(d, &["run", "--drain", "--shared"]);
    std::fs::write(d.join("tokens.txt"), "dana 5f1b7c0a9e3d4c2b8a6f\n").expect("token file");
    let c = console(d, &["--token-file", "tokens.txt"]);
    let addr = addr_of(&c);
    let token = Some("5f1b7c0a9e3d4c2b8a6f");
    // 64 idle sockets from the operator's own address, then 64 from four others.
    let mut idle: Vec<std::net::TcpStream> = (0..64)
        .map(|_| connect_from([127, 0, 0, 1], &addr))
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        get(&format!("{}/tasks/t1", c.base), token).0,
        200,
        "beside 64 idle sockets of its own address"
    );
    for n in 2..6 {
        idle.extend((0..16).map(|_| connect_from([127, 0, 0, n], &addr)));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        get(&format!("{}/tasks/t1", c.base), token).0,
        200,
        "beside 64 idle sockets of four addresses"
    );
    // An idle connection that sent nothing is closed (an empty answer), well before a minute.
    let mut last = idle.last().expect("a socket");
    last.set_read_timeout(Some(Duration::from_secs(60)))
        .expect("timeout");
    let mut rest = Vec::new();
    assert_eq!(
        last.read_to_end(&mut rest).expect("closed by the server"),
        0
    );
}

/// Review item 13, the console's part: with a token file, /metrics and /healthz need a token
/// unless --public-metrics; tokens are compared in constant time (not observable here); a
/// `?done=` text of the link's own never shows as a success; two Content-Length headers are
/// refused.
#[test]
fn hole_13_the_token_console_guards_metrics_messages_and_lengths() {
    let dir = TempDir::new("console-smaller");
    let d = dir.path();
    suspended(d, "s1", "cu_ana");
    ok(d, &["run", "--drain", "--shared"]);
    std::fs::write(d.join("tokens.txt"), "dana 5f1b7c0a9e3d4c2b8a6f\n").expect("token file");
    let token = Some("5f1b7c0a9e3d4c2b8a6f");
    let c = console(d, &["--token-file", "tokens.txt"]);
    for path in ["/metrics", "/healthz"] {
        assert_eq!(get(&format!("{}{path}", c.base), None).0, 401, "{path}");
        assert_eq!(get(&format!("{}{path}", c.base), token).0, 200, "{path}");
    }
    // A link cannot announce a decision: neither text of its own, nor a decision that was
    // not made on this task (an event number of another task, or none).
    for query in [
        "done=refund%20issued%20to%20attacker",
        "done=approved",
        "event=1",
        "event=99",
    ] {
        let page = get(&format!("{}/tasks/t1?{query}", c.base), token).1;
        assert!(!page.contains("Recorded:"), "{query}: {page}");
        assert!(!page.contains("refund issued to attacker"), "{query}");
    }
    let addr = addr_of(&c);
    let (status, body) = raw_http(
        &addr,
        b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\ntoken",
        Duration::from_secs(10),
        false,
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("more than one Content-Length"), "{body}");
    for (head, want) in [
        (
            "POST /login HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\ntoken",
            "not a number",
        ),
        (
            "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: attacker.example\r\n\r\n",
            "more than one Host",
        ),
    ] {
        let (status, body) = raw_http(&addr, head.as_bytes(), Duration::from_secs(10), false);
        assert_eq!(status, 400, "{head}: {body}");
        assert!(body.contains(want), "{body}");
    }
    // The scheme of an Authorization header is case-insensitive (RFC 9110).
    let (status, _) = raw_http(
        &addr,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nAuthorization: bearer 5f1b7c0a9e3d4c2b8a6f\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
        false,
    );
    assert_eq!(status, 200);
    drop(c);
    let c = console(d, &["--token-file", "tokens.txt", "--public-metrics"]);
    assert_eq!(get(&format!("{}/metrics", c.base), None).0, 200);
    assert_eq!(
        get(&format!("{}/", c.base), None).0,
        303,
        "pages still need a token"
    );
    let (code, err) = fails(d, &["console", "--token-file", "no-such-file.txt"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no-such-file.txt"), "{err}");
}
