//! Crash recovery: 60 tasks enqueued by several `worker enqueue` processes while a daemon is
//! killed with SIGKILL at 32 random moments and restarted each time; then a final drain.
//! Afterwards no task is lost, duplicated or stuck in running, every task is done, stopped,
//! suspended or held, and the store's ledger holds each refund and each email at most once
//! (exactly once for tasks that ended done). Then a test-side oracle settles every held write
//! by asking the store's ledger (`worker reconcile --applied` or `--not-applied`) and approves
//! the suspended tasks; after a last drain every task is finished and every effect of a task
//! that ended done appears exactly once.
//!
//! It runs on both backends (`::redb`, `::postgres`) with daemons that share the file for
//! writing (`--shared`), and once more on a file with daemons as they start by default, each
//! the file's only writer while it runs.
//!
//! The seed is printed; `TETHER_SEED=<seed> cargo test --test crash_recovery` replays the same
//! task mix and kill schedule (the machine's timing still varies).

use crate::common;
use common::*;

use std::time::Duration;

const TASKS: usize = 60;
const KILLS: usize = 32;
const ENQUEUERS: usize = 3;

conformance! {
fn daemon_killed_at_random_moments_loses_and_repeats_nothing(dir) {
    crash(dir, &["--shared"]);
}
}

/// The same with a daemon that is the file's only writer (the default): the enqueuers go
/// through its socket while it runs, and open the file themselves between a kill and the next
/// start (or wait for that daemon's socket when it took the file first).
#[test]
fn a_sole_writer_daemon_killed_at_random_moments_loses_and_repeats_nothing() {
    let dir = TempDir::on("crash_sole", Backend::Redb).expect("a directory");
    crash(dir.path(), &[]);
}

/// Kills daemons started with `run_extra` at random moments while enqueuers run beside them.
fn crash(dir: &std::path::Path, run_extra: &[&str]) {
    let seed = seed("crash recovery");
    let mut rng = Rng(seed);
    let d = dir.to_path_buf();
    ok(&d, &["store", "orders"]); // creates the store with its orders

    // The task mix: mostly the design reference's Policy (refund + email), some that suspend for
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
                let out = worker(&d, &["enqueue", "--model", "policy", "--file", &f]);
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
        kill_after(
            command(&d)
                .args(["run", "--max-in-flight", "4", "--time-scale", "0.004"])
                .args(run_extra)
                // On PostgreSQL a killed daemon's claims are taken over when its heartbeat
                // runs out (a file judges the dead process at once).
                .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"]),
            20 + rng.below(120),
        );
    }
    for e in enqueuers {
        e.join().expect("enqueuer thread");
    }
    let mut drain = vec![
        "run",
        "--drain",
        "--max-in-flight",
        "4",
        "--recover-every-ms",
        "200",
    ];
    drain.extend_from_slice(run_extra);
    ok(&d, &drain);

    check_after_crashes(&d, TASKS, seed);
    settle_with_oracle(&d, seed);
}
