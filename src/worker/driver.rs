//! The durable driver: runs one claimed task's kernel session against its model and the durable
//! store, committing at each boundary the kernel reports.
//!
//! - Every commit carries the claim's fencing token; the store applies it only while that claim
//!   is the task's current one.
//! - Before a write is sent, its intent (call key, tool, args, digest) and the step's model reply
//!   are committed.
//! - At each step end, the state, the spans changed, the reply, the call-key result and the
//!   lease renewal are committed in one transaction.
//! - A step interrupted by a crash is re-run from the last committed state; if its reply was
//!   recorded with an intent, the same reply is folded in again instead of asking the model, so
//!   the step proposes the same call under the same key. A write whose intent has no result is
//!   re-sent only if the tool is idempotent, whether or not it was a held call being resumed;
//!   otherwise its outcome is unknown and the task is held for reconcile.
//! - A read of the database that fails is never taken for "nothing recorded": the run stops
//!   here (nothing is sent) and the task is recovered later.
//! - A write leaves only through a [`Proof`]: its route asks it as the last step before the
//!   request's first byte (after any definition check or connection set-up), and it proves
//!   the claim current and held for at least [`SEND_MARGIN_MS`] more (renewed if it would run
//!   out sooner), at most [`PROOF_FRESH_MS`] (and half that margin) before the bytes leave (a
//!   proof older than that, by the run's clock and by the monotonic clock, is taken again).
//!   What no process can bound is a pause between that last look at the clock and the system
//!   call that writes: the margin is what covers it. A run whose claim was
//!   taken over while it waited (a paused process) stops there and sends nothing; a claim
//!   that cannot be proved stops the run, and the write's intent, without a result, holds it
//!   for reconcile.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use super::machine::{Ended, Machine};
use super::routes::Routed;
use super::{CommitFail, Committer, Stats};

use crate::mcp::McpTools;
use crate::model::rate::RateLimit;
use crate::store::{Backend, TaskRecord};
use crate::tools::durable::DemoShop;
use crate::tools::http::HttpTools;

/// Where a driver stops to let a simulation run other work first, or crash it: before a model
/// call, as the call leaves (its rate limit, if any, granted it), before a tool call is sent,
/// after its answer came back, and before each commit. A
/// hook that returns false crashes the worker there: it abandons the task at once, as a killed
/// process would, leaving only what it had committed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    Model,
    ModelCall,
    /// A tool call goes to its route (a write's intent is committed).
    Send,
    /// A write's claim was just proved; the request's first byte is next.
    Proved,
    Sent,
    Commit,
}

pub type Hook = Arc<dyn Fn(Point) -> bool + Send + Sync>;
/// Wall-clock milliseconds since the epoch (simulated in a simulation).
pub type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// How long, at the least, a claim must be certain to stay this run's when a write is sent
/// (or a third of the heartbeat TTL when that is shorter: a healthy heartbeat thread keeps
/// two thirds of it left): a takeover needs the lease or the heartbeat to run out first, so
/// only a pause of longer than this between the check and the request leaving the process
/// can let a new owner send the same write too.
pub const SEND_MARGIN_MS: u64 = 5_000;

/// How old a proof of the claim may be when a write's first byte leaves (at most; and at most
/// half the margin the proof found, when the heartbeat makes that shorter): a process paused
/// after its proof for longer than this proves again (and finds its claim gone) rather than
/// send under a claim that may have been taken over.
pub const PROOF_FRESH_MS: u64 = SEND_MARGIN_MS / 5;

/// How many times a proof is taken for one send before the send is given up (each pause
/// between the proof and the send makes it stale).
const PROOFS_MAX: u32 = 3;

pub struct Context {
    pub clock: Clock,
    /// None in the daemon.
    pub hook: Option<Hook>,
    /// The daemon's MCP sessions, if its config names servers.
    pub mcp: Option<Arc<crate::mcp::Mcp>>,
    /// The daemon's config: a task's model profile and tools are resolved in it.
    pub trusted: Arc<crate::config::Config>,
    /// Spans are exported live: each commit queues the spans it ends in the outbox.
    pub export: bool,
    /// This process as a lease owner, for the claim made with a task's final commit.
    pub identity: super::Identity,
    pub store: Arc<dyn Backend>,
    /// The demo shop, for tasks whose catalog routes a tool to it; `None`: this daemon has none.
    pub demo: Option<Arc<DemoShop>>,
    pub committer: Committer,
    pub lease_ms: u64,
    /// How long this daemon's heartbeat vouches for its claims (a shared backend).
    pub heartbeat_ttl_ms: u64,
    pub time_scale: f64,
    pub shutdown: Arc<AtomicBool>,
    /// Woken when the daemon begins stopping (after `shutdown` is set): runs waiting on their
    /// model drop the wait and hand their task back.
    pub stopping: Arc<tokio::sync::Notify>,
    pub stats: Arc<Stats>,
    /// A shared rate limit for the scripted models (which have no profile to name one): the
    /// seeded simulation runs its tasks under one. `None` in the daemon.
    pub scripted_rate: Option<(String, RateLimit)>,
    /// The resolved catalogs of the runs in flight, shared by the runs of one catalog.
    pub catalogs: super::catalogs::Catalogs,
}

/// Runs the task until it ends, suspends, is released at shutdown, or its claim is superseded,
/// waiting in this thread (a test's worker; the daemon's executor awaits [`run`]). Returns the
/// next task, claimed for this run in the transaction of the final commit.
pub fn run_task(ctx: &Context, rec: TaskRecord) -> Option<TaskRecord> {
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run(ctx, rec)),
        Err(e) => {
            tracing::error!(task = %rec.id, error = %e, "cannot start a runtime for the run");
            None
        }
    }
}

/// [`run_task`] as the executor's task: every log line of the run (the HTTP adapters' retries
/// too) carries the task id.
pub async fn run(ctx: &Context, rec: TaskRecord) -> Option<TaskRecord> {
    use tracing::Instrument;
    let id = rec.id.clone();
    let span = tracing::info_span!("task", task = %id, run = rec.runs);
    match drive(ctx, rec).instrument(span).await {
        Ok((Ended::Stopped(stop), next)) => {
            ctx.stats.tasks_ended.fetch_add(1, Ordering::Relaxed);
            crate::metrics::global()
                .tasks_ended
                .with_label_values(&[stop.as_str()])
                .inc();
            tracing::info!(task = %id, stop = %stop, "task ended");
            return next;
        }
        Ok((Ended::Released, _)) => tracing::info!(task = %id, "task released at shutdown"),
        Ok((Ended::Yielded, _)) => {}
        Err(CommitFail::LeaseLost) => {
            ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(task = %id, "claim superseded (lease taken over); abandoning the task here");
        }
        Err(CommitFail::Failed(e)) => {
            ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
            tracing::error!(task = %id, error = %e, "the run stopped (a commit or a read of the database failed); the task will be recovered when its lease expires");
        }
    }
    None
}

/// Counts a model call and logs its failure, with the task and step.
pub(super) fn observe_model(task: &str, step: u32, model: &str, reply: &crate::kernel::ModelReply) {
    let m = crate::metrics::global();
    let outcome = match &reply.outcome {
        Ok(_) => "ok",
        Err(crate::kernel::ModelError::Timeout) => "timeout",
        Err(_) => "error",
    };
    m.model_calls.with_label_values(&[model, outcome]).inc();
    m.model_seconds
        .with_label_values(&[model])
        .observe(reply.latency_ms as f64 / 1000.0);
    if let Err(e) = &reply.outcome {
        tracing::warn!(task, step, model, error = ?e, "model call failed");
    }
}

/// The proof a write needs to leave (see the module's rules): the route asks it right before
/// the request's first byte. It owns what it needs (a route may keep it while a connection is
/// made), and keeps why it refused, which stops the run.
pub struct Proof {
    clock: Clock,
    hook: Option<Hook>,
    store: Arc<dyn Backend>,
    owner: String,
    id: String,
    token: u64,
    lease_ms: u64,
    heartbeat_ttl_ms: u64,
    /// When the claim was last proved: by the run's clock, and by the monotonic clock.
    proved: std::sync::Mutex<Option<(u64, std::time::Instant)>>,
    /// Why the proof was refused, if it was: the run stops with it.
    refused: std::sync::Mutex<Option<CommitFail>>,
}

impl Proof {
    pub fn new(ctx: &Context, id: &str, token: u64) -> Proof {
        Proof {
            clock: Arc::clone(&ctx.clock),
            hook: ctx.hook.clone(),
            store: Arc::clone(&ctx.store),
            owner: ctx.identity.owner(),
            id: id.to_string(),
            token,
            lease_ms: ctx.lease_ms,
            heartbeat_ttl_ms: ctx.heartbeat_ttl_ms,
            proved: std::sync::Mutex::new(None),
            refused: std::sync::Mutex::new(None),
        }
    }

    /// Why the proof was refused, if it was (taken: asked once, after the call).
    pub fn refusal(&self) -> Option<CommitFail> {
        self.refused.lock().ok().and_then(|mut r| r.take())
    }

    /// The margin a proof asks for: [`SEND_MARGIN_MS`], or a third of the heartbeat TTL when
    /// that is shorter (a healthy heartbeat keeps two thirds of it left).
    fn margin_ms(&self) -> u64 {
        SEND_MARGIN_MS.min(self.heartbeat_ttl_ms / 3)
    }

    /// Whether the last proof is recent enough for a byte to leave now: younger than
    /// [`PROOF_FRESH_MS`] and half the margin, by the run's clock and the monotonic one.
    fn fresh(&self) -> bool {
        let Ok(proved) = self.proved.lock() else {
            return false;
        };
        let fresh_ms = PROOF_FRESH_MS.min(self.margin_ms() / 2);
        proved.is_some_and(|(at, mono)| {
            (self.clock)().saturating_sub(at) < fresh_ms
                && mono.elapsed() < std::time::Duration::from_millis(fresh_ms)
        })
    }

    /// Proves the claim current and held for [`SEND_MARGIN_MS`] (or a third of the heartbeat
    /// TTL) more: renews the lease and the heartbeat when less is left. `LeaseLost` when the
    /// claim was taken over, or is still short after renewing.
    fn prove(&self) -> Result<(), CommitFail> {
        let id = &self.id;
        let failed = |e: crate::store::Error| {
            CommitFail::Failed(format!("cannot check the claim of task {id}: {e}"))
        };
        let margin = self.margin_ms();
        for renewed in [false, true] {
            let now = (self.clock)();
            match self.store.claim_left(id, self.token, now).map_err(failed)? {
                None => return Err(CommitFail::LeaseLost),
                Some(left) if left >= margin => {
                    if let Ok(mut p) = self.proved.lock() {
                        *p = Some((now, std::time::Instant::now()));
                    }
                    return Ok(());
                }
                Some(_) if renewed => break,
                Some(left) => {
                    tracing::info!(task = %id, left_ms = left, "the claim runs out soon; renewing it before a write");
                    if !self
                        .store
                        .renew_claim(id, self.token, now, self.lease_ms)
                        .map_err(failed)?
                    {
                        return Err(CommitFail::LeaseLost);
                    }
                    self.store
                        .heartbeat(&self.owner, now, now.saturating_add(self.heartbeat_ttl_ms))
                        .map_err(failed)?;
                }
            }
        }
        Err(CommitFail::LeaseLost)
    }

    /// A proof fresh enough for the first byte to leave now, taken again while a pause made
    /// the last one stale (the simulation may stop here, right after a proof).
    fn check(&self) -> Result<(), CommitFail> {
        for _ in 0..PROOFS_MAX {
            if self.fresh() {
                return Ok(());
            }
            self.prove()?;
            if let Some(hook) = &self.hook
                && !hook(Point::Proved)
            {
                return Err(CommitFail::Failed("crashed at Proved".into()));
            }
        }
        Err(CommitFail::Failed(format!(
            "the claim of task {} could not be proved within {PROOF_FRESH_MS} ms of a send, {PROOFS_MAX} times",
            self.id
        )))
    }
}

impl crate::kernel::io::SendGate for Proof {
    fn ready(&self) -> Result<(), String> {
        match self.check() {
            Ok(()) => Ok(()),
            Err(e) => {
                let why = match &e {
                    CommitFail::LeaseLost => {
                        "this run's claim of the task was taken over; nothing was sent".to_string()
                    }
                    CommitFail::Failed(m) => format!("{m}; nothing was sent"),
                };
                tracing::warn!(task = %self.id, reason = %why, "the write is not sent");
                if let Ok(mut r) = self.refused.lock() {
                    *r = Some(e);
                }
                Err(why)
            }
        }
    }
}

/// Passes `point`, or crashes here if the hook says so.
pub(super) fn pass(ctx: &Context, point: Point) -> Result<(), CommitFail> {
    match &ctx.hook {
        Some(hook) if !hook(point) => Err(CommitFail::Failed(format!("crashed at {point:?}"))),
        _ => Ok(()),
    }
}

/// One run of `rec`: the durable step's machine, and the I/O it asks for.
async fn drive(ctx: &Context, rec: TaskRecord) -> Result<(Ended, Option<TaskRecord>), CommitFail> {
    let token = rec.lease.as_ref().map_or(0, |l| l.token);
    // What the task's tools and model mean here is the daemon's config's to say.
    let resolved = ctx.catalogs.resolve(&ctx.trusted, rec.catalog.as_ref());
    let crate::config::Resolved {
        catalog,
        unavailable,
    } = &*resolved;
    for (tool, why) in unavailable {
        tracing::warn!(task = %rec.id, tool = %tool, reason = %why, "tool unavailable to this worker");
    }
    let (model, rate) = task_model(ctx, &rec, catalog);
    let input = model.input();
    // The record goes to the machine; the routes keep copies of the little they need.
    let (scope, latency_ms) = (rec.store_scope.clone(), rec.tool_latency_ms.clone());
    let model_label = rec.model.label().to_string();
    let routes = Routed {
        unavailable,
        demo: super::routes::DemoRoute {
            shop: ctx.demo.as_deref(),
            scope: &scope,
            latency_ms: &latency_ms,
        },
        http: HttpTools { catalog },
        mcp: McpTools {
            mcp: ctx.mcp.as_deref(),
            catalog,
        },
        catalog,
    };
    let mut io = super::drive::Io {
        ctx,
        token,
        model,
        routes,
        capacity: super::rate::Capacity::new(rate),
        model_label,
        next: None,
    };
    // Boxed, as every large part of a run waiting on its model: a waiting task holds only
    // what it needs (the executor's task holds the future).
    let mut machine = Box::new(Machine::new(rec, ctx.store.db_id(), catalog, input));
    let ended = io.run(&mut machine).await?;
    Ok((ended, io.next.take()))
}

/// The task's model as the daemon's config makes it (with its profile's shared rate limit),
/// or a stand-in that fails every call with the reason it is unavailable.
fn task_model(
    ctx: &Context,
    rec: &TaskRecord,
    catalog: &crate::kernel::Catalog,
) -> (Box<dyn crate::model::Model>, Option<(String, RateLimit)>) {
    match ctx.trusted.model_for(&rec.model) {
        Ok(m) => {
            let rate = match m.http() {
                Some(p) => p.rate_limit.clone(),
                None => ctx.scripted_rate.clone(),
            };
            (m.build(catalog, rec.instructions.as_deref()), rate)
        }
        Err(why) => {
            tracing::error!(task = %rec.id, reason = %why, "model unavailable to this worker");
            (Box::new(crate::model::Unavailable(why)), None)
        }
    }
}

/// Waits `latency_ms * scale` of real time (at most a second per call), holding no thread.
pub(super) async fn pause(scale: f64, latency_ms: u64) {
    if scale > 0.0 {
        let ms = (latency_ms as f64 * scale).min(1000.0);
        tokio::time::sleep(std::time::Duration::from_micros((ms * 1000.0) as u64)).await;
    }
}
