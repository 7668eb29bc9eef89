//! Issue 53's conversations, on both backends and both providers' native tool calling (fakes
//! built from the official SDKs' types), with the demo shop served over HTTP as the REST tool
//! service: a three-turn conversation whose second turn uses a fact of the first. Turn 1 reads
//! the order and refunds 5.00 under plan step `s2`; turn 2 (a follow-up sent with `worker say
//! --wait`, or from the console's form) refunds another 5.00 under a step of the same id, which
//! must be a new call key and so a second refund in the shop's ledger; turn 3 (through `POST
//! /api/v1/tasks/{id}/messages`) is answered from the facts alone. Every turn's request carries
//! the conversation as the provider's own messages and the facts of the turns before it.

use crate::common;
use crate::models::{Fake, python};
use common::serve::{agent, serve};
use common::shop::{store_service, write_catalog};
use common::*;

use serde_json::{Value, json};
use std::path::Path;

const OPS: &str = "0123456789abcdef-ops";
const SAY_2: &str = "Refund another 5.00, please.";
const SAY_3: &str = "How much was refunded in all?";

/// One provider's moves, in the order its requests come, for a conversation about `order`.
fn script(order: &str) -> Vec<Value> {
    let refund = json!({"call": "issue_refund", "args": {"order_id": order, "amount_cents": 500, "reason": "damaged"}});
    vec![
        json!({"call": "propose_plan", "args": {"steps": [
            {"id": "s1", "tool": "get_order", "depends_on": []},
            {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]}]}}),
        json!({"call": "get_order", "args": {"order_id": order}}),
        refund.clone(),
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Refunded 5.00."}}),
        // Turn 2: a plan step of the same id as turn 1's refund.
        json!({"call": "propose_plan", "args": {"steps": [
            {"id": "s2", "tool": "issue_refund", "depends_on": []}]}}),
        refund,
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Refunded another 5.00."}}),
        // Turn 3: from the facts, no tool.
        json!({"call": "final_answer", "args": {"outcome": "completed", "text": "10.00 in all."}}),
    ]
}

fn setup(d: &Path, store: &str, oa: &Fake, an: &Fake) {
    write_catalog(d, store);
    let profile = |name: &str, kind: &str, url: &str| {
        format!(
            "[models.{name}]\nkind = \"{kind}\"\nbase_url = \"{url}/v1\"\nmodel = \"m\"\napi_key_env = \"C_MODEL_KEY\"\n\n"
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

fn worker_cmd(d: &Path) -> std::process::Command {
    let mut c = command(d);
    c.args(["--config", "worker.toml"])
        .env("C_MODEL_KEY", "sk-c")
        .env("TETHER_APPROVAL_SECRET", common::shop::APPROVAL_SECRET);
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

/// The body of every request the fake was sent, in order.
fn bodies(f: &Fake) -> Vec<Value> {
    f.requests().iter().map(|r| r["body"].clone()).collect()
}

/// The messages of a request, whichever provider's shape, as (role, all its text).
fn said(body: &Value) -> Vec<(String, String)> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    messages
        .iter()
        .map(|m| {
            let text = match &m["content"] {
                Value::String(s) => s.clone(),
                Value::Array(blocks) => blocks
                    .iter()
                    .map(|b| match (&b["text"], &b["content"]) {
                        (Value::String(t), _) | (_, Value::String(t)) => t.clone(),
                        _ => b.to_string(),
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
                other => other.to_string(),
            };
            (m["role"].as_str().unwrap_or("").to_string(), text)
        })
        .collect()
}

/// The refunds of `order` in the shop's ledger: (amount, call key).
fn refunds(d: &Path, order: &str) -> Vec<(i64, String)> {
    let ledger = json_list(d, &["store", "--store", "store.redb", "ledger", "--json"]);
    ledger
        .iter()
        .filter(|e| e["effect"]["order"] == order)
        .filter_map(|e| {
            let amount = e["effect"]["amount_cents"].as_i64()?;
            Some((amount, e["key"].as_str()?.to_string()))
        })
        .collect()
}

/// Turn 2 from the console's form, bound to the turn the page showed.
fn said_in_the_console(d: &Path, console: &str, id: &str) {
    let mut resp = agent()
        .get(&format!("{console}/tasks/{id}"))
        .call()
        .expect("the page");
    let page = resp.body_mut().read_to_string().expect("html");
    assert!(
        page.contains("id=\"say-text\""),
        "a finished task takes a message: {page}"
    );
    let csrf = crate::questions::field(&page, "csrf");
    assert_eq!(crate::questions::field(&page, "turn"), "1", "{page}");
    let post = |fields: &[(&str, &str)]| {
        let r = agent()
            .post(&format!("{console}/tasks/{id}/say"))
            .send_form(fields.iter().copied())
            .expect("a message");
        r.status().as_u16()
    };
    assert_eq!(post(&[("csrf", &csrf), ("text", SAY_2)]), 400, "no turn");
    assert_eq!(
        post(&[("csrf", &csrf), ("turn", "1"), ("text", " ")]),
        400,
        "empty"
    );
    assert_eq!(
        post(&[("csrf", &csrf), ("turn", "1"), ("text", SAY_2)]),
        303
    );
    assert_eq!(
        post(&[("csrf", &csrf), ("turn", "1"), ("text", SAY_2)]),
        409,
        "the same form sent twice opens one turn"
    );
    wok(d, &["run", "--shared", "--drain"]);
}

/// The task's event stream (`text/event-stream`) from `last` (a `Last-Event-ID`), read until
/// it ends with the task: (id, event, data) of each event.
fn events(served: &str, id: &str, last: Option<&str>) -> Vec<(String, String, Value)> {
    let mut req = agent()
        .get(&format!("{served}/api/v1/tasks/{id}/events"))
        .header("Authorization", format!("Bearer {OPS}"))
        .header("Accept", "text/event-stream");
    if let Some(last) = last {
        req = req.header("Last-Event-ID", last);
    }
    let mut resp = req.call().expect("the stream");
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.body_mut().read_to_string().expect("the stream's text");
    text.split("\n\n")
        .filter_map(|block| {
            let field = |name: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(&format!("{name}: ")))
                    .map(str::to_string)
            };
            let data = serde_json::from_str(&field("data")?).unwrap_or(Value::Null);
            Some((field("id")?, field("event")?, data))
        })
        .collect()
}

/// Turn 2 from the CLI: `worker say --wait` prints the turn's answer once a run made it.
fn said_from_the_cli(d: &Path, id: &str) {
    let bad = w(d, &["say", id, "--text", "a\u{7}b"]);
    assert_eq!(
        bad.status.code(),
        Some(2),
        "a control character is a bad argument"
    );
    let waiter = worker_cmd(d)
        .args(["say", id, "--turn", "1", "--text", SAY_2, "--by", "ana"])
        .args(["--wait", "--json", "--timeout", "120s"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("worker say --wait");
    let mut turn = 1;
    for _ in 0..600 {
        turn = shown(d, id)["turn"].as_u64().unwrap_or(0);
        if turn == 2 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert_eq!(turn, 2, "the message opened turn 2");
    let again = w(d, &["say", id, "--turn", "1", "--text", SAY_2]);
    assert_eq!(again.status.code(), Some(1), "sent twice, one turn");
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(err.contains("on turn 2, not turn 1"), "{err}");
    let early = w(d, &["say", id, "--text", "and?"]);
    assert!(
        String::from_utf8_lossy(&early.stderr).contains("still working"),
        "a turn that has not finished takes no message"
    );
    wok(d, &["run", "--shared", "--drain"]);
    let out = waiter.wait_with_output().expect("the wait ends");
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: Value = serde_json::from_slice(&out.stdout).expect("the result");
    assert_eq!(
        (r["answer"].as_str(), r["turn"].as_u64()),
        (Some("Refunded another 5.00."), Some(2)),
        "{r}"
    );
}

/// Turn 3 through the API, bound to the turn the caller saw finish.
fn said_through_the_api(served: &str, id: &str) {
    let url = format!("{served}/api/v1/tasks/{id}/messages");
    let post = |body: &Value| {
        let mut resp = agent()
            .post(&url)
            .header("Authorization", format!("Bearer {OPS}"))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .expect("a message");
        let status = resp.status().as_u16();
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    };
    let (status, p) = post(&json!({}));
    assert_eq!(status, 400, "a message needs its text: {p}");
    let (status, p) = post(&json!({"text": " \r\n "}));
    assert_eq!(status, 422, "blank: {p}");
    let (status, p) = post(&json!({"text": SAY_3, "turn": 1}));
    assert_eq!(status, 409, "the task moved past turn 1: {p}");
    let (status, t) = post(&json!({"text": SAY_3, "turn": 2}));
    assert_eq!(status, 202, "{t}");
    assert_eq!(
        (t["status"].as_str(), t["turn"].as_u64()),
        (Some("queued"), Some(3)),
        "{t}"
    );
    assert_eq!(
        t["conversation"][3],
        json!({"role": "user", "text": SAY_3}),
        "{t}"
    );
    let (status, p) = post(&json!({"text": SAY_3, "turn": 2}));
    assert_eq!(status, 409, "sent twice, one turn: {p}");
}

fn one_provider(d: &Path, model: &str, fake: &Fake, order: &str, served: &str, console: &str) {
    let before = fake.requests().len();
    let goal = format!("What did order {order} cost? Refund 5.00 of it.");
    let id = wok(
        d,
        &[
            "enqueue", "--user", "cu_ana", "--model", model, "--goal", &goal,
        ],
    )
    .trim()
    .to_string();
    wok(d, &["run", "--shared", "--drain"]);
    let t = shown(d, &id);
    assert_eq!(
        (t["stop"].as_str(), t["turn"].as_u64()),
        (Some("done"), Some(1)),
        "{t}"
    );
    let total = t["state"]["facts"][format!("{order}.total_cents")].clone();
    let per_turn = t["budget"]["steps_max"].as_u64().expect("a step limit");
    assert!(total.is_i64(), "turn 1 read the order: {t}");
    assert!(
        wok(d, &["show", &id]).contains(&format!("worker say {id} --turn 1")),
        "show says how to continue"
    );
    let seen = events(served, &id, None);
    let (last, kind, _) = seen.last().expect("turn 1's events");
    assert_eq!(kind, "finished", "{seen:?}");
    if model == "oa" {
        said_from_the_cli(d, &id);
    } else {
        said_in_the_console(d, console, &id);
    }
    let t = shown(d, &id);
    assert_eq!(
        (t["stop"].as_str(), t["turn"].as_u64()),
        (Some("done"), Some(2)),
        "{t}"
    );
    assert_eq!(
        t["closing_message"], "The task is complete. In turn 2, the refund was issued.",
        "the closing speaks of the turn's own plan: {t}"
    );
    // A reader that saw turn 1 end and comes back gets turn 2, and nothing of turn 1 again.
    let more = events(served, &id, Some(last));
    let kinds: Vec<&str> = more.iter().map(|e| e.1.as_str()).collect();
    assert_eq!(kinds.first(), Some(&"step"), "{more:?}");
    assert!(
        more.iter()
            .all(|e| e.2["step"].as_u64().is_none_or(|s| s >= 5)),
        "{more:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "model").count(),
        3,
        "{more:?}"
    );
    let said2 = more
        .iter()
        .find(|e| e.1 == "decision")
        .expect("the message");
    assert_eq!(
        (said2.2["verb"].as_str(), said2.2["detail"]["text"].as_str()),
        (Some("say"), Some(SAY_2))
    );
    let (_, kind, end) = more.last().expect("turn 2's end");
    assert_eq!(
        (kind.as_str(), end["answer"].as_str()),
        ("finished", Some("Refunded another 5.00."))
    );
    said_through_the_api(served, &id);
    wok(d, &["run", "--shared", "--drain"]);
    let t = shown(d, &id);
    assert_eq!(
        (t["stop"].as_str(), t["turn"].as_u64()),
        (Some("done"), Some(3)),
        "{t}"
    );
    assert_eq!(t["state"]["answer"], "10.00 in all.", "{t}");
    assert_eq!(
        t["closing_message"],
        "The task is complete. This turn set no plan; 3 tool calls were made in the conversation so far.",
        "the closing speaks of the turn: {t}"
    );
    assert_eq!(t["state"]["tool_calls"], 3, "two refunds and a read: {t}");

    // The requests: each turn's first carries the conversation and the facts before it.
    let sent = bodies(fake);
    assert_eq!(sent.len(), before + 8, "four, three and one model calls");
    let mut turn2 = said(&sent[before + 4]);
    turn2.retain(|(role, _)| role != "system");
    let roles: Vec<&str> = turn2.iter().map(|(r, _)| r.as_str()).collect();
    assert_eq!(&roles[..3], ["user", "assistant", "user"], "{turn2:?}");
    assert!(turn2[0].1.contains(&goal), "{turn2:?}");
    assert!(turn2[1].1.contains("Refunded 5.00."), "{turn2:?}");
    assert!(turn2[2].1.contains(SAY_2), "{turn2:?}");
    let state2 = &turn2.last().expect("the state").1;
    assert!(
        state2.contains(&format!("{order}.total_cents")) && state2.contains(&total.to_string()),
        "turn 2 has turn 1's facts: {state2}"
    );
    let turn3 = said(&sent[before + 7]);
    assert!(
        turn3
            .iter()
            .any(|(_, t)| t.contains("Refunded another 5.00.")),
        "{turn3:?}"
    );
    assert!(turn3.iter().any(|(_, t)| t.contains(SAY_3)), "{turn3:?}");
    assert!(
        turn3
            .last()
            .expect("the state")
            .1
            .contains(&format!("\"{order}.refunded_cents\": 1000")),
        "turn 3 reads what both refunds did: {turn3:?}"
    );
    for earlier in &sent[before..before + 4] {
        assert!(
            !earlier.to_string().contains(SAY_2),
            "no message before it was sent"
        );
    }

    // Two refunds, each under a key of its own turn (the same step id, `s2`, in both).
    let refunds = refunds(d, order);
    assert_eq!(
        refunds.iter().map(|r| r.0).collect::<Vec<_>>(),
        [500, 500],
        "{refunds:?}"
    );
    assert!(refunds[0].1.ends_with(&format!(":{id}:s2")), "{refunds:?}");
    assert!(
        refunds[1].1.ends_with(&format!(":{id}#2:s2")),
        "{refunds:?}"
    );

    // The audit log, the replay across turns, `show` and `watch`.
    let events: Value = serde_json::from_str(&wok(d, &["events", &id, "--json"])).expect("events");
    let verbs: Vec<&str> = events
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| e["verb"].as_str())
        .collect();
    assert_eq!(verbs, ["say", "say"], "{events}");
    assert_eq!(events[0]["detail"]["turn"], 2, "{events}");
    let replayed: Value =
        serde_json::from_str(&wok(d, &["replay", &id, "--json"])).expect("a replay");
    assert_eq!(replayed["same_state"], true, "{replayed}");
    let text = wok(d, &["show", &id]);
    assert!(
        text.contains("turn      3") && text.contains(SAY_3),
        "{text}"
    );
    let watched = wok(d, &["watch", &id]);
    assert!(watched.contains(&format!("(turn 3): {SAY_3}")), "{watched}");
    // Turn 3 began after step 7, with the steps a turn may take.
    assert_eq!(t["budget"]["steps_max"], 7 + per_turn, "{t}");
}

conformance! {
    fn a_conversation_runs_three_turns_on_the_same_state(d) {
        let Some(py) = python() else { return };
        let store = store_service(d, &[]);
        let oa = Fake::start(&py, d, "openai", &script("ord_1001"));
        let an = Fake::start(&py, d, "anthropic", &script("ord_1004"));
        setup(d, &store.url, &oa, &an);
        let served = serve(d, &["--config", "worker.toml", "--token-file", "tokens.txt"]);
        let console = serve(d, &["--config", "worker.toml", "--by", "alice"]);
        one_provider(d, "oa", &oa, "ord_1001", &served.base, &console.base);
        one_provider(d, "an", &an, "ord_1004", &served.base, &console.base);
    }
}

conformance! {
    /// Under a kill: a daemon killed while the first model call of turn 2 waits leaves the
    /// message recorded and the turn unfinished; the next run makes turn 2 once, with the
    /// message in its request once, one `say` in the audit log and one refund in the ledger.
    fn a_message_survives_a_daemon_killed_while_the_model_reads_it(d) {
        let Some(py) = python() else { return };
        let store = store_service(d, &[]);
        let script = [
            json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Hello, Ana."}}),
            json!({"call": "final_answer", "args": {"outcome": "completed", "text": "never read"}, "delay_ms": 30000}),
            json!({"call": "propose_plan", "args": {"steps": [{"id": "s1", "tool": "issue_refund", "depends_on": []}]}}),
            json!({"call": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 500}}),
            json!({"call": "final_answer", "args": {"outcome": "completed", "text": "Refunded 5.00."}}),
        ];
        let oa = Fake::start(&py, d, "openai", &script);
        let an = Fake::start(&py, d, "anthropic", &[]);
        setup(d, &store.url, &oa, &an);
        let id = wok(d, &["enqueue", "--user", "cu_ana", "--goal", "Greet Ana."]).trim().to_string();
        let run = ["run", "--shared", "--heartbeat-ttl-ms", "3000", "--recover-every-ms", "200"];
        wok(d, &[&run[..], &["--drain"]].concat());
        wok(d, &["say", &id, "--turn", "1", "--text", "Refund 5.00 of ord_1001."]);
        let mut daemon = worker_cmd(d).args(run).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().expect("start the daemon");
        let mut waited = 0;
        while oa.requests().len() < 2 && waited < 600 {
            std::thread::sleep(std::time::Duration::from_millis(50));
            waited += 1;
        }
        assert_eq!(oa.requests().len(), 2, "turn 2's first model call is in flight");
        daemon.kill().expect("SIGKILL the daemon");
        daemon.wait().expect("reap it");
        wok(d, &[&run[..], &["--drain"]].concat());
        let t = shown(d, &id);
        assert_eq!((t["stop"].as_str(), t["turn"].as_u64()), (Some("done"), Some(2)), "{t}");
        assert_eq!(t["state"]["answer"], "Refunded 5.00.", "{t}");
        let sent = bodies(&oa);
        assert_eq!(sent.len(), 5, "{sent:?}");
        for b in &sent[1..] {
            let text = b.to_string();
            assert_eq!(text.matches("Refund 5.00 of ord_1001.").count(), 1, "the message once: {text}");
        }
        assert!(!sent[0].to_string().contains("Refund 5.00"), "not before it was sent");
        let events: Value = serde_json::from_str(&wok(d, &["events", &id, "--json"])).expect("events");
        let verbs: Vec<&str> = events.as_array().expect("events").iter().filter_map(|e| e["verb"].as_str()).collect();
        assert_eq!(verbs, ["say"], "{events}");
        assert_eq!(refunds(d, "ord_1001").len(), 1, "one refund");
        let replayed: Value = serde_json::from_str(&wok(d, &["replay", &id, "--json"])).expect("a replay");
        assert_eq!(replayed["same_state"], true, "{replayed}");

        // A message, then a cancel before any daemon ran the turn: replayed as it happened.
        let goal = "refund the damaged item on order ord_1001";
        let t2 = wok(d, &["enqueue", "--user", "cu_ana", "--model", "policy", "--goal", goal]).trim().to_string();
        wok(d, &[&run[..], &["--drain"]].concat());
        wok(d, &["say", &t2, "--text", "And the email?"]);
        wok(d, &["cancel", &t2, "--reason", "withdrawn"]);
        let t = shown(d, &t2);
        assert_eq!((t["stop"].as_str(), t["turn"].as_u64()), (Some("cancelled"), Some(2)), "{t}");
        assert!(!wok(d, &["show", &t2]).contains("worker say"), "a cancelled task takes no message");
        let replayed: Value = serde_json::from_str(&wok(d, &["replay", &t2, "--json"])).expect("a replay");
        assert_eq!(replayed["same_state"], true, "{replayed}");
    }
}
