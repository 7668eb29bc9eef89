//! Benchmark of the durable worker, all measured in one run on the same disk:
//! - the disk's raw rate: 4 KiB written in place and fsynced;
//! - the raw redb commit rate of a step-shaped transaction (about 2 KiB of state, a call-key
//!   record and three spans) in MultiWriter mode;
//! - durable steps/s and tasks/s with one worker thread (one task at a time), for a read-only
//!   workload (1 commit per step) and the design reference's Policy (refund and email: intents and
//!   store writes too), on a file shared for writing (the default) and on one the daemon is the
//!   only writer of (`worker run --sole-writer`), in alternating rounds;
//! - the same with 64 tasks in flight (64 threads; the committer groups their steps), both ways;
//! - enqueue to start with an idle daemon (its distribution): in process, and as a user's job
//!   sees it, `worker enqueue --wait` through a running daemon's socket (200 samples);
//! - enqueue throughput: one `worker enqueue` process per task, opening the file itself and
//!   through a running daemon's local socket, beside the rate of starting the binary alone (the
//!   floor of one process per task), and one batch file;
//! - bytes written per step commit, in the record format and as format 1 (JSON, the whole task
//!   record rewritten by every step) would have written the same commits: for the Policy, and
//!   for tasks sharing a 2 MB script.
//!
//! Run with `cargo bench --bench durable` (`TETHER_DURABLE=one`: the one-task figures only).
//! Figures are printed with their ratios.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;
use tether::store::prelude::*;

use tether::model::ModelProfile;
use tether::store::{QueueStatus, RedbStore, Sharing};
use tether::tools::durable::DurableStore;
use tether::worker::{self, Config};

#[path = "common/figures.rs"]
mod figures;
use figures::*;
#[path = "common/tasks.rs"]
mod tasks;
use tasks::tasks;

fn temp_dir(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("tether-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    std::fs::create_dir_all(&p).expect("temp dir");
    p
}

fn raw_commit_rate(n: usize) -> f64 {
    raw_commit_rate_in(redb::ConcurrencyMode::MultiWriter, n)
}

/// The same commits in another of redb's modes: what owning the file for writing would buy.
fn raw_commit_rate_in(mode: redb::ConcurrencyMode, n: usize) -> f64 {
    let dir = temp_dir("raw");
    let db = redb::Database::builder()
        .set_concurrency_mode(mode)
        .create(dir.join("raw.redb"))
        .expect("open");
    const STATE: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("tasks");
    const KEYS: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("call_keys");
    const SPANS: redb::TableDefinition<(&str, u32), &[u8]> = redb::TableDefinition::new("spans");
    let state = vec![b'x'; 2048];
    let key = vec![b'k'; 256];
    let span = vec![b's'; 200];
    let t = Instant::now();
    for i in 0..n {
        let w = db.begin_write().expect("write");
        {
            w.open_table(STATE)
                .expect("t")
                .insert("t1", state.as_slice())
                .expect("i");
            w.open_table(KEYS)
                .expect("t")
                .insert(format!("t1:s{i}").as_str(), key.as_slice())
                .expect("i");
            let mut s = w.open_table(SPANS).expect("t");
            for j in 0..3u32 {
                s.insert(("t1", i as u32 * 3 + j), span.as_slice())
                    .expect("i");
            }
        }
        w.commit().expect("commit");
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    rate
}

/// The disk's own rate: 4 KiB written in place and `fsync`ed, `n` times, in a file of the
/// same directory as the databases.
fn raw_fsync_rate(n: usize) -> f64 {
    use std::os::unix::fs::FileExt;
    let dir = temp_dir("fsync");
    let f = std::fs::File::create(dir.join("raw.bin")).expect("file");
    let block = vec![b'x'; 4096];
    f.write_all_at(&block, 0).expect("write");
    f.sync_all().expect("fsync");
    let t = Instant::now();
    for _ in 0..n {
        f.write_all_at(&block, 0).expect("write");
        f.sync_all().expect("fsync");
    }
    let rate = n as f64 / t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    rate
}

/// Enqueues `n` tasks of `model` (each with its own store tenant), runs them with at most
/// `workers` in flight until drained, and returns (steps/s, tasks/s, transactions, commits).
fn durable(name: &str, model: &ModelProfile, n: usize, workers: usize) -> (f64, f64, u64, u64) {
    durable_metered(name, model, n, workers, Sharing::Shared, |_| {})
}

/// [`durable`] on a file the daemon is the only writer of (`worker run --sole-writer`).
fn durable_sole(
    name: &str,
    model: &ModelProfile,
    n: usize,
    workers: usize,
) -> (f64, f64, u64, u64) {
    durable_metered(name, model, n, workers, Sharing::Sole, |_| {})
}

/// Enqueue-to-start latency with an idle daemon on the file: each of `n` tasks is enqueued
/// after a pause in which the daemon finds nothing to do, and the time until its claim is
/// visible is measured (ms, in order).
fn wake_latency(n: usize) -> Vec<f64> {
    let dir = temp_dir("wake");
    let store = Arc::new(RedbStore::open(&dir.join("w.redb"), true).expect("db"));
    let tools = Arc::new(DurableStore::open(&dir.join("w.store.redb")).expect("store"));
    let stop = Arc::new(AtomicBool::new(false));
    let daemon = {
        let (store, stop) = (store.clone(), stop.clone());
        std::thread::spawn(move || {
            let cfg = Config {
                demo: Some(Arc::new(tether::tools::durable::DemoShop::opened(
                    Arc::clone(&tools),
                ))),
                max_in_flight: 1,
                ..Config::default()
            };
            worker::run(store, &cfg, stop).expect("daemon")
        })
    };
    let reads = ModelProfile::NewIds { latency_ms: 1500 };
    let mut out = Vec::new();
    std::thread::sleep(std::time::Duration::from_millis(500));
    for _ in 0..n {
        std::thread::sleep(std::time::Duration::from_millis(300));
        let t = Instant::now();
        let id = store
            .enqueue(&tasks(&reads, 1), worker::now_ms())
            .expect("enqueue")[0]
            .id
            .clone();
        while store.task(&id).expect("task").status == QueueStatus::Queued {
            assert!(t.elapsed().as_secs() < 10, "the task never started");
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
        out.push(t.elapsed().as_secs_f64() * 1000.0);
    }
    stop.store(true, Ordering::SeqCst);
    daemon.join().expect("daemon thread");
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// `worker enqueue --wait` through the socket of an idle `worker run` (the release binary),
/// one task at a time after a pause, with a model that answers at once: each sample is the
/// whole command (process start, enqueue, start, run, the waiter woken), so it bounds
/// enqueue-to-start from above (ms, in order). A missed wake-up shows as the fallback poll's
/// second.
fn socket_wake(n: usize) -> Vec<f64> {
    let bin = env!("CARGO_BIN_EXE_worker");
    let dir = temp_dir("socket-wake");
    std::fs::write(
        dir.join("final.jsonl"),
        r#"{"type": "final", "outcome": "completed", "text": "Done."}"#,
    )
    .expect("script");
    let worker = |args: &[&str]| {
        let mut c = std::process::Command::new(bin);
        c.current_dir(&dir).env_remove("WORKER_DB").args(args);
        c
    };
    let mut daemon = worker(&["run"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the daemon");
    let enqueue = || {
        let t = Instant::now();
        let out = worker(&[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            "script:final.jsonl",
            "--wait",
        ])
        .output()
        .expect("enqueue");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        t.elapsed().as_secs_f64() * 1000.0
    };
    // The first waits for the daemon's socket.
    enqueue();
    let mut out = Vec::new();
    for _ in 0..n {
        std::thread::sleep(std::time::Duration::from_millis(20));
        out.push(enqueue());
    }
    let _ = daemon.kill();
    let _ = daemon.wait();
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// `durable`, with `meter` called on the database before the run (to switch its write meter on).
fn durable_metered(
    name: &str,
    model: &ModelProfile,
    n: usize,
    workers: usize,
    sharing: Sharing,
    meter: impl FnOnce(&RedbStore),
) -> (f64, f64, u64, u64) {
    let dir = temp_dir(name);
    let store = Arc::new(RedbStore::open_as(&dir.join("w.redb"), true, sharing).expect("db"));
    meter(&store);
    let tools = Arc::new(DurableStore::open(&dir.join("w.store.redb")).expect("store"));
    let tasks = tasks(model, n);
    store.enqueue(&tasks, worker::now_ms()).expect("enqueue");
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
    let steps = stats.steps.load(Ordering::Relaxed) as f64;
    let ended = stats.tasks_ended.load(Ordering::Relaxed);
    assert_eq!(ended as usize, n, "every task ran to its end");
    let out = (
        steps / secs,
        ended as f64 / secs,
        stats.transactions.load(Ordering::Relaxed),
        stats.commits.load(Ordering::Relaxed),
    );
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// `worker enqueue` one process per task: `single` of them straight to the file (no daemon
/// runs), then `single` through the local socket of a daemon on the same file (the file's only
/// writer, `--sole-writer`) (its tasks start
/// in an hour, so the daemon only commits them, as the direct enqueue does); and one batch
/// file of `batch` tasks. Returns (direct, through the daemon, batch) tasks/s.
fn enqueue_rates(single: usize, batch: usize) -> (f64, f64, f64, f64) {
    let bin = env!("CARGO_BIN_EXE_worker");
    let dir = temp_dir("enqueue");
    let run = |args: &[&str]| {
        let st = std::process::Command::new(bin)
            .args(args)
            .current_dir(&dir)
            .output()
            .expect("worker");
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
    };
    let singles = |prefix: &str| {
        let t = Instant::now();
        for i in 0..single {
            run(&[
                "enqueue",
                "--model",
                "policy",
                "--user",
                "u",
                "--goal",
                "g",
                "--in",
                "1h",
                "--key",
                &format!("{prefix}-{i}"),
            ]);
        }
        single as f64 / t.elapsed().as_secs_f64()
    };
    run(&[
        "enqueue", "--model", "policy", "--user", "u", "--goal", "warm up", "--in", "1h",
    ]);
    let direct = singles("direct");
    let mut daemon = std::process::Command::new(bin)
        .args(["run", "--max-in-flight", "1", "--sole-writer"])
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("daemon");
    let socket = dir.join("worker.redb.sock");
    let t = Instant::now();
    while std::os::unix::net::UnixStream::connect(&socket).is_err() {
        assert!(
            t.elapsed().as_secs() < 60,
            "the daemon never served its socket"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let through = singles("socket");
    // The floor of one process per task: starting the binary and nothing else.
    let t = Instant::now();
    for _ in 0..single {
        run(&["--version"]);
    }
    let floor = single as f64 / t.elapsed().as_secs_f64();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &daemon.id().to_string()])
        .status();
    let _ = daemon.wait();
    let lines: Vec<String> = (0..batch)
        .map(|i| format!(r#"{{"model": "policy", "user": "u", "goal": "g", "key": "batch-{i}"}}"#))
        .collect();
    std::fs::write(dir.join("batch.jsonl"), lines.join("\n")).expect("write batch");
    let t = Instant::now();
    run(&["enqueue", "--file", "batch.jsonl"]);
    let batch_rate = batch as f64 / t.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(&dir);
    (direct, through, floor, batch_rate)
}

/// A script model of about `bytes`: plan, read, final, then padding replies never reached.
fn big_script(bytes: usize) -> ModelProfile {
    let mut replies = vec![
        serde_json::json!({"type": "plan", "steps": [{"id": "s1", "tool": "get_order", "depends_on": []}]}),
        serde_json::json!({"type": "tool", "name": "get_order", "args": {"order_id": "ord_1001"}, "plan_step": "s1"}),
        serde_json::json!({"type": "final", "outcome": "completed", "text": "done"}),
    ];
    let pad = "p".repeat(1000);
    while replies.len() * 1000 < bytes {
        replies.push(serde_json::json!({"type": "final", "text": pad}));
    }
    ModelProfile::Script {
        replies,
        latency_ms: 100,
    }
}

fn main() {
    // The raw commit rate and one-thread durable rate are measured in alternating rounds, so
    // both see the same disk and the same background load; the median ratio is reported.
    let reads = ModelProfile::NewIds { latency_ms: 1500 };
    let policy = ModelProfile::policy();
    let (mut fsyncs, mut raws, mut r1s, mut rt1s, mut ratios, mut disk_ratios) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let (mut sole1s, mut sole_t1s, mut sole_disk) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..5 {
        let fsync = raw_fsync_rate(600);
        let raw = raw_commit_rate(300);
        let (r1, rt1, _, _) = durable(&format!("reads-1-{round}"), &reads, 60, 1);
        let (s1, st1, _, _) = durable_sole(&format!("sole-1-{round}"), &reads, 60, 1);
        ratios.push(r1 / raw);
        disk_ratios.push(r1 / fsync);
        sole_disk.push(s1 / fsync);
        fsyncs.push(fsync);
        raws.push(raw);
        r1s.push(r1);
        rt1s.push(rt1);
        sole1s.push(s1);
        sole_t1s.push(st1);
    }
    let (fsync, raw, r1, rt1) = (median(fsyncs), median(raws), median(r1s), median(rt1s));
    let (s1, st1) = (median(sole1s), median(sole_t1s));
    println!(
        "raw 4 KiB write + fsync (the disk)                        : {fsync:.0}/s (median of 5 rounds)"
    );
    println!(
        "raw redb commit (2 KiB state + key + 3 spans, MultiWriter): {raw:.0} commits/s (median of 5 rounds; {:.2}x the disk)",
        raw / fsync
    );
    // The modes a daemon that owns the file could use, measured beside MultiWriter (which
    // lets every process write, and so commits in two phases with the allocator state).
    let modes = [
        ("SingleWriter", redb::ConcurrencyMode::SingleWriter),
        ("ExclusiveWriter", redb::ConcurrencyMode::ExclusiveWriter),
    ];
    for (name, mode) in modes {
        let (mut own, mut multi) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            own.push(raw_commit_rate_in(mode, 300));
            multi.push(raw_commit_rate(300));
        }
        let (own, multi) = (median(own), median(multi));
        println!(
            "raw redb commit, {name:15}: {own:.0} commits/s ({:.2}x MultiWriter's {multi:.0} in alternating rounds; {:.2}x the disk)",
            own / multi,
            own / fsync
        );
    }
    println!(
        "1 thread,  read-only tasks : {r1:.0} steps/s, {rt1:.0} tasks/s  ({:.2}x the raw commit rate, median of 5 alternating rounds: {}; target 0.7x)",
        median(ratios.clone()),
        listed(&ratios)
    );
    println!(
        "                             {:.2}x the disk's 4 KiB write + fsync (rounds: {}; target 0.5x)",
        median(disk_ratios.clone()),
        listed(&disk_ratios)
    );
    println!(
        "1 thread,  read-only, sole writer: {s1:.0} steps/s, {st1:.0} tasks/s  ({:.2}x the shared file's; {:.2}x the disk, rounds: {}; target 0.5x)",
        s1 / r1,
        median(sole_disk.clone()),
        listed(&sole_disk)
    );
    // `TETHER_DURABLE=one`: the one-task figures only (a change to a step's path, measured
    // quickly).
    if std::env::var("TETHER_DURABLE").as_deref() == Ok("one") {
        return;
    }
    let (p1, pt1, _, _) = durable("policy-1", &policy, 100, 1);
    println!(
        "1 thread,  Policy tasks    : {p1:.0} steps/s, {pt1:.0} tasks/s  ({:.2}x the raw commit rate)",
        p1 / raw
    );
    let (r64, rt64, tx, commits) = durable("reads-64", &reads, 640, 64);
    println!(
        "64 in flight, read-only    : {r64:.0} steps/s, {rt64:.0} tasks/s  ({:.1}x one thread; target 5x; {:.2}x the disk's fsync rate, target 2x; {:.1} commits per transaction)",
        r64 / r1,
        r64 / fsync,
        commits as f64 / tx.max(1) as f64
    );
    let (s64, st64, tx, commits) = durable_sole("sole-64", &reads, 640, 64);
    println!(
        "64 in flight, read-only, sole writer: {s64:.0} steps/s, {st64:.0} tasks/s  ({:.2}x the shared file's; {:.2}x the disk's fsync rate, target 2x; {:.1} commits per transaction)",
        s64 / r64,
        s64 / fsync,
        commits as f64 / tx.max(1) as f64
    );
    let (p64, pt64, tx, commits) = durable("policy-64", &policy, 640, 64);
    println!(
        "64 in flight, Policy       : {p64:.0} steps/s, {pt64:.0} tasks/s  ({:.1}x one thread; {:.1} commits per transaction)",
        p64 / p1,
        commits as f64 / tx.max(1) as f64
    );
    let bytes = |name: &str, model: &ModelProfile, n: usize| {
        let mut meter = None;
        durable_metered(name, model, n, 1, Sharing::Shared, |store| {
            let m = store.meter_writes();
            m.measure_legacy.store(true, Ordering::Relaxed);
            meter = Some(m);
        });
        let m = meter.expect("the run switched the meter on");
        let commits = m.commits.load(Ordering::Relaxed).max(1) as f64;
        (
            m.bytes.load(Ordering::Relaxed) as f64 / commits,
            m.legacy_bytes.load(Ordering::Relaxed) as f64 / commits,
        )
    };
    let (now, before) = bytes("bytes-policy", &policy, 20);
    println!(
        "bytes per step commit, Policy      : {now:.0} B (format 1: {before:.0} B, {:.1}x less)",
        before / now
    );
    let script = big_script(2 << 20);
    let (now, before) = bytes("bytes-script", &script, 10);
    println!(
        "bytes per step commit, 2 MB script : {now:.0} B (format 1: {before:.0} B, {:.0}x less)",
        before / now
    );
    let mut lat = wake_latency(30);
    lat.sort_by(f64::total_cmp);
    println!(
        "enqueue to start, idle daemon: median {:.1} ms, p90 {:.1} ms, max {:.1} ms over {} tasks (in process, woken directly; target under 5 ms; the poll fallback is 1000 ms)",
        lat[lat.len() / 2],
        lat[lat.len() * 9 / 10],
        lat[lat.len() - 1],
        lat.len()
    );
    let mut lat = socket_wake(200);
    lat.sort_by(f64::total_cmp);
    println!(
        "enqueue --wait through an idle daemon's socket: median {:.1} ms, p90 {:.1} ms, max {:.1} ms over {} tasks (the whole command; target: no sample over 50 ms)",
        lat[lat.len() / 2],
        lat[lat.len() * 9 / 10],
        lat[lat.len() - 1],
        lat.len()
    );
    let (single, through, floor, batch) = enqueue_rates(100, 2000);
    println!(
        "enqueue, one process per task: {single:.0} tasks/s opening the file, {through:.0} tasks/s through a running daemon's socket ({:.2}x; target 3x)",
        through / single
    );
    println!(
        "process start alone          : {floor:.0} processes/s (`worker --version`, beside the daemon); an enqueue through the daemon takes {:.2} ms more",
        1000.0 / through - 1000.0 / floor
    );
    println!(
        "enqueue, one batch file      : {batch:.0} tasks/s ({:.0}x one process per task)",
        batch / single
    );
}
