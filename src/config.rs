//! The worker's config file (TOML): named model profiles and the tool catalog.
//!
//! ```toml
//! [models.local]
//! kind = "openai"                          # OpenAI-compatible Chat Completions
//! base_url = "http://127.0.0.1:11434/v1"   # OpenAI, vLLM, llama.cpp server, Ollama
//! model = "llama3.1"
//! api_key_env = "OPENAI_API_KEY"           # the variable's name; the key is never stored
//!
//! [tools]
//! catalog = "tools.toml"                   # relative to this file
//! ```

use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::kernel::Catalog;
use crate::model::ModelProfile;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConfigFile {
    #[serde(default)]
    models: BTreeMap<String, ModelEntry>,
    #[serde(default)]
    tools: Option<ToolsEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelEntry {
    kind: String,
    base_url: String,
    model: String,
    #[serde(default)]
    api_key_env: Option<String>,
    #[serde(default = "default_retries")]
    max_retries: u32,
    #[serde(default)]
    temperature: f64,
}

fn default_retries() -> u32 {
    3
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolsEntry {
    catalog: PathBuf,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogFile {
    version: u32,
    tools: Vec<crate::kernel::ToolSpec>,
}

/// A loaded config: model profiles by name, and the tool catalog if one is configured.
#[derive(Debug, Default)]
pub struct Config {
    pub models: BTreeMap<String, ModelProfile>,
    pub catalog: Option<Catalog>,
}

/// The catalog format this build reads.
pub const CATALOG_VERSION: u32 = 1;

pub fn load(path: &Path) -> Result<Config, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file: ConfigFile = toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut models = BTreeMap::new();
    for (name, m) in file.models {
        if m.kind != "openai" {
            return Err(format!(
                "{}: models.{name}.kind {:?} is not supported (use \"openai\")",
                path.display(),
                m.kind
            ));
        }
        if !(m.base_url.starts_with("http://") || m.base_url.starts_with("https://")) {
            return Err(format!(
                "{}: models.{name}.base_url must start with http:// or https://",
                path.display()
            ));
        }
        if !(0.0..=2.0).contains(&m.temperature) {
            return Err(format!(
                "{}: models.{name}.temperature must be between 0 and 2",
                path.display()
            ));
        }
        models.insert(
            name,
            ModelProfile::OpenAi {
                base_url: m.base_url.trim_end_matches('/').to_string(),
                model: m.model,
                api_key_env: m.api_key_env,
                max_retries: m.max_retries.min(10),
                temperature: m.temperature,
            },
        );
    }
    let catalog = match file.tools {
        Some(t) => {
            let p = if t.catalog.is_absolute() {
                t.catalog
            } else {
                path.parent().unwrap_or(Path::new(".")).join(t.catalog)
            };
            Some(load_catalog(&p)?)
        }
        None => None,
    };
    Ok(Config { models, catalog })
}

pub fn load_catalog(path: &Path) -> Result<Catalog, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let file: CatalogFile =
        toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if file.version > CATALOG_VERSION {
        return Err(format!(
            "{}: catalog version {} is newer than this build reads ({CATALOG_VERSION})",
            path.display(),
            file.version
        ));
    }
    let mut seen = std::collections::BTreeSet::new();
    for t in &file.tools {
        if !seen.insert(t.name.clone()) {
            return Err(format!(
                "{}: tool {:?} is declared twice",
                path.display(),
                t.name
            ));
        }
        match &t.http {
            Some(h) if !(h.url.starts_with("http://") || h.url.starts_with("https://")) => {
                return Err(format!(
                    "{}: tool {:?}: url must start with http:// or https://",
                    path.display(),
                    t.name
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
    Ok(Catalog { tools: file.tools })
}
