//! Tools that a plain REST API serves, with the result contract of `docs/tools.md`: a service
//! of the test's own answers the way REST services do (201 with an id, a problem-details 400,
//! a 404, 503 before doing anything, 429 with `Retry-After`), keeps a log of every arrival,
//! and the tasks end as the contract says: a read and an idempotent write are tried again
//! under the same key until they land, a non-idempotent write is sent once and held, and a
//! refusal reaches the model with the service's own code and words.

use crate::common;
use common::*;

use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One request the service received: its path, its Idempotency-Key, what it answered, and when
/// (milliseconds since the service started).
#[derive(Clone, Debug)]
struct Arrival {
    path: String,
    key: String,
    answered: u16,
    at_ms: u128,
}

/// The REST service: `POST /customers/lookup` fails once with 503, then answers 200 with the
/// customer (whose own `status` is `active`); `POST /tickets` answers each new key 503 (before
/// doing anything), then 429 with `Retry-After: 1`, then creates the ticket (201 with its id)
/// and answers a repeat of the key with the same ticket (200); `POST /notes` is down (503);
/// `POST /tickets/bad` refuses with an RFC 9457 problem; anything else is a 404.
struct Service {
    url: String,
    log: Arc<Mutex<Vec<Arrival>>>,
    tickets: Arc<Mutex<BTreeMap<String, String>>>,
}

fn service() -> Service {
    let server = tiny_http::Server::http("127.0.0.1:0").expect("bind the service");
    let url = format!("http://{}", server.server_addr());
    let log = Arc::new(Mutex::new(Vec::<Arrival>::new()));
    let tickets = Arc::new(Mutex::new(BTreeMap::<String, String>::new()));
    let (log2, tickets2) = (Arc::clone(&log), Arc::clone(&tickets));
    let started = Instant::now();
    std::thread::spawn(move || {
        for mut req in server.incoming_requests() {
            let mut body = String::new();
            let _ = req.as_reader().read_to_string(&mut body);
            let path = req.url().to_string();
            let key = idempotency_key(&req).unwrap_or_default();
            let mut log = log2.lock().expect("lock");
            let earlier = log
                .iter()
                .filter(|a| a.path == path && a.key == key)
                .count();
            let mut headers = vec![("Content-Type", "application/json".to_string())];
            let (status, answer) = match path.as_str() {
                "/customers/lookup" if earlier == 0 => (503, "upstream unavailable".to_string()),
                "/customers/lookup" => (
                    200,
                    json!({"id": "C-7", "name": "Ana", "status": "active"}).to_string(),
                ),
                "/tickets" => {
                    let mut tickets = tickets2.lock().expect("lock");
                    if let Some(id) = tickets.get(&key) {
                        (200, json!({"id": id, "created": false}).to_string())
                    } else if earlier == 0 {
                        (503, "{\"message\": \"try again\"}".to_string())
                    } else if earlier == 1 {
                        headers.push(("Retry-After", "1".to_string()));
                        (429, "{\"message\": \"slow down\"}".to_string())
                    } else {
                        let id = format!("T-{}", tickets.len() + 1);
                        tickets.insert(key.clone(), id.clone());
                        (201, json!({"id": id, "created": true}).to_string())
                    }
                }
                "/refunds" => {
                    let mut tickets = tickets2.lock().expect("lock");
                    let n = tickets.len() + 1;
                    let id = tickets
                        .entry(key.clone())
                        .or_insert(format!("R-{n}"))
                        .clone();
                    (201, json!({"id": id}).to_string())
                }
                // The Idempotency-Key draft's "request in progress": the key's first try is
                // still being processed when the second arrives.
                "/orders" if earlier == 0 => (
                    409,
                    json!({"code": "request_in_progress", "message": "this key is being processed"})
                        .to_string(),
                ),
                "/orders" => (201, json!({"id": "O-1"}).to_string()),
                "/notes" | "/memos" => (503, "down for maintenance".to_string()),
                // The notes service's lookup: the note was made, in its own words.
                p if p.starts_with("/lookup?") => (
                    200,
                    json!({"applied": true, "result": {"id": "N-1", "status": "open"}}).to_string(),
                ),
                // A read whose own `status` is a word of the service's domain.
                "/applications" => (200, json!({"id": "A-1", "status": "rejected"}).to_string()),
                // A read whose first answer is a 503 with a body over the result limit.
                "/reports" if earlier == 0 => (503, "x".repeat(1100 << 10)),
                "/reports" => (200, json!({"id": "R-1"}).to_string()),
                "/tickets/bad" => {
                    headers[0].1 = "application/problem+json".into();
                    (
                        400,
                        json!({"type": "https://tickets.example/problems/invalid-severity",
                            "title": "Invalid severity", "status": 400,
                            "detail": "severity must be one of low, normal, high"})
                        .to_string(),
                    )
                }
                _ => (404, String::new()),
            };
            log.push(Arrival {
                path,
                key,
                answered: status,
                at_ms: started.elapsed().as_millis(),
            });
            drop(log);
            let mut resp = tiny_http::Response::from_string(answer).with_status_code(status);
            for (k, v) in headers {
                resp = resp.with_header(
                    tiny_http::Header::from_bytes(k.as_bytes(), v.as_bytes()).expect("header"),
                );
            }
            let _ = req.respond(resp);
        }
    });
    Service { url, log, tickets }
}

impl Service {
    fn arrivals(&self, path: &str) -> Vec<Arrival> {
        let log = self.log.lock().expect("lock");
        log.iter().filter(|a| a.path == path).cloned().collect()
    }
}

/// The catalog of the service's tools, and a config that names it.
fn setup(d: &Path, url: &str) {
    let tool = |name: &str, access: &str, idempotent: bool, path: &str, args: &str| {
        let lookup = if path == "/notes" {
            format!(", lookup_url = \"{url}/lookup\"")
        } else {
            String::new()
        };
        format!(
            "[[tools]]\nname = \"{name}\"\naccess = \"{access}\"\nidempotent = {idempotent}\n\
             fact_fields = [\"id\", \"service_status\"]\nfact_prefix_arg = \"customer_id\"\n\
             http = {{ url = \"{url}{path}\", timeout_ms = 5000{lookup}, retry = {{ attempts = 4, backoff_ms = 50, max_backoff_ms = 2000 }} }}\n\
             args.customer_id = {{ type = \"string\", required = true }}\n{args}\n"
        )
    };
    let catalog = [
        "version = 1\n".to_string(),
        tool("lookup_customer", "read", true, "/customers/lookup", ""),
        tool(
            "create_ticket",
            "write",
            true,
            "/tickets",
            "args.title = { type = \"string\", required = true }\n",
        ),
        tool(
            "add_note",
            "write",
            false,
            "/notes",
            "args.text = { type = \"string\", required = true }\n",
        ),
        tool(
            "create_bad_ticket",
            "write",
            true,
            "/tickets/bad",
            "args.severity = { type = \"string\", required = true }\n",
        ),
        tool("find_invoice", "read", true, "/invoices/find", ""),
        tool(
            "add_memo",
            "write",
            false,
            "/memos",
            "args.text = { type = \"string\", required = true }\n",
        ),
        tool("get_application", "read", true, "/applications", ""),
        tool("place_order", "write", true, "/orders", ""),
        tool("get_report", "read", true, "/reports", ""),
        tool(
            "refund_customer",
            "write",
            true,
            "/refunds",
            "args.amount = { type = \"integer\", required = true }\napproval = { above = { amount = 100 } }\n",
        ),
    ]
    .concat();
    std::fs::write(d.join("tools.toml"), catalog).expect("catalog");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
}

fn worker_c(d: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(bin())
        .args(["--config", "worker.toml"])
        .args(args)
        .current_dir(d)
        .env_remove("WORKER_DB")
        .env_remove("WORKER_CONFIG")
        .output()
        .expect("run worker")
}

fn okc(d: &Path, args: &[&str]) -> String {
    succeeded(worker_c(d, args), args)
}

fn jsonc(d: &Path, args: &[&str]) -> Value {
    serde_json::from_str(&okc(d, args)).expect("JSON")
}

/// Enqueues a task whose model is the script `moves` (one JSON move a line).
fn task(d: &Path, name: &str, moves: &[Value]) -> String {
    let lines: Vec<String> = moves.iter().map(Value::to_string).collect();
    std::fs::write(d.join(format!("{name}.jsonl")), lines.join("\n")).expect("script");
    let model = format!("script:{name}.jsonl");
    okc(
        d,
        &[
            "enqueue", "--user", "cu_ana", "--goal", name, "--model", &model,
        ],
    )
    .trim()
    .to_string()
}

fn plan(write: &str) -> Value {
    json!({"type": "plan", "steps": [{"id": "s1", "tool": "lookup_customer"},
        {"id": "s2", "tool": write, "depends_on": ["s1"]}]})
}

fn call(name: &str, step: &str, args: Value) -> Value {
    json!({"type": "tool", "name": name, "plan_step": step, "args": args})
}

fn done() -> Value {
    json!({"type": "final", "outcome": "completed", "text": "done"})
}

/// Must-show 1: a 503 on a read and on an idempotent write, and a 429 with `Retry-After`,
/// end `done`, each effect once, every try under the call's one key; the waits are the
/// service's, the tries are not the model's tool calls, and the replay needs no service.
#[test]
fn transient_failures_are_tried_again_under_the_same_key_until_they_land() {
    let dir = TempDir::new("rest-retry");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let id = task(
        d,
        "ticket",
        &[
            plan("create_ticket"),
            call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
            call(
                "create_ticket",
                "s2",
                json!({"customer_id": "cu_ana", "title": "Refund not received"}),
            ),
            done(),
        ],
    );
    okc(d, &["run", "--drain"]);
    // The demo shop is one route among three, opened only when a task calls one of its
    // tools: this daemon's only task calls HTTP tools.
    assert!(
        !d.join("worker.store.redb").exists(),
        "the daemon opened the demo shop for a task that never calls it"
    );
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    // The lookup: a 503, then the customer; its own `status` is kept as `service_status`.
    let lookups: Vec<u16> = svc
        .arrivals("/customers/lookup")
        .iter()
        .map(|a| a.answered)
        .collect();
    assert_eq!(lookups, [503, 200]);
    assert_eq!(
        t["state"]["facts"]["cu_ana.service_status"], "active",
        "{t}"
    );
    // The ticket: 503, 429, then created once, all under one key; the try after the 429
    // waited the second it asked for.
    let tickets = svc.arrivals("/tickets");
    let answered: Vec<u16> = tickets.iter().map(|a| a.answered).collect();
    assert_eq!(answered, [503, 429, 201], "{tickets:?}");
    assert!(
        tickets
            .iter()
            .all(|a| a.key == tickets[0].key && !a.key.is_empty())
    );
    assert!(
        tickets[0].key.ends_with(&format!(":{id}:s2")),
        "{tickets:?}"
    );
    assert!(
        tickets[2].at_ms - tickets[1].at_ms >= 1000,
        "Retry-After: 1 was honoured: {tickets:?}"
    );
    assert_eq!(svc.tickets.lock().expect("lock").len(), 1);
    // A 201's body is the result: its id is a fact.
    assert_eq!(t["state"]["facts"]["cu_ana.id"], "T-1", "{t}");
    // Two tool calls of the budget (the model's), not five (the tries).
    assert_eq!(t["tool_calls"], 2, "{t}");
    // The replay answers from what the run recorded: no service needed, same state.
    let r = jsonc(d, &["replay", &id, "--json"]);
    assert_eq!(r["same_state"], true, "{r}");
    assert_eq!(r["tool_answers"], "recorded", "{r}");
    // What the tries were is in the metrics a daemon serves; here, in the arrivals log.
    assert_eq!(svc.arrivals("/tickets").len(), 3, "the replay sent nothing");
}

/// A write that is not idempotent is sent once: a 503 leaves its outcome unknown, and the task
/// is held for an operator, not tried again.
#[test]
fn a_write_that_is_not_idempotent_is_sent_once_and_held() {
    let dir = TempDir::new("rest-held");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let id = task(
        d,
        "note",
        &[
            plan("add_note"),
            call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
            call(
                "add_note",
                "s2",
                json!({"customer_id": "cu_ana", "text": "called back"}),
            ),
            done(),
        ],
    );
    // The daemon would settle it by the lookup (tests/settle.rs): here an operator does.
    okc(d, &["run", "--drain", "--no-auto-settle"]);
    okc(d, &["run", "--drain", "--no-auto-settle"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "unknown_outcome", "{t}");
    assert_eq!(svc.arrivals("/notes").len(), 1, "sent once");
    assert_eq!(t["state"]["pending"]["name"], "add_note", "{t}");
    // A result that says the write is still unknown (or waits, or was rejected) is no
    // settlement: the task would hold it again.
    for status in ["unknown", "needs_approval", "rejected"] {
        let result = format!("{{\"status\": \"{status}\"}}");
        let out = worker_c(
            d,
            &[
                "reconcile",
                &id,
                "--applied",
                "--result",
                &result,
                "--by",
                "bob",
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("cannot have status"),
            "{status}: {err}"
        );
    }
    // A bad --by or --reason is a usage error before anything is asked of the tool (review
    // 48: the lookup went out first, and the verb then exited 1).
    let lookups = || {
        svc.log
            .lock()
            .expect("lock")
            .iter()
            .filter(|a| a.path.starts_with("/lookup"))
            .count()
    };
    let long = "r".repeat(1025);
    for bad in [
        vec!["--by", ""],
        vec!["--by", "bob\u{7}"],
        vec!["--by", "bob", "--reason", long.as_str()],
    ] {
        let mut args = vec!["reconcile", id.as_str(), "--applied"];
        args.extend_from_slice(&bad);
        let out = worker_c(d, &args);
        assert_eq!(
            out.status.code(),
            Some(2),
            "{bad:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(lookups(), 0, "no lookup was sent for a refused decision");
    // Settled as applied without --result: the tool's lookup gives what it returned, read
    // under the contract of a live answer (its own `status` kept as `service_status`).
    okc(d, &["reconcile", &id, "--applied", "--by", "bob"]);
    assert_eq!(lookups(), 1);
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["facts"]["cu_ana.id"], "N-1", "{t}");
    assert_eq!(t["state"]["facts"]["cu_ana.service_status"], "open", "{t}");
    assert_eq!(svc.arrivals("/notes").len(), 1, "never sent again");
    // A tool without a lookup: `--result` is required rather than a bare `ok` the model
    // would take for the result.
    let memo = task(
        d,
        "memo",
        &[
            plan("add_memo"),
            call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
            call(
                "add_memo",
                "s2",
                json!({"customer_id": "cu_ana", "text": "hi"}),
            ),
            done(),
        ],
    );
    okc(d, &["run", "--drain"]);
    let out = worker_c(d, &["reconcile", &memo, "--applied", "--by", "bob"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--applied needs the write's result"), "{err}");
    assert_eq!(
        jsonc(d, &["show", &memo, "--json"])["stop"],
        "unknown_outcome"
    );
}

/// Review findings: a read's own `status` (`rejected`, `unknown`) is the service's word, not
/// a Tether status, so a read is never held or failed by it; and an error answer whose body is
/// over the limit is still told by its status (a 503 is retried).
#[test]
fn a_reads_own_status_and_an_oversized_error_are_read_by_the_contract() {
    let dir = TempDir::new("rest-reads");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let id = task(
        d,
        "reads",
        &[
            call("get_application", "s1", json!({"customer_id": "cu_ana"})),
            call("get_report", "s1", json!({"customer_id": "cu_ana"})),
            done(),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(
        t["state"]["facts"]["cu_ana.service_status"], "rejected",
        "{t}"
    );
    assert_eq!(t["state"]["facts"]["cu_ana.id"], "R-1", "{t}");
    let reports: Vec<u16> = svc
        .arrivals("/reports")
        .iter()
        .map(|a| a.answered)
        .collect();
    assert_eq!(reports, [503, 200]);
}

/// A refusal (a 4xx other than 408, 409, 425 and 429) is an error the model sees, with the
/// service's code and words: an RFC 9457 problem's type and detail, a bare 404's `not_found`.
/// It is not tried again.
#[test]
fn a_refusal_reaches_the_model_with_the_services_code_and_words() {
    let dir = TempDir::new("rest-refused");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let bad = task(
        d,
        "bad",
        &[
            plan("create_bad_ticket"),
            call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
            call(
                "create_bad_ticket",
                "s2",
                json!({"customer_id": "cu_ana", "severity": "urgent"}),
            ),
            json!({"type": "final", "outcome": "cannot_complete", "text": "refused"}),
        ],
    );
    let missing = task(
        d,
        "missing",
        &[
            call("find_invoice", "s1", json!({"customer_id": "cu_ana"})),
            json!({"type": "final", "outcome": "cannot_complete", "text": "no invoice"}),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &bad, "--json"]);
    let r = &t["state"]["last_result"];
    assert_eq!(r["status"], "error", "{t}");
    assert_eq!(r["code"], "invalid-severity", "{t}");
    assert_eq!(r["http_status"], 400, "{t}");
    assert_eq!(
        r["detail"], "severity must be one of low, normal, high",
        "{t}"
    );
    assert_eq!(
        svc.arrivals("/tickets/bad").len(),
        1,
        "a refusal is not tried again"
    );
    let t = jsonc(d, &["show", &missing, "--json"]);
    assert_eq!(t["state"]["last_result"]["code"], "not_found", "{t}");
    assert_eq!(svc.arrivals("/invoices/find").len(), 1);
}

/// Must-show 2 on the HTTP route: the catalog's approval rule (`above = { amount = 100 }`)
/// holds a call over the bound before anything is sent, and the approved call then arrives
/// once; a call under the bound runs without waiting. The service verifies nothing itself.
#[test]
fn the_catalogs_approval_rule_holds_a_write_before_it_is_sent() {
    let dir = TempDir::new("rest-approval");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let refund = |name: &str, amount: i64| {
        task(
            d,
            name,
            &[
                plan("refund_customer"),
                call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
                call(
                    "refund_customer",
                    "s2",
                    json!({"customer_id": "cu_ana", "amount": amount}),
                ),
                done(),
            ],
        )
    };
    let small = refund("small", 50);
    let large = refund("large", 500);
    okc(d, &["run", "--drain"]);
    assert_eq!(jsonc(d, &["show", &small, "--json"])["stop"], "done");
    let t = jsonc(d, &["show", &large, "--json"]);
    assert_eq!(t["stop"], "needs_approval", "{t}");
    assert_eq!(t["state"]["last_result"]["code"], "approval_rule", "{t}");
    // The held call went nowhere: only the lookup counts as a tool call so far.
    assert_eq!(t["state"]["tool_calls"], 1, "{t}");
    let arrived = svc.arrivals("/refunds");
    assert_eq!(
        arrived.len(),
        1,
        "only the small refund was sent: {arrived:?}"
    );
    assert!(
        arrived[0].key.contains(&format!(":{small}:")),
        "{arrived:?}"
    );
    let digest = held_digest(d, &large);
    okc(d, &["approve", &large, "--digest", &digest, "--by", "ana"]);
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &large, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(
        t["state"]["tool_calls"], 2,
        "the refund counted once, when sent: {t}"
    );
    let arrived = svc.arrivals("/refunds");
    assert_eq!(arrived.len(), 2, "{arrived:?}");
    assert!(
        arrived[1].key.contains(&format!(":{large}:s2")),
        "{arrived:?}"
    );
    assert_eq!(t["state"]["facts"]["cu_ana.id"], "R-2", "{t}");
    let r = jsonc(d, &["replay", &large, "--json"]);
    assert_eq!(r["same_state"], true, "{r}");
}

/// A rule that cannot work is refused when the catalog is read, naming the tool or the line.
#[test]
fn an_approval_rule_that_cannot_work_is_refused() {
    let dir = TempDir::new("rest-approval-bad");
    let d = dir.path();
    for (rule, says) in [
        ("approval = \"sometimes\"", "approval must be"),
        (
            "approval = { above = { title = 5 } }",
            "not an integer or number argument",
        ),
        (
            "approval = { above = { amount = \"x\" } }",
            "approval must be",
        ),
        // The same file's reading of a plan rule.
        (
            "requires = [\"lookup\"]",
            "which is not a tool of this catalog",
        ),
        ("requires = \"first\"", "requires must be"),
        ("requires = [\"pay\"]", "requires names the tool itself"),
    ] {
        let catalog = format!(
            "version = 1\n[[tools]]\nname = \"pay\"\naccess = \"write\"\n{rule}\n\
             http = {{ url = \"http://127.0.0.1:9/pay\" }}\n\
             args.title = {{ type = \"string\" }}\nargs.amount = {{ type = \"integer\" }}\n"
        );
        std::fs::write(d.join("tools.toml"), catalog).expect("catalog");
        std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n")
            .expect("config");
        std::fs::write(d.join("s.jsonl"), done().to_string()).expect("script");
        let out = worker_c(
            d,
            &[
                "enqueue",
                "--user",
                "u",
                "--goal",
                "g",
                "--model",
                "script:s.jsonl",
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{rule}");
        // Named by the tool, or (a value TOML cannot read) by its line.
        assert!(
            err.contains(says) && (err.contains("\"pay\"") || err.contains("line 5")),
            "{rule}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// Must-show 4, the newcomer's sequence: a lookup, a refund held by the catalog's rule and
/// rejected, a retry of the failed step refused (its key is spent), a revised plan with a new
/// step, the smaller refund sent under the new step's key, and `done` with the refund.
#[test]
fn a_rejected_write_is_retried_with_other_arguments_in_a_revised_plan() {
    let dir = TempDir::new("rest-revise");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let refund = |step: &str, amount: i64| {
        call(
            "refund_customer",
            step,
            json!({"customer_id": "cu_ana", "amount": amount}),
        )
    };
    let id = task(
        d,
        "revise",
        &[
            plan("refund_customer"),
            // Before its prerequisite: refused, nothing sent.
            refund("s2", 80),
            call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
            refund("s2", 500),
            // After the rejection: the failed step is not tried again.
            refund("s2", 70),
            json!({"type": "plan", "steps": [{"id": "s1", "tool": "lookup_customer"},
                {"id": "s3", "tool": "refund_customer", "depends_on": ["s1"]}]}),
            refund("s3", 80),
            done(),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "needs_approval", "{t}");
    assert!(svc.arrivals("/refunds").is_empty(), "nothing sent");
    // The early call made no tool span: only the lookup and the held refund did.
    let spans = jsonc(d, &["trace", &id, "--json"]);
    let tools: Vec<&str> = spans
        .as_array()
        .expect("spans")
        .iter()
        .filter(|s| s["kind"] == "tool")
        .filter_map(|s| s["name"].as_str())
        .collect();
    assert_eq!(tools, ["lookup_customer", "refund_customer"], "{spans}");
    // What the model is told of a call before its prerequisite, and of a failed step.
    let lines = [plan("refund_customer"), refund("s2", 80)].map(|m| m.to_string());
    std::fs::write(d.join("early.jsonl"), lines.join("\n")).expect("script");
    let early = okc(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "early",
            "--model",
            "script:early.jsonl",
            "--budget",
            "steps_max=2",
        ],
    )
    .trim()
    .to_string();
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &early, "--json"]);
    assert_eq!(
        t["state"]["last_result"]["code"], "prerequisite_not_done",
        "{t}"
    );
    assert!(
        t["state"]["last_result"]["detail"]
            .as_str()
            .is_some_and(|d| d.contains("depends on s1 (pending)")),
        "{t}"
    );
    okc(d, &["reject", &id, "--by", "ana", "--reason", "too much"]);
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["outcome"], "completed", "{t}");
    assert_eq!(t["state"]["replans"], 1, "{t}");
    let plan: Vec<(String, String)> = t["state"]["plan"]
        .as_array()
        .expect("plan")
        .iter()
        .map(|s| {
            (
                s["id"].as_str().unwrap_or("").into(),
                s["status"].as_str().unwrap_or("").into(),
            )
        })
        .collect();
    assert_eq!(
        plan,
        [("s1".into(), "done".into()), ("s3".into(), "done".into())]
    );
    let arrived = svc.arrivals("/refunds");
    assert_eq!(arrived.len(), 1, "one refund, the revised one: {arrived:?}");
    assert!(
        arrived[0].key.ends_with(&format!(":{id}:s3")),
        "a new key: {arrived:?}"
    );
    assert_eq!(t["state"]["facts"]["cu_ana.id"], "R-1", "{t}");
}

/// The completion check without a plan: a write refused (here: it names no plan step) keeps
/// `completed` from being accepted; `cannot_complete` ends the task. And revisions are
/// bounded: past `replans_max` a revision is refused, and a model that keeps revising ends.
#[test]
fn a_refused_write_blocks_completed_and_revisions_are_bounded() {
    let dir = TempDir::new("rest-complete");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let id = task(
        d,
        "no-plan",
        &[
            call(
                "create_ticket",
                "",
                json!({"customer_id": "cu_ana", "title": "jacket"}),
            ),
            done(),
            json!({"type": "final", "outcome": "cannot_complete", "text": "no ticket"}),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(
        t["outcome"], "cannot_complete",
        "completed was refused: {t}"
    );
    assert!(svc.arrivals("/tickets").is_empty());

    let revise = json!({"type": "plan", "steps": [{"id": "s1", "tool": "lookup_customer"}]});
    let moves: Vec<Value> = std::iter::once(plan("create_ticket"))
        .chain(std::iter::repeat_n(revise, 7))
        .collect();
    let lines: Vec<String> = moves.iter().map(Value::to_string).collect();
    std::fs::write(d.join("revise.jsonl"), lines.join("\n")).expect("script");
    let looping = okc(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "loop",
            "--model",
            "script:revise.jsonl",
            "--budget",
            "replans_max=1",
            "--budget",
            "steps_max=20",
        ],
    )
    .trim()
    .to_string();
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &looping, "--json"]);
    assert_eq!(t["state"]["replans"], 1, "{t}");
    assert_eq!(t["stop"], "no_progress", "ended bounded: {t}");
    assert!(
        t["state"]["last_result"]["detail"]
            .to_string()
            .contains("replans_max = 1"),
        "{t}"
    );
}

/// Must-show 2, the demo route: `[demo.tools.issue_refund]` gives the demo shop's refund an
/// approval rule. A refund over the bound (under the shop's own limit) is held before it is
/// sent, and sent once after its approval; one under the bound runs without waiting.
#[test]
fn an_approval_rule_holds_a_demo_shop_write_before_it_is_sent() {
    let dir = TempDir::new("demo-approval");
    let d = dir.path();
    std::fs::write(
        d.join("worker.toml"),
        "[demo.tools.issue_refund]\napproval = { above = { amount_cents = 2000 } }\n",
    )
    .expect("config");
    let enqueue = |model: &str, scope: &str| {
        okc(
            d,
            &[
                "enqueue",
                "--user",
                "cu_ana",
                "--goal",
                common::GOAL,
                "--model",
                model,
                "--store-scope",
                scope,
            ],
        )
        .trim()
        .to_string()
    };
    let large = enqueue("policy:ord_1001:3000", "a");
    let small = enqueue("policy:ord_1001:1500", "b");
    okc(d, &["run", "--drain"]);
    assert_eq!(jsonc(d, &["show", &small, "--json"])["stop"], "done");
    let t = jsonc(d, &["show", &large, "--json"]);
    assert_eq!(t["stop"], "needs_approval", "{t}");
    assert_eq!(t["state"]["last_result"]["code"], "approval_rule", "{t}");
    assert_eq!(refund_amounts(&ledger(d)), [1500], "only the small refund");
    let digest = held_digest(d, &large);
    okc(d, &["approve", &large, "--digest", &digest, "--by", "ana"]);
    okc(d, &["run", "--drain"]);
    assert_eq!(jsonc(d, &["show", &large, "--json"])["stop"], "done");
    assert_eq!(
        refund_amounts(&ledger(d)),
        [1500, 3000],
        "sent once, after it"
    );
}

/// `worker tools list` shows the whole catalog: the catalog's HTTP tools, each with its kind,
/// approval rule and retry policy (and the demo shop's only without a catalog of one's own).
#[test]
fn tools_list_shows_the_whole_catalog() {
    let dir = TempDir::new("rest-tools-list");
    let d = dir.path();
    setup(d, "http://127.0.0.1:9");
    let rows = jsonc(d, &["tools", "list", "--json"]);
    let row = |name: &str| {
        rows.as_array()
            .expect("rows")
            .iter()
            .find(|r| r["name"] == name)
            .cloned()
            .unwrap_or_else(|| panic!("no {name} in {rows}"))
    };
    // Issue 52: the demo shop's tools are not listed beside a catalog of one's own.
    assert!(
        rows.as_array()
            .expect("rows")
            .iter()
            .all(|r| r["source"] != "demo"),
        "{rows}"
    );
    let demo = json(d, &["tools", "list", "--json"]);
    let refund = demo
        .as_array()
        .expect("rows")
        .iter()
        .find(|r| r["name"] == "issue_refund")
        .expect("without a config, the demo shop's tools");
    assert_eq!(refund["source"], "demo");
    assert_eq!(refund["requires"], "any_step");
    let r = row("refund_customer");
    assert_eq!(r["source"], "http", "{r}");
    assert_eq!(r["access"], "write", "{r}");
    assert_eq!(r["approval"], json!({"above": {"amount": 100.0}}), "{r}");
    assert_eq!(r["retry"]["attempts"], 4, "{r}");
    assert_eq!(row("add_note")["auto_settle"], true);
    assert_eq!(row("add_memo")["auto_settle"], false, "no lookup_url");
    let table = okc(d, &["tools", "list"]);
    assert!(
        table.lines().any(|l| l.starts_with("http")
            && l.contains("refund_customer")
            && l.contains("{\"above\":{\"amount\":100.0}}")
            && l.contains("4 tries, 50-2000 ms")),
        "{table}"
    );
}

/// Review findings: a write's call key is never sent twice with other arguments. A service's
/// refusal spends the step's key (a retry needs a step of its own), a failed step's id stays
/// spent after a revision drops it, and a done step is not carried out again.
#[test]
fn a_call_key_is_never_sent_again_with_other_arguments() {
    let dir = TempDir::new("rest-key-reuse");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let lookup = call("lookup_customer", "s1", json!({"customer_id": "cu_ana"}));
    let bad = |step: &str, severity: &str| {
        call(
            "create_bad_ticket",
            step,
            json!({"customer_id": "cu_ana", "severity": severity}),
        )
    };
    let only_s1 = json!({"type": "plan", "steps": [{"id": "s1", "tool": "lookup_customer"}]});
    let id = task(
        d,
        "refused",
        &[
            plan("create_bad_ticket"),
            lookup.clone(),
            bad("s2", "urgent"),
            // The corrected call under the refused step's key: refused, nothing sent.
            bad("s2", "low"),
            only_s1,
            // Re-adding the dropped failed step's id: refused.
            plan("create_bad_ticket"),
            json!({"type": "final", "outcome": "cannot_complete", "text": "no ticket"}),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["replans"], 1, "{t}");
    assert_eq!(t["state"]["spent_steps"], json!(["s2"]), "{t}");
    let sent = svc.arrivals("/tickets/bad");
    assert_eq!(sent.len(), 1, "the refused call only: {sent:?}");

    let refund = |amount: i64| {
        call(
            "refund_customer",
            "s2",
            json!({"customer_id": "cu_ana", "amount": amount}),
        )
    };
    let again = task(
        d,
        "again",
        &[
            plan("refund_customer"),
            lookup,
            refund(50),
            refund(60),
            done(),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &again, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["outcome"], "completed", "{t}");
    let refunds: Vec<Arrival> = svc
        .arrivals("/refunds")
        .into_iter()
        .filter(|a| a.key.contains(&format!(":{again}:")))
        .collect();
    assert_eq!(
        refunds.len(),
        1,
        "a done step is not carried out again: {refunds:?}"
    );
}

/// A 409 while the key is in flight (the Idempotency-Key draft's "request in progress") is
/// waited out and tried again under the same key; the write lands once, and the service's own
/// code is kept in what the retry logged.
#[test]
fn a_key_in_flight_is_tried_again_under_the_same_key() {
    let dir = TempDir::new("rest-in-flight");
    let d = dir.path();
    let svc = service();
    setup(d, &svc.url);
    let id = task(
        d,
        "order",
        &[
            plan("place_order"),
            call("lookup_customer", "s1", json!({"customer_id": "cu_ana"})),
            call("place_order", "s2", json!({"customer_id": "cu_ana"})),
            done(),
        ],
    );
    okc(d, &["run", "--drain"]);
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["facts"]["cu_ana.id"], "O-1", "{t}");
    let tries = svc.arrivals("/orders");
    let answered: Vec<u16> = tries.iter().map(|a| a.answered).collect();
    assert_eq!(answered, [409, 201], "{tries:?}");
    assert_eq!(tries[0].key, tries[1].key, "one key: {tries:?}");
}

/// Issue 52: a write whose connection was refused sent nothing, so it is not held: the daemon
/// tries it again under its key (the tool is not idempotent), and once the service listens the
/// write lands once and the task ends `done`.
#[test]
fn a_refused_connection_on_a_write_is_tried_again_and_applied_once() {
    use std::io::{BufRead, BufReader};
    let dir = TempDir::new("rest-refused");
    let d = dir.path();
    // A port nobody listens on yet.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("a port")
        .local_addr()
        .expect("its address")
        .port();
    std::fs::write(
        d.join("tools.toml"),
        format!(
            "version = 1\n[[tools]]\nname = \"add_memo\"\naccess = \"write\"\nidempotent = false\n\
             http = {{ url = \"http://127.0.0.1:{port}/memos\", timeout_ms = 5000, \
             retry = {{ attempts = 10, backoff_ms = 200, max_backoff_ms = 1000 }} }}\n\
             args.text = {{ type = \"string\", required = true }}\n"
        ),
    )
    .expect("catalog");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
    let id = task(
        d,
        "memo",
        &[
            json!({"type": "plan", "steps": [{"id": "s1", "tool": "add_memo"}]}),
            call("add_memo", "s1", json!({"text": "call back"})),
            done(),
        ],
    );
    let mut daemon = std::process::Command::new(bin())
        .args(["--config", "worker.toml", "run", "--drain"])
        .current_dir(d)
        .env_remove("WORKER_DB")
        .env_remove("WORKER_CONFIG")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the daemon");
    let guard = KillOnDrop(daemon.id());
    // The service starts listening only once the daemon has found the port closed.
    let mut log = BufReader::new(daemon.stderr.take().expect("stderr"));
    let (mut line, mut seen) = (String::new(), String::new());
    loop {
        line.clear();
        let n = log.read_line(&mut line).expect("the daemon's log");
        seen.push_str(&line);
        assert!(
            n > 0,
            "the daemon ended before it tried the write again: {seen}"
        );
        if line.contains("trying again under the same key") {
            assert!(line.contains("connect"), "{line}");
            break;
        }
    }
    let arrivals = memo_service(port);
    // The rest of the log is drained so the daemon never blocks on it.
    std::thread::spawn(move || for _ in log.lines() {});
    let status = daemon.wait().expect("the daemon ends");
    // Reaped: its pid is no longer ours to signal.
    std::mem::forget(guard);
    assert!(status.success(), "the daemon exited {status}");
    let t = jsonc(d, &["show", &id, "--json"]);
    assert_eq!(t["stop"], "done", "{t}");
    let keys = arrivals.lock().expect("lock").clone();
    assert_eq!(keys.len(), 1, "the write arrived once: {keys:?}");
    assert!(!keys[0].is_empty(), "under its call key");
    assert!(t["state"]["pending"].is_null(), "nothing held: {t}");
}

/// A service at `port` that creates a memo (201) for each request; the keys that arrived.
fn memo_service(port: u16) -> Arc<Mutex<Vec<String>>> {
    let server = tiny_http::Server::http(format!("127.0.0.1:{port}")).expect("listen");
    let arrivals = Arc::new(Mutex::new(Vec::<String>::new()));
    let seen = Arc::clone(&arrivals);
    std::thread::spawn(move || {
        for req in server.incoming_requests() {
            let key = idempotency_key(&req).unwrap_or_default();
            seen.lock().expect("lock").push(key);
            let _ = req.respond(
                tiny_http::Response::from_string("{\"id\": \"m1\"}").with_status_code(201),
            );
        }
    });
    arrivals
}

/// Kills a process when dropped (a failing test leaves no daemon behind).
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: sending a signal to a pid has no memory effects.
        unsafe {
            libc::kill(self.0 as i32, libc::SIGKILL);
        }
    }
}
