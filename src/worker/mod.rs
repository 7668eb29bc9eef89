//! The daemon: a bounded pool of threads, each running one task at a time, fed through bounded
//! crossbeam channels, with one committer thread that groups the commits of all threads into
//! shared write transactions (group commit: each step stays atomic, many steps share an fsync).
//!
//! Life of a task here: the dispatcher claims it with a lease and a fencing token, only when a
//! thread is free to start it at once; a worker thread drives its kernel
//! session; before a write is sent its intent is committed; at every step end the state, spans,
//! reply, call-key record and lease renewal are committed together; at the end the stop reason
//! decides whether it is finished, suspended or held. On SIGINT/SIGTERM each thread commits the
//! step in progress, releases its lease and the daemon exits. Expired leases, and leases of
//! processes that are gone, are recovered on start and periodically, never this process's own
//! live claims. Every commit carries its claim's token; a superseded claim's commits are
//! refused by the store, so a stale thread can never move a task's state.

pub mod driver;
mod heartbeat;
mod routes;
mod settle;

pub use heartbeat::{HEARTBEAT_TTL_MS_MIN, Heartbeat};

use crossbeam_channel::{Receiver, Sender, bounded};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::store::{Backend, Commit, CommitOutcome, Error, Lease, Result, TaskRecord};
use crate::tools::durable::DemoShop;

pub use crate::clock::now_ms;

#[derive(Clone)]
pub struct Config {
    pub workers: usize,
    /// Exit when nothing is runnable.
    pub drain: bool,
    pub lease_ms: u64,
    /// How long the dispatcher waits when the queue is empty.
    pub poll_ms: u64,
    pub recover_every_ms: u64,
    /// On a database shared by hosts: how long this daemon's heartbeat vouches for its
    /// claims. A daemon silent for longer (killed, or cut off from the database) has its
    /// claims taken over; fencing refuses whatever it commits afterwards.
    pub heartbeat_ttl_ms: u64,
    /// Real time slept per simulated millisecond of model and tool latency (0: none). Lets
    /// scripted models take real time, e.g. for crash tests that kill a daemon mid-step.
    pub time_scale: f64,
    /// Called at every call-out point of every run (tests inject faults with it).
    pub hook: Option<driver::Hook>,
    /// The MCP servers of the daemon's config: one session per server, shared by its threads.
    pub mcp: Option<Arc<crate::mcp::Mcp>>,
    /// Where to export spans live (OTLP/HTTP), if anywhere.
    pub otlp: Option<crate::otlp::export::Target>,
    /// The daemon's own config: what a task's model profile and tools mean here (the
    /// endpoints, secrets and tool definitions are the daemon's, never the enqueuer's).
    pub trusted: Arc<crate::config::Config>,
    /// Settle held writes by asking their tool's `lookup_url` (see `settle`).
    pub auto_settle: bool,
    /// The demo shop, for tasks whose catalog routes a tool to it (opened on first use);
    /// `None`: a call routed there is answered `tool_unavailable`.
    pub demo: Option<Arc<DemoShop>>,
}

impl std::fmt::Debug for Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Config")
            .field("workers", &self.workers)
            .field("drain", &self.drain)
            .field("lease_ms", &self.lease_ms)
            .field("time_scale", &self.time_scale)
            .field("hook", &self.hook.is_some())
            .field("mcp", &self.mcp.is_some())
            .field("otlp", &self.otlp.as_ref().map(|t| t.url.as_str()))
            .field("auto_settle", &self.auto_settle)
            .field("demo", &self.demo.is_some())
            .finish_non_exhaustive()
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            workers: 4,
            drain: false,
            lease_ms: 60_000,
            poll_ms: 50,
            recover_every_ms: 5_000,
            heartbeat_ttl_ms: 30_000,
            time_scale: 0.0,
            hook: None,
            mcp: None,
            otlp: None,
            trusted: Arc::default(),
            auto_settle: true,
            demo: None,
        }
    }
}

/// Counters of one daemon run.
#[derive(Debug, Default)]
pub struct Stats {
    pub tasks_ended: AtomicU64,
    pub steps: AtomicU64,
    pub commits: AtomicU64,
    pub transactions: AtomicU64,
    pub abandoned: AtomicU64,
}

/// This process as a lease owner: host, pid and start time (which tell a dead process on
/// this host from a live one), and a random instance id made at start, which keeps two
/// processes apart even when hosts or containers share a name and pid numbers.
#[derive(Clone, Debug)]
pub struct Identity {
    pub host: String,
    pub pid: u32,
    pub start_ticks: u64,
    pub instance: u64,
}

impl Identity {
    pub fn current() -> Identity {
        static INSTANCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
        let pid = std::process::id();
        Identity {
            host: hostname(),
            pid,
            start_ticks: start_ticks(pid).unwrap_or(0),
            instance: *INSTANCE.get_or_init(crate::store::random_u64),
        }
    }

    pub fn owner(&self) -> String {
        format!(
            "{}:{}:{}:{:016x}",
            self.host, self.pid, self.start_ticks, self.instance
        )
    }

    pub fn lease(&self, now_ms: u64, lease_ms: u64) -> Lease {
        Lease {
            owner: self.owner(),
            host: self.host.clone(),
            pid: self.pid,
            start_ticks: self.start_ticks,
            expires_at_ms: now_ms.saturating_add(lease_ms),
            token: 0,
        }
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "localhost".into())
}

/// Field 22 of /proc/PID/stat: when the process started, in clock ticks since boot.
fn start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; fields after it follow the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// A lease whose owner is a process on this host that no longer exists can be taken over at
/// once, without waiting for it to expire. Other hosts' leases are left to expire.
pub fn owner_is_dead(lease: &Lease) -> bool {
    if lease.host != hostname() || !std::path::Path::new("/proc/self/stat").exists() {
        return false;
    }
    match start_ticks(lease.pid) {
        None => true,
        Some(t) => t != lease.start_ticks,
    }
}

/// Why a commit did not happen.
#[derive(Clone, Debug, PartialEq)]
pub enum CommitFail {
    LeaseLost,
    Failed(String),
}

struct CommitRequest {
    commit: Commit,
    reply: Sender<std::result::Result<CommitOutcome, CommitFail>>,
}

/// Handle that worker threads use to commit: through the committer thread (group commit), or
/// directly in the caller's thread, one transaction per commit (a simulation's workers).
#[derive(Clone)]
pub struct Committer {
    route: Route,
}

#[derive(Clone)]
enum Route {
    Thread(Sender<CommitRequest>),
    Direct(Arc<dyn Backend>),
}

impl Committer {
    /// Commits in the calling thread, each commit in its own transaction.
    pub fn direct(store: Arc<dyn Backend>) -> Committer {
        Committer {
            route: Route::Direct(store),
        }
    }

    pub fn commit(&self, commit: Commit) -> std::result::Result<CommitOutcome, CommitFail> {
        let tx = match &self.route {
            Route::Direct(store) => {
                let started = std::time::Instant::now();
                let result = commit_alone(store.as_ref(), &commit);
                observe_commit(started, 1);
                return result;
            }
            Route::Thread(tx) => tx,
        };
        let (reply, rx) = bounded(1);
        tx.send(CommitRequest { commit, reply })
            .map_err(|_| CommitFail::Failed("the committer has stopped".into()))?;
        rx.recv()
            .map_err(|_| CommitFail::Failed("the committer has stopped".into()))?
    }
}

/// Largest number of commits grouped into one transaction.
const GROUP_MAX: usize = 256;

fn committer_loop(store: &dyn Backend, rx: Receiver<CommitRequest>, stats: &Stats) {
    while let Some(batch) = crate::group::recv_batch(&rx, GROUP_MAX) {
        let started = std::time::Instant::now();
        let results = group_commit(store, &batch);
        observe_commit(started, batch.len());
        stats.transactions.fetch_add(1, Ordering::Relaxed);
        stats
            .commits
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        for (req, res) in batch.into_iter().zip(results) {
            let _ = req.reply.send(res);
        }
    }
}

fn group_commit(
    store: &dyn Backend,
    batch: &[CommitRequest],
) -> Vec<std::result::Result<CommitOutcome, CommitFail>> {
    let commits: Vec<&Commit> = batch.iter().map(|r| &r.commit).collect();
    match store.commit_batch(&commits) {
        Ok(results) => results.into_iter().map(refused).collect(),
        // Something failed mid-write, so nothing of that transaction landed. Each commit is
        // tried again alone, so one bad commit fails only itself, never its whole group.
        Err(_) if batch.len() > 1 => batch
            .iter()
            .map(|r| commit_alone(store, &r.commit))
            .collect(),
        Err(e) => vec![Err(CommitFail::Failed(e))],
    }
}

/// Counts a transaction of `n` commits and its latency.
fn observe_commit(started: std::time::Instant, n: usize) {
    let m = crate::metrics::global();
    m.commits.inc_by(n as u64);
    m.commit_group.observe(n as f64);
    m.commit_seconds.observe(started.elapsed().as_secs_f64());
}

fn commit_alone(store: &dyn Backend, c: &Commit) -> std::result::Result<CommitOutcome, CommitFail> {
    match store.commit_batch(&[c]) {
        Ok(mut one) => refused(one.pop().flatten()),
        Err(e) => Err(CommitFail::Failed(e)),
    }
}

/// A commit the backend refused because its claim was superseded.
fn refused(o: Option<CommitOutcome>) -> std::result::Result<CommitOutcome, CommitFail> {
    o.ok_or(CommitFail::LeaseLost)
}

/// Runs the daemon until `shutdown` is set (or, with `drain`, until nothing is runnable).
pub fn run(store: Arc<dyn Backend>, cfg: &Config, shutdown: Arc<AtomicBool>) -> Result<Arc<Stats>> {
    let workers = cfg.workers.max(1);
    let me = Identity::current();
    let stats = Arc::new(Stats::default());
    // A file on one host judges owners by their process; a shared database by heartbeats.
    let never = |_: &Lease| false;
    let is_dead: &dyn Fn(&Lease) -> bool = if store.local_owners() {
        &owner_is_dead
    } else {
        &never
    };
    let heartbeat = Arc::new(Heartbeat::start(
        Arc::clone(&store),
        me.owner(),
        cfg.heartbeat_ttl_ms.max(HEARTBEAT_TTL_MS_MIN),
    )?);
    // Live export reads committed spans from the outbox; it stops after the workers, sending
    // what is left for a bounded time.
    let exporter = match &cfg.otlp {
        Some(target) => {
            tracing::info!(url = %target.url, "exporting spans over OTLP/HTTP");
            Some(
                crate::otlp::export::Exporter::start(Arc::clone(&store), target.clone())
                    .map_err(|e| Error::Conflict(format!("cannot start the OTLP exporter: {e}")))?,
            )
        }
        None => None,
    };
    let expired = crate::operator::expire_approvals(&*store, now_ms())?;
    if !expired.is_empty() {
        tracing::info!(tasks = ?expired, "approval waits ran out");
    }
    // The claims this process's threads hold: (task, fencing token). Recovery never takes
    // them over, however late their lease renewal is.
    let live: Arc<Mutex<HashSet<(String, u64)>>> = Arc::default();
    let owner = me.owner();
    let is_live = |id: &str, l: &Lease| {
        l.owner == owner
            && live
                .lock()
                .is_ok_and(|set| set.contains(&(id.to_string(), l.token)))
    };
    let recovered = store.recover(now_ms(), is_dead, &is_live)?;
    if !recovered.is_empty() {
        crate::metrics::global()
            .takeovers
            .inc_by(recovered.len() as u64);
        tracing::warn!(count = recovered.len(), tasks = ?recovered, "lease takeover: recovered tasks whose lease expired or whose worker is gone");
    }
    let (commit_tx, commit_rx) = bounded::<CommitRequest>(workers * 2);
    // Tasks are claimed only for threads that are free, so no claimed task waits in a queue
    // with a lease that nothing renews: a claim starts running as soon as it is made.
    let (task_tx, task_rx) = bounded::<TaskRecord>(workers);
    // As large as the most tasks in flight, so a thread never blocks reporting a finished
    // task while the dispatcher is no longer listening (at shutdown).
    let (done_tx, done_rx) = bounded::<()>(workers);
    let committer = {
        let store = Arc::clone(&store);
        let stats = Arc::clone(&stats);
        std::thread::Builder::new()
            .name("committer".into())
            .spawn(move || committer_loop(store.as_ref(), commit_rx, &stats))
            .map_err(|e| Error::Conflict(format!("cannot start the committer thread: {e}")))?
    };
    let mut threads = Vec::with_capacity(workers);
    for i in 0..workers {
        let ctx = driver::Context {
            identity: me.clone(),
            store: Arc::clone(&store),
            demo: cfg.demo.clone(),
            committer: Committer {
                // One thread has no one to share a transaction with, and a server with a
                // connection per thread commits in parallel: such threads commit directly,
                // saving two thread hand-offs per commit.
                route: if workers == 1 || !store.groups_commits() {
                    Route::Direct(Arc::clone(&store))
                } else {
                    Route::Thread(commit_tx.clone())
                },
            },
            clock: Arc::new(now_ms),
            hook: cfg.hook.clone(),
            mcp: cfg.mcp.clone(),
            trusted: Arc::clone(&cfg.trusted),
            export: cfg.otlp.is_some(),
            lease_ms: cfg.lease_ms,
            heartbeat_ttl_ms: cfg.heartbeat_ttl_ms.max(HEARTBEAT_TTL_MS_MIN),
            time_scale: cfg.time_scale,
            shutdown: Arc::clone(&shutdown),
            stats: Arc::clone(&stats),
        };
        let rx = task_rx.clone();
        let done = done_tx.clone();
        let live = Arc::clone(&live);
        let t = std::thread::Builder::new()
            .name(format!("worker-{i}"))
            .spawn(move || {
                for rec in rx {
                    // A chain of tasks: each final commit may claim the next one for this
                    // thread. The dispatcher counts the chain as one task in flight.
                    let mut next = Some(rec);
                    while let Some(rec) = next.take() {
                        let claim = (rec.id.clone(), rec.lease.as_ref().map_or(0, |l| l.token));
                        if let Ok(mut set) = live.lock() {
                            set.insert(claim.clone());
                        }
                        // A panic (a bug) ends this run only: the thread goes on, and the claim
                        // leaves the live set, so the task is recovered from its last commit
                        // when its lease expires (or at once by the next daemon).
                        let id = claim.0.clone();
                        next = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(
                            || driver::run_task(&ctx, rec),
                        )) {
                            Ok(next) => next,
                            Err(_) => {
                                ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                                tracing::error!(task = %id, "the run panicked; its claim is dropped and the task will be recovered from its last commit when its lease expires");
                                None
                            }
                        };
                        if let Ok(mut set) = live.lock() {
                            set.remove(&claim);
                        }
                    }
                    if done.send(()).is_err() {
                        break;
                    }
                }
            })
            .map_err(|e| Error::Conflict(format!("cannot start worker thread {i}: {e}")))?;
        threads.push(t);
    }
    drop(commit_tx);
    drop(task_rx);
    drop(done_tx);
    // Held writes settled by their tool's lookup: a thread of its own, since a lookup may
    // take as long as its timeout; a drain also asks once more before it exits.
    let settler = Arc::new(settle::Settler::new(&owner));
    let settling = match cfg.auto_settle {
        true => {
            let (store, settler, config, stop) = (
                Arc::clone(&store),
                Arc::clone(&settler),
                Arc::clone(&cfg.trusted),
                Arc::clone(&shutdown),
            );
            let every = Duration::from_millis(cfg.recover_every_ms.min(1000));
            let (quit_tx, quit_rx) = bounded::<()>(0);
            let t = std::thread::Builder::new()
                .name("settler".into())
                .spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        settler.pass(store.as_ref(), &config);
                        // Woken early (or for good) when the dispatcher drops its end.
                        if quit_rx.recv_timeout(every)
                            != Err(crossbeam_channel::RecvTimeoutError::Timeout)
                        {
                            break;
                        }
                    }
                })
                .map_err(|e| Error::Conflict(format!("cannot start the settler thread: {e}")))?;
            Some((t, quit_tx))
        }
        false => None,
    };

    // Wake-ups when a task becomes ready (PostgreSQL's NOTIFY); polling is then the fallback.
    let wake = store.wakeups();
    let poll = Duration::from_millis(if wake.is_some() {
        cfg.poll_ms.max(1000)
    } else {
        cfg.poll_ms
    });
    let wake = wake.unwrap_or_else(crossbeam_channel::never);
    let mut in_flight = 0usize;
    // In-process intervals run on the monotonic clock; the wall clock (`now_ms`) is only for
    // expiries that other processes compare.
    let mut last_recover = std::time::Instant::now();
    let result = loop {
        if shutdown.load(Ordering::SeqCst) {
            break Ok(());
        }
        while done_rx.try_recv().is_ok() {
            in_flight -= 1;
        }
        let now = now_ms();
        if last_recover.elapsed() >= Duration::from_millis(cfg.recover_every_ms) {
            last_recover = std::time::Instant::now();
            match store.recover(now, is_dead, &is_live) {
                Ok(ids) if !ids.is_empty() => {
                    crate::metrics::global().takeovers.inc_by(ids.len() as u64);
                    tracing::warn!(tasks = ?ids, "lease takeover: recovered expired leases")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "lease recovery failed"),
            }
            match crate::operator::expire_approvals(&*store, now) {
                Ok(ids) if !ids.is_empty() => {
                    tracing::info!(tasks = ?ids, "approval waits ran out")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "expiring approval waits failed"),
            }
        }
        let free = workers.saturating_sub(in_flight);
        let claimed = if free > 0 {
            match store.claim(&me.lease(now, cfg.lease_ms), free, now) {
                Ok(c) => c,
                Err(e @ Error::Unavailable(_)) => {
                    // The database is away: keep what runs, and try again after a pause.
                    tracing::warn!(error = %e, "cannot claim tasks; trying again");
                    std::thread::sleep(poll);
                    continue;
                }
                Err(e) => break Err(e),
            }
        } else {
            Vec::new()
        };
        let got = claimed.len();
        for rec in claimed {
            tracing::debug!(task = %rec.id, "claimed");
            in_flight += 1;
            if let Ok(mut set) = live.lock() {
                set.insert((rec.id.clone(), rec.lease.as_ref().map_or(0, |l| l.token)));
            }
            if task_tx.send(rec).is_err() {
                break;
            }
        }
        if got == 0 {
            if cfg.drain && in_flight == 0 {
                // Nothing of ours in flight and nothing queued: also take over dead workers' tasks.
                // On a shared database a running task of another daemon may be one whose
                // daemon died: its heartbeat runs out and it is recovered, so a drain waits
                // for the running tasks too. A file judges dead owners at once.
                let waits = |store: &dyn Backend| -> Result<u64> {
                    let ready = store.ready_count()?;
                    if ready > 0 || store.local_owners() {
                        return Ok(ready);
                    }
                    store.running_count()
                };
                match store.recover(now_ms(), is_dead, &is_live).and_then(|ids| {
                    if !ids.is_empty() {
                        crate::metrics::global().takeovers.inc_by(ids.len() as u64);
                        tracing::warn!(tasks = ?ids, "lease takeover: recovered expired leases");
                    }
                    Ok((ids.is_empty(), waits(store.as_ref())?))
                }) {
                    // Held writes that a lookup settles now (here or on the settler's
                    // thread) run in this drain too.
                    Ok((true, 0)) => {
                        if cfg.auto_settle {
                            settler.pass(store.as_ref(), &cfg.trusted);
                        }
                        if store.ready_count().is_ok_and(|n| n == 0) {
                            break Ok(());
                        }
                    }
                    Ok((true, _)) => {}
                    Ok(_) => continue,
                    Err(e @ Error::Unavailable(_)) => {
                        tracing::warn!(error = %e, "cannot check for work; trying again");
                    }
                    Err(e) => break Err(e),
                }
            }
            crossbeam_channel::select! {
                recv(done_rx) -> r => if r.is_ok() { in_flight -= 1 },
                recv(wake) -> _ => {}
                default(poll) => {}
            }
        }
    };
    drop(task_tx);
    if let Some((t, quit)) = settling {
        drop(quit);
        let _ = t.join();
    }
    for t in threads {
        let _ = t.join();
    }
    let _ = committer.join();
    drop(exporter);
    drop(heartbeat);
    if let Err(e) = store.sign_off(&me.owner()) {
        tracing::warn!(error = %e, "could not remove this daemon's heartbeat");
    }
    result.map(|()| stats)
}
