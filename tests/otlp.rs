//! Live OTLP export (`worker run --otlp-endpoint`), checked by a receiver that decodes every
//! request with the official protobuf schema (`tests/otlp/receiver.py`, Python
//! `opentelemetry-proto`): ids unique across two databases, one root per task, parents in the
//! trace, GenAI attributes and span kinds, error statuses; every stored span arrives, across a
//! daemon SIGKILLed 10 times and across a receiver that is down for a while.

mod common;
use common::*;

use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A Python with `opentelemetry-proto` (the venv `.ci/test` makes).
fn python() -> Option<PathBuf> {
    let p = std::env::var_os("TETHER_MCP_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/mcp-venv/bin/python")
        });
    let ok = Command::new(&p)
        .args([
            "-c",
            "import opentelemetry.proto.collector.trace.v1.trace_service_pb2",
        ])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        missing(
            &format!("a Python with opentelemetry-proto at {}", p.display()),
            ".ci/test makes target/mcp-venv",
        );
        return None;
    }
    Some(p)
}

/// The receiver on `port`, appending spans to `out`.
fn receiver(py: &Path, port: u16, out: &Path) -> common::mcp::Listening {
    let mut cmd = Command::new(py);
    cmd.arg(format!(
        "{}/tests/otlp/receiver.py",
        env!("CARGO_MANIFEST_DIR")
    ))
    .env("PORT", port.to_string())
    .env("OUT", out);
    common::mcp::listen(cmd, port)
}

fn received(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).expect("a span line"))
        .collect()
}

/// The spans a task stored, by id (`worker trace --json`).
fn stored(d: &Path, task: &str) -> Vec<Value> {
    json(d, &["trace", task, "--json"])
        .as_array()
        .expect("spans")
        .clone()
}

/// Waits until `ready` holds (at most a minute).
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn attr<'a>(s: &'a Value, k: &str) -> &'a Value {
    &s["attributes"][k]
}

/// Every received span of a database's tasks: one trace per task, one root, parents in the
/// trace, and each stored span there (at least once, always with the same ids).
fn check_trees(d: &Path, spans: &[Value]) -> BTreeMap<String, String> {
    let db = json(d, &["migrate", "--json"])["db_id"].clone();
    let ours: Vec<&Value> = spans
        .iter()
        .filter(|s| s["resource"]["tether.db_id"] == db)
        .collect();
    let tasks = json(d, &["list", "--json", "--limit", "10000"]);
    let mut traces = BTreeMap::new();
    for t in tasks.as_array().expect("tasks") {
        let id = t["id"].as_str().expect("id");
        let mine: Vec<&&Value> = ours
            .iter()
            .filter(|s| attr(s, "tether.task_id") == id)
            .collect();
        let trace: BTreeSet<&str> = mine.iter().filter_map(|s| s["trace_id"].as_str()).collect();
        assert_eq!(trace.len(), 1, "{id}: one trace, not {trace:?}");
        let trace = trace.into_iter().next().expect("trace");
        assert_eq!(trace.len(), 32);
        let ids: BTreeSet<&str> = mine.iter().filter_map(|s| s["span_id"].as_str()).collect();
        let roots: BTreeSet<&str> = mine
            .iter()
            .filter(|s| s["parent"] == "")
            .filter_map(|s| s["span_id"].as_str())
            .collect();
        assert_eq!(roots.len(), 1, "{id}: one root, not {roots:?}");
        for s in &mine {
            assert_eq!(s["span_id"].as_str().map(str::len), Some(16));
            let p = s["parent"].as_str().expect("parent");
            assert!(
                p.is_empty() || ids.contains(p),
                "{id}: parent {p} not in the trace"
            );
        }
        // Nothing lost: every stored span arrived (a span sent twice keeps its ids, so the
        // distinct ids are as many as the stored spans).
        let want = stored(d, id).len();
        assert_eq!(
            ids.len(),
            want,
            "{id}: {} of {want} spans arrived",
            ids.len()
        );
        traces.insert(id.to_string(), trace.to_string());
    }
    traces
}

conformance! {
    fn spans_arrive_decoded_with_ids_unique_across_databases(d) {
        let Some(py) = python() else { return };
        let out = d.join("spans.jsonl");
        let port = pg::free_port();
        let _rx = receiver(&py, port, &out);
        let endpoint = format!("http://127.0.0.1:{port}");
        // A second database of the same kind, with a task t1 of its own.
        let other = match db_url(d) {
            Some(_) => TempDir::on("otlp-other", Backend::Postgres).expect("postgres"),
            None => TempDir::new("otlp-other"),
        };
        let e = other.path();
        for dir in [d, e] {
            // A model server that is not there: every call fails, with a message.
            std::fs::write(
                dir.join("dead.toml"),
                "[models.dead]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\nmax_retries = 0\n",
            )
            .expect("config");
            enqueue(dir, &["--model", "policy"]);
            // Suspends for approval, then resumes: one trace, one root.
            enqueue(dir, &["--model", "policy:ord_1004:8000"]);
            ok(
                dir,
                &["--config", "dead.toml", "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "dead"],
            );
        }
        for dir in [d, e] {
            ok(dir, &["run", "--drain", "--otlp-endpoint", &endpoint]);
            let digest = held_digest(dir, "t2");
            ok(dir, &["approve", "t2", "--digest", &digest, "--by", "alice"]);
            ok(dir, &["run", "--drain", "--otlp-endpoint", &endpoint]);
        }
        let spans = received(&out);
        let a = check_trees(d, &spans);
        let b = check_trees(e, &spans);
        assert_ne!(a["t1"], b["t1"], "t1 of two databases shares a trace id");
        // Kinds and attributes.
        let chat = spans.iter().find(|s| s["name"] == "chat policy").expect("a chat span");
        assert_eq!(chat["kind"], 3, "chat is CLIENT");
        assert_eq!(attr(chat, "gen_ai.operation.name"), "chat");
        assert_eq!(attr(chat, "gen_ai.provider.name"), "tether.scripted");
        assert!(attr(chat, "gen_ai.request.max_tokens").is_i64(), "{chat}");
        assert_eq!(attr(chat, "openinference.span.kind"), "LLM");
        let tool = spans
            .iter()
            .find(|s| s["name"] == "execute_tool issue_refund")
            .expect("a tool span");
        assert_eq!(tool["kind"], 1, "execute_tool is INTERNAL");
        assert!(attr(tool, "gen_ai.tool.call.id").as_str().is_some_and(|k| k.ends_with(":s2") || k.contains(':')));
        let root = spans
            .iter()
            .find(|s| s["name"] == "invoke_agent tether" && attr(s, "tether.stop_reason") == "done")
            .expect("a root");
        assert!(attr(root, "tether.budget.steps.used").is_i64(), "{root}");
        // The failing model: an error status that says why, with error.type.
        let failed = spans
            .iter()
            .find(|s| s["name"].as_str().is_some_and(|n| n.starts_with("chat ")) && s["status"]["code"] == 2)
            .expect("a failed chat span");
        assert!(!failed["status"]["message"].as_str().unwrap_or("").is_empty(), "{failed}");
        assert_eq!(attr(failed, "error.type"), "error");
        assert!(
            attr(failed, "gen_ai.provider.name").as_str().is_some_and(|p| p.starts_with("openai_compatible")),
            "{failed}"
        );
    }
}

#[test]
fn a_daemon_killed_ten_times_loses_no_span() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("otlp-kills");
    let d = dir.path();
    let out = d.join("spans.jsonl");
    let port = pg::free_port();
    let _rx = receiver(&py, port, &out);
    let endpoint = format!("http://127.0.0.1:{port}");
    for i in 0..24 {
        ok(
            d,
            &[
                "enqueue",
                "--user",
                "cu_ana",
                "--goal",
                GOAL,
                "--model",
                "policy",
                "--store-scope",
                &format!("k{i}"),
            ],
        );
    }
    let seed = 0x5eed_u64;
    let mut rng = Rng(seed);
    for _ in 0..10 {
        let mut child = command(d)
            .args(["run", "--workers", "4", "--time-scale", "0.004"])
            .args(["--otlp-endpoint", &endpoint])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start daemon");
        std::thread::sleep(Duration::from_millis(100 + rng.below(400)));
        child.kill().expect("SIGKILL the daemon");
        child.wait().expect("reap");
    }
    ok(d, &["run", "--drain", "--otlp-endpoint", &endpoint]);
    let spans = received(&out);
    let traces = check_trees(d, &spans);
    assert_eq!(traces.len(), 24);
}

#[test]
fn a_receiver_that_is_down_costs_no_task_and_gets_its_spans_later() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("otlp-down");
    let d = dir.path();
    let out = d.join("spans.jsonl");
    let port = pg::free_port();
    let metrics_port = pg::free_port();
    for _ in 0..6 {
        enqueue(d, &["--model", "policy"]);
    }
    // Nothing listens on the endpoint yet.
    let mut daemon = command(d)
        .args(["run", "--workers", "2", "--recover-every-ms", "200"])
        .args(["--otlp-endpoint", &format!("http://127.0.0.1:{port}")])
        .args(["--metrics", &format!("127.0.0.1:{metrics_port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start daemon");
    wait_for("the tasks to end while the receiver is down", || {
        json(d, &["list", "--json", "--limit", "100"])
            .as_array()
            .is_some_and(|t| t.iter().all(|t| t["status"] == "finished"))
    });
    let metrics = |name: &str| -> f64 {
        let (_, text) = raw_http(
            &format!("127.0.0.1:{metrics_port}"),
            b"GET /metrics HTTP/1.0\r\n\r\n",
            Duration::from_secs(5),
            false,
        );
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().last())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    wait_for("a failed export attempt", || {
        metrics("tether_otlp_export_failures_total") >= 1.0
    });
    assert_eq!(metrics("tether_otlp_spans_exported_total"), 0.0);
    // The receiver comes back: the backlog arrives, from the database.
    let _rx = receiver(&py, port, &out);
    wait_for("the backlog", || {
        let spans = received(&out);
        let tasks: BTreeSet<&str> = spans
            .iter()
            .filter_map(|s| attr(s, "tether.task_id").as_str())
            .collect();
        tasks.len() == 6
            && spans.len()
                >= (1..=6)
                    .map(|i| stored(d, &format!("t{i}")).len())
                    .sum::<usize>()
    });
    assert!(metrics("tether_otlp_spans_exported_total") > 0.0);
    signal(daemon.id(), "-TERM");
    let status = daemon.wait().expect("daemon");
    assert!(status.success());
    let mut log = String::new();
    use std::io::Read;
    daemon
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("log");
    assert!(
        log.contains("cannot send spans to the OTLP receiver"),
        "{log}"
    );
    assert!(log.contains("accepts spans again"), "{log}");
    check_trees(d, &received(&out));
}
