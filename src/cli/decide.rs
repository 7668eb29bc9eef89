//! The operators' decisions: approve, reject, reconcile (by hand or `--auto` from the
//! tools' lookups) and cancel, each bound to the call the operator reviewed.

use super::*;

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
    // The approval is written once, here, with its audit event; the re-sent call carries it
    // to the tool service.
    let call = open_existing(cli)?.approve(&a.decide.task, &reviewed, &extend, &d)?;
    outln!(
        "approved {} {} for task {}; it is queued and runs the call first",
        call.name,
        Value::Object(call.args.clone()),
        a.decide.task
    );
    Ok(())
}

pub(super) fn cmd_reject(cli: &Cli, a: &RejectArgs) -> CliResult {
    let d = decision(&a.decide.by, &a.decide.reason)?;
    let call = open_existing(cli)?.reject(&a.decide.task, &a.call.reviewed(), &d)?;
    outln!(
        "rejected {} for task {}; it is queued and continues without it",
        call.name,
        a.decide.task
    );
    Ok(())
}

pub(super) fn cmd_reconcile(cli: &Cli, a: &ReconcileArgs) -> CliResult {
    let store = if a.task.is_none() && !a.auto {
        open_reader(cli)?
    } else {
        open_existing(cli)?
    };
    if a.auto {
        return reconcile_auto(cli, store.as_ref(), a);
    }
    let Some(task) = &a.task else {
        let held = store.held()?;
        if a.json {
            let v: Vec<Value> = held
                .iter()
                .map(|(r, c)| {
                    let p = r.state.pending.as_ref();
                    let damaged = c.as_ref().err();
                    let c = c.as_ref().ok().and_then(Option::as_ref);
                    json!({
                        "call_record_error": damaged,
                        "task": r.id,
                        "tool": p.map(|p| p.name.clone()),
                        "args": p.map(|p| Value::Object(p.args.clone())),
                        "key": p.map(|p| store.call_key(p, &r.id, r.state.step)),
                        "digest": p.map(|p| p.digest()),
                        "status": r.status.as_str(),
                        "since_ms": c.map_or(r.updated_at_ms, |c| c.intent_at_ms),
                        "known": c.and_then(|c| c.result.clone()),
                    })
                })
                .collect();
            print_json(&Value::Array(v))?;
            return Ok(());
        }
        if held.is_empty() {
            outln!("no held writes");
        }
        for (r, c) in &held {
            let Some(p) = &r.state.pending else { continue };
            let known = match c {
                Err(e) => format!("its call record is unreadable ({e})"),
                Ok(c) => match c.as_ref().and_then(|c| c.result.clone()) {
                    Some(v) => format!("last answer {v}"),
                    None => "no answer: the worker stopped while the call was in flight".into(),
                },
            };
            let since = c
                .as_ref()
                .ok()
                .and_then(Option::as_ref)
                .map_or(r.updated_at_ms, |c| c.intent_at_ms);
            let cancelled = if r.status == QueueStatus::Finished {
                "  (task cancelled)"
            } else {
                ""
            };
            outln!(
                "{}  {} {}  key {}  digest {}  since {} ms  {known}{cancelled}",
                r.id,
                p.name,
                Value::Object(p.args.clone()),
                store.call_key(p, &r.id, r.state.step),
                p.digest(),
                since
            );
        }
        return Ok(());
    };
    let settlement = match (a.applied, a.not_applied) {
        (true, _) => {
            let result = match &a.result {
                Some(text) => crate::limits::parse_json_input(
                    text,
                    "--result",
                    crate::limits::OPERATOR_RESULT_BYTES_MAX,
                )
                .map_err(|e| CliError::usage(e.0))?,
                None => json!({"status": "ok"}),
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
    let d = decision(&a.by, &a.reason)?;
    let extend = extension(&a.extend)?;
    let call = store.reconcile(task, &settlement, &a.call.reviewed(), &extend, &d)?;
    let what = if a.applied {
        "applied"
    } else {
        "not applied; it will be sent again under the same key"
    };
    outln!(
        "recorded {} for task {} as {what}; the task is queued",
        call.name,
        task
    );
    Ok(())
}

pub(super) fn cmd_cancel(cli: &Cli, a: &DecideArgs) -> CliResult {
    let d = decision(&a.by, &a.reason)?;
    match open_existing(cli)?.cancel(&a.task, &d)? {
        QueueStatus::Running => outln!(
            "task {} will stop at its next step boundary (cancelled)",
            a.task
        ),
        _ => outln!("task {} cancelled", a.task),
    }
    Ok(())
}

/// Settles held writes from each tool's lookup, only on a definite answer.
pub(super) fn reconcile_auto(cli: &Cli, store: &dyn Backend, a: &ReconcileArgs) -> CliResult {
    let mut demo: Option<DurableStore> = None;
    let (mut settled, mut skipped) = (0, 0);
    for (rec, _) in store.held()? {
        let Some(call) = rec.state.pending.clone() else {
            continue;
        };
        let key = store.call_key(&call, &rec.id, rec.state.step);
        let answer = match rec
            .catalog
            .as_ref()
            .and_then(|c| c.get(&call.name))
            .and_then(|s| s.http.clone())
        {
            Some(http) => match &http.lookup_url {
                Some(url) => crate::http::lookup(url, &key),
                None => {
                    crate::http::Lookup::Unknown(format!("tool {} has no lookup_url", call.name))
                }
            },
            None if rec.catalog.is_none() => {
                if demo.is_none() {
                    demo = Some(open_tools(cli)?);
                }
                match demo.as_ref().map(|d| d.lookup(&key, &call.name)) {
                    Some(Ok(Some(result))) => crate::http::Lookup::Applied(result),
                    Some(Ok(None)) => crate::http::Lookup::NotApplied,
                    Some(Err(e)) => crate::http::Lookup::Unknown(e.to_string()),
                    None => crate::http::Lookup::Unknown("no store".into()),
                }
            }
            None => crate::http::Lookup::Unknown(format!(
                "tool {} is not in the task's catalog",
                call.name
            )),
        };
        let settlement = match answer {
            crate::http::Lookup::Applied(result) => Settlement::Applied(result),
            crate::http::Lookup::NotApplied => Settlement::NotApplied,
            crate::http::Lookup::Unknown(why) => {
                skipped += 1;
                outln!("{}  {} key {}: left held ({why})", rec.id, call.name, key);
                continue;
            }
        };
        let d = decision(
            &a.by,
            &Some(
                a.reason
                    .clone()
                    .unwrap_or_else(|| "reconcile --auto: the tool's lookup answered".into()),
            ),
        )?;
        let applied = matches!(settlement, Settlement::Applied(_));
        // The key looked up is checked again inside the transaction that settles it.
        let reviewed = Reviewed {
            key: Some(key.clone()),
            digest: Some(call.digest()),
        };
        match store.reconcile(&rec.id, &settlement, &reviewed, &Extension::default(), &d) {
            Ok(_) => {
                settled += 1;
                outln!(
                    "{}  {} key {}: {}",
                    rec.id,
                    call.name,
                    key,
                    if applied {
                        "applied"
                    } else {
                        "not applied; will be re-sent under the same key"
                    }
                );
            }
            Err(e) => {
                skipped += 1;
                outln!("{}  {} key {}: left held ({e})", rec.id, call.name, key);
            }
        }
    }
    outln!("{settled} settled, {skipped} left held");
    Ok(())
}
