//! The dispatcher: the daemon's main loop, and the worker threads it feeds.
//!
//! Each turn of the loop meets one of a closed set of events (`Turn`): shutdown asked; tasks
//! claimed for the threads that are free; nothing to claim, so (when draining) a check whether
//! anything is left, else a wait for a thread to finish, a wake-up (PostgreSQL's `NOTIFY`) or
//! the poll interval. Periodically it recovers expired claims and ends approval waits that ran
//! out. The claims this process's threads hold (`Claims`) are never taken over by its own
//! recovery, however late their lease renewal is.

use crossbeam_channel::{Receiver, Sender};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Config, Identity, driver, now_ms, owner_is_dead, settle::Settler};
use crate::store::{Backend, Error, Lease, Result, TaskRecord};

/// The claims of this process's threads, (task, fencing token), and how its recovery judges
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

    /// The set, for a worker thread to add its chained claims to.
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

/// A worker thread: runs each task it is handed, and the chain of tasks each final commit
/// claims for it, then reports the chain done.
pub(super) fn worker_thread(
    ctx: &driver::Context,
    rx: Receiver<TaskRecord>,
    done: Sender<()>,
    live: &Mutex<HashSet<(String, u64)>>,
) {
    for rec in rx {
        // The dispatcher counts the chain as one task in flight.
        let mut next = Some(rec);
        while let Some(rec) = next.take() {
            let claim = (rec.id.clone(), rec.lease.as_ref().map_or(0, |l| l.token));
            if let Ok(mut set) = live.lock() {
                set.insert(claim.clone());
            }
            // A panic (a bug) ends this run only: the thread goes on, and the claim leaves the
            // live set, so the task is recovered from its last commit when its lease expires
            // (or at once by the next daemon).
            let id = claim.0.clone();
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                driver::run_task(ctx, rec)
            }));
            next = run.unwrap_or_else(|_| {
                ctx.stats.abandoned.fetch_add(1, Ordering::Relaxed);
                tracing::error!(task = %id, "the run panicked; its claim is dropped and the task will be recovered from its last commit when its lease expires");
                None
            });
            if let Ok(mut set) = live.lock() {
                set.remove(&claim);
            }
        }
        if done.send(()).is_err() {
            break;
        }
    }
}

/// What one turn of the dispatcher's loop met.
enum Turn {
    Shutdown,
    /// This many tasks were claimed and handed to threads.
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
    workers: usize,
    task_tx: Sender<TaskRecord>,
    /// Borrowed, so it outlives the loop: a thread that finishes after the loop ended can
    /// still report, and goes on to take the tasks left in the channel until it closes.
    done_rx: &'a Receiver<()>,
    wake: Receiver<()>,
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
        task_tx: Sender<TaskRecord>,
        done_rx: &'a Receiver<()>,
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
            workers: cfg.workers.max(1),
            task_tx,
            done_rx,
            wake: wake.unwrap_or_else(crossbeam_channel::never),
            poll,
            in_flight: 0,
            last_recover: Instant::now(),
            last_schedules: Instant::now(),
            schedules_active: true,
        }
    }

    /// The loop, until shutdown, a drain with nothing left, or an error of the database
    /// other than its being away. Dropping `self` at the end hands the threads their last
    /// task.
    pub fn run(mut self, shutdown: &AtomicBool) -> Result<()> {
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
            let idle = self.idle_for();
            crossbeam_channel::select! {
                recv(self.done_rx) -> r => if r.is_ok() { self.in_flight -= 1 },
                recv(self.wake) -> _ => {}
                default(idle) => {}
            }
        }
    }

    /// How long to wait for a wake-up before claiming again: the poll interval, or less when
    /// a delayed task, recovery or the schedules come due sooner (a daemon with wake-ups
    /// polls once a second).
    fn idle_for(&self) -> Duration {
        // Recovery and the schedules keep their times however long the poll interval is.
        let recover = Duration::from_millis(self.cfg.recover_every_ms)
            .saturating_sub(self.last_recover.elapsed());
        let mut timers = self.poll.min(recover);
        if self.schedules_active {
            timers = timers.min(SCHEDULES_EVERY.saturating_sub(self.last_schedules.elapsed()));
        }
        if self.in_flight >= self.workers {
            return timers;
        }
        let now = now_ms();
        match self.store.next_start_ms(now) {
            Ok(Some(at)) => timers.min(Duration::from_millis(at.saturating_sub(now))),
            Ok(None) => timers,
            Err(e) => {
                tracing::debug!(error = %e, "cannot read the next start time; polling");
                timers
            }
        }
    }

    /// One turn: threads that finished counted, housekeeping when due, then claims for the
    /// threads that are free.
    fn turn(&mut self, shutdown: &AtomicBool) -> Result<Turn> {
        if shutdown.load(Ordering::SeqCst) {
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
        let free = self.workers.saturating_sub(self.in_flight);
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
        for rec in claimed {
            tracing::debug!(task = %rec.id, "claimed");
            self.in_flight += 1;
            if let Ok(mut set) = self.claims.live.lock() {
                set.insert((rec.id.clone(), rec.lease.as_ref().map_or(0, |l| l.token)));
            }
            if self.task_tx.send(rec).is_err() {
                break;
            }
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
            let ready = store.ready_count()?;
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
                if store.ready_count().is_ok_and(|n| n == 0) {
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
