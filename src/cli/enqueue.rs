//! `worker enqueue`: one task from flags or a batch from a JSONL file, all or nothing.

use super::*;
use crate::limits;
use crate::operator::submit::{Origin, TaskRequest, new_task};

fn parse_pair<'a>(flag: &str, s: &'a str) -> Result<(&'a str, &'a str), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("--{flag} {s:?}: expected NAME=VALUE"))
}

/// One line of a `worker enqueue --file` batch as the task it asks for; `Err` names what is
/// wrong with it. Nothing is read from disk unless the line names a script file.
pub fn parse_batch_line(
    line: &str,
    cfg: Option<&crate::config::Config>,
    model: Option<&str>,
) -> Result<NewTask, String> {
    let v = limits::parse_json_input(line, "the line", limits::BATCH_LINE_BYTES_MAX)
        .map_err(|e| e.0)?;
    if !v.is_object() {
        return Err("a line must be a JSON object (see --help)".into());
    }
    let mut l: TaskRequest = serde_json::from_value(v).map_err(|e| e.to_string())?;
    if l.model.is_none() {
        l.model = model.map(str::to_string);
    }
    new_task(l, cfg, Origin::Cli)
}

pub(super) fn load_config(cli: &Cli) -> Result<Option<crate::config::Config>, CliError> {
    match &cli.config {
        None => Ok(None),
        Some(p) => crate::config::load(p).map(Some).map_err(|e| {
            // A file that is not there is a wrong argument (as for --file); one that cannot
            // be read for another reason is operational.
            let unreadable = matches!(e, crate::config::LoadError::Unreadable(_));
            let code = if unreadable && p.is_file() { 1 } else { 2 };
            CliError {
                message: e.to_string(),
                cause: None,
                hint: Some(
                    "the format: docs/models.md (profiles), docs/catalog.md (tools), data/worker.toml (an example)".into(),
                ),
                code,
            }
        }),
    }
}

/// The config for enqueue: with MCP servers, their tools join the catalog each task keeps
/// (discovered now, once for the whole batch).
pub(super) fn enqueue_config(cli: &Cli) -> Result<Option<crate::config::Config>, CliError> {
    let Some(cfg) = load_config(cli)? else {
        return Ok(None);
    };
    if cfg.mcp.servers.is_empty() {
        return Ok(Some(cfg));
    }
    crate::operator::submit::with_mcp_tools(&cfg)
        .map(Some)
        .map_err(CliError::op)
}

/// The tasks of a JSONL batch file, every line checked before any is written.
fn read_batch(
    path: &std::path::Path,
    cfg: Option<&crate::config::Config>,
    model: Option<&str>,
) -> Result<Vec<NewTask>, CliError> {
    let file = std::fs::File::open(path).map_err(|e| {
        let m = format!("cannot read {}: {e}", path.display());
        // A file that is not there is a wrong argument; anything else is operational.
        if e.kind() == std::io::ErrorKind::NotFound {
            CliError::usage(m)
        } else {
            CliError::op(m)
        }
    })?;
    let size = file.metadata().map_or(0, |m| m.len());
    let mut bar = super::progress::Bar::new("reading", size);
    let mut read = 0u64;
    let mut lines = limits::Lines::new(std::io::BufReader::new(file));
    let mut tasks = Vec::new();
    let mut n = 0;
    loop {
        n += 1;
        let at = |m: String| CliError::usage(format!("{}:{n}: {m}", path.display()));
        let line = match lines.next_line(limits::BATCH_LINE_BYTES_MAX) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(limits::LineError::Io(e)) => {
                return Err(CliError::op(format!("cannot read {}: {e}", path.display())));
            }
            Err(limits::LineError::Bad(m)) => return Err(at(m)),
        };
        read += line.len() as u64 + 1;
        bar.set(read, &format!("{} tasks checked", tasks.len()));
        if line.trim().is_empty() {
            continue;
        }
        if tasks.len() == limits::BATCH_TASKS_MAX {
            return Err(at(format!(
                "more than {} tasks in one batch; split the file",
                limits::BATCH_TASKS_MAX
            )));
        }
        tasks.push(parse_batch_line(&line, cfg, model).map_err(at)?);
    }
    if tasks.is_empty() {
        return Err(CliError::usage(format!(
            "{}: no tasks in the file",
            path.display()
        )));
    }
    bar.finish(&format!(
        "{} tasks checked; writing them in one transaction",
        tasks.len()
    ));
    Ok(tasks)
}

/// The one task the command line describes.
fn one_task(a: &EnqueueArgs, cfg: Option<&crate::config::Config>) -> Result<NewTask, CliError> {
    new_task(request_of(a)?, cfg, Origin::Cli).map_err(CliError::usage)
}

/// The task the command line asks for, as a batch line would (nothing resolved yet).
pub(super) fn request_of(a: &EnqueueArgs) -> Result<TaskRequest, CliError> {
    let mut budget = BTreeMap::new();
    for b in &a.budgets {
        let (k, v) = parse_pair("budget", b).map_err(CliError::usage)?;
        budget.insert(k.to_string(), Value::String(v.to_string()));
    }
    let mut latency = BTreeMap::new();
    for t in &a.tool_latency {
        let (k, v) = parse_pair("tool-latency", t).map_err(CliError::usage)?;
        let ms = v.parse().map_err(|_| {
            CliError::usage(format!(
                "--tool-latency {t:?}: {v:?} is not a whole number of ms"
            ))
        })?;
        latency.insert(k.to_string(), ms);
    }
    Ok(TaskRequest {
        user: a.user.clone().unwrap_or_default(),
        goal: a.goal.clone().unwrap_or_default(),
        key: a.key.clone(),
        priority: a.priority,
        budget,
        model: a.model.clone(),
        tool_latency_ms: latency,
        store_scope: a.store_scope.clone(),
        approval_wait_ms: a.approval_wait_ms,
        instructions: a.instructions.clone(),
        callback_url: a.callback.clone(),
        not_before: a.not_before.clone(),
        start_in: a.start_in.clone(),
        concurrency_key: a.concurrency_key.clone(),
        ttl: a.ttl.clone(),
        finish_within: a.finish_within.clone(),
    })
}

pub(super) fn cmd_enqueue(cli: &Cli, a: &EnqueueArgs) -> CliResult {
    let cfg = enqueue_config(cli)?;
    let tasks = match &a.file {
        Some(path) => read_batch(path, cfg.as_ref(), a.model.as_deref())?,
        None => vec![one_task(a, cfg.as_ref())?],
    };
    // While a daemon runs on the file, it commits the tasks in the database it has open.
    let here = || -> store::Result<_> {
        let store = store::open_backend(&cli.db, Access::Create, 1)?;
        Ok((store.enqueue(&tasks, now_ms())?, Some(store)))
    };
    let (out, store) = if store::pg::is_url(&cli.db) {
        here()?
    } else {
        let daemon = || {
            crate::local::enqueue(Path::new(&cli.db), &tasks)
                .map(|done| done.map(|out| (out, None)))
        };
        through_daemon(daemon, here)?
    };
    if a.wait {
        // On a file, the wait reads through a read-only handle: a writer's handle held for the
        // whole wait would keep a daemon, which must be the file's only writer, from starting.
        let store = match store {
            Some(s) if store::pg::is_url(&cli.db) => s,
            writer => {
                drop(writer);
                open_reader(cli)?
            }
        };
        let Some(e) = out.first() else {
            return Err(CliError::op("the enqueue returned no task"));
        };
        eprintln!(
            "{}{}; waiting for it to finish",
            e.id,
            if e.created {
                ""
            } else {
                " (already enqueued with this key)"
            }
        );
        return super::wait::wait_and_report(
            store.as_ref(),
            &e.id,
            a.timeout,
            a.json,
            a.until.unwrap_or(UntilArg::Settled),
        );
    }
    if a.json {
        let v: Vec<Value> = out
            .iter()
            .map(|e| json!({"id": e.id, "created": e.created}))
            .collect();
        print_json(&Value::Array(v))?;
    } else {
        for e in &out {
            if e.created {
                outln!("{}", e.id);
            } else {
                outln!("{} (already enqueued with this key)", e.id);
            }
        }
    }
    Ok(())
}
