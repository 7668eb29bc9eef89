//! A daemon paused between proving its claim and sending a write never sends it after another
//! daemon took the task over (review 48, hole 5). The proof is the last step before the
//! request's first byte, after the slow parts of a send: an MCP tool's definition check
//! (`tools/list`) and an HTTP tool's connection set-up (here, a connection waiting on a full
//! accept queue). Daemon A is stopped (SIGSTOP) inside that slow part; daemon B takes the task over when A's heartbeat
//! runs out, holds the write, an operator settles it `--not-applied` and B sends it; then A
//! is let go, and the service must still have the write once.
//!
//! On PostgreSQL, where daemons on several hosts take each other's tasks over by heartbeat.
//! On a file, a task is taken over only when its lease runs out, and the lease covers the
//! task's whole remaining active time, which bounds every call's timeout: a daemon paused that
//! long finds its send timed out. The same pause on both engines, with a clock of the test's
//! own, is `exactly_once::hole_48_5_a_run_paused_after_its_proof_never_sends_its_write`.

use crate::common;
use common::*;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A REST service whose `POST /notes` records each arrival and answers 201.
fn notes_service() -> (String, Arc<Mutex<Vec<String>>>) {
    let server = tiny_http::Server::http("127.0.0.1:0").expect("bind the service");
    let url = format!("http://{}", server.server_addr());
    let log = Arc::new(Mutex::new(Vec::new()));
    let arrivals = Arc::clone(&log);
    std::thread::spawn(move || {
        for mut req in server.incoming_requests() {
            let mut body = String::new();
            let _ = req.as_reader().read_to_string(&mut body);
            log.lock().expect("lock").push(body);
            let resp = tiny_http::Response::from_string(json!({"id": "N-1"}).to_string())
                .with_status_code(201);
            let _ = req.respond(resp);
        }
    });
    (url, arrivals)
}

/// A daemon with its log lines collected; killed when dropped.
struct Daemon {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `worker --config CFG run` on `d`'s database, with `env`; its heartbeat vouches 3 s.
fn daemon(d: &Path, cfg: &str, env: &[(&str, String)]) -> Daemon {
    let mut cmd = command(d);
    cmd.args(["--config", cfg, "run", "--no-auto-settle"])
        .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"])
        .env("RUST_LOG", "info")
        .env_remove("HTTP_PROXY")
        .env_remove("HTTPS_PROXY")
        .env_remove("ALL_PROXY")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("start a daemon");
    let log = Arc::new(Mutex::new(String::new()));
    let lines = Arc::clone(&log);
    let stderr = child.stderr.take().expect("stderr");
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let mut l = lines.lock().expect("lock");
            l.push_str(&line);
            l.push('\n');
        }
    });
    Daemon { child, log }
}

/// Waits up to a minute for `what`.
fn until(what: &str, mut done: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(60);
    while !done() {
        assert!(Instant::now() < end, "waited a minute for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stop_of(d: &Path, cfg: &str) -> Value {
    let out = command(d)
        .args(["--config", cfg, "show", "t1", "--json"])
        .output()
        .expect("show");
    serde_json::from_slice::<Value>(&out.stdout).map_or(Value::Null, |t| t["stop"].clone())
}

/// The scenario, once daemon A is inside its send's slow part (`paused` returned) and stopped:
/// B takes over and holds the write, an operator settles it not applied, B sends it; then A
/// goes on (`let_go`), and `sent` must still be 1 once A is done with it.
fn b_sends_then_a_goes_on(
    d: &Path,
    cfg: &str,
    a: &Daemon,
    let_go: impl FnOnce(),
    a_done: impl Fn() -> bool,
    sent: impl Fn() -> usize,
) {
    signal(a.child.id(), "-STOP");
    let b = daemon(d, cfg, &[]);
    until("B to hold the write", || {
        stop_of(d, cfg) == "unknown_outcome"
    });
    assert_eq!(sent(), 0, "A never sent it");
    let out = command(d)
        .args([
            "--config",
            cfg,
            "reconcile",
            "t1",
            "--not-applied",
            "--by",
            "ops",
        ])
        .output()
        .expect("reconcile");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    until("B to send the write and finish", || {
        stop_of(d, cfg) == "done"
    });
    assert_eq!(sent(), 1, "B sent it");
    drop(b);
    let_go();
    signal(a.child.id(), "-CONT");
    until("A to be done with its send", || a_done() || sent() > 1);
    // A send A might still make would come right after what it just did.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        sent(),
        1,
        "the paused daemon sent the write again:\n{}",
        a.log.lock().expect("lock")
    );
    let log = a.log.lock().expect("lock").clone();
    assert!(log.contains("taken over; nothing was sent"), "{log}");
}

/// A script whose one write is `tool` with `args`.
fn one_write(d: &Path, tool: &str, args: Value) -> String {
    let moves = [
        json!({"type": "plan", "steps": [{"id": "s1", "tool": tool}]}),
        json!({"type": "tool", "name": tool, "plan_step": "s1", "args": args}),
        json!({"type": "final", "outcome": "completed", "text": "done"}),
    ];
    let lines: Vec<String> = moves.iter().map(Value::to_string).collect();
    std::fs::write(d.join("write.jsonl"), lines.join("\n")).expect("script");
    "script:write.jsonl".to_string()
}

fn enqueue_with(d: &Path, cfg: &str, model: &str) {
    let out = command(d)
        .args([
            "--config", cfg, "enqueue", "--user", "cu_ana", "--goal", "note", "--model", model,
        ])
        .output()
        .expect("enqueue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Review 48, hole 5, on the HTTP route: A committed its write's intent, then stopped while
/// its connection to the service was being made (its SYN waiting on the forwarder's full
/// accept queue); let go after B sent the write, it sent it again. A proves its claim only
/// once the connection is made, so it sends nothing.
#[test]
fn a_paused_daemon_never_sends_an_http_write_it_no_longer_owns() {
    let Some(py) = common::mcp::python() else {
        return;
    };
    let Some(dir) = TempDir::on("paused_http", Backend::Postgres) else {
        return;
    };
    let d = dir.path();
    let (url, arrivals) = notes_service();
    let service_port = url.rsplit(':').next().and_then(|p| p.parse::<u16>().ok());
    let via = common::pg::free_port();
    let mut cmd = std::process::Command::new(&py);
    cmd.arg(format!(
        "{}/tests/mcp/forwarder.py",
        env!("CARGO_MANIFEST_DIR")
    ))
    .args([
        via.to_string(),
        service_port.expect("the service's port").to_string(),
        d.display().to_string(),
    ]);
    let _forwarder = common::mcp::listen(cmd, via);
    for (name, url) in [("a", format!("http://127.0.0.1:{via}")), ("b", url)] {
        let catalog = format!(
            "version = 1\n[[tools]]\nname = \"add_note\"\naccess = \"write\"\nidempotent = false\n\
             http = {{ url = \"{url}/notes\", timeout_ms = 60000 }}\n\
             args.text = {{ type = \"string\", required = true }}\n"
        );
        std::fs::write(d.join(format!("{name}-tools.toml")), catalog).expect("catalog");
        std::fs::write(
            d.join(format!("{name}.toml")),
            format!("[tools]\ncatalog = \"{name}-tools.toml\"\n"),
        )
        .expect("config");
    }
    let model = one_write(d, "add_note", json!({"text": "called back"}));
    enqueue_with(d, "b.toml", &model);
    // New connections to A's address wait in connect from the start.
    std::fs::write(d.join("clog"), "clog").expect("clog");
    until("the forwarder to stall new connections", || {
        d.join("clogged").exists()
    });
    let a = daemon(d, "a.toml", &[]);
    until("A to claim the task", || {
        json(d, &["show", "t1", "--json"])["status"] == "running"
    });
    // A script answers at once: A commits the intent and waits in connect well within this.
    std::thread::sleep(Duration::from_millis(1500));
    let log_a = Arc::clone(&a.log);
    let clog = d.join("clog");
    b_sends_then_a_goes_on(
        d,
        "b.toml",
        &a,
        || std::fs::remove_file(&clog).expect("let connections through"),
        || {
            let l = log_a.lock().expect("lock");
            l.contains("nothing was sent") || l.contains("abandoning")
        },
        || arrivals.lock().expect("lock").len(),
    );
}

/// Review 48, hole 5, on the MCP route: A proved its claim, then stopped in the definition
/// check (`tools/list`, slow); let go after B sent the write, it sent it again.
#[test]
fn a_paused_daemon_never_sends_an_mcp_write_it_no_longer_owns() {
    let Some(py) = common::mcp::python() else {
        return;
    };
    let Some(dir) = TempDir::on("paused_mcp", Backend::Postgres) else {
        return;
    };
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let (hold, held) = (d.join("hold"), d.join("held"));
    let server = |extra: &str| {
        format!(
            "[mcp.servers.shop]\ncommand = {:?}\nargs = [{:?}]\ntrusted = true\n\
             env = {{ ARRIVALS = {:?}{extra} }}\n",
            py.display().to_string(),
            common::mcp::server_py(),
            log.display().to_string(),
        )
    };
    std::fs::write(d.join("b.toml"), server("")).expect("config");
    let a_extra = format!(
        ", LIST_HOLD = {:?}, LIST_HELD = {:?}",
        hold.display().to_string(),
        held.display().to_string()
    );
    std::fs::write(d.join("a.toml"), server(&a_extra)).expect("config");
    let model = one_write(
        d,
        "add_note",
        json!({"order_id": "o1", "text": "called back"}),
    );
    enqueue_with(d, "b.toml", &model);
    std::fs::write(&hold, "hold").expect("hold tools/list");
    let a = daemon(d, "a.toml", &[]);
    until("A to check the write's definition", || held.exists());
    let sent = || common::mcp::arrivals_of(&log, "add_note").len();
    let log_a = Arc::clone(&a.log);
    b_sends_then_a_goes_on(
        d,
        "b.toml",
        &a,
        || std::fs::remove_file(&hold).expect("let tools/list answer"),
        || {
            let l = log_a.lock().expect("lock");
            l.contains("nothing was sent") || l.contains("abandoning")
        },
        sent,
    );
}

/// From a hostile review of the fix: over streamable HTTP each MCP request opens a connection
/// of its own, after the gate the call asked first; a daemon paused while that connection was
/// being made (its SYN waiting on a full accept queue) sent the write once let go. The
/// connection asks the gate again once made: the paused daemon sends nothing.
#[test]
fn a_paused_daemon_never_sends_an_mcp_http_write_it_no_longer_owns() {
    let Some(py) = common::mcp::python() else {
        return;
    };
    let Some(dir) = TempDir::on("paused_mcp_http", Backend::Postgres) else {
        return;
    };
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let (hold, held) = (d.join("hold"), d.join("held"));
    let logs = log.display().to_string();
    let (holds, helds) = (hold.display().to_string(), held.display().to_string());
    let server = common::mcp::python_http(
        &py,
        &[
            ("ARRIVALS", &logs),
            ("LIST_HOLD", &holds),
            ("LIST_HELD", &helds),
        ],
    );
    let via = common::pg::free_port();
    let mut cmd = std::process::Command::new(&py);
    cmd.arg(format!(
        "{}/tests/mcp/forwarder.py",
        env!("CARGO_MANIFEST_DIR")
    ))
    .args([
        via.to_string(),
        server.port.to_string(),
        d.display().to_string(),
    ]);
    let _forwarder = common::mcp::listen(cmd, via);
    let config = |port: u16| {
        format!("[mcp.servers.shop]\nurl = \"http://127.0.0.1:{port}/mcp\"\ntrusted = true\n")
    };
    std::fs::write(d.join("a.toml"), config(via)).expect("config");
    std::fs::write(d.join("b.toml"), config(server.port)).expect("config");
    let model = one_write(
        d,
        "add_note",
        json!({"order_id": "o1", "text": "called back"}),
    );
    enqueue_with(d, "b.toml", &model);
    std::fs::write(&hold, "hold").expect("hold tools/list");
    let a = daemon(d, "a.toml", &[]);
    until("A to check the write's definition", || held.exists());
    // New connections to A's address now wait in connect; A goes on to make one for the call.
    std::fs::write(d.join("clog"), "clog").expect("clog");
    until("the forwarder to stall new connections", || {
        d.join("clogged").exists()
    });
    std::fs::remove_file(&hold).expect("let tools/list answer");
    std::thread::sleep(Duration::from_millis(500));
    let sent = || common::mcp::arrivals_of(&log, "add_note").len();
    let log_a = Arc::clone(&a.log);
    let clog = d.join("clog");
    b_sends_then_a_goes_on(
        d,
        "b.toml",
        &a,
        || std::fs::remove_file(&clog).expect("let connections through"),
        || {
            let l = log_a.lock().expect("lock");
            l.contains("nothing was sent") || l.contains("abandoning")
        },
        sent,
    );
}
