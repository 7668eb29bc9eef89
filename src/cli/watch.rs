//! `worker watch TASK`: a task's events as they are recorded (each step's model move and tool
//! calls, each decision on it, each change of status) until it finishes, with a live status
//! line on a terminal. The same events as the HTTP API's stream (`operator::stream`), read
//! from the database, so it works beside a daemon or after the task ended; `--after ID`
//! resumes after an event id that `--json` printed. Exits with `worker wait`'s codes.

use super::*;
use crate::operator::stream::{self, Cursor, Event, FollowError, Out};
use crate::store::Watched;
use crate::store::result::Ending;
use crate::store::watch::Watch;
use serde_json::Value;

pub const WATCH_HELP: &str = "\
Examples:
  worker watch t3
  worker watch key:job-42 --json            # one JSON object per event: id, event, data
  worker watch t3 --json --after 12.40.running

Each line is one event: a step once it is recorded (at its end), its model's move, a tool
call and its result, a held call sent after a person's decision, a decision (approve,
reject, reconcile, cancel), a change of status. On a terminal a status line below
them shows the task's status, step, tool calls and active time. Ends when the task finishes,
with `worker wait`'s exit codes (0 completed, 3 could not complete, 4 stopped, 6 cancelled).";

#[derive(clap::Args, Debug)]
pub struct WatchArgs {
    /// Task id (e.g. t3), or key:KEY for the task enqueued under KEY.
    pub task: String,
    /// One JSON object per event (`id`, `event`, `data`), as the HTTP API's stream sends it.
    #[arg(long)]
    pub json: bool,
    /// Only the events after this one (an `id` that `--json` printed).
    #[arg(long, value_name = "EVENT_ID")]
    pub after: Option<String>,
}

pub(super) fn cmd_watch(cli: &Cli, a: &WatchArgs) -> CliResult {
    let store = open_reader(cli)?;
    let id = store.resolve(&a.task)?;
    let cursor = match &a.after {
        Some(after) => {
            Cursor::parse(after).map_err(|e| CliError::usage(format!("--after: {e}")))?
        }
        None => Cursor::default(),
    };
    let watch = Watch::new(store.as_ref(), Watched::Settled);
    let mut line = StatusLine::new(progress::enabled());
    let mut failed: Option<CliError> = None;
    let followed = stream::follow(
        store.as_ref(),
        &watch,
        &id,
        cursor,
        false,
        &|| false,
        &mut |out| {
            let Out::Event(e) = out else { return Ok(()) };
            line.clear();
            let printed = if a.json {
                serde_json::to_string(
                    &serde_json::json!({"id": e.id, "event": e.kind, "data": e.data}),
                )
                .map_err(std::io::Error::other)
                .and_then(|j| print_line(&j))
            } else {
                print_line(&crate::limits::one_line(&describe(e)))
            };
            if let Err(err) = printed {
                failed = Some(CliError::from_stdout(err));
                return Err(std::io::Error::other("stdout"));
            }
            line.show(e);
            Ok(())
        },
    );
    line.clear();
    if let Some(e) = failed {
        return Err(e);
    }
    match followed {
        Ok(_) => {}
        Err(FollowError::Store(e)) => return Err(e.into()),
        Err(FollowError::Gone(e)) => return Err(CliError::from_stdout(e)),
    }
    let rec = store.task(&id)?;
    match Ending::of(&rec).map(Ending::exit_code) {
        Some(0) | None => Ok(()),
        Some(code) => Err(CliError {
            message: String::new(),
            cause: None,
            hint: None,
            code,
        }),
    }
}

fn print_line(text: &str) -> std::io::Result<()> {
    use std::io::Write as _;
    writeln!(
        std::io::stdout().lock(),
        "{}",
        crate::limits::printable(text)
    )
}

/// An event as one line for a person.
fn describe(e: &Event) -> String {
    let d = &e.data;
    let s = |k: &str| d.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let step = d.get("step").and_then(Value::as_u64).unwrap_or(0);
    match e.kind {
        "step" => format!(
            "step {step:<3} {} (active {} s to {} s)",
            s("status"),
            d["started_s"],
            d["ended_s"]
        ),
        "resume" => format!("resumed   {} -> {}", s("what"), s("status")),
        "model" => format!(
            "step {step:<3} model: {} ({} tokens in, {} out)",
            d["move"]["summary"].as_str().unwrap_or("-"),
            d["tokens_in"],
            d["tokens_out"]
        ),
        "tool" => format!(
            "{} tool:  {} {} -> {} ({} s)",
            if d["step"].is_null() {
                "resumed  ".to_string()
            } else {
                format!("step {step:<3}")
            },
            s("tool"),
            d["args"],
            s("result"),
            d["seconds"]
        ),
        "decision" => {
            let why = d["reason"]
                .as_str()
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            match d["detail"]["answer"].as_str() {
                Some(a) if s("verb") == "answer" => format!("answered  by {}: {a}", s("by")),
                _ if s("verb") == "say" => format!(
                    "message   by {} (turn {}): {}",
                    s("by"),
                    d["detail"]["turn"],
                    d["detail"]["text"].as_str().unwrap_or_default()
                ),
                _ => format!("decision  {} by {}{why}", s("verb"), s("by")),
            }
        }
        "finished" => {
            let answer = d["answer"]
                .as_str()
                .map(|a| format!(": {a}"))
                .unwrap_or_default();
            format!("finished  {}{answer}", s("stop"))
        }
        _ => describe_status(d),
    }
}

/// A `status` event as one line: what the task waits for, the question when it asks one.
fn describe_status(d: &Value) -> String {
    let s = |k: &str| d.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    match d["waiting_for"].as_str() {
        Some("answer") => format!(
            "status    {} (asks a person: {}{})",
            s("status"),
            d["question"]["text"].as_str().unwrap_or("?"),
            match d["question"]["choices"].as_array() {
                Some(c) if !c.is_empty() => format!(
                    " [{}]",
                    c.iter()
                        .filter_map(Value::as_str)
                        .collect::<Vec<_>>()
                        .join(" | ")
                ),
                _ => String::new(),
            }
        ),
        Some(w) => format!(
            "status    {} (waits for {w} of {})",
            s("status"),
            d["held_call"]["tool"].as_str().unwrap_or("a call")
        ),
        None => format!("status    {}", s("status")),
    }
}

/// The live line below the events on a terminal (stderr): status, step, calls, active time.
struct StatusLine {
    on: bool,
    status: String,
    step: u64,
    tools: u64,
    seconds: f64,
}

impl StatusLine {
    fn new(on: bool) -> StatusLine {
        StatusLine {
            on,
            status: "-".into(),
            step: 0,
            tools: 0,
            seconds: 0.0,
        }
    }

    fn show(&mut self, e: &Event) {
        let d = &e.data;
        match e.kind {
            "status" | "finished" => {
                self.status = d["status"].as_str().unwrap_or("-").to_string();
                self.step = d["steps"].as_u64().unwrap_or(self.step);
                self.tools = d["tool_calls"].as_u64().unwrap_or(self.tools);
            }
            "step" | "resume" => {
                self.step = d["step"].as_u64().unwrap_or(self.step);
                self.seconds = d["ended_s"].as_f64().unwrap_or(self.seconds);
            }
            "tool" => self.tools += 1,
            _ => {}
        }
        if self.on && e.kind != "finished" {
            eprint!(
                "\r\x1b[2K{} · step {} · {} tool call(s) · {:.1} s active",
                self.status, self.step, self.tools, self.seconds
            );
        }
    }

    fn clear(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
        }
    }
}
