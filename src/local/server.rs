//! The daemon's side of the local API: the lock that makes one daemon per file serve it, the
//! socket bound with its mode from the start, a thread per request (at most
//! `CONNECTIONS_MAX`), and each request carried out through the store or the operators'
//! functions.

use std::fs::{self, File};
use std::io::{BufReader, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::*;
use crate::limits::{self, LineError, Lines};
use crate::store::{Backend, Enqueued, NewTask, Result};

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
    match claim(db)? {
        Claim::Held(lock) => serve_claimed(db, lock, store).map(Served::Serving),
        Claim::Elsewhere(pid) => Ok(Served::Elsewhere(pid)),
    }
}

/// The lock on `worker.redb.lock`, which one daemon per file holds.
pub enum Claim {
    /// This process holds it, its pid written in the file.
    Held(File),
    /// Another daemon holds it (its pid, if it wrote one).
    Elsewhere(Option<u32>),
}

/// Takes the daemon's lock of the file `db`, unless another daemon holds it. A daemon that is
/// the file's only writer takes it before it opens the file, so a second daemon is refused
/// by name before it touches the database.
pub fn claim(db: &Path) -> std::result::Result<Claim, String> {
    let lock_file = lock_path(db);
    let lock = open_lock(&lock_file)?;
    match lock.try_lock() {
        Ok(()) => {}
        Err(fs::TryLockError::WouldBlock) => return Ok(Claim::Elsewhere(daemon_pid(db))),
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
    Ok(Claim::Held(lock))
}

/// Serves the local API of `db` under the lock [`claim`] took.
pub fn serve_claimed(
    db: &Path,
    lock: File,
    store: Arc<dyn Backend>,
) -> std::result::Result<LocalApi, String> {
    let socket = socket_path(db);
    if socket.as_os_str().len() > SOCKET_PATH_MAX {
        return Err(format!(
            "{} is longer than the {SOCKET_PATH_MAX} bytes a Unix socket's path may have",
            socket.display()
        ));
    }
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
    Ok(LocalApi {
        socket,
        stop,
        live,
        accept: Some(accept),
        _lock: lock,
    })
}

/// Opens the lock file without following a symbolic link, and only if it is a regular file of
/// this user with no other name: its content is replaced with the pid, so a link planted
/// there must not make the daemon overwrite the file it names.
fn open_lock(path: &Path) -> std::result::Result<File, String> {
    use std::os::unix::fs::MetadataExt;
    let lock = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let m = lock
        .metadata()
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !m.is_file() || m.uid() != own_uid() || m.nlink() != 1 {
        return Err(format!(
            "{} is not a file of this user's alone (a regular file owned by uid {}, with one name); remove it",
            path.display(),
            own_uid()
        ));
    }
    Ok(lock)
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
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let private = dir.join(format!(".tether-socket-{}-{nanos:09}", std::process::id()));
    let inner = private.join("s");
    if inner.as_os_str().len() > SOCKET_PATH_MAX {
        return Err(format!(
            "the socket is bound at {} first, longer than the {SOCKET_PATH_MAX} bytes a Unix socket's path may have",
            inner.display()
        ));
    }
    let _ = fs::remove_dir_all(&private);
    let bound = (|| {
        fs::DirBuilder::new().mode(0o700).create(&private)?;
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
                kind: "busy".into(),
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
    let _ = conn.set_write_timeout(Some(REQUEST_TIMEOUT));
    // The socket's mode keeps other users out; root is the one other caller it lets in.
    let answer = match peer_uid(&conn) {
        Ok(uid) if uid == own_uid() || uid == 0 => {
            let mut r = Reading {
                lines: Lines::new(BufReader::new(Timed {
                    conn: &conn,
                    until: Instant::now() + REQUEST_TIMEOUT,
                })),
                bytes: 0,
            };
            request(&mut r, store)
        }
        Ok(uid) => Err(Error::Invalid(format!(
            "the daemon takes requests from its own user only, not from uid {uid}"
        ))),
        Err(e) => Err(Error::Invalid(format!(
            "the daemon cannot tell who is calling: {e}"
        ))),
    };
    let answer = match answer {
        Ok(out) => Answer::Ok(out),
        Err(e) => Answer::Error(failure(&e)),
    };
    if let Err(e) = reply(&conn, &answer) {
        tracing::warn!(error = %e, "local API: the caller left before its answer");
    }
}

/// A request as it arrives: within one time limit for the whole of it, and one size limit.
struct Reading<'a> {
    lines: Lines<BufReader<Timed<'a>>>,
    bytes: usize,
}

/// The connection read within one deadline for the whole request: each read may wait only
/// for what is left of it, so a caller sending a byte at a time cannot hold a slot longer.
struct Timed<'a> {
    conn: &'a UnixStream,
    until: Instant,
}

impl std::io::Read for Timed<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let late = || {
            std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "the request took longer than {} s to arrive",
                    REQUEST_TIMEOUT.as_secs()
                ),
            )
        };
        let left = self.until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(late());
        }
        self.conn.set_read_timeout(Some(left))?;
        match self.conn.read(buf) {
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                Err(late())
            }
            other => other,
        }
    }
}

impl Reading<'_> {
    fn next(&mut self, what: &str) -> Result<String> {
        let line = match self.lines.next_line(LINE_BYTES_MAX) {
            Ok(Some(l)) => l,
            Ok(None) => {
                return Err(Error::Invalid(format!("the request ended before {what}")));
            }
            Err(LineError::Bad(m)) => return Err(Error::Invalid(format!("{what}: {m}"))),
            Err(LineError::Io(e)) => {
                return Err(Error::Invalid(format!("reading {what}: {e}")));
            }
        };
        self.bytes += line.len() + 1;
        if self.bytes > REQUEST_BYTES_MAX {
            return Err(Error::Invalid(format!(
                "the request is over {} MiB; split the batch",
                REQUEST_BYTES_MAX >> 20
            )));
        }
        Ok(line)
    }
}

/// Refuses a request whose caller stopped waiting before the daemon came to it.
fn in_time(deadline_ms: u64) -> Result<()> {
    if crate::clock::now_ms() > deadline_ms {
        return Err(Error::Daemon(
            "the caller's deadline passed before the daemon came to the request (was it paused?): nothing was done"
                .into(),
        ));
    }
    Ok(())
}

/// Reads one request and carries it out.
fn request(r: &mut Reading, store: &dyn Backend) -> Result<serde_json::Value> {
    let header: Header = serde_json::from_str(&r.next("the header")?)
        .map_err(|e| Error::Invalid(format!("the request's header: {e}")))?;
    if header.protocol != PROTOCOL {
        return Err(Error::Invalid(format!(
            "the daemon speaks version {PROTOCOL} of the local API and the request version {}: run the same Tether release for the daemon and the verbs",
            header.protocol
        )));
    }
    let value = |v: std::result::Result<serde_json::Value, serde_json::Error>| {
        v.map_err(|e| Error::Daemon(format!("cannot write the answer: {e}")))
    };
    match header.op.as_str() {
        "enqueue" => value(serde_json::to_value(enqueue_request(r, &header, store)?)),
        "decide" => {
            let d: Decide = serde_json::from_str(&r.next("the decision")?)
                .map_err(|e| Error::Invalid(format!("the decision: {e}")))?;
            in_time(header.deadline_ms)?;
            let out = decide_here(&d, store)?;
            tracing::debug!(decision = ?d, "decided for a caller of the local API");
            Ok(out)
        }
        other => Err(Error::Invalid(format!(
            "the local API has no operation {other:?}"
        ))),
    }
}

fn enqueue_request(r: &mut Reading, header: &Header, store: &dyn Backend) -> Result<Vec<Enqueued>> {
    let count = header.tasks;
    if count == 0 || count > limits::BATCH_TASKS_MAX {
        return Err(Error::Invalid(format!(
            "an enqueue carries 1 to {} tasks, not {count}",
            limits::BATCH_TASKS_MAX,
        )));
    }
    let mut tasks = Vec::with_capacity(count.min(1024));
    for i in 0..count {
        let what = format!("task {}", i + 1);
        let line = r.next(&what)?;
        let task: NewTask =
            serde_json::from_str(&line).map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        crate::operator::submit::check_new_task(&task)
            .map_err(|e| Error::Invalid(format!("{what}: {e}")))?;
        tasks.push(task);
    }
    in_time(header.deadline_ms)?;
    let out = store.enqueue(&tasks, crate::clock::now_ms())?;
    tracing::debug!(tasks = out.len(), "enqueued for a caller of the local API");
    Ok(out)
}

/// Carries out a decision in this process, through the operators' own functions: what the
/// daemon runs for a caller of the socket, and what a verb runs when no daemon does.
pub fn decide_here(d: &Decide, store: &dyn Backend) -> Result<serde_json::Value> {
    use crate::operator::{Extension, Reviewed, Settlement};
    let decision = |by: &str, reason: &Option<String>| {
        crate::operator::decision(by, reason.as_deref()).map_err(Error::Invalid)
    };
    let reviewed = |key: &Option<String>, digest: &Option<String>| Reviewed {
        key: key.clone(),
        digest: digest.clone(),
    };
    let call = match d {
        Decide::Approve {
            task,
            key,
            digest,
            extend,
            by,
            reason,
        } => crate::operator::approve(
            store,
            task,
            &reviewed(key, digest),
            &Extension(extend.clone()),
            &decision(by, reason)?,
        )?,
        Decide::Reject {
            task,
            key,
            digest,
            by,
            reason,
        } => crate::operator::reject(store, task, &reviewed(key, digest), &decision(by, reason)?)?,
        Decide::Reconcile {
            task,
            applied,
            key,
            digest,
            extend,
            by,
            reason,
        } => {
            let settlement = match applied {
                Some(result) => Settlement::Applied(result.clone()),
                None => Settlement::NotApplied,
            };
            crate::operator::reconcile(
                store,
                task,
                &settlement,
                &reviewed(key, digest),
                &Extension(extend.clone()),
                &decision(by, reason)?,
            )?
        }
        Decide::Answer { .. } | Decide::Say { .. } => return words(d, store),
        Decide::Cancel { task, by, reason } => {
            let was = crate::operator::cancel(store, task, None, &decision(by, reason)?)?;
            return Ok(serde_json::json!(was));
        }
        other => return maintain(other, store),
    };
    Ok(serde_json::json!(call))
}

/// A person's words to a task: an answer to its question, or a follow-up message.
fn words(d: &Decide, store: &dyn Backend) -> Result<serde_json::Value> {
    match d {
        Decide::Answer {
            task,
            text,
            key,
            digest,
            by,
            reason,
        } => {
            let seen = crate::operator::Reviewed {
                key: key.clone(),
                digest: digest.clone(),
            };
            let d = crate::operator::decision(by, reason.as_deref()).map_err(Error::Invalid)?;
            let q = crate::operator::answer(store, task, text, &seen, &d)?;
            Ok(serde_json::json!(q))
        }
        Decide::Say {
            task,
            text,
            turn,
            by,
            reason,
        } => {
            let d = crate::operator::decision(by, reason.as_deref()).map_err(Error::Invalid)?;
            let said = crate::operator::say(store, task, text, *turn, &d)?;
            Ok(serde_json::json!(said))
        }
        _ => Err(Error::Invalid("not a person's words".into())),
    }
}

/// The maintenance requests (memory notes, purge, schedules), here as in the verbs.
fn maintain(d: &Decide, store: &dyn Backend) -> Result<serde_json::Value> {
    let decision = |by: &str| crate::operator::decision(by, None).map_err(Error::Invalid);
    let out = match d {
        Decide::Note {
            user,
            text,
            source,
            ttl_s,
            by,
        } => serde_json::json!(store.add_note(user, text, source, *ttl_s, &decision(by)?)?),
        Decide::Forget { user, source, by } => {
            serde_json::json!(store.forget(user, source.as_deref(), &decision(by)?)?)
        }
        Decide::Purge {
            before_ms,
            batch,
            by,
            reason,
        } => {
            let d = crate::operator::decision(by, reason.as_deref()).map_err(Error::Invalid)?;
            serde_json::json!(store.purge(*before_ms, (*batch).clamp(1, 10_000), &d)?)
        }
        Decide::ScheduleAdd { schedule } => {
            let s = checked_schedule(schedule)?;
            store.add_schedule(&s)?;
            serde_json::json!(true)
        }
        Decide::SchedulePaused { name, paused } => {
            let now = crate::clock::now_ms();
            let found = store.update_schedule(name, &mut |s| {
                // Resumed: the ticks missed while paused are not fired.
                if s.paused && !*paused {
                    s.last_tick_ms = s.last_tick_ms.max(now);
                }
                s.paused = *paused;
            })?;
            serde_json::json!(found)
        }
        Decide::ScheduleRemove { name } => serde_json::json!(store.remove_schedule(name)?),
        other => {
            return Err(Error::Invalid(format!(
                "not a maintenance request: {other:?}"
            )));
        }
    };
    Ok(out)
}

/// A schedule a caller sent, checked as `worker schedule add` checks it (its name, cron
/// expression, time zone and task), and new: made now, not paused, nothing fired yet.
fn checked_schedule(
    s: &crate::store::schedule::Schedule,
) -> Result<crate::store::schedule::Schedule> {
    use crate::operator::schedule as sched;
    crate::limits::check_name(&s.name, "the schedule's name").map_err(|e| Error::Invalid(e.0))?;
    sched::parse(&s.cron).map_err(Error::Invalid)?;
    sched::zone(&s.tz).map_err(Error::Invalid)?;
    serde_json::from_value::<crate::operator::submit::TaskRequest>(s.task.clone())
        .map_err(|e| Error::Invalid(format!("the schedule's task: {e}")))?;
    let now = crate::clock::now_ms();
    Ok(crate::store::schedule::Schedule {
        paused: false,
        last_tick_ms: now,
        created_at_ms: now,
        fired: 0,
        ..s.clone()
    })
}
