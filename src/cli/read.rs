//! The read verbs: list, show, trace, postmortem and events; each with `--json` (replay is
//! `replay.rs`).

use super::*;
use crate::clock::{ago, parse_when, rfc3339};
use crate::store::list::{ListQuery, Listed, Page, TaskSummary, task_num};

fn record_json(r: &TaskRecord) -> Value {
    json!({
        "id": r.id,
        "status": r.status.as_str(),
        "stop": r.state.stop.map(|s| s.as_str()),
        "outcome": r.state.outcome,
        "user": r.state.user_id,
        "goal": r.state.goal,
        "priority": r.priority,
        "key": r.key,
        "steps": r.state.step,
        "tool_calls": r.state.tool_calls,
        "tokens": r.state.tokens,
        "elapsed_s": r.state.elapsed_ms as f64 / 1000.0,
        "runs": r.runs,
        "created_at": rfc3339(r.created_at_ms),
        "updated_at": rfc3339(r.updated_at_ms),
        "created_at_ms": r.created_at_ms,
        "updated_at_ms": r.updated_at_ms,
    })
}

/// A task's line of `list --json`: the API's, with its stop reason as stored and the times
/// also in ms.
fn summary_json(t: &TaskSummary) -> Value {
    let mut v = crate::store::result::summary_json(t, t.stop);
    v["created_at_ms"] = json!(t.created_at_ms);
    v["updated_at_ms"] = json!(t.updated_at_ms);
    v
}

/// A stop as a person reads it: a final answer that could not complete the goal says so
/// (`done: cannot_complete`), so it is never taken for a completed task.
fn stop_shown(stop: Option<StopReason>, outcome: Option<&str>) -> String {
    match (stop, outcome) {
        (Some(StopReason::Done), Some("cannot_complete")) => "done: cannot_complete".into(),
        (Some(s), _) => s.as_str().into(),
        (None, _) => "-".into(),
    }
}

fn parse_status(s: &str) -> Result<QueueStatus, CliError> {
    QueueStatus::parse(s).ok_or_else(|| {
        CliError::usage(format!("--status {s:?} is not a status"))
            .hint("use queued, running, suspended, held, finished or damaged")
    })
}

pub(super) fn cmd_list(cli: &Cli, a: &ListArgs) -> CliResult {
    let now = now_ms();
    let q = list_query(a, now)?;
    let store = open_reader(cli)?;
    if a.status.as_deref() == Some("damaged") {
        // Quarantined records: found by reading every task, as `worker check` does.
        let damaged = store.damaged()?;
        if a.json {
            let v: Vec<Value> = damaged
                .iter()
                .map(|(id, why)| json!({"id": id, "status": "damaged", "error": why}))
                .collect();
            return print_json(&Value::Array(v));
        }
        for (id, why) in &damaged {
            outln!("{id:8} damaged    {why}");
        }
        return Ok(());
    }
    let page = store.list(&q)?;
    if a.json {
        let v: Vec<Value> = page
            .tasks
            .iter()
            .map(|l| match l {
                Listed::Task(t) => summary_json(t),
                Listed::Damaged { id, error } => {
                    json!({"id": id, "status": "damaged", "error": error})
                }
            })
            .collect();
        print_json(&Value::Array(v))?;
    } else {
        print_table(&page, now)?;
    }
    if let Some(n) = page.next {
        // On stderr, so a pipe of the table gets rows only.
        eprintln!("more: worker list --before t{n} (with the same filters)");
    }
    Ok(())
}

/// The query `worker list`'s flags ask for, or what is wrong with them.
fn list_query(a: &ListArgs, now: u64) -> Result<ListQuery, CliError> {
    let when = |flag: &str, v: &Option<String>| -> Result<Option<u64>, CliError> {
        v.as_deref()
            .map(|t| parse_when(t, now).map_err(|e| CliError::usage(format!("{flag}: {e}"))))
            .transpose()
    };
    if !(1..=crate::store::list::LIMIT_MAX).contains(&a.limit) {
        return Err(CliError::usage(format!(
            "--limit {} is out of range: use 1 to {}",
            a.limit,
            crate::store::list::LIMIT_MAX
        )));
    }
    let before = match &a.before {
        Some(c) => Some(task_num(c).ok_or_else(|| {
            CliError::usage(format!("--before {c:?} is not a task id (like t950)"))
        })?),
        None => None,
    };
    let stop = match &a.stop {
        Some(s) => Some(StopReason::parse(s).ok_or_else(|| {
            let all: Vec<&str> = crate::kernel::state::STOP_REASONS
                .iter()
                .map(|r| r.as_str())
                .collect();
            CliError::usage(format!("--stop {s:?} is not a stop reason"))
                .hint(format!("use one of {}", all.join(", ")))
        })?),
        None => None,
    };
    let status = match a.status.as_deref() {
        Some("damaged") | None => None,
        Some(s) => Some(parse_status(s)?),
    };
    let outcome = match a.outcome.as_deref() {
        None => None,
        Some(o @ ("completed" | "cannot_complete")) => Some(o.to_string()),
        Some(o) => {
            return Err(
                CliError::usage(format!("--outcome {o:?} is not an outcome"))
                    .hint("use completed or cannot_complete"),
            );
        }
    };
    Ok(ListQuery {
        status,
        stop,
        outcome,
        user: a.user.clone(),
        key: a.key.clone(),
        since_ms: when("--since", &a.since)?,
        until_ms: when("--until", &a.until)?,
        before,
        limit: a.limit,
    })
}

/// `worker list` as a table, one line per task.
fn print_table(page: &Page, now: u64) -> CliResult {
    outln!(
        "{:8} {:10} {:16} {:>5} {:>5} {:>6} {:>6}  {:10} {:9} goal",
        "id",
        "status",
        "stop",
        "steps",
        "tools",
        "tokens",
        "secs",
        "user",
        "created"
    );
    for l in &page.tasks {
        match l {
            Listed::Task(t) => {
                let goal: String = t.goal.chars().take(48).collect();
                let goal = crate::limits::one_line(&goal);
                outln!(
                    "{:8} {:10} {:16} {:>5} {:>5} {:>6} {:>6.1}  {:10} {:9} {}",
                    t.id,
                    t.shown_status(now),
                    stop_shown(t.stop, t.outcome.as_deref()),
                    t.steps,
                    t.tool_calls,
                    t.tokens,
                    t.elapsed_ms as f64 / 1000.0,
                    t.user,
                    ago(t.created_at_ms, now),
                    goal
                );
            }
            Listed::Damaged { id, error } => outln!("{id:8} damaged    {error}"),
        }
    }
    Ok(())
}

/// `worker show --json`: the task's record with its state, budget, model, closing message,
/// cause, calls and held call.
fn show_json(store: &dyn Backend, r: &TaskRecord, closing: String) -> Value {
    let b = &r.budget;
    let mut v = record_json(r);
    v["state"] = serde_json::from_str(&r.state.to_json()).unwrap_or(Value::Null);
    v["budget"] = serde_json::to_value(b).unwrap_or(Value::Null);
    v["model"] = serde_json::to_value(&r.model).unwrap_or(Value::Null);
    v["closing_message"] = Value::String(closing);
    v["turn"] = json!(r.state.turn());
    // Why it stopped, in plain words (null while it runs and once it completed).
    v["cause"] =
        json!(crate::kernel::report::why_stopped(&r.state, b).filter(|_| r.status.is_settled()));
    v["calls"] = match store.calls(&r.id) {
        Ok(calls) => serde_json::to_value(calls).unwrap_or(Value::Null),
        Err(e) => json!({"error": e.to_string()}),
    };
    if let Some(p) = &r.state.pending {
        v["held"] = json!({"tool": p.name, "args": p.args,
            "key": store.call_key(r, p), "digest": p.digest()});
    }
    if let Some(q) = crate::store::result::question_json(store.db_id(), r) {
        v["question"] = q;
    }
    v
}

pub(super) fn cmd_show(cli: &Cli, a: &TaskArgs) -> CliResult {
    let store = open_reader(cli)?;
    let r = store.task(&store.resolve(&a.task)?)?;
    let catalog = r.catalog.as_deref().cloned().unwrap_or_else(Catalog::demo);
    let closing = closing_explained(&r.state, &r.budget, &catalog);
    let b = &r.budget;
    if a.json {
        return print_json(&show_json(store.as_ref(), &r, closing));
    }
    let st = &r.state;
    outln!(
        "task      {}  ({}; {} run(s))",
        r.id,
        r.status.as_str(),
        r.runs
    );
    outln!("user      {}", crate::limits::one_line(&st.user_id));
    outln!("goal      {}", crate::limits::one_line(&st.goal));
    print_conversation(&r)?;
    outln!(
        "created   {}  updated {}",
        rfc3339(r.created_at_ms),
        rfc3339(r.updated_at_ms)
    );
    // Queued or running again (after a decision or an answer), the last stop is history.
    let settled = r.status.is_settled();
    let stop = st.stop.filter(|_| settled);
    outln!("stop      {}", stop_shown(stop, st.outcome.as_deref()));
    if let Some(ans) = &st.answer {
        outln!("answer    {}", crate::limits::one_line(ans));
    }
    outln!("plan");
    if st.plan.is_empty() {
        outln!("  (none)");
    }
    for s in &st.plan {
        outln!(
            "  {:4} {:18} {:8} after {:?}",
            s.id,
            s.tool,
            s.status.as_str(),
            s.depends_on
        );
    }
    outln!("budget    used / limit");
    outln!("  steps       {:>6} / {}", st.step, b.steps_max);
    outln!("  tool calls  {:>6} / {}", st.tool_calls, b.tool_calls_max);
    outln!("  tokens      {:>6} / {}", st.tokens, b.tokens_max);
    outln!(
        "  active s    {:>6.1} / {:.1}",
        st.elapsed_ms as f64 / 1000.0,
        b.deadline_ms as f64 / 1000.0
    );
    outln!("  stalls      {:>6} / {}", st.stalls, b.stalls_max);
    print_waiting(store.as_ref(), &r, settled, &closing)?;
    print_say(&r)
}

/// `worker show`'s conversation, once a person continued the task: its turn and the messages
/// after the goal.
fn print_conversation(r: &TaskRecord) -> CliResult {
    let st = &r.state;
    if !st.conversation.is_empty() {
        let most = crate::kernel::conversation::TURNS_MAX;
        outln!("turn      {} (of at most {most})", st.turn());
        for m in &st.conversation {
            let text: String = m.text.chars().take(200).collect();
            outln!(
                "  {:5}   {}",
                m.role.as_str(),
                crate::limits::one_line(&text)
            );
        }
    }
    Ok(())
}

/// How to continue a finished task that can take a follow-up message.
fn print_say(r: &TaskRecord) -> CliResult {
    let st = &r.state;
    if r.why_no_message(crate::clock::now_ms()).is_none() {
        outln!(
            "say       worker say {} --turn {} --text '...'   (continues it)",
            r.id,
            st.turn()
        );
    }
    Ok(())
}

/// `worker show`'s last lines: what the task waits for (a question, or the held call), and
/// its closing message once it has stopped or waits.
fn print_waiting(store: &dyn Backend, r: &TaskRecord, settled: bool, closing: &str) -> CliResult {
    let st = &r.state;
    if let Some(q) = crate::store::result::question(r) {
        outln!("question  {}", crate::limits::one_line(&q.text));
        if !q.choices.is_empty() {
            outln!(
                "choices   {}",
                crate::limits::one_line(&q.choices.join(" | "))
            );
        }
        let key = r.state.pending.as_ref().map(|p| store.call_key(r, p));
        outln!(
            "answer it `worker answer {} --key {} --text ANSWER`",
            r.id,
            key.unwrap_or_default()
        );
    } else if let Some(p) = st
        .pending
        .as_ref()
        .filter(|_| crate::store::result::waiting_for(r).is_some() || st.unknown_write().is_some())
    {
        outln!(
            "held      {} {} key {} digest {}",
            p.name,
            Value::Object(p.args.clone()),
            store.call_key(r, p),
            p.digest()
        );
    }
    if settled {
        outln!("closing   {closing}");
    } else {
        outln!(
            "closing   (none yet: the task is {}; `worker wait {}` waits for it)",
            r.status.as_str(),
            r.id
        );
    }
    Ok(())
}

pub(super) fn cmd_trace(cli: &Cli, a: &TraceArgs) -> CliResult {
    let store = open_reader(cli)?;
    let rec = store.task(&store.resolve(&a.task)?)?;
    let spans = store.spans(&rec.id)?;
    if let Some(path) = &a.otlp {
        // The model and provider of a profile, as this config names them.
        let model = super::enqueue::load_config(cli)?.and_then(|c| c.model_for(&rec.model).ok());
        let replies = store.replies(&rec.id)?;
        let db = store.db_id();
        let http = model.as_ref().and_then(crate::model::RunModel::http);
        let trace = crate::otlp::trace_of(db, &rec, &spans, &replies, http);
        let doc = crate::otlp::json::request(&crate::otlp::resource(db), &trace);
        std::fs::write(path, format!("{doc}\n"))
            .map_err(|e| CliError::op(format!("cannot write {}: {e}", path.display())))?;
        outln!("{} spans written to {}", trace.len(), path.display());
        return Ok(());
    }
    if a.json {
        print_json(&serde_json::to_value(&spans).unwrap_or(Value::Null))?;
    } else {
        out!("{}", span_table(&spans));
    }
    Ok(())
}

pub(super) fn cmd_postmortem(cli: &Cli, a: &TaskArgs) -> CliResult {
    let store = open_reader(cli)?;
    let r = store.task(&store.resolve(&a.task)?)?;
    // The first model call that gave no move, from the recorded replies.
    let first_model_error = store.replies(&r.id)?.into_iter().find_map(|rep| {
        use crate::model::RecordedOutcome as O;
        match rep.outcome {
            O::Failed(m) | O::Refused(m) | O::Fatal(m) | O::Invalid(m) => Some((rep.step, m)),
            O::Timeout => Some((rep.step, crate::kernel::ModelError::Timeout.detail().into())),
            O::Json(_) | O::Text(_) => None,
        }
    });
    let pm =
        crate::kernel::report::postmortem_with(&r.state, &store.spans(&r.id)?, first_model_error);
    if a.json {
        print_json(&serde_json::to_value(&pm).unwrap_or(Value::Null))?;
    } else {
        out!("{}", postmortem_text(&r, &pm));
    }
    Ok(())
}

/// The post-mortem for people: what the task did, why it stopped, and what to do next.
fn postmortem_text(r: &TaskRecord, pm: &crate::kernel::report::Postmortem) -> String {
    use crate::kernel::report::why_stopped;
    let st = &r.state;
    let stop = stop_shown(st.stop, st.outcome.as_deref());
    let mut out = format!("task {}: {stop} after {} step(s)\n", r.id, pm.steps);
    if let Some(why) = why_stopped(st, &r.budget).filter(|_| r.status.is_settled()) {
        out.push_str(&format!("{:18} {why}\n", "why"));
    }
    let first_error = match &pm.first_error {
        Some((tool, status)) => format!("{tool} ({status})"),
        None => "none".into(),
    };
    out.push_str(&format!("{:18} {first_error}\n", "first tool error"));
    if let Some((step, why)) = &pm.first_model_error {
        out.push_str(&format!(
            "{:18} step {step}: {}\n",
            "first model error",
            crate::limits::one_line(why)
        ));
    }
    if let Some(((tool, args), n)) = &pm.most_repeated {
        out.push_str(&format!(
            "{:18} {tool} {args}, {n} time(s)\n",
            "most repeated call"
        ));
    }
    out.push_str(&format!(
        "{:18} model {:.1} s, tools {:.1} s\n",
        "time",
        pm.model_ms as f64 / 1000.0,
        pm.tool_ms as f64 / 1000.0
    ));
    out.push_str(&format!("{:18} {}\n", "next", next_action(r)));
    out
}

/// Whether the task's stop stands: it is neither queued nor running (an approved task is
/// queued again, and its last stop no longer says what it waits for).
/// What an operator can do about a task that stopped this way.
fn next_action(r: &TaskRecord) -> String {
    use crate::kernel::StopReason as S;
    let (id, st) = (&r.id, &r.state);
    if !r.status.is_settled() {
        return format!(
            "nothing yet: it is {} (`worker wait {id}`)",
            r.status.as_str()
        );
    }
    let digest = st.pending.as_ref().map_or(String::new(), |p| p.digest());
    let settle = |after: &str| {
        format!(
            "find out whether the write took effect, then settle it: `worker reconcile {id} --applied` or `--not-applied` ({after})"
        )
    };
    match st.stop {
        None => format!("nothing yet: it has not run (`worker wait {id}`)"),
        Some(S::Done) if st.outcome.as_deref().is_none_or(|o| o == "completed") => {
            "nothing: the task is complete".into()
        }
        Some(S::Done) => "read its answer (`worker show`); enqueue a new task if the goal still stands".into(),
        Some(S::NeedsApproval) => format!(
            "approve or reject the held call: `worker approve {id} --digest {digest}` (`--extend` grants more budget) or `worker reject {id} --digest {digest}`"
        ),
        Some(S::NeedsAnswer) => format!(
            "answer its question: `worker answer {id} --text ANSWER` (the task goes on with your words)"
        ),
        Some(S::UnknownOutcome) => settle("the task goes on from there"),
        Some(S::Cancelled | S::TimedOut) if st.unknown_write().is_some() => {
            settle("the task stays stopped")
        }
        Some(S::Cancelled | S::TimedOut | S::ApprovalExpired | S::QuestionExpired) => {
            "nothing is held; enqueue the goal again if it still stands".into()
        }
        Some(S::Expired) => "nothing ran; enqueue it again, with a longer --ttl if it waited too long".into(),
        Some(S::MaxSteps | S::MaxToolCalls | S::MaxTokens | S::Deadline) => {
            "enqueue the goal again with a larger budget (`worker enqueue --budget NAME=VALUE`), or look at where the steps went (`worker trace`)".into()
        }
        Some(S::RepeatedCall | S::NoProgress) => {
            "look at what the model answered (`worker trace`, `worker show --json`): its instructions, its model or the tools' descriptions may need a change before the goal is enqueued again".into()
        }
        Some(S::ModelFailed) => {
            "fix what the model's error says (its key, its address, its limits), then enqueue the goal again".into()
        }
    }
}

pub(super) fn cmd_events(cli: &Cli, a: &EventsArgs) -> CliResult {
    let store = open_reader(cli)?;
    let task = match &a.task {
        Some(t) => Some(store.task(&store.resolve(t)?)?.id),
        None => None,
    };
    let events = store.events(task.as_deref())?;
    if a.json {
        print_json(&serde_json::to_value(&events).unwrap_or(Value::Null))?;
        return Ok(());
    }
    for e in &events {
        outln!(
            "{:5} {} {:8} {:22} by {:10} {}  {}",
            e.seq,
            rfc3339(e.at_ms),
            e.task.as_deref().unwrap_or("-"),
            e.verb,
            e.by,
            e.reason.as_deref().map_or(String::new(), |r| format!(
                "({})",
                crate::limits::one_line(r)
            )),
            e.detail
        );
    }
    Ok(())
}
