//! `worker schedule`: cron schedules stored in the database, each tick enqueuing one task
//! (`operator::schedule` fires them; every daemon does at each housekeeping pass).

use super::*;
use crate::operator::schedule as sched;
use crate::store::schedule::{CatchUp, Schedule};

pub(super) const SCHEDULE_HELP: &str = "Examples:
  worker schedule add nightly --cron '0 2 * * *' --tz Europe/Paris -- --user ops --goal 'reconcile the ledger' --model agent
  worker schedule add every-5m --cron '*/5 * * * *' --catch-up none -- --user ops --goal 'check the queue'
  worker schedule list
  worker schedule pause nightly
  worker schedule resume nightly
  worker schedule remove nightly

Every running daemon fires the schedules' due ticks (it looks every second); each tick enqueues exactly one task, under the key
schedule:NAME:TICK (TICK its time in UTC), however many daemons fire it; keys starting with
schedule: are reserved for ticks (no enqueue may use one). A tick whose task cannot be made
is reported and passed over, never holding back the next ones. Ticks missed while
no daemon ran: --catch-up latest (the default) enqueues the latest of them once; none skips
them. A time the zone skips (clocks going forward) fires at the end of the gap; a time it
repeats fires once. `worker schedule tick` fires the due ticks once, without a daemon.";

#[derive(Subcommand, Debug)]
pub enum ScheduleCommand {
    /// Add a schedule: each tick of --cron enqueues the task the arguments after `--` describe
    /// (the arguments of `worker enqueue`).
    Add(AddArgs),
    /// List the schedules: expression, zone, next tick, last tick, ticks fired.
    List {
        /// Print them as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Stop firing a schedule until it is resumed.
    Pause { name: String },
    /// Fire a paused schedule again, from now on (ticks that fell while it was paused do not
    /// fire).
    Resume { name: String },
    /// Remove a schedule (the tasks it enqueued stay).
    Remove { name: String },
    /// Fire the due ticks once, as a daemon does at each pass; prints what was enqueued.
    Tick {
        /// Fire as of this time (RFC 3339) instead of now.
        #[arg(long, value_name = "TIME")]
        now: Option<String>,
    },
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum CatchUpArg {
    Latest,
    None,
}

#[derive(Args, Debug)]
pub struct AddArgs {
    /// The schedule's name (letters, digits, '-', '_', '.', ':').
    pub name: String,
    /// The cron expression: minute hour day-of-month month day-of-week, or six fields with
    /// seconds first.
    #[arg(long)]
    pub cron: String,
    /// The IANA time zone the expression's times are in.
    #[arg(long, default_value = "UTC")]
    pub tz: String,
    /// Ticks missed while no daemon ran: the latest fires once, or none.
    #[arg(long, value_enum, default_value = "latest")]
    pub catch_up: CatchUpArg,
    /// The task, as `worker enqueue` arguments (after `--`).
    #[arg(last = true, required = true, value_name = "ENQUEUE ARGS")]
    pub enqueue: Vec<String>,
}

/// `worker enqueue`'s arguments alone, to read the task of a schedule.
#[derive(Parser, Debug)]
#[command(
    name = "worker schedule add NAME --cron EXPR --",
    no_binary_name = false
)]
struct EnqueueOnly {
    #[command(flatten)]
    a: EnqueueArgs,
}

/// The task of `add`, as a batch line would ask for it, checked in this config now.
fn task_of(cli: &Cli, add: &AddArgs) -> Result<Value, CliError> {
    let argv = std::iter::once("worker schedule add NAME --cron EXPR --".to_string())
        .chain(add.enqueue.iter().cloned());
    let a = EnqueueOnly::try_parse_from(argv)
        .map_err(|e| CliError::usage(format!("the task after --: {}", e.render())))?
        .a;
    let refused = [
        (a.file.is_some(), "--file"),
        (a.wait, "--wait"),
        (
            a.key.is_some(),
            "--key (each tick's key is schedule:NAME:TICK)",
        ),
        (
            a.start_in.is_some() || a.not_before.is_some(),
            "--in and --not-before",
        ),
    ];
    if let Some((_, what)) = refused.iter().find(|(bad, _)| *bad) {
        return Err(CliError::usage(format!(
            "the task after --: {what} cannot be given to a schedule"
        )));
    }
    let mut req = super::enqueue::request_of(&a)?;
    // A script file is read when each tick's task is made, by a daemon elsewhere.
    if let Some(arg) = req.model.as_deref().and_then(|m| m.strip_prefix("script:")) {
        let (file, latency) = crate::model::script_file(arg);
        let abs = std::fs::canonicalize(file)
            .map_err(|e| CliError::usage(format!("--model script:{file}: {e}")))?;
        let latency = latency.map_or(String::new(), |ms| format!(":{ms}"));
        req.model = Some(format!("script:{}{latency}", abs.display()));
    }
    let cfg = super::enqueue::enqueue_config(cli)?;
    crate::operator::submit::new_task(
        req.clone(),
        cfg.as_ref(),
        crate::operator::submit::Origin::Cli,
    )
    .map_err(|e| CliError::usage(format!("the task after --: {e}")))?;
    serde_json::to_value(&req).map_err(|e| CliError::op(e.to_string()))
}

fn add(cli: &Cli, a: &AddArgs) -> CliResult {
    crate::limits::check_name(&a.name, "the schedule's name").map_err(|e| CliError::usage(e.0))?;
    sched::parse(&a.cron).map_err(CliError::usage)?;
    sched::zone(&a.tz).map_err(CliError::usage)?;
    let task = task_of(cli, a)?;
    let now = now_ms();
    let s = Schedule {
        name: a.name.clone(),
        cron: a.cron.clone(),
        tz: a.tz.clone(),
        catch_up: match a.catch_up {
            CatchUpArg::Latest => CatchUp::Latest,
            CatchUpArg::None => CatchUp::None,
        },
        paused: false,
        task,
        last_tick_ms: now,
        created_at_ms: now,
        fired: 0,
    };
    let next = sched::next_tick(&s, now).map_err(CliError::usage)?;
    let asked = crate::local::Decide::ScheduleAdd {
        schedule: s.clone(),
    };
    let _: bool = operator_write(cli, &asked, Access::Create, None)?;
    outln!(
        "schedule {} added; next tick {}",
        s.name,
        next.map_or("never".into(), crate::clock::rfc3339)
    );
    Ok(())
}

fn list(cli: &Cli, json_out: bool) -> CliResult {
    let store = open_reader(cli)?;
    let now = now_ms();
    let rows: Vec<Value> = store
        .schedules()?
        .iter()
        .map(|s| {
            let next = (!s.paused)
                .then(|| sched::next_tick(s, s.last_tick_ms.max(now)).ok().flatten())
                .flatten();
            json!({
                "name": s.name, "cron": s.cron, "tz": s.tz, "catch_up": s.catch_up.as_str(),
                "status": if s.paused { "paused" } else { "active" },
                "next_tick": next.map(crate::clock::rfc3339),
                "last_tick": crate::clock::rfc3339(s.last_tick_ms),
                "fired": s.fired, "goal": s.task["goal"],
            })
        })
        .collect();
    if json_out {
        return print_json(&Value::Array(rows));
    }
    outln!(
        "{:<16} {:<16} {:<18} {:<7} {:<24} {:>6}  goal",
        "name",
        "cron",
        "tz",
        "status",
        "next tick",
        "fired"
    );
    for r in &rows {
        outln!(
            "{:<16} {:<16} {:<18} {:<7} {:<24} {:>6}  {}",
            r["name"].as_str().unwrap_or(""),
            r["cron"].as_str().unwrap_or(""),
            r["tz"].as_str().unwrap_or(""),
            r["status"].as_str().unwrap_or(""),
            r["next_tick"].as_str().unwrap_or("-"),
            r["fired"].as_u64().unwrap_or(0),
            r["goal"].as_str().unwrap_or("")
        );
    }
    Ok(())
}

fn tick(cli: &Cli, at: &Option<String>) -> CliResult {
    let now = match at {
        Some(t) => crate::clock::parse_rfc3339(t).map_err(CliError::usage)?,
        None => now_ms(),
    };
    let cfg = super::enqueue::enqueue_config(cli)?;
    let store = open_created(cli, 1)?;
    let pass = sched::fire_due(store.as_ref(), cfg.as_ref(), now)?;
    for f in &pass.fired {
        outln!(
            "{} {} {}{}",
            f.schedule,
            crate::clock::rfc3339(f.tick_ms),
            f.task.id,
            if f.task.created {
                ""
            } else {
                " (already enqueued)"
            }
        );
    }
    for (name, n) in &pass.skipped {
        outln!("{name}: {n} missed ticks passed over");
    }
    for e in &pass.failed {
        eprintln!("error: {e}");
    }
    if !pass.failed.is_empty() {
        return Err(CliError::op(format!(
            "{} schedules or ticks could not fire (see above)",
            pass.failed.len()
        )));
    }
    Ok(())
}

fn set_paused(cli: &Cli, name: &str, paused: bool) -> CliResult {
    let asked = crate::local::Decide::SchedulePaused {
        name: name.to_string(),
        paused,
    };
    let found: bool = operator_write(cli, &asked, Access::Write, None)?;
    if !found {
        return Err(CliError::usage(format!(
            "there is no schedule {name:?} (see worker schedule list)"
        )));
    }
    outln!(
        "schedule {name} {}",
        if paused { "paused" } else { "resumed" }
    );
    Ok(())
}

pub(super) fn cmd_schedule(cli: &Cli, c: &ScheduleCommand) -> CliResult {
    match c {
        ScheduleCommand::Add(a) => add(cli, a),
        ScheduleCommand::List { json } => list(cli, *json),
        ScheduleCommand::Pause { name } => set_paused(cli, name, true),
        ScheduleCommand::Resume { name } => set_paused(cli, name, false),
        ScheduleCommand::Remove { name } => {
            let asked = crate::local::Decide::ScheduleRemove { name: name.clone() };
            let found: bool = operator_write(cli, &asked, Access::Write, None)?;
            if !found {
                return Err(CliError::usage(format!(
                    "there is no schedule {name:?} (see worker schedule list)"
                )));
            }
            outln!("schedule {name} removed");
            Ok(())
        }
        ScheduleCommand::Tick { now } => tick(cli, now),
    }
}
