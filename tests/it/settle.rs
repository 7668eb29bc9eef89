//! Held writes settled without a person: a daemon killed with SIGKILL between sending a
//! non-idempotent write and recording its answer leaves the write's outcome unknown; the next
//! daemon asks the tool's `lookup_url` by itself, settles what it answers (audited under the
//! daemon's identity), and the task runs on with the service's real result. The service's
//! arrivals log shows the write arrived once. A lookup that cannot answer leaves the write to
//! an operator, and `--no-auto-settle` leaves every held write to one.

use crate::common;
use common::*;

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A ticket service: `POST /customers` answers a customer; `POST /tickets` creates a ticket
/// for each new Idempotency-Key (it is not idempotent: a repeat makes another ticket) and,
/// while `stall` is set, answers only after 60 s; `GET /tickets/lookup?key=K` says whether
/// K made a ticket and which, or 503 while `lookup_down` is set.
struct Service {
    url: String,
    /// (method and path without the query, key) of every request, in arrival order.
    log: Arc<Mutex<Vec<(String, String)>>>,
    stall: Arc<AtomicBool>,
    lookup_down: Arc<AtomicBool>,
    /// `POST /tickets` answers 500 after making the ticket, and the lookup says it did not.
    broken: Arc<AtomicBool>,
    /// `POST /tickets` makes the ticket only after the lookup has answered "not applied" once
    /// (honestly: it is still working), long after the write's 1 s timeout.
    slow: Arc<AtomicBool>,
}

fn service() -> Service {
    let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("bind"));
    let url = format!("http://{}", server.server_addr());
    let log: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let tickets: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
    let stall = Arc::new(AtomicBool::new(false));
    let lookup_down = Arc::new(AtomicBool::new(false));
    let broken = Arc::new(AtomicBool::new(false));
    let slow = Arc::new(AtomicBool::new(false));
    // How many lookups answered "not applied".
    let not_applied: Arc<AtomicUsize> = Arc::default();
    let (log2, stall2, down2, broken2, slow2) = (
        Arc::clone(&log),
        Arc::clone(&stall),
        Arc::clone(&lookup_down),
        Arc::clone(&broken),
        Arc::clone(&slow),
    );
    std::thread::spawn(move || {
        for mut req in server.incoming_requests() {
            let not_applied = Arc::clone(&not_applied);
            let (log, tickets, stall, down, broken, slow) = (
                Arc::clone(&log2),
                Arc::clone(&tickets),
                Arc::clone(&stall2),
                Arc::clone(&down2),
                Arc::clone(&broken2),
                Arc::clone(&slow2),
            );
            // A thread per request: a stalled write must not hold up the lookups.
            std::thread::spawn(move || {
                let mut body = String::new();
                let _ = req.as_reader().read_to_string(&mut body);
                let url = req.url().to_string();
                let (path, query) = url.split_once('?').unwrap_or((&url, ""));
                let header = idempotency_key(&req);
                let key = header
                    .or_else(|| query.strip_prefix("key=").map(percent_decoded))
                    .unwrap_or_default();
                log.lock()
                    .expect("lock")
                    .push((format!("{} {path}", req.method()), key.clone()));
                let (status, answer) = match path {
                    "/customers" => (200, json!({"id": "C-7", "name": "Ana"})),
                    "/tickets" => {
                        if slow.load(Ordering::SeqCst) {
                            let asked = Instant::now();
                            while not_applied.load(Ordering::SeqCst) == 0
                                && asked.elapsed() < Duration::from_secs(60)
                            {
                                std::thread::sleep(Duration::from_millis(10));
                            }
                        }
                        let id = {
                            let mut t = tickets.lock().expect("lock");
                            let id = format!("T-{}", t.len() + 1);
                            t.insert(key.clone(), id.clone());
                            id
                        };
                        if stall.load(Ordering::SeqCst) {
                            std::thread::sleep(Duration::from_secs(60));
                        }
                        if broken.load(Ordering::SeqCst) {
                            (500, json!({"message": "internal error"}))
                        } else {
                            (201, json!({"ticket_id": id}))
                        }
                    }
                    "/tickets/lookup" if broken.load(Ordering::SeqCst) => {
                        (200, json!({"applied": false}))
                    }
                    "/tickets/lookup" if down.load(Ordering::SeqCst) => {
                        (503, json!({"message": "lookup unavailable"}))
                    }
                    "/tickets/lookup" => match tickets.lock().expect("lock").get(&key) {
                        Some(id) => (200, json!({"applied": true, "result": {"ticket_id": id}})),
                        None => {
                            not_applied.fetch_add(1, Ordering::SeqCst);
                            (200, json!({"applied": false}))
                        }
                    },
                    _ => (404, json!({})),
                };
                let _ = req.respond(
                    tiny_http::Response::from_string(answer.to_string())
                        .with_status_code(status)
                        .with_header(
                            tiny_http::Header::from_bytes(b"Content-Type", b"application/json")
                                .expect("header"),
                        ),
                );
            });
        }
    });
    Service {
        url,
        log,
        stall,
        lookup_down,
        broken,
        slow,
    }
}

/// A query value as the service reads it (`%3A` is `:`).
fn percent_decoded(s: &str) -> String {
    let mut out = Vec::new();
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match (
            b[i],
            s.get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok()),
        ) {
            (b'%', Some(v)) => {
                out.push(v);
                i += 3;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Service {
    fn count(&self, what: &str) -> usize {
        let log = self.log.lock().expect("lock");
        log.iter().filter(|(p, _)| p == what).count()
    }
}

fn setup(d: &Path, url: &str, auto_settle: bool) {
    setup_with(d, url, auto_settle, ", lookup_grace_ms = 1000");
}

/// The catalog, with `extra` added to the write's `http` table.
fn setup_with(d: &Path, url: &str, auto_settle: bool, extra: &str) {
    let switch = if auto_settle {
        extra.to_string()
    } else {
        format!("{extra}, auto_settle = false")
    };
    let catalog = format!(
        "version = 1\n\
         [[tools]]\nname = \"find_customer\"\naccess = \"read\"\nidempotent = true\n\
         http = {{ url = \"{url}/customers\" }}\n\
         args.customer_id = {{ type = \"string\", required = true }}\n\
         [[tools]]\nname = \"open_ticket\"\naccess = \"write\"\nidempotent = false\n\
         fact_fields = [\"ticket_id\"]\n\
         http = {{ url = \"{url}/tickets\", timeout_ms = 1000, lookup_url = \"{url}/tickets/lookup\"{switch} }}\n\
         args.title = {{ type = \"string\", required = true }}\n"
    );
    std::fs::write(d.join("tools.toml"), catalog).expect("catalog");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
}

fn worker_c(d: &Path) -> Command {
    let mut c = Command::new(bin());
    c.args(["--config", "worker.toml"])
        .current_dir(d)
        .env_remove("WORKER_DB")
        .env_remove("WORKER_CONFIG");
    c
}

fn okc(d: &Path, args: &[&str]) -> String {
    succeeded(worker_c(d).args(args).output().expect("run"), args)
}

fn show(d: &Path, id: &str) -> Value {
    serde_json::from_str(&okc(d, &["show", id, "--json"])).expect("JSON")
}

fn task(d: &Path, name: &str) -> String {
    let moves = [
        json!({"type": "plan", "steps": [{"id": "s1", "tool": "find_customer"},
            {"id": "s2", "tool": "open_ticket", "depends_on": ["s1"]}]}),
        json!({"type": "tool", "name": "find_customer", "plan_step": "s1",
            "args": {"customer_id": "cu_ana"}}),
        json!({"type": "tool", "name": "open_ticket", "plan_step": "s2",
            "args": {"title": "damaged jacket"}}),
        json!({"type": "final", "outcome": "completed", "text": "ticket opened"}),
    ];
    let lines: Vec<String> = moves.iter().map(Value::to_string).collect();
    std::fs::write(d.join(format!("{name}.jsonl")), lines.join("\n")).expect("script");
    let model = format!("script:{name}.jsonl");
    okc(
        d,
        &[
            "enqueue", "--user", "cu_ana", "--goal", name, "--model", &model,
        ],
    )
    .trim()
    .to_string()
}

fn daemon(d: &Path) -> Child {
    worker_c(d)
        .args(["run", "--max-in-flight", "1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the daemon")
}

/// Waits (60 s at most) until `cond` holds.
fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "waited too long for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A task whose daemon was killed with SIGKILL while its ticket write was in flight (the
/// service made the ticket and had not answered yet).
fn killed_mid_write(d: &Path, svc: &Service) -> String {
    setup(d, &svc.url, true);
    svc.stall.store(true, Ordering::SeqCst);
    let id = task(d, "ticket");
    let mut first = daemon(d);
    wait_for("the write to arrive", || svc.count("POST /tickets") == 1);
    first.kill().expect("SIGKILL");
    first.wait().expect("reap");
    svc.stall.store(false, Ordering::SeqCst);
    id
}

/// Must-show 3: SIGKILL between the write and its answer; the next daemon settles the held
/// write by the lookup alone, audited as the daemon's decision, and the model gets the real
/// ticket id. The write arrived once.
#[test]
fn a_write_held_by_a_crash_is_settled_by_the_daemon_from_its_lookup() {
    let dir = TempDir::new("settle-crash");
    let d = dir.path();
    let svc = service();
    let id = killed_mid_write(d, &svc);
    let t = show(d, &id);
    assert_eq!(t["status"], "running", "killed mid-write: {t}");

    let mut second = daemon(d);
    wait_for("the task to end", || show(d, &id)["stop"] == "done");
    second.kill().expect("stop the daemon");
    second.wait().expect("reap");

    let t = show(d, &id);
    assert_eq!(svc.count("POST /tickets"), 1, "sent once: {:?}", svc.log);
    assert!(svc.count("GET /tickets/lookup") >= 1, "{:?}", svc.log);
    assert_eq!(
        t["state"]["facts"]["open_ticket.ticket_id"], "T-1",
        "the real result: {t}"
    );
    let events: Value = serde_json::from_str(&okc(d, &["events", &id, "--json"])).expect("JSON");
    let settled: Vec<&Value> = events
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["verb"] == "reconcile_applied")
        .collect();
    assert_eq!(settled.len(), 1, "{events}");
    assert!(
        settled[0]["by"]
            .as_str()
            .is_some_and(|b| b.starts_with("daemon ")),
        "audited as the daemon's: {events}"
    );
    assert!(
        settled[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("lookup_url")),
        "{events}"
    );
}

/// What the lookup cannot answer stays for a person; once it can, a drain settles it. With
/// `auto_settle = false` (or `--no-auto-settle`) nothing is asked at all.
#[test]
fn only_a_definite_lookup_answer_settles_and_the_switch_turns_it_off() {
    let dir = TempDir::new("settle-down");
    let d = dir.path();
    let svc = service();
    let id = killed_mid_write(d, &svc);

    // The lookup is down: the write stays held, for an operator. (The drain asks once the
    // write's send can no longer be in flight: after its one-second timeout.)
    svc.lookup_down.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(1100));
    okc(d, &["run", "--drain"]);
    let t = show(d, &id);
    assert_eq!(t["stop"], "unknown_outcome", "{t}");
    assert!(svc.count("GET /tickets/lookup") >= 1, "{:?}", svc.log);

    // Switched off: the lookup is up, and still nothing is asked.
    svc.lookup_down.store(false, Ordering::SeqCst);
    let asked = svc.count("GET /tickets/lookup");
    okc(d, &["run", "--drain", "--no-auto-settle"]);
    assert_eq!(show(d, &id)["stop"], "unknown_outcome");
    setup(d, &svc.url, false);
    okc(d, &["run", "--drain"]);
    assert_eq!(show(d, &id)["stop"], "unknown_outcome");
    assert_eq!(svc.count("GET /tickets/lookup"), asked, "nothing asked");

    // On again: the drain settles it and the task ends.
    setup(d, &svc.url, true);
    okc(d, &["run", "--drain"]);
    let t = show(d, &id);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["facts"]["open_ticket.ticket_id"], "T-1", "{t}");
    assert_eq!(svc.count("POST /tickets"), 1, "sent once: {:?}", svc.log);
}

/// A lookup that says "not applied" is believed once: the write is sent again under its key.
/// If that send is held again, the lookup and the service disagree, and the daemon leaves it to
/// a person instead of sending it again and again.
#[test]
fn a_lookup_that_disagrees_with_the_service_gets_one_resend_then_a_person() {
    let dir = TempDir::new("settle-disagree");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url, true);
    svc.broken.store(true, Ordering::SeqCst);
    let id = task(d, "ticket");
    okc(d, &["run", "--drain"]);
    // Held after the 500; asked once its send can no longer be in flight.
    std::thread::sleep(Duration::from_millis(1100));
    okc(d, &["run", "--drain"]);
    std::thread::sleep(Duration::from_millis(1100));
    okc(d, &["run", "--drain"]);
    okc(d, &["run", "--drain"]);
    let t = show(d, &id);
    assert_eq!(t["stop"], "unknown_outcome", "left to a person: {t}");
    assert_eq!(
        svc.count("POST /tickets"),
        2,
        "one re-send, no more: {:?}",
        svc.log
    );
    let events: Value = serde_json::from_str(&okc(d, &["events", &id, "--json"])).expect("JSON");
    let by_daemon = events
        .as_array()
        .expect("events")
        .iter()
        .filter(|e| e["verb"] == "reconcile_not_applied")
        .count();
    assert_eq!(by_daemon, 1, "{events}");
}

/// A slow service that makes the ticket only when it is done answers the lookup "not applied",
/// honestly, while it works: the daemon does not take that for final before the tool's
/// `lookup_grace_ms` (60 s by default), asks again, and settles the write as applied once the
/// service has done it. The write arrives once.
#[test]
fn a_slow_write_is_not_sent_again_while_the_service_may_still_be_doing_it() {
    let dir = TempDir::new("settle-slow");
    let d = dir.path();
    let svc = service();
    setup_with(d, &svc.url, true, "");
    svc.slow.store(true, Ordering::SeqCst);
    let id = task(d, "ticket");
    let mut daemon = daemon(d);
    wait_for("the task to end", || show(d, &id)["stop"] == "done");
    daemon.kill().expect("stop the daemon");
    daemon.wait().expect("reap");
    let t = show(d, &id);
    assert_eq!(svc.count("POST /tickets"), 1, "sent once: {:?}", svc.log);
    assert_eq!(t["state"]["facts"]["open_ticket.ticket_id"], "T-1", "{t}");
    assert!(
        svc.count("GET /tickets/lookup") >= 2,
        "asked until it knew: {:?}",
        svc.log
    );
}
