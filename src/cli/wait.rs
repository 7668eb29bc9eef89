//! `worker wait` and `worker enqueue --wait`: block until a task finishes or starts waiting on
//! a person (with `--until finished`, through its waits on people to its end), print its answer (or the whole result as JSON), and exit with the code of
//! [`crate::store::result`]'s table.

use super::*;
use crate::operator::{Waited, wait};
use crate::store::Watched;
use crate::store::result::{EXIT_TIMED_OUT, Ending, result_json};
use crate::store::watch::Watch;
use std::time::{Duration, Instant};

/// How far `worker wait` (and `enqueue --wait`) waits.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum UntilArg {
    /// Until the task finishes or starts waiting on a person (exit 5).
    Settled,
    /// Until the task finishes, through its approvals and held writes.
    Finished,
}

impl UntilArg {
    pub fn until(self) -> crate::operator::Until {
        match self {
            UntilArg::Settled => crate::operator::Until::Settled,
            UntilArg::Finished => crate::operator::Until::Finished,
        }
    }
}

pub(super) fn cmd_wait(cli: &Cli, a: &WaitArgs) -> CliResult {
    let store = open_reader(cli)?;
    let id = store.resolve(&a.task)?;
    wait_and_report(store.as_ref(), &id, a.timeout, a.json, a.until)
}

/// Waits for task `id` (at most `timeout_ms`), then prints and exits as `worker wait` does.
pub(super) fn wait_and_report(
    store: &dyn Backend,
    id: &str,
    timeout_ms: Option<u64>,
    json: bool,
    how: UntilArg,
) -> CliResult {
    let watch = Watch::new(store, Watched::Settled);
    if !watch.is_woken() {
        tracing::info!("this database gives no wake-ups here: the wait polls");
    }
    let until = timeout_ms.map(|ms| Instant::now() + Duration::from_millis(ms));
    // Waiting through a person: said once per wait, with what the person does.
    let mut on_person = |rec: &TaskRecord| {
        let line = how_it_stands(store, rec, 5);
        let line = line.replace("; exit 5", "");
        eprintln!(
            "{}; the wait goes on until it finishes",
            crate::limits::printable(&line)
        );
    };
    let (rec, code) = match wait(store, &watch, id, until, how.until(), &mut on_person)? {
        Waited::Settled(rec, ending) => (rec, ending.exit_code()),
        Waited::TimedOut(rec) => (rec, EXIT_TIMED_OUT),
    };
    if json {
        print_json(&result_json(store.db_id(), &rec))?;
    } else {
        if let Some(answer) = rec.state.answer.as_ref().filter(|_| code != EXIT_TIMED_OUT) {
            outln!("{answer}");
        }
        eprintln!(
            "{}",
            crate::limits::printable(&how_it_stands(store, &rec, code))
        );
    }
    if code == 0 {
        return Ok(());
    }
    Err(CliError {
        message: String::new(),
        cause: None,
        hint: None,
        code,
    })
}

/// One line for the person who runs the job: how the task stands and what to do next.
fn how_it_stands(store: &dyn Backend, rec: &TaskRecord, code: i32) -> String {
    let id = &rec.id;
    let stop = rec.state.stop.map_or("-", StopReason::as_str);
    match Ending::of(rec) {
        None => format!(
            "{id} is still {} after the timeout; `worker wait {id}` waits again",
            rec.status.as_str()
        ),
        Some(Ending::Completed) => format!("{id} completed ({} steps)", rec.state.step),
        Some(Ending::CannotComplete) => format!(
            "{id} could not complete its goal (the model gave up; its answer says why); exit {code}"
        ),
        Some(Ending::Stopped) => {
            format!("{id} stopped: {stop}; exit {code} (`worker postmortem {id}` says why)")
        }
        Some(Ending::Cancelled) => format!("{id} ended: {stop}; exit {code}"),
        Some(Ending::Waiting) => match rec.state.pending.as_ref() {
            _ if let Some(q) = crate::store::result::question(rec) => format!(
                "{id} asks a person \"{}\"; exit {code}: answer with `worker answer {id} --text ANSWER`",
                crate::limits::one_line(&q.text)
            ),
            Some(p) if rec.status == QueueStatus::Suspended => format!(
                "{id} waits for an approval of {} (digest {}); exit {code}: `worker approve {id} --digest {}` or `worker reject {id}`",
                p.name,
                p.digest(),
                p.digest()
            ),
            Some(p) => format!(
                "{id} holds a write of {} whose outcome is unknown (key {}); exit {code}: settle it with `worker reconcile {id}`",
                p.name,
                store.call_key(rec, p)
            ),
            None => format!("{id} is {}; exit {code}", rec.status.as_str()),
        },
    }
}
