//! The tool catalog file (`[tools] catalog = "tools.toml"`): read, and every tool checked
//! (names, schemas, URLs, approval and retry rules, plan rules) before any task can use it.
//! Each option is described in `docs/catalog.md`.

use serde::Deserialize;
use std::path::Path;

use crate::kernel::Catalog;

use super::CATALOG_VERSION;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CatalogFile {
    version: u32,
    #[serde(default)]
    tools: Vec<crate::kernel::ToolSpec>,
    /// OpenAPI documents whose operations are tools too.
    #[serde(default)]
    openapi: Vec<super::openapi::Source>,
    /// The built-in question to a person, when the catalog opts into it.
    #[serde(default, deserialize_with = "ask_person_table")]
    ask_person: Option<crate::kernel::person::AskPerson>,
}

/// `[ask_person]`, a table; anything else (`ask_person = true`) is told how to write it.
fn ask_person_table<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<crate::kernel::person::AskPerson>, D::Error> {
    let v = toml::Value::deserialize(d)?;
    if !v.is_table() {
        return Err(serde::de::Error::custom(format!(
            "ask_person is a table, not {}: write [ask_person] on a line of its own (its description and fact_fields are optional)",
            v.type_str()
        )));
    }
    v.try_into().map(Some).map_err(serde::de::Error::custom)
}

/// What in a tool's approval rule cannot work: a bound on an argument the tool does not
/// declare as a number (when it declares arguments).
fn approval_problem(t: &crate::kernel::ToolSpec) -> Option<String> {
    use crate::kernel::catalog::{Approval, ArgType};
    let Approval::Above(bounds) = &t.approval else {
        return None;
    };
    bounds.keys().find_map(|arg| {
        let numeric = t
            .args
            .get(arg)
            .is_some_and(|a| matches!(a.kind, ArgType::Integer | ArgType::Number));
        (!t.args.is_empty() && !numeric).then(|| {
            format!("approval.above names {arg:?}, which is not an integer or number argument of the tool")
        })
    })
}

/// An http:// or https:// URL with a host (see [`crate::net::check_url`]).
fn is_url(u: &str) -> bool {
    crate::net::check_url(u).is_ok()
}

/// Parses a catalog file's text; `path` names it in errors.
pub fn parse_catalog(text: &str, path: &Path) -> Result<Catalog, String> {
    let mut file: CatalogFile =
        toml::from_str(text).map_err(|e| format!("{}: {e}", path.display()))?;
    if file.version > CATALOG_VERSION {
        return Err(format!(
            "{}: catalog version {} is newer than this build reads ({CATALOG_VERSION})",
            path.display(),
            file.version
        ));
    }
    let at = |e: String| format!("{}: {e}", path.display());
    for t in &file.tools {
        if t.http.as_ref().is_some_and(|h| h.api.is_some()) {
            return Err(at(format!(
                "tool {:?}: http.api is written by an [[openapi]] source, not by hand",
                t.name
            )));
        }
    }
    for src in &file.openapi {
        let tools = super::openapi::tools_of(src, path).map_err(at)?;
        file.tools.extend(tools);
    }
    let person = crate::kernel::person::ASK_PERSON;
    if let Some(t) = file
        .tools
        .iter()
        .find(|t| t.asks_person || t.name == person)
    {
        return Err(at(format!(
            "tool {:?}: {person:?} and asks_person belong to the built-in question to a person; opt into it with an [ask_person] table (description, fact_fields), or rename the tool",
            t.name
        )));
    }
    if let Some(ask) = &file.ask_person {
        file.tools.push(ask.spec().map_err(at)?);
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &file.tools {
        if !t.asks_person {
            check_tool(t).map_err(at)?;
        }
        if !seen.insert(t.name.clone()) {
            return Err(at(format!("tool {:?} is declared twice", t.name)));
        }
    }
    if file.tools.is_empty() {
        return Err(at(
            "the catalog declares no tools: add [[tools]] tables, an [[openapi]] source or an [ask_person] table".into(),
        ));
    }
    for t in &file.tools {
        if let crate::kernel::catalog::Requires::Tools(names) = &t.requires {
            if names.contains(&t.name) {
                return Err(at(format!(
                    "tool {:?}: requires names the tool itself, so no plan could use it",
                    t.name
                )));
            }
            if let Some(n) = names.iter().find(|n| !seen.contains(*n)) {
                return Err(at(format!(
                    "tool {:?}: requires names {n:?}, which is not a tool of this catalog",
                    t.name
                )));
            }
        }
    }
    for overlap in overlapping_facts(&file.tools) {
        tracing::warn!("{}: {overlap}", path.display());
    }
    Ok(Catalog { tools: file.tools })
}

/// Facts two tools would both record under one name (the same `fact_prefix_arg` and a field
/// in both `fact_fields`): the one called last overwrites the other's. It may be meant (two
/// tools reporting one order's status), so it is said, not refused.
fn overlapping_facts(tools: &[crate::kernel::ToolSpec]) -> Vec<String> {
    let mut out = Vec::new();
    for (i, a) in tools.iter().enumerate() {
        for b in &tools[i + 1..] {
            // Without a fact_prefix_arg a tool's facts are named after the tool: no clash.
            if a.fact_prefix_arg != b.fact_prefix_arg || a.fact_prefix_arg.is_empty() {
                continue;
            }
            let shared: Vec<&str> = a
                .fact_fields
                .iter()
                .filter(|f| b.fact_fields.contains(f))
                .map(String::as_str)
                .collect();
            if shared.is_empty() {
                continue;
            }
            out.push(format!(
                "tools {:?} and {:?} both record the fact(s) {} for the same {}: whichever is called last overwrites the other's value (rename a field in one fact_fields, or give one tool another fact_prefix_arg, if they mean different things)",
                a.name,
                b.name,
                shared.join(", "),
                a.fact_prefix_arg
            ));
        }
    }
    out
}

/// What is wrong with one tool of a catalog file, on its own.
fn check_tool(t: &crate::kernel::ToolSpec) -> Result<(), String> {
    crate::limits::check_name(&t.name, "a tool name").map_err(|e| e.to_string())?;
    let name = &t.name;
    let prompt = &crate::model::prompt::RESERVED_NAMES;
    if prompt.contains(&name.as_str()) {
        return Err(format!(
            "tool {name:?}: the name is the kernel's own function (its names: {}); rename the tool",
            prompt.join(", ")
        ));
    }
    if t.args.contains_key(crate::model::prompt::PLAN_STEP_ARG) {
        return Err(format!(
            "tool {name:?}: the argument name {:?} is the kernel's (the plan step a call carries out); rename the argument",
            crate::model::prompt::PLAN_STEP_ARG
        ));
    }
    t.check_schema()
        .map_err(|e| format!("tool {name:?}: {e}"))?;
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(format!(
            "tool {name:?}: a name is letters, digits, '_' and '-'"
        ));
    }
    if t.mcp.is_some() {
        return Err(format!(
            "tool {name:?}: mcp is not a catalog key (MCP tools come from the config's [mcp.servers.NAME])"
        ));
    }
    let Some(h) = &t.http else {
        return Err(format!("tool {name:?} has no [http] section"));
    };
    let problem = if !is_url(&h.url) {
        Some("url must be an http:// or https:// URL with a host".to_string())
    } else if h.lookup_url.as_deref().is_some_and(|u| !is_url(u)) {
        Some("lookup_url must be an http:// or https:// URL with a host".to_string())
    } else if let Some(p) = approval_problem(t) {
        Some(p)
    } else if let Err(e) = h.retry.check() {
        Some(e)
    } else if h.api.is_none() && !matches!(h.method.as_str(), "POST" | "PUT") {
        Some("method must be POST or PUT".to_string())
    } else {
        None
    };
    match problem {
        Some(p) => Err(format!("tool {name:?}: {p}")),
        None => Ok(()),
    }
}

/// Where a tool's lookup is, how long it may take, and what it carries, as the config's
/// catalog says.
impl super::Config {
    /// The lookup URL of `tool` in this config's catalog, when the daemon is to ask it by
    /// itself for a held write (`auto_settle`, on by default).
    pub fn auto_settle_url(&self, tool: &str) -> Option<&str> {
        let h = self.catalog.as_ref()?.get(tool)?.http.as_ref()?;
        h.lookup_url.as_deref().filter(|_| h.auto_settle)
    }

    /// How long a lookup of `tool` may take: the tool's own `timeout_ms` (5 s without one).
    pub fn lookup_timeout(&self, tool: &str) -> std::time::Duration {
        let ms = self
            .catalog
            .as_ref()
            .and_then(|c| c.get(tool))
            .and_then(|t| t.http.as_ref())
            .map_or(5_000, |h| h.timeout_ms);
        std::time::Duration::from_millis(ms)
    }

    /// The headers a lookup of `tool` carries: those its API's requests carry from the
    /// daemon's environment (an API key, a bearer token), for a tool from an OpenAPI document.
    /// Only to a lookup on the API's own origin: a key is never sent to another host.
    pub fn lookup_auth(&self, tool: &str) -> Vec<(String, String)> {
        let Some(h) = self
            .catalog
            .as_ref()
            .and_then(|c| c.get(tool))
            .and_then(|t| t.http.as_ref())
        else {
            return Vec::new();
        };
        let origin = |u: &str| reqwest::Url::parse(u).ok().map(|u| u.origin());
        let same = h
            .lookup_url
            .as_deref()
            .is_some_and(|l| origin(l).is_some() && origin(l) == origin(&h.url));
        match &h.api {
            Some(a) if same => crate::tools::request::auth_headers(a).unwrap_or_default(),
            _ => Vec::new(),
        }
    }

    /// The lookup URL of `tool` in this config's catalog.
    pub fn lookup_url(&self, tool: &str) -> Option<&str> {
        self.catalog
            .as_ref()?
            .get(tool)?
            .http
            .as_ref()?
            .lookup_url
            .as_deref()
    }
}
