//! `worker wait` and `worker enqueue --wait`, as a job uses them, on both backends: a wait that
//! began before any daemon ran follows its task through a daemon killed once; an idle waiter
//! is woken by the database (its reads of the task are counted: a poll would read it every
//! half second), and the exit code table of `worker wait --help` holds row by row.

use crate::common;
use common::*;

use std::process::{Child, Output, Stdio};
use std::time::Duration;

/// `worker wait ARGS` started in the background, with its reads of the task logged.
fn spawn_wait(d: &std::path::Path, args: &[&str]) -> Child {
    spawn_wait_into(d, args, Stdio::piped())
}

fn spawn_wait_into(d: &std::path::Path, args: &[&str], stderr: Stdio) -> Child {
    command(d)
        .arg("wait")
        .args(args)
        .env("RUST_LOG", "tether::operator=debug")
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .expect("start worker wait")
}

/// How many times a waiter's log says it read the task.
fn reads(stderr: &str) -> usize {
    stderr.matches("wait: read the task").count()
}

fn finish(child: Child) -> (Output, String, String) {
    let out = child.wait_with_output().expect("the waiter ends");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, stdout, stderr)
}

fn daemon(d: &std::path::Path, extra: &[&str]) -> Child {
    command(d)
        .args(["run", "--max-in-flight", "2", "--time-scale", "0.3"])
        .args(["--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the daemon")
}

conformance! {
    /// The job's view: the wait starts before any daemon runs, a daemon is killed mid-task and
    /// another finishes it; the waiter prints the task's result and exits 0.
    fn a_wait_outlives_a_killed_daemon(d) {
        // A model call takes 1.5 s of active time, shown at 0.3x: the task is mid-run for
        // seconds, so the kill lands inside it.
        enqueue(d, &["--key", "job-1"]);
        let waiter = spawn_wait(d, &["key:job-1", "--json"]);
        std::thread::sleep(Duration::from_millis(300));
        let mut first = daemon(d, &[]);
        std::thread::sleep(Duration::from_millis(900));
        first.kill().expect("SIGKILL the daemon");
        first.wait().expect("reap it");
        let mut second = daemon(d, &["--drain"]);
        let (out, stdout, stderr) = finish(waiter);
        assert!(second.wait().expect("the drain ends").success());
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
        assert_eq!(v["id"], "t1", "{v}");
        assert_eq!(v["status"], "finished", "{v}");
        assert_eq!(v["stop"], "done", "{v}");
        assert_eq!(v["outcome"], "completed", "{v}");
        assert_eq!(v["answer"], "Refund issued and confirmation sent.", "{v}");
        assert!(v["runs"].as_u64().is_some_and(|r| r >= 2), "the kill made a second run: {v}");
    }

    /// An idle waiter reads its task once (and once more on PostgreSQL, when its LISTEN
    /// session starts), however long it waits; it reads it again when the daemon's commits
    /// wake it. A poll every half second would have read it about six times while idle.
    fn an_idle_waiter_is_woken_not_polling(d) {
        enqueue(d, &[]);
        // The waiter logs into a file, so what it logged before any daemon ran can be read
        // while it waits.
        let log_path = d.join("waiter.log");
        let log = std::fs::File::create(&log_path).expect("the waiter's log");
        let waiter = spawn_wait_into(d, &["t1"], Stdio::from(log));
        std::thread::sleep(Duration::from_secs(3));
        let idle = std::fs::read_to_string(&log_path).expect("the waiter's log so far");
        assert!(
            reads(&idle) <= 2,
            "read the task {} times while nothing happened:\n{idle}",
            reads(&idle)
        );
        let mut drain = daemon(d, &["--drain"]);
        let (out, stdout, _) = finish(waiter);
        let stderr = std::fs::read_to_string(&log_path).expect("the waiter's log");
        assert!(drain.wait().expect("drain").success());
        assert_eq!(out.status.code(), Some(0), "{stderr}");
        assert_eq!(stdout.trim(), "Refund issued and confirmation sent.");
        assert!(reads(&stderr) > reads(&idle), "read again when woken:\n{stderr}");
        assert!(stderr.contains("t1 completed"), "{stderr}");
    }

    /// Issue 53: `--until finished` waits through a wait on a person. A waiter started before
    /// anything ran sees the task suspended for an approval, says once on stderr what it
    /// waits for (the approve command with its digest) and goes on waiting; once an operator
    /// approved and a daemon finished the task, it prints the answer and exits 0. Without the
    /// flag the same wait ends there with exit 5.
    fn a_wait_until_finished_goes_through_an_approval(d) {
        enqueue(d, &["--model", "policy:ord_1004:8000", "--key", "big"]);
        let log_path = d.join("waiter.log");
        let log = std::fs::File::create(&log_path).expect("the waiter's log");
        let mut waiter = spawn_wait_into(d, &["key:big", "--until", "finished", "--json"], Stdio::from(log));
        ok(d, &["run", "--drain", "--time-scale", "0.002"]);
        let t = json(d, &["show", "t1", "--json"]);
        assert_eq!(t["status"], "suspended", "{t}");
        let digest = t["held"]["digest"].as_str().expect("digest").to_string();
        let settled = worker(d, &["wait", "t1"]);
        assert_eq!(settled.status.code(), Some(5), "the default still ends at the person");
        // The waiter says what it waits for, and does not end.
        let said = format!("worker approve t1 --digest {digest}");
        let mut log_text = String::new();
        for _ in 0..300 {
            log_text = std::fs::read_to_string(&log_path).unwrap_or_default();
            if log_text.contains(&said) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        assert!(log_text.contains(&said) && log_text.contains("the wait goes on until it finishes"), "{log_text}");
        assert!(waiter.try_wait().expect("the waiter").is_none(), "it waits on: {log_text}");
        ok(d, &["approve", "t1", "--digest", &digest, "--by", "alice"]);
        ok(d, &["run", "--drain", "--time-scale", "0.002"]);
        let (out, stdout, _) = finish(waiter);
        let log_text = std::fs::read_to_string(&log_path).unwrap_or_default();
        assert_eq!(out.status.code(), Some(0), "{log_text}");
        let v: serde_json::Value = serde_json::from_str(&stdout).expect("JSON on stdout");
        assert_eq!((v["status"].as_str(), v["outcome"].as_str()), (Some("finished"), Some("completed")), "{v}");
        assert_eq!(log_text.matches("the wait goes on until it finishes").count(), 1, "said once: {log_text}");
        // `--until` belongs to a wait.
        let out = worker(d, &["enqueue", "--user", "u", "--goal", "g", "--model", "policy", "--until", "finished"]);
        assert_eq!(out.status.code(), Some(2), "{out:?}");
    }

    /// A second hold of the same arguments at a later step is another call: the waiter says
    /// it again (found by review: the line was keyed on the arguments' digest).
    fn a_wait_until_finished_says_each_held_call(d) {
        let refund = r#"{"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1004", "amount_cents": 6000, "reason": "damaged"}, "plan_step": "STEP"}"#;
        let script = [
            r#"{"type": "plan", "steps": [{"id": "s1", "tool": "get_order", "depends_on": []}, {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]}, {"id": "s3", "tool": "issue_refund", "depends_on": ["s2"]}]}"#.to_string(),
            r#"{"type": "tool", "name": "get_order", "args": {"order_id": "ord_1004"}, "plan_step": "s1"}"#.to_string(),
            refund.replace("STEP", "s2"),
            refund.replace("STEP", "s3"),
            r#"{"type": "final", "outcome": "completed", "text": "Refunded twice."}"#.to_string(),
        ];
        std::fs::write(d.join("twice.jsonl"), script.join("\n")).expect("script");
        enqueue(d, &["--model", "script:twice.jsonl:0"]);
        let log_path = d.join("waiter.log");
        let log = std::fs::File::create(&log_path).expect("the waiter's log");
        let waiter = spawn_wait_into(d, &["t1", "--until", "finished"], Stdio::from(log));
        for round in 1..=2 {
            ok(d, &["run", "--drain"]);
            let t = json(d, &["show", "t1", "--json"]);
            assert_eq!(t["status"], "suspended", "{t}");
            let digest = t["held"]["digest"].as_str().expect("digest").to_string();
            // The waiter says this hold before it is approved.
            let mut said = String::new();
            for _ in 0..300 {
                said = std::fs::read_to_string(&log_path).unwrap_or_default();
                if said.matches("the wait goes on").count() >= round {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            assert_eq!(said.matches("the wait goes on").count(), round, "hold {round}: {said}");
            ok(d, &["approve", "t1", "--digest", &digest, "--by", "alice"]);
        }
        ok(d, &["run", "--drain"]);
        let (out, _, _) = finish(waiter);
        let said = std::fs::read_to_string(&log_path).unwrap_or_default();
        assert_eq!(out.status.code(), Some(0), "{said}");
        assert_eq!(said.matches("the wait goes on until it finishes").count(), 2, "{said}");
    }

    /// Every row of the exit-code table (`worker wait --help`), through `enqueue --wait` with a
    /// daemon running, and `worker wait` on a task that stays queued.
    fn the_exit_code_table_row_by_row(d) {
        std::fs::write(
            d.join("gives-up.jsonl"),
            r#"{"type": "final", "outcome": "cannot_complete", "text": "order ord_9 does not exist"}"#,
        )
        .expect("script");
        let mut run = command(d)
            .args(["run", "--max-in-flight", "4", "--time-scale", "0.002"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("daemon");
        let rows: [(&[&str], i32, &str); 6] = [
            (&["--model", "policy"], 0, "finished"),
            (&["--model", "script:gives-up.jsonl"], 3, "finished"),
            (&["--model", "same_call"], 4, "finished"),
            (&["--model", "policy:ord_1004:8000"], 5, "suspended"),
            (&["--model", "policy", "--tool-latency", "issue_refund=40000"], 5, "held"),
            (&["--model", "policy", "--budget", "steps_max=2"], 4, "finished"),
        ];
        for (i, (extra, code, status)) in rows.iter().enumerate() {
            let key = format!("row-{i}");
            let mut args = vec!["enqueue", "--user", "cu_ana", "--goal", GOAL, "--key", &key];
            args.extend_from_slice(extra);
            args.extend_from_slice(&["--wait", "--json"]);
            let out = worker(d, &args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(*code), "row {i} {extra:?}: {stderr}");
            let v: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("the result as JSON");
            assert_eq!(v["status"], *status, "row {i}: {v}");
            match i {
                1 => {
                    assert_eq!(v["outcome"], "cannot_complete", "{v}");
                    assert_eq!(v["answer"], "order ord_9 does not exist", "{v}");
                }
                2 => assert_eq!(v["stop"], "repeated_call", "{v}"),
                3 => {
                    assert_eq!(v["waiting_for"], "approval", "{v}");
                    assert_eq!(v["held_call"]["tool"], "issue_refund", "{v}");
                }
                4 => assert_eq!(v["waiting_for"], "reconcile", "{v}"),
                5 => assert_eq!(v["stop"], "max_steps", "{v}"),
                _ => {}
            }
            // A retried job: the same key waits on the same task, with the same code.
            let again = worker(d, &args);
            assert_eq!(again.status.code(), Some(*code), "row {i} retried");
        }
        // Cancelled: a suspended task cancelled by an operator.
        ok(d, &["cancel", "key:row-3", "--reason", "not today"]);
        let out = worker(d, &["wait", "key:row-3"]);
        assert_eq!(out.status.code(), Some(6), "{out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("cancelled"), "{out:?}");
        run.kill().expect("stop the daemon");
        run.wait().expect("reap");
        // Timed out: nothing runs the task; the wait gives up, the task stays queued.
        let out = worker(d, &[
            "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "policy", "--key", "late",
            "--wait", "--timeout", "1s",
        ]);
        assert_eq!(out.status.code(), Some(7), "{out:?}");
        assert!(out.stdout.is_empty(), "no answer yet: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains("still queued"), "{out:?}");
        let v = json(d, &["show", "key:late", "--json"]);
        assert_eq!(v["status"], "queued", "{v}");
        // Text: the answer alone on stdout, for `answer=$(...)`.
        let out = worker(d, &["wait", "key:row-0"]);
        assert_eq!(out.status.code(), Some(0));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "Refund issued and confirmation sent.\n");
        // Usage errors stay 2; an unknown task is operational (1).
        assert_eq!(worker(d, &["wait", "t1", "--timeout", "soon"]).status.code(), Some(2));
        assert_eq!(worker(d, &["wait", "t999"]).status.code(), Some(1));
        assert_eq!(worker(d, &["enqueue", "--file", "x.jsonl", "--wait"]).status.code(), Some(2));
    }
}
