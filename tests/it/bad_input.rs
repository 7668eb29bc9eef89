//! The bad-input corpus (issue 9): over 300 hostile inputs across CLI arguments, batch files,
//! script replies, model HTTP replies, tool results, config and catalog files, HTTP requests
//! to `demo-store` and memory notes. Each case checks the exit code (or the HTTP status, or the
//! step's recorded error), an error that names the problem, no panic, and that the database
//! still opens with every earlier task as it was.

use crate::common;
use common::*;

use serde_json::{Value, json};
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

/// A database with two earlier tasks: t1 finished, t2 queued.
fn bench(name: &str) -> (TempDir, Value) {
    let dir = TempDir::new(name);
    let d = dir.path();
    enqueue(d, &[]);
    ok(d, &["run", "--drain"]);
    enqueue(d, &["--model", "policy:ord_1004:8000", "--key", "earlier"]);
    let baseline = json(d, &["list", "--json", "--limit", "10000"]);
    (dir, baseline)
}

/// The earlier tasks are all there, as they were.
fn intact(d: &Path, baseline: &Value, case: &str) {
    let now = json(d, &["list", "--json", "--limit", "10000"]);
    for t in baseline.as_array().expect("baseline") {
        let id = &t["id"];
        let found = now
            .as_array()
            .expect("list")
            .iter()
            .find(|n| &n["id"] == id)
            .unwrap_or_else(|| panic!("{case}: task {id} is gone"));
        assert_eq!(found, t, "{case}: task {id} changed");
    }
}

fn no_panic(case: &str, stderr: &str) {
    for bad in [
        "panicked",
        "RUST_BACKTRACE",
        "unreachable",
        "stack backtrace",
    ] {
        assert!(!stderr.contains(bad), "{case}: {stderr}");
    }
}

/// Runs a command that must fail with `code` and an `error:` line containing `want`;
/// returns what was wrong, if anything, so that a test reports every mismatch at once.
fn check_refused(d: &Path, args: &[&str], code: i32, want: &str) -> Option<String> {
    let out = worker(d, args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let case = format!("{args:?}");
    for bad in ["panicked", "RUST_BACKTRACE", "stack backtrace"] {
        if err.contains(bad) {
            return Some(format!("{case}: panic: {err}"));
        }
    }
    if out.status.code() != Some(code) {
        return Some(format!(
            "{case}: exit {:?}, not {code}: {err}",
            out.status.code()
        ));
    }
    if !err.lines().any(|l| l.starts_with("error:")) {
        return Some(format!("{case}: no error line in {err}"));
    }
    if !err.to_lowercase().contains(&want.to_lowercase()) {
        return Some(format!("{case}: expected {want:?} in {err}"));
    }
    None
}

fn refused(d: &Path, args: &[&str], code: i32, want: &str) {
    if let Some(m) = check_refused(d, args, code, want) {
        panic!("{m}");
    }
}

#[test]
fn cli_arguments() {
    let (dir, base) = bench("bad-cli");
    let d = dir.path();
    let long = "x".repeat(5000);
    let key256 = "k".repeat(256);
    let esc = "goal\u{1b}[2J";
    let mut cases: Vec<(Vec<String>, i32, &str)> = Vec::new();
    macro_rules! add {
        ($args:expr, $code:expr, $want:expr) => {
            cases.push((
                $args.iter().map(|s: &&str| s.to_string()).collect(),
                $code,
                $want,
            ))
        };
    }
    // enqueue
    let e = ["enqueue", "--user", "u", "--goal", "g"];
    let with = |extra: &[&str]| -> Vec<String> {
        // The demo model unless the case names one: enqueue needs a model.
        let model: &[&str] = if extra.contains(&"--model") {
            &[]
        } else {
            &["--model", "policy"]
        };
        e.iter()
            .chain(model.iter())
            .chain(extra.iter())
            .map(|s| s.to_string())
            .collect()
    };
    for (extra, want) in [
        (&["--priority", "x"][..], "priority"),
        (&["--priority", "-9223372036854775808"], "priority"),
        (&["--priority", "9223372036854775807"], "priority"),
        (&["--priority", "1e9"], "priority"),
        (&["--budget", "steps_max"], "NAME=VALUE"),
        (&["--budget", "=3"], "NAME=VALUE"),
        (&["--budget", "steps_max=-1"], "whole number"),
        (&["--budget", "steps_max=99999999999"], "too large"),
        (&["--budget", "steps_max=3.5"], "whole number"),
        (&["--budget", "wings=3"], "wings"),
        // Issue 52: a limit of 0 where it cannot work is refused, saying why.
        (
            &["--budget", "steps_max=0"],
            "steps_max: 0 cannot work (the task would stop before its first model call)",
        ),
        (&["--budget", "tokens_max=0"], "tokens_max: 0 cannot work"),
        (&["--budget", "deadline_ms=0"], "deadline_ms: 0 cannot work"),
        (
            &["--budget", "output_tokens_max=0"],
            "output_tokens_max: 0 cannot work",
        ),
        (&["--budget", "stalls_max=0"], "stalls_max: 0 cannot work"),
        (&["--budget", "repeat_max=0"], "repeat_max: 0 cannot work"),
        (
            &["--budget", "tool_calls_max=0"],
            "tool_calls_max: 0 cannot work",
        ),
        (
            &["--budget", "tokens_max=18446744073709551616"],
            "whole number",
        ),
        (&["--model", "telepathy"], "unknown model"),
        (&["--instructions", "be brief"], "the demo model"),
        (&["--model", "policy:ord_1:lots"], "whole number"),
        (&["--model", "script:/nonexistent/file"], "cannot read"),
        (&["--model", "script:"], "cannot read"),
        (&["--tool-latency", "teleport=5"], "unknown tool"),
        (&["--tool-latency", "get_order"], "NAME=VALUE"),
        (&["--tool-latency", "get_order=-5"], "whole number"),
        (&["--tool-latency", "get_order=soon"], "whole number"),
        (&["--key", &key256], "over the limit of 255"),
        (&["--key", ""], "empty"),
        (&["--key", "clé"], "printable ASCII"),
        (&["--key", "a\u{7}b"], "printable ASCII"),
        (&["--store-scope", "a/b"], "/"),
        (&["--store-scope", &key256], "over the limit"),
        (&["--approval-wait-ms", "-1"], "'-1'"),
        (&["--approval-wait-ms", "soon"], "approval-wait-ms"),
        (&["--file", "x.jsonl"], "cannot be used with"),
        (&["--frobnicate"], "unexpected argument"),
    ] {
        let args = with(extra);
        cases.push((args, 2, want));
    }
    for (user, goal, want) in [
        ("", "g", "--user must not be empty"),
        ("u", "", "--goal must not be empty"),
        ("u", "   ", "--goal must not be empty"),
        ("u", long.as_str(), "over the limit of 4096"),
        ("u", esc, "control character"),
        ("u\u{1b}", "g", "printable ASCII"),
        (key256.as_str(), "g", "over the limit of 255"),
        ("u u", "g\u{7}", "control character"),
    ] {
        cases.push((
            [
                "enqueue", "--model", "policy", "--user", user, "--goal", goal,
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
            2,
            want,
        ));
    }
    add!(
        &["enqueue", "--model", "policy", "--goal", "g"],
        2,
        "--user"
    );
    add!(
        &["enqueue", "--model", "policy", "--user", "u"],
        2,
        "--goal"
    );
    add!(
        &[
            "enqueue",
            "--model",
            "policy",
            "--file",
            "/nonexistent.jsonl"
        ],
        2,
        "cannot read"
    );
    // run
    for (extra, want) in [
        (&["--max-in-flight", "0"][..], "max-in-flight"),
        (&["--max-in-flight", "1000001"], "max-in-flight"),
        (&["--max-in-flight", "-1"], "'-1'"),
        // Retired: the message says what replaced it.
        (&["--workers", "4"], "--max-in-flight"),
        (&["--lease-ms", "5"], "lease-ms"),
        (&["--lease-ms", "18446744073709551615"], "lease-ms"),
        (&["--lease-ms", "86400001"], "lease-ms"),
        (&["--time-scale=-1"], "time-scale"),
        (&["--time-scale", "NaN"], "time-scale"),
        (&["--time-scale", "inf"], "time-scale"),
        (&["--drain", "--drain"], "cannot be used multiple times"),
        (&["--otlp-backlog", "0"], "otlp-backlog"),
        (
            &["--otlp-endpoint", "ftp://x"],
            "must be an http:// or https:// URL",
        ),
    ] {
        let mut a = vec!["run".to_string()];
        a.extend(extra.iter().map(|s| s.to_string()));
        cases.push((a, 2, want));
    }
    // reads
    add!(&["list", "--status", "sleeping"], 2, "is not a status");
    add!(&["list", "--stop", "tired"], 2, "is not a stop reason");
    add!(&["show"], 2, "TASK");
    add!(&["show", "t999"], 1, "no task");
    add!(&["show", "t1", "t2"], 2, "unexpected argument");
    add!(&["trace", "t999"], 1, "no task");
    add!(&["trace", "t1", "--otlp"], 2, "value is required");
    add!(&["postmortem", "nope"], 1, "no task");
    add!(&["events", "t1", "t2"], 2, "unexpected argument");
    add!(&["replay", "t999"], 1, "no task");
    // decisions
    add!(&["approve", "t999", "--digest", "abc"], 1, "no task");
    add!(
        &["approve", "t1", "--digest", "abc"],
        1,
        "not waiting for approval"
    );
    add!(&["approve", "t2"], 2, "--digest");
    add!(
        &["approve", "t2", "--digest", "abc", "--by", ""],
        2,
        "--by must not be empty"
    );
    add!(
        &["approve", "t2", "--digest", "abc", "--by", "a\u{1b}b"],
        2,
        "control character"
    );
    add!(
        &["approve", "t2", "--digest", "abc", "--by", &key256],
        2,
        "over the limit"
    );
    add!(
        &["approve", "t2", "--digest", "abc", "--reason", &long],
        2,
        "over the limit"
    );
    add!(
        &["approve", "t2", "--digest", "abc", "--extend", "wings=3"],
        2,
        "wings"
    );
    add!(
        &["approve", "t2", "--digest", "abc", "--extend", "steps"],
        2,
        "extend"
    );
    add!(
        &["approve", "t2", "--digest", "abc", "--extend", "steps=-3"],
        2,
        "extend"
    );
    add!(&["reject", "t999", "--digest", "abc"], 1, "no task");
    add!(
        &["reject", "t1", "--digest", "abc"],
        1,
        "not waiting for approval"
    );
    add!(&["reconcile", "t1"], 2, "--applied or --not-applied");
    add!(
        &["reconcile", "t1", "--applied", "--not-applied"],
        2,
        "cannot be used with"
    );
    add!(
        &["reconcile", "t1", "--not-applied", "--result", "{}"],
        2,
        "cannot be used with"
    );
    add!(
        &["reconcile", "t1", "--applied", "--result", "{"],
        2,
        "--result is not valid JSON"
    );
    add!(
        &[
            "reconcile",
            "t1",
            "--applied",
            "--result",
            &format!("[{}]", "1,".repeat(40_000) + "1")
        ],
        2,
        "over the limit"
    );
    add!(&["reconcile", "t999", "--applied"], 1, "no task");
    add!(&["reconcile", "--auto", "t1"], 2, "cannot be used with");
    add!(&["cancel", "t999"], 1, "no task");
    add!(&["cancel", "t1"], 1, "finished");
    add!(&["cancel", "t2", "--by", ""], 2, "--by must not be empty");
    // stores, maintenance
    add!(
        &["store", "add-order", "--order", "ord_1:cu"],
        2,
        "ID:CUSTOMER:TOTAL_CENTS"
    );
    add!(
        &["store", "add-order", "--order", "ord_1:cu:-5"],
        2,
        "positive"
    );
    add!(
        &["store", "add-order", "--order", "ord_1:cu:x"],
        2,
        "positive"
    );
    add!(
        &["store", "add-order", "--order", "a/b:cu:5"],
        2,
        "without '/'"
    );
    add!(&["store", "add-order", "--order", ":cu:5"], 2, "non-empty");
    add!(&["store", "frobnicate"], 2, "unrecognized subcommand");
    add!(&["store"], 2, "a command is required");
    add!(&["memory"], 2, "a command is required");
    add!(&[], 2, "a command is required");
    add!(&["frobnicate"], 2, "unrecognized subcommand");
    add!(&["purge"], 2, "--finished-before");
    add!(
        &["purge", "--finished-before", "soon"],
        2,
        "whole number with a unit"
    );
    add!(&["purge", "--finished-before", "5y"], 2, "unit");
    add!(
        &["purge", "--finished-before", "99999999999999999d"],
        2,
        "too long"
    );
    add!(
        &["purge", "--finished-before", "1d", "--batch", "0"],
        2,
        "batch"
    );
    add!(
        &["demo-store", "--listen", "nonsense"],
        2,
        "is not an address"
    );
    add!(
        &[
            "demo-store",
            "--listen",
            "127.0.0.1:8700",
            "--lose-rate",
            "2"
        ],
        2,
        "between 0 and 1"
    );
    add!(
        &["demo-store", "--read-timeout-ms", "0"],
        2,
        "read-timeout-ms"
    );
    add!(&["demo-store", "--connections", "0"], 2, "connections");
    add!(&["demo", "--workers", "4"], 2, "worker threads are retired");
    add!(
        &["--db", "/nonexistent/dir/worker.redb", "list"],
        1,
        "no database"
    );
    add!(&["--db", "/", "list"], 1, "directory");
    let n = cases.len();
    let mut wrong = Vec::new();
    for (args, code, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        wrong.extend(check_refused(d, &args, code, want));
    }
    assert!(
        wrong.is_empty(),
        "{} of {n} cases:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    intact(d, &base, "cli");
    eprintln!("cli arguments: {n} cases");
    assert!(n >= 100, "{n} cases");
}

#[test]
fn batch_files() {
    let (dir, base) = bench("bad-batch");
    let d = dir.path();
    let deep = format!("{}1{}", "[".repeat(40), "]".repeat(40));
    let mut lines: Vec<(String, &str)> = Vec::new();
    for field in [
        "user",
        "goal",
        "key",
        "priority",
        "budget",
        "model",
        "tool_latency_ms",
        "store_scope",
        "approval_wait_ms",
    ] {
        for bad in [
            "null",
            "true",
            "[]",
            "{}",
            "\"\"",
            "-1",
            "1.5",
            deep.as_str(),
        ] {
            // Values a field accepts are not cases.
            let fine = matches!(
                (field, bad),
                ("key", "null")
                    | ("priority", "-1")
                    | ("budget", "{}")
                    | ("model", "null")
                    | ("tool_latency_ms", "{}")
                    | ("store_scope", "\"\"")
                    | ("approval_wait_ms", "null")
            );
            if fine {
                continue;
            }
            let mut v = json!({"user": "u", "goal": "g"});
            v[field] = serde_json::from_str(bad).expect("json");
            lines.push((v.to_string(), "b.jsonl:1:"));
        }
    }
    for (line, want) in [
        (r#"["u", "g"]"#, "must be a JSON object"),
        (r#""u""#, "must be a JSON object"),
        ("42", "must be a JSON object"),
        ("{", "not valid JSON"),
        ("{\"user\": \"u\", \"goal\": \"g\"", "not valid JSON"),
        (r#"{"user": "u", "goal": "g", "wings": 2}"#, "unknown field"),
        (r#"{"user": "u"}"#, "goal"),
        (r#"{"goal": "g"}"#, "user"),
        (
            r#"{"user": "u", "goal": "g", "budget": {"wings": 3}}"#,
            "wings",
        ),
        (
            r#"{"user": "u", "goal": "g", "budget": {"steps_max": -3}}"#,
            "whole number",
        ),
        (
            r#"{"user": "u", "goal": "g", "budget": {"steps_max": 1e99}}"#,
            "budget",
        ),
        (
            r#"{"user": "u", "goal": "g", "model": "telepathy"}"#,
            "unknown model",
        ),
        (
            r#"{"user": "u", "goal": "g", "model": "script:/nope"}"#,
            "cannot read",
        ),
        (
            r#"{"user": "u", "goal": "g", "tool_latency_ms": {"x": 1}}"#,
            "unknown tool",
        ),
        (
            r#"{"user": "u", "goal": "g", "tool_latency_ms": {"get_order": -1}}"#,
            "b.jsonl:1:",
        ),
        (
            r#"{"user": "u", "goal": "g", "priority": -9223372036854775808}"#,
            "out of range",
        ),
        (
            r#"{"user": "u", "goal": "g", "priority": 18446744073709551615}"#,
            "b.jsonl:1:",
        ),
        (
            r#"{"user": "u", "goal": "g", "approval_wait_ms": 18446744073709551616}"#,
            "b.jsonl:1:",
        ),
        (
            r#"{"user": "u", "goal": "g\u001b[2J"}"#,
            "control character",
        ),
        (r#"{"user": "u\u0000", "goal": "g"}"#, "printable ASCII"),
        (
            r#"{"user": "u", "goal": "g", "key": "clé"}"#,
            "printable ASCII",
        ),
        (r#"{"user": "u", "goal": "g", "store_scope": "a/b"}"#, "/"),
    ] {
        lines.push((line.to_string(), want));
    }
    lines.push((
        format!(r#"{{"user": "u", "goal": "{}"}}"#, "g".repeat(5000)),
        "over the limit of 4096",
    ));
    lines.push((
        format!(r#"{{"user": "u", "goal": "{}"}}"#, "g".repeat(70_000)),
        "over the limit of 65536",
    ));
    lines.push((
        format!(r#"{{"user": "{}", "goal": "g"}}"#, "u".repeat(300)),
        "over the limit of 255",
    ));
    let n = lines.len();
    for (line, want) in &lines {
        std::fs::write(d.join("b.jsonl"), format!("{line}\n")).expect("write");
        refused(
            d,
            &["enqueue", "--model", "policy", "--file", "b.jsonl"],
            2,
            want,
        );
    }
    // A bad line anywhere refuses the whole batch: the good lines before it are not stored.
    std::fs::write(
        d.join("b.jsonl"),
        "{\"user\": \"u\", \"goal\": \"fine\"}\n{\"user\": \"u\", \"goal\": \"fine\"}\n[1]\n",
    )
    .expect("write");
    refused(
        d,
        &["enqueue", "--model", "policy", "--file", "b.jsonl"],
        2,
        "b.jsonl:3:",
    );
    std::fs::write(
        d.join("b.jsonl"),
        b"{\"user\": \"u\", \"goal\": \"\xff\xfe\"}\n",
    )
    .expect("write");
    refused(
        d,
        &["enqueue", "--model", "policy", "--file", "b.jsonl"],
        2,
        "not UTF-8",
    );
    std::fs::write(d.join("b.jsonl"), "\n\n   \n").expect("write");
    refused(
        d,
        &["enqueue", "--model", "policy", "--file", "b.jsonl"],
        2,
        "no tasks",
    );
    intact(d, &base, "batch");
    assert_eq!(
        json(d, &["list", "--json", "--limit", "10000"])
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    eprintln!("batch lines: {} cases", n + 3);
    assert!(n >= 70, "{n} cases");
}

#[test]
fn memory_notes() {
    let (dir, base) = bench("bad-memory");
    let d = dir.path();
    let long = "n".repeat(3000);
    let cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["--user", "u", "--source", "model_output", "--text", "x"],
            2,
            "not trusted",
        ),
        (
            vec!["--user", "u", "--source", "", "--text", "x"],
            2,
            "not trusted",
        ),
        (
            vec!["--user", "u", "--source", "web", "--text", "x"],
            2,
            "not trusted",
        ),
        (
            vec!["--user", "u", "--source", "user_message", "--text", ""],
            2,
            "non-empty",
        ),
        (
            vec!["--user", "u", "--source", "user_message", "--text", "   "],
            2,
            "non-empty",
        ),
        (
            vec!["--user", "u", "--source", "user_message", "--text", &long],
            2,
            "over the limit of 2048",
        ),
        (
            vec![
                "--user",
                "u",
                "--source",
                "user_message",
                "--text",
                "a\u{1b}]0;pwned\u{7}",
            ],
            2,
            "control character",
        ),
        (
            vec!["--user", "", "--source", "user_message", "--text", "x"],
            2,
            "--user must not be empty",
        ),
        (
            vec![
                "--user",
                "u\u{1b}",
                "--source",
                "user_message",
                "--text",
                "x",
            ],
            2,
            "printable ASCII",
        ),
        (
            vec![
                "--user",
                "u",
                "--source",
                "user_message",
                "--text",
                "x",
                "--ttl-days",
                "-1",
            ],
            2,
            "'-1'",
        ),
        (
            vec![
                "--user",
                "u",
                "--source",
                "user_message",
                "--text",
                "x",
                "--ttl-days",
                "x",
            ],
            2,
            "ttl-days",
        ),
        (vec!["--user", "u", "--source", "user_message"], 2, "--text"),
        (vec!["--user", "u", "--text", "x"], 2, "--source"),
        (vec!["--source", "user_message", "--text", "x"], 2, "--user"),
        (
            vec![
                "--user",
                "u",
                "--source",
                "user_message",
                "--text",
                "x",
                "--by",
                "",
            ],
            2,
            "--by must not be empty",
        ),
    ];
    let n = cases.len();
    let mut wrong = Vec::new();
    for (extra, code, want) in cases {
        let mut args = vec!["memory", "add"];
        args.extend(extra);
        wrong.extend(check_refused(d, &args, code, want));
    }
    assert!(
        wrong.is_empty(),
        "{} of {n} cases:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    refused(d, &["memory", "forget"], 2, "--user");
    refused(d, &["memory", "list", "--frob"], 2, "unexpected argument");
    assert_eq!(json(d, &["memory", "list", "--json"]), json!([]));
    intact(d, &base, "memory");
    eprintln!("memory notes: {} cases", n + 2);
    assert!(n >= 15);
}

#[test]
fn config_and_catalog_files() {
    let (dir, base) = bench("bad-config");
    let d = dir.path();
    let good_tool =
        "[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"http://127.0.0.1:1/t\" }\n";
    let catalogs: Vec<(String, &str)> = vec![
        ("version = 1\n".into(), "the catalog declares no tools"),
        ("version = 1\ntools = []\n".into(), "declares no tools"),
        ("version = 99\n".to_string() + good_tool, "newer than this build"),
        ("version = 1\n[[tools]]\nname = \"\"\naccess = \"read\"\nhttp = { url = \"http://h/t\" }\n".into(), "must not be empty"),
        ("version = 1\n[[tools]]\nname = \"a b\"\naccess = \"read\"\nhttp = { url = \"http://h/t\" }\n".into(), "letters, digits"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"sometimes\"\nhttp = { url = \"http://h/t\" }\n".into(), "access"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\n".into(), "no [http] section"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"not a url\" }\n".into(), "url must be"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"ftp://h/t\" }\n".into(), "url must be"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"http://\" }\n".into(), "url must be"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"write\"\nhttp = { url = \"http://h/t\", lookup_url = \"not a url\" }\n".into(), "lookup_url"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"http://h/t\", method = \"DELETE\" }\n".into(), "POST or PUT"),
        ("version = 1\n".to_string() + good_tool + good_tool, "declared twice"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nwings = 2\nhttp = { url = \"http://h/t\" }\n".into(), "unknown field"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"http://h/t\" }\nargs.a = { type = \"blob\" }\n".into(), "unknown variant"),
        ("version = 1\n[[tools]]\nname = \"t\"\naccess = \"read\"\nhttp = { url = \"http://h/t\", timeout_ms = -5 }\n".into(), "timeout_ms"),
        ("version = \"one\"\n".into(), "version"),
        ("[[tools]\n".into(), "tools.toml"),
        ("version = 1\n[[tools]]\nname = 5\n".into(), "name"),
        (format!("version = 1\nx = {}1{}\n", "[".repeat(200), "]".repeat(200)), "tools.toml"),
        (format!("version = 1\n# {}\n", "c".repeat(1_100_000)), "over the limit"),
        ("\u{feff}\u{0}".into(), "tools.toml"),
    ];
    let configs: Vec<(String, &str)> = vec![
        ("[models.m]\nkind = \"gemini\"\nbase_url = \"http://h\"\nmodel = \"x\"\n".into(), "not supported"),
        ("[models.m]\nkind = \"openai\"\nbase_url = \"h\"\nmodel = \"x\"\n".into(), "base_url"),
        ("[models.m]\nkind = \"openai\"\nbase_url = \"http://h\"\nmodel = \"x\"\ntemperature = 9\n".into(), "temperature"),
        ("[models.m]\nkind = \"openai\"\nbase_url = \"http://h\"\n".into(), "model"),
        ("[models.m]\nkind = \"openai\"\nbase_url = \"http://h\"\nmodel = \"x\"\nmax_retries = -1\n".into(), "max_retries"),
        ("[models]\nm = 5\n".into(), "worker.toml"),
        ("[tools]\ncatalog = \"/nonexistent.toml\"\n".into(), "cannot read"),
        ("[tools]\n".into(), "catalog"),
        ("wings = 1\n".into(), "unknown field"),
        ("[models.m\n".into(), "worker.toml"),
    ];
    let n = catalogs.len() + configs.len();
    let mut wrong = Vec::new();
    let args = [
        "--config",
        "worker.toml",
        "enqueue",
        "--user",
        "u",
        "--goal",
        "g",
    ];
    for (cat, want) in &catalogs {
        std::fs::write(d.join("tools.toml"), cat).expect("write");
        std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n")
            .expect("write");
        wrong.extend(check_refused(d, &args, 2, want).map(|m| format!("{cat:.80?}: {m}")));
    }
    for (cfg, want) in &configs {
        std::fs::write(d.join("worker.toml"), cfg).expect("write");
        let code = if *want == "cannot read" { 1 } else { 2 };
        wrong.extend(check_refused(d, &args, code, want).map(|m| format!("{cfg:.80?}: {m}")));
    }
    assert!(
        wrong.is_empty(),
        "{} of {n} cases:\n{}",
        wrong.len(),
        wrong.join("\n")
    );
    // A --config that is not there is a wrong argument, as a --file that is not there.
    refused(
        d,
        &[
            "--config",
            "/nonexistent.toml",
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
        ],
        2,
        "cannot read",
    );
    intact(d, &base, "config");
    eprintln!("config and catalog files: {} cases", n + 1);
    assert!(n >= 30, "{n}");
}

/// `worker demo-store` on a free port; killed when dropped.
struct Service {
    child: std::process::Child,
    addr: String,
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn service(d: &Path) -> Service {
    let mut child = Command::new(bin())
        .args([
            "demo-store",
            "--store",
            "svc.redb",
            "--listen",
            "127.0.0.1:0",
            "--read-timeout-ms",
            "500",
        ])
        .current_dir(d)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("demo-store");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("address");
    let addr = line
        .trim()
        .trim_start_matches("listening on http://")
        .to_string();
    Service { child, addr }
}

fn raw(addr: &str, bytes: &[u8]) -> (u16, String) {
    raw_http(addr, bytes, Duration::from_secs(20), true)
}

#[test]
fn http_requests_to_demo_store() {
    let dir = TempDir::new("bad-http");
    let d = dir.path();
    let svc = service(d);
    let post = |path: &str, headers: &str, body: &str| -> Vec<u8> {
        format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    };
    let refund = r#"{"user_id": "cu_ana", "args": {"order_id": "ord_1001", "amount_cents": 100, "reason": "x"}}"#;
    let deep = format!(
        r#"{{"user_id": "cu_ana", "args": {{"x": {}1{}}}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    let mut cases: Vec<(Vec<u8>, u16)> = vec![
        (b"GARBAGE\r\n\r\n".to_vec(), 400),
        (b"GET\r\n\r\n".to_vec(), 400),
        (b"GET / HTTP/9.9\r\n\r\n".to_vec(), 400),
        (b"\x00\x01\x02\x03\r\n\r\n".to_vec(), 400),
        (
            b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            404,
        ),
        (
            b"GET /tools/get_order HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".to_vec(),
            405,
        ),
        (
            b"GET /lookup/issue_refund HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec(),
            400,
        ),
        (
            b"GET /lookup/teleport?key=a HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec(),
            400,
        ),
        (
            b"GET /lookup/issue_refund?key=%FF%FE HTTP/1.1\r\nConnection: close\r\n\r\n".to_vec(),
            400,
        ),
        (
            format!(
                "GET /lookup/issue_refund?key={} HTTP/1.1\r\nConnection: close\r\n\r\n",
                "k".repeat(300)
            )
            .into_bytes(),
            400,
        ),
        (post("/tools/teleport", "", refund), 404),
        (post("/tools/get_order", "", "{"), 400),
        (post("/tools/get_order", "", "[]"), 400),
        (post("/tools/get_order", "", "null"), 400),
        (post("/tools/get_order", "", r#"{"args": {}}"#), 400),
        (
            post("/tools/get_order", "", r#"{"user_id": 5, "args": {}}"#),
            400,
        ),
        (
            post("/tools/get_order", "", r#"{"user_id": "u", "args": []}"#),
            400,
        ),
        (post("/tools/get_order", "", &deep), 400),
        (post("/tools/issue_refund", "", refund), 400),
        (
            post("/tools/issue_refund", "Idempotency-Key: \r\n", refund),
            400,
        ),
        (
            post("/tools/issue_refund", "Idempotency-Key: a b\r\n", refund),
            400,
        ),
        (
            post(
                "/tools/issue_refund",
                &format!("Idempotency-Key: {}\r\n", "k".repeat(256)),
                refund,
            ),
            400,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nContent-Length: 1000000000000000\r\n\r\n{}"
                .to_vec(),
            413,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n{}"
                .to_vec(),
            400,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nContent-Length: -1\r\n\r\n{}".to_vec(),
            400,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nContent-Length: abc\r\n\r\n{}".to_vec(),
            400,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nContent-Length: 70000\r\n\r\n{}".to_vec(),
            413,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                .to_vec(),
            411,
        ),
        (
            b"POST /tools/get_order HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"user".to_vec(),
            0,
        ),
        (
            format!("GET /health HTTP/1.1\r\nX: {}\r\n\r\n", "h".repeat(20_000)).into_bytes(),
            431,
        ),
        (
            (0..70)
                .map(|i| format!("X-{i}: v\r\n"))
                .fold("GET /health HTTP/1.1\r\n".to_string(), |a, h| a + &h)
                .into_bytes(),
            431,
        ),
    ];
    let mut with_bad_key = post("/tools/issue_refund", "Idempotency-Key: ", refund);
    let at = with_bad_key
        .windows(2)
        .position(|w| w == b": ")
        .expect("key header")
        + 2;
    with_bad_key.splice(at..at, b"cl\xc3\xa9".iter().copied());
    cases.push((with_bad_key, 400));
    cases.push((b"POST /tools/get_order HTTP/1.1\r\nContent-Length: 4\r\nConnection: close\r\n\r\n\xff\xfe\xfd\xfc".to_vec(), 400));
    cases.push((b"POST /tools/get_order HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\nConnection: close\r\n\r\n{}".to_vec(), 400));
    let n = cases.len();
    for (req, want) in &cases {
        let (st, text) = raw(&svc.addr, req);
        let shown = String::from_utf8_lossy(&req[..req.len().min(80)]).into_owned();
        // 0: the server closed the slow request's connection after its read time (408 sent
        // first, or the client's half-close ended it).
        if *want == 0 {
            assert!(st == 408 || st == 400 || st == 0, "{shown}: {text}");
        } else {
            assert_eq!(st, *want, "{shown}: {text}");
            assert!(
                text.contains("\"error\""),
                "{shown}: the answer names the problem: {text}"
            );
        }
        let (h, _) = raw(
            &svc.addr,
            b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(h, 200, "alive after {shown}");
    }
    // Nothing reached the store's rules: no arrival was a write that took effect.
    let arrivals = json(d, &["store", "--store", "svc.redb", "arrivals", "--json"]);
    assert!(
        arrivals
            .as_array()
            .expect("arrivals")
            .iter()
            .all(|a| a["outcome"] != "applied"),
        "{arrivals}"
    );
    eprintln!("demo-store requests: {n} cases");
    assert!(n >= 30, "{n}");
}

/// A mock server: `/mN/...` answers case N's body to the first request and `then` after;
/// `/tN` answers tool case N's body every time.
fn mock(model_cases: Vec<(u16, String)>, then: String, tool_cases: Vec<(u16, String)>) -> String {
    let server = tiny_http::Server::http("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", server.server_addr());
    std::thread::spawn(move || {
        let mut seen = std::collections::HashSet::new();
        for mut req in server.incoming_requests() {
            let mut body = String::new();
            let _ = req.as_reader().read_to_string(&mut body);
            let path = req.url().to_string();
            let n: usize = path[2..]
                .split('/')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            let (status, body) = if path.starts_with("/m") {
                if seen.insert(n) {
                    model_cases[n].clone()
                } else {
                    (200, then.clone())
                }
            } else {
                tool_cases[n].clone()
            };
            let _ = req.respond(tiny_http::Response::from_string(body).with_status_code(status));
        }
    });
    url
}

fn completion(content: &str) -> String {
    json!({"choices": [{"finish_reason": "stop", "message": {"content": content}}],
           "usage": {"prompt_tokens": 10, "completion_tokens": 5}})
    .to_string()
}

#[test]
fn model_replies_script_lines_and_tool_results() {
    let (dir, base) = bench("bad-replies");
    let d = dir.path();
    let deep = |n: usize| format!("{}1{}", "[".repeat(n), "]".repeat(n));
    let final_reply = r#"{"type": "final", "outcome": "cannot_complete", "text": "giving up"}"#;
    // Replies a model may send (as the content of a completion, and as a script line).
    let replies: Vec<String> = vec![
        "hello".into(),
        "".into(),
        "{".into(),
        "[1, 2]".into(),
        "null".into(),
        "42".into(),
        r#""a string""#.into(),
        r#"{"type": 5}"#.into(),
        r#"{"type": "dance"}"#.into(),
        r#"{"kind": "final"}"#.into(),
        r#"{"type": "final"}"#.into(),
        r#"{"type": "final", "text": 5}"#.into(),
        r#"{"type": "final", "text": "x", "outcome": 7}"#.into(),
        r#"{"type": "tool"}"#.into(),
        r#"{"type": "tool", "name": 5, "args": {}}"#.into(),
        r#"{"type": "tool", "name": "teleport", "args": {}}"#.into(),
        r#"{"type": "tool", "name": "get_order", "args": []}"#.into(),
        r#"{"type": "tool", "name": "get_order", "args": {"order_id": 5}}"#.into(),
        r#"{"type": "tool", "name": "get_order", "args": {"order_id": "ord_1001"}, "plan_step": 3}"#.into(),
        r#"{"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 1e300}}"#.into(),
        r#"{"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 100}, "plan_step": "nope"}"#.into(),
        r#"{"type": "plan"}"#.into(),
        r#"{"type": "plan", "steps": "all of them"}"#.into(),
        r#"{"type": "plan", "steps": [{"id": 1}]}"#.into(),
        r#"{"type": "plan", "steps": [{"id": "s1", "tool": "teleport", "depends_on": []}]}"#.into(),
        r#"{"type": "plan", "steps": [{"id": "s1", "tool": "get_order", "depends_on": ["s9"]}]}"#.into(),
        r#"{"type": "plan", "steps": [{"id": "s1", "tool": "get_order", "depends_on": ["s1"]}]}"#.into(),
        format!(r#"{{"type": "tool", "name": "get_order", "args": {{"order_id": "ord_1001", "x": {}}}}}"#, deep(40)),
        format!(r#"{{"type": "final", "text": "{}"}}"#, "t".repeat(1_100_000)),
        // (A JSON move inside prose is taken, so this one has no whole object in it.)
        "\u{1b}[2J{\"type\": \"final\", \"text\": \"x\"".into(),
    ];
    // Bodies an OpenAI-compatible server may answer.
    let mut model_cases: Vec<(u16, String)> =
        replies.iter().map(|r| (200, completion(r))).collect();
    for (status, body) in [
        (200, "not json at all".to_string()),
        (200, "{}".into()),
        (200, r#"{"choices": []}"#.into()),
        (200, r#"{"choices": [{"message": {}}]}"#.into()),
        (200, r#"{"choices": [{"message": {"content": 5}}]}"#.into()),
        (200, r#"{"choices": [{"finish_reason": "length", "message": {"content": "{"}}]}"#.into()),
        (200, r#"{"choices": [{"message": {"content": null, "refusal": "no"}}]}"#.into()),
        (200, deep(300)),
        (200, format!(r#"{{"choices": {}}}"#, deep(60))),
        (200, r#"{"choices": [{"message": {"content": "hello"}}], "usage": {"prompt_tokens": -5, "completion_tokens": "many"}}"#.into()),
        (200, " ".repeat(2 << 20)),
        (401, r#"{"error": "bad key"}"#.into()),
        (404, "".into()),
        (418, "teapot".into()),
    ] {
        model_cases.push((status, body));
    }
    // Bodies a read tool may answer.
    let tool_cases: Vec<(u16, String)> = vec![
        (200, "not json".into()),
        (200, "{}".into()),
        (200, "[]".into()),
        (200, r#"{"status": 5}"#.into()),
        (200, format!(r#"{{"status": "ok", "x": {}}}"#, deep(40))),
        (200, " ".repeat(2 << 20)),
        (200, "".into()),
        (200, "\u{1b}[2J".into()),
        (500, "boom".into()),
        (404, "".into()),
        (400, r#"{"error": "bad"}"#.into()),
        (422, "mismatch".into()),
        (409, "in flight".into()),
        (
            200,
            r#"{"status": "ok", "order_status": {"deep": [1, 2]}}"#.into(),
        ),
        (
            200,
            r#"{"status": "ok", "order_status": "\u0000\u001b"}"#.into(),
        ),
    ];
    let url = mock(
        model_cases.clone(),
        completion(final_reply),
        tool_cases.clone(),
    );
    let mut cfg = String::new();
    for n in 0..model_cases.len() {
        cfg.push_str(&format!(
            "[models.m{n}]\nkind = \"openai\"\nbase_url = \"{url}/m{n}\"\nmodel = \"x\"\nmax_retries = 0\n\n"
        ));
    }
    cfg.push_str("[tools]\ncatalog = \"tools.toml\"\n");
    let mut cat = String::from("version = 1\n");
    for n in 0..tool_cases.len() {
        cat.push_str(&format!(
            "[[tools]]\nname = \"t{n}\"\naccess = \"read\"\nhttp = {{ url = \"{url}/t{n}\", timeout_ms = 5000 }}\n"
        ));
    }
    cat.push_str(&format!(
        "[[tools]]\nname = \"get_order\"\naccess = \"read\"\nhttp = {{ url = \"{url}/t0\" }}\n"
    ));
    cat.push_str(&format!(
        "[[tools]]\nname = \"issue_refund\"\naccess = \"write\"\nhttp = {{ url = \"{url}/t0\" }}\n"
    ));
    std::fs::write(d.join("worker.toml"), cfg).expect("config");
    std::fs::write(d.join("tools.toml"), cat).expect("catalog");
    let with_cfg = |args: &[&str]| {
        let mut a = vec!["--config", "worker.toml"];
        a.extend_from_slice(args);
        ok(d, &a)
    };
    let mut expect: Vec<(String, String)> = Vec::new();
    for n in 0..model_cases.len() {
        let id = with_cfg(&[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            &format!("m{n}"),
        ]);
        expect.push((id.trim().to_string(), format!("model case {n}")));
    }
    for (n, r) in replies.iter().enumerate() {
        if r.is_empty() {
            continue;
        }
        std::fs::write(
            d.join(format!("s{n}.jsonl")),
            format!("{r}\n{final_reply}\n"),
        )
        .expect("script");
        let out = worker(
            d,
            &[
                "--config",
                "worker.toml",
                "enqueue",
                "--user",
                "u",
                "--goal",
                "g",
                "--model",
                &format!("script:s{n}.jsonl"),
            ],
        );
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        no_panic(r, &err);
        if out.status.success() {
            let id = String::from_utf8_lossy(&out.stdout).trim().to_string();
            expect.push((id, format!("script case {n}")));
        } else {
            // Only a line over the depth or size limit is refused at enqueue, by name.
            assert_eq!(out.status.code(), Some(2), "{r:.80}: {err}");
            assert!(
                err.contains("nests") || err.contains("over the limit"),
                "{r:.80}: {err}"
            );
        }
    }
    for n in 0..tool_cases.len() {
        let script =
            format!("{{\"type\": \"tool\", \"name\": \"t{n}\", \"args\": {{}}}}\n{final_reply}\n");
        std::fs::write(d.join(format!("tool{n}.jsonl")), script).expect("script");
        let id = with_cfg(&[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            &format!("script:tool{n}.jsonl"),
        ]);
        expect.push((id.trim().to_string(), format!("tool case {n}")));
    }
    let out = worker(
        d,
        &[
            "--config",
            "worker.toml",
            "run",
            "--drain",
            "--max-in-flight",
            "4",
        ],
    );
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    no_panic("run", &err);
    assert!(out.status.success(), "{err}");
    let stops = [
        "done",
        "max_steps",
        "max_tool_calls",
        "max_tokens",
        "deadline",
        "repeated_call",
        "no_progress",
        "needs_approval",
        "unknown_outcome",
        "model_failed",
    ];
    for (id, case) in &expect {
        let t = json(d, &["show", id, "--json"]);
        let stop = t["stop"].as_str().unwrap_or("-");
        assert!(stops.contains(&stop), "{case}: {t}");
        // The bad input was turned into an error of its step, recorded as such.
        let r = &t["state"]["last_result"];
        if case.starts_with("tool") {
            let n: usize = case
                .rsplit(' ')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            // A 2xx JSON body is a result (docs/tools.md): `{}`, `[]`, `{"status": 5}` (the
            // service's own status, kept as `service_status`) and an empty body are `ok`.
            if [1, 2, 3, 6].contains(&n) {
                assert_eq!(r["status"], "ok", "{case}: {t}");
            } else if n < 13 {
                assert_eq!(r["status"], "error", "{case}: {t}");
            }
        } else {
            let trace = json(d, &["trace", id, "--json"]);
            let first_model = trace
                .as_array()
                .expect("spans")
                .iter()
                .find(|s| s["kind"] == "model")
                .cloned()
                .unwrap_or(Value::Null);
            let step_failed = r["status"] == "error" || first_model["status"] == "error";
            assert!(step_failed || stop != "done", "{case}: {t}\n{first_model}");
        }
    }
    ok(d, &["check"]);
    // The daemon ran the earlier queued task too, as it should; the finished one is as it was.
    let finished: Vec<Value> = base
        .as_array()
        .expect("baseline")
        .iter()
        .filter(|t| t["status"] == "finished")
        .cloned()
        .collect();
    intact(d, &Value::Array(finished), "replies");
    eprintln!(
        "model replies, script lines, tool results: {} cases run, {} script lines refused at enqueue",
        expect.len(),
        replies.len() - 1 - (expect.len() - model_cases.len() - tool_cases.len())
    );
    assert!(expect.len() >= 60, "{} cases", expect.len());
}

/// Review item 14: a batch line (or a script line) naming a field twice ran with the last one.
#[test]
fn hole_14_a_field_named_twice_is_refused() {
    let (dir, base) = bench("bad-review-dup");
    let d = dir.path();
    for line in [
        r#"{"user": "u", "user": "v", "goal": "g"}"#,
        r#"{"user": "u", "goal": "g", "goal": "h"}"#,
        r#"{"user": "u", "goal": "g", "key": "a", "key": "b"}"#,
        r#"{"user": "u", "goal": "g", "budget": {"steps_max": 3, "steps_max": 9}}"#,
    ] {
        std::fs::write(d.join("dup.jsonl"), format!("{line}\n")).expect("batch");
        refused(
            d,
            &["enqueue", "--model", "policy", "--file", "dup.jsonl"],
            2,
            "twice",
        );
    }
    std::fs::write(
        d.join("dup-script.jsonl"),
        "{\"type\": \"final\", \"type\": \"plan\", \"outcome\": \"completed\", \"text\": \"x\"}\n",
    )
    .expect("script");
    refused(
        d,
        &[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            "script:dup-script.jsonl",
        ],
        2,
        "twice",
    );
    intact(d, &base, "duplicate fields");
}

/// Review item 14: a goal or note with a newline printed a forged row in `list` and
/// `memory list`.
#[test]
fn hole_14_a_newline_in_stored_text_prints_no_row_of_its_own() {
    let (dir, _) = bench("bad-review-newline");
    let d = dir.path();
    let fake = "refund\nt99      finished   done forged row \u{202E}wor degrof";
    ok(
        d,
        &[
            "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", fake,
        ],
    );
    ok(
        d,
        &[
            "memory",
            "add",
            "--user",
            "cu_ana",
            "--source",
            "user_message",
            "--text",
            fake,
        ],
    );
    for args in [&["list"][..], &["memory", "list", "--user", "cu_ana"]] {
        let out = ok(d, args);
        assert!(
            !out.lines().any(|l| l.starts_with("t99")),
            "{args:?} printed a forged row:\n{out}"
        );
        assert!(out.contains("refund\\nt99"), "{args:?}:\n{out}");
        assert!(
            !out.contains('\u{202E}'),
            "{args:?}: a right-to-left override printed raw"
        );
    }
}

/// Review item 14: `--otlp-endpoint http://:4318` and an endpoint with an escape character
/// were accepted; `--metrics not-an-address` and a missing `--config` file exited 1.
#[test]
fn hole_14_urls_addresses_and_files_are_usage_errors_at_start() {
    let fresh = TempDir::new("bad-review-fresh");
    let f = fresh.path();
    for (args, want) in [
        (
            &["run", "--drain", "--otlp-endpoint", "http://:4318"][..],
            "has no host",
        ),
        (
            &[
                "run",
                "--drain",
                "--otlp-endpoint",
                "http://col\u{1b}[31mlector:4318",
            ],
            "control character",
        ),
        (
            &["run", "--drain", "--otlp-endpoint", "http://a b:4318"],
            "space",
        ),
        (
            &["run", "--drain", "--metrics", "not-an-address"],
            "not an address",
        ),
        (
            &["--config", "no-such.toml", "run", "--drain"],
            "no-such.toml",
        ),
        (
            &[
                "--config",
                "no-such.toml",
                "enqueue",
                "--user",
                "u",
                "--goal",
                "g",
            ],
            "no-such.toml",
        ),
    ] {
        refused(f, args, 2, want);
        let err = String::from_utf8_lossy(&worker(f, args).stderr).into_owned();
        assert!(
            !err.contains('\u{1b}'),
            "{args:?}: an escape character printed raw: {err:?}"
        );
    }
    assert!(
        !f.join("worker.redb").exists(),
        "a usage error created the database"
    );
}

/// Review item 13: a FIFO given as `--db` was called a truncated database.
#[test]
fn hole_13_a_fifo_is_not_a_database() {
    let fresh = TempDir::new("bad-review-fifo");
    let f = fresh.path();
    let fifo = f.join("fifo.redb");
    let made = Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
    assert!(made.success());
    let fifo_s = fifo.display().to_string();
    refused(f, &["--db", &fifo_s, "list"], 1, "not a regular file");
    refused(
        f,
        &["--db", &fifo_s, "run", "--drain"],
        1,
        "not a regular file",
    );
}

/// Review item 14: `worker migrate` adopted the demo store's redb file as a worker database,
/// and `check` said "ok: 0 records".
#[test]
fn hole_14_a_redb_file_of_another_kind_is_refused() {
    let (dir, _) = bench("bad-review-foreign");
    let d = dir.path();
    let store_file = d.join("worker.store.redb");
    assert!(store_file.exists(), "the bench ran the demo store");
    let store_s = store_file.display().to_string();
    for verb in [&["migrate"][..], &["check"], &["run", "--drain"], &["list"]] {
        let mut args = vec!["--db", &store_s];
        args.extend_from_slice(verb);
        refused(d, &args, 1, "another kind");
    }
    ok(d, &["store", "--store", "worker.store.redb", "ledger"]);
    // And the other way round: the worker database is not a store file.
    for verb in [&["store", "orders"][..], &["store", "ledger"]] {
        let mut args = verb.to_vec();
        args.extend_from_slice(&["--store", "worker.redb"]);
        refused(d, &args, 1, "not the demo shop's file");
    }
    ok(d, &["list"]);
}

/// Review item 13: the reconcile hint named one exhausted limit at a time (`try --extend
/// tool_calls=1`, then `try --extend deadline_ms=10000`).
#[test]
fn hole_13_one_hint_names_every_limit_a_resend_needs() {
    let held = TempDir::new("bad-review-held");
    let h = held.path();
    enqueue(
        h,
        &[
            "--tool-latency",
            "issue_refund=40000",
            "--budget",
            "tool_calls_max=2",
        ],
    );
    ok(h, &["run", "--drain"]);
    let (code, err) = fails(h, &["reconcile", "t1", "--not-applied", "--by", "bob"]);
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("tool calls are used up") && err.contains("active time is used up"),
        "{err}"
    );
    assert!(
        err.contains("--extend tool_calls=1,deadline_ms=10000"),
        "{err}"
    );
    ok(
        h,
        &[
            "reconcile",
            "t1",
            "--not-applied",
            "--by",
            "bob",
            "--extend",
            "tool_calls=1,deadline_ms=10000",
        ],
    );
}
