//! MCP servers: discovery (`tools/list`) over stdio and streamable HTTP against a test server
//! built on the Python `mcp` SDK (`tests/mcp/server.py`), and the kernel kinds `worker tools
//! list` derives from its annotations, trusted or not, with the config's overrides.

use crate::common;
use common::*;

use common::mcp::{arrived, python, python_http, server_py};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, Instant};

/// A resolved tool's kinds: (access, idempotent, needs approval).
fn kinds(t: &Value) -> (Option<&str>, Option<bool>, Option<bool>) {
    (
        t["access"].as_str(),
        t["idempotent"].as_bool(),
        t["needs_approval"].as_bool(),
    )
}

fn tool<'a>(tools: &'a Value, server: &str, name: &str) -> &'a Value {
    tools
        .as_array()
        .expect("tools")
        .iter()
        .find(|t| t["server"] == server && t["name"] == name)
        .unwrap_or_else(|| panic!("no tool {server}/{name} in {tools:#}"))
}

#[test]
fn tools_are_discovered_over_both_transports_with_their_annotations() {
    let Some(py) = python() else { return };
    let http = python_http(&py, &[]);
    let dir = TempDir::new("mcp-discovery");
    let d = dir.path();
    std::fs::write(
        d.join("worker.toml"),
        format!(
            r#"
[mcp.servers.local]
command = "{py}"
args = ["{server}"]
env_from = ["PATH"]
trusted = true

[mcp.servers.remote]
url = "http://127.0.0.1:{port}/mcp"
trusted = true

[mcp.servers.remote.tools.add_note]
approval = "always"
facts = ["notes"]

[mcp.servers.stranger]
command = "{py}"
args = ["{server}"]
trusted = false
"#,
            py = py.display(),
            server = server_py(),
            port = http.port
        ),
    )
    .expect("config");
    let tools = json(d, &["--config", "worker.toml", "tools", "list", "--json"]);
    let mcp_rows = tools
        .as_array()
        .expect("tools")
        .iter()
        .filter(|t| t["source"].as_str().is_some_and(|s| s.starts_with("mcp:")))
        .count();
    assert_eq!(mcp_rows, 12, "{tools:#}");
    for server in ["local", "remote"] {
        let t = tool(&tools, server, "lookup_order");
        assert_eq!(kinds(t), (Some("read"), Some(true), Some(false)));
        let t = tool(&tools, server, "set_status");
        assert_eq!(kinds(t), (Some("write"), Some(true), Some(false)));
        let t = tool(&tools, server, "issue_refund");
        assert_eq!(kinds(t), (Some("write"), Some(false), Some(true)));
        assert_eq!(
            t["input_schema"]["required"],
            serde_json::json!(["order_id", "amount_cents"])
        );
    }
    // The override: approval always, and facts from structuredContent.
    assert_eq!(tool(&tools, "local", "add_note")["needs_approval"], false);
    assert_eq!(tool(&tools, "remote", "add_note")["needs_approval"], true);
    assert_eq!(
        tool(&tools, "remote", "add_note")["facts"],
        serde_json::json!(["notes"])
    );
    // An untrusted server's annotations are not believed: every tool is a non-idempotent
    // write that needs approval, the read-only one included.
    for name in ["lookup_order", "set_status", "issue_refund", "add_note"] {
        let t = tool(&tools, "stranger", name);
        assert_eq!(kinds(t), (Some("write"), Some(false), Some(true)), "{name}");
    }
    // The same definition has the same digest over both transports.
    assert_eq!(
        tool(&tools, "local", "issue_refund")["digest"],
        tool(&tools, "remote", "issue_refund")["digest"]
    );
    assert_ne!(
        tool(&tools, "local", "issue_refund")["digest"],
        tool(&tools, "local", "add_note")["digest"]
    );
    // The table names each tool with its kinds.
    let table = ok(d, &["--config", "worker.toml", "tools", "list"]);
    assert!(
        table.lines().any(|l| l.starts_with("mcp:local")
            && l.contains("issue_refund")
            && l.contains("write")),
        "{table}"
    );
}

#[test]
fn bad_mcp_declarations_and_dead_servers_are_named() {
    let dir = TempDir::new("mcp-bad");
    let d = dir.path();
    for (text, want) in [
        ("[mcp.servers.a]\nargs = []\n", "give command"),
        (
            "[mcp.servers.a]\ncommand = \"x\"\nurl = \"http://h/mcp\"\n",
            "not both",
        ),
        (
            "[mcp.servers.a]\nurl = \"ftp://h\"\n",
            "must start with http",
        ),
        (
            "[mcp.servers.a]\ncommand = \"x\"\n[mcp.servers.a.tools.t]\napproval = \"maybe\"\n",
            "approval must be",
        ),
        (
            "[demo.tools.refund_everything]\napproval = \"always\"\n",
            "the demo shop has no tool",
        ),
        (
            "[demo.tools.issue_refund]\napproval = { above = { amount_cent = 5000 } }\n",
            "not a numeric argument of issue_refund",
        ),
        (
            "[mcp.servers.a]\ncommand = \"x\"\ntrusted = \"yes\"\n",
            "invalid type",
        ),
    ] {
        std::fs::write(d.join("bad.toml"), text).expect("config");
        let (code, err) = fails(d, &["--config", "bad.toml", "tools", "list"]);
        assert_eq!(code, 2, "{text}: {err}");
        assert!(err.contains(want), "{text}: {err}");
    }
    std::fs::write(
        d.join("gone.toml"),
        "[mcp.servers.gone]\ncommand = \"/nonexistent/mcp-server\"\n",
    )
    .expect("config");
    let (code, err) = fails(d, &["--config", "gone.toml", "tools", "list"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("MCP server gone: cannot start"), "{err}");
    // Without a config: the demo shop's tools, which need no server.
    let demo = json(d, &["tools", "list", "--json"]);
    let names: Vec<&str> = demo
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| {
            assert_eq!(t["source"], "demo", "{t}");
            t["name"].as_str().unwrap_or("")
        })
        .collect();
    assert!(names.contains(&"issue_refund"), "{demo}");
}

/// An `Mcp` for one stdio test server in `mode`, logging arrivals to `arrivals`.
fn one_server(py: &Path, mode: &str, arrivals: &Path) -> tether::mcp::Mcp {
    let text = format!(
        r#"[servers.t]
command = "{py}"
args = ["{server}"]
trusted = true
env = {{ MODE = "{mode}", SLOW_S = "5", ARRIVALS = "{arrivals}" }}
"#,
        py = py.display(),
        server = server_py(),
        arrivals = arrivals.display()
    );
    let cfg: tether::mcp::McpConfig = toml::from_str(&text).expect("config");
    tether::mcp::Mcp::new(cfg).expect("mcp")
}

/// How many test-server processes log their arrivals to `log` (from /proc: the command line
/// and the ARRIVALS variable of each process).
fn servers_logging_to(log: &Path) -> usize {
    let want = format!("ARRIVALS={}", log.display());
    std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(Result::ok)
                .filter(|e| {
                    let p = e.path();
                    let cmd = std::fs::read(p.join("cmdline")).unwrap_or_default();
                    let env = std::fs::read(p.join("environ")).unwrap_or_default();
                    String::from_utf8_lossy(&cmd).contains("tests/mcp/server.py")
                        && env.split(|b| *b == 0).any(|kv| kv == want.as_bytes())
                })
                .count()
        })
        .unwrap_or(0)
}

fn args(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().expect("an object").clone()
}

#[test]
fn calls_are_answered_lost_and_cancelled_as_the_server_behaves() {
    use tether::mcp::CallOutcome;
    let Some(py) = python() else { return };
    let dir = TempDir::new("mcp-calls");
    let t = Duration::from_secs(30);
    // Answered: structuredContent is the result; a schema error is an error result.
    let log = dir.file("normal.jsonl");
    let mcp = one_server(&py, "normal", &log);
    let CallOutcome::Answered(v) = mcp.call(
        "t",
        "lookup_order",
        args(serde_json::json!({"order_id": "o1"})),
        t,
    ) else {
        panic!("lookup_order answered")
    };
    // This server answers with text content only (no structuredContent): the text is kept
    // as `text`, never taken apart for facts.
    assert_eq!(v["status"], "ok", "{v}");
    assert!(
        v["text"]
            .as_str()
            .is_some_and(|t| t.contains("\"total_cents\": 15000")),
        "{v}"
    );
    let CallOutcome::Answered(v) = mcp.call(
        "t",
        "issue_refund",
        args(serde_json::json!({"order_id": "o1"})),
        t,
    ) else {
        panic!("answered")
    };
    assert_eq!(
        v["status"], "error",
        "a missing argument is an error result: {v}"
    );
    assert_eq!(
        arrived(&log).len(),
        1,
        "the server refused the bad call before its tool ran"
    );
    // Slow: the call is cancelled at its timeout; the outcome is unknown.
    let log = dir.file("slow.jsonl");
    let mcp = one_server(&py, "slow", &log);
    // (The session is started first: a Python server takes a while to start.)
    assert!(matches!(
        mcp.call(
            "t",
            "lookup_order",
            args(serde_json::json!({"order_id": "o1"})),
            t
        ),
        CallOutcome::Answered(_)
    ));
    let out = mcp.call(
        "t",
        "add_note",
        args(serde_json::json!({"order_id": "o1", "text": "x"})),
        Duration::from_millis(1500),
    );
    assert!(
        matches!(out, CallOutcome::Lost(ref why) if why.contains("no answer within")),
        "{out:?}"
    );
    assert_eq!(arrived(&log).len(), 2);
    // Crash: the write was applied, the server died, the answer is lost; the next call
    // starts a new session with a new server process.
    let log = dir.file("crash.jsonl");
    let mcp = one_server(&py, "crash", &log);
    let out = mcp.call(
        "t",
        "issue_refund",
        args(serde_json::json!({"order_id": "o1", "amount_cents": 100})),
        t,
    );
    assert!(matches!(out, CallOutcome::Lost(_)), "{out:?}");
    let out = mcp.call(
        "t",
        "lookup_order",
        args(serde_json::json!({"order_id": "o1"})),
        t,
    );
    assert!(
        matches!(out, CallOutcome::Answered(ref v) if v["status"] == "ok"),
        "a new session answers: {out:?}"
    );
    assert_eq!(arrived(&log).len(), 2);
    // Drop: applied, never answered.
    let log = dir.file("drop.jsonl");
    let mcp = one_server(&py, "drop", &log);
    assert!(matches!(
        mcp.call(
            "t",
            "lookup_order",
            args(serde_json::json!({"order_id": "o1"})),
            t
        ),
        CallOutcome::Answered(_)
    ));
    let out = mcp.call(
        "t",
        "set_status",
        args(serde_json::json!({"order_id": "o1", "status": "x"})),
        Duration::from_millis(1500),
    );
    assert!(matches!(out, CallOutcome::Lost(_)), "{out:?}");
    assert_eq!(arrived(&log).len(), 2);
    // The server stuck in that call dies with its session.
    drop(mcp);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = servers_logging_to(&log) > 0;
        if !left {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the stuck server outlived its session"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Review item 14: a server that answers every page of `tools/list` with another
/// `nextCursor` drove `worker tools list` to 834 MB before its timeout. Now the pages and the
/// tools taken from one server are bounded, and the listing fails with a message naming it.
#[test]
fn hole_14_an_endless_tool_list_is_refused_not_followed() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("mcp-endless");
    let d = dir.path();
    std::fs::write(
        d.join("endless.toml"),
        format!(
            "[mcp.servers.endless]\ncommand = {:?}\nargs = [{:?}]\nenv = {{ LIST = \"endless\" }}\ntrusted = true\n",
            py.display().to_string(),
            server_py()
        ),
    )
    .expect("config");
    let (code, err) = fails(d, &["--config", "endless.toml", "tools", "list"]);
    assert_eq!(code, 1, "{err}");
    // Refused for its pages, not cut off by the timeout after reading without a bound.
    assert!(err.contains("MCP server endless"), "{err}");
    assert!(err.contains("pages of tools/list"), "{err}");
}
