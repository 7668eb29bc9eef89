//! Crash recovery: 60 tasks enqueued by several `worker enqueue` processes while a daemon is
//! killed with SIGKILL at 32 random moments and restarted each time; then a final drain.
//! Afterwards no task is lost, duplicated or stuck in running, every task is done, stopped,
//! suspended or held, and the store's ledger holds each refund and each email at most once
//! (exactly once for tasks that ended done). Then a test-side oracle settles every held write
//! by asking the store's ledger (`worker reconcile --applied` or `--not-applied`) and approves
//! the suspended tasks; after a last drain every task is finished and every effect of a task
//! that ended done appears exactly once.
//!
//! The seed is printed; `TETHER_SEED=<seed> cargo test --test crash_recovery` replays the same
//! task mix and kill schedule (the machine's timing still varies).

mod common;
use common::*;

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

const TASKS: usize = 60;
const KILLS: usize = 32;
const ENQUEUERS: usize = 3;

#[test]
fn daemon_killed_at_random_moments_loses_and_repeats_nothing() {
    let seed: u64 = std::env::var("TETHER_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(7, |d| d.as_nanos() as u64)
        });
    println!("crash recovery seed: TETHER_SEED={seed}");
    let mut rng = Rng(seed);
    let dir = TempDir::new("crash");
    let d = dir.path().to_path_buf();
    ok(&d, &["store", "orders"]); // creates the store with its orders

    // The task mix: mostly the document's Policy (refund + email), some that suspend for
    // approval, some that get stuck. Each has its own store tenant and an enqueue key.
    let mut chunks: Vec<Vec<String>> = vec![Vec::new(); TASKS / 6];
    for i in 0..TASKS {
        let model = match rng.below(10) {
            0 => "policy:ord_1004:8000",
            1 => "new_ids",
            2 => "same_call",
            _ => "policy",
        };
        let line = format!(
            r#"{{"user": "cu_ana", "goal": "refund the damaged item on order ord_1001", "key": "crash-{i}", "model": "{model}", "store_scope": "c{i}"}}"#
        );
        chunks[i / 6].push(line);
    }
    for (k, c) in chunks.iter().enumerate() {
        std::fs::write(d.join(format!("chunk{k}.jsonl")), c.join("\n")).expect("write chunk");
    }

    // Enqueuers run beside the daemon; each retries one of its chunks, as a retried job would.
    let mut enqueuers = Vec::new();
    for e in 0..ENQUEUERS {
        let d = d.clone();
        let mine: Vec<usize> = (0..chunks.len()).filter(|k| k % ENQUEUERS == e).collect();
        let pause = 10 + rng.below(60);
        enqueuers.push(std::thread::spawn(move || {
            let mut runs = mine.clone();
            runs.push(mine[0]);
            for k in runs {
                let f = format!("chunk{k}.jsonl");
                let out = worker(&d, &["enqueue", "--file", &f]);
                assert!(
                    out.status.success(),
                    "enqueue {f}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                std::thread::sleep(Duration::from_millis(pause));
            }
        }));
    }

    for _ in 0..KILLS {
        let mut child = Command::new(bin())
            .args(["run", "--workers", "4", "--time-scale", "0.004"])
            .current_dir(&d)
            .env_remove("WORKER_DB")
            .env_remove("WORKER_STORE")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start daemon");
        std::thread::sleep(Duration::from_millis(20 + rng.below(120)));
        child.kill().expect("SIGKILL the daemon");
        child.wait().expect("reap the daemon");
    }
    for e in enqueuers {
        e.join().expect("enqueuer thread");
    }
    ok(&d, &["run", "--drain", "--workers", "4"]);

    let tasks = json(&d, &["list", "--json"]);
    let tasks = tasks.as_array().expect("list is an array");
    assert_eq!(
        tasks.len(),
        TASKS,
        "every enqueued task exists exactly once (seed {seed})"
    );
    let mut keys: Vec<&str> = tasks.iter().filter_map(|t| t["key"].as_str()).collect();
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), TASKS, "one task per key (seed {seed})");

    let ledger = json(&d, &["store", "ledger", "--json"]);
    let ledger = ledger.as_array().expect("ledger is an array");
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    let mut per_task: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for e in ledger {
        let key = e["key"].as_str().expect("ledger key");
        *per_key.entry(key).or_default() += 1;
        let task = key.split(':').nth(1).unwrap_or("").to_string();
        let slot = per_task.entry(task).or_default();
        match e["effect"]["kind"].as_str() {
            Some("refund") => slot.0 += 1,
            Some("email") => slot.1 += 1,
            other => panic!("unexpected effect {other:?}"),
        }
    }
    for (key, n) in &per_key {
        assert_eq!(*n, 1, "call key {key} took effect {n} times (seed {seed})");
    }
    let mut by_status: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks {
        let id = t["id"].as_str().expect("id");
        let status = t["status"].as_str().expect("status");
        *by_status
            .entry(format!("{status}/{}", t["stop"].as_str().unwrap_or("-")))
            .or_default() += 1;
        assert!(
            matches!(status, "finished" | "suspended" | "held"),
            "task {id} ended {status} (seed {seed})"
        );
        let (refunds, emails) = per_task.get(id).copied().unwrap_or((0, 0));
        assert!(
            refunds <= 1 && emails <= 1,
            "task {id}: {refunds} refunds, {emails} emails (seed {seed})"
        );
        if t["stop"] == "done" {
            assert_eq!(
                (refunds, emails),
                (1, 1),
                "task {id} ended done (seed {seed})"
            );
        }
    }
    println!("after {KILLS} kills: {by_status:?}");
    let keys = assert_sent_at_most_once(&d, &[], seed);
    assert!(keys > 0, "no refund reached the store (seed {seed})");

    // The oracle: a held write is applied exactly when the ledger has its call key; suspended
    // tasks are approved. A settled write can lead to an approval and back, so a few rounds.
    for _round in 0..3 {
        let ledger = json(&d, &["store", "ledger", "--json"]);
        let ledger = ledger.as_array().expect("ledger");
        let held = json(&d, &["reconcile", "--json"]);
        for h in held.as_array().expect("held list") {
            let (task, key) = (
                h["task"].as_str().expect("task"),
                h["key"].as_str().expect("key"),
            );
            let applied = ledger.iter().any(|e| e["key"] == key);
            let mut args = vec!["reconcile", task, "--key", key, "--by", "oracle"];
            args.extend_from_slice(&["--reason", "asked the ledger"]);
            if applied {
                args.push("--applied");
            } else {
                // A re-send needs budget left: grant it, as an operator would.
                args.extend_from_slice(&[
                    "--not-applied",
                    "--extend",
                    "tool_calls=1,deadline_ms=30000",
                ]);
            }
            ok(&d, &args);
        }
        let suspended = json(&d, &["list", "--status", "suspended", "--json"]);
        for t in suspended.as_array().expect("suspended list") {
            let id = t["id"].as_str().expect("id");
            let digest = held_digest(&d, id);
            ok(&d, &["approve", id, "--by", "oracle", "--digest", &digest]);
        }
        ok(&d, &["run", "--drain", "--workers", "4"]);
    }
    let tasks = json(&d, &["list", "--json"]);
    let ledger = json(&d, &["store", "ledger", "--json"]);
    let mut per_key: BTreeMap<String, usize> = BTreeMap::new();
    let mut per_task: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for e in ledger.as_array().expect("ledger") {
        let key = e["key"].as_str().expect("key").to_string();
        let task = key.split(':').nth(1).unwrap_or("").to_string();
        *per_key.entry(key).or_default() += 1;
        let slot = per_task.entry(task).or_default();
        if e["effect"]["kind"] == "refund" {
            slot.0 += 1;
        } else {
            slot.1 += 1;
        }
    }
    assert!(
        per_key.values().all(|n| *n == 1),
        "an effect twice after reconcile (seed {seed}): {per_key:?}"
    );
    let mut settled: BTreeMap<String, usize> = BTreeMap::new();
    for t in tasks.as_array().expect("tasks") {
        let id = t["id"].as_str().expect("id");
        assert_eq!(
            t["status"], "finished",
            "task {id} is not final after reconcile (seed {seed}): {t}"
        );
        *settled
            .entry(t["stop"].as_str().unwrap_or("-").to_string())
            .or_default() += 1;
        if t["stop"] == "done" {
            assert_eq!(
                per_task.get(id).copied(),
                Some((1, 1)),
                "task {id} (seed {seed})"
            );
        }
    }
    assert_sent_at_most_once(&d, &[], seed);
    println!("after reconcile and approvals: {settled:?}");
}
