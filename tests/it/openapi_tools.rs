//! Tools from an OpenAPI document, against a peer written by others: a FastAPI service
//! (`tests/openapi/service.py`) whose document FastAPI generates. A native-tool fake model
//! (the official SDKs' reply types) drives a task through a read, a create that needs an
//! operator's approval, an update and a delete, on both providers; the service's log of
//! arrivals shows each write once with its method, path, key and body, and path values that
//! try to climb the path stay inside their segment.

use crate::common::*;
use crate::models::{Fake, python, readme_block};

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

const API_KEY: &str = "desk-key-7";

/// The FastAPI service; killed when dropped.
struct Desk {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Drop for Desk {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Desk {
    fn start(py: &Path, dir: &Path) -> Desk {
        let log = dir.join("arrivals.jsonl");
        let mut child = Command::new(py)
            .arg(format!(
                "{}/tests/openapi/service.py",
                env!("CARGO_MANIFEST_DIR")
            ))
            .arg("--log")
            .arg(&log)
            .args(["--api-key", API_KEY])
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the FastAPI service");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("address");
        let url = line
            .trim()
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("service said {line:?}"))
            .to_string();
        // uvicorn serves once its startup is done: wait for the document.
        for _ in 0..100 {
            if ureq_get(&format!("{url}/openapi.json")).is_some() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Desk { child, url, log }
    }

    fn arrivals(&self) -> Vec<Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).expect("an arrival"))
            .collect()
    }
}

fn ureq_get(url: &str) -> Option<String> {
    let out = Command::new("curl").args(["-sf", url]).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into())
}

/// The catalog of README's "Run your own agent" (`# desk-tools.toml`), as written, with the
/// service's address: the document by its URL, the admin route left out, the key from the
/// environment, the create held for approval.
fn catalog(desk: &str) -> String {
    let text = readme_block("# desk-tools.toml");
    assert!(
        text.contains("http://127.0.0.1:8000/openapi.json"),
        "{text}"
    );
    text.replace("http://127.0.0.1:8000", desk)
}

fn setup(d: &Path, desk: &Desk, kind: &str, model_url: &str) {
    std::fs::write(d.join("tools.toml"), catalog(&desk.url)).expect("catalog");
    std::fs::write(
        d.join("worker.toml"),
        format!(
            "default_model = \"agent\"\n\n[models.agent]\nkind = \"{kind}\"\nbase_url = \"{model_url}\"\nmodel = \"gpt-4o\"\napi_key_env = \"DESK_MODEL_KEY\"\n\n[tools]\ncatalog = \"tools.toml\"\n"
        ),
    )
    .expect("config");
}

fn worker(d: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(["--config", "worker.toml"])
        .args(args)
        .current_dir(d)
        .env("DESK_MODEL_KEY", "sk-desk")
        .env("DESK_API_KEY", API_KEY)
        .env_remove("WORKER_DB")
        .env_remove("WORKER_STORE")
        .env_remove("WORKER_CONFIG")
        .output()
        .expect("run worker")
}

fn ok(d: &Path, args: &[&str]) -> String {
    succeeded(worker(d, args), args)
}

fn shown(d: &Path, task: &str) -> Value {
    let out = ok(d, &["show", task, "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}\n{out}"))
}

/// The model's moves: a plan, the read, the create (held, then approved), the update, the
/// delete, the answer; then a second task that tries to climb the path.
fn script() -> Vec<Value> {
    vec![
        json!({"call": "propose_plan", "args": {"steps": [
            {"id": "s1", "tool": "get_customer", "depends_on": []},
            {"id": "s2", "tool": "create_ticket", "depends_on": ["s1"]},
            {"id": "s3", "tool": "update_ticket", "depends_on": ["s2"]},
            {"id": "s4", "tool": "delete_ticket", "depends_on": ["s3"]}]}}),
        json!({"call": "get_customer", "args": {"customer_id": "cu_ana", "include_orders": true}}),
        json!({"call": "create_ticket", "args": {"customer_id": "cu_ana", "title": "Refund not received", "severity": "high"}}),
        json!({"call": "update_ticket", "args": {"ticket_id": "tk_1", "status": "closed"}}),
        json!({"call": "delete_ticket", "args": {"ticket_id": "tk_1"}}),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Opened, closed and removed tk_1."}}),
        json!({"call": "get_customer", "args": {"customer_id": "../admin"}}),
        json!({"call": "get_customer", "args": {"customer_id": "x/../../y"}}),
        json!({"call": "final_answer", "args": {"outcome": "cannot_complete", "text": "No such customer."}}),
    ]
}

/// Must-show 1 on one provider.
fn runs_against_the_fastapi_document(kind: &str) {
    let Some(py) = python() else { return };
    let has_fastapi = Command::new(&py)
        .args(["-c", "import fastapi, uvicorn"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_fastapi {
        missing(
            "FastAPI and uvicorn (target/mcp-venv)",
            "bash .ci/test installs them",
        );
        return;
    }
    let dir = TempDir::new(&format!("openapi-{kind}"));
    let d = dir.path();
    let desk = Desk::start(&py, d);
    let fake = Fake::start(&py, d, kind, &script());
    setup(d, &desk, kind, &format!("{}/v1", fake.url));
    ok(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "Open a ticket for Ana, then close and remove it.",
        ],
    );
    ok(d, &["run", "--drain"]);
    let t = shown(d, "t1");
    assert_eq!(
        t["status"], "suspended",
        "the create waits for approval: {t}"
    );
    assert!(
        desk.arrivals().iter().all(|a| a["method"] == "GET"),
        "nothing is written before the approval: {:?}",
        desk.arrivals()
    );
    let digest = t["held"]["digest"].as_str().expect("digest").to_string();
    ok(d, &["approve", "t1", "--digest", &digest, "--by", "alice"]);
    ok(d, &["run", "--drain"]);
    let t = shown(d, "t1");
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["state"]["outcome"], "completed", "{t}");
    assert_eq!(t["state"]["facts"]["get_customer.name"], "Ana", "{t}");
    assert_eq!(
        t["state"]["facts"]["create_ticket.ticket_id"], "tk_1",
        "{t}"
    );
    let arrivals = desk.arrivals();
    let line = |a: &Value| {
        format!(
            "{} {}",
            a["method"].as_str().unwrap(),
            a["raw_path"].as_str().unwrap()
        )
    };
    let lines: Vec<String> = arrivals.iter().map(line).collect();
    assert_eq!(
        lines,
        [
            "GET /customers/cu_ana",
            "POST /customers/cu_ana/tickets",
            "PATCH /tickets/tk_1",
            "DELETE /tickets/tk_1"
        ],
        "each call once: {arrivals:?}"
    );
    let (read, create, update, delete) = (&arrivals[0], &arrivals[1], &arrivals[2], &arrivals[3]);
    assert_eq!(read["query"], "include_orders=true");
    assert!(
        read["body"].is_null() && read["idempotency_key"].is_null(),
        "{read}"
    );
    assert_eq!(
        create["body"],
        json!({"title": "Refund not received", "severity": "high"})
    );
    assert_eq!(update["body"], json!({"status": "closed"}));
    assert!(delete["body"].is_null(), "{delete}");
    for w in [create, update, delete] {
        assert_eq!(
            w["content_type"].as_str().is_some(),
            !w["body"].is_null(),
            "{w}"
        );
        let key = w["idempotency_key"]
            .as_str()
            .unwrap_or_else(|| panic!("a write carries its key: {w}"));
        assert!(
            key.contains(":t1:"),
            "the call key of the task's step: {key}"
        );
    }
    assert!(
        arrivals.iter().all(|a| a["api_key"] == API_KEY),
        "the key from the daemon's environment"
    );
    // The model was shown the document's operations as functions, the key header never.
    let reqs = fake.requests();
    let tools = reqs[0]["body"]["tools"].to_string();
    for name in [
        "get_customer",
        "create_ticket",
        "update_ticket",
        "delete_ticket",
        "include_orders",
        "severity",
    ] {
        assert!(tools.contains(name), "{name} in {tools}");
    }
    for hidden in ["admin_reset", "X-API-Key", "idempotency-key"] {
        assert!(
            !tools.contains(hidden),
            "{hidden} offered to the model: {tools}"
        );
    }
    climbing_stays_in_its_segment(d, &desk, arrivals.len());
}

/// Path values that would climb reach the service percent-encoded under the operation's own
/// path; the admin route is never reached.
fn climbing_stays_in_its_segment(d: &Path, desk: &Desk, before: usize) {
    ok(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "Read the customer ../admin.",
        ],
    );
    ok(d, &["run", "--drain"]);
    let t = shown(d, "t2");
    assert_eq!(t["stop"], "done", "{t}");
    let arrivals = desk.arrivals();
    let paths: Vec<&str> = arrivals[before..]
        .iter()
        .map(|a| a["raw_path"].as_str().unwrap())
        .collect();
    assert_eq!(
        paths,
        ["/customers/..%2Fadmin", "/customers/x%2F..%2F..%2Fy"],
        "{arrivals:?}"
    );
    assert!(arrivals.iter().all(|a| a["raw_path"] != "/admin"));
}

#[test]
fn a_task_runs_against_a_fastapi_document_on_chat_completions() {
    runs_against_the_fastapi_document("openai");
}

#[test]
fn a_task_runs_against_a_fastapi_document_on_anthropic_messages() {
    runs_against_the_fastapi_document("anthropic");
}

/// A document, or an operation, that cannot be mapped is an error when the catalog is read,
/// naming the document, the operation and what is wrong; nothing starts.
#[test]
fn what_cannot_be_mapped_is_named_at_start() {
    let dir = TempDir::new("openapi-bad");
    let d = dir.path();
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
    let op = |id: &str, extra: Value| {
        let mut o = json!({"operationId": id, "responses": {"200": {"description": "ok"}}});
        o.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        o
    };
    let doc = |paths: Value| {
        json!({"openapi": "3.1.0", "info": {"title": "t", "version": "1"},
               "servers": [{"url": "http://127.0.0.1:9/api"}], "paths": paths,
               "components": {"schemas": {"Node": {"type": "object", "properties": {
                   "children": {"type": "array", "items": {"$ref": "#/components/schemas/Node"}}}}}}})
        .to_string()
    };
    let json_body = |schema: Value| json!({"requestBody": {"required": true, "content": {"application/json": {"schema": schema}}}});
    let cases: Vec<(String, &str, Vec<&str>)> = vec![
        (
            doc(
                json!({"/nodes": {"post": op("add_node", json_body(json!({"$ref": "#/components/schemas/Node"})))}}),
            ),
            "",
            vec!["\"add_node\" (POST /nodes)", "refers to itself"],
        ),
        (
            doc(
                json!({"/files": {"post": op("upload", json!({"requestBody": {"required": true, "content": {"multipart/form-data": {"schema": {}}}}}))}}),
            ),
            "",
            vec![
                "\"upload\"",
                "request body is not JSON",
                "multipart/form-data",
            ],
        ),
        (
            doc(
                json!({"/s": {"get": op("session", json!({"parameters": [{"name": "sid", "in": "cookie", "required": true, "schema": {"type": "string"}}]}))}}),
            ),
            "",
            vec!["\"session\"", "\"sid\" is in \"cookie\""],
        ),
        (
            doc(
                json!({"/a/{id}": {"get": op("read_a", json!({"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}]}))}}),
            ),
            "operations = [\"read_b\"]\n",
            vec![
                "no operation is called \"read_b\"",
                "its operations: read_a",
            ],
        ),
        (
            doc(json!({"/a": {"get": op("read_a", json!({}))}}))
                .replace(",\"servers\":[{\"url\":\"http://127.0.0.1:9/api\"}]", ""),
            "",
            vec!["set base_url"],
        ),
        (
            "openapi: 3.1.0\ninfo: {title: t}\n".to_string(),
            "",
            vec!["it is YAML"],
        ),
        // Options and exclusions must name operations.
        (
            doc(json!({"/a": {"get": op("read.a", json!({}))}})),
            "exclude = [\"read-a\"]\n",
            vec![
                "no operation is called \"read-a\"",
                "its operations: read.a",
            ],
        ),
        // Two operations that make one tool name.
        (
            doc(
                json!({"/a": {"get": op("get.item", json!({}))}, "/b": {"get": op("get_item", json!({}))}}),
            ),
            "",
            vec!["\"get.item\" and \"get_item\" both make the tool \"get_item\""],
        ),
        // The model never sets a header that frames the request.
        (
            doc(
                json!({"/a": {"get": op("read_a", json!({"parameters": [{"name": "Host", "in": "header", "required": true, "schema": {"type": "string"}}]}))}}),
            ),
            "",
            vec![
                "\"read_a\"",
                "the header \"Host\" is set by the worker or the connection",
            ],
        ),
        // A path whose template names no parameter, or that does not start with '/'.
        (
            doc(
                json!({"/a/{id}/b/{other}": {"get": op("read_a", json!({"parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}]}))}}),
            ),
            "",
            vec!["{other} is no path parameter"],
        ),
        (
            doc(
                json!({"{p}/x": {"get": op("read_a", json!({"parameters": [{"name": "p", "in": "path", "required": true, "schema": {"type": "string"}}]}))}}),
            ),
            "",
            vec!["does not start with '/'"],
        ),
        // A GET that requires a body.
        (
            doc(json!({"/a": {"get": op("read_a", json_body(json!({"type": "object"})))}})),
            "",
            vec!["requires a request body on a GET"],
        ),
        // $refs that grow exponentially once written out, and a schema too deep to store.
        (
            refs_doc(30, |next| {
                json!({"type": "object", "properties": {
                "a": {"$ref": next}, "b": {"$ref": next}, "c": {"$ref": next}}})
            }),
            "",
            vec!["grows past 20000 values"],
        ),
        (
            refs_doc(
                30,
                |next| json!({"allOf": [{"type": "object", "properties": {"a": {"$ref": next}}}]}),
            ),
            "",
            vec!["\"add\"", "nests", "a task can store at most 27"],
        ),
        (
            "{\"openapi\": 3.1, \"paths\": {}}".to_string(),
            "",
            vec!["version is 3.1, not a string"],
        ),
        (
            doc(json!({"/a": {"get": 5}})),
            "",
            vec!["GET /a: an operation is an object, not 5"],
        ),
        (
            json!({"swagger": "2.0", "paths": {}}).to_string(),
            "",
            vec!["Swagger 2.0"],
        ),
    ];
    for (i, (text, extra, expected)) in cases.iter().enumerate() {
        std::fs::write(d.join("api.json"), text).expect("document");
        std::fs::write(
            d.join("tools.toml"),
            format!("version = 1\n\n[[openapi]]\ndocument = \"api.json\"\n{extra}"),
        )
        .expect("catalog");
        for verb in [&["tools", "list"][..], &["run", "--drain"][..]] {
            let out = Command::new(bin())
                .args(["--config", "worker.toml"])
                .args(verb)
                .current_dir(d)
                .env_remove("WORKER_DB")
                .env_remove("WORKER_CONFIG")
                .output()
                .expect("worker");
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "case {i} {verb:?}: {err}");
            assert!(err.contains("openapi document api.json"), "case {i}: {err}");
            for e in expected {
                assert!(err.contains(e), "case {i} {verb:?}: {e:?} not in {err}");
            }
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}

/// A document whose `POST /add` body is `S0`, each `S{i}` made by `schema` with a `$ref` to
/// `S{i+1}`, the last one a string.
fn refs_doc(n: usize, schema: impl Fn(&str) -> Value) -> String {
    let mut schemas = serde_json::Map::new();
    for i in 0..n {
        schemas.insert(
            format!("S{i}"),
            schema(&format!("#/components/schemas/S{}", i + 1)),
        );
    }
    schemas.insert(format!("S{n}"), json!({"type": "string"}));
    json!({"openapi": "3.0.3", "info": {"title": "t", "version": "1"},
           "servers": [{"url": "http://127.0.0.1:9"}],
           "paths": {"/add": {"post": {"operationId": "add", "responses": {"200": {"description": "ok"}},
               "requestBody": {"required": true, "content": {"application/json": {
                   "schema": {"$ref": "#/components/schemas/S0"}}}}}}},
           "components": {"schemas": schemas}})
    .to_string()
}

/// What a mapped document becomes: options found by operationId, OpenAPI 3.0's `nullable`
/// (beside a type, and around a `$ref`) as a null the schema accepts, and a property named
/// `nullable` kept as a property.
#[test]
fn documents_map_as_documented() {
    let dir = TempDir::new("openapi-map");
    let d = dir.path();
    let doc = json!({"openapi": "3.0.3", "info": {"title": "t", "version": "1"},
        "servers": [{"url": "http://127.0.0.1:9/v1"}],
        "paths": {"/items/{id}": {"patch": {"operationId": "items.update",
            "parameters": [{"name": "id", "in": "path", "required": true, "schema": {"type": "string"}}],
            "requestBody": {"required": true, "content": {"application/json": {"schema": {
                "type": "object", "properties": {
                    "note": {"type": "string", "nullable": true},
                    "kind": {"allOf": [{"$ref": "#/components/schemas/Kind"}], "nullable": true},
                    "code": {"type": "string", "const": "x", "nullable": true},
                    "kind2": {"$ref": "#/components/schemas/Kind", "nullable": true},
                    "plain": {"type": "string", "nullable": false},
                    "nullable": {"type": "boolean"}}}}}},
            "responses": {"200": {"description": "ok"}}}}},
        "components": {"schemas": {"Kind": {"type": "string", "enum": ["a", "b"]}}}});
    std::fs::write(d.join("api.json"), doc.to_string()).expect("document");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
    std::fs::write(
        d.join("tools.toml"),
        "version = 1\n[[openapi]]\ndocument = \"api.json\"\n[openapi.tools.\"items.update\"]\napproval = \"always\"\n",
    )
    .expect("catalog");
    let out = Command::new(bin())
        .args(["--config", "worker.toml", "tools", "list", "--json"])
        .current_dir(d)
        .output()
        .expect("worker");
    let listed: Value = serde_json::from_str(&succeeded(out, &["tools", "list"])).expect("json");
    let t = &listed[0];
    assert_eq!(t["name"], "items_update", "{t}");
    assert_eq!(
        t["approval"], "always",
        "options named by operationId apply: {t}"
    );
    let schema = jsonschema::validator_for(&t["schema"]).expect("the listed schema compiles");
    for ok in [
        json!({"id": "7", "note": null, "kind": null, "nullable": true, "code": null, "kind2": null}),
        json!({"id": "7", "code": "x", "kind2": "b", "plain": "p"}),
        json!({"id": "7", "note": "x", "kind": "a"}),
    ] {
        assert!(schema.is_valid(&ok), "{ok} against {}", t["schema"]);
    }
    for bad in [
        json!({"id": "7", "kind": "c"}),
        json!({"id": "7", "kind2": "c"}),
        json!({"id": "7", "code": "y"}),
        json!({"id": "7", "plain": null}),
    ] {
        assert!(!schema.is_valid(&bad), "{bad} against {}", t["schema"]);
    }
    assert!(
        !t["schema"].to_string().contains("\"nullable\":false"),
        "OpenAPI's keyword is not passed on: {}",
        t["schema"]
    );
}

/// A write whose answer came after its timeout is held with an unknown outcome; the daemon
/// settles it from the tool's lookup, which carries the API's key like every request of the
/// API (the lookup is on the API's own origin), and the task goes on: the create arrived once.
#[test]
fn a_held_write_is_settled_by_a_lookup_that_carries_the_apis_key() {
    let Some(py) = python() else { return };
    let dir = TempDir::new("openapi-lookup");
    let d = dir.path();
    let desk = Desk::start(&py, d);
    let script = [
        json!({"call": "propose_plan", "args": {"steps": [
            {"id": "s1", "tool": "create_ticket", "depends_on": []}]}}),
        json!({"call": "create_ticket", "args": {"customer_id": "cu_ana", "title": "slow", "severity": "low"}}),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Opened."}}),
    ];
    let fake = Fake::start(&py, d, "openai", &script);
    setup(d, &desk, "openai", &format!("{}/v1", fake.url));
    let url = &desk.url;
    std::fs::write(
        d.join("tools.toml"),
        format!(
            "version = 1\n[[openapi]]\ndocument = \"{url}/openapi.json\"\nexclude = [\"admin_reset\", \"lookup_ticket\"]\napi_key_env = \"DESK_API_KEY\"\n\
             [openapi.tools.create_ticket]\ntimeout_ms = 1000\nretry = {{ attempts = 1 }}\nlookup_url = \"{url}/tickets/lookup\"\nlookup_grace_ms = 1000\n"
        ),
    )
    .expect("catalog");
    ok(
        d,
        &["enqueue", "--user", "cu_ana", "--goal", "Open a ticket."],
    );
    for _ in 0..3 {
        ok(d, &["run", "--drain"]);
        if shown(d, "t1")["stop"] == "done" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    let t = shown(d, "t1");
    assert_eq!(t["stop"], "done", "{t}");
    let arrivals = desk.arrivals();
    let creates = arrivals.iter().filter(|a| a["method"] == "POST").count();
    assert_eq!(creates, 1, "sent once: {arrivals:?}");
    let lookups: Vec<&Value> = arrivals
        .iter()
        .filter(|a| a["raw_path"] == "/tickets/lookup")
        .collect();
    assert!(!lookups.is_empty(), "the lookup was asked: {arrivals:?}");
    assert!(
        lookups.iter().all(|a| a["api_key"] == API_KEY),
        "with the API's key: {lookups:?}"
    );
}
