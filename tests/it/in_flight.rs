//! A write in flight when its daemon was killed: its service applied it, no answer was
//! recorded, and whatever ends its task afterwards (an operator's cancel while no daemon ran,
//! the task's wall-clock deadline passing before a daemon picked it up again), the write stays
//! held: `worker reconcile`, `worker show` and the closing message name it until an operator
//! settles it. A REST service of the test's own applies the write and never answers.

use crate::common;
use common::*;

use serde_json::{Value, json};
use std::path::Path;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A service whose `POST /notes` records each arrival (its Idempotency-Key), applies it, and
/// then holds the connection without answering, as a service does whose answer is lost.
struct Service {
    url: String,
    arrivals: Arc<Mutex<Vec<String>>>,
}

fn service() -> Service {
    let server = tiny_http::Server::http("127.0.0.1:0").expect("bind the service");
    let url = format!("http://{}", server.server_addr());
    let arrivals = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&arrivals);
    std::thread::spawn(move || {
        let mut open = Vec::new();
        for req in server.incoming_requests() {
            let key = idempotency_key(&req).unwrap_or_default();
            log.lock().expect("lock").push(key);
            // Applied, never answered: the request stays open until the daemon dies.
            open.push(req);
        }
    });
    Service { url, arrivals }
}

impl Service {
    fn arrivals(&self) -> Vec<String> {
        self.arrivals.lock().expect("lock").clone()
    }
}

/// A catalog with one write that is not idempotent (`add_note`, at the service) and a config
/// naming it.
fn setup(d: &Path, url: &str) {
    let catalog = format!(
        "version = 1\n[[tools]]\nname = \"add_note\"\naccess = \"write\"\nidempotent = false\n\
         http = {{ url = \"{url}/notes\", timeout_ms = 60000 }}\n\
         args.text = {{ type = \"string\", required = true }}\n"
    );
    std::fs::write(d.join("tools.toml"), catalog).expect("catalog");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
    let moves = [
        json!({"type": "plan", "steps": [{"id": "s1", "tool": "add_note"}]}),
        json!({"type": "tool", "name": "add_note", "plan_step": "s1", "args": {"text": "called back"}}),
        json!({"type": "final", "outcome": "completed", "text": "done"}),
    ];
    let lines: Vec<String> = moves.iter().map(Value::to_string).collect();
    std::fs::write(d.join("note.jsonl"), lines.join("\n")).expect("script");
}

/// `worker --config worker.toml ARGS` in `d`, which must succeed.
fn okc(d: &Path, args: &[&str]) -> String {
    let out = command(d)
        .args(["--config", "worker.toml"])
        .args(args)
        .output()
        .expect("run worker");
    succeeded(out, args)
}

fn jsonc(d: &Path, args: &[&str]) -> Value {
    serde_json::from_str(&okc(d, args)).expect("JSON")
}

/// Starts a daemon, waits until the service has the write, and kills the daemon with SIGKILL.
fn killed_mid_write(d: &Path, svc: &Service) {
    let mut daemon = command(d)
        .args(["--config", "worker.toml", "run", "--no-auto-settle"])
        .args(["--heartbeat-ttl-ms", "3000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the daemon");
    let until = Instant::now() + Duration::from_secs(60);
    while svc.arrivals().is_empty() {
        assert!(
            Instant::now() < until,
            "the write never reached the service"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    daemon.kill().expect("SIGKILL the daemon");
    daemon.wait().expect("reap the daemon");
}

/// The task ended `stop` and its write stays held: listed by reconcile under the key that
/// reached the service, named by show and the closing message; settled, it leaves the list.
fn held_beside(d: &Path, svc: &Service, stop: &str) {
    let t = jsonc(d, &["show", "t1", "--json"]);
    assert_eq!(t["stop"], stop, "{t}");
    assert_eq!(t["status"], "finished", "{t}");
    assert_eq!(t["state"]["pending"]["name"], "add_note", "{t}");
    assert_eq!(t["state"]["tool_calls"], 1, "the write was made: {t}");
    let closing = t["closing_message"].as_str().unwrap_or("");
    assert!(closing.contains("not known whether add_note"), "{closing}");
    let held = jsonc(d, &["reconcile", "--json"]);
    assert_eq!(held.as_array().map(Vec::len), Some(1), "{held}");
    assert_eq!(held[0]["task"], "t1", "{held}");
    assert_eq!(held[0]["key"], svc.arrivals()[0].as_str(), "{held}");
    okc(
        d,
        &[
            "reconcile",
            "t1",
            "--applied",
            "--result",
            r#"{"status": "ok"}"#,
            "--by",
            "ops",
        ],
    );
    assert_eq!(jsonc(d, &["reconcile", "--json"]), json!([]));
    assert_eq!(jsonc(d, &["show", "t1", "--json"])["stop"], stop);
    okc(d, &["run", "--drain", "--no-auto-settle"]);
    assert_eq!(svc.arrivals().len(), 1, "the write was sent once");
}

conformance! {
    /// Review 48, hole 1: cancelled while no daemon ran, a task whose write was in flight
    /// ended `cancelled` with 0 tool calls and the write vanished from reconcile.
    fn a_write_in_flight_stays_held_when_its_task_is_cancelled(d) {
        let svc = service();
        setup(d, &svc.url);
        okc(d, &["enqueue", "--user", "cu_ana", "--goal", "note", "--model", "script:note.jsonl"]);
        killed_mid_write(d, &svc);
        okc(d, &["cancel", "t1", "--reason", "customer withdrew", "--by", "ops"]);
        okc(d, &["run", "--drain", "--no-auto-settle"]);
        held_beside(d, &svc, "cancelled");
    }

    /// Review 48, hole 1: the same when the task's wall-clock deadline (`--finish-within`)
    /// passed before a daemon picked it up again.
    fn a_write_in_flight_stays_held_when_its_deadline_passes(d) {
        let svc = service();
        setup(d, &svc.url);
        okc(
            d,
            &["enqueue", "--user", "cu_ana", "--goal", "note", "--model", "script:note.jsonl",
              "--finish-within", "3s"],
        );
        let enqueued = Instant::now();
        killed_mid_write(d, &svc);
        if let Some(left) = Duration::from_millis(3_500).checked_sub(enqueued.elapsed()) {
            std::thread::sleep(left);
        }
        okc(d, &["run", "--drain", "--no-auto-settle"]);
        held_beside(d, &svc, "timed_out");
    }
}

/// Puts back in the queue the tasks of daemons that died (as a daemon starting does, before
/// it claims anything).
fn recover(d: &Path) {
    let db = database(d);
    let now = tether::clock::now_ms();
    let back = db.recover(now, &|_| true, &|_, _| false).expect("recover");
    assert_eq!(back, ["t1"]);
    assert_eq!(
        db.task("t1").expect("t1").status,
        tether::store::QueueStatus::Queued
    );
}

conformance! {
    /// From the review of this fix: a held write settled `--not-applied`, re-sent, its daemon
    /// killed mid-send, the task put back in the queue, then cancelled: the cancel saw the
    /// stop the task had before the re-send (`unknown_outcome`), took the write for one
    /// already held, and ended the task with nothing held. The re-sent write is held.
    fn a_resent_write_in_flight_stays_held_when_its_queued_task_is_cancelled(d) {
        let svc = service();
        setup(d, &svc.url);
        okc(d, &["enqueue", "--user", "cu_ana", "--goal", "note", "--model", "script:note.jsonl"]);
        killed_mid_write(d, &svc);
        okc(d, &["run", "--drain", "--no-auto-settle"]);
        assert_eq!(jsonc(d, &["show", "t1", "--json"])["stop"], "unknown_outcome");
        okc(d, &["reconcile", "t1", "--not-applied", "--by", "ops"]);
        let before = svc.arrivals().len();
        let mut daemon = command(d)
            .args(["--config", "worker.toml", "run", "--no-auto-settle"])
            .args(["--heartbeat-ttl-ms", "3000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the daemon");
        let until = Instant::now() + Duration::from_secs(60);
        while svc.arrivals().len() == before {
            assert!(Instant::now() < until, "the re-send never reached the service");
            std::thread::sleep(Duration::from_millis(20));
        }
        daemon.kill().expect("SIGKILL the daemon");
        daemon.wait().expect("reap the daemon");
        recover(d);
        okc(d, &["cancel", "t1", "--reason", "customer withdrew", "--by", "ops"]);
        let t = jsonc(d, &["show", "t1", "--json"]);
        assert_eq!((&t["status"], &t["stop"]), (&json!("finished"), &json!("cancelled")), "{t}");
        assert_eq!(t["state"]["cancelled_from"], "unknown_outcome", "{t}");
        let held = jsonc(d, &["reconcile", "--json"]);
        assert_eq!(held.as_array().map(Vec::len), Some(1), "{held}");
        assert_eq!(held[0]["key"], svc.arrivals()[before].as_str(), "{held}");
    }
}

/// From the review of this fix: a write in flight whose call record cannot be read. Cancelled
/// while queued, the task ended with nothing held (the record was skipped); cancelled while
/// its daemon was gone, the next daemon failed on the record at every lease and the task
/// stayed running. Now the queued cancel is refused, naming the record, and a daemon runs the
/// task on until the write is held (a damaged record is held, never sent), then cancels it.
#[test]
fn a_damaged_call_record_in_flight_is_never_dropped_by_a_cancel() {
    let dir = TempDir::new("in-flight-damaged");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    okc(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "note",
            "--model",
            "script:note.jsonl",
        ],
    );
    killed_mid_write(d, &svc);
    {
        let db = redb::Database::open(d.join("worker.redb")).expect("open the file");
        let w = db.begin_write().expect("write");
        {
            let mut t = w
                .open_table(tether::store::schema::CALL_KEYS)
                .expect("call keys");
            let key = svc.arrivals()[0].clone();
            t.insert(key.as_str(), &b"not a record"[..])
                .expect("damage it");
        }
        w.commit().expect("commit");
    }
    recover(d);
    let out = command(d)
        .args(["--config", "worker.toml", "cancel", "t1", "--by", "ops"])
        .output()
        .expect("cancel");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot be read") && err.contains("worker check"),
        "{err}"
    );
    assert_eq!(jsonc(d, &["show", "t1", "--json"])["status"], "queued");
    // Claimed by a daemon that died at once, then cancelled while no daemon ran.
    {
        let db = database(d);
        let now = tether::clock::now_ms();
        // A process of this host that has ended: a daemon judges its claims dead at once.
        let mut ended = std::process::Command::new("true").spawn().expect("true");
        let pid = ended.id();
        ended.wait().expect("reap");
        let mut lease = tether::worker::Identity::current().lease(now, 60_000);
        lease.pid = pid;
        lease.owner = format!("{}:{pid}:0:0", lease.host);
        assert_eq!(db.claim(&lease, 1, now).expect("claim").len(), 1);
    }
    okc(d, &["cancel", "t1", "--by", "ops"]);
    okc(d, &["run", "--drain", "--no-auto-settle"]);
    let t = jsonc(d, &["show", "t1", "--json"]);
    assert_eq!(
        (&t["status"], &t["stop"]),
        (&json!("finished"), &json!("cancelled")),
        "{t}"
    );
    let held = jsonc(d, &["reconcile", "--json"]);
    assert_eq!(held.as_array().map(Vec::len), Some(1), "{held}");
    assert!(held[0]["call_record_error"].is_string(), "{held}");
    assert_eq!(svc.arrivals().len(), 1, "never sent again");
}
