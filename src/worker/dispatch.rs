//! The dispatcher: the daemon's main loop, which claims tasks and starts each as a task of the
//! executor ([`Spawner`]).
//!
//! Each turn of the loop meets one of a closed set of events (`Turn`): shutdown asked; tasks
//! claimed for the room left under the most runs in flight; nothing to claim, so (when
//! draining) a check whether anything is left, else a wait for a run to finish, a wake-up
//! (PostgreSQL's `NOTIFY`) or the poll interval. Periodically it recovers expired claims and ends approval waits that ran
//! out. The claims this process's runs hold (`Claims`) are never taken over by its own
//! recovery, however late their lease renewal is.

use crossbeam_channel::{Receiver, Sender};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Config, Identity, driver, now_ms, owner_is_dead, settle::Settler};
use crate::store::{Backend, Error, Lease, Result, TaskRecord};

/// The claims of this process's runs, (task, fencing token), and how its recovery judges
/// other owners: by their process on a file of one host, by heartbeats on a shared database.
pub(super) struct Claims {
    live: Arc<Mutex<HashSet<(String, u64)>>>,
    owner: String,
    local_owners: bool,
}

impl Claims {
    pub fn new(store: &dyn Backend, owner: String) -> Claims {
        Claims {
            live: Arc::default(),
            owner,
            local_owners: store.local_owners(),
        }
    }

    /// The set, for a run to add its chained claims to.
    pub fn live(&self) -> Arc<Mutex<HashSet<(String, u64)>>> {
        Arc::clone(&self.live)
    }

    fn is_live(&self, id: &str, l: &Lease) -> bool {
        l.owner == self.owner
            && self
                .live
                .lock()
                .is_ok_and(|set| set.contains(&(id.to_string(), l.token)))
    }

    /// Takes over the tasks whose claim expired or whose owner is gone.
    fn recover(&self, store: &dyn Backend, now: u64) -> Result<Vec<String>> {
        let local = self.local_owners;
        let is_dead = |l: &Lease| local && owner_is_dead(l);
        let recovered = store.recover(now, &is_dead, &|id, l| self.is_live(id, l))?;
        if !recovered.is_empty() {
            crate::metrics::global()
                .takeovers
                .inc_by(recovered.len() as u64);
            tracing::warn!(count = recovered.len(), tasks = ?recovered, "lease takeover: recovered tasks whose lease expired or whose worker is gone");
        }
        Ok(recovered)
    }

    /// At start: approval waits that ran out, and what dead claims left.
    pub fn recover_at_start(&self, store: &dyn Backend) -> Result<()> {
        let expired = crate::operator::expire_approvals(store, now_ms())?;
        if !expired.is_empty() {
            tracing::info!(tasks = ?expired, "approval waits ran out");
        }
        self.recover(store, now_ms()).map(|_| ())
    }
}

/// How the dispatcher starts a claimed task: as a task of the executor, which runs it and the
/// chain of tasks each final commit claims for it, then reports the chain done.
pub(super) struct Spawner {
    pub executor: tokio::runtime::Handle,
    pub ctx: Arc<driver::Context>,
    /// One message per chain that ended (as many as were spawned: the sender never blocks).
    pub done: Sender<()>,
    pub live: Arc<Mutex<HashSet<(String, u64)>>>,
}

impl Spawner {
    fn spawn(&self, rec: TaskRecord) {
        let (ctx, live) = (Arc::clone(&self.ctx), Arc::clone(&self.live));
        let done = Done(self.done.clone());
        self.executor.spawn(async move {
            // Reported when the chain ends, however it ends.
            let _done = done;
            // Boxed: the chain's future holds a pointer while its run waits, not a record.
            let mut next = Some(Box::new(rec));
            while let Some(rec) = next.take() {
                let claim = Claim::new(&live, &rec);
                // A panic (a bug) ends this run only: the claim leaves the live set, so the task
                // is recovered from its last commit when its lease expires (or at once by the
                // next daemon).
                let id = rec.id.clone();
                next = CatchUnwind(start(&ctx, *rec)).await.map(|n| n.map(Box::new)).unwrap_or_else(|_| {
                    ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(task = %id, "the run panicked; its claim is dropped and the task will be recovered from its last commit when its lease expires");
                    None
                });
                drop(claim);
            }
        });
    }
}

type Run<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Option<TaskRecord>> + Send + 'a>>;

/// One run, boxed: a function, not inline in the chain's future, so the chain's future holds a
/// pointer to the run's, not the run's itself (rustc keeps a future made inside an async
/// block in its state, and every waiting task would weigh twice).
fn start(ctx: &driver::Context, rec: TaskRecord) -> Run<'_> {
    Box::pin(driver::run(ctx, rec))
}

/// A run whose panic ends it with `Err`, as a task's panic would end its task, without a task
/// of its own.
struct CatchUnwind<'a>(Run<'a>);

impl std::future::Future for CatchUnwind<'_> {
    type Output = std::thread::Result<Option<TaskRecord>>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let run = &mut self.0;
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run.as_mut().poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(next)) => std::task::Poll::Ready(Ok(next)),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}

/// Reports a chain's end to the dispatcher when dropped.
struct Done(Sender<()>);

impl Drop for Done {
    fn drop(&mut self) {
        let _ = self.0.send(());
    }
}

/// A run's claim in the live set, taken out when dropped.
struct Claim<'a> {
    live: &'a Mutex<HashSet<(String, u64)>>,
    claim: (String, u64),
}

impl<'a> Claim<'a> {
    fn new(live: &'a Mutex<HashSet<(String, u64)>>, rec: &TaskRecord) -> Claim<'a> {
        let claim = (rec.id.clone(), rec.lease.as_ref().map_or(0, |l| l.token));
        if let Ok(mut set) = live.lock() {
            set.insert(claim.clone());
        }
        Claim { live, claim }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if let Ok(mut set) = self.live.lock() {
            set.remove(&self.claim);
        }
    }
}

/// What led the dispatcher to look for tasks to claim.
#[derive(Clone, Copy)]
enum Cause {
    /// The daemon's start, or the claims before ran out of room (it claims again at once).
    Start,
    /// An enqueue or a decision made through this daemon's own store.
    Enqueued,
    /// Another process's write, seen by a watch or a notification.
    Watch,
    RunEnded,
    /// A delayed task's start time, a schedule's tick or recovery came due.
    Due,
    /// The fallback poll: a wake-up, if there was one, was missed.
    Poll,
}

impl Cause {
    fn label(self) -> &'static str {
        match self {
            Cause::Start => "start",
            Cause::Enqueued => "enqueued",
            Cause::Watch => "watch",
            Cause::RunEnded => "run_ended",
            Cause::Due => "due",
            Cause::Poll => "poll",
        }
    }
}

/// What one turn of the dispatcher's loop met.
enum Turn {
    Shutdown,
    /// This many tasks were claimed and started.
    Claimed(usize),
    /// The database is away for now: the claim is tried again after a pause.
    Unavailable,
}

/// What a drain found when nothing was claimed.
enum Drain {
    /// Nothing is left to run: the daemon exits.
    Done,
    /// Something was recovered: claim again at once.
    Again,
    /// Tasks of others run or wait: wait as when idle.
    Wait,
}

pub(super) struct Dispatch<'a> {
    store: &'a Arc<dyn Backend>,
    cfg: &'a Config,
    me: &'a Identity,
    claims: &'a Claims,
    settler: &'a Settler,
    max_in_flight: usize,
    spawner: Spawner,
    done_rx: Receiver<()>,
    /// Another process's write (PostgreSQL's NOTIFY, a watch on the redb file).
    wake: Receiver<()>,
    /// This process's own enqueues and decisions (its socket, API and console), directly.
    woken: Receiver<()>,
    /// What led to the claims being made now, for `tether_tasks_claimed_total`.
    cause: Cause,
    poll: Duration,
    in_flight: usize,
    // In-process intervals run on the monotonic clock; the wall clock (`now_ms`) is only for
    // expiries that other processes compare.
    last_recover: Instant,
    last_schedules: Instant,
    /// Whether the last pass over the schedules found an active one: only then does an idle
    /// daemon wake for them between wake-ups.
    schedules_active: bool,
}

/// How often a daemon fires the schedules' due ticks.
const SCHEDULES_EVERY: Duration = Duration::from_secs(1);

impl<'a> Dispatch<'a> {
    pub fn new(
        store: &'a Arc<dyn Backend>,
        cfg: &'a Config,
        me: &'a Identity,
        claims: &'a Claims,
        settler: &'a Settler,
        spawner: Spawner,
        done_rx: Receiver<()>,
    ) -> Dispatch<'a> {
        // Wake-ups when a task may have become ready (PostgreSQL's NOTIFY, a watch on the
        // redb file); polling is the fallback.
        let wake = store.wakeups();
        let poll = Duration::from_millis(if wake.is_some() {
            cfg.poll_ms.max(1000)
        } else {
            cfg.poll_ms
        });
        Dispatch {
            store,
            cfg,
            me,
            claims,
            settler,
            max_in_flight: cfg.max_in_flight.max(1),
            spawner,
            done_rx,
            wake: wake.unwrap_or_else(crossbeam_channel::never),
            woken: store.woken(),
            cause: Cause::Start,
            poll,
            in_flight: 0,
            last_recover: Instant::now(),
            last_schedules: Instant::now(),
            schedules_active: true,
        }
    }

    /// The loop, until shutdown, a drain with nothing left, or an error of the database
    /// other than its being away; then every run in flight is waited for (at shutdown each
    /// commits its step and releases its task).
    pub fn run(mut self, shutdown: &AtomicBool) -> Result<()> {
        let result = self.turns(shutdown);
        if self.in_flight > 0 {
            tracing::info!(in_flight = self.in_flight, "waiting for the runs in flight");
        }
        while self.in_flight > 0 && self.done_rx.recv().is_ok() {
            self.in_flight -= 1;
        }
        result
    }

    fn turns(&mut self, shutdown: &AtomicBool) -> Result<()> {
        loop {
            match self.turn(shutdown)? {
                Turn::Shutdown => return Ok(()),
                Turn::Claimed(n) if n > 0 => continue,
                Turn::Claimed(_) => {}
                Turn::Unavailable => {
                    std::thread::sleep(self.poll);
                    continue;
                }
            }
            if self.cfg.drain && self.in_flight == 0 {
                match self.drain()? {
                    Drain::Done => return Ok(()),
                    Drain::Again => continue,
                    Drain::Wait => {}
                }
            }
            let (idle, timer) = self.idle_for();
            self.cause = crossbeam_channel::select! {
                recv(self.done_rx) -> r => {
                    if r.is_ok() { self.in_flight -= 1 }
                    Cause::RunEnded
                }
                recv(self.woken) -> _ => Cause::Enqueued,
                recv(self.wake) -> _ => Cause::Watch,
                // A wake-up sent as the wait ran out still counts as one.
                default(idle) => match (self.woken.try_recv(), self.wake.try_recv()) {
                    (Ok(()), _) => Cause::Enqueued,
                    (_, Ok(())) => Cause::Watch,
                    _ => timer,
                },
            };
        }
    }

    /// How long to wait for a wake-up before claiming again: the poll interval, or less when
    /// a delayed task, recovery or the schedules come due sooner (a daemon with wake-ups
    /// polls once a second); and which of the two it is.
    fn idle_for(&self) -> (Duration, Cause) {
        let poll = self.timers();
        let due = if self.in_flight >= self.max_in_flight {
            None
        } else {
            self.next_start()
        };
        match due {
            Some(d) if d < poll.0 => (d, Cause::Due),
            _ => poll,
        }
    }

    /// The poll interval, or the housekeeping times when sooner.
    fn timers(&self) -> (Duration, Cause) {
        // Recovery and the schedules keep their times however long the poll interval is.
        let recover = Duration::from_millis(self.cfg.recover_every_ms)
            .saturating_sub(self.last_recover.elapsed());
        let mut timers = recover;
        if self.schedules_active {
            timers = timers.min(SCHEDULES_EVERY.saturating_sub(self.last_schedules.elapsed()));
        }
        if timers < self.poll {
            (timers, Cause::Due)
        } else {
            (self.poll, Cause::Poll)
        }
    }

    /// How long until the next delayed task comes due, if one is waiting.
    fn next_start(&self) -> Option<Duration> {
        let now = now_ms();
        match self.store.next_start_ms(now) {
            Ok(at) => at.map(|at| Duration::from_millis(at.saturating_sub(now))),
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the next start time; polling");
                None
            }
        }
    }

    /// One turn: runs that finished counted, housekeeping when due, then claims for the room
    /// left under the most runs in flight.
    fn turn(&mut self, shutdown: &AtomicBool) -> Result<Turn> {
        if shutdown.load(Ordering::SeqCst) {
            // Runs waiting on their model drop the wait and hand their tasks back.
            self.spawner.ctx.stopping.notify_waiters();
            return Ok(Turn::Shutdown);
        }
        while self.done_rx.try_recv().is_ok() {
            self.in_flight -= 1;
        }
        let now = now_ms();
        if self.last_recover.elapsed() >= Duration::from_millis(self.cfg.recover_every_ms) {
            self.last_recover = Instant::now();
            self.housekeeping(now);
        }
        if self.last_schedules.elapsed() >= SCHEDULES_EVERY {
            self.last_schedules = Instant::now();
            self.fire_schedules(now);
        }
        let free = self.max_in_flight.saturating_sub(self.in_flight);
        if free == 0 {
            return Ok(Turn::Claimed(0));
        }
        let claimed = match self
            .store
            .claim(&self.me.lease(now, self.cfg.lease_ms), free, now)
        {
            Ok(c) => c,
            Err(e @ Error::Unavailable(_)) => {
                // The database is away: keep what runs, and try again after a pause.
                tracing::warn!(error = %e, "cannot claim tasks; trying again");
                return Ok(Turn::Unavailable);
            }
            Err(e) => return Err(e),
        };
        let got = claimed.len();
        if got > 0 {
            crate::metrics::global()
                .claims_by
                .with_label_values(&[self.cause.label()])
                .inc_by(got as u64);
        }
        for rec in claimed {
            tracing::debug!(task = %rec.id, "claimed");
            self.in_flight += 1;
            if let Ok(mut set) = self.claims.live.lock() {
                set.insert((rec.id.clone(), rec.lease.as_ref().map_or(0, |l| l.token)));
            }
            self.spawner.spawn(rec);
        }
        Ok(Turn::Claimed(got))
    }

    /// Expired claims recovered and approval waits that ran out ended; a failure is logged
    /// and tried again next time.
    fn housekeeping(&self, now: u64) {
        if let Err(e) = self.claims.recover(&**self.store, now) {
            tracing::warn!(error = %e, "lease recovery failed");
        }
        match crate::operator::expire_approvals(&**self.store, now) {
            Ok(ids) if !ids.is_empty() => tracing::info!(tasks = ?ids, "approval waits ran out"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "expiring approval waits failed"),
        }
    }

    /// The schedules' due ticks enqueued (each under its tick's key, so daemons firing the
    /// same tick enqueue it once); a failure is logged and tried again at the next pass.
    fn fire_schedules(&mut self, now: u64) {
        let store = &**self.store;
        let pass = match crate::operator::schedule::fire_due(store, Some(&self.cfg.trusted), now) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the schedules");
                return;
            }
        };
        self.schedules_active = pass.active > 0;
        for f in pass.fired.iter().filter(|f| f.task.created) {
            tracing::info!(schedule = %f.schedule, tick = %crate::clock::rfc3339(f.tick_ms), task = %f.task.id, "schedule fired");
        }
        for (name, n) in &pass.skipped {
            tracing::info!(schedule = %name, missed = n, "missed ticks passed over");
        }
        for e in &pass.failed {
            tracing::warn!(error = %e, "a schedule could not fire");
        }
    }

    /// Nothing of ours in flight and nothing claimed: also take over dead workers' tasks. On
    /// a shared database a running task of another daemon may be one whose daemon died: its
    /// heartbeat runs out and it is recovered, so a drain waits for the running tasks too. A
    /// file judges dead owners at once.
    fn drain(&self) -> Result<Drain> {
        let store = &**self.store;
        let waits = || -> Result<u64> {
            let ready = runnable_queued(store, self.cfg)?;
            if ready > 0 || store.local_owners() {
                return Ok(ready);
            }
            store.running_count()
        };
        let checked = self
            .claims
            .recover(store, now_ms())
            .and_then(|ids| Ok((ids.is_empty(), waits()?)));
        match checked {
            // Held writes that a lookup settles now (here or on the settler's thread) run in
            // this drain too.
            Ok((true, 0)) => {
                if self.cfg.auto_settle {
                    self.settler.pass(store, &self.cfg.trusted);
                }
                if runnable_queued(store, self.cfg).is_ok_and(|n| n == 0) {
                    left_for_others(store, self.cfg);
                    return Ok(Drain::Done);
                }
                Ok(Drain::Wait)
            }
            Ok((true, _)) => Ok(Drain::Wait),
            Ok(_) => Ok(Drain::Again),
            Err(e @ Error::Unavailable(_)) => {
                tracing::warn!(error = %e, "cannot check for work; trying again");
                Ok(Drain::Wait)
            }
            Err(e) => Err(e),
        }
    }
}

/// The queued tasks this daemon could run: every one, unless it passes over the tasks of a
/// profile whose API key its environment lacks (those wait for a daemon that has it, and a
/// drain does not wait for them).
fn runnable_queued(store: &dyn Backend, cfg: &Config) -> Result<u64> {
    let ready = store.ready_count()?;
    let missing = cfg.trusted.missing_keys();
    if ready == 0 || missing.is_empty() {
        return Ok(ready);
    }
    Ok(ready.saturating_sub(passed_over(store, &missing)?.len() as u64))
}

/// The queued tasks of the profiles in `missing` (`(profile, why)`), by id.
fn passed_over(store: &dyn Backend, missing: &[(String, String)]) -> Result<Vec<String>> {
    use crate::store::list::{ListQuery, Listed};
    let rules = crate::store::flow::ConcurrencyLimits::default()
        .passing_over(missing.iter().map(|(n, _)| n.clone()).collect());
    let mut out = Vec::new();
    let mut q = ListQuery {
        status: Some(crate::store::QueueStatus::Queued),
        limit: 500,
        ..Default::default()
    };
    loop {
        let page = store.list(&q)?;
        for l in &page.tasks {
            if let Listed::Task(t) = l
                && store.task(&t.id).is_ok_and(|r| rules.passes_over(&r.model))
            {
                out.push(t.id.clone());
            }
        }
        match page.next {
            Some(c) => q.before = Some(c),
            None => return Ok(out),
        }
    }
}

/// Says, as a drain ends, which tasks it left queued for a daemon with their profile's key.
fn left_for_others(store: &dyn Backend, cfg: &Config) {
    let missing = cfg.trusted.missing_keys();
    if missing.is_empty() {
        return;
    }
    if let Ok(ids) = passed_over(store, &missing)
        && !ids.is_empty()
    {
        let why: Vec<String> = missing.iter().map(|(n, w)| format!("{n}: {w}")).collect();
        tracing::warn!(
            tasks = ids.len(),
            first = %ids[0],
            "the drain ends with tasks left queued for a daemon that has their model profile's key ({})",
            why.join("; ")
        );
    }
}
