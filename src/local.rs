//! The daemon's local API: a Unix socket beside the redb file (`worker.redb.sock`, mode 0600)
//! through which `worker enqueue` hands its tasks to the running daemon, which commits them in
//! the database it already has open. The verb then opens nothing itself (no file open, no
//! repair check, no commit of its own). Without a daemon (no socket, or a socket nobody
//! listens on, left by a daemon that was killed) the verb opens the file as before.
//!
//! One daemon per file serves the socket: the one holding the lock on `worker.redb.lock`
//! (an exclusive `flock`, with its pid written in the file) for as long as it runs. The kernel
//! drops the lock when the process ends, however it ends, so a socket left by a killed daemon
//! is replaced by the next one to start. The lock file is never removed: two daemons must
//! never lock two different files of the same name. The socket is bound inside a private
//! directory and renamed into place, so it is never reachable with looser permissions.
//!
//! The protocol: one request per connection, in lines of JSON. A request is a header line
//! (`{"op": "enqueue", "protocol": 1, "tasks": N}`) and N lines, one task each; the answer is
//! one line, `{"ok": [{"id": ..., "created": ...}]}` or `{"error": {"kind": ..., "message":
//! ...}}`. Errors carry the store's kinds, so a verb prints and exits as it would have without
//! the daemon. A request whose answer never comes (the daemon paused, or killed after reading
//! it) is reported as such: the verb does not send it again on its own.

use serde::{Deserialize, Serialize};
use std::fs::{self, File};
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::limits::{self, LineError, Lines};
use crate::store::{Backend, Enqueued, Error, NewTask, Result};

/// The protocol's version: a request of another version is refused, not guessed at.
pub const PROTOCOL: u32 = 1;
/// Requests handled at once; one more is answered "busy".
const CONNECTIONS_MAX: usize = 32;
/// How long the daemon waits for each line of a request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a verb waits for the daemon's answer, unless `WORKER_DAEMON_TIMEOUT_MS` says.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// One line of a request: a task with its script and catalog.
const LINE_BYTES_MAX: usize = 64 << 20;

/// `dir/worker.redb` -> `dir/worker.redb.sock`.
pub fn socket_path(db: &Path) -> PathBuf {
    suffixed(db, ".sock")
}

/// `dir/worker.redb` -> `dir/worker.redb.lock`: held by the daemon that serves the socket.
pub fn lock_path(db: &Path) -> PathBuf {
    suffixed(db, ".lock")
}

fn suffixed(db: &Path, suffix: &str) -> PathBuf {
    let mut s = db.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The pid the daemon serving `db` wrote in its lock file, if one did.
pub fn daemon_pid(db: &Path) -> Option<u32> {
    fs::read_to_string(lock_path(db)).ok()?.trim().parse().ok()
}

#[derive(Serialize, Deserialize)]
struct Header {
    op: String,
    protocol: u32,
    #[serde(default)]
    tasks: usize,
}

#[derive(Debug, Serialize, Deserialize)]
struct Failure {
    kind: String,
    message: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Answer {
    Ok(Vec<Enqueued>),
    Error(Failure),
}

fn failure(e: &Error) -> Failure {
    let (kind, message) = match e {
        Error::Invalid(m) => ("invalid", m.clone()),
        Error::Conflict(m) => ("conflict", m.clone()),
        Error::NoTask(id) => ("no_task", id.clone()),
        other => ("other", other.to_string()),
    };
    Failure {
        kind: kind.into(),
        message,
    }
}

fn error_of(f: Failure) -> Error {
    match f.kind.as_str() {
        "invalid" => Error::Invalid(f.message),
        "conflict" => Error::Conflict(f.message),
        "no_task" => Error::NoTask(f.message),
        _ => Error::Daemon(f.message),
    }
}

/// Whether this daemon serves the socket, or another one does.
pub enum Served {
    Serving(LocalApi),
    /// Another daemon holds the lock (its pid, if it wrote one).
    Elsewhere(Option<u32>),
}

/// The socket being served; dropping it stops the server (requests being answered are
/// finished first, for up to five seconds), removes the socket and lets the lock go.
pub struct LocalApi {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
    accept: Option<std::thread::JoinHandle<()>>,
    _lock: File,
}

/// Serves the local API of the database file `db` with `store`, unless another daemon does.
pub fn serve(db: &Path, store: Arc<dyn Backend>) -> std::result::Result<Served, String> {
    let lock_file = lock_path(db);
    let lock = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&lock_file)
        .map_err(|e| format!("cannot open {}: {e}", lock_file.display()))?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Ok(Served::Elsewhere(daemon_pid(db))),
        Err(fs::TryLockError::Error(e)) => {
            return Err(format!("cannot lock {}: {e}", lock_file.display()));
        }
    }
    let pid = format!("{}\n", std::process::id());
    (|| {
        lock.set_len(0)?;
        (&lock).write_all(pid.as_bytes())
    })()
    .map_err(|e| format!("cannot write {}: {e}", lock_file.display()))?;
    let socket = socket_path(db);
    let listener = bind_private(&socket)?;
    let stop = Arc::new(AtomicBool::new(false));
    let live = Arc::new(AtomicUsize::new(0));
    let accept = {
        let (stop, live) = (Arc::clone(&stop), Arc::clone(&live));
        std::thread::Builder::new()
            .name("local-api".into())
            .spawn(move || accept_loop(listener, store, stop, live))
            .map_err(|e| format!("cannot start the local API's thread: {e}"))?
    };
    Ok(Served::Serving(LocalApi {
        socket,
        stop,
        live,
        accept: Some(accept),
        _lock: lock,
    }))
}

impl LocalApi {
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for LocalApi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which sees the flag. If the socket was removed under the
        // daemon, nothing can reach the loop: it is left asleep in `accept` (it holds nothing
        // but the listener) rather than waited for.
        let woken = UnixStream::connect(&self.socket).is_ok();
        if let Some(t) = self.accept.take()
            && woken
        {
            let _ = t.join();
        }
        let _ = fs::remove_file(&self.socket);
        let until = Instant::now() + Duration::from_secs(5);
        while self.live.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Binds `socket` with mode 0600 from the start: inside a directory only this user can enter,
/// then renamed into place (replacing a socket a killed daemon left).
fn bind_private(socket: &Path) -> std::result::Result<UnixListener, String> {
    let dir = match socket.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let private = dir.join(format!(".tether-socket-{}", std::process::id()));
    let _ = fs::remove_dir_all(&private);
    let bound = (|| {
        fs::DirBuilder::new().mode(0o700).create(&private)?;
        let inner = private.join("s");
        let listener = UnixListener::bind(&inner)?;
        fs::set_permissions(&inner, fs::Permissions::from_mode(0o600))?;
        match fs::remove_file(socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        fs::rename(&inner, socket)?;
        Ok(listener)
    })();
    let _ = fs::remove_dir_all(&private);
    bound.map_err(|e: std::io::Error| format!("cannot serve {}: {e}", socket.display()))
}

fn accept_loop(
    listener: UnixListener,
    store: Arc<dyn Backend>,
    stop: Arc<AtomicBool>,
    live: Arc<AtomicUsize>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors, say: wait a little rather than spin.
                tracing::warn!(error = %e, "local API: cannot accept a connection");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if live.fetch_add(1, Ordering::SeqCst) >= CONNECTIONS_MAX {
            live.fetch_sub(1, Ordering::SeqCst);
            let busy = Answer::Error(Failure {
                kind: "other".into(),
                message: format!("the daemon is answering {CONNECTIONS_MAX} requests; try again"),
            });
            let _ = reply(&conn, &busy);
            continue;
        }
        let (store, done) = (Arc::clone(&store), Arc::clone(&live));
        let spawned = std::thread::Builder::new()
            .name("local-request".into())
            .spawn(move || {
                handle(conn, store.as_ref());
                done.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            live.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

fn reply(mut conn: &UnixStream, answer: &Answer) -> std::io::Result<()> {
    let mut line = serde_json::to_vec(answer).map_err(std::io::Error::other)?;
    line.push(b'\n');
    conn.write_all(&line)
}

fn handle(conn: UnixStream, store: &dyn Backend) {
    let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
    let _ = conn.set_write_timeout(Some(REQUEST_TIMEOUT));
    let mut lines = Lines::new(BufReader::new(&conn));
    let answer = match request(&mut lines, store) {
        Ok(out) => Answer::Ok(out),
        Err(e) => Answer::Error(failure(&e)),
    };
    if let Err(e) = reply(&conn, &answer) {
        tracing::warn!(error = %e, "local API: the caller left before its answer");
    }
}

fn next_line<R: std::io::BufRead>(lines: &mut Lines<R>, what: &str) -> Result<String> {
    match lines.next_line(LINE_BYTES_MAX) {
        Ok(Some(l)) => Ok(l),
        Ok(None) => Err(Error::Invalid(format!("the request ended before {what}"))),
        Err(LineError::Bad(m)) => Err(Error::Invalid(format!("{what}: {m}"))),
        Err(LineError::Io(e)) => Err(Error::Invalid(format!("reading {what}: {e}"))),
    }
}

/// Reads one request and carries it out.
fn request<R: std::io::BufRead>(
    lines: &mut Lines<R>,
    store: &dyn Backend,
) -> Result<Vec<Enqueued>> {
    let header: Header = serde_json::from_str(&next_line(lines, "the header")?)
        .map_err(|e| Error::Invalid(format!("the request's header: {e}")))?;
    if header.protocol != PROTOCOL {
        return Err(Error::Invalid(format!(
            "the daemon speaks version {PROTOCOL} of the local API and the request version {}: run the same Tether release for the daemon and the verbs",
            header.protocol
        )));
    }
    if header.op != "enqueue" {
        return Err(Error::Invalid(format!(
            "the local API has no operation {:?}",
            header.op
        )));
    }
    if header.tasks == 0 || header.tasks > limits::BATCH_TASKS_MAX {
        return Err(Error::Invalid(format!(
            "an enqueue carries 1 to {} tasks, not {}",
            limits::BATCH_TASKS_MAX,
            header.tasks
        )));
    }
    let mut tasks = Vec::with_capacity(header.tasks.min(1024));
    for i in 0..header.tasks {
        let what = format!("task {}", i + 1);
        let line = next_line(lines, &what)?;
        let task =
            serde_json::from_str(&line).map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        tasks.push(task);
    }
    let out = store.enqueue(&tasks, crate::clock::now_ms())?;
    tracing::debug!(tasks = out.len(), "enqueued for a caller of the local API");
    Ok(out)
}

/// How long a verb waits for the daemon's answer.
fn answer_timeout() -> Duration {
    std::env::var("WORKER_DAEMON_TIMEOUT_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(ANSWER_TIMEOUT, Duration::from_millis)
}

/// Enqueues `tasks` through the daemon serving the file `db`, in one transaction of its own.
/// `Ok(None)`: no daemon answers on the socket, nothing was sent (open the file instead).
pub fn enqueue(db: &Path, tasks: &[NewTask]) -> Result<Option<Vec<Enqueued>>> {
    let socket = socket_path(db);
    let conn = match UnixStream::connect(&socket) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(socket = %socket.display(), error = %e, "no daemon answers; opening the file");
            return Ok(None);
        }
    };
    let timeout = answer_timeout();
    let _ = conn.set_read_timeout(Some(timeout));
    let _ = conn.set_write_timeout(Some(timeout));
    let sent = send(&conn, tasks);
    // An answer may have come even when sending failed (a refusal of the header).
    let answer = read_answer(&conn);
    let daemon = match daemon_pid(db) {
        Some(pid) => format!("the daemon serving {} (pid {pid})", db.display()),
        None => format!("the daemon serving {}", db.display()),
    };
    let unknown = |what: String| {
        let again = if tasks.iter().all(|t| t.key.is_some()) {
            "running the same enqueue again is safe: its keys are not enqueued twice"
        } else {
            "tasks without --key would be enqueued twice by running it again"
        };
        Error::Daemon(format!(
            "{daemon} {what}: the tasks may or may not be enqueued; `worker list` shows them ({again})"
        ))
    };
    match (sent, answer) {
        (_, Ok(Answer::Ok(out))) => Ok(Some(out)),
        (_, Ok(Answer::Error(f))) => Err(error_of(f)),
        (Err(e), Err(_)) => Err(unknown(format!("stopped reading the request ({e})"))),
        (Ok(()), Err(e)) if is_timeout(&e) => Err(unknown(format!(
            "did not answer within {} ms (is it paused?)",
            timeout.as_millis()
        ))),
        (Ok(()), Err(e)) => Err(unknown(format!("did not answer ({e})"))),
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn send(conn: &UnixStream, tasks: &[NewTask]) -> std::io::Result<()> {
    let mut w = BufWriter::new(conn);
    let header = Header {
        op: "enqueue".into(),
        protocol: PROTOCOL,
        tasks: tasks.len(),
    };
    serde_json::to_writer(&mut w, &header)?;
    w.write_all(b"\n")?;
    for t in tasks {
        serde_json::to_writer(&mut w, t)?;
        w.write_all(b"\n")?;
    }
    w.flush()
}

fn read_answer(conn: &UnixStream) -> std::io::Result<Answer> {
    let mut line = Vec::new();
    BufReader::new(conn)
        .take(LINE_BYTES_MAX as u64)
        .read_until(b'\n', &mut line)?;
    if line.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the connection closed without an answer",
        ));
    }
    serde_json::from_slice(&line).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("its answer is not one this release reads: {e}"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::RedbStore;
    use crate::store::prelude::*;

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
            instructions: Some("be brief".into()),
            callback_url: None,
            submitted_by: None,
            not_before_ms: None,
            concurrency_key: Some("tenant:a".into()),
            time_limits: Default::default(),
        }
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
        (&conn).write_all(text.as_bytes()).expect("send");
        conn.shutdown(std::net::Shutdown::Write).expect("shutdown");
        read_answer(&conn).expect("an answer")
    }

    #[test]
    fn tasks_sent_to_the_daemon_are_committed_as_sent_and_keys_hold() {
        let dir = temp("enqueue");
        let db = dir.join("worker.redb");
        let store = Arc::new(RedbStore::open(&db, true).expect("open"));
        let api = serving(&db, &store);
        let mode = fs::metadata(socket_path(&db))
            .expect("socket")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "the socket is the owner's only");
        assert_eq!(daemon_pid(&db), Some(std::process::id()));
        let sent = vec![task(Some("k1")), task(None)];
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
            assert_eq!(rec.instructions.as_deref(), Some("be brief"));
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
        let dir = temp("owner");
        let db = dir.join("worker.redb");
        let store = Arc::new(RedbStore::open(&db, true).expect("open"));
        let api = serving(&db, &store);
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

    #[test]
    fn a_bad_request_is_refused_with_its_reason_and_enqueues_nothing() {
        let dir = temp("bad");
        let db = dir.join("worker.redb");
        let store = Arc::new(RedbStore::open(&db, true).expect("open"));
        let api = serving(&db, &store);
        let line = serde_json::to_string(&task(None)).expect("json");
        let cases = [
            ("", "ended before the header"),
            ("nonsense\n", "header"),
            (
                r#"{"op": "enqueue", "protocol": 99, "tasks": 1}"#,
                "version 1",
            ),
            (r#"{"op": "drop_tables", "protocol": 1}"#, "no operation"),
            (r#"{"op": "enqueue", "protocol": 1, "tasks": 0}"#, "1 to"),
            (
                &format!("{{\"op\": \"enqueue\", \"protocol\": 1, \"tasks\": 2}}\n{line}\n"),
                "ended before task 2",
            ),
            (
                &format!(
                    "{{\"op\": \"enqueue\", \"protocol\": 1, \"tasks\": 2}}\n{line}\n{{\"user\": 1}}\n"
                ),
                "task 2",
            ),
        ];
        for (text, says) in cases {
            match raw(&db, text) {
                Answer::Error(f) => {
                    assert_eq!(f.kind, "invalid", "{text:?}: {f:?}");
                    assert!(f.message.contains(says), "{text:?}: {f:?}");
                }
                Answer::Ok(out) => panic!("{text:?} was accepted: {out:?}"),
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
}
