//! The local API in one process: tasks and decisions through the socket, one server per lock,
//! a stale or removed socket, and malformed requests.

use super::client::read_answer;
use super::server::*;
use super::*;
use crate::limits;
use crate::store::prelude::*;
use crate::store::{Backend, NewTask, RedbStore};
use std::fs;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("tether-local-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).expect("temp dir");
    d
}

fn task(key: Option<&str>) -> NewTask {
    NewTask {
        user: "cu_ana".into(),
        goal: "refund the damaged item on order ord_1001".into(),
        key: key.map(str::to_string),
        priority: 3,
        budget: crate::kernel::Budget::default(),
        model: crate::model::ModelProfile::policy(),
        tool_latency_ms: [("get_order".to_string(), 7)].into(),
        catalog: None,
        store_scope: "s1".into(),
        approval_wait_ms: 60_000,
        instructions: None,
        callback_url: None,
        submitted_by: None,
        not_before_ms: None,
        concurrency_key: Some("tenant:a".into()),
        time_limits: Default::default(),
    }
}

/// A fresh directory, its database, the store and the local API serving it.
fn served(name: &str) -> (PathBuf, PathBuf, Arc<RedbStore>, LocalApi) {
    let dir = temp(name);
    let db = dir.join("worker.redb");
    let store = Arc::new(RedbStore::open(&db, true).expect("open"));
    let api = serving(&db, &store);
    (dir, db, store, api)
}

fn serving(db: &Path, store: &Arc<RedbStore>) -> LocalApi {
    match serve(db, Arc::clone(store) as Arc<dyn Backend>).expect("serve") {
        Served::Serving(api) => api,
        Served::Elsewhere(pid) => panic!("the socket is served by {pid:?}"),
    }
}

/// Sends `text` as a whole request and returns the answer.
fn raw(db: &Path, text: &str) -> Answer {
    let conn = UnixStream::connect(socket_path(db)).expect("connect");
    // The daemon may answer (and close) before it read everything: a refusal of the header,
    // or of a line over the limit.
    let _ = (&conn).write_all(text.as_bytes());
    let _ = conn.shutdown(std::net::Shutdown::Write);
    read_answer(&conn).expect("an answer")
}

#[test]
fn tasks_sent_to_the_daemon_are_committed_as_sent_and_keys_hold() {
    let (dir, db, store, api) = served("enqueue");
    let mode = fs::metadata(socket_path(&db))
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the socket is the owner's only");
    assert_eq!(daemon_pid(&db), Some(std::process::id()));
    let mut profiled = task(None);
    profiled.model = crate::model::ModelProfile::Profile {
        name: "support".into(),
    };
    profiled.instructions = Some("be brief".into());
    let sent = vec![task(Some("k1")), profiled];
    let out = enqueue(&db, &sent)
        .expect("enqueue")
        .expect("a daemon answered");
    assert_eq!(out.len(), 2);
    assert!(out.iter().all(|e| e.created));
    // What the daemon committed is what was sent, field for field.
    for (e, t) in out.iter().zip(&sent) {
        let rec = store.task(&e.id).expect("the task");
        assert_eq!(rec.key, t.key);
        assert_eq!(rec.priority, 3);
        assert_eq!(rec.instructions, t.instructions);
        assert_eq!(rec.concurrency_key.as_deref(), Some("tenant:a"));
        assert_eq!(rec.tool_latency_ms.get("get_order"), Some(&7));
        assert_eq!(rec.model, t.model);
    }
    // The key is the daemon's to check, as it is the file's.
    let again = enqueue(&db, &[task(Some("k1"))])
        .expect("enqueue")
        .expect("answered");
    assert_eq!(again[0].id, out[0].id);
    assert!(!again[0].created);
    drop(api);
    assert!(
        !socket_path(&db).exists(),
        "a stopped daemon removes its socket"
    );
    assert!(enqueue(&db, &[task(None)]).expect("no daemon").is_none());
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn one_daemon_serves_the_socket_and_a_killed_ones_socket_is_replaced() {
    let (dir, db, store, api) = served("owner");
    match serve(&db, Arc::clone(&store) as Arc<dyn Backend>).expect("second") {
        Served::Elsewhere(pid) => assert_eq!(pid, Some(std::process::id())),
        Served::Serving(_) => panic!("two daemons served one socket"),
    }
    drop(api);
    // A socket nobody listens on (its daemon was killed): the verbs open the file...
    let stale = UnixListener::bind(socket_path(&db)).expect("bind");
    drop(stale);
    assert!(socket_path(&db).exists());
    assert!(enqueue(&db, &[task(None)]).expect("no daemon").is_none());
    // ... and the next daemon replaces it.
    let api = serving(&db, &store);
    assert!(enqueue(&db, &[task(None)]).expect("enqueue").is_some());
    drop(api);
    // A socket removed under the daemon: it still stops.
    let api = serving(&db, &store);
    fs::remove_file(socket_path(&db)).expect("remove");
    drop(api);
    let _ = fs::remove_dir_all(&dir);
}

/// Requests the daemon must refuse, each with what its refusal says.
fn bad_requests() -> Vec<(String, &'static str)> {
    let line = serde_json::to_string(&task(None)).expect("json");
    let later = crate::clock::now_ms() + 60_000;
    let head = |op: &str, tasks: usize| {
        format!(
            "{{\"op\": \"{op}\", \"protocol\": 1, \"tasks\": {tasks}, \"deadline_ms\": {later}}}\n"
        )
    };
    let mut empty_user = task(None);
    empty_user.user = String::new();
    let mut long_goal = task(None);
    long_goal.goal = "g".repeat(limits::GOAL_BYTES_MAX + 1);
    let mut far = task(None);
    far.not_before_ms = Some(u64::MAX);
    let mut told = task(None);
    told.instructions = Some("obey".into());
    let mut spoofed = task(None);
    spoofed.submitted_by = Some("admin".into());
    let mut slow_tool = task(None);
    slow_tool.tool_latency_ms = [("no_such_tool".to_string(), 5)].into();
    let mut file_callback = task(None);
    file_callback.callback_url = Some("file:///etc/passwd".into());
    let mut tick = task(None);
    tick.key = Some("schedule:nightly:2030-01-01T00:00:00.000Z".into());
    let one = |t: &NewTask| {
        format!(
            "{}{}\n",
            head("enqueue", 1),
            serde_json::to_string(t).expect("json")
        )
    };
    vec![
        (String::new(), "ended before the header"),
        ("nonsense\n".to_string(), "header"),
        (
            format!(
                "{{\"op\": \"enqueue\", \"protocol\": 99, \"tasks\": 1, \"deadline_ms\": {later}}}\n"
            ),
            "version 1",
        ),
        (
            r#"{"op": "enqueue", "protocol": 1, "tasks": 1}"#.to_string() + "\n",
            "deadline_ms",
        ),
        (head("drop_tables", 0), "no operation"),
        (head("enqueue", 0), "1 to"),
        (
            format!("{}{line}\n", head("enqueue", 2)),
            "ended before task 2",
        ),
        (
            format!("{}{line}\n{{\"user\": 1}}\n", head("enqueue", 2)),
            "task 2",
        ),
        (one(&empty_user), "user"),
        (one(&long_goal), "goal"),
        (one(&far), "century"),
        (one(&told), "instructions"),
        (one(&spoofed), "submitted_by"),
        (one(&slow_tool), "no_such_tool"),
        (one(&file_callback), "callback_url"),
        (one(&tick), "reserved for the tasks of schedules"),
        (
            format!(
                "{}{}\n",
                head("enqueue", 1),
                "x".repeat(LINE_BYTES_MAX + 10)
            ),
            "limit",
        ),
    ]
}

#[test]
fn a_bad_request_is_refused_with_its_reason_and_enqueues_nothing() {
    let (dir, db, store, api) = served("bad");
    let cases = bad_requests();
    for (text, says) in &cases {
        match raw(&db, text) {
            Answer::Error(f) => {
                assert_eq!(f.kind, "invalid", "{says}: {f:?}");
                assert!(f.message.contains(says), "{says}: {f:?}");
            }
            Answer::Ok(out) => panic!("{says}: accepted: {out:?}"),
        }
    }
    let q = crate::store::list::ListQuery {
        limit: 100,
        ..Default::default()
    };
    let page = store.list(&q).expect("list");
    assert!(
        page.tasks.is_empty(),
        "nothing was enqueued: {:?}",
        page.tasks
    );
    // The daemon still answers.
    assert!(enqueue(&db, &[task(None)]).expect("enqueue").is_some());
    drop(api);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn decisions_sent_to_the_daemon_run_the_operators_functions_and_keep_their_errors() {
    let (dir, db, store, api) = served("decide");
    let out = enqueue(&db, &[task(None)])
        .expect("enqueue")
        .expect("answered");
    let id = out[0].id.clone();
    // Nothing is held: the operator function's refusal comes back as the same error.
    let reject = Decide::Reject {
        task: id.clone(),
        key: None,
        digest: Some("0000000000".into()),
        by: "alice".into(),
        reason: None,
    };
    match decide(&db, &reject) {
        Err(Error::Conflict(m)) => assert!(m.contains(&id), "{m}"),
        other => panic!("a reject of a queued task: {other:?}"),
    }
    let missing = Decide::Cancel {
        task: "t999".into(),
        by: "alice".into(),
        reason: None,
    };
    assert!(matches!(decide(&db, &missing), Err(Error::NoTask(t)) if t == "t999"));
    let bad_by = Decide::Cancel {
        task: id.clone(),
        by: String::new(),
        reason: None,
    };
    assert!(matches!(decide(&db, &bad_by), Err(Error::Invalid(_))));
    // A cancel is carried out and audited under the operator's name.
    let cancel = Decide::Cancel {
        task: id.clone(),
        by: "alice".into(),
        reason: Some("not needed".into()),
    };
    let was = decide(&db, &cancel).expect("cancel").expect("answered");
    assert_eq!(was, serde_json::json!("queued"));
    let rec = store.task(&id).expect("task");
    assert_eq!(rec.status, crate::store::QueueStatus::Finished);
    let events = store.events(Some(&id)).expect("events");
    assert!(
        events.iter().any(|e| e.verb == "cancel"
            && e.by == "alice"
            && e.reason.as_deref() == Some("not needed")),
        "{events:?}"
    );
    drop(api);
    assert!(decide(&db, &cancel).expect("no daemon").is_none());
    let _ = fs::remove_dir_all(&dir);
}

/// A "daemon" that reads the first line of one request and dies without answering, leaving its
/// socket behind.
fn dies_after_reading(db: &Path) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(socket_path(db)).expect("bind");
    std::thread::spawn(move || {
        use std::io::BufRead;
        let (conn, _) = listener.accept().expect("accept");
        let mut line = String::new();
        let _ = std::io::BufReader::new(&conn).read_line(&mut line);
    })
}

#[test]
fn a_lost_answer_is_tried_again_only_when_keys_make_it_safe() {
    let dir = temp("lost");
    let db = dir.join("worker.redb");
    // Every task keyed: tried again; nobody listens any more, so the verb is told to open the
    // file itself (where the keys make a second enqueue harmless).
    let fake = dies_after_reading(&db);
    let out = enqueue(&db, &[task(Some("k1")), task(Some("k2"))]).expect("tried again");
    assert!(out.is_none(), "{out:?}");
    fake.join().expect("fake daemon");
    fs::remove_file(socket_path(&db)).expect("remove");
    // A task without a key: the outcome is unknown, and the verb says so instead of sending it
    // a second time.
    let fake = dies_after_reading(&db);
    match enqueue(&db, &[task(Some("k3")), task(None)]) {
        Err(Error::Daemon(m)) => {
            assert!(m.contains("did not answer"), "{m}");
            assert!(m.contains("may or may not be enqueued"), "{m}");
            assert!(m.contains("would be enqueued twice"), "{m}");
        }
        other => panic!("a keyless enqueue whose answer was lost: {other:?}"),
    }
    fake.join().expect("fake daemon");
    fs::remove_file(socket_path(&db)).expect("remove");
    // A decision likewise (taking it twice would report a refusal of what was done).
    let fake = dies_after_reading(&db);
    let cancel = Decide::Cancel {
        task: "t1".into(),
        by: "alice".into(),
        reason: None,
    };
    assert!(
        matches!(decide(&db, &cancel), Err(Error::Daemon(m)) if m.contains("may or may not be recorded"))
    );
    fake.join().expect("fake daemon");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_request_past_its_deadline_is_refused_not_carried_out() {
    let (dir, db, store, api) = served("late");
    let past = crate::clock::now_ms() - 1;
    let line = serde_json::to_string(&task(Some("late"))).expect("json");
    let text = format!(
        "{{\"op\": \"enqueue\", \"protocol\": 1, \"tasks\": 1, \"deadline_ms\": {past}}}\n{line}\n"
    );
    match raw(&db, &text) {
        Answer::Error(f) => assert!(f.message.contains("deadline passed"), "{f:?}"),
        Answer::Ok(out) => panic!("a late request was carried out: {out:?}"),
    }
    let cancel = Decide::Cancel {
        task: "t1".into(),
        by: "alice".into(),
        reason: None,
    };
    let text = format!(
        "{{\"op\": \"decide\", \"protocol\": 1, \"deadline_ms\": {past}}}\n{}\n",
        serde_json::to_string(&cancel).expect("json")
    );
    assert!(matches!(raw(&db, &text), Answer::Error(f) if f.message.contains("deadline passed")));
    assert!(matches!(store.task("t1"), Err(Error::NoTask(_))));
    drop(api);
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_planted_lock_link_or_an_overlong_path_is_refused_and_nothing_is_overwritten() {
    let dir = temp("planted");
    let db = dir.join("worker.redb");
    let store = Arc::new(RedbStore::open(&db, true).expect("open"));
    let precious = dir.join("precious");
    fs::write(&precious, "IMPORTANT").expect("write");
    std::os::unix::fs::symlink(&precious, lock_path(&db)).expect("link");
    match serve(&db, Arc::clone(&store) as Arc<dyn Backend>) {
        Err(why) => assert!(why.contains("worker.redb.lock"), "{why}"),
        Ok(_) => panic!("served through a planted link"),
    }
    assert_eq!(fs::read_to_string(&precious).expect("read"), "IMPORTANT");
    fs::remove_file(lock_path(&db)).expect("remove");
    // A second name for the lock file (a hard link) is refused too.
    fs::hard_link(&precious, lock_path(&db)).expect("hard link");
    assert!(serve(&db, Arc::clone(&store) as Arc<dyn Backend>).is_err());
    assert_eq!(fs::read_to_string(&precious).expect("read"), "IMPORTANT");
    fs::remove_file(lock_path(&db)).expect("remove");
    let deep = dir.join("d".repeat(120));
    fs::create_dir_all(&deep).expect("dir");
    let long = deep.join("worker.redb");
    let long_store = Arc::new(RedbStore::open(&long, true).expect("open"));
    match serve(&long, long_store as Arc<dyn Backend>) {
        Err(why) => assert!(why.contains("longer than"), "{why}"),
        Ok(_) => panic!("served a socket path no client can connect to"),
    }
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_request_sent_a_byte_at_a_time_is_cut_off_at_its_time_limit() {
    let (dir, db, _store, api) = served("trickle");
    let conn = UnixStream::connect(socket_path(&db)).expect("connect");
    let writer = conn.try_clone().expect("clone");
    // One byte of a header that never ends, every 100 ms, for up to ten times the limit: each
    // read of the daemon's gets a byte well within any per-read timeout.
    let trickle = std::thread::spawn(move || {
        for _ in 0..(REQUEST_TIMEOUT.as_millis() / 10) {
            if (&writer).write_all(b" ").is_err() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        false
    });
    match read_answer(&conn) {
        Ok(Answer::Error(f)) => assert!(f.message.contains("took longer than"), "{f:?}"),
        other => panic!("a trickled request was not cut off: {other:?}"),
    }
    drop(conn);
    // Cut off while it was still sending, not when it stopped.
    assert!(
        trickle.join().expect("trickle"),
        "the daemon waited for the trickle to end"
    );
    drop(api);
    let _ = fs::remove_dir_all(&dir);
}

/// A "daemon" of an earlier release: it answers each of `n` requests as a daemon that knows
/// decisions but not memory notes answers a note ("unknown variant").
fn knows_no_notes(db: &Path, n: usize) -> std::thread::JoinHandle<()> {
    let listener = UnixListener::bind(socket_path(db)).expect("bind");
    std::thread::spawn(move || {
        use std::io::BufRead;
        for _ in 0..n {
            let (mut conn, _) = listener.accept().expect("accept");
            let mut line = String::new();
            let _ = std::io::BufReader::new(&conn).read_line(&mut line);
            let answer = r#"{"error":{"kind":"invalid","message":"the decision: unknown variant `note`, expected one of `approve`, `reject`, `reconcile`, `cancel`"}}"#;
            let _ = writeln!(conn, "{answer}");
        }
    })
}

#[test]
fn a_note_refused_by_an_earlier_daemon_is_written_by_the_verb_and_a_decision_is_not() {
    let dir = temp("old-daemon");
    let db = dir.join("worker.redb");
    let server = knows_no_notes(&db, 2);
    let note = Decide::Note {
        user: "cu_ana".into(),
        text: "Prefers refunds to the card.".into(),
        source: "user_message".into(),
        ttl_s: 60,
        by: "alice".into(),
    };
    assert!(
        matches!(decide(&db, &note), Ok(None)),
        "the note falls back to the file"
    );
    let cancel = Decide::Cancel {
        task: "t1".into(),
        by: "alice".into(),
        reason: None,
    };
    assert!(
        matches!(decide(&db, &cancel), Err(Error::Invalid(m)) if m.contains("unknown variant")),
        "any other refusal stands"
    );
    server.join().expect("the old daemon");
    let _ = fs::remove_dir_all(&dir);
}

#[test]
fn a_schedule_sent_to_the_daemon_is_checked_and_made_new() {
    let (dir, db, store, _api) = served("schedule");
    let schedule = |task: serde_json::Value| crate::store::schedule::Schedule {
        name: "nightly".into(),
        cron: "0 2 * * *".into(),
        tz: "UTC".into(),
        catch_up: crate::store::schedule::CatchUp::Latest,
        paused: true,
        task,
        last_tick_ms: 0,
        created_at_ms: 0,
        fired: 7,
    };
    let bad = Decide::ScheduleAdd {
        schedule: schedule(serde_json::json!({"nonsense": 1})),
    };
    assert!(
        matches!(decide(&db, &bad), Err(Error::Invalid(m)) if m.contains("the schedule's task")),
        "a task no enqueue would take is refused"
    );
    assert!(store.schedules().expect("schedules").is_empty());
    let good = Decide::ScheduleAdd {
        schedule: schedule(serde_json::json!({"user": "cu_ana", "goal": "g", "model": "policy"})),
    };
    decide(&db, &good)
        .expect("added")
        .expect("through the daemon");
    let s = &store.schedules().expect("schedules")[0];
    // Made now: no tick from the epoch on is due, nothing fired, not paused.
    assert!(s.last_tick_ms > 0 && s.created_at_ms > 0, "{s:?}");
    assert_eq!((s.fired, s.paused), (0, false));
    let _ = fs::remove_dir_all(&dir);
}

/// The socket and the lock sit beside the file a chain of links ends at, named as shortly as
/// the links allow; a path that is no link is kept as given.
#[test]
fn links_lead_to_the_files_socket() {
    let d = temp("links");
    let real = d.join("sub").join("worker.redb");
    fs::create_dir_all(real.parent().expect("dir")).expect("sub dir");
    fs::write(&real, b"").expect("file");
    // A relative link beside the file's directory, then an absolute link to that link.
    std::os::unix::fs::symlink("sub/worker.redb", d.join("rel.redb")).expect("link");
    std::os::unix::fs::symlink(d.join("rel.redb"), d.join("abs.redb")).expect("link");
    assert_eq!(socket_path(&real), d.join("sub/worker.redb.sock"));
    assert_eq!(
        socket_path(&d.join("rel.redb")),
        d.join("sub/worker.redb.sock")
    );
    assert_eq!(
        lock_path(&d.join("abs.redb")),
        d.join("sub/worker.redb.lock")
    );
    assert_eq!(
        socket_path(Path::new("no-such.redb")),
        Path::new("no-such.redb.sock")
    );
    let _ = fs::remove_dir_all(&d);
}
