//! The executor holds tasks, not threads: a newcomer's `worker run` with no flags has all of
//! 500 enqueued tasks of a profile waiting on their model at once, against a fake provider
//! that counts the requests it holds open; a concurrency key still bounds them; and every
//! task handed to an idle daemon through its socket is started by a wake-up, never by the
//! fallback poll (the daemon's `tether_tasks_claimed_total{by}` says what started each).

use crate::common::*;

use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What the fake provider has seen.
#[derive(Default)]
struct Open {
    now: usize,
    most: usize,
    total: usize,
    /// Once set, every request held is answered, and every later one at once.
    released: bool,
    last_arrival: Option<Instant>,
}

/// A fake OpenAI-compatible provider that holds every request open until `target` are open
/// at once (or no new one came for `quiet`), then answers them all with a final answer.
struct Provider {
    url: String,
    state: Arc<(Mutex<Open>, Condvar)>,
}

impl Provider {
    fn start(target: usize, quiet: Duration) -> Provider {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake provider");
        let url = format!("http://{}/v1", listener.local_addr().expect("its address"));
        let state: Arc<(Mutex<Open>, Condvar)> = Arc::default();
        let shared = Arc::clone(&state);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let state = Arc::clone(&shared);
                std::thread::spawn(move || serve(conn, &state, target, quiet));
            }
        });
        Provider { url, state }
    }

    /// The most requests it held open at once, and how many it answered.
    fn seen(&self) -> (usize, usize) {
        let open = self.state.0.lock().expect("lock");
        (open.most, open.total)
    }
}

/// One connection: request after request (keep-alive), each held until the release.
fn serve(conn: TcpStream, state: &(Mutex<Open>, Condvar), target: usize, quiet: Duration) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone the stream"));
    let mut conn = conn;
    while read_request(&mut reader).is_some() {
        {
            let (lock, cv) = state;
            let mut open = lock.lock().expect("lock");
            open.now += 1;
            open.total += 1;
            open.most = open.most.max(open.now);
            open.last_arrival = Some(Instant::now());
            if open.now >= target {
                open.released = true;
            }
            cv.notify_all();
            while !open.released {
                let (o, _) = cv
                    .wait_timeout(open, Duration::from_millis(100))
                    .expect("wait");
                open = o;
                if open.last_arrival.is_some_and(|t| t.elapsed() >= quiet) {
                    open.released = true;
                    cv.notify_all();
                }
            }
            open.now -= 1;
        }
        let arguments = json!({"outcome": "completed", "text": "Done."}).to_string();
        let body = json!({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "gpt-4o",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                "role": "assistant", "content": null,
                "tool_calls": [{"id": "call_1", "type": "function",
                    "function": {"name": "final_answer", "arguments": arguments}}]}}],
            "usage": {"prompt_tokens": 300, "completion_tokens": 20, "total_tokens": 320}
        })
        .to_string();
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            body.len()
        );
        if conn.write_all(head.as_bytes()).is_err() || conn.write_all(body.as_bytes()).is_err() {
            return;
        }
    }
}

/// Reads one request (its head, then a body of its content-length); `None` at the end.
fn read_request(r: &mut BufReader<TcpStream>) -> Option<()> {
    let mut length = 0usize;
    let mut first = true;
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end();
        if line.is_empty() && !first {
            break;
        }
        first = false;
        if let Some((k, v)) = line.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0; length];
    r.read_exact(&mut body).ok()
}

/// A config with the profile `agent` at the provider (and `extra` below it), and `n` tasks of
/// it enqueued (with `task_extra` on each line).
fn setup(d: &Path, url: &str, extra: &str, n: usize, task_extra: serde_json::Value) {
    std::fs::write(
        d.join("worker.toml"),
        format!(
            "[models.agent]\nkind = \"openai\"\nbase_url = \"{url}\"\nmodel = \"gpt-4o\"\n{extra}"
        ),
    )
    .expect("config");
    let lines: Vec<String> = (0..n)
        .map(|i| {
            let mut t =
                json!({"user": "cu_ana", "goal": format!("answer ticket {i}"), "model": "agent"});
            if let (Some(t), Some(e)) = (t.as_object_mut(), task_extra.as_object()) {
                t.extend(e.clone());
            }
            t.to_string()
        })
        .collect();
    std::fs::write(d.join("batch.jsonl"), lines.join("\n")).expect("batch");
    let out = command(d)
        .env("WORKER_CONFIG", "worker.toml")
        .args(["enqueue", "--file", "batch.jsonl"])
        .output()
        .expect("enqueue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A daemon started as a newcomer starts it: `worker run`, no flags (the config by
/// `WORKER_CONFIG`), ended when dropped.
struct Daemon(Child);

impl Daemon {
    fn start(d: &Path) -> Daemon {
        let log = std::fs::File::create(d.join("daemon.log")).expect("log");
        let child = command(d)
            .env("WORKER_CONFIG", "worker.toml")
            .arg("run")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the daemon");
        Daemon(child)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            signal(self.0.id(), "-TERM");
        }
        let _ = self.0.wait();
    }
}

/// Waits until every task is finished (each one done).
fn all_done(d: &Path, n: usize) {
    let give_up = Instant::now() + Duration::from_secs(240);
    loop {
        let list = json(d, &["list", "--json", "--limit", "1000"]);
        let list = list.as_array().expect("a list");
        let done = list.iter().filter(|t| t["stop"] == "done").count();
        if done == n {
            return;
        }
        let log = std::fs::read_to_string(d.join("daemon.log")).unwrap_or_default();
        assert!(
            Instant::now() < give_up,
            "{done} of {n} tasks done:\n{}\n{log}",
            ok(d, &["list", "--limit", "20"])
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

conformance! {
    /// Must-show 2: with no flags, all 500 tasks wait on the provider at once (the thread
    /// executor's default held 4). The provider answers only once 500 are open, so a daemon
    /// that holds fewer at once reaches it only after the quiet time, and fails the count.
    fn a_newcomers_daemon_runs_500_tasks_of_a_profile_at_once(d) {
        let provider = Provider::start(500, Duration::from_secs(60));
        setup(d, &provider.url, "", 500, json!({}));
        let daemon = Daemon::start(d);
        all_done(d, 500);
        drop(daemon);
        assert_eq!(provider.seen(), (500, 500), "(most open at once, answered)");
    }

    /// The concurrency key still bounds them: of 120 tasks under a key limited to 40, the
    /// provider never holds more than 40 at once, and holds 40 (it answers once no new
    /// request came for 5 s).
    fn a_concurrency_key_bounds_the_tasks_in_flight(d) {
        let provider = Provider::start(usize::MAX, Duration::from_secs(5));
        setup(d, &provider.url, "\n[concurrency]\n\"tenant:acme\" = 40\n", 120,
            json!({"concurrency_key": "tenant:acme"}));
        let daemon = Daemon::start(d);
        all_done(d, 120);
        drop(daemon);
        assert_eq!(provider.seen(), (40, 120), "(most open at once, answered)");
    }

    /// From the review: at SIGTERM a run waiting on its model dropped nothing and waited for
    /// the answer (a provider that never answers held the daemon for the tasks' whole active
    /// time, 600 s, and the tasks ended `deadline`). The wait holds nothing durable: the runs
    /// drop it, hand their tasks back, and the daemon exits 0.
    fn sigterm_drops_the_waits_on_a_model_and_hands_the_tasks_back(d) {
        let provider = Provider::start(usize::MAX, Duration::from_secs(3600));
        setup(d, &provider.url, "", 20, json!({}));
        let mut daemon = Daemon::start(d);
        let give_up = Instant::now() + Duration::from_secs(60);
        while provider.seen().1 < 20 {
            assert!(Instant::now() < give_up, "the 20 requests never reached the provider");
            std::thread::sleep(Duration::from_millis(50));
        }
        signal(daemon.0.id(), "-TERM");
        let exited = loop {
            if let Some(status) = daemon.0.try_wait().expect("wait") {
                break status;
            }
            let log = std::fs::read_to_string(d.join("daemon.log")).unwrap_or_default();
            assert!(Instant::now() < give_up + Duration::from_secs(60), "the daemon still waits for its model calls:\n{log}");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(exited.success(), "{exited}");
        let list = json(d, &["list", "--json", "--limit", "100"]);
        let queued = list.as_array().expect("a list").iter().filter(|t| t["status"] == "queued").count();
        assert_eq!(queued, 20, "every task handed back:\n{list}");
    }

    /// Must-show "every wake-up lands": 20 tasks handed one at a time to an idle daemon
    /// through its socket (`worker enqueue --wait`, as a user's job does) are each started by a
    /// wake-up; the fallback poll started none.
    fn every_task_handed_to_an_idle_daemon_is_started_by_a_wake_up(d) {
        std::fs::write(
            d.join("final.jsonl"),
            r#"{"type": "final", "outcome": "completed", "text": "Done."}"#,
        )
        .expect("script");
        let (child, addr, _logs) = crate::metrics::start(d);
        // Ended when the test ends, however it ends.
        let daemon = Daemon(child);
        for _ in 0..20 {
            // The daemon goes idle between two: it waits for a wake-up, not a poll.
            std::thread::sleep(Duration::from_millis(50));
            enqueue(d, &["--model", "script:final.jsonl", "--wait"]);
        }
        let (_, text) = crate::metrics::get(&addr, "/metrics");
        let claims = crate::metrics::samples(&text);
        drop(daemon);
        let by = |cause: &str| claims.get(&format!("tether_tasks_claimed_total{{by=\"{cause}\"}}")).copied().unwrap_or(0.0);
        assert_eq!(crate::metrics::total(&claims, "tether_tasks_claimed_total"), 20.0, "{text}");
        assert_eq!(by("poll"), 0.0, "the fallback poll started a task:\n{text}");
        assert!(by("enqueued") + by("watch") >= 15.0, "{text}");
    }
}

conformance! {
    /// A task's tool catalog is one copy in memory for all the tasks of that catalog read from
    /// the database (ten thousand waiting tasks of one catalog hold one, not ten thousand).
    fn the_tasks_of_one_catalog_share_one_copy_in_memory(d) {
        std::fs::write(
            d.join("tools.toml"),
            "version = 1\n[[tools]]\nname = \"work\"\naccess = \"read\"\n\
             http = { url = \"http://127.0.0.1:9/work\" }\n",
        )
        .expect("catalog");
        std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
        for user in ["u1", "u2"] {
            ok(d, &["--config", "worker.toml", "enqueue", "--user", user, "--goal", "look", "--model", "policy"]);
        }
        let db = database(d);
        let now = tether::clock::now_ms();
        let lease = tether::store::Lease {
            owner: "test:1:1".into(),
            host: "test".into(),
            pid: 1,
            start_ticks: 1,
            expires_at_ms: now + 60_000,
            token: 0,
        };
        let claimed = db.claim(&lease, 10, now).expect("claim");
        assert_eq!(claimed.len(), 2, "both tasks claimed");
        let (a, b) = (
            claimed[0].catalog.as_ref().expect("a catalog"),
            claimed[1].catalog.as_ref().expect("a catalog"),
        );
        assert_eq!(a.tools[0].name, "work");
        assert!(Arc::ptr_eq(a, b), "one copy of the catalog for both tasks");
        // Read again while a task holds it: still the same copy.
        let again = db.task(&claimed[0].id).expect("read").catalog.expect("a catalog");
        assert!(Arc::ptr_eq(a, &again));
    }
}
