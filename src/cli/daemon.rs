//! `worker run` (the daemon), `worker console` (the web console), `worker demo` (scenarios A-H
//! through the durable worker) and `worker demo-store` (the demo shop over HTTP).

use super::inflight::{open_files_for, workers_retired};
use super::sole::{claim_sole, open_sole};
use super::*;

pub(super) fn cmd_run(cli: &Cli, a: &RunArgs) -> CliResult {
    check_run_args(a)?;
    // The daemon's own config: its model profiles, tool catalog and MCP servers are what a
    // task's names mean here (a task names them; it never supplies an endpoint or a secret).
    let trusted = Arc::new(trusted_config(cli)?);
    // Every argument is checked before the database is opened (or created).
    let otlp = crate::otlp::export::Target::configured(a.otlp_endpoint.as_deref())
        .map_err(CliError::usage)?
        .map(|t| crate::otlp::export::Target {
            backlog_max: a.otlp_backlog,
            config: Arc::clone(&trusted),
            ..t
        });
    // MCP servers named by the config: one set of sessions for the whole daemon, each started
    // when a task first calls one of its tools.
    let mcp = if trusted.mcp.servers.is_empty() {
        None
    } else {
        Some(Arc::new(
            crate::mcp::Mcp::new(trusted.mcp.clone()).map_err(CliError::usage)?,
        ))
    };
    let console = console_args(a)?;
    let (store, sole) = open_daemon_store(cli, a)?;
    // The demo shop is opened only if a task calls one of its tools.
    let demo = Arc::new(DemoShop::at(&store_target(cli, &a.shop), SHOP_CONNECTIONS));
    let shutdown = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&shutdown))
            .map_err(|e| CliError::op(format!("cannot install the signal handler: {e}")))?;
    }
    let cfg = Config {
        max_in_flight: open_files_for(a.max_in_flight),
        drain: a.drain,
        lease_ms: a.lease_ms,
        time_scale: a.time_scale,
        heartbeat_ttl_ms: a.heartbeat_ttl_ms,
        recover_every_ms: a.recover_every_ms,
        mcp,
        otlp,
        trusted,
        auto_settle: !a.no_auto_settle,
        demo: Some(demo),
        ..Config::default()
    };
    if let Some(addr) = &a.metrics {
        let bound = crate::metrics::serve(addr, Arc::clone(&store), Arc::clone(&shutdown))
            .map_err(CliError::op)?;
        tracing::info!(addr = %bound, "serving /metrics and /healthz");
    }
    if let Some((listen, access)) = console {
        console_in_daemon(cli, a, listen, access, &store, &shutdown)?;
    }
    tracing::info!(db = %store.describe(), max_in_flight = cfg.max_in_flight, drain = cfg.drain, "worker started");
    let local = serve_api(cli, &store, sole)?;
    let reporting = drain_progress(&store, cfg.drain);
    let stats = worker::run(store, &cfg, shutdown);
    reporting.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(local);
    let stats = stats?;
    tracing::info!(
        tasks_ended = stats.tasks_ended.load(std::sync::atomic::Ordering::Relaxed),
        steps = stats.steps.load(std::sync::atomic::Ordering::Relaxed),
        "worker stopped"
    );
    Ok(())
}

/// `--console` and its flags, checked before the database is opened: the console's address
/// and who may use it.
fn console_args(a: &RunArgs) -> Result<Option<(String, crate::console::Access)>, CliError> {
    if a.drain && a.console.is_some() {
        return Err(CliError::usage(
            "--console serves operators while the daemon runs; with --drain the daemon (and its console) would stop as soon as the queue is empty",
        )
        .hint("serve the console from a daemon that keeps running (without --drain)"));
    }
    Ok(match &a.console {
        Some(listen) => Some((
            listen.clone(),
            console_access(
                listen,
                a.console_token_file.as_deref(),
                &std::env::var("USER").unwrap_or_else(|_| "operator".into()),
                "--console-token-file",
            )?,
        )),
        None => None,
    })
}

/// The daemon's database, and on a file (unless `--shared`) the daemon's lock of it, taken first
/// so that a second daemon is refused by name before it touches the database.
fn open_daemon_store(cli: &Cli, a: &RunArgs) -> Result<(Db, Option<std::fs::File>), CliError> {
    let pg = store::pg::is_url(&cli.db);
    if pg && a.sole_writer {
        return Err(CliError::usage(
            "--sole-writer is for a database file: daemons on PostgreSQL share its database",
        ));
    }
    if !pg && !a.shared {
        let lock = claim_sole(&cli.db)?;
        return Ok((open_sole(&cli.db)?, Some(lock)));
    }
    // Connections for the executor's blocking work, the dispatcher, the settler and the
    // heartbeat (which must never wait behind the others).
    match store::open_backend(&cli.db, Access::Create, DB_CONNECTIONS) {
        Ok(db) => Ok((db, None)),
        Err(store::Error::InUse(path)) => {
            let who = crate::local::daemon_pid(&path).map_or_else(
                || "a daemon".to_string(),
                |p| format!("the daemon with pid {p}"),
            );
            Err(CliError::op(format!(
                "{who} runs on {} as its only writer (it was not started with --shared), so no other daemon may run on it",
                path.display()
            ))
            .hint("stop that daemon first (SIGTERM lets it finish its steps), or start every daemon on the file with --shared"))
        }
        Err(e) => Err(e.into()),
    }
}

/// The local API: under the lock a sole writer took (which cannot run without it: the
/// verbs reach the file through it), else as [`serve_local`] decides.
fn serve_api(
    cli: &Cli,
    store: &Db,
    sole: Option<std::fs::File>,
) -> Result<Option<crate::local::LocalApi>, CliError> {
    let Some(lock) = sole else {
        return Ok(serve_local(cli, store));
    };
    let api = crate::local::serve_claimed(Path::new(&cli.db), lock, Arc::clone(store))
        .map_err(|why| {
            CliError::op(format!("cannot serve the local API: {why}")).hint(
                "a daemon that is its file's only writer needs it: `worker enqueue` and the decisions reach the file through it (or start the daemon with --shared)",
            )
        })?;
    tracing::info!(socket = %api.socket().display(), sole_writer = true, "serving the local API");
    Ok(Some(api))
}

/// On a redb file: the local socket that `worker enqueue` hands its tasks to while this daemon
/// runs, unless another daemon on the file serves it. Without it the verbs open the file
/// themselves, as they do when no daemon runs, so a socket that cannot be served is a warning.
fn serve_local(cli: &Cli, store: &Db) -> Option<crate::local::LocalApi> {
    if store::pg::is_url(&cli.db) {
        return None;
    }
    match crate::local::serve(Path::new(&cli.db), Arc::clone(store)) {
        Ok(crate::local::Served::Serving(api)) => {
            tracing::info!(socket = %api.socket().display(), "serving the local API");
            Some(api)
        }
        Ok(crate::local::Served::Elsewhere(pid)) => {
            tracing::info!(
                daemon = pid,
                "another daemon on this file serves the local API; this one does not"
            );
            None
        }
        Err(why) => {
            tracing::warn!(%why, "the local API is not served; verbs open the file themselves");
            None
        }
    }
}

/// The daemon's own config, refused when the callbacks' secret is missing; a profile whose
/// key is missing is said, and its tasks are passed over.
fn trusted_config(cli: &Cli) -> Result<crate::config::Config, CliError> {
    let trusted = super::enqueue::load_config(cli)?.unwrap_or_default();
    // A profile whose key variable is missing could not run its tasks: the daemon's claims
    // pass them over (they keep their place for a daemon that has the key), and it says so.
    for (name, why) in trusted.missing_keys() {
        tracing::warn!(
            profile = %name,
            "model profile {name}: {why}; this daemon does not run the profile's tasks (they stay queued for a daemon that has the key): export the variable and restart it to run them here"
        );
    }
    // The callbacks' signing secret, likewise: no callback goes out unsigned.
    if let Some(c) = &trusted.callbacks
        && let Err(why) = c.key()
    {
        return Err(CliError::usage(format!("[callbacks]: {why}")).hint(
            "export the variable before starting the worker: echo whsec_$(head -c 32 /dev/urandom | base64)",
        ));
    }
    Ok(trusted)
}

/// Connections of a daemon to a database server: a run's blocking work waits for one.
const DB_CONNECTIONS: usize = 24;

/// Connections of a daemon to the demo shop's database, when it is a server.
const SHOP_CONNECTIONS: usize = 8;

/// The daemon's arguments that can be checked before anything is opened.
fn check_run_args(a: &RunArgs) -> CliResult {
    workers_retired(
        &a.workers,
        "drop --workers; --max-in-flight N bounds the tasks running at once (default 10000)",
    )?;
    if !(a.time_scale.is_finite() && (0.0..=10.0).contains(&a.time_scale)) {
        return Err(CliError::usage(format!(
            "--time-scale {} must be between 0 and 10",
            a.time_scale
        )));
    }
    if let Some(addr) = &a.metrics {
        use std::net::ToSocketAddrs;
        addr.to_socket_addrs().map_err(|e| {
            CliError::usage(format!(
                "--metrics {addr:?} is not an address to listen on: {e}"
            ))
            .hint("give HOST:PORT, e.g. --metrics 127.0.0.1:9464")
        })?;
    }
    Ok(())
}

/// With `--drain`, progress lines every few seconds until the returned flag is set.
fn drain_progress(store: &Db, drain: bool) -> Arc<AtomicBool> {
    let reporting = Arc::new(AtomicBool::new(false));
    if drain {
        let every = std::time::Duration::from_millis(
            std::env::var("WORKER_PROGRESS_EVERY_MS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(5000),
        );
        progress::drain_reporter(Arc::clone(store), Arc::clone(&reporting), every);
    }
    reporting
}

pub(super) fn cmd_demo(cli: &Cli, a: &DemoArgs) -> CliResult {
    workers_retired(
        &a.workers,
        "drop --workers: the demo runs all its scenarios at once",
    )?;
    if store::pg::is_url(&cli.db) {
        return demo_pg(cli, a);
    }
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
    let store: Db = Arc::new(RedbStore::open(&db, true)?);
    let tools = Arc::new(DurableStore::open(&sibling_store(&db))?);
    run_demo(store, tools)?;
    if a.keep.is_some() {
        outln!(
            "\ndatabase kept: {} (try: worker --db {} trace t1)",
            db.display(),
            db.display()
        );
    }
    Ok(())
}

/// The demo through PostgreSQL, in schemas of its own (`demo_<pid>_<ms>` and its store),
/// dropped afterwards unless `--keep` is given.
fn demo_pg(cli: &Cli, a: &DemoArgs) -> CliResult {
    let schema = format!("demo_{}_{}", std::process::id(), now_ms());
    let sep = if cli.db.contains('?') { '&' } else { '?' };
    let url = format!("{}{sep}schema={schema}", cli.db);
    let pg = Arc::new(store::pg::PgStore::open(
        &url,
        true,
        DB_CONNECTIONS,
        store::pg::CLI_RETRY,
    )?);
    let tools = Arc::new(DurableStore::open_sized(&url, SHOP_CONNECTIONS)?);
    let ran = run_demo(pg.clone(), tools);
    if a.keep.is_some() {
        outln!("\nschemas kept: {schema} and {schema}_store (try: worker --db '{url}' trace t1)");
    } else {
        pg.drop_schemas()?;
    }
    ran
}

/// Enqueues scenarios A-H, runs them to the end and prints the design reference's table.
fn run_demo(store: Db, tools: Arc<DurableStore>) -> CliResult {
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
            not_before_ms: None,
            time_limits: Default::default(),
            concurrency_key: None,
            instructions: None,
            callback_url: None,
            submitted_by: None,
        })
        .collect();
    let ids = store.enqueue(&tasks, now_ms())?;
    let cfg = Config {
        drain: true,
        demo: Some(Arc::new(DemoShop::opened(Arc::clone(&tools)))),
        ..Config::default()
    };
    worker::run(store.clone(), &cfg, Arc::new(AtomicBool::new(false)))?;
    let ledger = tools.ledger()?;
    outln!("{SCENARIO_HEADER}");
    for (sc, e) in all.iter().zip(&ids) {
        let r = store.task(&e.id)?;
        outln!(
            "{}",
            scenario_row(
                sc.name,
                &r.state,
                &effects_to_python(&task_effects(&ledger, store.db_id(), &r))
            )
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

pub(super) fn cmd_demo_store(cli: &Cli, a: &DemoStoreArgs) -> CliResult {
    use std::net::ToSocketAddrs;
    if a.listen.to_socket_addrs().is_err() {
        return Err(CliError::usage(format!(
            "--listen {:?} is not an address; use HOST:PORT, e.g. 127.0.0.1:8700 (port 0 picks a free one)",
            a.listen
        )));
    }
    for (name, rate) in [("--lose-rate", a.lose_rate), ("--error-rate", a.error_rate)] {
        if !(0.0..=1.0).contains(&rate) {
            return Err(CliError::usage(format!(
                "{name} {rate} must be between 0 and 1"
            )));
        }
    }
    let path = match &a.shop.store {
        Some(p) => p.clone(),
        None if cli.db != "worker.redb" => cli.db.clone(),
        None => sibling_store(Path::new(&cli.db)).display().to_string(),
    };
    let tools = DurableStore::open_target(&path)?;
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
    let approval_secret = match std::env::var(&a.approval_secret_env) {
        Ok(v) if !v.is_empty() => Some(v.into_bytes()),
        _ => {
            tracing::warn!(var = %a.approval_secret_env, "no approval secret: approved calls will be refused");
            None
        }
    };
    let opts = crate::tools::service::Options {
        faults,
        connections: a.connections as usize,
        read_timeout: std::time::Duration::from_millis(a.read_timeout_ms),
        approval_secret,
    };
    crate::tools::service::serve(tools, &a.listen, opts, stop, |addr| {
        use std::io::Write;
        let _ = writeln!(std::io::stdout(), "listening on http://{addr}");
        let _ = std::io::stdout().flush();
    })
    .map_err(CliError::op)
}

/// Who may use a console listening on `listen`: the holders of the tokens in `token_file`,
/// or without one (loopback only) the operator `by`. `flag` names the token file's flag in
/// the messages.
fn console_access(
    listen: &str,
    token_file: Option<&Path>,
    by: &str,
    flag: &str,
) -> Result<crate::console::Access, CliError> {
    use crate::console::{Access, check_listen, read_tokens};
    use std::net::ToSocketAddrs;
    if let Err(e) = listen.to_socket_addrs() {
        return Err(CliError::usage(format!(
            "{listen} is not an address to listen on ({e}); give HOST:PORT, e.g. 127.0.0.1:8080"
        )));
    }
    check_listen(listen, token_file.is_some()).map_err(|e| {
        CliError::usage(e.replace("--token-file", flag))
            .hint(format!("pass {flag} FILE, or listen on 127.0.0.1"))
    })?;
    Ok(match token_file {
        Some(path) => {
            // A token file that is not there is a wrong argument, named as such.
            let text = crate::limits::read_file(path, 1 << 20)
                .map_err(|e| CliError::usage(format!("{flag} {}: {e}", path.display())))?;
            Access::Tokens(
                read_tokens(&text)
                    .map_err(|e| CliError::usage(format!("{}: {e}", path.display())))?,
            )
        }
        None => {
            decision(by, &None)?;
            Access::Loopback {
                operator: by.to_string(),
            }
        }
    })
}

/// `worker run --console ADDR`: the console and the HTTP API served from the daemon, on its
/// own database handle (a sole writer's file admits no `worker console` beside
/// it), until the daemon stops. A console that cannot listen stops the daemon's start.
fn console_in_daemon(
    cli: &Cli,
    a: &RunArgs,
    listen: String,
    access: crate::console::Access,
    store: &Db,
    stop: &Arc<AtomicBool>,
) -> CliResult {
    let config = super::enqueue::load_config(cli)?.unwrap_or_default();
    let console = crate::console::Console::new(
        Arc::clone(store),
        store_target(cli, &a.shop),
        config,
        access,
        a.console_public_metrics,
    );
    let (tx, rx) = std::sync::mpsc::channel();
    let stop = Arc::clone(stop);
    std::thread::Builder::new()
        .name("console".into())
        .spawn(move || {
            let bound = tx.clone();
            let served = console.serve(&listen, stop, move |addr| {
                tracing::info!(addr = %addr, "console listening");
                eprintln!("console: http://{addr}/");
                let _ = bound.send(Ok(()));
            });
            if let Err(e) = served {
                tracing::error!(error = %e, "the console stopped");
                let _ = tx.send(Err(e));
            }
        })
        .map_err(|e| CliError::op(format!("cannot start the console's thread: {e}")))?;
    match rx.recv_timeout(std::time::Duration::from_secs(30)) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(CliError::op(format!("--console: {e}"))),
        Err(_) => Err(CliError::op(
            "--console: the console did not start listening",
        )),
    }
}

pub(super) fn cmd_console(cli: &Cli, a: &ConsoleArgs) -> CliResult {
    use crate::console::Console;
    let access = console_access(&a.listen, a.token_file.as_deref(), &a.by, "--token-file")?;
    // Services may create tasks before any daemon ran: the database is created when there is
    // none, as `run` and `enqueue` do.
    let db = match store::open_backend(&cli.db, Access::Create, 4) {
        Err(e @ store::Error::InUse(_)) => {
            return Err(CliError::from(e).hint(
                "the daemon is the file's only writer: serve the console from it (worker run --console 127.0.0.1:8080), or start the daemon with --shared",
            ));
        }
        opened => opened?,
    };
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .map_err(|e| CliError::op(format!("cannot install the signal handler: {e}")))?;
    }
    let config = super::enqueue::load_config(cli)?.unwrap_or_default();
    let console = Console::new(
        db,
        store_target(cli, &a.shop),
        config,
        access,
        a.public_metrics,
    );
    console
        .serve(&a.listen, stop, |addr| {
            tracing::info!(addr = %addr, "console listening");
            eprintln!("console: http://{addr}/");
        })
        .map_err(CliError::op)
}
