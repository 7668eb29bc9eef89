//! Benchmark of the PostgreSQL backend, all measured in one run against the same throwaway
//! server (started here: `initdb` in a temporary directory, a free port, and PostgreSQL's own
//! durability defaults, `fsync=on` and `synchronous_commit=on`, so that a commit is on disk
//! when it is acknowledged, as on a production server):
//! - the raw rate of single-row `UPDATE` commits (autocommit, a prepared statement);
//! - durable steps/s with one worker thread (one task at a time, read-only tasks: one commit
//!   per step) and its ratio to the raw rate;
//! - the same with 64 tasks in flight (64 threads, each committing on its own connection);
//! - enqueue-to-start latency with an idle daemon, woken by `NOTIFY` (its poll fallback is
//!   one second);
//! - a step's two round trips alone, in the same alternating rounds: the step's commit (the
//!   store's own statement, with the state, spans and reply a run of the same tasks left), the
//!   demo shop's read, and the two in turn (a step without the worker's own time).
//!
//! Run with `cargo bench --bench postgres`. Figures are printed with their ratios.

#[path = "common/figures.rs"]
mod figures;
use figures::*;
#[path = "common/tasks.rs"]
mod tasks;
use tasks::tasks;
use tether::store::prelude::*;

#[path = "../tests/it/common/pg.rs"]
#[allow(dead_code)]
mod pg;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tether::model::ModelProfile;
use tether::store::QueueStatus;
use tether::store::pg::PgStore;
use tether::tools::durable::DurableStore;
use tether::worker::{self, Config};

fn raw_commit_rate(url: &str, n: usize) -> f64 {
    let mut c = postgres::Client::connect(url, postgres::NoTls).expect("connect");
    c.batch_execute(
        "DROP TABLE IF EXISTS bench_raw; CREATE TABLE bench_raw (id int PRIMARY KEY, v bigint NOT NULL);
         INSERT INTO bench_raw VALUES (1, 0)",
    )
    .expect("table");
    let st = c
        .prepare("UPDATE bench_raw SET v = $1 WHERE id = 1")
        .expect("prepare");
    let t = Instant::now();
    for i in 0..n as i64 {
        c.execute(&st, &[&i]).expect("update");
    }
    n as f64 / t.elapsed().as_secs_f64()
}

/// Runs `n` tasks, at most `workers` in flight, until drained, in a schema of its own; returns
/// steps/s.
fn durable(base: &str, name: &str, model: &ModelProfile, n: usize, workers: usize) -> f64 {
    let url = format!("{base}?schema={name}");
    let store =
        Arc::new(PgStore::open(&url, true, workers + 2, Duration::from_secs(10)).expect("db"));
    let tools = Arc::new(DurableStore::open_target(&url).expect("store"));
    store
        .enqueue(&tasks(model, n), worker::now_ms())
        .expect("enqueue");
    let cfg = Config {
        demo: Some(std::sync::Arc::new(
            tether::tools::durable::DemoShop::opened(std::sync::Arc::clone(&tools)),
        )),
        max_in_flight: workers,
        drain: true,
        ..Config::default()
    };
    let t = Instant::now();
    let stats = worker::run(store.clone(), &cfg, Arc::new(AtomicBool::new(false))).expect("run");
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(
        stats.tasks_ended.load(Ordering::Relaxed) as usize,
        n,
        "every task ran to its end"
    );
    stats.steps.load(Ordering::Relaxed) as f64 / secs
}

/// Enqueue-to-start latency with an idle daemon: each of `n` tasks is enqueued after a pause
/// longer than nothing-to-do, and the time until a worker claimed it is measured.
fn wake_latency(base: &str, n: usize) -> Vec<f64> {
    let url = format!("{base}?schema=bench_wake");
    let store = Arc::new(PgStore::open(&url, true, 4, Duration::from_secs(10)).expect("db"));
    let tools = Arc::new(DurableStore::open_target(&url).expect("store"));
    let stop = Arc::new(AtomicBool::new(false));
    let daemon = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let cfg = Config {
                demo: Some(std::sync::Arc::new(
                    tether::tools::durable::DemoShop::opened(std::sync::Arc::clone(&tools)),
                )),
                max_in_flight: 1,
                ..Config::default()
            };
            worker::run(store, &cfg, stop).expect("daemon")
        })
    };
    let reads = ModelProfile::NewIds { latency_ms: 1500 };
    let mut out = Vec::new();
    std::thread::sleep(Duration::from_millis(1500));
    for _ in 0..n {
        std::thread::sleep(Duration::from_millis(300));
        let t = Instant::now();
        let id = store
            .enqueue(&tasks(&reads, 1), worker::now_ms())
            .expect("enqueue")[0]
            .id
            .clone();
        loop {
            if store.task(&id).expect("task").status != QueueStatus::Queued {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the task never started"
            );
            // Looked at every 0.1 ms, as the redb bench does: a loop of queries without a
            // pause kept the server's backend and this thread on both cores, and the daemon
            // it measures waited for them.
            std::thread::sleep(Duration::from_micros(100));
        }
        out.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    stop.store(true, Ordering::SeqCst);
    daemon.join().expect("daemon thread");
    out
}

/// A step's parts alone, on the same server, each timed over `n` repetitions: the step's
/// commit (the store's own statement on one claimed task, with the state that a finished run
/// of the same model left and its first step's spans and reply, span ids and step numbers
/// advanced so that each commit inserts its rows as a step does); the demo shop's read as the
/// step's tool makes it; and the two one after the other, read then commit, as a step makes
/// them when the worker's own time is left out. Returns (commits/s, reads/s, both/s).
fn step_parts(base: &str, round: usize, n: usize) -> (f64, f64, f64) {
    use tether::store::{Commit, CommitKind};
    let url = format!("{base}?schema=bench_parts_{round}");
    let store = Arc::new(PgStore::open(&url, true, 3, Duration::from_secs(10)).expect("db"));
    let tools = Arc::new(DurableStore::open_target(&url).expect("store"));
    let reads = ModelProfile::NewIds { latency_ms: 1500 };
    let done = store
        .enqueue(&tasks(&reads, 1), worker::now_ms())
        .expect("enqueue")[0]
        .id
        .clone();
    let cfg = Config {
        demo: Some(Arc::new(tether::tools::durable::DemoShop::opened(
            Arc::clone(&tools),
        ))),
        max_in_flight: 1,
        drain: true,
        ..Config::default()
    };
    worker::run(store.clone(), &cfg, Arc::new(AtomicBool::new(false))).expect("run");
    let state = store.task(&done).expect("task").state;
    let spans: Vec<_> = store
        .spans(&done)
        .expect("spans")
        .into_iter()
        .take(3)
        .collect();
    let reply = store.replies(&done).expect("replies").into_iter().next();
    assert!(
        spans.len() == 3 && reply.is_some(),
        "the run left its spans and replies"
    );
    store
        .enqueue(&tasks(&reads, 1), worker::now_ms())
        .expect("enqueue");
    let now = worker::now_ms();
    let rec = store
        .claim(&tasks::lease(now), 1, now)
        .expect("claim")
        .remove(0);
    let token = rec.lease.as_ref().expect("claimed").token;
    let step = |i: u32| {
        let spans = spans
            .iter()
            .map(|s| {
                let mut s = s.clone();
                s.id += 3 * (i + 1);
                s
            })
            .collect();
        let mut reply = reply.clone();
        if let Some(r) = reply.as_mut() {
            r.step = i + 2;
        }
        let commit = Commit {
            task_id: rec.id.clone(),
            token,
            kind: CommitKind::Step,
            state: state.clone(),
            next_span_id: 3 * (i + 2),
            spans,
            reply,
            call: None,
            now_ms: worker::now_ms(),
            lease_ms: 60_000,
            clear_settle: false,
            claim_next: None,
            export: false,
            callback: None,
            not_before_ms: None,
        };
        let landed = store.commit_batch(&[&commit]).expect("commit");
        assert!(landed[0].is_some(), "the claim holds");
    };
    let args = serde_json::json!({"order_id": "ord_9001"});
    let args = args.as_object().expect("an object");
    let read = || {
        tools
            .call_once("b0", "cu_ana", "get_order", args, "k", false, None)
            .expect("read");
    };
    let n32 = n as u32;
    let t = Instant::now();
    (0..n32).for_each(&step);
    let commits = n as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    (0..n).for_each(|_| read());
    let reads = n as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    for i in n32..2 * n32 {
        read();
        step(i);
    }
    (commits, reads, n as f64 / t.elapsed().as_secs_f64())
}

fn main() {
    let cluster =
        pg::PgCluster::start_durable("bench").expect("PostgreSQL is needed for this bench");
    let base = cluster.url();
    println!(
        "machine: {} CPUs, shared by the server and the workers",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let reads = ModelProfile::NewIds { latency_ms: 1500 };
    // Alternating rounds: the raw rate, the one-thread rate and a step's parts alone see the
    // same load, and each is a ratio to the raw rate of its own round.
    let (mut raws, mut ones, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut commits, mut shop, mut both) = (Vec::new(), Vec::new(), Vec::new());
    let mut boths = Vec::new();
    for round in 0..5 {
        let raw = raw_commit_rate(&base, 600);
        // 300 tasks (900 steps) a round, so that the daemon's start (connecting, recovering:
        // about 17 ms) weighs little on a per-step rate.
        let one = durable(&base, &format!("bench_one_{round}"), &reads, 300, 1);
        let (c, r, b) = step_parts(&base, round, 600);
        raws.push(raw);
        ones.push(one);
        ratios.push(one / raw);
        commits.push(c / raw);
        shop.push(r / raw);
        both.push(b / raw);
        boths.push(b);
    }
    let (raw, one) = (median(raws), median(ones));
    println!(
        "raw single-row UPDATE commits (PostgreSQL, autocommit, fsync on): {raw:.0} commits/s (median of 5 rounds)"
    );
    println!(
        "1 thread,  read-only tasks : {one:.0} steps/s ({:.2}x the raw commit rate, median of 5 alternating rounds: {}; target 0.5x)",
        median(ratios.clone()),
        listed(&ratios)
    );
    println!("a step's parts alone, in the same rounds, against each round's raw rate:");
    println!(
        "  the step's commit (state, 3 spans, reply, marker): {:.2}x (rounds: {})",
        median(commits.clone()),
        listed(&commits)
    );
    println!(
        "  the demo shop's read                             : {:.2}x (rounds: {})",
        median(shop.clone()),
        listed(&shop)
    );
    println!(
        "  a read then a commit, in turn                    : {:.2}x, {:.0} steps/s (rounds: {}; a step without the worker's own time or its task's last commit)",
        median(both.clone()),
        median(boths),
        listed(&both)
    );
    // Enough tasks that opening the 64 threads' connections (a process each on the server)
    // does not weigh on the rate.
    let many = durable(&base, "bench_many", &reads, 3200, 64);
    println!(
        "64 in flight, read-only    : {many:.0} steps/s ({:.1}x one thread; target 5x; each thread commits on its own connection)",
        many / one
    );
    let lat = wake_latency(&base, 30);
    let max = lat.iter().copied().fold(0.0, f64::max);
    let mut sorted = lat.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "enqueue to start, idle daemon: median {:.1} ms, p90 {:.1} ms, max {max:.1} ms over {} tasks (woken by NOTIFY; looked at every 0.1 ms; target under 5 ms; the poll fallback is 1000 ms)",
        median(lat.clone()),
        sorted[sorted.len() * 9 / 10],
        lat.len()
    );
}
