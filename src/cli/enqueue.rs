//! `worker enqueue`: one task from flags or a batch from a JSONL file, all or nothing.

use super::*;
use crate::limits;
use std::path::Path;

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
    #[serde(default)]
    instructions: Option<String>,
}

/// The demo models, for messages.
const DEMO_MODELS: &str = "policy, same_call, new_ids, search_loop, script:FILE";

fn check_text(field: &str, v: &str, max: usize) -> Result<(), String> {
    if v.trim().is_empty() {
        return Err(format!("--{field} must not be empty"));
    }
    limits::check_text(v, &format!("--{field}"), max).map_err(|e| e.0)
}

fn check_name(field: &str, v: &str) -> Result<(), String> {
    limits::check_name(v, &format!("--{field}")).map_err(|e| e.0)
}

fn parse_model(spec: &str) -> Result<ModelProfile, String> {
    if let Some(file) = spec.strip_prefix("script:") {
        let text = limits::read_file(Path::new(file), limits::SCRIPT_BYTES_MAX)
            .map_err(|e| format!("--model script:{file}: {e}"))?;
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

/// The profiles a config offers, for an error about a model name.
fn profiles(cfg: Option<&crate::config::Config>) -> String {
    match cfg {
        Some(c) if !c.models.is_empty() => format!(
            "the config's profiles: {}",
            c.models.keys().cloned().collect::<Vec<_>>().join(", ")
        ),
        Some(_) => "the config has no model profiles".to_string(),
        None => "no config was given (--config or WORKER_CONFIG)".to_string(),
    }
}

/// The model a task names and its default budget. A profile of the config is stored by name:
/// the daemon resolves it in its own config.
fn resolve_model(
    name: &str,
    cfg: Option<&crate::config::Config>,
) -> Result<(ModelProfile, Budget), String> {
    match cfg.and_then(|c| c.models.get(name)) {
        Some(p) => {
            p.api_key().map_err(|e| {
                format!("model {name}: {e}; the worker that runs the task needs it too")
            })?;
            let model = ModelProfile::Profile {
                name: name.to_string(),
            };
            Ok((model, p.budget))
        }
        None => match parse_model(name) {
            Ok(m) => Ok((m, Budget::default())),
            Err(e) if e.contains("unknown model") => Err(format!(
                "unknown model {name:?}: {}; the demo models: {DEMO_MODELS}",
                profiles(cfg)
            )),
            Err(e) => Err(e),
        },
    }
}

fn new_task(l: TaskLine, cfg: Option<&crate::config::Config>) -> Result<NewTask, String> {
    check_name("user", &l.user)?;
    check_text("goal", &l.goal, limits::GOAL_BYTES_MAX)?;
    if let Some(k) = &l.key {
        check_name("key", k)?;
    }
    if !l.store_scope.is_empty() {
        check_name("store-scope", &l.store_scope)?;
        if l.store_scope.contains('/') {
            return Err("--store-scope must not contain '/'".into());
        }
    }
    if l.priority.unsigned_abs() > limits::PRIORITY_MAX.unsigned_abs() {
        return Err(format!(
            "--priority {} is out of range (-{max} to {max})",
            l.priority,
            max = limits::PRIORITY_MAX
        ));
    }
    let Some(name) = l
        .model
        .as_deref()
        .or_else(|| cfg.and_then(|c| c.default_model.as_deref()))
    else {
        return Err(format!(
            "no model: give --model NAME ({}; the demo models: {DEMO_MODELS}) or set default_model in the config",
            profiles(cfg)
        ));
    };
    let (model, mut budget) = resolve_model(name, cfg)?;
    let instructions = match l.instructions {
        None => None,
        Some(i) => {
            if !matches!(model, ModelProfile::Profile { .. }) {
                return Err(format!(
                    "--instructions are for a model profile of the config; the demo model {name:?} takes none"
                ));
            }
            check_text("instructions", &i, limits::INSTRUCTIONS_BYTES_MAX)?;
            Some(i)
        }
    };
    for (k, v) in &l.budget {
        let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
        budget.set(k, &v).map_err(|e| format!("--budget: {e}"))?;
    }
    for tool in l.tool_latency_ms.keys() {
        if Catalog::demo().get(tool).is_none() {
            return Err(format!("--tool-latency: unknown tool {tool:?}"));
        }
    }
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
        instructions,
    })
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
    let mut l: TaskLine = serde_json::from_value(v).map_err(|e| e.to_string())?;
    if l.model.is_none() {
        l.model = model.map(str::to_string);
    }
    new_task(l, cfg)
}

pub(super) fn load_config(cli: &Cli) -> Result<Option<crate::config::Config>, CliError> {
    match &cli.config {
        None => Ok(None),
        Some(p) => crate::config::load(p).map(Some).map_err(|e| {
            // A file that is not there is a wrong argument (as for --file); one that cannot
            // be read for another reason is operational.
            let code = if e.starts_with("cannot read") && p.is_file() {
                1
            } else {
                2
            };
            CliError {
                message: e,
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
fn enqueue_config(cli: &Cli) -> Result<Option<crate::config::Config>, CliError> {
    let Some(mut cfg) = load_config(cli)? else {
        return Ok(None);
    };
    if cfg.mcp.servers.is_empty() {
        return Ok(Some(cfg));
    }
    let mcp = crate::mcp::Mcp::new(cfg.mcp.clone()).map_err(CliError::usage)?;
    let tools = crate::mcp::discover(&mcp, std::time::Duration::from_millis(MCP_LIST_TIMEOUT_MS))
        .map_err(|e| {
            CliError::op(e).hint("the task keeps a snapshot of its MCP tools, taken at enqueue: every server of the config must answer tools/list")
        })?;
    cfg.catalog =
        Some(crate::mcp::task_catalog(cfg.catalog.as_ref(), &tools).map_err(CliError::usage)?);
    Ok(Some(cfg))
}

/// How long enqueue waits for each MCP server's session and tool list.
const MCP_LIST_TIMEOUT_MS: u64 = 30_000;

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
    new_task(
        TaskLine {
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
        },
        cfg,
    )
    .map_err(CliError::usage)
}

pub(super) fn cmd_enqueue(cli: &Cli, a: &EnqueueArgs) -> CliResult {
    let cfg = enqueue_config(cli)?;
    let tasks = match &a.file {
        Some(path) => read_batch(path, cfg.as_ref(), a.model.as_deref())?,
        None => vec![one_task(a, cfg.as_ref())?],
    };
    let store = open_created(cli, 1)?;
    let out = store.enqueue(&tasks, now_ms())?;
    if a.wait {
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
        return super::wait::wait_and_report(store.as_ref(), &e.id, a.timeout, a.json);
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
