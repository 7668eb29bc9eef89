//! Regression tests for the exactly-once defects of issue 8, each able to see its violation:
//! they read the store's arrivals log (every write request that reached it) or the task's
//! committed record, not only the deduplicated ledger.
//!
//! - a rejected call is never applied, whatever an approve did before failing;
//! - a superseded claim (same process, older fencing token) can never commit, and a process
//!   never recovers its own live claims;
//! - a held call whose re-send was in flight at a crash is not sent again (not idempotent);
//! - a settled call is not counted twice; a re-send the budget would stop is refused;
//! - decisions name the call they were made for;
//! - the kernel owns keys: a write must name a plan step of its tool;
//! - keys of two databases never collide at one tool service;
//! - a cancelled held write stays listed until it is settled;
//! - an enqueue key reused for another request is refused.

use crate::common;
use common::*;
use tether::store::prelude::*;

use serde_json::Value;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tether::model::ModelProfile;
use tether::store::{Backend, Commit, CommitKind, Error, Lease, NewTask, RedbStore};

pub(crate) fn new_task(user: &str, goal: &str, key: Option<&str>) -> NewTask {
    NewTask {
        key: key.map(str::to_string),
        approval_wait_ms: 60_000,
        ..NewTask::of(
            user,
            goal,
            ModelProfile::parse("policy", None).expect("policy"),
        )
    }
}

fn lease(owner: &str, expires_at_ms: u64) -> Lease {
    Lease {
        owner: owner.into(),
        host: "test-host".into(),
        pid: 1,
        start_ticks: 0,
        expires_at_ms,
        token: 0,
    }
}

fn step_commit(rec: &tether::store::TaskRecord, token: u64, steps: u32) -> Commit {
    let mut state = rec.state.clone();
    state.step = steps;
    Commit {
        task_id: rec.id.clone(),
        token,
        kind: CommitKind::Step,
        state,
        next_span_id: rec.next_span_id,
        spans: Vec::new(),
        reply: None,
        call: None,
        now_ms: 1_000,
        lease_ms: 1_000,
        clear_settle: false,
        claim_next: None,
        export: false,
        callback: None,
        not_before_ms: None,
    }
}

/// One commit in its own transaction; a superseded claim is `LeaseLost`.
fn commit(store: &dyn Backend, c: &Commit) -> Result<(), Error> {
    match store.commit_batch(&[c]) {
        Ok(mut v) => v
            .pop()
            .flatten()
            .map(|_| ())
            .ok_or_else(|| Error::LeaseLost(c.task_id.clone())),
        Err(e) => Err(Error::Invalid(e)),
    }
}

/// The test directory's database as a backend: a file in it, or its PostgreSQL schema.
pub(crate) fn backend(d: &Path) -> Arc<dyn Backend> {
    match db_url(d) {
        Some(url) => Arc::new(
            tether::store::pg::PgStore::open(&url, true, 4, std::time::Duration::from_secs(5))
                .expect("open"),
        ),
        None => Arc::new(RedbStore::open(&d.join("w.redb"), true).expect("open")),
    }
}

conformance! {
    /// Defect 1: a reject wins, an approve comes after it and fails. Before, the approve had
    /// already written an approval into the tool store, and the model's identical re-proposal
    /// was applied. Now nothing outside the worker database knows of approvals.
    fn a_rejected_refund_is_never_applied(d) {
        suspended_g(d);
        let digest = held_digest(d, "t1");
        ok(d, &["reject", "t1", "--digest", &digest, "--reason", "no"]);
        let (code, err) = fails(d, &["approve", "t1", "--digest", &digest]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("not waiting for approval"), "{err}");
        // The policy proposes the same refund again (same key, same digest, within repeat_max).
        ok(d, &["run", "--drain"]);
        assert!(ledger(d).is_empty(), "a rejected refund was applied");
        let outcomes: Vec<Value> = arrivals(d).iter().map(|a| a["outcome"].clone()).collect();
        assert!(!outcomes.is_empty());
        assert!(
            outcomes.iter().all(|o| o == "needs_approval"),
            "{outcomes:?}"
        );
    }
}

conformance! {
    /// A group of commits is one transaction: a superseded claim in it is refused alone, the
    /// others land, and a final commit in the group claims the thread's next task.
    fn a_group_refuses_a_superseded_commit_alone(d) {
        let store = backend(d);
        let three = [
            new_task("cu_ana", "a", None),
            new_task("cu_ana", "b", None),
            new_task("cu_ana", "c", None),
        ];
        store.enqueue(&three, 0).expect("enqueue");
        let claimed = store.claim(&lease("me", 0), 2, 0).expect("claim");
        let (a, b) = (&claimed[0], &claimed[1]);
        let ta = a.lease.as_ref().expect("lease").token;
        let tb = b.lease.as_ref().expect("lease").token;
        let stale = step_commit(a, ta + 7, 5);
        let mut fin = step_commit(b, tb, 2);
        fin.kind = CommitKind::Final(tether::kernel::StopReason::Done);
        fin.claim_next = Some(lease("me", 0));
        let out = store.commit_batch(&[&stale, &fin]).expect("the group");
        assert!(out[0].is_none(), "the superseded commit is refused");
        let next = out[1].as_ref().expect("accepted").next.as_ref().expect("next claimed");
        assert_eq!(next.id, "t3");
        assert_eq!(store.task(&a.id).expect("a").state.step, a.state.step);
        assert_eq!(store.task(&b.id).expect("b").status.as_str(), "finished");
        assert_eq!(store.task("t3").expect("t3").status.as_str(), "running");
    }
}

conformance! {
    /// Defect 2: the stale claim's commits were accepted because the lease named the process,
    /// not the claim. With fencing, the older token of the same owner is refused.
    fn a_superseded_claim_never_commits(d) {
        let store = backend(d);
        store
            .enqueue(&[new_task("cu_ana", "refund", None)], 0)
            .expect("enqueue");
        let first = store.claim(&lease("me", 0), 1, 0).expect("claim").remove(0);
        let t1 = first.lease.as_ref().expect("lease").token;
        commit(store.as_ref(), &step_commit(&first, t1, 3)).expect("the live claim commits");
        // The lease runs out; the same process recovers and claims the task again.
        let far = 10_000_000;
        let none_live = |_: &str, _: &Lease| false;
        let recovered = store
            .recover(far, &|_: &Lease| false, &none_live)
            .expect("recover");
        assert_eq!(recovered, ["t1"]);
        let second = store
            .claim(&lease("me", far), 1, far)
            .expect("claim")
            .remove(0);
        let t2 = second.lease.as_ref().expect("lease").token;
        assert!(t2 > t1, "fencing tokens grow: {t1} then {t2}");
        // The stale copy tries to commit an older state: refused, nothing written.
        let stale = commit(store.as_ref(), &step_commit(&first, t1, 1));
        assert!(matches!(stale, Err(Error::LeaseLost(_))), "{stale:?}");
        assert_eq!(store.task("t1").expect("task").state.step, 3);
        commit(store.as_ref(), &step_commit(&second, t2, 4)).expect("the current claim commits");
        assert_eq!(store.task("t1").expect("task").state.step, 4);
    }
}

conformance! {
    /// Defect 2, the daemon's side: its own recovery skipped nothing, so it requeued the tasks its
    /// own threads were running. A live claim is never recovered by its own process.
    fn a_process_never_recovers_its_own_live_claims(d) {
        let store = backend(d);
        store
            .enqueue(
                &[new_task("cu_ana", "a", None), new_task("cu_ana", "b", None)],
                0,
            )
            .expect("enqueue");
        let claimed = store.claim(&lease("me", 0), 2, 0).expect("claim");
        let live_id = claimed[0].id.clone();
        let live_token = claimed[0].lease.as_ref().expect("lease").token;
        let live = |id: &str, l: &Lease| id == live_id && l.token == live_token;
        let recovered = store
            .recover(10_000_000, &|_: &Lease| false, &live)
            .expect("recover");
        assert_eq!(
            recovered,
            [claimed[1].id.clone()],
            "only the claim nobody runs"
        );
    }
}

/// Scenario G approved, then its approved refund's intent committed by a claim whose process
/// is gone, and nothing more: the crash left the refund maybe sent, maybe not. Returns the
/// refund's call key.
fn approved_call_in_flight(d: &Path) -> String {
    suspended_g(d);
    let digest = held_digest(d, "t1");
    ok(d, &["approve", "t1", "--digest", &digest]);
    let store = RedbStore::open(&d.join("worker.redb"), false).expect("open");
    // A process that is gone: a pid that no longer exists on this host.
    let mut gone = std::process::Command::new("true").spawn().expect("spawn");
    let pid = gone.id();
    gone.wait().expect("wait");
    let identity = tether::worker::Identity::current();
    let dead = Lease {
        owner: format!("{}:{pid}:1", identity.host),
        host: identity.host.clone(),
        pid,
        start_ticks: 1,
        expires_at_ms: 0,
        token: 0,
    };
    let now = tether::clock::now_ms();
    let rec = store.claim(&dead, 1, now).expect("claim").remove(0);
    let token = rec.lease.as_ref().expect("lease").token;
    let call = rec.state.pending.clone().expect("held call");
    let key = store.call_key(&rec, &call);
    let intent = tether::store::CallRecord {
        key: key.clone(),
        task_id: rec.id.clone(),
        step: rec.state.step,
        tool: call.name.clone(),
        args: call.args.clone(),
        digest: call.digest(),
        intent_at_ms: now,
        result: None,
        result_at_ms: None,
    };
    let mut c = step_commit(&rec, token, rec.state.step);
    c.kind = CommitKind::Intent;
    c.call = Some(intent);
    commit(&store, &c).expect("intent");
    key
}

/// Defect 3: a held call (approved) was re-sent after a crash although its intent had no
/// result and the tool is not idempotent. The crash is made exactly: the approved call's
/// intent is committed by a claim whose process is gone, and nothing more.
#[test]
fn a_resumed_held_call_in_flight_at_a_crash_is_not_sent_again() {
    let dir = TempDir::new("held-crash");
    let d = dir.path();
    approved_call_in_flight(d);
    let before = arrivals(d).len();
    ok(d, &["run", "--drain"]);
    let t = json(d, &["show", "t1", "--json"]);
    assert_eq!(t["status"], "held", "{t}");
    assert_eq!(t["stop"], "unknown_outcome");
    assert_eq!(arrivals(d).len(), before, "the refund was sent again");
    assert!(ledger(d).is_empty());
    assert_eq!(
        json(d, &["reconcile", "--json"]).as_array().map(Vec::len),
        Some(1)
    );
}

conformance! {
    /// Defect 6: decisions must name the call the operator reviewed.
    fn decisions_are_bound_to_the_reviewed_call(d) {
        suspended_g(d);
        let (code, err) = fails(d, &["approve", "t1"]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("--digest or --key"), "{err}");
        let (code, err) = fails(d, &["approve", "t1", "--key", "nope:t1:s2"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("does not match the held call"), "{err}");
        let (code, err) = fails(d, &["reject", "t1", "--digest", "0000000000"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("does not match the held call"), "{err}");
        assert_eq!(json(d, &["show", "t1", "--json"])["status"], "suspended");
        let key = json(d, &["show", "t1", "--json"])["held"]["key"]
            .as_str()
            .expect("key")
            .to_string();
        ok(d, &["approve", "t1", "--key", &key]);
        assert_eq!(
            json(d, &["events", "t1", "--json"])[0]["detail"]["key"],
            key
        );
    }
}

conformance! {
    /// Defect 7: the model chose the key. A write naming no plan step when several open steps
    /// use its tool, a step that is not in the plan, or a step of another tool is an error of
    /// the reply, and nothing is sent; so is a write of a step whose prerequisite is not done.
    /// (With one open step of its tool, that step is the one.)
    fn a_write_must_name_a_plan_step_of_its_tool(d) {
        let script = r#"{"type": "plan", "steps": [{"id": "s1", "tool": "get_order"}, {"id": "s2", "tool": "issue_refund", "depends_on": ["s1"]}, {"id": "s3", "tool": "issue_refund", "depends_on": ["s1"]}]}
    {"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 100}}
    {"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 200}, "plan_step": "s9"}
    {"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 300}, "plan_step": "s1"}
    {"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 350}, "plan_step": "s2"}
    {"type": "tool", "name": "get_order", "args": {"order_id": "ord_1001"}, "plan_step": "s1"}
    {"type": "tool", "name": "issue_refund", "args": {"order_id": "ord_1001", "amount_cents": 400}, "plan_step": "s2"}
    {"type": "final", "outcome": "cannot_complete", "text": "stop"}
    "#;
        std::fs::write(d.join("replies.jsonl"), script).expect("write");
        let budget = ["--budget", "stalls_max=10"];
        let mut args = vec!["--model", "script:replies.jsonl"];
        args.extend_from_slice(&budget);
        enqueue(d, &args);
        ok(d, &["run", "--drain"]);
        let t = json(d, &["show", "t1", "--json"]);
        // The read, and the refund once its prerequisite was done (the one before it waited).
        assert_eq!(t["tool_calls"], 2, "{t}");
        let sent: Vec<Value> = arrivals(d).into_iter().filter(|a| a["tool"] == "issue_refund").collect();
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert!(
            sent[0]["key"]
                .as_str()
                .is_some_and(|k| k.ends_with(":t1:s2"))
        );
        let refunds = refund_amounts(&ledger(d));
        assert_eq!(refunds, [400]);
    }
}

/// Defect 7, the service's side: a key reused with other arguments is a conflict, never the
/// first call's result reported as success.
#[test]
fn a_reused_key_with_other_arguments_is_a_conflict() {
    let dir = TempDir::new("key-conflict");
    let store = tether::tools::durable::DurableStore::open(&dir.file("store.redb")).expect("open");
    let args = |amount: i64| {
        serde_json::json!({"order_id": "ord_1001", "amount_cents": amount})
            .as_object()
            .cloned()
            .unwrap_or_default()
    };
    let call = |amount| {
        store
            .call_once(
                "",
                "cu_ana",
                "issue_refund",
                &args(amount),
                "db:t1:s2",
                true,
                None,
            )
            .expect("call")
    };
    assert_eq!(call(3000).0["status"], "ok");
    let (again, replayed) = call(3000);
    assert!(replayed && again["status"] == "ok");
    let (other, _) = call(1000);
    assert_eq!(other["status"], "error");
    assert_eq!(other["code"], "key_conflict");
    let outcomes: Vec<String> = store
        .arrivals()
        .expect("arrivals")
        .into_iter()
        .map(|a| a.outcome)
        .collect();
    assert_eq!(outcomes, ["applied", "replayed", "conflict"]);
    assert_eq!(store.ledger().expect("ledger").len(), 1);
}

/// Defect 8: two worker databases sharing one tool store both number their tasks from t1.
/// Their keys carry the database id, so both refunds apply.
#[test]
fn two_databases_sharing_one_store_never_collide() {
    let dir = TempDir::new("two-dbs");
    let d = dir.path();
    for (db, amount) in [("a.redb", "3000"), ("b.redb", "1000")] {
        ok(
            d,
            &[
                "--db",
                db,
                "enqueue",
                "--user",
                "cu_ana",
                "--goal",
                GOAL,
                "--model",
                &format!("policy:ord_1001:{amount}"),
            ],
        );
        ok(d, &["--db", db, "run", "--store", "shared.redb", "--drain"]);
        let t = json(d, &["--db", db, "show", "t1", "--json"]);
        assert_eq!(t["stop"], "done", "{t}");
    }
    let refunds = refund_amounts(&json_list(
        d,
        &["store", "--store", "shared.redb", "ledger", "--json"],
    ));
    assert_eq!(
        refunds,
        [3000, 1000],
        "the second task's refund was applied"
    );
}

conformance! {
    /// Defect 9: cancelling a held task made its write disappear from reconcile while the
    /// refund may have been applied.
    fn a_cancelled_held_write_stays_listed_until_settled(d) {
        enqueue(d, &["--tool-latency", "issue_refund=40000"]);
        ok(d, &["run", "--drain"]);
        assert_eq!(json(d, &["show", "t1", "--json"])["status"], "held");
        ok(d, &["cancel", "t1", "--reason", "customer withdrew"]);
        let t = json(d, &["show", "t1", "--json"]);
        assert_eq!(t["stop"], "cancelled");
        let closing = t["closing_message"].as_str().unwrap_or("");
        assert!(
            closing.contains("not known whether issue_refund") && !closing.contains("was not issued"),
            "{closing}"
        );
        let held = json(d, &["reconcile", "--json"]);
        assert_eq!(held.as_array().map(Vec::len), Some(1), "{held}");
        assert_eq!(held[0]["task"], "t1");
        // The refund did apply (the store applies a write whose answer came too late).
        assert_eq!(ledger(d).len(), 1);
        ok(
            d,
            &[
                "reconcile",
                "t1",
                "--applied",
                "--result",
                r#"{"status": "ok", "refunded_cents": 3000}"#,
            ],
        );
        assert_eq!(json(d, &["reconcile", "--json"]), serde_json::json!([]));
        let t = json(d, &["show", "t1", "--json"]);
        assert_eq!(t["stop"], "cancelled");
        assert_eq!(t["status"], "finished");
        let closing = t["closing_message"].as_str().unwrap_or("");
        assert!(closing.contains("the refund was issued"), "{closing}");
        ok(d, &["run", "--drain"]);
        assert_eq!(
            ledger(d).len(),
            1,
            "a settled cancelled task never runs again"
        );
    }
}

conformance! {
    /// Defect 14: the same enqueue key with another request was answered with the old task.
    fn an_enqueue_key_reused_for_another_request_is_refused(d) {
        enqueue(d, &["--key", "job-1"]);
        assert!(enqueue(d, &["--key", "job-1"]).contains("t1"), "a retry");
        let (code, err) = fails(
            d,
            &[
                "enqueue", "--model", "policy", "--user", "cu_bo", "--goal", GOAL, "--key", "job-1",
            ],
        );
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("job-1") && err.contains("another user"),
            "{err}"
        );
        let (_, err) = fails(
            d,
            &[
                "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", "other", "--key", "job-1",
            ],
        );
        assert!(err.contains("another goal"), "{err}");
        assert_eq!(
            json(d, &["list", "--json", "--limit", "10000"]).as_array().map(Vec::len),
            Some(1)
        );
    }
}

conformance! {
    /// Review item 10: a restored backup reused call keys the tool service had already seen.
    /// The file (or schema) kept its database id and task counter, so the next t2 got the
    /// lost t2's keys, and the service answered with a conflict (the legitimate refund never
    /// issued) or a silent replay. Each task's keys now carry 48 random bits made at enqueue.
    fn hole_10_a_restored_backup_never_reuses_call_keys(d) {
        enqueue(d, &["--model", "policy:ord_1001:1000"]); // t1
        ok(d, &["run", "--drain"]);
        let backup = Backup::take(d);
        enqueue(d, &["--model", "policy:ord_1001:1000"]); // t2, in the timeline that is lost
        ok(d, &["run", "--drain"]);
        let lost = json(d, &["show", "t2", "--json"]);
        assert_eq!(lost["stop"], "done", "{lost}");
        backup.restore(d);
        assert_eq!(fails(d, &["show", "t2"]).0, 1, "t2 is gone with the restore");
        enqueue(d, &["--model", "policy:ord_1001:1500"]); // a new t2
        ok(d, &["run", "--drain"]);
        let t2 = json(d, &["show", "t2", "--json"]);
        assert_eq!(t2["stop"], "done", "{t2}");
        assert_eq!(refund_amounts(&ledger(d)), [1000, 1000, 1500]);
        let keys: std::collections::BTreeSet<String> = arrivals(d)
            .iter()
            .filter(|a| a["tool"] == "issue_refund")
            .map(|a| a["key"].as_str().expect("key").to_string())
            .collect();
        assert_eq!(keys.len(), 3, "three refunds, three keys: {keys:?}");
        assert_ne!(lost["calls"][0]["key"], t2["calls"][0]["key"]);
    }
}

conformance! {
    /// Review item 15: a job's retried `enqueue --key` was refused ("with another budget")
    /// after an operator's `reconcile --extend` on its task, because the key was compared
    /// with the task's extended budget, not with the request it was made by.
    fn hole_15_a_retried_enqueue_returns_its_task_after_an_extension(d) {
        let job = ["--key", "job-7", "--tool-latency", "issue_refund=40000"];
        let first = enqueue(d, &job);
        ok(d, &["run", "--drain"]);
        assert_eq!(json(d, &["show", "t1", "--json"])["stop"], "unknown_outcome");
        ok(d, &[
            "reconcile", "t1", "--not-applied", "--by", "bob",
            "--extend", "tool_calls=1,deadline_ms=60000",
        ]);
        assert_eq!(json(d, &["show", "t1", "--json"])["budget"]["deadline_ms"], 90000);
        assert_eq!(
            enqueue(d, &job),
            format!("{} (already enqueued with this key)\n", first.trim()),
            "the retry returns its task"
        );
        let (code, err) = fails(d, &[
            "enqueue", "--model", "policy", "--user", "cu_ana", "--goal", GOAL, "--key", "job-7",
            "--tool-latency", "issue_refund=40000", "--budget", "deadline_ms=90000",
        ]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains("another budget"), "{err}");
    }
}

/// Defect 11: one undecodable task record stopped `claim` and `recover` for every task and
/// made the daemon exit. It is quarantined instead: listed as damaged, never run.
#[test]
fn a_damaged_task_record_is_quarantined_not_fatal() {
    let dir = TempDir::new("quarantine");
    let d = dir.path();
    enqueue(d, &["--store-scope", "a"]);
    enqueue(d, &["--store-scope", "b"]);
    {
        let store = RedbStore::open(&dir.file("worker.redb"), false).expect("open");
        let w = store.begin_write().expect("write");
        w.open_table(tether::store::schema::TASKS)
            .expect("tasks")
            .insert("t1", &b"{\"not\": \"a task\"}"[..])
            .expect("insert");
        w.commit().expect("commit");
    }
    ok(d, &["run", "--drain"]);
    let list = json(d, &["list", "--json", "--limit", "10000"]);
    let list = list.as_array().expect("list");
    let t2 = list.iter().find(|t| t["id"] == "t2").expect("t2 listed");
    assert_eq!(t2["stop"], "done", "{t2}");
    let t1 = list.iter().find(|t| t["id"] == "t1").expect("t1 listed");
    assert_eq!(t1["status"], "damaged", "{t1}");
    assert!(ok(d, &["list", "--status", "damaged"]).contains("t1"));
    let (code, err) = fails(d, &["show", "t1"]);
    assert_eq!(code, 1);
    assert!(err.contains("damaged"), "{err}");
}

/// Defect 13: a process stopped inside a write transaction blocked `worker list` and `worker
/// show` for everyone. Read verbs open the file read-only and do not wait for the writer.
#[test]
fn readers_do_not_wait_for_a_writer() {
    let dir = TempDir::new("readers");
    let d = dir.path();
    enqueue(d, &[]);
    let store = RedbStore::open(&dir.file("worker.redb"), false).expect("open");
    let w = store.begin_write().expect("a write transaction held open");
    let mut child = std::process::Command::new(bin())
        .args(["list", "--json", "--limit", "10000"])
        .current_dir(d)
        .env_remove("WORKER_DB")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("list");
    // Bounded wait: a reader that waits for the writer never exits while `w` is open.
    let mut exited = None;
    for _ in 0..1000 {
        if let Some(st) = child.try_wait().expect("try_wait") {
            exited = Some(st);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    if exited.is_none() {
        let _ = child.kill();
    }
    let out = child.wait_with_output().expect("output");
    drop(w);
    assert!(exited.is_some(), "worker list waited for the writer");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(v[0]["id"], "t1");
}

conformance! {
    /// Defect 1 under the race that produced it: an approve and a reject of the same call start
    /// together, for many tasks. Whatever wins, a refund is applied exactly when the audit log
    /// holds the approval: never an effect without its audit event.
    fn racing_approve_and_reject_never_apply_without_an_approval_event(d) {
        let n = 12;
        let lines: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"user": "cu_ana", "goal": "{GOAL}", "model": "policy:ord_1004:8000", "store_scope": "r{i}"}}"#))
            .collect();
        std::fs::write(d.join("tasks.jsonl"), lines.join("\n")).expect("write");
        ok(d, &["enqueue", "--model", "policy", "--file", "tasks.jsonl"]);
        ok(d, &["run", "--drain"]);
        let mut procs = Vec::new();
        for i in 1..=n {
            let id = format!("t{i}");
            let digest = held_digest(d, &id);
            for verb in ["reject", "approve"] {
                procs.push(
                    command(d)
                        .args([verb, &id, "--digest", &digest, "--by", verb])
                        .stdout(std::process::Stdio::null())
                        .stderr(std::process::Stdio::null())
                        .spawn()
                        .expect("spawn"),
                );
            }
        }
        for mut p in procs {
            p.wait().expect("wait");
        }
        ok(d, &["run", "--drain"]);
        let ledger = ledger(d);
        for i in 1..=n {
            let id = format!("t{i}");
            let approved = json(d, &["events", &id, "--json"])
                .as_array()
                .expect("events")
                .iter()
                .any(|e| e["verb"] == "approve");
            let refunded = ledger
                .iter()
                .filter(|e| e["scope"] == format!("r{}", i - 1) && e["effect"]["kind"] == "refund")
                .count();
            assert_eq!(
                refunded,
                usize::from(approved),
                "task {id}: {refunded} refund(s), approval event: {approved}"
            );
        }
    }
}

conformance! {
    /// A thread that ends a task claims its next one in the same transaction as the final commit:
    /// the claim gets its own fencing token, and only a final commit claims.
    fn a_final_commit_claims_the_next_task_under_a_new_token(d) {
        let store = backend(d);
        store
            .enqueue(
                &[new_task("cu_ana", "a", None), new_task("cu_ana", "b", None)],
                0,
            )
            .expect("enqueue");
        let first = store.claim(&lease("me", 0), 1, 0).expect("claim").remove(0);
        let token = first.lease.as_ref().expect("lease").token;
        let mut step = step_commit(&first, token, 1);
        step.claim_next = Some(lease("me", 0));
        let out = store.commit_batch(&[&step]).expect("step").remove(0).expect("accepted");
        assert!(out.next.is_none(), "a step commit claims nothing");
        let mut fin = step_commit(&first, token, 2);
        fin.kind = CommitKind::Final(tether::kernel::StopReason::Done);
        fin.claim_next = Some(lease("me", 0));
        let out = store.commit_batch(&[&fin]).expect("final").remove(0).expect("accepted");
        let next = out.next.expect("the next task was claimed");
        assert_eq!(next.id, "t2");
        assert_eq!(next.lease.as_ref().map(|l| l.token), Some(1));
        assert_eq!(store.task("t2").expect("t2").status.as_str(), "running");
        assert_eq!(store.task("t1").expect("t1").status.as_str(), "finished");
        assert_eq!(store.ready_count().expect("ready"), 0);
    }
}

conformance! {
    /// The task a final commit claims gets a lease as long as one from a plain claim (the
    /// lease plus its remaining active time, from now), so no daemon's recovery takes it over
    /// while it runs.
    fn a_task_claimed_by_a_final_commit_holds_a_full_lease(d) {
        let store = backend(d);
        let now = tether::clock::now_ms();
        let long = now + 1_000_000_000;
        store.heartbeat("me", now, long).expect("heartbeat");
        store
            .enqueue(&[new_task("cu_ana", "a", None), new_task("cu_ana", "b", None)], now)
            .expect("enqueue");
        let first = store.claim(&lease("me", now + 60_000), 1, now).expect("claim").remove(0);
        let token = first.lease.as_ref().expect("lease").token;
        let mut fin = step_commit(&first, token, 2);
        fin.now_ms = now;
        fin.kind = CommitKind::Final(tether::kernel::StopReason::Done);
        fin.claim_next = Some(lease("me", now + 60_000));
        let out = store.commit_batch(&[&fin]).expect("final").remove(0).expect("accepted");
        let next = out.next.expect("the next task was claimed");
        let left = store
            .claim_left(&next.id, next.lease.as_ref().expect("lease").token, now)
            .expect("claim_left")
            .expect("its claim");
        assert!(left >= 60_000, "the claim of {} is held for {left} ms only", next.id);
        let recovered = store
            .recover(now + 1_000, &|_| false, &|_, _| false)
            .expect("recover");
        assert!(recovered.is_empty(), "recovered while running: {recovered:?}");
    }
}

/// A file backend whose writes, syncs and growth fail while `full` is set, as on a full disk.
#[derive(Debug)]
struct FullDisk {
    inner: redb::backends::FileBackend,
    full: Arc<AtomicBool>,
}

impl FullDisk {
    fn check(&self) -> Result<(), std::io::Error> {
        if self.full.load(Ordering::SeqCst) {
            Err(std::io::Error::from_raw_os_error(28)) // ENOSPC
        } else {
            Ok(())
        }
    }
}

type B = std::ops::Bound<u64>;

impl redb::StorageBackend for FullDisk {
    fn len(&self) -> Result<u64, std::io::Error> {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), std::io::Error> {
        self.inner.read(offset, out)
    }
    fn set_len(&self, len: u64) -> Result<(), std::io::Error> {
        self.check()?;
        self.inner.set_len(len)
    }
    fn sync_data(&self) -> Result<(), std::io::Error> {
        self.check()?;
        self.inner.sync_data()
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), std::io::Error> {
        self.check()?;
        self.inner.write(offset, data)
    }
    fn close(&self) -> Result<(), std::io::Error> {
        self.inner.close()
    }
    fn try_lock_range(&self, s: B, e: B) -> Result<bool, redb::BackendError> {
        self.inner.try_lock_range(s, e)
    }
    fn try_lock_shared_range(&self, s: B, e: B) -> Result<bool, redb::BackendError> {
        self.inner.try_lock_shared_range(s, e)
    }
    fn lock_range(&self, s: B, e: B) -> Result<(), redb::BackendError> {
        self.inner.lock_range(s, e)
    }
    fn lock_shared_range(&self, s: B, e: B) -> Result<(), redb::BackendError> {
        self.inner.lock_shared_range(s, e)
    }
    fn unlock_range(&self, s: B, e: B) -> Result<(), redb::BackendError> {
        self.inner.unlock_range(s, e)
    }
    fn query_lock_range(&self, s: B, e: B) -> Result<bool, redb::BackendError> {
        self.inner.query_lock_range(s, e)
    }
}

/// Opens `path` over a [`FullDisk`] backend that fails while `full` is set.
fn full_disk_opener(path: &Path, full: &Arc<AtomicBool>) -> tether::store::Opener {
    let (path, full) = (path.to_path_buf(), Arc::clone(full));
    Arc::new(move || {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
        let inner =
            redb::backends::FileBackend::new(file).map_err(|e| Error::Db(redb::Error::from(e)))?;
        redb::Database::builder()
            .set_concurrency_mode(redb::ConcurrencyMode::MultiWriter)
            .create_with_backend(FullDisk {
                inner,
                full: Arc::clone(&full),
            })
            .map_err(|e| Error::Db(redb::Error::from(e)))
    })
}

/// Defect 12: after a disk error the store's handle refused every later call ("Previous I/O
/// error") until the process restarted. Now it is opened again, and once the disk has room
/// the next write goes through; the failed one never took effect twice.
#[test]
fn a_store_recovers_from_a_full_disk_without_a_restart() {
    let dir = TempDir::new("full-disk");
    let path = dir.file("store.redb");
    std::fs::File::create(&path).expect("create");
    let full = Arc::new(AtomicBool::new(false));
    let opener = full_disk_opener(&path, &full);
    let store = tether::tools::durable::DurableStore::open_with(&path, opener).expect("open");
    let refund = |key: &str| {
        let args = serde_json::json!({"order_id": "ord_1001", "amount_cents": 1000})
            .as_object()
            .cloned()
            .unwrap_or_default();
        store.call_once("", "cu_ana", "issue_refund", &args, key, true, None)
    };
    assert_eq!(refund("db:t1:s2").expect("first").0["status"], "ok");
    full.store(true, Ordering::SeqCst);
    assert!(refund("db:t2:s2").is_err(), "a write on a full disk fails");
    full.store(false, Ordering::SeqCst);
    let (third, _) = refund("db:t3:s2").expect("the store works again without a restart");
    assert_eq!(third["status"], "ok");
    let keys: Vec<String> = store
        .ledger()
        .expect("ledger")
        .into_iter()
        .map(|e| e.key)
        .collect();
    assert_eq!(keys, ["db:t1:s2", "db:t3:s2"]);
}

/// Defect 12 for the worker database: a commit that failed on a full disk does not stop the
/// next commits once the disk has room again; the failed one was not applied.
#[test]
fn the_worker_database_recovers_from_a_full_disk_without_a_restart() {
    let dir = TempDir::new("full-disk-worker");
    let path = dir.file("worker.redb");
    std::fs::File::create(&path).expect("create");
    let full = Arc::new(AtomicBool::new(false));
    let store =
        Arc::new(RedbStore::open_with(&path, full_disk_opener(&path, &full)).expect("open"));
    store
        .enqueue(&[new_task("cu_ana", "refund", None)], 0)
        .expect("enqueue");
    let rec = store.claim(&lease("me", 0), 1, 0).expect("claim").remove(0);
    let token = rec.lease.as_ref().expect("lease").token;
    let committer = tether::worker::Committer::direct(store.clone());
    full.store(true, Ordering::SeqCst);
    assert!(committer.commit(step_commit(&rec, token, 1)).is_err());
    full.store(false, Ordering::SeqCst);
    committer
        .commit(step_commit(&rec, token, 2))
        .expect("commits work again without a restart");
    assert_eq!(store.task("t1").expect("t1").state.step, 2);
}

/// Defect 3, the read side: a call record that could not be read was taken for "nothing
/// recorded", and the write was sent again under a fresh intent. A damaged record now holds
/// the call for reconcile (its outcome is unknown), and reconcile can settle it.
#[test]
fn an_unreadable_call_record_holds_the_write_never_resends_it() {
    let dir = TempDir::new("damaged-call");
    let d = dir.path();
    let key = approved_call_in_flight(d);
    {
        let store = RedbStore::open(&dir.file("worker.redb"), false).expect("open");
        let w = store.begin_write().expect("write");
        w.open_table(tether::store::schema::CALL_KEYS)
            .expect("call keys")
            .insert(key.as_str(), &b"\x00 not a record"[..])
            .expect("insert");
        w.commit().expect("commit");
    }
    let before = arrivals(d).len();
    ok(d, &["run", "--drain"]);
    assert_eq!(arrivals(d).len(), before, "the refund was sent again");
    let t = json(d, &["show", "t1", "--json"]);
    assert_eq!(t["status"], "held", "{t}");
    let held = json(d, &["reconcile", "--json"]);
    assert_eq!(held[0]["key"], key.as_str(), "{held}");
    ok(
        d,
        &[
            "reconcile",
            "t1",
            "--not-applied",
            "--key",
            &key,
            "--by",
            "op",
        ],
    );
    ok(d, &["run", "--drain"]);
    assert_eq!(
        refund_amounts(&ledger(d)),
        [8000],
        "sent once after the decision"
    );
}

/// A panic inside a run (a bug) used to kill its worker thread with the task still counted in
/// flight and still in the daemon's live claims: `run --drain` waited forever and the task was
/// never recovered while the daemon lived. Now the run ends, the drain finishes, and the task
/// is recovered from its last commit when its lease expires: it ends once, nothing is lost.
#[test]
fn a_panicking_run_neither_stalls_a_drain_nor_loses_its_task() {
    let dir = TempDir::new("panicking-run");
    let store: Arc<dyn Backend> =
        Arc::new(RedbStore::open(&dir.file("worker.redb"), true).expect("open"));
    let tools = Arc::new(
        tether::tools::durable::DurableStore::open(&dir.file("worker.store.redb")).expect("store"),
    );
    let mut tasks: Vec<NewTask> = (0..3)
        .map(|i| {
            let mut t = new_task("cu_ana", "refund", None);
            t.store_scope = format!("s{i}");
            // A short active time: the lease covers it, so a dropped claim expires soon.
            t.budget.deadline_ms = 2_000;
            t
        })
        .collect();
    tasks[0].key = Some("first".into());
    store
        .enqueue(&tasks, tether::clock::now_ms())
        .expect("enqueue");
    let panicked = Arc::new(AtomicBool::new(false));
    let once = Arc::clone(&panicked);
    let cfg = tether::worker::Config {
        demo: Some(std::sync::Arc::new(
            tether::tools::durable::DemoShop::opened(std::sync::Arc::clone(&tools)),
        )),
        max_in_flight: 2,
        drain: true,
        lease_ms: 1_000,
        recover_every_ms: 100,
        hook: Some(Arc::new(move |point| {
            if point == tether::worker::driver::Point::Model && !once.swap(true, Ordering::SeqCst) {
                panic!("injected: a bug in the middle of a run");
            }
            true
        })),
        ..Default::default()
    };
    let drain = |cfg: tether::worker::Config| {
        let store = Arc::clone(&store);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let stop = Arc::new(AtomicBool::new(false));
            let _ = tx.send(tether::worker::run(store, &cfg, stop).map(|_| ()));
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("the drain ends (it used to wait forever after a panic)")
            .expect("the drain succeeds");
    };
    drain(cfg.clone());
    assert!(panicked.load(Ordering::SeqCst), "the fault was injected");
    let running: Vec<String> = store
        .tasks()
        .expect("tasks")
        .into_iter()
        .filter(|t| t.status == tether::store::QueueStatus::Running)
        .map(|t| t.id)
        .collect();
    assert_eq!(
        running.len(),
        1,
        "the panicked run's task waits for its lease"
    );
    // Once its lease has expired (a few seconds), a drain recovers it and it ends.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        drain(tether::worker::Config {
            hook: None,
            ..cfg.clone()
        });
        let tasks = store.tasks().expect("tasks");
        if tasks
            .iter()
            .all(|t| t.status == tether::store::QueueStatus::Finished)
        {
            assert!(tasks.iter().all(|t| t.state.stop.is_some()));
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the task was never recovered"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Review item 15, second part: on PostgreSQL a demo-store write whose connection dropped
/// before its COMMIT (nothing of it can have landed) was reported as a database error, and the
/// driver held the task with `unknown_outcome`. The store's transaction now runs again on a
/// new connection, and the write is applied once.
#[test]
fn hole_15_a_store_write_cut_before_its_commit_runs_again() {
    let Some(dir) = TempDir::on("store-cut", common::Backend::Postgres) else {
        return;
    };
    let url = db_url(dir.path()).expect("a PostgreSQL directory");
    let pg = common::pg::shared().expect("the cluster");
    let store = Arc::new(tether::tools::durable::DurableStore::open_target(&url).expect("store"));
    let key = format!("cut-{}:t1:s2", std::process::id());
    // Another session holds the advisory lock the store's transaction takes on the key, so
    // the write waits inside its transaction, where the test cuts its connection.
    let lock = format!("hashtextextended('tether-store:key:{key}', 0)");
    let holder = {
        let cluster_url = pg.url();
        let lock = lock.clone();
        std::thread::spawn(move || {
            let _ = std::process::Command::new("psql")
                .args(["-X", "-q", "-d", &cluster_url, "-c"])
                .arg(format!(
                    "SELECT pg_advisory_lock({lock}); SELECT pg_sleep(120)"
                ))
                .output();
        })
    };
    let waiting = |what: &str| {
        pg.psql(&format!(
            "SELECT pid FROM pg_stat_activity WHERE {what} AND pid <> pg_backend_pid() ORDER BY pid LIMIT 1"
        ))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while waiting("wait_event = 'PgSleep'").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the lock holder never started"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let args = serde_json::json!({"order_id": "ord_1001", "amount_cents": 1200, "reason": "cut"});
    let call = {
        let (store, key) = (Arc::clone(&store), key.clone());
        let args = args.as_object().expect("args").clone();
        std::thread::spawn(move || {
            store.call_once("", "cu_ana", "issue_refund", &args, &key, true, None)
        })
    };
    let writer = loop {
        if call.is_finished() {
            panic!("the call did not wait: {:?}", call.join());
        }
        let pid = waiting("wait_event = 'advisory' AND query LIKE '%pg_advisory_xact_lock%'");
        if !pid.is_empty() {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the store's write never waited"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    // The write's connection is cut inside its transaction; then the lock is let go.
    pg.psql(&format!("SELECT pg_terminate_backend({writer})"));
    let sleeper = waiting("wait_event = 'PgSleep'");
    pg.psql(&format!("SELECT pg_terminate_backend({sleeper})"));
    let _ = holder.join();
    let (result, _) = call
        .join()
        .expect("the call")
        .expect("the write ran again and was applied");
    assert_eq!(result["status"], "ok", "{result}");
    let arrivals = store.arrivals().expect("arrivals");
    assert_eq!(arrivals.iter().filter(|a| a.key == key).count(), 1);
    let ledger = store.ledger().expect("ledger");
    assert_eq!(ledger.iter().filter(|e| e.key == key).count(), 1);
}

/// A driver context for `store` and `tools` as worker `n` of a test, with `clock`.
fn test_context(
    store: &Arc<dyn Backend>,
    tools: &Arc<tether::tools::durable::DurableStore>,
    clock: &Arc<std::sync::atomic::AtomicU64>,
    n: u64,
    hook: Option<tether::worker::driver::Hook>,
) -> tether::worker::driver::Context {
    let clock = Arc::clone(clock);
    tether::worker::driver::Context {
        clock: Arc::new(move || clock.load(Ordering::SeqCst)),
        hook,
        mcp: None,
        trusted: Arc::default(),
        export: false,
        identity: tether::worker::Identity {
            host: "test".into(),
            pid: n as u32,
            start_ticks: 0,
            instance: n,
        },
        store: Arc::clone(store),
        demo: Some(Arc::new(tether::tools::durable::DemoShop::opened(
            Arc::clone(tools),
        ))),
        committer: tether::worker::Committer::direct(Arc::clone(store)),
        lease_ms: 1_000,
        heartbeat_ttl_ms: u64::MAX / 4,
        time_scale: 0.0,
        shutdown: Arc::new(AtomicBool::new(false)),
        stopping: Default::default(),
        stats: Arc::new(tether::worker::Stats::default()),
        scripted_rate: None,
        catalogs: Default::default(),
    }
}

conformance! {
    /// Review item 5: a daemon that lost its claim still sent its in-flight write. Paused
    /// between the refund's intent and its send, it was taken over; the new owner held the
    /// write, an operator settled it `--not-applied`, the new owner sent it; then the first
    /// resumed and sent it again. The claim is now proved current right before a write goes
    /// out: the resumed run stops and sends nothing.
    fn hole_5_a_run_whose_claim_was_taken_over_never_sends_its_write(d) {
        let store = backend(d);
        let tools = Arc::new(match db_url(d) {
            Some(url) => tether::tools::durable::DurableStore::open_target(&url),
            None => tether::tools::durable::DurableStore::open(&d.join("worker.store.redb")),
        }.expect("store"));
        let clock = Arc::new(std::sync::atomic::AtomicU64::new(tether::clock::now_ms()));
        let mut t = new_task("cu_ana", GOAL, Some("paused"));
        t.model = ModelProfile::parse("policy", None).expect("model");
        store.enqueue(&[t], clock.load(Ordering::SeqCst)).expect("enqueue");
        // Worker 1 stops at its first write's send (the refund, after its intent) until let go.
        let (at_send, paused) = std::sync::mpsc::channel::<()>();
        let (resume, go) = std::sync::mpsc::channel::<()>();
        let go = std::sync::Mutex::new(go);
        // (Its first send is the order's read, its second the refund.)
        let sends = std::sync::atomic::AtomicU32::new(0);
        let hook: tether::worker::driver::Hook = Arc::new(move |p| {
            if p == tether::worker::driver::Point::Send && sends.fetch_add(1, Ordering::SeqCst) == 1 {
                let _ = at_send.send(());
                let _ = go.lock().expect("lock").recv();
            }
            true
        });
        let first = test_context(&store, &tools, &clock, 1, Some(hook));
        let now = clock.load(Ordering::SeqCst);
        let rec = store
            .claim(&first.identity.lease(now, 1_000), 1, now)
            .expect("claim")
            .remove(0);
        let worker1 = std::thread::spawn(move || tether::worker::driver::run_task(&first, rec));
        paused.recv().expect("worker 1 reached the refund's send");
        // Past every lease: worker 2 takes the task over; the refund's intent has no result,
        // so the write is held. An operator settles it as not applied; worker 2 sends it.
        clock.fetch_add(120_000, Ordering::SeqCst);
        let now = clock.load(Ordering::SeqCst);
        assert_eq!(store.recover(now, &|_| false, &|_, _| false).expect("recover").len(), 1);
        let second = test_context(&store, &tools, &clock, 2, None);
        let claim = |store: &Arc<dyn Backend>| {
            let now = clock.load(Ordering::SeqCst);
            store.claim(&second.identity.lease(now, 1_000), 1, now).expect("claim").remove(0)
        };
        assert!(tether::worker::driver::run_task(&second, claim(&store)).is_none());
        let held = store.task("t1").expect("t1");
        assert_eq!(held.status, tether::store::QueueStatus::Held, "{:?}", held.state.stop);
        let decision = tether::store::Decision {
            by: "bob".into(),
            reason: None,
            now_ms: clock.load(Ordering::SeqCst),
        };
        tether::operator::reconcile(
                &*store,
                "t1",
                &tether::operator::Settlement::NotApplied,
                &tether::operator::Reviewed::default(),
                &tether::operator::Extension::parse("tool_calls=1,deadline_ms=30000").expect("extend"),
                &decision,
            )
            .expect("reconcile");
        assert!(tether::worker::driver::run_task(&second, claim(&store)).is_none());
        let refunds = |tools: &tether::tools::durable::DurableStore| {
            tools.arrivals().expect("arrivals").iter().filter(|a| a.tool == "issue_refund").count()
        };
        assert_eq!(refunds(&tools), 1, "the new owner sent the refund");
        assert_eq!(store.task("t1").expect("t1").state.stop, Some(tether::kernel::StopReason::Done));
        // Worker 1 resumes where it stood: about to send the refund under a claim long gone.
        resume.send(()).expect("resume");
        assert!(worker1.join().expect("worker 1").is_none());
        assert_eq!(refunds(&tools), 1, "the resumed run sent the refund again");
        assert_eq!(tools.ledger().expect("ledger").iter().filter(|e| e.key.contains(":t1:s2")).count(), 1);
    }
}

conformance! {
    /// Review 48, hole 5: the same takeover, with the run paused after it proved its claim
    /// and before the write's first byte (a slow definition check or connection set-up came
    /// between them). A proof older than `PROOF_FRESH_MS` when the bytes would leave is taken
    /// again, and finds the claim gone: the resumed run sends nothing.
    fn hole_48_5_a_run_paused_after_its_proof_never_sends_its_write(d) {
        let store = backend(d);
        let tools = Arc::new(match db_url(d) {
            Some(url) => tether::tools::durable::DurableStore::open_target(&url),
            None => tether::tools::durable::DurableStore::open(&d.join("worker.store.redb")),
        }.expect("store"));
        let clock = Arc::new(std::sync::atomic::AtomicU64::new(tether::clock::now_ms()));
        let mut t = new_task("cu_ana", GOAL, Some("paused-after-proof"));
        t.model = ModelProfile::parse("policy", None).expect("model");
        store.enqueue(&[t], clock.load(Ordering::SeqCst)).expect("enqueue");
        // Worker 1 stops right after it proved its claim for the refund, until let go.
        let (at_send, paused) = std::sync::mpsc::channel::<()>();
        let (resume, go) = std::sync::mpsc::channel::<()>();
        let go = std::sync::Mutex::new(go);
        // (Only a write is proved: the refund.)
        let proofs = std::sync::atomic::AtomicU32::new(0);
        let hook: tether::worker::driver::Hook = Arc::new(move |p| {
            if p == tether::worker::driver::Point::Proved && proofs.fetch_add(1, Ordering::SeqCst) == 0 {
                let _ = at_send.send(());
                let _ = go.lock().expect("lock").recv();
            }
            true
        });
        let first = test_context(&store, &tools, &clock, 1, Some(hook));
        let now = clock.load(Ordering::SeqCst);
        let rec = store
            .claim(&first.identity.lease(now, 1_000), 1, now)
            .expect("claim")
            .remove(0);
        let worker1 = std::thread::spawn(move || tether::worker::driver::run_task(&first, rec));
        paused.recv().expect("worker 1 proved its claim for the refund");
        // Past every lease: worker 2 takes the task over; the refund's intent has no result,
        // so the write is held. An operator settles it as not applied; worker 2 sends it.
        clock.fetch_add(120_000, Ordering::SeqCst);
        let now = clock.load(Ordering::SeqCst);
        assert_eq!(store.recover(now, &|_| false, &|_, _| false).expect("recover").len(), 1);
        let second = test_context(&store, &tools, &clock, 2, None);
        let claim = |store: &Arc<dyn Backend>| {
            let now = clock.load(Ordering::SeqCst);
            store.claim(&second.identity.lease(now, 1_000), 1, now).expect("claim").remove(0)
        };
        assert!(tether::worker::driver::run_task(&second, claim(&store)).is_none());
        let held = store.task("t1").expect("t1");
        assert_eq!(held.status, tether::store::QueueStatus::Held, "{:?}", held.state.stop);
        let decision = tether::store::Decision {
            by: "bob".into(),
            reason: None,
            now_ms: clock.load(Ordering::SeqCst),
        };
        tether::operator::reconcile(
                &*store,
                "t1",
                &tether::operator::Settlement::NotApplied,
                &tether::operator::Reviewed::default(),
                &tether::operator::Extension::parse("tool_calls=1,deadline_ms=30000").expect("extend"),
                &decision,
            )
            .expect("reconcile");
        assert!(tether::worker::driver::run_task(&second, claim(&store)).is_none());
        let refunds = |tools: &tether::tools::durable::DurableStore| {
            tools.arrivals().expect("arrivals").iter().filter(|a| a.tool == "issue_refund").count()
        };
        assert_eq!(refunds(&tools), 1, "the new owner sent the refund");
        assert_eq!(store.task("t1").expect("t1").state.stop, Some(tether::kernel::StopReason::Done));
        // Worker 1 resumes where it stood: about to send the refund under a claim long gone.
        resume.send(()).expect("resume");
        assert!(worker1.join().expect("worker 1").is_none());
        assert_eq!(refunds(&tools), 1, "the resumed run sent the refund again");
        assert_eq!(tools.ledger().expect("ledger").iter().filter(|e| e.key.contains(":t1:s2")).count(), 1);
    }
}
