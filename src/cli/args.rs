//! The command line's arguments: every verb, its flags and its `--help` examples.

use super::*;

const AFTER_HELP: &str = "Examples:
  worker demo                                   # scenarios A-H through the durable path
  worker enqueue --user cu_ana --goal 'refund the damaged item on order ord_1001' --model policy --key job-42
  worker run --drain                            # run until nothing is runnable
  worker list --status finished --json
  worker show t1
  worker trace t1

The database is ./worker.redb unless --db or WORKER_DB says otherwise. The demo shop (the
orders and refund ledger that the demo's tools act on) is a second file beside it (--store or
WORKER_STORE on the verbs that reach it: run, console, reconcile, replay, check, migrate,
store, demo-store), opened only when a task calls one of its tools. With --db
postgres://user@host/db (several hosts share one queue) the demo shop is a schema of the same
database, and every verb works the same way.";

#[derive(Parser, Debug)]
#[command(name = "worker", version, about = "Tether: a durable, bounded agent worker on redb or PostgreSQL", after_help = AFTER_HELP)]
pub struct Cli {
    /// The worker database: a redb file shared by the processes of one host, or
    /// postgres://user@host:port/db[?schema=NAME] shared by daemons on several hosts.
    #[arg(long, global = true, env = "WORKER_DB", default_value = "worker.redb")]
    pub db: String,
    /// Config file (TOML) with model profiles and the tool catalog, for `worker enqueue`.
    #[arg(long, global = true, env = "WORKER_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log lines on stderr as text (for people) or json (one object per line, for log
    /// shippers). RUST_LOG sets the level (default: info for daemons, warn otherwise).
    #[arg(long, global = true, env = "WORKER_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run the daemon: claim tasks and run thousands at once while they wait on models and tools.
    #[command(
        after_help = "Example:\n  RUST_LOG=info worker run                    # until SIGINT/SIGTERM\n  worker run --drain                          # until the queue is empty\n  worker run --console 127.0.0.1:8080         # with the web console and the HTTP API\n  worker run --shared                         # beside other daemons on the same file\n\nOn a file, the daemon is its only writer (unless --shared) and serves a local API on a Unix\nsocket beside it (worker.redb.sock, mode 0600): while it runs, `worker enqueue`, the\ndecisions (approve, reject, reconcile, answer, cancel), `memory add|forget`, `purge` and the\nschedules' changes go through it. It holds worker.redb.lock, which names its pid; a second\ndaemon on the file is refused. Daemons started with --shared share the file, and the one\nholding the lock serves the socket."
    )]
    Run(RunArgs),
    /// Add a task (or a batch from a JSONL file) to the queue; prints the task id.
    #[command(after_help = ENQUEUE_HELP)]
    Enqueue(EnqueueArgs),
    /// Wait until a task finishes or starts waiting on a person; print its answer, and exit
    /// with a code that says how it ended.
    #[command(after_help = WAIT_HELP)]
    Wait(WaitArgs),
    /// List tasks.
    #[command(
        after_help = "Example:\n  worker list --status held\n  worker list --user cu_ana --since 7d --limit 20\n  worker list --before t950          # the next page, as the last one printed\n  worker list --stop max_steps --json\n\nNewest first, --limit 50 by default. Each filter reads through an index, never every task."
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
    /// A task's post-mortem: what it did, why it stopped, and what an operator can do.
    #[command(after_help = "Example:\n  worker postmortem t2")]
    Postmortem(TaskArgs),
    /// Serve the demo shop over HTTP (Stripe-style idempotency keys, fault injection).
    /// Its file is --store, or --db when given, or worker.store.redb.
    #[command(
        name = "demo-store",
        after_help = "Example:\n  worker demo-store --listen 127.0.0.1:8700 --db store.redb --lose-rate 0.2"
    )]
    DemoStore(DemoStoreArgs),
    /// The web console and the HTTP API (/api/v1, for services and jobs): tasks, a task's
    /// trace and budgets, held writes and questions; approve, reject, reconcile, answer and
    /// cancel with the same audit events as the CLI. `worker serve` is the same server.
    #[command(
        visible_alias = "serve",
        after_help = "Example:\n  worker console                                   # http://127.0.0.1:8080\n  worker console --listen 0.0.0.0:8080 --token-file tokens.txt\n\nA token file has one `NAME TOKEN [ROLE]` line per caller (tokens of at least 16\ncharacters; ROLE is operator, the default, or submit: an API caller that creates\ntasks and reads its own). An operator's name is recorded in the audit log of each\ndecision, and /metrics and /healthz need a token too unless --public-metrics.\n\nThe API: /api/v1 (its OpenAPI document at /api/v1/openapi.json), with\nAuthorization: Bearer TOKEN. Without a token file, the console\nlistens on loopback only, answers only requests addressed to a loopback name (so a web\npage cannot reach it through DNS rebinding), and records --by. Forms sent from another\nsite (Origin, Sec-Fetch-Site) are refused.\n\nA daemon on a file is its only writer: serve the console from it (worker run --console\nADDR --console-token-file FILE), or start the daemon with --shared to run this beside it."
    )]
    Console(ConsoleArgs),
    /// Every tool a task may call (the demo shop's, the catalog's, the MCP servers'), as the
    /// worker resolves it.
    #[command(
        subcommand,
        after_help = "Example:\n  worker --config worker.toml tools list\n  worker --config worker.toml tools list --json"
    )]
    Tools(ToolsCommand),
    /// Cron schedules stored in the database: each tick enqueues one task.
    #[command(subcommand, after_help = super::schedule::SCHEDULE_HELP)]
    Schedule(super::schedule::ScheduleCommand),
    /// Enqueue scenarios A-H on a fresh temporary database, run them, print the table.
    #[command(
        after_help = "Example:\n  worker demo\n  worker demo --keep ./demo    # keep its databases to look at"
    )]
    Demo(DemoArgs),
    /// The demo shop: its orders and refund ledger.
    Store(StoreArgs),
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
    /// Answer the question a task asked a person (`ask_person`); the task is requeued and
    /// goes on with the answer.
    #[command(
        after_help = "Examples:\n  worker show t9                 # the question, and the choices it offers\n  worker answer t9 --text office --by ana\n  worker answer t9 --text 'ord_1001, on the receipt' --reason 'called the customer'\n\nThe answer reaches the model as the person's words (at most 4,000 characters; one of the\nchoices, as written, when the question offers some). Who answered is recorded in the audit\nlog, not shown to the model."
    )]
    Answer(AnswerArgs),
    /// Continue a finished task with a follow-up message: its next turn runs on the same
    /// state (facts, memory) with the conversation so far.
    #[command(
        after_help = "Examples:\n  worker say t4 --text 'and the second order?' --wait\n  worker say t4 --text 'refund it to the card' --turn 2   # refused if t4 moved past turn 2\n\nEach turn gets the budget the task was enqueued with, counted from where the conversation\nstands; a conversation has at most 20 turns. The message reaches the model as the person's\nwords (at most 4,000 characters). A task takes a message once it finished (not while it\nruns or waits on a person, nor with a write to reconcile)."
    )]
    Say(SayArgs),
    /// Cancel a queued, running (at its next step boundary), suspended or held task.
    #[command(after_help = "Example:\n  worker cancel t3 --reason 'customer withdrew the request'")]
    Cancel(DecideArgs),
    /// Re-run a task offline from its recorded replies against a fresh copy of the demo shop,
    /// and compare its final state and effects with the stored ones (exit 1 if they differ).
    #[command(after_help = "Example:\n  worker replay t1 --json")]
    Replay(ReplayArgs),
    /// Follow a task's events (steps, model moves, tool calls, decisions) until it finishes.
    #[command(after_help = super::watch::WATCH_HELP)]
    Watch(super::watch::WatchArgs),
    /// The audit log (who, what, when, why), of one task when given.
    #[command(after_help = "Example:\n  worker events t7")]
    Events(EventsArgs),
    /// Long-term memory: notes from trusted sources, scoped to a user, expiring.
    #[command(subcommand)]
    Memory(MemoryCommand),
    /// Verify every record of the database (and of the demo shop's): checksums, rows,
    /// blobs, and the storage engine's own integrity check. Exit 1 if anything is damaged.
    #[command(after_help = "Example:\n  worker check\n  worker check --json")]
    Check(ShopJsonArgs),
    /// Delete finished tasks (with their spans, replies, call records, audit events and
    /// enqueue keys) last updated longer ago than DURATION, in bounded transactions; each
    /// transaction records a `purge` audit event.
    #[command(
        after_help = "Example:\n  worker purge --finished-before 30d --by alice\n  worker purge --finished-before 12h --json\n\nDURATION is a whole number with a unit: s, m, h or d. A purged task's enqueue key\ncan be used again."
    )]
    Purge(PurgeArgs),
    /// Create the database, or bring it to this release's schema (PostgreSQL: the versioned
    /// migrations, under an advisory lock; `run` and `enqueue` do the same on their own).
    #[command(
        after_help = "Example:\n  worker migrate --db postgres://tether@db.internal/jobs\n  worker migrate --db postgres://tether@db.internal/jobs?schema=team_a"
    )]
    Migrate(ShopJsonArgs),
}

/// A verb that reads a task and may reach the demo shop.
#[derive(Args, Debug)]
pub struct ReplayArgs {
    /// Task id, as printed by `worker enqueue` (e.g. t1), or key:KEY (its enqueue key).
    pub task: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub shop: ShopArg,
}

/// `--json`, and where the demo shop is.
#[derive(Args, Debug)]
pub struct ShopJsonArgs {
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub shop: ShopArg,
}

/// A verb whose only flag is `--json`.
#[derive(Args, Debug)]
pub struct JsonArgs {
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

pub use crate::clock::parse_duration_ms;

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
        /// Who decides, as recorded in the audit log.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
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
        /// Who decides, as recorded in the audit log.
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

const ENQUEUE_HELP: &str = "Models (--model): policy | policy:ORDER:AMOUNT_CENTS[:LATENCY_MS] | same_call | new_ids |
search_loop | script:FILE.jsonl (one reply per line); each with optional :LATENCY_MS, the
simulated time a reply takes (default 1500), which counts against deadline_ms.
Budgets (--budget NAME=VALUE): steps_max, tool_calls_max, tokens_max, output_tokens_max,
deadline_ms, repeat_max, stalls_max, plan_steps_max, replans_max.

Examples:
  worker enqueue --user cu_ana --goal 'refund the damaged item on order ord_1001' --model policy
  worker enqueue --user cu_ana --goal 'refund' --model policy:ord_1004:8000 --key job-7
  worker enqueue --user cu_ana --goal 'refund' --model support    # a profile of --config
  worker enqueue --file tasks.jsonl
A line of tasks.jsonl:
  {\"user\": \"cu_ana\", \"goal\": \"refund\", \"key\": \"job-7\", \"priority\": 5,
   \"budget\": {\"steps_max\": 3}, \"model\": \"policy\", \"tool_latency_ms\": {\"issue_refund\": 40000}}

While a daemon runs on the file, the tasks are handed to it through its socket and it commits
them; otherwise the file is opened here. A daemon that does not answer within 60 s
(WORKER_DAEMON_TIMEOUT_MS) is reported, exit 1, and the request is not sent again: the tasks
may or may not be enqueued (with --key, running the same enqueue again is safe).";

#[derive(Args, Debug)]
pub struct RunArgs {
    /// The most tasks running at once. A running task waiting on its model or a tool holds
    /// no thread (the daemon runs on about one thread per core), so this bounds memory and
    /// open connections, not threads; model profiles' rate limits and concurrency keys bound
    /// it further.
    #[arg(long, value_name = "N", default_value_t = crate::worker::MAX_IN_FLIGHT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_in_flight: usize,
    /// Retired: tasks no longer hold a thread each (see --max-in-flight).
    #[arg(long, hide = true, value_name = "N")]
    pub workers: Option<String>,
    /// Exit when nothing is runnable.
    #[arg(long)]
    pub drain: bool,
    /// Lease length: a task whose worker has not committed for this long is taken over.
    #[arg(long, default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(1000..=crate::limits::LEASE_MS_MAX as u64))]
    pub lease_ms: u64,
    /// Sleep this many real ms per simulated ms of scripted model and tool latency (0: none).
    #[arg(long, default_value_t = 0.0)]
    pub time_scale: f64,
    /// With PostgreSQL: how long this daemon's heartbeat vouches for its claims; a daemon
    /// silent for longer (killed, or cut off) has its tasks taken over by the others.
    /// A thread of its own beats every third of it; the least is 3000 (a beat is a database
    /// write, which a busy or briefly unreachable server can hold up for a second or two).
    #[arg(long, default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(crate::worker::HEARTBEAT_TTL_MS_MIN..=crate::limits::LEASE_MS_MAX as u64))]
    pub heartbeat_ttl_ms: u64,
    /// How often to look for tasks whose lease expired or whose daemon is gone.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub recover_every_ms: u64,
    /// Do not settle held writes by asking their tool's lookup_url (by default the daemon
    /// asks, with backoff, and settles what the lookup answers; the rest waits for
    /// `worker reconcile`).
    #[arg(long)]
    pub no_auto_settle: bool,
    /// On a file (the default there): be its only writer while this daemon runs (redb's
    /// single-writer mode, whose commits are quicker than shared writing). A second daemon on
    /// the file is refused, and so is any process that would open it for writing: `worker
    /// enqueue`, the decisions, `memory add|forget`, `purge` and `schedule
    /// add|pause|resume|remove` go through this daemon's socket; `check`, `migrate`,
    /// `console`, `reconcile --auto` and `schedule tick` are refused until it stops (serve the
    /// console from the daemon with --console). Readers (list, show, wait, ...) read on.
    #[arg(long)]
    pub sole_writer: bool,
    /// On a file: share it for writing with other daemons and `worker console` processes
    /// (redb's multi-writer mode: every commit costs more), instead of being its only writer.
    /// Daemons on PostgreSQL always share their database.
    #[arg(long, conflicts_with = "sole_writer")]
    pub shared: bool,
    /// Serve the web console and the HTTP API from this daemon (what `worker console` serves),
    /// on this address, e.g. 127.0.0.1:8080; a non-loopback one needs --console-token-file.
    /// Without a token file, decisions are recorded as $USER. The way to a console beside a
    /// daemon that is its file's only writer, which admits no `worker console` process.
    #[arg(long, value_name = "ADDR")]
    pub console: Option<String>,
    /// With --console: who may sign in and call the API, as `worker console --token-file`.
    #[arg(long, value_name = "FILE", requires = "console")]
    pub console_token_file: Option<PathBuf>,
    /// With --console-token-file: serve /metrics and /healthz without a token.
    #[arg(long, requires = "console_token_file")]
    pub console_public_metrics: bool,
    /// Serve /metrics (Prometheus text format) and /healthz on this address, e.g.
    /// 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<String>,
    /// Export spans live over OTLP/HTTP (protobuf) to this endpoint, e.g. http://127.0.0.1:4318
    /// (spans go to {URL}/v1/traces). Default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    /// OTEL_EXPORTER_OTLP_ENDPOINT; headers from OTEL_EXPORTER_OTLP_HEADERS (k=v,k2=v2). A
    /// receiver that is down delays spans (they wait in the database), never tasks.
    #[arg(long, value_name = "URL")]
    pub otlp_endpoint: Option<String>,
    /// With export on, the most commits whose spans may wait in the database for a receiver
    /// that is down; past it the oldest are dropped (counted in
    /// tether_otlp_spans_dropped_total and logged), so the backlog on disk stays bounded.
    #[arg(long, value_name = "COMMITS", default_value_t = crate::otlp::export::BACKLOG_MAX,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000_000))]
    pub otlp_backlog: usize,
    #[command(flatten)]
    pub shop: ShopArg,
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
    /// Higher runs first; from -1000000000 to 1000000000.
    #[arg(
        long,
        default_value_t = 0,
        conflicts_with = "file",
        allow_negative_numbers = true,
        value_parser = clap::value_parser!(i64)
            .range(-crate::limits::PRIORITY_MAX..=crate::limits::PRIORITY_MAX)
    )]
    pub priority: i64,
    /// A budget limit, NAME=VALUE; repeatable.
    #[arg(long = "budget", value_name = "NAME=VALUE", conflicts_with = "file")]
    pub budgets: Vec<String>,
    /// The model: a profile of the --config file, or a demo model (see below). Default: the
    /// config's default_model; without one, --model is required. With --file: the model of
    /// every line that names none.
    #[arg(long)]
    pub model: Option<String>,
    /// The task's own agent instructions, given to the model after its profile's (at most
    /// 4 KiB; for a model profile of the config).
    #[arg(long, conflicts_with = "file")]
    pub instructions: Option<String>,
    /// Simulated latency of a demo-shop tool, TOOL=MS; repeatable.
    #[arg(long = "tool-latency", value_name = "TOOL=MS", conflicts_with = "file")]
    pub tool_latency: Vec<String>,
    /// Demo-shop tenant: the task gets its own fresh copy of the demo shop's orders.
    #[arg(long, default_value = "", conflicts_with = "file")]
    pub store_scope: String,
    /// How long the task may wait on a person, for an approval or an answer to a question,
    /// before it stops with approval_expired or question_expired
    /// (default: 24 hours). Separate from the active-time deadline.
    #[arg(long, conflicts_with = "file")]
    pub approval_wait_ms: Option<u64>,
    /// When the task finishes or starts waiting on a person, POST its result here, signed as
    /// Standard Webhooks specifies (default: its model profile's callback_url). Only a URL
    /// the config's [callbacks] allow list admits.
    #[arg(long, value_name = "URL", conflicts_with = "file")]
    pub callback: Option<String>,
    /// Do not start the task before this time (RFC 3339, e.g. 2026-12-05T02:00:00Z); it is
    /// listed as scheduled until then.
    #[arg(long, value_name = "TIME", conflicts_with_all = ["file", "start_in"])]
    pub not_before: Option<String>,
    /// Do not start the task before this long from now (90s, 10m, 2h, 1d).
    #[arg(long = "in", value_name = "DURATION", conflicts_with = "file")]
    pub start_in: Option<String>,
    /// The key whose limit in the daemon's [concurrency] config bounds how many of its
    /// tasks run at once, e.g. tenant:acme (default: the model profile's concurrency_key).
    #[arg(long, value_name = "KEY", conflicts_with = "file")]
    pub concurrency_key: Option<String>,
    /// Expire the task (stop `expired`) unless it has started within this long (30s, 10m,
    /// 2h, 1d): a queue time to live.
    #[arg(long, value_name = "DURATION", conflicts_with = "file")]
    pub ttl: Option<String>,
    /// Stop the task (`timed_out`) unless it has finished within this long of now, by the
    /// wall clock, waits included (its budget's deadline_ms counts active time only).
    #[arg(long, value_name = "DURATION", conflicts_with = "file")]
    pub finish_within: Option<String>,
    /// Enqueue every task of a JSONL file in one transaction (all or nothing).
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Then wait until the task finishes or starts waiting on a person, as `worker wait`
    /// does: print its answer and exit with the code that says how it ended.
    #[arg(long, conflicts_with = "file")]
    pub wait: bool,
    /// With --wait: give up waiting after this long (30s, 10m, 2h); exit 7, the task goes on.
    /// Default: no limit.
    #[arg(long, value_name = "DURATION", requires = "wait", value_parser = crate::clock::parse_duration_ms)]
    pub timeout: Option<u64>,
    /// With --wait: settled (default) returns when the task finishes or starts waiting on a
    /// person; finished waits through approvals and held writes to its end.
    #[arg(long, value_enum, requires = "wait")]
    pub until: Option<UntilArg>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

pub(super) const WAIT_HELP: &str =
    "Prints the task's answer on stdout (the whole result as JSON with --json) and
says on stderr how it ended; waits without polling (woken by the database when a task
settles). The exit code says how the task stands:

  0  completed: the model's final answer completed the goal
  3  cannot_complete: the model gave up, saying why (the answer says why)
  4  stopped by a budget or a loop check (max_steps, max_tool_calls, max_tokens,
     deadline, repeated_call, no_progress), by its model (model_failed) or by its
     wall-clock deadline (timed_out)
  5  waiting on a person: an approval (worker approve) or a held write (worker reconcile);
     never with --until finished, which waits on through it
  6  cancelled, its approval wait ran out, or it expired unstarted (expired)
  7  --timeout passed while it was still queued or running, or, with --until finished,
     waiting on a person (it goes on)
  1  an operational error (the database cannot be read); 2  a usage error

Examples:
  worker wait t3
  worker wait key:job-42 --timeout 10m --json
  worker wait t3 --until finished             # through approvals, to the final answer
  answer=$(worker enqueue --user cu_ana --goal 'refund ord_1001' --key job-42 --wait)";

#[derive(Args, Debug)]
pub struct WaitArgs {
    /// Task id (e.g. t3), or key:KEY for the task enqueued under KEY.
    pub task: String,
    /// Give up waiting after this long (30s, 10m, 2h); exit 7, the task goes on. Default: no
    /// limit.
    #[arg(long, value_name = "DURATION", value_parser = crate::clock::parse_duration_ms)]
    pub timeout: Option<u64>,
    /// settled: return when the task finishes or starts waiting on a person (exit 5);
    /// finished: wait through approvals and held writes to its end (saying on stderr what it
    /// waits for).
    #[arg(long, value_enum, default_value_t = UntilArg::Settled)]
    pub until: UntilArg,
    /// Print the whole result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ListArgs {
    /// queued, running, suspended, held, finished, or damaged (this one reads every task).
    #[arg(long)]
    pub status: Option<String>,
    /// A stop reason (done, max_steps, ..., needs_answer, question_expired; docs/reference/stops.md).
    #[arg(long)]
    pub stop: Option<String>,
    /// A final answer's outcome: completed, or cannot_complete (the model gave up, saying
    /// why). `--stop done` lists both.
    #[arg(long)]
    pub outcome: Option<String>,
    /// Only this user's tasks.
    #[arg(long)]
    pub user: Option<String>,
    /// Only the task enqueued under this key.
    #[arg(long)]
    pub key: Option<String>,
    /// Enqueued at or after this time: RFC 3339 (2026-11-30T08:00:00Z, 2026-11-30) or a
    /// duration ago (30m, 12h, 7d).
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// Enqueued before this time (same forms as --since).
    #[arg(long, value_name = "WHEN")]
    pub until: Option<String>,
    /// The cursor: tasks enqueued before this one. A full page's last task is the next
    /// page's cursor (printed on stderr as `more: worker list --before ID`).
    #[arg(long, value_name = "TASK")]
    pub before: Option<String>,
    /// At most this many tasks, newest first (1 to 10000).
    #[arg(long, default_value_t = 50)]
    pub limit: usize,
    /// Print the result as JSON (an array of tasks, newest first).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TaskArgs {
    /// Task id, as printed by `worker enqueue` (e.g. t1), or key:KEY (its enqueue key).
    pub task: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TraceArgs {
    /// Task id (e.g. t1), or key:KEY.
    pub task: String,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the spans as OTLP/JSON to this file (one line, as a collector's file receiver reads).
    #[arg(long, value_name = "FILE")]
    pub otlp: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum ToolsCommand {
    /// Every tool a task may call, as the worker resolves it: the catalog's HTTP tools and
    /// each MCP server's (discovered with `tools/list`), or the demo shop's when the config
    /// names no tools of its own (or sets `[demo.tools]` rules), with the access, idempotency,
    /// approval rule and retry policy the worker gives it.
    List {
        /// How long each server may take to start and answer.
        #[arg(long, default_value_t = 30_000)]
        timeout_ms: u64,
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Debug)]
pub struct ConsoleArgs {
    /// Address to listen on; a non-loopback one needs --token-file.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// Who may sign in and call the API: one `NAME TOKEN [operator|submit]` line each.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
    /// With --token-file: serve /metrics and /healthz without a token (for a scraper that
    /// cannot send one). Without this, they need a token like every other page.
    #[arg(long, requires = "token_file")]
    pub public_metrics: bool,
    /// The operator recorded for decisions when there is no token file.
    #[arg(long, env = "USER", default_value = "operator")]
    pub by: String,
    #[command(flatten)]
    pub shop: ShopArg,
}
