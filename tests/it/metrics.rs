//! `worker run --metrics`: `/metrics` in the Prometheus text format (checked by `promtool check
//! metrics`) with figures that match the database after a known workload, `/healthz`, and
//! `--log-format json` logs that name the task and call key. On both backends.

use crate::common;
use common::*;

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A daemon serving metrics on a free port, with JSON logs; its address, read from its log.
pub(crate) fn start(d: &std::path::Path) -> (Child, String, std::thread::JoinHandle<Vec<Value>>) {
    let mut child = command(d)
        .args([
            "--log-format",
            "json",
            "run",
            "--max-in-flight",
            "2",
            "--metrics",
            "127.0.0.1:0",
        ])
        .env("RUST_LOG", "debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the daemon");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.expect("a log line");
            let v: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line}"));
            if v["fields"]["message"] == "serving /metrics and /healthz" {
                let _ = tx.send(v["fields"]["addr"].as_str().expect("addr").to_string());
            }
            lines.push(v);
        }
        lines
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the daemon logs the metrics address");
    (child, addr, reader)
}

pub(crate) fn get(addr: &str, path: &str) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut r = agent
        .get(&format!("http://{addr}{path}"))
        .call()
        .expect("an answer");
    let status = r.status().as_u16();
    (status, r.body_mut().read_to_string().expect("a body"))
}

/// Samples of the text format: `name{labels}` -> value.
pub(crate) fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// The sum of every sample of a metric (over its labels).
pub(crate) fn total(s: &BTreeMap<String, f64>, name: &str) -> f64 {
    s.iter()
        .filter(|(k, _)| k.as_str() == name || k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

fn promtool_check(text: &str) {
    let promtool = std::env::var("TETHER_PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let mut child = match std::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            missing(
                &format!("promtool ({e})"),
                ".ci/test installs the prometheus package",
            );
            return;
        }
    };
    use std::io::Write;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

conformance! {
    fn metrics_match_the_database_after_a_workload(d) {
        let (mut child, addr, reader) = start(d);
        let (code, health) = get(&addr, "/healthz");
        assert_eq!(code, 200, "{health}");
        assert_eq!(serde_json::from_str::<Value>(&health).expect("JSON")["status"], "ok");
        // The workload: three runs that end done, one that repeats a call, one that waits for
        // an approval; each in a store scope of its own.
        for (i, model) in ["policy", "policy", "policy", "same_call", "policy:ord_1004:8000"].iter().enumerate() {
            ok(d, &["enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", model,
                    "--store-scope", &format!("s{i}")]);
        }
        let deadline = Instant::now() + Duration::from_secs(120);
        let text = loop {
            let (code, text) = get(&addr, "/metrics");
            assert_eq!(code, 200);
            let s = samples(&text);
            let idle = s.get("tether_tasks{status=\"queued\"}") == Some(&0.0)
                && s.get("tether_tasks{status=\"running\"}") == Some(&0.0)
                && total(&s, "tether_tasks") == 5.0;
            if idle && total(&s, "tether_tasks_ended_total") == 5.0 {
                break text;
            }
            assert!(Instant::now() < deadline, "the workload did not end:\n{text}");
            std::thread::sleep(Duration::from_millis(100));
        };
        promtool_check(&text);
        let s = samples(&text);
        let tasks = json(d, &["list", "--json", "--limit", "10000"]);
        let tasks = tasks.as_array().expect("list");
        let count = |status: &str| tasks.iter().filter(|t| t["status"] == status).count() as f64;
        for status in ["queued", "running", "suspended", "held", "finished"] {
            assert_eq!(
                s.get(&format!("tether_tasks{{status=\"{status}\"}}")),
                Some(&count(status)),
                "{status}"
            );
        }
        assert_eq!(count("suspended"), 1.0);
        let sum = |field: &str| tasks.iter().map(|t| t[field].as_f64().expect(field)).sum::<f64>();
        assert_eq!(total(&s, "tether_steps_total"), sum("steps"));
        assert_eq!(total(&s, "tether_model_calls_total"), sum("steps"));
        assert_eq!(total(&s, "tether_tool_calls_total"), sum("tool_calls"));
        assert_eq!(s.get("tether_suspended_calls"), Some(&1.0));
        assert_eq!(s.get("tether_held_writes"), Some(&0.0));
        assert_eq!(s.get("tether_oldest_queued_task_age_seconds"), Some(&0.0));
        assert_eq!(s.get("tether_tasks_ended_total{stop=\"done\"}"), Some(&3.0));
        assert_eq!(s.get("tether_tasks_ended_total{stop=\"needs_approval\"}"), Some(&1.0));
        assert_eq!(
            s.get("tether_tool_calls_total{outcome=\"needs_approval\",tool=\"issue_refund\"}"),
            Some(&1.0)
        );
        assert!(total(&s, "tether_commits_total") >= sum("steps"));
        assert!(s.get("tether_commit_seconds_count").is_some_and(|n| *n >= 1.0));
        assert_eq!(s.get("tether_database_up"), Some(&1.0));
        let (code, _) = get(&addr, "/nothing");
        assert_eq!(code, 404);
        // The held refund is logged with its task and call key.
        signal(child.id(), "-TERM");
        let status = child.wait().expect("the daemon exits");
        assert!(status.success());
        let logs = reader.join().expect("the log reader");
        let approval = logs
            .iter()
            .find(|l| l["fields"]["message"] == "tool call needs approval")
            .expect("a log line for the refund that needs approval");
        assert_eq!(approval["fields"]["tool"], "issue_refund");
        assert!(approval["fields"]["key"].as_str().is_some_and(|k| k.ends_with(":t5:s2")), "{approval}");
        assert_eq!(approval["span"]["task"], "t5", "{approval}");
        assert!(logs.iter().any(|l| l["fields"]["message"] == "task ended" && l["level"] == "INFO"));
    }
}
