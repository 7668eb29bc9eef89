//! A new task as callers ask for it: `worker enqueue` (flags and batch lines) and the HTTP
//! API's create both describe a task as a [`TaskRequest`], and [`new_task`] checks it and
//! resolves its model, budget and callback in the caller's config, with the same messages for
//! both.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

use crate::kernel::{Budget, Catalog};
use crate::limits;
use crate::model::ModelProfile;
use crate::store::NewTask;

/// Who asks for the task.
#[derive(Clone, Debug, PartialEq)]
pub enum Origin {
    /// `worker enqueue`, run by someone with access to the database.
    Cli,
    /// The HTTP API, by a caller with a token: `submitter` is a `submit` token's name (such a
    /// caller reads only its own tasks), `None` for an operator's token.
    Api { submitter: Option<String> },
    /// A schedule's tick: the only origin whose key may start with [`TICK_KEY_PREFIX`].
    Schedule,
}

/// The start of every schedule tick's enqueue key (`schedule:NAME:TIME`): reserved for them,
/// so no caller can take the key of a coming tick and stop the schedule.
pub const TICK_KEY_PREFIX: &str = "schedule:";

/// Refuses a caller's key in the schedules' namespace.
fn check_key_namespace(key: Option<&str>) -> Result<(), String> {
    match key {
        Some(k) if k.starts_with(TICK_KEY_PREFIX) => Err(format!(
            "the key {:?} starts with {TICK_KEY_PREFIX:?}, which is reserved for the tasks of schedules' ticks: choose another key",
            limits::printable(k)
        )),
        _ => Ok(()),
    }
}

/// A task as a caller asks for it: a line of an enqueue batch file, `worker enqueue`'s flags,
/// or the body of the HTTP API's create (its key then comes from the `Idempotency-Key`
/// header).
#[derive(Serialize, Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields)]
pub struct TaskRequest {
    pub user: String,
    pub goal: String,
    #[serde(default)]
    pub key: Option<String>,
    #[serde(default)]
    pub priority: i64,
    #[serde(default)]
    pub budget: BTreeMap<String, Value>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub tool_latency_ms: BTreeMap<String, u64>,
    #[serde(default)]
    pub store_scope: String,
    #[serde(default)]
    pub approval_wait_ms: Option<u64>,
    #[serde(default)]
    pub instructions: Option<String>,
    /// Where the result is POSTed when the task settles (else the profile's).
    #[serde(default)]
    pub callback_url: Option<String>,
    /// Not started before this time (RFC 3339).
    #[serde(default)]
    pub not_before: Option<String>,
    /// Not started before this long from now (`90s`, `10m`, `2h`, `1d`).
    #[serde(default)]
    pub start_in: Option<String>,
    /// The key whose concurrency limit bounds this task (else its model profile's).
    #[serde(default)]
    pub concurrency_key: Option<String>,
    /// Expires (stop `expired`) unless started within this long (`30s`, `10m`, `2h`, `1d`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl: Option<String>,
    /// Stops (`timed_out`) unless finished within this long of its enqueue, wall clock.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finish_within: Option<String>,
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
    if let Some(arg) = spec.strip_prefix("script:") {
        let (file, latency) = crate::model::script_file(arg);
        let text = limits::read_file(Path::new(file), limits::SCRIPT_BYTES_MAX)
            .map_err(|e| format!("--model script:{file}: {e}"))?;
        let kind = latency.map_or("script".to_string(), |ms| format!("script:{ms}"));
        return ModelProfile::parse(&kind, Some(&text))
            .map_err(|e| format!("--model script:{file}: {e}"));
    }
    ModelProfile::parse(spec, None).map_err(|e| format!("--model {spec}: {e}"))
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
    origin: &Origin,
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
        None if matches!(origin, Origin::Api { .. }) && name.starts_with("script:") => Err(
            "a script model reads a file on the daemon's machine: it cannot be named over the API"
                .into(),
        ),
        None if !ModelProfile::names_a_demo_model(name) => Err(format!(
            "unknown model {name:?}: {}; the demo models: {DEMO_MODELS}",
            profiles(cfg)
        )),
        None => parse_model(name).map(|m| (m, Budget::default())),
    }
}

/// The request's budget over its model's: from the CLI (an operator) any limit; from an API
/// caller with a `submit` token only lower ones, so a less trusted caller cannot lift the
/// bounds an operator set on a model profile.
fn set_budget(
    budget: &mut crate::kernel::Budget,
    asked: &BTreeMap<String, serde_json::Value>,
    origin: &Origin,
) -> Result<(), String> {
    let (flag, ceiling) = match origin {
        Origin::Cli | Origin::Schedule => ("--budget", None),
        Origin::Api { submitter: None } => ("budget", None),
        Origin::Api { submitter: Some(_) } => ("budget", Some(*budget)),
    };
    for (k, v) in asked {
        let v = v.as_str().map_or_else(|| v.to_string(), str::to_string);
        budget.set(k, &v).map_err(|e| format!("{flag}: {e}"))?;
        if let Some(max) = ceiling.and_then(|c| c.get(k))
            && budget.get(k).is_some_and(|now| now > max)
        {
            return Err(format!(
                "budget.{k}: a submit token may lower its model's limits, not raise them ({k} is at most {max} for this model)"
            ));
        }
    }
    Ok(())
}

/// A task made elsewhere (handed to the daemon through its local socket) held to the rules a
/// request is: names, the goal's and the instructions' lengths, the demo tenant, the priority,
/// times within reach, instructions only for a profile, tool latencies only for demo tools, no
/// API submitter. A callback URL's host is not checked here: the daemon's sender checks every
/// URL against its own `[callbacks]` before it sends anything.
pub fn check_new_task(t: &NewTask) -> Result<(), String> {
    // The daemon fires its schedules itself: nothing it is handed is a tick.
    check_key_namespace(t.key.as_deref())?;
    check_request(&TaskRequest {
        user: t.user.clone(),
        goal: t.goal.clone(),
        key: t.key.clone(),
        priority: t.priority,
        store_scope: t.store_scope.clone(),
        concurrency_key: t.concurrency_key.clone(),
        ..TaskRequest::default()
    })?;
    if let Some(i) = &t.instructions {
        if !matches!(t.model, ModelProfile::Profile { .. }) {
            return Err("instructions are for a model profile of the config".into());
        }
        check_text("instructions", i, limits::INSTRUCTIONS_BYTES_MAX)?;
    }
    if t.submitted_by.is_some() {
        return Err("submitted_by is set by the HTTP API only".into());
    }
    for tool in t.tool_latency_ms.keys() {
        if Catalog::demo().get(tool).is_none() {
            return Err(format!("tool_latency_ms: unknown tool {tool:?}"));
        }
    }
    if let Some(url) = &t.callback_url
        && !(url.starts_with("https://") || url.starts_with("http://"))
    {
        return Err(format!("callback_url {url:?} is not an http(s) URL"));
    }
    // A century from now is later than anything a caller means.
    let far = crate::clock::now_ms().saturating_add(100 * 365 * 24 * 3600 * 1000);
    let times = [
        ("not_before", t.not_before_ms),
        ("expires_at", t.time_limits.expires_at_ms),
        ("deadline_at", t.time_limits.deadline_at_ms),
    ];
    for (name, at) in times {
        if at.is_some_and(|at| at > far) {
            return Err(format!("{name} is more than a century away"));
        }
    }
    if t.approval_wait_ms > 100 * 365 * 24 * 3600 * 1000 {
        return Err("approval_wait_ms is more than a century".into());
    }
    Ok(())
}

/// The request's own fields checked: names, the goal's length, the demo tenant, the priority.
fn check_request(l: &TaskRequest) -> Result<(), String> {
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
    if let Some(k) = &l.concurrency_key {
        check_name("concurrency-key", k)?;
    }
    if l.priority.unsigned_abs() > limits::PRIORITY_MAX.unsigned_abs() {
        return Err(format!(
            "--priority {} is out of range (-{max} to {max})",
            l.priority,
            max = limits::PRIORITY_MAX
        ));
    }
    Ok(())
}

/// The task `l` asks for, checked and resolved in `cfg`; `Err` says what is wrong.
pub fn new_task(
    l: TaskRequest,
    cfg: Option<&crate::config::Config>,
    origin: Origin,
) -> Result<NewTask, String> {
    check_request(&l)?;
    if origin != Origin::Schedule {
        check_key_namespace(l.key.as_deref())?;
    }
    let Some(name) = l
        .model
        .as_deref()
        .or_else(|| cfg.and_then(|c| c.default_model.as_deref()))
    else {
        let give = match &origin {
            Origin::Cli | Origin::Schedule => "give --model NAME",
            Origin::Api { .. } => "name a `model`",
        };
        return Err(format!(
            "no model: {give} ({}; the demo models: {DEMO_MODELS}) or set default_model in the server's config",
            profiles(cfg)
        ));
    };
    let (model, mut budget) = resolve_model(name, cfg, &origin)?;
    let callback_url = callback_of(l.callback_url, name, cfg)?;
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
    set_budget(&mut budget, &l.budget, &origin)?;
    let not_before_ms = start_of(l.not_before.as_deref(), l.start_in.as_deref(), &origin)?;
    let time_limits = time_limits_of(l.ttl.as_deref(), l.finish_within.as_deref(), &origin)?;
    let concurrency_key = l.concurrency_key.or_else(|| {
        cfg.and_then(|c| c.models.get(name))
            .and_then(|p| p.concurrency_key.clone())
    });
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
            .unwrap_or(crate::store::DEFAULT_APPROVAL_WAIT_MS),
        instructions,
        callback_url,
        submitted_by: match origin {
            Origin::Cli | Origin::Schedule => None,
            Origin::Api { submitter } => submitter,
        },
        not_before_ms,
        time_limits,
        concurrency_key,
    })
}

/// The start time a request asks for: a time (RFC 3339) or a delay from now, not both.
fn start_of(at: Option<&str>, delay: Option<&str>, origin: &Origin) -> Result<Option<u64>, String> {
    let (at_name, in_name) = match origin {
        Origin::Cli | Origin::Schedule => ("--not-before", "--in"),
        Origin::Api { .. } => ("not_before", "start_in"),
    };
    match (at, delay) {
        (Some(_), Some(_)) => Err(format!("give {at_name} or {in_name}, not both")),
        (Some(t), None) => crate::clock::parse_rfc3339_from_epoch(t)
            .map(Some)
            .map_err(|e| format!("{at_name}: {e}")),
        (None, Some(d)) => crate::clock::parse_duration_ms(d)
            .map(|ms| Some(crate::clock::now_ms().saturating_add(ms)))
            .map_err(|e| format!("{in_name}: {e}")),
        (None, None) => Ok(None),
    }
}

/// A task's time limits from their durations, counted from now.
fn time_limits_of(
    ttl: Option<&str>,
    within: Option<&str>,
    origin: &Origin,
) -> Result<crate::store::TimeLimits, String> {
    let (ttl_name, within_name) = match origin {
        Origin::Cli | Origin::Schedule => ("--ttl", "--finish-within"),
        Origin::Api { .. } => ("ttl", "finish_within"),
    };
    let at = |d: Option<&str>, name: &str| -> Result<Option<u64>, String> {
        d.map(|d| {
            crate::clock::parse_duration_ms(d)
                .map(|ms| crate::clock::now_ms().saturating_add(ms))
                .map_err(|e| format!("{name}: {e}"))
        })
        .transpose()
    };
    Ok(crate::store::TimeLimits {
        expires_at_ms: at(ttl, ttl_name)?,
        deadline_at_ms: at(within, within_name)?,
    })
}

/// `cfg` with its MCP servers' tools in the catalog a task keeps (each server asked for its
/// tools now): a task keeps a snapshot of its MCP tools, taken when it is made.
pub fn with_mcp_tools(cfg: &crate::config::Config) -> Result<crate::config::Config, String> {
    let mcp = crate::mcp::Mcp::new(cfg.mcp.clone())?;
    let tools = crate::mcp::discover(&mcp, std::time::Duration::from_millis(MCP_LIST_TIMEOUT_MS))
        .map_err(|e| format!("{e} (the task keeps a snapshot of its MCP tools, taken when it is made: every server of the config must answer tools/list)"))?;
    let catalog = crate::mcp::task_catalog(cfg.catalog.as_ref(), &tools)?;
    Ok(crate::config::Config {
        models: cfg.models.clone(),
        default_model: cfg.default_model.clone(),
        catalog: Some(catalog),
        mcp: cfg.mcp.clone(),
        demo: cfg.demo.clone(),
        callbacks: cfg.callbacks.clone(),
        concurrency: cfg.concurrency.clone(),
    })
}

/// How long a new task waits for each MCP server's session and tool list.
const MCP_LIST_TIMEOUT_MS: u64 = 30_000;

/// The task's callback URL: the one it asks for, else its profile's; checked against the
/// config's `[callbacks] allow`, which must exist for any callback.
fn callback_of(
    asked: Option<String>,
    model: &str,
    cfg: Option<&crate::config::Config>,
) -> Result<Option<String>, String> {
    let url = asked.or_else(|| {
        cfg.and_then(|c| c.models.get(model))
            .and_then(|p| p.callback_url.clone())
    });
    let Some(url) = url else {
        return Ok(None);
    };
    limits::check_text(&url, "the callback URL", limits::NAME_BYTES_MAX * 8).map_err(|e| e.0)?;
    match cfg.and_then(|c| c.callbacks.as_ref()) {
        Some(c) => c.check(&url).map(|()| Some(url)),
        None => Err("a callback needs the config's [callbacks] section (secret_env, allow): give --config (or WORKER_CONFIG) naming one".into()),
    }
}
