//! Completion callbacks against a receiver written with the `standardwebhooks` package (the
//! reference implementation verifies every signature, not our code), which logs every
//! arrival: on both backends, with the daemon killed 10 times mid-run and the receiver down
//! for the first half, every task's event arrives, a redelivery keeps its `webhook-id`, and a
//! receiver deduplicating by id sees each event exactly once; a callback no receiver takes is
//! given up after its retry window with an audit event; the metrics count what happened.

use crate::common;
use common::mcp::{Listening, listen};
use common::*;

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A Standard Webhooks secret (the specification's example format: `whsec_` and base64).
pub(crate) const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
pub(crate) const SECRET_ENV: &str = "TETHER_WEBHOOK_SECRET";

/// A config that lets callbacks go to loopback receivers, tried for `retry_for`.
fn config(d: &Path, retry_for: &str) {
    std::fs::write(
        d.join("worker.toml"),
        format!(
            "[callbacks]\nsecret_env = \"{SECRET_ENV}\"\nallow = [\"http://127.0.0.1:*/hooks/\"]\nretry_for = \"{retry_for}\"\ntimeout = \"2s\"\n"
        ),
    )
    .expect("write the config");
}

/// `worker --config worker.toml ARGS`, with the signing secret in its environment.
fn with_config(d: &Path, args: &[&str]) -> Command {
    let mut c = command(d);
    c.args(["--config", "worker.toml"])
        .args(args)
        .env(SECRET_ENV, SECRET);
    c
}

/// The Python receiver on `port`, logging to `log`; 503 to its first `fail_first` requests.
pub(crate) fn receiver(port: u16, log: &Path, fail_first: u32) -> Option<Listening> {
    let py = common::mcp::python()?;
    let mut cmd = Command::new(py);
    cmd.arg(format!(
        "{}/tests/callbacks/receiver.py",
        env!("CARGO_MANIFEST_DIR")
    ))
    .arg(port.to_string())
    .arg(log)
    .arg(SECRET)
    .args(["--fail-first", &fail_first.to_string()]);
    common::mcp::python_with("standardwebhooks", "standardwebhooks")?;
    Some(listen(cmd, port))
}

/// Every arrival the receiver logged.
pub(crate) fn arrivals(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("an arrival"))
        .collect()
}

/// The events a deduplicating receiver keeps: the first accepted arrival of each webhook-id.
fn deduplicated(arrived: &[Value]) -> BTreeMap<String, Value> {
    let mut kept = BTreeMap::new();
    for a in arrived.iter().filter(|a| a["status"] == 204) {
        let id = a["webhook_id"].as_str().expect("a webhook-id").to_string();
        kept.entry(id).or_insert_with(|| {
            serde_json::from_str(a["body"].as_str().expect("a body")).expect("a JSON body")
        });
    }
    kept
}

fn daemon(d: &Path, extra: &[&str]) -> std::process::Child {
    with_config(d, &["run", "--max-in-flight", "2", "--time-scale", "0.2"])
        .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the daemon")
}

/// `worker enqueue` of a demo task whose callback goes to `url`.
fn enqueue_to(url: &str) -> [&str; 9] {
    [
        "enqueue",
        "--user",
        "cu_ana",
        "--goal",
        GOAL,
        "--model",
        "policy",
        "--callback",
        url,
    ]
}

fn url(port: u16, task: &str) -> String {
    format!("http://127.0.0.1:{port}/hooks/{task}")
}

conformance! {
    /// Seven tasks with callbacks: five refunds, one that waits on an approval, one cancelled
    /// before it ran. The receiver is down while the first five daemons are killed, and
    /// answers 503 to its first two requests once up; ten daemons are killed mid-run in all.
    /// Then the waits are settled and one daemon runs until every event arrived: one
    /// `task.finished` per task and one `task.waiting` per wait a decision ended.
    fn every_event_arrives_once_through_kills_and_a_receiver_that_was_down(d) {
        config(d, "10m");
        let port = pg::free_port();
        let log = d.join("arrivals.jsonl");
        let seed = seed("callbacks");
        let mut rng = Rng(seed);
        for i in 1..=5 {
            let key = format!("job-{i}");
            let cb = url(port, &key);
            let mut args = vec!["enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy"];
            // Each refund in a demo-shop tenant of its own, so no two refund one order.
            args.extend(["--key", key.as_str(), "--store-scope", key.as_str(), "--callback", cb.as_str()]);
            assert!(with_config(d, &args).output().expect("enqueue").status.success());
        }
        let cb = url(port, "held");
        let held = ["enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy:ord_1004:8000", "--key", "held", "--callback", cb.as_str()];
        assert!(with_config(d, &held).output().expect("enqueue").status.success());
        let cb = url(port, "cancelled");
        let cancelled = ["enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy", "--key", "cancelled", "--callback", cb.as_str(), "--priority", "-10"];
        assert!(with_config(d, &cancelled).output().expect("enqueue").status.success());
        let out = with_config(d, &["cancel", "key:cancelled", "--reason", "not needed"]).output().expect("cancel");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

        let mut up = None;
        for kill in 0..10 {
            if kill == 5 {
                up = receiver(port, &log, 2);
                if up.is_none() {
                    return;
                }
            }
            let mut child = daemon(d, &[]);
            std::thread::sleep(Duration::from_millis(300 + rng.below(500)));
            child.kill().expect("SIGKILL the daemon");
            child.wait().expect("reap the daemon");
        }
        let _receiver = up;
        // A kill during a write leaves its outcome unknown: the task waits on a person (an
        // event). The ledger settles those and the approval is given, as operators would;
        // each decision ends a wait, and each task then finishes (another event).
        settle_with_oracle(d, seed);
        let tasks = json_list(d, &["list", "--json"]);
        let decisions = |id: &str| {
            json(d, &["events", id, "--json"])
                .as_array()
                .expect("events")
                .iter()
                .filter(|e| {
                    e["verb"]
                        .as_str()
                        .is_some_and(|v| v == "approve" || v.starts_with("reconcile"))
                })
                .count()
        };
        let expected: usize = tasks.iter().map(|t| 1 + decisions(t["id"].as_str().expect("id"))).sum();
        let mut last = daemon(d, &[]);
        let deadline = Instant::now() + Duration::from_secs(120);
        while deduplicated(&arrivals(&log)).len() < expected && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        signal(last.id(), "-TERM");
        last.wait().expect("the daemon stops");

        let arrived = arrivals(&log);
        assert!(arrived.iter().all(|a| a["verified"] == true), "every signature verifies: {arrived:?}");
        assert!(arrived.iter().take(2).all(|a| a["status"] == 503), "the receiver's bad moment: {arrived:?}");
        // A redelivery (after the 503s, or a kill between the POST and its record) carries the
        // same webhook-id and the same body.
        let mut bodies: BTreeMap<&str, &str> = BTreeMap::new();
        for a in &arrived {
            let id = a["webhook_id"].as_str().expect("an id");
            let body = a["body"].as_str().expect("a body");
            assert_eq!(*bodies.entry(id).or_insert(body), body, "webhook-id {id} came with another body");
        }
        let kept = deduplicated(&arrived);
        assert_eq!(kept.len(), expected, "seed {seed}: every event, once: {kept:#?}");
        let mut per_task: BTreeMap<String, Vec<Value>> = BTreeMap::new();
        for event in kept.values() {
            let key = event["data"]["key"].as_str().expect("the task's key").to_string();
            per_task.entry(key).or_default().push(event.clone());
        }
        for t in &tasks {
            let key = t["key"].as_str().expect("a key");
            let id = t["id"].as_str().expect("an id");
            let events = &per_task[key];
            let finished: Vec<_> = events.iter().filter(|e| e["type"] == "task.finished").collect();
            assert_eq!(finished.len(), 1, "{key}: one task.finished: {events:#?}");
            let waiting = events.iter().filter(|e| e["type"] == "task.waiting");
            assert_eq!(waiting.count(), decisions(id), "{key}: a task.waiting per wait: {events:#?}");
            let shown = json(d, &["show", id, "--json"]);
            assert_eq!(finished[0]["data"]["id"], shown["id"]);
            assert_eq!(finished[0]["data"]["stop"], shown["stop"], "{key}");
        }
        for i in 1..=5 {
            let e = per_task[&format!("job-{i}")].iter().find(|e| e["type"] == "task.finished").expect("finished");
            assert_eq!(e["data"]["outcome"], "completed", "{e}");
            assert_eq!(e["data"]["answer"], "Refund issued and confirmation sent.", "{e}");
        }
        let held = &per_task["held"];
        assert!(held.iter().any(|e| e["type"] == "task.waiting" && e["data"]["waiting_for"] == "approval"), "{held:#?}");
        let cancelled = &per_task["cancelled"];
        assert_eq!(cancelled.len(), 1, "{cancelled:#?}");
        assert_eq!(cancelled[0]["data"]["stop"], "cancelled");
        // Nothing is left to send.
        let again = arrived.len();
        let mut child = daemon(d, &["--drain"]);
        assert!(child.wait().expect("drain").success());
        assert_eq!(arrivals(&log).len(), again, "a delivered callback is not sent again");
    }

    /// A receiver that never answers: the callback is tried for its window, then given up
    /// with a `callback_failed` audit event naming why; the task itself finished at once.
    /// `/metrics` counts the failed attempts and the give-up, and nothing is left pending.
    fn a_callback_no_one_takes_is_given_up_with_an_audit_event(d) {
        config(d, "3s");
        let port = pg::free_port();
        let cb = url(port, "lost");
        let args = ["enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy", "--callback", cb.as_str()];
        assert!(with_config(d, &args).output().expect("enqueue").status.success());
        let metrics_port = pg::free_port();
        let metrics_addr = format!("127.0.0.1:{metrics_port}");
        let mut child = daemon(d, &["--metrics", &metrics_addr]);
        let deadline = Instant::now() + Duration::from_secs(60);
        let given_up = loop {
            let events = json(d, &["events", "t1", "--json"]);
            if let Some(e) = events.as_array().and_then(|a| a.iter().find(|e| e["verb"] == "callback_failed")) {
                break e.clone();
            }
            assert!(Instant::now() < deadline, "no callback_failed event: {events}");
            std::thread::sleep(Duration::from_millis(200));
        };
        let metrics = ureq::get(&format!("http://{metrics_addr}/metrics"))
            .call()
            .expect("metrics")
            .body_mut()
            .read_to_string()
            .expect("a body");
        signal(child.id(), "-TERM");
        child.wait().expect("the daemon stops");
        assert_eq!(json(d, &["show", "t1", "--json"])["stop"], "done");
        let detail = given_up["detail"].to_string();
        assert!(detail.contains(&cb) && detail.contains("retry window"), "{given_up}");
        let value = |name: &str| -> f64 {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
                .unwrap_or_else(|| panic!("{name} not in /metrics:\n{metrics}"))
        };
        assert!(value("tether_callbacks_failed_total ") >= 2.0, "{metrics}");
        assert_eq!(value("tether_callbacks_given_up_total "), 1.0, "{metrics}");
        assert_eq!(value("tether_callbacks_sent_total "), 0.0, "{metrics}");
        assert_eq!(value("tether_callbacks_pending "), 0.0, "{metrics}");
    }
}

/// A callback URL is refused when the task is enqueued unless the config's `[callbacks]`
/// allows it, and a daemon whose config names a signing secret that is not set does not
/// start.
#[test]
fn callback_urls_are_checked_against_the_config() {
    let dir = TempDir::new("callback_urls");
    let d = dir.path();
    let (code, err) = fails(d, &enqueue_to("http://127.0.0.1:9/hooks/x"));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("[callbacks]"), "{err}");
    config(d, "1m");
    for bad in [
        "http://evil.example/hooks/x",
        "http://127.0.0.1:9/elsewhere",
        "http://127.0.0.1@evil.example:9/hooks/",
        "file:///etc/passwd",
        "http://127.0.0.1:9/hooks/../admin",
        "http://127.0.0.1:9/hooks/%2e%2e/admin",
        "http://127.0.0.1:99999/hooks/x",
    ] {
        let out = with_config(d, &enqueue_to(bad)).output().expect("enqueue");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{bad} was accepted");
        assert!(
            err.contains("callback") || err.contains(bad),
            "{bad}: {err}"
        );
    }
    let out = with_config(d, &["run", "--drain"])
        .env_remove(SECRET_ENV)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a daemon without its signing secret started"
    );
    assert!(err.contains(SECRET_ENV), "{err}");
    assert!(
        !d.join("worker.redb").exists(),
        "a refused enqueue creates nothing"
    );
}

/// Review 48, design holes: a receiver that several submitters point at learns whose task a
/// callback is from what is signed (`submitted_by`, the submit token's name), and a submitter
/// reading its task's `callback_failed` event learns that the callback failed, not what
/// answered (or did not) at the address it named; an operator still reads the error.
#[test]
fn a_callback_names_its_submitter_and_a_submitter_reads_no_reachability() {
    const OPS: &str = "0123456789abcdef-ops";
    const JOB: &str = "0123456789abcdef-job";
    let dir = TempDir::new("callback_who");
    let d = dir.path();
    config(d, "3s");
    let tokens = d.join("tokens.txt");
    std::fs::write(&tokens, format!("ops {OPS} operator\njob {JOB} submit\n")).expect("tokens");
    let port = pg::free_port();
    let log = d.join("arrivals.jsonl");
    let Some(_receiver) = receiver(port, &log, 0) else {
        return;
    };
    let tokens = tokens.display().to_string();
    let server = common::serve::spawn_with(
        with_config(d, &[]),
        &["serve", "--listen", "127.0.0.1:0", "--token-file", &tokens],
    );
    let api = format!("{}/api/v1/tasks", server.base);
    let create = |callback: String| {
        let body = serde_json::json!({"user": "cu_ana", "goal": GOAL, "model": "policy",
            "callback_url": callback});
        let mut r = common::serve::agent()
            .post(&api)
            .header("Authorization", &format!("Bearer {JOB}"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .expect("create");
        assert_eq!(r.status().as_u16(), 201);
        let v: Value =
            serde_json::from_str(&r.body_mut().read_to_string().expect("a body")).expect("a task");
        v["id"].as_str().expect("an id").to_string()
    };
    let delivered = create(url(port, "who"));
    let lost = create(url(pg::free_port(), "lost"));
    let mut child = daemon(d, &["--shared"]);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let failed = json(d, &["events", &lost, "--json"])
            .as_array()
            .is_some_and(|a| a.iter().any(|e| e["verb"] == "callback_failed"));
        if failed && !deduplicated(&arrivals(&log)).is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "the callbacks did not settle");
        std::thread::sleep(Duration::from_millis(200));
    }
    signal(child.id(), "-TERM");
    child.wait().expect("the daemon stops");
    let kept = deduplicated(&arrivals(&log));
    let event = kept.values().next().expect("one callback");
    assert_eq!(event["data"]["id"], delivered.as_str(), "{event}");
    assert_eq!(event["submitted_by"], "job", "{event}");
    let events = |token: &str| -> Value {
        let mut r = common::serve::agent()
            .get(&format!("{api}/{lost}/events"))
            .header("Authorization", &format!("Bearer {token}"))
            .call()
            .expect("events");
        let all: Value =
            serde_json::from_str(&r.body_mut().read_to_string().expect("a body")).expect("events");
        all.as_array()
            .and_then(|a| a.iter().find(|e| e["verb"] == "callback_failed").cloned())
            .expect("a callback_failed event")
    };
    let theirs = events(JOB);
    assert_eq!(theirs["detail"]["last_error"], Value::Null, "{theirs}");
    let why = theirs["detail"]["why"].as_str().unwrap_or_default();
    assert!(
        why.contains("no receiver accepted it") && !why.contains("refused"),
        "{theirs}"
    );
    let ours = events(OPS);
    assert!(
        ours["detail"]["why"].to_string().contains("attempts"),
        "{ours}"
    );
    assert_ne!(ours["detail"]["last_error"], Value::Null, "{ours}");
}
