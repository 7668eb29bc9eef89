//! An MCP tool as the kernel will see it: its access, idempotency and approval rule, derived
//! from the server's annotations only when the server is trusted (annotations are hints an
//! untrusted server can get wrong), then from the config's per-tool overrides; and a digest of
//! the server's definition, so a tool whose definition changed since a task was enqueued is
//! refused instead of called with another meaning.
//!
//! | server | annotations | kernel tool |
//! | --- | --- | --- |
//! | trusted | `readOnlyHint: true` | read |
//! | trusted | `idempotentHint: true` (not read-only) | idempotent write: re-sent after a lost answer |
//! | trusted | otherwise | non-idempotent write: held for reconcile after a lost answer |
//! | trusted | `destructiveHint` true or absent | write that needs approval (rule `destructive`) |
//! | untrusted | any | non-idempotent write that needs approval |
//!
//! An override `approval = { above = { ARG = N } }` replaces the setting with a rule on the
//! call's arguments, kept in the task's snapshot and held by the worker's route like a
//! catalog tool's.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

use crate::kernel::catalog::{Access, McpSpec};
use crate::kernel::{Catalog, ToolSpec};

use super::config::{ServerConfig, ToolOverride};
use rmcp::model::Tool;

/// When a call of the tool waits for an operator's approval.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Approval {
    Always,
    Destructive,
    Never,
    /// A rule on the call's arguments (`rule`), held by the worker's route.
    Rule,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct McpTool {
    pub server: String,
    pub name: String,
    pub description: String,
    pub input_schema: Value,
    /// `read` or `write`.
    pub access: &'static str,
    pub idempotent: bool,
    /// The server says (trusted) or is assumed (untrusted) to destroy or overwrite.
    pub destructive: bool,
    pub approval: Approval,
    /// The rule on arguments, when `approval` is `rule`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rule: Option<crate::kernel::policy::Approval>,
    /// Whether every call needs an approval, by the setting and the tool's destructiveness
    /// (a rule holds only the calls it covers).
    pub needs_approval: bool,
    pub facts: Vec<String>,
    pub user_arg: Option<String>,
    /// SHA-256 (first 16 hex digits) of the server's definition (name, description, input
    /// schema, annotations) in canonical JSON.
    pub digest: String,
}

/// The digest of a tool definition.
pub fn definition_digest(t: &Tool) -> String {
    let v = serde_json::json!({
        "name": t.name,
        "description": t.description,
        "inputSchema": Value::Object((*t.input_schema).clone()),
        "annotations": t.annotations,
    });
    // serde_json's maps are sorted (no preserve_order feature): the text is canonical.
    let digest = Sha256::digest(v.to_string().as_bytes());
    digest.iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The kernel's view of tool `t` of `server`.
pub fn resolve(server: &str, cfg: &ServerConfig, t: &Tool) -> McpTool {
    let a = t.annotations.as_ref().filter(|_| cfg.trusted);
    let read_only = a.and_then(|a| a.read_only_hint).unwrap_or(false);
    let idempotent_hint = a.and_then(|a| a.idempotent_hint).unwrap_or(false);
    // The specification's default for destructiveHint is true; untrusted means assume it.
    let destructive = !read_only && a.and_then(|a| a.destructive_hint).unwrap_or(true);
    let o: ToolOverride = cfg.tools.get(t.name.as_ref()).cloned().unwrap_or_default();
    let access = match o.access.as_deref() {
        Some("read") => "read",
        Some(_) => "write",
        None if read_only => "read",
        None => "write",
    };
    let idempotent = o.idempotent.unwrap_or(access == "read" || idempotent_hint);
    // A rule on arguments is the catalog's kind, enforced by the worker's route for every
    // tool; the words are this server's kinds.
    let rule = o
        .approval
        .clone()
        .and_then(|v| crate::kernel::policy::Approval::try_from(v).ok())
        .filter(|a| matches!(a, crate::kernel::policy::Approval::Above(_)));
    let approval = match o.approval.as_ref().and_then(Value::as_str) {
        _ if rule.is_some() => Approval::Rule,
        Some("always") => Approval::Always,
        Some("never") => Approval::Never,
        _ => Approval::Destructive,
    };
    let needs_approval = access == "write"
        && match approval {
            Approval::Always => true,
            Approval::Never | Approval::Rule => false,
            Approval::Destructive => destructive,
        };
    McpTool {
        server: server.to_string(),
        name: t.name.to_string(),
        description: t.description.as_deref().unwrap_or("").to_string(),
        input_schema: Value::Object((*t.input_schema).clone()),
        access,
        idempotent,
        destructive,
        approval,
        rule,
        needs_approval,
        facts: o.facts.unwrap_or_default(),
        user_arg: o.user_arg,
        digest: definition_digest(t),
    }
}

impl McpTool {
    /// The tool as a task's catalog snapshot keeps it.
    pub fn to_spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name.clone(),
            description: crate::limits::one_line(&self.description).into_owned(),
            access: if self.access == "read" {
                Access::Read
            } else {
                Access::Write
            },
            idempotent: self.idempotent,
            fact_fields: self.facts.clone(),
            fact_prefix_arg: String::new(),
            done_phrase: String::new(),
            not_done_phrase: String::new(),
            approval: self.rule.clone().unwrap_or_default(),
            requires: Default::default(),
            args: BTreeMap::new(),
            http: None,
            mcp: Some(McpSpec {
                server: self.server.clone(),
                digest: self.digest.clone(),
                input_schema: self.input_schema.clone(),
                needs_approval: self.needs_approval,
                user_arg: self.user_arg.clone(),
            }),
            asks_person: false,
        }
    }
}

/// A task's catalog: the config's own tools, then every tool of the MCP servers. A name
/// offered twice (by two servers, or by a server and the catalog file) is an error: the model
/// calls tools by name, so a name must mean one tool.
pub fn task_catalog(base: Option<&Catalog>, tools: &[McpTool]) -> Result<Catalog, String> {
    let mut out = base.cloned().unwrap_or_default();
    for t in tools {
        if let Some(other) = out.get(&t.name) {
            let first = other
                .mcp
                .as_ref()
                .map_or("the tool catalog".to_string(), |m| {
                    format!("MCP server {}", m.server)
                });
            return Err(format!(
                "tool {:?} is offered by {first} and by MCP server {}; a task's tools need distinct names",
                t.name, t.server
            ));
        }
        out.tools.push(t.to_spec());
    }
    Ok(out)
}
