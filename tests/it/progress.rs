//! Progress on a terminal, silence in a pipe: a batch enqueue draws a bar and `run --drain`
//! prints rate and remaining-count lines when stderr is a terminal (run under `script`, which
//! gives the command a pseudo-terminal); piped, neither prints anything of the kind.

use crate::common;
use common::*;

use std::path::Path;
use std::process::Command;

/// Runs `worker ARGS` in `dir` under a pseudo-terminal; everything it printed.
fn on_a_terminal(dir: &Path, args: &str, env: &[(&str, &str)]) -> Option<String> {
    let line = format!(
        "{} --db {} {args}",
        bin(),
        dir.join("worker.redb").display()
    );
    let mut c = Command::new("script");
    c.args(["-qfec", &line, "/dev/null"]).current_dir(dir);
    for (k, v) in env {
        c.env(k, v);
    }
    c.env_remove("WORKER_PROGRESS");
    match c.output() {
        Ok(out) => {
            assert!(
                out.status.success(),
                "{line}: {}",
                String::from_utf8_lossy(&out.stdout)
            );
            Some(String::from_utf8_lossy(&out.stdout).into_owned())
        }
        Err(e) => {
            missing(&format!("`script` ({e})"), "it comes with bsdutils");
            None
        }
    }
}

fn batch(dir: &Path, name: &str, n: usize) {
    let lines: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"user": "cu_ana", "goal": "refund {i}", "model": "policy", "store_scope": "{name}{i}"}}"#))
        .collect();
    std::fs::write(dir.join(name), lines.join("\n")).expect("a batch file");
}

#[test]
fn progress_on_a_terminal_and_quiet_in_a_pipe() {
    let dir = TempDir::new("progress");
    let d = dir.path();
    batch(d, "a.jsonl", 500);
    batch(d, "b.jsonl", 500);
    // Piped: the result only.
    let out = command(d)
        .args(["enqueue", "--model", "policy", "--file", "a.jsonl"])
        .output()
        .expect("runs");
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("reading ["), "no bar in a pipe: {err}");
    let Some(tty) = on_a_terminal(d, "enqueue --file b.jsonl", &[]) else {
        return;
    };
    assert!(tty.contains("reading ["), "a bar on a terminal: {tty}");
    assert!(
        tty.contains("100%") && tty.contains("500 tasks checked; writing them in one transaction"),
        "{tty}"
    );
    // A drain: rate and remaining lines on a terminal, none in a pipe (in a database of its
    // own with fewer tasks, each step slowed a little so the drain lasts a few reports).
    let dir = TempDir::new("progress-drain");
    let d = dir.path();
    batch(d, "a.jsonl", 150);
    ok(d, &["enqueue", "--model", "policy", "--file", "a.jsonl"]);
    let slow = [("WORKER_PROGRESS_EVERY_MS", "100")];
    let tty = on_a_terminal(d, "run --drain --max-in-flight 2 --time-scale 0.002", &slow)
        .expect("script");
    assert!(
        tty.contains("drain: ") && tty.contains("runs ended (") && tty.contains(" queued, "),
        "{tty}"
    );
    batch(d, "c.jsonl", 150);
    ok(d, &["enqueue", "--model", "policy", "--file", "c.jsonl"]);
    let out = command(d)
        .args([
            "run",
            "--drain",
            "--max-in-flight",
            "2",
            "--time-scale",
            "0.002",
        ])
        .env("WORKER_PROGRESS_EVERY_MS", "100")
        .output()
        .expect("runs");
    assert!(out.status.success());
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("drain: "),
        "quiet in a pipe"
    );
}
