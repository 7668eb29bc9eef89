//! Issue 53's questions to a person, on both backends and both providers' native tool calling
//! (fakes built from the official SDKs' types): a catalog that opts into `ask_person` lets the
//! model ask; the task waits (`needs_answer`, exit 5) spending no tool call; one question is
//! answered with `worker answer`, one through the API, one in the console, one is left to run out
//! (`question_expired`). The answer reaches the model as the person's words in the next
//! request, never as a fact; a choice outside the offered ones is refused, as is an answer to a
//! task that asked nothing.

use crate::common;
use crate::models::{Fake, python};
use common::serve::{agent, serve};
use common::*;

use serde_json::{Value, json};
use std::path::Path;

const OPS: &str = "0123456789abcdef-ops";

const ASK_ADDRESS: &str = "Which address should the replacement go to?";
const ASK_ORDER: &str = "What is the order number on the receipt?";
const ASK_COLOUR: &str = "Which colour should the new kettle be?";

/// One provider's moves for the three tasks, in the order its requests come.
fn script() -> Vec<Value> {
    vec![
        json!({"call": "ask_person", "args": {"question": ASK_ADDRESS, "choices": ["home", "office"]}}),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Sending it to the office."}}),
        json!({"call": "ask_person", "args": {"question": ASK_ORDER}}),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Order ord_1001 it is."}}),
        json!({"call": "ask_person", "args": {"question": ASK_COLOUR, "choices": ["red", "blue"]}}),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Blue it is."}}),
        json!({"call": "ask_person", "args": {"question": "Is anyone there?"}}),
        json!({"call": "final_answer", "args": {"outcome": "cannot_complete", "text": "No answer."}}),
    ]
}

fn setup(d: &Path, oa: &Fake, an: &Fake) {
    std::fs::write(
        d.join("tools.toml"),
        "version = 1\n\n[ask_person]\ndescription = \"Ask the customer's account manager.\"\n",
    )
    .expect("catalog");
    let profile = |name: &str, kind: &str, url: &str| {
        format!(
            "[models.{name}]\nkind = \"{kind}\"\nbase_url = \"{url}/v1\"\nmodel = \"m\"\napi_key_env = \"Q_MODEL_KEY\"\n\n"
        )
    };
    std::fs::write(
        d.join("worker.toml"),
        format!(
            "default_model = \"oa\"\n\n{}{}[tools]\ncatalog = \"tools.toml\"\n",
            profile("oa", "openai", &oa.url),
            profile("an", "anthropic", &an.url)
        ),
    )
    .expect("config");
    std::fs::write(d.join("tokens.txt"), format!("ops {OPS} operator\n")).expect("tokens");
}

/// `worker --config worker.toml` in `d`, with the model's key and the callbacks' secret.
fn worker_cmd(d: &Path) -> std::process::Command {
    let mut c = command(d);
    c.args(["--config", "worker.toml"])
        .env("Q_MODEL_KEY", "sk-q")
        .env(crate::callbacks::SECRET_ENV, crate::callbacks::SECRET);
    c
}

fn w(d: &Path, args: &[&str]) -> std::process::Output {
    worker_cmd(d).args(args).output().expect("run worker")
}

fn wok(d: &Path, args: &[&str]) -> String {
    succeeded(w(d, args), args)
}

fn shown(d: &Path, task: &str) -> Value {
    let out = wok(d, &["show", task, "--json"]);
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}\n{out}"))
}

/// The text of every request the fake was sent, in order.
fn bodies(f: &Fake) -> Vec<String> {
    f.requests().iter().map(|r| r["body"].to_string()).collect()
}

fn enqueue(d: &Path, model: &str, goal: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "enqueue", "--user", "cu_ana", "--model", model, "--goal", goal,
    ];
    args.extend_from_slice(extra);
    wok(d, &args);
    let list: Value = serde_json::from_str(&wok(d, &["list", "--json"])).expect("list");
    list.as_array()
        .and_then(|a| {
            a.iter()
                .map(|t| t["id"].as_str())
                .max_by_key(|id| id.map(|s| s[1..].parse::<u64>().unwrap_or(0)))
        })
        .flatten()
        .expect("a task")
        .to_string()
}

/// A task that asked: suspended, waiting for an answer, the question in its result, no tool
/// call spent, nothing of the question in its facts.
fn asked(d: &Path, id: &str, question: &str) -> Value {
    let t = shown(d, id);
    assert_eq!(t["status"], "suspended", "{t}");
    assert_eq!(t["state"]["stop"], "needs_answer", "{t}");
    assert_eq!(t["state"]["stalls"], 0, "asking is not stalling: {t}");
    assert_eq!(t["question"]["text"], question, "{t}");
    assert_eq!(
        t["state"]["tool_calls"], 0,
        "a question is not a tool call: {t}"
    );
    let wait = w(d, &["wait", id, "--json"]);
    assert_eq!(wait.status.code(), Some(5), "waiting on a person");
    let plain = w(d, &["wait", id]);
    let said = String::from_utf8_lossy(&plain.stderr);
    assert!(
        said.contains(&format!("asks a person \"{question}\"")) && said.contains("worker answer"),
        "{said}"
    );
    let r: Value = serde_json::from_slice(&wait.stdout).expect("the result");
    assert_eq!(r["waiting_for"], "answer", "{r}");
    assert_eq!(r["question"], t["question"], "{r}");
    t
}

/// A form field's value in a console page.
pub(crate) fn field(html: &str, name: &str) -> String {
    let at = html
        .find(&format!("name=\"{name}\" value=\""))
        .unwrap_or_else(|| panic!("no field {name} in {html}"));
    let rest = &html[at + name.len() + 15..];
    rest[..rest.find('"').expect("a closing quote")].to_string()
}

/// Answered from the console's form, bound to the question the page showed.
fn answered_in_the_console(d: &Path, model: &str, fake: &Fake, console: &str, before: usize) {
    let t4 = enqueue(d, model, "Pick a kettle colour.", &[]);
    wok(d, &["run", "--shared", "--drain"]);
    asked(d, &t4, ASK_COLOUR);
    let mut resp = agent()
        .get(&format!("{console}/tasks/{t4}"))
        .call()
        .expect("the page");
    let page = resp.body_mut().read_to_string().expect("html");
    assert!(
        page.contains(ASK_COLOUR) && page.contains("<option value=\"blue\">"),
        "{page}"
    );
    assert!(
        !page.contains("id=\"approve\""),
        "a question is answered, not approved"
    );
    let (csrf, key, digest) = (
        field(&page, "csrf"),
        field(&page, "key"),
        field(&page, "digest"),
    );
    let mut resp = agent()
        .get(&format!("{console}/held"))
        .call()
        .expect("the page");
    let held = resp.body_mut().read_to_string().expect("html");
    assert!(
        held.contains(ASK_COLOUR) && held.contains("question-row"),
        "the held page lists the question apart from approvals: {held}"
    );
    let post = |fields: &[(&str, &str)]| {
        let mut r = agent()
            .post(&format!("{console}/tasks/{t4}/answer"))
            .send_form(fields.iter().copied())
            .expect("an answer");
        (
            r.status().as_u16(),
            r.body_mut().read_to_string().unwrap_or_default(),
        )
    };
    let (status, body) = post(&[
        ("csrf", &csrf),
        ("key", &key),
        ("digest", "0000000000"),
        ("text", "blue"),
    ]);
    assert_eq!(status, 409, "a form of another question: {body}");
    let (status, body) = post(&[("csrf", &csrf), ("digest", &digest), ("text", "blue")]);
    assert_eq!(status, 400, "a form without the question's key: {body}");
    let (status, body) = post(&[
        ("csrf", &csrf),
        ("key", &key),
        ("digest", &digest),
        ("text", "green"),
    ]);
    assert_eq!(status, 400, "not a choice: {body}");
    let (status, body) = post(&[
        ("csrf", &csrf),
        ("key", &key),
        ("digest", &digest),
        ("text", "blue"),
    ]);
    assert_eq!(status, 303, "{body}");
    wok(d, &["run", "--shared", "--drain"]);
    assert_eq!(shown(d, &t4)["stop"], "done");
    let sent = bodies(fake);
    assert!(sent[before + 5].contains("blue"), "{}", sent[before + 5]);
}

fn one_provider(d: &Path, model: &str, fake: &Fake, served: &str, console: &str) {
    let before = fake.requests().len();
    // 1. Answered from the CLI, with one of the offered choices.
    let t1 = enqueue(d, model, "Replace Ana's broken kettle.", &[]);
    wok(d, &["run", "--shared", "--drain"]);
    let t = asked(d, &t1, ASK_ADDRESS);
    assert_eq!(t["question"]["choices"], json!(["home", "office"]), "{t}");
    let shown_text = wok(d, &["show", &t1]);
    assert!(
        shown_text.contains(ASK_ADDRESS) && shown_text.contains("worker answer"),
        "show says what is asked and how to answer: {shown_text}"
    );
    for (text, says) in [
        ("", "needs some text"),
        ("a\u{7}b", "control character"),
        (&"x".repeat(4001), "at most 4000 characters"),
    ] {
        let out = w(d, &["answer", &t1, "--text", text]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{says:?} in {err}");
    }
    let bad = w(d, &["answer", &t1, "--text", "the moon"]);
    assert_eq!(
        bad.status.code(),
        Some(2),
        "an answer outside the choices is a bad argument"
    );
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("home") && err.contains("office"), "{err}");
    // Bound to the question read: another key is refused, the question's own is taken.
    let key = t["held"]["key"]
        .as_str()
        .expect("the question's key")
        .to_string();
    let stale = w(
        d,
        &["answer", &t1, "--key", "x:t1:adhoc9", "--text", "office"],
    );
    assert_eq!(stale.status.code(), Some(1), "a stale key");
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(err.contains("not the question you answered"), "{err}");
    wok(
        d,
        &[
            "answer", &t1, "--key", &key, "--text", "office", "--by", "ana",
        ],
    );
    // Answered and queued: nothing says it still waits, and a second answer is told why not.
    let queued = wok(d, &["show", &t1]);
    assert!(
        !queued.contains("waiting for a person") && !queued.contains("answer it"),
        "{queued}"
    );
    let late = w(d, &["answer", &t1, "--text", "home"]);
    assert!(
        String::from_utf8_lossy(&late.stderr).contains("was answered already"),
        "{}",
        String::from_utf8_lossy(&late.stderr)
    );
    wok(d, &["run", "--shared", "--drain"]);
    let t = shown(d, &t1);
    assert_eq!(t["stop"], "done", "{t}");
    assert_eq!(t["outcome"], "completed", "{t}");
    assert_eq!(t["state"]["tool_calls"], 0, "{t}");
    assert!(
        t["state"]["facts"].as_object().is_none_or(|f| f.is_empty()),
        "an answer is never a fact without a rule: {t}"
    );
    let sent = bodies(fake);
    assert_eq!(sent.len(), before + 2, "two model calls: {sent:?}");
    assert!(
        sent[before + 1].contains("office") && !sent[before].contains("office"),
        "the answer reaches the model in the next request: {}",
        sent[before + 1]
    );
    assert!(
        sent[before].contains("ask_person"),
        "the model is offered ask_person: {}",
        sent[before]
    );
    let events: Value = serde_json::from_str(&wok(d, &["events", &t1, "--json"])).expect("events");
    assert_eq!(events[0]["verb"], "answer", "{events}");
    assert_eq!(events[0]["by"], "ana", "{events}");
    assert_eq!(events[0]["detail"]["answer"], "office", "{events}");
    assert_eq!(events[0]["detail"]["question"], ASK_ADDRESS, "{events}");
    let replayed: Value =
        serde_json::from_str(&wok(d, &["replay", &t1, "--json"])).expect("a replay");
    assert_eq!(
        replayed["same_state"], true,
        "replay folds the answer in: {replayed}"
    );
    // The event stream says what was asked and what was answered, in plain words.
    let watched = wok(d, &["watch", &t1]);
    for line in [
        format!("model: asks a person: {ASK_ADDRESS}"),
        "answered  by ana: office".to_string(),
        "finished  done: Sending it to the office.".to_string(),
    ] {
        assert!(watched.contains(&line), "{line:?} in {watched}");
    }
    let again = w(d, &["answer", &t1, "--text", "home"]);
    assert_eq!(again.status.code(), Some(1), "answered once");
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("not waiting for an answer"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );

    // 2. Answered through the API, free text.
    let t2 = enqueue(d, model, "Find Ana's order.", &[]);
    wok(d, &["run", "--shared", "--drain"]);
    asked(d, &t2, ASK_ORDER);
    let url = format!("{served}/api/v1/tasks/{t2}/answer");
    let post = |body: &Value| {
        let mut resp = agent()
            .post(&url)
            .header("Authorization", format!("Bearer {OPS}"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .expect("an answer");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        (status, v)
    };
    // A job waiting for the final answer waits through the question.
    let waiter = command(d)
        .args([
            "wait",
            &t2,
            "--until",
            "finished",
            "--json",
            "--timeout",
            "120s",
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("worker wait");
    let (status, p) = post(&json!({}));
    assert_eq!(status, 400, "an answer needs its text: {p}");
    let (status, p) = post(&json!({"text": "ord_1001", "digest": "0000000000"}));
    assert_eq!(status, 409, "another question's digest: {p}");
    let got: Value = serde_json::from_str(&wok(d, &["show", &t2, "--json"])).expect("show");
    let digest = got["question"]["digest"]
        .as_str()
        .expect("the question's digest");
    let text = "ord_1001\r\nIt is on the receipt.";
    let (status, t) = post(&json!({"text": text, "digest": digest, "reason": "on the receipt"}));
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["status"], "queued", "{t}");
    wok(d, &["run", "--shared", "--drain"]);
    let t = shown(d, &t2);
    assert_eq!(t["stop"], "done", "{t}");
    let waited = waiter.wait_with_output().expect("the wait ends");
    assert_eq!(
        waited.status.code(),
        Some(0),
        "completed, through the question"
    );
    let r: Value = serde_json::from_slice(&waited.stdout).expect("the result");
    assert_eq!(r["answer"], "Order ord_1001 it is.", "{r}");
    let sent = bodies(fake);
    assert!(
        sent[before + 3].contains("ord_1001"),
        "{}",
        sent[before + 3]
    );
    let (status, p) = post(&json!({"text": "again"}));
    assert_eq!(status, 409, "{p}");
    let events: Value = serde_json::from_str(&wok(d, &["events", &t2, "--json"])).expect("events");
    assert_eq!(
        events[0]["detail"]["answer"], "ord_1001\nIt is on the receipt.",
        "a browser's or a client's CRLF is kept as a line break: {events}"
    );

    // 3. From the console.
    answered_in_the_console(d, model, fake, console, before);

    // 4. Left to run out: the daemon ends the wait.
    let t3 = enqueue(d, model, "Ask and wait.", &["--approval-wait-ms", "1"]);
    wok(d, &["run", "--shared", "--drain"]);
    std::thread::sleep(std::time::Duration::from_millis(20));
    wok(d, &["run", "--shared", "--drain"]);
    let t = shown(d, &t3);
    assert_eq!(t["status"], "finished", "{t}");
    assert_eq!(t["stop"], "question_expired", "{t}");
    assert_eq!(w(d, &["wait", &t3]).status.code(), Some(6));
    let late = w(d, &["answer", &t3, "--text", "yes"]);
    assert_eq!(late.status.code(), Some(1));
    let events: Value = serde_json::from_str(&wok(d, &["events", &t3, "--json"])).expect("events");
    assert_eq!(events[0]["verb"], "expire", "{events}");
    let replayed: Value =
        serde_json::from_str(&wok(d, &["replay", &t3, "--json"])).expect("a replay");
    assert_eq!(replayed["same_state"], true, "{replayed}");
    assert_eq!(
        bodies(fake).len(),
        before + 7,
        "no model call after the wait ran out"
    );
}

conformance! {
    fn a_question_is_answered_from_the_cli_the_api_the_console_or_runs_out(d) {
        let Some(py) = python() else { return };
        let oa = Fake::start(&py, d, "openai", &script());
        let an = Fake::start(&py, d, "anthropic", &script());
        setup(d, &oa, &an);
        let served = serve(d, &["--config", "worker.toml", "--token-file", "tokens.txt"]);
        let console = serve(d, &["--config", "worker.toml", "--by", "alice"]);
        one_provider(d, "oa", &oa, &served.base, &console.base);
        one_provider(d, "an", &an, &served.base, &console.base);
        // A task that asked nothing cannot be answered.
        let (code, _) = (w(d, &["answer", "t99", "--text", "x"]).status.code(), ());
        assert_eq!(code, Some(1));
    }

    /// Under a kill: a daemon killed while the model call that reads the answer waits leaves
    /// the answer recorded and unapplied; the next run folds it in once and the model reads it
    /// again. One answer in the audit log, one resume in the trace, two steps in all; its
    /// callbacks (verified by `standardwebhooks`) are the wait with the question, then the end.
    fn an_answer_survives_a_daemon_killed_while_the_model_reads_it(d) {
        let Some(py) = python() else { return };
        let script = [
            json!({"call": "ask_person", "args": {"question": ASK_ADDRESS, "choices": ["home", "office"]}}),
            json!({"call": "final_answer", "args": {"outcome": "completed", "text": "never read"}, "delay_ms": 30000}),
            json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Sending it to the office."}}),
        ];
        let oa = Fake::start(&py, d, "openai", &script);
        let an = Fake::start(&py, d, "anthropic", &script);
        setup(d, &oa, &an);
        // Callbacks to a Standard Webhooks receiver (the `standardwebhooks` package verifies
        // each signature): the wait on a person, with the question, then the end.
        let mut config = std::fs::read_to_string(d.join("worker.toml")).expect("config");
        config.push_str(&format!(
            "\n[callbacks]\nsecret_env = \"{}\"\nallow = [\"http://127.0.0.1:*/hooks/\"]\n",
            crate::callbacks::SECRET_ENV
        ));
        std::fs::write(d.join("worker.toml"), config).expect("config");
        let port = common::pg::free_port();
        let log = d.join("callbacks.jsonl");
        let Some(_receiver) = crate::callbacks::receiver(port, &log, 0) else { return };
        let hook = format!("http://127.0.0.1:{port}/hooks/kettle");
        let run = ["run", "--shared", "--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"];
        let t1 = enqueue(d, "oa", "Replace Ana's broken kettle.", &["--callback", &hook]);
        wok(d, &[&run[..], &["--drain"]].concat());
        asked(d, &t1, ASK_ADDRESS);
        wok(d, &["answer", &t1, "--text", "office", "--by", "ana"]);
        let mut daemon = worker_cmd(d).args(run).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("start the daemon");
        let mut waited = 0;
        while oa.requests().len() < 2 && waited < 600 {
            std::thread::sleep(std::time::Duration::from_millis(50));
            waited += 1;
        }
        assert_eq!(oa.requests().len(), 2, "the model call that reads the answer is in flight");
        daemon.kill().expect("SIGKILL the daemon");
        daemon.wait().expect("reap it");
        wok(d, &[&run[..], &["--drain"]].concat());
        let t = shown(d, &t1);
        assert_eq!(t["stop"], "done", "{t}");
        assert_eq!(t["state"]["answer"], "Sending it to the office.", "{t}");
        assert_eq!(t["state"]["step"], 2, "the ask, then the final answer: {t}");
        assert_eq!(t["state"]["tool_calls"], 0, "{t}");
        let sent = bodies(&oa);
        assert_eq!(sent.len(), 3, "{sent:?}");
        assert!(sent[1].contains("office") && sent[2].contains("office"), "the answer is not lost");
        assert_eq!(sent[2].matches("office").count(), sent[1].matches("office").count(), "nor folded in twice");
        let events: Value = serde_json::from_str(&wok(d, &["events", &t1, "--json"])).expect("events");
        let verbs: Vec<&str> = events.as_array().expect("events").iter().filter_map(|e| e["verb"].as_str()).collect();
        assert_eq!(verbs, ["answer"], "{events}");
        let trace = wok(d, &["trace", &t1]);
        assert_eq!(trace.matches("settled held call").count(), 1, "{trace}");
        let replayed: Value = serde_json::from_str(&wok(d, &["replay", &t1, "--json"])).expect("a replay");
        assert_eq!(replayed["same_state"], true, "{replayed}");
        // A daemon delivers what the drains left in the outbox.
        let mut daemon = worker_cmd(d).args(run).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("start the daemon");
        let verified = || -> Vec<Value> {
            crate::callbacks::arrivals(&log)
                .into_iter()
                .filter(|a| a["status"] == 204)
                .filter_map(|a| serde_json::from_str(a["body"].as_str()?).ok())
                .collect()
        };
        for _ in 0..400 {
            if verified().len() >= 2 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let _ = daemon.kill();
        let _ = daemon.wait();
        let got = verified();
        let types: Vec<&str> = got.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(types, ["task.waiting", "task.finished"], "{got:?}");
        assert_eq!(got[0]["data"]["waiting_for"], "answer", "{}", got[0]);
        assert_eq!(got[0]["data"]["question"]["text"], ASK_ADDRESS, "{}", got[0]);
        assert_eq!(got[1]["data"]["answer"], "Sending it to the office.", "{}", got[1]);
    }
}

/// A person answers in the console with a real browser (headless chromium), choosing among
/// the offered answers; the task goes on with the answer. A script stands in for the model.
#[test]
fn a_person_answers_in_the_browser() {
    let dir = TempDir::new("questions-browser");
    let d = dir.path();
    std::fs::write(d.join("tools.toml"), "version = 1\n\n[ask_person]\n").expect("catalog");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
    let script = [
        json!({"type": "tool", "name": "ask_person", "args": {"question": ASK_COLOUR, "choices": ["red", "blue"]}}),
        json!({"type": "final", "outcome": "completed", "text": "Blue it is."}),
    ];
    let lines: Vec<String> = script.iter().map(Value::to_string).collect();
    std::fs::write(d.join("ask.jsonl"), lines.join("\n")).expect("script");
    let args = [
        "enqueue",
        "--user",
        "cu_ana",
        "--goal",
        "Pick a colour.",
        "--model",
        "script:ask.jsonl",
    ];
    wok(d, &args);
    wok(d, &["run", "--shared", "--drain"]);
    let c = serve(d, &["--config", "worker.toml", "--by", "alice"]);
    let Some(b) = common::webdriver::Browser::start() else {
        return;
    };
    b.open(&format!("{}/tasks/t1", c.base));
    assert_eq!(b.text("#question-text"), ASK_COLOUR);
    assert_eq!(
        b.count("#approve"),
        0,
        "a question is answered, not approved"
    );
    b.click("#answer-text option[value=blue]");
    b.click("#answer");
    assert!(
        b.text("#flash").contains("question was answered"),
        "{}",
        b.text("#flash")
    );
    assert_eq!(b.text("#task-status"), "queued");
    wok(d, &["run", "--shared", "--drain"]);
    b.open(&format!("{}/tasks/t1", c.base));
    assert_eq!(b.text("#task-stop"), "done");
    assert!(b.text("#events").contains("blue"), "{}", b.text("#events"));
    let t = shown(d, "t1");
    assert_eq!(t["state"]["last_result"]["answer"], "blue", "{t}");
    assert_eq!(t["state"]["tool_calls"], 0, "{t}");
}
