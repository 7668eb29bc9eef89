//! The real `worker` binary in temporary directories: the demo, enqueue/run/show/trace,
//! idempotent enqueue, scenario G held with nothing refunded, JSON output, exit codes for bad
//! input, and damaged or newer database files.

use crate::common;
use common::*;

conformance! {
    /// `worker demo` on a file, or through PostgreSQL in schemas of its own that it drops.
    fn demo_prints_the_documents_table_through_the_durable_path(d) {
        assert_eq!(ok(d, &["demo"]), fixture("scenarios"));
        if let Some(url) = db_url(d) {
            let out = std::process::Command::new("psql")
                .args(["-X", "-A", "-t", "-d", url.split('?').next().unwrap_or(&url), "-c",
                    "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'demo_%'"])
                .output()
                .expect("psql");
            assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "0", "the demo's schemas are dropped");
        }
    }
}

#[test]
fn enqueue_run_show_trace() {
    let dir = TempDir::new("basic");
    let d = dir.path();
    assert_eq!(enqueue(d, &[]).trim(), "t1");
    ok(d, &["run", "--drain", "--max-in-flight", "2"]);
    let show = ok(d, &["show", "t1"]);
    assert!(show.contains("stop      done"), "{show}");
    assert!(show.contains("tokens         708 / 4000"), "{show}");
    assert!(show.contains("the confirmation email was sent"), "{show}");
    assert_eq!(ok(d, &["trace", "t1"]), fixture("trace"));
    let pm = ok(d, &["postmortem", "t1"]);
    assert!(
        pm.starts_with("task t1: done after 5 step(s)\n")
            && pm.contains("nothing: the task is complete"),
        "{pm}"
    );
    let ledger = json(d, &["store", "ledger", "--json"]);
    assert_eq!(ledger.as_array().map(Vec::len), Some(2));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.file("worker.redb"))
            .expect("db exists")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "database must be private to its owner");
    }
}

conformance! {
    fn enqueue_with_the_same_key_creates_one_task(d) {
        let a = json(
            d,
            &[
                "enqueue", "--model", "policy", "--user", "u", "--goal", "g", "--key", "job-1", "--json",
            ],
        );
        let b = json(
            d,
            &[
                "enqueue", "--model", "policy", "--user", "u", "--goal", "g", "--key", "job-1", "--json",
            ],
        );
        assert_eq!(a[0]["id"], b[0]["id"]);
        assert_eq!(a[0]["created"], true);
        assert_eq!(b[0]["created"], false);
        let list = json(d, &["list", "--json", "--limit", "10000"]);
        assert_eq!(list.as_array().map(Vec::len), Some(1));
    }
}

conformance! {
    fn scenario_g_suspends_with_its_call_held_and_nothing_refunded(d) {
        enqueue(d, &["--model", "policy:ord_1004:8000"]);
        ok(d, &["run", "--drain"]);
        let show = json(d, &["show", "t1", "--json"]);
        assert_eq!(show["status"], "suspended");
        assert_eq!(show["stop"], "needs_approval");
        assert_eq!(show["state"]["pending"]["name"], "issue_refund");
        assert_eq!(show["state"]["pending"]["args"]["amount_cents"], 8000);
        assert_eq!(show["tokens"], 393);
        assert_eq!(
            json(d, &["store", "ledger", "--json"]),
            serde_json::json!([])
        );
        let listed = json(d, &["list", "--status", "suspended", "--json"]);
        assert_eq!(listed.as_array().map(Vec::len), Some(1));
        // A second drain does not run a suspended task again.
        ok(d, &["run", "--drain"]);
        assert_eq!(json(d, &["show", "t1", "--json"])["steps"], 3);
    }
}

conformance! {
    fn batch_enqueue_is_all_or_nothing_and_names_the_line(d) {
        let good = r#"{"user": "cu_ana", "goal": "refund", "key": "a"}
    {"user": "cu_ana", "goal": "refund", "budget": {"steps_max": 3}, "model": "policy:ord_1004:8000", "priority": 5}
    "#;
        std::fs::write(d.join("good.jsonl"), good).expect("write");
        let out = json(d, &["enqueue", "--model", "policy", "--file", "good.jsonl", "--json"]);
        assert_eq!(out.as_array().map(Vec::len), Some(2));
        let bad = "{\"user\": \"u\", \"goal\": \"g\"}\n{\"user\": \"u\", \"goal\": \"g\", \"budget\": {\"steps\": 3}}\n";
        std::fs::write(d.join("bad.jsonl"), bad).expect("write");
        let (code, err) = fails(d, &["enqueue", "--model", "policy", "--file", "bad.jsonl"]);
        assert_eq!(code, 2);
        assert!(
            err.contains("bad.jsonl:2") && err.contains("unknown budget \"steps\""),
            "{err}"
        );
        let unknown_field = "{\"user\": \"u\", \"goal\": \"g\", \"colour\": 1}\n";
        std::fs::write(d.join("bad2.jsonl"), unknown_field).expect("write");
        let (code, err) = fails(d, &["enqueue", "--model", "policy", "--file", "bad2.jsonl"]);
        assert_eq!(code, 2);
        assert!(err.contains("colour"), "{err}");
        assert_eq!(
            json(d, &["list", "--json", "--limit", "10000"]).as_array().map(Vec::len),
            Some(2),
            "nothing of a bad batch lands"
        );
        // Newest first: the second line, of priority 5, is listed first.
        let list = json(d, &["list", "--status", "queued", "--json"]);
        assert_eq!(list[0]["priority"], 5);
    }
}

conformance! {
    fn json_output_parses_for_every_read_verb(d) {
        enqueue(d, &["--model", "same_call"]);
        ok(d, &["run", "--drain"]);
        assert_eq!(json(d, &["list", "--json", "--limit", "10000"])[0]["stop"], "repeated_call");
        assert_eq!(
            json(d, &["show", "t1", "--json"])["closing_message"]
                .as_str()
                .map(|s| s.contains("same call")),
            Some(true)
        );
        assert_eq!(
            json(d, &["trace", "t1", "--json"]).as_array().map(Vec::len),
            Some(9)
        );
        assert_eq!(
            json(d, &["postmortem", "t1", "--json"])["first_error"][1],
            "not_found"
        );
        assert!(
            json(d, &["store", "orders", "--json"])
                .get("ord_1001")
                .is_some()
        );
    }
}

#[test]
fn bad_input_gets_exit_code_2_and_names_the_problem() {
    let dir = TempDir::new("usage");
    let d = dir.path();
    let cases: &[(&[&str], &str)] = &[
        (&["enqueue", "--model", "policy", "--goal", "g"], "--user"),
        (
            &["enqueue", "--model", "policy", "--user", "", "--goal", "g"],
            "--user must not be empty",
        ),
        (
            &[
                "enqueue", "--model", "policy", "--user", "u", "--goal", "  ",
            ],
            "--goal must not be empty",
        ),
        (
            &[
                "enqueue",
                "--model",
                "policy",
                "--user",
                "u",
                "--goal",
                "g",
                "--budget",
                "steps_max",
            ],
            "expected NAME=VALUE",
        ),
        (
            &[
                "enqueue",
                "--model",
                "policy",
                "--user",
                "u",
                "--goal",
                "g",
                "--budget",
                "steps_max=-1",
            ],
            "not a whole number",
        ),
        (
            &["enqueue", "--user", "u", "--goal", "g", "--model", "gpt"],
            "unknown model",
        ),
        (
            &[
                "enqueue",
                "--user",
                "u",
                "--goal",
                "g",
                "--model",
                "policy:ord_1:lots",
            ],
            "whole number of cents",
        ),
        (
            &[
                "enqueue",
                "--model",
                "policy",
                "--user",
                "u",
                "--goal",
                "g",
                "--tool-latency",
                "teleport=5",
            ],
            "unknown tool",
        ),
        (&["list", "--status", "sleeping"], "is not a status"),
        (&["list", "--stop", "tired"], "is not a stop reason"),
        (&["run", "--max-in-flight", "0"], "max-in-flight"),
        (&["run", "--workers", "4"], "worker threads are retired"),
        (&["run", "--time-scale=-1"], "time-scale"),
        (&["show"], "TASK"),
        (
            &["store", "add-order", "--order", "ord_1:cu"],
            "ID:CUSTOMER:TOTAL_CENTS",
        ),
        (&["frobnicate"], "unrecognized subcommand"),
    ];
    for (args, want) in cases {
        let (code, err) = fails(d, args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in {err}");
    }
    // Nothing was created by rejected commands.
    assert!(!dir.file("worker.redb").exists());
}

conformance! {
    fn operational_errors_get_exit_code_1(d) {
        let (code, err) = fails(d, &["list"]);
        assert_eq!(code, 1);
        assert!(
            err.contains("no database at") && err.contains("hint:"),
            "{err}"
        );
        ok(d, &["enqueue", "--model", "policy", "--user", "u", "--goal", "g"]);
        let (code, err) = fails(d, &["show", "t42"]);
        assert_eq!(code, 1);
        assert!(err.contains("no task \"t42\""), "{err}");
        let (code, err) = fails(d, &["trace", "nope"]);
        assert_eq!(code, 1, "{err}");
        // A batch file that is not there is a wrong argument: a usage error (issue 9).
        let (code, err) = fails(d, &["enqueue", "--model", "policy", "--file", "missing.jsonl"]);
        assert_eq!(code, 2);
        assert!(err.contains("missing.jsonl"), "{err}");
        let (code, err) = fails(
            d,
            &[
                "enqueue",
                "--user",
                "u",
                "--goal",
                "g",
                "--model",
                "script:none.jsonl",
            ],
        );
        assert_eq!(code, 2);
        assert!(err.contains("none.jsonl"), "{err}");
    }
}

#[test]
fn damaged_and_newer_files_are_refused_cleanly() {
    let dir = TempDir::new("damaged");
    let d = dir.path();
    ok(
        d,
        &["enqueue", "--model", "policy", "--user", "u", "--goal", "g"],
    );
    let db = dir.file("worker.redb");
    let good = std::fs::read(&db).expect("read db");

    // Truncated.
    std::fs::write(dir.file("trunc.redb"), &good[..good.len() / 3]).expect("write");
    let (code, err) = fails(d, &["--db", "trunc.redb", "list"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("damaged") && !err.contains("panicked"),
        "{err}"
    );

    // Not a database at all.
    std::fs::write(dir.file("junk.redb"), vec![0x5a; 20_000]).expect("write");
    let (code, err) = fails(d, &["--db", "junk.redb", "show", "t1"]);
    assert_eq!(code, 1);
    assert!(
        err.contains("damaged") && !err.contains("panicked"),
        "{err}"
    );

    // Written by a newer schema.
    {
        let newer = redb::Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .create(&db)
            .expect("open");
        let w = newer.begin_write().expect("write");
        {
            let mut meta = w.open_table(tether::store::schema::META).expect("meta");
            meta.insert("schema_version", 99u64).expect("insert");
        }
        w.commit().expect("commit");
    }
    for verb in [
        &["list"][..],
        &["enqueue", "--model", "policy", "--user", "u", "--goal", "g"],
        &["run", "--drain"],
    ] {
        let (code, err) = fails(d, verb);
        assert_eq!(code, 1, "{verb:?}");
        assert!(
            err.contains("newer version") && err.contains("99"),
            "{verb:?}: {err}"
        );
    }
}

#[test]
fn help_has_examples() {
    let dir = TempDir::new("help");
    let verbs: [&[&str]; 17] = [
        &["run"],
        &["enqueue", "--model", "policy"],
        &["list"],
        &["show"],
        &["trace"],
        &["postmortem"],
        &["demo"],
        &["demo-store"],
        &["approve"],
        &["reject"],
        &["reconcile"],
        &["cancel"],
        &["replay"],
        &["events"],
        &["memory", "add"],
        &["memory", "list"],
        &["memory", "forget"],
    ];
    for verb in verbs {
        let mut args = verb.to_vec();
        args.push("--help");
        let out = ok(dir.path(), &args);
        assert!(
            out.contains("Example"),
            "{verb:?} --help has no example:\n{out}"
        );
    }
}

/// The demo shop's flag is on the verbs that reach the demo shop, and only there: a job's
/// `enqueue --help` or an operator's `list --help` does not offer it.
#[test]
fn the_demo_shops_flag_is_on_its_verbs_only() {
    let dir = TempDir::new("help-store");
    let d = dir.path();
    for verb in [
        &["run"][..],
        &["console"],
        &["reconcile"],
        &["replay"],
        &["check"],
        &["store", "ledger"],
        &["demo-store"],
        &["migrate"],
    ] {
        let mut args = verb.to_vec();
        args.push("--help");
        let out = ok(d, &args);
        assert!(
            out.contains("--store"),
            "{verb:?} --help lacks --store:\n{out}"
        );
    }
    for verb in [
        &["enqueue"][..],
        &["list"],
        &["show"],
        &["approve"],
        &["cancel"],
        &["events"],
        &["purge"],
    ] {
        let mut args = verb.to_vec();
        args.push("--help");
        let out = ok(d, &args);
        assert!(
            !out.contains("--store "),
            "{verb:?} --help offers --store:\n{out}"
        );
    }
    // Before or after the demo shop's sub-verb, the same file.
    ok(
        d,
        &[
            "store",
            "--store",
            "x.store.redb",
            "add-order",
            "--order",
            "ord_9:cu_x:100",
        ],
    );
    let out = ok(d, &["store", "orders", "--store", "x.store.redb", "--json"]);
    assert!(out.contains("ord_9"), "{out}");
    let out = worker(d, &["list", "--store", "x.store.redb"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--store"),
        "{out:?}"
    );
}

/// A database written before a table was added to schema 1 gets the table on open.
#[test]
fn a_missing_table_is_created_on_open() {
    let dir = TempDir::new("compat");
    let d = dir.path();
    enqueue(d, &["--model", "policy:ord_1004:8000"]);
    {
        let db = redb::Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .create(dir.file("worker.redb"))
            .expect("open");
        let w = db.begin_write().expect("write");
        assert!(
            w.delete_table(tether::store::schema::WAITING)
                .expect("delete")
        );
        w.commit().expect("commit");
    }
    ok(d, &["run", "--drain"]);
    assert_eq!(json(d, &["show", "t1", "--json"])["status"], "suspended");
}

/// The allocator is chosen before `main` from the verb: mimalloc for the daemon, the system's
/// for one-shot verbs (whose start and exit mimalloc's arena slowed). The choice is made in
/// the C runtime's pre-init hook, so this fails if that hook never ran (the daemon would say
/// "system") or if the verb were not what decides.
#[test]
fn the_daemon_allocates_with_mimalloc_and_one_shot_verbs_with_the_system() {
    let dir = TempDir::new("allocator");
    let d = dir.path();
    let chosen = |args: &[&str]| {
        let out = command(d)
            .env("RUST_LOG", "worker=debug")
            .args(args)
            .output()
            .expect("run worker");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "worker {args:?}: {err}");
        err.lines()
            .find_map(|l| {
                l.split("allocator=\"")
                    .nth(1)?
                    .split('"')
                    .next()
                    .map(str::to_string)
            })
            .unwrap_or_else(|| panic!("worker {args:?} logged no allocator:\n{err}"))
    };
    assert_eq!(
        chosen(&[
            "enqueue", "--model", "policy", "--user", "u", "--goal", "run"
        ]),
        "system"
    );
    assert_eq!(chosen(&["run", "--drain"]), "mimalloc");
    assert_eq!(chosen(&["list"]), "system");
}

/// mimalloc is built without its requests for transparent huge pages: with them each worker
/// thread's first pages cost a zeroed 2 MiB page (a 64-thread daemon held 160 MB, 66 MB
/// without). A mapping the process asked huge pages for carries `hg` in its `VmFlags`
/// (whatever the system's own policy gives), so a daemon that ran tasks on several threads
/// must show none.
#[test]
#[cfg(target_os = "linux")]
fn the_daemon_asks_for_no_huge_pages() {
    let dir = TempDir::new("no-thp");
    let d = dir.path();
    // Without the settings that ask for huge pages from the environment (mimalloc's own, and
    // glibc's for its arenas), so that only what the binary does is seen.
    let mut cmd = command(d);
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("MIMALLOC_") || text == "GLIBC_TUNABLES" {
            cmd.env_remove(&name);
        }
    }
    let daemon = common::serve::spawn_with(
        cmd,
        &["run", "--console", "127.0.0.1:0", "--max-in-flight", "8"],
    );
    let ids: Vec<String> = (0..16)
        .map(|i| {
            let scope = format!("s{i}");
            enqueue(d, &["--model", "new_ids", "--store-scope", &scope])
                .trim()
                .to_string()
        })
        .collect();
    for id in &ids {
        // These tasks stop on their loop check (no_progress): exit 4.
        let out = worker(d, &["wait", id, "--timeout", "60s"]);
        assert_eq!(
            out.status.code(),
            Some(4),
            "worker wait {id}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let smaps = std::fs::read_to_string(format!("/proc/{}/smaps", daemon.child.id()))
        .expect("the daemon's mappings");
    let advised: Vec<&str> = smaps
        .lines()
        .filter(|l| l.starts_with("VmFlags:") && l.split_whitespace().any(|f| f == "hg"))
        .collect();
    assert!(
        advised.is_empty(),
        "the daemon asked for huge pages on {} mappings",
        advised.len()
    );
}

/// Issue 52: a script's simulated latency per reply is set like the other demo models'
/// (`script:FILE:MS`), so a long script need not run out of active time; without it a reply
/// takes the demo's 1,500 ms.
#[test]
fn a_scripts_latency_is_set_like_the_other_demo_models() {
    let dir = TempDir::new("script-latency");
    let d = dir.path();
    let done = r#"{"type": "final", "outcome": "cannot_complete", "text": "no order"}"#;
    std::fs::write(d.join("s.jsonl"), done).expect("script");
    for (model, elapsed) in [
        ("script:s.jsonl", 1.5),
        ("script:s.jsonl:0", 0.0),
        ("script:s.jsonl:250", 0.25),
    ] {
        let id = ok(
            d,
            &["enqueue", "--user", "u", "--goal", "g", "--model", model],
        );
        ok(d, &["run", "--drain"]);
        let t = json(d, &["show", id.trim(), "--json"]);
        assert_eq!(t["stop"], "done", "{model}: {t}");
        assert_eq!(t["elapsed_s"], elapsed, "{model}: {t}");
        assert!(
            t["closing_message"]
                .as_str()
                .is_some_and(|m| m.contains("(cannot_complete): no order. No plan was set")),
            "a sentence ends before the next begins: {t}"
        );
    }
    let (code, err) = fails(
        d,
        &[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            "script:s.jsonl:x",
        ],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("s.jsonl:x"),
        "a file of that name is looked for: {err}"
    );
    // A file whose own name ends in `:` and digits is that file, not a latency.
    std::fs::write(d.join("run:2024"), done).expect("script");
    let id = ok(
        d,
        &[
            "enqueue",
            "--user",
            "u",
            "--goal",
            "g",
            "--model",
            "script:run:2024",
        ],
    );
    ok(d, &["run", "--drain"]);
    assert_eq!(json(d, &["show", id.trim(), "--json"])["elapsed_s"], 1.5);
}

/// Issue 52: two tools that would record one fact under one name (the same fact_prefix_arg,
/// a field in both fact_fields) are named in a warning when the catalog is read.
#[test]
fn overlapping_facts_are_a_warning_at_catalog_load() {
    let dir = TempDir::new("facts-overlap");
    let d = dir.path();
    let tool = |name: &str, fields: &str| {
        format!(
            "[[tools]]\nname = \"{name}\"\naccess = \"read\"\nfact_fields = [{fields}]\n\
             fact_prefix_arg = \"order_id\"\nhttp = {{ url = \"http://127.0.0.1:9/{name}\" }}\n\
             args.order_id = {{ type = \"string\", required = true }}\n"
        )
    };
    let catalog = [
        "version = 1\n".to_string(),
        tool("get_order", "\"status\", \"total\""),
        tool("get_shipment", "\"status\", \"carrier\""),
        tool("get_invoice", "\"due\""),
        // Without a fact_prefix_arg a tool's facts are named after it: these two never clash.
        "[[tools]]\nname = \"get_ticket\"\naccess = \"read\"\nfact_fields = [\"state\"]\n\
         http = { url = \"http://127.0.0.1:9/t\" }\n"
            .to_string(),
        "[[tools]]\nname = \"get_case\"\naccess = \"read\"\nfact_fields = [\"state\"]\n\
         http = { url = \"http://127.0.0.1:9/c\" }\n"
            .to_string(),
    ]
    .concat();
    std::fs::write(d.join("tools.toml"), catalog).expect("catalog");
    std::fs::write(d.join("worker.toml"), "[tools]\ncatalog = \"tools.toml\"\n").expect("config");
    let out = worker(d, &["--config", "worker.toml", "tools", "list"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("tools \"get_order\" and \"get_shipment\" both record the fact(s) status for the same order_id"),
        "{err}"
    );
    assert!(!err.contains("get_invoice"), "{err}");
    assert!(!err.contains("get_ticket"), "{err}");
}
