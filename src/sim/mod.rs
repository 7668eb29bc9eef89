//! The in-memory driver: runs a kernel session against a model and tools in this thread, with
//! time simulated by the latencies they report. The design reference's programs, the scenarios A-H, the
//! random-model workload and the benchmarks run here; the durable driver must give the same
//! figures for the same scripted model.

use crate::kernel::{Action, Budget, Catalog, Session, Span, StopReason, TaskState};
use crate::model::pyrandom::PyRandom;
use crate::model::{Model, ModelProfile, RandomModel};
pub use crate::tools::DemoStore;
use crate::tools::{Tools, effects_to_python};

pub mod demos;

/// Drives `session` until it finishes (or suspends). Returns the stop reason.
pub fn drive(
    session: &mut Session<'_>,
    model: &mut dyn Model,
    tools: &mut dyn Tools,
) -> StopReason {
    // Every action either ends the loop or advances the session; the cap is a guard against a
    // kernel bug turning into a hang (each step takes at most a handful of actions).
    let cap = 16 * (session.budget().steps_max as usize + 2);
    for _ in 0..cap {
        match session.poll() {
            Action::Model(req) => {
                let reply = model.next(&req);
                session.on_model(reply);
            }
            Action::Tool(req) => {
                let reply = tools.call(&req);
                session.on_tool(reply);
            }
            Action::StepEnd => {}
            Action::Finished(stop) => return stop,
        }
    }
    unreachable!("a session took more than {cap} actions: kernel bug");
}

pub const DEFAULT_USER: &str = "cu_ana";
pub const DEFAULT_GOAL: &str = "refund the damaged item on order ord_1001";

/// The outcome of one in-memory run.
pub struct RunOutput {
    pub state: TaskState,
    pub spans: Vec<Span>,
    pub store: DemoStore,
}

/// The design reference's `go`: a fresh task `t1` for Ana, run to its end.
pub fn go(model: &mut dyn Model, budget: Budget, store: DemoStore) -> RunOutput {
    let catalog = Catalog::demo();
    go_with(
        model,
        budget,
        store,
        &catalog,
        TaskState::new("t1", DEFAULT_USER, DEFAULT_GOAL),
    )
}

pub fn go_with(
    model: &mut dyn Model,
    budget: Budget,
    mut store: DemoStore,
    catalog: &Catalog,
    state: TaskState,
) -> RunOutput {
    let mut session = Session::start(state, budget, catalog, 0);
    drive(&mut session, model, &mut store);
    let (state, trace) = session.into_parts();
    RunOutput {
        state,
        spans: trace.spans,
        store,
    }
}

/// Continues a suspended or held task from a saved state against `store`.
pub fn resume(
    model: &mut dyn Model,
    budget: Budget,
    store: &mut DemoStore,
    state: TaskState,
) -> (TaskState, Vec<Span>) {
    let catalog = Catalog::demo();
    let mut session = Session::resume(state, budget, &catalog, 0);
    drive(&mut session, model, store);
    let (state, trace) = session.into_parts();
    (state, trace.spans)
}

/// One of the design reference's scenarios, as data, so the durable worker can enqueue the same ones.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub model: ModelProfile,
    pub budget: Budget,
    /// Tool latency overrides of the store, in milliseconds.
    pub tool_latency: Vec<(&'static str, u64)>,
}

impl Scenario {
    pub fn store(&self) -> DemoStore {
        let mut s = DemoStore::new();
        for (tool, ms) in &self.tool_latency {
            s = s.with_latency(tool, *ms);
        }
        s
    }

    pub fn run(&self) -> RunOutput {
        go(&mut self.model.build(), self.budget, self.store())
    }
}

/// Scenarios A-H of the design reference.
pub fn scenarios() -> Vec<Scenario> {
    let d = Budget::default();
    let s = |name, model, budget, tool_latency| Scenario {
        name,
        model,
        budget,
        tool_latency,
    };
    let policy = |order: &str, amount, latency_ms| ModelProfile::Policy {
        order: order.into(),
        amount_cents: amount,
        latency_ms,
    };
    vec![
        s("A normal run", ModelProfile::policy(), d, vec![]),
        s(
            "B same call repeated",
            ModelProfile::SameCall { latency_ms: 1500 },
            d,
            vec![],
        ),
        s(
            "C new ids every step",
            ModelProfile::NewIds { latency_ms: 1500 },
            d,
            vec![],
        ),
        s(
            "D large results",
            ModelProfile::SearchLoop { latency_ms: 1500 },
            Budget {
                stalls_max: 10,
                tool_calls_max: 20,
                steps_max: 20,
                ..d
            },
            vec![],
        ),
        s(
            "E slow model calls",
            policy("ord_1001", 3000, 6000),
            d,
            vec![],
        ),
        s(
            "F step cap too low",
            ModelProfile::policy(),
            Budget { steps_max: 3, ..d },
            vec![],
        ),
        s(
            "G refund needs approval",
            policy("ord_1004", 8000, 1500),
            d,
            vec![],
        ),
        s(
            "H write times out",
            ModelProfile::policy(),
            d,
            vec![("issue_refund", 40_000)],
        ),
    ]
}

pub const SCENARIO_HEADER: &str =
    "scenario                 stop             steps tools tokens   secs  effects";

/// One row of the design reference's scenario table.
pub fn scenario_row(name: &str, state: &TaskState, effects: &str) -> String {
    format!(
        "{:24} {:16} {:5} {:5} {:6} {:6.1}  {}",
        name,
        state.stop.map_or("-", StopReason::as_str),
        state.step,
        state.tool_calls,
        state.tokens,
        state.elapsed_ms as f64 / 1000.0,
        effects
    )
}

/// The whole scenario table, run in memory.
pub fn scenario_table() -> String {
    let mut out = String::from(SCENARIO_HEADER);
    out.push('\n');
    for sc in scenarios() {
        let r = sc.run();
        out.push_str(&scenario_row(
            sc.name,
            &r.state,
            &effects_to_python(&r.store.effects),
        ));
        out.push('\n');
    }
    out
}

/// Summary of the design reference's random-model workload.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RandomSummary {
    pub runs: u64,
    pub steps: u64,
    pub violations: u64,
    pub worst_step: u32,
    pub worst_tool_calls: u32,
    pub worst_tokens: u64,
    pub worst_elapsed_ms: u64,
    /// Count per stop reason, most common first (ties in first-seen order, as Counter prints).
    pub stops: Vec<(StopReason, u64)>,
}

/// Runs `random_demo.py`'s workload for seeds `seeds`: one random model per seed, fresh store.
pub fn random_workload(seeds: std::ops::Range<u64>, budget: Budget) -> RandomSummary {
    let catalog = Catalog::demo();
    let mut sum = RandomSummary::default();
    let mut counts: Vec<(StopReason, u64)> = Vec::new();
    // Generators are seeded sixteen at a time (the same numbers as one by one, faster).
    const LANES: usize = 16;
    let mut next = seeds.start;
    while next < seeds.end {
        let lanes = (seeds.end - next).min(LANES as u64) as usize;
        let rngs = PyRandom::many(std::array::from_fn::<u64, LANES, _>(|l| {
            next.wrapping_add(l as u64)
        }));
        next += lanes as u64;
        for rng in rngs.into_iter().take(lanes) {
            let mut model = RandomModel::from_rng(rng);
            let r = go_with(
                &mut model,
                budget,
                DemoStore::new(),
                &catalog,
                TaskState::new("t1", DEFAULT_USER, DEFAULT_GOAL),
            );
            let st = &r.state;
            sum.runs += 1;
            sum.steps += st.step as u64;
            sum.worst_step = sum.worst_step.max(st.step);
            sum.worst_tool_calls = sum.worst_tool_calls.max(st.tool_calls);
            sum.worst_tokens = sum.worst_tokens.max(st.tokens);
            sum.worst_elapsed_ms = sum.worst_elapsed_ms.max(st.elapsed_ms);
            let ok = st.stop.is_some()
                && st.step <= budget.steps_max
                && st.tool_calls <= budget.tool_calls_max
                && st.tokens <= budget.tokens_max
                && st.elapsed_ms <= budget.deadline_ms
                && r.store.refunds_within_totals();
            sum.violations += u64::from(!ok);
            if let Some(stop) = st.stop {
                match counts.iter_mut().find(|(s, _)| *s == stop) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((stop, 1)),
                }
            }
        }
    }
    // Stable sort: equal counts keep first-seen order, like collections.Counter.most_common.
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    sum.stops = counts;
    sum
}
