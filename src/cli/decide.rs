//! The operators' decisions: approve, reject, reconcile (by hand or `--auto` from the
//! tools' lookups), answer (a task's question to a person) and cancel, each bound to the call the operator reviewed. The work is in
//! [`crate::operator`] and the backend's decisions; this file parses and prints. While a
//! daemon runs on the file, the decision itself is handed to it (`crate::local`), which runs
//! the same function.

use super::*;
use crate::kernel::ToolCall;
use crate::operator::{held_writes, reconcile_auto};

/// What a decision printed as JSON says: the task, the verb, and the call it covered.
fn decided_json(verb: &str, task: &str, call: &ToolCall, key: Option<String>) -> Value {
    json!({
        "task": task,
        "decision": verb,
        "tool": call.name,
        "args": Value::Object(call.args.clone()),
        "digest": call.digest(),
        "key": key,
    })
}

/// Takes a decision: through the daemon that serves the file if one runs, else here, by the
/// same function the daemon runs (`db` is the handle the verb read the task with).
fn take<T: serde::de::DeserializeOwned>(
    cli: &Cli,
    db: &dyn Backend,
    d: &crate::local::Decide,
) -> Result<T, CliError> {
    operator_write(cli, d, Access::Write, Some(db))
}

pub(super) fn cmd_approve(cli: &Cli, a: &ApproveArgs) -> CliResult {
    let d = decision(&a.decide.by, &a.decide.reason)?;
    let reviewed = a.call.reviewed();
    if reviewed.is_empty() {
        return Err(CliError::usage(
            "approve needs --digest or --key of the held call, so the approval covers the call you reviewed",
        )
        .hint(format!(
            "`worker show {}` prints the held call's key and digest",
            a.decide.task
        )));
    }
    let extend = extension(&a.extend)?;
    let db = open_reader(cli)?;
    let task = db.resolve(&a.decide.task)?;
    // The approval is written once, here, with its audit event; the re-sent call carries it
    // to the tool service.
    let asked = crate::local::Decide::Approve {
        task: task.clone(),
        key: reviewed.key.clone(),
        digest: reviewed.digest.clone(),
        extend: extend.0.clone(),
        by: d.by.clone(),
        reason: d.reason.clone(),
    };
    let call: ToolCall = take(cli, &*db, &asked)?;
    if a.decide.json {
        return print_json(&decided_json("approve", &task, &call, reviewed.key));
    }
    outln!(
        "approved {} {} for task {task}; it is queued and runs the call first",
        call.name,
        Value::Object(call.args.clone()),
    );
    Ok(())
}

pub(super) fn cmd_reject(cli: &Cli, a: &RejectArgs) -> CliResult {
    let d = decision(&a.decide.by, &a.decide.reason)?;
    let db = open_reader(cli)?;
    let task = db.resolve(&a.decide.task)?;
    let reviewed = a.call.reviewed();
    let asked = crate::local::Decide::Reject {
        task: task.clone(),
        key: reviewed.key.clone(),
        digest: reviewed.digest.clone(),
        by: d.by.clone(),
        reason: d.reason.clone(),
    };
    let call: ToolCall = take(cli, &*db, &asked)?;
    if a.decide.json {
        return print_json(&decided_json("reject", &task, &call, a.call.key.clone()));
    }
    outln!(
        "rejected {} for task {task}; it is queued and continues without it",
        call.name,
    );
    Ok(())
}

pub(super) fn cmd_answer(cli: &Cli, a: &AnswerArgs) -> CliResult {
    let d = decision(&a.decide.by, &a.decide.reason)?;
    let db = open_reader(cli)?;
    let task = db.resolve(&a.decide.task)?;
    let asked = crate::local::Decide::Answer {
        task: task.clone(),
        text: a.text.clone(),
        key: a.call.key.clone(),
        digest: a.call.digest.clone(),
        by: d.by.clone(),
        reason: d.reason.clone(),
    };
    let q: Value = take(cli, &*db, &asked)?;
    if a.decide.json {
        return print_json(
            &json!({"task": task, "decision": "answer", "question": q, "answer": a.text}),
        );
    }
    outln!(
        "answered task {task}'s question ({}); it is queued and goes on with the answer",
        crate::limits::one_line(q["text"].as_str().unwrap_or_default())
    );
    Ok(())
}

pub(super) fn cmd_say(cli: &Cli, a: &SayArgs) -> CliResult {
    let d = decision(&a.decide.by, &a.decide.reason)?;
    let db = open_reader(cli)?;
    let task = db.resolve(&a.decide.task)?;
    let asked = crate::local::Decide::Say {
        task: task.clone(),
        text: a.text.clone(),
        turn: a.turn,
        by: d.by.clone(),
        reason: d.reason.clone(),
    };
    let said: crate::operator::Said = take(cli, &*db, &asked)?;
    if a.wait {
        eprintln!(
            "task {task} is on turn {}; waiting for its answer",
            said.turn
        );
        let until = a.until.unwrap_or(super::wait::UntilArg::Settled);
        return super::wait::wait_and_report(db.as_ref(), &task, a.timeout, a.decide.json, until);
    }
    if a.decide.json {
        return print_json(&json!({"task": task, "turn": said.turn, "text": said.text}));
    }
    outln!(
        "task {task} is queued for turn {}; `worker wait {task}` prints its answer",
        said.turn
    );
    Ok(())
}

fn list_held(db: &dyn Backend, json: bool) -> CliResult {
    let held = held_writes(db)?;
    if json {
        let v = serde_json::to_value(&held).unwrap_or_default();
        return print_json(&v);
    }
    if held.is_empty() {
        outln!("no held writes");
    }
    for h in &held {
        let known = match (&h.call_record_error, &h.known) {
            (Some(e), _) => format!("its call record is unreadable ({e})"),
            (None, Some(v)) => format!("last answer {v}"),
            (None, None) => "no answer: the worker stopped while the call was in flight".into(),
        };
        let cancelled = if h.status == QueueStatus::Finished {
            "  (task cancelled)"
        } else {
            ""
        };
        outln!(
            "{}  {} {}  key {}  digest {}  since {}  {known}{cancelled}",
            h.task,
            h.tool,
            h.args,
            h.key,
            h.digest,
            crate::clock::rfc3339(h.since_ms),
        );
    }
    Ok(())
}

pub(super) fn cmd_reconcile(cli: &Cli, a: &ReconcileArgs) -> CliResult {
    // The decision itself opens the file for writing only if no daemon takes it.
    let store = if a.auto {
        open_existing(cli)?
    } else {
        open_reader(cli)?
    };
    if a.auto {
        return auto(cli, store.as_ref(), a);
    }
    let Some(task) = &a.task else {
        return list_held(store.as_ref(), a.json);
    };
    // Who and why, and any extension, are checked before anything is asked of a tool.
    let d = decision(&a.by, &a.reason)?;
    let extend = extension(&a.extend)?;
    let task = store.resolve(task)?;
    let settlement = match (a.applied, a.not_applied) {
        (true, _) => {
            let result = match &a.result {
                Some(text) => crate::limits::parse_json_input(
                    text,
                    "--result",
                    crate::limits::OPERATOR_RESULT_BYTES_MAX,
                )
                .map_err(|e| CliError::usage(e.0))?,
                // The model is told what the write returned (a ticket's id), so an applied
                // write is settled with its real result: the tool's lookup gives it.
                None => looked_up_result(cli, &a.shop, store.as_ref(), &task)?,
            };
            Settlement::Applied(result)
        }
        (false, true) => Settlement::NotApplied,
        (false, false) => {
            return Err(CliError::usage(
                "say whether the write took effect: --applied or --not-applied",
            ));
        }
    };
    let reviewed = a.call.reviewed();
    let asked = crate::local::Decide::Reconcile {
        task: task.clone(),
        applied: match &settlement {
            Settlement::Applied(result) => Some(result.clone()),
            Settlement::NotApplied => None,
        },
        key: reviewed.key.clone(),
        digest: reviewed.digest.clone(),
        extend: extend.0.clone(),
        by: d.by.clone(),
        reason: d.reason.clone(),
    };
    let call: ToolCall = take(cli, &*store, &asked)?;
    if a.json {
        let verb = if a.applied {
            "reconcile_applied"
        } else {
            "reconcile_not_applied"
        };
        return print_json(&decided_json(verb, &task, &call, a.call.key.clone()));
    }
    // A task cancelled while its write was held is settled, not run again.
    let cancelled = store
        .task(&task)
        .is_ok_and(|r| r.status == crate::store::QueueStatus::Finished);
    let what = match (a.applied, cancelled) {
        (true, false) => "applied; the task is queued",
        (false, false) => {
            "not applied; it will be sent again under the same key; the task is queued"
        }
        (true, true) => "applied; the task stays cancelled",
        (false, true) => "not applied; the task stays cancelled, so nothing is sent",
    };
    outln!("recorded {} for task {task} as {what}", call.name);
    Ok(())
}

pub(super) fn cmd_cancel(cli: &Cli, a: &DecideArgs) -> CliResult {
    let d = decision(&a.by, &a.reason)?;
    let db = open_reader(cli)?;
    let task = db.resolve(&a.task)?;
    let asked = crate::local::Decide::Cancel {
        task: task.clone(),
        by: d.by.clone(),
        reason: d.reason.clone(),
    };
    let was: QueueStatus = take(cli, &*db, &asked)?;
    if a.json {
        return print_json(&json!({
            "task": task,
            "decision": "cancel",
            "was": was.as_str(),
            "at_next_step_boundary": was == QueueStatus::Running,
        }));
    }
    match was {
        QueueStatus::Running => {
            outln!("task {task} will stop at its next step boundary (cancelled)")
        }
        _ => outln!("task {task} cancelled"),
    }
    Ok(())
}

/// Settles held writes from each tool's lookup, only on a definite answer.
/// The result of task `id`'s held write, from the tool's lookup: for `reconcile --applied`
/// without `--result`. Refused when the lookup cannot give it, or says it was not applied.
fn looked_up_result(
    cli: &Cli,
    shop: &ShopArg,
    store: &dyn Backend,
    id: &str,
) -> Result<Value, CliError> {
    let rec = store.task(id)?;
    let Some(call) = rec.state.unknown_write().cloned() else {
        // Not held: the decision itself says what is wrong.
        return Ok(json!({"status": "ok"}));
    };
    let key = store.call_key(&rec, &call);
    let config = super::enqueue::load_config(cli)?.unwrap_or_default();
    let mut tools = || {
        Ok(Arc::new(DurableStore::open_target(&store_target(
            cli, shop,
        ))?))
    };
    match crate::operator::ask_tool(&rec, &call.name, &key, &config, &mut tools)? {
        crate::tools::http::Lookup::Applied(result) => Ok(result),
        crate::tools::http::Lookup::NotApplied => Err(CliError::op(format!(
            "the lookup of {} says key {key} was not applied",
            call.name
        ))
        .hint("settle it with --not-applied (it is sent again under the same key), or pass --result if you know it was applied")),
        crate::tools::http::Lookup::Unknown(why) => Err(CliError::usage(format!(
            "--applied needs the write's result, and the tool's lookup could not give it ({why})"
        ))
        .hint("pass what the write returned: --result '{\"status\": \"ok\", ...}'")),
    }
}

fn auto(cli: &Cli, store: &dyn Backend, a: &ReconcileArgs) -> CliResult {
    let shop = &a.shop;
    let mut tools = || {
        Ok(Arc::new(DurableStore::open_target(&store_target(
            cli, shop,
        ))?))
    };
    let config = super::enqueue::load_config(cli)?.unwrap_or_default();
    let rows = reconcile_auto(store, &config, &mut tools, &a.by, a.reason.as_deref())?;
    if a.json {
        return print_json(&serde_json::to_value(&rows).unwrap_or_default());
    }
    for r in &rows {
        let what = match r.outcome {
            "applied" => "applied".to_string(),
            "not_applied" => "not applied; will be re-sent under the same key".to_string(),
            _ => format!("left held ({})", r.why.as_deref().unwrap_or("no answer")),
        };
        outln!("{}  {} key {}: {what}", r.task, r.tool, r.key);
    }
    let settled = rows.iter().filter(|r| r.outcome != "left_held").count();
    outln!("{settled} settled, {} left held", rows.len() - settled);
    Ok(())
}
