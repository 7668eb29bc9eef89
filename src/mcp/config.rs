//! MCP servers as the config file declares them (`[mcp.servers.NAME]`), and per-tool
//! overrides. A server is a child process (`command`, `args`, an explicit environment: the
//! worker's own variables reach the child only when named in `env_from`) or a streamable-HTTP
//! `url` (headers whose values come from environment variables). `trusted` says whether its
//! tool annotations are believed.
//!
//! ```toml
//! [mcp.servers.everything]
//! command = "npx"
//! args = ["-y", "@modelcontextprotocol/server-everything"]
//! env_from = ["PATH", "HOME"]              # copied from the worker's environment
//! env = { LOG_LEVEL = "warn" }             # set as given
//! trusted = true
//!
//! [mcp.servers.billing]
//! url = "http://127.0.0.1:8765/mcp"
//! headers_from_env = { Authorization = "BILLING_TOKEN" }
//! trusted = false
//!
//! [mcp.servers.billing.tools.issue_refund]
//! access = "write"                         # read | write
//! idempotent = false
//! approval = "always"                      # always | destructive | never | { above = { amount_cents = 5000 } }
//! facts = ["refunded_cents"]               # fields of structuredContent that become facts
//! user_arg = "customer_id"                 # the argument that receives the task's user id
//! ```

use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct McpConfig {
    #[serde(default)]
    pub servers: BTreeMap<String, ServerConfig>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    pub command: Option<String>,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub env_from: Vec<String>,
    pub url: Option<String>,
    #[serde(default)]
    pub headers_from_env: BTreeMap<String, String>,
    #[serde(default)]
    pub trusted: bool,
    #[serde(default)]
    pub tools: BTreeMap<String, ToolOverride>,
}

#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ToolOverride {
    pub access: Option<String>,
    pub idempotent: Option<bool>,
    /// `"always"`, `"destructive"` (the default), `"never"`, or a rule on arguments
    /// (`{ above = { ARG = N } }`, as a catalog's).
    pub approval: Option<serde_json::Value>,
    pub facts: Option<Vec<String>>,
    pub user_arg: Option<String>,
}

impl ServerConfig {
    /// What is wrong with this server's declaration, if anything.
    pub fn check(&self, name: &str) -> Result<(), String> {
        match (&self.command, &self.url) {
            (Some(_), Some(_)) => Err(format!(
                "MCP server {name}: give either command (a child process) or url (streamable HTTP), not both"
            )),
            (None, None) => Err(format!(
                "MCP server {name}: give command (a child process) or url (streamable HTTP)"
            )),
            (None, Some(u)) if !(u.starts_with("http://") || u.starts_with("https://")) => Err(
                format!("MCP server {name}: url {u:?} must start with http:// or https://"),
            ),
            _ => {
                for (tool, o) in &self.tools {
                    if let Some(a) = &o.access
                        && a != "read"
                        && a != "write"
                    {
                        return Err(format!(
                            "MCP server {name}, tool {tool}: access must be read or write, not {a:?}"
                        ));
                    }
                    if let Some(a) = &o.approval
                        && a.as_str() != Some("destructive")
                        && crate::kernel::policy::Approval::try_from(a.clone()).is_err()
                    {
                        return Err(format!(
                            "MCP server {name}, tool {tool}: approval must be always, destructive, never or {{ above = {{ ARGUMENT = NUMBER }} }}, not {a}"
                        ));
                    }
                }
                Ok(())
            }
        }
    }

    /// The child's whole environment: the named variables of the worker's, then `env`.
    pub fn child_env(&self) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for k in &self.env_from {
            if let Ok(v) = std::env::var(k) {
                out.insert(k.clone(), v);
            }
        }
        out.extend(self.env.clone());
        out
    }
}
