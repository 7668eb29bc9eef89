//! The daemon as operators run it: graceful shutdown on SIGTERM and SIGINT, two daemons on one
//! file never running the same task, and a task driven by a JSONL script of replies.

use crate::common;
use common::*;

use std::process::Stdio;
use std::time::Duration;

fn enqueue_many(d: &std::path::Path, n: usize, model: &str) {
    let lines: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"user": "cu_ana", "goal": "refund the damaged item on order ord_1001", "model": "{model}", "store_scope": "s{i}"}}"#))
        .collect();
    std::fs::write(d.join("tasks.jsonl"), lines.join("\n")).expect("write tasks");
    ok(
        d,
        &["enqueue", "--model", "policy", "--file", "tasks.jsonl"],
    );
}

/// A signal: the daemon commits the step in progress, releases its leases and exits 0.
fn signal_releases(d: &std::path::Path, sig: &str) {
    enqueue_many(d, 12, "policy");
    // Slow steps (1.5 s of model latency = 30 ms), so tasks are mid-run at the signal.
    let child = command(d)
        .args(["run", "--max-in-flight", "3", "--time-scale", "0.02"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start daemon");
    std::thread::sleep(Duration::from_millis(250));
    signal(child.id(), sig);
    let out = child.wait_with_output().expect("daemon exits");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{sig}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tasks = json(d, &["list", "--json", "--limit", "10000"]);
    let tasks = tasks.as_array().expect("array");
    assert!(
        tasks.iter().all(|t| t["status"] != "running"),
        "{sig}: a lease was left behind: {tasks:?}"
    );
    assert!(
        tasks.iter().any(|t| t["status"] == "queued"),
        "{sig}: the signal came after all work was done"
    );
    // Released tasks continue from their committed state and finish with one effect each.
    ok(d, &["run", "--drain"]);
    let tasks = json(d, &["list", "--json", "--limit", "10000"]);
    assert!(
        tasks
            .as_array()
            .expect("array")
            .iter()
            .all(|t| t["stop"] == "done"),
        "{tasks}"
    );
    let ledger = json(d, &["store", "ledger", "--json"]);
    assert_eq!(
        ledger.as_array().map(Vec::len),
        Some(24),
        "one refund and one email per task"
    );
}

conformance! {
    fn sigterm_commits_releases_and_exits_zero(d) {
        signal_releases(d, "-TERM");
    }

    fn sigint_commits_releases_and_exits_zero(d) {
        signal_releases(d, "-INT");
    }
}

conformance! {
    fn two_daemons_never_run_the_same_task(d) {
        enqueue_many(d, 40, "policy");
        let start = || {
            command(d)
                .args(["run", "--max-in-flight", "4", "--drain", "--time-scale", "0.002", "--shared"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start daemon")
        };
        let (mut a, mut b) = (start(), start());
        assert!(a.wait().expect("a").success());
        assert!(b.wait().expect("b").success());
        let tasks = json(d, &["list", "--json", "--limit", "10000"]);
        for t in tasks.as_array().expect("array") {
            assert_eq!(t["runs"], 1, "claimed more than once: {t}");
            assert_eq!(t["stop"], "done", "{t}");
        }
        let ledger = json(d, &["store", "ledger", "--json"]);
        assert_eq!(ledger.as_array().map(Vec::len), Some(80));
    }
}

conformance! {
    fn a_task_driven_by_a_jsonl_script(d) {
        let script = r#"{"type": "plan", "steps": [{"id": "s1", "tool": "get_order"}]}
    this line is not JSON
    {"type": "tool", "name": "get_order", "args": {"order_id": "ord_1001"}, "plan_step": "s1"}
    {"type": "final", "outcome": "completed", "text": "read it"}
    "#;
        std::fs::write(d.join("replies.jsonl"), script).expect("write");
        ok(
            d,
            &[
                "enqueue",
                "--user",
                "cu_ana",
                "--goal",
                "read my order",
                "--model",
                "script:replies.jsonl",
            ],
        );
        ok(d, &["run", "--drain"]);
        let show = json(d, &["show", "t1", "--json"]);
        assert_eq!(show["stop"], "done");
        assert_eq!(show["steps"], 4);
        assert_eq!(show["state"]["answer"], "read it");
        assert_eq!(show["state"]["facts"]["ord_1001.total_cents"], 4200);
    }
}

conformance! {
    /// Issue 8, defect 2: a daemon paused (SIGSTOP) past its lease while another daemon takes the
    /// task over. When it resumes, its commits carry a superseded fencing token and are refused:
    /// the task's committed state never goes back, and no write is sent twice.
    fn a_daemon_paused_past_its_lease_never_commits_again(d) {
        // ~3 s of active time at 100 ms per model call; a 4 s deadline keeps the lease short
        // (lease 1 s + the 4 s of active time left).
        enqueue(
            d,
            &[
                "--model",
                "policy:ord_1001:3000:100",
                "--budget",
                "deadline_ms=4000",
            ],
        );
        let a = command(d)
            .args([
                "run",
                "--max-in-flight",
                "1",
                "--lease-ms",
                "1000",
                "--time-scale",
                "1",
                "--shared",
            ])
            .env_remove("WORKER_STORE")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("daemon a");
        let mut started = false;
        for _ in 0..500 {
            if json(d, &["show", "t1", "--json"])["steps"].as_u64() >= Some(1) {
                started = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(started, "daemon a never started t1");
        signal(a.id(), "-STOP");
        let paused_at = json(d, &["show", "t1", "--json"]);
        // Past the lease: 1 s + 4 s of active time, with room for a loaded machine.
        std::thread::sleep(Duration::from_millis(6500));
        ok(d, &["run", "--drain", "--max-in-flight", "1", "--shared"]);
        let after_b = json(d, &["show", "t1", "--json"]);
        assert_eq!(after_b["runs"], 2, "daemon b took the task over: {after_b}");
        assert!(after_b["steps"].as_u64() >= paused_at["steps"].as_u64());
        signal(a.id(), "-CONT");
        // Daemon a goes on with its stale copy until its next commit, which must be refused.
        std::thread::sleep(Duration::from_millis(2500));
        signal(a.id(), "-TERM");
        let out = a.wait_with_output().expect("daemon a exits");
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(log.contains("claim superseded"), "{log}");
        let finally = json(d, &["show", "t1", "--json"]);
        assert_eq!(
            finally["state"], after_b["state"],
            "a stale commit was applied"
        );
        assert_eq!(finally["updated_at_ms"], after_b["updated_at_ms"]);
        assert_sent_at_most_once(d, &[], 0);
    }
}

/// An idle daemon on the file is woken by the enqueue's commit: with its polling and recovery
/// set ten minutes apart, a task enqueued by another process while it waits still runs (the
/// test would wait those ten minutes without the wake-up).
#[test]
fn an_idle_daemon_on_the_file_is_woken_by_an_enqueue() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;
    use tether::store::RedbStore;
    use tether::tools::durable::DurableStore;
    let dir = TempDir::new("file_wake");
    let db = dir.path().join("worker.redb");
    let store = Arc::new(RedbStore::open(&db, true).expect("open"));
    let shop = dir.path().join("worker.store.redb");
    let tools = Arc::new(DurableStore::open_target(&shop.to_string_lossy()).expect("store"));
    let stop = Arc::new(AtomicBool::new(false));
    let daemon = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let cfg = tether::worker::Config {
                demo: Some(Arc::new(tether::tools::durable::DemoShop::opened(
                    Arc::clone(&tools),
                ))),
                max_in_flight: 1,
                poll_ms: 600_000,
                recover_every_ms: 600_000,
                ..Default::default()
            };
            tether::worker::run(store, &cfg, stop).expect("daemon")
        })
    };
    // Let it find the queue empty and wait.
    std::thread::sleep(Duration::from_millis(500));
    let id = enqueue(dir.path(), &[]).trim().to_string();
    let started = Instant::now();
    let mut status = String::new();
    while started.elapsed() < Duration::from_secs(120) {
        status = json(dir.path(), &["show", &id, "--json"])["status"]
            .as_str()
            .unwrap_or("")
            .to_string();
        if status == "finished" {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::SeqCst);
    // The stopping daemon waits for a wake-up too: touch the file.
    let f = std::fs::File::options()
        .write(true)
        .open(&db)
        .expect("the file");
    f.set_modified(std::time::SystemTime::now()).expect("touch");
    assert_eq!(status, "finished", "the idle daemon never started {id}");
    daemon.join().expect("daemon");
}

/// Issue 52: a daemon started while its killed predecessor is still being ended by the system
/// (which keeps the file's lock until then) waits for the lock, says so in its log, and runs,
/// instead of refusing as if the predecessor still ran.
#[test]
fn a_daemon_started_as_its_killed_predecessor_ends_waits_for_its_lock() {
    use std::io::BufRead;
    let dir = TempDir::new("lock-wait");
    let d = dir.path();
    enqueue(d, &[]);
    // The predecessor: a process that has ended and is not yet reaped (the system's part of
    // ending it is not done), named in the lock file; the lock itself is let go a moment later.
    let mut ended = std::process::Command::new("true").spawn().expect("true");
    let stat = format!("/proc/{}/stat", ended.id());
    while !std::fs::read_to_string(&stat).is_ok_and(|s| s.contains(") Z ")) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let mut holder = std::process::Command::new("python3")
        .args([
            "-c",
            "import fcntl, sys, time\n\
             f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n\
             f.truncate(0); f.write(sys.argv[2] + '\\n'); f.flush()\n\
             print('held', flush=True); time.sleep(1.5)",
            "worker.redb.lock",
            &ended.id().to_string(),
        ])
        .current_dir(d)
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("the holder's word");
    assert_eq!(line.trim(), "held");
    let out = worker(d, &["run", "--drain"]);
    let _ = holder.wait();
    let _ = ended.wait();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("has not yet let go of its lock; waiting"),
        "{err}"
    );
    assert!(ok(d, &["show", "t1"]).contains("stop      done"));
}

/// The other side: a daemon that still runs holds the file, and a second is refused at once,
/// naming it.
#[test]
fn a_daemon_beside_a_running_one_is_refused_at_once() {
    let dir = TempDir::new("lock-live");
    let d = dir.path();
    let mut first = command(d)
        .args(["run"])
        .stderr(Stdio::null())
        .spawn()
        .expect("the first daemon");
    let socket = d.join("worker.redb.sock");
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !socket.exists() {
        assert!(
            std::time::Instant::now() < until,
            "the first daemon never served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let (code, err) = fails(d, &["run"]);
    let _ = first.kill();
    let _ = first.wait();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains(&format!("the daemon with pid {} already runs", first.id())),
        "{err}"
    );
    // A live daemon is not waited for: the refusal comes without the wait's log line.
    assert!(!err.contains("waiting"), "{err}");
}
