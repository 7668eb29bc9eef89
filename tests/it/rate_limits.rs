//! Model rate limits shared by every daemon on a database: three daemons run tasks against
//! a fake provider (its replies built with the official `openai` SDK types) that is itself
//! rate limited as a provider is, answering 429 past its limits and logging every arrival.
//! With the same limit in the daemons' config, no window of the provider's log holds more
//! requests or tokens than the limit allows (with a tolerance of one request in flight), and
//! every task ends done without its waits counted as active time; without it, the log shows
//! the storm of 429s the limit prevents.

use crate::common::*;
use crate::models::{Fake, python};

use serde_json::{Value, json};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const TASKS: usize = 18;
const REQUESTS: usize = 3;
const TOKENS: u64 = 1_100;
const WINDOW_MS: u64 = 1_000;
/// What the fake bills each call: 300 tokens in, 50 out.
const CALL_TOKENS: u64 = 350;

/// The fake provider with its limits, and the daemons' config (with `limit` in the profile).
fn setup(d: &Path, py: &Path, limit: &str) -> Fake {
    let script = [json!({"call": "final_answer",
        "args": {"outcome": "completed", "text": "Done."}, "usage": [300, 50]})];
    let extra = [
        format!("--limit-requests={REQUESTS}"),
        format!("--limit-tokens={TOKENS}"),
        format!("--window-ms={WINDOW_MS}"),
    ];
    let fake = Fake::start_with(py, d, "openai", &script, &extra);
    std::fs::write(
        d.join("worker.toml"),
        format!(
            "[models.agent]\nkind = \"openai\"\nbase_url = \"{}\"\nmodel = \"gpt-4o\"\n\
             budget.output_tokens_max = 200\n{limit}\n",
            fake.url
        ),
    )
    .expect("config");
    let lines: Vec<String> = (0..TASKS)
        .map(|i| {
            json!({"user": "cu_ana", "goal": format!("answer {i}"), "model": "agent"}).to_string()
        })
        .collect();
    std::fs::write(d.join("batch.jsonl"), lines.join("\n")).expect("batch");
    let out = command(d)
        .args([
            "--config",
            "worker.toml",
            "enqueue",
            "--file",
            "batch.jsonl",
        ])
        .output()
        .expect("enqueue");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    fake
}

/// Runs three daemons until no task is left unfinished; returns how long that took.
fn run_three(d: &Path) -> Duration {
    let start = Instant::now();
    let mut daemons: Vec<Child> = (0..3)
        .map(|i| {
            let log = std::fs::File::create(d.join(format!("daemon-{i}.log"))).expect("log");
            command(d)
                .args([
                    "--config",
                    "worker.toml",
                    "run",
                    "--max-in-flight",
                    "3",
                    "--shared",
                ])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("start a daemon")
        })
        .collect();
    let give_up = start + Duration::from_secs(60);
    loop {
        let list = json(d, &["list", "--json", "--limit", "1000"]);
        let left = list
            .as_array()
            .expect("a list")
            .iter()
            .filter(|t| t["status"] != "finished")
            .count();
        if left == 0 {
            break;
        }
        if Instant::now() > give_up {
            let logs = std::fs::read_to_string(d.join("daemon-0.log")).unwrap_or_default();
            panic!("{left} tasks did not finish:\n{}\n{logs}", ok(d, &["list"]));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let took = start.elapsed();
    for c in &mut daemons {
        let _ = c.kill();
        let _ = c.wait();
    }
    took
}

/// The most requests, and the most tokens, that arrived at the provider in any window of
/// `WINDOW_MS` (each window starting at an arrival), and how many were answered 429.
fn busiest_window(requests: &[Value]) -> (usize, u64, usize) {
    let at: Vec<(u64, u64)> = requests
        .iter()
        .map(|r| {
            (
                r["at_ms"].as_u64().expect("at_ms"),
                r["tokens"].as_u64().expect("tokens"),
            )
        })
        .collect();
    let mut most = (0, 0);
    for &(t0, _) in &at {
        let inside = at.iter().filter(|(t, _)| *t >= t0 && *t < t0 + WINDOW_MS);
        let (n, tokens) = inside.fold((0, 0), |(n, s), (_, k)| (n + 1, s + k));
        most = (most.0.max(n), most.1.max(tokens));
    }
    let refused = requests.iter().filter(|r| r["status"] == 429).count();
    (most.0, most.1, refused)
}

conformance! {
    /// Must-show 1: the provider's log never shows more than the limit in any window (one
    /// request in flight of tolerance), every task ends done, and no task's active time
    /// holds its waits.
    fn a_shared_rate_limit_holds_across_three_daemons(d) {
        let Some(py) = python() else { return };
        let limit = format!(
            "rate_limit = {{ requests = {REQUESTS}, tokens = {TOKENS}, per = \"1s\" }}"
        );
        let fake = setup(d, &py, &limit);
        let took = run_three(d);
        let reqs = fake.requests();
        let (most, tokens, refused) = busiest_window(&reqs);
        let tasks = json(d, &["list", "--json", "--limit", "1000"]);
        let tasks = tasks.as_array().expect("a list");
        let not_done: Vec<&Value> = tasks.iter().filter(|t| t["stop"] != "done").collect();
        assert!(not_done.is_empty(), "tasks not done: {not_done:?}\n{}", ok(d, &["show", "t1"]));
        assert!(
            most <= REQUESTS + 1 && tokens <= TOKENS + CALL_TOKENS,
            "the provider saw {most} requests and {tokens} tokens in one window \
             (limit {REQUESTS} and {TOKENS}); {refused} answered 429"
        );
        // 18 calls at no more than 3 a second took seconds; each task's active time is its
        // one model call, not the time it waited for capacity. The last tasks waited most of
        // the run, so had the waits been counted, some task would show most of it; compared
        // with the run itself, not with a fixed time, as a loaded machine slows a call too.
        assert!(took >= Duration::from_millis((TASKS / (REQUESTS + 1)) as u64 * WINDOW_MS / 2));
        for t in tasks {
            let id = t["id"].as_str().expect("id");
            let shown = json(d, &["show", id, "--json"]);
            let active = shown["elapsed_s"].as_f64().expect("elapsed_s");
            assert!(
                active < took.as_secs_f64() / 2.0,
                "{id} counted {active} s of active time in a run of {took:?}: {shown}"
            );
            assert_eq!(shown["steps"], 1, "{id} took the step it waited for once: {shown}");
        }
        eprintln!("limited: busiest window {most} requests, {tokens} tokens; {refused} answered 429; {} arrivals", reqs.len());
    }
}

/// The control: the same tasks and provider without the limit in the daemons' config make
/// a storm of 429s, more requests in a window than the provider allows, so the test above
/// can fail.
#[test]
fn without_a_shared_limit_the_daemons_storm_the_provider() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("rate_storm");
    let d = dir.path();
    let fake = setup(d, &py, "max_retries = 1");
    run_three(d);
    let (most, tokens, refused) = busiest_window(&fake.requests());
    eprintln!("control: busiest window {most} requests, {tokens} tokens; {refused} answered 429");
    assert!(most > REQUESTS + 1, "busiest window {most}");
    assert!(refused > 0, "no 429");
}

conformance! {
    /// The engine's side: two handles on one database (two daemons) share one window. The
    /// fourth request of a 3-per-second limit waits until the first leaves the window; a
    /// settled reservation holds what the provider billed, not the estimate; a dropped one
    /// frees its request; a slow-down one daemon records holds the other's reservations.
    fn reservations_are_shared_by_every_handle_on_a_database(d) {
        use tether::model::rate::{RateLimit, Reserve};
        let (a, b) = (crate::exactly_once::backend(d), crate::exactly_once::backend(d));
        let limit = RateLimit { requests: Some(3), tokens: Some(1_000), per_ms: 1_000 };
        // A whole second before now: the times are the database's, and PostgreSQL's is the
        // server clock plus the caller's offset, so "now" must be close to the wall clock.
        let t0 = tether::clock::now_ms();
        let granted = |r: Reserve| match r {
            Reserve::Granted(id) => id,
            Reserve::WaitUntil(t) => panic!("refused until {t}"),
        };
        let first = granted(a.reserve("agent", &limit, 400, t0).expect("reserve"));
        let second = granted(b.reserve("agent", &limit, 400, t0).expect("reserve"));
        // 800 of 1,000 tokens are held: a call of 400 waits for the first to leave.
        let Reserve::WaitUntil(t) = a.reserve("agent", &limit, 400, t0).expect("reserve") else {
            panic!("a third call of 400 tokens fit in 1,000 with 800 held");
        };
        assert!(t >= t0 + 900 && t <= t0 + 1_100, "{t} vs {t0}");
        // Settled at what the provider billed (100 each): room for 400 more, on either.
        a.settle_reservation("agent", first, Some(100)).expect("settle");
        b.settle_reservation("agent", second, Some(100)).expect("settle");
        let third = granted(b.reserve("agent", &limit, 400, t0).expect("reserve"));
        // Three requests in the window: the fourth waits, whatever its tokens.
        let Reserve::WaitUntil(_) = a.reserve("agent", &limit, 1, t0).expect("reserve") else {
            panic!("a fourth request fit a limit of 3");
        };
        // A call never sent gives its request back; another key is not concerned.
        b.settle_reservation("agent", third, None).expect("drop");
        granted(a.reserve("agent", &limit, 1, t0).expect("reserve"));
        granted(a.reserve("other", &limit, 1, t0).expect("reserve"));
        // A 429 seen by one daemon holds the profile for every daemon.
        let until = a.slow_down("other", t0, 5_000).expect("slow down");
        match b.reserve("other", &limit, 1, t0).expect("reserve") {
            Reserve::WaitUntil(t) => assert_eq!(t, until),
            Reserve::Granted(_) => panic!("granted during a slow-down"),
        }
        assert!(until >= t0 + 4_900, "{until} vs {t0}");
    }
}

/// A provider stricter than the daemons' config answers 429: the profile slows down, the
/// tasks that saw it yield instead of failing, and every task still ends done.
#[test]
fn a_429_makes_the_task_yield_and_the_profile_wait() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("rate_429");
    let d = dir.path();
    // The daemons believe in twice the provider's limit, and never retry in the thread.
    let limit = format!(
        "max_retries = 0\nrate_limit = {{ requests = {}, per = \"1s\" }}",
        REQUESTS * 2
    );
    let fake = setup(d, &py, &limit);
    run_three(d);
    let reqs = fake.requests();
    let refused = reqs.iter().filter(|r| r["status"] == 429).count();
    let (most, _, _) = busiest_window(&reqs);
    assert!(
        refused > 0,
        "the provider never refused (busiest window {most}): the test shows nothing"
    );
    let tasks = json(d, &["list", "--json", "--limit", "1000"]);
    for t in tasks.as_array().expect("a list") {
        assert_eq!(t["stop"], "done", "{t}");
        assert_eq!(t["steps"], 1, "a 429 took a step of the task: {t}");
    }
    let logs = std::fs::read_to_string(d.join("daemon-0.log")).unwrap_or_default();
    eprintln!("{refused} answered 429 of {} arrivals", reqs.len());
    assert!(
        !logs.contains("retrying"),
        "a thread retried a 429 itself:\n{logs}"
    );
}
