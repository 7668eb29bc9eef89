//! The `worker` command line: one function per verb. Read verbs take `--json`. Exit codes: 0 ok,
//! 1 operational error, 2 usage error; every error says what was wrong and, where it helps, what
//! to do (`error:` / `caused by:` / `hint:`).

use clap::{Args, Parser, Subcommand};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use crate::kernel::report::{closing_message, postmortem, span_table};
use crate::kernel::{Budget, Catalog, StopReason};
use crate::model::ModelProfile;
use crate::sim::{SCENARIO_HEADER, scenario_row, scenarios};
use crate::store::ops::{Decision, Extension, Reviewed, Settlement};
use crate::store::{self, NewTask, QueueStatus, Store, TaskRecord};
use crate::tools::durable::{DurableStore, LedgerEntry};
use crate::tools::{Effect, Order, effects_to_python};
use crate::worker::{self, Config, now_ms};

const AFTER_HELP: &str = "Examples:
  worker demo                                   # scenarios A-H through the durable path
  worker enqueue --user cu_ana --goal 'refund the damaged item on order ord_1001' --key job-42
  worker run --workers 4 --drain                # run until nothing is runnable
  worker list --status finished --json
  worker show t1
  worker trace t1

The database is ./worker.redb unless --db or WORKER_DB says otherwise; the document's store
(orders, ledger, stored results) is a second file beside it (--store or WORKER_STORE).";

#[derive(Parser, Debug)]
#[command(name = "worker", version, about = "Tether: a durable, bounded agent worker on redb", after_help = AFTER_HELP)]
pub struct Cli {
    /// The worker database (redb, shared by all processes).
    #[arg(long, global = true, env = "WORKER_DB", default_value = "worker.redb")]
    pub db: PathBuf,
    /// The document's store (orders, ledger, stored results); default: <db>.store.redb beside --db.
    #[arg(long, global = true, env = "WORKER_STORE")]
    pub store: Option<PathBuf>,
    /// Config file (TOML) with model profiles and the tool catalog, for `worker enqueue`.
    #[arg(long, global = true, env = "WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon: claim tasks and run them on a pool of threads.
    #[command(
        after_help = "Example:\n  RUST_LOG=info worker run --workers 8        # until SIGINT/SIGTERM\n  worker run --drain                          # until the queue is empty"
    )]
    Run(RunArgs),
    /// Add a task (or a batch from a JSONL file) to the queue; prints the task id.
    #[command(after_help = ENQUEUE_HELP)]
    Enqueue(EnqueueArgs),
    /// List tasks.
    #[command(
        after_help = "Example:\n  worker list --status held\n  worker list --stop max_steps --json"
    )]
    List(ListArgs),
    /// Show one task: state, plan, budgets used, closing message.
    #[command(after_help = "Example:\n  worker show t1 --json")]
    Show(TaskArgs),
    /// The task's span table, or its spans as OTLP/JSON for an OpenTelemetry collector.
    #[command(
        after_help = "Example:\n  worker trace t1\n  worker trace t1 --otlp t1.otlp.json   # GenAI semantic conventions"
    )]
    Trace(TraceArgs),
    /// The document's post-mortem of a task.
    #[command(after_help = "Example:\n  worker postmortem t2")]
    Postmortem(TaskArgs),
    /// Serve the document's store over HTTP (Stripe-style idempotency keys, fault injection).
    /// Its file is --store, or --db when given, or worker.store.redb.
    #[command(
        name = "demo-store",
        after_help = "Example:\n  worker demo-store --listen 127.0.0.1:8700 --db store.redb --lose-rate 0.2"
    )]
    DemoStore(DemoStoreArgs),
    /// Enqueue scenarios A-H on a fresh temporary database, run them, print the table.
    #[command(after_help = "Example:\n  worker demo --workers 4")]
    Demo(DemoArgs),
    /// The document's store: orders and ledger.
    #[command(subcommand)]
    Store(StoreCommand),
    /// Approve exactly the held call of a suspended task; the task is requeued.
    #[command(
        after_help = "Examples:\n  worker show t7                 # the held call, its key and its digest\n  worker approve t7 --by alice --reason 'damage confirmed' --digest 3f2a9c1d0e\n  worker approve t7 --digest 3f2a9c1d0e --extend tool_calls=1   # when its budget is spent"
    )]
    Approve(ApproveArgs),
    /// Reject the held call of a suspended task: it is never sent; the task goes on.
    #[command(
        after_help = "Example:\n  worker reject t7 --by alice --reason 'refund above policy' --digest 3f2a9c1d0e"
    )]
    Reject(RejectArgs),
    /// List held writes (outcome unknown), or settle one: --applied or --not-applied.
    #[command(
        after_help = "Examples:\n  worker reconcile                                  # list held writes, with keys and digests\n  worker reconcile t8 --applied --result '{\"status\": \"ok\", \"refunded_cents\": 3000}' --by bob --reason 'seen in the ledger'\n  worker reconcile t8 --not-applied --key 5f0c2a9e11d3:t8:s2 --by bob   # re-sent under the same key\n  worker reconcile t8 --not-applied --digest 54592ae224 --extend deadline_ms=10000"
    )]
    Reconcile(ReconcileArgs),
    /// Cancel a queued, running (at its next step boundary), suspended or held task.
    #[command(after_help = "Example:\n  worker cancel t3 --reason 'customer withdrew the request'")]
    Cancel(DecideArgs),
    /// Re-run a task offline from its recorded replies against a fresh copy of the demo store,
    /// and compare its final state and effects with the stored ones (exit 1 if they differ).
    #[command(after_help = "Example:\n  worker replay t1 --json")]
    Replay(TaskArgs),
    /// The audit log (who, what, when, why), of one task when given.
    #[command(after_help = "Example:\n  worker events t7")]
    Events(EventsArgs),
    /// Long-term memory: notes from trusted sources, scoped to a user, expiring.
    #[command(subcommand)]
    Memory(MemoryCommand),
}

fn default_by() -> String {
    std::env::var("USER")
        .ok()
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "operator".into())
}

#[derive(Args, Debug)]
pub struct DecideArgs {
    /// Task id.
    pub task: String,
    /// Who decides (default: $USER).
    /// Who decides (default: $USER); recorded in the audit log.
    #[arg(long, default_value_t = default_by())]
    pub by: String,
    /// Why; recorded in the audit log.
    /// Why; recorded in the audit log.
    #[arg(long)]
    pub reason: Option<String>,
}

/// The held call a decision is about, as `worker show` prints it. Compared inside the
/// decision's transaction: a task that moved on to another call refuses the decision.
#[derive(Args, Debug)]
pub struct CallArgs {
    /// The held call's digest of tool and args (from `worker show`).
    #[arg(long)]
    pub digest: Option<String>,
    /// The held call's call key (from `worker show`).
    #[arg(long)]
    pub key: Option<String>,
}

impl CallArgs {
    fn reviewed(&self) -> Reviewed {
        Reviewed {
            key: self.key.clone(),
            digest: self.digest.clone(),
        }
    }
}

#[derive(Args, Debug)]
pub struct ApproveArgs {
    #[command(flatten)]
    pub decide: DecideArgs,
    /// Required: --digest or --key of the held call; refused if the task holds another call.
    #[command(flatten)]
    pub call: CallArgs,
    /// Grant more budget with the approval, e.g. `tool_calls=1,deadline_ms=10000` (each limit
    /// grows by its amount; recorded in the audit event).
    #[arg(long)]
    pub extend: Option<String>,
}

#[derive(Args, Debug)]
pub struct RejectArgs {
    #[command(flatten)]
    pub decide: DecideArgs,
    /// When given, refused if the task holds another call.
    #[command(flatten)]
    pub call: CallArgs,
}

#[derive(Args, Debug)]
pub struct ReconcileArgs {
    /// Task id; without it, list the held writes.
    pub task: Option<String>,
    /// Settle every held write whose tool's lookup gives a definite answer.
    #[arg(long, conflicts_with_all = ["task", "applied", "not_applied"])]
    pub auto: bool,
    /// The write took effect.
    #[arg(long, requires = "task", conflicts_with = "not_applied")]
    pub applied: bool,
    /// The write did not take effect: send it again under the same call key.
    #[arg(long, requires = "task")]
    pub not_applied: bool,
    /// With --applied: the service's result, as JSON (default {"status": "ok"}).
    #[arg(long, requires = "applied")]
    pub result: Option<String>,
    /// When given, refused if the task holds another call.
    #[command(flatten)]
    pub call: CallArgs,
    /// With --not-applied or --applied: grant more budget, e.g. `tool_calls=1` or
    /// `deadline_ms=10000` (each limit grows by its amount; recorded in the audit event).
    #[arg(long, requires = "task")]
    pub extend: Option<String>,
    /// Who decides (default: $USER); recorded in the audit log.
    #[arg(long, default_value_t = default_by())]
    pub by: String,
    /// Why; recorded in the audit log.
    #[arg(long)]
    pub reason: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct EventsArgs {
    /// Only this task's events.
    pub task: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum MemoryCommand {
    /// Store a note (trusted sources only: user_message, validated_tool).
    #[command(
        after_help = "Example:\n  worker memory add --user cu_ana --source user_message --ttl-days 90 --text 'Prefers refunds to the original card.'"
    )]
    Add {
        /// The user the note belongs to; only that user's tasks will see it.
        #[arg(long)]
        user: String,
        /// The note itself.
        #[arg(long)]
        text: String,
        /// Where it came from: user_message or validated_tool (anything else is refused).
        #[arg(long)]
        source: String,
        /// How long the note lives.
        #[arg(long, default_value_t = 90)]
        ttl_days: u64,
        /// Who decides (default: $USER); recorded in the audit log.
        #[arg(long, default_value_t = default_by())]
        by: String,
    },
    /// List live notes (all with --all), of one user when given.
    #[command(after_help = "Example:\n  worker memory list --user cu_ana")]
    List {
        /// Only this user's notes.
        #[arg(long)]
        user: Option<String>,
        /// Include expired notes.
        #[arg(long)]
        all: bool,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete a user's notes, only those from one source when given.
    #[command(
        after_help = "Example:\n  worker memory forget --user cu_ana --source validated_tool"
    )]
    Forget {
        /// Whose notes.
        #[arg(long)]
        user: String,
        /// Only the notes from this source.
        #[arg(long)]
        source: Option<String>,
        /// Who decides (default: $USER); recorded in the audit log.
        #[arg(long, default_value_t = default_by())]
        by: String,
    },
}

const ENQUEUE_HELP: &str = "Models (--model): policy | policy:ORDER:AMOUNT_CENTS[:LATENCY_MS] | same_call | new_ids |
search_loop (each with optional :LATENCY_MS) | script:FILE.jsonl (one reply per line).
Budgets (--budget NAME=VALUE): steps_max, tool_calls_max, tokens_max, output_tokens_max,
deadline_ms, repeat_max, stalls_max, plan_steps_max.

Examples:
  worker enqueue --user cu_ana --goal 'refund the damaged item on order ord_1001'
  worker enqueue --user cu_ana --goal 'refund' --model policy:ord_1004:8000 --key job-7
  worker enqueue --file tasks.jsonl
A line of tasks.jsonl:
  {\"user\": \"cu_ana\", \"goal\": \"refund\", \"key\": \"job-7\", \"priority\": 5,
   \"budget\": {\"steps_max\": 3}, \"model\": \"policy\", \"tool_latency_ms\": {\"issue_refund\": 40000}}";

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Worker threads, each running one task at a time.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub workers: u16,
    /// Exit when nothing is runnable.
    #[arg(long)]
    pub drain: bool,
    /// Lease length: a task whose worker has not committed for this long is taken over.
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(u64).range(1000..))]
    pub lease_ms: u64,
    /// Sleep this many real ms per simulated ms of scripted model and tool latency (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub time_scale: f64,
}

#[derive(Args, Debug)]
pub struct EnqueueArgs {
    /// The user the task runs as (never taken from the model).
    #[arg(long, required_unless_present = "file", conflicts_with = "file")]
    pub user: Option<String>,
    /// The task's goal.
    #[arg(long, required_unless_present = "file", conflicts_with = "file")]
    pub goal: Option<String>,
    /// Idempotency key: enqueueing the same key again returns the existing task.
    #[arg(long, conflicts_with = "file")]
    pub key: Option<String>,
    /// Higher runs first.
    #[arg(
        long,
        default_value_t = 0,
        conflicts_with = "file",
        allow_negative_numbers = true
    )]
    pub priority: i64,
    /// A budget limit, NAME=VALUE; repeatable.
    #[arg(long = "budget", value_name = "NAME=VALUE", conflicts_with = "file")]
    pub budgets: Vec<String>,
    /// The model profile: a built-in one (see below) or a name from the --config file.
    #[arg(long, default_value = "policy", conflicts_with = "file")]
    pub model: String,
    /// Simulated latency of a demo-store tool, TOOL=MS; repeatable.
    #[arg(long = "tool-latency", value_name = "TOOL=MS", conflicts_with = "file")]
    pub tool_latency: Vec<String>,
    /// Demo-store tenant: the task gets its own fresh copy of the document's orders.
    #[arg(long, default_value = "", conflicts_with = "file")]
    pub store_scope: String,
    /// How long the task may wait for an approval before it stops with approval_expired
    /// (default: 24 hours). Separate from the active-time deadline.
    #[arg(long, conflicts_with = "file")]
    pub approval_wait_ms: Option<u64>,
    /// Enqueue every task of a JSONL file in one transaction (all or nothing).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// queued, running, suspended, held or finished.
    #[arg(long)]
    pub status: Option<String>,
    /// A stop reason (done, max_steps, ..., cancelled).
    #[arg(long)]
    pub stop: Option<String>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TaskArgs {
    /// Task id, as printed by `worker enqueue` (e.g. t1).
    pub task: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Task id (e.g. t1).
    pub task: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the spans as OTLP/JSON to this file (one line, as a collector's file receiver reads).
    #[arg(long, value_name = "FILE")]
    pub otlp: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct DemoStoreArgs {
    /// Address to listen on; port 0 picks a free one (printed on the first line of stdout).
    #[arg(long, default_value = "127.0.0.1:8700")]
    pub listen: String,
    /// Handler threads.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub threads: u16,
    /// Fault: added latency of every tool call, in ms.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Fault: fraction of writes whose response is lost after the write was applied.
    #[arg(long, default_value_t = 0.0)]
    pub lose_rate: f64,
    /// Fault: fraction of calls answered 503 before anything is applied.
    #[arg(long, default_value_t = 0.0)]
    pub error_rate: f64,
    /// Seed of the fault draws.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Worker threads of the demo's daemon.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub workers: u16,
    /// Keep the demo's database files in this directory instead of a temporary one.
    #[arg(long)]
    pub keep: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum StoreCommand {
    /// List the store's orders.
    Orders {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Add or replace orders: --order ID:CUSTOMER:TOTAL_CENTS, repeatable.
    #[command(
        after_help = "Example:\n  worker store add-order --order ord_2001:cu_bo:4200 --order ord_2002:cu_cy:15000"
    )]
    AddOrder {
        /// An order: its id, its customer's user id, its total in cents.
        #[arg(
            long = "order",
            value_name = "ID:CUSTOMER:TOTAL_CENTS",
            required = true
        )]
        orders: Vec<String>,
    },
    /// The ledger of effects (refunds and emails), in order.
    Ledger {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every write request that reached the store (applied, replayed, refused, ...), in order:
    /// where a duplicate send shows even when the stored result hid it.
    Arrivals {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// An error for the user: what was wrong, why, and what to do; exit code 1 or 2.
#[derive(Debug)]
pub struct CliError {
    pub message: String,
    pub cause: Option<String>,
    pub hint: Option<String>,
    pub code: i32,
}

impl CliError {
    pub fn usage(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            cause: None,
            hint: None,
            code: 2,
        }
    }

    pub fn op(message: impl Into<String>) -> CliError {
        CliError {
            message: message.into(),
            cause: None,
            hint: None,
            code: 1,
        }
    }

    pub fn hint(mut self, hint: impl Into<String>) -> CliError {
        self.hint = Some(hint.into());
        self
    }

    pub fn render(&self) -> String {
        let mut s = format!("error: {}\n", self.message);
        if let Some(c) = &self.cause {
            s.push_str(&format!("caused by: {c}\n"));
        }
        if let Some(h) = &self.hint {
            s.push_str(&format!("hint: {h}\n"));
        }
        s
    }
}

impl From<store::Error> for CliError {
    fn from(e: store::Error) -> CliError {
        let code = match e {
            store::Error::Invalid(_) => 2,
            _ => 1,
        };
        let hint = match &e {
            store::Error::Missing(_) => Some(
                "run `worker enqueue ...` or `worker run` to create it, or pass --db PATH"
                    .to_string(),
            ),
            store::Error::NoTask(_) => Some("`worker list` shows the task ids".to_string()),
            store::Error::NewerVersion { .. } => {
                Some("use the Tether release that wrote this file, or a newer one".to_string())
            }
            store::Error::Corrupt(_) => Some(
                "restore the file from a backup; this build will not guess at its contents"
                    .to_string(),
            ),
            _ => None,
        };
        CliError {
            message: e.to_string(),
            cause: None,
            hint,
            code,
        }
    }
}

type CliResult = Result<(), CliError>;

fn store_path(cli: &Cli) -> PathBuf {
    cli.store.clone().unwrap_or_else(|| sibling_store(&cli.db))
}

/// `dir/worker.redb` -> `dir/worker.store.redb`.
pub fn sibling_store(db: &Path) -> PathBuf {
    let stem = db.file_stem().and_then(|s| s.to_str()).unwrap_or("worker");
    db.with_file_name(format!("{stem}.store.redb"))
}

pub fn run(cli: Cli) -> CliResult {
    match &cli.command {
        Command::Run(a) => cmd_run(&cli, a),
        Command::Enqueue(a) => cmd_enqueue(&cli, a),
        Command::List(a) => cmd_list(&cli, a),
        Command::Show(a) => cmd_show(&cli, a),
        Command::Trace(a) => cmd_trace(&cli, a),
        Command::Postmortem(a) => cmd_postmortem(&cli, a),
        Command::Demo(a) => cmd_demo(a),
        Command::DemoStore(a) => cmd_demo_store(&cli, a),
        Command::Store(c) => cmd_store(&cli, c),
        Command::Approve(a) => cmd_approve(&cli, a),
        Command::Reject(a) => cmd_reject(&cli, a),
        Command::Reconcile(a) => cmd_reconcile(&cli, a),
        Command::Cancel(a) => cmd_cancel(&cli, a),
        Command::Replay(a) => cmd_replay(&cli, a),
        Command::Events(a) => cmd_events(&cli, a),
        Command::Memory(c) => cmd_memory(&cli, c),
    }
}

fn open_existing(cli: &Cli) -> Result<Store, CliError> {
    Ok(Store::open(&cli.db, false)?)
}

/// For the read verbs: read-only, so they never wait for a process inside a write.
fn open_reader(cli: &Cli) -> Result<Store, CliError> {
    Ok(Store::open_for_reading(&cli.db)?)
}

fn print_json(v: &Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string())
    );
}

fn cmd_run(cli: &Cli, a: &RunArgs) -> CliResult {
    if !(a.time_scale.is_finite() && (0.0..=10.0).contains(&a.time_scale)) {
        return Err(CliError::usage(format!(
            "--time-scale {} must be between 0 and 10",
            a.time_scale
        )));
    }
    let store = Arc::new(Store::open(&cli.db, true)?);
    let tools = Arc::new(DurableStore::open(&store_path(cli))?);
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&shutdown))
            .map_err(|e| CliError::op(format!("cannot install the signal handler: {e}")))?;
    }
    let cfg = Config {
        workers: a.workers as usize,
        drain: a.drain,
        lease_ms: a.lease_ms,
        time_scale: a.time_scale,
        ..Config::default()
    };
    tracing::info!(db = %cli.db.display(), workers = cfg.workers, drain = cfg.drain, "worker started");
    let stats = worker::run(store, tools, &cfg, shutdown)?;
    tracing::info!(
        tasks_ended = stats.tasks_ended.load(std::sync::atomic::Ordering::Relaxed),
        steps = stats.steps.load(std::sync::atomic::Ordering::Relaxed),
        "worker stopped"
    );
    Ok(())
}

/// One line of an enqueue batch file.
#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
struct TaskLine {
    user: String,
    goal: String,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    priority: i64,
    #[serde(default)]
    budget: BTreeMap<String, Value>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    tool_latency_ms: BTreeMap<String, u64>,
    #[serde(default)]
    store_scope: String,
    #[serde(default)]
    approval_wait_ms: Option<u64>,
}

const GOAL_MAX_CHARS: usize = 4000;

fn check_text(field: &str, v: &str, max: usize) -> Result<(), String> {
    if v.trim().is_empty() {
        return Err(format!("--{field} must not be empty"));
    }
    if v.chars().count() > max {
        return Err(format!("--{field} is longer than {max} characters"));
    }
    Ok(())
}

fn parse_model(spec: &str) -> Result<ModelProfile, String> {
    if let Some(file) = spec.strip_prefix("script:") {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("--model script:{file}: cannot read it: {e}"))?;
        return ModelProfile::parse("script", Some(&text))
            .map_err(|e| format!("--model script:{file}: {e}"));
    }
    ModelProfile::parse(spec, None).map_err(|e| format!("--model {spec}: {e}"))
}

fn parse_pair<'a>(flag: &str, s: &'a str) -> Result<(&'a str, &'a str), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .ok_or_else(|| format!("--{flag} {s:?}: expected NAME=VALUE"))
}

fn new_task(l: TaskLine, cfg: Option<&crate::config::Config>) -> Result<NewTask, String> {
    check_text("user", &l.user, 200)?;
    check_text("goal", &l.goal, GOAL_MAX_CHARS)?;
    if let Some(k) = &l.key {
        check_text("key", k, 200)?;
    }
    let mut budget = Budget::default();
    for (k, v) in &l.budget {
        let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
        budget.set(k, &v).map_err(|e| format!("--budget: {e}"))?;
    }
    for tool in l.tool_latency_ms.keys() {
        if Catalog::demo().get(tool).is_none() {
            return Err(format!("--tool-latency: unknown tool {tool:?}"));
        }
    }
    let name = l.model.as_deref().unwrap_or("policy");
    let model = match cfg.and_then(|c| c.models.get(name)) {
        Some(profile) => profile.clone(),
        None => parse_model(name)?,
    };
    Ok(NewTask {
        model,
        catalog: cfg.and_then(|c| c.catalog.clone()),
        user: l.user,
        goal: l.goal,
        key: l.key,
        priority: l.priority,
        budget,
        tool_latency_ms: l.tool_latency_ms,
        store_scope: l.store_scope,
        approval_wait_ms: l
            .approval_wait_ms
            .unwrap_or(store::DEFAULT_APPROVAL_WAIT_MS),
    })
}

fn load_config(cli: &Cli) -> Result<Option<crate::config::Config>, CliError> {
    match &cli.config {
        None => Ok(None),
        Some(p) => crate::config::load(p).map(Some).map_err(|e| {
            let code = if e.starts_with("cannot read") { 1 } else { 2 };
            CliError {
                message: e,
                cause: None,
                hint: Some(
                    "see `worker enqueue --help` and data/worker.toml for the format".into(),
                ),
                code,
            }
        }),
    }
}

fn cmd_enqueue(cli: &Cli, a: &EnqueueArgs) -> CliResult {
    let cfg = load_config(cli)?;
    let tasks = match &a.file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| CliError::op(format!("cannot read {}: {e}", path.display())))?;
            let mut tasks = Vec::new();
            for (n, line) in text.lines().enumerate() {
                if line.trim().is_empty() {
                    continue;
                }
                let at = |m: String| CliError::usage(format!("{}:{}: {m}", path.display(), n + 1));
                let l: TaskLine = serde_json::from_str(line).map_err(|e| at(e.to_string()))?;
                let t = new_task(l, cfg.as_ref()).map_err(at)?;
                tasks.push(t);
            }
            if tasks.is_empty() {
                return Err(CliError::usage(format!(
                    "{}: no tasks in the file",
                    path.display()
                )));
            }
            tasks
        }
        None => {
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
            let t = new_task(
                TaskLine {
                    user: a.user.clone().unwrap_or_default(),
                    goal: a.goal.clone().unwrap_or_default(),
                    key: a.key.clone(),
                    priority: a.priority,
                    budget,
                    model: Some(a.model.clone()),
                    tool_latency_ms: latency,
                    store_scope: a.store_scope.clone(),
                    approval_wait_ms: a.approval_wait_ms,
                },
                cfg.as_ref(),
            )
            .map_err(CliError::usage)?;
            vec![t]
        }
    };
    let store = Store::open(&cli.db, true)?;
    let out = store.enqueue(&tasks, now_ms())?;
    if a.json {
        let v: Vec<Value> = out
            .iter()
            .map(|e| json!({"id": e.id, "created": e.created}))
            .collect();
        print_json(&Value::Array(v));
    } else {
        for e in &out {
            if e.created {
                println!("{}", e.id);
            } else {
                println!("{} (already enqueued with this key)", e.id);
            }
        }
    }
    Ok(())
}

fn record_json(r: &TaskRecord) -> Value {
    json!({
        "id": r.id,
        "status": r.status.as_str(),
        "stop": r.state.stop.map(|s| s.as_str()),
        "user": r.state.user_id,
        "goal": r.state.goal,
        "priority": r.priority,
        "key": r.key,
        "steps": r.state.step,
        "tool_calls": r.state.tool_calls,
        "tokens": r.state.tokens,
        "elapsed_s": r.state.elapsed_ms as f64 / 1000.0,
        "runs": r.runs,
        "created_at_ms": r.created_at_ms,
        "updated_at_ms": r.updated_at_ms,
    })
}

fn cmd_list(cli: &Cli, a: &ListArgs) -> CliResult {
    // Damaged (quarantined) records are listed with the others, or alone with --status damaged.
    let only_damaged = a.status.as_deref() == Some("damaged");
    let status = match &a.status {
        Some(_) if only_damaged => None,
        Some(s) => Some(QueueStatus::parse(s).ok_or_else(|| {
            CliError::usage(format!("--status {s:?} is not a status"))
                .hint("use queued, running, suspended, held, finished or damaged")
        })?),
        None => None,
    };
    let stop = match &a.stop {
        Some(s) => Some(StopReason::parse(s).ok_or_else(|| {
            CliError::usage(format!("--stop {s:?} is not a stop reason")).hint(
                "use done, max_steps, max_tool_calls, max_tokens, deadline, repeated_call, no_progress, needs_approval, unknown_outcome or cancelled",
            )
        })?),
        None => None,
    };
    let store = open_reader(cli)?;
    let tasks: Vec<TaskRecord> = store
        .tasks()?
        .into_iter()
        .filter(|r| !only_damaged && status.is_none_or(|s| r.status == s))
        .filter(|r| stop.is_none_or(|s| r.state.stop == Some(s)))
        .collect();
    let damaged = if status.is_none() && stop.is_none() {
        store.damaged()?
    } else {
        Vec::new()
    };
    if a.json {
        let mut v: Vec<Value> = tasks.iter().map(record_json).collect();
        v.extend(
            damaged
                .iter()
                .map(|(id, why)| json!({"id": id, "status": "damaged", "error": why})),
        );
        print_json(&Value::Array(v));
        return Ok(());
    }
    println!(
        "{:8} {:10} {:16} {:>5} {:>5} {:>6} {:>6}  {:10} goal",
        "id", "status", "stop", "steps", "tools", "tokens", "secs", "user"
    );
    for r in &tasks {
        let goal: String = r.state.goal.chars().take(48).collect();
        println!(
            "{:8} {:10} {:16} {:>5} {:>5} {:>6} {:>6.1}  {:10} {}",
            r.id,
            r.status.as_str(),
            r.state.stop.map_or("-", |s| s.as_str()),
            r.state.step,
            r.state.tool_calls,
            r.state.tokens,
            r.state.elapsed_ms as f64 / 1000.0,
            r.state.user_id,
            goal
        );
    }
    for (id, why) in &damaged {
        println!("{id:8} damaged    {why}");
    }
    Ok(())
}

fn cmd_show(cli: &Cli, a: &TaskArgs) -> CliResult {
    let store = open_reader(cli)?;
    let r = store.task(&a.task)?;
    let catalog = r.catalog.clone().unwrap_or_else(Catalog::demo);
    let closing = closing_message(&r.state, &catalog);
    let b = &r.budget;
    if a.json {
        let mut v = record_json(&r);
        v["state"] = serde_json::from_str(&r.state.to_json()).unwrap_or(Value::Null);
        v["budget"] = serde_json::to_value(b).unwrap_or(Value::Null);
        v["model"] = serde_json::to_value(&r.model).unwrap_or(Value::Null);
        v["closing_message"] = Value::String(closing);
        v["calls"] = match store.calls(&r.id) {
            Ok(calls) => serde_json::to_value(calls).unwrap_or(Value::Null),
            Err(e) => json!({"error": e.to_string()}),
        };
        if let Some(p) = &r.state.pending {
            v["held"] = json!({"tool": p.name, "args": p.args,
                "key": store.call_key(p, &r.id, r.state.step), "digest": p.digest()});
        }
        print_json(&v);
        return Ok(());
    }
    let st = &r.state;
    println!(
        "task      {}  ({}; {} run(s))",
        r.id,
        r.status.as_str(),
        r.runs
    );
    println!("user      {}", st.user_id);
    println!("goal      {}", st.goal);
    println!("stop      {}", st.stop.map_or("-", |s| s.as_str()));
    if let Some(ans) = &st.answer {
        println!("answer    {ans}");
    }
    println!("plan");
    if st.plan.is_empty() {
        println!("  (none)");
    }
    for s in &st.plan {
        println!(
            "  {:4} {:18} {:8} after {:?}",
            s.id,
            s.tool,
            s.status.as_str(),
            s.depends_on
        );
    }
    println!("budget    used / limit");
    println!("  steps       {:>6} / {}", st.step, b.steps_max);
    println!("  tool calls  {:>6} / {}", st.tool_calls, b.tool_calls_max);
    println!("  tokens      {:>6} / {}", st.tokens, b.tokens_max);
    println!(
        "  active s    {:>6.1} / {:.1}",
        st.elapsed_ms as f64 / 1000.0,
        b.deadline_ms as f64 / 1000.0
    );
    println!("  stalls      {:>6} / {}", st.stalls, b.stalls_max);
    if let Some(p) = &st.pending {
        println!(
            "held      {} {} key {} digest {}",
            p.name,
            Value::Object(p.args.clone()),
            store.call_key(p, &st.task_id, st.step),
            p.digest()
        );
    }
    println!("closing   {closing}");
    Ok(())
}

fn cmd_trace(cli: &Cli, a: &TraceArgs) -> CliResult {
    let store = open_reader(cli)?;
    let rec = store.task(&a.task)?;
    let spans = store.spans(&a.task)?;
    if let Some(path) = &a.otlp {
        let doc = crate::otlp::export(&rec, &spans);
        std::fs::write(path, format!("{doc}\n"))
            .map_err(|e| CliError::op(format!("cannot write {}: {e}", path.display())))?;
        println!("{} spans written to {}", spans.len(), path.display());
        return Ok(());
    }
    if a.json {
        print_json(&serde_json::to_value(&spans).unwrap_or(Value::Null));
    } else {
        print!("{}", span_table(&spans));
    }
    Ok(())
}

fn cmd_postmortem(cli: &Cli, a: &TaskArgs) -> CliResult {
    let store = open_reader(cli)?;
    let r = store.task(&a.task)?;
    let pm = postmortem(&r.state, &store.spans(&a.task)?);
    if a.json {
        print_json(&serde_json::to_value(&pm).unwrap_or(Value::Null));
    } else {
        println!("{}", pm.to_python());
    }
    Ok(())
}

/// Effects of one task: ledger entries whose call key belongs to it.
/// The effects of one task of the database whose id is `db_id` (keys are `db_id:task:step`).
pub fn task_effects(ledger: &[LedgerEntry], db_id: &str, task_id: &str) -> Vec<Effect> {
    let prefix = format!("{db_id}:{task_id}:");
    ledger
        .iter()
        .filter(|e| e.key.starts_with(&prefix))
        .map(|e| e.effect.clone())
        .collect()
}

fn cmd_demo(a: &DemoArgs) -> CliResult {
    let (dir, _guard) = match &a.keep {
        Some(d) => {
            std::fs::create_dir_all(d)
                .map_err(|e| CliError::op(format!("cannot create {}: {e}", d.display())))?;
            (d.clone(), None)
        }
        None => {
            let d = std::env::temp_dir().join(format!(
                "tether-demo-{}-{}",
                std::process::id(),
                now_ms()
            ));
            std::fs::create_dir_all(&d)
                .map_err(|e| CliError::op(format!("cannot create {}: {e}", d.display())))?;
            (d.clone(), Some(RemoveOnDrop(d)))
        }
    };
    let db = dir.join("worker.redb");
    let store = Arc::new(Store::open(&db, true)?);
    let tools = Arc::new(DurableStore::open(&sibling_store(&db))?);
    let all = scenarios();
    let tasks: Vec<NewTask> = all
        .iter()
        .map(|sc| NewTask {
            user: crate::sim::DEFAULT_USER.into(),
            goal: crate::sim::DEFAULT_GOAL.into(),
            key: Some(format!("demo-{}", &sc.name[..1])),
            priority: 0,
            budget: sc.budget,
            model: sc.model.clone(),
            tool_latency_ms: sc
                .tool_latency
                .iter()
                .map(|(t, ms)| (t.to_string(), *ms))
                .collect(),
            catalog: None,
            store_scope: sc.name[..1].to_string(),
            approval_wait_ms: store::DEFAULT_APPROVAL_WAIT_MS,
        })
        .collect();
    let ids = store.enqueue(&tasks, now_ms())?;
    let cfg = Config {
        workers: a.workers as usize,
        drain: true,
        ..Config::default()
    };
    worker::run(
        Arc::clone(&store),
        Arc::clone(&tools),
        &cfg,
        Arc::new(AtomicBool::new(false)),
    )?;
    let ledger = tools.ledger()?;
    println!("{SCENARIO_HEADER}");
    for (sc, e) in all.iter().zip(&ids) {
        let r = store.task(&e.id)?;
        println!(
            "{}",
            scenario_row(
                sc.name,
                &r.state,
                &effects_to_python(&task_effects(&ledger, store.db_id(), &e.id))
            )
        );
    }
    if a.keep.is_some() {
        println!(
            "\ndatabase kept: {} (try: worker --db {} trace t1)",
            db.display(),
            db.display()
        );
    }
    Ok(())
}

struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cmd_store(cli: &Cli, c: &StoreCommand) -> CliResult {
    let open = || DurableStore::open(&store_path(cli));
    match c {
        StoreCommand::Orders { json } => {
            let orders = open()?.orders()?;
            if *json {
                print_json(&serde_json::to_value(&orders).unwrap_or(Value::Null));
            } else {
                println!(
                    "{:16} {:10} {:>8} {:>8} status",
                    "order", "customer", "total", "refunded"
                );
                for (id, o) in &orders {
                    println!(
                        "{:16} {:10} {:>8} {:>8} {}",
                        id, o.customer, o.total, o.refunded, o.status
                    );
                }
            }
        }
        StoreCommand::AddOrder { orders } => {
            let mut parsed = Vec::new();
            for o in orders {
                let parts: Vec<&str> = o.split(':').collect();
                let [id, customer, total] = parts.as_slice() else {
                    return Err(CliError::usage(format!(
                        "--order {o:?}: expected ID:CUSTOMER:TOTAL_CENTS"
                    )));
                };
                let total: i64 = total.parse().ok().filter(|t| *t > 0).ok_or_else(|| {
                    CliError::usage(format!(
                        "--order {o:?}: total must be a positive whole number of cents"
                    ))
                })?;
                if id.is_empty() || customer.is_empty() || id.contains('/') {
                    return Err(CliError::usage(format!(
                        "--order {o:?}: id and customer must be non-empty (and the id without '/')"
                    )));
                }
                parsed.push((
                    id.to_string(),
                    Order {
                        customer: customer.to_string(),
                        total,
                        refunded: 0,
                        status: "delivered".into(),
                    },
                ));
            }
            open()?.put_orders(&parsed)?;
            println!("{} order(s) stored", parsed.len());
        }
        StoreCommand::Ledger { json } => {
            let ledger = open()?.ledger()?;
            if *json {
                print_json(&serde_json::to_value(&ledger).unwrap_or(Value::Null));
            } else {
                for e in &ledger {
                    println!("{:6} {:24} {}", e.seq, e.key, e.effect.to_python());
                }
            }
        }
        StoreCommand::Arrivals { json } => {
            let arrivals = open()?.arrivals()?;
            if *json {
                print_json(&serde_json::to_value(&arrivals).unwrap_or(Value::Null));
            } else {
                for a in &arrivals {
                    println!(
                        "{:6} {:24} {:18} {} {}",
                        a.seq, a.key, a.tool, a.digest, a.outcome
                    );
                }
            }
        }
    }
    Ok(())
}

fn decision(by: &str, reason: &Option<String>) -> Result<Decision, CliError> {
    if by.trim().is_empty() {
        return Err(CliError::usage("--by must not be empty"));
    }
    Ok(Decision {
        by: by.to_string(),
        reason: reason.clone(),
        now_ms: now_ms(),
    })
}

fn extension(text: &Option<String>) -> Result<Extension, CliError> {
    match text {
        Some(t) => Extension::parse(t).map_err(CliError::usage),
        None => Ok(Extension::default()),
    }
}

fn cmd_approve(cli: &Cli, a: &ApproveArgs) -> CliResult {
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
    println!(
        "approved {} {} for task {}; it is queued and runs the call first",
        call.name,
        Value::Object(call.args.clone()),
        a.decide.task
    );
    Ok(())
}

fn cmd_reject(cli: &Cli, a: &RejectArgs) -> CliResult {
    let d = decision(&a.decide.by, &a.decide.reason)?;
    let call = open_existing(cli)?.reject(&a.decide.task, &a.call.reviewed(), &d)?;
    println!(
        "rejected {} for task {}; it is queued and continues without it",
        call.name, a.decide.task
    );
    Ok(())
}

fn cmd_reconcile(cli: &Cli, a: &ReconcileArgs) -> CliResult {
    let store = if a.task.is_none() && !a.auto {
        open_reader(cli)?
    } else {
        open_existing(cli)?
    };
    if a.auto {
        return reconcile_auto(cli, &store, a);
    }
    let Some(task) = &a.task else {
        let held = store.held()?;
        if a.json {
            let v: Vec<Value> = held
                .iter()
                .map(|(r, c)| {
                    let p = r.state.pending.as_ref();
                    json!({
                        "task": r.id,
                        "tool": p.map(|p| p.name.clone()),
                        "args": p.map(|p| Value::Object(p.args.clone())),
                        "key": p.map(|p| store.call_key(p, &r.id, r.state.step)),
                        "digest": p.map(|p| p.digest()),
                        "status": r.status.as_str(),
                        "since_ms": c.as_ref().map_or(r.updated_at_ms, |c| c.intent_at_ms),
                        "known": c.as_ref().and_then(|c| c.result.clone()),
                    })
                })
                .collect();
            print_json(&Value::Array(v));
            return Ok(());
        }
        if held.is_empty() {
            println!("no held writes");
        }
        for (r, c) in &held {
            let Some(p) = &r.state.pending else { continue };
            let known = match c.as_ref().and_then(|c| c.result.clone()) {
                Some(v) => format!("last answer {v}"),
                None => "no answer: the worker stopped while the call was in flight".into(),
            };
            let since = c.as_ref().map_or(r.updated_at_ms, |c| c.intent_at_ms);
            let cancelled = if r.status == QueueStatus::Finished {
                "  (task cancelled)"
            } else {
                ""
            };
            println!(
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
                Some(text) => serde_json::from_str::<Value>(text)
                    .map_err(|e| CliError::usage(format!("--result is not JSON: {e}")))?,
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
    println!(
        "recorded {} for task {} as {what}; the task is queued",
        call.name, task
    );
    Ok(())
}

fn cmd_cancel(cli: &Cli, a: &DecideArgs) -> CliResult {
    let d = decision(&a.by, &a.reason)?;
    match open_existing(cli)?.cancel(&a.task, &d)? {
        QueueStatus::Running => println!(
            "task {} will stop at its next step boundary (cancelled)",
            a.task
        ),
        _ => println!("task {} cancelled", a.task),
    }
    Ok(())
}

fn cmd_replay(cli: &Cli, a: &TaskArgs) -> CliResult {
    let store = open_reader(cli)?;
    let rec = store.task(&a.task)?;
    if matches!(rec.status, QueueStatus::Queued | QueueStatus::Running) {
        return Err(CliError::op(format!(
            "task {} is {}; replay a task that has stopped",
            rec.id,
            rec.status.as_str()
        )));
    }
    let ledger = DurableStore::open(&store_path(cli))?.ledger()?;
    let stored = task_effects(&ledger, store.db_id(), &rec.id);
    let report = crate::replay::replay(
        &rec,
        store.replies(&rec.id)?,
        &store.events(Some(&rec.id))?,
        &stored,
    );
    if a.json {
        print_json(&json!({
            "task": rec.id,
            "same_state": report.same_state,
            "same_effects": report.same_effects,
            "stop": report.state.stop.map(|s| s.as_str()),
            "effects": effects_to_python(&report.effects),
            "stored_effects": effects_to_python(&stored),
        }));
    } else {
        let yn = |b: bool| if b { "identical" } else { "DIFFERENT" };
        println!(
            "replay of {}: stop {}, {} steps",
            rec.id,
            report.state.stop.map_or("-", |s| s.as_str()),
            report.state.step
        );
        println!("final state JSON: {}", yn(report.same_state));
        println!(
            "effects         : {} {}",
            yn(report.same_effects),
            effects_to_python(&report.effects)
        );
    }
    if report.same_state && report.same_effects {
        Ok(())
    } else {
        Err(CliError::op(format!("the replay of task {} differs from the stored run", rec.id))
            .hint("a run that crashed mid-write, or was settled by reconcile, can differ: its tool results are not recorded"))
    }
}

fn cmd_events(cli: &Cli, a: &EventsArgs) -> CliResult {
    let store = open_reader(cli)?;
    if let Some(t) = &a.task {
        store.task(t)?;
    }
    let events = store.events(a.task.as_deref())?;
    if a.json {
        print_json(&serde_json::to_value(&events).unwrap_or(Value::Null));
        return Ok(());
    }
    for e in &events {
        println!(
            "{:5} {} {:8} {:22} by {:10} {}  {}",
            e.seq,
            e.at_ms,
            e.task.as_deref().unwrap_or("-"),
            e.verb,
            e.by,
            e.reason
                .as_deref()
                .map_or(String::new(), |r| format!("({r})")),
            e.detail
        );
    }
    Ok(())
}

fn cmd_memory(cli: &Cli, c: &MemoryCommand) -> CliResult {
    match c {
        MemoryCommand::Add {
            user,
            text,
            source,
            ttl_days,
            by,
        } => {
            if user.trim().is_empty() {
                return Err(CliError::usage("--user must not be empty"));
            }
            let d = decision(by, &None)?;
            let store = Store::open(&cli.db, true)?;
            let note = store.add_note(user, text, source, ttl_days.saturating_mul(86_400), &d)?;
            println!(
                "stored for {} until {} (unix seconds)",
                note.user, note.expires_at_s
            );
        }
        MemoryCommand::List {
            user,
            all,
            json: as_json,
        } => {
            let notes = open_reader(cli)?.notes(user.as_deref(), now_ms(), *all)?;
            if *as_json {
                print_json(&serde_json::to_value(&notes).unwrap_or(Value::Null));
            } else {
                for n in &notes {
                    println!(
                        "{:10} {:16} expires {:>10}  {}",
                        n.user, n.source, n.expires_at_s, n.text
                    );
                }
            }
        }
        MemoryCommand::Forget { user, source, by } => {
            let d = decision(by, &None)?;
            let n = open_existing(cli)?.forget(user, source.as_deref(), &d)?;
            println!("{n} note(s) deleted");
        }
    }
    Ok(())
}

/// Settles held writes from each tool's lookup, only on a definite answer.
fn reconcile_auto(cli: &Cli, store: &Store, a: &ReconcileArgs) -> CliResult {
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
                    demo = Some(DurableStore::open(&store_path(cli))?);
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
                println!("{}  {} key {}: left held ({why})", rec.id, call.name, key);
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
                println!(
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
                println!("{}  {} key {}: left held ({e})", rec.id, call.name, key);
            }
        }
    }
    println!("{settled} settled, {skipped} left held");
    Ok(())
}

fn cmd_demo_store(cli: &Cli, a: &DemoStoreArgs) -> CliResult {
    for (name, rate) in [("--lose-rate", a.lose_rate), ("--error-rate", a.error_rate)] {
        if !(0.0..=1.0).contains(&rate) {
            return Err(CliError::usage(format!(
                "{name} {rate} must be between 0 and 1"
            )));
        }
    }
    let path = match &cli.store {
        Some(p) => p.clone(),
        None if cli.db != Path::new("worker.redb") => cli.db.clone(),
        None => sibling_store(&cli.db),
    };
    let tools = DurableStore::open(&path)?;
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .map_err(|e| CliError::op(format!("cannot install the signal handler: {e}")))?;
    }
    let faults = crate::tools::service::Faults {
        latency_ms: a.latency_ms,
        lose_rate: a.lose_rate,
        error_rate: a.error_rate,
        seed: a.seed,
    };
    crate::tools::service::serve(tools, &a.listen, faults, a.threads as usize, stop, |addr| {
        use std::io::Write;
        println!("listening on http://{addr}");
        let _ = std::io::stdout().flush();
    })
    .map_err(CliError::op)
}
