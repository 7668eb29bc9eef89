//! Tasks that call MCP tools, end to end through the `worker` binary with the scripted model:
//! against `@modelcontextprotocol/server-everything` over stdio and streamable HTTP (discovery,
//! a task through its tools, schema errors caught before a call, no leaked environment), and
//! against the Python SDK test server, whose arrivals log shows what was sent: a destructive
//! call waits for approval and is sent once after it, a lost answer holds a non-idempotent
//! write for `worker reconcile` and is re-sent for an idempotent one, an untrusted server's
//! tool is never re-sent, a changed definition is refused, and a daemon killed again and again
//! with MCP writes in flight never sends a non-idempotent call twice.

use crate::common;
use common::mcp::*;
use common::*;

use serde_json::{Value, json};
use std::path::Path;

/// A variable of the worker's own environment that no MCP server may see.
const CANARY: &str = "sk-canary-7f3a9d";

/// Writes a reply script; returns the `--model` value for it.
fn script(d: &Path, name: &str, lines: &[Value]) -> String {
    let text: Vec<String> = lines.iter().map(Value::to_string).collect();
    std::fs::write(d.join(name), text.join("\n") + "\n").expect("script");
    format!("script:{name}")
}

/// `worker --config CFG ARGS` with the canary in the worker's environment.
fn with_canary(d: &Path, cfg: &str, args: &[&str]) -> String {
    let out = command(d)
        .env("TETHER_TEST_API_KEY", CANARY)
        .arg("--config")
        .arg(cfg)
        .args(args)
        .output()
        .expect("run worker");
    succeeded(out, args)
}

fn enqueue_script(d: &Path, cfg: &str, model: &str, key: &str) -> String {
    with_canary(
        d,
        cfg,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "use the tools",
            "--key",
            key,
            "--model",
            model,
            "--budget",
            "deadline_ms=20000",
        ],
    )
    .trim()
    .to_string()
}

fn show(d: &Path, task: &str) -> Value {
    json(d, &["show", task, "--json"])
}

fn tool_list<'a>(tools: &'a Value, name: &str) -> &'a Value {
    tools
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no tool {name} in {tools:#}"))
}

/// A config of `data/` (the README's) with `from` replaced by `to`, written into `d`.
fn data_config(d: &Path, name: &str, from: &str, to: &str) -> String {
    let text = std::fs::read_to_string(format!("{}/data/{name}", env!("CARGO_MANIFEST_DIR")))
        .expect("a config of data/");
    assert!(text.contains(from), "{name} has {from:?}");
    std::fs::write(d.join(name), text.replace(from, to)).expect("config");
    name.to_string()
}

#[test]
fn a_task_runs_through_server_everything_over_both_transports() {
    let Some((node, index)) = everything() else {
        return;
    };
    let port = pg::free_port();
    let mut cmd = std::process::Command::new(&node);
    cmd.arg(&index)
        .arg("streamableHttp")
        .env_clear()
        .env("PORT", port.to_string());
    let _server = listen(cmd, port); // listening until the test ends
    let dir = TempDir::new("mcp-everything");
    let d = dir.path();
    // The README's two configs, with the server installed here and the port it listens on.
    let stdio = data_config(
        d,
        "mcp-stdio.toml",
        r#"command = "npx"
args = ["-y", "@modelcontextprotocol/server-everything@2026.8.31", "stdio"]"#,
        &format!(
            "command = {:?}\nargs = [{:?}, \"stdio\"]",
            node.display().to_string(),
            index.display().to_string()
        ),
    );
    let remote = data_config(
        d,
        "mcp-http.toml",
        "127.0.0.1:3001",
        &format!("127.0.0.1:{port}"),
    );
    for (n, (cfg, server)) in [(&stdio, "everything"), (&remote, "remote")]
        .into_iter()
        .enumerate()
    {
        // Discovery: the annotations of a trusted server make its read-only tools reads.
        let tools: Value =
            serde_json::from_str(&with_canary(d, cfg, &["tools", "list", "--json"])).expect("json");
        for name in ["echo", "get-sum", "get-env", "get-structured-content"] {
            let t = tool_list(&tools, name);
            assert_eq!(t["access"], "read", "{cfg}: {t}");
            assert_eq!(t["idempotent"], true, "{cfg}: {t}");
            assert_eq!(t["needs_approval"], false, "{cfg}: {t}");
        }
        let table = with_canary(d, cfg, &["tools", "list"]);
        assert!(
            table
                .lines()
                .any(|l| l.contains("get-sum") && l.contains("read")),
            "{table}"
        );
        let model = script(
            d,
            &format!("everything{n}.jsonl"),
            &[
                json!({"type": "plan", "steps": [
                    {"id": "s1", "tool": "get-sum"},
                    {"id": "s2", "tool": "get-structured-content"},
                    {"id": "s3", "tool": "echo"},
                    {"id": "s4", "tool": "get-env"},
                ]}),
                // Refused by the input schema before anything is sent: b is not a number.
                json!({"type": "tool", "name": "get-sum", "args": {"a": 2, "b": "three"}, "plan_step": "s1"}),
                json!({"type": "tool", "name": "get-sum", "args": {"a": 2, "b": 3}, "plan_step": "s1"}),
                // Refused too: a value the schema's enum does not allow.
                json!({"type": "tool", "name": "get-structured-content", "args": {"location": "Paris"}, "plan_step": "s2"}),
                json!({"type": "tool", "name": "get-structured-content", "args": {"location": "Chicago"}, "plan_step": "s2"}),
                json!({"type": "tool", "name": "echo", "args": {"message": "hello"}, "plan_step": "s3"}),
                json!({"type": "tool", "name": "get-env", "args": {}, "plan_step": "s4"}),
                json!({"type": "final", "outcome": "completed", "text": "done"}),
            ],
        );
        let id = enqueue_script(d, cfg, &model, &format!("everything-{n}"));
        with_canary(d, cfg, &["run", "--drain", "--max-in-flight", "1"]);
        let s = show(d, &id);
        assert_eq!(s["stop"], "done", "{cfg}: {s:#}");
        // Six tool replies, two refused before sending: four calls went out.
        assert_eq!(s["state"]["tool_calls"], 4, "{cfg}: {s:#}");
        // structuredContent is the result; its allowed fields became facts.
        assert_eq!(
            s["state"]["facts"]["get-structured-content.temperature"], 36,
            "{s:#}"
        );
        assert_eq!(
            s["state"]["facts"]["get-structured-content.conditions"],
            "Light rain / drizzle"
        );
        // The environment-printing tool: the child saw the variable its config names, and
        // nothing of the worker's own environment.
        let env = s["state"]["last_result"]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("get-env's text: {s:#}"));
        if cfg == &stdio {
            assert!(
                env.contains("NODE_ENV"),
                "the variable the config sets: {env}"
            );
        }
        assert!(!env.contains(CANARY), "the worker's secret leaked: {env}");
        assert!(!env.contains("TETHER_TEST_API_KEY"), "{env}");
        assert!(
            !env.contains("CARGO_"),
            "the worker's environment leaked: {env}"
        );
        // The trace: four tool spans (the refused calls opened none).
        let trace = json(d, &["trace", &id, "--json"]);
        let spans = trace["spans"]
            .as_array()
            .or(trace.as_array())
            .expect("spans");
        let tools_spans = spans.iter().filter(|s| s["kind"] == "tool").count();
        assert_eq!(tools_spans, 4, "{trace:#}");
        // As OTLP: GenAI execute_tool spans that name the MCP method and server.
        let otlp = d.join(format!("t{n}.otlp.json"));
        ok(d, &["trace", &id, "--otlp", otlp.to_str().expect("path")]);
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(&otlp).expect("otlp")).expect("json");
        let spans = doc["resourceSpans"][0]["scopeSpans"][0]["spans"]
            .as_array()
            .expect("spans");
        let attr = |s: &Value, k: &str| {
            s["attributes"]
                .as_array()
                .and_then(|a| a.iter().find(|a| a["key"] == k))
                .map(|a| a["value"]["stringValue"].clone())
        };
        let sum = spans
            .iter()
            .find(|s| s["name"] == "execute_tool get-sum")
            .unwrap_or_else(|| panic!("{doc:#}"));
        assert_eq!(
            attr(sum, "gen_ai.operation.name"),
            Some(json!("execute_tool"))
        );
        assert_eq!(attr(sum, "mcp.method.name"), Some(json!("tools/call")));
        assert_eq!(attr(sum, "tether.mcp.server"), Some(json!(server)));
    }
}

/// A config naming the Python test server as `shop` (over HTTP at `url`, or as a child with
/// `env`), trusted or not, with `extra` TOML after it.
fn shop_config(d: &Path, name: &str, server: &str, trusted: bool, extra: &str) -> String {
    let text = format!("[mcp.servers.shop]\n{server}\ntrusted = {trusted}\n{extra}");
    std::fs::write(d.join(name), text).expect("config");
    name.to_string()
}

fn child_server(py: &Path, env: &[(&str, String)]) -> String {
    let env: Vec<String> = env.iter().map(|(k, v)| format!("{k} = {v:?}")).collect();
    format!(
        "command = {:?}\nargs = [{:?}]\nenv = {{ {} }}",
        py.display().to_string(),
        server_py(),
        env.join(", ")
    )
}

/// A plan of a read (the write's prerequisite) and one write, the two calls, and a final
/// answer.
fn one_write(tool: &str, args: Value) -> Vec<Value> {
    vec![
        json!({"type": "plan", "steps": [{"id": "s1", "tool": "lookup_order"}, {"id": "s2", "tool": tool, "depends_on": ["s1"]}]}),
        json!({"type": "tool", "name": "lookup_order", "args": {"order_id": args["order_id"]}, "plan_step": "s1"}),
        json!({"type": "tool", "name": tool, "args": args, "plan_step": "s2"}),
        json!({"type": "final", "outcome": "completed", "text": "done"}),
    ]
}

/// The arrivals of `tool` for order `order`.
fn sent(log: &Path, tool: &str, order: &str) -> usize {
    arrivals_of(log, tool)
        .iter()
        .filter(|a| a["args"]["order_id"] == order)
        .count()
}

#[test]
fn approval_lost_answers_and_changed_definitions() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("mcp-tasks");
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let logs = log.display().to_string();
    // One server: add_note drops its answer (applied, never answered), set_status crashes the
    // server on its first call only (applied; the session dies).
    let http = python_http(
        &py,
        &[
            ("ARRIVALS", &logs),
            ("MODE", "drop"),
            ("MODE_TOOLS", "add_note"),
        ],
    );
    let cfg = shop_config(
        d,
        "shop.toml",
        &format!("url = {:?}", http.url()),
        true,
        "[mcp.servers.shop.tools.issue_refund]\nuser_arg = \"customer_id\"\nfacts = [\"refunded_cents\"]\n",
    );

    // A destructive tool waits for approval: nothing is sent before it.
    let refund = script(
        d,
        "refund.jsonl",
        &one_write(
            "issue_refund",
            json!({"order_id": "o1", "amount_cents": 700}),
        ),
    );
    let t1 = enqueue_script(d, &cfg, &refund, "refund");
    // The model may not choose whose refund it is: the user id comes from the task.
    let forged = script(
        d,
        "forged.jsonl",
        &one_write(
            "issue_refund",
            json!({"order_id": "o1", "amount_cents": 700, "customer_id": "cu_mallory"}),
        ),
    );
    let t2 = enqueue_script(d, &cfg, &forged, "forged");
    // A schema error is caught before anything is sent.
    let bad = script(
        d,
        "bad.jsonl",
        &one_write(
            "issue_refund",
            json!({"order_id": "o1", "amount_cents": "lots"}),
        ),
    );
    let t3 = enqueue_script(d, &cfg, &bad, "bad");
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "2"]);
    assert_eq!(show(d, &t1)["stop"], "needs_approval");
    for t in [&t2, &t3] {
        let s = show(d, t);
        assert_eq!(s["state"]["plan"][1]["status"], "pending", "{s:#}");
        assert_eq!(s["state"]["tool_calls"], 1, "only the read went out: {s:#}");
    }
    assert!(
        arrivals_of(&log, "issue_refund").is_empty(),
        "{:?}",
        arrived(&log)
    );
    let digest = held_digest(d, &t1);
    ok(
        d,
        &[
            "approve", &t1, "--digest", &digest, "--by", "alice", "--reason", "checked",
        ],
    );
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "2"]);
    let s = show(d, &t1);
    assert_eq!(s["stop"], "done", "{s:#}");
    let refunds = arrivals_of(&log, "issue_refund");
    assert_eq!(
        refunds.len(),
        1,
        "sent once, after the approval: {refunds:?}"
    );
    assert_eq!(refunds[0]["args"]["customer_id"], "cu_ana", "{refunds:?}");

    // A dropped answer holds a non-idempotent write; reconcile lists it and settles it.
    let note = script(
        d,
        "note.jsonl",
        &one_write("add_note", json!({"order_id": "o1", "text": "hello"})),
    );
    let t4 = with_canary(
        d,
        &cfg,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "note it",
            "--model",
            &note,
            "--budget",
            "deadline_ms=8000",
        ],
    )
    .trim()
    .to_string();
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(show(d, &t4)["stop"], "unknown_outcome");
    let held = json(d, &["reconcile", "--json"]);
    let row = held
        .as_array()
        .expect("held writes")
        .iter()
        .find(|h| h["task"] == t4.as_str())
        .unwrap_or_else(|| panic!("{t4} not listed: {held:#}"))
        .clone();
    assert_eq!(row["tool"], "add_note");
    // Run again: a held write is not sent again by itself.
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(arrivals_of(&log, "add_note").len(), 1);
    ok(
        d,
        &[
            "reconcile",
            &t4,
            "--applied",
            "--key",
            row["key"].as_str().expect("key"),
            "--result",
            r#"{"status": "ok", "notes": 1}"#,
            // The lost answer used up the task's active time.
            "--extend",
            "deadline_ms=10000",
            "--by",
            "bob",
        ],
    );
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(show(d, &t4)["stop"], "done");
    assert_eq!(arrivals_of(&log, "add_note").len(), 1, "never re-sent");
    drop(http);

    // A child server that crashes on its first call: an idempotent write is re-sent on a new
    // session and the task goes on; an untrusted server's tool is held, never re-sent.
    let once = d.join("once");
    let crashing = |once: &Path| {
        child_server(
            &py,
            &[
                ("ARRIVALS", logs.clone()),
                ("MODE", "crash".into()),
                ("MODE_TOOLS", "set_status".into()),
                ("ONCE_FILE", once.display().to_string()),
            ],
        )
    };
    let trusted = shop_config(d, "crash.toml", &crashing(&once), true, "");
    let status = script(
        d,
        "status.jsonl",
        &one_write("set_status", json!({"order_id": "o2", "status": "shipped"})),
    );
    let t5 = enqueue_script(d, &trusted, &status, "status");
    with_canary(d, &trusted, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(show(d, &t5)["stop"], "done", "{:#}", show(d, &t5));
    assert_eq!(
        sent(&log, "set_status", "o2"),
        2,
        "lost once, re-sent once (idempotent)"
    );
    // The same tool from a server that is not trusted: its idempotentHint is not believed.
    // (The operator vouches for its lookup as a read, so a plan can check before it writes.)
    let once = d.join("once-untrusted");
    let untrusted = shop_config(
        d,
        "untrusted.toml",
        &crashing(&once),
        false,
        "[mcp.servers.shop.tools.lookup_order]\naccess = \"read\"\n",
    );
    let status3 = script(
        d,
        "status3.jsonl",
        &one_write("set_status", json!({"order_id": "o3", "status": "shipped"})),
    );
    let t6 = enqueue_script(d, &untrusted, &status3, "untrusted");
    with_canary(d, &untrusted, &["run", "--drain", "--max-in-flight", "1"]);
    // Untrusted: every write needs approval.
    assert_eq!(show(d, &t6)["stop"], "needs_approval");
    assert_eq!(sent(&log, "set_status", "o3"), 0);
    let digest = held_digest(d, &t6);
    ok(d, &["approve", &t6, "--digest", &digest, "--by", "alice"]);
    with_canary(d, &untrusted, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(show(d, &t6)["stop"], "unknown_outcome");
    with_canary(d, &untrusted, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(
        sent(&log, "set_status", "o3"),
        1,
        "an untrusted server's tool is never re-sent after a lost answer"
    );
    ok(d, &["reconcile", &t6, "--not-applied", "--by", "bob"]);
    with_canary(d, &untrusted, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(show(d, &t6)["stop"], "done", "{:#}", show(d, &t6));
    assert_eq!(
        sent(&log, "set_status", "o3"),
        2,
        "sent again on the operator's word"
    );

    // A definition that changed after enqueue is refused, not called with another meaning.
    let v1 = shop_config(
        d,
        "v1.toml",
        &child_server(&py, &[("ARRIVALS", logs.clone())]),
        true,
        "",
    );
    let v2 = shop_config(
        d,
        "v2.toml",
        &child_server(&py, &[("ARRIVALS", logs.clone()), ("VARIANT", "2".into())]),
        true,
        "",
    );
    let note2 = script(
        d,
        "note2.jsonl",
        &one_write("add_note", json!({"order_id": "o4", "text": "later"})),
    );
    let t7 = enqueue_script(d, &v1, &note2, "changed");
    with_canary(d, &v2, &["run", "--drain", "--max-in-flight", "1"]);
    let s = show(d, &t7);
    assert_eq!(sent(&log, "add_note", "o4"), 0, "nothing sent");
    assert_eq!(s["state"]["plan"][1]["status"], "pending", "{s:#}");
    let events = ok(d, &["trace", &t7]);
    assert!(events.contains("tool_changed"), "{events}");
}

#[test]
fn a_daemon_killed_with_mcp_writes_in_flight_never_sends_a_write_twice() {
    let Some(py) = python() else { return };
    let seed = seed("MCP crash");
    let mut rng = Rng(seed);
    let dir = TempDir::new("mcp-crash");
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let logs = log.display().to_string();
    // The server outlives the daemons (streamable HTTP); its writes take a while, so kills
    // land while calls are in flight.
    let http = python_http(
        &py,
        &[("ARRIVALS", &logs), ("MODE", "slow"), ("SLOW_S", "0.25")],
    );
    let cfg = shop_config(d, "shop.toml", &format!("url = {:?}", http.url()), true, "");
    const TASKS: usize = 12;
    let mut lines = Vec::new();
    for i in 0..TASKS {
        let model = script(
            d,
            &format!("t{i}.jsonl"),
            &[
                json!({"type": "plan", "steps": [{"id": "s1", "tool": "lookup_order"}, {"id": "s2", "tool": "add_note", "depends_on": ["s1"]}, {"id": "s3", "tool": "set_status", "depends_on": ["s2"]}]}),
                json!({"type": "tool", "name": "lookup_order", "args": {"order_id": format!("o{i}")}, "plan_step": "s1"}),
                json!({"type": "tool", "name": "add_note", "args": {"order_id": format!("o{i}"), "text": format!("note {i}")}, "plan_step": "s2"}),
                json!({"type": "tool", "name": "set_status", "args": {"order_id": format!("o{i}"), "status": "shipped"}, "plan_step": "s3"}),
                json!({"type": "final", "outcome": "completed", "text": "done"}),
            ],
        );
        lines.push(
            json!({"user": "cu_ana", "goal": "note and ship", "key": format!("k{i}"), "model": model})
                .to_string(),
        );
    }
    std::fs::write(d.join("batch.jsonl"), lines.join("\n")).expect("batch");
    with_canary(
        d,
        &cfg,
        &["enqueue", "--model", "policy", "--file", "batch.jsonl"],
    );
    const KILLS: usize = 12;
    for _ in 0..KILLS {
        kill_after(
            command(d)
                .args(["--config", &cfg, "run", "--max-in-flight", "4"])
                .args(["--recover-every-ms", "200"]),
            150 + rng.below(600),
        );
    }
    with_canary(
        d,
        &cfg,
        &[
            "run",
            "--drain",
            "--max-in-flight",
            "4",
            "--recover-every-ms",
            "200",
        ],
    );
    // Settle every held write by what the server's log says arrived.
    let held = json(d, &["reconcile", "--json"]);
    let held = held.as_array().expect("held writes").clone();
    println!("{} writes held after {KILLS} kills", held.len());
    for h in &held {
        let args = &h["args"];
        let arrived = arrived(&log)
            .iter()
            .any(|a| a["tool"] == h["tool"] && &a["args"] == args);
        let task = h["task"].as_str().expect("task");
        let key = h["key"].as_str().expect("key");
        if arrived {
            ok(
                d,
                &[
                    "reconcile",
                    task,
                    "--applied",
                    "--key",
                    key,
                    "--result",
                    r#"{"status": "ok"}"#,
                    "--by",
                    "oracle",
                ],
            );
        } else {
            ok(
                d,
                &[
                    "reconcile",
                    task,
                    "--not-applied",
                    "--key",
                    key,
                    "--by",
                    "oracle",
                ],
            );
        }
    }
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "4"]);
    let tasks = json(d, &["list", "--json", "--limit", "10000"]);
    let tasks = tasks.as_array().expect("tasks");
    assert_eq!(tasks.len(), TASKS);
    for t in tasks {
        assert_eq!(t["stop"], "done", "{t}");
    }
    // The guarantee: each task's non-idempotent note arrived exactly once.
    let notes = arrivals_of(&log, "add_note");
    for i in 0..TASKS {
        let n = notes
            .iter()
            .filter(|a| a["args"]["text"] == format!("note {i}"))
            .count();
        assert_eq!(n, 1, "note {i} arrived {n} times (seed {seed}): {notes:?}");
    }
    let statuses = arrivals_of(&log, "set_status").len();
    assert!(statuses >= TASKS, "every status was set: {statuses}");
}

/// Review item 1: an applied MCP write was sent again. A non-idempotent write whose server
/// applied it and then answered with a result over 1 MiB, or with a JSON-RPC internal error,
/// was recorded as an error ("was not done"), and the model's next proposal sent it again; a
/// write that succeeded was sent again when the model proposed the same plan step once more.
/// Now an answer that arrived but cannot be used holds a write (unknown outcome), and a repeat
/// under a key with a recorded result is answered from the call record, never sent.
#[test]
fn hole_1_an_applied_mcp_write_is_never_sent_again() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("mcp-applied");
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let logs = log.display().to_string();
    let note = |order: &str, text: &str| json!({"type": "tool", "name": "add_note", "args": {"order_id": order, "text": text}, "plan_step": "s2"});
    // The write, then the same plan step proposed again, then a final answer.
    let twice = |order: &str, again: Value| {
        let mut lines = one_write("add_note", json!({"order_id": order, "text": "hello"}));
        lines.insert(3, again);
        lines
    };
    // An untrusted server whose every tool the operator vouches for as not needing approval:
    // its refusals are not believed either.
    let untrusted = "[mcp.servers.shop.tools.add_note]\napproval = \"never\"\n[mcp.servers.shop.tools.lookup_order]\naccess = \"read\"\n";
    for (mode, order, trusted) in [
        ("big", "o-big", true),
        ("rpc_error", "o-rpc", true),
        ("rpc_invalid", "o-invalid", false),
    ] {
        let cfg = shop_config(
            d,
            &format!("{mode}.toml"),
            &child_server(
                &py,
                &[
                    ("ARRIVALS", logs.clone()),
                    ("MODE", mode.into()),
                    ("MODE_TOOLS", "add_note".into()),
                ],
            ),
            trusted,
            if trusted { "" } else { untrusted },
        );
        let model = script(
            d,
            &format!("{mode}.jsonl"),
            &twice(order, note(order, "hello")),
        );
        let t = enqueue_script(d, &cfg, &model, mode);
        with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
        let s = show(d, &t);
        assert_eq!(s["stop"], "unknown_outcome", "{mode}: {s:#}");
        assert_eq!(s["status"], "held", "{mode}: {s:#}");
        with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
        assert_eq!(
            sent(&log, "add_note", order),
            1,
            "{mode}: applied once, never re-sent"
        );
        let held = json(d, &["reconcile", "--json"]);
        assert!(
            held.as_array()
                .expect("held")
                .iter()
                .any(|h| h["task"] == t.as_str()),
            "{mode}: {held:#}"
        );
    }
    // A write that succeeded, proposed again under its plan step (with the same arguments or
    // others): the step is done, so the kernel refuses it (`step_done`); sent once.
    let cfg = shop_config(
        d,
        "ok.toml",
        &child_server(&py, &[("ARRIVALS", logs.clone())]),
        true,
        "",
    );
    let same = script(d, "same.jsonl", &twice("o-same", note("o-same", "hello")));
    let t = enqueue_script(d, &cfg, &same, "same");
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
    let s = show(d, &t);
    assert_eq!(s["stop"], "done", "{s:#}");
    assert_eq!(sent(&log, "add_note", "o-same"), 1, "{s:#}");
    let calls = s["calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 1, "{s:#}");
    let other = script(
        d,
        "other.jsonl",
        &twice("o-other", note("o-other", "changed")),
    );
    let t = enqueue_script(d, &cfg, &other, "other");
    with_canary(d, &cfg, &["run", "--drain", "--max-in-flight", "1"]);
    let s = show(d, &t);
    assert_eq!(s["stop"], "done", "{s:#}");
    assert_eq!(sent(&log, "add_note", "o-other"), 1, "{s:#}");
    assert_eq!(s["calls"].as_array().map(Vec::len), Some(1), "{s:#}");
}

/// Review item 3, for MCP tools: a task's snapshot of its tools comes from the enqueuer's
/// config, whose overrides could turn a destructive write into one that needs no approval.
/// The daemon compares the snapshot with what its own config makes of the server's
/// definition before each call, and sends nothing when they differ.
#[test]
fn hole_3_an_enqueuers_tool_kinds_are_checked_against_the_daemons() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("mcp-trust");
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let server = child_server(&py, &[("ARRIVALS", log.display().to_string())]);
    let lax = shop_config(
        d,
        "lax.toml",
        &server,
        true,
        "[mcp.servers.shop.tools.issue_refund]\napproval = \"never\"\n",
    );
    let strict = shop_config(d, "strict.toml", &server, true, "");
    let refund = script(
        d,
        "refund.jsonl",
        &one_write(
            "issue_refund",
            json!({"order_id": "o9", "amount_cents": 900}),
        ),
    );
    let t = enqueue_script(d, &lax, &refund, "lax");
    with_canary(d, &strict, &["run", "--drain", "--max-in-flight", "1"]);
    assert!(
        arrivals_of(&log, "issue_refund").is_empty(),
        "{:?}",
        arrived(&log)
    );
    let trace = ok(d, &["trace", &t]);
    assert!(trace.contains("tool_mismatch"), "{trace}");
    assert_eq!(show(d, &t)["state"]["plan"][1]["status"], "pending");
}

/// Must-show 2, the MCP route: an override's rule on arguments replaces the server's
/// destructive hint. A refund over the bound waits for an approval (nothing arrives before
/// it) and arrives once after it; one under the bound runs without waiting.
#[test]
fn an_approval_rule_on_an_mcp_tool_holds_only_the_calls_it_covers() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("mcp-rule");
    let d = dir.path();
    let log = d.join("arrivals.jsonl");
    let logs = log.display().to_string();
    let http = python_http(&py, &[("ARRIVALS", &logs)]);
    let cfg = shop_config(
        d,
        "shop.toml",
        &format!("url = {:?}", http.url()),
        true,
        "[mcp.servers.shop.tools.issue_refund]\nuser_arg = \"customer_id\"\napproval = { above = { amount_cents = 500 } }\n",
    );
    let small = script(
        d,
        "small.jsonl",
        &one_write(
            "issue_refund",
            json!({"order_id": "o1", "amount_cents": 300}),
        ),
    );
    let large = script(
        d,
        "large.jsonl",
        &one_write(
            "issue_refund",
            json!({"order_id": "o2", "amount_cents": 700}),
        ),
    );
    let t1 = enqueue_script(d, &cfg, &small, "small");
    let t2 = enqueue_script(d, &cfg, &large, "large");
    with_canary(d, &cfg, &["run", "--drain"]);
    assert_eq!(show(d, &t1)["stop"], "done", "{:#}", show(d, &t1));
    let s = show(d, &t2);
    assert_eq!(s["stop"], "needs_approval", "{s:#}");
    assert_eq!(s["state"]["last_result"]["code"], "approval_rule", "{s:#}");
    assert_eq!(sent(&log, "issue_refund", "o1"), 1);
    assert_eq!(
        sent(&log, "issue_refund", "o2"),
        0,
        "nothing before the approval"
    );
    let digest = held_digest(d, &t2);
    ok(
        d,
        &[
            "approve", &t2, "--digest", &digest, "--by", "alice", "--reason", "checked",
        ],
    );
    with_canary(d, &cfg, &["run", "--drain"]);
    assert_eq!(show(d, &t2)["stop"], "done", "{:#}", show(d, &t2));
    assert_eq!(sent(&log, "issue_refund", "o2"), 1, "once, after it");
    // `tools list` shows the rule as the tool's approval.
    let tools = json(d, &["--config", &cfg, "tools", "list", "--json"]);
    let mcp_refund = tools
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["source"] == "mcp:shop" && t["name"] == "issue_refund")
        .unwrap_or_else(|| panic!("{tools:#}"));
    assert_eq!(
        mcp_refund["approval"],
        json!({"above": {"amount_cents": 500.0}}),
        "{tools:#}"
    );
}
