//! The record format (issue 9): a version-1 database from an earlier release is read back and
//! migrated; inputs over a limit are refused before anything is stored; a step never rewrites
//! what does not change; a closed pipe, a truncated file and out-of-range numbers are errors,
//! never panics.

use crate::common;
use common::*;

use redb::{ReadableDatabase, ReadableTable};
use serde_json::Value;
use std::path::Path;
use std::process::{Command, Stdio};

fn fixture_dir() -> String {
    format!("{}/tests/fixtures/v1", env!("CARGO_MANIFEST_DIR"))
}

fn fixture_json(name: &str) -> Value {
    let p = format!("{}/{name}", fixture_dir());
    serde_json::from_str(&std::fs::read_to_string(&p).expect("fixture")).expect("fixture JSON")
}

/// Whether `actual` has every field `fixture` has, with the same value (later releases add
/// fields, such as the RFC 3339 times beside the milliseconds); arrays element by element.
fn has_fields_of(actual: &Value, fixture: &Value) -> bool {
    match (actual, fixture) {
        (Value::Object(a), Value::Object(f)) => f
            .iter()
            .all(|(k, v)| a.get(k).is_some_and(|x| has_fields_of(x, v))),
        (Value::Array(a), Value::Array(f)) => {
            a.len() == f.len() && a.iter().zip(f).all(|(x, v)| has_fields_of(x, v))
        }
        (a, f) => a == f,
    }
}

fn schema_version(db: &Path) -> u64 {
    let db = redb::Database::builder()
        .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
        .open(db)
        .expect("open");
    let r = db.begin_read().expect("read");
    r.open_table(tether::store::schema::META)
        .expect("meta")
        .get(tether::store::schema::META_SCHEMA)
        .expect("get")
        .expect("schema version")
        .value()
}

#[test]
fn a_version_1_database_is_read_back_as_written_and_migrated() {
    let dir = TempDir::new("v1");
    let d = dir.path();
    for f in ["worker.redb", "worker.store.redb"] {
        std::fs::copy(format!("{}/{f}", fixture_dir()), d.join(f)).expect("copy fixture");
    }
    assert_eq!(schema_version(&d.join("worker.redb")), 1);
    // Every read verb prints what the release that wrote the file printed.
    // (`list` now prints newest first, and both print RFC 3339 times beside the ms.)
    // (And a task queued again after an approval lists no stop until it stops again: t7.)
    let mut listed = fixture_json("list.json");
    listed.as_array_mut().expect("list fixture").reverse();
    for t in listed.as_array_mut().expect("list fixture") {
        if t["status"] == "queued" {
            t["stop"] = Value::Null;
        }
    }
    let list = json(d, &["list", "--json", "--limit", "10000"]);
    assert!(has_fields_of(&list, &listed), "{list:#}");
    for t in ["t1", "t8"] {
        let shown = json(d, &["show", t, "--json"]);
        let want = fixture_json(&format!("{t}.json"));
        assert!(has_fields_of(&shown, &want), "{shown:#}\nfixture: {want:#}");
    }
    assert_eq!(
        json(d, &["trace", "t1", "--json"]),
        fixture_json("trace-t1.json")
    );
    assert_eq!(json(d, &["events", "--json"]), fixture_json("events.json"));
    assert_eq!(
        json(d, &["memory", "list", "--json"]),
        fixture_json("notes.json")
    );
    for (verb, file) in [
        ("arrivals", "arrivals.json"),
        ("ledger", "ledger.json"),
        ("orders", "orders.json"),
    ] {
        assert_eq!(
            json(d, &["store", verb, "--json"]),
            fixture_json(file),
            "{verb}"
        );
    }
    // The file is now of the current version, every record in the envelope, none as JSON.
    assert_eq!(schema_version(&d.join("worker.redb")), 4);
    let raw = stored_records(&d.join("worker.redb"));
    assert!(raw.len() > 40, "{} records", raw.len());
    for (table, v) in &raw {
        assert_eq!(
            v.first(),
            Some(&0xB7),
            "a {table} record is not in the envelope"
        );
    }
    assert!(raw.iter().any(|(t, _)| t == "task_specs"));
    assert!(
        raw.iter().any(|(t, _)| t == "blobs"),
        "the script became a blob"
    );
    ok(d, &["check"]);
    // The migrated tasks run on: t7 (approved before the migration) sends its refund once,
    // t11 (queued) runs, t8 stays held.
    ok(d, &["run", "--drain", "--max-in-flight", "1"]);
    assert_eq!(json(d, &["show", "t7", "--json"])["stop"], "done");
    assert_eq!(json(d, &["show", "t11", "--json"])["status"], "finished");
    assert_eq!(json(d, &["show", "t8", "--json"])["status"], "held");
    let refunds_t7: Vec<Value> = json(d, &["store", "ledger", "--json"])
        .as_array()
        .expect("ledger")
        .iter()
        .filter(|e| e["key"].as_str().is_some_and(|k| k.ends_with(":t7:s2")))
        .cloned()
        .collect();
    assert_eq!(refunds_t7.len(), 1, "{refunds_t7:?}");
    assert_eq!(refunds_t7[0]["effect"]["amount_cents"], 8000);
}

/// The format of each reply record in the database at `db`, with its task.
fn reply_formats(db: &Path) -> Vec<(String, u8)> {
    let db = redb::Database::builder()
        .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
        .open(db)
        .expect("open");
    let r = db.begin_read().expect("read");
    let def: redb::TableDefinition<(&str, u32), &[u8]> = redb::TableDefinition::new("replies");
    let t = r.open_table(def).expect("replies");
    t.iter()
        .expect("iter")
        .map(|e| {
            let (k, v) = e.expect("entry");
            (k.value().0.to_string(), v.value()[1])
        })
        .collect()
}

#[test]
fn format_2_replies_replay_beside_format_3_ones() {
    let dir = TempDir::new("v2");
    let d = dir.path();
    for f in ["worker.redb", "worker.store.redb"] {
        let src = format!("{}/tests/fixtures/v2/{f}", env!("CARGO_MANIFEST_DIR"));
        std::fs::copy(src, d.join(f)).expect("copy fixture");
    }
    let before = reply_formats(&d.join("worker.redb"));
    assert!(before.len() > 20, "{before:?}");
    assert!(before.iter().all(|(_, v)| *v == 2), "{before:?}");
    // Every demo task replays from its format-2 replies to the state and effects it stored.
    for t in ["t1", "t2", "t3", "t4", "t5", "t6", "t7", "t8"] {
        let r = json(d, &["replay", t, "--json"]);
        assert_eq!(r["same_state"], true, "{t}: {r}");
        assert_eq!(r["same_effects"], true, "{t}: {r}");
    }
    let trace: Value = serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{}/tests/fixtures/v2/trace-t1.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .expect("fixture"),
    )
    .expect("fixture JSON");
    assert_eq!(json(d, &["trace", "t1", "--json"]), trace);
    ok(d, &["check"]);
    // A task run by this build stores format-5 replies (with tool answers) beside them, and
    // replays too.
    let id = enqueue(d, &["--model", "policy:ord_1001:3000"]);
    let id = id.trim();
    ok(d, &["run", "--drain", "--max-in-flight", "1"]);
    let after = reply_formats(&d.join("worker.redb"));
    let new: Vec<u8> = after
        .iter()
        .filter(|(t, _)| t == id)
        .map(|(_, v)| *v)
        .collect();
    assert!(!new.is_empty() && new.iter().all(|v| *v == 5), "{after:?}");
    assert_eq!(
        after.iter().filter(|(_, v)| *v == 2).count(),
        before.len(),
        "the old replies are left as they were"
    );
    let r = json(d, &["replay", id, "--json"]);
    assert_eq!(r["same_state"], true, "{r}");
    ok(d, &["check"]);
}

#[test]
fn a_newer_record_format_is_refused_by_name() {
    let dir = TempDir::new("newer");
    let d = dir.path();
    enqueue(d, &[]);
    {
        let db = redb::Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .open(d.join("worker.redb"))
            .expect("open");
        let w = db.begin_write().expect("write");
        {
            let def: redb::TableDefinition<&str, &[u8]> = redb::TableDefinition::new("tasks");
            let mut t = w.open_table(def).expect("tasks");
            // A record of format 9 (same header layout, checksum over version and payload).
            let mut v = t.get("t1").expect("get").expect("t1").value().to_vec();
            v[1] = 9;
            let mut h = <sha2::Sha256 as sha2::Digest>::new();
            sha2::Digest::update(&mut h, [9u8]);
            sha2::Digest::update(&mut h, &v[10..]);
            let sum = sha2::Digest::finalize(h);
            v[2..10].copy_from_slice(&sum[..8]);
            t.insert("t1", v.as_slice()).expect("insert");
        }
        w.commit().expect("commit");
    }
    let (code, err) = fails(d, &["show", "t1"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("task t1 record was written by a newer version"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn nested_operator_results_and_batch_lines_are_refused_before_anything_is_stored() {
    let dir = TempDir::new("deep-input");
    let d = dir.path();
    enqueue(d, &["--tool-latency", "issue_refund=40000"]);
    ok(d, &["run", "--drain"]);
    assert_eq!(json(d, &["show", "t1", "--json"])["status"], "held");
    let digest = held_digest(d, "t1");
    let deep = format!(
        r#"{{"status": "ok", "x": {}{}}}"#,
        "[".repeat(125),
        "]".repeat(125)
    );
    let events_before = json(d, &["events", "--json"]);
    let (code, err) = fails(
        d,
        &[
            "reconcile",
            "t1",
            "--applied",
            "--digest",
            &digest,
            "--result",
            &deep,
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--result nests 126 levels"), "{err}");
    assert_eq!(json(d, &["show", "t1", "--json"])["status"], "held");
    assert_eq!(json(d, &["events", "--json"]), events_before);
    // A batch line nested too deep, a line that is an array, and a line too long.
    let cases: [(String, &str); 3] = [
        (
            format!(
                r#"{{"user": "u", "goal": "g", "budget": {{"x": {}{}}}}}"#,
                "[".repeat(40),
                "]".repeat(40)
            ),
            "nests",
        ),
        (
            r#"["cu_ana", "refund"]"#.to_string(),
            "must be a JSON object",
        ),
        (
            format!(r#"{{"user": "u", "goal": "{}"}}"#, "g".repeat(70_000)),
            "over the limit",
        ),
    ];
    for (line, want) in cases {
        std::fs::write(d.join("batch.jsonl"), format!("{line}\n")).expect("write");
        let (code, err) = fails(
            d,
            &["enqueue", "--model", "policy", "--file", "batch.jsonl"],
        );
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(want), "expected {want:?}: {err}");
        assert!(err.contains("batch.jsonl:1:"), "{err}");
    }
    assert_eq!(
        json(d, &["list", "--json", "--limit", "10000"])
            .as_array()
            .expect("list")
            .len(),
        1
    );
    // A script line nested too deep is refused at enqueue.
    std::fs::write(
        d.join("deep.jsonl"),
        format!(
            r#"{{"type": "final", "text": "x", "y": {}{}}}"#,
            "[".repeat(40),
            "]".repeat(40)
        ),
    )
    .expect("write");
    let (code, err) = fails(
        d,
        &[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            "script:deep.jsonl",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("line 1 nests 41 levels"), "{err}");
}

#[test]
fn numbers_out_of_range_are_usage_errors() {
    let dir = TempDir::new("ranges");
    let d = dir.path();
    for args in [
        // With --drain, so that a build accepting the flag ends instead of running on.
        &["run", "--drain", "--lease-ms", "18446744073709551615"][..],
        &["run", "--drain", "--lease-ms", "86400001"],
        &[
            "enqueue",
            "--model",
            "policy",
            "--user",
            "u",
            "--goal",
            "g",
            "--priority",
            "-9223372036854775808",
        ],
        &[
            "enqueue",
            "--model",
            "policy",
            "--user",
            "u",
            "--goal",
            "g",
            "--priority",
            "1000000001",
        ],
    ] {
        let (code, err) = fails(d, args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.starts_with("error:"), "{err}");
    }
    std::fs::write(
        d.join("b.jsonl"),
        r#"{"user": "u", "goal": "g", "priority": -9223372036854775808}"#,
    )
    .expect("write");
    let (code, err) = fails(d, &["enqueue", "--model", "policy", "--file", "b.jsonl"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("out of range"), "{err}");
    assert!(!d.join("worker.redb").exists());
}

#[test]
fn a_closed_pipe_ends_a_verb_quietly() {
    let dir = TempDir::new("pipe");
    let d = dir.path();
    let lines: String = (0..1500)
        .map(|i| format!("{{\"user\": \"u{i}\", \"goal\": \"goal number {i} of a long batch\"}}\n"))
        .collect();
    std::fs::write(d.join("b.jsonl"), lines).expect("write");
    ok(d, &["enqueue", "--model", "policy", "--file", "b.jsonl"]);
    // Both listings are larger than a pipe's buffer, so the writer meets the closed pipe even
    // when it runs before the reader goes away.
    for args in [
        &["list", "--limit", "10000"][..],
        &["list", "--json", "--limit", "10000"],
        &["events"],
    ] {
        let mut child = Command::new(bin())
            .args(args)
            .current_dir(d)
            .env_remove("WORKER_DB")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        drop(child.stdout.take()); // the reader goes away, as `| head -0` does
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(!err.contains("error"), "{args:?}: {err}");
        // `events` may print nothing (no events), so it may exit 0; the others hit the pipe.
        if args[0] == "list" {
            assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
        }
    }
}

#[test]
fn a_truncated_database_is_an_error_not_a_new_database() {
    let dir = TempDir::new("trunc");
    let d = dir.path();
    enqueue(d, &[]);
    std::fs::write(d.join("worker.redb"), b"").expect("truncate");
    for args in [
        &["list"][..],
        &["enqueue", "--model", "policy", "--user", "u", "--goal", "g"],
        &["run", "--drain"],
    ] {
        let (code, err) = fails(d, args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.contains("is empty (0 bytes)"), "{args:?}: {err}");
    }
    assert_eq!(
        std::fs::metadata(d.join("worker.redb"))
            .expect("file")
            .len(),
        0
    );
}

#[test]
fn fifty_tasks_sharing_a_2_mb_script_store_it_once() {
    // Issue 9, defect 7: each step rewrote the whole task record with its script; 50 tasks
    // sharing a 2 MB script grew the file to 138 MB.
    let dir = TempDir::new("lean");
    let d = dir.path();
    let mut script = String::from(
        "{\"type\": \"plan\", \"steps\": [{\"id\": \"s1\", \"tool\": \"get_order\", \"depends_on\": []}]}\n\
         {\"type\": \"tool\", \"name\": \"get_order\", \"args\": {\"order_id\": \"ord_1001\"}, \"plan_step\": \"s1\"}\n\
         {\"type\": \"final\", \"outcome\": \"completed\", \"text\": \"done\"}\n",
    );
    let pad = "p".repeat(1000);
    while script.len() < 2 << 20 {
        script.push_str(&format!("{{\"type\": \"final\", \"text\": \"{pad}\"}}\n"));
    }
    std::fs::write(d.join("script.jsonl"), &script).expect("write script");
    let batch: String = (0..50)
        .map(|i| {
            format!("{{\"user\": \"u{i}\", \"goal\": \"g\", \"model\": \"script:script.jsonl\"}}\n")
        })
        .collect();
    std::fs::write(d.join("b.jsonl"), batch).expect("write batch");
    ok(d, &["enqueue", "--model", "policy", "--file", "b.jsonl"]);
    ok(d, &["run", "--drain", "--max-in-flight", "2"]);
    let list = json(d, &["list", "--json", "--limit", "10000"]);
    let stops: Vec<&str> = list
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|t| t["stop"].as_str())
        .collect();
    assert_eq!(stops, vec!["done"; 50]);
    let size = std::fs::metadata(d.join("worker.redb")).expect("db").len();
    assert!(size < 10 << 20, "the database is {size} bytes");
    // Every task still reads its script back whole.
    let raw = stored_records(&d.join("worker.redb"));
    let blobs = raw.iter().filter(|(t, _)| t == "blobs").count();
    assert_eq!(blobs, 1, "one copy of the script");
    ok(d, &["check"]);
    // Purging the tasks deletes the script with its last user.
    ok(d, &["purge", "--finished-before", "0s"]);
    let raw = stored_records(&d.join("worker.redb"));
    assert_eq!(raw.iter().filter(|(t, _)| t == "blobs").count(), 0);
    assert_eq!(raw.iter().filter(|(t, _)| t == "tasks").count(), 0);
}

#[test]
fn re_adding_an_order_keeps_its_refunds() {
    // Issue 9, item 8: `store add-order` on an existing order reset its refunds.
    let dir = TempDir::new("add-order");
    let d = dir.path();
    enqueue(d, &[]);
    ok(d, &["run", "--drain"]);
    let refunded =
        |d: &Path| json(d, &["store", "orders", "--json"])["ord_1001"]["refunded"].clone();
    assert_eq!(refunded(d), 3000);
    ok(
        d,
        &["store", "add-order", "--order", "ord_1001:cu_ana:4200"],
    );
    assert_eq!(refunded(d), 3000);
    assert_eq!(
        json(d, &["store", "orders", "--json"])["ord_1001"]["total"],
        4200
    );
    let (code, err) = fails(
        d,
        &["store", "add-order", "--order", "ord_1001:cu_ana:1000"],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("below the 3000 already refunded"), "{err}");
    assert_eq!(refunded(d), 3000);
}

#[test]
fn an_order_id_with_a_slash_never_reaches_another_tenants_book() {
    let dir = TempDir::new("tenant");
    let d = dir.path();
    enqueue(d, &["--store-scope", "victim"]);
    ok(d, &["run", "--drain"]);
    std::fs::write(
        d.join("s.jsonl"),
        "{\"type\": \"tool\", \"name\": \"get_order\", \"args\": {\"order_id\": \"victim/ord_1001\"}}\n\
         {\"type\": \"final\", \"text\": \"x\"}\n",
    )
    .expect("script");
    ok(
        d,
        &[
            "enqueue",
            "--user",
            "cu_ana",
            "--goal",
            "g",
            "--model",
            "script:s.jsonl",
        ],
    );
    ok(d, &["run", "--drain"]);
    let t = json(d, &["show", "t2", "--json"]);
    assert_eq!(t["state"]["last_result"]["code"], "not_found", "{t}");
    assert_eq!(t["state"]["facts"], serde_json::json!({}), "{t}");
}

#[test]
fn terminal_escapes_in_stored_text_are_printed_escaped() {
    let dir = TempDir::new("escapes");
    let d = dir.path();
    std::fs::write(
        d.join("s.jsonl"),
        "{\"type\": \"final\", \"text\": \"done\\u001b[2J\\u001b]0;pwned\\u0007\"}\n",
    )
    .expect("script");
    ok(
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
    ok(d, &["run", "--drain"]);
    let human = ok(d, &["show", "t1"]);
    assert!(
        !human.contains('\u{1b}') && !human.contains('\u{7}'),
        "{human:?}"
    );
    assert!(human.contains("done\\u{1b}[2J"), "{human}");
    let v = json(d, &["show", "t1", "--json"]);
    assert_eq!(v["state"]["answer"], "done\u{1b}[2J\u{1b}]0;pwned\u{7}");
}

conformance! {
    fn purge_deletes_finished_tasks_with_everything_of_theirs_and_audits_it(d) {
        enqueue(d, &["--key", "job-1"]);
        enqueue(d, &["--tool-latency", "issue_refund=40000"]);
        ok(d, &["run", "--drain"]);
        ok(
            d,
            &[
                "cancel",
                "t2",
                "--by",
                "alice",
                "--reason",
                "customer withdrew",
            ],
        );
        ok(d, &["enqueue", "--model", "policy", "--user", "u", "--goal", "later"]);
        // t1 finished, t2 cancelled with its write still held, t3 queued.
        let none = json(d, &["purge", "--finished-before", "1d", "--json"]);
        assert_eq!(none["purged"], 0, "nothing is that old: {none}");
        let purged = json(
            d,
            &["purge", "--finished-before", "0s", "--by", "bob", "--json"],
        );
        assert_eq!(purged["ids"], serde_json::json!(["t1"]), "{purged}");
        let mut ids: Vec<String> = json(d, &["list", "--json", "--limit", "10000"])
            .as_array()
            .expect("list")
            .iter()
            .map(|t| t["id"].as_str().expect("id").to_string())
            .collect();
        ids.sort();
        assert_eq!(
            ids,
            ["t2", "t3"],
            "a cancelled task with a held write stays"
        );
        fails(d, &["show", "t1"]);
        let trace = worker(d, &["trace", "t1", "--json"]);
        assert!(!trace.status.success());
        let events = json(d, &["events", "--json"]);
        let verbs: Vec<(&str, &str)> = events
            .as_array()
            .expect("events")
            .iter()
            .map(|e| {
                (
                    e["task"].as_str().unwrap_or("-"),
                    e["verb"].as_str().unwrap_or(""),
                )
            })
            .collect();
        assert!(verbs.contains(&("t2", "cancel")), "{verbs:?}");
        assert!(verbs.contains(&("-", "purge")), "{verbs:?}");
        assert!(!verbs.iter().any(|(t, _)| *t == "t1"), "{verbs:?}");
        if db_url(d).is_none() {
            let raw = stored_records(&d.join("worker.redb"));
            assert!(
                raw.iter().filter(|(t, _)| t == "call_keys").count() >= 1,
                "t2's call stays"
            );
        } else {
            let t2 = json(d, &["show", "t2", "--json"]);
            assert_eq!(t2["calls"].as_array().map(Vec::len), Some(1), "t2's call stays: {t2}");
        }
        ok(d, &["check"]);
        // The purged task's key may be used again.
        let again = ok(
            d,
            &[
                "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", "refund", "--key", "job-1",
            ],
        );
        assert_eq!(again.trim(), "t4");
    }
}
