//! The tool catalog file (`[tools] catalog = "tools.toml"`): read, and every tool checked
//! (names, schemas, URLs, approval and retry rules, plan rules) before any task can use it.
//! Each option is described in `docs/catalog.md`.

use serde::Deserialize;
use std::path::Path;

use crate::kernel::Catalog;

use super::{CATALOG_VERSION, read};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    version: u32,
    tools: Vec<crate::kernel::ToolSpec>,
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

pub fn load_catalog(path: &Path) -> Result<Catalog, String> {
    parse_catalog(&read(path)?, path)
}

/// Parses a catalog file's text; `path` names it in errors.
pub fn parse_catalog(text: &str, path: &Path) -> Result<Catalog, String> {
    let file: CatalogFile = toml::from_str(text).map_err(|e| format!("{}: {e}", path.display()))?;
    if file.version > CATALOG_VERSION {
        return Err(format!(
            "{}: catalog version {} is newer than this build reads ({CATALOG_VERSION})",
            path.display(),
            file.version
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &file.tools {
        crate::limits::check_name(&t.name, "a tool name")
            .map_err(|e| format!("{}: {e}", path.display()))?;
        if crate::model::prompt::RESERVED_NAMES.contains(&t.name.as_str()) {
            return Err(format!(
                "{}: tool {:?}: the name is the kernel's own function (its names: {}); rename the tool",
                path.display(),
                t.name,
                crate::model::prompt::RESERVED_NAMES.join(", ")
            ));
        }
        if t.args.contains_key(crate::model::prompt::PLAN_STEP_ARG) {
            return Err(format!(
                "{}: tool {:?}: the argument name {:?} is the kernel's (the plan step a call carries out); rename the argument",
                path.display(),
                t.name,
                crate::model::prompt::PLAN_STEP_ARG
            ));
        }
        t.check_schema()
            .map_err(|e| format!("{}: tool {:?}: {e}", path.display(), t.name))?;
        if !t
            .name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(format!(
                "{}: tool {:?}: a name is letters, digits, '_' and '-'",
                path.display(),
                t.name
            ));
        }
        if !seen.insert(t.name.clone()) {
            return Err(format!(
                "{}: tool {:?} is declared twice",
                path.display(),
                t.name
            ));
        }
        match &t.http {
            Some(h) if !is_url(&h.url) => {
                return Err(format!(
                    "{}: tool {:?}: url must be an http:// or https:// URL with a host",
                    path.display(),
                    t.name
                ));
            }
            Some(h) if h.lookup_url.as_deref().is_some_and(|u| !is_url(u)) => {
                return Err(format!(
                    "{}: tool {:?}: lookup_url must be an http:// or https:// URL with a host",
                    path.display(),
                    t.name
                ));
            }
            Some(_) if approval_problem(t).is_some() => {
                return Err(format!(
                    "{}: tool {:?}: {}",
                    path.display(),
                    t.name,
                    approval_problem(t).unwrap_or_default()
                ));
            }
            Some(h) if h.retry.check().is_err() => {
                return Err(format!(
                    "{}: tool {:?}: {}",
                    path.display(),
                    t.name,
                    h.retry.check().err().unwrap_or_default()
                ));
            }
            Some(h) if !matches!(h.method.as_str(), "POST" | "PUT") => {
                return Err(format!(
                    "{}: tool {:?}: method must be POST or PUT",
                    path.display(),
                    t.name
                ));
            }
            None => {
                return Err(format!(
                    "{}: tool {:?} has no [http] section",
                    path.display(),
                    t.name
                ));
            }
            _ => {}
        }
    }
    if file.tools.is_empty() {
        return Err(format!("{}: the catalog declares no tools", path.display()));
    }
    for t in &file.tools {
        if let crate::kernel::catalog::Requires::Tools(names) = &t.requires
            && names.contains(&t.name)
        {
            return Err(format!(
                "{}: tool {:?}: requires names the tool itself, so no plan could use it",
                path.display(),
                t.name
            ));
        }
        if let crate::kernel::catalog::Requires::Tools(names) = &t.requires
            && let Some(n) = names.iter().find(|n| !seen.contains(*n))
        {
            return Err(format!(
                "{}: tool {:?}: requires names {n:?}, which is not a tool of this catalog",
                path.display(),
                t.name
            ));
        }
    }
    Ok(Catalog { tools: file.tools })
}
