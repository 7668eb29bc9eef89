//! The worker's config file (TOML): named model profiles, the default one, and the tool
//! catalog. Every option is described in `docs/models.md` and `docs/catalog.md`.
//!
//! ```toml
//! default_model = "local"
//!
//! [models.local]
//! kind = "openai"                          # Chat Completions; "anthropic" for Messages
//! base_url = "http://127.0.0.1:11434/v1"   # OpenAI, vLLM, llama.cpp server, Ollama
//! model = "llama3.1"
//! api_key_env = "OPENAI_API_KEY"           # the variable's name; the key is never stored
//! instructions = "You are a support agent."
//!
//! [models.local.budget]                    # the defaults of this profile's tasks
//! steps_max = 30
//!
//! [tools]
//! catalog = "tools.toml"                   # relative to this file
//!
//! [mcp.servers.billing]                    # MCP servers: see `crate::mcp::config`
//! url = "http://127.0.0.1:8765/mcp"
//!
//! [demo.tools.issue_refund]                # the demo shop's tools: approval rules
//! approval = { above = { amount_cents = 5000 } }
//!
//! [callbacks]                              # completion callbacks: see `callbacks`
//! secret_env = "TETHER_WEBHOOK_SECRET"
//! allow = ["https://hooks.example.com/"]
//!
//! [concurrency]                            # tasks of a concurrency key running at once
//! "tenant:*" = 2                           # a prefix and '*': each such key
//! "tenant:acme" = 5                        # a key's own limit wins
//! ```

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::kernel::Catalog;

pub mod callbacks;
mod catalog;
mod openapi;
use crate::model::profile::{Api, HttpProfile};
use crate::model::{ModelProfile, RunModel};
pub use catalog::parse_catalog;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    default_model: Option<String>,
    #[serde(default)]
    models: BTreeMap<String, crate::model::profile::ProfileEntry>,
    #[serde(default)]
    tools: Option<ToolsEntry>,
    #[serde(default)]
    mcp: Option<crate::mcp::McpConfig>,
    #[serde(default)]
    demo: DemoConfig,
    #[serde(default)]
    callbacks: Option<callbacks::CallbacksEntry>,
    #[serde(default)]
    concurrency: BTreeMap<String, u32>,
}

/// Rules for the demo shop's tools (`[demo.tools.NAME]`), which have no catalog entry.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DemoConfig {
    #[serde(default)]
    pub tools: BTreeMap<String, DemoTool>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DemoTool {
    /// The tool's approval rule, as a catalog's (`"never"` by default).
    #[serde(default)]
    pub approval: crate::kernel::policy::Approval,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolsEntry {
    catalog: PathBuf,
}

/// A loaded config: model profiles by name, and the tool catalog if one is configured.
#[derive(Debug, Default, PartialEq)]
pub struct Config {
    pub models: BTreeMap<String, HttpProfile>,
    /// The profile `worker enqueue` uses without `--model`.
    pub default_model: Option<String>,
    pub catalog: Option<Catalog>,
    /// MCP servers (`[mcp.servers.NAME]`).
    pub mcp: crate::mcp::McpConfig,
    /// Rules for the demo shop's tools (`[demo.tools.NAME]`).
    pub demo: DemoConfig,
    /// Where completion callbacks may go and how they are signed (`[callbacks]`).
    pub callbacks: Option<callbacks::Callbacks>,
    /// How many tasks of a concurrency key a daemon's claims let run at once
    /// (`[concurrency]`).
    pub concurrency: crate::store::flow::ConcurrencyLimits,
}

impl Config {
    /// What the model a task stored means to this process, resolved in this config: a
    /// profile by name; a profile stored whole by an older version only if this config has
    /// one equal to it (a task never makes this process call an endpoint, or send a key, its
    /// config does not name); a scripted model as it is. `Err` says what is missing.
    pub fn model_for(&self, stored: &ModelProfile) -> Result<RunModel, String> {
        match stored {
            ModelProfile::Profile { name } => match self.models.get(name) {
                Some(p) => Ok(RunModel::Http {
                    name: name.clone(),
                    profile: Box::new(p.clone()),
                }),
                None => Err(format!(
                    "this worker's config has no model profile {name:?} ({}); run it with the config the task was enqueued with (--config or WORKER_CONFIG)",
                    self.known_models()
                )),
            },
            ModelProfile::OpenAi {
                base_url,
                model,
                api_key_env,
                max_retries,
                temperature,
            } => self
                .models
                .iter()
                .find(|(_, p)| {
                    p.api == Api::OpenAi
                        && &p.base_url == base_url
                        && &p.model == model
                        && &p.api_key_env == api_key_env
                        && p.max_retries == *max_retries
                        && p.temperature.unwrap_or(0.0) == *temperature
                })
                .map(|(n, p)| RunModel::Http {
                    name: n.clone(),
                    profile: Box::new(p.clone()),
                })
                .ok_or_else(|| {
                    format!(
                        "the task names a model endpoint of its own ({base_url}), as older versions stored it; this worker calls only the endpoints of its config's profiles ({}): enqueue it again with --model NAME",
                        self.known_models()
                    )
                }),
            other => Ok(RunModel::Scripted(other.clone())),
        }
    }

    /// The profiles of this config, for a message.
    pub fn known_models(&self) -> String {
        if self.models.is_empty() {
            "it has none".to_string()
        } else {
            format!(
                "it has {}",
                self.models.keys().cloned().collect::<Vec<_>>().join(", ")
            )
        }
    }

    /// Every profile whose API key variable is named but not set, with why.
    pub fn missing_keys(&self) -> Vec<(String, String)> {
        self.models
            .iter()
            .filter_map(|(n, p)| p.api_key().err().map(|e| (n.clone(), e)))
            .collect()
    }
}

/// The tools of a task as this process calls them (see [`Config::catalog_for`]).
pub struct Resolved {
    pub catalog: Catalog,
    /// Tools this process cannot call, with why: nothing is sent to them.
    pub unavailable: BTreeMap<String, String>,
}

impl Config {
    /// The catalog a task stored, as this process calls it: this config is the authority on
    /// every tool's definition. An HTTP tool is this config's tool of that name (its URL,
    /// kind, schema, facts, approval secret), whatever the task stored; a tool of the demo shop
    /// is the built-in one; an MCP tool keeps its snapshot, which is checked against this
    /// config's reading of the server's definition before each call (`McpTools`). A tool
    /// this config lacks stays in the catalog (the plan may name it) but is never called.
    pub fn catalog_for(&self, stored: Option<&Catalog>) -> Resolved {
        let demo = self.demo_catalog();
        let Some(stored) = stored else {
            return Resolved {
                catalog: demo,
                unavailable: BTreeMap::new(),
            };
        };
        let mut unavailable = BTreeMap::new();
        let tools = stored
            .tools
            .iter()
            .map(|t| {
                if t.mcp.is_some() {
                    return t.clone();
                }
                let own = if t.asks_person {
                    // The question to a person, as this worker's catalog words it (its
                    // description, its rule for facts); without [ask_person] it is not asked.
                    self.catalog
                        .as_ref()
                        .and_then(|c| c.get(&t.name))
                        .filter(|o| o.asks_person)
                } else if t.http.is_some() {
                    self.catalog
                        .as_ref()
                        .and_then(|c| c.get(&t.name))
                        .filter(|o| o.http.is_some())
                } else {
                    demo.get(&t.name)
                };
                match own {
                    Some(o) => o.clone(),
                    None => {
                        let why = if t.asks_person {
                            "this worker's tool catalog has no [ask_person] (the task was enqueued with one), so no one is asked: start it with the catalog the task was enqueued with".to_string()
                        } else if t.http.is_some() {
                            format!("this worker's tool catalog has no HTTP tool {:?} (the task was enqueued with one): start it with the catalog the task was enqueued with; nothing was sent", t.name)
                        } else {
                            format!("{:?} is not a tool of the demo shop; nothing was sent", t.name)
                        };
                        unavailable.insert(t.name.clone(), why);
                        // Not held for a person: the call is answered as unavailable.
                        let mut t = t.clone();
                        t.asks_person = false;
                        t
                    }
                }
            })
            .collect();
        Resolved {
            catalog: Catalog { tools },
            unavailable,
        }
    }

    /// The demo shop's tools with this config's rules for them (`[demo.tools.NAME]`).
    pub fn demo_catalog(&self) -> Catalog {
        let mut c = Catalog::demo();
        for t in &mut c.tools {
            if let Some(o) = self.demo.tools.get(&t.name) {
                t.approval = o.approval.clone();
            }
        }
        c
    }
}

/// The catalog format this build reads.
pub const CATALOG_VERSION: u32 = 1;

pub fn load(path: &Path) -> Result<Config, LoadError> {
    parse_config(&read_config_file(path)?, path)
}

/// Parses a config file's text; `path` names it in errors and anchors a relative catalog path.
pub fn parse(text: &str, path: &Path) -> Result<Config, String> {
    parse_config(text, path).map_err(|e| e.to_string())
}

impl From<String> for LoadError {
    fn from(m: String) -> Self {
        LoadError::Invalid(m)
    }
}

/// [`parse`], telling a catalog file that cannot be read from what is wrong in one.
fn parse_config(text: &str, path: &Path) -> Result<Config, LoadError> {
    let file: ConfigFile = toml::from_str(text).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut models = BTreeMap::new();
    for (name, m) in file.models {
        let profile = crate::model::profile::from_entry(&name, m, path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        models.insert(name, profile);
    }
    if let Some(d) = &file.default_model
        && !models.contains_key(d)
    {
        return Err(format!(
            "{}: default_model {d:?} is not a profile of this file (its profiles: {})",
            path.display(),
            if models.is_empty() {
                "none".to_string()
            } else {
                models.keys().cloned().collect::<Vec<_>>().join(", ")
            }
        )
        .into());
    }
    let catalog = match file.tools {
        Some(t) => {
            let p = if t.catalog.is_absolute() {
                t.catalog
            } else {
                path.parent().unwrap_or(Path::new(".")).join(t.catalog)
            };
            Some(parse_catalog(&read_config_file(&p)?, &p)?)
        }
        None => None,
    };
    check_demo_rules(&file.demo, path)?;
    let mcp = file.mcp.unwrap_or_default();
    for (name, s) in &mcp.servers {
        s.check(name)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let callbacks = callbacks_of(file.callbacks, &models, path)?;
    for k in file.concurrency.keys() {
        crate::limits::check_name(k.trim_end_matches('*'), &format!("concurrency.{k:?}"))
            .map_err(|e| format!("{}: {}", path.display(), e.0))?;
    }
    let concurrency = crate::store::flow::ConcurrencyLimits::new(file.concurrency)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(Config {
        models,
        default_model: file.default_model,
        catalog,
        mcp,
        demo: file.demo,
        callbacks,
        concurrency,
    })
}

/// The config's approval rules on the demo shop's tools: each names one of its tools, and a
/// bound names a numeric argument of it.
fn check_demo_rules(demo_cfg: &DemoConfig, path: &Path) -> Result<(), String> {
    let demo = Catalog::demo();
    for (name, o) in &demo_cfg.tools {
        if demo.get(name).is_none() {
            return Err(format!(
                "{}: [demo.tools.{name}]: the demo shop has no tool {name:?} (its tools: {})",
                path.display(),
                demo.tools
                    .iter()
                    .map(|t| t.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        // The demo shop's numeric arguments, which a rule's bound may name.
        let numeric: &[&str] = if name == "issue_refund" {
            &["amount_cents"]
        } else {
            &[]
        };
        if let crate::kernel::policy::Approval::Above(bounds) = &o.approval
            && let Some(arg) = bounds.keys().find(|a| !numeric.contains(&a.as_str()))
        {
            return Err(format!(
                "{}: [demo.tools.{name}]: approval.above names {arg:?}, which is not a numeric argument of {name} (its numeric arguments: {})",
                path.display(),
                if numeric.is_empty() {
                    "none".to_string()
                } else {
                    numeric.join(", ")
                }
            ));
        }
    }
    Ok(())
}

/// `[callbacks]` read, and every profile's default callback URL checked against it.
fn callbacks_of(
    entry: Option<callbacks::CallbacksEntry>,
    models: &BTreeMap<String, crate::model::profile::HttpProfile>,
    path: &Path,
) -> Result<Option<callbacks::Callbacks>, String> {
    let callbacks = entry
        .map(callbacks::Callbacks::from_entry)
        .transpose()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    for (name, p) in models {
        if let (Some(url), Some(c)) = (&p.callback_url, &callbacks) {
            c.check(url)
                .map_err(|e| format!("{}: models.{name}.callback_url: {e}", path.display()))?;
        } else if p.callback_url.is_some() {
            return Err(format!(
                "{}: models.{name}.callback_url needs a [callbacks] section (secret_env, allow)",
                path.display()
            ));
        }
    }
    Ok(callbacks)
}

/// Why a config could not be loaded: its file could not be read, or what it says is wrong.
#[derive(Debug)]
pub enum LoadError {
    Unreadable(String),
    Invalid(String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Unreadable(m) | LoadError::Invalid(m) => f.write_str(m),
        }
    }
}

/// A config or catalog file's text (at most [`crate::limits::CONFIG_BYTES_MAX`] bytes), or
/// why it cannot be read (naming the file).
fn read_config_file(path: &Path) -> Result<String, LoadError> {
    use crate::limits::ReadError;
    crate::limits::read_file(path, crate::limits::CONFIG_BYTES_MAX).map_err(|e| match e {
        ReadError::Unreadable(e) => {
            LoadError::Unreadable(format!("cannot read {}: {e}", path.display()))
        }
        e => LoadError::Invalid(format!("{}: {e}", path.display())),
    })
}

#[cfg(test)]
mod tests;
