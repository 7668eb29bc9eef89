//! `worker replay`: a stored run rerun offline from its recorded replies (and the audit log's
//! decisions), compared with what it stored: its final state and its effects on the demo shop.

use super::*;

pub(super) fn cmd_replay(cli: &Cli, a: &ReplayArgs) -> CliResult {
    let store = open_reader(cli)?;
    let rec = store.task(&store.resolve(&a.task)?)?;
    if !rec.status.is_settled() {
        return Err(CliError::op(format!(
            "task {} is {}; replay a task that has stopped",
            rec.id,
            rec.status.as_str()
        )));
    }
    let ledger = open_tools(cli, &a.shop)?.ledger()?;
    let stored = task_effects(&ledger, store.db_id(), &rec);
    // A model of the config took messages: the replay counts its input as it did, which needs
    // the config's profile to build the prompt the run was given.
    let replies = store.replies(&rec.id)?;
    let (input, prompt_note) = replay_input(cli, &rec, &replies)?;
    let keys = crate::kernel::Keys::durable(rec.key_namespace(store.db_id()));
    let report = crate::replay::replay(
        &rec,
        replies,
        &store.events(Some(&rec.id))?,
        &stored,
        input,
        keys,
    );
    if a.json {
        print_json(&json!({
            "task": rec.id,
            "same_state": report.same_state,
            "same_effects": report.same_effects,
            "tool_answers": report.answers.as_str(),
            "divergence": report.divergence,
            "prompt_note": prompt_note,
            "differences": report.differences,
            "stop": report.state.stop.map(|s| s.as_str()),
            "effects": report.effects,
            "stored_effects": report.stored_effects,
        }))?;
    } else {
        print_replay(&rec.id, &report, prompt_note.as_deref())?;
    }
    if report.same_state && report.same_effects {
        return Ok(());
    }
    let hint = match report.answers {
        _ if prompt_note.is_some() => {
            "the replay was not given the prompt the run was: replay with the config the daemon used"
        }
        crate::replay::Answers::Recorded => {
            "the kernel took another path from the same model replies and tool answers: \
             its code, or the task's catalog, changed since the run"
        }
        crate::replay::Answers::DocumentStore => {
            "this task was recorded before tool answers were kept, so the replay asked a \
             fresh copy of the demo shop, which can answer differently from the \
             tools the run used"
        }
    };
    Err(CliError::op(format!(
        "the replay of task {} differs from the stored run",
        rec.id
    ))
    .hint(hint))
}

/// How the run's model counted its input (which the token check needs: a model of the
/// config took messages, built from its profile), and a note when this config's profile
/// builds another prompt than the run was told.
fn replay_input(
    cli: &Cli,
    rec: &TaskRecord,
    replies: &[crate::model::RecordedReply],
) -> Result<(crate::kernel::InputStyle, Option<String>), CliError> {
    let recorded_prompt = replies.iter().find_map(|r| r.prompt.clone());
    let built = super::enqueue::load_config(cli)?
        .and_then(|c| c.model_for(&rec.model).ok())
        .map(|m| {
            let catalog = rec
                .catalog
                .as_deref()
                .cloned()
                .unwrap_or_else(crate::kernel::Catalog::demo);
            m.build(&catalog, rec.instructions.as_deref())
        });
    let input = built
        .as_ref()
        .map_or(crate::kernel::InputStyle::View, |m| m.input());
    let now_prompt = built.as_ref().and_then(|m| m.prompt_id());
    // The token check counts the prompt's size: with another prompt (or none) it may stop the
    // replay elsewhere than the run.
    let note = match (&recorded_prompt, &now_prompt) {
        (Some(r), Some(n)) if r != n => Some(format!(
            "the run's model was told prompt {r}; this config's profile {} builds {n}",
            rec.model.label()
        )),
        (Some(r), None) => Some(format!(
            "the run's model was told prompt {r}, and no profile {} of this config builds it (pass the config the daemon used: --config)",
            rec.model.label()
        )),
        _ => None,
    };
    Ok((input, note))
}

/// A replay's verdict for people.
fn print_replay(
    task: &str,
    report: &crate::replay::ReplayReport,
    prompt_note: Option<&str>,
) -> CliResult {
    let yn = |b: bool| if b { "identical" } else { "DIFFERENT" };
    outln!(
        "replay of {}: stop {}, {} steps",
        task,
        report.state.stop.map_or("-", |s| s.as_str()),
        report.state.step
    );
    outln!(
        "tool answers    : {}",
        match report.answers {
            crate::replay::Answers::Recorded => "as the run recorded them",
            crate::replay::Answers::DocumentStore =>
                "from a fresh copy of the demo shop (recorded before answers were kept)",
        }
    );
    outln!("final state JSON: {}", yn(report.same_state));
    for d in &report.differences {
        outln!(
            "  {}: stored {}, replayed {}",
            d.path,
            clip(&d.stored),
            clip(&d.replayed)
        );
    }
    let label = match report.answers {
        crate::replay::Answers::Recorded => "writes          ",
        crate::replay::Answers::DocumentStore => "effects         ",
    };
    outln!("{label}: {} {}", yn(report.same_effects), report.effects);
    if let Some(d) = &report.divergence {
        outln!("diverged        : {}", crate::limits::printable(d));
    }
    if let Some(n) = prompt_note {
        outln!("note            : {}", crate::limits::printable(n));
    }
    Ok(())
}

/// A JSON value on one line, at most 120 characters, with control and bidirectional
/// characters escaped.
fn clip(v: &Value) -> String {
    let s = v.to_string();
    let s = crate::limits::printable(&s);
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s.into_owned(),
    }
}
