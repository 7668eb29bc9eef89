//! The daemon's local socket (`worker.redb.sock`): `worker enqueue` hands its tasks to the
//! running daemon; a paused daemon's silence is reported, the request is not sent again and the
//! daemon refuses it when it resumes past its deadline; a
//! killed daemon's socket does not stop an enqueue, and the next daemon replaces it; one
//! daemon per file serves it. A daemon started with `--sole-writer` is the file's only writer:
//! a second daemon is refused by name, the enqueues and decisions go through its socket, other
//! writers are refused with a message that names it, readers read on.

use crate::common::*;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// `worker run` in `dir`, logging at debug level to `dir/NAME.log`.
fn daemon(dir: &Path, name: &str) -> (Child, PathBuf) {
    daemon_with(dir, name, &[])
}

/// [`daemon`] with more arguments.
fn daemon_with(dir: &Path, name: &str, extra: &[&str]) -> (Child, PathBuf) {
    let log = dir.join(format!("{name}.log"));
    let child = command(dir)
        .args(["run", "--max-in-flight", "1"])
        .args(extra)
        .env("RUST_LOG", "tether=debug")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("start the daemon");
    (child, log)
}

fn until(what: &str, mut done: impl FnMut() -> bool) {
    let t = Instant::now();
    while !done() {
        assert!(t.elapsed() < Duration::from_secs(60), "never: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn log_says(log: &Path, text: &str) -> bool {
    std::fs::read_to_string(log).is_ok_and(|l| l.contains(text))
}

fn serving(log: &Path) {
    until("the daemon serves its socket", || {
        log_says(log, "serving the local API")
    });
}

fn stop(mut child: Child) {
    signal(child.id(), "-TERM");
    let st = child.wait().expect("the daemon exits");
    assert!(st.success(), "the daemon exited with {st}");
}

#[test]
fn an_enqueue_goes_through_the_daemon_and_a_paused_one_is_not_sent_twice() {
    let dir = TempDir::new("local_paused");
    let d = dir.path();
    let (child, log) = daemon(d, "a");
    serving(&log);
    let socket = d.join("worker.redb.sock");
    {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let m = std::fs::metadata(&socket).expect("the socket");
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o600);
    }
    let id = enqueue(d, &["--key", "k1", "--in", "1h"])
        .trim()
        .to_string();
    until("the daemon logs the enqueue", || {
        log_says(&log, "enqueued for a caller of the local API")
    });
    assert_eq!(json(d, &["show", &id, "--json"])["key"], "k1");

    // Paused: the request waits in the socket; the verb says so and does not send it again.
    signal(child.id(), "-STOP");
    let out = command(d)
        .args([
            "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy",
        ])
        .args(["--key", "k2", "--in", "1h"])
        .env("WORKER_DAEMON_TIMEOUT_MS", "300")
        .output()
        .expect("enqueue");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("(pid {})", child.id()))
            && err.contains("did not answer within 300 ms"),
        "{err}"
    );
    assert!(err.contains("when it resumes it refuses"), "{err}");
    assert!(
        err.contains("running the same enqueue again is safe"),
        "{err}"
    );
    // Resumed, the daemon comes to the request after its deadline and refuses it: the caller
    // was told it stopped waiting, and nothing is done behind its back.
    signal(child.id(), "-CONT");
    until("the daemon answers the request it had", || {
        log_says(&log, "the caller left before its answer")
    });
    assert!(json_list(d, &["list", "--key", "k2", "--json"]).is_empty());
    let again = enqueue(d, &["--key", "k2", "--in", "1h"]);
    assert!(!again.contains("already enqueued"), "{again}");
    assert_eq!(json_list(d, &["list", "--json"]).len(), 2);
    // A timeout that is not a number of milliseconds is refused, not taken as the default.
    for bad in ["0", "soon"] {
        let out = command(d)
            .args([
                "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy",
            ])
            .env("WORKER_DAEMON_TIMEOUT_MS", bad)
            .output()
            .expect("enqueue");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {err}");
        assert!(err.contains("WORKER_DAEMON_TIMEOUT_MS"), "{err}");
    }

    stop(child);
    assert!(!socket.exists(), "a stopped daemon removes its socket");
}

#[test]
fn a_killed_daemons_socket_is_passed_over_and_replaced_and_one_daemon_serves_it() {
    let dir = TempDir::new("local_killed");
    let d = dir.path();
    let (mut child, log) = daemon(d, "a");
    serving(&log);
    signal(child.id(), "-KILL");
    child.wait().expect("killed");
    let socket = d.join("worker.redb.sock");
    assert!(socket.exists(), "a killed daemon cannot remove its socket");
    // Nobody listens: the verb opens the file itself.
    let id = enqueue(d, &["--key", "after-kill", "--in", "1h"]);
    assert!(id.trim().starts_with('t'), "{id}");

    let (b, log_b) = daemon_with(d, "b", &["--shared"]);
    serving(&log_b);
    assert_eq!(
        std::fs::read_to_string(d.join("worker.redb.lock"))
            .expect("the lock file")
            .trim(),
        b.id().to_string()
    );
    // A second daemon on the file runs tasks but leaves the socket to the first.
    let (c, log_c) = daemon_with(d, "c", &["--shared"]);
    until("the second daemon sees the first", || {
        log_says(&log_c, "another daemon on this file serves the local API")
    });
    assert!(
        log_says(&log_c, &format!("daemon={}", b.id())),
        "it names the running one"
    );
    enqueue(d, &["--key", "through-b", "--in", "1h"]);
    until("the serving daemon logs the enqueue", || {
        log_says(&log_b, "enqueued for a caller of the local API")
    });
    assert!(!log_says(&log_c, "enqueued for a caller of the local API"));
    stop(c);
    assert!(
        socket.exists(),
        "the daemon that did not serve leaves the socket alone"
    );
    stop(b);
    assert!(!socket.exists());
    assert_eq!(json_list(d, &["list", "--json"]).len(), 2);
}

#[test]
fn decisions_go_through_the_daemon_with_their_refusals_and_audit() {
    let dir = TempDir::new("local_decide");
    let d = dir.path();
    ok(d, &["store", "orders"]);
    let (child, log) = daemon(d, "a");
    serving(&log);
    enqueue(d, &["--model", "policy:ord_1004:8000"]);
    until("t1 waits for its approval", || {
        json(d, &["show", "t1", "--json"])["status"] == "suspended"
    });
    // A refusal made by the daemon reads as it would without it.
    let (code, err) = fails(
        d,
        &["approve", "t1", "--digest", "0000000000", "--by", "alice"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("does not match the held call"), "{err}");
    assert!(!log_says(&log, "decided for a caller of the local API"));
    let digest = held_digest(d, "t1");
    let said = ok(
        d,
        &[
            "approve",
            "t1",
            "--by",
            "alice",
            "--reason",
            "damage confirmed",
            "--digest",
            &digest,
        ],
    );
    assert!(said.contains("approved issue_refund"), "{said}");
    until("the daemon logs the decision", || {
        log_says(&log, "decided for a caller of the local API")
    });
    until("t1 finishes", || {
        json(d, &["show", "t1", "--json"])["status"] == "finished"
    });
    assert_eq!(json(d, &["show", "t1", "--json"])["stop"], "done");
    assert_eq!(ledger(d).len(), 2, "one refund and one email");
    let events = json_list(d, &["events", "--json"]);
    assert!(
        events.iter().any(|e| e["verb"] == "approve"
            && e["by"] == "alice"
            && e["reason"] == "damage confirmed"),
        "{events:?}"
    );
    // A cancel too.
    let t2 = enqueue(d, &["--in", "1h"]).trim().to_string();
    let said = ok(d, &["cancel", &t2, "--by", "alice", "--json"]);
    assert!(said.contains("\"was\": \"queued\""), "{said}");
    assert_eq!(json(d, &["show", &t2, "--json"])["status"], "finished");
    stop(child);
}

#[test]
fn a_sole_writer_daemon_refuses_a_second_one_and_takes_the_verbs_writes() {
    let dir = TempDir::new("local_sole");
    let d = dir.path();
    ok(d, &["store", "orders"]);
    let (a, log) = daemon_with(d, "a", &["--sole-writer"]);
    serving(&log);
    let pid = format!("pid {}", a.id());
    // A second daemon is refused by name, whether it would share the file or own it.
    for extra in [&[][..], &["--shared"][..]] {
        let out = command(d)
            .args(["run", "--drain"])
            .args(extra)
            .output()
            .expect("a second daemon");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {err}");
        assert!(
            err.contains(&pid),
            "{extra:?} names the running daemon: {err}"
        );
    }
    // The enqueues and the decisions go through it; the tasks run.
    enqueue(d, &["--model", "policy:ord_1004:8000", "--key", "big"]);
    enqueue(d, &["--model", "policy", "--key", "small"]);
    until("t1 waits for its approval", || {
        json(d, &["show", "t1", "--json"])["status"] == "suspended"
    });
    let digest = held_digest(d, "t1");
    ok(d, &["approve", "t1", "--by", "alice", "--digest", &digest]);
    until("the daemon logs the decision", || {
        log_says(&log, "decided for a caller of the local API")
    });
    until("both tasks finish", || {
        json_list(d, &["list", "--json"])
            .iter()
            .all(|t| t["status"] == "finished")
    });
    let t3 = enqueue(d, &["--in", "1h"]).trim().to_string();
    ok(d, &["cancel", &t3, "--by", "alice"]);
    // A memory note goes through it too.
    ok(
        d,
        &[
            "memory",
            "add",
            "--user",
            "cu_ana",
            "--source",
            "user_message",
            "--text",
            "hi",
        ],
    );
    assert_eq!(json_list(d, &["memory", "list", "--json"]).len(), 1);
    // So do a purge and the schedules' changes.
    let said = ok(d, &["purge", "--finished-before", "30d"]);
    assert!(said.contains("purged 0"), "{said}");
    let said = ok(
        d,
        &[
            "schedule",
            "add",
            "nightly",
            "--cron",
            "0 2 * * *",
            "--",
            "--user",
            "cu_ana",
            "--goal",
            GOAL,
            "--model",
            "policy",
        ],
    );
    assert!(said.contains("schedule nightly added"), "{said}");
    ok(d, &["schedule", "pause", "nightly"]);
    let listed = json_list(d, &["schedule", "list", "--json"]);
    assert_eq!(listed[0]["status"], "paused", "{listed:?}");
    ok(d, &["schedule", "remove", "nightly"]);
    assert!(json_list(d, &["schedule", "list", "--json"]).is_empty());
    // A verb that needs the file itself is refused with the reason and the daemon's name.
    let (code, err) = fails(d, &["schedule", "tick"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("only writer") && err.contains(&pid), "{err}");
    // `check` too: the file is in use, not damaged.
    let out = worker(d, &["check"]);
    let (said, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(1), "{said}{err}");
    assert!(
        !said.contains("damaged") && !err.contains("backup"),
        "{said}{err}"
    );
    assert!(err.contains(&pid), "{err}");
    // A daemon busy with as many requests as it takes at once: the verb asks again, then says
    // so (nothing done), and goes through once the daemon has room.
    let socket = d.join("worker.redb.sock");
    let held: Vec<_> = (0..32)
        .map(|_| std::os::unix::net::UnixStream::connect(&socket).expect("connect"))
        .collect();
    until("the daemon holds the 32 requests", || {
        let probe = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        let mut line = String::new();
        use std::io::BufRead;
        let _ = std::io::BufReader::new(probe).read_line(&mut line);
        line.contains("busy")
    });
    let (code, err) = fails(
        d,
        &[
            "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy",
        ],
    );
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("busy") && err.contains("nothing was done"),
        "{err}"
    );
    drop(held);
    let room = enqueue(d, &["--key", "room", "--in", "1h"])
        .trim()
        .to_string();
    ok(d, &["cancel", &room, "--by", "alice"]);
    assert_eq!(ledger(d).len(), 4, "two refunds and two emails, once each");

    // Killed, it leaves no claim on the file: a verb opens it, and the next sole writer starts.
    signal(a.id(), "-KILL");
    let mut a = a;
    a.wait().expect("killed");
    enqueue(d, &["--key", "after", "--store-scope", "s2"]);
    ok(d, &["run", "--drain", "--sole-writer"]);
    let tasks = json_list(d, &["list", "--json"]);
    assert_eq!(
        tasks.len(),
        5,
        "the busy daemon's refused enqueue made no task"
    );
    assert!(tasks.iter().all(|t| t["status"] == "finished"), "{tasks:?}");
    assert_eq!(ledger(d).len(), 6);
}

#[test]
fn a_sole_writer_daemon_serves_the_console_and_the_api_itself() {
    let dir = TempDir::new("local_sole_console");
    let d = dir.path();
    ok(d, &["store", "orders"]);
    let token = "0123456789abcdef-ops";
    std::fs::write(d.join("tokens.txt"), format!("ops {token} operator\n")).expect("tokens");
    // Checked before the daemon opens anything: a public address needs a token file, and the
    // token file needs the console.
    let (code, err) = fails(d, &["run", "--console", "0.0.0.0:8080"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("needs --console-token-file"), "{err}");
    for bad in ["127.0.0.1:99999", "nonsense"] {
        let (code, err) = fails(d, &["run", "--console", bad]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("not an address"), "{err}");
    }
    // A console that a drain would end at once, and a token file without a console.
    let (code, err) = fails(d, &["run", "--drain", "--console", "127.0.0.1:0"]);
    assert_eq!(code, 2, "{err}");
    let (code, err) = fails(d, &["run", "--drain", "--console-token-file", "tokens.txt"]);
    assert_eq!(code, 2, "{err}");
    assert!(!d.join("worker.redb").exists(), "nothing was opened");
    let (a, log) = daemon_with(
        d,
        "a",
        &[
            "--sole-writer",
            "--console",
            "127.0.0.1:0",
            "--console-token-file",
            "tokens.txt",
        ],
    );
    serving(&log);
    let mut base = String::new();
    until("the daemon's console listens", || {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        match text.lines().find_map(|l| l.strip_prefix("console: ")) {
            Some(url) => {
                base = url.trim_end_matches('/').to_string();
                true
            }
            None => false,
        }
    });
    // A task created through the daemon's API runs to its end.
    let body = serde_json::json!({"user": "cu_ana", "goal": GOAL, "model": "policy"});
    let req = ureq::http::Request::builder()
        .method("POST")
        .uri(format!("{base}/api/v1/tasks"))
        .header("Authorization", format!("Bearer {token}"))
        .header("Content-Type", "application/json")
        .body(body.to_string())
        .expect("a request");
    let mut resp = serve::agent().run(req).expect("an answer");
    let text = resp.body_mut().read_to_string().unwrap_or_default();
    assert_eq!(resp.status().as_u16(), 201, "{text}");
    let id = serde_json::from_str::<serde_json::Value>(&text).expect("JSON")["id"]
        .as_str()
        .expect("an id")
        .to_string();
    until("the task finishes", || {
        json(d, &["show", &id, "--json"])["status"] == "finished"
    });
    assert_eq!(json(d, &["show", &id, "--json"])["stop"], "done");
    // A console process beside it is refused, and told where the console is.
    let (code, err) = fails(d, &["console", "--listen", "127.0.0.1:0"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("--console"), "{err}");
    stop(a);
}

/// `worker enqueue --wait` with no daemon running commits the task itself, then waits: its
/// wait holds no writer's handle, so a daemon started meanwhile (the file's only writer)
/// starts, runs the task and the wait ends with it.
#[test]
fn a_daemon_starts_beside_an_enqueue_that_waits() {
    let dir = TempDir::new("local_wait_then_daemon");
    let d = dir.path();
    ok(d, &["store", "orders"]);
    let mut waiting = command(d)
        .args([
            "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy",
        ])
        .args(["--wait", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("enqueue --wait");
    until("the task is enqueued", || {
        let out = worker(d, &["list", "--json"]);
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("\"t1\"")
    });
    let (daemon, log) = daemon(d, "a");
    serving(&log);
    let t = Instant::now();
    while waiting.try_wait().expect("the wait").is_none() {
        if t.elapsed() > Duration::from_secs(60) {
            let _ = waiting.kill();
            panic!(
                "the wait never ended; the daemon said: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = waiting.wait_with_output().expect("the wait's output");
    assert!(out.status.success(), "{:?}", out.status);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["stop"], "done", "{v}");
    stop(daemon);
}

/// A file named through a symbolic link is the file it links to: a verb that names the link
/// reaches the daemon started on the file (it looked for a socket beside the link, found
/// none, and gave up after 10 s, the file being the daemon's), and a second daemon started
/// through the link is refused by the first one's pid, as it would be by the file's name.
#[test]
fn a_file_named_through_a_link_is_served_by_its_daemon() {
    let dir = TempDir::new("local_link");
    let d = dir.path();
    std::os::unix::fs::symlink("worker.redb", d.join("link.redb")).expect("symlink");
    let (a, log) = daemon(d, "a");
    serving(&log);
    let id = enqueue(
        d,
        &[
            "--db",
            "link.redb",
            "--model",
            "policy",
            "--key",
            "via-link",
        ],
    );
    assert_eq!(id.trim(), "t1");
    until("the daemon logs the enqueue", || {
        log_says(&log, "enqueued for a caller of the local API")
    });
    let out = command(d)
        .args(["--db", "link.redb", "run", "--drain"])
        .output()
        .expect("a second daemon");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("pid {}", a.id())), "{err}");
    stop(a);
    // And the other way round: a daemon started through the link serves the file's name.
    let (b, log) = daemon_with(d, "b", &["--db", "link.redb"]);
    serving(&log);
    let id = enqueue(d, &["--model", "policy", "--key", "via-file", "--in", "1h"]);
    assert_eq!(id.trim(), "t2");
    until("the second daemon logs the enqueue", || {
        log_says(&log, "enqueued for a caller of the local API")
    });
    stop(b);
}
