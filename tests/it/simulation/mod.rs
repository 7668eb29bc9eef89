//! A seeded simulation of the durable layer: several workers and operators interleaved by a
//! seeded scheduler on the real backend (the redb file, or PostgreSQL), the durable step's
//! real machine (`worker::machine`) and the demo shop as the strict sink, under a simulated
//! clock.
//!
//! Every worker is a machine and the I/O it asks for (`worker.rs`), all in this one thread: a
//! scheduler step lets one worker do one thing (claim, read, ask its model, prove a write's
//! claim, send, commit), so a seed fixes the whole schedule and every interleaving of those
//! steps is one the scheduler can choose. On PostgreSQL, some step commits lose their
//! acknowledgment, after landing or while still in progress. The scheduler also moves the
//! clock (and jumps it past every lease), crashes workers between any two of their steps (the
//! crashed worker's memory is dropped and a new incarnation with a new identity starts),
//! pauses workers while others take their tasks over and lets them resume (between a write's
//! proof and its send too), and runs operators who review a held call and decide on it later
//! (approve with or without an extension, reject, reconcile from the ledger, answer a task's
//! question, cancel), so decisions race with the workers. A quarter of the tasks ask a person
//! first (`ask_person`, then their final answer).
//!
//! Invariants, checked after every scheduler step (the logs of the sink, which only grow, after
//! each phase) and at the end:
//! - no refund key arrives at the store more than once, plus once per `--not-applied`
//!   decision for it (arrivals log, not the deduplicating ledger), and never more than once
//!   between two such decisions (a run that sends after a takeover breaks that);
//! - every applied refund above the automatic limit has an approval event for its key;
//! - a task's committed step, tool calls and active time never go back (a superseded claim
//!   never commits);
//! - no committed state exceeds its budget;
//! - every held write stays listed by `held` until it is settled;
//! - a task given a start time (some are) has not run before it, by the simulated clock;
//! - no more tasks of a concurrency key run at once than its limit (`tenant:*` = 1; most
//!   tasks have one of two keys), whatever crashes, pauses and takeovers happen;
//! - the model calls of all workers together (every one shares one rate limit, small enough
//!   that tasks often wait for it) never exceed the limit in any window of the simulated
//!   clock, and a task waiting for capacity is queued, not running (it gave its worker back).
//!   On PostgreSQL these time checks allow `PG_CLOCK_SLACK_MS`: the store reads "now" as the
//!   server's clock plus the caller's lead, so it runs ahead of the simulated clock by the
//!   real time a statement takes to start;
//! - a question is never a tool call; a task is answered at most once, holds an answer only
//!   after one was recorded, and one that asked and ended `done` read the answer it was given;
//! - after a settling phase without faults, every task has ended and nothing is held.
//!
//! Three mutations of the protocol, each tried by hand against this file, are caught within the
//! default 2,000 seeds (a refund arrives twice, or arrives after a takeover, and the sink's
//! invariant fails; or an answer is lost):
//! - **the claim check dropped before a send**: in `src/worker/machine/write.rs`, the write's
//!   `Need::Send` asks for no proof (`proof: p.access == Access::Write` made `false`): a paused
//!   worker resumed after a takeover sends the write its successor also sent;
//! - **a non-idempotent write re-sent**: in the same file, the condition that holds a write
//!   found in flight (`in_flight && !p.idempotent`) made `false`: a rerun after a crash sends
//!   the refund again under its key.
//! - **a question resumed without its answer**: in `src/worker/machine/mod.rs`, `begin`'s
//!   `resuming` without `StopReason::NeedsAnswer`: the next run starts over and the task ends
//!   `done` without having read the answer (caught within a few dozen seeds).
//!
//! `cargo test --test it simulation` runs 2,000 seeds from a random base it prints;
//! `TETHER_SIM_SEEDS=N` runs N seeds, `TETHER_SIM_BASE=B` fixes the base, and
//! `TETHER_SIM_SEED=S` replays one seed.

use crate::common;
use common::Rng;
use tether::operator;

use serde_json::json;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use std::time::Duration;
use tether::kernel::Budget;
use tether::model::ModelProfile;
use tether::operator::{Extension, Reviewed, Settlement};
use tether::store::Decision;
use tether::store::pg::{CommitFault, PgStore};
use tether::store::{Backend, Error, NewTask, QueueStatus, RedbStore, TaskRecord};
use tether::tools::durable::DurableStore;

const SEEDS: u64 = 2_000;
const LEASE_MS: u64 = 1_000;
const CHAOS_STEPS: usize = 140;
const SETTLE_STEPS_MAX: usize = 4_000;

mod worker;

use worker::{Shared, Worker};

struct Sim {
    seed: u64,
    rng: Rng,
    store: Arc<dyn Backend>,
    tools: Arc<DurableStore>,
    clock: Arc<AtomicU64>,
    shared: Shared,
    workers: Vec<Worker>,
    incarnations: u32,
    /// Calls reviewed by an operator, decided on later: (task, key, digest).
    reviews: Vec<(String, String, String)>,
    /// Highest (step, tool calls, active ms) committed per task.
    seen: BTreeMap<String, (u32, u32, u64)>,
    /// Per refund key: (arrivals seen, `--not-applied` decisions seen, arrivals since the
    /// latest of those decisions).
    sends: BTreeMap<String, (usize, usize, usize)>,
    ids: Vec<String>,
    /// When each task's own start time is, if it has one.
    starts: BTreeMap<String, u64>,
    /// How far the store's "now" may run ahead of the simulated clock (0 on redb).
    slack_ms: u64,
}

/// On PostgreSQL, how far its "now" may run ahead of the simulated clock.
const PG_CLOCK_SLACK_MS: u64 = 250;

fn sim_dir() -> std::path::PathBuf {
    // tmpfs makes fsync cheap, so thousands of seeds fit in a test run.
    let shm = Path::new("/dev/shm");
    let base = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let p = base.join(format!(
        "tether-sim-{}-{:?}-{nanos}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&p).expect("sim dir");
    p
}

/// The model of the tasks that ask a person first (a script: the question, then the final
/// answer), and what operators answer.
const ASK_SCRIPT: &str = r#"{"type": "tool", "name": "ask_person", "args": {"question": "May I refund the kettle?", "choices": ["yes", "no"]}}
{"type": "final", "outcome": "completed", "text": "Asked, and answered."}"#;
const ANSWER: &str = "yes";

fn task(rng: &mut Rng, i: usize) -> NewTask {
    let mut t = refund_task(rng, i);
    // Some ask a person first: the question waits for an operator's answer through crashes,
    // pauses and takeovers like any held call.
    if rng.below(4) == 0 {
        t.model = ModelProfile::parse("script:400", Some(ASK_SCRIPT)).expect("model");
    }
    t
}

fn refund_task(rng: &mut Rng, i: usize) -> NewTask {
    let (model, latency) = match rng.below(4) {
        0 => ("policy:ord_1004:8000", None),
        1 => ("policy:ord_1001:3000", Some(40_000)),
        _ => ("policy:ord_1001:3000", None),
    };
    let mut tool_latency_ms = BTreeMap::new();
    if let Some(ms) = latency {
        tool_latency_ms.insert("issue_refund".to_string(), ms);
    }
    NewTask {
        user: "cu_ana".into(),
        goal: "refund the damaged item on order ord_1001".into(),
        key: Some(format!("sim-{i}")),
        priority: 0,
        budget: Budget::default(),
        model: ModelProfile::parse(model, None).expect("model"),
        tool_latency_ms,
        catalog: None,
        store_scope: format!("s{i}"),
        approval_wait_ms: 1 << 40,
        instructions: None,
        callback_url: None,
        submitted_by: None,
        // Some start later (the simulated clock starts at 1,000,000 ms); most share one of
        // two concurrency keys, limited to one running task each.
        not_before_ms: (rng.below(3) == 0).then(|| START_MS + rng.below(5_000)),
        // Some must finish by a wall-clock deadline (`timed_out`), which may pass while a
        // crashed run's write is in flight.
        time_limits: tether::store::TimeLimits {
            expires_at_ms: None,
            deadline_at_ms: (rng.below(4) == 0).then(|| START_MS + 2_000 + rng.below(60_000)),
        },
        concurrency_key: match rng.below(3) {
            0 => None,
            1 => Some("tenant:a".into()),
            _ => Some("tenant:b".into()),
        },
    }
}

/// The simulated clock at the start.
const START_MS: u64 = 1_000_000;

/// The demo shop's catalog with the question to a person, as every simulated task resolves
/// it (they name no catalog).
fn demo_catalog() -> &'static tether::kernel::Catalog {
    static CATALOG: std::sync::OnceLock<tether::kernel::Catalog> = std::sync::OnceLock::new();
    CATALOG.get_or_init(|| {
        let mut c = tether::config::Config::default().catalog_for(None).catalog;
        let ask = tether::kernel::person::AskPerson::default().spec();
        c.tools.push(ask.expect("the question's tool"));
        c
    })
}
/// The limit of every `tenant:` key.
const TENANT_LIMIT: usize = 1;
/// The rate limit every model call shares: `RATE_REQUESTS` calls in any `RATE_WINDOW_MS`.
const RATE_REQUESTS: usize = 2;
const RATE_WINDOW_MS: u64 = 400;

impl Sim {
    fn new(seed: u64, db: &SimDb) -> Sim {
        let mut rng = Rng(seed);
        let (store, tools): (Arc<dyn Backend>, _) = match db {
            SimDb::Dir(dir) => (
                Arc::new(RedbStore::open(&dir.join("worker.redb"), true).expect("open")),
                DurableStore::open(&dir.join("store.redb")).expect("store"),
            ),
            SimDb::Pg(url) => {
                let pg = PgStore::open(url, true, 8, Duration::from_secs(5)).expect("open");
                // Some step commits lose their acknowledgment: after landing, or while their
                // transaction is still in progress (it commits or rolls back a moment later,
                // as a COMMIT waiting for a synchronous standby does). The read-back must
                // settle each exactly: the invariants below see a commit applied twice or lost.
                let mut faults = Rng(seed ^ 0x5eed_fa17);
                pg.inject_commit_faults(move || match faults.below(100) {
                    0..=4 => CommitFault::LostAck,
                    5..=9 => CommitFault::InProgress {
                        lands: faults.chance(50),
                        resolve_after: Duration::from_millis(faults.below(30)),
                    },
                    _ => CommitFault::None,
                });
                (Arc::new(pg), DurableStore::open_target(url).expect("store"))
            }
        };
        let tools = Arc::new(tools);
        let limits = [("tenant:*".to_string(), TENANT_LIMIT as u32)];
        store.set_limits(tether::store::flow::ConcurrencyLimits::new(limits).expect("limits"));
        let n = 2 + rng.below(3) as usize;
        let tasks: Vec<NewTask> = (0..n).map(|i| task(&mut rng, i)).collect();
        let ids: Vec<String> = store
            .enqueue(&tasks, 0)
            .expect("enqueue")
            .into_iter()
            .map(|e| e.id)
            .collect();
        let starts = ids
            .iter()
            .zip(&tasks)
            .filter_map(|(id, t)| Some((id.clone(), t.not_before_ms?)))
            .collect();
        let clock = Arc::new(AtomicU64::new(START_MS));
        let shared = Shared {
            store: Arc::clone(&store),
            shop: Arc::new(tether::tools::durable::DemoShop::opened(Arc::clone(&tools))),
            clock: Arc::clone(&clock),
            calls: Arc::default(),
            lease_ms: LEASE_MS,
            rate: tether::model::rate::RateLimit {
                requests: Some(RATE_REQUESTS as u32),
                tokens: None,
                per_ms: RATE_WINDOW_MS,
            },
            catalog: demo_catalog(),
        };
        let mut sim = Sim {
            seed,
            rng,
            store,
            tools,
            clock,
            shared,
            workers: Vec::new(),
            incarnations: 0,
            reviews: Vec::new(),
            seen: BTreeMap::new(),
            sends: BTreeMap::new(),
            ids,
            starts,
            slack_ms: match db {
                SimDb::Dir(_) => 0,
                SimDb::Pg(_) => PG_CLOCK_SLACK_MS,
            },
        };
        let workers = 2 + sim.rng.below(2) as usize;
        for _ in 0..workers {
            sim.incarnations += 1;
            let w = Worker::new(&sim.shared, sim.incarnations);
            sim.workers.push(w);
        }
        sim
    }

    fn now(&self) -> u64 {
        self.clock.load(Ordering::SeqCst)
    }

    /// Lets worker `slot` do one thing. Returns whether it may have written.
    fn step(&mut self, slot: usize) -> bool {
        self.workers[slot].step(&self.shared)
    }

    /// Crashes worker `slot` where it stands: its run is dropped, and a new incarnation with
    /// an identity of its own takes its place.
    fn crash(&mut self, slot: usize) {
        self.incarnations += 1;
        self.workers[slot] = Worker::new(&self.shared, self.incarnations);
    }

    fn decision(&self, by: &str) -> Decision {
        Decision {
            by: by.into(),
            reason: Some("simulation".into()),
            now_ms: self.now(),
        }
    }

    /// An operator looks at a held or suspended call and notes its key and digest.
    fn review(&mut self) {
        let id = self.ids[self.rng.below(self.ids.len() as u64) as usize].clone();
        let Ok(rec) = self.store.task(&id) else {
            return;
        };
        if let Some(p) = &rec.state.pending {
            let key = self.store.call_key(&rec, p);
            self.reviews.push((id, key, p.digest()));
        }
    }

    /// An operator decides on a call reviewed earlier; the task may have moved on since.
    fn decide(&mut self) {
        if self.reviews.is_empty() {
            return;
        }
        let i = self.rng.below(self.reviews.len() as u64) as usize;
        let (id, key, digest) = self.reviews.swap_remove(i);
        let reviewed = Reviewed {
            key: Some(key.clone()),
            digest: Some(digest),
        };
        let Ok(rec) = self.store.task(&id) else {
            return;
        };
        let extend = if self.rng.chance(50) {
            Extension::parse("tool_calls=1,deadline_ms=10000").expect("extension")
        } else {
            Extension::default()
        };
        let asked = rec.state.stop == Some(tether::kernel::StopReason::NeedsAnswer);
        let r = if rec.status == QueueStatus::Suspended && asked {
            let d = self.decision("answerer");
            operator::answer(&*self.store, &id, ANSWER, &reviewed, &d).map(|_| ())
        } else if rec.status == QueueStatus::Suspended {
            if self.rng.chance(60) {
                operator::approve(
                    &*self.store,
                    &id,
                    &reviewed,
                    &extend,
                    &self.decision("approver"),
                )
                .map(|_| ())
            } else {
                operator::reject(&*self.store, &id, &reviewed, &self.decision("rejecter"))
                    .map(|_| ())
            }
        } else if rec.state.unknown_write().is_some() {
            // The oracle: the write took effect exactly when the ledger has its key.
            let applied = self
                .tools
                .ledger()
                .expect("ledger")
                .iter()
                .any(|e| e.key == key);
            let s = if applied {
                Settlement::Applied(json!({"status": "ok"}))
            } else {
                Settlement::NotApplied
            };
            operator::reconcile(
                &*self.store,
                &id,
                &s,
                &reviewed,
                &extend,
                &self.decision("reconciler"),
            )
            .map(|_| ())
        } else {
            return;
        };
        match r {
            Ok(()) | Err(Error::Conflict(_)) => {}
            Err(e) => panic!("seed {}: decision on {id} failed: {e}", self.seed),
        }
    }

    fn cancel(&mut self) {
        let id = self.ids[self.rng.below(self.ids.len() as u64) as usize].clone();
        match operator::cancel(&*self.store, &id, None, &self.decision("canceller")) {
            Ok(_) | Err(Error::Conflict(_)) => {}
            Err(e) => panic!("seed {}: cancel {id} failed: {e}", self.seed),
        }
    }

    fn runnable(&mut self) -> Option<usize> {
        let ready: Vec<usize> = (0..self.workers.len())
            .filter(|s| self.workers[*s].paused_for == 0)
            .collect();
        if ready.is_empty() {
            return None;
        }
        Some(ready[self.rng.below(ready.len() as u64) as usize])
    }

    fn tick_pauses(&mut self) {
        for w in &mut self.workers {
            w.paused_for = w.paused_for.saturating_sub(1);
        }
    }

    fn advance(&self, ms: u64) {
        self.clock.fetch_add(ms, Ordering::SeqCst);
    }

    /// One step of the chaos phase; false if it cannot have changed the database.
    fn chaos(&mut self) -> bool {
        self.advance(10);
        self.tick_pauses();
        let r = self.rng.below(100);
        let slot = self.rng.below(self.workers.len() as u64) as usize;
        match r {
            0..=54 => match self.runnable() {
                Some(s) => self.step(s),
                None => false,
            },
            55..=64 => {
                let ms = self.rng.below(3_000);
                self.advance(ms);
                false
            }
            65..=67 => {
                self.advance(45_000); // past every lease
                false
            }
            68..=71 => {
                self.crash(slot);
                false
            }
            72..=75 => {
                self.workers[slot].paused_for = 5 + self.rng.below(40) as usize;
                false
            }
            76..=87 => {
                self.review();
                false
            }
            88..=97 => {
                self.decide();
                true
            }
            _ => {
                self.cancel();
                true
            }
        }
    }

    /// One step of the settling phase: no faults; operators settle whatever waits.
    fn settle(&mut self) {
        self.advance(50);
        for w in &mut self.workers {
            w.paused_for = 0;
        }
        match self.rng.below(10) {
            0 => self.advance(45_000),
            1 => {
                self.review();
                self.decide();
            }
            _ => {
                if let Some(s) = self.runnable() {
                    self.step(s);
                }
            }
        }
    }

    fn all_ended(&self) -> bool {
        self.ids.iter().all(|id| {
            self.store
                .task(id)
                .is_ok_and(|r| r.status == QueueStatus::Finished)
        }) && operator::held(&*self.store).expect("held").is_empty()
    }

    /// What can be transient is checked after every step: committed state and held writes.
    fn check(&mut self) {
        let seed = self.seed;
        let tasks: Vec<TaskRecord> = self.store.tasks().expect("tasks");
        let held: BTreeSet<String> = operator::held(&*self.store)
            .expect("held")
            .into_iter()
            .map(|(r, _)| r.id)
            .collect();
        let mut running: BTreeMap<&str, usize> = BTreeMap::new();
        for r in &tasks {
            if let (QueueStatus::Running, Some(k)) = (r.status, r.concurrency_key.as_deref()) {
                *running.entry(k).or_default() += 1;
            }
            let now = self.now() + self.slack_ms;
            if let Some(&at) = self.starts.get(&r.id).filter(|&&at| at > now) {
                assert!(
                    r.runs == 0 && r.state.step == 0,
                    "seed {seed}: task {} ran before its start time {at} (now {})",
                    r.id,
                    self.now()
                );
            }
            if let Some(at) = r.not_before_ms.filter(|&at| at > now) {
                assert!(
                    r.status != QueueStatus::Running,
                    "seed {seed}: task {} runs while it waits until {at} (now {})",
                    r.id,
                    self.now()
                );
            }
        }
        for (k, n) in running {
            assert!(
                n <= TENANT_LIMIT,
                "seed {seed}: {n} tasks of {k} run at once (limit {TENANT_LIMIT})"
            );
        }
        self.check_rate();
        for r in &tasks {
            let st = &r.state;
            let now = (st.step, st.tool_calls, st.elapsed_ms);
            let before = self.seen.insert(r.id.clone(), now).unwrap_or((0, 0, 0));
            assert!(
                now.0 >= before.0 && now.1 >= before.1 && now.2 >= before.2,
                "seed {seed}: task {} went back from {before:?} to {now:?}",
                r.id
            );
            let b = &r.budget;
            assert!(
                st.step <= b.steps_max
                    && st.tool_calls <= b.tool_calls_max
                    && st.elapsed_ms <= b.deadline_ms,
                "seed {seed}: task {} exceeds its budget: {now:?} of {b:?}",
                r.id
            );
            let holds = st.unknown_write().is_some()
                && matches!(r.status, QueueStatus::Held | QueueStatus::Finished);
            assert!(
                !holds || held.contains(&r.id),
                "seed {seed}: the held write of task {} is not listed",
                r.id
            );
            self.check_in_flight(r, &held);
            self.check_answers(r);
        }
    }

    /// A question is never a tool call; a task answered once at most (its script asks once),
    /// and an answer in its state only after one was recorded; a task that asked and ended
    /// done read the answer (it was not lost).
    fn check_answers(&self, r: &TaskRecord) {
        if r.model.label() != "script" {
            return;
        }
        let seed = self.seed;
        let st = &r.state;
        assert_eq!(
            st.tool_calls, 0,
            "seed {seed}: task {}'s question counted as a tool call",
            r.id
        );
        let events = self.store.events(Some(&r.id)).expect("events");
        let answers = events.iter().filter(|e| e.verb == "answer").count();
        assert!(
            answers <= 1,
            "seed {seed}: task {} answered {answers} times",
            r.id
        );
        let read = st
            .last_result
            .as_ref()
            .is_some_and(|v| v.get("answer").is_some());
        assert!(
            !read || answers == 1,
            "seed {seed}: task {} holds an answer nobody gave",
            r.id
        );
        if r.status == QueueStatus::Finished && st.stop == Some(tether::kernel::StopReason::Done) {
            assert_eq!(
                st.last_result,
                Some(json!({"status": "ok", "answer": ANSWER})),
                "seed {seed}: task {} ended done without the answer it was given",
                r.id
            );
        }
    }

    /// A write whose intent has no result (it may have been sent) is never in a task that no
    /// run will pick up again unless it is the write the held list shows for that task:
    /// whatever ended the task (a cancel, a deadline), an operator must still see it.
    fn check_in_flight(&self, r: &TaskRecord, held: &BTreeSet<String>) {
        if matches!(r.status, QueueStatus::Queued | QueueStatus::Running) {
            return;
        }
        let calls = self.store.calls(&r.id).expect("calls");
        for c in calls.iter().filter(|c| c.result.is_none()) {
            let shown = r.state.unknown_write().map(|p| self.store.call_key(r, p));
            assert!(
                held.contains(&r.id) && shown.as_deref() == Some(c.key.as_str()),
                "seed {}: task {} is {} ({:?}) with the write {} in flight, and no list shows it",
                self.seed,
                r.id,
                r.status.as_str(),
                r.state.stop,
                c.key
            );
        }
    }

    /// No more than `RATE_REQUESTS` model calls in any window of `RATE_WINDOW_MS`.
    fn check_rate(&self) {
        let mut calls = self.shared.calls.lock().expect("calls").clone();
        calls.sort_unstable();
        for w in calls.windows(RATE_REQUESTS + 1) {
            assert!(
                w[RATE_REQUESTS] - w[0] + self.slack_ms >= RATE_WINDOW_MS,
                "seed {}: {} model calls within {} ms (at {w:?}; the limit is {RATE_REQUESTS} in {RATE_WINDOW_MS} ms)",
                self.seed,
                RATE_REQUESTS + 1,
                w[RATE_REQUESTS] - w[0]
            );
        }
    }

    /// After every scheduler step: a refund key arrives at most once before the first
    /// `--not-applied` decision for it, and at most once after each such decision (the
    /// re-send it asked for). A run that sends after its claim was taken over breaks this
    /// even when the total stays within one per decision: the new owner's re-send and the
    /// late send both come after the decision.
    fn check_sends(&mut self) {
        let seed = self.seed;
        let events = self.store.events(None).expect("events");
        let mut now: BTreeMap<String, usize> = BTreeMap::new();
        for a in self.tools.arrivals().expect("arrivals") {
            if a.tool == "issue_refund" && a.outcome != "needs_approval" {
                *now.entry(a.key).or_default() += 1;
            }
        }
        for (key, n) in now {
            let decided = events
                .iter()
                .filter(|e| e.verb == "reconcile_not_applied" && e.detail["key"] == key.as_str())
                .count();
            let (seen, decisions, since) = self.sends.entry(key.clone()).or_default();
            if decided > *decisions {
                *decisions = decided;
                *since = 0;
            }
            *since += n - *seen;
            *seen = n;
            assert!(
                *since <= 1,
                "seed {seed}: refund {key} arrived {since} times since its last not-applied decision ({decided} of them)"
            );
        }
    }

    /// The sink's logs only grow, so a violation stays visible: checked after each phase.
    fn check_sink(&self) {
        let seed = self.seed;
        let events = self.store.events(None).expect("events");
        let resends = |key: &str| {
            events
                .iter()
                .filter(|e| e.verb == "reconcile_not_applied" && e.detail["key"] == key)
                .count()
        };
        let mut sent: BTreeMap<String, usize> = BTreeMap::new();
        for a in self.tools.arrivals().expect("arrivals") {
            if a.tool == "issue_refund" && a.outcome != "needs_approval" {
                *sent.entry(a.key).or_default() += 1;
            }
        }
        for (key, n) in &sent {
            let allowed = 1 + resends(key);
            assert!(
                *n <= allowed,
                "seed {seed}: refund {key} arrived {n} times, {allowed} allowed"
            );
        }
        for e in self.tools.ledger().expect("ledger") {
            let big = matches!(e.effect, tether::tools::Effect::Refund { amount_cents, .. } if amount_cents > tether::tools::AUTO_LIMIT_CENTS);
            if big {
                assert!(
                    events
                        .iter()
                        .any(|v| v.verb == "approve" && v.detail["key"] == e.key.as_str()),
                    "seed {seed}: refund under {} applied without an approval",
                    e.key
                );
            }
        }
    }

    fn run(mut self) {
        for _ in 0..CHAOS_STEPS {
            if self.chaos() {
                self.check();
            }
            self.check_sends();
        }
        self.check_sink();
        let mut steps = 0;
        while !self.all_ended() {
            steps += 1;
            assert!(
                steps < SETTLE_STEPS_MAX,
                "seed {}: tasks did not end after settling: {:?}",
                self.seed,
                self.store
                    .tasks()
                    .expect("tasks")
                    .iter()
                    .map(|r| (r.id.clone(), r.status, r.state.stop))
                    .collect::<Vec<_>>()
            );
            self.settle();
            self.check();
            self.check_sends();
        }
        self.check_sink();
        if std::env::var("TETHER_SIM_VERBOSE").is_ok() {
            eprintln!("seed {}: {steps} settling steps", self.seed);
        }
    }
}

/// Where a seed's databases are.
enum SimDb {
    Dir(std::path::PathBuf),
    /// A PostgreSQL URL with a schema of the seed's own.
    Pg(String),
}

fn run_seed(seed: u64) {
    let dir = sim_dir();
    run_seed_on(seed, &SimDb::Dir(dir.clone()));
    let _ = std::fs::remove_dir_all(&dir);
}

fn run_seed_on(seed: u64, db: &SimDb) {
    let outcome = std::panic::catch_unwind(|| {
        let t = std::time::Instant::now();
        let sim = Sim::new(seed, db);
        if std::env::var("TETHER_SIM_VERBOSE").is_ok() {
            eprintln!("seed {seed}: set up in {:?}", t.elapsed());
        }
        sim.run();
        if std::env::var("TETHER_SIM_VERBOSE").is_ok() {
            eprintln!("seed {seed}: done in {:?}", t.elapsed());
        }
    });
    if let Err(e) = outcome {
        eprintln!("simulation failed at seed {seed}: replay with TETHER_SIM_SEED={seed}");
        std::panic::resume_unwind(e);
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.trim().parse().ok())
}

#[test]
fn the_durable_layer_holds_its_invariants_under_every_schedule() {
    if let Some(seed) = env_u64("TETHER_SIM_SEED") {
        run_seed(seed);
        return;
    }
    let n = env_u64("TETHER_SIM_SEEDS").unwrap_or(SEEDS);
    let base = env_u64("TETHER_SIM_BASE").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            % 1_000_000_000
    });
    println!("simulation: {n} seeds from {base} (TETHER_SIM_BASE={base} repeats this run)");
    let threads = std::thread::available_parallelism().map_or(2, |p| p.get().min(4)) as u64;
    let next = Arc::new(Mutex::new(0u64));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let next = Arc::clone(&next);
            std::thread::spawn(move || {
                loop {
                    let i = {
                        let mut g = next.lock().expect("seed counter");
                        let i = *g;
                        *g += 1;
                        i
                    };
                    if i >= n {
                        break;
                    }
                    run_seed(base + i);
                }
            })
        })
        .collect();
    let mut failed = false;
    for h in handles {
        failed |= h.join().is_err();
    }
    assert!(!failed, "a seed failed; its number is printed above");
}

/// Seeds run against PostgreSQL in `cargo test`: each in a schema of its own on one throwaway
/// cluster, with the same workers, operators, faults and invariants as on the file.
const PG_SEEDS: u64 = 60;

#[test]
fn the_durable_layer_holds_its_invariants_on_postgres() {
    let Some(pg) = common::pg::PgCluster::start("simulation") else {
        return;
    };
    let n = env_u64("TETHER_SIM_PG_SEEDS").unwrap_or(PG_SEEDS);
    let base = env_u64("TETHER_SIM_BASE").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            % 1_000_000_000
    });
    println!(
        "simulation on PostgreSQL: {n} seeds from {base} (TETHER_SIM_BASE={base} repeats this run)"
    );
    let url = pg.url();
    let next = Arc::new(Mutex::new(0u64));
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let (next, url) = (Arc::clone(&next), url.clone());
            std::thread::spawn(move || {
                loop {
                    let i = {
                        let mut g = next.lock().expect("seed counter");
                        *g += 1;
                        *g - 1
                    };
                    if i >= n {
                        break;
                    }
                    let seed = base + i;
                    let schema = format!("sim_{seed}");
                    run_seed_on(seed, &SimDb::Pg(format!("{url}?schema={schema}")));
                }
            })
        })
        .collect();
    let mut failed = false;
    for h in handles {
        failed |= h.join().is_err();
    }
    assert!(
        !failed,
        "a seed failed on PostgreSQL; its number is printed above"
    );
}
