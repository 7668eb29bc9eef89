//! The simulation's workers: each is the durable step's machine (`worker::machine`) and the
//! I/O it asks for, done here, in the simulation's one thread, one need at a time, so the
//! scheduler chooses every interleaving of every worker's reads, model calls, proofs, sends
//! and commits, and crashes or pauses a worker between any two of them. A write's send is two
//! scheduler steps: the proof of the claim, then the send, whose route asks the proof again
//! (as the daemon's routes do right before the first byte), so a pause between them is one
//! the scheduler can choose.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tether::kernel::io::SendGate;
use tether::kernel::{Catalog, ToolReply};
use tether::model::Model;
use tether::store::{Backend, CommitKind, Error, TaskRecord};
use tether::tools::Tools;
use tether::worker::driver::{self, Proof};
use tether::worker::machine::{Damaged, Ended, Machine, Need};
use tether::worker::rate::{Capacity, Gate};
use tether::worker::{CommitFail, Committer, Identity, Stats};

/// One incarnation of a worker process: who it is, and the run it is in.
pub struct Worker {
    pub ctx: driver::Context,
    run: Option<Run>,
    /// Scheduler steps this worker is left out of (paused).
    pub paused_for: usize,
}

/// A run in progress.
struct Run {
    machine: Machine<'static>,
    token: u64,
    model: Box<dyn Model>,
    capacity: Option<Capacity>,
    /// A write's proof of its claim, taken at the step before its send.
    proved: Option<Arc<Proof>>,
    /// The task the run's last commit claimed for this worker.
    next: Option<TaskRecord>,
    /// The task's demo-shop scope and tool latencies, for its sends.
    scope: String,
    latency: BTreeMap<String, u64>,
}

/// What a worker shares with the simulation.
pub struct Shared {
    pub store: Arc<dyn Backend>,
    pub shop: Arc<tether::tools::durable::DemoShop>,
    pub clock: Arc<AtomicU64>,
    /// The simulated time of every model call that left a worker (its capacity granted).
    pub calls: Arc<Mutex<Vec<u64>>>,
    pub lease_ms: u64,
    pub rate: tether::model::rate::RateLimit,
    /// The demo shop's catalog, as every simulated task's (they name none).
    pub catalog: &'static Catalog,
}

impl Worker {
    /// A new incarnation, number `n`, of a worker.
    pub fn new(shared: &Shared, n: u32) -> Worker {
        let me = Identity {
            host: "sim".into(),
            pid: n,
            start_ticks: 0,
            instance: u64::from(n),
        };
        // Leases end by expiry only, as on a file where no owner is judged dead: the
        // heartbeat of a shared database never runs out here.
        shared
            .store
            .heartbeat(&me.owner(), 0, u64::MAX / 4)
            .expect("heartbeat");
        let clock = Arc::clone(&shared.clock);
        let ctx = driver::Context {
            clock: Arc::new(move || clock.load(Ordering::SeqCst)),
            hook: None,
            mcp: None,
            trusted: Arc::default(),
            export: false,
            identity: me,
            store: Arc::clone(&shared.store),
            demo: Some(Arc::clone(&shared.shop)),
            committer: Committer::direct(Arc::clone(&shared.store)),
            lease_ms: shared.lease_ms,
            heartbeat_ttl_ms: u64::MAX / 4,
            time_scale: 0.0,
            shutdown: Arc::new(AtomicBool::new(false)),
            stopping: Default::default(),
            stats: Arc::new(Stats::default()),
            scripted_rate: None,
            catalogs: Default::default(),
        };
        Worker {
            ctx,
            run: None,
            paused_for: 0,
        }
    }

    fn now(&self) -> u64 {
        (self.ctx.clock)()
    }

    /// One step: between runs, recover what expired and claim a task (never this worker's
    /// own live claim: between runs it has none); in a run, one need of its machine. Returns
    /// whether the step may have written to the database.
    pub fn step(&mut self, shared: &Shared) -> bool {
        match self.run.take() {
            None => self.claim(shared),
            Some(mut run) => match self.advance(shared, &mut run) {
                Ok(Some(Ended::Stopped(_))) => {
                    if let Some(next) = run.next.take() {
                        self.run = Some(Self::start(shared, next));
                    }
                    true
                }
                Ok(Some(Ended::Released | Ended::Yielded)) => true,
                Ok(None) => {
                    self.run = Some(run);
                    true
                }
                // Abandoned, as the daemon abandons a run whose claim was taken over or whose
                // database failed: the task is recovered when its lease expires.
                Err(_) => true,
            },
        }
    }

    fn claim(&mut self, shared: &Shared) -> bool {
        let now = self.now();
        let store = &shared.store;
        let _ = store.recover(now, &|_| false, &|_, _| false);
        let lease = self.ctx.identity.lease(now, shared.lease_ms);
        match store.claim(&lease, 1, now) {
            Ok(mut v) => {
                if let Some(rec) = v.pop() {
                    self.run = Some(Self::start(shared, rec));
                }
            }
            Err(e) => panic!("claim failed: {e}"),
        }
        true
    }

    fn start(shared: &Shared, rec: TaskRecord) -> Run {
        let token = rec.lease.as_ref().map_or(0, |l| l.token);
        let model = tether::config::Config::default()
            .model_for(&rec.model)
            .expect("a scripted model")
            .build(shared.catalog, rec.instructions.as_deref());
        let input = model.input();
        let scope = rec.store_scope.clone();
        let latency = rec.tool_latency_ms.clone();
        Run {
            scope,
            latency,
            machine: Machine::new(rec, shared.store.db_id(), shared.catalog, input),
            token,
            model,
            capacity: Capacity::new(Some(("sim-model".into(), shared.rate))),
            proved: None,
            next: None,
        }
    }

    /// Does one need of the run's machine; `Ok(Some)` when the run is over.
    fn advance(&mut self, shared: &Shared, run: &mut Run) -> Result<Option<Ended>, CommitFail> {
        let now = self.now();
        let store = &*shared.store;
        let id = run.machine.record().id.clone();
        let failed = |e: Error| CommitFail::Failed(e.to_string());
        let damaged = |e: Error| match e {
            Error::Corrupt(_) | Error::NewerVersion { .. } => Ok(Damaged(e.to_string())),
            e => Err(CommitFail::Failed(e.to_string())),
        };
        match run.machine.poll(now) {
            Need::Calls => {
                let calls = match store.calls(&id) {
                    Ok(c) => Ok(c),
                    Err(e) => Err(damaged(e)?),
                };
                run.machine.on_calls(calls, now);
            }
            Need::Spans => {
                let spans = store.spans(&id).map_err(failed)?;
                run.machine.on_spans(spans);
            }
            Need::Reply { step, .. } => {
                let reply = store.reply(&id, step).map_err(failed)?;
                run.machine.on_reply(reply);
            }
            Need::Model(req) => {
                let cap = run.capacity.as_mut().expect("a rate limit");
                if let Gate::Wait(t) = cap.before(store, &req, now).map_err(failed)? {
                    run.machine.on_model_deferred(t);
                    return Ok(None);
                }
                shared.calls.lock().expect("calls").push(now);
                let reply = run.model.next(&req);
                let busy = run.model.busy();
                let after = cap.after(store, &reply, busy, now).map_err(failed)?;
                let prompt = run.model.prompt_id();
                match after {
                    Gate::Wait(t) => run.machine.on_model_deferred(t),
                    Gate::Go => {
                        run.machine.on_model(reply, prompt);
                    }
                }
            }
            Need::Call { key } => {
                let record = match store.call(key) {
                    Ok(c) => Ok(c),
                    Err(e) => Err(damaged(e)?),
                };
                run.machine.on_call(record, now);
            }
            Need::Commit(c) => {
                let claim_next = matches!(c.kind, CommitKind::Final(_))
                    .then(|| self.ctx.identity.lease(now, shared.lease_ms));
                let mut outcome = self.ctx.committer.commit(tether::store::Commit {
                    task_id: id.clone(),
                    token: run.token,
                    kind: c.kind,
                    state: c.state.clone(),
                    next_span_id: c.next_span_id,
                    spans: c.spans.clone(),
                    reply: c.reply.clone(),
                    call: c.call.clone(),
                    now_ms: now,
                    lease_ms: shared.lease_ms,
                    clear_settle: c.clear_settle,
                    claim_next,
                    export: false,
                    callback: c.callback.clone(),
                    not_before_ms: c.not_before_ms,
                })?;
                run.next = outcome.next.take();
                run.machine.on_committed(&outcome, now);
            }
            Need::Send(send) if send.proof && run.proved.is_none() => {
                // The proof of the claim: the next step of this worker sends (another worker,
                // a pause or a clock jump may come between).
                let proof = Arc::new(Proof::new(&self.ctx, &id, run.token));
                if proof.ready().is_err() {
                    return Err(proof.refusal().unwrap_or(CommitFail::LeaseLost));
                }
                run.proved = Some(proof);
            }
            Need::Send(mut send) => {
                let proof = run.proved.take();
                let gate = proof.clone().map(|p| -> tether::kernel::io::Gate { p });
                send.request.gate = gate.as_ref();
                let reply = demo_shop(shared, &run.scope, &run.latency, &send.request);
                if let Some(e) = proof.and_then(|p| p.refusal()) {
                    return Err(e);
                }
                run.machine.on_sent(reply, now);
            }
            Need::CompleteCancel => {
                let done =
                    tether::operator::complete_requested_cancel(store, &id, now).unwrap_or(false);
                run.machine.on_cancel_completed(done);
            }
            Need::Ended(e) => return Ok(Some(e)),
        }
        Ok(None)
    }
}

/// The demo shop as a route, as the daemon's: the proof asked right before the call.
fn demo_shop(
    shared: &Shared,
    scope: &str,
    latency: &BTreeMap<String, u64>,
    req: &tether::kernel::ToolRequest<'_>,
) -> ToolReply {
    if let Err(why) = req.ready_to_send() {
        return ToolReply {
            result: serde_json::json!({"status": "error", "code": "not_sent", "detail": why}),
            latency_ms: 0,
        };
    }
    let shop = shared.shop.get().expect("the demo shop");
    tether::tools::durable::DurableTools {
        store: &shop,
        scope,
        latency_ms: latency,
    }
    .call(req)
}
