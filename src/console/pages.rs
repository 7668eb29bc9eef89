//! The console's pages: askama templates (`templates/`, checked at compile time) and the view
//! models they render, built from the operator API. Every value is escaped by the template;
//! nothing here writes.

use askama::Template;
use serde_json::Value;

use crate::clock::{ago, now_ms, rfc3339};
use crate::kernel::report::closing_explained;
use crate::kernel::{Catalog, SpanKind};
use crate::operator::{HeldWrite, TaskDetail};
use crate::store::QueueStatus;
use crate::store::list::{Listed, Page, STATUSES};

/// Who is signed in and which database the console shows: in every page's header.
pub struct Frame {
    pub operator: String,
    pub db: String,
}

/// The task list's filters as the form shows them.
#[derive(Default)]
pub struct Filters {
    pub status: String,
    pub stop: String,
    /// A finished task's outcome: `completed`, `cannot_complete` or empty (any).
    pub outcome: String,
    pub user: String,
    pub key: String,
    pub since: String,
    pub until: String,
}

pub struct Row {
    id: String,
    status: &'static str,
    stop: String,
    steps: u32,
    tools: u32,
    tokens: u64,
    secs: String,
    user: String,
    created: String,
    ago: String,
    goal: String,
}

#[derive(Template)]
#[template(path = "tasks.html")]
pub struct TasksPage {
    operator: String,
    db: String,
    counts: Vec<(&'static str, u64)>,
    statuses: Vec<&'static str>,
    outcomes: [&'static str; 2],
    f: Filters,
    rows: Vec<Row>,
    next: Option<String>,
    error: Option<String>,
}

impl TasksPage {
    pub fn new(
        frame: Frame,
        counts: &[(QueueStatus, u64)],
        f: Filters,
        page: &Page,
        next: Option<String>,
        error: Option<String>,
    ) -> TasksPage {
        let now = now_ms();
        let rows = page
            .tasks
            .iter()
            .map(|l| match l {
                Listed::Task(t) => Row {
                    id: t.id.clone(),
                    status: t.shown_status(now),
                    stop: match (t.stop, t.outcome.as_deref()) {
                        (_, Some("cannot_complete")) => "done: cannot_complete".into(),
                        (s, _) => s.map_or("-", |s| s.as_str()).into(),
                    },
                    steps: t.steps,
                    tools: t.tool_calls,
                    tokens: t.tokens,
                    secs: format!("{:.1}", t.elapsed_ms as f64 / 1000.0),
                    user: t.user.clone(),
                    created: rfc3339(t.created_at_ms),
                    ago: ago(t.created_at_ms, now),
                    goal: t.goal.chars().take(80).collect(),
                },
                Listed::Damaged { id, error } => Row {
                    id: id.clone(),
                    status: "damaged",
                    stop: "-".into(),
                    steps: 0,
                    tools: 0,
                    tokens: 0,
                    secs: String::new(),
                    user: String::new(),
                    created: String::new(),
                    ago: String::new(),
                    goal: error.clone(),
                },
            })
            .collect();
        TasksPage {
            operator: frame.operator,
            db: frame.db,
            counts: counts.iter().map(|(s, n)| (s.as_str(), *n)).collect(),
            statuses: STATUSES.iter().map(|s| s.as_str()).collect(),
            outcomes: ["completed", "cannot_complete"],
            f,
            rows,
            next,
            error,
        }
    }
}

pub struct TaskView {
    id: String,
    status: &'static str,
    stop: &'static str,
    /// The final answer's outcome (completed, cannot_complete) and the answer, once there is one.
    outcome: String,
    answer: Option<String>,
    user: String,
    goal: String,
    key: String,
    runs: u32,
    created: String,
    updated: String,
    closing: String,
    /// The record's last change, which a cancel form carries back.
    seen: u64,
    /// The turn of its conversation, and the messages after the goal: (who, text).
    turn: u32,
    conversation: Vec<(&'static str, String)>,
    /// It finished and can take a follow-up message.
    can_say: bool,
}

pub struct HeldView {
    tool: String,
    args: String,
    key: String,
    digest: String,
    /// A held write (outcome unknown) rather than a call waiting for approval.
    unknown: bool,
    /// The task is where a decision applies (suspended or held, not cancelled).
    actionable: bool,
}

/// The question a task waits to have answered, and the form's binding to it.
pub struct QuestionView {
    text: String,
    choices: Vec<String>,
    key: String,
    digest: String,
}

pub struct PlanRow {
    id: String,
    tool: String,
    status: &'static str,
    deps: String,
}

pub struct BudgetBar {
    name: &'static str,
    used: String,
    limit: String,
    pct: u32,
    over: bool,
}

pub struct SpanBar {
    kind: &'static str,
    name: String,
    status: String,
    ms: u64,
    left: String,
    width: String,
    indent: u32,
}

pub struct EventRow {
    seq: u64,
    at: String,
    verb: String,
    by: String,
    reason: String,
    detail: String,
}

#[derive(Template)]
#[template(path = "task.html")]
pub struct TaskPage {
    operator: String,
    db: String,
    t: TaskView,
    flash: Option<String>,
    held: Option<HeldView>,
    question: Option<QuestionView>,
    can_cancel: bool,
    csrf: String,
    plan: Vec<PlanRow>,
    budgets: Vec<BudgetBar>,
    total_ms: u64,
    spans: Vec<SpanBar>,
    facts: String,
    replies: Vec<(u32, u64, String)>,
    events: Vec<EventRow>,
}

fn bar(name: &'static str, used: u64, limit: u64, shown: impl Fn(u64) -> String) -> BudgetBar {
    let pct = used
        .saturating_mul(100)
        .checked_div(limit)
        .map_or(100, |p| p.min(100) as u32);
    BudgetBar {
        name,
        used: shown(used),
        limit: shown(limit),
        pct,
        over: used >= limit,
    }
}

impl TaskView {
    fn of(r: &crate::store::TaskRecord, catalog: &Catalog) -> TaskView {
        let st = &r.state;
        TaskView {
            id: r.id.clone(),
            status: r.status.as_str(),
            stop: st.stop.map_or("-", |s| s.as_str()),
            outcome: st.outcome.clone().unwrap_or_else(|| "-".into()),
            answer: st.answer.clone(),
            user: st.user_id.clone(),
            goal: st.goal.clone(),
            key: r.key.clone().unwrap_or_else(|| "-".into()),
            runs: r.runs,
            created: rfc3339(r.created_at_ms),
            updated: rfc3339(r.updated_at_ms),
            closing: closing_explained(st, &r.budget, catalog),
            seen: r.updated_at_ms,
            turn: st.turn(),
            conversation: (st.conversation.iter())
                .map(|m| (m.role.as_str(), m.text.clone()))
                .collect(),
            can_say: r.why_no_message(crate::clock::now_ms()).is_none(),
        }
    }
}

impl TaskPage {
    pub fn new(frame: Frame, d: &TaskDetail, csrf: String, flash: Option<String>) -> TaskPage {
        let r = &d.record;
        let st = &r.state;
        let catalog = r.catalog.as_deref().cloned().unwrap_or_else(Catalog::demo);
        let question = crate::store::result::question(r).map(|q| QuestionView {
            text: q.text,
            choices: q.choices,
            key: d.pending_key.clone().unwrap_or_default(),
            digest: st.pending.as_ref().map(|p| p.digest()).unwrap_or_default(),
        });
        let held = st
            .pending
            .as_ref()
            .filter(|_| question.is_none())
            .map(|p| HeldView {
                tool: p.name.clone(),
                args: Value::Object(p.args.clone()).to_string(),
                key: d.pending_key.clone().unwrap_or_default(),
                digest: p.digest(),
                unknown: r.status == QueueStatus::Held
                    || st.stop == Some(crate::kernel::StopReason::UnknownOutcome)
                    || (r.status == QueueStatus::Finished && st.outcome.is_some()),
                actionable: matches!(r.status, QueueStatus::Suspended | QueueStatus::Held),
            });
        let budgets = budget_bars(st, &r.budget);
        let (total_ms, spans) = waterfall(&d.spans);
        let events = d.events.iter().map(EventRow::of).collect();
        let replies = d
            .replies
            .iter()
            .map(|rep| {
                let text = serde_json::to_string(rep).unwrap_or_default();
                (rep.step, rep.latency_ms, text.chars().take(2000).collect())
            })
            .collect();
        TaskPage {
            operator: frame.operator,
            db: frame.db,
            t: TaskView::of(r, &catalog),
            flash,
            can_cancel: r.status != QueueStatus::Finished,
            held,
            question,
            csrf,
            plan: st
                .plan
                .iter()
                .map(|p| PlanRow {
                    id: p.id.clone(),
                    tool: p.tool.clone(),
                    status: p.status.as_str(),
                    deps: p.depends_on.join(", "),
                })
                .collect(),
            budgets,
            total_ms,
            spans,
            facts: serde_json::to_string_pretty(&st.facts).unwrap_or_default(),
            replies,
            events,
        }
    }
}

/// One bar per budget: used against its limit.
fn budget_bars(st: &crate::kernel::TaskState, b: &crate::kernel::Budget) -> Vec<BudgetBar> {
    let secs = |ms: u64| format!("{:.1} s", ms as f64 / 1000.0);
    let n = |v: u64| v.to_string();
    vec![
        bar("steps", st.step.into(), b.steps_max.into(), n),
        bar(
            "tool calls",
            st.tool_calls.into(),
            b.tool_calls_max.into(),
            n,
        ),
        bar("tokens", st.tokens, b.tokens_max, n),
        bar("active time", st.elapsed_ms, b.deadline_ms, secs),
        bar("stalled steps", st.stalls.into(), b.stalls_max.into(), n),
    ]
}

/// The waterfall: each span placed on the task's active time, indented by depth; and that
/// time.
fn waterfall(all: &[crate::kernel::Span]) -> (u64, Vec<SpanBar>) {
    let total_ms = (all.iter().map(|s| s.t1_ms.unwrap_or(s.t0_ms)))
        .max()
        .unwrap_or(0)
        .max(1);
    let depth = |mut id: Option<u32>| {
        let mut n = 0;
        while let Some(p) = id.and_then(|i| all.iter().find(|s| s.id == i)) {
            n += 1;
            id = p.parent;
            if n > 16 {
                break;
            }
        }
        n
    };
    let spans = all
        .iter()
        .map(|s| {
            let left = s.t0_ms as f64 * 100.0 / total_ms as f64;
            let width = (s.duration_ms() as f64 * 100.0 / total_ms as f64).max(0.4);
            SpanBar {
                kind: s.kind.as_str(),
                name: match (&s.kind, &s.key) {
                    (SpanKind::Tool, Some(k)) => format!("{} ({k})", s.name),
                    _ => s.name.to_string(),
                },
                status: s.status.to_string(),
                ms: s.duration_ms(),
                left: format!("{left:.2}"),
                width: format!("{:.2}", width.min(100.0 - left).max(0.4)),
                indent: 8 + 14 * depth(s.parent),
            }
        })
        .collect();
    (total_ms, spans)
}

impl EventRow {
    fn of(e: &crate::store::Event) -> EventRow {
        EventRow {
            seq: e.seq,
            at: rfc3339(e.at_ms),
            verb: e.verb.clone(),
            by: e.by.clone(),
            reason: e.reason.clone().unwrap_or_default(),
            detail: e.detail.to_string(),
        }
    }
}

pub struct HeldRow {
    task: String,
    tool: String,
    args: String,
    key: String,
    digest: String,
    since: String,
    known: String,
}

impl HeldRow {
    pub fn of(h: &HeldWrite) -> HeldRow {
        HeldRow {
            task: h.task.clone(),
            tool: h.tool.clone(),
            args: h.args.to_string(),
            key: h.key.clone(),
            digest: h.digest.clone(),
            since: rfc3339(h.since_ms),
            known: match (&h.call_record_error, &h.known) {
                (Some(e), _) => format!("call record unreadable: {e}"),
                (None, Some(v)) => v.to_string(),
                (None, None) => "no answer (in flight at a stop)".into(),
            },
        }
    }
}

#[derive(Template)]
#[template(path = "held.html")]
pub struct HeldPage {
    pub operator: String,
    pub db: String,
    pub csrf: String,
    pub held: Vec<HeldRow>,
    pub suspended: Vec<HeldRow>,
    /// Questions waiting for an answer: (task, question, since).
    pub questions: Vec<(String, String, String)>,
    pub lookup_key: String,
    pub lookup: Option<String>,
}

#[derive(Template)]
#[template(path = "memory.html")]
pub struct MemoryPage {
    pub operator: String,
    pub db: String,
    pub user: String,
    pub notes: Vec<(String, String, String, String)>,
}

#[derive(Template)]
#[template(path = "message.html")]
pub struct MessagePage {
    pub operator: String,
    pub db: String,
    pub heading: String,
    pub message: String,
    pub back: Option<String>,
}

#[derive(Template)]
#[template(path = "login.html")]
pub struct LoginPage {
    pub failed: bool,
}
