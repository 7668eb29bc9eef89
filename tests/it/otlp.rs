//! Live OTLP export (`worker run --otlp-endpoint`), checked by a receiver that decodes every
//! request with the official protobuf schema (`tests/otlp/receiver.py`, Python
//! `opentelemetry-proto`): ids unique across two databases, one root per task, parents in the
//! trace, GenAI attributes and span kinds, error statuses; every stored span arrives, across a
//! daemon SIGKILLed 10 times and across a receiver that is down for a while.

use crate::common;
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
    slow_receiver(py, port, out, 0)
}

/// The receiver on `port`, answering each request `delay_ms` after it wrote its spans down.
fn slow_receiver(py: &Path, port: u16, out: &Path, delay_ms: u64) -> common::mcp::Listening {
    let mut cmd = Command::new(py);
    cmd.arg(format!(
        "{}/tests/otlp/receiver.py",
        env!("CARGO_MANIFEST_DIR")
    ))
    .env("PORT", port.to_string())
    .env("DELAY_MS", delay_ms.to_string())
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

/// A test directory with `n` queued tasks of the policy model.
fn with_tasks(name: &str, n: usize) -> TempDir {
    let dir = TempDir::new(name);
    for _ in 0..n {
        enqueue(dir.path(), &["--model", "policy"]);
    }
    dir
}

/// [`with_tasks`] on PostgreSQL (`None`, said, when it is missing).
fn pg_with_tasks(name: &str, n: usize) -> Option<TempDir> {
    let Some(dir) = TempDir::on(name, Backend::Postgres) else {
        missing("PostgreSQL", ".ci/test installs it");
        return None;
    };
    for _ in 0..n {
        enqueue(dir.path(), &["--model", "policy"]);
    }
    Some(dir)
}

/// Waits until every task of `d` finished.
fn wait_all_finished(d: &Path, what: &str) {
    wait_for(what, || {
        json(d, &["list", "--json", "--limit", "100"])
            .as_array()
            .is_some_and(|t| t.iter().all(|t| t["status"] == "finished"))
    });
}

/// The value of metric `name` on the daemon's `/metrics` at `port` (0 when absent).
fn metric(port: u16, name: &str) -> f64 {
    let (_, text) = raw_http(
        &format!("127.0.0.1:{port}"),
        b"GET /metrics HTTP/1.0\r\n\r\n",
        Duration::from_secs(5),
        false,
    );
    text.lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Stops `daemon` with SIGTERM, checks it exited 0, and returns what it logged.
fn stop(mut daemon: std::process::Child) -> String {
    signal(daemon.id(), "-TERM");
    let status = daemon.wait().expect("daemon");
    assert!(status.success(), "{status}");
    let mut log = String::new();
    use std::io::Read;
    daemon.stderr.take().map(|mut e| e.read_to_string(&mut log));
    log
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
        let root = usize::from(t["status"] == "finished");
        assert_eq!(
            roots.len(),
            root,
            "{id}: one root once the task finished, not {roots:?}"
        );
        // Every parent is in the trace; only a run's `task` span may wait for its parent, the
        // root, while the task has not finished.
        for s in &mine {
            assert_eq!(s["span_id"].as_str().map(str::len), Some(16));
            let p = s["parent"].as_str().expect("parent");
            let waits = root == 0 && attr(s, "tether.span.kind") == "task";
            assert!(
                p.is_empty() || ids.contains(p) || waits,
                "{id}: parent {p} not in the trace"
            );
        }
        // Nothing lost: every stored span arrived, and the root of a finished task (a span sent
        // twice keeps its ids, so the distinct ids are as many as the spans).
        let want = stored(d, id).len() + root;
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

/// A Chat Completions server that always answers with a final reply, naming the model that
/// answered (a dated version of the requested one) and why it stopped. Returns its base URL.
fn mock_model() -> String {
    let server = tiny_http::Server::http("127.0.0.1:0").expect("bind mock");
    let url = format!("http://{}/v1", server.server_addr());
    std::thread::spawn(move || {
        for req in server.incoming_requests() {
            let body = serde_json::json!({
                "id": "cmpl-7", "object": "chat.completion", "model": "mock-1-2026-11-01",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
                    "content": "{\"type\": \"final\", \"outcome\": \"completed\", \"text\": \"done\"}"}}],
                "usage": {"prompt_tokens": 50, "completion_tokens": 9}
            });
            let _ = req.respond(tiny_http::Response::from_string(body.to_string()));
        }
    });
    url
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
        let mock = mock_model();
        for dir in [d, e] {
            // A model server that is not there: every call fails, with a message; and one
            // that answers, naming the model version and why it stopped.
            std::fs::write(
                dir.join("dead.toml"),
                format!(
                    "[models.dead]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\nmax_retries = 0\n\
                     [models.mock]\nkind = \"openai\"\nbase_url = \"{mock}\"\nmodel = \"mock-1\"\n"
                ),
            )
            .expect("config");
            enqueue(dir, &["--model", "policy"]);
            // Suspends for approval, then resumes: one trace, one root.
            enqueue(dir, &["--model", "policy:ord_1004:8000"]);
            ok(
                dir,
                &["--config", "dead.toml", "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "dead"],
            );
            // Suspends, then an operator cancels it: the root is queued by the decision.
            enqueue(dir, &["--model", "policy:ord_1004:8000"]);
            ok(
                dir,
                &["--config", "dead.toml", "enqueue", "--user", "cu_ana", "--goal", GOAL, "--model", "mock"],
            );
        }
        for dir in [d, e] {
            // The daemon resolves the profiles in its own config, the one they were named in.
            let run = ["--config", "dead.toml", "run", "--drain", "--otlp-endpoint", &endpoint];
            ok(dir, &run);
            // Suspended tasks: their runs arrived, their roots did not (not ended yet).
            check_trees(dir, &received(&out));
            let digest = held_digest(dir, "t2");
            ok(dir, &["approve", "t2", "--digest", &digest, "--by", "alice"]);
            ok(dir, &["cancel", "t4", "--by", "alice"]);
            ok(dir, &run);
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
        // Roots: the resumed task's has its final status and both runs as children.
        let root_of = |task: &str| -> &Value {
            let db = json(d, &["migrate", "--json"])["db_id"].clone();
            spans
                .iter()
                .find(|s| s["name"] == "invoke_agent tether" && attr(s, "tether.task_id") == task && s["resource"]["tether.db_id"] == db)
                .unwrap_or_else(|| panic!("no root of {task}"))
        };
        let root = root_of("t2");
        assert_eq!(root["parent"], "");
        assert_eq!(attr(root, "tether.stop_reason"), "done");
        assert_eq!(root["status"]["code"], 1, "{root}");
        assert_eq!(attr(root, "tether.runs"), 2);
        assert_eq!(attr(root, "gen_ai.operation.name"), "invoke_agent");
        assert!(attr(root, "tether.budget.steps.used").as_i64() > Some(0), "{root}");
        let runs: Vec<&Value> = spans
            .iter()
            .filter(|s| s["parent"] == root["span_id"] && attr(s, "tether.span.kind") == "task")
            .collect();
        assert_eq!(runs.len(), 2, "two runs under the root");
        let cancelled = root_of("t4");
        assert_eq!(attr(cancelled, "tether.stop_reason"), "cancelled");
        assert_eq!(cancelled["status"]["code"], 2, "{cancelled}");
        assert_eq!(attr(cancelled, "error.type"), "cancelled");
        // A provider's answer: the response's model, id and finish reasons.
        let answered = spans.iter().find(|s| s["name"] == "chat mock-1").expect("a mock chat span");
        assert_eq!(attr(answered, "gen_ai.response.model"), "mock-1-2026-11-01");
        assert_eq!(attr(answered, "gen_ai.response.finish_reasons"), &serde_json::json!(["stop"]));
        assert_eq!(attr(answered, "gen_ai.response.id"), "cmpl-7");
        assert_eq!(attr(answered, "gen_ai.request.model"), "mock-1");
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
        enqueue(d, &["--model", "policy", "--store-scope", &format!("k{i}")]);
    }
    let mut rng = Rng(seed("otlp kills"));
    for _ in 0..10 {
        kill_after(
            command(d)
                .args(["run", "--max-in-flight", "4", "--time-scale", "0.004"])
                .args(["--otlp-endpoint", &endpoint]),
            100 + rng.below(400),
        );
    }
    ok(d, &["run", "--drain", "--otlp-endpoint", &endpoint]);
    let spans = received(&out);
    let traces = check_trees(d, &spans);
    assert_eq!(traces.len(), 24);
}

#[test]
fn a_receiver_that_is_down_costs_no_task_and_gets_its_spans_later() {
    let Some(py) = python() else { return };
    let dir = with_tasks("otlp-down", 6);
    let d = dir.path();
    let out = d.join("spans.jsonl");
    let (port, metrics_port) = (pg::free_port(), pg::free_port());
    // Nothing listens on the endpoint yet.
    let daemon = command(d)
        .args(["run", "--max-in-flight", "2", "--recover-every-ms", "200"])
        .args(["--otlp-endpoint", &format!("http://127.0.0.1:{port}")])
        .args(["--metrics", &format!("127.0.0.1:{metrics_port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start daemon");
    wait_all_finished(d, "the tasks to end while the receiver is down");
    let metrics = |name: &str| metric(metrics_port, name);
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
    let log = stop(daemon);
    assert!(
        log.contains("cannot send spans to the OTLP receiver"),
        "{log}"
    );
    assert!(log.contains("accepts spans again"), "{log}");
    check_trees(d, &received(&out));
}

/// A receiver down while the backlog passes `--otlp-backlog`: the oldest spans are dropped and
/// logged, the rest arrive when it is back, and the two add up to every span of every task.
#[test]
fn a_full_backlog_drops_its_oldest_spans_and_says_how_many() {
    let Some(py) = python() else { return };
    let dir = with_tasks("otlp-backlog", 6);
    let d = dir.path();
    let out = d.join("spans.jsonl");
    let (port, metrics_port) = (pg::free_port(), pg::free_port());
    let endpoint = format!("http://127.0.0.1:{port}");
    let daemon = command(d)
        .args(["run", "--max-in-flight", "2", "--log-format", "json"])
        .args(["--otlp-endpoint", &endpoint, "--otlp-backlog", "3"])
        .args(["--metrics", &format!("127.0.0.1:{metrics_port}")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start daemon");
    wait_all_finished(d, "the tasks to end while the receiver is down");
    wait_for("a trim of the backlog", || {
        metric(metrics_port, "tether_otlp_spans_dropped_total") > 0.0
    });
    let log = stop(daemon);
    let dropped: u64 = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| {
            v["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("span backlog is full"))
        })
        .map(|v| v["fields"]["spans"].as_u64().expect("spans dropped"))
        .sum();
    assert!(dropped > 0, "{log}");
    // The receiver is back: what is left arrives, at most the last 3 commits' spans.
    let _rx = receiver(&py, port, &out);
    ok(d, &["run", "--drain", "--otlp-endpoint", &endpoint]);
    let spans = received(&out);
    let ids: BTreeSet<&str> = spans.iter().filter_map(|s| s["span_id"].as_str()).collect();
    let stored_total: usize = (1..=6).map(|i| stored(d, &format!("t{i}")).len() + 1).sum();
    assert!(!ids.is_empty());
    assert_eq!(
        ids.len() as u64 + dropped,
        stored_total as u64,
        "every span is either received or counted as dropped"
    );
}

/// Two daemons on one PostgreSQL database, both exporting, to a slow receiver (each request
/// takes a second and a half, so the other exporter reads the outbox while a batch is in
/// flight): every span arrives exactly once, because each exporter claims what it sends.
#[test]
fn two_exporting_daemons_on_one_database_send_each_span_once() {
    let Some(py) = python() else { return };
    let Some(dir) = pg_with_tasks("otlp-two", 12) else {
        return;
    };
    let d = dir.path();
    let out = d.join("spans.jsonl");
    let port = pg::free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let daemons: Vec<_> = (0..2)
        .map(|_| {
            command(d)
                .args(["run", "--max-in-flight", "2", "--otlp-endpoint", &endpoint])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start daemon")
        })
        .collect();
    wait_all_finished(d, "the tasks to end while the receiver is down");
    let want: usize = (1..=12)
        .map(|i| stored(d, &format!("t{i}")).len() + 1)
        .sum();
    let _rx = slow_receiver(&py, port, &out, 1500);
    wait_for("every span", || {
        let spans = received(&out);
        spans
            .iter()
            .filter_map(|s| s["span_id"].as_str())
            .collect::<BTreeSet<_>>()
            .len()
            == want
    });
    // Both exporters keep polling a while: nothing arrives twice.
    std::thread::sleep(Duration::from_secs(2));
    for daemon in daemons {
        stop(daemon);
    }
    let spans = received(&out);
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &spans {
        *seen.entry(s["span_id"].as_str().expect("id")).or_default() += 1;
    }
    let twice: Vec<_> = seen.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{} spans sent more than once, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(3)]
    );
    assert_eq!(spans.len(), want);
    check_trees(d, &spans);
}

/// A daemon that stops while its receiver is down gives up the outbox entries it claimed: the
/// next daemon sends them at once, not when the claims run out a minute later.
#[test]
fn a_stopping_exporter_leaves_its_claims_to_the_next() {
    let Some(py) = python() else { return };
    let Some(dir) = pg_with_tasks("otlp-release", 3) else {
        return;
    };
    let d = dir.path();
    let out = d.join("spans.jsonl");
    let port = pg::free_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    // Nothing listens: the drain claims the spans, fails to send them, and stops.
    ok(d, &["run", "--drain", "--otlp-endpoint", &endpoint]);
    assert!(received(&out).is_empty());
    let _rx = receiver(&py, port, &out);
    ok(d, &["run", "--drain", "--otlp-endpoint", &endpoint]);
    let traces = check_trees(d, &received(&out));
    assert_eq!(traces.len(), 3);
}
