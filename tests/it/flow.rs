//! Flow control as a user meets it, on both backends: a task given a start time is listed as
//! scheduled and starts no earlier; a concurrency key's limit holds across three daemons, one
//! of them killed, as a tool service that counts the calls in flight per key sees it, and a
//! second key's task finishes while the first still has most of its tasks queued. A control
//! run without the limit shows the test can fail.

use crate::common;
use common::*;

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What the service saw: calls in flight now and at most, per tenant, and every arrival
/// (tenant, the task id from its call key) in order, with its wall-clock time.
#[derive(Default)]
struct Seen {
    in_flight: BTreeMap<String, u32>,
    max: BTreeMap<String, u32>,
    arrivals: Vec<(String, String)>,
    at_ms: Vec<u64>,
}

/// A tool service whose `POST /work` holds each call 100 ms and counts, per `customer_id`,
/// how many are in flight at once. Each request has a thread of its own.
fn service() -> (String, Arc<Mutex<Seen>>) {
    let server = tiny_http::Server::http("127.0.0.1:0").expect("bind the service");
    let url = format!("http://{}/work", server.server_addr());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let s = Arc::clone(&seen);
    std::thread::spawn(move || {
        for mut req in server.incoming_requests() {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                let mut body = String::new();
                let _ = req.as_reader().read_to_string(&mut body);
                let args: Value = serde_json::from_str(&body).unwrap_or(Value::Null);
                let tenant = args
                    .pointer("/customer_id")
                    .or_else(|| args.pointer("/args/customer_id"))
                    .and_then(Value::as_str)
                    .unwrap_or("?")
                    .to_string();
                let key = idempotency_key(&req).unwrap_or_default();
                let task = key.split(':').nth(1).unwrap_or("").to_string();
                {
                    let mut g = s.lock().expect("lock");
                    let n = g.in_flight.entry(tenant.clone()).or_default();
                    *n += 1;
                    let n = *n;
                    let m = g.max.entry(tenant.clone()).or_default();
                    *m = (*m).max(n);
                    g.arrivals.push((tenant.clone(), task));
                    g.at_ms.push(tether::clock::now_ms());
                }
                std::thread::sleep(Duration::from_millis(100));
                if let Some(n) = s.lock().expect("lock").in_flight.get_mut(&tenant) {
                    *n -= 1;
                }
                let answer = json!({"id": "W-1", "status": "ok"}).to_string();
                let _ = req.respond(
                    tiny_http::Response::from_string(answer).with_header(
                        tiny_http::Header::from_bytes("Content-Type", "application/json")
                            .expect("header"),
                    ),
                );
            });
        }
    });
    (url, seen)
}

/// The catalog with the service's `work` tool, and a config naming it (and `limits`).
fn setup(d: &Path, url: &str, limits: &str) {
    let catalog = format!(
        "version = 1\n[[tools]]\nname = \"work\"\naccess = \"read\"\nidempotent = true\n\
         http = {{ url = \"{url}\", timeout_ms = 5000 }}\n\
         args.customer_id = {{ type = \"string\", required = true }}\n\
         args.n = {{ type = \"integer\", required = true }}\n"
    );
    std::fs::write(d.join("tools.toml"), catalog).expect("catalog");
    std::fs::write(
        d.join("worker.toml"),
        format!("[tools]\ncatalog = \"tools.toml\"\n{limits}"),
    )
    .expect("config");
    let moves: Vec<String> = [
        json!({"type": "tool", "name": "work", "args": {"customer_id": "TENANT", "n": 1}}),
        json!({"type": "tool", "name": "work", "args": {"customer_id": "TENANT", "n": 2}}),
        json!({"type": "final", "outcome": "completed", "text": "done"}),
    ]
    .iter()
    .map(Value::to_string)
    .collect();
    for tenant in ["acme", "bo"] {
        std::fs::write(
            d.join(format!("{tenant}.jsonl")),
            moves.join("\n").replace("TENANT", tenant),
        )
        .expect("script");
    }
}

fn with_config(d: &Path) -> std::process::Command {
    let mut c = command(d);
    c.args(["--config", "worker.toml"]);
    c
}

/// `n` tasks of `tenant` under the concurrency key `tenant:TENANT`, in one batch.
fn enqueue_tenant(d: &Path, tenant: &str, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| {
            json!({"user": "cu_ana", "goal": format!("{tenant} {i}"),
                "model": format!("script:{tenant}.jsonl"),
                "concurrency_key": format!("tenant:{tenant}")})
            .to_string()
        })
        .collect();
    let file = d.join(format!("{tenant}-batch.jsonl"));
    std::fs::write(&file, lines.join("\n")).expect("batch");
    let out = with_config(d)
        .args(["enqueue", "--file"])
        .arg(&file)
        .output()
        .expect("enqueue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn daemon(d: &Path) -> Child {
    with_config(d)
        .args([
            "run",
            "--max-in-flight",
            "3",
            "--heartbeat-ttl-ms",
            "3000",
            "--shared",
        ])
        .args(["--recover-every-ms", "200"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start a daemon")
}

/// How many tasks are not finished.
fn unfinished(d: &Path) -> usize {
    json(d, &["list", "--json", "--limit", "1000"])
        .as_array()
        .expect("a list")
        .iter()
        .filter(|t| t["status"] != "finished")
        .count()
}

/// 30 tasks of acme, then one of bo, run by three daemons; one daemon is killed once acme's
/// calls have begun (all three paused first until no call is in flight at the service, so
/// the dead one leaves no call behind that no claim rule could recall), and a new one
/// started. Returns what the service saw.
fn run_tenants(d: &Path, limits: &str) -> Arc<Mutex<Seen>> {
    let (url, seen) = service();
    setup(d, &url, limits);
    enqueue_tenant(d, "acme", 30);
    enqueue_tenant(d, "bo", 1);
    let mut daemons: Vec<Child> = (0..3).map(|_| daemon(d)).collect();
    let give_up = Instant::now() + Duration::from_secs(120);
    while seen.lock().expect("lock").arrivals.len() < 8 {
        assert!(
            Instant::now() < give_up,
            "the tasks did not start: {}\n{}",
            ok(d, &["list"]),
            ok(d, &["show", "t1"])
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in &daemons {
        signal(c.id(), "-STOP");
    }
    while seen
        .lock()
        .expect("lock")
        .in_flight
        .values()
        .any(|n| *n > 0)
    {
        std::thread::sleep(Duration::from_millis(10));
    }
    signal(daemons[0].id(), "-KILL");
    let _ = daemons[0].wait();
    for c in &daemons[1..] {
        signal(c.id(), "-CONT");
    }
    daemons[0] = daemon(d);
    while unfinished(d) > 0 {
        assert!(
            Instant::now() < give_up,
            "tasks left unfinished: {}",
            unfinished(d)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for mut c in daemons {
        signal(c.id(), "-TERM");
        let _ = c.wait();
    }
    seen
}

conformance! {
    /// The limit of `tenant:*` (2) holds for each tenant across three daemons and a kill, as
    /// the service counts calls in flight; bo's one task ends while most of acme's 30 have
    /// not begun; every task ends done.
    fn a_concurrency_limit_holds_across_daemons_and_a_kill(d) {
        let seen = run_tenants(d, "[concurrency]\n\"tenant:*\" = 2\n");
        let g = seen.lock().expect("lock");
        assert!(g.max.get("acme").is_some_and(|m| *m <= 2), "{:?}", g.max);
        assert!(g.max.get("bo").is_some_and(|m| *m <= 2), "{:?}", g.max);
        let bo_last = g.arrivals.iter().rposition(|(t, _)| t == "bo").expect("bo's calls");
        let mut begun: Vec<&String> = g.arrivals[..bo_last]
            .iter()
            .filter(|(t, _)| t == "acme")
            .map(|(_, task)| task)
            .collect();
        begun.sort();
        begun.dedup();
        assert!(begun.len() < 15, "bo waited for {} of acme's tasks", begun.len());
        drop(g);
        let tasks = json(d, &["list", "--json", "--limit", "1000"]);
        for t in tasks.as_array().expect("a list") {
            assert_eq!(t["stop"], "done", "{t}");
        }
    }
}

/// The control: the same run with no limit has acme's calls more than two at once, so the
/// test above would see a limit that did not hold.
#[test]
fn without_a_limit_a_key_runs_on_every_thread() {
    let dir = TempDir::new("no_limit");
    let seen = run_tenants(dir.path(), "");
    let g = seen.lock().expect("lock");
    assert!(g.max.get("acme").is_some_and(|m| *m > 2), "{:?}", g.max);
}

conformance! {
    /// A task given a start time is listed as scheduled, and its first tool call reaches the
    /// service no earlier than that time; a task without one runs meanwhile.
    fn a_delayed_task_is_scheduled_and_starts_no_earlier(d) {
        let (url, seen) = service();
        setup(d, &url, "");
        let enqueue_as = |tenant: &str, extra: &[&str]| -> String {
            let model = format!("script:{tenant}.jsonl");
            let mut args = vec!["enqueue", "--user", "cu_ana", "--goal", tenant, "--model", &model];
            args.extend_from_slice(extra);
            let out = with_config(d).args(&args).output().expect("enqueue");
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let later = enqueue_as("acme", &["--in", "2s"]);
        enqueue_as("bo", &[]);
        let listed = json(d, &["list", "--json"]);
        let row = listed
            .as_array()
            .expect("a list")
            .iter()
            .find(|t| t["id"] == later.as_str())
            .expect("listed")
            .clone();
        assert_eq!(row["status"], "queued", "{row}");
        let not_before = tether::clock::parse_rfc3339(row["not_before"].as_str().expect("a time"))
            .expect("RFC 3339");
        assert!(ok(d, &["list"]).contains("scheduled"));
        let out = with_config(d).args(["run", "--drain"]).output().expect("run");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(unfinished(d) == 0, "{}", ok(d, &["list"]));
        let g = seen.lock().expect("lock");
        let first = g
            .arrivals
            .iter()
            .zip(&g.at_ms)
            .filter(|((tenant, _), _)| tenant == "acme")
            .map(|(_, at)| *at)
            .min()
            .expect("acme's calls");
        assert!(first >= not_before, "its first call at {first}, before {not_before}");
        assert_eq!(g.arrivals.first().map(|a| a.0.as_str()), Some("bo"), "bo ran first");
    }
}

/// Purging a finished task removes its concurrency key too (the file keeps nothing of it).
#[test]
fn a_purged_task_leaves_no_concurrency_key_behind() {
    let dir = TempDir::new("purge_key");
    let d = dir.path();
    enqueue(d, &["--concurrency-key", "tenant:acme"]);
    ok(d, &["run", "--drain"]);
    let purged = json(d, &["purge", "--finished-before", "0s", "--json"]);
    assert_eq!(purged["ids"], json!(["t1"]), "{purged}");
    let db = redb::Database::open(d.join("worker.redb")).expect("open");
    let r = redb::ReadableDatabase::begin_read(&db).expect("read");
    let keys: redb::TableDefinition<&str, &str> = redb::TableDefinition::new("concurrency_keys");
    let t = r.open_table(keys).expect("the table");
    assert_eq!(redb::ReadableTableMetadata::len(&t).expect("len"), 0);
}

conformance! {
    /// A task not started within its `--ttl` ends `expired` without running a step (and
    /// `worker wait` exits 6); one without a limit, queued beside it, runs.
    fn a_task_not_started_within_its_ttl_expires(d) {
        let late = enqueue(d, &["--ttl", "1s"]).trim().to_string();
        let fine = enqueue(d, &[]).trim().to_string();
        std::thread::sleep(Duration::from_millis(1_300));
        ok(d, &["run", "--drain"]);
        let t = json(d, &["show", &late, "--json"]);
        assert_eq!(t["stop"], "expired", "{t}");
        assert_eq!(t["steps"], 0, "an expired task ran nothing: {t}");
        assert_eq!(json(d, &["show", &fine, "--json"])["stop"], "done");
        let out = worker(d, &["wait", &late]);
        assert_eq!(out.status.code(), Some(6), "{}", String::from_utf8_lossy(&out.stderr));
        let listed = json(d, &["list", "--stop", "expired", "--json"]);
        assert_eq!(listed.as_array().map(Vec::len), Some(1), "{listed}");
    }
}

conformance! {
    /// A task whose wall-clock deadline passes while it runs stops `timed_out` at the next
    /// step boundary, having taken some of its steps; the same task without the limit runs
    /// them all. Its time counts waits (here the tools' latency), unlike the active-time
    /// budget, which is far from spent.
    fn a_wall_clock_deadline_stops_a_running_task(d) {
        let limited = enqueue(d, &["--tool-latency", "get_order=800", "--finish-within", "3s", "--store-scope", "a"])
            .trim()
            .to_string();
        let free = enqueue(d, &["--tool-latency", "get_order=800", "--store-scope", "b"])
            .trim()
            .to_string();
        ok(d, &["run", "--drain", "--time-scale", "1"]);
        let t = json(d, &["show", &limited, "--json"]);
        let all = json(d, &["show", &free, "--json"]);
        assert_eq!(t["stop"], "timed_out", "{t}");
        assert_eq!(all["stop"], "done", "{all}");
        let (steps, full) = (t["steps"].as_u64().unwrap_or(0), all["steps"].as_u64().unwrap_or(0));
        assert!(steps >= 1 && steps < full, "{steps} of {full} steps");
        assert!(t["closing_message"].as_str().unwrap_or("").contains("wall-clock deadline"), "{t}");
        let out = worker(d, &["wait", &limited]);
        assert_eq!(out.status.code(), Some(4));
    }
}

conformance! {
    /// A delayed task cancelled before its start time is no longer work to come: a drain
    /// right after ends at once (it waited for the start time, an hour here, while the
    /// cancelled task's entry stayed in the file's delayed index).
    fn a_cancelled_delayed_task_does_not_hold_a_drain(d) {
        let later = enqueue(d, &["--in", "1h"]).trim().to_string();
        ok(d, &["cancel", &later, "--by", "alice"]);
        let mut drain = command(d)
            .args(["run", "--drain"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start the drain");
        let t = Instant::now();
        while drain.try_wait().expect("the drain").is_none() {
            if t.elapsed() > Duration::from_secs(60) {
                let _ = drain.kill();
                let _ = drain.wait();
                panic!("the drain waited for a cancelled task's start time");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(json(d, &["show", &later, "--json"])["stop"], "cancelled");
    }
}

/// How many of `claimed` have each concurrency key ("-" for none).
fn per_key(claimed: &[tether::store::TaskRecord]) -> BTreeMap<String, usize> {
    let mut n = BTreeMap::new();
    for r in claimed {
        let k = r.concurrency_key.clone().unwrap_or_else(|| "-".into());
        *n.entry(k).or_default() += 1;
    }
    n
}

conformance! {
    /// The claim itself, on the store: a key's own limit wins over its prefix's, a key no
    /// limit names is not bounded, claims of one task at a time and of many at once take the
    /// same share of each key, and the slots come back when the claims run out.
    fn a_claim_takes_each_keys_share_and_no_more(d) {
        use tether::store::flow::ConcurrencyLimits;
        let store = crate::exactly_once::backend(d);
        let limits = [("tenant:*".to_string(), 2), ("tenant:acme".to_string(), 3)];
        store.set_limits(ConcurrencyLimits::new(limits).expect("limits"));
        let now = tether::clock::now_ms();
        let mut tasks = Vec::new();
        for (key, n) in [(Some("tenant:acme"), 6), (Some("tenant:bo"), 4), (Some("free"), 3), (None, 2)] {
            for _ in 0..n {
                let mut t = crate::exactly_once::new_task("cu_ana", "work", None);
                t.concurrency_key = key.map(str::to_string);
                tasks.push(t);
            }
        }
        store.enqueue(&tasks, now).expect("enqueue");
        let lease = |owner: &str| tether::store::Lease {
            owner: owner.into(),
            host: "test-host".into(),
            pid: 1,
            start_ticks: 0,
            expires_at_ms: now + 60_000,
            token: 0,
        };
        let expected: BTreeMap<String, usize> =
            [("-", 2), ("free", 3), ("tenant:acme", 3), ("tenant:bo", 2)]
                .into_iter()
                .map(|(k, n)| (k.to_string(), n))
                .collect();
        // One at a time, as a daemon with one free thread claims.
        let mut one_by_one = Vec::new();
        loop {
            let got = store.claim(&lease("a"), 1, now).expect("claim");
            assert!(got.len() <= 1, "a claim of 1 took {}", got.len());
            if got.is_empty() {
                break;
            }
            one_by_one.extend(got);
        }
        assert_eq!(per_key(&one_by_one), expected);
        // Every claim runs out: the slots come back, and one claim of many takes the same.
        let later = now + 100_000_000;
        store.recover(later, &|_| false, &|_, _| false).expect("recover");
        let at_once = store.claim(&lease("b"), 100, later).expect("claim");
        assert_eq!(per_key(&at_once), expected);
        assert!(store.claim(&lease("c"), 100, later).expect("claim").is_empty());
    }
}

conformance! {
    /// A limit changed while its key's tasks run: the claim counts against the limit the
    /// daemon has now. Lowered below what runs, the key's queued tasks wait and another key's
    /// task behind them still starts (they do not fill the claim's look at the queue);
    /// raised, the key takes the new room at once.
    fn a_changed_limit_counts_at_the_next_claim(d) {
        use tether::store::flow::ConcurrencyLimits;
        let store = crate::exactly_once::backend(d);
        let limit = |n: u32| ConcurrencyLimits::new([("tenant:acme".to_string(), n)]).expect("limits");
        store.set_limits(limit(5));
        let now = tether::clock::now_ms();
        let task = |key: &str| {
            let mut t = crate::exactly_once::new_task("cu_ana", "work", None);
            t.concurrency_key = Some(key.to_string());
            t
        };
        // 5 run, 60 wait (more than any claim looks at), then one of another key.
        let mut tasks: Vec<_> = (0..65).map(|_| task("tenant:acme")).collect();
        tasks.push(task("tenant:bo"));
        store.enqueue(&tasks, now).expect("enqueue");
        let lease = tether::store::Lease {
            owner: "a".into(),
            host: "test-host".into(),
            pid: 1,
            start_ticks: 0,
            expires_at_ms: now + 60_000,
            token: 0,
        };
        let first = store.claim(&lease, 5, now).expect("claim");
        assert_eq!(per_key(&first).get("tenant:acme"), Some(&5));
        store.set_limits(limit(2));
        let next = store.claim(&lease, 8, now).expect("claim");
        let want: BTreeMap<String, usize> = [("tenant:bo".to_string(), 1)].into_iter().collect();
        assert_eq!(per_key(&next), want, "the lowered limit holds acme back, not bo");
        store.set_limits(limit(8));
        let raised = store.claim(&lease, 8, now).expect("claim");
        assert_eq!(per_key(&raised).get("tenant:acme"), Some(&3), "the raised limit's room is taken");
    }
}
