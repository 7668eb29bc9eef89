//! The daemon: an executor (tokio, one thread per core) whose tasks each drive one claimed task's
//! durable machine, up to `max_in_flight` at once, with one committer thread that groups the
//! commits of all runs into shared write transactions (group commit: each step stays atomic,
//! many steps share an fsync). A run waiting on its model or a tool holds no thread.
//!
//! Life of a task here: the dispatcher claims it with a lease and a fencing token when there is
//! room in flight and starts it on the executor, where its `Io` drives the machine; before a
//! write is sent its intent is committed; at every step end the state, spans,
//! reply, call-key record and lease renewal are committed together; at the end the stop reason
//! decides whether it is finished, suspended or held. On SIGINT/SIGTERM each run commits the
//! step in progress, releases its lease and the daemon exits. Expired leases, and leases of
//! processes that are gone, are recovered on start and periodically, never this process's own
//! live claims. Every commit carries its claim's token; a superseded claim's commits are
//! refused by the store, so a stale run can never move a task's state.

mod callbacks;
pub mod catalogs;
mod committer;
mod dispatch;
mod drive;
pub mod driver;
mod heartbeat;
mod identity;
pub mod machine;
pub mod rate;
mod routes;
mod settle;

pub use committer::{CommitFail, Committer};
pub use heartbeat::{HEARTBEAT_TTL_MS_MIN, Heartbeat};
pub use identity::{Identity, owner_is_dead};

use crossbeam_channel::{Sender, bounded};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::store::{Backend, Error, Result};
use crate::tools::durable::DemoShop;

pub use crate::clock::now_ms;

#[derive(Clone)]
pub struct Config {
    /// The most runs in flight at once (each a task of the executor, not a thread).
    pub max_in_flight: usize,
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
    /// The MCP servers of the daemon's config: one session per server, shared by its runs.
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
            .field("max_in_flight", &self.max_in_flight)
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
            max_in_flight: MAX_IN_FLIGHT,
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

/// How many runs a daemon holds in flight at most, by default: agents spend nearly all their
/// time waiting on a model, and a waiting run costs its state, not a thread.
pub const MAX_IN_FLIGHT: usize = 10_000;

/// Counters of one daemon run.
#[derive(Debug, Default)]
pub struct Stats {
    pub tasks_ended: AtomicU64,
    pub steps: AtomicU64,
    pub commits: AtomicU64,
    pub transactions: AtomicU64,
    pub abandoned: AtomicU64,
}

/// What this daemon's claims apply: the config's concurrency limits, and passing over the
/// tasks of a profile whose API key its environment lacks (they stay queued, in their place,
/// for a daemon that has it).
fn claim_rules(cfg: &Config) -> crate::store::flow::ConcurrencyLimits {
    let passed_over = cfg
        .trusted
        .missing_keys()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    cfg.trusted.concurrency.clone().passing_over(passed_over)
}

/// Runs the daemon until `shutdown` is set (or, with `drain`, until nothing is runnable):
/// the heartbeat, the exporter, recovery of what dead claims left, the committer, the worker
/// threads and the settler start here; the dispatcher's loop (`dispatch`) runs in this thread
/// and everything stops in the reverse order.
pub fn run(store: Arc<dyn Backend>, cfg: &Config, shutdown: Arc<AtomicBool>) -> Result<Arc<Stats>> {
    store.set_limits(claim_rules(cfg));
    let me = Identity::current();
    let stats = Arc::new(Stats::default());
    let heartbeat = Arc::new(Heartbeat::start(
        Arc::clone(&store),
        me.owner(),
        cfg.heartbeat_ttl_ms.max(HEARTBEAT_TTL_MS_MIN),
    )?);
    let exporter = start_exporter(&store, cfg)?;
    let claims = dispatch::Claims::new(&*store, me.owner());
    claims.recover_at_start(&*store)?;
    let executor = executor()?;
    // Proxies and TLS roots read now, not by the first call: a rate-limit reservation is
    // followed by its request at once, so the provider sees the window the daemon keeps.
    crate::net::h1::prepare();
    // Each run has at most one commit waiting, so the queue is bounded by the runs in flight;
    // unbounded, it never makes a run wait and takes memory only for the commits it holds.
    let (commit_tx, commit_rx) = crossbeam_channel::unbounded::<committer::CommitRequest>();
    // A file gains from sharing transactions; a server with a connection per commit commits
    // in parallel (and groups the flushes itself).
    let (route, committer) = if store.groups_commits() {
        let (store, stats) = (Arc::clone(&store), Arc::clone(&stats));
        let t = std::thread::Builder::new()
            .name("committer".into())
            .spawn(move || committer::committer_loop(store.as_ref(), commit_rx, &stats))
            .map_err(|e| Error::Conflict(format!("cannot start the committer thread: {e}")))?;
        (committer::Route::Thread(commit_tx), Some(t))
    } else {
        drop((commit_tx, commit_rx));
        (committer::Route::Direct(Arc::clone(&store)), None)
    };
    let ctx = Arc::new(context(
        &store,
        cfg,
        &me,
        Committer { route },
        &shutdown,
        &stats,
    ));
    // One message per chain of runs that ended: never more than were started.
    let (done_tx, done_rx) = crossbeam_channel::unbounded::<()>();
    let spawner = dispatch::Spawner {
        executor: executor.handle().clone(),
        ctx,
        done: done_tx,
        live: claims.live(),
    };
    let sending = start_sender(&store, cfg, &me)?;
    let settler = Arc::new(settle::Settler::new(&me.owner()));
    let settling = match cfg.auto_settle {
        true => Some(start_settler(&store, cfg, &settler, &shutdown)?),
        false => None,
    };
    let result = dispatch::Dispatch::new(&store, cfg, &me, &claims, &settler, spawner, done_rx)
        .run(&shutdown);
    if let Some((t, quit)) = settling {
        drop(quit);
        let _ = t.join();
    }
    // Every run has ended: the executor holds nothing, and the committer's channel closes.
    executor.shutdown_timeout(Duration::from_secs(1));
    if let Some(t) = committer {
        let _ = t.join();
    }
    // After the last commit: the callbacks of the tasks this run settled go out too.
    if let Some((t, stop)) = sending {
        stop.store(true, Ordering::SeqCst);
        let _ = t.join();
    }
    drop(exporter);
    drop(heartbeat);
    if let Err(e) = store.sign_off(&me.owner()) {
        tracing::warn!(error = %e, "could not remove this daemon's heartbeat");
    }
    result.map(|()| stats)
}

/// The executor: a runtime of about one thread per core, on which every run in flight is a
/// task (a waiting run costs its state and a timer, not a thread).
fn executor() -> Result<tokio::runtime::Runtime> {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(cores.clamp(1, EXECUTOR_THREADS_MAX))
        .max_blocking_threads(BLOCKING_THREADS_MAX)
        .thread_name("executor")
        .enable_all()
        .build()
        .map_err(|e| Error::Conflict(format!("cannot start the executor: {e}")))
}

/// The most threads the executor runs tasks on, whatever the cores.
const EXECUTOR_THREADS_MAX: usize = 16;

/// The most threads the executor lends to blocking work at once (a database server's client,
/// MCP sessions, the demo shop); more waits for one.
const BLOCKING_THREADS_MAX: usize = 64;

/// Runs `f`, which blocks (a database server's client, an MCP session, the demo shop), without
/// stalling the executor: on one of its threads, the thread's other tasks move to another
/// first. Outside the executor (a test's run on a runtime of one thread), in place.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// Live export, when configured: it reads committed spans from the outbox, and stops after
/// the workers (when dropped), sending what is left for a bounded time.
fn start_exporter(
    store: &Arc<dyn Backend>,
    cfg: &Config,
) -> Result<Option<crate::otlp::export::Exporter>> {
    let Some(target) = &cfg.otlp else {
        return Ok(None);
    };
    tracing::info!(url = %target.url, "exporting spans over OTLP/HTTP");
    crate::otlp::export::Exporter::start(Arc::clone(store), target.clone())
        .map(Some)
        .map_err(|e| Error::Conflict(format!("cannot start the OTLP exporter: {e}")))
}

/// What one worker thread runs its tasks with.
fn context(
    store: &Arc<dyn Backend>,
    cfg: &Config,
    me: &Identity,
    committer: Committer,
    shutdown: &Arc<AtomicBool>,
    stats: &Arc<Stats>,
) -> driver::Context {
    driver::Context {
        identity: me.clone(),
        store: Arc::clone(store),
        demo: cfg.demo.clone(),
        committer,
        clock: Arc::new(now_ms),
        hook: cfg.hook.clone(),
        mcp: cfg.mcp.clone(),
        trusted: Arc::clone(&cfg.trusted),
        export: cfg.otlp.is_some(),
        lease_ms: cfg.lease_ms,
        heartbeat_ttl_ms: cfg.heartbeat_ttl_ms.max(HEARTBEAT_TTL_MS_MIN),
        time_scale: cfg.time_scale,
        shutdown: Arc::clone(shutdown),
        stopping: Arc::default(),
        stats: Arc::clone(stats),
        scripted_rate: None,
        catalogs: Default::default(),
    }
}

/// The callback sender, when the config has `[callbacks]`: a thread of its own, stopped (after
/// a last pass) by setting the returned flag.
fn start_sender(
    store: &Arc<dyn Backend>,
    cfg: &Config,
    me: &Identity,
) -> Result<Option<(std::thread::JoinHandle<()>, Arc<AtomicBool>)>> {
    let Some(settings) = cfg.trusted.callbacks.clone() else {
        // Callbacks wait in the database for a daemon whose config can send them.
        if let Ok(n @ 1..) = store.callbacks_pending() {
            tracing::warn!(
                pending = n,
                "callbacks are waiting to be sent, and this daemon's config has no [callbacks] section: a daemon started with one sends them"
            );
        }
        return Ok(None);
    };
    let key = settings.key().map_err(Error::Invalid)?;
    let sender = callbacks::Sender::new(Arc::clone(store), settings, key, me.owner());
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let t = std::thread::Builder::new()
        .name("callbacks".into())
        .spawn(move || sender.run(&flag))
        .map_err(|e| Error::Conflict(format!("cannot start the callback sender: {e}")))?;
    Ok(Some((t, stop)))
}

/// Held writes settled by their tool's lookup: a thread of its own, since a lookup may take
/// as long as its timeout. Dropping the returned sender wakes it to stop.
fn start_settler(
    store: &Arc<dyn Backend>,
    cfg: &Config,
    settler: &Arc<settle::Settler>,
    shutdown: &Arc<AtomicBool>,
) -> Result<(std::thread::JoinHandle<()>, Sender<()>)> {
    let (store, settler, config, stop) = (
        Arc::clone(store),
        Arc::clone(settler),
        Arc::clone(&cfg.trusted),
        Arc::clone(shutdown),
    );
    let every = Duration::from_millis(cfg.recover_every_ms.min(1000));
    let (quit_tx, quit_rx) = bounded::<()>(0);
    let t = std::thread::Builder::new()
        .name("settler".into())
        .spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                settler.pass(store.as_ref(), &config);
                // Woken early (or for good) when the dispatcher drops its end.
                if quit_rx.recv_timeout(every) != Err(crossbeam_channel::RecvTimeoutError::Timeout)
                {
                    break;
                }
            }
        })
        .map_err(|e| Error::Conflict(format!("cannot start the settler thread: {e}")))?;
    Ok((t, quit_tx))
}
