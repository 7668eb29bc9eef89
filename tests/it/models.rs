//! Real agents on the providers' own protocols: Chat Completions with native tool calling,
//! Anthropic Messages, and the LiteLLM proxy translating one into the other. The fake
//! providers (`tests/models/fake_provider.py`) build every reply with the official `openai`
//! and `anthropic` SDK types; every Chat Completions request Tether sends is checked against
//! OpenAI's own OpenAPI document (`tests/fixtures/openai-openapi`). The tools are the
//! document's shop served over HTTP by `worker demo-store`.

use crate::common;
use common::shop::{APPROVAL_SECRET, StoreService, store_service, write_catalog};
use common::*;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The Python of the test peers' venv (`.ci/test` makes it), if it has the SDKs.
pub(crate) fn python() -> Option<PathBuf> {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/mcp-venv/bin/python");
    let has = Command::new(&py)
        .args(["-c", "import openai, anthropic"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has {
        Some(py)
    } else {
        missing(
            "the openai and anthropic Python SDKs (target/mcp-venv)",
            "bash .ci/test installs them",
        );
        None
    }
}

/// A fake provider process; killed when dropped.
pub(crate) struct Fake {
    child: Child,
    pub(crate) url: String,
    log: PathBuf,
}

impl Drop for Fake {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Fake {
    pub(crate) fn start(py: &Path, dir: &Path, api: &str, script: &[Value]) -> Fake {
        Fake::start_with(py, dir, api, script, &[])
    }

    /// A fake started with extra arguments (its rate limits).
    pub(crate) fn start_with(
        py: &Path,
        dir: &Path,
        api: &str,
        script: &[Value],
        extra: &[String],
    ) -> Fake {
        let name = format!("{api}-{}", std::process::id());
        let script_path = dir.join(format!("{name}.script.jsonl"));
        let lines: Vec<String> = script.iter().map(Value::to_string).collect();
        std::fs::write(&script_path, lines.join("\n") + "\n").expect("script");
        let log = dir.join(format!("{name}.requests.jsonl"));
        let mut child = Command::new(py)
            .arg(format!(
                "{}/tests/models/fake_provider.py",
                env!("CARGO_MANIFEST_DIR")
            ))
            .args(["--api", api, "--script"])
            .arg(&script_path)
            .arg("--log")
            .arg(&log)
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the fake provider");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("address");
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("fake provider said {line:?}"))
            .to_string();
        Fake { child, url, log }
    }

    /// Every request the fake received, in order.
    pub(crate) fn requests(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("logged request"))
            .collect()
    }
}

/// OpenAI's `CreateChatCompletionRequest`, from the fixture of its OpenAPI document.
fn chat_request_schema() -> jsonschema::Validator {
    let path = format!(
        "{}/tests/fixtures/openai-openapi/chat_completion_request.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).expect("fixture"))
        .expect("fixture JSON");
    let root = json!({"$ref": doc["root"], "components": doc["components"]});
    jsonschema::validator_for(&root).expect("the OpenAPI schema compiles")
}

/// Fails unless every request body validates against `CreateChatCompletionRequest`.
fn assert_valid_chat_requests(requests: &[Value]) {
    let schema = chat_request_schema();
    assert!(!requests.is_empty());
    for r in requests {
        let problems: Vec<String> = schema
            .iter_errors(&r["body"])
            .map(|e| format!("{}: {e}", e.instance_path()))
            .collect();
        assert!(
            problems.is_empty(),
            "request {} is not a valid CreateChatCompletionRequest: {problems:?}\n{}",
            r["n"],
            r["body"]
        );
    }
}

const KEY_VAR: &str = "TETHER_TEST_KEY";
const KEY: &str = "sk-test-native-1";

/// The config of these tests: one profile `NAME` of `kind` at `url`, the shop's catalog.
fn config(dir: &Path, store: &str, kind: &str, url: &str, extra: &str) {
    write_catalog(dir, store);
    std::fs::write(
        dir.join("worker.toml"),
        format!(
            "default_model = \"agent\"\n\n[models.agent]\nkind = \"{kind}\"\nbase_url = \"{url}\"\nmodel = \"gpt-4o\"\napi_key_env = \"{KEY_VAR}\"\ninstructions = \"You are the shop's support agent. Refund only what the order shows.\"\n{extra}\n[tools]\ncatalog = \"tools.toml\"\n"
        ),
    )
    .expect("config");
}

fn worker_in(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(["--config", "worker.toml"])
        .args(args)
        .current_dir(dir)
        .env(KEY_VAR, KEY)
        .env("TETHER_APPROVAL_SECRET", APPROVAL_SECRET)
        .env_remove("WORKER_DB")
        .env_remove("WORKER_STORE")
        .env_remove("WORKER_CONFIG")
        .output()
        .expect("run worker")
}

fn okw(dir: &Path, args: &[&str]) -> String {
    succeeded(worker_in(dir, args), args)
}

fn jsonw(dir: &Path, args: &[&str]) -> Value {
    let out = okw(dir, args);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}\n{out}"))
}

/// The replies of the refund task: a plan, a read (with prose beside the call), the write
/// (which waits for approval), the final answer.
fn refund_script() -> Vec<Value> {
    vec![
        json!({"call": "propose_plan", "args": {"steps": [
            {"id": "s1", "tool": "get_order", "depends_on": []},
            {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]}]}}),
        json!({"text": "Here is my next move: reading the order.", "call": "get_order", "args": {"order_id": "ord_1004"}}),
        json!({"call": "issue_refund", "args": {"order_id": "ord_1004", "amount_cents": 8000, "reason": "damaged"}}),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Refunded 80.00 on ord_1004."}}),
    ]
}

/// Runs the refund task on the config's default profile: enqueued without --model, held
/// for approval, approved, finished. Returns the shop's ledger of refunds.
fn run_refund(d: &Path, svc: &StoreService) -> Vec<i64> {
    let _ = svc;
    okw(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "Refund the damaged item on order ord_1004.",
            "--instructions",
            "Answer in one sentence.",
        ],
    );
    okw(d, &["run", "--drain"]);
    let t = jsonw(d, &["show", "t1", "--json"]);
    assert_eq!(t["status"], "suspended", "{t}");
    let digest = t["held"]["digest"].as_str().expect("digest").to_string();
    okw(d, &["approve", "t1", "--digest", &digest, "--by", "alice"]);
    okw(d, &["run", "--drain"]);
    let t = jsonw(d, &["show", "t1", "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["outcome"], "completed", "{t}");
    assert_eq!(t["state"]["answer"], "Refunded 80.00 on ord_1004.", "{t}");
    refund_amounts(&json_list(
        d,
        &["store", "--store", "store.redb", "ledger", "--json"],
    ))
}

/// Must-show 1, Chat Completions: native tools carry their schemas, the model's calls run
/// (the plan step inferred), the write is approved and sent once, and every request is a
/// valid `CreateChatCompletionRequest` with the last call and its result as the protocol's
/// `assistant`/`tool` pair.
#[test]
fn a_refund_runs_end_to_end_on_chat_completions_with_native_tools() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("native-openai");
    let d = dir.path();
    let svc = store_service(d, &[]);
    let fake = Fake::start(&py, d, "openai", &refund_script());
    config(d, &svc.url, "openai", &format!("{}/v1", fake.url), "");
    assert_eq!(run_refund(d, &svc), [8000]);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 4, "one request per model step");
    assert_valid_chat_requests(&reqs);
    for r in &reqs {
        assert_eq!(r["path"], "/v1/chat/completions");
        assert_eq!(r["headers"]["authorization"], format!("Bearer {KEY}"));
        let b = &r["body"];
        assert_eq!(b["tool_choice"], "required");
        assert_eq!(b["parallel_tool_calls"], false);
        assert!(b["max_completion_tokens"].as_u64().is_some(), "{b}");
        assert!(b.get("max_tokens").is_none() && b.get("temperature").is_none());
        let system = b["messages"][0]["content"].as_str().expect("system");
        assert!(system.starts_with("You are the shop's support agent."));
        assert!(
            system.contains("Answer in one sentence."),
            "task instructions"
        );
        assert_eq!(
            b["messages"][1]["content"],
            "Refund the damaged item on order ord_1004."
        );
    }
    // The tools: the catalog's schemas, descriptions included, and the kernel's functions.
    let tools = reqs[0]["body"]["tools"].as_array().expect("tools");
    let names: Vec<&str> = tools
        .iter()
        .filter_map(|t| t["function"]["name"].as_str())
        .collect();
    assert_eq!(
        names,
        [
            "propose_plan",
            "get_order",
            "search_policy",
            "issue_refund",
            "send_status_email",
            "final_answer"
        ]
    );
    let refund = &tools[3]["function"];
    assert!(
        refund["description"]
            .as_str()
            .is_some_and(|d| d.starts_with("Refund part or all of an order")),
        "{refund}"
    );
    let amount = &refund["parameters"]["properties"]["amount_cents"];
    assert_eq!(amount["type"], "integer");
    assert_eq!(amount["minimum"], 1);
    assert_eq!(amount["maximum"], 1_000_000);
    assert!(amount["description"].is_string(), "{amount}");
    // The second request answers the plan; the third carries the read's result as a tool
    // message, after the assistant message with the model's prose and call.
    let m = reqs[1]["body"]["messages"].as_array().expect("messages");
    assert_eq!(m.len(), 5, "system, goal, assistant, tool, state: {m:?}");
    assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "propose_plan");
    assert_eq!(m[3]["role"], "tool");
    assert_eq!(m[3]["tool_call_id"], m[2]["tool_calls"][0]["id"]);
    assert!(m[3]["content"].as_str().unwrap().contains("plan_accepted"));
    let m = reqs[2]["body"]["messages"].as_array().expect("messages");
    assert_eq!(m[2]["content"], "Here is my next move: reading the order.");
    assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "get_order");
    assert!(
        m[3]["content"].as_str().unwrap().contains("total_cents"),
        "the read's result: {}",
        m[3]
    );
    let state = m[4]["content"].as_str().expect("state");
    assert!(!state.contains("\"goal\""), "the goal is its own message");
    assert!(
        !state.contains("\"last_result\""),
        "the tool message has it"
    );
    // After approval: the refund's result is answered to the call that asked for it.
    let m = reqs[3]["body"]["messages"].as_array().expect("messages");
    assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "issue_refund");
    assert!(
        m[3]["content"].as_str().unwrap().contains("\"ok\""),
        "{}",
        m[3]
    );
    // Each reply is recorded with the prompt it was made with.
    let pm = okw(d, &["postmortem", "t1"]);
    assert!(
        pm.starts_with("task t1: done") && !pm.contains("first model error"),
        "{pm}"
    );
}

/// Must-show 1, Anthropic Messages: `tool_use` and `tool_result` blocks, `x-api-key`,
/// `anthropic-version`, the system prompt as a cached block, cached input counted.
#[test]
fn a_refund_runs_end_to_end_on_anthropic_messages() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("native-anthropic");
    let d = dir.path();
    let svc = store_service(d, &[]);
    let fake = Fake::start(&py, d, "anthropic", &refund_script());
    config(d, &svc.url, "anthropic", &format!("{}/v1", fake.url), "");
    assert_eq!(run_refund(d, &svc), [8000]);
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 4);
    for r in &reqs {
        assert_eq!(r["path"], "/v1/messages");
        assert_eq!(r["headers"]["x-api-key"], KEY);
        assert_eq!(r["headers"]["anthropic-version"], "2023-06-01");
        assert!(r["headers"].get("authorization").is_none());
        let b = &r["body"];
        assert_eq!(b["system"][0]["cache_control"]["type"], "ephemeral");
        assert_eq!(b["tool_choice"]["type"], "any");
        assert_eq!(b["tool_choice"]["disable_parallel_tool_use"], true);
        assert!(b["max_tokens"].as_u64().is_some());
        // Roles alternate, starting with the user.
        let roles: Vec<&str> = b["messages"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["role"].as_str())
            .collect();
        assert_eq!(roles[0], "user");
        assert!(roles.windows(2).all(|w| w[0] != w[1]), "{roles:?}");
    }
    let tools = reqs[0]["body"]["tools"].as_array().expect("tools");
    assert_eq!(tools[3]["name"], "issue_refund");
    assert_eq!(
        tools[3]["input_schema"]["properties"]["amount_cents"]["maximum"],
        1_000_000
    );
    let m = reqs[2]["body"]["messages"].as_array().expect("messages");
    assert_eq!(m.len(), 3, "goal, the last reply, its result and the state");
    assert_eq!(m[1]["content"][0]["type"], "text");
    assert_eq!(m[1]["content"][1]["type"], "tool_use");
    assert_eq!(m[1]["content"][1]["name"], "get_order");
    let result = &m[2]["content"][0];
    assert_eq!(result["type"], "tool_result");
    assert_eq!(result["tool_use_id"], m[1]["content"][1]["id"]);
    assert!(result["content"].as_str().unwrap().contains("total_cents"));
}

/// Must-show 1, through a translation layer written by others: the LiteLLM proxy receives
/// Tether's Chat Completions requests (each valid against OpenAI's schema, checked at a
/// recording hop in front of the proxy) and forwards them to an Anthropic-format fake.
#[test]
fn a_refund_runs_end_to_end_through_the_litellm_proxy() {
    let Some(py) = python() else { return };
    let has_litellm = Command::new(&py)
        .args(["-c", "import litellm.proxy.proxy_server"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_litellm {
        missing(
            "the LiteLLM proxy (target/mcp-venv)",
            "bash .ci/test installs it",
        );
        return;
    }
    let dir = TempDir::new("native-litellm");
    let d = dir.path();
    let svc = store_service(d, &[]);
    let fake = Fake::start(&py, d, "anthropic", &refund_script());
    let port = free_port();
    std::fs::write(
        d.join("litellm.yaml"),
        format!(
            "model_list:\n  - model_name: gpt-4o\n    litellm_params:\n      model: anthropic/claude-sonnet-4-5\n      api_base: {}\n      api_key: sk-ant-fake\n",
            fake.url
        ),
    )
    .expect("litellm config");
    let litellm = py.parent().expect("venv bin").join("litellm");
    let mut proxy = Command::new(&litellm)
        .args(["--config", "litellm.yaml", "--host", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .current_dir(d)
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_MASTER_KEY", KEY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start litellm");
    let ready = (0..240).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(500));
        ureq::get(&format!("http://127.0.0.1:{port}/health/liveliness"))
            .call()
            .is_ok()
    });
    assert!(ready, "the LiteLLM proxy did not start");
    // A recording hop in front of the proxy: every request Tether sent, as sent.
    let hop = Hop::start(&format!("http://127.0.0.1:{port}"));
    config(
        d,
        &svc.url,
        "openai",
        &format!("http://{}/v1", hop.addr),
        "",
    );
    let refunds = run_refund(d, &svc);
    let _ = proxy.kill();
    let _ = proxy.wait();
    assert_eq!(refunds, [8000]);
    let sent: Vec<Value> = hop
        .bodies()
        .into_iter()
        .enumerate()
        .map(|(n, b)| json!({"n": n, "body": b}))
        .collect();
    assert_eq!(sent.len(), 4);
    assert_valid_chat_requests(&sent);
    // What arrived at the Anthropic side is LiteLLM's translation of them.
    let reqs = fake.requests();
    assert_eq!(reqs.len(), 4);
    let m = reqs[2]["body"]["messages"].as_array().expect("messages");
    assert!(
        m.iter().any(|m| m["content"]
            .as_array()
            .is_some_and(|c| c.iter().any(|b| b["type"] == "tool_result"))),
        "the tool message became a tool_result block: {m:?}"
    );
}

/// An HTTP hop that keeps every request body and forwards the request to `target`.
struct Hop {
    addr: String,
    bodies: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
}

impl Hop {
    fn start(target: &str) -> Hop {
        let server = tiny_http::Server::http("127.0.0.1:0").expect("bind hop");
        let addr = server.server_addr().to_string();
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = std::sync::Arc::clone(&bodies);
        let target = target.to_string();
        std::thread::spawn(move || {
            for mut req in server.incoming_requests() {
                let mut body = String::new();
                let _ = req.as_reader().read_to_string(&mut body);
                kept.lock()
                    .expect("hop")
                    .push(serde_json::from_str(&body).unwrap_or(Value::Null));
                let mut fwd = ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .build()
                    .new_agent()
                    .post(&format!("{target}{}", req.url()));
                for h in req.headers() {
                    let name = h.field.as_str().as_str().to_ascii_lowercase();
                    if matches!(name.as_str(), "authorization" | "content-type") {
                        fwd = fwd.header(name.as_str(), h.value.as_str());
                    }
                }
                let (status, text) = match fwd.send(body) {
                    Ok(mut r) => (
                        r.status().as_u16(),
                        r.body_mut().read_to_string().unwrap_or_default(),
                    ),
                    Err(e) => (502, e.to_string()),
                };
                let _ =
                    req.respond(tiny_http::Response::from_string(text).with_status_code(status));
            }
        });
        Hop { addr, bodies }
    }

    fn bodies(&self) -> Vec<Value> {
        self.bodies.lock().expect("hop").clone()
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

/// One task of the model zoo on its own fake, shop and database: the replies of `script`,
/// the profile's `extra` options, the enqueue's `args`. Returns the task, what was sent, and
/// the task's postmortem.
fn zoo_case(
    py: &Path,
    name: &str,
    script: &[Value],
    extra: &str,
    args: &[&str],
) -> (Value, Vec<Value>, String) {
    let dir = TempDir::new(&format!("zoo-{name}"));
    let d = dir.path();
    let svc = store_service(d, &[]);
    let fake = Fake::start(py, d, "openai", script);
    config(d, &svc.url, "openai", &format!("{}/v1", fake.url), extra);
    let mut enqueue = vec![
        "enqueue",
        "--user",
        "cu_ana",
        "--goal",
        "Look into order ord_1001.",
    ];
    enqueue.extend_from_slice(args);
    okw(d, &enqueue);
    okw(d, &["run", "--drain"]);
    let t = jsonw(d, &["show", "t1", "--json"]);
    let reqs = fake.requests();
    assert_valid_chat_requests(&reqs);
    (t, reqs, okw(d, &["postmortem", "t1"]))
}

fn final_answer() -> Value {
    json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Done."}})
}

/// The content of request `n`'s tool message `i` (after system, goal and assistant).
fn tool_message(reqs: &[Value], n: usize, i: usize) -> String {
    let m = &reqs[n]["body"]["messages"][3 + i];
    assert_eq!(m["role"], "tool", "{m}");
    m["content"].as_str().expect("content").to_string()
}

/// Must-show 2: each kind of reply a real provider sends ends as docs/models.md says, and
/// none of them as `no_progress` from a valid reply that was not understood.
#[test]
fn the_model_zoo_ends_each_case_as_documented() {
    let Some(py) = python() else { return };
    // Two calls in one reply: the first runs, the second is answered not_run.
    let (t, reqs, _) = zoo_case(
        &py,
        "two-calls",
        &[
            json!({"calls": [["get_order", {"order_id": "ord_1001"}], ["search_policy", {"q": "refunds"}]]}),
            final_answer(),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["tool_calls"], 1, "{t}");
    assert!(tool_message(&reqs, 1, 0).contains("total_cents"));
    assert!(tool_message(&reqs, 1, 1).contains("not_run"));
    // Arguments that are not JSON: an invalid reply the model is told about.
    let (t, reqs, _) = zoo_case(
        &py,
        "bad-args",
        &[
            json!({"call": "get_order", "raw_args": "{order_id: ord_1001"}),
            final_answer(),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    let answer = tool_message(&reqs, 1, 0);
    assert!(
        answer.contains("invalid_reply") && answer.contains("not a JSON object"),
        "{answer}"
    );
    // Cut off at the output limit.
    let (t, reqs, _) = zoo_case(
        &py,
        "length",
        &[
            json!({"finish": "length", "call": "get_order", "raw_args": "{\"order_id\": \"ord_10"}),
            final_answer(),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    assert!(tool_message(&reqs, 1, 0).contains("cut off at the output token limit"));
    // A refusal: recorded as one, its billed tokens counted.
    let (t, reqs, _) = zoo_case(
        &py,
        "refusal",
        &[
            json!({"refusal": "I can't help with that.", "usage": [540, 12]}),
            json!({"call": "final_answer", "args": {"outcome": "cannot_complete", "text": "Refused."}, "usage": [100, 10]}),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["outcome"], "cannot_complete", "{t}");
    assert_eq!(
        t["tokens"], 662,
        "the refused reply's 552 tokens count: {t}"
    );
    let state = reqs[1]["body"]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .expect("state")
        .to_string();
    assert!(state.contains("model_refused"), "{state}");
    // 429 with Retry-After, then an answer: one step, two requests.
    let (t, reqs, _) = zoo_case(
        &py,
        "429",
        &[
            json!({"status": 429, "headers": {"Retry-After": "1"}, "error": {"message": "Rate limit reached", "type": "requests", "code": "rate_limit_exceeded"}}),
            final_answer(),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!((t["steps"].clone(), reqs.len()), (json!(1), 2), "{t}");
    // 529 (overloaded): retried with backoff.
    let (t, reqs, _) = zoo_case(
        &py,
        "529",
        &[
            json!({"status": 529, "error": {"type": "overloaded_error", "message": "Overloaded"}}),
            final_answer(),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(reqs.len(), 2);
    // 401: the task stops at once, naming the key's variable; nothing is retried.
    let (t, reqs, pm) = zoo_case(
        &py,
        "401",
        &[
            json!({"status": 401, "error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}}),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "model_failed", "{t}");
    assert_eq!(reqs.len(), 1);
    let detail = t["state"]["last_result"]["detail"].to_string();
    assert!(detail.contains(KEY_VAR), "{detail}");
    assert!(
        pm.contains("first model error") && pm.contains(KEY_VAR),
        "the postmortem shows the first model error: {pm}"
    );
    assert!(
        t["closing_message"]
            .as_str()
            .unwrap_or("")
            .contains(KEY_VAR),
        "the closing message names the model failure: {t}"
    );
    // The context window exceeded: stops, saying so.
    let (t, _, _) = zoo_case(
        &py,
        "context",
        &[
            json!({"status": 400, "error": {"message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 tokens.", "type": "invalid_request_error", "code": "context_length_exceeded"}}),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "model_failed", "{t}");
    assert!(
        t["state"]["last_result"]["detail"]
            .to_string()
            .contains("context window"),
        "{t}"
    );
    // A server that keeps failing: the stop names the model, not progress.
    let (t, reqs, _) = zoo_case(
        &py,
        "500",
        &[json!({"status": 500, "error": {"message": "internal error", "type": "server_error"}})],
        "max_retries = 1\n",
        &[],
    );
    assert_eq!(t["stop"], "model_failed", "{t}");
    assert_eq!(reqs.len(), 6, "3 steps of 2 attempts");
    // JSON mode for a model without tools: one JSON object found in prose.
    let (t, reqs, _) = zoo_case(
        &py,
        "json-mode",
        &[
            json!({"text": "Here is my next move:\n{\"type\": \"final\", \"outcome\": \"completed\", \"text\": \"Done.\"}"}),
        ],
        "tool_calling = \"json\"\n",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    let b = &reqs[0]["body"];
    assert_eq!(b["response_format"]["type"], "json_object");
    assert!(b.get("tools").is_none());
    assert!(
        b["messages"][0]["content"]
            .as_str()
            .unwrap()
            .contains("issue_refund")
    );
}

/// Must-show 2: the input of a long native task stays flat. Twenty steps of reads, each with
/// a result of its own; the tokens each request carried (as the provider counted them, from
/// the length of what was sent) are printed and stay within a small band after the plan.
#[test]
fn the_input_per_step_of_a_twenty_step_native_task_stays_flat() {
    let Some(py) = python() else { return };
    let mut script: Vec<Value> = (0..19)
        .map(|i| json!({"call": "search_policy", "args": {"q": format!("refund rule {i}")}}))
        .collect();
    script.push(final_answer());
    let (t, reqs, _) = zoo_case(
        &py,
        "flat",
        &script,
        "",
        &[
            "--budget",
            "stalls_max=30",
            "--budget",
            "steps_max=25",
            "--budget",
            "tool_calls_max=25",
        ],
    );
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["steps"], 20, "{t}");
    let tin: Vec<u64> = reqs
        .iter()
        .map(|r| (r["body"].to_string().len() as u64).div_ceil(4))
        .collect();
    println!("tokens in per step: {tin:?}");
    let later = &tin[2..];
    let (lo, hi) = (
        *later.iter().min().expect("steps"),
        *later.iter().max().expect("steps"),
    );
    assert!(
        hi <= lo + lo / 10,
        "the input grew from {lo} to {hi} tokens over the task: {tin:?}"
    );
}

/// The blocks of README's "Run your own agent": the fenced block whose first line is
/// `# NAME` (TOML), or the first `sh` block of the section.
pub(crate) fn readme_block(first_line: &str) -> String {
    let readme = std::fs::read_to_string(format!("{}/README.md", env!("CARGO_MANIFEST_DIR")))
        .expect("README");
    let section = readme
        .split("## Run your own agent")
        .nth(1)
        .expect("the README has \"Run your own agent\"");
    let section = section.split("\n## ").next().expect("section");
    section
        .split("```")
        .skip(1)
        .step_by(2)
        .find(|b| {
            b.lines().nth(1).is_some_and(|l| l.starts_with(first_line)) || b.starts_with(first_line)
        })
        .map(|b| b.split_once('\n').map_or("", |(_, rest)| rest).to_string())
        .unwrap_or_else(|| panic!("no README block starting with {first_line:?}"))
}

/// Must-show 4: README's "Run your own agent" works exactly as written. Its two files and
/// its commands are run as they are, with three substitutions: `base_url` points at a fake
/// provider (whose replies are the official SDK's types), the shop listens on a free port
/// instead of 8700, and DIGEST is the digest `worker show` printed.
#[test]
fn the_readme_agent_runs_as_written() {
    /// A process killed and reaped when dropped.
    struct Killed(Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let Some(py) = python() else { return };
    let dir = TempDir::new("readme-agent");
    let d = dir.path();
    let fake = Fake::start(&py, d, "openai", &refund_script());
    let port = free_port().to_string();
    let shop = format!("127.0.0.1:{port}");
    let config = readme_block("# agent.toml")
        .replace("https://api.openai.com/v1", &format!("{}/v1", fake.url));
    assert!(
        config.contains(&fake.url),
        "the README's base_url is the one replaced"
    );
    std::fs::write(d.join("agent.toml"), config).expect("agent.toml");
    std::fs::write(
        d.join("agent-tools.toml"),
        readme_block("# agent-tools.toml").replace("127.0.0.1:8700", &shop),
    )
    .expect("agent-tools.toml");
    let script = readme_block("sh");
    let bin_dir = Path::new(bin()).parent().expect("bin dir").to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut env: Vec<(String, String)> = vec![("PATH".into(), path)];
    // Ended however the test ends (a panic too).
    let mut shop_child: Option<Killed> = None;
    let mut digest = String::new();
    let mut shown = Vec::new();
    for line in script.lines() {
        let cmd = line.split("  #").next().unwrap_or("").trim();
        if cmd.is_empty() {
            continue;
        }
        if let Some(kv) = cmd.strip_prefix("export ") {
            let (k, v) = kv.split_once('=').expect("export K=V");
            // The key the README leaves to the reader: any value, the fake checks none.
            env.push((k.to_string(), v.replace("sk-...", "sk-readme")));
            continue;
        }
        let cmd = cmd
            .replace("127.0.0.1:8700", &shop)
            .replace("DIGEST", &digest);
        let background = cmd.ends_with('&');
        let mut c = Command::new("sh");
        // `exec`: the shell becomes the command, so a background one is the process the test
        // stops (a shell killed in its place leaves the command running after the suite).
        c.args(["-c", &format!("exec {}", cmd.trim_end_matches('&').trim())])
            .current_dir(d)
            .env_remove("WORKER_DB")
            .env_remove("WORKER_STORE")
            .env_remove("WORKER_CONFIG");
        for (k, v) in &env {
            c.env(k, v);
        }
        if background {
            shop_child = Some(Killed(
                c.stdout(Stdio::null()).spawn().expect("start the shop"),
            ));
            let up = (0..100).any(|_| {
                std::thread::sleep(std::time::Duration::from_millis(100));
                std::net::TcpStream::connect(&shop).is_ok()
            });
            assert!(up, "the shop did not listen on {shop}");
            continue;
        }
        let out = c.output().expect("run");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{cmd}: {}\n{text}",
            String::from_utf8_lossy(&out.stderr)
        );
        if cmd.starts_with("worker show") {
            if let Some(i) = text.find("digest") {
                digest = text[i..]
                    .split(|c: char| !c.is_ascii_hexdigit())
                    .find(|w| w.len() >= 10)
                    .unwrap_or("")
                    .to_string();
            }
            shown.push(text);
        }
    }
    drop(shop_child);
    assert_eq!(shown.len(), 2, "{shown:?}");
    assert!(shown[0].contains("suspended"), "{}", shown[0]);
    assert!(
        shown[1].contains("done") && shown[1].contains("Refunded 80.00"),
        "{}",
        shown[1]
    );
    assert_eq!(fake.requests().len(), 4);
    assert_valid_chat_requests(&fake.requests());
}

/// Must-show 5: native-tool tasks survive a daemon killed during their model calls. Six
/// tasks, each a refund on one of the shop's orders, decided by a fake Chat Completions
/// provider that answers from the request alone and takes 150 ms a reply, so most kills land
/// in a model call. The daemon is killed with SIGKILL at random moments and restarted; held
/// writes are settled by `reconcile --auto` from the shop's lookup endpoint. Then every task
/// is done, the shop's arrivals log shows every refund key applied at most once (exactly once
/// per task), and `worker replay` reproduces each task's state offline.
#[test]
fn native_tool_tasks_survive_a_daemon_killed_during_model_calls() {
    let Some(py) = python() else { return };
    let seed = seed("native crash");
    let mut rng = Rng(seed);
    let dir = TempDir::new("native-crash");
    let d = dir.path();
    let svc = store_service(d, &[]);
    let fake = Fake::start(&py, d, "openai", &[json!({"policy": 100, "delay_ms": 150})]);
    config(d, &svc.url, "openai", &format!("{}/v1", fake.url), "");
    // (The two orders of the shop that take refunds: each gets three of a dollar.)
    let orders = [
        "ord_1001", "ord_1004", "ord_1001", "ord_1004", "ord_1001", "ord_1004",
    ];
    for (i, o) in orders.iter().enumerate() {
        okw(
            d,
            &[
                "enqueue",
                "--user",
                "cu_ana",
                "--goal",
                &format!("Refund one dollar on order {o}."),
                "--key",
                &format!("native-{i}"),
            ],
        );
    }
    for _ in 0..8 {
        let mut daemon = Command::new(bin())
            .args(["--config", "worker.toml", "run", "--max-in-flight", "3"])
            .current_dir(d)
            .env(KEY_VAR, KEY)
            .env("TETHER_APPROVAL_SECRET", APPROVAL_SECRET)
            .env_remove("WORKER_DB")
            .env_remove("WORKER_CONFIG")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("daemon");
        std::thread::sleep(std::time::Duration::from_millis(100 + rng.below(600)));
        daemon.kill().expect("SIGKILL");
        daemon.wait().expect("reap");
    }
    // Held writes (a kill between a refund's intent and its answer) are settled from the
    // shop's own record, then everything runs to the end.
    for _ in 0..3 {
        okw(d, &["reconcile", "--auto"]);
        okw(d, &["run", "--drain"]);
    }
    let list = jsonw(d, &["list", "--json", "--limit", "100"]);
    let tasks = list.as_array().expect("tasks");
    assert_eq!(tasks.len(), orders.len(), "seed {seed}: {list}");
    for t in tasks {
        assert_eq!(t["stop"], "done", "seed {seed}: {t}");
    }
    let arrivals = json(d, &["store", "--store", "store.redb", "arrivals", "--json"]);
    let mut applied: std::collections::BTreeMap<String, usize> = Default::default();
    for a in arrivals.as_array().expect("arrivals") {
        if a["tool"] == "issue_refund" && a["outcome"] == "applied" {
            *applied
                .entry(a["key"].as_str().unwrap_or("").to_string())
                .or_default() += 1;
        }
    }
    assert!(
        applied.values().all(|n| *n == 1),
        "seed {seed}: a refund key applied twice: {applied:?}"
    );
    let (mut replayed, mut interrupted, mut settled) = (0, 0, 0);
    for t in tasks {
        let id = t["id"].as_str().expect("id");
        let full = jsonw(d, &["show", id, "--json"]);
        assert_eq!(
            full["state"]["plan"][1]["status"], "done",
            "seed {seed}: {full}"
        );
        let sent = applied
            .iter()
            .filter(|(k, _)| k.ends_with(&format!(":{id}:s2")))
            .count();
        assert_eq!(
            sent, 1,
            "seed {seed}: {id}'s refund applied once: {applied:?}"
        );
        // Every task replays offline to the state it stored, from its recorded replies and
        // tool answers: also one a kill interrupted (its redone step recorded what the redo
        // saw) and one settled by reconcile (the decision comes from the audit log).
        let out = worker_in(d, &["replay", id, "--json"]);
        let r: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
        assert_eq!(r["tool_answers"], "recorded", "seed {seed}: {id}: {r}");
        assert_eq!(r["same_state"], true, "seed {seed}: {id}: {r}");
        assert_eq!(r["same_effects"], true, "seed {seed}: {id}: {r}");
        assert!(out.status.success(), "seed {seed}: {id}: {r}");
        if full["runs"] != 1 {
            interrupted += 1;
        }
        let events = json_list(d, &["events", id, "--json"]);
        if events.iter().any(|e| {
            e["verb"]
                .as_str()
                .is_some_and(|v| v.starts_with("reconcile"))
        }) {
            settled += 1;
        }
        replayed += 1;
    }
    // Without the config the daemon used, the replay cannot build the prompt the run was
    // given (its token counts depend on it), and says so.
    let id = tasks[0]["id"].as_str().expect("id");
    let out = worker(d, &["replay", id, "--json"]);
    let r: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert!(
        r["prompt_note"]
            .as_str()
            .is_some_and(|n| n.contains("--config")),
        "{r}"
    );
    println!(
        "{replayed} of {} tasks replayed to their stored state; {interrupted} were run more than \
         once, {settled} settled by reconcile",
        tasks.len()
    );
}

/// A task whose model gave up (`cannot_complete`) is never shown as a completed one: `show`
/// says so, `--json` carries the outcome, and `list --outcome` tells the two apart.
#[test]
fn cannot_complete_is_told_apart_from_completed() {
    let dir = TempDir::new("outcome");
    let d = dir.path();
    std::fs::write(
        d.join("gave-up.jsonl"),
        "{\"type\": \"final\", \"outcome\": \"cannot_complete\", \"text\": \"the order does not exist\"}\n",
    )
    .expect("script");
    std::fs::write(
        d.join("done.jsonl"),
        "{\"type\": \"final\", \"outcome\": \"completed\", \"text\": \"nothing to do\"}\n",
    )
    .expect("script");
    enqueue(d, &["--model", "script:gave-up.jsonl"]);
    enqueue(d, &["--model", "script:done.jsonl"]);
    ok(d, &["run", "--drain"]);
    let shown = ok(d, &["show", "t1"]);
    assert!(shown.contains("done: cannot_complete"), "{shown}");
    assert!(!ok(d, &["show", "t2"]).contains("cannot_complete"));
    assert_eq!(
        json(d, &["show", "t1", "--json"])["outcome"],
        "cannot_complete"
    );
    let ids = |outcome: &str| -> Vec<String> {
        json_list(d, &["list", "--outcome", outcome, "--json"])
            .iter()
            .filter_map(|t| t["id"].as_str().map(str::to_string))
            .collect()
    };
    assert_eq!(ids("cannot_complete"), ["t1"]);
    assert_eq!(ids("completed"), ["t2"]);
    assert!(ok(d, &["list"]).contains("done: cannot_complete"));
    let (code, err) = fails(d, &["list", "--outcome", "maybe"]);
    assert_eq!(code, 2, "{err}");
    // The console's list and task page say it too, with the answer.
    let mut child = Command::new(bin())
        .args(["console", "--listen", "127.0.0.1:0"])
        .current_dir(d)
        .env_remove("WORKER_DB")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("console");
    let mut base = String::new();
    for line in BufReader::new(child.stderr.take().expect("stderr"))
        .lines()
        .map_while(Result::ok)
    {
        if let Some(url) = line.strip_prefix("console: ") {
            base = url.trim_end_matches('/').to_string();
            break;
        }
    }
    let page = |path: &str| {
        ureq::get(&format!("{base}{path}"))
            .call()
            .expect("page")
            .into_body()
            .read_to_string()
            .expect("body")
    };
    let list = page("/");
    let task = page("/tasks/t1");
    let gave_up = page("/?outcome=cannot_complete");
    let completed = page("/?outcome=completed");
    let bad = page("/?outcome=maybe");
    let _ = child.kill();
    let _ = child.wait();
    assert!(list.contains("done: cannot_complete"), "{list}");
    let rows = |html: &str| -> Vec<String> {
        html.split("href=\"/tasks/")
            .skip(1)
            .filter_map(|s| s.split('"').next().map(str::to_string))
            .collect()
    };
    assert_eq!(rows(&gave_up), ["t1"], "{gave_up}");
    assert_eq!(rows(&completed), ["t2"], "{completed}");
    assert!(
        gave_up.contains("<option value=\"cannot_complete\" selected>"),
        "{gave_up}"
    );
    assert!(bad.contains("&#34;maybe&#34; is not an outcome"), "{bad}");
    assert!(
        task.contains("id=\"task-outcome\">cannot_complete")
            && task.contains("the order does not exist"),
        "{task}"
    );
    // The answer comes first on the task's page, before the stop reason and the rest.
    let answer_at = task
        .find("id=\"task-answer\"")
        .expect("the answer is shown");
    assert!(
        answer_at < task.find("id=\"task-stop\"").expect("the stop"),
        "{task}"
    );
}

conformance! {
    /// Issue 52: a daemon whose environment lacks one profile's key variable starts, says so
    /// naming the variable, and passes over only that profile's tasks: they stay queued in
    /// their place (nothing ended, nothing lost) while the others run, and a drain does not
    /// wait for them; a daemon that has the key runs them.
    fn a_missing_key_passes_over_only_its_profiles_tasks(d) {
        std::fs::write(
            d.join("worker.toml"),
            format!(
                "[models.agent]\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"gpt-4o\"\napi_key_env = \"{KEY_VAR}\"\n"
            ),
        )
        .expect("config");
        let enqueue = |model: &str| {
            let out = command(d)
                .args(["--config", "worker.toml", "enqueue", "--user", "cu_ana"])
                .args(["--goal", "look into order ord_1004", "--model", model])
                .env(KEY_VAR, KEY)
                .output()
                .expect("enqueue");
            succeeded(out, &["enqueue"]).trim().to_string()
        };
        let agent = enqueue("agent");
        let demo = enqueue("policy:ord_1004:3000:0");
        let out = command(d)
            .args(["--config", "worker.toml", "run", "--drain"])
            .env_remove(KEY_VAR)
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(
            err.contains(&format!(
                "model profile agent: the API key variable {KEY_VAR} is not set; this daemon does not run the profile's tasks"
            )),
            "said at start: {err}"
        );
        assert!(err.contains("left queued for a daemon that has their model profile's key"), "{err}");
        let show = |id: &str| {
            let out = command(d).args(["--config", "worker.toml", "show", id, "--json"]).output().expect("show");
            serde_json::from_str::<Value>(&succeeded(out, &["show"])).expect("json")
        };
        let t = show(&agent);
        assert_eq!(t["status"], "queued", "passed over, not ended: {t}");
        assert_eq!(t["runs"], 0, "never claimed: {t}");
        assert_eq!(show(&demo)["stop"], "done", "the other task ran");
        // With the key, the profile's task is claimed (its endpoint is down: it ends on the
        // model's failure, which is the daemon trying it).
        let out = command(d)
            .args(["--config", "worker.toml", "run", "--drain"])
            .env(KEY_VAR, KEY)
            .output()
            .expect("run");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let t = show(&agent);
        assert_eq!(t["runs"], 1, "{t}");
        assert_ne!(t["status"], "queued", "{t}");
    }
}

/// Issue 52: a model that stumbles once (a reply cut off at the output limit) and then reads
/// new data (the policy, three questions, a tool without fact_fields) is making progress: each
/// successful read the task had not made before counts, so the task is not stopped
/// `no_progress` with the default stalls_max of 3; a read repeated with the same arguments
/// still counts as nothing new.
#[test]
fn reads_of_new_data_are_progress_for_a_real_model() {
    let Some(py) = python() else { return };
    let search = |q: &str| json!({"call": "search_policy", "args": {"q": q}});
    let cut =
        json!({"finish": "length", "call": "get_order", "raw_args": "{\"order_id\": \"ord_10"});
    let (t, _, _) = zoo_case(
        &py,
        "new-reads",
        &[
            cut.clone(),
            search("refunds for damaged items"),
            search("refund time limits"),
            search("who pays return shipping"),
            final_answer(),
        ],
        "",
        &[],
    );
    assert_eq!(t["stop"], "done", "{t}");
    // The same read again and again is no progress: three stalls in a row stop it.
    let (t, _, _) = zoo_case(
        &py,
        "same-reads",
        &[
            cut,
            search("refunds for damaged items"),
            search("refunds for damaged items"),
            search("refunds for damaged items"),
            search("refunds for damaged items"),
            final_answer(),
        ],
        "",
        // (Not stopped first as a repeated call.)
        &["--budget", "repeat_max=5"],
    );
    assert_eq!(t["stop"], "no_progress", "{t}");
}

/// Issue 52, the zoo as one table: a model that stumbles once in each way a real provider's
/// model does (prose without a call, arguments that are not JSON, a reply cut off at the
/// output limit, a refusal, a plan naming tools that do not exist) and then reads new data
/// (three reads of a tool without fact_fields) ends `done`, never `no_progress`; a model
/// that keeps stumbling ends with its cause in plain words in `worker show`.
#[test]
fn the_zoo_recovers_from_each_stumble_and_names_the_cause_when_it_does_not() {
    let Some(py) = python() else { return };
    let search = |q: &str| json!({"call": "search_policy", "args": {"q": q}});
    let stumbles = [
        ("prose", json!({"text": "I will look into the order now."})),
        (
            "bad-json",
            json!({"call": "get_order", "raw_args": "{order_id: ord_1001"}),
        ),
        (
            "cut-off",
            json!({"finish": "length", "call": "get_order", "raw_args": "{\"order_id\": \"ord_10"}),
        ),
        ("refusal", json!({"refusal": "I can't help with that."})),
        (
            "unknown-tools",
            json!({"call": "propose_plan", "args": {"steps": [
            {"id": "s1", "tool": "lookup_customer", "depends_on": []}]}}),
        ),
    ];
    for (name, stumble) in &stumbles {
        let script = [
            stumble.clone(),
            search("refunds for damaged items"),
            search("refund time limits"),
            search("who pays return shipping"),
            final_answer(),
        ];
        let (t, _, _) = zoo_case(&py, name, &script, "", &[]);
        assert_eq!(t["stop"], "done", "{name}: {t}");
        assert_eq!(t["state"]["outcome"], "completed", "{name}: {t}");
    }
    // A model that only ever stumbles: the stop's cause says how, in words.
    for (name, stumble, words) in [
        ("prose-only", &stumbles[0].1, "text without a function call"),
        ("bad-json-only", &stumbles[1].1, "not a JSON object"),
        ("unknown-tools-only", &stumbles[4].1, "lookup_customer"),
    ] {
        let (t, _, pm) = zoo_case(&py, name, std::slice::from_ref(stumble), "", &[]);
        assert_ne!(t["stop"], "done", "{name}: {t}");
        let cause = t["cause"].as_str().unwrap_or_default();
        assert!(
            cause.contains(words),
            "{name}: the cause {cause:?} names {words:?}"
        );
        let closing = t["closing_message"].as_str().unwrap_or_default();
        assert!(closing.contains(words), "{name}: {closing}");
        assert!(!pm.starts_with('{'), "postmortem is text: {pm}");
    }
}
